"""Probe (issue 19): the global cumsum before and after, on one GPU.

Variants, each through the Triton path of ``chunk_global_cumsum``:

* ``old``: fdebc21's autotune list, one walk per sequence (the new kernel with SPLIT 1 and no
  DOT compiles to the old kernel: the same sm_90 SASS in the dense case, offline, triton 3.6);
* ``new``: what ships: small inputs with few walks (``_TWO_PASS_MAX_BYTES``,
  ``_TWO_PASS_MAX_WALKS``: the scalar case) in two passes, others (the vector case) one walk
  autotuned over ``_GLOBAL_TILES``;
* ``new 1-pass``: the scalar case through the one-walk path (``_GLOBAL_TILES``);
* ``xla``: ``impl="xla"``, the peer;
* then each tile of ``_GLOBAL_TILES`` pinned (forward only, while the budget lasts), so that the
  list can be pruned.

Cases: bench/cumsum.py's vector [4, 4096, 16, 128] and scalar [8, 8192, 16] gates, bfloat16 and
float32; forward and backward (the reverse sum, through jax.grad) as bench/cumsum.py times them.
Device time (bench/common.py's timer: 10 samples after the first call, which autotunes, and 3
warm-up calls), % of the copy bandwidth measured here as bench/cumsum.py does (best of four
methods on 1 GiB). Every timed result is checked against float64 NumPy first; the script exits 1
on any error past the tests' tolerance. Lower-priority rows are skipped (and said so) once
BUDGET_S has passed, so that the whole run stays under 4 minutes.

    PYTHONPATH=$PWD python bench/_probe_cumsum.py
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ejk_lite  # noqa: E402, F401  (first: settles the Triton backend)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import triton  # noqa: E402

import ejk_lite.cumsum as cs  # noqa: E402
from common import (Run, ceilings, print_table, relative_error, time_stats_ms,  # noqa: E402
                    tolerance)
from cumsum import numpy_cumsum  # noqa: E402  (bench/cumsum.py's float64 reference)

SAMPLES = 10
BUDGET_S = 180  # no row starts after this; the whole run stays under 4 minutes
OLD_TILES = [(64, 32, 4, 3, 1, False), (128, 32, 4, 3, 1, False), (128, 16, 4, 3, 1, False),
             (32, 64, 4, 3, 1, False), (128, 32, 8, 3, 1, False), (256, 16, 8, 3, 1, False),
             (256, 32, 8, 2, 1, False), (512, 8, 4, 3, 1, False), (1024, 4, 4, 3, 1, False)]
CASES = [("vector", (4, 4096, 16, 128)), ("scalar", (8, 8192, 16))]
if not ejk_lite.ON_GPU:  # a dry run of the script on a CPU (interpreter): tiny shapes
    CASES = [("vector", (1, 96, 2, 16)), ("scalar", (2, 200, 4))]
DTYPES = ("bfloat16", "float32")

_OLD_TUNER = triton.autotune(configs=cs._configs(OLD_TILES), key=["T", "C"])(
    cs.chunk_global_cumsum_kernel)
_NEW_TUNERS = cs._global_autotuned
_TWO_PASS_MAX_BYTES = cs._TWO_PASS_MAX_BYTES


def global_cumsum(variant):
    """``x -> chunk_global_cumsum(x)`` for a variant (a name, or a CumsumConfig to pin)."""
    if variant == "xla":
        return lambda x: cs.chunk_global_cumsum(x, impl="xla")
    config = variant if isinstance(variant, cs.CumsumConfig) else None
    return lambda x: cs._cumsum_triton(x, None, None, False, 1.0, False, x.dtype, x.dtype, config)


def patched(variant):
    """What the module must look like while ``variant`` is traced (its launch reads both)."""
    old = variant == "old"
    return {"_global_autotuned": (lambda sixteen_bit: _OLD_TUNER) if old else _NEW_TUNERS,
            "_TWO_PASS_MAX_BYTES": 0 if old or variant == "new 1-pass" else _TWO_PASS_MAX_BYTES}


def main() -> None:
    run = Run(BUDGET_S)
    copy_gbs, _ = ceilings()
    run.log(f"copy bandwidth {copy_gbs:.0f} GB/s (best of {', '.join(ejk_lite_ceilings())})")
    key = jax.random.key(0)
    data = {}
    for kind, shape in CASES:
        for dtype in DTYPES:
            key, kx, kw = jax.random.split(key, 3)
            x, w = jax.random.normal(kx, shape, dtype), jax.random.normal(kw, shape, dtype)
            data[kind, dtype] = (x, w, {"fwd": numpy_cumsum(x, None, reverse=False),
                                        "bwd": numpy_cumsum(w, None, reverse=True)})

    rows = []

    def measure(kind, dtype, variant, directions=("fwd", "bwd")):
        x, w, expected = data[kind, dtype]
        name = variant if isinstance(variant, str) else \
            "pinned " + ",".join(str(getattr(variant, k)) for k in
                                 ("block_t", "block_c", "num_warps", "num_stages", "split", "dot"))
        f = global_cumsum(variant)
        fwd = jax.jit(f)  # fresh functions: traced (under the patch) on their first call
        bwd = jax.jit(jax.grad(lambda x, w: jnp.sum((w * f(x)).astype(jnp.float32))))
        calls = {"fwd": lambda: fwd(x), "bwd": lambda: bwd(x, w)}
        for direction in directions:
            if run.out_of_time(f"{kind} {dtype} {direction} {name}"):
                continue
            for attr, value in patched(variant).items():
                setattr(cs, attr, value)
            try:
                call = calls[direction]
                err = relative_error(call(), expected[direction])  # the first call autotunes
                stats = time_stats_ms(call, SAMPLES, one_trace=True)
            finally:
                for attr, value in patched("new").items():
                    setattr(cs, attr, value)
            gbs = 2 * x.size * x.dtype.itemsize / (stats["median_ms"] * 1e-3) / 1e9
            ok = bool(err <= tolerance(dtype))
            run.log(f"{kind:6s} {dtype:8s} {direction} {name:28s} median {stats['median_ms']:.4f} "
                    f"min {stats['min_ms']:.4f} max {stats['max_ms']:.4f} ms "
                    f"{100 * gbs / copy_gbs:5.1f}% of copy  rel err {err:.1e}"
                    f"{'' if ok else '  FAILED'}")
            if not ok:
                run.failures.append(f"{kind} {dtype} {direction} {name}: rel err {err:.3g}")
            rows.append({"case": kind, "dtype": dtype, "dir": direction, "variant": name,
                         "median_ms": stats["median_ms"], "min_ms": stats["min_ms"],
                         "max_ms": stats["max_ms"], "pct_of_copy": 100 * gbs / copy_gbs,
                         "rel_err": err, "ok": ok})

    for dtype in DTYPES:  # the targets first: vector bf16 / fp32, scalar against XLA
        for variant in ("old", "new"):
            measure("vector", dtype, variant)
    for dtype in DTYPES:
        for variant in ("old", "new", "xla"):
            measure("scalar", dtype, variant)
    for dtype in DTYPES:
        measure("scalar", dtype, "new 1-pass", directions=("fwd",))
        measure("vector", dtype, "xla", directions=("fwd",))
    run.log("pinned tiles of _GLOBAL_TILES, forward (while the budget lasts)")
    for kind, _ in CASES:
        for dtype in DTYPES:
            for tile in cs._GLOBAL_TILES:
                if not (tile[5] and dtype == "float32"):  # no DOT for float32
                    measure(kind, dtype, cs.CumsumConfig(*tile), directions=("fwd",))
    if run.not_run:
        run.log(f"not run (budget): {len(run.not_run)} rows")
    print()
    print_table([r for r in rows if not r["variant"].startswith("pinned")],
                ["case", "dtype", "dir", "variant", "median_ms", "min_ms", "max_ms", "pct_of_copy",
                 "rel_err", "ok"])
    best = {}
    for r in rows:
        if r["variant"].startswith("pinned"):
            k = (r["case"], r["dtype"])
            if k not in best or r["median_ms"] < best[k]["median_ms"]:
                best[k] = r
    print("\nfastest pinned tile, forward:")
    print_table(list(best.values()), ["case", "dtype", "variant", "median_ms", "pct_of_copy"])
    run.finish()
    run.log("all results within tolerance")


def ejk_lite_ceilings() -> list[str]:
    from common import CEILINGS

    return [f"{k} {v:.0f}" for k, v in CEILINGS.get("copy_gbs_by_method", {}).items()]


if __name__ == "__main__":
    main()
