"""Launches that ``test_attention.test_default_tiles_fit_smaller_gpus`` compiles (through
``tools/compile_check.py --package``): the forward and backward at the default tiles that a GPU
with ``EJK_LITE_TEST_SHARED_MEMORY`` bytes of shared memory a block gets (an A100: 166912; sm_86
and sm_89: 101376), bfloat16 at D64, D128 and D256 and float32 at D128 and D256, plain, with a
bias and with a dense attention_mask."""
import os

import jax
import jax.numpy as jnp
import numpy as np

import ejk_lite.attention
from ejk_lite import blocksparse_attention

LIMIT = int(os.environ["EJK_LITE_TEST_SHARED_MEMORY"])
ejk_lite.attention.max_shared_memory = lambda: LIMIT  # what the GPU's driver would report
rng = np.random.default_rng(0)
T = 130
for dtype, D in [("bfloat16", 128), ("bfloat16", 64), ("float32", 128), ("bfloat16", 256),
                 ("float32", 256)]:
    q = jnp.asarray(rng.standard_normal((1, 2, T, D)), dtype)
    k = jnp.asarray(rng.standard_normal((1, 1, T, D)), dtype)
    for kw in [dict(), dict(bias=jnp.asarray(rng.standard_normal((1, 2, T, T)), jnp.float32)),
               dict(attention_mask=jnp.asarray(rng.random((1, 1, T, T)) < 0.5))]:
        jax.grad(lambda q, kw=kw: blocksparse_attention(q, k, k, **kw, impl="triton")
                 .astype(jnp.float32).sum())(q)
