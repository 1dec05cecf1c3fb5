"""Probe (not a bench): the attention backward with dQ accumulated by atomics, against two kernels.

Why: issue 19 wants forward + backward at >= 0.8x cuDNN on causal; the backward is the larger
gap. Ours runs two kernels (``ejk_lite/attention.py``): dK/dV per key block (4 products: QK^T,
dO V^T, P^T dO, dS^T Q) and dQ per query block (3: QK^T, dO V^T, dS K), 7 products a tile
pair. FlashAttention-2 and -3 run one: the dK/dV kernel also computes dS K and adds it into a
float32 dQ with atomics, 5 products a tile pair, at the price of [BQ, D] float32 atomic adds
per tile pair, a zeroed dQ buffer and a conversion after.

Both forms here are written the same way (dense causal attention, no lists, no NaN
containment, head-first [B, H, T, D] bfloat16), so the only difference is the dQ. Each is
checked against autodiff of the package's dense float32 reference (the script fails past
bfloat16's tolerance) and timed on the device (10 samples, min / median / max, each after an L2 flush),
with the package's own backward at its defaults beside them for scale.

    python3 bench/_probe_atomic_dq.py [--out bench/results]   # GPU: B4 H16 T8192 D128
    python3 bench/_probe_atomic_dq.py --quick                 # interpreter: small shapes

What it found (bench/results/probe_atomic_dq.json, H200, 2026-12-02; tiles BQ x BK, warps,
stages; backward kernels only, median of 10): two kernels 6.793 ms, with the dK/dV tiles
transposed 6.683; dQ by atomics, transposed, 7.199 at 64 x 128 with 8 warps and 3 stages (the
best of six tiles; 64 x 64 with 4 warps 12.497). Not transposed, the atomic form ran 12-21 ms
in an earlier run of the same probe (not recorded). So in Triton 3.6 the atomic form loses
despite its 5 products for 7: its atomics are vectorised (``atom.global.gpu.relaxed.add.v4.f32``
in the sm_90 PTX), but they and the dK/dV kernel's register pressure (255 registers, spills
at every tile that fits, from ptxas -v offline) cost more than the two products saved. The
package's own backward at its defaults ran dK/dV 4.067 ms + dQ 2.886 ms in the race's form
(bench/_probe_attention.py, the same machine), 0.2-0.3 ms behind this probe's two kernels,
which have no lists, no GQA loop and no NaN containment.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ejk_lite  # noqa: E402, F401  (first: settles the Triton backend)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from common import relative_error, time_stats_ms, tolerance, write_result  # noqa: E402
from ejk_lite.attention import reference as attention_reference  # noqa: E402
from ejk_lite.launch import triton_call  # noqa: E402

LOG2E = 1.4426950408889634


@triton.jit
def _pair(q, k, v, do, lse, delta, offs_m, offs_n, QK_SCALE: tl.constexpr,
          MASK: tl.constexpr):
    """p and ds = dL/d(logit) of one tile pair, [BQ, BK]; logits in base 2 (lse too)."""
    s = tl.dot(q, tl.trans(k)) * QK_SCALE
    if MASK:
        s = tl.where(offs_m[:, None] >= offs_n[None, :], s, float("-inf"))
    p = tl.exp2(s - lse[:, None])
    dp = tl.dot(do, tl.trans(v))
    return p, p * (dp - delta[:, None])


@triton.jit
def _pair_t(q, k, v, do, lse, delta, offs_m, offs_n, QK_SCALE: tl.constexpr,
            MASK: tl.constexpr):
    """p and ds transposed, [BK, BQ]: computed as K Q^T and V dO^T, so that the products
    dV += P^T dO and dK += dS^T Q take them from registers as they are (the A operand of a
    Hopper wgmma may come from registers, not transposed) instead of through shared memory."""
    st = tl.dot(k, tl.trans(q)) * QK_SCALE
    if MASK:
        st = tl.where(offs_m[None, :] >= offs_n[:, None], st, float("-inf"))
    pt = tl.exp2(st - lse[None, :])
    dpt = tl.dot(v, tl.trans(do))
    return pt, pt * (dpt - delta[None, :])


@triton.jit
def _dkv_steps(dk, dv, k, v, offs_n, base, lse_base, first, last, dq_base, T,
               QK_SCALE: tl.constexpr, SM_SCALE: tl.constexpr, BQ: tl.constexpr,
               D: tl.constexpr, MASK: tl.constexpr, ATOMIC: tl.constexpr,
               TRANSPOSED: tl.constexpr):
    offs_d = tl.arange(0, D)
    for start in range(first, last, BQ):
        offs_m = start + tl.arange(0, BQ)
        rows = offs_m[:, None] * D + offs_d[None, :]
        q = tl.load(base[0] + rows)
        do = tl.load(base[1] + rows)
        lse = tl.load(lse_base[0] + offs_m)
        delta = tl.load(lse_base[1] + offs_m)
        if TRANSPOSED:
            pt, dst = _pair_t(q, k, v, do, lse, delta, offs_m, offs_n, QK_SCALE, MASK)
            dv += tl.dot(pt.to(do.dtype), do)
            dst16 = dst.to(q.dtype)
            dk += tl.dot(dst16, q)
            ds16 = tl.trans(dst16)
        else:
            p, ds = _pair(q, k, v, do, lse, delta, offs_m, offs_n, QK_SCALE, MASK)
            dv += tl.dot(tl.trans(p.to(do.dtype)), do)
            ds16 = ds.to(q.dtype)
            dk += tl.dot(tl.trans(ds16), q)
        if ATOMIC:
            dq = tl.dot(ds16, k) * SM_SCALE
            tl.atomic_add(dq_base + rows, dq, sem="relaxed")
    return dk, dv


@triton.jit
def dkv_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr,
               dq_in_ptr,  # the zeroed dQ, aliased to dq_ptr (jax-triton's convention)
               T, dk_ptr, dv_ptr, dq_ptr, QK_SCALE: tl.constexpr, SM_SCALE: tl.constexpr,
               BQ: tl.constexpr, BK: tl.constexpr, D: tl.constexpr, ATOMIC: tl.constexpr,
               TRANSPOSED: tl.constexpr):
    """Grid (T / BK, B * H): dK, dV of one key block (ATOMIC: and its share of dQ), causal."""
    i_n, i_bh = tl.program_id(0), tl.program_id(1).to(tl.int64)
    offs_n = i_n * BK + tl.arange(0, BK)
    offs_d = tl.arange(0, D)
    kv_rows = i_bh * T * D + offs_n[:, None] * D + offs_d[None, :]
    k = tl.load(k_ptr + kv_rows)
    v = tl.load(v_ptr + kv_rows)
    base = (q_ptr + i_bh * T * D, do_ptr + i_bh * T * D)
    lse_base = (lse_ptr + i_bh * T, delta_ptr + i_bh * T)
    dq_base = dq_ptr + i_bh * T * D
    dk = tl.zeros([BK, D], tl.float32)
    dv = tl.zeros([BK, D], tl.float32)
    diag = i_n * BK  # query blocks [diag, diag + BK) cross the diagonal; later ones see it all
    dk, dv = _dkv_steps(dk, dv, k, v, offs_n, base, lse_base, diag, diag + BK, dq_base, T,
                        QK_SCALE, SM_SCALE, BQ, D, True, ATOMIC, TRANSPOSED)
    dk, dv = _dkv_steps(dk, dv, k, v, offs_n, base, lse_base, diag + BK, T, dq_base, T,
                        QK_SCALE, SM_SCALE, BQ, D, False, ATOMIC,
                        TRANSPOSED)
    tl.store(dk_ptr + kv_rows, (dk * SM_SCALE).to(dk_ptr.dtype.element_ty))
    tl.store(dv_ptr + kv_rows, dv.to(dv_ptr.dtype.element_ty))


@triton.jit
def _dq_steps(dq, q, do, lse, delta, offs_m, k_base, v_base, first, last,
              QK_SCALE: tl.constexpr, BK: tl.constexpr, D: tl.constexpr, MASK: tl.constexpr):
    offs_d = tl.arange(0, D)
    for start in range(first, last, BK):
        offs_n = start + tl.arange(0, BK)
        rows = offs_n[:, None] * D + offs_d[None, :]
        k = tl.load(k_base + rows)
        v = tl.load(v_base + rows)
        _, ds = _pair(q, k, v, do, lse, delta, offs_m, offs_n, QK_SCALE, MASK)
        dq += tl.dot(ds.to(k.dtype), k)
    return dq


@triton.jit
def dq_kernel(q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, T, dq_ptr,
              QK_SCALE: tl.constexpr, SM_SCALE: tl.constexpr, BQ: tl.constexpr,
              BK: tl.constexpr, D: tl.constexpr):
    """Grid (T / BQ, B * H), last query blocks first: dQ of one query block, causal."""
    i_m = tl.num_programs(0) - 1 - tl.program_id(0)
    i_bh = tl.program_id(1).to(tl.int64)
    offs_m = i_m * BQ + tl.arange(0, BQ)
    offs_d = tl.arange(0, D)
    rows = i_bh * T * D + offs_m[:, None] * D + offs_d[None, :]
    q = tl.load(q_ptr + rows)
    do = tl.load(do_ptr + rows)
    lse = tl.load(lse_ptr + i_bh * T + offs_m)
    delta = tl.load(delta_ptr + i_bh * T + offs_m)
    k_base, v_base = k_ptr + i_bh * T * D, v_ptr + i_bh * T * D
    dq = tl.zeros([BQ, D], tl.float32)
    full = (i_m * BQ) // BK * BK  # key blocks before the one holding the query block's first row
    dq = _dq_steps(dq, q, do, lse, delta, offs_m, k_base, v_base, 0, full, QK_SCALE, BK, D,
                   False)
    dq = _dq_steps(dq, q, do, lse, delta, offs_m, k_base, v_base, full, (i_m + 1) * BQ,
                   QK_SCALE, BK, D, True)
    tl.store(dq_ptr + rows, (dq * SM_SCALE).to(dq_ptr.dtype.element_ty))


def backward(q, k, v, do, lse2, delta, form, dkv_tiles, dq_tiles):
    """(dq, dk, dv). ``form``: "split" (two kernels) or "atomic" (one, dQ by atomics), either
    with "_t": the dK/dV kernel's tiles transposed (``_pair_t``)."""
    B, H, T, D = q.shape
    scale = 1 / math.sqrt(D)
    consts = dict(QK_SCALE=scale * LOG2E, SM_SCALE=scale, D=D)
    bq, bk, warps, stages = dkv_tiles
    assert bq <= bk and bk % bq == 0, "the diagonal loop assumes BQ divides BK"
    atomic = form.startswith("atomic")
    dq0 = jnp.zeros((B, H, T, D), jnp.float32)
    out = [jax.ShapeDtypeStruct(q.shape, q.dtype)] * 2 + [jax.ShapeDtypeStruct(q.shape,
                                                                              jnp.float32)]
    dk, dv, dq32 = triton_call(q, k, v, do, lse2, delta, dq0, T, kernel=dkv_kernel,
                               out_shape=out, grid=(T // bk, B * H), num_warps=warps,
                               num_stages=stages, input_output_aliases={6: 2}, BQ=bq, BK=bk,
                               ATOMIC=atomic, TRANSPOSED=form.endswith("_t"), **consts)
    if atomic:
        return dq32.astype(q.dtype), dk, dv
    bq, bk, warps, stages = dq_tiles
    dq = triton_call(q, k, v, do, lse2, delta, T, kernel=dq_kernel,
                     out_shape=jax.ShapeDtypeStruct(q.shape, q.dtype), grid=(T // bq, B * H),
                     num_warps=warps, num_stages=stages, BQ=bq, BK=bk, **consts)
    return dq, dk, dv


def base2_lse(q, k):
    """The rows' log-sum-exp of the causal logits in base 2, float32: what the kernels take
    (the package's reference returns the output only)."""
    q, k = q.astype(jnp.float32), k.astype(jnp.float32)
    T = q.shape[2]
    s = jnp.einsum("bhtd,bhsd->bhts", q, k) / math.sqrt(q.shape[-1])
    s = jnp.where(jnp.tril(jnp.ones((T, T), bool)), s, -jnp.inf)
    return jax.nn.logsumexp(s, axis=-1) * LOG2E


# name: (form, dK/dV tiles, dQ tiles), tiles (BQ, BK, warps, stages)
VARIANTS = {
    "split 64x64 4w 2st": ("split", (64, 64, 4, 2), (64, 64, 4, 2)),
    "atomic 64x64 4w 2st": ("atomic", (64, 64, 4, 2), None),
    "atomic 64x128 8w 2st": ("atomic", (64, 128, 8, 2), None),
    "atomic 64x128 8w 3st": ("atomic", (64, 128, 8, 3), None),
    "atomic 32x128 8w 2st": ("atomic", (32, 128, 8, 2), None),
    "atomic 64x64 4w 3st": ("atomic", (64, 64, 4, 3), None),
    "atomic 64x128 4w 2st": ("atomic", (64, 128, 4, 2), None),
}
QUICK_VARIANTS = {"split": ("split", (16, 32, 2, 1), (16, 32, 2, 1)),
                  "split_t": ("split_t", (16, 32, 2, 1), (32, 16, 2, 1)),
                  "atomic": ("atomic", (16, 32, 2, 1), None),
                  "atomic_t 16x16": ("atomic_t", (16, 16, 1, 1), None)}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--variants", help='JSON {name: [form, dkv tiles, dq tiles or null]}, tiles '
                   '[BQ, BK, warps, stages]; default: VARIANTS')
    p.add_argument("--out", help="also write probe_atomic_dq.json (rows, versions, commit) here")
    args = p.parse_args()
    B, H, T, D = (1, 2, 128, 32) if args.quick else (4, 16, 8192, 128)
    keys = jax.random.split(jax.random.key(0), 4)
    q, k, v, do = (jax.random.normal(kk, (B, H, T, D), jnp.bfloat16) for kk in keys)
    # The package's dense reference (float32) gives the output, so delta, and by autodiff the
    # gradients the kernels are checked against.
    dense = jax.jit(lambda q, k, v: attention_reference(q, k, v, causal=True))
    lse2 = jax.jit(base2_lse)(q, k)
    delta = jnp.sum(dense(q, k, v) * do.astype(jnp.float32), axis=-1)
    # float32 inputs, so the gradients are not rounded to bfloat16; on the GPU one batch row
    # (the float32 gradient of T = 8192 holds several [H, T, T] arrays)
    n_checked = B if args.quick else 1
    one = [x[:n_checked].astype(jnp.float32) for x in (q, k, v, do)]
    expected = jax.vjp(dense, *one[:3])[1](one[3])
    variants = json.loads(args.variants) if args.variants else VARIANTS
    if args.quick:
        variants = QUICK_VARIANTS
    failures, rows = [], []
    for name, (form, dkv_tiles, dq_tiles) in variants.items():
        fn = jax.jit(lambda q, k, v, do, lse2, delta, form=form, a=dkv_tiles, b=dq_tiles:
                     backward(q, k, v, do, lse2, delta, form, a, b))
        try:
            grads = fn(q, k, v, do, lse2, delta)
            errs = [relative_error(g[:n_checked], e)
                    for g, e in zip(grads, expected)]
        except Exception as e:  # noqa: BLE001  (a probe: report and go on)
            failures.append(f"{name}: {type(e).__name__}: {str(e)[:300]}")
            print(f"{name:24} FAILED {failures[-1]}", flush=True)
            continue
        bad = max(errs) > tolerance(jnp.bfloat16)
        if bad:
            failures.append(f"{name}: relative errors {errs}")
        row = dict(name=name, form=form, dkv_tiles=dkv_tiles, dq_tiles=dq_tiles,
                   rel_err_dq_dk_dv=errs, ok=not bad)
        rows.append(row)
        line = f"{name:24} rel err dq/dk/dv " + " ".join(f"{e:.1e}" for e in errs)
        line += " FAILED" if bad else ""
        if ejk_lite.ON_GPU:
            st = time_stats_ms(lambda: fn(q, k, v, do, lse2, delta), 10)
            row.update(st)
            # 5 products of 2 D flops a visible pair, T^2 / 2 pairs a head (causal)
            flops = 5 * B * H * T * T * D
            line += (f"  {st['median_ms']:.3f} ms ({st['min_ms']:.3f}-{st['max_ms']:.3f})"
                     f"  {flops / st['median_ms'] / 1e9:.0f} TFLOP/s (5-product count)")
        print(line, flush=True)
    if ejk_lite.ON_GPU:  # the package's own backward at its defaults, for scale
        qs, ks, vs = q, k, v
        f = jax.jit(lambda q, k, v: ejk_lite.blocksparse_attention(q, k, v, causal=True))
        g = jax.jit(lambda q, k, v, do: jax.vjp(
            lambda q, k, v: ejk_lite.blocksparse_attention(q, k, v, causal=True), q, k, v)[1](do))
        fwd = time_stats_ms(lambda: f(qs, ks, vs), 10)
        both = time_stats_ms(lambda: g(qs, ks, vs, do), 10)
        rows.append(dict(name="package forward (blocksparse_attention, causal=True)", **fwd))
        rows.append(dict(name="package forward + backward (jax.vjp)", **both))
        print(f"package: forward {fwd['median_ms']:.3f} ms, forward + backward "
              f"{both['median_ms']:.3f} ms (vjp recomputes the forward): backward ~"
              f"{both['median_ms'] - fwd['median_ms']:.3f} ms", flush=True)
    if args.out:
        # "variants", not "rows": the Performance chapter reads a file's "rows" as bench rows
        write_result(args.out, "probe_atomic_dq", dict(shape=[B, H, T, D], dtype="bfloat16",
                                                       variants=rows, failures=failures))
    if failures:
        sys.exit("failed: " + "; ".join(failures))


if __name__ == "__main__":
    main()
