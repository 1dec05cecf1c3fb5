"""Probe (issue 18): chunked_recurrent's kernels, per variant of ChunkedConfig, at one shape.

For each variant (``NAME=JSON``: ChunkedConfig fields, a KernelConfig as a dict of its fields,
and optionally ``chunk_size``, the op's argument; ``default={}`` is the shipped config at chunk
64) and each gate: forward and forward + backward device time (common.time_stats_ms: profiler,
L2 flushed before each of ``SAMPLES`` samples), then where the time of each goes, each kernel's
median over the calls of one trace (warm L2: for proportions).
Every variant is checked first, against the float32 ``ejk_lite.linear_attention.reference`` on
the first ``CHECK_SEQ_LEN`` tokens (as bench/chunked.py: output and every input's gradient,
bf16 tolerances), and against the first variant at full length. Variants not started within
``--budget`` seconds are skipped (said at the end; not a failure). Probes are not results:
bench/chunked.py records the race.

    PYTHONPATH=$PWD python bench/_probe_chunked_gk.py                    # GPU: the variants below
    PYTHONPATH=$PWD python bench/_probe_chunked_gk.py --shape 2 --gates gk,g default={} \\
        'diag64={"diagonal": {"block_k": 64, "num_warps": 1}}'
    PYTHONPATH=$PWD python bench/_probe_chunked_gk.py --quick            # CPU interpreter, tiny
    PYTHONPATH=$PWD python bench/_probe_chunked_gk.py default={} --fla   # and fla's, per kernel

``--fla`` also runs fla's kernel for each gate (``peers.FLA``: ``chunk_gla`` for ``gk``,
``chunk_simple_gla`` for ``g``), checked against the first variant, timed the same way, with its
per-kernel breakdown: which of our kernels is slower than its counterpart. fla autotunes its
kernels on the first call, for minutes from a cold cache: carry its ``*.autotune.json`` files
in ``TRITON_CACHE_DIR`` from call to call as bench/chunked.py's docstring says.

Exit status 1 if any check fails.
"""

from __future__ import annotations

import argparse
import collections
import functools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import chunked as race  # noqa: E402
import ejk_lite  # noqa: E402
import peers  # noqa: E402
from common import (Run, _gpu_events, compare, device_samples_ms, forward_and_backward,  # noqa: E402
                    past_tolerance, spread, time_stats_ms)
from ejk_lite.chunked import ChunkedConfig, KernelConfig, chunked_recurrent  # noqa: E402
from ejk_lite.linear_attention import reference  # noqa: E402

CHECK_SEQ_LEN = 256
SAMPLES = 10
# The shipped config and the alternatives to it measured last (H100, bf16, B4 T4096 H16
# K=V=128, per-key gate; per-kernel medians, .scratch probes of 41f5d0e's tree and of its
# successor with the operands in the input dtype): _gk_attention_kernel BK64 0.43 ms, BK32
# 0.46; _gk_diagonal_kernel BK128 one warp 0.28, BK64 one warp 0.37; _intra_grads_kernel at
# 2 or 8 warps instead of 4 took 1.16 / 1.18 ms more forward + backward.
VARIANTS = ["default={}",
            'att32={"attention": {"block_k": 32}}',
            'diag64w1={"diagonal": {"block_k": 64, "num_warps": 1}}',
            'intra_w2={"intra_grads": {"block_k": 32, "unroll": 4, "num_warps": 2}}',
            'inter_w8={"inter_grads": {"num_warps": 8}}']


def parse_variant(spec: str) -> tuple[str, ChunkedConfig, int | None]:
    """(name, config, chunk size): ``chunk_size`` in the JSON is the op's argument (None: the
    probe's own, 64), every other field the config's."""
    name, fields = spec.split("=", 1)
    fields = {k: KernelConfig(**v) if isinstance(v, dict) else v for k, v in json.loads(fields).items()}
    chunk = fields.pop("chunk_size", None)
    return name, ChunkedConfig(**fields), chunk


def kernel_breakdown(fn, samples: int) -> list[tuple[str, float, float]]:
    """(kernel, median device ms per ``fn()`` call, launches per call) over ``samples`` calls
    traced together, largest first (no L2 flush between the calls: for proportions)."""
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


def print_breakdown(title: str, fn, samples: int) -> None:
    """:func:`kernel_breakdown` of ``fn``, a line a kernel."""
    print(f"  {title}: kernels (median ms per call, warm L2; launches)")
    for kernel, ms, n in kernel_breakdown(fn, samples):
        print(f"    {ms:8.4f}  x{n:g}  {kernel[:80]}")


def fla_probe(run, fla, gate, inputs, d_o, scale, samples, first, directions) -> dict:
    """fla's kernel for ``gate`` on ``inputs``: checked against ``first`` (our first variant's
    output and gradients), timed (``peers.fla_race``), and each direction's kernels. With
    ``directions`` ("fwd",) only the forward runs (and only its kernels autotune): its output is
    checked, timed the same way and broken down."""
    label = f"{gate} fla"
    torch = fla["torch"]
    call = peers.fla_call(fla, "chunked", gate, scale)
    tensors = {name: peers.to_torch(torch, x) for name, x in inputs.items()}
    if "fwd+bwd" in directions:
        o, grads, stats = peers.fla_race(fla, "chunked", gate, inputs, d_o, scale, samples)
        err = compare(o, grads, *first)
    else:
        with torch.no_grad():
            o = peers.from_torch(call(tensors))
            stats = {"fwd": spread(device_samples_ms(lambda: call(tensors), samples))}
        err = compare(o, {}, first[0], {})
    failures = past_tolerance(err, jnp.bfloat16, f"{label} vs ours")
    run.failures += failures
    run.log(f"{label} ({'FAILED' if failures else 'checked'} against ours): "
            + ", ".join(f"{k} {v['median_ms']:.4g} ms" for k, v in stats.items()))
    leaves = {name: t.detach().requires_grad_(True) for name, t in tensors.items()}
    d_o_t = peers.to_torch(torch, d_o)

    def forward():
        with torch.no_grad():
            call(tensors)
        torch.cuda.synchronize()  # kernel_breakdown's trace needs the work done

    def forward_backward():
        for leaf in leaves.values():
            leaf.grad = None  # no accumulation kernels in the breakdown
        call(leaves).backward(d_o_t)
        torch.cuda.synchronize()

    for direction, fn in (("fwd", forward), ("fwd+bwd", forward_backward)):
        if direction in directions:
            print_breakdown(f"{label} {direction}", fn, samples)
    return stats


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("variants", nargs="*", help="NAME=JSON of ChunkedConfig fields")
    parser.add_argument("--shape", type=int, default=0, help="index into bench/chunked.py's SHAPES")
    parser.add_argument("--gates", default="gk", help="gk, g or both (gk,g)")
    parser.add_argument("--budget", type=float, default=240, help="seconds to start variants in")
    parser.add_argument("--quick", action="store_true", help="tiny shape, CPU interpreter")
    parser.add_argument("--fla", action="store_true", help="also fla's kernel, per kernel")
    parser.add_argument("--strong", action="store_true",
                        help="strong decays (peers.gla_inputs' strong): the careful kernels")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"),
                        help="the inputs' dtype (and the tolerances the checks take)")
    parser.add_argument("--forward-only", action="store_true",
                        help="time and break down the forward only (fla autotunes only it)")
    args = parser.parse_args()
    variants = [parse_variant(spec) for spec in (args.variants or VARIANTS)]
    run = Run(budget_s=None if args.quick else args.budget)
    shape = race.SHAPES[args.shape]
    b, t, h, d, kv = shape["batch"], shape["seq_len"], shape["heads"], shape["dim"], shape.get("kv_heads")
    samples, check_len = SAMPLES, CHECK_SEQ_LEN
    directions = ("fwd",) if args.forward_only else ("fwd", "fwd+bwd")
    if args.quick:
        b, t, h, d, samples, check_len = 1, 40, 2, 32, 2, 40
        variants = variants[:2]
    chunk = race.QUICK_CHUNK_SIZE if args.quick else 64
    scale = d ** -0.5
    dtype = jnp.dtype(args.dtype)
    run.log(f"device {jax.devices()[0].device_kind}; B{b} T{t} H{h}{f'/{kv}' if kv else ''} "
            f"K=V={d} {args.dtype}, chunk {chunk}")
    results = []
    fla = None
    if args.fla:
        fla, why = peers.load_fla()
        if fla is None:
            run.not_run["fla"] = why
    for gate in args.gates.split(","):
        inputs, d_o = peers.gla_inputs(int(gate == "gk"), b, t, h, d, gate, kv_heads=kv,
                                       strong=args.strong)
        inputs = {n: x.astype(dtype) for n, x in inputs.items()}
        d_o = d_o.astype(dtype)
        short, short_d_o = peers.prefix(inputs, check_len), d_o[:, :check_len]
        wide = {n: x.astype(jnp.float32) for n, x in short.items()}
        ref_fwd_bwd = forward_and_backward(lambda x: reference(**x, softmax_scale=scale)[0])[1]
        ref_o, ref_grads = ref_fwd_bwd(wide, short_d_o.astype(jnp.float32))
        first = None
        for index, (name, config, variant_chunk) in enumerate(variants):
            label = f"{gate} {name}"
            if index and run.out_of_time(label):
                continue
            op = functools.partial(chunked_recurrent, impl="triton", chunk_size=variant_chunk or chunk,
                                   config=config, softmax_scale=scale)
            fwd, fwd_bwd = forward_and_backward(lambda x, op=op: op(**x)[0])
            err = compare(*fwd_bwd(short, short_d_o), ref_o, ref_grads)
            failures = past_tolerance(err, dtype, f"{label} vs reference")
            o, grads = fwd_bwd(inputs, d_o)
            if first is None:
                first = (o, grads)
            else:  # every variant computes the same function: close to the first, full length
                failures += past_tolerance(compare(o, grads, *first), dtype,
                                           f"{label} vs the first variant")
            if not bool(jnp.all(jnp.isfinite(o.astype(jnp.float32)))):
                failures.append(f"{label}: non-finite output at full length")
            run.failures += failures
            del o, grads
            stats = {"fwd": time_stats_ms(lambda: fwd(inputs), samples)}
            if "fwd+bwd" in directions:
                stats["fwd+bwd"] = time_stats_ms(lambda: fwd_bwd(inputs, d_o), samples)
            results.append((label, stats))
            errs = " ".join(f"{k} {v:.2g}" for k, v in err.items())
            run.log(f"{label} ({'FAILED' if failures else 'checked'}: {errs}): "
                    + ", ".join(f"{k} {v['median_ms']:.4g} ms" for k, v in stats.items()))
            if ejk_lite.ON_GPU:
                for direction, fn in (("fwd", lambda: fwd(inputs)), ("fwd+bwd", lambda: fwd_bwd(inputs, d_o))):
                    if direction in directions:
                        print_breakdown(f"{label} {direction}", fn, samples)
        if fla is not None and first is not None and not run.out_of_time(f"{gate} fla"):
            results.append((f"{gate} fla", fla_probe(run, fla, gate, inputs, d_o, scale, samples,
                                                    first, directions)))

    print(f"\n{'variant':24s} {'direction':9s} {'min_ms':>8s} {'median_ms':>9s} {'max_ms':>8s}")
    for label, stats in results:
        for direction, st in stats.items():
            print(f"{label:24s} {direction:9s} {st['min_ms']:8.4f} {st['median_ms']:9.4f} "
                  f"{st['max_ms']:8.4f}")
    for name, why in run.not_run.items():
        print(f"not run: {name}: {why}")
    run.finish()
    print("all checks passed")


if __name__ == "__main__":
    main()
