"""Probe (not a bench): the global cumsum's walk with its scan on the tensor cores.

Why: the walk of 16-bit inputs is bound by the instructions of ``tl.cumsum`` (the comment above
``_GLOBAL_TILES`` in ejk_lite/cumsum.py: about one warp instruction per element for tall tiles,
passing partial sums between lanes and warps). Here each block of ``BT`` tokens is scanned by
two matrix products and no reduction at all:

    sums  = L @ x + carry      L: [BT, BT] lower triangle of ones (exact in 16 bits)
    carry = 1 @ x + carry      1: [BT, BT] ones: every row of carry is the running total

``carry`` is a float32 [BT, BC] tile (every row the same), the products' accumulator, so the
sums are float32 all the way: x is exact in 16 bits, the ones are exact, the products too.
A float32 carry is the point: a carry rounded to 16 bits at every block would lose about
2**-9 a block. Each config is checked against float64 (the script fails on an error past the
tolerance) and timed: device time, 10 samples, min / median / max.

    python3 bench/_probe_cumsum_tc.py            # GPU
    python3 bench/_probe_cumsum_tc.py --quick    # interpreter: small shapes, checked only
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
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from common import copy_methods_gbs, probe_line  # noqa: E402
from ejk_lite import chunk_global_cumsum  # noqa: E402
from ejk_lite.launch import triton_call  # noqa: E402


@triton.jit
def tc_walk_kernel(x_ptr, T, out_ptr, C: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                   NUM_STAGES: tl.constexpr, ONE_DOT: tl.constexpr, FREE: tl.constexpr):
    cols = tl.program_id(0) * BC + tl.arange(0, BC)
    row = tl.program_id(1).to(tl.int64) * T * C
    r = tl.arange(0, BT)
    lower = (r[:, None] >= r[None, :]).to(x_ptr.dtype.element_ty)
    ones = tl.full([BT, BT], 1.0, x_ptr.dtype.element_ty)
    carry = tl.zeros([BT, BC], dtype=tl.float32)
    for first in tl.range(0, T, BT, num_stages=NUM_STAGES):
        tokens = first + r
        offsets = row + tokens[:, None] * C + cols[None, :]
        mask = (tokens < T)[:, None] & (cols < C)[None, :]
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0)
        if FREE:  # no product waits on the last block's: the carry is added elementwise
            sums = tl.dot(lower, x) + carry
        else:
            sums = tl.dot(lower, x, carry)
        tl.store(out_ptr + offsets, sums.to(out_ptr.dtype.element_ty), mask=mask)
        if FREE:
            carry += tl.dot(ones, x)
        elif ONE_DOT:  # the block's total from the sums' last row, broadcast (a reduction)
            last = tl.sum(tl.where((r == BT - 1)[:, None], sums, 0.0), axis=0)
            carry = tl.zeros([BT, BC], dtype=tl.float32) + last[None, :]
        else:
            carry = tl.dot(ones, x, carry)


def tc_walk(x, bt, bc, warps, stages, one_dot=False, free=False):
    b, t, h, k = x.shape
    c = h * k
    out = triton_call(x.reshape(b, t, c), t, kernel=tc_walk_kernel,
                      out_shape=jax.ShapeDtypeStruct((b, t, c), x.dtype),
                      grid=(triton.cdiv(c, bc), b), num_warps=warps, num_stages=stages,
                      C=c, BT=bt, BC=bc, NUM_STAGES=stages, ONE_DOT=one_dot, FREE=free)
    return out.reshape(x.shape)


# (BT, BC, warps, stages, one_dot)
TILES = [(64, 64, 4, 4, False), (64, 64, 4, 5, False), (64, 64, 4, 6, False),
         (64, 64, 4, 8, False), (64, 128, 4, 4, False), (64, 128, 4, 6, False),
         (128, 64, 4, 4, False), (128, 64, 4, 6, False), (64, 64, 8, 6, False),
         (32, 64, 4, 6, False), (64, 128, 8, 4, False), (32, 128, 4, 6, False)]
QUICK_TILES = [(16, 16, 1, 2, False), (32, 16, 2, 3, True), (16, 16, 1, 2, False, True)]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--tiles", help="JSON [[BT, BC, warps, stages, one_dot, free], ...] instead "
                   "of TILES, on the benchmark's shape only")
    args = p.parse_args()
    shape = (2, 100, 2, 16) if args.quick else (4, 4096, 16, 128)
    tiles = QUICK_TILES if args.quick else TILES
    if args.tiles:
        tiles = [tuple(t) for t in json.loads(args.tiles)]
    rng = np.random.default_rng(0)
    copy = None
    if not args.quick:
        copy = max(copy_methods_gbs().values())
        print(f"copy ceiling {copy:.0f} GB/s", flush=True)
    failures = []
    shapes = [shape] if args.quick or args.tiles else [shape, (8, 8192, 16, 128)]
    for shape in shapes:
        for dtype in ("bfloat16",):
            x = jnp.asarray(rng.standard_normal(shape), dtype)
            expected = np.cumsum(np.asarray(x, np.float64), axis=1)
            fns = {"main walk (autotuned)": jax.jit(
                lambda x: chunk_global_cumsum(x, impl="triton"))}
            for tile in tiles:
                fns["tc {}x{} {}w {}st one_dot={}".format(*tile[:5])
                    + (" free" if tile[5:] and tile[5] else "")] = jax.jit(
                    lambda x, tile=tile: tc_walk(x, *tile))
            for name, fn in fns.items():
                print(probe_line(f"{str(shape):18} {dtype:9} {name:32}", fn, x, expected,
                                 failures, copy), flush=True)
    if failures:
        sys.exit("failed: " + "; ".join(failures))


if __name__ == "__main__":
    main()
