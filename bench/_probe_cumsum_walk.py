"""Probe (not a bench): forms of the global cumsum's walk, side by side with the package's.

Why: issue 19 wants the vector cumsum ([4, 4096, 16, 128]) at >= 85% of the copy ceiling, and
the package's global walk sits at it (bench/results/cumsum.json, ddf12e5: float32 84.8% /
85.5%, bfloat16 83.6% / 82.5%, forward / backward). The walk here is the package's
(``_scan_blocks`` in ejk_lite/cumsum.py, non-packed rows, the scale multiplied as there) with
one thing changed at a time:

* ``mode``: how a block is scanned.
  ``walk``: ``tl.cumsum`` + a ``[BC]`` carry (the package's float32 path);
  ``dot``: ``L @ x`` accumulated onto the carry tile, ``1 @ x`` likewise (the package's 16-bit
  path); ``free``: ``L @ x`` from zero, the carry added elementwise, so no product waits on the
  last block's (``bench/_probe_cumsum_tc.py``'s FREE);
  ``tf32x2``: float32 on the tensor cores, x split into ``hi`` (x with its low 13 mantissa bits
  cleared: exact in TF32) and ``lo = x - hi`` (13 significant bits, of which TF32 keeps 11:
  an error below 2**-20 |x| an element), ``L @ lo + L @ hi`` onto the carry (four products a
  block). ``L`` is exact in TF32, so no split of it is needed (Triton's ``tf32x3`` splits both).
* ``unmasked``: full blocks in a loop with no token mask (and no column mask where the tile
  divides the columns), the last partial block after it, masked.

* ``lookback`` (its own kernel): one block a program, chained to the blocks before it by a
  decoupled look-back (``lookback_kernel``), ``dot`` = 1 for the block scanned as ``L @ x``.

Measured (H200, [4, 4096, 16, 128], % of the copy ceiling, 4311 GB/s in the first run): two
runs of two passes each, the first with the forms now in FORMS, the second (as first committed)
with the look-back tiles added; the four figures of a form are run 1 then run 2:

* bfloat16: the package (autotuned) 84.7, 84.8, -, 83.7 (run 2's first line is not in the
  log kept); the walk pinned to the package's tile (64 x 64, 8 warps, 6 stages, ``dot``) 84.8,
  84.3, 84.6, 84.3; ``free`` at 6 stages 84.4 and 85.0, unmasked 82.7 and 83.8 (run 1 only);
  ``free`` unmasked at 7 stages 84.6, 86.1, 85.3, 85.7 (about 1 point over the package's, no
  more than the spread between runs); 4 warps 74.7 and 74.1.
* float32: the package 84.9, 84.7, 84.0, 84.0; the walk 128 x 32, 4 warps, 3 stages, 82.1,
  82.0, 80.8, 80.7 masked and 84.0, 84.2, 84.4, 84.3 unmasked (the package, autotuned, runs as
  fast as the unmasked one); 64 x 32 73.6, 128 x 16 77.8; ``tf32x2`` 25.4
  (64 x 64, 8 warps), 51.0 (64 x 32), 73.8 and 74.2 (32 x 64), relative error 7.2e-6 against
  the tolerance 1e-5: slower and less exact.
* the look-back: slower everywhere, 27.8 to 40.2% in bfloat16 and 53.1 to 72.5% in float32 (the
  best: 128 x 32, 4 warps), and *wrong* on four tiles of 64 or 128 columns (64 x 64 bfloat16 and
  float32, 64 x 128 and 128 x 64 bfloat16; the last in one pass of two; relative errors 3.1e-2
  to 9.6e-2; right on the tiles of 32 or 16 columns). A likely cause, not verified: a column's
  ``[BC]`` look-back state is held by several threads (Triton replicates a row's slice across
  the threads of the token axis), each of which reads the published word on its own; two copies
  can read it on either side of a publish and go on with different prefixes. Its time is spent
  waiting, not moving bytes: left there.

After these two runs nothing here was a win beyond the spread. Then:

A third run (``--hinted-copy`` and the forms with a seventh field, ``hints``: loads
``evict_first``, stores ``.cs``): the hinted copy 4178 GB/s (1024 a program) and 4068 (4096),
below the plain Triton copy's 4308: the hints do not raise the ceiling. (That run timed the
hinted copy with a kernel of this file's own, since folded into ``common._copy_kernel``.)
bfloat16, two passes: the package 83.7, 84.8; 64 x 64, 8 warps, ``dot`` at 6 stages 84.3, 84.7
(hinted 85.1, 84.1); ``free`` at 7 stages 87.5, 87.0 masked (hinted 87.7, 86.7), 85.7, 85.5
unmasked (hinted 84.5, 84.5); at 8 stages unmasked hinted 85.9, 85.2. float32: the package 85.0,
84.1; 128 x 32 unmasked 84.8, 83.5, hinted 82.7, 83.4; masked hinted 81.9, 81.4; 256 x 32 8
warps 2 stages hinted 63.9, 63.1; 128 x 32 at 4 stages hinted 75.4, 74.2. A fourth (one pass): 7
stages, masked, ``dot`` 87.3 and ``free`` 86.1. So seven stages, not the elementwise carry or
the hints, is what helps: the package's 16-bit tile now has 7 (the comment above
``_GLOBAL_TILES``).

Session 31 added two forms. ``copy``: the walk's loads and stores with no scan (checked against
x itself), the bound its tile and stages put on it. ``prefetch1``/``prefetch2``: the float32
walk with Triton's pipelining off, the next one or two blocks loaded into registers before the
current one is scanned (``prefetch_kernel``). Two runs (H200, copy ceiling 4288 and 4306 GB/s),
of two and three passes; the figures of a form are its passes in order:

* float32, run 1: the package 84.7, 84.6; 128 x 32 4 warps 3 stages ``walk`` 82.1, 81.6, ``copy``
  90.6, 88.7; ``copy`` 128 x 64 91.6, 90.6, 128 x 128 91.5, 88.1, 64 x 256 52.7, 52.7;
  ``prefetch1`` 128 x 32 4 warps 86.9, 85.6, ``prefetch2`` 85.4, 85.2; ``prefetch2`` 64 x 32
  72.4, 72.5, 128 x 32 8 warps 70.0, 70.1, 64 x 32 2 warps 71.9, 71.6.
* bfloat16, run 1: the package 85.0, 86.4; 64 x 64 8 warps 7 stages ``dot`` 86.6, 87.7,
  ``copy`` 91.7, 88.6; ``copy`` 64 x 128 83.5, 82.7, 64 x 256 4 stages 61.5, 62.4.
* float32, run 2: the package 84.5, 84.4, 84.7; ``prefetch1`` 128 x 32 4 warps 86.1, 86.2, 86.5;
  256 x 32 82.2, 80.7, 81.8; 128 x 64 81.3, 81.2, 81.1; 128 x 16 2 warps 84.7, 84.0, 84.7;
  256 x 16 59.3, 59.8, 59.1; 64 x 64 71.0, 71.6, 71.6; ``walk`` 128 x 128 3 stages 25.9 (all
  three); ``walk`` 128 x 32 2 stages 59.4, 59.0, 59.4.

So the float32 walk gains about 1.5 points from holding one block ahead in registers: the
package's float32 tiles now include it (``PREFETCH``, the comment above ``_GLOBAL_TILES``).

Each form is checked against float64 by the tests' metric and tolerance (the script fails on an
error past it) and timed: device time, 10 samples, min / median / max; ``--repeat`` times the
whole list again, so that the spread between runs shows.

    python3 bench/_probe_cumsum_walk.py            # GPU
    python3 bench/_probe_cumsum_walk.py --quick    # interpreter: small shapes, checked only
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

MODES = {"walk": 0, "dot": 1, "free": 2, "tf32x2": 3, "copy": 4}


@triton.jit
def _block(x, carry, lower, ones, MODE: tl.constexpr):
    """One block's sums and the carry after it (``carry``: ``[BC]`` for ``walk``, else a tile)."""
    if MODE == 0:
        x = x.to(tl.float32)
        sums = tl.cumsum(x, axis=0) + carry[None, :]
        carry += tl.sum(x, axis=0)
    elif MODE == 1:
        sums = tl.dot(lower, x, carry)
        carry = tl.dot(ones, x, carry)
    elif MODE == 2:
        sums = tl.dot(lower, x) + carry
        carry += tl.dot(ones, x)
    elif MODE == 4:
        sums = x.to(tl.float32)  # no scan: what the walk's loads and stores alone cost
    else:
        hi = (x.to(tl.int32, bitcast=True) & -8192).to(tl.float32, bitcast=True)
        lo = x - hi
        sums = tl.dot(lower, hi, tl.dot(lower, lo, carry, input_precision="tf32"),
                      input_precision="tf32")
        carry = tl.dot(ones, hi, tl.dot(ones, lo, carry, input_precision="tf32"),
                       input_precision="tf32")
    return sums, carry


@triton.jit
def walk_kernel(x_ptr, T, scale, out_ptr, C: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                NUM_STAGES: tl.constexpr, MODE: tl.constexpr, UNMASKED: tl.constexpr,
                HINTS: tl.constexpr):
    cols = tl.program_id(0) * BC + tl.arange(0, BC)
    col_mask = cols < C
    row = tl.program_id(1).to(tl.int64) * T * C
    x_ptr += row
    out_ptr += row
    scale = tl.cast(scale, tl.float32)
    r = tl.arange(0, BT)
    # HINTS: every element is read once and written once, so ask the caches not to keep them
    EVICT: tl.constexpr = "evict_first" if HINTS else ""
    STORE_CACHE: tl.constexpr = ".cs" if HINTS else ""
    if MODE == 0:
        carry = tl.zeros([BC], dtype=tl.float32)
        lower = None
        ones = None
    else:
        carry = tl.zeros([BT, BC], dtype=tl.float32)
        lower = (r[:, None] >= r[None, :]).to(x_ptr.dtype.element_ty)
        ones = tl.full([BT, BT], 1.0, x_ptr.dtype.element_ty)
    walked = 0
    if UNMASKED:
        EVEN_C: tl.constexpr = C % BC == 0
        walked = T // BT * BT
        for first in tl.range(0, walked, BT, num_stages=NUM_STAGES):
            offsets = (first + r)[:, None] * C + cols[None, :]
            if EVEN_C:
                x = tl.load(x_ptr + offsets, eviction_policy=EVICT)
            else:
                x = tl.load(x_ptr + offsets, mask=col_mask[None, :], other=0.0,
                            eviction_policy=EVICT)
            sums, carry = _block(x, carry, lower, ones, MODE)
            if EVEN_C:
                tl.store(out_ptr + offsets, (sums * scale).to(out_ptr.dtype.element_ty),
                         cache_modifier=STORE_CACHE)
            else:
                tl.store(out_ptr + offsets, (sums * scale).to(out_ptr.dtype.element_ty),
                         mask=col_mask[None, :], cache_modifier=STORE_CACHE)
    for first in tl.range(walked, T, BT, num_stages=NUM_STAGES):
        tokens = first + r
        offsets = tokens[:, None] * C + cols[None, :]
        mask = (tokens[:, None] < T) & col_mask[None, :]
        x = tl.load(x_ptr + offsets, mask=mask, other=0.0)
        sums, carry = _block(x, carry, lower, ones, MODE)
        tl.store(out_ptr + offsets, (sums * scale).to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _load_block(x_ptr, first, r, cols, T, C: tl.constexpr):
    tokens = first + r
    mask = (tokens[:, None] < T) & (cols[None, :] < C)
    return tl.load(x_ptr + tokens[:, None] * C + cols[None, :], mask=mask, other=0.0)


@triton.jit
def prefetch_kernel(x_ptr, T, scale, out_ptr, C: tl.constexpr, BT: tl.constexpr,
                    BC: tl.constexpr, AHEAD: tl.constexpr):
    """The float32 walk (``walk``) without Triton's pipelining (no ``cp.async`` into shared
    memory): the next ``AHEAD`` blocks are loaded into registers before the current one is
    scanned, so that their loads are in flight during the scan."""
    cols = tl.program_id(0) * BC + tl.arange(0, BC)
    row = tl.program_id(1).to(tl.int64) * T * C
    x_ptr += row
    out_ptr += row
    scale = tl.cast(scale, tl.float32)
    r = tl.arange(0, BT)
    carry = tl.zeros([BC], dtype=tl.float32)
    x0 = _load_block(x_ptr, 0, r, cols, T, C)
    x1 = x0
    if AHEAD == 2:
        x1 = _load_block(x_ptr, BT, r, cols, T, C)
    for first in tl.range(0, T, BT, num_stages=1):
        if AHEAD == 2:
            x2 = _load_block(x_ptr, first + 2 * BT, r, cols, T, C)
        else:
            x1 = _load_block(x_ptr, first + BT, r, cols, T, C)
        x = x0.to(tl.float32)
        sums = tl.cumsum(x, axis=0) + carry[None, :]
        carry += tl.sum(x, axis=0)
        tokens = first + r
        mask = (tokens[:, None] < T) & (cols[None, :] < C)
        tl.store(out_ptr + tokens[:, None] * C + cols[None, :],
                 (sums * scale).to(out_ptr.dtype.element_ty), mask=mask)
        if AHEAD == 2:
            x0 = x1
            x1 = x2
        else:
            x0 = x1


@triton.jit
def lookback_kernel(x_ptr, T, scale, scratch_ptr, out_ptr, scratch_out_ptr,
                    C: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr, LANES: tl.constexpr,
                    COL_TILES: tl.constexpr, DOT: tl.constexpr):
    """One block of ``BT`` tokens a program, chained to the blocks before it by a decoupled
    look-back (Merrill & Garland, "Single-pass parallel prefix scan with decoupled look-back",
    2016): the program publishes its block's total (flag 1), adds up the totals of the blocks
    before it, walking back until one has published its inclusive prefix (flag 2), then
    publishes its own inclusive prefix and writes its sums. Flag and float32 value share one
    64-bit word a column, written at once, so a reader never sees one without the other.
    Programs take blocks in the order of a ticket (an atomic counter), so the blocks a program
    waits for went to programs already running: no deadlock whatever order the GPU starts
    programs in."""
    ticket = tl.atomic_add(scratch_out_ptr, 1)  # (scratch_ptr: the same buffer, aliased)
    block = ticket // LANES
    lane = ticket % LANES
    row = lane // COL_TILES
    cols = (lane % COL_TILES) * BC + tl.arange(0, BC)
    col_mask = cols < C
    r = tl.arange(0, BT)
    tokens = block * BT + r
    offsets = row.to(tl.int64) * T * C + tokens[:, None] * C + cols[None, :]
    mask = (tokens[:, None] < T) & col_mask[None, :]
    x = tl.load(x_ptr + offsets, mask=mask, other=0.0)
    total = tl.sum(x.to(tl.float32), axis=0)
    if DOT:
        lower = (r[:, None] >= r[None, :]).to(x_ptr.dtype.element_ty)
        sums = tl.dot(lower, x)
    else:
        sums = tl.cumsum(x.to(tl.float32), axis=0)
    state = (scratch_out_ptr + 2).to(tl.pointer_type(tl.int64), bitcast=True)
    blocks = tl.cdiv(T, BT)
    mine = state + (row * blocks + block) * C + cols
    bits = total.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    prefix = tl.zeros([BC], dtype=tl.float32)
    if block == 0:
        tl.atomic_xchg(mine, bits | (2 << 32), mask=col_mask, sem="relaxed")
    else:
        tl.atomic_xchg(mine, bits | (1 << 32), mask=col_mask, sem="relaxed")
        look = tl.zeros([BC], dtype=tl.int32) + block - 1
        done = cols >= C
        while tl.sum(tl.where(done, 0, 1), axis=0) > 0:
            word = tl.load(state + (row * blocks + look) * C + cols, mask=~done, other=0,
                           volatile=True)
            flag = (word >> 32).to(tl.int32)
            value = (word & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)
            got = (flag > 0) & ~done
            prefix += tl.where(got, value, 0.0)
            done = done | (flag == 2)
            look = tl.where(got & (flag == 1), look - 1, look)
        bits = (total + prefix).to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
        tl.atomic_xchg(mine, bits | (2 << 32), mask=col_mask, sem="relaxed")
    sums = (sums + prefix[None, :]) * tl.cast(scale, tl.float32)
    tl.store(out_ptr + offsets, sums.to(out_ptr.dtype.element_ty), mask=mask)


def lookback(x, bt, bc, warps, dot):
    b, t, h, k = x.shape
    c = h * k
    col_tiles = triton.cdiv(c, bc)
    blocks = triton.cdiv(t, bt)
    # uint32 words: the ticket, one spare (8-byte alignment), then a 64-bit word a column a block
    scratch = jnp.zeros((2 + 2 * b * blocks * c,), jnp.uint32)
    out, _ = triton_call(x.reshape(b, t, c), t, 1.0, scratch, kernel=lookback_kernel,
                         out_shape=[jax.ShapeDtypeStruct((b, t, c), x.dtype),
                                    jax.ShapeDtypeStruct(scratch.shape, scratch.dtype)],
                         input_output_aliases={1: 1}, grid=(b * col_tiles * blocks,),
                         num_warps=warps, num_stages=1, C=c, BT=bt, BC=bc, LANES=b * col_tiles,
                         COL_TILES=col_tiles, DOT=bool(dot))
    return out.reshape(x.shape)


def walk(x, bt, bc, warps, stages, mode, unmasked, hints=0):
    b, t, h, k = x.shape
    c = h * k
    if mode.startswith("prefetch"):  # prefetch1, prefetch2: AHEAD blocks in registers
        out = triton_call(x.reshape(b, t, c), t, 1.0, kernel=prefetch_kernel,
                          out_shape=jax.ShapeDtypeStruct((b, t, c), x.dtype),
                          grid=(triton.cdiv(c, bc), b), num_warps=warps, num_stages=1,
                          C=c, BT=bt, BC=bc, AHEAD=int(mode[-1]))
        return out.reshape(x.shape)
    out = triton_call(x.reshape(b, t, c), t, 1.0, kernel=walk_kernel,
                      out_shape=jax.ShapeDtypeStruct((b, t, c), x.dtype),
                      grid=(triton.cdiv(c, bc), b), num_warps=warps, num_stages=stages,
                      C=c, BT=bt, BC=bc, NUM_STAGES=stages, MODE=MODES[mode],
                      UNMASKED=bool(unmasked), HINTS=bool(hints))
    return out.reshape(x.shape)


# dtype -> [(BT, BC, warps, stages, mode, unmasked)]
FORMS = {
    "bfloat16": [(64, 64, 8, 6, "dot", 0), (64, 64, 8, 6, "dot", 1), (64, 64, 8, 6, "free", 0),
                 (64, 64, 8, 6, "free", 1), (64, 64, 8, 7, "free", 1),
                 (64, 64, 4, 6, "free", 1)],
    "float32": [(128, 32, 4, 3, "walk", 0), (128, 32, 4, 3, "walk", 1),
                (64, 32, 4, 3, "walk", 1), (128, 16, 4, 3, "walk", 1),
                (64, 64, 8, 4, "tf32x2", 1), (64, 32, 4, 4, "tf32x2", 1),
                (32, 64, 4, 4, "tf32x2", 1)],
}
QUICK_FORMS = {
    "bfloat16": [(16, 16, 1, 2, "dot", 0), (16, 32, 1, 2, "free", 1),
                 (16, 16, 1, 1, "lookback", 1), (32, 32, 1, 1, "lookback", 0)],
    "float32": [(16, 16, 1, 1, "lookback", 0), (16, 16, 1, 2, "walk", 1),
                (16, 32, 1, 2, "tf32x2", 1),
                (32, 16, 1, 2, "tf32x2", 0), (16, 32, 1, 2, "copy", 0),
                (16, 16, 1, 1, "prefetch1", 0), (32, 16, 1, 1, "prefetch2", 0)],
}


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--forms", help="JSON {dtype: [[BT, BC, warps, stages, mode, unmasked]]} "
                   "instead of FORMS; mode 'lookback' takes [BT, BC, warps, 1, 'lookback', dot]")
    p.add_argument("--hinted-copy", action="store_true",
                   help="the copy ceiling also tried with the walk's cache hints")
    p.add_argument("--repeat", type=int, default=1, help="time the whole list this often")
    args = p.parse_args()
    forms = QUICK_FORMS if args.quick else FORMS
    if args.forms:
        forms = json.loads(args.forms)
    # the quick shape: 100 tokens (not a multiple of a block), 48 columns (not of 32)
    shape = (2, 100, 3, 16) if args.quick else (4, 4096, 16, 128)
    rng = np.random.default_rng(0)
    copy = None
    if not args.quick:
        methods = copy_methods_gbs(hinted=args.hinted_copy)
        copy = max(methods.values())
        print(f"copy ceiling {copy:.0f} GB/s", {k: round(v) for k, v in methods.items()},
              flush=True)
    failures = []
    for _ in range(args.repeat):
        for dtype, tiles in forms.items():
            x = jnp.asarray(rng.standard_normal(shape), dtype)
            expected = np.cumsum(np.asarray(x, np.float64), axis=1)
            copies = set()  # the "copy" forms: checked against x itself
            fns = {"package (autotuned)": jax.jit(
                lambda x: chunk_global_cumsum(x, impl="triton"))}
            for t in tiles:
                if t[4] == "lookback":
                    fns["{}x{} {}w lookback dot={}".format(*t[:3], t[5])] = jax.jit(
                        lambda x, t=tuple(t): lookback(x, *t[:3], t[5]))
                    continue
                if t[4] == "copy":
                    copies.add("{}x{} {}w {}st {} unmasked={}".format(*t[:6]))
                fns["{}x{} {}w {}st {} unmasked={}".format(*t[:6])
                    + (" hints" if t[6:] and t[6] else "")] = jax.jit(
                    lambda x, t=tuple(t): walk(x, *t))
            for name, fn in fns.items():
                want = np.asarray(x, np.float64) if name in copies else expected
                print(probe_line(f"{dtype:9} {name:36}", fn, x, want, failures, copy),
                      flush=True)
    if failures:
        sys.exit("failed: " + "; ".join(failures))


if __name__ == "__main__":
    main()
