"""Attention calls for ``tools/compile_check.py --package tools/compile_calls_attention.py``: the
forward and both backward kernels at their bfloat16, head dim 128 defaults (the tiles of
bench/attention.py's race), causal, at a small length the interpreter runs quickly (tiles do not
depend on it). With ``--registers`` it says what ptxas makes of each: registers, spills."""

import jax
import jax.numpy as jnp
import numpy as np

from ejk_lite import blocksparse_attention

rng = np.random.default_rng(0)
B, H, T, D = 1, 2, 512, 128
q, k, v, do = (jnp.asarray(rng.standard_normal((B, H, T, D)), jnp.bfloat16) for _ in range(4))
_, vjp = jax.vjp(lambda q, k, v: blocksparse_attention(q, k, v, causal=True, impl="triton"),
                 q, k, v)
jax.block_until_ready(vjp(do))
