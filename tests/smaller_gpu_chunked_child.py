"""Launches that ``test_chunked.test_default_config_fits_smaller_gpus`` compiles (through
``tools/compile_check.py --package``): ``chunked_recurrent``'s forward and backward at the
default config (``ChunkedConfig.default``) that a GPU with ``EJK_LITE_TEST_SHARED_MEMORY`` bytes
of shared memory a block gets, at K = V = 128, with a scalar gate, a per-key gate and none:
float32, bfloat16, and a bfloat16 query with float32 keys and values (float32 kernels). float32
at K or V >= 128 is where the Hopper defaults ask for 131072 bytes."""
import os

import jax
import jax.numpy as jnp
import numpy as np

import ejk_lite.chunked
from ejk_lite import chunked_recurrent

LIMIT = int(os.environ["EJK_LITE_TEST_SHARED_MEMORY"])
ejk_lite.chunked.max_shared_memory = lambda: LIMIT  # what the GPU's driver would report
rng = np.random.default_rng(0)
B, T, H, K = 1, 150, 2, 128
f32 = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
q, k, v = f32(B, T, H, K), f32(B, T, H, K), f32(B, T, H, K)
gates = [dict(g=-jnp.abs(f32(B, T, H))), dict(gk=-jnp.abs(f32(B, T, H, K))), dict()]
# (query, key, value) dtypes; the kernels compute in their result type: the last is float32
for dtypes in [("float32",) * 3, ("bfloat16",) * 3, ("bfloat16", "float32", "float32")]:
    for kw in gates:
        def loss(q, k, v, kw=kw):
            return chunked_recurrent(q, k, v, **kw, impl="triton")[0].astype(jnp.float32).sum()

        args = [x.astype(dtype) for x, dtype in zip((q, k, v), dtypes)]
        jax.grad(loss, argnums=(0, 1, 2))(*args)
        loss(*args)  # the forward alone: kernels of its own
