"""Benchmark chunk_local_cumsum (chunk 64) and chunk_global_cumsum: Triton against XLA.

Cases, each in float32 and bfloat16:

* scalar gates ``[8, 8192, 16]`` (one log-decay per token and head);
* vector gates ``[4, 4096, 16, 128]`` (one per token, head and feature).

Directions:

* ``fwd``: the cumsum itself;
* ``bwd``: ``jax.grad`` of ``sum(w * out)``, i.e. the reverse cumsum of ``w``. The forward is dead
  code there (the op is linear, its output is not needed for the gradient) and JAX drops it.

A cumsum is memory-bound: it must read its input once and write its output once. Each row reports
those bytes over the median time, in GB/s and as a share of the copy bandwidth measured in the same
process (bench/common.py). The issue's target: Triton at >= 80 % of it on the large (vector) case,
and faster than XLA.

Checks before timing: outputs and gradients against float64 NumPy cumsums of the same (rounded)
inputs; rows failing their dtype's tolerance are marked ``ok: false`` and listed at the end.

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
    ceilings,
    parse_args,
    print_table,
    relative_error,
    row,
    time_stats_ms,
    write_result,
)
from ejk_lite import chunk_global_cumsum, chunk_local_cumsum  # noqa: E402

CHUNK = 64
TOLERANCE = {"float32": 1e-5, "bfloat16": 1.6e-2}  # as tests/conftest.py, against float64
SAMPLES = 10  # min / median / max over this many samples (common.time_stats_ms)






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




def make_op(op: str, impl: str):
    if op == "local":
        return lambda x: chunk_local_cumsum(x, CHUNK, impl=impl)
    return lambda x: chunk_global_cumsum(x, impl=impl)


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    if args.quick:
        shapes = {"scalar": (2, 200, 4), "vector": (1, 96, 2, 16)}
    else:
        shapes = {"scalar": (8, 8192, 16), "vector": (4, 4096, 16, 128)}
    copy_gbs, dispatch_ms = ceilings()
    print(f"copy bandwidth {copy_gbs:.0f} GB/s, dispatch overhead {dispatch_ms:.4f} ms")

    rows = []
    key = jax.random.key(0)
    for (kind, shape), dtype in [(s, d) for s in shapes.items() for d in ("float32", "bfloat16")]:
        key, kx, kw = jax.random.split(key, 3)
        x = jax.random.normal(kx, shape, dtype)
        w = jax.random.normal(kw, shape, dtype)
        x64, w64 = np.asarray(x.astype(jnp.float32), np.float64), np.asarray(w.astype(jnp.float32), np.float64)
        moved = 2 * x.size * x.dtype.itemsize  # read the input once, write the output once
        for op in ("local", "global"):
            chunk = CHUNK if op == "local" else None
            expected = {"fwd": numpy_cumsum(x64, chunk, reverse=False), "bwd": numpy_cumsum(w64, chunk, reverse=True)}
            for impl in ("triton", "xla"):
                f = make_op(op, impl)
                forward = jax.jit(f)
                backward = jax.jit(jax.grad(lambda x, w, f=f: jnp.sum((w * f(x)).astype(jnp.float32))))
                for direction, run in (("fwd", lambda: forward(x)), ("bwd", lambda: backward(x, w))):
                    err = relative_error(run(), expected[direction])
                    name = f"{op}{CHUNK if op == 'local' else ''} {kind} {list(shape)}"
                    st = time_stats_ms(run, SAMPLES)
                    r = row(name, impl, direction, list(shape), dtype, st["median_ms"], bytes_moved=moved,
                            copy_gbs=copy_gbs, rel_err=err, op=op, ok=bool(err < TOLERANCE[dtype]),
                            min_ms=st["min_ms"], max_ms=st["max_ms"], samples=st["samples"],
                            calls_per_sample=st["calls_per_sample"])
                    rows.append(r)
                    print(f"{name:32s} {impl:6s} {direction} {dtype:8s} {r['median_ms']:8.4f} ms "
                          f"{r['gbs']:7.0f} GB/s ({r['pct_of_copy']:3.0f}% of copy)  rel err {err:.1e}", flush=True)

    speedups = {}
    for r in rows:
        if r["impl"] == "triton":
            peer = next(p for p in rows if p["impl"] == "xla" and
                        all(p[k] == r[k] for k in ("name", "direction", "dtype")))
            speedups[f"{r['name']} {r['direction']} {r['dtype']}"] = peer["median_ms"] / r["median_ms"]
    path = write_result(args.out, "cumsum", {
        "quick": args.quick,
        "copy_bandwidth_gbs": copy_gbs,
        "dispatch_overhead_ms": dispatch_ms,
        "chunk_size": CHUNK,
        "target": "triton >= 80% of copy bandwidth on the large shapes, and faster than XLA",
        "triton_speedup_over_xla": speedups,
        "tolerance": TOLERANCE,
        "failures": [f"{r['name']} {r['impl']} {r['direction']} {r['dtype']}: rel_err "
                     f"{r['rel_err']:.3g}" for r in rows if not r["ok"]],
        "passed": all(r["ok"] for r in rows),
        "rows": rows,
    })
    print(f"\nwrote {path}\n")
    print_table(rows, ["name", "impl", "direction", "dtype", "median_ms", "gbs", "pct_of_copy", "rel_err", "ok"])
    failed = [f"{r['name']} {r['impl']} {r['direction']} {r['dtype']}" for r in rows if not r["ok"]]
    if failed:
        print("\nCORRECTNESS FAILURES:\n  " + "\n  ".join(failed))
        sys.exit(1)


if __name__ == "__main__":
    main()
