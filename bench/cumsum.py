"""Benchmark chunk_local_cumsum (chunk 64) and chunk_global_cumsum: Triton against XLA.

Cases (``CASES``), each in float32 and bfloat16:

* scalar gates ``[8, 8192, 16]`` (one log-decay per token and head);
* vector gates ``[4, 4096, 16, 128]`` (one per token, head and feature).

Directions:

* ``fwd``: the cumsum itself;
* ``bwd``: ``jax.grad`` of ``sum(w * out)``, i.e. the reverse cumsum of ``w``. The forward is dead
  code there (the op is linear, its output is not needed for the gradient) and JAX drops it.

A cumsum is memory-bound: it must read its input once and write its output once. Each row reports
those bytes over the median time, in GB/s and as a share of the copy bandwidth measured in the same
process (bench/common.py). The target (issue 19): Triton at >= 85 % of it on the large (vector)
case, and faster than XLA. The ceiling is measured on 1 GiB, as the issue defines it; a copy of
a case's own size reaches less of it (a smaller launch, its start and tail a larger share), so
each row also gives ``pct_of_same_size_copy``: against the best copy method on an input of the
case's own bytes, measured in the same process (``same_size_copy`` in the file).

Checks before timing: outputs and gradients against float64 NumPy cumsums of the same (rounded)
inputs; rows past their dtype's tolerance (``ejk_lite.testing``, the tests' own) are marked
``ok: false`` and listed at the end, and the script exits 1.

    python bench/cumsum.py --out bench/results          # on the GPU
    python bench/cumsum.py --quick --out /tmp/bench_cs  # tiny shapes, any machine (interpreter)
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ejk_lite  # noqa: E402, F401  (first: settles the Triton backend)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from common import (  # noqa: E402
    TOLERANCE,
    Run,
    ceilings,
    copy_methods_gbs,
    parse_args,
    print_table,
    relative_error,
    row,
    time_stats_ms,
    tolerance,
    wall_ms,
    write_result,
)
from ejk_lite import chunk_global_cumsum, chunk_local_cumsum  # noqa: E402

CHUNK = 64
SAMPLES = 10  # min / median / max over this many samples (common.time_stats_ms)
CASES = [dict(kind="scalar", shape=(8, 8192, 16), quick=(2, 200, 4)),
         dict(kind="vector", shape=(4, 4096, 16, 128), quick=(1, 96, 2, 16))]
DTYPES = ("float32", "bfloat16")
OPS = {"local": lambda impl: lambda x: chunk_local_cumsum(x, CHUNK, impl=impl),
       "global": lambda impl: lambda x: chunk_global_cumsum(x, impl=impl)}


def numpy_cumsum(x: np.ndarray, chunk: int | None, reverse: bool) -> np.ndarray:
    """Float64 cumsum along axis 1, restarting every ``chunk`` tokens (never, for ``None``)."""
    x = np.asarray(x, np.float64)
    batch, tokens = x.shape[:2]
    step = tokens if chunk is None else chunk
    padded_len = -(-tokens // step) * step
    padded = np.zeros((batch, padded_len) + x.shape[2:])
    padded[:, :tokens] = x
    chunks = padded.reshape((batch, padded_len // step, step) + x.shape[2:])
    if reverse:
        chunks = chunks[:, :, ::-1]
    sums = np.cumsum(chunks, axis=2)
    if reverse:
        sums = sums[:, :, ::-1]
    return sums.reshape(padded.shape)[:, :tokens]


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    run = Run()
    copy_gbs, dispatch_ms = ceilings()
    print(f"copy bandwidth {copy_gbs:.0f} GB/s, dispatch overhead {dispatch_ms:.4f} ms")
    same_size = {}  # input bytes -> GB/s of each copy method on an input that size

    def same_size_copy_gbs(n_bytes: int) -> float:
        if n_bytes not in same_size:
            timer = None if ejk_lite.ON_GPU else wall_ms
            same_size[n_bytes] = copy_methods_gbs(n_bytes, timer=timer)
            print(f"copy of {n_bytes} bytes: {max(same_size[n_bytes].values()):.0f} GB/s")
        return max(same_size[n_bytes].values())

    rows = []
    key = jax.random.key(0)
    for case in CASES:
        shape = case["quick" if args.quick else "shape"]
        for dtype in DTYPES:
            key, kx, kw = jax.random.split(key, 3)
            x, w = jax.random.normal(kx, shape, dtype), jax.random.normal(kw, shape, dtype)
            moved = 2 * x.size * x.dtype.itemsize  # read the input once, write the output once
            own_copy_gbs = same_size_copy_gbs(x.size * x.dtype.itemsize)
            for op, make in OPS.items():
                chunk = CHUNK if op == "local" else None
                expected = {"fwd": numpy_cumsum(x, chunk, reverse=False),
                            "bwd": numpy_cumsum(w, chunk, reverse=True)}
                name = f"{op}{chunk or ''} {case['kind']} {list(shape)}"
                for impl in ("triton", "xla"):
                    f = make(impl)
                    fwd = jax.jit(f)
                    loss = lambda x, w, f=f: jnp.sum((w * f(x)).astype(jnp.float32))  # noqa: E731
                    bwd = jax.jit(jax.grad(loss))
                    for direction, call in (("fwd", lambda: fwd(x)), ("bwd", lambda: bwd(x, w))):
                        err = relative_error(call(), expected[direction])
                        r = row(name, impl, direction, list(shape), dtype, bytes_moved=moved,
                                copy_gbs=copy_gbs, rel_err=err, stats=time_stats_ms(call, SAMPLES),
                                op=op, ok=bool(err <= tolerance(dtype)),
                                same_size_copy_gbs=own_copy_gbs)
                        r["pct_of_same_size_copy"] = 100 * r["gbs"] / own_copy_gbs
                        rows.append(r)
                        print(f"{name:32s} {impl:6s} {direction} {dtype:8s} "
                              f"{r['median_ms']:8.4f} ms {r['gbs']:7.0f} GB/s "
                              f"({r['pct_of_copy']:3.0f}% of copy, "
                              f"{r['pct_of_same_size_copy']:3.0f}% of its size's)  "
                              f"rel err {err:.1e}", flush=True)

    speedups = {}
    for r in rows:
        if r["impl"] == "triton":
            xla = next(p for p in rows if p["impl"] == "xla" and
                       all(p[k] == r[k] for k in ("name", "direction", "dtype")))
            case = f"{r['name']} {r['direction']} {r['dtype']}"
            speedups[case] = xla["median_ms"] / r["median_ms"]
    run.failures = [f"{r['name']} {r['impl']} {r['direction']} {r['dtype']}: rel_err "
                    f"{r['rel_err']:.3g}" for r in rows if not r["ok"]]
    path = write_result(args.out, "cumsum", {
        "quick": args.quick,
        "copy_bandwidth_gbs": copy_gbs,
        "same_size_copy": {str(n): {"gbs_by_method": m, "gbs": max(m.values())}
                           for n, m in same_size.items()},
        "dispatch_overhead_ms": dispatch_ms,
        "chunk_size": CHUNK,
        "target": "triton >= 85% of copy bandwidth on the large shapes, and faster than XLA",
        "bandwidth_target_pct": 85,
        "triton_speedup_over_xla": speedups,
        "tolerance": {dtype: TOLERANCE[dtype] for dtype in DTYPES},
        "failures": run.failures,
        "passed": not run.failures,
        "rows": rows,
    })
    print(f"\nwrote {path}\n")
    print_table(rows, ["name", "impl", "direction", "dtype", "median_ms", "gbs", "pct_of_copy",
                       "pct_of_same_size_copy", "rel_err", "ok"])
    run.finish()


if __name__ == "__main__":
    main()
