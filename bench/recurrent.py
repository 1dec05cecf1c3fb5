"""Benchmark ejk_lite.recurrent: forward and forward + backward, bf16, plain and with a K gate.

Peers: the pure-JAX ``lax.scan`` reference (jitted) and flash-linear-attention's fused recurrent
kernels (``fused_recurrent_simple_gla`` without gates, ``fused_recurrent_gla`` with ``gk``), run in
PyTorch on the same inputs when the package is installed. Checks: our output and gradients against
fla's on the full inputs, and against the fp32 reference on a prefix of the sequence.

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

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import ejk_lite  # noqa: E402

if ejk_lite.ON_GPU:
    # Import jax-triton now, through ejk_lite, which keeps TRITON_CACHE_DIR usable for fla's kernels.
    ejk_lite.launch._import_jax_triton()
from common import (  # noqa: E402
    ceilings,
    device_samples_ms,
    parse_args,
    print_table,
    relative_error,
    row,
    spread,
    time_stats_ms,
    wall_ms,
    write_result,
)
from ejk_lite.linear_attention import reference  # noqa: E402
from ejk_lite.linear_attention import recurrent as _recurrent  # noqa: E402

# The kernels, also in --quick runs on a CPU (where impl="auto" would pick the reference).
recurrent = functools.partial(_recurrent, impl="triton")

SHAPES = [dict(batch=4, seq_len=4096, heads=16, dim=128), dict(batch=1, seq_len=32768, heads=8, dim=64)]
QUICK_SHAPES = [dict(batch=1, seq_len=24, heads=2, dim=16)]
SCAN_MAX_SEQ_LEN = {"fwd": 8192, "fwd+bwd": 1024}  # longest sequence the scan is timed on
# (at 2048 the per-key-gated scan's backward asked for a 24.7 GiB buffer and ran out on the H100)
CHECK_SEQ_LEN = 1024  # prefix checked against the fp32 reference
SAMPLES = 10
TOL = {"fwd": 2e-2, "fwd+bwd": 4e-2}  # relative L2 of bf16 results, as bench/chunked.py


def make_inputs(key, batch, seq_len, heads, dim, gated):
    kq, kk, kv, kg, kd = jax.random.split(key, 5)
    shape = (batch, seq_len, heads, dim)
    inputs = dict(query=jax.random.normal(kq, shape, jnp.bfloat16),
                  key=jax.random.normal(kk, shape, jnp.bfloat16),
                  value=jax.random.normal(kv, shape, jnp.bfloat16))
    if gated:  # log-decays in (-inf, 0), most of them mild, as a trained GLA layer has
        inputs["gk"] = jax.nn.log_sigmoid(jax.random.normal(kg, shape, jnp.float32) + 4.0).astype(jnp.bfloat16)
    d_o = jax.random.normal(kd, shape, jnp.bfloat16)
    return inputs, d_o


def prefix(inputs, length):
    return {name: x[:, :length] for name, x in inputs.items()}


def forward_fn(impl):
    return jax.jit(lambda inputs: impl(**inputs)[0])


def forward_backward_fn(impl):
    """Output and the gradients of every input for the loss sum(o * d_o) (final state unused)."""
    def loss(inputs, d_o):
        o = impl(**inputs)[0]
        return jnp.sum(o.astype(jnp.float32) * d_o.astype(jnp.float32)), o
    return jax.jit(jax.grad(loss, has_aux=True))








# ----------------------------------------------------------------------------------------------
# flash-linear-attention (PyTorch), if installed.
# ----------------------------------------------------------------------------------------------


def load_fla():
    try:
        import torch
        from fla.ops.gla import fused_recurrent_gla
        from fla.ops.simple_gla import fused_recurrent_simple_gla
    except Exception as error:  # not installed, or no CUDA torch
        return None, f"{type(error).__name__}: {error}"
    if not torch.cuda.is_available():
        return None, "torch sees no CUDA device"
    return (torch, fused_recurrent_simple_gla, fused_recurrent_gla), None


def to_torch(torch, x):
    return torch.from_dlpack(jax.block_until_ready(x)).clone()


def run_fla(fla, inputs, d_o):
    """fla's outputs and gradients on our inputs, and its forward / forward + backward times
    (min / median / max over ``SAMPLES``, device time)."""
    torch, simple_gla, gla = fla
    tensors = {name: to_torch(torch, x) for name, x in inputs.items()}
    d_o_t = to_torch(torch, d_o)

    def call(t):
        if "gk" in t:
            return gla(t["query"], t["key"], t["value"], gk=t["gk"], output_final_state=False)[0]
        return simple_gla(t["query"], t["key"], t["value"], output_final_state=False)[0]

    with torch.no_grad():
        o = call(tensors)
        fwd_ms = spread(device_samples_ms(lambda: call(tensors), SAMPLES))
    leaves = {name: t.detach().requires_grad_(True) for name, t in tensors.items()}

    def forward_backward():
        call(leaves).backward(d_o_t)

    forward_backward()
    grads = {name: t.grad.clone() for name, t in leaves.items()}
    fwd_bwd_ms = spread(device_samples_ms(forward_backward, SAMPLES,
                                         grad_to_none=list(leaves.values())))

    def back(t):
        return jnp.asarray(t.detach().float().cpu().numpy())

    return back(o), {name: back(g) for name, g in grads.items()}, fwd_ms, fwd_bwd_ms


# ----------------------------------------------------------------------------------------------


def main():
    args = parse_args(__doc__.splitlines()[0])
    shapes = QUICK_SHAPES if args.quick else SHAPES
    check_len = 8 if args.quick else CHECK_SEQ_LEN
    scan_max = {"fwd": 16, "fwd+bwd": 12} if args.quick else SCAN_MAX_SEQ_LEN
    fla, fla_missing = load_fla() if ejk_lite.ON_GPU else (None, "no GPU")
    copy_gbs, dispatch_ms = ceilings()
    rows, summary, failures = [], {}, []
    for shape in shapes:
        for gated in (False, True):
            b, t, h, d = shape["batch"], shape["seq_len"], shape["heads"], shape["dim"]
            name = f"B{b} T{t} H{h} K=V={d}" + (" gk" if gated else "")
            inputs, d_o = make_inputs(jax.random.key(len(rows)), b, t, h, d, gated)
            dims = [b, t, h, d]
            # Fewest bytes: every input read once and every output written once, in bf16. Work: per
            # token and state element, the forward decays, adds k v^T and multiplies by q (4 flops);
            # the backward recomputes the state and carries its gradient (about 8 more).
            tensor_bytes = b * t * h * d * 2
            n_in = 3 + gated
            bytes_moved = {"fwd": (n_in + 1) * tensor_bytes, "fwd+bwd": (2 * n_in + 2) * tensor_bytes}
            flops = {"fwd": 4 * b * t * h * d * d, "fwd+bwd": 12 * b * t * h * d * d}

            # Accuracy against the fp32 reference on a prefix (both on the same bf16 inputs).
            short, short_d_o = prefix(inputs, check_len), d_o[:, :check_len]
            ours_grads, ours_o = forward_backward_fn(recurrent)(short, short_d_o)
            ref_grads, ref_o = forward_backward_fn(reference)(short, short_d_o)
            err = {"fwd": relative_error(ours_o, ref_o),
                   "fwd+bwd": max(relative_error(ours_grads[n], ref_grads[n]) for n in short)}

            fwd, fwd_bwd = forward_fn(recurrent), forward_backward_fn(recurrent)
            ours_stats = {"fwd": time_stats_ms(lambda: fwd(inputs), SAMPLES),
                          "fwd+bwd": time_stats_ms(lambda: fwd_bwd(inputs, d_o), SAMPLES)}
            ours = {k: st["median_ms"] for k, st in ours_stats.items()}

            # The scan, at full length or on a prefix, scaled to the full length.
            scan = {}
            for direction, make in (("fwd", forward_fn), ("fwd+bwd", forward_backward_fn)):
                length = min(t, scan_max[direction])
                fn = make(reference)
                sub, sub_d_o = prefix(inputs, length), d_o[:, :length]
                ms = wall_ms((lambda: fn(sub)) if direction == "fwd" else (lambda: fn(sub, sub_d_o)))
                scan[direction] = (ms * t / length, length)

            fla_result = None
            if fla is not None:
                fla_o, fla_grads, fla_fwd, fla_fwd_bwd = run_fla(fla, inputs, d_o)
                our_grads, our_o = fwd_bwd(inputs, d_o)
                fla_result = dict(stats={"fwd": fla_fwd, "fwd+bwd": fla_fwd_bwd},
                                  ms={"fwd": fla_fwd["median_ms"], "fwd+bwd": fla_fwd_bwd["median_ms"]},
                                  err={"fwd": relative_error(our_o, fla_o),
                                       "fwd+bwd": {n: relative_error(our_grads[n], fla_grads[n]) for n in inputs}})

            for direction in ("fwd", "fwd+bwd"):
                common = dict(shape=dims, dtype="bfloat16", bytes_moved=bytes_moved[direction],
                              flops=flops[direction], copy_gbs=copy_gbs)
                extra = {"speedup_vs_scan": scan[direction][0] / ours[direction]}
                checked = {"reference": err[direction]}
                if fla_result is not None:
                    extra["speedup_vs_fla"] = fla_result["ms"][direction] / ours[direction]
                    extra["rel_err_vs_fla"] = fla_result["err"][direction]
                    vs_fla = fla_result["err"][direction]
                    checked["fla"] = vs_fla if direction == "fwd" else max(vs_fla.values())
                failures += [f"{name} {direction} vs {against}: rel_err {e:.3g} > {TOL[direction]}"
                             for against, e in checked.items() if not e <= TOL[direction]]
                st = ours_stats[direction]
                rows.append(row(name, "triton", direction, median=ours[direction], rel_err=err[direction],
                                min_ms=st["min_ms"], max_ms=st["max_ms"], samples=st["samples"],
                                calls_per_sample=st["calls_per_sample"], **common, **extra))
                rows.append(row(name, "scan", direction, median=scan[direction][0], **common,
                                timed_seq_len=scan[direction][1], scaled_to_seq_len=t))
                if fla_result is not None:
                    st = fla_result["stats"][direction]
                    rows.append(row(name, "fla", direction, median=st["median_ms"], min_ms=st["min_ms"],
                                    max_ms=st["max_ms"], samples=st["samples"],
                                    calls_per_sample=st["calls_per_sample"], **common))
                summary[f"{name} {direction}"] = {k: round(v, 2) for k, v in extra.items() if k.startswith("speedup")}
            print(name, "done", flush=True)

    payload = dict(
        quick=args.quick, copy_bandwidth_gbs=copy_gbs, dispatch_overhead_ms=dispatch_ms,
        peer_fla="fla-core fused_recurrent_simple_gla (plain) / fused_recurrent_gla (gk)" if fla
        else f"not run: {fla_missing}",
        target="at least as fast as fla forward and fwd+bwd; >= 20x the lax.scan reference",
        speedups=summary, tolerance=TOL, failures=failures, passed=not failures, rows=rows,
        notes=("bf16 inputs, fp32 state; gradients of sum(o * d_o) w.r.t. every input (final state "
               f"unused). triton and fla rows: min / median / max over {SAMPLES} samples, device time "
               "from the profiler, L2 flushed before each (common.device_samples_ms). scan rows: wall clock, "
               "median of 3 after a warm-up, on timed_seq_len tokens, scaled linearly to seq_len (the "
               "scan is one loop iteration per token). triton rel_err: first "
               f"{check_len} tokens against the fp32 lax.scan reference on the same inputs (fwd: the output; "
               "fwd+bwd: the worst gradient); rel_err_vs_fla: full inputs, ours against fla. The "
               "recurrence is sequential in T, so per-token latency, not bandwidth, sets its speed: "
               "pct_of_copy is low by nature."),
    )
    path = write_result(args.out, "recurrent", payload)
    print(f"wrote {path}")
    print_table(rows, ["name", "impl", "direction", "median_ms", "gbs", "tflops", "rel_err", "speedup_vs_fla",
                       "speedup_vs_scan"])
    if failures:
        print(f"FAILED ({len(failures)}):", *failures, sep="\n  ", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
