"""The shared memory of attention's kernels at each config of ``_SMALLER_FORWARDS`` and
``_SMALLER_BACKWARDS``, compiled for sm_80 as jax-triton compiles, without a GPU: the figures of
``_SM80_FORWARD_SHARED`` and ``_SM80_BACKWARD_SHARED`` in ``ejk_lite/attention.py``.

Each config is launched in the interpreter (tiny sizes, with ``fwd_blocks`` or ``bwd_blocks``
pinned), once plain, once with a float32 ``bias`` and once with a dense ``attention_mask``; the
recorder of ``tools/compile_check.py`` notes the launches, and each is compiled for sm_80. A
forward config's figure is the larger of the forward's two launches (the optimistic one and the
retry); a backward config's, the largest of the dK/dV and dQ kernels' four. Prints the tables'
entries, ready to paste::

    python tools/forward_shared_memory.py                  # every list (not timed whole)
    python tools/forward_shared_memory.py --head-dims 256  # one padded head dim: 11 min, 2 cores

(The forward lists of head dims 64 and 128 alone took about 8 minutes on 2 cores. The name
stays from when the script did the forward only.)
"""

from __future__ import annotations

import argparse
import collections
import importlib
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import compile_check  # noqa: E402

CALLS = '''
import jax
import jax.numpy as jnp
import numpy as np
from ejk_lite import blocksparse_attention
from ejk_lite.attention import _SMALLER_BACKWARDS, _SMALLER_FORWARDS, BlockSizes

HEAD_DIMS = {head_dims}
rng = np.random.default_rng(0)
f32 = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
T = 128
SMALL = BlockSizes(32, 32, num_warps=4, num_stages=1)  # the backward runs' forward (below)
for direction, lists in (("fwd", _SMALLER_FORWARDS), ("bwd", _SMALLER_BACKWARDS)):
    for (itemsize, D), configs in lists.items():
        if HEAD_DIMS and D not in HEAD_DIMS:
            continue
        dtype = "float32" if itemsize == 4 else "bfloat16"
        q, k, v = (f32(1, 1, T, D).astype(dtype) for _ in range(3))
        for pair in (dict(), dict(bias=f32(1, 1, T, T)),
                     dict(attention_mask=jnp.asarray(f32(1, 1, T, T) > 0))):
            for block_q, block_kv, num_warps, num_stages in configs:
                blocks = BlockSizes(block_q, block_kv, num_warps=num_warps,
                                    num_stages=num_stages)
                if direction == "fwd":
                    blocksparse_attention(q, k, v, causal=True, fwd_blocks=blocks,
                                          impl="triton", **pair)
                    continue
                jax.grad(lambda q, pair=pair, blocks=blocks: blocksparse_attention(
                    q, k, v, causal=True, fwd_blocks=SMALL, bwd_blocks=blocks, impl="triton",
                    **pair).astype(jnp.float32).sum())(q)
'''
KERNELS = {"_attention_fwd_kernel": "fwd", "_attention_dkv_kernel": "bwd",
           "_attention_dq_kernel": "bwd"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--head-dims", type=int, nargs="*", default=[],
                        help="only the lists of these padded head dims (64, 128, 256)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder) / "calls.py"
        script.write_text(CALLS.format(head_dims=set(args.head_dims)))
        launches = compile_check.record_script(script)
    import jax

    jax.devices = lambda *args, **kwargs: [type("PretendGpu", (), {"platform": "gpu"})()]
    sys.path.insert(0, str(ROOT))
    import ejk_lite  # noqa: F401  (compiled mode: JAX is told it has a GPU)
    from ejk_lite.attention import _SMALLER_BACKWARDS, _SMALLER_FORWARDS

    shared = {"fwd": collections.defaultdict(dict), "bwd": collections.defaultdict(dict)}
    for launch in launches:
        direction = KERNELS.get(launch["name"])
        if direction is None:
            continue
        meta = launch["meta"]
        shape, logits, rule = (meta[k]["values"] for k in ("SHAPE", "LOGITS", "RULE"))
        itemsize = 4 if logits[4] == "tf32x3" else 2  # DOT_PRECISION: float32's
        key = (itemsize, shape[4], shape[6], shape[7], meta["num_warps"], meta["num_stages"])
        lists = _SMALLER_FORWARDS if direction == "fwd" else _SMALLER_BACKWARDS
        if key[2:] not in lists.get(key[:2], []):
            continue  # not one of the lists' configs: a backward run's forward at SMALL
        # (where SMALL is in a forward list, its launch there is the same as the forward run's)
        pair = "bias" if logits[3] else "mask" if rule[3] else "none"  # HAS_BIAS, HAS_TOKEN_MASK
        fn = getattr(importlib.import_module(launch["module"]), launch["name"])
        saved = compile_check.SHARED_MEMORY[80]
        compile_check.SHARED_MEMORY[80] = 1 << 30  # report the bytes, not a failure
        try:
            nbytes = compile_check.compile_launch(fn, launch, 80)
        finally:
            compile_check.SHARED_MEMORY[80] = saved
        table = shared[direction]
        table[key][pair] = max(table[key].get(pair, 0), nbytes)
    for direction, name in (("fwd", "_SM80_FORWARD_SHARED"), ("bwd", "_SM80_BACKWARD_SHARED")):
        print(f"{name}:")
        for key, figures in sorted(shared[direction].items(),
                                   key=lambda kv: (-kv[0][0], -kv[0][1])):
            print(f"    {key}: dict(none={figures['none']}, bias={figures['bias']}, "
                  f"mask={figures['mask']}),")


if __name__ == "__main__":
    main()
