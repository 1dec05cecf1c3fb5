"""Launches that ``test_attention.test_default_tiles_fit_shared_memory`` compiles for sm_90
(through ``tools/compile_check.py --package``): the forward and backward at their default tiles,
bfloat16 D128, with a bias and with a dense attention_mask (a tile per pair in every stage); and
a value head dim of 256 with D128 (the defaults follow the wider)."""
import jax
import jax.numpy as jnp
import numpy as np

from ejk_lite import blocksparse_attention

rng = np.random.default_rng(0)
T, D = 200, 128
q = jnp.asarray(rng.standard_normal((1, 2, T, D)), jnp.bfloat16)
k = jnp.asarray(rng.standard_normal((1, 1, T, D)), jnp.bfloat16)
for kw in [dict(bias=jnp.asarray(rng.standard_normal((1, 2, T, T)), jnp.float32)),
           dict(attention_mask=jnp.asarray(rng.random((1, 1, T, T)) < 0.5))]:
    jax.grad(lambda q, kw=kw: blocksparse_attention(q, k, k, **kw, impl="triton")
             .astype(jnp.float32).sum())(q)
v = jnp.asarray(rng.standard_normal((1, 1, T, 256)), jnp.bfloat16)  # D128, value head dim 256
jax.grad(lambda q: blocksparse_attention(q, k, v, causal=True, impl="triton")
         .astype(jnp.float32).sum())(q)
