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


# ----------------------------------------------------------------------------------------------
# NaN stays inside the rows (and documents) that can see it.
# ----------------------------------------------------------------------------------------------

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from conftest import TOLERANCE, rel_err  # noqa: E402
from test_attention import BWD, FWD, documents, make_inputs  # noqa: E402

from ejk_lite import blocksparse_attention  # noqa: E402
from ejk_lite.attention import reference  # noqa: E402


def nan_rows(x):
    return np.isnan(np.asarray(x, np.float64)).any(axis=-1)


# where the NaN goes: (array, extra inputs, extra options)
NAN_CASES = {
    "value": ("value", dict(bias=True), dict()),  # a bias [B, H, T, T]
    "key": ("key", dict(sinks=True, q_scale=6.0), dict(logits_soft_cap=3.0)),
    "query": ("query", dict(), dict()),
}


# float32 runs its partial tiles with NaN containment from the start; 16-bit dtypes run them
# optimistically and again only when the accumulator shows a NaN (attention._optimistic).
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case", list(NAN_CASES))
def test_nan_stays_in_the_rows_that_see_it(case, dtype, rng):
    """Packed documents, causal: one NaN in one token of one document. Semantics: invisible keys
    do not exist for a row. The output rows and every gradient's rows of the other documents
    are finite and equal to the float64 reference without the NaN; in the NaN's document, the
    rows that hold a NaN are those of the float64 reference with the NaN (which holds NaN exactly
    in the rows that see the token, for the output), and the others equal it."""
    check_nan_contained(case, dtype, rng, T=64, H_kv=2)


def test_nan_retry_looks_after_several_programs_each(rng):
    """The retry launch of 16-bit inputs (attention._launch) gives each of its programs several
    programs of the first launch once these outnumber attention._RETRY_PROGRAMS (264): here 272
    in the forward and in dK/dV (T = 544 in blocks of 16, B * H = 8), so two each."""
    check_nan_contained("value", "bfloat16", rng, T=544, H_kv=4)


def check_nan_contained(case, dtype, rng, T, H_kv):
    where, shapes, extra = NAN_CASES[case]
    B, H = 2, 4
    shapes = dict(shapes)
    if shapes.pop("bias", False):
        shapes["bias_shape"] = (B, H, T, T)
    options = dict(documents(rng, B, T), **extra)
    ids = options["q_segment_ids"]
    doc = np.bincount(ids[0]).argmax()  # the longest document of row 0
    tokens = np.flatnonzero(ids[0] == doc)
    token = tokens[len(tokens) // 2]  # rows of its document before it cannot see it (causal)
    head = 1
    arrays = make_inputs(rng, B=B, T=T, H=H, H_kv=H_kv, **shapes)
    arrays[where][0, head, token, 3] = np.nan
    clean = dict(arrays, **{where: np.where(np.isnan(arrays[where]), 0.5, arrays[where])})

    names = list(arrays)
    xs = [jnp.asarray(arrays[n], dtype) for n in names]
    call = lambda fn, *xs, **kw: fn(**dict(zip(names, xs)), **options, **kw)  # noqa: E731
    out, vjp = jax.vjp(lambda *xs: call(blocksparse_attention, *xs, impl="triton", fwd_blocks=FWD,
                                        bwd_blocks=BWD), *xs)
    cotangent = rng.normal(size=out.shape)
    grads = vjp(jnp.asarray(cotangent, dtype))
    with jax.enable_x64(True):
        results = []
        for inputs in (arrays, clean):
            x64 = [jnp.asarray(np.asarray(jnp.asarray(inputs[n], dtype), np.float64)) for n in names]
            o, f_vjp = jax.vjp(lambda *xs: call(reference, *xs), *x64)
            ct64 = np.asarray(jnp.asarray(cotangent, dtype), np.float64)
            results.append((np.asarray(o), [np.asarray(g) for g in f_vjp(jnp.asarray(ct64))]))
    (ref, ref_grads), (ref_clean, clean_grads) = results

    # The reference itself: NaN in exactly the output rows that see the token.
    expected = np.zeros((B, H, T), bool)
    if where == "query":
        expected[0, head, token] = True
    else:  # the query heads of the key's group; the rows of its document from the token on
        group = H // H_kv
        expected[0, head * group:(head + 1) * group] = (ids[0] == doc) & (np.arange(T) >= token)
    np.testing.assert_array_equal(nan_rows(ref), expected)

    other_docs = ids != doc
    other_docs[1] = True
    for name, got, want, want_clean in [("output", out, ref, ref_clean)] + [
            (f"d{n}", g, r, c) for n, g, r, c in zip(names, grads, ref_grads, clean_grads)]:
        got, want = np.asarray(got, np.float64), np.asarray(want)
        np.testing.assert_array_equal(nan_rows(got), nan_rows(want), err_msg=name)
        finite = ~nan_rows(want)
        assert rel_err(got[finite], want[finite]) <= TOLERANCE[dtype], name
        if want.ndim == 4 and want.shape[2] == T:  # token rows: those of the other documents
            rows = np.broadcast_to(other_docs[:, None, :], want.shape[:3])
            assert not nan_rows(want)[rows].any(), name
            np.testing.assert_allclose(want[rows], want_clean[rows], rtol=1e-9, atol=1e-12, err_msg=name)
    assert nan_rows(out).any()
