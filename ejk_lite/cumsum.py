"""Chunked cumulative sums: ``chunk_local_cumsum`` and ``chunk_global_cumsum``.

Gated linear-attention models (GLA, RetNet, Mamba-2, gated DeltaNet, ...) give every token a
log-decay ``g[t] <= 0``. The decay between positions ``s <= t`` is ``exp(G[t] - G[s])`` with
``G = cumsum(g)``, so the running sum of the gates is the first thing such a layer computes:

* chunked algorithms cut the sequence into chunks of ``chunk_size`` tokens and need the sums
  *inside* each chunk: ``chunk_local_cumsum`` restarts the sum at every chunk;
* recurrent and state-passing steps need them over the whole sequence: ``chunk_global_cumsum``.

``reverse=True`` gives suffix sums instead (from the token to the end of its chunk or sequence); a
reverse cumsum is also the gradient of a forward one.

Both are one computation, a *segmented* cumulative sum. The token axis is cut into segments, and
each output is the sum of its segment's inputs up to (reverse: from) that token::

    x        = [ 1   2   3   4 | 5   6   7 ]          two segments
    forward  = [ 1   3   6  10 | 5  11  18 ]
    reverse  = [10   9   7   4 | 18 13   7 ]

Local cumsum: the segments are chunks. Global cumsum: the segments are whole sequences.

Shapes. A *scalar* input is ``[B, T, H]`` (one gate per token and head), a *vector* input is
``[B, T, H, S]`` (one per token, head and feature); with ``head_first=True`` they are ``[B, H, T]``
and ``[B, H, T, S]``. With ``cu_seqlens`` the batch must be 1 and its token axis packs several
sequences back to back (see :mod:`ejk_lite.packing`): global sums restart at each sequence; local
chunks are counted from each sequence's first token, so a chunk never straddles two sequences and
a sequence's last chunk may be short. Tokens past ``cu_seqlens[-1]`` belong to no sequence; their
output (and gradient) is zero. ``cu_seqlens`` may be traced under ``jax.jit``; its values cannot
be checked then, and both implementations use the nearest valid packing instead
(:func:`ejk_lite.packing.sanitize_cu_seqlens`): garbage offsets give wrong sums, never a crash.
Sums are accumulated in float32 whatever the input dtype; the output has the input dtype unless
``output_dtype`` says otherwise, and ``softmax_scale`` multiplies the sums before that final cast.

Implementations (``impl=``):

* ``"triton"``: two kernels sharing one loop, :func:`_scan_span`. A program owns one segment of one
  row and a tile of ``BLOCK_C`` columns; it walks the segment in blocks of ``BLOCK_T`` tokens,
  scans each block with ``tl.cumsum`` and carries the float32 running sum into the next block.
  Reverse sums read the segment backwards and scan forwards.
  The local kernel has one program per (chunk, column tile, row); the global kernel one per
  (sequence, column tile, row), or ``SPLIT`` per sequence, each starting from the sum of the
  tokens before its span. Every element is written once and read once (the global kernel's
  ``SPLIT`` reads spans again, mostly from L2). Small inputs (``_TWO_PASS_MAX_BYTES``) of
  sequences of at most ``_TWO_PASS_MAX_CHUNKS`` chunks take the global cumsum in two passes
  instead: chunk totals, then the local kernel with each chunk starting from the totals before
  it. A 16-bit input's global walk may scan each block on the tensor cores instead of with
  ``tl.cumsum`` (``USE_DOT``: two products with triangles of ones, see :func:`_scan_span`).
  Under ``jax.vmap`` the mapped axis is folded into the rows: a batch is one launch.
* ``"xla"``: plain ``jax.numpy``/``lax`` ops, differentiated by JAX itself.
* ``"auto"``: Triton on a GPU, XLA otherwise (the interpreter is for testing, not for speed).

Tiles (``config=``): by default Triton's autotuner picks the column width, warps and (global)
token block and split on the GPU from the lists below; a :class:`CumsumConfig` pins one
instead (and the global cumsum then always walks in one pass).

The module reads top to bottom as every op of ejk_lite: the kernels, the launchers ``_fwd`` /
``_bwd``, one ``custom_vjp``, the XLA implementation, the references, the public functions.

``reference_local_cumsum`` / ``reference_global_cumsum`` define the answer as directly as
possible, a masked matrix product (O(T²) memory): for tests and the book, not for speed.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl
from jax import lax

from ejk_lite.checks import (
    check_config,
    check_floating,
    check_triton_dtype,
    freeze_fields,
    next_power_of_2,
    power_of_two,
    resolve_impl,
    static_float,
    validated_fields,
)
from ejk_lite.launch import triton_call, vmap_by_folding
from ejk_lite.packing import (
    cdiv,
    check_packed_batch,
    checked_cu_seqlens,
    prepare_chunk_indices,
    prepare_position_ids,
    sanitize_cu_seqlens,
)

__all__ = ["chunk_local_cumsum", "chunk_global_cumsum", "reference_local_cumsum",
           "reference_global_cumsum", "CumsumConfig"]

_MAX_GRID_YZ = 65535  # CUDA's limit on the 2nd and 3rd grid dimensions


# ----------------------------------------------------------------------------------------------
# The kernels.
#
# The kernels see every input as ``rows`` of a ``[N, T, C]`` array: ``N`` independent rows (batch
# entries, or (batch, head) pairs), ``T`` tokens, ``C`` columns that are summed independently
# (heads, features). Element ``(n, t, c)`` sits at ``(n*T + t)*C + c``, so a tile of tokens x
# columns reads whole contiguous rows of columns. The one exception is the head-first scalar
# layout ``[B, H, T]``, where the tokens are contiguous: there ``TOKENS_CONTIGUOUS`` puts element
# ``(n, t, c)`` at ``(n*C + c)*T + t``. Both are reshapes of the caller's array, never copies;
# strides are spelled out in the kernel (not passed in) so Triton knows which axis is contiguous
# and vectorises it.
#
# ``C`` is a compile-time constant for the same reason. jax-triton (0.3.1) passes an int argument
# with no divisibility hint, so with ``C`` a runtime int Triton cannot prove that a row of columns
# starts 16-byte aligned, nor that the mask ``cols < C`` is constant over 8 columns, and it loads
# and stores one element per instruction: the PTX for sm_90 of a 64 x 32 tile held 16
# ``ld.global.b16`` per thread in bfloat16 (16 ``ld.global.b32`` in float32). Knowing ``C``
# (2048 in the benchmark) it emits 2 ``ld.global.v4.b32`` (4 in float32), 16 bytes each. Element
# by element, bfloat16 issued as many memory instructions as float32 for half the bytes, and on
# the H100 it reached 73% of the copy bandwidth where float32 reached 94%
# (bench/results/cumsum.json, chunk-local, [4, 4096, 16, 128]). ``C`` is heads x features, fixed
# for a model: one compile per model, as the autotuner's key already had it.
# ----------------------------------------------------------------------------------------------


@triton.jit
def _offsets(tokens, cols, T, C: tl.constexpr, TOKENS_CONTIGUOUS: tl.constexpr):
    """``[len(tokens), len(cols)]`` offsets of elements (token, column) in a row (layouts above)."""
    if TOKENS_CONTIGUOUS:
        offsets = tokens[:, None] + cols[None, :] * T
    else:
        offsets = tokens[:, None] * C + cols[None, :]
    return offsets


@triton.jit
def _span_total(
    x_ptr,  # a row, laid out as the kernels' rows (T tokens, or entries, x C columns)
    first_token, count,  # the tokens first_token, first_token + 1, ... (- 1, ... REVERSE): count
    keep, cols, T, C: tl.constexpr,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
    NUM_STAGES: tl.constexpr,  # None: a plain range, no pipelining asked for
    REVERSE: tl.constexpr, TOKENS_CONTIGUOUS: tl.constexpr,
):
    """``[BLOCK_C]`` float32: the total of ``count`` tokens of columns ``cols``, read in order.

    Elementwise adds into a ``[BLOCK_T, BLOCK_C]`` float32 tile, one ``tl.sum`` at the end: no
    carry from block to block, so the loads stream instead of waiting on each block's sum.
    """
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for first in tl.range(0, count, BLOCK_T, num_stages=NUM_STAGES):
        ahead = first + tl.arange(0, BLOCK_T)  # tokens counted from first_token
        tokens = first_token - ahead if REVERSE else first_token + ahead
        mask = (ahead[:, None] < count) & (cols[None, :] < C)
        offsets = _offsets(tokens, cols, T, C, TOKENS_CONTIGUOUS)
        acc += tl.load(x_ptr + offsets, mask=mask & keep, other=0.0).to(tl.float32)
    return tl.sum(acc, axis=0)


@triton.jit
def _block(first, start, end, cols, col_mask, T, C: tl.constexpr, BLOCK_T: tl.constexpr,
           REVERSE: tl.constexpr, TOKENS_CONTIGUOUS: tl.constexpr):
    """``(offsets, mask)`` of the block ``first`` tokens into the walk of ``[start, end)``
    (from ``end - 1`` backwards, ``REVERSE``): row ``i`` is the ``first + i``-th token walked."""
    if REVERSE:
        tokens = end - 1 - first - tl.arange(0, BLOCK_T)
    else:
        tokens = start + first + tl.arange(0, BLOCK_T)
    offsets = _offsets(tokens, cols, T, C, TOKENS_CONTIGUOUS)
    mask = (tokens[:, None] >= start) & (tokens[:, None] < end) & col_mask[None, :]
    return offsets, mask


@triton.jit
def _scan_blocks(
    x_ptr, out_ptr, start, end, keep, carry, T, C: tl.constexpr, scale,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, NUM_STAGES: tl.constexpr,
    REVERSE: tl.constexpr, TOKENS_CONTIGUOUS: tl.constexpr, DOT: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """The walk of :func:`_scan_span` (its arguments), block by block, each block scanned with
    ``tl.cumsum`` or (``DOT``) by two matrix products; returns the running totals, a
    ``[BLOCK_C]`` carry or (``DOT``) a ``[BLOCK_T, BLOCK_C]`` tile whose every row is one.

    ``PREFETCH``: the next block is loaded into registers before this one is scanned, so its
    loads are in flight during the scan, and Triton's pipelining (``cp.async`` into shared
    memory, ``NUM_STAGES``) is off: for float32 walks the faster of the two (see
    ``_GLOBAL_TILES``)."""
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    col_mask = cols < C
    # jax-triton hands a Python float over as float64: multiplying the float32 sums by it would
    # convert every element to float64 and back. (The default scale, 1.0, arrives as the
    # constant 1.)
    scale = tl.cast(scale, tl.float32)
    if DOT:
        r = tl.arange(0, BLOCK_T)
        lower = (r[:, None] >= r[None, :]).to(x_ptr.dtype.element_ty)
        ones = tl.full([BLOCK_T, BLOCK_T], 1.0, x_ptr.dtype.element_ty)
        carry = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32) + carry[None, :]
    STAGES: tl.constexpr = 1 if PREFETCH else NUM_STAGES
    if PREFETCH:
        offsets, mask = _block(0, start, end, cols, col_mask, T, C, BLOCK_T, REVERSE,
                               TOKENS_CONTIGUOUS)
        ahead = tl.load(x_ptr + offsets, mask=mask & keep, other=0.0)
    for first in tl.range(0, end - start, BLOCK_T, num_stages=STAGES):
        offsets, mask = _block(first, start, end, cols, col_mask, T, C, BLOCK_T, REVERSE,
                               TOKENS_CONTIGUOUS)
        # Masked tokens load as 0: they add nothing to the sums of the tokens that are kept.
        if PREFETCH:
            x = ahead
            following, following_mask = _block(first + BLOCK_T, start, end, cols, col_mask, T,
                                               C, BLOCK_T, REVERSE, TOKENS_CONTIGUOUS)
            ahead = tl.load(x_ptr + following, mask=following_mask & keep, other=0.0)
        else:
            x = tl.load(x_ptr + offsets, mask=mask & keep, other=0.0)
        if DOT:
            sums = tl.dot(lower, x, carry)
            carry = tl.dot(ones, x, carry)
        else:
            x = x.to(tl.float32)
            sums = tl.cumsum(x, axis=0) + carry[None, :]
            carry += tl.sum(x, axis=0)
        tl.store(out_ptr + offsets, (sums * scale).to(out_ptr.dtype.element_ty), mask=mask)
    return carry


@triton.jit
def _scan_span(
    x_ptr, out_ptr,  # this program's row: its element (t, c) is at offset t*C + c (or c*T + t)
    start, end,  # the segment: tokens start <= t < end
    keep,  # False for padding past cu_seqlens[-1]: read nothing, write zeros
    carry,  # [BLOCK_C] float32: what the sums start from (the tokens walked before this span)
    T, C: tl.constexpr, scale,
    BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, NUM_STAGES: tl.constexpr,
    REVERSE: tl.constexpr, TOKENS_CONTIGUOUS: tl.constexpr, USE_DOT: tl.constexpr,
    PREFETCH: tl.constexpr,
):
    """Write the (reverse) cumulative sum of tokens [start, end) for this program's column tile.

    Tokens are taken ``BLOCK_T`` at a time. Each block is scanned on its own with ``tl.cumsum``
    and the running total of the blocks before it is added: the classic two-level scan, with the
    upper level a single float32 register per column. A reverse sum is a forward sum read
    backwards: row ``i`` of the block is token ``end - 1 - i`` (then ``end - 1 - BLOCK_T - i``,
    ...), so the same forward ``tl.cumsum`` gives suffix sums (measured faster on an H100 than
    ``tl.cumsum(..., reverse=True)``).

    With ``NUM_STAGES > 1`` Triton pipelines the walk: the loads of the next ``NUM_STAGES - 1``
    blocks are issued (``cp.async``, into shared memory) before the current block is scanned.
    Without it a program has one block of loads in flight and waits out the memory's latency at
    every step; that bounds a long walk (the global kernel) by bytes in flight, and a bfloat16
    block holds half the bytes of a float32 one. A program that scans one block (a chunk no
    longer than ``BLOCK_T``) has nothing to overlap: the local launcher passes 1 then.

    ``USE_DOT`` (16-bit inputs only; a 32-bit one takes ``tl.cumsum`` whatever it says): each
    block is scanned on the tensor cores, by two matrix products and no reduction::

        sums    = L @ x + running      L: [BLOCK_T, BLOCK_T], ones on and below the diagonal
        running = 1 @ x + running      1: [BLOCK_T, BLOCK_T], all ones

    ``running`` is a float32 ``[BLOCK_T, BLOCK_C]`` tile whose every row is the carry, and it is
    both products' accumulator: x and the ones are exact in 16 bits, so are their products, and
    every sum is accumulated at float32 width (the tensor cores' own rounding, not IEEE's; a
    carry rounded to 16 bits would lose up to 2**-8 of it a block in bfloat16). Why:
    ``tl.cumsum`` of a tall tile passes partial sums between lanes and warps, about one warp
    instruction per element, which bounds a 16-bit walk (the comment above ``_GLOBAL_TILES``).

    A product is not a sum where an input is infinite: the zeros of ``L`` above the diagonal
    times an inf are NaN, so a -inf gate (log 0) would make the sums *before* it NaN where the
    sequential sum keeps them finite. The running totals stay right (``1 @ x`` has no zeros),
    and once an inf or a NaN is in them it stays: so a walk whose final totals are not all
    finite is walked again with ``tl.cumsum``, overwriting what the products wrote (all inputs
    finite: one check at the end of the walk; any inf or NaN in a column tile: twice the time).
    """
    DOT: tl.constexpr = USE_DOT and x_ptr.dtype.element_ty.primitive_bitwidth == 16
    totals = _scan_blocks(x_ptr, out_ptr, start, end, keep, carry, T, C, scale, BLOCK_T, BLOCK_C,
                          NUM_STAGES, REVERSE, TOKENS_CONTIGUOUS, DOT, PREFETCH)
    if DOT:
        # abs(NaN) < inf is False too
        if tl.sum(tl.where(tl.abs(totals) < float("inf"), 0, 1)) > 0:
            _scan_blocks(x_ptr, out_ptr, start, end, keep, carry, T, C, scale, BLOCK_T, BLOCK_C,
                         NUM_STAGES, REVERSE, TOKENS_CONTIGUOUS, False, PREFETCH)


# Autotuning (on the GPU) picks the tile; the interpreter and the first compile use the first
# config. A chunk is a segment, so BLOCK_T is capped at the chunk size, and a chunk of one block
# gets NUM_STAGES = 1 (_local_configs).
#
# Two kinds of tile. Tall ones (a whole chunk of 64 tokens, few columns) spread the tokens over
# the lanes of a warp and over warps, so tl.cumsum passes partial sums through shuffles and shared
# memory: in the sm_90 SASS of a 64 x 32 bfloat16 tile (compiled as jax-triton compiles, arrays
# 16-byte aligned: tools/compile_check.py) the loop runs 517 instructions a thread for its 16
# elements, 74 of them SHFL, 90 LDS/STS and 5 barriers: about 1 warp instruction per element,
# near all an SM can issue while streaming bfloat16 at the copy bandwidth (4 a clock, for some
# 3.3 elements a clock at 1.75 GHz); float32 needs half the elements a second. Wide, short tiles
# put a warp's lanes side by side along the columns, each lane 8 tokens x one 16-byte vector
# (BLOCK_C = 32 lanes x 8 columns x warps in bfloat16): the scan stays in registers, no SHFL, and
# an 8 x 1024 step costs 495 instructions a thread, 0.24 warp instructions per element; the chunk
# is walked in steps of 8 tokens, pipelined. Narrow tiles suit few columns (scalar gates).
_LOCAL_TILES = [  # (BLOCK_T, BLOCK_C, num_warps, NUM_STAGES)
    (64, 32, 4, 1),
    (64, 16, 2, 1),
    (64, 64, 4, 1),
    (64, 128, 4, 1),
    (64, 128, 8, 1),
    (8, 256, 1, 3),
    (8, 512, 4, 3),
    (8, 1024, 4, 3),
]
_TILE_FIELDS = ("BLOCK_T", "BLOCK_C", "num_warps", "NUM_STAGES", "SPLIT", "USE_DOT", "PREFETCH")


def _configs(tiles) -> list[triton.Config]:
    """One ``triton.Config`` per tile, a tuple of ``_TILE_FIELDS`` (the local kernel's stop at
    ``NUM_STAGES``, the global kernel's have all seven): Triton's ``num_stages`` is the walk's
    ``NUM_STAGES``."""
    configs = []
    for tile in tiles:
        meta = dict(zip(_TILE_FIELDS, tile))
        num_warps = meta.pop("num_warps")
        configs.append(triton.Config(meta, num_warps=num_warps, num_stages=meta["NUM_STAGES"]))
    return configs


def _local_configs(chunk_size: int) -> list[triton.Config]:
    """``_LOCAL_TILES`` for chunks of ``chunk_size`` tokens: no block taller than a chunk, and no
    pipelining where a chunk is one block (duplicates dropped, the order kept)."""
    tiles = []
    for t, c, w, s in _LOCAL_TILES:
        t = min(t, chunk_size)
        tile = (t, c, w, 1 if t == chunk_size else s)
        if tile not in tiles:
            tiles.append(tile)
    return _configs(tiles)


@triton.jit
def _chunk_bounds(i_chunk, cu_seqlens_ptr, chunk_indices_ptr, T, num_seqs, CHUNK: tl.constexpr,
                  IS_VARLEN: tl.constexpr):
    """``(start, end, keep, bos, eos, chunk)`` of work-list entry ``i_chunk``: its tokens, whether
    they are kept, its sequence's tokens ``[bos, eos)`` and its index within the sequence."""
    if IS_VARLEN:
        # Every index loaded from memory is clamped before it addresses anything (the launch
        # already hands over a valid packing; this is the second line of defence): whatever
        # chunk_indices and cu_seqlens hold, 0 <= bos <= start <= end <= eos <= T.
        seq = tl.minimum(tl.load(chunk_indices_ptr + 2 * i_chunk), num_seqs)
        chunk = tl.maximum(tl.load(chunk_indices_ptr + 2 * i_chunk + 1), 0)
        keep = seq < num_seqs  # the last "sequence" is the padding past cu_seqlens[-1]
        bos = tl.minimum(tl.maximum(tl.load(cu_seqlens_ptr + tl.maximum(seq, 0)), 0), T)
        eos = tl.minimum(tl.maximum(tl.load(cu_seqlens_ptr + tl.maximum(seq, 0) + 1), bos), T)
        eos = tl.where(seq >= 0, eos, bos)  # a spare entry: no tokens
        start = tl.minimum(tl.maximum(bos + chunk * CHUNK, bos), eos)
        end = tl.minimum(start + CHUNK, eos)
    else:
        chunk = i_chunk
        keep = True
        bos = 0
        eos = T
        start = i_chunk * CHUNK
        end = tl.minimum(start + CHUNK, T)
    return start, end, keep, bos, eos, chunk


@triton.jit
def chunk_local_cumsum_kernel(
    x_ptr, cu_seqlens_ptr, chunk_indices_ptr, sums_ptr, T, num_seqs, total_chunks, scale, out_ptr,
    C: tl.constexpr, CHUNK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
    NUM_STAGES: tl.constexpr, REVERSE: tl.constexpr, IS_VARLEN: tl.constexpr,
    TOKENS_CONTIGUOUS: tl.constexpr, CARRY: tl.constexpr,
):
    """Grid ``(chunks, column tiles, rows)``: one program scans one chunk of one row's column tile.

    Without ``cu_seqlens`` chunk ``i`` is tokens ``[i*CHUNK, (i+1)*CHUNK)``. With it, row ``i`` of
    ``chunk_indices`` names (sequence, chunk within the sequence); rows of ``-1`` (spare programs
    when the chunk count was bounded from above, under ``jax.jit``) own no tokens.

    ``CARRY`` (the global cumsum in two passes, see _launch_rows): the sums run on over the
    whole sequence. ``sums_ptr`` holds each entry's float32 total (``[rows, total_chunks, C]``,
    :func:`chunk_sums_kernel`); a chunk starts from the totals of the chunks before it in its
    sequence (after it, ``REVERSE``), which are the entries just before (after) its own.
    """
    i_chunk = tl.program_id(0)
    row = tl.program_id(2).to(tl.int64) * T * C
    start, end, keep, bos, eos, chunk = _chunk_bounds(i_chunk, cu_seqlens_ptr, chunk_indices_ptr, T,
                                                      num_seqs, CHUNK, IS_VARLEN)
    carry = tl.zeros([BLOCK_C], dtype=tl.float32)
    if CARRY:
        if REVERSE:
            first = i_chunk + 1
            count = tl.cdiv(eos - bos, CHUNK) - 1 - chunk
        else:
            first = i_chunk - chunk
            count = chunk
        # Clamped: whatever the work list holds, only entries 0 <= e < total_chunks are read.
        first = tl.minimum(tl.maximum(first, 0), total_chunks)
        count = tl.minimum(tl.maximum(tl.where(start < end, count, 0), 0), total_chunks - first)
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        ENTRIES: tl.constexpr = 2048 // BLOCK_C if BLOCK_C < 2048 else 1  # 2048 floats a step
        totals = sums_ptr + tl.program_id(2).to(tl.int64) * total_chunks * C
        # The totals are a row of total_chunks entries x C columns: summed as count tokens.
        carry = _span_total(totals, first, count, True, cols, total_chunks, C, BLOCK_T=ENTRIES,
                            BLOCK_C=BLOCK_C, NUM_STAGES=None, REVERSE=False,
                            TOKENS_CONTIGUOUS=False)
    _scan_span(x_ptr + row, out_ptr + row, start, end, keep, carry, T, C, scale, BLOCK_T=BLOCK_T,
               BLOCK_C=BLOCK_C, NUM_STAGES=NUM_STAGES, REVERSE=REVERSE,
               TOKENS_CONTIGUOUS=TOKENS_CONTIGUOUS, USE_DOT=False, PREFETCH=False)


@triton.jit
def chunk_sums_kernel(
    x_ptr, cu_seqlens_ptr, chunk_indices_ptr, T, num_seqs, total_chunks, sums_ptr,
    C: tl.constexpr, CHUNK: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
    IS_VARLEN: tl.constexpr, TOKENS_CONTIGUOUS: tl.constexpr,
):
    """Grid ``(chunks, column tiles, rows)``: the float32 total of each chunk's columns, into
    ``sums_ptr[row, chunk, column]`` (the first pass of the two-pass global cumsum)."""
    i_chunk = tl.program_id(0)
    row = tl.program_id(2).to(tl.int64) * T * C
    start, end, keep, _, _, _ = _chunk_bounds(i_chunk, cu_seqlens_ptr, chunk_indices_ptr, T,
                                              num_seqs, CHUNK, IS_VARLEN)
    cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    total = _span_total(x_ptr + row, start, end - start, keep, cols, T, C, BLOCK_T=BLOCK_T,
                        BLOCK_C=BLOCK_C, NUM_STAGES=None, REVERSE=False,
                        TOKENS_CONTIGUOUS=TOKENS_CONTIGUOUS)
    totals = sums_ptr + (tl.program_id(2).to(tl.int64) * total_chunks + i_chunk) * C
    tl.store(totals + cols, total, mask=cols < C)


@functools.cache
def _local_autotuned(chunk_size: int):
    """The local kernel autotuned over :func:`_local_configs` (one tuner per chunk size)."""
    tune = triton.autotune(configs=_local_configs(chunk_size), key=["T", "C"])
    return tune(chunk_local_cumsum_kernel)


# The global kernel runs the same loop over a whole sequence. Its parallelism is rows x column
# tiles x sequences (x SPLIT, below), and its time is the length of the walk. With few rows and
# columns (scalar gates, [8, 8192, 16]: 128 independent sums) narrow, tall tiles give more programs
# and fewer steps each; with many (vector gates) wide tiles read longer contiguous runs. The walk
# keeps NUM_STAGES blocks in flight (see _scan_span): the vector benchmark, [4, 4096, 16, 128], has
# only 256 walks of 64 x 32 columns for 132 SMs, and one such block is 4 KB of bfloat16 (8 KB of
# float32); with one block in flight the global kernel reached 54% of the copy bandwidth in
# bfloat16, 85% in float32. A probe of ten pinned tiles (H100, bfloat16, forward, device time;
# not recorded, so no figures here) found three stages well ahead of one, and 128 x 32 with 3
# stages and 4 warps the best tile (ahead of the same with 8 warps); the list without it
# autotuned lower. The re-recorded run (fdebc21) autotuned to 65.6% in bfloat16 and 87.9% in
# float32.
#
# Why bfloat16 stays behind: the SMs' instruction issue, not the bytes in flight. In the sm_90
# SASS of the loop (offline compile, triton 3.6, arrays 16-byte aligned as jax-triton takes them)
# a 128 x 32 block costs 1015 instructions a warp in bfloat16 and 936 in float32, 0.99 and 0.91
# warp instructions per element (64 x 32: 1.06 and 0.97), most of them tl.cumsum's passing of
# partial sums between lanes and warps (122 SHFL, 136 LDS, 41 STS, 330 FADD in the bfloat16
# one). At the copy bandwidth bfloat16 streams twice the elements a second that float32 does:
# 3032 GB/s over 4 bytes an element moved is 758 G elements/s, so 750 G warp instructions/s,
# 0.81 of the 924 G that 132 SMs can issue (4 a clock at 1.755 GHz), against 0.37 for float32.
# At the recorded 65.6% (bfloat16) and 87.9% (float32) the walks issue 0.53 and 0.33 of that
# peak: bfloat16 hits what about two 4-warp programs an SM (256 walks) issue of this code first.
#
# SPLIT > 1: SPLIT programs share one walk. Program p scans the p-th of SPLIT spans (counted in
# the direction of the sum) and starts from the sum of the spans before it, which it adds up
# itself first: elementwise adds into a [BLOCK_T, BLOCK_C] float32 tile, one tl.sum at the end,
# no carry from block to block, so that part streams instead of waiting on each block's scan.
# The spans before are read SPLIT(SPLIT - 1)/2 times over, at about the time their own program
# reads them (in the same order, from the same offsets), so mostly from L2. More programs, a
# shorter chain of scans, but the last program still streams the whole sequence.
#
# SPLIT is for few, long walks. On the vector gates it did not help: a probe on the H100 (not
# recorded) found SPLIT 2 on the 128 x 32 tile slower than SPLIT 1, and with SPLIT in the list
# the recorded run (bench/results/cumsum.json, f7b2211: forward, device time, median of 10)
# autotuned to 0.0673 ms, 65.8% of the 3032 GB/s copy, in bfloat16 and 0.1009 ms, 87.7%, in
# float32, as before SPLIT (fdebc21: 65.6% and 87.9%): bound by instruction issue, above. The
# same probe found SPLIT 8 faster than SPLIT 1 on the scalar gates forced into one pass; no
# figure of that is recorded. A scan on the tensor cores (each 16-bit block's prefix sums as
# tl.dot of a lower triangle of ones and the block) was faster in that probe too, but its sums
# were wrong at the benchmark's sizes (relative errors above the bfloat16 tolerance, 1.6e-2,
# against float64; right on the tests' small shapes), cause not found: removed. The scan on
# the tensor cores below keeps its carry in the products' float32 accumulator and is right at
# the benchmark's sizes (relative error 1.7e-3 in bfloat16, as the walk's); whether the removed
# one rounded its carry to 16 bits is not known.
#
# The scan on the tensor cores (USE_DOT, 16-bit inputs: see _scan_span) leaves tl.cumsum's
# shuffles out: each block is two products with a triangle of ones, accumulated in float32.
# A probe of pinned tiles (bench/_probe_cumsum_tc.py: H200, bfloat16 [4, 4096, 16, 128],
# forward, device time, median of 10, against float64, same run; % of the 4291 GB/s copy):
# the autotuned walk 0.0672 ms, 46.5%; on the tensor cores 64 x 64 with 8 warps and 6 stages
# 0.0365 ms, 85.7%, with 4 warps 83.4%; 64 x 64 at 4 stages 73.5%, 64 x 128 at 4 stages 46.9%
# with 4 warps and 57.6% with 8. Stages count: in two earlier runs of the same probe, 64 x 32
# with 4 warps gave 61.3% at 3 stages, 72.9% and 72.3% at 4, 80.6% at 5. On a longer input,
# [8, 8192, 16, 128], the order changes: 64 x 128 with 8 warps at 4 stages 91.9%, 32 x 64 at 6
# stages 89.4%, 64 x 64 with 8 warps at 6 85.2% (the walk 51.6%). float16 ran as bfloat16 did
# (64 x 32, 4 warps, 4 stages: 71.6% and 72.9%). So 16-bit inputs autotune over the walk's
# tiles and one of these (_GLOBAL_16_BIT_TILES); float32 ones (their products would be TF32,
# rounded) over the walk's only. One, the benchmark's best, not five: bench/cumsum.py (H200)
# ran the bfloat16 global vector case at 0.0377 ms forward, 83% of copy, with the probe's best
# five in the list (867d172) and with this one alone (5aab3e4), and every autotune config is
# compiled at a first call. The package's kernel runs a little behind the probe's (it also masks
# for packed sequences and padding, and scales; which of these costs was not measured): pinned
# to this tile 84.4%, autotuned 84.8%, in one run of bench/_probe_cumsum_tiles.py (H200,
# 5aab3e4), where the probe's kernel gave 85.7% in a run of its own. Longer inputs may want
# 64 x 128 (91.9% at [8, 8192, 16, 128] above): not listed, since it ran the benchmark at 57.6%.
#
# Seven stages, not six: pinned through CumsumConfig (bench/_probe_cumsum_tiles.py, H200, same
# shape, bfloat16 forward, two passes in one run, % of copy), with the carry added after the
# products (a form tried then, not kept): 7 stages 85.1 and 84.5, 6 stages 82.8 and 82.8,
# 8 stages 85.0 and 83.2. The walk alone (bench/_probe_cumsum_walk.py, no packed sequences, no
# scale, same run) at 7 stages: 87.3 with the carry accumulated in the products, 86.1 with it
# added after (one sample each); at 6 stages in an earlier run 84.8 and 84.3 accumulated, 84.4
# and 85.0 added after. So the carry stays in the products' accumulator.
#
# float32 walks may hold the next block in registers (PREFETCH) instead of Triton's pipelining,
# which loads blocks into shared memory with cp.async and reads them back from there. In
# bench/_probe_cumsum_walk.py (H200, float32 [4, 4096, 16, 128], forward, % of copy, two runs of
# two and three passes): the package, autotuned, 84.7, 84.6 | 84.5, 84.4, 84.7; the probe's
# walk at 128 x 32, 4 warps, one block ahead in registers 86.9, 85.6 | 86.1, 86.2, 86.5, two blocks
# ahead 85.4, 85.2 (first run); 128 x 16 with 2 warps 84.0 to 84.7; 256 x 32, 128 x 64, 64 x 64,
# 64 x 32 and 8 warps slower (70 to 82). The walk's loads and stores alone (its tile and stages,
# no scan) ran at 88.7 to 90.6 in float32 and 88.6 to 91.7 in bfloat16 (64 x 64, 7 stages):
# the scan costs a few points, the tile's access pattern the rest.
#
# The 16-bit walk on the tensor cores, pinned (bench/_probe_cumsum_tiles.py, H200, bfloat16,
# same shape, % of copy; two runs, three then two passes a direction): forward 7 stages 87.2,
# 84.9, 86.7 | 86.7, 82.4 and 8 stages 84.3, 83.6, 84.2 | 83.7, 83.8; reverse (the backward's
# sum) 7 stages 84.4, 85.2, 85.2 | 84.9, 85.3 and 8 stages 86.6, 85.9, 86.7 | 86.6, 84.2. Each
# direction's tile was ahead in four passes of five, by 1.7 (forward) and 1.0 (reverse) points
# on average, about the spread of one tile from pass to pass. So each direction lists its own
# (_GLOBAL_16_BIT_TILES, by REVERSE): with both listed (ea0501c) the benchmark's autotuned
# calls ran at 84.2 forward and 84.8 backward (bench/results/cumsum.json at 3ca00b9), with one
# a direction at 85.1 and 85.1 (at af69362); the probe's autotuned calls in the second run
# above, one list a direction, 86.5, 84.4 forward and 82.8, 85.0 reverse. The same tile holding
# its next block in registers (PREFETCH, no cp.async) ran at 49 to 63: the products want their
# operand in shared memory.
_GLOBAL_TILES = [  # (BLOCK_T, BLOCK_C, num_warps, NUM_STAGES, SPLIT, USE_DOT, PREFETCH)
    (64, 32, 4, 3, 1, False, False),  # first: CumsumConfig()'s, what the interpreter runs
    (128, 32, 4, 3, 1, False, False),
    (128, 32, 4, 1, 1, False, True),  # the next block in registers, not cp.async (above)
    (128, 16, 4, 3, 1, False, False),
    (32, 64, 4, 3, 1, False, False),
    (128, 32, 8, 3, 1, False, False),
    (256, 16, 8, 3, 1, False, False),
    (256, 32, 8, 2, 1, False, False),
    (512, 8, 4, 3, 1, False, False),
    (1024, 4, 4, 3, 1, False, False),
    # An autotune candidate, not a known win: SPLIT 2 on the vector gates' best tile was slower
    # than SPLIT 1 there (above), and no input is known where it is faster.
    (128, 32, 4, 3, 2, False, False),
    (256, 16, 4, 3, 8, False, False),  # few, long walks (the two-pass path takes small inputs)
    (512, 8, 4, 3, 8, False, False),
]
_GLOBAL_16_BIT_TILES = {  # by REVERSE: the walk's tiles and one on the tensor cores (above)
    False: _GLOBAL_TILES + [(64, 64, 8, 7, 1, True, False)],
    True: _GLOBAL_TILES + [(64, 64, 8, 8, 1, True, False)],
}
_GLOBAL_CONFIGS = _configs(_GLOBAL_TILES)
_GLOBAL_16_BIT_CONFIGS = {reverse: _configs(t) for reverse, t in _GLOBAL_16_BIT_TILES.items()}


@triton.jit
def chunk_global_cumsum_kernel(
    x_ptr, cu_seqlens_ptr, T, num_seqs, scale, out_ptr,
    C: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, NUM_STAGES: tl.constexpr,
    SPLIT: tl.constexpr, USE_DOT: tl.constexpr, PREFETCH: tl.constexpr,
    REVERSE: tl.constexpr, IS_VARLEN: tl.constexpr, TOKENS_CONTIGUOUS: tl.constexpr,
):
    """Grid ``(sequences x SPLIT, column tiles, rows)``: ``SPLIT`` programs scan one sequence.

    Program ``part`` of a sequence scans its ``part``-th span of ``cdiv(length, SPLIT)`` tokens
    rounded up to whole blocks, counted from the sequence's first token (its last, ``REVERSE``);
    the spans past the sequence's end are empty, their programs do nothing. It first sums the
    ``walked`` tokens before its span, read in the order of the sum, and starts from that.
    """
    seq = tl.program_id(0) // SPLIT
    row = tl.program_id(2).to(tl.int64) * T * C
    if IS_VARLEN:
        # Clamped as in the local kernel: 0 <= start <= end <= T whatever cu_seqlens holds.
        start = tl.minimum(tl.maximum(tl.load(cu_seqlens_ptr + seq), 0), T)
        end = tl.minimum(tl.maximum(tl.load(cu_seqlens_ptr + seq + 1), start), T)
        keep = seq < num_seqs
    else:
        start = 0
        end = T
        keep = True
    carry = tl.zeros([BLOCK_C], dtype=tl.float32)
    if SPLIT > 1:
        part = tl.program_id(0) % SPLIT
        span = tl.cdiv(tl.cdiv(end - start, SPLIT), BLOCK_T) * BLOCK_T
        walked = tl.minimum(part * span, end - start)  # 0 <= walked <= mine + walked <= length
        mine = tl.minimum(span, end - start - walked)
        walked = tl.where(mine > 0, walked, 0)  # an empty span needs no sum
        cols = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
        # The walked tokens, from the sequence's first (last, REVERSE) in the order of the sum.
        carry = _span_total(x_ptr + row, end - 1 if REVERSE else start, walked, keep, cols, T, C,
                            BLOCK_T=BLOCK_T, BLOCK_C=BLOCK_C, NUM_STAGES=NUM_STAGES,
                            REVERSE=REVERSE, TOKENS_CONTIGUOUS=TOKENS_CONTIGUOUS)
        if REVERSE:
            end = end - walked
            start = end - mine
        else:
            start = start + walked
            end = start + mine
    _scan_span(x_ptr + row, out_ptr + row, start, end, keep, carry, T, C, scale, BLOCK_T=BLOCK_T,
               BLOCK_C=BLOCK_C, NUM_STAGES=NUM_STAGES, REVERSE=REVERSE,
               TOKENS_CONTIGUOUS=TOKENS_CONTIGUOUS, USE_DOT=USE_DOT, PREFETCH=PREFETCH)


_global_autotuned = triton.autotune(configs=_GLOBAL_CONFIGS, key=["T", "C"])(
    chunk_global_cumsum_kernel)
_global_16_bit_autotuned = {
    reverse: triton.autotune(configs=configs, key=["T", "C"])(chunk_global_cumsum_kernel)
    for reverse, configs in _GLOBAL_16_BIT_CONFIGS.items()}


# Small inputs take the global cumsum in two passes instead (with config=None): the scalar gates
# of the benchmark, [8, 8192, 16], are 128 sums of 8192 tokens, and one walk per sum (8 programs
# of 16 columns) took 0.0219 ms in float32 where XLA took 0.0128 (bench/results/cumsum.json as
# recorded at fdebc21, commit aecf2de: H100, forward, device time, median of 10): 4 MB, no
# program with enough work in flight. Pass one, chunk_sums_kernel, writes the float32 total of
# every chunk of _TWO_PASS_CHUNK tokens; pass two is the local kernel over the same chunks
# (CARRY), each chunk starting from the totals of the chunks before it in its sequence: one
# program per chunk, as the local cumsum (0.0041 ms at that shape, same record). Pass two reads
# the input again, from L2 as long as it fits there (50 MB on the H100), hence the bound on the
# input's size; and an input with enough walks to fill the GPU (many rows, columns or
# sequences) keeps the one pass, which reads it once. Recorded at [8, 8192, 16]
# (bench/results/cumsum.json, f7b2211: H100, forward, device time, median of 10): two passes
# 0.0075 ms in bfloat16 and 0.0073 in float32, against XLA's 0.0126 and 0.0128 (the one pass at
# fdebc21: 0.0213 and 0.0219).
#
# Pass two's carry adds up, for every chunk, the totals of all the chunks before it (after it,
# REVERSE) in its sequence: n(n - 1)/2 totals a column for a sequence of n chunks, quadratic in
# n where the one pass is linear. Those float32 reads come to (n - 1)/64 of the input's bytes
# in bfloat16 ((n - 1)/128 in float32), from L2 (the totals are 1/32 of a bfloat16 input), hence
# a bound on a sequence's chunks. The benchmark's sequences are 128 chunks, where the carry reads
# twice the input's bytes in bfloat16 and the two passes still took about a third of the one
# pass's time (above); longer sequences, never timed in two passes, walk in one. The bound is on
# cdiv(T, _TWO_PASS_CHUNK): T bounds every sequence's length (with cu_seqlens the lengths are
# traced), so a packing of more tokens takes one pass however short its sequences.
# All three bounds are guesses from the reasoning above: only the benchmark's shapes were timed.
_TWO_PASS_CHUNK = 64
_TWO_PASS_MAX_BYTES = 16 << 20
_TWO_PASS_MAX_WALKS = 512  # about 4 walks of 32 columns an SM on the H100's 132
_TWO_PASS_MAX_CHUNKS = 128  # chunks of _TWO_PASS_CHUNK tokens a sequence: 8192 tokens


# ----------------------------------------------------------------------------------------------
# The config: pinned tiles instead of the autotuner's pick.
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class CumsumConfig:
    """Tiles of the cumsum kernels, pinned (``config=None``: autotuned, see above).

    One config serves both directions: the backward is the same kernel with ``reverse``
    flipped, so what suits one suits the other. The defaults are the first autotune config
    of each kernel (the one the interpreter runs).

    * ``block_t``: tokens scanned per step, a power of two; the local kernel takes
      ``min(block_t, chunk_size)`` (its chunks are the segments).
    * ``block_c``: columns per program, a power of two.
    * ``num_warps``: a power of two, as in ``triton.Config``.
    * ``num_stages``: blocks of loads in flight in a walk (``NUM_STAGES``, Triton's software
      pipelining; 1: none). The local kernel uses 1 when a chunk is one block.
    * ``split``: programs sharing one sequence's walk (global kernel only; see _GLOBAL_TILES).
    * ``tensor_cores``: scan each block of a 16-bit input by two matrix products on the tensor
      cores (global kernel only; see ``_scan_span``), which needs ``block_t`` and ``block_c`` of
      at least 16. A float32 input scans with ``tl.cumsum`` either way.
    * ``prefetch``: hold the next block in registers while this one is scanned, instead of
      Triton's pipelining (global kernel only; see ``_scan_blocks``), so ``num_stages`` must be 1.
    """

    block_t: int = 64
    block_c: int = 32
    num_warps: int = 4
    num_stages: int = 3
    split: int = 1
    tensor_cores: bool = False
    prefetch: bool = False

    def __post_init__(self):
        fields = validated_fields(self, powers_of_two=("block_t", "block_c", "num_warps"),
                                  flags=("tensor_cores", "prefetch"))
        freeze_fields(self, fields)
        for name in ("block_t", "block_c", "num_warps", "num_stages", "split"):
            if getattr(self, name) is None:
                raise ValueError(f"CumsumConfig.{name} must be a positive int, got None")
        if self.tensor_cores and min(self.block_t, self.block_c) < 16:
            # tl.dot's smallest tile: a matrix product of fewer rows or columns does not compile
            raise ValueError(f"CumsumConfig.block_t and block_c must be at least 16 with "
                             f"tensor_cores=True, got {self.block_t} and {self.block_c}")
        if self.prefetch and self.num_stages != 1:
            # the registers hold the next block; Triton's pipelining would hold more in shared
            # memory on top of them
            raise ValueError(f"CumsumConfig.num_stages must be 1 with prefetch=True, got "
                             f"{self.num_stages}")


# ----------------------------------------------------------------------------------------------
# Launching the kernels, and their gradient.
# ----------------------------------------------------------------------------------------------


def _kernel_view(x: jax.Array, head_first: bool) -> tuple[jax.Array, int, int, int, bool]:
    """``x`` reshaped to the kernels' rows: ``(view, N, T, C, tokens_contiguous)``."""
    if head_first and x.ndim == 3:  # [B, H, T]: each head's tokens are contiguous
        B, H, T = x.shape
        return x, B, T, H, True
    if head_first:  # [B, H, T, S] -> [B*H, T, S]
        B, H, T, S = x.shape
        return x.reshape(B * H, T, S), B * H, T, S, False
    B, T = x.shape[:2]  # [B, T, H] or [B, T, H, S] -> [B, T, H*S]
    C = int(np.prod(x.shape[2:]))
    return x.reshape(B, T, C), B, T, C, False


def _launch(x, cu_seqlens, chunk_size, reverse, scale, head_first, out_dtype, config=None):
    """Run the local kernel (``chunk_size`` given) or the global one (``None``) on ``x``.

    Under ``jax.vmap`` the mapped axis is folded into the batch axis: the kernels' rows are
    independent and share ``cu_seqlens``, so a batch of ``n`` inputs is one launch over ``n * B``
    rows. A mapped ``cu_seqlens`` (each element its own packing) runs one launch per element.
    """
    run = functools.partial(_launch_rows, chunk_size=chunk_size, reverse=reverse, scale=scale,
                            head_first=head_first, out_dtype=out_dtype, config=config)
    return vmap_by_folding(run, in_axes=(0, None), out_axes=0)(x, cu_seqlens)


def _launch_rows(x, cu_seqlens, *, chunk_size, reverse, scale, head_first, out_dtype, config):
    if x.size == 0:
        return jnp.zeros(x.shape, out_dtype)
    view, N, T, C, tokens_contiguous = _kernel_view(x, head_first)
    if N > _MAX_GRID_YZ:
        raise ValueError(f"{N} rows (batch, or batch x heads when head_first with vectors, times "
                         f"the size of any vmapped axes) exceed the grid limit of {_MAX_GRID_YZ}; "
                         f"use impl='xla'")
    if T * C >= 2**31:
        raise ValueError(f"one row of {T} tokens x {C} columns exceeds 2**31 elements; "
                         f"use impl='xla'")
    varlen = cu_seqlens is not None
    if varlen:
        # One extra "sequence" covers the tokens past cu_seqlens[-1] (usually none): the kernels
        # give it zeros, so every output element is written by exactly one program.
        num_seqs = cu_seqlens.shape[0] - 1
        cu = jnp.concatenate([cu_seqlens.astype(jnp.int32), jnp.full((1,), T, jnp.int32)])
    else:
        num_seqs = 1
        cu = jnp.zeros((1,), jnp.int32)  # never read: IS_VARLEN is a compile-time False
    common = dict(
        out_shape=jax.ShapeDtypeStruct(view.shape, out_dtype),
        REVERSE=bool(reverse), IS_VARLEN=varlen, TOKENS_CONTIGUOUS=tokens_contiguous,
    )
    pinned = {} if config is None else dict(BLOCK_C=config.block_c, num_warps=config.num_warps,
                                            num_stages=config.num_stages, config_argument="config")
    walks = N * cdiv(C, 32) * (num_seqs + 1 if varlen else 1)  # one-pass programs, 32 columns
    two_pass = (chunk_size is None and config is None and view.nbytes <= _TWO_PASS_MAX_BYTES
                and walks <= _TWO_PASS_MAX_WALKS
                and cdiv(T, _TWO_PASS_CHUNK) <= _TWO_PASS_MAX_CHUNKS)  # T: the longest sequence
    if chunk_size is None and not two_pass:
        num_segments = num_seqs + 1 if varlen else 1
        kernel = chunk_global_cumsum_kernel
        if config is None:
            kernel = (_global_16_bit_autotuned[bool(reverse)] if view.dtype.itemsize == 2
                      else _global_autotuned)
        if config is not None:
            pinned.update(BLOCK_T=config.block_t, NUM_STAGES=config.num_stages, SPLIT=config.split,
                          USE_DOT=config.tensor_cores, PREFETCH=config.prefetch)
        out = triton_call(
            view, cu, T, num_seqs, scale, kernel=kernel, C=C,
            grid=lambda meta: (num_segments * meta["SPLIT"], cdiv(C, meta["BLOCK_C"]), N),
            **common, **pinned,
        )
        return out.reshape(x.shape)
    carry = two_pass
    if two_pass:
        chunk_size = _TWO_PASS_CHUNK
    if varlen:
        # The number of chunks depends on the lengths, which are traced under jax.jit, but the
        # grid must be static. Launch an upper bound instead: each of the num_seqs + 1 sequences
        # adds at most one partial chunk to the cdiv(T, chunk_size) full ones.
        # prepare_chunk_indices gives the spare programs (-1, -1), and they do nothing.
        total = cdiv(T, chunk_size) + num_seqs + 1
        chunk_indices = prepare_chunk_indices(cu, chunk_size, total_chunks=total).astype(jnp.int32)
    else:
        total = cdiv(T, chunk_size)
        chunk_indices = cu  # never read
    if config is not None:
        # As _local_configs: no block taller than a chunk; a chunk of one block, no pipelining.
        block_t = min(chunk_size, config.block_t)
        pinned.update(BLOCK_T=block_t, NUM_STAGES=1 if block_t == chunk_size else config.num_stages)
    if carry:
        block_c = min(64, next_power_of_2(C))
        sums = triton_call(
            view, cu, chunk_indices, T, num_seqs, total, kernel=chunk_sums_kernel,
            out_shape=jax.ShapeDtypeStruct((N, total, C), jnp.float32),
            grid=(total, cdiv(C, block_c), N), num_warps=4, C=C, CHUNK=chunk_size,
            BLOCK_T=min(64, chunk_size), BLOCK_C=block_c, IS_VARLEN=varlen,
            TOKENS_CONTIGUOUS=tokens_contiguous,
        )
    else:
        sums = cu  # never read: CARRY is a compile-time False
    out = triton_call(
        view, cu, chunk_indices, sums, T, num_seqs, total, scale, C=C,
        kernel=_local_autotuned(chunk_size) if config is None else chunk_local_cumsum_kernel,
        grid=lambda meta: (total, cdiv(C, meta["BLOCK_C"]), N),
        CHUNK=chunk_size, CARRY=carry, **common, **pinned,
    )
    return out.reshape(x.shape)


# The gradient of a cumulative sum is the cumulative sum of the cotangent the other way round,
# over the same segments: out[t] = scale * sum_{u in seg(t), u <= t} x[u] gives
# dx[u] = scale * sum_{t in seg(u), t >= u} dout[t]. So the backward pass is the same kernel with
# `reverse` flipped, writing the input's dtype. cu_seqlens (integers) gets no cotangent.
@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3, 4, 5, 6, 7, 8))
def _cumsum_triton(x, cu_seqlens, chunk_size, reverse, scale, head_first, out_dtype, in_dtype,
                   config):
    return _launch(x, cu_seqlens, chunk_size, reverse, scale, head_first, out_dtype, config)


def _fwd(x, cu_seqlens, chunk_size, reverse, scale, head_first, out_dtype, in_dtype, config):
    out = _launch(x, cu_seqlens, chunk_size, reverse, scale, head_first, out_dtype, config)
    return out, cu_seqlens


def _bwd(chunk_size, reverse, scale, head_first, out_dtype, in_dtype, config, cu_seqlens, dout):
    dx = _launch(dout, cu_seqlens, chunk_size, not reverse, scale, head_first, in_dtype, config)
    return dx, None


_cumsum_triton.defvjp(_fwd, _bwd)


# ----------------------------------------------------------------------------------------------
# The XLA implementation: vectorised jax.numpy, differentiated by JAX.
# ----------------------------------------------------------------------------------------------


def _xla_cumsum(x, cu_seqlens, chunk_size, reverse, scale, head_first, out_dtype):
    axis = 2 if head_first else 1
    T = x.shape[axis]
    acc = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    if cu_seqlens is None and chunk_size is None:
        sums = lax.cumsum(acc, axis=axis, reverse=reverse)
    elif cu_seqlens is None:
        # Fixed chunks: pad T to a whole number of chunks, give the chunks their own axis, scan it.
        num_chunks = cdiv(T, chunk_size)
        pad = [(0, 0)] * acc.ndim
        pad[axis] = (0, num_chunks * chunk_size - T)
        padded = jnp.pad(acc, pad)
        chunked = padded.reshape(padded.shape[:axis] + (num_chunks, chunk_size)
                                 + padded.shape[axis + 1:])
        sums = lax.cumsum(chunked, axis=axis + 1, reverse=reverse).reshape(padded.shape)
        sums = lax.slice_in_dim(sums, 0, T, axis=axis)
    else:
        flags, inside = _segment_flags(cu_seqlens, T, chunk_size, reverse)
        sums = _segmented_cumsum(acc, flags, axis, reverse)
        sums = jnp.where(_along(inside, acc.ndim, axis), sums, 0)
    return (sums * scale).astype(out_dtype)


def _segment_flags(cu_seqlens, T, chunk_size, reverse):
    """Per token: does a segment start here (ends here, when ``reverse``)? Is it in a sequence?"""
    position = prepare_position_ids(cu_seqlens, total_tokens=T)  # -1 past cu_seqlens[-1]
    inside = position >= 0
    offset = position if chunk_size is None else position % chunk_size
    starts = (offset == 0) | ~inside  # each padding token is a segment of its own (zeroed later)
    if not reverse:
        return starts, inside
    ends = jnp.concatenate([starts[1:], jnp.ones((1,), bool)])  # a segment ends before a start
    return ends, inside


def _segmented_cumsum(x, flags, axis, reverse):
    """Cumulative sum along ``axis`` that restarts wherever ``flags`` is set (Blelloch, 1990).

    Pairs (partial sum, "a segment starts in here") combine associatively: the right operand's
    sum alone if a segment starts inside it, else both sums added. ``lax.associative_scan`` runs
    that in O(log T) parallel steps; with ``reverse`` it scans from the end, so the flags mark
    segment ends.
    """

    def combine(a, b):
        a_sum, a_flag = a
        b_sum, b_flag = b
        return jnp.where(b_flag, b_sum, a_sum + b_sum), a_flag | b_flag

    flags = jnp.broadcast_to(_along(flags, x.ndim, axis), x.shape)
    sums, _ = lax.associative_scan(combine, (x, flags), reverse=reverse, axis=axis)
    return sums


def _along(v, ndim, axis):
    """A per-token vector ``[T]`` shaped to broadcast along ``axis`` of an ``ndim``-array."""
    shape = [1] * ndim
    shape[axis] = v.shape[0]
    return v.reshape(shape)


# ----------------------------------------------------------------------------------------------
# The references: the definition, written as directly as possible.
# ----------------------------------------------------------------------------------------------


def _reference(x, chunk_size, reverse, softmax_scale, cu_seqlens, head_first, output_dtype):
    x = jnp.asarray(x)
    axis = 2 if head_first else 1
    T = x.shape[axis]
    t = jnp.arange(T)
    position = (t if cu_seqlens is None
                else prepare_position_ids(jnp.asarray(cu_seqlens), total_tokens=T))
    offset = position if chunk_size is None else position % chunk_size
    segment = jnp.where(position >= 0, t - offset, -1)  # a segment is named by its first token
    same_segment = (segment[:, None] == segment[None, :]) & (segment[:, None] >= 0)
    counted = t[None, :] >= t[:, None] if reverse else t[None, :] <= t[:, None]
    acc_dtype = jnp.promote_types(x.dtype, jnp.float32)
    # weights[t, u]: does x[u] count in out[t]?
    weights = (same_segment & counted).astype(acc_dtype)
    xt = jnp.moveaxis(x.astype(acc_dtype), axis, 1)
    out = jnp.einsum("tu,bu...->bt...", weights, xt, precision=lax.Precision.HIGHEST)
    out = jnp.moveaxis(out, 1, axis)
    if softmax_scale is not None:
        out = out * softmax_scale
    return out.astype(x.dtype if output_dtype is None else output_dtype)


def reference_local_cumsum(g, chunk_size, reverse=False, softmax_scale=None, cu_seqlens=None,
                           head_first=False, output_dtype=None):
    """What :func:`chunk_local_cumsum` computes, as a masked matrix product (small inputs only)."""
    return _reference(g, chunk_size, reverse, softmax_scale, cu_seqlens, head_first, output_dtype)


def reference_global_cumsum(s, reverse=False, cu_seqlens=None, softmax_scale=None, head_first=False,
                            output_dtype=None):
    """What :func:`chunk_global_cumsum` computes, as a masked matrix product (small inputs only)."""
    return _reference(s, None, reverse, softmax_scale, cu_seqlens, head_first, output_dtype)


# ----------------------------------------------------------------------------------------------
# The public functions.
# ----------------------------------------------------------------------------------------------


def chunk_local_cumsum(g, chunk_size, reverse=False, softmax_scale=None, cu_seqlens=None,
                       head_first=False, output_dtype=None, impl="auto", config=None):
    """Cumulative sum of ``g`` along the tokens, restarting every ``chunk_size`` tokens.

    Args:
      g: ``[B, T, H]`` or ``[B, T, H, S]`` (``[B, H, T]`` / ``[B, H, T, S]`` when ``head_first``).
      chunk_size: a power of two. With ``cu_seqlens`` chunks are counted from each sequence's start.
      reverse: suffix sums (from each token to the end of its chunk) instead of prefix sums.
      softmax_scale: a Python number multiplying the sums, or ``None``.
      cu_seqlens: ``[num_seqs + 1]`` integer offsets of packed sequences (batch must be 1); may be
        traced under ``jax.jit``.
      head_first: the layout of ``g``.
      output_dtype: dtype of the result; default ``g.dtype``. Sums accumulate in float32.
      impl: ``"auto"`` (Triton on a GPU, else XLA), ``"triton"`` or ``"xla"``.
      config: a :class:`CumsumConfig` pinning the Triton tiles; ``None`` autotunes them.

    Returns:
      An array shaped like ``g``; differentiable with respect to ``g``.
    """
    chunk_size = power_of_two(chunk_size, "chunk_size")
    return _cumsum(g, "g", chunk_size, reverse, softmax_scale, cu_seqlens, head_first, output_dtype,
                   impl, config)


def chunk_global_cumsum(s, reverse=False, cu_seqlens=None, softmax_scale=None, head_first=False,
                        output_dtype=None, impl="auto", config=None):
    """Cumulative sum of ``s`` along the tokens of each whole sequence.

    Arguments as in :func:`chunk_local_cumsum` (note the order: ``reverse, cu_seqlens,
    softmax_scale``); without ``cu_seqlens`` each batch entry is one sequence.
    """
    return _cumsum(s, "s", None, reverse, softmax_scale, cu_seqlens, head_first, output_dtype, impl,
                   config)


def _cumsum(x, name, chunk_size, reverse, softmax_scale, cu_seqlens, head_first, output_dtype, impl,
            config):
    impl = resolve_impl(impl)
    config = check_config(config, CumsumConfig)
    check_floating(x, name)
    x = jnp.asarray(x)
    if x.ndim not in (3, 4):
        layout = "[B, H, T] or [B, H, T, S]" if head_first else "[B, T, H] or [B, T, H, S]"
        raise ValueError(f"{name} must be {layout} (rank 3 or 4), got shape {x.shape}")
    scale = 1.0 if softmax_scale is None else static_float(softmax_scale, "softmax_scale")
    try:
        out_dtype = jnp.dtype(x.dtype if output_dtype is None else output_dtype)
    except TypeError as error:
        raise ValueError(f"output_dtype must be a dtype, got {output_dtype!r}") from error
    if not jnp.issubdtype(out_dtype, jnp.floating):
        raise ValueError(f"output_dtype must be a floating dtype, got {out_dtype}")
    T = x.shape[2 if head_first else 1]
    if cu_seqlens is not None:
        cu_seqlens = checked_cu_seqlens(cu_seqlens, T)  # values checked if concrete
        check_packed_batch(x.shape[0], name, x.shape)
    if impl == "triton":
        check_triton_dtype(x, name)
    return _checked_cumsum(x, cu_seqlens, chunk_size=chunk_size, reverse=bool(reverse), scale=scale,
                           head_first=bool(head_first), out_dtype=out_dtype, impl=impl,
                           config=config)


# Everything after the checks is one jitted function of (x, cu_seqlens): eager calls compile once
# per shape and flags, instead of dispatching each small op on its own.
@functools.partial(jax.jit, static_argnames=("chunk_size", "reverse", "scale", "head_first",
                                             "out_dtype", "impl", "config"))
def _checked_cumsum(x, cu_seqlens, *, chunk_size, reverse, scale, head_first, out_dtype, impl,
                    config):
    if cu_seqlens is not None:
        # Traced values were not checked: both implementations see the nearest valid packing, so
        # that no kernel can be sent outside x (and the two agree even on garbage).
        cu_seqlens = sanitize_cu_seqlens(cu_seqlens, x.shape[2 if head_first else 1])
    if impl == "xla":
        return _xla_cumsum(x, cu_seqlens, chunk_size, reverse, scale, head_first, out_dtype)
    return _cumsum_triton(x, cu_seqlens, chunk_size, reverse, scale, head_first, out_dtype, x.dtype,
                          config)
