"""Probe (not a bench): ``chunk_global_cumsum`` on the vector case at pinned tiles, wide ones
among them, against its autotuned pick and the copy ceiling. (Session 24: now the scan on the
tensor cores, pinned, against the autotuner's pick; the wide tiles below were session 23's.)

Why: issue 19 wants the vector cumsum at >= 85% of copy; bfloat16 stays behind, bound by the
instructions of ``tl.cumsum``'s passing of partial sums between lanes and warps (the comment
above ``_GLOBAL_TILES``). A tile many columns wide and few tokens long (``BLOCK_C`` = 256 x
``num_warps``, eight 16-bit columns a lane) lets Triton lay each lane's columns along its own
registers, so that the scan along the tokens needs no shuffle (the sm_90 PTX of
``bench/_probe_cumsum_lookback.py``'s 16 x 1024 tile has none). Such tiles leave few walks
(2048 columns a row, 4 rows: 8192 columns), so ``SPLIT`` shares each walk between programs.
Each config is checked against float64 (the script fails on an error past the tolerance) and
timed: device time, 10 samples, min / median / max.

    python3 bench/_probe_cumsum_tiles.py            # GPU
    python3 bench/_probe_cumsum_tiles.py --quick    # interpreter: small shapes, checked only
    python3 bench/_probe_cumsum_tiles.py --repeat 2 --tiles '{"float32": [[128, 32, 4, 6, 1, 0]]}'
    python3 bench/_probe_cumsum_tiles.py --reverse --tiles '{"bfloat16": [[64, 64, 8, 1, 1, 1, 1]]}'
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ejk_lite  # noqa: E402, F401  (first: settles the Triton backend)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from common import copy_methods_gbs, probe_line  # noqa: E402
from ejk_lite import chunk_global_cumsum  # noqa: E402
from ejk_lite.cumsum import CumsumConfig  # noqa: E402

# (block_t, block_c, num_warps, num_stages, split, tensor_cores)
TILES = [(64, 64, 8, 6, 1, True), (64, 64, 4, 6, 1, True), (64, 128, 8, 4, 1, True),
         (128, 32, 4, 3, 1, False)]
QUICK_TILES = [(16, 32, 1, 3, 1, False), (16, 32, 1, 3, 4, True), (16, 64, 2, 2, 2, True)]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--tiles", help="JSON {dtype: [[block_t, block_c, warps, stages, split, "
                   "tensor_cores(, prefetch)], ...]}: pinned tiles instead of TILES, per dtype")
    p.add_argument("--repeat", type=int, default=1, help="time the whole list this often")
    p.add_argument("--reverse", action="store_true", help="the reverse sum (the backward's)")
    args = p.parse_args()
    by_dtype = json.loads(args.tiles) if args.tiles else None
    shape = (2, 100, 3, 16) if args.quick else (4, 4096, 16, 128)
    tiles = QUICK_TILES if args.quick else TILES
    rng = np.random.default_rng(0)
    copy = None if args.quick else max(copy_methods_gbs().values())
    failures = []
    for dtype in (tuple(by_dtype) if by_dtype else ("float32", "bfloat16")) * args.repeat:
        if by_dtype:
            tiles = [(*t[:5], *map(bool, t[5:7])) for t in by_dtype[dtype]]
        x = jnp.asarray(rng.standard_normal(shape), dtype)
        x64 = np.asarray(x, np.float64)
        expected = (np.flip(np.cumsum(np.flip(x64, 1), axis=1), 1) if args.reverse
                    else np.cumsum(x64, axis=1))
        rev = args.reverse
        fns = {"autotuned": jax.jit(lambda x: chunk_global_cumsum(x, reverse=rev, impl="triton"))}
        for t in tiles:
            cfg = CumsumConfig(*t)
            name = "{}x{} {}w {}st split {} tensor cores {}".format(*t[:6])
            fns[name + (" prefetch" if cfg.prefetch else "")] = jax.jit(
                lambda x, cfg=cfg: chunk_global_cumsum(x, reverse=rev, impl="triton", config=cfg))
        for name, fn in fns.items():
            print(probe_line(f"{dtype:9} {name:44}", fn, x, expected, failures, copy), flush=True)
    if failures:
        sys.exit("failed: " + "; ".join(failures))


if __name__ == "__main__":
    main()
