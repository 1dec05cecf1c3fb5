"""Sequence parallelism on N GPUs of one host (2 unless ``--devices``) against 1 GPU: time,
memory, correctness and communication (issue 22), bf16.

One process, a 1-D mesh ``"sp"`` of the first N devices; every case runs the same op on the
whole sequence on device 0 (1 GPU) and under ``jax.shard_map`` split along the sequence over the
mesh (N GPUs), forward and forward + backward (``jax.vjp``, a random cotangent):

* ``blocksparse_attention``: causal with a window of 1024 (``sliding_window=(1024, 0)``), 8
  packed documents (segment ids) + causal, and plain causal (contiguous slices, no zigzag: the
  last of N shards does 2N - 1 times the first's work), at B1 H16 T65536 D128;
* ``chunked_recurrent`` with a scalar gate ``g``, then a per-key gate ``gk``, at B1 T131072 H16
  K=V=128 (output only; the final state unused).

Per case: wall time of one jitted call to ``block_until_ready`` (``SAMPLES`` samples after a
warm-up; min / median / max): ``bench/common.py``'s device timer sums every GPU plane of a
trace and flushes one device's L2, so it does not time a step on several devices. Then one
profiler trace of one step, per device: its span (first kernel start to last kernel end), busy
time, the time in collective kernels (NCCL), and how much of that overlaps compute kernels (the
intersection of the two sets of intervals, exact), plus the issue's formula ``(compute +
collective - span) / collective``. Memory: XLA's ``memory_analysis()`` of each compiled program
(per device: arguments + outputs + temporaries), and ``peak_bytes_in_use`` of each device after
the case (a running maximum since the process started: JAX has no reset). Correctness: the
sharded output and gradients against the 1-GPU ones on the full arrays (relative L2 error on
device 0, bf16 tolerance of ``ejk_lite.testing``, gradient tolerance for gradients). Keys
ending ``_1gpu`` are the one-device run, ``_sharded`` the run over the mesh (``mesh.size``
devices).

    python3 bench/multi_gpu.py --out bench/results --budget-s 380    # 2 GPUs
    python3 bench/multi_gpu.py --devices 4 --out bench/results        # 4 GPUs
    python3 bench/multi_gpu.py --quick --out /tmp/mgpu                 # 2 CPU devices, interpreter

NVLink multicast stays off: the script sets ``NCCL_NVLS_ENABLE=0`` before JAX starts (on the
lent machines multicast can put the host's shared GPUs out of service; their notes say so).

The JSON (``multi_gpu.json``) is written after every case; past ``--budget-s`` the remaining
cases go to ``not_run``. Exit status 1 (after the file is written) on an error past tolerance.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
from pathlib import Path


def parse(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="bench/results")
    parser.add_argument("--quick", action="store_true",
                        help="tiny shapes on --devices CPU devices (Triton's interpreter)")
    parser.add_argument("--devices", type=int, default=2,
                        help="the mesh's size: the first N devices (N >= 2)")
    parser.add_argument("--budget-s", type=float, default=380.0)
    args = parser.parse_args(argv)
    if args.devices < 2:
        parser.error(f"--devices must be at least 2, got {args.devices}")
    return args


if __name__ == "__main__":  # before JAX starts
    ARGS = parse()
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    if ARGS.quick:  # as many CPU devices as the mesh needs
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_"
                                   f"device_count={ARGS.devices}").strip()

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import ejk_lite  # noqa: E402
from common import (Run, past_tolerance, relative_error, spread, tolerance,  # noqa: E402
                    write_result)
from ejk_lite import BlockSizes, blocksparse_attention, chunked_recurrent  # noqa: E402

OP = "multi_gpu"
SAMPLES = 10
COLLECTIVE_WORDS = ("nccl", "allgather", "all_gather", "all-gather", "reducescatter",
                    "reduce_scatter", "reduce-scatter", "allreduce", "all_reduce", "all-reduce",
                    "collective", "sendrecv", "permute")


# ----------------------------------------------------------------------------------------------
# The cases.
# ----------------------------------------------------------------------------------------------


def attention_case(mask, b, h, t, d, window, quick, key):
    """(name, arrays, in_specs, fn taking the arrays) for one attention mask; fn takes the
    sequence-parallel axis name or None."""
    kq, kk, kv = jax.random.split(key, 3)
    q, k, v = (jax.random.normal(x, (b, h, t, d), jnp.bfloat16) for x in (kq, kk, kv))
    options = dict(causal=True, impl="triton")
    if quick:
        options.update(fwd_blocks=BlockSizes(16, 16), bwd_blocks=BlockSizes(16, 16))
    if mask == "window":
        options["sliding_window"] = (window, 0)
    extra, extra_specs = [], []
    if mask == "documents":  # 8 documents of equal length: the boundaries cross no shard edge
        extra = [jnp.repeat(jnp.arange(8, dtype=jnp.int32), t // 8)[None]]  # [1, T]
        extra_specs = [P(None, "sp")]

    def fn(axis, q, k, v, *ids):
        kw = dict(options)
        if ids:
            kw.update(q_segment_ids=ids[0], kv_segment_ids=ids[0])
        if axis:
            kw["sequence_parallelism_mesh_axis_name"] = axis
        return blocksparse_attention(q, k, v, **kw)

    seq = P(None, None, "sp")
    label = {"window": f"causal window {window}", "documents": "documents (8) causal",
             "causal": "causal"}[mask]
    name = f"attention {label} B{b} H{h} T{t} D{d}"
    return name, [q, k, v], extra, [seq] * 3, extra_specs, seq, fn, ("q", "k", "v")


def chunked_case(gate, b, t, h, d, quick, key):
    kq, kk, kv, kg = jax.random.split(key, 4)
    q, k, v = (jax.random.normal(x, (b, t, h, d), jnp.bfloat16) for x in (kq, kk, kv))
    shape = (b, t, h) if gate == "g" else (b, t, h, d)
    # log(sigmoid(x)) with x ~ N(3, 1): decays near 1, a state that lives across chunks and
    # across the shard boundary (so the exchange matters).
    log_gate = jax.nn.log_sigmoid(3.0 + jax.random.normal(kg, shape, jnp.float32))
    log_gate = log_gate.astype(jnp.bfloat16)
    options = dict(impl="triton", softmax_scale=d ** -0.5)
    if quick:
        options["chunk_size"] = 16

    def fn(axis, q, k, v, g):
        kw = dict(options, **{gate: g})
        if axis:
            kw["sequence_parallelism_mesh_axis_name"] = axis
        return chunked_recurrent(q, k, v, **kw)[0]

    seq = P(None, "sp")
    name = f"chunked_recurrent {gate} B{b} T{t} H{h} K=V={d}"
    return name, [q, k, v, log_gate], [], [seq] * 4, [], seq, fn, ("q", "k", "v", gate)


# ----------------------------------------------------------------------------------------------
# Measurement.
# ----------------------------------------------------------------------------------------------


def wall_stats(fn, args, samples, warmup=1):
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(samples):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append((time.perf_counter() - start) * 1e3)
    return spread(times)


def memory(compiled):
    """Per-device bytes XLA plans for the compiled program (arguments, outputs, temporaries)."""
    try:
        analysis = compiled.memory_analysis()
        found = {k: int(getattr(analysis, k)) for k in (
            "argument_size_in_bytes", "output_size_in_bytes", "temp_size_in_bytes",
            "alias_size_in_bytes") if hasattr(analysis, k)}
        found["total_bytes"] = (found.get("argument_size_in_bytes", 0)
                                + found.get("output_size_in_bytes", 0)
                                + found.get("temp_size_in_bytes", 0)
                                - found.get("alias_size_in_bytes", 0))
        return found
    except Exception as error:  # noqa: BLE001 (recorded, not fatal)
        return {"error": f"{type(error).__name__}: {str(error)[:200]}"}


def peak_bytes(devices):
    found = {}
    for device in devices:
        stats = device.memory_stats() or {}
        found[str(device.id)] = stats.get("peak_bytes_in_use")
    return found


def _union(intervals):
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def _intersection(a, b):
    total, i, j = 0, 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _top_kernels(events, count=8):
    """The ``count`` kernels that took the most time in a plane, summed by name (ms)."""
    totals = collections.Counter()
    for start, end, name in events:
        totals[name[:80]] += (end - start) / 1e6
    return dict(totals.most_common(count))


def profile_step(fn, args):
    """One step in a profiler trace: per GPU plane, the span, busy time, collective kernels' time
    and their overlap with compute kernels (ms), and the collective kernels' names."""
    import tempfile

    from common import _profile_options

    jax.block_until_ready(fn(*args))
    with tempfile.TemporaryDirectory() as folder:
        jax.profiler.start_trace(folder, profiler_options=_profile_options())
        jax.block_until_ready(fn(*args))
        jax.profiler.stop_trace()
        (path,) = Path(folder).rglob("*.xplane.pb")
        data = jax.profiler.ProfileData.from_file(str(path))
    result = {}
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        events = [(e.start_ns, e.start_ns + e.duration_ns, e.name) for line in plane.lines
                  if line.name.startswith("Stream") for e in line.events]
        if not events:
            continue
        comm = [(s, e) for s, e, n in events if any(w in n.lower() for w in COLLECTIVE_WORDS)]
        compute = [(s, e) for s, e, n in events
                   if not any(w in n.lower() for w in COLLECTIVE_WORDS)]
        span = max(e for _, e, _ in events) - min(s for s, _, _ in events)
        comm_sum = sum(e - s for s, e in comm)
        compute_sum = sum(e - s for s, e in compute)
        comm_union, compute_union = _union(comm), _union(compute)
        comm_time = sum(e - s for s, e in comm_union)
        overlap = _intersection(comm_union, compute_union)
        result[plane.name] = {
            "span_ms": span / 1e6, "busy_ms": sum(e - s for s, e in _union(
                [(s, e) for s, e, _ in events])) / 1e6,
            "compute_kernels_ms": compute_sum / 1e6, "collective_kernels_ms": comm_sum / 1e6,
            "collective_share_of_span": comm_time / span if span else None,
            "collective_overlapped_ms": overlap / 1e6,
            "overlap_fraction": overlap / comm_time if comm_time else None,
            "overlap_formula": ((compute_sum + comm_sum - span) / comm_sum) if comm_sum else None,
            "kernels": len(events),
            "collective_names": sorted({n for _, _, n in events
                                        if any(w in n.lower() for w in COLLECTIVE_WORDS)})[:8],
            "top_kernels_ms": _top_kernels(events),
        }
    return result


def main(args):
    run = Run(budget_s=args.budget_s)
    quick, n = args.quick, args.devices
    devices = jax.devices()
    if len(devices) < n:
        raise SystemExit(f"--devices {n}: found {len(devices)} devices: {devices}")
    mesh = jax.make_mesh((n,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=devices[:n])
    one = devices[0]
    if quick:  # 16 tokens a shard at least: the interpreter's tiles are 16 wide
        attn_shape = dict(b=1, h=2, t=max(64, 16 * n), d=16, window=16)
        chunk_shape = dict(b=1, t=max(64, 16 * n), h=2, d=16)
    else:
        attn_shape = dict(b=1, h=16, t=65536, d=128, window=1024)
        chunk_shape = dict(b=1, t=131072, h=16, d=128)
    samples = 1 if quick else SAMPLES
    payload = {
        "devices": [getattr(d, "device_kind", d.platform) for d in devices[:n]],
        "device_count": len(devices),
        "mesh": {"axis": "sp", "size": n},
        "on_gpu": bool(ejk_lite.ON_GPU),
        "shapes": {"attention": attn_shape, "chunked_recurrent": chunk_shape},
        "dtype": "bfloat16",
        "environment": {"NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE")},
        "notes": [
            f"time: wall clock of one compiled call to block_until_ready, {samples} samples after "
            "a checked call and a warm-up call (min/median/max); common's device timer sums all "
            "GPU planes of a trace and flushes one device's L2, so it does not fit a step on "
            "several devices; no L2 flush here",
            "profile: one step traced (jax.profiler), per GPU plane: span = first kernel start "
            "to last kernel end; collective kernels = names containing nccl/all-gather/"
            "reduce-scatter/all-reduce/...; overlap_fraction = time where a collective and a "
            "compute kernel run at once (interval intersection) / collective time; "
            "overlap_formula = (compute + collective - span) / collective (the issue's, which "
            "counts idle gaps against overlap). NCCL kernels' time includes waiting for the "
            "other GPU (a load imbalance shows as collective time); top_kernels_ms = the 8 "
            "kernels with the most time in the plane, summed by name",
            "memory: memory_analysis() of each compiled program (per device: arguments + "
            "outputs + temporaries - aliases); peak_bytes_in_use per device after the case is a "
            "running maximum since the process began (JAX cannot reset it)",
            "correctness: the sharded output and gradients of the inputs (vjp of a random "
            "cotangent) "
            "against the 1-GPU ones, full arrays, relative L2 on device 0 (ejk_lite.testing), "
            "bf16 tolerance (gradient tolerance for gradients)",
            "attention slices are contiguous (no zigzag): under a causal mask the last of n "
            "shards does 2n - 1 times the first's work, which the collectives' wait shows",
            "T=65536 for attention: the 1-GPU causal fwd+bwd at T=131072 is 4x the work of "
            "T=65536, and 3 masks x 2 directions x (1 + n GPUs) with compiles must fit in "
            "the 380 s budget",
        ],
        "cases": [],
        "not_run": run.not_run,
        "failures": run.failures,
    }

    key = jax.random.key(22)
    keys = jax.random.split(key, 8)
    specs = [attention_case("window", **attn_shape, quick=quick, key=keys[0]),
             attention_case("documents", **attn_shape, quick=quick, key=keys[1]),
             chunked_case("g", **chunk_shape, quick=quick, key=keys[2]),
             attention_case("causal", **attn_shape, quick=quick, key=keys[3]),
             chunked_case("gk", **chunk_shape, quick=quick, key=keys[4])]

    for index, (name, arrays, extra, specs_x, specs_e, out_spec, fn, names) in enumerate(specs):
        for direction in ("fwd", "fwd+bwd"):
            what = f"{name} {direction}"
            if run.out_of_time(what):
                continue
            run.log(what)
            try:
                case = measure(run, what, name, direction, arrays, extra, specs_x, specs_e,
                               out_spec, fn, names, mesh, one, samples, keys[5 + index % 3], quick)
            except Exception as error:  # noqa: BLE001 (recorded; the other cases still run)
                message = f"{what}: {type(error).__name__}: {str(error)[:400]}"
                run.failures.append(message)
                run.log(message)
                case = {"name": name, "direction": direction, "error": message}
            payload["cases"].append(case)
            write_result(args.out, OP, payload)
    path = write_result(args.out, OP, payload)
    run.log(f"wrote {path}")
    run.finish()


def measure(run, what, name, direction, arrays, extra, specs_x, specs_e, out_spec, fn, names,
            mesh, one, samples, key, quick):
    def local(axis):
        def f(xs, *ids):
            return fn(axis, *xs, *ids)
        return f

    sharded = jax.shard_map(local("sp"), mesh=mesh, in_specs=(tuple(specs_x), *specs_e),
                            out_specs=out_spec)
    single = local(None)
    xs1 = tuple(jax.device_put(x, one) for x in arrays)
    ids1 = [jax.device_put(x, one) for x in extra]
    xs2 = tuple(jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(arrays, specs_x))
    ids2 = [jax.device_put(x, NamedSharding(mesh, s)) for x, s in zip(extra, specs_e)]
    out_shape = jax.eval_shape(single, xs1, *ids1)
    d_o = jax.random.normal(key, out_shape.shape, out_shape.dtype)
    d_o1, d_o2 = jax.device_put(d_o, one), jax.device_put(d_o, NamedSharding(mesh, out_spec))

    def with_grad(f):
        def g(xs, d_o, *ids):
            out, pullback = jax.vjp(lambda xs_: f(xs_, *ids), xs)
            return out, pullback(d_o)[0]
        return jax.jit(g)

    if direction == "fwd":
        f1, f2 = jax.jit(single), jax.jit(sharded)
        a1, a2 = (xs1, *ids1), (xs2, *ids2)
    else:
        f1, f2 = with_grad(single), with_grad(sharded)
        a1, a2 = (xs1, d_o1, *ids1), (xs2, d_o2, *ids2)

    case = {"name": name, "direction": direction, "shape": [list(x.shape) for x in arrays],
            "dtype": "bfloat16"}
    # Compiled once, here; the compiled programs are what every call below runs.
    start = time.perf_counter()
    f1 = f1.lower(*a1).compile()
    case["compile_s_1gpu"] = time.perf_counter() - start
    start = time.perf_counter()
    f2 = f2.lower(*a2).compile()
    case["compile_s_sharded"] = time.perf_counter() - start
    r1 = jax.block_until_ready(f1(*a1))
    r2 = jax.block_until_ready(f2(*a2))
    run.log(f"  compiled in {case['compile_s_1gpu']:.1f} s (1 device), "
            f"{case['compile_s_sharded']:.1f} s ({mesh.size} devices), ran both")
    # Correctness, on device 0.
    if direction == "fwd":
        errors = {"out": relative_error(jax.device_put(r2, one), r1)}
    else:
        errors = {"out": relative_error(jax.device_put(r2[0], one), r1[0])}
        for n, g2, g1 in zip(names, r2[1], r1[1]):
            errors[f"d{n}"] = relative_error(jax.device_put(g2, one), g1)
    del r1, r2
    case["rel_err_sharded_vs_1gpu"] = errors
    case["tolerance"] = {n: tolerance(jnp.bfloat16, gradient=n != "out") for n in errors}
    failed = past_tolerance(errors, jnp.bfloat16, what)
    run.failures.extend(failed)
    case["passed"] = not failed
    run.log(f"  errors {', '.join(f'{k} {v:.3g}' for k, v in errors.items())}")

    case["memory_analysis_1gpu"] = memory(f1)
    case["memory_analysis_sharded_per_device"] = memory(f2)
    warmup = 0 if quick else 1  # the interpreter: seconds a call, and nothing to warm
    case["time_1gpu"] = wall_stats(f1, a1, samples, warmup)
    case["time_sharded"] = wall_stats(f2, a2, samples, warmup)
    case["median_ms_1gpu"] = case["time_1gpu"]["median_ms"]
    case["median_ms_sharded"] = case["time_sharded"]["median_ms"]
    case["speedup"] = case["median_ms_1gpu"] / case["median_ms_sharded"]
    case["peak_bytes_in_use_running_max"] = peak_bytes(list(mesh.devices.flat))
    run.log(f"  1 device {case['median_ms_1gpu']:.3f} ms, {mesh.size} devices "
            f"{case['median_ms_sharded']:.3f} ms, "
            f"speed-up {case['speedup']:.2f}")
    if ejk_lite.ON_GPU:
        try:
            case["profile_1gpu"] = profile_step(f1, a1)
            case["profile_sharded"] = profile_step(f2, a2)
            for plane, p in case["profile_sharded"].items():
                run.log(f"  {plane}: span {p['span_ms']:.3f} ms, collectives "
                        f"{p['collective_kernels_ms']:.3f} ms, overlap {p['overlap_fraction']}")
                run.log("    " + ", ".join(f"{name[:40]} {ms:.3f}"
                                           for name, ms in p["top_kernels_ms"].items()))
        except Exception as error:  # noqa: BLE001 (recorded; timing and checks stand)
            case["profile_error"] = f"{type(error).__name__}: {str(error)[:300]}"
            run.log(f"  profile failed: {case['profile_error']}")
    else:
        case["profile"] = "not measured: no GPU (CPU devices have no collective kernels)"
    return case


if __name__ == "__main__":
    main(ARGS)
