"""Mean pooling over the token axis, and its block-wise variant, as Triton kernels for JAX.

``mean_pooling`` turns a sequence of token vectors into one vector, their average::

    out[b, :] = (1 / T) * sum_t x[b, t, :]

the usual way to get a sentence embedding from a transformer's token states (Reimers & Gurevych,
*Sentence-BERT*, 2019). ``block_mean_pooling`` keeps one average per block of ``block_size``
consecutive tokens instead, a cheap way to compress keys and values for sparse attention (the
"compressed" branch of Native Sparse Attention, Yuan et al. 2025, pools blocks of keys).

Both accept a padded batch ``(batch, seq_len, *rest)`` or a packed one ``(total_tokens, *rest)``
with ``cu_seqlens`` (see :mod:`ejk_lite.packing`). Inside, ``rest`` is flattened to one feature
axis of size ``F`` and a padded batch is just a packed one whose sequences all have length
``seq_len``: ``cu_seqlens = [0, T, 2T, ...]``. So every kernel below sees a row-major
``(tokens, F)`` matrix and a list of row ranges.

The algorithm (one HBM pass each way)
-------------------------------------
Pooling reads every element of ``x`` once and does one addition per element: it is bound by
memory bandwidth, and a good kernel is one that keeps enough loads in flight on every SM.

* **Forward.** A program owns ``BLOCK_D`` features and walks down a range of tokens ``BLOCK_T``
  (= ``chunk_size``) rows at a time, adding each tile into a ``(BLOCK_T, BLOCK_D)`` float32
  accumulator; one reduction over the rows at the end gives the sum. One program per (sequence,
  feature tile) is the obvious grid, and too small when there are few sequences: 8 sequences of
  hidden size 4096 make 128 programs for 132 SMs, each streaming 8192 tokens; and with sequences of
  random lengths the longest one decides the time. So the token axis is cut into tiles of
  ``TILE_TOKENS`` tokens, whatever the sequences, and two kernels share the work:

  1. ``mean_pool_pieces_kernel``, one program per (token tile, feature tile), sums the *pieces* of
     the sequences that cross the tile's edges (at most two per tile) into float32 rows; where
     few sequences overlap its tile, also the long ones that lie inside it;
  2. ``mean_pool_finish_kernel``, one program per (sequence, feature tile), sums the other
     sequences that lie inside one tile straight from ``x``, or adds up a sequence's pieces (or
     takes its sum from the pieces kernel), and divides by its length.

  Every token of a sequence is read once, by one of the two, and no program has more than
  ``TILE_TOKENS`` tokens to read. (The book's chapter builds this design with every sequence
  inside a tile left to the finish kernel; the long ones moved to the pieces kernel took the
  benchmark's packed forward from 0.210 to 0.204 ms: see ``_WALK_SEQS``.)
  Three details decide the speed
  (measured on an H100, see ``bench/mean_pooling.py``): the loop over a tile keeps ``NUM_STAGES``
  tiles of loads in flight (Triton's software pipelining, ``tl.range(..., num_stages=...)``);
  the feature tile is the fastest-varying index of the grid, so programs running together read
  whole rows side by side (``_work_item``); and the feature count is a compile-time constant
  (``NUM_FEATURES``), so the compiler knows that every row starts 16-byte aligned and loads eight
  bf16 at a time (jax-triton passes a Python int without that divisibility hint). This is a segmented reduction with the
  carries between tiles made explicit (the split-K pattern; Flash-Decoding does the same for
  attention over a long KV axis). Finding a tile's sequences is a binary search over
  ``cu_seqlens`` inside the kernel, so nothing is computed by XLA before the launch, and a
  ``cu_seqlens`` traced under ``jax.jit`` costs nothing extra.
* **Backward.** ``out = sum(x) / n`` is linear, so ``dx[t] = dout[seq(t)] / n``: the gradient is
  ``dout`` broadcast over each sequence's tokens. One program per (token tile, feature tile) walks
  the sequences overlapping its tile, reads each one's ``dout`` row once and writes it, divided by
  the length, over the overlap: ``dx`` is written once and ``dout`` (tiny) read once per tile.
* **Blocks.** ``block_mean_pooling`` has one program per (block, feature tile), a wider tile
  (512 features) because a block is too short a loop to pipeline; the block list
  comes from :func:`ejk_lite.prepare_chunk_indices` with ``chunk_size=block_size``. Each block is
  divided by its own length, so the last, shorter block of a sequence is a true mean.

All accumulation is in float32, whatever the input dtype; outputs (and gradients) have the input's
dtype. A zero-length sequence pools to zeros (its sum, 0, divided by max(n, 1)).

Every kernel also takes a second grid axis of *rows*, independent copies of the problem sharing
``cu_seqlens``: ``jax.vmap`` folds its mapped axis into them, so a batch is one launch.

Tiles (``config=``): a :class:`PoolingConfig`; its ``None`` fields are chosen from the shapes,
and ``config=None`` takes every default (the settings measured best on an H100).

``impl="xla"`` computes the same functions with plain ``jnp`` (a mean, or ``jax.ops.segment_sum``
for packed input) and lets JAX differentiate them; ``reference`` and ``reference_blocks`` are
deliberately naive loops that tests and the book check both against.
"""

from __future__ import annotations

import dataclasses
import math
from functools import partial
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl
from jax import Array

from ejk_lite.checks import (
    check_config,
    check_floating,
    check_triton_dtype,
    concrete_value,
    freeze_fields,
    next_power_of_2,
    resolve_impl,
    static_int,
    validated_fields,
)
from ejk_lite.launch import triton_call, vmap_by_folding
from ejk_lite.packing import (
    cdiv,
    checked_cu_seqlens,
    prepare_chunk_indices,
    prepare_chunk_offsets,
    prepare_lens,
    prepare_position_ids,
    prepare_sequence_ids,
    sanitize_cu_seqlens,
)

__all__ = ["mean_pooling", "block_mean_pooling", "reference", "reference_blocks", "PoolingConfig"]


# ----------------------------------------------------------------------------------------------
# Kernels. Every array is a row-major (rows, NUM_FEATURES) matrix. A program handles the features
# cols = d_tile * BLOCK_D + arange(BLOCK_D) of some range of rows (tokens).
# ----------------------------------------------------------------------------------------------


@triton.jit
def _boundary(cu_seqlens_ptr, i, num_tokens):
    """``cu_seqlens[i]`` clipped to ``[0, num_tokens]``: a traced ``cu_seqlens`` with bad values
    gives wrong numbers, but never a load or store out of bounds."""
    return tl.minimum(tl.maximum(tl.load(cu_seqlens_ptr + i), 0), num_tokens)


@triton.jit
def _sequence_at(cu_seqlens_ptr, num_seqs, token, SEARCH_STEPS: tl.constexpr):
    """The first sequence that ends after ``token``: the one holding it, or ``num_seqs`` if none.

    A binary search over the ends ``cu_seqlens[1:]`` for the answer in ``[0, num_seqs]``;
    ``SEARCH_STEPS = num_seqs.bit_length()`` halvings of those ``num_seqs + 1`` candidates always
    suffice. ``cu_seqlens`` is tiny and stays in cache: a handful of cached loads.
    """
    lo = 0
    hi = num_seqs
    for _ in tl.static_range(SEARCH_STEPS):
        searching = lo < hi
        mid = (lo + hi) // 2
        end_of_mid = tl.load(cu_seqlens_ptr + mid + 1, mask=searching, other=0)
        lo = tl.where(searching & (end_of_mid <= token), mid + 1, lo)
        hi = tl.where(searching & (end_of_mid > token), mid, hi)
    return lo


@triton.jit
def _work_item(NUM_FEATURES: tl.constexpr, BLOCK_D: tl.constexpr):
    """This program's ``(item, feature tile, row)``; an item is a token tile, a sequence or a
    block.

    Grid axis 1 is the *row*: independent copies of the whole problem that share ``cu_seqlens``
    (one, unless ``jax.vmap`` folded a mapped axis into it); the row comes back as an int64,
    ready to scale a row stride. Grid axis 0 has ``items * feature_tiles`` programs with the
    feature tile varying fastest. The GPU starts programs roughly in id order, so the programs
    running side by side read the *same rows* of ``x``, each its own ``BLOCK_D`` columns:
    together, whole contiguous rows. With the item varying fastest instead, hundreds of programs
    would each read a narrow column strip, rows ``F`` elements apart, which DRAM serves less well
    (measured on an H100: a few points of bandwidth, forward and backward).
    """
    feature_tiles: tl.constexpr = (NUM_FEATURES + BLOCK_D - 1) // BLOCK_D
    program = tl.program_id(0)
    return program // feature_tiles, program % feature_tiles, tl.program_id(1).to(tl.int64)


@triton.jit
def _sum_rows(x_ptr, start, end, NUM_FEATURES: tl.constexpr, cols, col_mask,
              BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, NUM_STAGES: tl.constexpr):
    """Float32 sum of the rows ``[start, end)`` of ``x`` over the columns ``cols``.

    Tiles are added into a ``(BLOCK_T, BLOCK_D)`` accumulator and reduced over rows once at the
    end, so the loop is nothing but loads and adds. With ``NUM_STAGES > 1`` Triton pipelines the
    loop: the loads of the next ``NUM_STAGES - 1`` tiles are issued (asynchronously, into shared
    memory) before the current one is added, so each program keeps that many tiles in flight.
    """
    rows = tl.arange(0, BLOCK_T)
    ptrs = x_ptr + start.to(tl.int64) * NUM_FEATURES + rows[:, None] * NUM_FEATURES + cols[None, :]
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for t in tl.range(start, end, BLOCK_T, num_stages=NUM_STAGES):
        mask = ((t + rows) < end)[:, None] & col_mask[None, :]
        acc += tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        ptrs += BLOCK_T * NUM_FEATURES
    return tl.sum(acc, axis=0)


@triton.jit
def _fill_rows(dx_ptr, start, end, NUM_FEATURES: tl.constexpr, cols, col_mask, value,
               BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    """Write the row vector ``value`` (over ``cols``) into every row ``[start, end)`` of ``dx``."""
    rows = tl.arange(0, BLOCK_T)
    tile = tl.broadcast_to(value[None, :], (BLOCK_T, BLOCK_D)).to(dx_ptr.dtype.element_ty)
    ptrs = dx_ptr + start.to(tl.int64) * NUM_FEATURES + rows[:, None] * NUM_FEATURES + cols[None, :]
    for t in range(start, end, BLOCK_T):
        mask = ((t + rows) < end)[:, None] & col_mask[None, :]
        tl.store(ptrs, tile, mask=mask)
        ptrs += BLOCK_T * NUM_FEATURES


@triton.jit
def _walked(first, last, WALK_SEQS: tl.constexpr):
    """Whether the pieces kernel sums every long sequence of a tile, not just its two pieces:
    when at most ``WALK_SEQS`` sequences overlap it, counting empty ones and the tokens past
    ``cu_seqlens[-1]`` as one more (``first``, ``last``: the sequences at its first and last
    token). Both kernels ask, so they agree on who sums what."""
    return last - first < WALK_SEQS


@triton.jit
def mean_pool_pieces_kernel(
    x_ptr, cu_seqlens_ptr, num_seqs, num_tokens,
    pieces_ptr,
    NUM_FEATURES: tl.constexpr, TILE_TOKENS: tl.constexpr, SEARCH_STEPS: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, NUM_STAGES: tl.constexpr,
    WALK_SEQS: tl.constexpr, WALK_MIN_TOKENS: tl.constexpr,
):
    """Grid ``(cdiv(num_tokens, TILE_TOKENS), cdiv(F, BLOCK_D))``: the pieces of the sequences.

    Tile ``i`` holds the tokens ``[i * TILE_TOKENS, (i + 1) * TILE_TOKENS)``. The sequences that
    cross its edges leave pieces here, at most two per tile, as float32 sums:

    * ``pieces[2 i]``: the tile's rows of the sequence that began in an earlier tile;
    * ``pieces[2 i + 1]``: the tile's rows of the sequence that begins here and runs past the tile.

    A tile that few sequences overlap (``_walked``) also sums those of them that lie inside it and
    have at least ``WALK_MIN_TOKENS`` tokens, into ``pieces[2 num_tiles + s]``: its program walks
    the sequences one after another. Other sequences inside a tile are left whole to
    ``mean_pool_finish_kernel``: one program each there, where a walk over many short sequences
    would be a long loop of short sums here.
    """
    tile, d_tile, row = _work_item(NUM_FEATURES, BLOCK_D)
    num_tiles = (num_tokens + TILE_TOKENS - 1) // TILE_TOKENS
    x_ptr += row * num_tokens * NUM_FEATURES
    pieces_ptr += row * (2 * num_tiles + num_seqs) * NUM_FEATURES
    cols = d_tile * BLOCK_D + tl.arange(0, BLOCK_D)
    col_mask = cols < NUM_FEATURES
    tile_start = tile * TILE_TOKENS
    tile_end = tl.minimum(tile_start + TILE_TOKENS, num_tokens)

    # Two independent searches, side by side so that their loads overlap.
    first = _sequence_at(cu_seqlens_ptr, num_seqs, tile_start, SEARCH_STEPS)
    last = _sequence_at(cu_seqlens_ptr, num_seqs, tile_end - 1, SEARCH_STEPS)
    if _walked(first, last, WALK_SEQS):
        seq = first
        start = _boundary(cu_seqlens_ptr, seq, num_tokens)
        while (seq < num_seqs) & (start < tile_end):
            end = tl.maximum(_boundary(cu_seqlens_ptr, seq + 1, num_tokens), start)
            if (start < tile_start) | (end > tile_end) | (end - start >= WALK_MIN_TOKENS):
                total = _sum_rows(x_ptr, tl.maximum(start, tile_start), tl.minimum(end, tile_end),
                                  NUM_FEATURES, cols, col_mask, BLOCK_T, BLOCK_D, NUM_STAGES)
                slot = tl.where(start < tile_start, 2 * tile,
                                tl.where(end > tile_end, 2 * tile + 1, 2 * num_tiles + seq))
                tl.store(pieces_ptr + slot.to(tl.int64) * NUM_FEATURES + cols, total, mask=col_mask)
            seq += 1
            start = _boundary(cu_seqlens_ptr, seq, num_tokens)
    else:
        if first < num_seqs:
            start = _boundary(cu_seqlens_ptr, first, num_tokens)
            end = _boundary(cu_seqlens_ptr, first + 1, num_tokens)
            if start < tile_start:
                total = _sum_rows(x_ptr, tile_start, tl.minimum(end, tile_end), NUM_FEATURES, cols,
                                  col_mask, BLOCK_T, BLOCK_D, NUM_STAGES)
                tl.store(pieces_ptr + (2 * tile).to(tl.int64) * NUM_FEATURES + cols, total, mask=col_mask)
        if last < num_seqs:
            start = _boundary(cu_seqlens_ptr, last, num_tokens)
            end = _boundary(cu_seqlens_ptr, last + 1, num_tokens)
            if (start >= tile_start) & (end > tile_end):
                total = _sum_rows(x_ptr, start, tile_end, NUM_FEATURES, cols, col_mask, BLOCK_T, BLOCK_D,
                                  NUM_STAGES)
                tl.store(pieces_ptr + (2 * tile + 1).to(tl.int64) * NUM_FEATURES + cols, total,
                         mask=col_mask)


@triton.jit
def mean_pool_finish_kernel(
    x_ptr, pieces_ptr, cu_seqlens_ptr, num_seqs, num_tokens,
    out_ptr,
    NUM_FEATURES: tl.constexpr, TILE_TOKENS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr, NUM_STAGES: tl.constexpr, HAS_PIECES: tl.constexpr,
    SEARCH_STEPS: tl.constexpr, WALK_SEQS: tl.constexpr, WALK_MIN_TOKENS: tl.constexpr,
):
    """Grid ``(num_seqs, cdiv(F, BLOCK_D))``: each sequence's mean, in the output's dtype.

    A sequence that spans tiles ``first..last`` adds its pieces: ``pieces[2 first + 1]`` and
    ``pieces[2 j]`` for the tiles after, ``BLOCK_P`` at a time. One inside a tile reads its sum,
    ``pieces[2 num_tiles + seq]``, if the pieces kernel wrote it (a walked tile, a sequence of at
    least ``WALK_MIN_TOKENS``: the same two searches as there tell), else sums it here, straight
    from ``x`` (so does every sequence without ``HAS_PIECES``: padded sequences no longer than a
    tile, and no pieces kernel). An empty sequence sums nothing and gets zeros.
    """
    seq, d_tile, row = _work_item(NUM_FEATURES, BLOCK_D)
    num_tiles = (num_tokens + TILE_TOKENS - 1) // TILE_TOKENS
    x_ptr += row * num_tokens * NUM_FEATURES
    pieces_ptr += row * (2 * num_tiles + num_seqs) * NUM_FEATURES
    out_ptr += row * num_seqs * NUM_FEATURES
    cols = d_tile * BLOCK_D + tl.arange(0, BLOCK_D)
    col_mask = cols < NUM_FEATURES
    start = _boundary(cu_seqlens_ptr, seq, num_tokens)
    end = tl.maximum(_boundary(cu_seqlens_ptr, seq + 1, num_tokens), start)
    first_tile = start // TILE_TOKENS
    last_tile = (end - 1) // TILE_TOKENS

    if (end > start) & (first_tile < last_tile):
        total = tl.load(pieces_ptr + (2 * first_tile + 1).to(tl.int64) * NUM_FEATURES + cols,
                        mask=col_mask, other=0.0).to(tl.float32)
        tiles = tl.arange(0, BLOCK_P)
        acc = tl.zeros((BLOCK_P, BLOCK_D), dtype=tl.float32)
        for j in range(first_tile + 1, last_tile + 1, BLOCK_P):
            rows = (2 * (j + tiles)).to(tl.int64)
            mask = ((j + tiles) <= last_tile)[:, None] & col_mask[None, :]
            piece_ptrs = pieces_ptr + rows[:, None] * NUM_FEATURES + cols[None, :]
            acc += tl.load(piece_ptrs, mask=mask, other=0.0).to(tl.float32)
        total += tl.sum(acc, axis=0)
    else:
        summed = end < start  # False: a tensor, as the walk's answer below
        if HAS_PIECES:
            if end - start >= WALK_MIN_TOKENS:
                tile_start = first_tile * TILE_TOKENS
                tile_end = tl.minimum(tile_start + TILE_TOKENS, num_tokens)
                first = _sequence_at(cu_seqlens_ptr, num_seqs, tile_start, SEARCH_STEPS)
                last = _sequence_at(cu_seqlens_ptr, num_seqs, tile_end - 1, SEARCH_STEPS)
                summed = _walked(first, last, WALK_SEQS)
        if summed:
            whole = (2 * num_tiles + seq).to(tl.int64)
            total = tl.load(pieces_ptr + whole * NUM_FEATURES + cols, mask=col_mask, other=0.0)
        else:
            total = _sum_rows(x_ptr, start, end, NUM_FEATURES, cols, col_mask, BLOCK_T, BLOCK_D,
                              NUM_STAGES)
    mean = total / tl.maximum(end - start, 1)
    tl.store(out_ptr + seq.to(tl.int64) * NUM_FEATURES + cols, mean.to(out_ptr.dtype.element_ty), mask=col_mask)


@triton.jit
def mean_pool_backward_kernel(
    dout_ptr, cu_seqlens_ptr, num_seqs, num_tokens,
    dx_ptr,
    NUM_FEATURES: tl.constexpr, TILE_TOKENS: tl.constexpr, SEARCH_STEPS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Grid ``(cdiv(num_tokens, TILE_TOKENS), cdiv(F, BLOCK_D))``: ``dx[t] = dout[seq(t)] / len``.

    Each program writes one tile of tokens: for every sequence that overlaps it, that sequence's
    ``dout`` row (read once, divided by the length) over the overlap; then zeros over the tokens
    after ``cu_seqlens[-1]``, which belong to no sequence.
    """
    tile, d_tile, row = _work_item(NUM_FEATURES, BLOCK_D)
    dout_ptr += row * num_seqs * NUM_FEATURES
    dx_ptr += row * num_tokens * NUM_FEATURES
    cols = d_tile * BLOCK_D + tl.arange(0, BLOCK_D)
    col_mask = cols < NUM_FEATURES
    tile_start = tile * TILE_TOKENS
    tile_end = tl.minimum(tile_start + TILE_TOKENS, num_tokens)

    seq = _sequence_at(cu_seqlens_ptr, num_seqs, tile_start, SEARCH_STEPS)
    start = _boundary(cu_seqlens_ptr, seq, num_tokens)
    while (seq < num_seqs) & (start < tile_end):
        end = tl.maximum(_boundary(cu_seqlens_ptr, seq + 1, num_tokens), start)
        dout = tl.load(dout_ptr + seq.to(tl.int64) * NUM_FEATURES + cols, mask=col_mask, other=0.0)
        grad = dout.to(tl.float32) / tl.maximum(end - start, 1)
        _fill_rows(dx_ptr, tl.maximum(start, tile_start), tl.minimum(end, tile_end), NUM_FEATURES,
                   cols, col_mask, grad, BLOCK_T, BLOCK_D)
        seq += 1
        start = _boundary(cu_seqlens_ptr, seq, num_tokens)

    unowned = tl.minimum(tl.maximum(_boundary(cu_seqlens_ptr, num_seqs, num_tokens), tile_start), tile_end)
    _fill_rows(dx_ptr, unowned, tile_end, NUM_FEATURES, cols, col_mask,
               tl.zeros((BLOCK_D,), dtype=tl.float32), BLOCK_T, BLOCK_D)


@triton.jit
def _block_bounds(block_index_ptr, cu_seqlens_ptr, block, block_size, num_seqs, num_tokens):
    """Rows ``[start, end)`` of block ``block`` and whether it is a real block: row ``block`` of
    ``prepare_chunk_indices`` is ``(sequence, chunk within it)``, or ``(-1, -1)`` past the last
    block (then ``start == end == 0``). The row is read from memory, so it is trusted with no
    address: a sequence outside ``[0, num_seqs)`` reads nothing, and the block is clamped into its
    sequence, whatever ``chunk`` says."""
    seq = tl.load(block_index_ptr + 2 * block)
    chunk = tl.load(block_index_ptr + 2 * block + 1)
    valid = (seq >= 0) & (seq < num_seqs)
    seq_start = tl.load(cu_seqlens_ptr + seq, mask=valid, other=0)
    seq_end = tl.load(cu_seqlens_ptr + seq + 1, mask=valid, other=0)
    seq_start = tl.minimum(tl.maximum(seq_start, 0), num_tokens)
    seq_end = tl.minimum(tl.maximum(seq_end, seq_start), num_tokens)
    start = tl.minimum(tl.maximum(seq_start + chunk * block_size, seq_start), seq_end)
    end = tl.minimum(start + block_size, seq_end)
    return tl.where(valid, start, 0), tl.where(valid, end, 0), valid


@triton.jit
def block_pool_forward_kernel(
    x_ptr, block_index_ptr, cu_seqlens_ptr, block_size, num_blocks, num_seqs, num_tokens,
    out_ptr,
    NUM_FEATURES: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    """Grid ``(num_blocks, cdiv(F, BLOCK_D))``: the mean of one block, divided by its own length."""
    block, d_tile, row = _work_item(NUM_FEATURES, BLOCK_D)
    x_ptr += row * num_tokens * NUM_FEATURES
    out_ptr += row * num_blocks * NUM_FEATURES
    cols = d_tile * BLOCK_D + tl.arange(0, BLOCK_D)
    col_mask = cols < NUM_FEATURES

    start, end, _ = _block_bounds(block_index_ptr, cu_seqlens_ptr, block, block_size, num_seqs,
                                  num_tokens)
    mean = _sum_rows(x_ptr, start, end, NUM_FEATURES, cols, col_mask, BLOCK_T, BLOCK_D, NUM_STAGES)
    mean = mean / tl.maximum(end - start, 1)
    tl.store(out_ptr + block.to(tl.int64) * NUM_FEATURES + cols, mean.to(out_ptr.dtype.element_ty), mask=col_mask)


@triton.jit
def block_pool_backward_kernel(
    dout_ptr, block_index_ptr, cu_seqlens_ptr, block_size, num_blocks, num_seqs, num_tokens,
    dx_ptr,
    NUM_FEATURES: tl.constexpr, TAIL_TOKENS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Grid ``(num_blocks + tail programs, cdiv(F, BLOCK_D))``.

    The first ``num_blocks`` programs broadcast ``dout[block] / len(block)`` over their block.
    Listed blocks cover the tokens ``[0, covered)`` with no gap, so the programs after them write
    zeros over the rest, ``TAIL_TOKENS`` rows each: the tokens after ``cu_seqlens[-1]``, and any
    blocks a too-small ``total_blocks`` left out.
    """
    program, d_tile, row = _work_item(NUM_FEATURES, BLOCK_D)
    dout_ptr += row * num_blocks * NUM_FEATURES
    dx_ptr += row * num_tokens * NUM_FEATURES
    cols = d_tile * BLOCK_D + tl.arange(0, BLOCK_D)
    col_mask = cols < NUM_FEATURES

    if program < num_blocks:
        start, end, _ = _block_bounds(block_index_ptr, cu_seqlens_ptr, program, block_size,
                                      num_seqs, num_tokens)
        dout = tl.load(dout_ptr + program.to(tl.int64) * NUM_FEATURES + cols, mask=col_mask, other=0.0)
        grad = dout.to(tl.float32) / tl.maximum(end - start, 1)
    else:
        # The last listed block ends the covered range; if it is a (-1, -1) filler row, every
        # block was listed and the last sequence ends it.
        # (No `_` here: compiled Triton wants a name bound in both branches of an `if` to keep
        # one type, and `_` is the bool `valid` in the other branch, an int here.)
        last_start, last_end, last_is_real = _block_bounds(
            block_index_ptr, cu_seqlens_ptr, num_blocks - 1, block_size, num_seqs, num_tokens)
        covered = tl.where(last_is_real, last_end, _boundary(cu_seqlens_ptr, num_seqs, num_tokens))
        start = tl.minimum(covered + (program - num_blocks) * TAIL_TOKENS, num_tokens)
        end = tl.minimum(start + TAIL_TOKENS, num_tokens)
        grad = tl.zeros((BLOCK_D,), dtype=tl.float32)
    _fill_rows(dx_ptr, start, end, NUM_FEATURES, cols, col_mask, grad, BLOCK_T, BLOCK_D)


# ----------------------------------------------------------------------------------------------
# Launch configuration.
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PoolingConfig:
    """How the Triton kernels cut the work: a tuning knob that never changes the result.

    ``fwd_*`` fields set the forward kernels, ``bwd_*`` the backward ones; ``None`` fields are
    chosen from the shapes (see ``_plan``), and ``PoolingConfig()`` (or ``config=None``) is the
    shipped default everywhere. Every field is a positive int; a ``ValueError`` names a bad one.

    * ``block_hidden``: features per program (``BLOCK_D``), a power of two, both directions.
      Default: up to 256 for ``mean_pooling``; 512 for ``block_mean_pooling``'s forward, whose
      program pools one block, too short a loop to pipeline, so it takes more features instead.
    * ``fwd_tile_tokens`` / ``bwd_tile_tokens``: tokens per tile of ``mean_pooling``'s forward /
      backward grid (padded input whose sequences are shorter rounds the forward's down to a
      multiple of ``seq_len``). Default: the power-of-two multiple of ``BLOCK_T`` that gives
      about ``fwd_programs`` / ``bwd_programs`` programs.
    * ``fwd_num_warps`` / ``bwd_num_warps``: warps per program, powers of two.
    * ``fwd_num_stages``: how many ``BLOCK_T``-row tiles a forward program keeps in flight
      (Triton's software pipelining of the loop's loads through shared memory; 1 turns it off).
      Default: 3 for ``mean_pooling``, 1 for ``block_mean_pooling`` (a block is too short a loop).
      The backward kernels only store: they have no loads to pipeline.
    """

    block_hidden: int | None = None
    fwd_tile_tokens: int | None = None
    bwd_tile_tokens: int | None = None
    # How many programs the token tiles aim at (measured on an H100, hidden 4096, bf16). The
    # forward keeps NUM_STAGES tiles of loads in flight and pays a binary search and a pipeline
    # fill per program (and a fill per long sequence of a tile it walks), so it wants a few long
    # programs: about 1024, some 8 per SM. The backward only stores (no latency to hide) and
    # evens out best over many short ones: about 4096.
    fwd_programs: int = 1024
    bwd_programs: int = 4096
    fwd_num_warps: int = 4
    bwd_num_warps: int = 4
    fwd_num_stages: int | None = None

    def __post_init__(self):
        values = validated_fields(self, powers_of_two=("block_hidden", "fwd_num_warps", "bwd_num_warps"))
        for name in ("fwd_programs", "bwd_programs", "fwd_num_warps", "bwd_num_warps"):
            if values[name] is None:
                raise ValueError(f"PoolingConfig.{name} must be a positive int, got None")
        freeze_fields(self, values)


class _Plan(NamedTuple):
    num_tokens: int        # rows of x (the backward needs it to shape dx)
    block_tokens: int      # BLOCK_T, rows per step
    block_hidden: int      # BLOCK_D, features per program
    tile_tokens: int       # TILE_TOKENS of the forward's token tiles
    grad_tile_tokens: int  # TILE_TOKENS of the backward's token tiles
    has_pieces: bool       # whether a sequence can cross a forward tile edge (else: no pieces kernel)
    search_steps: int      # num_seqs.bit_length()
    num_warps: int         # the forward's
    num_stages: int        # NUM_STAGES, tiles of loads in flight in the forward's loop
    bwd_num_warps: int


_FORWARD_STAGES = 3
# Who sums a sequence that lies inside one token tile (see mean_pool_pieces_kernel). Measured
# on an H100 (bf16, 65,536 tokens x 4096 packed, forward, device time, median of 10; probes,
# not recorded), ms for: 64 sequences of random lengths (bench/mean_pooling.py's packing) /
# 4096 of 16 tokens / random lengths 1-32 / 1-256 / the 64 with 4096 empty ones at one point:
#   the finish kernel sums every one (the chapter's design):  0.210 / 0.763 / 0.751 / 0.207 / 0.893
#   the pieces kernel walks every sequence of its tile:       0.200 / 0.904 / 0.973 / 0.235 / 6.61
#   walked tiles: at most _WALK_SEQS sequences overlap; sequences of _WALK_MIN_TOKENS or more:
#                                                             0.204 / 0.757 / 0.745 / 0.211 / 0.878
# A walk over many short sequences is a long loop of short sums in one program, where the finish
# kernel gives each its own. The two bounds are guesses from these figures, not tuned.
_WALK_SEQS = 4
_WALK_MIN_TOKENS = 128  # >= 1: an empty sequence is never the pieces kernel's to sum
assert _WALK_SEQS >= 1 and _WALK_MIN_TOKENS >= 1
_MAX_TILE_TOKENS = 8192
_MAX_TILE_ELEMENTS = 8192  # BLOCK_T * BLOCK_D: 64 float32 accumulators per thread at 4 warps
_PIECES_PER_STEP = 16      # BLOCK_P
# block_mean_pooling's forward: a program pools one block, too short a loop to pipeline, so it
# takes a wider slice of features instead to keep as many bytes in flight.
_BLOCK_POOL_HIDDEN = 512
_MAX_GRID_Y = 65535  # CUDA's limit on the 2nd grid dimension: the rows


def _token_tile(num_tokens: int, feature_tiles: int, block_tokens: int, programs: int) -> int:
    """A power-of-two multiple of ``block_tokens`` giving about ``programs`` programs in all."""
    wanted = num_tokens * feature_tiles // (programs * block_tokens)
    return block_tokens * min(max(1, 1 << max(0, wanted.bit_length() - 1)), _MAX_TILE_TOKENS // block_tokens)


def _plan(chunk_size: int, num_tokens: int, num_features: int, num_seqs: int, seq_len: int | None,
          config: PoolingConfig | None) -> _Plan:
    """Tiles and grid sizes; ``seq_len`` is the length of every sequence of padded input, else None."""
    config = PoolingConfig() if config is None else config
    block_tokens = min(next_power_of_2(chunk_size), _MAX_TILE_ELEMENTS // 16)
    block_hidden = config.block_hidden
    if block_hidden is None:
        block_hidden = min(256, max(16, next_power_of_2(num_features)), max(16, _MAX_TILE_ELEMENTS // block_tokens))
    feature_tiles = cdiv(num_features, block_hidden)
    tile_tokens = config.fwd_tile_tokens or _token_tile(num_tokens, feature_tiles, block_tokens,
                                                        config.fwd_programs)
    grad_tile_tokens = config.bwd_tile_tokens or _token_tile(num_tokens, feature_tiles, block_tokens,
                                                             config.bwd_programs)
    has_pieces = True
    if seq_len is not None and seq_len <= tile_tokens:
        # Padded input of short sequences: tiles of whole sequences, and no pieces to add up.
        tile_tokens = max(1, seq_len) * max(1, tile_tokens // max(1, seq_len))
        has_pieces = False
    num_stages = config.fwd_num_stages or _FORWARD_STAGES
    return _Plan(num_tokens, block_tokens, block_hidden, tile_tokens, grad_tile_tokens, has_pieces,
                 num_seqs.bit_length(), config.fwd_num_warps, num_stages, config.bwd_num_warps)


# ----------------------------------------------------------------------------------------------
# Mean pooling: custom_vjp around the kernels.
# ----------------------------------------------------------------------------------------------


# Every launch below takes ``rows`` independent copies of the problem, ``x3d`` of shape
# ``(rows, tokens, F)`` sharing ``cu_seqlens`` (grid axis 1, see ``_work_item``). The public
# functions pass one row; ``jax.vmap`` folds its mapped axis into the rows (``vmap_by_folding``),
# so a batch of inputs is one launch, not one per element. A mapped ``cu_seqlens`` gives each
# element its own packing: then the launches run one element at a time.


def _check_rows(rows: int) -> None:
    if rows > _MAX_GRID_Y:
        raise ValueError(f"{rows} rows (the sizes of the vmapped axes multiplied) exceed the grid "
                         f"limit of {_MAX_GRID_Y}; use impl='xla'")


def _mean_pool_forward_rows(x3d: Array, cu_seqlens: Array, plan: _Plan) -> Array:
    rows, num_tokens, num_features = x3d.shape
    _check_rows(rows)
    num_seqs = cu_seqlens.shape[0] - 1
    tiles = (cdiv(num_tokens, plan.tile_tokens), cdiv(num_features, plan.block_hidden))
    common = dict(config_argument="config",
                  num_warps=plan.num_warps, NUM_FEATURES=num_features, TILE_TOKENS=plan.tile_tokens,
                  BLOCK_T=plan.block_tokens, BLOCK_D=plan.block_hidden, NUM_STAGES=plan.num_stages,
                  SEARCH_STEPS=plan.search_steps, WALK_SEQS=_WALK_SEQS, WALK_MIN_TOKENS=_WALK_MIN_TOKENS)
    if plan.has_pieces:
        pieces = triton_call(
            x3d, cu_seqlens, num_seqs, num_tokens,
            kernel=mean_pool_pieces_kernel,
            out_shape=jax.ShapeDtypeStruct((rows, 2 * tiles[0] + num_seqs, num_features), jnp.float32),
            grid=(tiles[0] * tiles[1], rows), **common,
        )
    else:
        pieces = x3d  # never read: no sequence crosses a tile edge
    return triton_call(
        x3d, pieces, cu_seqlens, num_seqs, num_tokens,
        kernel=mean_pool_finish_kernel,
        out_shape=jax.ShapeDtypeStruct((rows, num_seqs, num_features), x3d.dtype),
        grid=(num_seqs * tiles[1], rows), BLOCK_P=_PIECES_PER_STEP, HAS_PIECES=plan.has_pieces, **common,
    )


def _mean_pool_backward_rows(dout: Array, cu_seqlens: Array, plan: _Plan) -> Array:
    rows, num_seqs, num_features = dout.shape
    _check_rows(rows)
    return triton_call(
        dout, cu_seqlens, num_seqs, plan.num_tokens,
        kernel=mean_pool_backward_kernel,
        out_shape=jax.ShapeDtypeStruct((rows, plan.num_tokens, num_features), dout.dtype),
        grid=(cdiv(plan.num_tokens, plan.grad_tile_tokens) * cdiv(num_features, plan.block_hidden),
              rows),
        config_argument="config",
        num_warps=plan.bwd_num_warps, NUM_FEATURES=num_features, TILE_TOKENS=plan.grad_tile_tokens,
        SEARCH_STEPS=plan.search_steps, BLOCK_T=plan.block_tokens, BLOCK_D=plan.block_hidden,
    )


def _folding(launch, plan):
    """``launch(array, cu_seqlens, plan)`` as a function of the arrays, vmapped by folding."""
    return vmap_by_folding(partial(launch, plan=plan), in_axes=(0, None), out_axes=0)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _mean_pool_triton(x3d: Array, cu_seqlens: Array, plan: _Plan) -> Array:
    """Mean of the rows ``cu_seqlens[i]:cu_seqlens[i + 1]`` of each ``x3d[r]``, for each i."""
    return _folding(_mean_pool_forward_rows, plan)(x3d, cu_seqlens)


def _mean_fwd(x3d, cu_seqlens, plan):
    # The backward needs only where the sequences are (dout has x's dtype, plan its length).
    return _mean_pool_triton(x3d, cu_seqlens, plan), cu_seqlens


def _mean_bwd(plan, cu_seqlens, dout):
    return _folding(_mean_pool_backward_rows, plan)(dout, cu_seqlens), None


_mean_pool_triton.defvjp(_mean_fwd, _mean_bwd)


# ----------------------------------------------------------------------------------------------
# Block mean pooling: custom_vjp around the kernels.
# ----------------------------------------------------------------------------------------------


class _BlockPlan(NamedTuple):
    block_size: int
    block_hidden: int      # the forward's BLOCK_D
    num_stages: int        # the forward's NUM_STAGES
    tail_programs: int     # backward programs that zero the tokens no listed block covers
    tail_tokens: int
    tiles: _Plan           # BLOCK_T, and the backward's BLOCK_D and warps


def _block_pool_forward_rows(x3d: Array, cu_seqlens: Array, block_index: Array,
                             plan: _BlockPlan) -> Array:
    rows, num_tokens, num_features = x3d.shape
    _check_rows(rows)
    num_blocks = block_index.shape[0]
    return triton_call(
        x3d, block_index, cu_seqlens, plan.block_size, num_blocks, cu_seqlens.shape[0] - 1,
        num_tokens,
        kernel=block_pool_forward_kernel,
        out_shape=jax.ShapeDtypeStruct((rows, num_blocks, num_features), x3d.dtype),
        grid=(num_blocks * cdiv(num_features, plan.block_hidden), rows),
        config_argument="config",
        num_warps=plan.tiles.num_warps, NUM_FEATURES=num_features,
        BLOCK_T=plan.tiles.block_tokens, BLOCK_D=plan.block_hidden, NUM_STAGES=plan.num_stages,
    )


def _block_pool_backward_rows(dout: Array, cu_seqlens: Array, block_index: Array,
                              plan: _BlockPlan) -> Array:
    rows, num_blocks, num_features = dout.shape
    _check_rows(rows)
    num_tokens = plan.tiles.num_tokens
    num_seqs = cu_seqlens.shape[0] - 1
    return triton_call(
        dout, block_index, cu_seqlens, plan.block_size, num_blocks, num_seqs, num_tokens,
        kernel=block_pool_backward_kernel,
        out_shape=jax.ShapeDtypeStruct((rows, num_tokens, num_features), dout.dtype),
        grid=((num_blocks + plan.tail_programs) * cdiv(num_features, plan.tiles.block_hidden),
              rows),
        config_argument="config",
        num_warps=plan.tiles.bwd_num_warps, NUM_FEATURES=num_features,
        TAIL_TOKENS=plan.tail_tokens, BLOCK_T=plan.tiles.block_tokens, BLOCK_D=plan.tiles.block_hidden,
    )


def _block_folding(launch, plan):
    # block_index is derived from cu_seqlens: both are shared by the rows, or the rule falls back.
    return vmap_by_folding(partial(launch, plan=plan), in_axes=(0, None, None), out_axes=0)


@partial(jax.custom_vjp, nondiff_argnums=(3,))
def _block_pool_triton(x3d: Array, cu_seqlens: Array, block_index: Array,
                       plan: _BlockPlan) -> Array:
    return _block_folding(_block_pool_forward_rows, plan)(x3d, cu_seqlens, block_index)


def _block_fwd(x3d, cu_seqlens, block_index, plan):
    return _block_pool_triton(x3d, cu_seqlens, block_index, plan), (cu_seqlens, block_index)


def _block_bwd(plan, residuals, dout):
    cu_seqlens, block_index = residuals
    dx = _block_folding(_block_pool_backward_rows, plan)(dout, cu_seqlens, block_index)
    return dx, None, None


_block_pool_triton.defvjp(_block_fwd, _block_bwd)


# ----------------------------------------------------------------------------------------------
# XLA implementations (plain jnp; JAX differentiates them).
# ----------------------------------------------------------------------------------------------


def _mean_pooling_xla(x: Array, x2d: Array, cu: Any, padded: bool) -> Array:
    if padded:
        return jnp.mean(x, axis=1, dtype=jnp.float32).astype(x.dtype)
    num_tokens = x2d.shape[0]
    cu = sanitize_cu_seqlens(cu, num_tokens)  # as the kernels see it: the same answer on garbage
    seq_ids = prepare_sequence_ids(cu, total_tokens=num_tokens)  # -1 past cu_seqlens[-1]: dropped
    sums = jax.ops.segment_sum(x2d.astype(jnp.float32), seq_ids, num_segments=cu.shape[0] - 1)
    lens = jnp.maximum(prepare_lens(cu), 1).astype(jnp.float32)
    return (sums / lens[:, None]).astype(x.dtype)


def _block_mean_pooling_xla(x, x2d, cu, block_size, total_blocks, padded) -> Array:
    if padded:
        batch, seq_len = x.shape[:2]
        blocks = cdiv(seq_len, block_size)
        x3 = x2d.reshape(batch, seq_len, -1).astype(jnp.float32)
        x4 = jnp.pad(x3, ((0, 0), (0, blocks * block_size - seq_len), (0, 0))).reshape(batch, blocks, block_size, -1)
        lens = np.minimum(block_size, seq_len - block_size * np.arange(blocks))  # static
        return (x4.sum(axis=2) / lens[None, :, None].astype(np.float32)).astype(x.dtype)
    num_tokens = x2d.shape[0]
    cu = sanitize_cu_seqlens(cu, num_tokens)  # as the kernels see it: the same answer on garbage
    seq_ids = prepare_sequence_ids(cu, total_tokens=num_tokens)
    positions = prepare_position_ids(cu, total_tokens=num_tokens)
    offsets = prepare_chunk_offsets(cu, block_size)
    block_ids = jnp.where(seq_ids >= 0, offsets[jnp.maximum(seq_ids, 0)] + positions // block_size, -1)
    sums = jax.ops.segment_sum(x2d.astype(jnp.float32), block_ids, num_segments=total_blocks)
    counts = jax.ops.segment_sum(jnp.ones((num_tokens,), jnp.float32), block_ids, num_segments=total_blocks)
    return (sums / jnp.maximum(counts, 1.0)[:, None]).astype(x.dtype)


# ----------------------------------------------------------------------------------------------
# References: naive loops over concrete cu_seqlens, for tests and the book.
# ----------------------------------------------------------------------------------------------


def _mean_rows(rows: Array, dtype: Any) -> Array:
    """Mean of ``rows`` over axis 0 in at least float32, cast to ``dtype``; zeros if empty."""
    if rows.shape[0] == 0:
        return jnp.zeros(rows.shape[1:], dtype)
    return jnp.mean(rows.astype(jnp.promote_types(rows.dtype, jnp.float32)), axis=0).astype(dtype)


def _sequences(x: Array, cu_seqlens: Any) -> list[Array]:
    if cu_seqlens is None:
        return [x[b] for b in range(x.shape[0])]
    cu = np.asarray(cu_seqlens)
    return [x[cu[i]:cu[i + 1]] for i in range(len(cu) - 1)]


def reference(x: Array, cu_seqlens: Any = None) -> Array:
    """``mean_pooling`` as a Python loop over sequences (needs a concrete ``cu_seqlens``)."""
    rest = x.shape[2:] if cu_seqlens is None else x.shape[1:]
    seqs = _sequences(x, cu_seqlens)
    return jnp.stack([_mean_rows(s, x.dtype) for s in seqs]) if seqs else jnp.zeros((0, *rest), x.dtype)


def reference_blocks(x: Array, block_size: int, cu_seqlens: Any = None) -> Array:
    """``block_mean_pooling`` as a Python loop over sequences and blocks (concrete ``cu_seqlens``)."""
    rest = x.shape[2:] if cu_seqlens is None else x.shape[1:]
    per_seq = [[_mean_rows(s[i:i + block_size], x.dtype) for i in range(0, s.shape[0], block_size)]
               for s in _sequences(x, cu_seqlens)]
    if cu_seqlens is None:
        return jnp.stack([jnp.stack(blocks) if blocks else jnp.zeros((0, *rest), x.dtype) for blocks in per_seq])
    blocks = [b for seq in per_seq for b in seq]
    return jnp.stack(blocks) if blocks else jnp.zeros((0, *rest), x.dtype)


# ----------------------------------------------------------------------------------------------
# Argument checks and shape plumbing.
# ----------------------------------------------------------------------------------------------


def _resolve_impl(impl: str, x: Any) -> str:
    impl = resolve_impl(impl)
    check_floating(x, "x")
    if impl == "triton":
        check_triton_dtype(x, "x")
    return impl


def _as_packed(x: Array, cu_seqlens: Any, fn: str) -> tuple[Array, Any, tuple[int, ...], bool]:
    """``x`` as a ``(tokens, F)`` matrix, the ``cu_seqlens`` that describes it, the feature axes
    ``rest`` and whether ``x`` was padded. A padded batch gets a NumPy ``[0, T, 2T, ...]``."""
    if cu_seqlens is None:
        if x.ndim < 3:
            raise ValueError(f"{fn}: x must be padded (batch, seq_len, hidden, ...) without cu_seqlens, "
                             f"got shape {x.shape}; pass cu_seqlens for a packed (total_tokens, hidden) x")
        batch, seq_len, rest = x.shape[0], x.shape[1], x.shape[2:]
        return (x.reshape(batch * seq_len, math.prod(rest)), np.arange(batch + 1, dtype=np.int32) * seq_len,
                rest, True)
    if x.ndim < 2:
        raise ValueError(f"{fn}: with cu_seqlens, x must be packed (total_tokens, hidden, ...), got shape {x.shape}")
    if x.ndim >= 3 and x.shape[0] == 1:
        raise ValueError(f"{fn}: with cu_seqlens, x must be packed (total_tokens, hidden, ...) with no batch "
                         f"axis, got shape {x.shape}; pass x[0]")
    cu = checked_cu_seqlens(cu_seqlens, x.shape[0])  # values checked if concrete
    rest = x.shape[1:]
    return x.reshape(x.shape[0], math.prod(rest)), cu, rest, False


def _count_blocks(cu: Any, block_size: int, total_blocks: int | None) -> int:
    values = concrete_value(cu)
    if values is None:
        if total_blocks is None:
            raise ValueError("block_mean_pooling: the number of blocks depends on the values of cu_seqlens, "
                             "which are not known under jax.jit; pass it as a static argument total_blocks=...")
        return total_blocks
    true_count = int(cdiv(np.diff(values.astype(np.int64)), block_size).sum())
    if total_blocks is None:
        return true_count
    if total_blocks < true_count:
        raise ValueError(f"total_blocks={total_blocks} is fewer than the {true_count} blocks cu_seqlens makes "
                         f"with block_size={block_size}")
    return total_blocks


# ----------------------------------------------------------------------------------------------
# The public functions.
# ----------------------------------------------------------------------------------------------


def mean_pooling(
    x: Array,
    chunk_size: int = 32,
    cu_seqlens: Array | None = None,
    *,
    impl: str = "auto",
    config: PoolingConfig | None = None,
) -> Array:
    """Mean of each sequence's token vectors.

    Args:
      x: padded ``(batch, seq_len, *rest)``, pooled over axis 1 into ``(batch, *rest)``; or, with
        ``cu_seqlens``, packed ``(total_tokens, *rest)``, pooled into ``(num_seqs, *rest)``.
        ``rest`` is any number of feature axes (``hidden``, or ``heads, head_dim``). A packed ``x``
        has no batch axis: one of more than two axes whose first has size 1 is taken to be the
        ``(1, total_tokens, ...)`` layout of other libraries and rejected.
      chunk_size: tokens a program adds per step (rounded up to a power of two, at most 512). A
        tuning knob: the result does not depend on it beyond float32 rounding.
      cu_seqlens: ``[0, len_0, len_0 + len_1, ...]`` (int), sequence ``i`` being the tokens
        ``cu_seqlens[i]:cu_seqlens[i + 1]``. Tokens at or past ``cu_seqlens[-1]`` belong to no
        sequence: ignored, with zero gradient. Its values are checked when they are concrete;
        under ``jax.jit`` they cannot be, and invalid ones are replaced by the nearest valid
        packing (:func:`ejk_lite.packing.sanitize_cu_seqlens`): wrong numbers, never a crash.
      impl: ``"triton"``, ``"xla"`` (plain ``jnp``) or ``"auto"`` (Triton on a GPU, else XLA).
      config: optional :class:`PoolingConfig` for the Triton kernels (benchmarks sweep it).

    Returns:
      The means, in ``x``'s dtype (accumulated in float32). A zero-length sequence gives zeros,
      not NaN. Differentiable in ``x`` (``jax.grad``, ``jax.jit``, ``jax.value_and_grad``); the
      gradient has ``x``'s shape and dtype.

    Raises:
      ValueError: naming the argument, for a wrong rank, a non-float ``x``, an invalid
        ``cu_seqlens`` (see :func:`ejk_lite.validate_cu_seqlens`) or a non-positive ``chunk_size``.
    """
    impl = _resolve_impl(impl, x)
    x = jnp.asarray(x)
    chunk_size = static_int(chunk_size, "chunk_size", minimum=1)
    config = check_config(config, PoolingConfig)
    x2d, cu, rest, padded = _as_packed(x, cu_seqlens, "mean_pooling")
    num_tokens, num_features = x2d.shape
    num_seqs = cu.shape[0] - 1
    out_shape = (num_seqs, *rest)
    if num_seqs == 0 or num_tokens == 0 or num_features == 0:
        return jnp.zeros(out_shape, x.dtype)
    if impl == "xla":
        return _mean_pooling_xla(x, x2d, cu, padded).reshape(out_shape)
    plan = _plan(chunk_size, num_tokens, num_features, num_seqs, x.shape[1] if padded else None, config)
    out = _mean_pool_triton(x2d[None], sanitize_cu_seqlens(cu, num_tokens), plan)
    return out.reshape(out_shape)


def block_mean_pooling(
    x: Array,
    block_size: int,
    cu_seqlens: Array | None = None,
    chunk_size: int = 32,
    *,
    total_blocks: int | None = None,
    impl: str = "auto",
    config: PoolingConfig | None = None,
) -> Array:
    """One mean per block of ``block_size`` consecutive tokens within each sequence.

    A sequence of ``n`` tokens has ``ceil(n / block_size)`` blocks; the last may be shorter and is
    divided by its own length. Blocks never straddle two sequences.

    Args:
      x: padded ``(batch, seq_len, *rest)`` gives ``(batch, ceil(seq_len / block_size), *rest)``;
        packed ``(total_tokens, *rest)`` with ``cu_seqlens`` gives ``(total_blocks, *rest)``, the
        blocks listed sequence by sequence, in order within each sequence (the order of
        :func:`ejk_lite.prepare_chunk_indices` with ``chunk_size=block_size``; a zero-length
        sequence has no block).
      block_size: tokens per block, a positive int.
      cu_seqlens: as for :func:`mean_pooling`.
      chunk_size: tokens a program adds per step (rounded up to a power of two and capped at
        ``block_size`` rounded up likewise); a tuning knob.
      total_blocks: the number of output rows for packed input. Needed when ``cu_seqlens`` is
        traced (under ``jax.jit`` its values, and so the number of blocks, are unknown): pass it
        as a static int. It may exceed the true count; the extra rows are zeros. When
        ``cu_seqlens`` is concrete, a value below the true count is an error.
      impl: ``"triton"``, ``"xla"`` or ``"auto"``, as for :func:`mean_pooling`.
      config: optional :class:`PoolingConfig` (the token tiles are not used here: a program
        pools one block).

    Returns:
      The block means in ``x``'s dtype (float32 accumulation); differentiable in ``x``. Tokens in
      no block (past ``cu_seqlens[-1]``) get zero gradient.
    """
    impl = _resolve_impl(impl, x)
    x = jnp.asarray(x)
    block_size = static_int(block_size, "block_size", minimum=1)
    chunk_size = static_int(chunk_size, "chunk_size", minimum=1)
    if total_blocks is not None:
        total_blocks = static_int(total_blocks, "total_blocks")
    config = check_config(config, PoolingConfig)
    x2d, cu, rest, padded = _as_packed(x, cu_seqlens, "block_mean_pooling")
    num_tokens, num_features = x2d.shape
    num_seqs = cu.shape[0] - 1

    if padded:
        batch, seq_len = x.shape[:2]
        blocks_per_seq = cdiv(seq_len, block_size)
        if total_blocks is not None and total_blocks != batch * blocks_per_seq:
            raise ValueError(f"total_blocks={total_blocks} does not match the {batch * blocks_per_seq} blocks "
                             f"of a padded x of shape {x.shape}; leave it out for padded input")
        total_blocks = batch * blocks_per_seq
        out_shape = (batch, blocks_per_seq, *rest)
    else:
        total_blocks = _count_blocks(cu, block_size, total_blocks)
        out_shape = (total_blocks, *rest)
    if total_blocks == 0 or num_tokens == 0 or num_features == 0:
        return jnp.zeros(out_shape, x.dtype)
    if impl == "xla":
        return _block_mean_pooling_xla(x, x2d, cu, block_size, total_blocks, padded).reshape(out_shape)

    # The block list: concrete (a constant) whenever cu_seqlens is. Both come from the sanitized
    # offsets (unchanged if valid), so the kernels never see an invalid packing.
    with jax.ensure_compile_time_eval():
        cu = sanitize_cu_seqlens(cu, num_tokens)
        block_index = prepare_chunk_indices(cu, block_size, total_chunks=total_blocks)

    tiles = _plan(min(chunk_size, block_size), num_tokens, num_features, num_seqs, None, config)
    tail_tokens = tiles.block_tokens * 64
    cu_values = concrete_value(cu)
    if padded:
        tail_programs = 0
    elif cu_values is not None:
        # Exact: every real block is listed (checked above), so the blocks end at cu_seqlens[-1].
        tail_programs = cdiv(num_tokens - int(cu_values[-1]), tail_tokens)
    else:
        tail_programs = cdiv(num_tokens, tail_tokens)
    block_hidden = (config.block_hidden if config is not None and config.block_hidden
                    else min(_BLOCK_POOL_HIDDEN, max(16, next_power_of_2(num_features))))
    num_stages = config.fwd_num_stages if config is not None and config.fwd_num_stages else 1
    plan = _BlockPlan(block_size, block_hidden, num_stages, tail_programs, tail_tokens, tiles)
    return _block_pool_triton(x2d[None], cu, block_index, plan).reshape(out_shape)
