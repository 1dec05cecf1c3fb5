"""The calls whose kernel launches ``tools/compile_check.py --package`` compiles for real GPUs:
each public op forward and backward over the features that change its kernels' constants (gates,
direction, packing, dtypes, chunk sizes), at tiny sizes (the interpreter runs them first)."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np

from ejk_lite import chunk_local_cumsum, chunked_recurrent, mean_pooling, recurrent

rng = np.random.default_rng(0)
B, T, H, K, V = 1, 150, 2, 32, 16
f32 = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)  # noqa: E731
q, k, v = f32(B, T, H, K), f32(B, T, H, K), f32(B, T, H, V)
gates = {"g": -jnp.abs(f32(B, T, H)), "gk": -jnp.abs(f32(B, T, H, K)), "g_gamma": -jnp.abs(f32(H))}
packed = jnp.asarray([0, 7, 7, 130, 150], jnp.int32)

for dtype, chunk, names, rev, cu in itertools.product(
        ["float32", "bfloat16"], [16, 64], [("g",), ("gk",), ("g_gamma",), ("g", "gk", "g_gamma")],
        [False, True], [None, packed]):
    kw = {n: gates[n] for n in names}
    seqs = B if cu is None else cu.shape[0] - 1

    def loss(q, k, v):
        o, _ = chunked_recurrent(q, k, v, **kw, reverse=rev, cu_seqlens=cu, chunk_size=chunk,
                                 initial_state=jnp.zeros((seqs, H, K, V)), impl="triton")
        return o.astype(jnp.float32).sum()

    jax.grad(loss, argnums=(0, 1, 2))(*(x.astype(dtype) for x in (q, k, v)))
    loss(*(x.astype(dtype) for x in (q, k, v)))  # the forward alone: kernels of its own

for dtype in ["float32", "bfloat16"]:
    x = q.astype(dtype)
    jax.grad(lambda x: chunk_local_cumsum(x, 16, impl="triton").astype(jnp.float32).sum())(x)
    jax.grad(lambda x: mean_pooling(x, impl="triton").astype(jnp.float32).sum())(x)
    jax.grad(lambda q: recurrent(q, k.astype(dtype), v.astype(dtype), g=gates["g"],
                                 impl="triton")[0].astype(jnp.float32).sum())(x)
