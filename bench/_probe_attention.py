"""Probe (not a bench): ours' attention at bench/attention.py's shapes, masks and inputs (same
seeds, per-row random documents), for variants of the block sizes and of the call's form, timed in
one process in interleaved rounds (median of round medians, as bench/_ab_attention.py), each
variant checked against the first, with a per-kernel breakdown of forward + backward (ours'
Triton kernels apart from everything else: the backward's in-call mask build, delta, ...), the
time of a build of the backward's mask alone, and optionally FlexAttention on the same inputs.

It imports bench/attention.py, common and peers. On the GPU:

    python3 bench/_probe_attention.py --shape 0 --masks window,documents --reps 3 default={} \
        'kept={"call": "kept"}' 'flexbwd={"dkv": [64, 128, 8, 3], "dq": [128, 64, 8, 3]}'

A variant is NAME=JSON, the JSON's keys all optional: "fwd", "dkv", "dq", each
[block_q, block_kv, num_warps, num_stages] (default BlockSizes.forward / .backward); "call":
"mask" (default: a BlockMask built at the variant's forward tiles outside the timed call,
positions or segment ids as jit arguments, causal=False in the call; the backward rebuilds it at
its tiles inside the call), "kept" (the same mask keeping the backward's tiles, BlockMask.keeping:
nothing is built in the call), "closed" (kept, and causal and window masks without positions: the
kernels take a token's index for its position, as bench/attention.py's race does) or "rule"
(no mask: causal=True, sliding_window, segment ids given to the call, positions left to arange:
the default call, which today builds its masks inside the call).
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
import time

sys.path.insert(0, "bench")
import attention as bench  # noqa: E402  (first: it sets the memory fraction before JAX starts)
import common  # noqa: E402
import peers  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import ejk_lite  # noqa: E402
from ejk_lite.attention import BlockSizes  # noqa: E402


def parse_variant(spec: str):
    name, _, text = spec.partition("=")
    cfg = json.loads(text or "{}")
    if unknown := set(cfg) - {"fwd", "dkv", "dq", "call"}:
        raise SystemExit(f"{name}: unknown keys {sorted(unknown)}")
    if cfg.get("call", "mask") not in ("mask", "kept", "closed", "rule"):
        raise SystemExit(f"{name}: call must be 'mask', 'kept', 'closed' or 'rule'")
    fwd = BlockSizes(*cfg["fwd"]) if "fwd" in cfg else BlockSizes.forward(128)
    dkv = BlockSizes(*cfg["dkv"]) if "dkv" in cfg else BlockSizes.backward(128)
    dq = BlockSizes(*cfg["dq"]) if "dq" in cfg else BlockSizes.backward(128)
    return name, fwd, (dkv, dq), cfg.get("call", "mask")


def functions(mask, T, fwd, bwd, call, seg):
    """(forward(qkv), forward+backward(qkv, d_o)) of one variant on one mask."""
    if call in ("mask", "kept", "closed"):
        keep = tuple(sorted({(b.block_q, b.block_kv) for b in bwd})) if call != "mask" else ()
        build = bench.build_fn(mask, T, fwd.block_q, fwd.block_kv, keep,
                               positions=call != "closed")
        built = jax.block_until_ready(build(bench.build_arg(mask, seg, T)))

        def attend(qkv, extra):
            return ejk_lite.blocksparse_attention(*qkv, qkv_layouts=extra, causal=False,
                                                  fwd_blocks=fwd, bwd_blocks=bwd)
    else:
        built = seg  # an argument either way (unused without documents)

        def attend(qkv, extra):
            return ejk_lite.blocksparse_attention(*qkv, fwd_blocks=fwd, bwd_blocks=bwd,
                                                  **bench.rule_kwargs(mask, extra))
    f, fb = common.forward_and_backward(attend)
    return (lambda qkv: f(qkv, built)), (lambda qkv, d_o: fb(qkv, d_o, built))


def breakdown(fn, samples: int = 5):
    """(kernel, median-free mean ms per call, launches per call), largest first (warm L2)."""
    jax.block_until_ready(fn())
    events = common._gpu_events(lambda: [jax.block_until_ready(fn()) for _ in range(samples)])
    ms, n = collections.defaultdict(float), collections.Counter()
    for _, duration, name in events:
        ms[name] += duration / 1e6 / samples
        n[name] += 1
    return sorted(((k, v, n[k] / samples) for k, v in ms.items()), key=lambda r: -r[1])


def rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("variants", nargs="+", help="NAME=JSON (see the docstring); the first is the "
                   "reference of the checks and ratios")
    p.add_argument("--shape", type=int, default=0, help="index into bench/attention.py's SHAPES")
    p.add_argument("--masks", default="causal,window,documents")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--samples", type=int, default=10)
    p.add_argument("--flex", action="store_true", help="FlexAttention too (peers.flex)")
    p.add_argument("--no-breakdown", action="store_true")
    p.add_argument("--out", help="write the table here as JSON")
    args = p.parse_args()
    start = time.perf_counter()
    log = lambda s: print(f"[{time.perf_counter() - start:6.1f}s] {s}", flush=True)  # noqa: E731

    shape = bench.SHAPES[args.shape]
    T = shape["seq_len"]
    q, k, v, d_o = bench.make_inputs(shape, seed=args.shape)
    qkv = (q, k, v)
    seg_np = bench.make_documents(seed=1000 + args.shape, batch=shape["batch"], seq_len=T)
    seg = jnp.asarray(seg_np)
    masks = [m for m in bench.race_masks(1024) if m.key in args.masks.split(",")]
    variants = [parse_variant(s) for s in args.variants]
    log(f"{jax.devices()[0]}  {bench.shape_name(shape)}  masks {[m.key for m in masks]}")

    fns, results, worst = {}, {}, 0.0
    for mask in masks:
        tiles_timed = set()
        for name, fwd, bwd, call in variants:
            f, fb = functions(mask, T, fwd, bwd, call, seg)
            fns[name, mask.key] = (f, fb)
            o = f(qkv)
            _, grads = fb(qkv, d_o)
            results[name, mask.key] = (o, grads)
            first = results[variants[0][0], mask.key]
            if name != variants[0][0]:
                errs = [rel(a, b) for a, b in zip((o, *grads), (first[0], *first[1]))]
                worst = max(worst, *errs)
                log(f"  {mask.key} {name}: rel. diff to {variants[0][0]} o/dq/dk/dv "
                    + " ".join(f"{e:.1e}" for e in errs))
            # the backward's mask, built inside the timed call when its tiles are not the forward's
            for b in bwd:
                tile = (b.block_q, b.block_kv)
                if call == "mask" and tile != (fwd.block_q, fwd.block_kv) and tile not in tiles_timed:
                    tiles_timed.add(tile)
                    build = bench.build_fn(mask, T, *tile)
                    arg = bench.build_arg(mask, seg, T)
                    st = common.time_stats_ms(lambda: build(arg), args.samples, one_trace=True)
                    log(f"  {mask.key}: make_block_mask at {tile} (the backward's in-call build) "
                        f"{st['median_ms']:.3f} ms")
        log(f"compiled and checked {mask.key}")
    if not worst <= 1e-2:
        raise SystemExit(f"variants disagree: {worst}")

    rounds = collections.defaultdict(list)
    for r in range(args.reps):
        for (name, mk), (f, fb) in fns.items():
            rounds[name, mk, "fwd"].append(common.time_stats_ms(
                lambda: f(qkv), args.samples, one_trace=True)["median_ms"])
            rounds[name, mk, "fwd+bwd"].append(common.time_stats_ms(
                lambda: fb(qkv, d_o), args.samples, one_trace=True)["median_ms"])
        log(f"round {r + 1} of {args.reps}")
    table = {}
    for (name, mk, direction), xs in rounds.items():
        table.setdefault(f"{mk} {direction}", {})[name] = dict(
            median_ms=float(np.median(xs)), min_ms=min(xs), max_ms=max(xs))
    ref = variants[0][0]
    for case, cells in table.items():
        print(f"  {case:20s}" + "  ".join(
            f"{n} {c['median_ms']:.4f} ({c['median_ms'] / cells[ref]['median_ms']:.3f})"
            for n, c in cells.items()), flush=True)

    if not args.no_breakdown:
        for (name, mk), (f, fb) in fns.items():
            rows = breakdown(lambda: fb(qkv, d_o))
            ours = sum(ms for kname, ms, _ in rows if "_attention_" in kname)
            other = sum(ms for kname, ms, _ in rows if "_attention_" not in kname)
            print(f"  {mk} {name} fwd+bwd kernels (warm L2): ours' Triton {ours:.4f} ms, "
                  f"everything else {other:.4f} ms", flush=True)
            for kname, ms, count in rows[:12]:
                print(f"    {ms:8.4f}  x{count:g}  {kname[:90]}", flush=True)

    if args.flex:
        bundle, why = peers.load_flex()
        if bundle is None:
            log(f"flex not run: {why}")
        for mask in masks if bundle is not None else ():
            o, grads = results[ref, mask.key]
            case = peers.AttentionCase(q, k, v, d_o, mask.window,
                                       seg_np if mask.documents else None, o, tuple(grads),
                                       args.samples, {}, bundle)
            res = peers.flex(case, log)
            for direction, st in res.stats.items():
                table.setdefault(f"{mask.key} {direction}", {})["flex"] = st
            log(f"  {mask.key} flex fwd {res.stats['fwd']['median_ms']:.4f} fwd+bwd "
                f"{res.stats['fwd+bwd']['median_ms']:.4f} ms (err vs {ref}: "
                f"{ {n: round(e, 5) for n, e in res.err.items()} })")
    if args.out:
        common.write_result(args.out, "probe_attention", dict(
            shape=shape, variants=args.variants, reps=args.reps, samples=args.samples,
            largest_relative_difference=worst, median_of_round_medians=table))


if __name__ == "__main__":
    main()
