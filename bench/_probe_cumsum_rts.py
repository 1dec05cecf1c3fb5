"""Probe (not a bench): a one-pass global cumsum whose look-back reads a window of predecessors
at once, against main's walk, a chunk-parallel scan with no carry (wrong sums: the bound) and
the copy ceiling.

Why: issue 19 wants the vector cumsum [4, 4096, 16, 128] at >= 85% of copy in bfloat16; main's
walk reaches about 46% on the H200 (too few walks for the bytes in flight), and the look-back
kernels tried in sessions 21-23 at best 64%. Those walked back one predecessor per round trip to
L2 (WINDOW 1), or a few as separate loads. Here a program reads W predecessors' status words as
one [W, BC] tile (one round trip), per column takes everything back to the closest inclusive
prefix, and spins only on words not yet published. MODE:

* 0: no status at all, each chunk scanned on its own (wrong sums past the first chunk: the
  upper bound for the design, the data moved once);
* 1: decoupled look-back, window W (aggregates published first, inclusive prefixes after);
* 2: aggregates only: every chunk reads all its predecessors' aggregates (W >= chunks), and
  publishes no inclusive prefix (no chain at all; reads grow as chunks squared).

Each config is checked against float64 (the script fails on an error past the tolerance) and
timed: device time, 10 samples, min / median / max.

    python3 bench/_probe_cumsum_rts.py            # GPU
    python3 bench/_probe_cumsum_rts.py --quick    # interpreter: small shapes, checked only
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
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from common import copy_methods_gbs, probe_line  # noqa: E402
from ejk_lite import chunk_global_cumsum, chunk_local_cumsum  # noqa: E402
from ejk_lite.launch import triton_call  # noqa: E402

AGGREGATE = tl.constexpr(1)
INCLUSIVE = tl.constexpr(2)
LOW = tl.constexpr(0xFFFFFFFF)


@triton.jit
def _word(value, FLAG: tl.constexpr):
    """A float32 [BC] as status words: the flag in the high 32 bits, the value's bits below."""
    bits = value.to(tl.uint32, bitcast=True).to(tl.int64)
    return bits | (FLAG << 32)


@triton.jit
def rts_kernel(x_ptr, status_in_ptr, ticket_in_ptr, diag_in_ptr, T, num_chunks,
               out_ptr, status_ptr, ticket_ptr, diag_ptr,
               C: tl.constexpr, SEG: tl.constexpr, BC: tl.constexpr, W: tl.constexpr,
               MODE: tl.constexpr, MAX_SPIN: tl.constexpr, TEST_AGGREGATES: tl.constexpr,
               TICKET: tl.constexpr, SLEEP: tl.constexpr):
    cb = tl.program_id(1)
    n = tl.program_id(2)
    if TICKET:  # chunks in the order programs start, not the order of their ids
        s = tl.atomic_add(ticket_ptr + n * tl.num_programs(1) + cb, 1)
    else:
        s = tl.program_id(0)
    cols = cb * BC + tl.arange(0, BC)
    tokens = s * SEG + tl.arange(0, SEG)
    offsets = n.to(tl.int64) * T * C + tokens[:, None] * C + cols[None, :]
    mask = tokens[:, None] < T
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
    local = tl.cumsum(x, axis=0)
    carry = tl.zeros([BC], dtype=tl.float32)
    if MODE != 0:
        total = tl.sum(x, axis=0)
        # The status words are int64; JAX (without x64) hands them over as pairs of int32.
        words_ptr = status_ptr.to(tl.pointer_type(tl.int64))
        chain = words_ptr + ((n * tl.num_programs(1) + cb).to(tl.int64) * num_chunks) * BC
        lane = tl.arange(0, BC)
        if (MODE == 1) & (s == 0):
            tl.store(chain + lane, _word(total, INCLUSIVE))
        else:
            tl.store(chain + s * BC + lane, _word(total, AGGREGATE))
        if s > 0:
            back = tl.arange(0, W)
            hi = tl.zeros([BC], dtype=tl.int32) + s  # per column: the window is rows hi-W..hi-1
            done = tl.zeros([BC], dtype=tl.int32)
            spins = 0
            while (tl.min(done) == 0) & (spins < MAX_SPIN):
                if SLEEP > 0:
                    if spins > 0:
                        tl.inline_asm_elementwise("nanosleep.u32 $1;\n mov.u32 $0, 0;", "=r,r",
                                                  [spins], dtype=tl.int32, is_pure=False, pack=1)
                rows = hi[None, :] - 1 - back[:, None]  # [W, BC], the closest first
                wanted = (rows >= 0) & (done[None, :] == 0)
                # Rows before the sequence (and columns already done) read as an inclusive 0.
                words = tl.load(chain + rows * BC + lane[None, :], mask=wanted,
                                other=INCLUSIVE << 32, volatile=True)
                flag = (words >> 32).to(tl.int32)
                value = (words & LOW).to(tl.uint32).to(tl.float32, bitcast=True)
                if MODE == 1:
                    closest = tl.min(tl.where(flag == INCLUSIVE, back[:, None], W), axis=0)
                else:
                    closest = tl.zeros([BC], dtype=tl.int32) + W
                needed = back[:, None] <= closest[None, :]
                ok = tl.min(tl.where(needed & (flag == 0), 0, 1), axis=0)  # [BC] all published
                take = (ok == 1) & (done == 0)
                carry += tl.sum(tl.where(needed & take[None, :], value, 0.0), axis=0)
                finished = take & ((closest < W) | (hi - W <= 0))
                hi = tl.where(take & ~finished, hi - W, hi)
                done = tl.where(finished, 1, done)
                spins += 1
            carry = tl.where(done == 1, carry, float("nan"))
            tl.atomic_add(diag_ptr, spins)
            tl.atomic_add(diag_ptr + 1, (spins > 1).to(tl.int32))
            if MODE == 1:
                if not TEST_AGGREGATES:
                    tl.store(chain + s * BC + lane, _word(total + carry, INCLUSIVE))
    tl.store(out_ptr + offsets, (local + carry[None, :]).to(out_ptr.dtype.element_ty), mask=mask)


def rts(x, seg, bc, warps, mode, window, ticket=0, sleep=0, test_aggregates=False,
        max_spin=1 << 20, diag=False):
    """Global cumsum over axis 1 of a [B, T, H, K] array (forward only)."""
    b, t, h, k = x.shape
    c = h * k
    chunks = -(-t // seg)
    if mode == 2:
        window = triton.next_power_of_2(chunks)
    status = jnp.zeros((2 * b * (c // bc) * chunks * bc,), jnp.int32)  # int64 words
    tickets = jnp.zeros((b * (c // bc),), jnp.int32)
    counts = jnp.zeros((2,), jnp.int32)
    shapes = [jax.ShapeDtypeStruct((b, t, c), x.dtype)] + [
        jax.ShapeDtypeStruct(a.shape, a.dtype) for a in (status, tickets, counts)]
    out, _, _, counts = triton_call(
        x.reshape(b, t, c), status, tickets, counts, t, chunks, kernel=rts_kernel,
        out_shape=shapes, grid=(chunks, c // bc, b), num_warps=warps, num_stages=1,
        input_output_aliases={1: 1, 2: 2, 3: 3},
        C=c, SEG=seg, BC=bc, W=window, MODE=mode, MAX_SPIN=max_spin,
        TEST_AGGREGATES=test_aggregates, TICKET=ticket, SLEEP=sleep)
    return (out.reshape(x.shape), counts) if diag else out.reshape(x.shape)


# (SEG, BC, warps, mode, window, ticket, sleep ns)
TILES = [(128, 32, 1, 0, 1), (64, 64, 1, 0, 1)] + [
    (seg, bc, 1, mode, 8 if mode == 1 else 0, ticket, sleep)
    for seg, bc in ((128, 32), (64, 64)) for mode in (1, 2) for ticket in (0, 1)
    for sleep in (0, 200)]
FIRST_TILES = [
    (128, 32, 1, 0, 1), (128, 64, 2, 0, 1), (64, 64, 1, 0, 1), (256, 32, 2, 0, 1),
    (128, 32, 1, 1, 8), (128, 32, 2, 1, 8), (128, 64, 2, 1, 8), (128, 64, 4, 1, 8),
    (64, 64, 1, 1, 8), (64, 64, 2, 1, 16), (256, 32, 2, 1, 8), (256, 64, 4, 1, 8),
    (128, 128, 4, 1, 8), (32, 128, 1, 1, 16), (128, 32, 1, 1, 32),
    (128, 32, 1, 2, 0), (128, 64, 2, 2, 0), (256, 32, 2, 2, 0), (256, 64, 4, 2, 0),
]
QUICK_TILES = [(16, 32, 1, 0, 1), (16, 32, 1, 1, 2), (8, 16, 2, 1, 4), (16, 32, 1, 2, 0),
               (32, 16, 1, 1, 2), (16, 32, 1, 1, 2, 1), (16, 32, 1, 2, 0, 1)]


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--dtypes", default="bfloat16,float32")
    args = p.parse_args()
    shape = (2, 100, 2, 32) if args.quick else (4, 4096, 16, 128)
    tiles = QUICK_TILES if args.quick else TILES
    rng = np.random.default_rng(0)
    copy = None
    if not args.quick:
        methods = copy_methods_gbs()
        copy = max(methods.values())
        print("copy ceiling", {k: round(v) for k, v in methods.items()}, flush=True)
    failures = []
    for dtype in args.dtypes.split(","):
        x = jnp.asarray(rng.standard_normal(shape), dtype)
        expected = np.cumsum(np.asarray(x, np.float64), axis=1)
        # name: (function, checked against float64, the tile whose spins are counted)
        fns = {"main walk (autotuned)": (jax.jit(lambda x: chunk_global_cumsum(x, impl="triton")),
                                         True, None),
               "main local64 (no carry)": (jax.jit(
                   lambda x: chunk_local_cumsum(x, 64, impl="triton")), False, None)}
        for tile in tiles:
            seg, bc, warps, mode, window = tile[:5]
            name = f"mode {mode} {seg}x{bc} {warps}w W{window} ticket/sleep {tile[5:]}"
            fns[name] = (jax.jit(lambda x, tile=tile: rts(x, *tile)), mode != 0,
                         tile if mode != 0 else None)
            if args.quick and mode == 1:
                fns[name + " aggregates only"] = (jax.jit(
                    lambda x, tile=tile: rts(x, *tile, test_aggregates=True)), True, None)
        for name, (fn, checked, counted) in fns.items():
            if counted is not None:  # the look-back's spins, counted in the kernel
                _, counts = rts(x, *counted, diag=True)
                name += f" spins {int(counts[0])}, spun {int(counts[1])}"
            print(probe_line(f"{dtype:9} {name:30}", fn, x, expected, failures, copy, checked),
                  flush=True)
    if failures:
        sys.exit("failed: " + "; ".join(failures))


if __name__ == "__main__":
    main()
