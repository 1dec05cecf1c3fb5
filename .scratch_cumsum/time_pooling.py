"""Issue 19, item 5 (lower priority): where the packed block_mean_pooling forward's time goes.

    PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 python3 .scratch_cumsum/time_pooling.py
    python .scratch_cumsum/time_pooling.py --quick      # CPU smoke test

The case is bench/mean_pooling.py's packed one: 64 random-length sequences, 65,536 tokens,
hidden 4096, bfloat16, block_size 64, chunk_size 32, ``cu_seqlens`` traced (an argument of the
jitted function, as the bench passes it). The hypothesis (from the compiled HLO on a CPU): with
``cu_seqlens`` traced, ``prepare_chunk_indices`` runs on the device every call, and its
``jnp.searchsorted`` (method "scan", a while loop of log2(num_seqs) + 1 steps) and the cummax of
``sanitize_cu_seqlens`` are a few dozen tiny kernels, each counted by the device timer. The
padded case (cu_seqlens concrete: the list is a constant) ran the same kernel at 94% of copy.

Printed:

1. the kernels of one call, name and microseconds, largest first, and their sum: how much of the
   forward is the Triton kernel and how much XLA's index preparation;
2. the forward's device time (median of 10, bench/common.py's timer) and % of copy for variants:
   ``as shipped``; ``searchsorted scan_unrolled`` / ``compare_all`` (ejk_lite.packing's
   ``jnp.searchsorted`` given that method: no while loop); ``cu_seqlens concrete`` (the index list
   a compile-time constant, the floor for any index-preparation fix); each checked against a
   float64 reference first (FAIL: exit 1). mean_pooling's packed forward (84.2%) gets rows 1-2 too.
"""

from __future__ import annotations

import functools
import sys
import time
from pathlib import Path

START = time.perf_counter()
ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench")]

import ejk_lite  # noqa: E402

if not Path(ejk_lite.__file__).resolve().is_relative_to(ROOT):
    sys.exit(f"ejk_lite came from {ejk_lite.__file__}, not from {ROOT}: fix PYTHONPATH")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import common  # noqa: E402
import ejk_lite.packing as packing  # noqa: E402
from ejk_lite import pooling  # noqa: E402

QUICK = "--quick" in sys.argv
TOTAL, HIDDEN, NUM_SEQS = (200, 48, 5) if QUICK else (65536, 4096, 64)
BLOCK, CHUNK = 64, 32
TOLERANCE = 1.6e-2  # bfloat16, as tests/conftest.py
FAILED = []


def make_case():
    rng = np.random.default_rng(0)
    cuts = np.sort(rng.choice(np.arange(1, TOTAL), NUM_SEQS - 1, replace=False))
    cu = np.concatenate([[0], cuts, [TOTAL]]).astype(np.int32)
    x = jax.random.normal(jax.random.key(1), (TOTAL, HIDDEN), jnp.bfloat16)
    x64 = np.asarray(x.astype(jnp.float32), np.float64)
    sums = np.concatenate([np.zeros((1, HIDDEN)), np.cumsum(x64, axis=0)])
    seqs = list(zip(cu[:-1], cu[1:]))
    blocks = [(s, min(s + BLOCK, b)) for a, b in seqs for s in range(a, b, BLOCK)]
    ref = {name: np.stack([(sums[b] - sums[a]) / max(b - a, 1) for a, b in bounds])
           for name, bounds in (("mean", seqs), ("blocks", blocks))}
    return x, cu, ref, len(blocks)


def fn(kind, num_blocks, concrete_cu=None):
    if kind == "mean":
        f = lambda x, cu: pooling.mean_pooling(x, CHUNK, cu, impl="triton")  # noqa: E731
    else:
        f = lambda x, cu: pooling.block_mean_pooling(x, BLOCK, cu, CHUNK, total_blocks=num_blocks,  # noqa: E731
                                                     impl="triton")
    if concrete_cu is not None:
        return jax.jit(lambda x, cu: f(x, concrete_cu))
    return jax.jit(f)


def breakdown(label, f, x, cu):
    """The kernels of one call, as the profiler saw them (after an L2 flush)."""
    if not ejk_lite.ON_GPU:
        print(f"{label}: no GPU, no kernel breakdown")
        return
    from triton import runtime

    device = runtime.driver.active.get_device_interface()
    jax.block_until_ready(f(x, cu))
    device.synchronize()
    events = common._gpu_events(lambda: (jax.block_until_ready(f(x, cu)), device.synchronize()))
    by_name = {}
    for _, duration, name in events:
        count, total = by_name.get(name, (0, 0))
        by_name[name] = (count + 1, total + duration)
    total = sum(t for _, t in by_name.values())
    print(f"\n{label}: {len(events)} kernels, {total / 1e3:.1f} us in all")
    for name, (count, t) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:12]:
        print(f"  {t / 1e3:8.1f} us  {100 * t / max(total, 1):5.1f}%  x{count:<3d} {name[:90]}")


def variant(label, kind, f, x, cu, ref, copy_gbs):
    try:
        out = np.asarray(jnp.asarray(f(x, cu), jnp.float32), np.float64).reshape(ref.shape)
        err = float(np.linalg.norm(out - ref) / np.linalg.norm(ref)) if np.all(np.isfinite(out)) else float("inf")
        if not err < TOLERANCE:
            FAILED.append(label)
            print(f"  {kind:6s} {label:30s} FAIL rel err {err:.2e}", flush=True)
            return
        st = common.time_stats_ms(lambda: f(x, cu), 10)
        n_bytes = x.nbytes + out.size * 2  # read x, write the bfloat16 output (as the bench)
        pct = 100 * n_bytes / (st["median_ms"] * 1e-3) / 1e9 / copy_gbs
        print(f"  {kind:6s} {label:30s} {st['median_ms']:.4f} ms ({st['min_ms']:.4f}-{st['max_ms']:.4f}) "
              f"{pct:5.1f}% of copy, rel err {err:.1e}", flush=True)
    except Exception as error:  # noqa: BLE001
        FAILED.append(label)
        print(f"  {kind:6s} {label:30s} FAIL {type(error).__name__}: {str(error).splitlines()[0][:200]}")


def main():
    copy_gbs, _ = common.ceilings()
    print(f"ejk_lite from {ejk_lite.__file__}; {common.device_name()}; copy {copy_gbs:.0f} GB/s", flush=True)
    x, cu_np, ref, num_blocks = make_case()
    cu = jnp.asarray(cu_np)
    for kind in ("blocks", "mean"):
        breakdown(f"{kind}, as shipped (cu_seqlens traced)", fn(kind, num_blocks), x, cu)
    print("\nforward, device time, median of 10")
    original = jnp.searchsorted
    for kind in ("blocks", "mean"):
        variant("as shipped", kind, fn(kind, num_blocks), x, cu, ref[kind], copy_gbs)
        for method in ("scan_unrolled", "compare_all"):
            packing.jnp.searchsorted = functools.partial(original, method=method)
            try:
                f = fn(kind, num_blocks)
                variant(f"searchsorted {method}", kind, f, x, cu, ref[kind], copy_gbs)
                if method == "scan_unrolled":
                    breakdown(f"{kind}, searchsorted {method}", f, x, cu)
            finally:
                packing.jnp.searchsorted = original
        variant("cu_seqlens concrete", kind, fn(kind, num_blocks, concrete_cu=cu_np), x, cu, ref[kind], copy_gbs)
    print(f"\ntotal {time.perf_counter() - START:.1f} s")
    if FAILED:
        print("FAILED: " + ", ".join(FAILED))
        sys.exit(1)


if __name__ == "__main__":
    main()
