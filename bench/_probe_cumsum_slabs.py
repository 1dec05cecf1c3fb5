"""Probe (not a bench): ``chunk_global_cumsum`` of the vector benchmark taken a slab of rows at a
time through the two-pass path, and the walk at pinned tiles.

Why: the two-pass path (chunk totals, then the local kernel starting each chunk from the totals
before it) reads its input twice, the second time from L2 as long as the input fits there; the
benchmark's input, [4, 4096, 16, 128] (67 MB in bfloat16), does not fit the H200's L2 (50 MB),
one row of it (16 MB) does. So: time the two passes on one row, on two rows (the size bound
lifted), and the walk on the whole at pinned tiles, each against float64 and the copy ceiling.

    python3 bench/_probe_cumsum_slabs.py            # GPU
    python3 bench/_probe_cumsum_slabs.py --quick    # interpreter: small shapes, checked only
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ejk_lite  # noqa: E402, F401  (first: settles the Triton backend)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import ejk_lite.cumsum as cumsum  # noqa: E402
from common import copy_methods_gbs, probe_line  # noqa: E402
from ejk_lite import chunk_global_cumsum  # noqa: E402
from ejk_lite.cumsum import CumsumConfig  # noqa: E402

# (block_t, block_c, num_warps, num_stages, split)
WALK_TILES = [(64, 32, 4, 4, 1), (32, 32, 2, 4, 1), (64, 64, 4, 3, 1), (32, 64, 4, 4, 1),
              (128, 32, 4, 4, 1), (16, 128, 4, 4, 1), (32, 128, 4, 3, 1), (64, 32, 2, 3, 1),
              (128, 32, 4, 3, 1)]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()
    shape = (4, 300, 2, 32) if args.quick else (4, 4096, 16, 128)
    tiles = WALK_TILES[:2] if args.quick else WALK_TILES
    rng = np.random.default_rng(0)
    copy = None
    if not args.quick:
        copy = max(copy_methods_gbs().values())
        print(f"copy ceiling {copy:.0f} GB/s", flush=True)
    failures = []
    cumsum._TWO_PASS_MAX_BYTES = 1 << 40  # the probe decides what takes two passes: the walks
    cumsum._TWO_PASS_MAX_WALKS = 1 << 20  # test (rows, columns) on the whole input only
    for dtype in ("bfloat16", "float32"):
        x = jnp.asarray(rng.standard_normal(shape), dtype)
        expected = np.cumsum(np.asarray(x, np.float64), axis=1)
        cases = {}
        for rows in (1, 2, 4):
            cases[f"two passes, {rows} row(s)"] = (
                jax.jit(lambda x: chunk_global_cumsum(x, impl="triton")), x[:rows],
                expected[:rows])
        for t in tiles:
            cfg = CumsumConfig(*t)
            cases["walk {}x{} {}w {}st split {}".format(*t)] = (
                jax.jit(lambda x, cfg=cfg: chunk_global_cumsum(x, impl="triton", config=cfg)),
                x, expected)
        for name, (fn, arg, want) in cases.items():
            print(probe_line(f"{dtype:9} {name:30}", fn, arg, want, failures, copy), flush=True)
    if failures:
        sys.exit("failed: " + "; ".join(failures))


if __name__ == "__main__":
    main()
