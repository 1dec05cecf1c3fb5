# Cumsum launches for tools/compile_check.py --package: every layout, dtype and flag, small shapes.
#   python tools/compile_check.py --package .scratch_cumsum/compile_calls_cumsum.py --arch 80 90
import jax
import jax.numpy as jnp
import numpy as np
from ejk_lite import CumsumConfig, chunk_global_cumsum, chunk_local_cumsum

rng = np.random.default_rng(0)
cu = jnp.asarray([0, 7, 30, 41], jnp.int32)
for dtype in (jnp.float32, jnp.bfloat16, jnp.float16):
    for shape, head_first in (((1, 41, 3), False), ((1, 41, 3, 5), False), ((1, 3, 41), True),
                              ((1, 3, 41, 16), True), ((2, 41, 16, 128), False)):
        x = jnp.asarray(rng.standard_normal(shape), dtype)
        for varlen in (False, True):
            if varlen and shape[0] != 1:
                continue
            kw = dict(head_first=head_first, cu_seqlens=cu if varlen else None, impl="triton")
            for scale in (None, 0.5):
                chunk_local_cumsum(x, 16, softmax_scale=scale, **kw)
                chunk_global_cumsum(x, softmax_scale=scale, **kw)
            jax.grad(lambda x: chunk_local_cumsum(x, 128, **kw).astype(jnp.float32).sum())(x)
            jax.grad(lambda x: chunk_global_cumsum(x, reverse=True, **kw).astype(jnp.float32).sum())(x)
            chunk_global_cumsum(x, config=CumsumConfig(block_t=32, block_c=16, num_warps=2, num_stages=1), **kw)
            chunk_local_cumsum(x, 64, config=CumsumConfig(block_t=16, block_c=64, num_warps=4, num_stages=2),
                               **kw)
