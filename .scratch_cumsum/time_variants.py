"""Issue 19, item 5: time the cumsum variants on the GPU, the shipped kernels against this tree's,
at bench/cumsum.py's shapes, each result checked against a float64 NumPy cumsum first.

    PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1 python3 .scratch_cumsum/time_variants.py
    python .scratch_cumsum/time_variants.py --quick     # CPU smoke test: interpreter, tiny shapes

Rows (device time, bench/common.py's time_stats_ms: 10 samples after an L2 flush, median):

* ``A`` shipped vs new, autotuned, as bench/cumsum.py calls them: vector gates [4, 4096, 16, 128],
  chunk-local (64) and global, fwd and bwd, bfloat16 then float32. ``shipped`` is
  .scratch_cumsum/cumsum_shipped.py (ejk_lite/cumsum.py as bench/results/cumsum.json measured it),
  ``new`` this tree's ejk_lite/cumsum.py (C a constexpr: 16-byte loads; pipelined global walk).
* ``B`` pinned tiles (CumsumConfig), vector gates, forward only: which tile each dtype wants, and
  the changes apart: ``shipped local/global 64x32 w4`` is the shipped default tile as shipped,
  ``new local 64x32 w4 s1`` / ``new global 64x32 w4 s1`` the same tile with 16-byte loads,
  ``new global 64x32 w4 s3`` that plus the pipelined walk, ``new local 8x1024 w4 s3`` (and the
  other ``8x...`` rows) the wide tiles that scan in registers.
* ``C`` shipped vs new, autotuned, scalar gates [8, 8192, 16], forward: no regression there.

Order: A, B bfloat16, C, B float32.

Columns: ms (median; min-max), GB/s (2 x bytes of the input over the median: one read, one
write), % of copy (of the best copy bandwidth measured in this process, bench/common.py),
rel err (against float64; a row over bench/cumsum.py's tolerance prints FAIL and the script
exits 1 after the table). Rows start in this order while less than ``BUDGET_S`` seconds
have passed since the start; what did not start is listed as skipped. With ``$OUT`` set the
rows are written to ``$OUT/cumsum_variants.json`` as well.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path

START = time.perf_counter()
ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "bench"), str(ROOT / ".scratch_cumsum")]

import ejk_lite  # noqa: E402  (first: settles the Triton backend)

if not Path(ejk_lite.__file__).resolve().is_relative_to(ROOT):
    sys.exit(f"ejk_lite came from {ejk_lite.__file__}, not from {ROOT}: fix PYTHONPATH")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import common  # noqa: E402  (bench/common.py)
import cumsum_shipped as shipped  # noqa: E402
import ejk_lite.cumsum as new  # noqa: E402

QUICK = "--quick" in sys.argv
BUDGET_S = 1e9 if QUICK else 115.0  # no row starts after this (the lead's limit: 150 s in all)
SAMPLES = 10
CHUNK = 64
TOLERANCE = {"float32": 1e-5, "bfloat16": 1.6e-2}  # bench/cumsum.py's
RECORDED_COPY_GBS = 3031.97  # bench/results/cumsum.json (H100, best of four methods)
VECTOR = (1, 96, 2, 16) if QUICK else (4, 4096, 16, 128)
SCALAR = (2, 200, 4) if QUICK else (8, 8192, 16)
MODULES = {"shipped": shipped, "new": new}


def numpy_cumsum(x, chunk, reverse):
    """Float64 cumsum along axis 1, restarting every ``chunk`` tokens (never, for ``None``)."""
    x = np.asarray(x, np.float64)
    tokens = x.shape[1]
    step = tokens if chunk is None else chunk
    padded = np.zeros((x.shape[0], -(-tokens // step) * step) + x.shape[2:])
    padded[:, :tokens] = x
    blocks = padded.reshape((x.shape[0], padded.shape[1] // step, step) + x.shape[2:])
    if reverse:
        sums = np.flip(np.cumsum(np.flip(blocks, 2), axis=2), 2)
    else:
        sums = np.cumsum(blocks, axis=2)
    return sums.reshape(padded.shape)[:, :tokens]


class Case:
    """Inputs of one shape and dtype, and their float64 answers (computed once, when first asked)."""

    def __init__(self, shape, dtype, seed):
        kx, kw = jax.random.split(jax.random.key(seed))
        self.shape, self.dtype = shape, dtype
        self.x = jax.random.normal(kx, shape, dtype)
        self.w = jax.random.normal(kw, shape, dtype)
        self.bytes = 2 * self.x.size * self.x.dtype.itemsize  # read once, write once
        self._answers = {}

    def answer(self, op, direction):
        key = (op, direction)
        if key not in self._answers:
            source = self.x if direction == "fwd" else self.w
            source = np.asarray(source.astype(jnp.float32), np.float64)
            ref = numpy_cumsum(source, CHUNK if op == "local" else None, reverse=direction == "bwd")
            self._answers[key] = (ref, np.linalg.norm(ref))
        return self._answers[key]


def rel_err(out, op, direction, case):
    ref, norm = case.answer(op, direction)
    out = np.asarray(jnp.asarray(out, jnp.float32)).astype(np.float64)
    if not np.all(np.isfinite(out)):
        return float("inf")
    return float(np.linalg.norm(out - ref) / max(norm, 1e-30))


def op_fn(module, op, config):
    if op == "local":
        return lambda x: module.chunk_local_cumsum(x, CHUNK, impl="triton", config=config)
    return lambda x: module.chunk_global_cumsum(x, impl="triton", config=config)


def timed(run):
    """bench/common.py's device timer; one profiler trace for all samples where it can."""
    try:
        return common.time_stats_ms(run, SAMPLES, one_trace=True)
    except RuntimeError:  # the trace could not be split at the flushes: one trace per sample
        return common.time_stats_ms(run, SAMPLES)


ROWS, FAILED, SKIPPED = [], [], []


def measure(group, label, module_name, op, direction, case, config=None):
    f = op_fn(MODULES[module_name], op, config)
    if direction == "fwd":
        fn = jax.jit(f)
        run = lambda: fn(case.x)  # noqa: E731
    else:  # as bench/cumsum.py: the gradient of sum(w * out) is the reverse cumsum of w
        fn = jax.jit(jax.grad(lambda x, w: jnp.sum((w * f(x)).astype(jnp.float32))))
        run = lambda: fn(case.x, case.w)  # noqa: E731
    started = time.perf_counter()
    row = dict(group=group, label=label, impl=module_name, op=op, direction=direction,
               shape=list(case.shape), dtype=case.dtype)
    try:
        out = jax.block_until_ready(run())  # compiles (and autotunes) here
        row["first_call_s"] = time.perf_counter() - started
        row["rel_err"] = rel_err(out, op, direction, case)
        row["ok"] = bool(row["rel_err"] < TOLERANCE[case.dtype])
        if row["ok"]:
            st = timed(run)
            row.update(st)
            row["gbs"] = case.bytes / (st["median_ms"] * 1e-3) / 1e9
            row["pct_of_copy"] = 100 * row["gbs"] / COPY_GBS
    except Exception as error:  # noqa: BLE001 (one broken variant must not end the run)
        row.update(ok=False, error=f"{type(error).__name__}: {str(error).splitlines()[0][:200]}")
        traceback.print_exc(limit=2)
    if not row["ok"]:
        FAILED.append(row)
    ROWS.append(row)
    if "median_ms" in row:
        print(f"{group} {label:34s} {case.dtype:8s} {op:6s} {direction} {row['median_ms']:8.4f} ms "
              f"({row['min_ms']:.4f}-{row['max_ms']:.4f}) {row['gbs']:6.0f} GB/s {row['pct_of_copy']:5.1f}% "
              f"err {row['rel_err']:.1e} first call {row['first_call_s']:.1f}s", flush=True)
    else:
        print(f"{group} {label:34s} {case.dtype:8s} {op:6s} {direction} FAIL "
              f"err {row.get('rel_err')} {row.get('error', '')}", flush=True)


def cfg(block_t, block_c, warps, stages):
    return new.CumsumConfig(block_t=block_t, block_c=block_c, num_warps=warps, num_stages=stages)


# Pinned tiles for group B: (block_t, block_c, num_warps, num_stages). Local: block_t 64 is the
# whole chunk (one block, never pipelined: "tall" tiles, the scan crosses lanes and warps); block_t
# 8 walks the chunk in 8 pipelined steps with a warp's lanes side by side along the columns
# ("wide" tiles, the scan in registers when block_c = 32 lanes x 8 (bf16) or 4 (f32) x warps).
LOCAL_TILES = [(64, 32, 4, 1), (64, 64, 4, 1), (64, 128, 4, 1), (8, 256, 1, 3), (8, 256, 1, 2),
               (8, 512, 4, 3), (8, 1024, 4, 3), (8, 1024, 4, 2), (16, 512, 4, 3), (8, 128, 1, 3)]
GLOBAL_TILES = [(64, 32, 4, 1), (64, 32, 4, 3), (64, 32, 4, 4), (128, 16, 4, 3), (128, 32, 4, 3),
                (128, 32, 8, 3), (256, 16, 8, 3), (256, 32, 8, 2), (64, 16, 4, 4)]


def groups():
    """(name, list of thunks), in order of priority."""
    vec = {d: Case(VECTOR, d, seed) for seed, d in enumerate(("bfloat16", "float32"))}
    sca = {d: Case(SCALAR, d, 10 + seed) for seed, d in enumerate(("bfloat16", "float32"))}
    a = [lambda d=d, op=op, dr=dr, m=m: measure("A", f"{m} autotuned", m, op, dr, vec[d])
         for d in ("bfloat16", "float32") for op in ("local", "global") for dr in ("fwd", "bwd")
         for m in ("shipped", "new")]
    def b(d):
        shipped_tile = shipped.CumsumConfig(block_t=64, block_c=32, num_warps=4, num_stages=3)
        rows = [lambda op=op: measure("B", f"shipped {op} 64x32 w4", "shipped", op, "fwd", vec[d], shipped_tile)
                for op in ("local", "global")]
        rows += [lambda t=t: measure("B", "new local {0}x{1} w{2} s{3}".format(*t), "new", "local", "fwd",
                                     vec[d], cfg(*t)) for t in LOCAL_TILES]
        rows += [lambda t=t: measure("B", "new global {0}x{1} w{2} s{3}".format(*t), "new", "global", "fwd",
                                     vec[d], cfg(*t)) for t in GLOBAL_TILES]
        return rows

    c = [lambda d=d, op=op, m=m: measure("C", f"{m} autotuned", m, op, "fwd", sca[d])
         for d in ("bfloat16", "float32") for op in ("local", "global") for m in ("shipped", "new")]
    return [("A", a), ("B bfloat16", b("bfloat16")), ("C", c), ("B float32", b("float32"))]


def summary():
    print("\nsummary (A: new vs shipped, autotuned; ratio > 1: new faster)")
    for r in ROWS:
        if r["group"] == "A" and r["impl"] == "new" and "median_ms" in r:
            old = next((o for o in ROWS if o["group"] == "A" and o["impl"] == "shipped" and "median_ms" in o
                        and all(o[k] == r[k] for k in ("op", "direction", "dtype"))), None)
            if old:
                print(f"  {r['dtype']:8s} {r['op']:6s} {r['direction']}  shipped {old['median_ms']:.4f} ms "
                      f"{old['pct_of_copy']:5.1f}%  new {r['median_ms']:.4f} ms {r['pct_of_copy']:5.1f}%  "
                      f"x{old['median_ms'] / r['median_ms']:.2f}")
    print("best pinned tile per kernel and dtype (B, forward)")
    for d in ("bfloat16", "float32"):
        for op in ("local", "global"):
            rows = [r for r in ROWS if r["group"] == "B" and r["impl"] == "new" and r["op"] == op
                    and r["dtype"] == d and "median_ms" in r]
            if rows:
                best = min(rows, key=lambda r: r["median_ms"])
                print(f"  {d:8s} {op:6s} {best['label']:30s} {best['median_ms']:.4f} ms {best['pct_of_copy']:5.1f}%")


def main():
    global COPY_GBS
    print(f"ejk_lite from {ejk_lite.__file__}; device {common.device_name()}; jax {jax.__version__}", flush=True)
    try:
        COPY_GBS, _ = common.ceilings()
        print(f"copy bandwidth {COPY_GBS:.0f} GB/s (best of {common.CEILINGS.get('copy_gbs_by_method')}); "
              f"recorded in cumsum.json: {RECORDED_COPY_GBS:.0f}", flush=True)
    except Exception as error:  # noqa: BLE001
        COPY_GBS = RECORDED_COPY_GBS
        print(f"copy ceiling failed ({error}); using the recorded {COPY_GBS:.0f} GB/s", flush=True)
    print(f"setup {time.perf_counter() - START:.1f} s", flush=True)
    for name, thunks in groups():
        for i, thunk in enumerate(thunks):
            if time.perf_counter() - START > BUDGET_S:
                SKIPPED.append(f"group {name}: {len(thunks) - i} of {len(thunks)} rows")
                break
            thunk()
    summary()
    if SKIPPED:
        print("skipped (time budget): " + "; ".join(SKIPPED))
    if os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / "cumsum_variants.json"
        path.write_text(json.dumps({"device": common.device_name(), "copy_gbs": COPY_GBS, "rows": ROWS,
                                    "skipped": SKIPPED, "failed": [r["label"] for r in FAILED]}, indent=1))
        print(f"wrote {path}")
    print(f"total {time.perf_counter() - START:.1f} s")
    if FAILED:
        print("FAILED: " + "; ".join(f"{r['label']} {r['op']} {r['direction']} {r['dtype']}" for r in FAILED))
        sys.exit(1)


if __name__ == "__main__":
    main()
