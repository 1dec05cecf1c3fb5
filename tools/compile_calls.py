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

# chunk_global_cumsum's scan on the tensor cores, at each autotune tile that takes it (the
# autotuner compiles them all on a GPU): both directions (the gradient is the reverse sum),
# packed and not, both 16-bit dtypes, the head-first scalar layout (tokens contiguous), split.
from ejk_lite import chunk_global_cumsum  # noqa: E402
from ejk_lite.cumsum import _GLOBAL_16_BIT_TILES, CumsumConfig  # noqa: E402

x = f32(1, 150, 4, 40)
tiles = dict.fromkeys(t for ts in _GLOBAL_16_BIT_TILES.values() for t in ts)  # both directions'
for tile in [t for t in tiles if t[5]]:
    for dtype, cu in [("bfloat16", None), ("float16", packed)]:
        cfg = CumsumConfig(*tile)
        jax.grad(lambda x: chunk_global_cumsum(x, cu_seqlens=cu, impl="triton", config=cfg)
                 .astype(jnp.float32).sum())(x.astype(dtype))
cfg = CumsumConfig(32, 16, 4, 3, split=2, tensor_cores=True)
for shape, head_first in [((2, 3, 150), True), ((2, 150, 3, 8), False)]:
    chunk_global_cumsum(f32(*shape).astype("bfloat16"), head_first=head_first, impl="triton",
                        config=cfg)
# ... and its walks that hold the next block in registers (prefetch), likewise: the autotune
# tiles that take it, float32 and bfloat16, and one on the tensor cores, split.
for tile in [t for t in tiles if t[6]]:
    for dtype, cu in [("float32", None), ("bfloat16", packed)]:
        cfg = CumsumConfig(*tile)
        jax.grad(lambda x: chunk_global_cumsum(x, cu_seqlens=cu, impl="triton", config=cfg)
                 .astype(jnp.float32).sum())(x.astype(dtype))
cfg = CumsumConfig(32, 16, 4, 1, split=2, tensor_cores=True, prefetch=True)
for shape, head_first in [((2, 3, 150), True), ((2, 150, 3, 8), False)]:
    chunk_global_cumsum(f32(*shape).astype("bfloat16"), head_first=head_first, impl="triton",
                        config=cfg)

# blocksparse_attention at its default tiles (those of a real call; the unit tests use small
# ones), over the features that change its kernels' constants: dtypes, head dims, lengths that
# are and are not multiples of the tiles, the token rule's clauses and where positions come from
# (given: loaded; else the indices), bias, soft cap, sinks, grouped heads.
from ejk_lite import blocksparse_attention, make_block_mask  # noqa: E402

B, H, H_KV = 1, 2, 1
for dtype, D, T in [("bfloat16", 128, 200), ("bfloat16", 128, 256), ("float16", 128, 200),
                    ("float32", 128, 200), ("bfloat16", 64, 200), ("bfloat16", 96, 200),
                    ("float32", 64, 200)]:
    q = f32(B, H, T, D).astype(dtype)
    k, v = f32(B, H_KV, T, D).astype(dtype), f32(B, H_KV, T, D).astype(dtype)
    seg = jnp.asarray(np.repeat([[0, 1, 2]], [70, 60, T - 130], axis=1), jnp.int32)
    pos = jnp.arange(T, dtype=jnp.int32)[None]
    prebuilt = make_block_mask(T, T, q_segment_ids=seg, kv_segment_ids=seg, causal=True)
    features = [dict(), dict(causal=False), dict(sliding_window=(64, 0)),
                dict(q_segment_ids=seg, kv_segment_ids=seg),
                dict(q_positions=pos, kv_positions=pos, sliding_window=(64, 8)),
                dict(bias=f32(1, H, T, T)), dict(logits_soft_cap=20.0),
                dict(softmax_aux=f32(H)), dict(attention_mask=jnp.asarray(f32(1, 1, T, T) > 0)),
                dict(qkv_layouts=prebuilt, causal=False),
                dict(qkv_layouts=prebuilt, causal=False, sliding_window=(64, 0))]
    if dtype != "bfloat16" or T != 200:  # the rest: one clause, no extras
        features = features[:2]
    for kw in features:
        def loss(q, k, v, kw=kw):
            o = blocksparse_attention(q, k, v, **kw, impl="triton")
            return o.astype(jnp.float32).sum()

        jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
