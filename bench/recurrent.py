"""Benchmark ejk_lite.recurrent: forward and forward + backward, bf16, plain and with a K gate.

Peers: the pure-JAX ``lax.scan`` reference (jitted) and flash-linear-attention's fused recurrent
kernels (``fused_recurrent_simple_gla`` without gates, ``fused_recurrent_gla`` with ``gk``), run in
PyTorch on the same inputs when the package is installed (``peers.fla_race``). Checks: our output
and gradients against fla's on the full inputs, and against the fp32 reference on a prefix of the
sequence, within bf16's tolerance (``ejk_lite.testing``); the script exits 1 past it.

The scan walks the sequence one XLA loop iteration at a time, so its time is linear in T; where
running it at full length would take too long (or, for the backward, store T states of K x V),
it is timed on a shorter sequence and scaled to T. The JSON says which (``scan_timed_seq_len``).

    python bench/recurrent.py --out bench/results           # GPU
    python bench/recurrent.py --quick --out /tmp/bench_recurrent   # tiny shapes, CPU interpreter
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax.numpy as jnp  # noqa: E402

import ejk_lite  # noqa: E402

if ejk_lite.ON_GPU:
    # Import jax-triton now, through ejk_lite, which keeps TRITON_CACHE_DIR usable for fla's
    # kernels.
    ejk_lite.launch._import_jax_triton()
import peers  # noqa: E402
from common import (  # noqa: E402
    Run,
    ceilings,
    compare,
    forward_and_backward,
    parse_args,
    past_tolerance,
    print_table,
    row,
    time_stats_ms,
    tolerance,
    wall_ms,
    worst,
    write_result,
)
from ejk_lite.linear_attention import recurrent as _recurrent  # noqa: E402
from ejk_lite.linear_attention import reference  # noqa: E402

# The kernels, also in --quick runs on a CPU (where impl="auto" would pick the reference).
recurrent = functools.partial(_recurrent, impl="triton")

SHAPES = [dict(batch=4, seq_len=4096, heads=16, dim=128),
          dict(batch=1, seq_len=32768, heads=8, dim=64)]
QUICK_SHAPES = [dict(batch=1, seq_len=24, heads=2, dim=16)]
GATES = (None, "gk")  # plain, and a per-key gate
SCAN_MAX_SEQ_LEN = {"fwd": 8192, "fwd+bwd": 1024}  # longest sequence the scan is timed on
# (at 2048 the per-key-gated scan's backward asked for a 24.7 GiB buffer and ran out on the H100)
QUICK_SCAN_MAX_SEQ_LEN = {"fwd": 16, "fwd+bwd": 12}
CHECK_SEQ_LEN = 1024  # prefix checked against the fp32 reference (quick: 8)
SAMPLES = 10
TOL = {"fwd": tolerance(jnp.bfloat16), "fwd+bwd": tolerance(jnp.bfloat16, gradient=True)}


def functions(op):
    """``op``'s output (final state unused) jitted, and its output and the gradients of every
    input for the cotangent ``d_o`` (:func:`common.forward_and_backward`)."""
    return forward_and_backward(lambda inputs: op(**inputs)[0])


def main():
    args = parse_args(__doc__.splitlines()[0])
    run = Run()
    shapes = QUICK_SHAPES if args.quick else SHAPES
    check_len = 8 if args.quick else CHECK_SEQ_LEN
    scan_max = QUICK_SCAN_MAX_SEQ_LEN if args.quick else SCAN_MAX_SEQ_LEN
    fla, fla_missing = peers.load_fla()
    copy_gbs, dispatch_ms = ceilings()
    rows, summary = [], {}
    ours_fwd, ours_fwd_bwd = functions(recurrent)
    scan_fwd, scan_fwd_bwd = functions(reference)
    for shape in shapes:
        for gate in GATES:
            b, t, h, d = shape["batch"], shape["seq_len"], shape["heads"], shape["dim"]
            name = f"B{b} T{t} H{h} K=V={d}" + (f" {gate}" if gate else "")
            inputs, d_o = peers.gla_inputs(len(rows), b, t, h, d, gate)
            # Fewest bytes: every input read once and every output written once, in bf16. Work: per
            # token and state element, the forward decays, adds k v^T and multiplies by q (4 flops);
            # the backward recomputes the state and carries its gradient (about 8 more).
            tensor_bytes = b * t * h * d * 2
            n_in = len(inputs)
            bytes_moved = {"fwd": (n_in + 1) * tensor_bytes,
                           "fwd+bwd": (2 * n_in + 2) * tensor_bytes}
            flops = {"fwd": 4 * b * t * h * d * d, "fwd+bwd": 12 * b * t * h * d * d}

            # Accuracy against the fp32 reference on a prefix (both on the same bf16 inputs).
            short, short_d_o = peers.prefix(inputs, check_len), d_o[:, :check_len]
            err_ref = compare(*ours_fwd_bwd(short, short_d_o), *scan_fwd_bwd(short, short_d_o))
            stats = {"fwd": time_stats_ms(lambda: ours_fwd(inputs), SAMPLES),
                     "fwd+bwd": time_stats_ms(lambda: ours_fwd_bwd(inputs, d_o), SAMPLES)}

            # The scan, at full length or on a prefix, scaled to the full length.
            scan = {}
            for direction in ("fwd", "fwd+bwd"):
                length = min(t, scan_max[direction])
                sub, sub_d_o = peers.prefix(inputs, length), d_o[:, :length]
                ms = wall_ms((lambda: scan_fwd(sub)) if direction == "fwd"
                             else (lambda: scan_fwd_bwd(sub, sub_d_o)))
                scan[direction] = (ms * t / length, length)

            fla_stats = err_fla = None
            if fla is not None:
                fla_o, fla_grads, fla_stats = peers.fla_race(fla, "recurrent", gate, inputs, d_o,
                                                             d ** -0.5, SAMPLES)
                err_fla = compare(*ours_fwd_bwd(inputs, d_o), fla_o, fla_grads)
                del fla_o, fla_grads
            for against, err in (("reference", err_ref), ("fla", err_fla)):
                if err is not None:
                    run.failures += past_tolerance(err, jnp.bfloat16, f"{name} vs {against}")

            for direction in ("fwd", "fwd+bwd"):
                common = dict(shape=[b, t, h, d], dtype="bfloat16",
                              bytes_moved=bytes_moved[direction], flops=flops[direction],
                              copy_gbs=copy_gbs)
                median = stats[direction]["median_ms"]
                extra = {"speedup_vs_scan": scan[direction][0] / median}
                if fla_stats is not None:
                    extra["speedup_vs_fla"] = fla_stats[direction]["median_ms"] / median
                    extra["rel_err_vs_fla"] = err_fla["out"] if direction == "fwd" else {
                        n: err_fla[f"d{n}"] for n in inputs}
                rows.append(row(name, "triton", direction, stats=stats[direction],
                                rel_err=worst(err_ref, direction), **common, **extra))
                rows.append(row(name, "scan", direction, median=scan[direction][0], **common,
                                timed_seq_len=scan[direction][1], scaled_to_seq_len=t))
                if fla_stats is not None:
                    rows.append(row(name, "fla", direction, stats=fla_stats[direction], **common))
                summary[f"{name} {direction}"] = {k: round(v, 2) for k, v in extra.items()
                                                  if k.startswith("speedup")}
            print(name, "done", flush=True)

    payload = dict(
        quick=args.quick, copy_bandwidth_gbs=copy_gbs, dispatch_overhead_ms=dispatch_ms,
        peer_fla="fla-core fused_recurrent_simple_gla (plain) / fused_recurrent_gla (gk)" if fla
        else f"not run: {fla_missing}",
        target="at least as fast as fla forward and fwd+bwd; >= 20x the lax.scan reference",
        speedups=summary, tolerance=TOL, failures=run.failures, passed=not run.failures,
        rows=rows,
        notes=("bf16 inputs, fp32 state; gradients of sum(o * d_o) w.r.t. every input (final state "
               f"unused). triton and fla rows: min / median / max over {SAMPLES} samples, device "
               "time from the profiler, L2 flushed before each (common.device_samples_ms). scan "
               "rows: wall clock, median of 3 after a warm-up, on timed_seq_len tokens, scaled "
               "linearly to seq_len (the scan is one loop iteration per token). triton rel_err: "
               f"first {check_len} tokens against the fp32 lax.scan reference on the same inputs "
               "(fwd: the output; fwd+bwd: the worst gradient); rel_err_vs_fla: full inputs, ours "
               "against fla. The recurrence is sequential in T, so per-token latency, not "
               "bandwidth, sets its speed: pct_of_copy is low by nature."),
    )
    path = write_result(args.out, "recurrent", payload)
    print(f"wrote {path}")
    print_table(rows, ["name", "impl", "direction", "median_ms", "gbs", "tflops", "rel_err",
                       "speedup_vs_fla", "speedup_vs_scan"])
    run.finish()


if __name__ == "__main__":
    main()
