"""Probe (issue 18): chunked_recurrent with a per-key gate ``gk``, bf16, B4 T4096 H16 K=V=128.

With per-key decays the forward's intra-chunk attention is one program per chunk now
(``_gk_attention_kernel``), which also writes the decayed q and k and Gamma for the states and
the output kernels and, kept, for the backward's; the backward's intra-chunk gradients
(``_intra_grads_kernel``) are one program per chunk and K tile. This times forward and forward +
backward for a few tiles of those two kernels (``ChunkedConfig.attention`` and ``.intra_grads``:
``block_k``, ``num_warps``) and of ``_inter_grads_kernel`` (which spills at its default), and
the scalar gate ``g`` (its attention kernel changed grid only), each checked first against the
float32 ``ejk_lite.linear_attention.reference`` on the first ``CHECK_SEQ_LEN`` tokens (as
bench/chunked.py: output and every input's gradient, bf16 tolerances). Then, for each, where the
device time of forward + backward goes: each kernel's median over the calls of one trace. A
variant not started within ``BUDGET_S`` seconds is skipped (said at the end; not a failure).

Device time as bench/chunked.py (common.time_stats_ms: profiler, L2 flushed before each sample).
fla is not timed here (its autotuning takes minutes); earlier figures, H100, commit 8c02bab:
ours gk 2.470 ms fwd / 6.423 ms fwd+bwd, fla chunk_gla 0.821 / 3.481; ours g 0.4465 / 1.682.

    PYTHONPATH=$PWD python bench/_probe_chunked_gk.py            # on the GPU: about 3 minutes
    PYTHONPATH=$PWD python bench/_probe_chunked_gk.py --quick    # CPU interpreter, tiny shape

Exit status 1 if any check fails.
"""

from __future__ import annotations

import argparse
import collections
import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import ejk_lite  # noqa: E402
import peers  # noqa: E402
from common import (  # noqa: E402
    Run,
    _gpu_events,
    compare,
    forward_and_backward,
    past_tolerance,
    time_stats_ms,
)
from ejk_lite.chunked import ChunkedConfig, KernelConfig, chunked_recurrent  # noqa: E402
from ejk_lite.linear_attention import reference  # noqa: E402

CHECK_SEQ_LEN = 256
SAMPLES = 10
BUDGET_S = 240


def _tiles(block_k: int, num_warps: int) -> dict:
    """The same tiles for _gk_attention_kernel and _intra_grads_kernel."""
    tiles = KernelConfig(block_k=block_k, num_warps=num_warps)
    return dict(attention=tiles, intra_grads=tiles)


# _inter_grads_kernel's default (BK64 BV64, 4 warps) spills offline for sm_90: 584 / 608 bytes
# stored / loaded with gk, 196 / 196 with g; BK32 (4 warps) and 8 warps (BK64) do not.
INTER_BK32 = dict(inter_grads=KernelConfig(block_k=32))
INTER_W8 = dict(inter_grads=KernelConfig(num_warps=8))
# (name, gate, ChunkedConfig arguments): the default first. The forward's diagonal sub-chunk
# blocks have their own kernel now (_gk_diagonal_kernel, ChunkedConfig.diagonal); offline sm_90
# registers: _gk_attention_kernel BK32 w4 251, BK16 w4 168, BK16 w8 139, BK32 w8 179;
# _gk_diagonal_kernel BK64 unrolled by 4 96 (by 1, the default: 62), BK128 by 4 168, BK32 by 8
# 72.
K = KernelConfig
VARIANTS = [("gk default", "gk", {}),
            ("gk att BK16 w4", "gk", dict(attention=K(block_k=16))),
            ("gk att BK16 w8", "gk", dict(attention=K(block_k=16, num_warps=8))),
            ("gk att BK32 w8", "gk", dict(attention=K(block_k=32, num_warps=8))),
            ("gk diag BK128 U4", "gk", dict(diagonal=K(block_k=128, unroll=4))),
            ("gk diag BK32 U8", "gk", dict(diagonal=K(block_k=32, unroll=8))),
            ("gk diag BK64 U1", "gk", dict(diagonal=K(block_k=64, unroll=1))),
            ("g default", "g", {})]


def kernel_breakdown(fn, samples: int) -> list[tuple[str, float]]:
    """Median device time of each kernel of one ``fn()`` call, over ``samples`` calls traced
    together, largest first (no L2 flush between the calls: for proportions)."""
    jax.block_until_ready(fn())
    events = _gpu_events(lambda: [jax.block_until_ready(fn()) for _ in range(samples)])
    by_name = collections.defaultdict(list)
    for _, duration, name in events:
        by_name[name].append(duration / 1e6)
    rows = []
    for name, times in by_name.items():  # in order of start: call i's launches are together
        n = max(len(times) // samples, 1)
        per_call = [sum(times[i * n:(i + 1) * n]) for i in range(samples)] \
            if len(times) == n * samples else [sum(times) / samples]
        rows.append((name, float(np.median(per_call)), len(times) / samples))
    return sorted(rows, key=lambda r: -r[1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny shape, CPU interpreter")
    args = parser.parse_args()
    run = Run(budget_s=None if args.quick else BUDGET_S)
    if args.quick:
        b, t, h, d, chunk, samples, check_len = 1, 40, 2, 32, 16, 2, 40
        variants = VARIANTS[:1] + VARIANTS[-2:-1]
    else:
        b, t, h, d, chunk, samples, check_len = 4, 4096, 16, 128, 64, SAMPLES, CHECK_SEQ_LEN
        variants = VARIANTS
    scale = d ** -0.5
    run.log(f"device {jax.devices()[0].device_kind}; B{b} T{t} H{h} K=V={d} bf16, chunk {chunk}")
    results = []
    for gate in ("gk", "g"):
        inputs, d_o = peers.gla_inputs(int(gate == "gk"), b, t, h, d, gate)  # chunked.py's seeds
        short, short_d_o = peers.prefix(inputs, check_len), d_o[:, :check_len]
        wide = {n: x.astype(jnp.float32) for n, x in short.items()}
        ref_fwd_bwd = forward_and_backward(lambda x: reference(**x, softmax_scale=scale)[0])[1]
        ref_o, ref_grads = ref_fwd_bwd(wide, short_d_o.astype(jnp.float32))
        run.log(f"{gate}: float32 reference on {check_len} tokens done")
        first_o = None
        for name, g, settings in variants:
            if g != gate or run.out_of_time(name):
                continue
            config = ChunkedConfig(**settings)
            op = functools.partial(chunked_recurrent, impl="triton", chunk_size=chunk,
                                   config=config, softmax_scale=scale)
            fwd, fwd_bwd = forward_and_backward(lambda x, op=op: op(**x)[0])
            err = compare(*fwd_bwd(short, short_d_o), ref_o, ref_grads)
            failures = past_tolerance(err, jnp.bfloat16, f"{name} vs reference")
            o_full = fwd(inputs)
            if first_o is None:
                first_o = o_full
            else:  # every variant computes the same function: close to the first, full length
                failures += past_tolerance({"out": float(jnp.linalg.norm(
                    (o_full - first_o).astype(jnp.float32)) / jnp.linalg.norm(
                    first_o.astype(jnp.float32)))}, jnp.bfloat16, f"{name} vs the first variant")
            if not bool(jnp.all(jnp.isfinite(o_full.astype(jnp.float32)))):
                failures.append(f"{name}: non-finite output at full length")
            run.failures += failures
            errs = " ".join(f"{k} {v:.2g}" for k, v in err.items())
            run.log(f"{name}: checked ({'FAILED' if failures else 'ok'}): {errs}")
            stats = {"fwd": time_stats_ms(lambda: fwd(inputs), samples),
                     "fwd+bwd": time_stats_ms(lambda: fwd_bwd(inputs, d_o), samples)}
            results.append((name, stats))
            run.log(f"{name}: fwd {stats['fwd']['median_ms']:.4g} ms, fwd+bwd "
                    f"{stats['fwd+bwd']['median_ms']:.4g} ms")
            if ejk_lite.ON_GPU:
                calls = [("fwd", lambda: fwd(inputs))]
                if name == variants[0][0]:
                    calls.append(("fwd+bwd", lambda: fwd_bwd(inputs, d_o)))
                for direction, call in calls:
                    print(f"  {name} {direction}: kernels (median ms per call, warm L2; "
                          "launches per call)")
                    try:  # a breakdown that fails is reported, not a failed check
                        for kernel, ms, n in kernel_breakdown(call, samples):
                            print(f"    {ms:8.4f}  x{n:g}  {kernel[:90]}")
                    except Exception as error:  # noqa: BLE001
                        print(f"    breakdown failed: {type(error).__name__}: {error}")
            del fwd, fwd_bwd, o_full
        del inputs, d_o, first_o

    print(f"\n{'variant':24s} {'direction':9s} {'min_ms':>8s} {'median_ms':>9s} {'max_ms':>8s}")
    for name, stats in results:
        for direction, st in stats.items():
            print(f"{name:24s} {direction:9s} {st['min_ms']:8.4f} {st['median_ms']:9.4f} "
                  f"{st['max_ms']:8.4f}")
    print("earlier (H100, 8c02bab): ours gk 2.470 / 6.423, fla chunk_gla 0.821 / 3.481; "
          "ours g 0.4465 / 1.682 (fwd / fwd+bwd median ms)")
    for name, why in run.not_run.items():
        print(f"not run: {name}: {why}")
    run.finish()
    print("all checks passed")


if __name__ == "__main__":
    main()
