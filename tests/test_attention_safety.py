"""blocksparse_attention must never read or write outside its arrays, whatever mask it is given.

A ``BlockMask`` passed as ``qkv_layouts`` is a pytree of arrays that a caller can build, edit or
corrupt. Its counts and block indices decide which memory the kernels address, so a wrong value
used to crash the process (SIGSEGV in the interpreter; on a GPU an illegal address). Now:

* a concrete mask is checked before any launch: a ``ValueError`` naming the bad field;
* a traced mask (under ``jax.jit``) cannot be checked; the kernels clamp every count and index
  they load. Garbage in may give garbage out, but the process survives.

Each case runs in a child process, so that a crash fails the test instead of ending the run.
"""

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_child(script: str, *args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script), *args], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=ROOT)


def describe(result: subprocess.CompletedProcess) -> str:
    return f"exit status {result.returncode}\nstdout:\n{result.stdout[-3000:]}\nstderr:\n{result.stderr[-3000:]}"


# The child: a causal mask at the kernels' own tiles (so the forward and both backward kernels read
# its lists as they are), one field corrupted at a time, at an entry the kernels do read.
CORRUPTED_MASKS = """
    import dataclasses, sys
    import jax, jax.numpy as jnp, numpy as np
    import ejk_lite
    from ejk_lite import blocksparse_attention, make_block_mask
    from ejk_lite.attention import BlockSizes

    mode, direction = sys.argv[1], sys.argv[2]
    rng = np.random.default_rng(0)
    q, k, v = (jnp.asarray(rng.normal(size=s), jnp.float32)
               for s in ((1, 2, 48, 16), (1, 1, 48, 16), (1, 1, 48, 16)))
    mask = make_block_mask(48, 48, q_block=16, kv_block=16, causal=True)
    blocks = BlockSizes(16, 16)

    def attend(q, k, v, m):
        return blocksparse_attention(q, k, v, qkv_layouts=m, causal=False, fwd_blocks=blocks,
                                     bwd_blocks=blocks, impl="triton")

    def loss(q, k, v, m):
        return jnp.sum(attend(q, k, v, m) ** 2)

    fn = attend if direction == "forward" else jax.grad(loss, argnums=(0, 1, 2))
    if mode == "jit":
        fn = jax.jit(fn)

    def corrupt(field, value):
        x = np.array(getattr(mask, field))
        if field.endswith("_index"):  # an entry the kernels read: the first listed one
            count = np.asarray(getattr(mask, field.replace("_index", "_count")))
            at = tuple(np.argwhere(count > 0)[0]) + (0,)
        else:
            at = (0,) * x.ndim
        x[at] = value
        return dataclasses.replace(mask, **{field: jnp.asarray(x)})

    huge = 2**31 - 1
    cases = [(f"{p}_{kind}", value) for p in ("partial", "full", "t_partial", "t_full")
             for kind, values in (("index", (10**6, -7, huge)), ("count", (99, -3, huge)))
             for value in values]
    if mode == "eager":
        cases.append(("kinds", 7))
    for field, value in cases:
        try:
            jax.block_until_ready(fn(q, k, v, corrupt(field, value)))
            print("ran", field, value, flush=True)
        except ValueError as error:
            print("ValueError", field, value, str(error).replace("\\n", " "), flush=True)
    print("done", flush=True)
"""


@pytest.mark.parametrize("direction", ["forward", "gradient"])
@pytest.mark.parametrize("mode", ["eager", "jit"])
def test_corrupted_block_mask_never_crashes(mode, direction):
    """Eager: a ValueError naming the field. Under jit: the call finishes (clamped reads)."""
    result = run_child(CORRUPTED_MASKS, mode, direction)
    assert result.returncode == 0 and result.stdout.rstrip().endswith("done"), describe(result)
    lines = result.stdout.splitlines()[:-1]
    assert len(lines) >= 24, describe(result)
    for line in lines:
        outcome, field, value, *message = line.split(" ")
        if mode == "eager":
            assert outcome == "ValueError" and f"qkv_layouts.{field}" in " ".join(message), line
        else:
            assert outcome == "ran", line
