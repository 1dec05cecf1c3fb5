"""Same-run A/B of two versions of ejk_lite: times the package found first on PYTHONPATH at
bench-like shapes (ours only, no peers) and prints one JSON line. Run it once per version in the
same device call, the old one from an exported tree (``git archive OLD ejk_lite``):

    PYTHONPATH=old_tree:/tmp/site python3 bench/_ab.py old > ab_old.json
    PYTHONPATH=$PWD:/tmp/site python3 bench/_ab.py new > ab_new.json

"fwd+bwd" is a jitted vjp with a random cotangent; where the backward needs no forward residual
(mean pooling, cumsum) XLA drops the forward and it times the backward alone. ``--tiny``: CPU try-out.
(Not a bench/<op>.py: gpu_check's ``benches`` skips files starting with ``_``.)
"""
import json, sys
sys.path.insert(0, "bench")
import numpy as np, jax, jax.numpy as jnp
import ejk_lite, common

label = sys.argv[1]
tiny = "--tiny" in sys.argv  # a CPU try-out
rng = np.random.default_rng(0)
rand = lambda shape, dt=jnp.bfloat16: jnp.asarray(rng.standard_normal(shape), dt)
out = {"label": label, "file": ejk_lite.__file__}


def both(name, fn, *args):
    """forward, and forward+backward (vjp with a random cotangent)."""
    f = jax.jit(fn)
    o = jax.eval_shape(fn, *args)
    ct = rand(o.shape, o.dtype)
    g = jax.jit(lambda *a: jax.vjp(fn, *a)[1](ct))
    out[name] = {"fwd": common.time_stats_ms(lambda: f(*args), samples=15),
                 "fwd+bwd": common.time_stats_ms(lambda: g(*args), samples=15)}
    print(name, {k: round(v["median_ms"], 3) for k, v in out[name].items()}, file=sys.stderr, flush=True)


# attention, bf16 B4 H16 T8192 D128, prebuilt masks (as bench/attention.py)
B, H, T, D = (1, 2, 128, 32) if tiny else (4, 16, 8192, 128)
q, k, v = (rand((B, H, T, D)) for _ in range(3))
bounds = np.sort(rng.choice(np.arange(1, T), 7, replace=False))
seg = jnp.asarray(np.broadcast_to(np.searchsorted(bounds, np.arange(T), side="right"), (B, T)), jnp.int32)
fb = ejk_lite.BlockSizes.forward(D, jnp.bfloat16)
for name, kw in {"attention causal": dict(causal=True),
                 "attention documents": dict(causal=True, q_segment_ids=seg, kv_segment_ids=seg)}.items():
    m = jax.jit(lambda: ejk_lite.make_block_mask(T, T, q_block=fb.block_q, kv_block=fb.block_kv, **kw))()
    both(name, lambda q, k, v, m=m: ejk_lite.blocksparse_attention(q, k, v, qkv_layouts=m, causal=False), q, k, v)
# mean pooling, bf16: padded [8, 8192, 4096]; packed 64 sequences in 65536 tokens
x = rand((2, 64, 32) if tiny else (8, 8192, 4096))
both("mean_pooling padded", lambda x: ejk_lite.mean_pooling(x, 32), x)
NT, NS = (256, 4) if tiny else (65536, 64)
cu = jnp.asarray(np.concatenate([[0], np.sort(rng.choice(np.arange(1, NT), NS - 1, replace=False)), [NT]]), jnp.int32)
xp = rand((NT, 32 if tiny else 4096))
both("mean_pooling packed", lambda x: ejk_lite.mean_pooling(x, 32, cu_seqlens=cu), xp)
# cumsum, fp32 gates [8, 16384, 16] (local, chunk 64) and global over vectors [4, 8192, 16, 64]
gs = rand((2, 128, 2) if tiny else (8, 16384, 16), jnp.float32)
both("cumsum local", lambda g: ejk_lite.chunk_local_cumsum(g, 64), gs)
gv = rand((1, 64, 2, 8) if tiny else (4, 8192, 16, 64), jnp.float32)
both("cumsum global", lambda g: ejk_lite.chunk_global_cumsum(g), gv)
# recurrent, bf16 B4 T4096 H16 K=V=128 with a scalar gate
Br, Tr, Hr, Kr = (1, 16, 2, 16) if tiny else (4, 4096, 16, 128)
qr, kr, vr = (rand((Br, Tr, Hr, Kr)) for _ in range(3))
gr = -jnp.abs(rand((Br, Tr, Hr), jnp.float32)) * 0.1
both("recurrent", lambda q, k, v: ejk_lite.recurrent(q, k, v, g=gr)[0], qr, kr, vr)
print(json.dumps(out), flush=True)
