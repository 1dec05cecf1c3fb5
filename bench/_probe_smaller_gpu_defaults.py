"""Probe (not a bench): the defaults a GPU with less shared memory takes, run on this GPU.

Session 25. ``BlockSizes.forward`` (attention) and ``ChunkedConfig.default`` (chunked
linear attention) choose other tiles or fewer stages where a block may use less shared memory
than Hopper's 232448 bytes: an A100 (166912), sm_86 and sm_89 (101376; L4, RTX 30xx / 40xx).
No such GPU is lent here, so those choices were only compiled for them. This runs them on the
GPU that is here (an H200): that they are right (against float64, the script fails on an error
past the tolerance), and what they cost *on this GPU* against its own defaults (device time,
10 samples, min / median / max). A Hopper's timing says nothing of an A100's: the point is
correctness on hardware, and a sign of the cost of fewer stages.

What it gave (H200, d599053, causal attention forward at B2 H16 T4096; chunked_recurrent
forward at B2 T4096 H8 K=V=128; median ms): every choice right (attention bf16 2.0-2.1e-3,
float32 4.5-4.8e-7; chunked float32 1.5-3.9e-7). On this GPU:

- attention bf16 D128: 0.463 (Hopper's 3 stages), 0.524 (the A100's 2), 0.599 (sm_89's 1);
  with a bias 1.017 (2 stages), 1.309 and 1.312 (1 stage); float32 D128 5.03 (64 x 64,
  2 stages), 5.14 (1 stage), 7.14 (sm_89's 32 x 32); bf16 D64 the same tiles everywhere (0.357).
- chunked_recurrent float32: scalar gate 0.430 / 0.430 / 0.435 (sm_89's config), no gate
  0.396 / 0.396 / 0.406; the per-key gate 0.608 at Hopper's default against **0.561** with
  sm_89's, whose ``attention`` takes 1 stage: fewer stages were faster here. (A lead for the
  Hopper default of float32 inputs, not followed: one run, and the 16-bit default was timed
  in bfloat16.)

``--head-dim-256`` (session 26, H200, d7c2d55, B1 H4 T1024 D256 causal; output and the
gradients of q, k, v against float64): bfloat16 2.0e-3 and 2.4e-3 at every limit's tiles
(forward 64 x 64 at 2 stages, 1 on sm_86/89; backward 32 x 32); float32 7.1-7.3e-7 and 1.3e-6
(forward 32 x 32, 16 x 16 on sm_86/89; backward 32 x 32, 32 x 16 on an A100, 16 x 16 on
sm_86/89). Checked only, not timed.

    python3 bench/_probe_smaller_gpu_defaults.py            # GPU
    python3 bench/_probe_smaller_gpu_defaults.py --head-dim-256   # GPU: attention at D256 only
    python3 bench/_probe_smaller_gpu_defaults.py --quick    # interpreter: small shapes
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ejk_lite  # noqa: E402, F401  (first: settles the Triton backend)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from common import relative_error, time_stats_ms, tolerance  # noqa: E402
from ejk_lite import blocksparse_attention, chunked_recurrent  # noqa: E402
from ejk_lite.attention import BlockSizes  # noqa: E402
from ejk_lite.chunked import ChunkedConfig  # noqa: E402

LIMITS = {"Hopper (232448)": None, "A100 (166912)": 166912, "sm_86/89 (101376)": 101376}


def line(label, fn, args, expected, dtype, failures, timed):
    err = max(relative_error(o, e) for o, e in zip(jax.tree.leaves(fn(*args)),
                                                   jax.tree.leaves(expected)))
    ok = err <= tolerance(dtype)
    if not ok:
        failures.append(f"{label}: relative error {err:.2e}")
    text = f"{label:62} rel err {err:.1e}{'' if ok else ' FAILED'}"
    if timed:
        st = time_stats_ms(lambda: fn(*args), 10)
        text += f"  {st['median_ms']:.4f} ms ({st['min_ms']:.4f}-{st['max_ms']:.4f})"
    return text


def head_dim_256(quick, rng, failures):
    """Attention at D256, causal, bfloat16 and float32: the output and the gradients of q, k
    and v at the forward's and the backward's defaults of each limit, against float64 (checked
    only, not timed: session 26 added those defaults)."""
    B, H, T, D = (1, 2, 130, 256) if quick else (1, 4, 1024, 256)
    for dtype in ("bfloat16", "float32"):
        q, k, v, d_o = (jnp.asarray(rng.standard_normal((B, H, T, D)), dtype)
                        for _ in range(4))
        with jax.enable_x64(True):
            wide = [x.astype(jnp.float64) for x in (q, k, v)]
            out, vjp = jax.vjp(lambda q, k, v: blocksparse_attention(
                q, k, v, causal=True, impl="xla"), *wide)
            expected = [np.asarray(x) for x in (out, *vjp(d_o.astype(jnp.float64)))]
        for name, limit in LIMITS.items():
            fwd = BlockSizes.forward(D, dtype, shared_memory=limit or 232448)
            bwd = BlockSizes.backward(D, dtype, shared_memory=limit or 232448)

            def call(q, k, v, d_o, fwd=fwd, bwd=bwd):
                out, vjp = jax.vjp(lambda q, k, v: blocksparse_attention(
                    q, k, v, causal=True, fwd_blocks=fwd, bwd_blocks=bwd, impl="triton"),
                    q, k, v)
                return [out, *vjp(d_o)]

            got = jax.jit(call)(q, k, v, d_o)
            errs = [relative_error(g, e) for g, e in zip(got, expected)]
            ok = (errs[0] <= tolerance(dtype)
                  and max(errs[1:]) <= tolerance(dtype, gradient=True))
            label = (f"attention {dtype} D256 {name}: fwd {fwd.block_q}x{fwd.block_kv} "
                     f"{fwd.num_stages}st, bwd {bwd.block_q}x{bwd.block_kv} {bwd.num_stages}st")
            if not ok:
                failures.append(f"{label}: relative errors {errs}")
            print(f"{label:70} rel err out {errs[0]:.1e}, grads {max(errs[1:]):.1e}"
                  f"{'' if ok else ' FAILED'}", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--head-dim-256", action="store_true",
                   help="only attention at D256, forward and backward, checked")
    args = p.parse_args()
    timed = not args.quick
    rng = np.random.default_rng(0)
    failures = []
    if args.head_dim_256:
        head_dim_256(args.quick, rng, failures)
        if failures:
            sys.exit("failed: " + "; ".join(failures))
        return

    # Attention, causal, forward: bf16 D128 (with and without a bias) and float32 D128.
    B, H, T = (1, 2, 200) if args.quick else (2, 16, 4096)
    for dtype, D, with_bias in [("bfloat16", 128, False), ("bfloat16", 128, True),
                                ("float32", 128, False), ("bfloat16", 64, False)]:
        q, k, v = (jnp.asarray(rng.standard_normal((B, H, T, D)), dtype) for _ in range(3))
        bias = (jnp.asarray(rng.standard_normal((1, H, T, T)), jnp.float32) if with_bias
                else None)
        with jax.enable_x64(True):
            expected = blocksparse_attention(*(x.astype(jnp.float64) for x in (q, k, v)),
                                             bias=None if bias is None else bias.astype(
                                                 jnp.float64), causal=True, impl="xla")
            expected = np.asarray(expected)
        for name, limit in LIMITS.items():
            blocks = BlockSizes.forward(D, dtype, bias=with_bias, shared_memory=limit or 232448)
            fn = jax.jit(lambda q, k, v, b, blocks=blocks: blocksparse_attention(
                q, k, v, bias=b, causal=True, fwd_blocks=blocks, impl="triton"))
            label = (f"attention {dtype} D{D}{' bias' if with_bias else ''} {name}: "
                     f"{blocks.block_q}x{blocks.block_kv} {blocks.num_warps}w "
                     f"{blocks.num_stages}st")
            print(line(label, fn, (q, k, v, bias), expected, dtype, failures, timed), flush=True)

    # chunked_recurrent, float32 K = V = 128 (where ChunkedConfig.default differs), forward.
    B, T, H, K = (1, 150, 2, 128) if args.quick else (2, 4096, 8, 128)
    q, k, v = (jnp.asarray(rng.standard_normal((B, T, H, K)), jnp.float32) for _ in range(3))
    q, k = q / np.sqrt(K), k / np.sqrt(K)
    gate_sets = {"g": dict(g=-jnp.abs(jnp.asarray(rng.standard_normal((B, T, H)), jnp.float32))),
                 "gk": dict(gk=-jnp.abs(jnp.asarray(rng.standard_normal((B, T, H, K)),
                                                    jnp.float32))),
                 "no gate": dict()}
    for gate, kw in gate_sets.items():
        with jax.enable_x64(True):
            expected = chunked_recurrent(*(x.astype(jnp.float64) for x in (q, k, v)),
                                         **{n: g.astype(jnp.float64) for n, g in kw.items()},
                                         impl="xla")
            expected = jax.tree.map(np.asarray, expected)
        for name, limit in LIMITS.items():
            config = ChunkedConfig.default(jnp.float32, shared_memory=limit or 232448)
            fn = jax.jit(lambda q, k, v, config=config, kw=kw: chunked_recurrent(
                q, k, v, **kw, config=config, impl="triton"))
            label = (f"chunked_recurrent float32 K=V=128 {gate} {name}: fused_output "
                     f"{config.fused_output.num_stages}st attention "
                     f"{config.attention.num_stages}st")
            print(line(label, fn, (q, k, v), expected, "float32", failures, timed), flush=True)
    if failures:
        sys.exit("failed: " + "; ".join(failures))


if __name__ == "__main__":
    main()
