"""The shared memory of the attention forward at each config of ``_SMALLER_FORWARDS``, compiled
for sm_80 as jax-triton compiles, without a GPU: the figures of ``_SM80_FORWARD_SHARED`` in
``ejk_lite/attention.py``.

Each config is launched in the interpreter (tiny sizes, with ``fwd_blocks`` pinned), once
plain, once with a float32 ``bias`` and once with a dense ``attention_mask``; the recorder of
``tools/compile_check.py`` notes the launches, and each is compiled for sm_80. A config's
figure is the larger of the forward's two launches (the optimistic one and the retry). Prints
the table's entries, ready to paste::

    python tools/forward_shared_memory.py      # about 8 minutes on 2 cores
"""

from __future__ import annotations

import collections
import importlib
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import compile_check  # noqa: E402

CALLS = '''
import jax.numpy as jnp
import numpy as np
from ejk_lite import blocksparse_attention
from ejk_lite.attention import _SMALLER_FORWARDS, BlockSizes

rng = np.random.default_rng(0)
f32 = lambda *s: jnp.asarray(rng.standard_normal(s), jnp.float32)
T = 128
for (itemsize, D), configs in _SMALLER_FORWARDS.items():
    dtype = "float32" if itemsize == 4 else "bfloat16"
    q, k, v = (f32(1, 1, T, D).astype(dtype) for _ in range(3))
    for pair in (dict(), dict(bias=f32(1, 1, T, T)),
                 dict(attention_mask=jnp.asarray(f32(1, 1, T, T) > 0))):
        for block_q, block_kv, num_warps, num_stages in configs:
            blocks = BlockSizes(block_q, block_kv, num_warps=num_warps, num_stages=num_stages)
            blocksparse_attention(q, k, v, causal=True, fwd_blocks=blocks, impl="triton", **pair)
'''


def main() -> None:
    with tempfile.TemporaryDirectory() as folder:
        script = Path(folder) / "calls.py"
        script.write_text(CALLS)
        launches = compile_check.record_script(script)
    import jax

    jax.devices = lambda *args, **kwargs: [type("PretendGpu", (), {"platform": "gpu"})()]
    sys.path.insert(0, str(ROOT))
    import ejk_lite  # noqa: F401  (compiled mode: JAX is told it has a GPU)

    shared = collections.defaultdict(dict)
    for launch in launches:
        if launch["name"] != "_attention_fwd_kernel":
            continue
        meta = launch["meta"]
        shape, logits, rule = (meta[k]["values"] for k in ("SHAPE", "LOGITS", "RULE"))
        itemsize = 4 if logits[4] == "tf32x3" else 2  # DOT_PRECISION: float32's
        key = (itemsize, shape[4], shape[6], shape[7], meta["num_warps"], meta["num_stages"])
        pair = "bias" if logits[3] else "mask" if rule[3] else "none"  # HAS_BIAS, HAS_TOKEN_MASK
        fn = getattr(importlib.import_module(launch["module"]), launch["name"])
        saved = compile_check.SHARED_MEMORY[80]
        compile_check.SHARED_MEMORY[80] = 1 << 30  # report the bytes, not a failure
        try:
            nbytes = compile_check.compile_launch(fn, launch, 80)
        finally:
            compile_check.SHARED_MEMORY[80] = saved
        shared[key][pair] = max(shared[key].get(pair, 0), nbytes)
    for key, figures in sorted(shared.items(), key=lambda kv: (-kv[0][0], -kv[0][1])):
        print(f"    {key}: dict(none={figures['none']}, bias={figures['bias']}, "
              f"mask={figures['mask']}),")


if __name__ == "__main__":
    main()
