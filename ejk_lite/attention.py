"""Block-sparse attention: a FlashAttention-2 forward and backward that visit only listed tiles.

For a query row ``i`` of head ``h`` (Dao 2023, "FlashAttention-2")::

    s_ij = scale * q_i . k_j                     scale = D ** -0.5 unless given
    s_ij = cap * tanh(s_ij / cap)                with logits_soft_cap (Gemma 2)
    s_ij = s_ij + bias_ij                        with bias, broadcastable to [B, Hq, T, S]
    p_ij = exp(s_ij) / (exp(sink_h) + sum_{j visible} exp(s_ij))     sink term with softmax_aux
    o_i  = sum_{j visible} p_ij v_j              zeros if nothing is visible

``exp(sink_h)`` is an attention *sink* (gpt-oss): it joins every row's denominator once and carries
no value. The kernels keep the softmax *online*: a program owns ``BQ`` query rows and walks key
blocks, keeping a running maximum ``m`` and sum ``l`` in fp32 (in base 2: ``exp2`` is one
instruction). Starting from ``m = sink, l = 1`` counts the sink exactly once. The forward stores
``lse = m + log2(l)`` per row; the backward recomputes ``p = exp2(s - lse)`` tile by tile::

    dv_j = sum_i p_ij do_i        dp_ij = do_i . v_j        ds_ij = p_ij (dp_ij - delta_i)
    dq_i = scale * sum_j ds_ij c_ij k_j     dk_j = scale * sum_i ds_ij c_ij q_i
    delta_i = do_i . o_i          c_ij = 1 - tanh(s_ij / cap)^2 (1 without a soft cap)
    dsink_h = -sum_i exp(sink_h - lse_i) delta_i         dbias_ij = ds_ij

The soft cap's derivative ``1 - tanh^2`` lies in ``[0, 1]``: no overflow, however large the logits.

A NaN stays in the rows that can see it. Multiplying by ``p = 0`` is not enough to drop an
invisible key (``0 * NaN`` is NaN), so partial tiles *select* instead: the forward zeroes
non-finite ``v`` rows before its product and sets NaN in exactly the rows that see one; the
backward selects ``p`` and ``ds`` on visibility and zeroes non-finite ``q`` (for dK) and ``k``
(for dQ) before its products. Full tiles need none of it (every row sees every key there).

Which tiles: a :class:`ejk_lite.masking.BlockMask` at the kernel's block sizes lists, per query
block, the *partial* key blocks (the token rule is evaluated pair by pair) and the *full* ones (no
per-token test); the dK/dV kernel walks the transposed lists. The backward builds the mask at its
own block sizes from the same rule, so forward and backward always agree on what is visible.
Grouped heads: key/value head ``j`` serves query heads ``j * G ... (j + 1) * G - 1``; the dK/dV
program of a key block loops over the group, so the sum over the group needs no atomics.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl
from jax import Array

from ejk_lite.launch import max_shared_memory, triton_call
from ejk_lite.checks import next_power_of_2, power_of_two, resolve_impl, static_bool, static_int
from ejk_lite.masking import (EMPTY, BlockMask, TokenRule, build_block_mask, check_block_mask,
                              check_layout, combine_rules, dense_mask, restrict, token_rule)
from ejk_lite import sequence_parallel

LOG2E = tl.constexpr(math.log2(math.e))  # a constexpr: usable inside the kernels too
_BIG_WINDOW = 2**30


# ----------------------------------------------------------------------------------------------
# Configuration: block sizes and launch settings, one per direction.
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Tile sizes and launch settings of one direction (forward, or the two backward kernels).

    ``float32_dot`` is how a float32 ``tl.dot`` multiplies (Triton's ``input_precision``):
    ``"tf32x3"``, three TF32 tensor-core products that keep float32 accuracy, or ``"ieee"``, plain
    FMAs without tensor cores. ``bench/attention_fp32.py`` measures both (cold and warm, each in a
    fresh process; ``bench/results/attention_fp32.json``). The first probe, H100, float32, B2 Hq16
    Hkv4 T2000 D128 causal, tf32x3 vs ieee: first forward 8.0 s vs 17.0 s, first gradient 13.6 s
    vs 77.5 s, warm forward 2.4 ms vs 62 ms, warm gradient 11.7 ms vs 380 ms, relative error
    against float64 4.5e-7 / 8e-7 (forward / gradients) vs 4.5e-7 / 1.7e-6.
    """

    block_q: int
    block_kv: int
    num_warps: int = 4
    num_stages: int = 2
    float32_dot: str = "tf32x3"

    def __post_init__(self):
        if self.float32_dot not in ("tf32x3", "ieee"):
            raise ValueError(f"float32_dot must be 'tf32x3' or 'ieee', got {self.float32_dot!r}")
        # Triton specialises on these; a NumPy int is an int, a bool or a float is a mistake.
        for field in dataclasses.fields(self):
            if field.name == "float32_dot":
                continue
            value = static_int(getattr(self, field.name), f"BlockSizes.{field.name}")
            object.__setattr__(self, field.name, value)

    @staticmethod
    def forward(head_dim: int, dtype: Any = jnp.bfloat16, bias: bool = False,
                mask: bool = False, shared_memory: int | None = None) -> BlockSizes:
        """Defaults measured on an H100 (bench/attention.py), by ``head_dim``, the wider of the
        query/key and the value head dims; float32 tiles are twice the bytes, so
        smaller (at 128 x 64 with three stages they overflow shared memory). ``bias``, ``mask``:
        the kernel also loads a tile per (query, key) pair of a block, of a ``bias`` or a dense
        ``attention_mask``: a third buffer in every pipeline stage.

        ``shared_memory``: the bytes a block may use on the GPU (``None``: GPU 0's, from the
        driver; no driver: the defaults). The defaults were chosen on Hopper GPUs (232448
        bytes); on one with less (an A100: 166912; sm_86 and sm_89: 101376) some of them ask
        for more than there is, and the driver would refuse the launch. There the first of
        :data:`_SMALLER_FORWARDS` that fits is taken instead: fewer stages, then smaller tiles,
        by the bytes :data:`_SM80_FORWARD_SHARED` records, starting from the Hopper default
        (never more stages than it has)."""
        bias, mask = static_bool(bias, "bias"), static_bool(mask, "mask")
        return _fitting(BlockSizes._hopper_forward(head_dim, dtype, bias or mask),
                        _SMALLER_FORWARDS, _SM80_FORWARD_SHARED, head_dim, dtype, bias, mask,
                        shared_memory)

    @staticmethod
    def _hopper_forward(head_dim: int, dtype: Any, pair_tiles: bool) -> BlockSizes:
        """The forward's defaults on a Hopper GPU (:meth:`forward`)."""
        if jnp.dtype(dtype).itemsize >= 4:
            return (BlockSizes(64, 64, num_warps=4, num_stages=2) if head_dim <= 128
                    else BlockSizes(32, 32, 4, 1))
        if head_dim <= 64:
            return BlockSizes(128, 64, num_warps=4, num_stages=3)
        if head_dim <= 128:  # H100, B4 H16 T8192, same run: causal 2.93 ms (128 x 64, 3 stages:
            # 3.27), window 1024 1.30 (1.21), documents 0.88 (1.17); 128 x 64 with 4 warps 4.59.
            # Three stages, not two (H200, B4 H16 T8192, bench/_probe_attention.py, same run,
            # median of 3 round medians): causal 2.631 -> 2.561 ms, window 0.842 -> 0.819,
            # documents 0.873 -> 0.858; 128 x 64 with 8 warps and 3 stages (FlexAttention's
            # forward tiles) 3.050, 0.937, 0.928; with 4 warps 2.551, 0.832, 0.890.
            # With a bias or a dense mask, two: at three, sm_90's shared memory (232448 bytes a
            # block) is overflowed, 360448 bytes with a float32 bias and 262144 with a mask
            # (tools/compile_check.py, compiled as jax-triton compiles: 16-byte aligned arrays).
            return BlockSizes(128, 128, num_warps=8, num_stages=2 if pair_tiles else 3)
        return BlockSizes(64, 64, num_warps=4, num_stages=2)

    @staticmethod
    def backward(head_dim: int, dtype: Any = jnp.bfloat16, bias: bool = False,
                 mask: bool = False, shared_memory: int | None = None) -> BlockSizes:
        """One config for both backward kernels (``bwd_blocks`` also takes a pair ``(dkv, dq)``).

        ``bias``, ``mask``, ``shared_memory``: as :meth:`forward`. The Hopper defaults fit
        an A100 and sm_86 / sm_89 but for float32 at head dims past 128; there, where a block
        has less than Hopper's shared memory, the first of :data:`_SMALLER_BACKWARDS` whose
        bytes (:data:`_SM80_BACKWARD_SHARED`, the larger of the two kernels') fit is
        taken."""
        bias, mask = static_bool(bias, "bias"), static_bool(mask, "mask")
        return _fitting(BlockSizes._hopper_backward(head_dim, dtype), _SMALLER_BACKWARDS,
                        _SM80_BACKWARD_SHARED, head_dim, dtype, bias, mask, shared_memory)

    @staticmethod
    def _hopper_backward(head_dim: int, dtype: Any) -> BlockSizes:
        """The backward's defaults on a Hopper GPU (:meth:`backward`)."""
        if jnp.dtype(dtype).itemsize >= 4:  # H100, float32 (tf32x3) B2 Hq16 Hkv4 T2000 D128
            # causal, same run (bench/results/attention_fp32.json): 32 x 32 gradient 6.71 ms
            # warm, first forward + first gradient 11.3 s; 64 x 64 10.61 ms and 18.3 s. A
            # probe (not recorded): 32 x 64 10.69 ms, 64 x 64 with 8 warps 11.45 ms. (Why
            # 64 x 64 is slower was not measured; spilled registers, three TF32 products per
            # dot, are the likely cause.)
            return BlockSizes(32, 32, num_warps=4, num_stages=1)
        if head_dim <= 64:
            return BlockSizes(64, 64, num_warps=4, num_stages=2)
        if head_dim <= 128:  # H100, B4 H16 T8192 causal: 4 warps 10.9 ms fwd+bwd, 8 warps 19.0 ms;
            # each kernel alone at its own tiles, dK/dV: 64 x 64 4.86 ms, 32 x 64 7.36, 32 x 128
            # (FlashAttention-2's Triton tutorial's shape) 7.85-16.9; dQ: 64 x 64 3.47,
            # 128 x 32 4.34
            return BlockSizes(64, 64, num_warps=4, num_stages=2)
        return BlockSizes(32, 32, num_warps=4, num_stages=1)


# The forward on GPUs with less shared memory than Hopper's. _SM80_FORWARD_SHARED: the bytes a
# block asks for, compiled for sm_80 as jax-triton compiles (tools/forward_shared_memory.py:
# the larger of the kernel's two launches, the optimistic one and the retry), by (bytes an
# element, head dim padded to a power of two, block_q, block_kv, warps, stages, pair tile:
# "none", "bias" (float32) or "mask"). _SMALLER_FORWARDS: for (bytes an element, padded head
# dim), the default first, then fewer stages, then smaller tiles. Compiled, never timed: no GPU
# with less shared memory than an H100's has run them here.
_HOPPER_SHARED_MEMORY = 232448
_SMALLER_FORWARDS = {
    (2, 128): [(128, 128, 8, 3), (128, 128, 8, 2), (128, 128, 8, 1), (128, 64, 4, 2),
               (128, 64, 4, 1), (64, 64, 4, 2), (64, 64, 4, 1)],
    (2, 64): [(128, 64, 4, 3), (128, 64, 4, 2), (128, 64, 4, 1), (64, 64, 4, 1)],
    (4, 128): [(64, 64, 4, 2), (64, 64, 4, 1), (64, 32, 4, 2), (64, 32, 4, 1), (32, 32, 4, 2),
               (32, 32, 4, 1)],
    (4, 64): [(64, 64, 4, 2), (64, 64, 4, 1), (64, 32, 4, 2), (64, 32, 4, 1), (32, 32, 4, 1)],
    (2, 256): [(64, 64, 4, 2), (64, 64, 4, 1), (64, 32, 4, 1), (32, 32, 4, 1), (32, 16, 4, 1),
               (16, 16, 4, 1)],
    (4, 256): [(32, 32, 4, 1), (32, 16, 4, 1), (16, 16, 4, 1)],
}
_SM80_FORWARD_SHARED = {
    (2, 128, 128, 128, 8, 3): dict(none=229376, bias=327680, mask=229376),
    (2, 128, 128, 128, 8, 2): dict(none=163840, bias=196608, mask=163840),
    (2, 128, 128, 128, 8, 1): dict(none=98304, bias=98304, mask=98304),
    (2, 128, 128, 64, 4, 2): dict(none=98304, bias=114688, mask=98304),
    (2, 128, 128, 64, 4, 1): dict(none=65536, bias=81920, mask=65536),
    (2, 128, 64, 64, 4, 2): dict(none=73728, bias=90112, mask=81920),
    (2, 128, 64, 64, 4, 1): dict(none=40960, bias=40960, mask=49152),
    (2, 64, 128, 64, 4, 3): dict(none=73728, bias=122880, mask=73728),
    (2, 64, 128, 64, 4, 2): dict(none=57344, bias=73728, mask=57344),
    (2, 64, 128, 64, 4, 1): dict(none=40960, bias=32768, mask=40960),
    (2, 64, 64, 64, 4, 1): dict(none=24576, bias=24576, mask=32768),
    (4, 128, 64, 64, 4, 2): dict(none=229376, bias=245760, mask=245760),
    (4, 128, 64, 64, 4, 1): dict(none=163840, bias=163840, mask=180224),
    (4, 128, 64, 32, 4, 2): dict(none=147456, bias=155648, mask=155648),
    (4, 128, 64, 32, 4, 1): dict(none=114688, bias=114688, mask=122880),
    (4, 128, 32, 32, 4, 2): dict(none=106496, bias=110592, mask=110592),
    (4, 128, 32, 32, 4, 1): dict(none=73728, bias=73728, mask=77824),
    (4, 64, 64, 64, 4, 2): dict(none=98304, bias=114688, mask=98304),
    (4, 64, 64, 64, 4, 1): dict(none=65536, bias=65536, mask=65536),
    (4, 64, 64, 32, 4, 2): dict(none=65536, bias=73728, mask=65536),
    (4, 64, 64, 32, 4, 1): dict(none=49152, bias=49152, mask=49152),
    (4, 64, 32, 32, 4, 1): dict(none=40960, bias=40960, mask=45056),
    (4, 256, 32, 32, 4, 1): dict(none=139264, bias=139264, mask=143360),
    (4, 256, 32, 16, 4, 1): dict(none=102400, bias=102400, mask=104448),
    (4, 256, 16, 16, 4, 1): dict(none=65536, bias=67584, mask=65536),
    (2, 256, 64, 64, 4, 2): dict(none=139264, bias=155648, mask=147456),
    (2, 256, 64, 64, 4, 1): dict(none=73728, bias=73728, mask=81920),
    (2, 256, 64, 32, 4, 1): dict(none=53248, bias=53248, mask=57344),
    (2, 256, 32, 32, 4, 1): dict(none=34816, bias=36864, mask=36864),
    (2, 256, 32, 16, 4, 1): dict(none=25600, bias=26624, mask=26624),
    (2, 256, 16, 16, 4, 1): dict(none=16896, bias=17408, mask=17408),
}
# The backward's, likewise (the larger of its two kernels' bytes; both take the config). Its
# defaults fit sm_80 and sm_89 but for float32 at head dims past 128 (196608 bytes on sm_80,
# the dK/dV kernel; bfloat16 at D256 69632 at most, plain, with a bias and with a mask:
# tools/compile_check.py --package --shared). 16 x 32 was compiled too and dropped: 163840
# bytes, more than 32 x 16's 147456 (as 64 x 32 and 32 x 32 at 2 stages were dropped from
# the bfloat16 D256 forward's list: more bytes than the config before them).
_SMALLER_BACKWARDS = {
    (4, 256): [(32, 32, 4, 1), (32, 16, 4, 1), (16, 16, 4, 1)],
}
_SM80_BACKWARD_SHARED = {
    (4, 256, 32, 32, 4, 1): dict(none=196608, bias=196608, mask=196608),
    (4, 256, 32, 16, 4, 1): dict(none=147456, bias=147456, mask=147456),
    (4, 256, 16, 16, 4, 1): dict(none=98304, bias=98304, mask=98304),
}


def _fitting(default: BlockSizes, lists: dict, table: dict, head_dim: int, dtype: Any,
             bias: bool, mask: bool, shared_memory: int | None) -> BlockSizes:
    """``default`` (Hopper's) where a block may use ``shared_memory`` bytes (``None``: what the
    driver says of GPU 0) and that is Hopper's or more, or no driver says; else the first
    config of ``lists`` (``_SMALLER_FORWARDS`` or ``_SMALLER_BACKWARDS``), from
    ``default`` on, whose bytes in ``table`` fit the limit (with a bias and a mask both, the
    bias's bytes plus what the mask adds: an estimate, that pair was not compiled, and the
    bytes are not additive everywhere); if none fits, the smallest (and the launch's
    shared-memory check names ``fwd_blocks`` or ``bwd_blocks``). ``default`` where nothing is
    listed (head dims past 256; the backward but for float32 past 128: its defaults fit).

    From the default on, not from the list's first: with a bias or a mask the forward's
    default has two stages where its list starts at three (sm_90 overflows at three, 262144
    bytes with a mask), and sm_80's bytes (229376 with a mask) would let a limit just below
    Hopper's take three."""
    limit = (max_shared_memory() if shared_memory is None
             else static_int(shared_memory, "shared_memory", minimum=1))
    if limit is None or limit >= _HOPPER_SHARED_MEMORY:
        return default
    key = (jnp.dtype(dtype).itemsize, next_power_of_2(max(head_dim, 64)))
    candidates = lists.get(key, [])
    if candidates:  # every list holds its default (a ValueError here if an edit drops it)
        candidates = candidates[candidates.index(
            (default.block_q, default.block_kv, default.num_warps, default.num_stages)):]
    for tiles in candidates:
        if _shared_bytes(table, key + tiles, bias, mask) <= limit:
            break
    else:
        if not candidates:
            return default
    block_q, block_kv, num_warps, num_stages = tiles
    return dataclasses.replace(default, block_q=block_q, block_kv=block_kv,
                               num_warps=num_warps, num_stages=num_stages)


def _shared_bytes(table: dict, config: tuple[int, ...], bias: bool, mask: bool) -> int:
    """Recorded bytes at ``config`` (a key of ``_SM80_FORWARD_SHARED`` or
    ``_SM80_BACKWARD_SHARED``, ``table``)."""
    shared = table[config]
    return (shared["bias"] if bias else shared["none"]) + (
        shared["mask"] - shared["none"] if mask else 0)


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything the kernels are specialised on (hashable: custom_vjp's non-differentiable arg)."""

    scale: float
    soft_cap: float | None
    fwd: BlockSizes
    dkv: BlockSizes  # the backward's dK/dV kernel
    dq: BlockSizes   # the backward's dQ kernel
    causal: bool
    window: tuple[int, int] | None
    has_segments: bool
    has_positions: bool
    has_token_mask: bool
    # (op, causal, window, segments, positions)
    clause2: tuple[str, bool, tuple[int, int] | None, bool, bool] | None


# What the kernels are compiled for, in three named groups that each kernel takes as one
# constexpr (``LOGITS.SCALE``, ``SHAPE.BQ`` in the kernels): built by ``_common``. A field read
# so is a plain Python value: fine in arithmetic, ``tl.arange`` and a static ``if``, but a
# shape list (``tl.zeros([BQ, BD])``) takes only ``tl.constexpr`` names (Triton 3.6 rejects
# the int), so the kernels name those sizes, and sizes used in many addresses, once.
class _Logits(NamedTuple):
    SCALE: float          # softmax scale
    SOFT_CAP: float       # cap * tanh(logit / cap); 1.0 when USE_SOFTCAP is False (unused)
    USE_SOFTCAP: bool
    HAS_BIAS: bool
    DOT_PRECISION: str    # tl.dot's input_precision for float32 inputs (BlockSizes.float32_dot)


class _Rule(NamedTuple):
    HAS_SEGMENTS: bool    # the first clause: equal segments, causal, a window, a token mask
    IS_CAUSAL: bool
    HAS_WINDOW: bool
    HAS_TOKEN_MASK: bool
    CLAUSE2: int          # a second clause: 0 none, 1 joined by and, 2 by or
    HAS_SEGMENTS2: bool
    IS_CAUSAL2: bool
    HAS_WINDOW2: bool
    # A clause reads positions that were given (TokenRule.loads_positions): they are loaded
    # in every partial tile; otherwise a token's position is its index, computed. H200, bf16
    # B4 H16 T8192 D128, 8 documents + causal, forward 0.873 -> 0.824 ms, forward + backward
    # 2.924 -> 2.831 (bench/_probe_attention.py, two runs).
    HAS_POSITIONS: bool
    HAS_POSITIONS2: bool


class _Shape(NamedTuple):
    H: int                # query heads; G query heads per key/value head
    G: int
    D: int                # head dims of q/k and of v, and their powers of two
    DV: int
    BD: int
    BDV: int
    BQ: int               # the kernel's query and key tiles
    BK: int
    EVEN_S: bool          # S a multiple of BK, T of BQ: no bounds to check (_in_bounds)
    EVEN_T: bool


# ----------------------------------------------------------------------------------------------
# Kernels. Every tensor is contiguous; a program's base pointers are computed once.
#
# The token rule's ids (segment ids and positions of queries and keys) come in one int32 array
# [clauses * 4, Bi, max(T, S)]: per clause q segments, kv segments, q positions, kv positions,
# ``stride_kind`` elements apart, a batch row ``stride_ids_b`` apart (0 when shared).
# ----------------------------------------------------------------------------------------------


@triton.jit
def _tanh(x):
    # 1 - 2 / (exp(2x) + 1): exp overflow gives +-1 exactly, never NaN.
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _clamp(x, n):
    """``x`` clamped to ``[0, n]``. Every count and block index a kernel loads from a mask goes
    through it: a traced mask cannot be checked, and a wrong one must give wrong numbers, never
    a read outside the inputs. Two integer instructions per load."""
    return tl.minimum(tl.maximum(x, 0), n)


@triton.jit
def _in_bounds(offs, n, EVEN: tl.constexpr):
    """``offs < n``, or all true if ``EVEN``: ``n`` is a multiple of the block and the block
    index was clamped (``_clamp``), so no offset passes ``n``. Then the compiler drops the
    compares and the masks of the loads they guard: for sm_90 the documents mask's dK/dV
    kernel went from 3144 to 2744 instructions, its forward from 3944 to 3128. H100, bf16 B4
    H16 T8192 D128, same process (bench/results/ab_attention.json): forward + backward now
    faster than before the NaN and bounds safety (139f93b) on every mask, documents 2.80
    against 2.97 ms (3.03 without this, a run not recorded)."""
    inside = offs < n
    if EVEN:
        inside = tl.full(offs.shape, True, tl.int1)
    return inside


@triton.jit
def _finite(x):
    """Where ``x`` is finite: ``x - x`` is exactly 0 for a finite ``x``, NaN for inf and NaN."""
    return (x - x) == 0


@triton.jit
def _rows_not_finite(x):
    """Per row of a tile, 1 where it holds a NaN or an inf (int8).

    NaN containment: a NaN or an inf in v (forward), q (dK) or k (dQ) must not reach, as p = 0
    times NaN, the rows that cannot see it. The selects that prevent that (``SAFE``) cost time in
    every partial tile. With 16-bit inputs (``OPTIMISTIC``, see ``_optimistic``) each kernel runs
    its partial tiles without them and stores these flags of its accumulator: a leak always shows
    there (0 times NaN is NaN), and without one the optimistic result is exact. A second launch
    (``RETRY``, see ``_launch``) runs the programs with a flag again, with ``SAFE``, into the same
    outputs: where a NaN or an inf showed (a leak, or a true NaN of a row that sees one). float32
    runs ``SAFE`` from the start, in one launch.

    Why a second launch and not a second attempt inside the kernel, which this code did first:
    the attempt was never taken, yet its code made the compiler spill registers in the optimistic
    path too (sm_90, bf16 D128 documents mask, bytes of spill stores by ``ptxas -v``, a probe not
    recorded: forward 928 against 108 without the attempt, dK/dV 2256 against 1348, dQ 772
    against 336), and cost time (H100, same process, device time, median of 6 rounds: documents
    forward 0.924 against 0.844 ms without it, forward + backward 3.328 against 3.042 ms;
    bench/results/ab_attention_in_kernel_retry.json). This design's A/B is ab_attention.json
    there. Why flags per row and not one per program: a row's maximum stays inside a warp, a
    tile's crosses warps (a barrier in every program)."""
    return tl.max(tl.where(_finite(x), 0, 1), 1).to(tl.int8)


@triton.jit
def _flagged(flag_ptr, first, n_programs, COUNT: tl.constexpr, ROWS: tl.constexpr):
    """Whether any of the ``COUNT`` programs from ``first`` of the first launch flagged a row
    (each stored ``ROWS`` flags; see ``_rows_not_finite``): one load for all."""
    p = first + tl.arange(0, COUNT)
    flags = tl.load(flag_ptr + p[:, None] * ROWS + tl.arange(0, ROWS)[None, :],
                    mask=(p < n_programs)[:, None], other=0)
    return tl.max(tl.max(flags, 1), 0) > 0


# Kernel parameters travel in tuples (Triton flattens them; the compiled code is the same), each
# named once here (the compile-time ones are NamedTuples, above):
#   rule    the token rule's runtime operands: ids, token mask, their strides, the two windows
#   bias    the bias, and its strides along B, H, T and S (in a tile: a head's base, T and S)
#   lists   the block mask's lists: partial count and index, full count and index, and the
#           strides of a batch row and a head in them
#   sizes   T, S, n_q_blocks, n_kv_blocks
#   LOGITS  _Logits: scale, soft cap, bias, dot precision
#   RULE    _Rule: which clauses the token rule has
#   SHAPE   _Shape: heads, head dims, tiles


@triton.jit
def _head(rule, bias, i_b, i_h):
    """The token rule and bias of one (batch ``i_b``, head ``i_h``) as the tile helpers take
    them: the batch row's ids, the head's token mask and bias (64-bit offsets: a token mask or a
    bias may pass 2**31 elements), their strides, the windows."""
    ids_ptr, token_mask_ptr, stride_ids_b, stride_kind, stride_mask_b, stride_mask_h, \
        window_left, window_right, window2_left, window2_right = rule
    bias_ptr, stride_bb, stride_bh, stride_bt, stride_bs = bias
    b64, h64 = i_b.to(tl.int64), i_h.to(tl.int64)
    mask_base = token_mask_ptr + b64 * stride_mask_b + h64 * stride_mask_h
    tile_rule = (ids_ptr + i_b * stride_ids_b, stride_kind, mask_base, window_left,
                 window_right, window2_left, window2_right)
    return tile_rule, (bias_ptr + b64 * stride_bb + h64 * stride_bh, stride_bt, stride_bs)


@triton.jit
def _block_list(lists, i_b, i_h, line, n_lines, n_blocks, FULL: tl.constexpr):
    """Line ``line`` of one (batch, head)'s partial (or ``FULL``) block list: a query block's
    key blocks, or in the transposed lists a key block's query blocks (``n_lines`` lines of
    ``n_blocks``). Returns where the list starts and its count, clamped."""
    partial_count_ptr, partial_index_ptr, full_count_ptr, full_index_ptr, stride_bm_b, \
        stride_bm_h = lists
    at = (i_b * stride_bm_b + i_h * stride_bm_h) * n_lines + line
    if FULL:
        count_ptr, index_ptr = full_count_ptr, full_index_ptr
    else:
        count_ptr, index_ptr = partial_count_ptr, partial_index_ptr
    return index_ptr + at.to(tl.int64) * n_blocks, _clamp(tl.load(count_ptr + at), n_blocks)


@triton.jit
def _logits(q, k, offs_m, offs_n, bias, T, S, LOGITS: tl.constexpr):
    """The final logits in base 2, ``log2(e) * (cap * tanh(SCALE q k^T / cap) + bias)``,
    and the tanh (for the soft cap's derivative). Base 2 because ``exp2`` is one
    instruction; without a soft cap and a bias the whole scaling is one multiply by a
    constant. ``bias``: a head's base, and its strides along T and S."""
    s = tl.dot(q, tl.trans(k), input_precision=LOGITS.DOT_PRECISION)
    t = s
    if LOGITS.USE_SOFTCAP:
        t = _tanh(s * (LOGITS.SCALE / LOGITS.SOFT_CAP))
        s = t * (LOGITS.SOFT_CAP * LOG2E)
    else:
        s = s * (LOGITS.SCALE * LOG2E)
    if LOGITS.HAS_BIAS:
        bias_base, stride_bt, stride_bs = bias
        bias_ptrs = (bias_base + offs_m.to(tl.int64)[:, None] * stride_bt
                     + offs_n.to(tl.int64)[None, :] * stride_bs)
        in_range = (offs_m < T)[:, None] & (offs_n < S)[None, :]
        s += tl.load(bias_ptrs, mask=in_range, other=0.0).to(tl.float32) * LOG2E
    return s, t


@triton.jit
def _load_tile(base, offs_r, offs_c, n_rows, N_COLS: tl.constexpr, EVEN: tl.constexpr):
    """Rows ``offs_r`` x columns ``offs_c`` of a row-major ``[n_rows, N_COLS]`` array, zeros
    outside. ``EVEN``: the tile lies inside (no bounds to test, the loads vectorise fully)."""
    ptrs = base + offs_r[:, None] * N_COLS + offs_c[None, :]
    if EVEN:
        x = tl.load(ptrs)
    else:
        x = tl.load(ptrs, mask=(offs_r < n_rows)[:, None] & (offs_c < N_COLS)[None, :],
                    other=0.0)
    return x


@triton.jit
def _q_ids(ids_base, stride_kind, offs_m, T, HAS_SEGMENTS: tl.constexpr,
           USE_POSITIONS: tl.constexpr, EVEN_T: tl.constexpr):
    """A query block's segment ids and positions in one clause (``offs_m`` where not needed or
    not given: default positions are the indices)."""
    in_q = _in_bounds(offs_m, T, EVEN_T)
    q_seg = offs_m
    q_pos = offs_m
    if HAS_SEGMENTS:
        q_seg = tl.load(ids_base + offs_m, mask=in_q, other=0)
    if USE_POSITIONS:
        q_pos = tl.load(ids_base + 2 * stride_kind + offs_m, mask=in_q, other=0)
    return q_seg, q_pos


@triton.jit
def _clause(visible, q_seg, q_pos, ids_base, stride_kind, offs_n, in_kv, window_left,
            window_right, HAS_SEGMENTS: tl.constexpr, IS_CAUSAL: tl.constexpr,
            HAS_WINDOW: tl.constexpr, HAS_POSITIONS: tl.constexpr):
    """``visible`` and one clause of the token rule: equal segments, causal, a window (as given).
    Without ``HAS_POSITIONS`` a key's position is its index: no load."""
    if HAS_SEGMENTS:
        kv_seg = tl.load(ids_base + stride_kind + offs_n, mask=in_kv, other=0)
        visible &= q_seg[:, None] == kv_seg[None, :]
    if IS_CAUSAL or HAS_WINDOW:
        if HAS_POSITIONS:
            kv_pos = tl.load(ids_base + 3 * stride_kind + offs_n, mask=in_kv, other=0)
        else:
            kv_pos = offs_n
        d = kv_pos[None, :] - q_pos[:, None]  # positions lie in (-2**30, 2**30): no overflow
        if IS_CAUSAL:
            visible &= d <= 0
        if HAS_WINDOW:
            visible &= (d >= -window_left) & (d <= window_right)
    return visible


@triton.jit
def _visible(offs_m, offs_n, q_seg, q_pos, rule, T, S, MASKED: tl.constexpr,
             RULE: tl.constexpr, EVEN_T: tl.constexpr, EVEN_S: tl.constexpr):
    """Which pairs of a tile are visible: in range, and (in partial tiles) the token rule holds:
    its first clause (``q_seg``, ``q_pos`` are the query block's ids in it, and the token mask
    belongs to it), joined by and (``CLAUSE2 == 1``) or or (2) to a second one if there is one.
    Rows past T see nothing: in the backward a NaN must not reach dK through a padding row.
    ``rule``: this batch row's ids, their stride, this head's token mask, the two windows.
    ``EVEN_T``, ``EVEN_S``: no row, no column past the end (see ``_in_bounds``)."""
    ids_base, stride_kind, mask_base, window_left, window_right, window2_left, \
        window2_right = rule
    in_kv = _in_bounds(offs_n, S, EVEN_S)
    in_range = _in_bounds(offs_m, T, EVEN_T)[:, None] & in_kv[None, :]
    visible = in_range
    if MASKED:
        visible = _clause(in_range, q_seg, q_pos, ids_base, stride_kind, offs_n, in_kv,
                          window_left, window_right, RULE.HAS_SEGMENTS, RULE.IS_CAUSAL,
                          RULE.HAS_WINDOW, RULE.HAS_POSITIONS)
        if RULE.HAS_TOKEN_MASK:
            ptrs = mask_base + offs_m.to(tl.int64)[:, None] * S + offs_n[None, :]
            visible &= tl.load(ptrs, mask=visible, other=0) != 0
        if RULE.CLAUSE2 != 0:  # the second clause's ids: four arrays further
            ids2_base = ids_base + 4 * stride_kind
            q_seg2, q_pos2 = _q_ids(ids2_base, stride_kind, offs_m, T, RULE.HAS_SEGMENTS2,
                                    RULE.HAS_POSITIONS2, EVEN_T)
            second = _clause(in_range, q_seg2, q_pos2, ids2_base, stride_kind, offs_n, in_kv,
                             window2_left, window2_right, RULE.HAS_SEGMENTS2, RULE.IS_CAUSAL2,
                             RULE.HAS_WINDOW2, RULE.HAS_POSITIONS2)
            if RULE.CLAUSE2 == 1:
                visible &= second
            else:
                visible |= second
    return visible


@triton.jit
def _online_softmax_step(acc, m_i, l_i, s, v, LOGITS: tl.constexpr):
    """One key tile of the online softmax: the running max, sum and output rescaled to the
    tile's logits ``s`` (base 2), which are added in.

    Every tile rescales. FlashAttention-4's lazy rescaling (keep ``m`` until some row's max
    exceeds it by more than 8, base 2; one test per tile for the whole program, the
    rescale under a branch) was slower here: H200, bf16 B4 H16 T8192 D128, same-process
    A/B (``bench/_ab_attention.py``, 3 rounds, medians), forward causal 2.594 against
    2.296 ms, window 1024 0.828 against 0.756, 8 documents 0.712 against 0.670."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # 0 for a row that has seen nothing
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=LOGITS.DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _fwd_tiles(acc, m_i, l_i, q, offs_m, q_seg, q_pos, partial_ptr, n_partial, full_ptr,
               n_full, n_blocks, k_base, v_base, rule, bias, T, S, LOGITS: tl.constexpr,
               RULE: tl.constexpr, SHAPE: tl.constexpr, SAFE: tl.constexpr):
    """The online-softmax inner loop over a query block's ``n_partial`` partial tiles,
    then its ``n_full`` full ones (their block indices at ``partial_ptr``, ``full_ptr``).
    ``SAFE``: keep a NaN or an inf of v inside the rows that see it (see
    ``_rows_not_finite``).

    One loop, with the token rule under a branch that only partial tiles take, not a loop
    per list: each loop fills its own software pipeline, and a query block's lists are
    short (a documents row at 128 x 128 has on average 2.7 partial and 4.9 full tiles,
    counted with ``make_block_mask``). Measured (H200, bf16 B4 H16 T8192 D128, forward at
    128 x 128, 8 warps, 3 stages, ``bench/_probe_attention.py``, same run, two loops ->
    one): forward causal 2.530 -> 2.307 ms, window 1024 0.824 -> 0.759, 8 documents
    0.828 -> 0.750; forward + backward 9.630 -> 9.459, 2.882 -> 2.821, 2.830 -> 2.755.
    (In the sm_90 SASS of the documents forward, compiled as jax-triton compiles it, with
    16-byte aligned arrays: 252 registers, no spill.)"""
    BQ: tl.constexpr = SHAPE.BQ  # (tl.zeros's shape: see above _Logits)
    offs_d = tl.arange(0, SHAPE.BD)
    offs_dv = tl.arange(0, SHAPE.BDV)
    for i in range(n_partial + n_full):
        is_partial = i < n_partial
        kb_ptr = tl.where(is_partial, partial_ptr + i, full_ptr + (i - n_partial))
        kb = _clamp(tl.load(kb_ptr), n_blocks - 1)
        offs_n = kb * SHAPE.BK + tl.arange(0, SHAPE.BK)
        k = _load_tile(k_base, offs_n, offs_d, S, SHAPE.D,
                       SHAPE.EVEN_S & (SHAPE.D == SHAPE.BD))
        v = _load_tile(v_base, offs_n, offs_dv, S, SHAPE.DV,
                       SHAPE.EVEN_S & (SHAPE.DV == SHAPE.BDV))
        s, _ = _logits(q, k, offs_m, offs_n, bias, T, S, LOGITS)
        if SAFE:  # no row is poisoned unless a partial tile says so
            poisoned = tl.zeros([BQ], tl.int1)
        if is_partial:  # one branch for the whole program: full tiles skip the rule
            visible = _visible(offs_m, offs_n, q_seg, q_pos, rule, T, S, True, RULE,
                               SHAPE.EVEN_T, SHAPE.EVEN_S)
            s = tl.where(visible, s, float("-inf"))
            if SAFE:
                # A NaN (or inf) in the v row of a key that a row cannot see must not
                # reach that row, as p = 0 times NaN would: zero such v rows for the
                # dot, and poison exactly the rows that do see one. Full tiles need
                # none of it: every row sees every key there.
                finite = _finite(v)
                v = tl.where(finite, v, tl.zeros_like(v))
                bad_key = tl.max(tl.where(finite, 0, 1), 1) > 0
                poisoned = tl.max(tl.where(visible & bad_key[None, :], 1, 0), 1) > 0
        else:
            if not SHAPE.EVEN_S:  # full tiles of an uneven length: the keys past S
                visible = _visible(offs_m, offs_n, q_seg, q_pos, rule, T, S, False, RULE,
                                   SHAPE.EVEN_T, SHAPE.EVEN_S)
                s = tl.where(visible, s, float("-inf"))
        acc, m_i, l_i = _online_softmax_step(acc, m_i, l_i, s, v, LOGITS)
        if SAFE:  # NaN stays NaN through every later rescaling and sum
            acc = tl.where(poisoned[:, None], float("nan"), acc)
    return acc, m_i, l_i


@triton.jit
def _fwd_program(i_m, i_bh, tensors, rule, bias, lists, sizes, LOGITS: tl.constexpr,
                 RULE: tl.constexpr, SHAPE: tl.constexpr, HAS_SINKS: tl.constexpr,
                 SAFE: tl.constexpr):
    """One query block ``i_m`` of one (batch, head) ``i_bh``: ``o`` and ``lse`` stored;
    its accumulator returned. ``tensors``: q, k, v, sinks, o, lse."""
    q_ptr, k_ptr, v_ptr, sink_ptr, o_ptr, lse_ptr = tensors
    T, S, n_q_blocks, n_kv_blocks = sizes
    D: tl.constexpr = SHAPE.D  # (tl.zeros's shapes, most addresses: see above _Logits)
    DV: tl.constexpr = SHAPE.DV
    BD: tl.constexpr = SHAPE.BD
    BDV: tl.constexpr = SHAPE.BDV
    BQ: tl.constexpr = SHAPE.BQ
    i_b, i_h = i_bh // SHAPE.H, i_bh % SHAPE.H
    i_bh64 = i_bh.to(tl.int64)
    i_kvh64 = (i_b * (SHAPE.H // SHAPE.G) + i_h // SHAPE.G).to(tl.int64)
    offs_m = i_m * BQ + tl.arange(0, BQ)
    offs_d = tl.arange(0, BD)
    offs_dv = tl.arange(0, BDV)
    in_q = _in_bounds(offs_m, T, SHAPE.EVEN_T)

    q_base = q_ptr + i_bh64 * T * D
    k_base = k_ptr + i_kvh64 * S * D
    v_base = v_ptr + i_kvh64 * S * DV
    q = _load_tile(q_base, offs_m, offs_d, T, D, SHAPE.EVEN_T & (D == BD))
    tile_rule, tile_bias = _head(rule, bias, i_b, i_h)
    ids_base, stride_kind = tile_rule[0], tile_rule[1]
    q_seg, q_pos = _q_ids(ids_base, stride_kind, offs_m, T, RULE.HAS_SEGMENTS,
                          RULE.HAS_POSITIONS, SHAPE.EVEN_T)

    # the sink is the first "logit" of every row: m = sink, l = exp2(sink - m) = 1
    if HAS_SINKS:
        m_i = tl.zeros([BQ], tl.float32) + tl.load(sink_ptr + i_h).to(tl.float32) * LOG2E
        l_i = tl.zeros([BQ], tl.float32) + 1.0
    else:
        m_i = tl.zeros([BQ], tl.float32) + float("-inf")
        l_i = tl.zeros([BQ], tl.float32)
    acc = tl.zeros([BQ, BDV], tl.float32)

    partial, n_partial = _block_list(lists, i_b, i_h, i_m, n_q_blocks, n_kv_blocks, False)
    full, n_full = _block_list(lists, i_b, i_h, i_m, n_q_blocks, n_kv_blocks, True)
    acc, m_i, l_i = _fwd_tiles(
        acc, m_i, l_i, q, offs_m, q_seg, q_pos, partial, n_partial, full, n_full,
        n_kv_blocks, k_base, v_base, tile_rule, tile_bias, T, S, LOGITS, RULE, SHAPE,
        SAFE)

    # A row that saw no key (and has no sink) has l = 0: its output is 0 and its lse +inf,
    # so that the backward's p = exp2(s - lse) is 0 for it. A row that saw a NaN logit has
    # l = NaN: its lse stays NaN, so that the backward's p is NaN for it wherever it sees,
    # as autodiff's.
    empty = l_i == 0.0
    o = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("inf"), m_i + tl.log2(tl.where(empty, 1.0, l_i)))
    tl.store(o_ptr + i_bh64 * T * DV + offs_m[:, None] * DV + offs_dv[None, :],
             o.to(o_ptr.dtype.element_ty), mask=in_q[:, None] & (offs_dv < DV)[None, :])
    tl.store(lse_ptr + i_bh64 * T + offs_m, lse, mask=in_q)
    return acc


@triton.jit
def _walk(PROGRAM: tl.constexpr, args, n_blocks, n_programs, retry_ptr, flag_ptr,
          REVERSED: tl.constexpr, OPTIMISTIC: tl.constexpr, RETRY: tl.constexpr,
          SCAN: tl.constexpr, ROWS: tl.constexpr):
    """What each of the three kernels does: ``PROGRAM(block, row, *args, SAFE)`` for
    program ``(block, row)`` of the grid ``(n_blocks, rows)``, blocks in reverse order if
    ``REVERSED`` (under a causal mask the last query blocks have the most work: they start
    first, so the short ones fill the gaps at the end). ``OPTIMISTIC``: without NaN
    containment, storing ``ROWS`` flags of what the program returns
    (``_rows_not_finite``).
    ``RETRY``: the second launch, which runs the programs of the first that flagged a row
    again, with containment (``SAFE``). Program p of the first launch is block
    ``p % n_blocks`` (reversed: ``n_blocks - 1 - p % n_blocks``) of row ``p // n_blocks``;
    see ``_launch``. ``PROGRAM`` is a function passed as a constant: Triton compiles one
    walk per kernel."""
    if RETRY:  # programs SCAN * pid ... of the first launch: one load, and rarely more
        first = tl.program_id(0) * SCAN
        if _flagged(retry_ptr, first, n_programs, SCAN, ROWS):
            for p in range(first, first + SCAN):
                if _flagged(retry_ptr, p, n_programs, 1, ROWS):
                    if REVERSED:
                        PROGRAM(n_blocks - 1 - p % n_blocks, p // n_blocks, *args,
                                True)
                    else:
                        PROGRAM(p % n_blocks, p // n_blocks, *args, True)
    else:
        if REVERSED:
            result = PROGRAM(n_blocks - 1 - tl.program_id(0), tl.program_id(1), *args,
                             not OPTIMISTIC)
        else:
            result = PROGRAM(tl.program_id(0), tl.program_id(1), *args, not OPTIMISTIC)
        if OPTIMISTIC:  # a flag per row (_rows_not_finite)
            p = tl.program_id(1) * n_blocks + tl.program_id(0)
            tl.store(flag_ptr + p * ROWS + tl.arange(0, ROWS),
                     _rows_not_finite(result))


@triton.jit
def _attention_fwd_kernel(
    # inputs
    q_ptr, k_ptr, v_ptr, ids_ptr, token_mask_ptr, bias_ptr, sink_ptr,
    partial_count_ptr, partial_index_ptr, full_count_ptr, full_index_ptr,
    retry_ptr, o_in_ptr, lse_in_ptr,  # RETRY: the first launch's flags; o, lse (aliased)
    # scalars
    window_left, window_right, window2_left, window2_right, T, S, n_q_blocks, n_kv_blocks,
    stride_ids_b, stride_kind, stride_mask_b, stride_mask_h, stride_bb, stride_bh,
    stride_bt, stride_bs, stride_bm_b, stride_bm_h, n_programs,
    # outputs
    o_ptr, lse_ptr, flag_ptr,
    # compile-time: the logits, the token rule, the shapes (_Logits, _Rule, _Shape), the sinks,
    # and the NaN containment's launch (_walk)
    LOGITS: tl.constexpr, RULE: tl.constexpr, SHAPE: tl.constexpr, HAS_SINKS: tl.constexpr,
    OPTIMISTIC: tl.constexpr, RETRY: tl.constexpr, SCAN: tl.constexpr, ROWS: tl.constexpr,
):
    # Arrays and numbers stay flat here: triton_call passes them one by one. Query blocks in
    # reverse order (see _walk).
    _walk(_fwd_program,
          ((q_ptr, k_ptr, v_ptr, sink_ptr, o_ptr, lse_ptr),
           (ids_ptr, token_mask_ptr, stride_ids_b, stride_kind, stride_mask_b, stride_mask_h,
            window_left, window_right, window2_left, window2_right),
           (bias_ptr, stride_bb, stride_bh, stride_bt, stride_bs),
           (partial_count_ptr, partial_index_ptr, full_count_ptr, full_index_ptr, stride_bm_b,
            stride_bm_h),
           (T, S, n_q_blocks, n_kv_blocks),
           LOGITS, RULE, SHAPE, HAS_SINKS),
          n_q_blocks, n_programs, retry_ptr, flag_ptr, True, OPTIMISTIC, RETRY, SCAN, ROWS)


@triton.jit
def _bwd_tile(q, k, v, do, lse, delta, offs_m, offs_n, q_seg, q_pos, rule, bias, T, S,
              LOGITS: tl.constexpr, RULE: tl.constexpr, MASKED: tl.constexpr,
              EVEN_T: tl.constexpr, EVEN_S: tl.constexpr, SAFE: tl.constexpr):
    """One tile of the backward: ``p``, ``ds`` = dL/d(final logit), and the same before
    the cap. ``SAFE``: see ``_rows_not_finite``."""
    s, t = _logits(q, k, offs_m, offs_n, bias, T, S, LOGITS)
    visible = _visible(offs_m, offs_n, q_seg, q_pos, rule, T, S, MASKED, RULE, EVEN_T,
                       EVEN_S)
    p = tl.exp2(s - lse[:, None])
    if MASKED or not EVEN_S:  # full tiles of an even length: every pair is visible
        p = tl.where(visible, p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=LOGITS.DOT_PRECISION)
    ds = p * (dp - delta[:, None])  # dL/d(logit after the soft cap): also dL/dbias
    if LOGITS.USE_SOFTCAP:
        d_raw = ds * (1.0 - t * t)  # through cap * tanh(s / cap): a factor in [0, 1]
    else:
        d_raw = ds
    if SAFE and (MASKED or not EVEN_S):
        # Selected, never multiplied by a zero p: a NaN of an invisible key (in dp, t) or
        # of a row's lse or delta must not reach the keys and rows that cannot see it.
        # (Without SAFE it would show in dK or dQ, and the program runs again with it.)
        ds = tl.where(visible, ds, 0.0)
        if LOGITS.USE_SOFTCAP:
            d_raw = tl.where(visible, d_raw, 0.0)
        else:
            d_raw = ds
    return p, ds, d_raw


@triton.jit
def _bwd_q_side(q_ptr, do_ptr, lse_ptr, delta_ptr, ids_base, stride_kind, i_bh64, offs_m, T,
                SHAPE: tl.constexpr, HAS_SEGMENTS: tl.constexpr, USE_POSITIONS: tl.constexpr):
    """Load a query block's q, do, lse, delta and token ids (rows past T: zeros and lse = +inf)."""
    in_q = _in_bounds(offs_m, T, SHAPE.EVEN_T)
    q = _load_tile(q_ptr + i_bh64 * T * SHAPE.D, offs_m, tl.arange(0, SHAPE.BD), T, SHAPE.D,
                   SHAPE.EVEN_T & (SHAPE.D == SHAPE.BD))
    do = _load_tile(do_ptr + i_bh64 * T * SHAPE.DV, offs_m, tl.arange(0, SHAPE.BDV), T,
                    SHAPE.DV, SHAPE.EVEN_T & (SHAPE.DV == SHAPE.BDV))
    lse = tl.load(lse_ptr + i_bh64 * T + offs_m, mask=in_q, other=float("inf"))
    delta = tl.load(delta_ptr + i_bh64 * T + offs_m, mask=in_q, other=0.0)
    q_seg, q_pos = _q_ids(ids_base, stride_kind, offs_m, T, HAS_SEGMENTS, USE_POSITIONS,
                          SHAPE.EVEN_T)
    return q, do, lse, delta, q_seg, q_pos


@triton.jit
def _dkv_tiles(dk, dv, k, v, offs_n, list_ptr, count, n_blocks, i_bh64, q_side, rule, bias, T,
               S, LOGITS: tl.constexpr, RULE: tl.constexpr, SHAPE: tl.constexpr,
               MASKED: tl.constexpr, SAFE: tl.constexpr):
    """Accumulate dK, dV of one key block over ``count`` query blocks read from ``list_ptr``.
    ``q_side``: q, do, lse, delta.

    The backward keeps a loop per list (partial, then full), unlike the forward: both backward
    kernels walking the two lists in one loop, as ``_fwd_tiles`` does, spilled less in the
    sm_90 SASS but ran slower. Measured (H200, bf16 B4 H16 T8192 D128, default tiles,
    ``bench/_probe_attention.py``, two runs each, forward + backward, two loops -> one):
    causal 9.735 / 9.563 -> 10.462 / 10.377 ms, window 1024 2.810 / 2.827 -> 2.971 / 2.976,
    8 documents 2.755 / 2.769 -> 2.875 / 2.875."""
    q_ptr, do_ptr, lse_ptr, delta_ptr = q_side
    ids_base, stride_kind = rule[0], rule[1]  # (the rest goes on to _visible)
    for i in range(count):
        qb = _clamp(tl.load(list_ptr + i), n_blocks - 1)
        offs_m = qb * SHAPE.BQ + tl.arange(0, SHAPE.BQ)
        q, do, lse, delta, q_seg, q_pos = _bwd_q_side(
            q_ptr, do_ptr, lse_ptr, delta_ptr, ids_base, stride_kind, i_bh64, offs_m, T, SHAPE,
            RULE.HAS_SEGMENTS, RULE.HAS_POSITIONS)
        p, _, ds = _bwd_tile(q, k, v, do, lse, delta, offs_m, offs_n, q_seg, q_pos, rule, bias,
                             T, S, LOGITS, RULE, MASKED, SHAPE.EVEN_T, SHAPE.EVEN_S, SAFE)
        dv += tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=LOGITS.DOT_PRECISION)
        if SAFE:  # a NaN q row that cannot see this key block must not reach dK as 0 * NaN
            q = tl.where(_finite(q), q, tl.zeros_like(q))  # (rows that see it reach dK by ds)
        dk += tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=LOGITS.DOT_PRECISION)
    return dk, dv


@triton.jit
def _dkv_heads(k, v, offs_n, i_b, i_kvh, i_n, q_side, rule, bias, lists, sizes,
               LOGITS: tl.constexpr, RULE: tl.constexpr, SHAPE: tl.constexpr,
               SAFE: tl.constexpr):
    """dK, dV of one key block over the query heads it serves: partial tiles, then full
    ones."""
    T, S, n_q_blocks, n_kv_blocks = sizes
    BD: tl.constexpr = SHAPE.BD  # (tl.zeros's shapes: see above _Logits)
    BDV: tl.constexpr = SHAPE.BDV
    BK: tl.constexpr = SHAPE.BK
    dk = tl.zeros([BK, BD], tl.float32)
    dv = tl.zeros([BK, BDV], tl.float32)
    for g in range(SHAPE.G):  # the query heads this key/value head serves
        i_h = i_kvh * SHAPE.G + g
        i_bh64 = (i_b * SHAPE.H + i_h).to(tl.int64)
        tile_rule, tile_bias = _head(rule, bias, i_b, i_h)
        # the transposed lists: per key block, its query blocks
        partial, n_partial = _block_list(lists, i_b, i_h, i_n, n_kv_blocks, n_q_blocks,
                                         False)
        dk, dv = _dkv_tiles(dk, dv, k, v, offs_n, partial, n_partial, n_q_blocks, i_bh64,
                            q_side, tile_rule, tile_bias, T, S, LOGITS, RULE, SHAPE, True,
                            SAFE)
        full, n_full = _block_list(lists, i_b, i_h, i_n, n_kv_blocks, n_q_blocks, True)
        dk, dv = _dkv_tiles(dk, dv, k, v, offs_n, full, n_full, n_q_blocks, i_bh64,
                            q_side, tile_rule, tile_bias, T, S, LOGITS, RULE, SHAPE,
                            False, False)
    return dk, dv


@triton.jit
def _dkv_program(i_n, i_bkv, tensors, rule, bias, lists, sizes, LOGITS: tl.constexpr,
                 RULE: tl.constexpr, SHAPE: tl.constexpr, SAFE: tl.constexpr):
    """One key block ``i_n`` of one (batch, key/value head) ``i_bkv``: ``dk`` and ``dv``
    stored; ``dk`` returned. ``tensors``: q, k, v, do, lse, delta, dk, dv; ``lists``: the
    transposed ones (per key block, the query blocks)."""
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr = tensors
    T, S, n_q_blocks, n_kv_blocks = sizes
    D: tl.constexpr = SHAPE.D  # (four times each in the addresses below)
    DV: tl.constexpr = SHAPE.DV
    H_KV: tl.constexpr = SHAPE.H // SHAPE.G
    i_b, i_kvh = i_bkv // H_KV, i_bkv % H_KV
    i_bkv64 = i_bkv.to(tl.int64)
    offs_n = i_n * SHAPE.BK + tl.arange(0, SHAPE.BK)
    offs_d = tl.arange(0, SHAPE.BD)
    offs_dv = tl.arange(0, SHAPE.BDV)
    in_kv = offs_n < S
    k = tl.load(k_ptr + i_bkv64 * S * D + offs_n[:, None] * D + offs_d[None, :],
                mask=in_kv[:, None] & (offs_d < D)[None, :], other=0.0)
    v = tl.load(v_ptr + i_bkv64 * S * DV + offs_n[:, None] * DV + offs_dv[None, :],
                mask=in_kv[:, None] & (offs_dv < DV)[None, :], other=0.0)
    q_side = (q_ptr, do_ptr, lse_ptr, delta_ptr)
    dk, dv = _dkv_heads(k, v, offs_n, i_b, i_kvh, i_n, q_side, rule, bias, lists, sizes,
                        LOGITS, RULE, SHAPE, SAFE)
    kv_rows = in_kv[:, None]
    tl.store(dk_ptr + i_bkv64 * S * D + offs_n[:, None] * D + offs_d[None, :],
             (dk * LOGITS.SCALE).to(dk_ptr.dtype.element_ty),
             mask=kv_rows & (offs_d < D)[None, :])
    tl.store(dv_ptr + i_bkv64 * S * DV + offs_n[:, None] * DV + offs_dv[None, :],
             dv.to(dv_ptr.dtype.element_ty), mask=kv_rows & (offs_dv < DV)[None, :])
    return dk


@triton.jit
def _attention_dkv_kernel(
    # inputs
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, ids_ptr, token_mask_ptr, bias_ptr,
    t_partial_count_ptr, t_partial_index_ptr, t_full_count_ptr, t_full_index_ptr,
    retry_ptr, dk_in_ptr, dv_in_ptr,  # RETRY: the first launch's flags; dk, dv (aliased)
    # scalars
    window_left, window_right, window2_left, window2_right, T, S, n_q_blocks, n_kv_blocks,
    stride_ids_b, stride_kind, stride_mask_b, stride_mask_h, stride_bb, stride_bh,
    stride_bt, stride_bs, stride_bm_b, stride_bm_h, n_programs,
    # outputs
    dk_ptr, dv_ptr, flag_ptr,
    # compile-time: as the forward's
    LOGITS: tl.constexpr, RULE: tl.constexpr, SHAPE: tl.constexpr,
    OPTIMISTIC: tl.constexpr, RETRY: tl.constexpr, SCAN: tl.constexpr, ROWS: tl.constexpr,
):
    # Key blocks in order (see _walk). A retry takes all query heads again, from zero: a copy
    # of dK kept for a rerun of one head's partial tiles held registers and cost 5 % of a
    # forward + backward (H100).
    _walk(_dkv_program,
          ((q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dk_ptr, dv_ptr),
           (ids_ptr, token_mask_ptr, stride_ids_b, stride_kind, stride_mask_b, stride_mask_h,
            window_left, window_right, window2_left, window2_right),
           (bias_ptr, stride_bb, stride_bh, stride_bt, stride_bs),
           (t_partial_count_ptr, t_partial_index_ptr, t_full_count_ptr, t_full_index_ptr,
            stride_bm_b, stride_bm_h),
           (T, S, n_q_blocks, n_kv_blocks),
           LOGITS, RULE, SHAPE),
          n_kv_blocks, n_programs, retry_ptr, flag_ptr, False, OPTIMISTIC, RETRY, SCAN, ROWS)


@triton.jit
def _dq_tiles(dq, q, do, lse, delta, offs_m, q_seg, q_pos, list_ptr, count, n_blocks, k_base,
              v_base, dbias_base, rule, bias, T, S, LOGITS: tl.constexpr, RULE: tl.constexpr,
              SHAPE: tl.constexpr, MASKED: tl.constexpr, SAFE: tl.constexpr):
    """Accumulate dQ of one query block over ``count`` key blocks (and write dbias tiles)."""
    offs_d = tl.arange(0, SHAPE.BD)
    offs_dv = tl.arange(0, SHAPE.BDV)
    for i in range(count):
        kb = _clamp(tl.load(list_ptr + i), n_blocks - 1)
        offs_n = kb * SHAPE.BK + tl.arange(0, SHAPE.BK)
        k = _load_tile(k_base, offs_n, offs_d, S, SHAPE.D,
                       SHAPE.EVEN_S & (SHAPE.D == SHAPE.BD))
        v = _load_tile(v_base, offs_n, offs_dv, S, SHAPE.DV,
                       SHAPE.EVEN_S & (SHAPE.DV == SHAPE.BDV))
        _, ds, d_raw = _bwd_tile(q, k, v, do, lse, delta, offs_m, offs_n, q_seg, q_pos, rule,
                                 bias, T, S, LOGITS, RULE, MASKED, SHAPE.EVEN_T, SHAPE.EVEN_S,
                                 SAFE)
        # dbias is ds itself; [B, H, T, S] fp32, unvisited tiles are zeroed outside
        if LOGITS.HAS_BIAS:
            ptrs = dbias_base + offs_m.to(tl.int64)[:, None] * S + offs_n[None, :]
            tl.store(ptrs, ds, mask=(offs_m < T)[:, None] & (offs_n < S)[None, :])
        if SAFE:  # a NaN k row that a query cannot see must not reach dQ as 0 * NaN
            k = tl.where(_finite(k), k, tl.zeros_like(k))  # (keys that are seen reach dQ by ds)
        dq += tl.dot(d_raw.to(k.dtype), k, input_precision=LOGITS.DOT_PRECISION)
    return dq


@triton.jit
def _dq_program(i_m, i_bh, tensors, rule, bias, lists, sizes, LOGITS: tl.constexpr,
                RULE: tl.constexpr, SHAPE: tl.constexpr, SAFE: tl.constexpr):
    """One query block ``i_m`` of one (batch, head) ``i_bh``: ``dq`` (and its ``dbias`` tiles)
    stored; ``dq`` returned. ``tensors``: q, k, v, do, lse, delta, dq, dbias."""
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, dbias_ptr = tensors
    T, S, n_q_blocks, n_kv_blocks = sizes
    D: tl.constexpr = SHAPE.D  # (four times in the addresses below; BD, BQ: tl.zeros's shape)
    BD: tl.constexpr = SHAPE.BD
    BQ: tl.constexpr = SHAPE.BQ
    i_b, i_h = i_bh // SHAPE.H, i_bh % SHAPE.H
    i_bh64 = i_bh.to(tl.int64)
    i_kvh64 = (i_b * (SHAPE.H // SHAPE.G) + i_h // SHAPE.G).to(tl.int64)
    offs_m = i_m * BQ + tl.arange(0, BQ)
    offs_d = tl.arange(0, BD)
    tile_rule, tile_bias = _head(rule, bias, i_b, i_h)
    q, do, lse, delta, q_seg, q_pos = _bwd_q_side(
        q_ptr, do_ptr, lse_ptr, delta_ptr, tile_rule[0], tile_rule[1], i_bh64, offs_m, T,
        SHAPE, RULE.HAS_SEGMENTS, RULE.HAS_POSITIONS)
    k_base = k_ptr + i_kvh64 * S * D
    v_base = v_ptr + i_kvh64 * S * SHAPE.DV
    dbias_base = dbias_ptr + i_bh64 * T * S
    dq = tl.zeros([BQ, BD], tl.float32)
    partial, n_partial = _block_list(lists, i_b, i_h, i_m, n_q_blocks, n_kv_blocks, False)
    dq = _dq_tiles(dq, q, do, lse, delta, offs_m, q_seg, q_pos, partial, n_partial,
                   n_kv_blocks, k_base, v_base, dbias_base, tile_rule, tile_bias, T, S, LOGITS,
                   RULE, SHAPE, True, SAFE)
    full, n_full = _block_list(lists, i_b, i_h, i_m, n_q_blocks, n_kv_blocks, True)
    dq = _dq_tiles(dq, q, do, lse, delta, offs_m, q_seg, q_pos, full, n_full, n_kv_blocks,
                   k_base, v_base, dbias_base, tile_rule, tile_bias, T, S, LOGITS, RULE, SHAPE,
                   False, False)
    tl.store(dq_ptr + i_bh64 * T * D + offs_m[:, None] * D + offs_d[None, :],
             (dq * LOGITS.SCALE).to(dq_ptr.dtype.element_ty),
             mask=(offs_m < T)[:, None] & (offs_d < D)[None, :])
    return dq


@triton.jit
def _attention_dq_kernel(
    # inputs
    q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, ids_ptr, token_mask_ptr, bias_ptr,
    partial_count_ptr, partial_index_ptr, full_count_ptr, full_index_ptr,
    retry_ptr, dq_in_ptr, dbias_in_ptr,  # RETRY: the first launch's flags; dq, dbias (aliased)
    # scalars
    window_left, window_right, window2_left, window2_right, T, S, n_q_blocks, n_kv_blocks,
    stride_ids_b, stride_kind, stride_mask_b, stride_mask_h, stride_bb, stride_bh, stride_bt,
    stride_bs, stride_bm_b, stride_bm_h, n_programs,
    # outputs
    dq_ptr, dbias_ptr, flag_ptr,
    # compile-time: as the forward's
    LOGITS: tl.constexpr, RULE: tl.constexpr, SHAPE: tl.constexpr,
    OPTIMISTIC: tl.constexpr, RETRY: tl.constexpr, SCAN: tl.constexpr, ROWS: tl.constexpr,
):
    # Query blocks in reverse order, as in the forward (see _walk).
    _walk(_dq_program,
          ((q_ptr, k_ptr, v_ptr, do_ptr, lse_ptr, delta_ptr, dq_ptr, dbias_ptr),
           (ids_ptr, token_mask_ptr, stride_ids_b, stride_kind, stride_mask_b, stride_mask_h,
            window_left, window_right, window2_left, window2_right),
           (bias_ptr, stride_bb, stride_bh, stride_bt, stride_bs),
           (partial_count_ptr, partial_index_ptr, full_count_ptr, full_index_ptr, stride_bm_b,
            stride_bm_h),
           (T, S, n_q_blocks, n_kv_blocks),
           LOGITS, RULE, SHAPE),
          n_q_blocks, n_programs, retry_ptr, flag_ptr, True, OPTIMISTIC, RETRY, SCAN, ROWS)


# ----------------------------------------------------------------------------------------------
# Launchers: the forward, and the backward's two kernels, each callable and testable alone.
# ----------------------------------------------------------------------------------------------


def _pow2(n: int) -> int:
    return max(16, next_power_of_2(n))


def _rule_operands(rule: TokenRule | None, B: int, T: int, S: int) -> tuple[list[Array], list[int]]:
    """The token rule as kernel operands: its ids as one int32 array ``[clauses * 4, Bi, n]``
    (``n = max(T, S)``; per clause q segments, kv segments, q positions, kv positions, stand-ins
    where absent), the token mask as int8, and the strides: a batch row of ids (0 where one row
    serves every batch row), one id array, a batch row and a head of the token mask."""
    if rule is None:
        return [jnp.zeros((1,), jnp.int32), jnp.zeros((1,), jnp.int8)], [0, 0, 0, 0]
    clauses = [rule.own] if rule.other is None else [rule.own, rule.other]
    ids = [x for c in clauses for x in (*c.segments(T, S), *c.positions(T, S))]
    ids_batch = max(x.shape[0] for x in ids)
    n_ids = max(T, S)

    def pad(x):  # every id array gets the same row stride: max(T, S)
        x = jnp.broadcast_to(x.astype(jnp.int32), (ids_batch, x.shape[1]))
        return jnp.pad(x, ((0, 0), (0, n_ids - x.shape[1])))

    ids = jnp.stack([pad(x) for x in ids])
    if rule.attention_mask is None:
        token_mask, mask_strides = jnp.zeros((1,), jnp.int8), [0, 0]
    else:
        am = rule.attention_mask
        token_mask = am.astype(jnp.int8)
        mask_strides = [0 if am.shape[0] == 1 else am.shape[1] * T * S,
                        0 if am.shape[1] == 1 else T * S]
    return [ids, token_mask], [0 if ids_batch == 1 else n_ids, ids_batch * n_ids, *mask_strides]


def _bias_operands(bias: Array | None, B: int, H: int, T: int, S: int) -> tuple[Array, list[int]]:
    """Bias as given (no broadcast copy) and its element strides, 0 along broadcast axes."""
    if bias is None:
        return jnp.zeros((1,), jnp.float32), [0, 0, 0, 0]
    shape = bias.shape
    full = (B, H, T, S)
    contiguous = np.cumprod((1,) + shape[::-1][:-1])[::-1]
    strides = [0 if shape[i] == 1 and full[i] != 1 else int(contiguous[i]) for i in range(4)]
    return bias, strides


def _mask_strides(mask: BlockMask) -> list[int]:
    Bm, Hm = mask.kinds.shape[:2]
    return [0 if Bm == 1 else Hm, 0 if Hm == 1 else 1]


def _window(window: tuple[int, int] | None) -> list[int]:
    left, right = window if window is not None else (0, 0)
    return [min(left, _BIG_WINDOW), min(right, _BIG_WINDOW)]


def _optimistic(dtype) -> bool:
    """Whether the kernels run their partial tiles first without NaN containment (see
    ``_rows_not_finite``). Not in float32, whose three-pass TF32 dots make the selects cheap
    beside them: one launch and one compile less. A same-run probe, not a recorded benchmark (H100,
    float32 B2 Hq16 Hkv4 T2000 D128 causal, each variant in a fresh process with an empty Triton
    cache, attention_fp32's method): first forward + first gradient 35.0 s optimistic, 25.0 s not
    (forward 11.6 -> 10.4 s, gradient 23.4 -> 14.7 s); warm forward 2.25 -> 2.36 ms, gradient
    11.69 -> 11.38 ms; 8 warps and 1 stage 20.9 s cold but a 3.19 ms warm forward (not taken).
    (Those cold times still held an ``import torch`` by Triton's specialiser, since avoided:
    ``launch._start_specializer_without_torch``.) The recorded cold start is
    bench/results/attention_fp32.json's."""
    return jnp.dtype(dtype) != jnp.float32


def _common(static: _Static, q, k, v, bias, rule, mask: BlockMask, blocks: BlockSizes):
    """Operands and meta-parameters shared by all three kernels."""
    B, H, T, D = q.shape
    H_kv, S, DV = k.shape[1], k.shape[2], v.shape[3]
    rule_args, rule_strides = _rule_operands(rule, B, T, S)
    bias_arg, bias_strides = _bias_operands(bias, B, H, T, S)
    soft_cap = 1.0 if static.soft_cap is None else float(static.soft_cap)
    op2, causal2, window2, segments2, positions2 = static.clause2 or ("and", False, None, False,
                                                                      False)
    scalars = [*_window(static.window), *_window(window2), T, S, mask.kinds.shape[2],
               mask.kinds.shape[3], *rule_strides, *bias_strides, *_mask_strides(mask)]
    meta = dict(
        LOGITS=_Logits(
            float(static.scale), soft_cap, static.soft_cap is not None, bias is not None,
            blocks.float32_dot if q.dtype == jnp.float32 else "tf32"),  # 16-bit: unused
        RULE=_Rule(
            static.has_segments, static.causal, static.window is not None,
            static.has_token_mask, 0 if static.clause2 is None else 1 if op2 == "and" else 2,
            segments2, causal2, window2 is not None, static.has_positions, positions2),
        SHAPE=_Shape(H, H // H_kv, D, DV, _pow2(D), _pow2(DV), blocks.block_q, blocks.block_kv,
                     S % blocks.block_kv == 0, T % blocks.block_q == 0),
        OPTIMISTIC=_optimistic(q.dtype),
        num_warps=blocks.num_warps, num_stages=blocks.num_stages,
    )
    return [*rule_args, bias_arg], scalars, meta


# The retry launch (16-bit only, see _rows_not_finite): about this many programs, each looking
# after SCAN programs of the first launch. Two per SM of an H100 (132 SMs) at the forward's shared
# memory: one wave. Where no flag is set, as almost always, each reads its flags in one load.
_RETRY_PROGRAMS = 264


def _launch(kernel, inputs: list, scalars: list, out_shape: list, grid: tuple[int, int],
            rows: int, meta: dict) -> list:
    """``kernel`` on ``grid``: its outputs ``out_shape``. 16-bit (``OPTIMISTIC``): the partial
    tiles without NaN containment, ``rows`` flags per program where the result holds a NaN or an
    inf, then a second launch that runs the flagged programs again with it, into the same
    outputs (aliased). float32: one launch, with containment."""
    n_programs = grid[0] * grid[1]
    none = jnp.zeros((1,), jnp.int8)  # a placeholder for what this launch does not use
    first = meta["OPTIMISTIC"]
    *outs, flags = triton_call(
        *inputs, none, *[none] * len(out_shape), *scalars, n_programs, kernel=kernel,
        out_shape=[*out_shape, jax.ShapeDtypeStruct((n_programs * rows if first else 1,),
                                                    jnp.int8)],
        grid=grid, RETRY=False, SCAN=1, ROWS=rows, **meta)
    if not first:
        return outs
    scan = min(_pow2(-(-n_programs // _RETRY_PROGRAMS)), 64)
    n_in = len(inputs) + 1  # the retry's inputs: inputs, flags, outputs (aliased)
    *outs, _ = triton_call(
        *inputs, flags, *outs, *scalars, n_programs, kernel=kernel,
        out_shape=[*out_shape, jax.ShapeDtypeStruct((1,), jnp.int8)],
        grid=(-(-n_programs // scan), 1), RETRY=True, SCAN=scan, ROWS=rows,
        input_output_aliases={n_in + i: i for i in range(len(out_shape))}, **meta)
    return outs


def _fwd(static: _Static, q, k, v, sinks, bias, rule, mask: BlockMask):
    """Forward launch: ``o`` ``[B, Hq, T, Dv]`` (query dtype) and ``lse`` ``[B, Hq, T]`` (fp32,
    base 2)."""
    B, H, T, _ = q.shape
    DV = v.shape[3]
    rule_args, scalars, meta = _common(static, q, k, v, bias, rule, mask, static.fwd)
    sink_arg = jnp.zeros((1,), jnp.float32) if sinks is None else sinks.astype(jnp.float32)
    return _launch(
        _attention_fwd_kernel,
        [q, k, v, *rule_args, sink_arg, mask.partial_count, mask.partial_index,
         mask.full_count, mask.full_index], scalars,
        [jax.ShapeDtypeStruct((B, H, T, DV), q.dtype),
         jax.ShapeDtypeStruct((B, H, T), jnp.float32)],
        (mask.kinds.shape[2], B * H), static.fwd.block_q,
        dict(meta, HAS_SINKS=sinks is not None, config_argument="fwd_blocks"))


def _bwd_dkv(static: _Static, q, k, v, do, lse, delta, bias, rule, mask: BlockMask):
    """dK, dV (summed over each group of query heads), in the key's / value's dtype."""
    B, H_kv, S, D = k.shape
    DV = v.shape[3]
    rule_args, scalars, meta = _common(static, q, k, v, bias, rule, mask, static.dkv)
    return _launch(
        _attention_dkv_kernel,
        [q, k, v, do, lse, delta, *rule_args, mask.t_partial_count, mask.t_partial_index,
         mask.t_full_count, mask.t_full_index], scalars,
        [jax.ShapeDtypeStruct((B, H_kv, S, D), k.dtype),
         jax.ShapeDtypeStruct((B, H_kv, S, DV), v.dtype)],
        (mask.kinds.shape[3], B * H_kv), static.dkv.block_kv,
        dict(meta, config_argument="bwd_blocks (its dK, dV tiles)"))


def _bwd_dq(static: _Static, q, k, v, do, lse, delta, bias, rule, mask: BlockMask):
    """dQ in the query's dtype, and dL/d(logits) ``[B, Hq, T, S]`` fp32 when there is a bias."""
    B, H, T, D = q.shape
    S = k.shape[2]
    rule_args, scalars, meta = _common(static, q, k, v, bias, rule, mask, static.dq)
    dbias_shape = (B, H, T, S) if bias is not None else (1,)
    return _launch(
        _attention_dq_kernel,
        [q, k, v, do, lse, delta, *rule_args, mask.partial_count, mask.partial_index,
         mask.full_count, mask.full_index], scalars,
        [jax.ShapeDtypeStruct((B, H, T, D), q.dtype),
         jax.ShapeDtypeStruct(dbias_shape, jnp.float32)],
        (mask.kinds.shape[2], B * H), static.dq.block_q,
        dict(meta, config_argument="bwd_blocks (its dQ tiles)"))


def _visited_tokens(mask: BlockMask) -> Array:
    """``[Bm, Hm, T, S]`` bool: pairs in visited tiles (the dQ kernel writes dbias only there)."""
    tiles = mask.kinds != EMPTY
    rows = jnp.repeat(tiles, mask.q_block, axis=2)[:, :, :mask.q_len]
    return jnp.repeat(rows, mask.kv_block, axis=3)[..., :mask.kv_len]


# ----------------------------------------------------------------------------------------------
# vmap: mapped axes folded into the batch axis, one launch for all.
# ----------------------------------------------------------------------------------------------

# How each launcher argument meets a batch: "dense" arrays have exactly the batch (q, k, v and
# the backward's do, lse, delta); "shared" ones 1 (every row) or the batch (the token rule, the
# bias, the mask's arrays); "head" ones none (the sinks, one per head).
_FWD_ARGS = ("dense",) * 3 + ("head", "shared", "shared", "shared")
_BWD_ARGS = ("dense",) * 6 + ("shared", "shared", "shared")


class _NoFold(Exception):
    """Folding this call would copy a [T, S] array or give the sinks a batch axis."""


def _fold(n: int, in_batched, args, kinds) -> list:
    """The arguments with the mapped axis (size ``n``, leading) folded into the batch axis."""
    q, q_batched = args[0], in_batched[0]
    B = q.shape[1] if q_batched else q.shape[0]
    T, S = q.shape[-2], args[1].shape[-2]

    def fold(kind, x, batched):
        if kind == "head":
            if batched:
                raise _NoFold
            return x
        one = x[0] if batched else x  # an element's shape
        if kind == "shared" and not batched and one.shape[0] == 1:
            return x  # one row serves every folded row
        if batched and (kind == "dense" or one.shape[0] == B):
            return x.reshape(n * one.shape[0], *one.shape[1:])  # free: the axes are adjacent
        if kind == "shared" and one.ndim == 4 and one.shape[-2:] == (T, S):
            raise _NoFold  # a bias or token mask copied n (or B) times: not worth one launch
        x = jnp.broadcast_to(x if batched else x[None], (n, B, *one.shape[1:]))
        return x.reshape(n * B, *one.shape[1:])

    return [jax.tree_util.tree_map(functools.partial(fold, kind), arg, flags)
            for kind, arg, flags in zip(kinds, args, in_batched)]


def _vmap_folding(launch: Callable, kinds: tuple[str, ...]) -> Callable:
    """``launch`` (a launcher, whose outputs have the batch axis first) with a batching rule: the
    mapped axis is folded into the batch axis (``[N, B, ...]`` -> ``[N * B, ...]``, broadcasting
    what is not mapped), one launch for all, and the outputs unfolded. The rule calls the batched
    function itself, so nested ``vmap`` folds every axis, one after the other. Where folding would
    copy a ``[T, S]`` array, or the sinks are mapped, it launches once per element (``lax.map``)."""

    @jax.custom_batching.custom_vmap
    def batched_launch(*args):
        return launch(*args)

    @batched_launch.def_vmap
    def rule(axis_size, in_batched, *args):
        try:
            folded = _fold(axis_size, in_batched, args, kinds)
        except _NoFold:
            leaves, tree = jax.tree_util.tree_flatten(args)
            flags = jax.tree_util.tree_leaves(in_batched)

            def one(mapped):
                it = iter(mapped)
                merged = [next(it) if flag else leaf for leaf, flag in zip(leaves, flags)]
                return batched_launch(*jax.tree_util.tree_unflatten(tree, merged))

            out = jax.lax.map(one, [leaf for leaf, flag in zip(leaves, flags) if flag])
        else:
            def unfold(x):  # a placeholder output of shape (1,) stays one per element
                return jnp.broadcast_to(x, (axis_size, 1)) if x.shape == (1,) else \
                    x.reshape(axis_size, x.shape[0] // axis_size, *x.shape[1:])

            out = jax.tree_util.tree_map(unfold, batched_launch(*folded))
        return out, jax.tree_util.tree_map(lambda _: True, out)

    return batched_launch


# ----------------------------------------------------------------------------------------------
# The differentiable op: one custom_vjp around the launchers.
# ----------------------------------------------------------------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _attention(static, q, k, v, sinks, bias, rule, fwd_mask, bwd_masks):
    o, _ = _vmap_folding(functools.partial(_fwd, static), _FWD_ARGS)(
        q, k, v, sinks, bias, rule, fwd_mask)
    return o


def _attention_fwd(static, q, k, v, sinks, bias, rule, fwd_mask, bwd_masks):
    o, lse = _vmap_folding(functools.partial(_fwd, static), _FWD_ARGS)(
        q, k, v, sinks, bias, rule, fwd_mask)
    return o, (q, k, v, sinks, bias, rule, bwd_masks, o, lse)


def _attention_bwd(static, residuals, do):
    q, k, v, sinks, bias, rule, (dkv_mask, dq_mask), o, lse = residuals
    delta = jnp.sum(do.astype(jnp.float32) * o.astype(jnp.float32), axis=-1)  # rowsum(dO * O)
    dk, dv = _vmap_folding(functools.partial(_bwd_dkv, static), _BWD_ARGS)(
        q, k, v, do, lse, delta, bias, rule, dkv_mask)
    dq, dlogits = _vmap_folding(functools.partial(_bwd_dq, static), _BWD_ARGS)(
        q, k, v, do, lse, delta, bias, rule, dq_mask)
    dsinks = dbias = None
    if sinks is not None:  # dL/dsink_h = -sum_i exp(sink_h - lse_i) delta_i
        p_sink = jnp.exp2(sinks.astype(jnp.float32)[:, None] * LOG2E.value - lse)
        dsinks = (-jnp.sum(p_sink * delta, axis=(0, 2))).astype(sinks.dtype)
    if bias is not None:  # the public function made bias 4-D; sum over its broadcast axes
        dlogits = jnp.where(_visited_tokens(dq_mask), dlogits, 0.0)  # unvisited: never written
        axes = tuple(i for i in range(4) if bias.shape[i] == 1 and dlogits.shape[i] != 1)
        dbias = jnp.sum(dlogits, axis=axes, keepdims=True).astype(bias.dtype)
    return dq, dk, dv, dsinks, dbias, None, None, None


_attention.defvjp(_attention_fwd, _attention_bwd)


# ----------------------------------------------------------------------------------------------
# Checks, the mask a call describes, the reference, and the public function.
# ----------------------------------------------------------------------------------------------


def _real_number(name: str, x: Any, *, positive: bool) -> float:
    """A Python or NumPy real scalar as a Python float. The kernels are specialised on it, so it
    must be static, and finite: ``inf`` or ``nan`` would only give NaN. A bool is refused (``True``
    is 1 by accident, not by intent)."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, (int, float, np.integer, np.floating)):
        raise ValueError(f"{name} must be a real number (a Python or NumPy scalar: static), "
                         f"got {x!r}")
    number = float(x)
    if not math.isfinite(number) or (positive and number <= 0):
        kind = "finite positive" if positive else "finite"
        raise ValueError(f"{name} must be a {kind} number, got {x!r}")
    return number


def _check_inputs(query, key, value, softmax_aux, bias, logits_soft_cap, softmax_scale):
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not hasattr(x, "shape") or len(x.shape) != 4:
            raise ValueError(f"{name} must be a 4-D array [batch, heads, seq_len, dim], "
                             f"got shape {getattr(x, 'shape', None)}")
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise ValueError(f"{name} must have a floating dtype, got {x.dtype}")
    if not query.dtype == key.dtype == value.dtype:
        # The kernels multiply q by k and p by v in one precision; promoting one side silently
        # would hide a forgotten cast and change the precision (and memory) of the whole call.
        raise ValueError(f"query, key and value must have one dtype, got {query.dtype}, "
                         f"{key.dtype} and {value.dtype}: cast them to one")
    B, H, T, D = query.shape
    if key.shape[0] != B or value.shape[0] != B:
        raise ValueError(f"key and value must have the query's batch {B}, got {key.shape[0]} and "
                         f"{value.shape[0]}")
    H_kv, S = key.shape[1], key.shape[2]
    if tuple(value.shape[:3]) != (B, H_kv, S):
        raise ValueError(f"value must have shape [batch, kv_heads, kv_len, value_dim] = "
                         f"[{B}, {H_kv}, {S}, *], "
                         f"got {tuple(value.shape)}")
    if key.shape[3] != D:
        raise ValueError(f"key must have the query's head dim {D}, got {key.shape[3]}")
    if H_kv == 0 or H % H_kv:
        raise ValueError(f"key/value heads ({H_kv}) must divide the query heads ({H})")
    if D == 0 or value.shape[3] == 0:
        raise ValueError(f"head dims must be >= 1, got query/key {D} and value {value.shape[3]}")
    if softmax_aux is not None:
        if (getattr(softmax_aux, "shape", None) != (H,)
                or not jnp.issubdtype(softmax_aux.dtype, jnp.floating)):
            raise ValueError(f"softmax_aux must be a float array [num_heads] = [{H}], "
                             f"got {getattr(softmax_aux, 'shape', None)}")
    if bias is not None:
        if not hasattr(bias, "shape") or not hasattr(bias, "dtype"):
            raise ValueError(f"bias must be a float array broadcastable to [batch, heads, q_len, "
                             f"kv_len] or a real number, got {type(bias).__name__}")
        shape = tuple(bias.shape)
        full = (B, H, T, S)
        padded = (1,) * (4 - len(shape)) + shape
        if len(shape) > 4 or any(b not in (1, f) for b, f in zip(padded, full)):
            raise ValueError(f"bias must broadcast to [batch, heads, q_len, kv_len] = "
                             f"{list(full)}, got {list(shape)}")
        if not jnp.issubdtype(bias.dtype, jnp.floating):
            raise ValueError(f"bias must have a floating dtype, got {bias.dtype}")
    if logits_soft_cap is not None:
        _real_number("logits_soft_cap", logits_soft_cap, positive=True)
    if softmax_scale is not None:
        _real_number("softmax_scale", softmax_scale, positive=False)


@dataclasses.dataclass(frozen=True)
class _MaskSpec:
    rule: TokenRule | None  # every rule of the call, the prebuilt mask's included
    layout: Array | None
    layout_block: tuple[int, int] | None
    combine: str
    prebuilt: BlockMask | None = None  # a caller's BlockMask: its kinds are used...
    extra: TokenRule | None = None  # ... with this rule of the call's added (None: as it is)


def _mask_spec(B, H, T, S, q_segment_ids, kv_segment_ids, q_positions, kv_positions,
               attention_mask, qkv_layouts, mask_builder, sliding_window, chunk_size, causal,
               default_block) -> _MaskSpec:
    """The token rule and block layout a call describes (every rule given must hold)."""
    rule = token_rule(T, S, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
                      q_positions=q_positions, kv_positions=kv_positions, causal=causal,
                      sliding_window=sliding_window, attention_mask=attention_mask, batch=B,
                      heads=H)
    if qkv_layouts is not None and mask_builder is not None:
        raise ValueError("give qkv_layouts or mask_builder, not both")
    if mask_builder is not None:
        if not callable(mask_builder):
            raise ValueError(f"mask_builder must be a callable returning a BlockMask or a block "
                             f"layout, got {type(mask_builder).__name__}")
        qkv_layouts = mask_builder()
    if qkv_layouts is None:
        return _MaskSpec(rule, None, None, "and")
    if isinstance(qkv_layouts, BlockMask):
        given = qkv_layouts
        check_block_mask(given, "qkv_layouts", B, H, T, S)
        if rule is None:
            return _MaskSpec(given.rule, given.layout, given.layout_block, given.combine, given)
        # The call's rule (causal=True by default) must hold too. Both rules go to the kernels
        # (one clause each, or merged into one) and the mask's kinds are combined with the call
        # rule's, tile by tile: no dense mask. A rule the mask's implies changes nothing.
        if given.rule is not None and given.layout is not None and given.combine == "or":
            raise ValueError(
                "qkv_layouts joins its rule and its layout by 'or'; the call's own rule "
                "(causal=True by default, or segment ids, positions, sliding_window, "
                "attention_mask) cannot be added to it without a dense token mask: pass "
                "causal=False and no other rule argument to use the mask as it is, or build the "
                "mask with every rule")
        try:
            combined = rule if given.rule is None else combine_rules(given.rule, rule, "and")
        except ValueError as error:
            raise ValueError(
                f"qkv_layouts' rule and the call's own rule (causal=True by default, or segment "
                f"ids, positions, sliding_window, attention_mask) cannot be joined without a dense "
                f"token mask ({error}); pass causal=False and no other rule argument to use the "
                f"mask as it is") from error
        extra = None if combined is given.rule else rule
        return _MaskSpec(combined, given.layout, given.layout_block, "and", given, extra)
    block = chunk_size if chunk_size is not None else default_block
    block = (block, block) if isinstance(block, (int, np.integer)) else tuple(block)
    power_of_two(block[0], "chunk_size")
    power_of_two(block[1], "chunk_size")
    layout = check_layout(qkv_layouts, T, S, block, H)
    return _MaskSpec(rule, layout, block, "and")


@jax.custom_jvp
def _finite_part(x: Array) -> Array:
    """``x`` with its non-finite entries set to 0, and derivative 1 everywhere: the derivative of a
    sum of products in ``x`` does not depend on the value of ``x``."""
    return jnp.where(jnp.isfinite(x), x, 0)


@_finite_part.defjvp
def _finite_part_jvp(primals, tangents):
    return _finite_part(primals[0]), tangents[0]


def _reference_spec(query, key, value, softmax_aux, bias, spec: _MaskSpec, scale, logits_soft_cap):
    """The definition, densely. Invisible keys do not exist for a row: a NaN (or inf) in q, k or
    v reaches exactly the rows that see it, forward and backward. So no product ever meets a
    zero weight: the sums over keys (and, by autodiff, over rows) take the finite part of q, k
    and v, and a pair with a non-finite q, k or v row has a NaN logit (and a visible such v row
    a NaN term) added on its own, where it is visible."""
    B, H, T, D = query.shape
    G = H // key.shape[1]
    dtype = jnp.promote_types(query.dtype, jnp.float32)
    q = query.astype(dtype)
    k = jnp.repeat(key.astype(dtype), G, axis=1)
    v = jnp.repeat(value.astype(dtype), G, axis=1)

    def non_finite_rows(x):
        return ~jnp.all(jnp.isfinite(x), axis=-1)

    exact = jax.lax.Precision.HIGHEST  # not TF32: on a GPU, XLA rounds float32 matmul inputs so
    s = jnp.einsum("bhtd,bhsd->bhts", _finite_part(q), _finite_part(k), precision=exact) * scale
    if logits_soft_cap is not None:
        s = logits_soft_cap * jnp.tanh(s / logits_soft_cap)
    if bias is not None:
        s = s + bias.astype(dtype)
    visible = dense_mask(spec.rule, spec.layout, spec.layout_block, spec.combine, T, key.shape[2])
    visible = jnp.broadcast_to(visible, s.shape)
    # The NaN of a non-finite q or k row joins the logit of visible pairs only, and after the soft
    # cap, whose derivative at a NaN would be NaN even where the select passes back a zero.
    bad_pair = non_finite_rows(q)[..., :, None] | non_finite_rows(k)[..., None, :]
    s = jnp.where(visible, s + jnp.where(bad_pair, jnp.nan, 0.0), -jnp.inf)
    m = jnp.max(s, axis=-1, initial=-jnp.inf)  # initial: no key at all (S = 0) is a row too
    if softmax_aux is not None:
        sink = softmax_aux.astype(dtype)[None, :, None]
        m = jnp.maximum(m, sink)
    m = jax.lax.stop_gradient(jnp.where(jnp.isfinite(m), m, 0.0))
    e = jnp.where(visible, jnp.exp(s - m[..., None]), 0.0)
    denom = jnp.sum(e, axis=-1)
    if softmax_aux is not None:
        denom = denom + jnp.exp(sink - m)
    # Normalised pair by pair, then selected: a NaN denominator (of a row that sees a NaN) must not
    # reach, by autodiff, the values of the keys that row cannot see.
    p = jnp.where(visible, e / jnp.where(denom == 0, 1.0, denom)[..., None], 0.0)
    o = jnp.einsum("bhts,bhsd->bhtd", p, _finite_part(v), precision=exact)
    v_nan = jnp.where(visible & non_finite_rows(v)[..., None, :], jnp.nan, 0.0)
    return (o + jnp.sum(p * v_nan, axis=-1)[..., None]).astype(query.dtype)


def _prepare(query, key, value, q_segment_ids, kv_segment_ids, q_positions, kv_positions,
             softmax_aux, bias, attention_mask, logits_soft_cap, qkv_layouts, softmax_scale,
             mask_builder, sliding_window, chunk_size, causal, default_block):
    if (isinstance(bias, (int, float, np.integer, np.floating))
            and not isinstance(bias, (bool, np.bool_))):
        # A number broadcasts like a 0-d array (as in NumPy); with sinks it even matters.
        bias = jnp.asarray(bias, jnp.float32)
    _check_inputs(query, key, value, softmax_aux, bias, logits_soft_cap, softmax_scale)
    B, H, T, D = query.shape
    S = key.shape[2]
    spec = _mask_spec(B, H, T, S, q_segment_ids, kv_segment_ids, q_positions, kv_positions,
                      attention_mask, qkv_layouts, mask_builder, sliding_window, chunk_size, causal,
                      default_block)
    scale = D ** -0.5 if softmax_scale is None else float(softmax_scale)
    if bias is not None:
        bias = jnp.asarray(bias).reshape((1,) * (4 - jnp.ndim(bias)) + tuple(jnp.shape(bias)))
    cap = None if logits_soft_cap is None else float(logits_soft_cap)
    return spec, scale, bias, cap


def reference(query: Array, key: Array, value: Array, q_segment_ids: Array | None = None,
              kv_segment_ids: Array | None = None, q_positions: Array | None = None,
              kv_positions: Array | None = None, softmax_aux: Array | None = None,
              bias: Array | None = None, attention_mask: Array | None = None,
              logits_soft_cap: float | None = None, qkv_layouts: Any = None,
              softmax_scale: float | None = None, mask_builder: Callable[[], Any] | None = None,
              sliding_window: int | tuple[int, int] | None = None, chunk_size: int | None = None,
              causal: bool = True) -> Array:
    """Dense attention in plain JAX with :func:`blocksparse_attention`'s semantics (float32, or
    float64 for float64 inputs). Memory ``B x Hq x T x S``: for tests, small shapes and
    ``impl="xla"``."""
    spec, scale, bias, cap = _prepare(query, key, value, q_segment_ids, kv_segment_ids, q_positions,
                                      kv_positions, softmax_aux, bias, attention_mask,
                                      logits_soft_cap, qkv_layouts, softmax_scale, mask_builder,
                                      sliding_window, chunk_size, causal, (128, 128))
    return _reference_spec(query, key, value, softmax_aux, bias, spec, scale, cap)


def _triton_supported(query, value, *configs: BlockSizes) -> str | None:
    """Why the Triton kernels cannot run this call (``None`` if they can)."""
    if query.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
        return f"dtype {query.dtype} (the kernels take float32, bfloat16, float16)"
    if max(query.shape[3], value.shape[3]) > 256:
        return f"head dims {query.shape[3]}/{value.shape[3]} (the kernels take up to 256)"
    for blocks in configs:
        if min(blocks.block_q, blocks.block_kv) < 16:
            return f"block sizes {blocks.block_q}x{blocks.block_kv} (tl.dot needs at least 16)"
    return None


def _pair(blocks: BlockSizes | tuple[BlockSizes, BlockSizes]) -> tuple[BlockSizes, BlockSizes]:
    """The backward's (dK/dV, dQ) kernel configs: one BlockSizes serves both."""
    return (blocks, blocks) if isinstance(blocks, BlockSizes) else tuple(blocks)


def _fit(blocks: BlockSizes, spec: _MaskSpec) -> BlockSizes:
    """Kernel tiles never larger than the layout's tiles (so that the mask stays exact)."""
    if spec.layout_block is None:
        return blocks
    return dataclasses.replace(blocks, block_q=min(blocks.block_q, spec.layout_block[0]),
                               block_kv=min(blocks.block_kv, spec.layout_block[1]))


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _run(static: _Static, layout_block, combine, query, key, value, softmax_aux, bias, rule, layout,
         prebuilt, extra):
    T, S = query.shape[2], key.shape[2]

    def mask_at(blocks: BlockSizes) -> BlockMask:
        if prebuilt is not None:
            mask = prebuilt.with_blocks(blocks.block_q, blocks.block_kv)
            return mask if extra is None else restrict(mask, extra, rule)
        return build_block_mask(rule, layout, layout_block, combine, T, S, blocks.block_q,
                                blocks.block_kv)

    masks = {}  # one mask per distinct tile shape (the backward's kernels may use other sizes)
    for blocks in (static.fwd, static.dkv, static.dq):
        tile = (blocks.block_q, blocks.block_kv)
        if tile not in masks:  # the kernels read the kinds and lists only (and a vmap folds them)
            masks[tile] = dataclasses.replace(mask_at(blocks), rule=None, layout=None, kept=())
    fwd_mask, dkv_mask, dq_mask = (masks[(b.block_q, b.block_kv)]
                                   for b in (static.fwd, static.dkv, static.dq))
    return _attention(static, query, key, value, softmax_aux, bias, rule, fwd_mask,
                      (dkv_mask, dq_mask))


def blocksparse_attention(
    query: Array,
    key: Array,
    value: Array,
    q_segment_ids: Array | None = None,
    kv_segment_ids: Array | None = None,
    q_positions: Array | None = None,
    kv_positions: Array | None = None,
    softmax_aux: Array | None = None,
    bias: Array | None = None,
    attention_mask: Array | None = None,
    logits_soft_cap: float | None = None,
    qkv_layouts: BlockMask | Array | None = None,
    softmax_scale: float | None = None,
    mask_builder: Callable[[], Any] | None = None,
    sliding_window: int | tuple[int, int] | None = None,
    chunk_size: int | tuple[int, int] | None = None,
    causal: bool = True,
    fwd_blocks: BlockSizes | None = None,
    bwd_blocks: BlockSizes | tuple[BlockSizes, BlockSizes] | None = None,
    impl: str = "auto",
    sequence_parallelism_mesh_axis_name: str | None = None,
) -> Array:
    """Attention that visits only the tiles its mask lists; differentiable in query, key, value,
    ``softmax_aux`` and ``bias``.

    Args:
        query: ``[B, Hq, T, D]``; key: ``[B, Hkv, S, D]``; value: ``[B, Hkv, S, Dv]``,
            ``Hq % Hkv == 0``, all three of one dtype.
        q_segment_ids, kv_segment_ids: ``[B, T]`` / ``[B, S]`` ints; only equal ids attend.
            Any integer dtype; ids are compared exactly (64-bit ids that do not fit in int32 are
            renumbered by rank, never truncated).
        q_positions, kv_positions: ``[B, T]`` / ``[B, S]`` ints for ``causal`` and the window
            (``arange`` by default), in ``(-2**30, 2**30)`` (checked when concrete).
        softmax_aux: ``[Hq]`` one sink logit per head, in every row's denominator, with no value.
        bias: broadcastable to ``[B, Hq, T, S]`` (a number too), added to the (soft-capped) logits.
        attention_mask: ``[B or 1, Hq or 1, T, S]`` bool or 0/1; honoured exactly.
        logits_soft_cap: ``cap``, a finite positive Python or NumPy number: logits become
            ``cap * tanh(logits / cap)`` before the bias.
        qkv_layouts: a :class:`~ejk_lite.masking.BlockMask` (e.g. from ``make_block_mask``, built
            once and reused across layers; the backward rebuilds it at its own block sizes
            unless the mask keeps them, ``BlockMask.keeping``), or a boolean block layout
            ``[nQ, nK]`` / ``[Hq, nQ, nK]`` whose tiles are ``chunk_size`` tokens (default 128);
            listed tiles may be visited. The call's own rules hold too (``causal=True`` by
            default): a mask whose rule implies them is used as it is; otherwise the two rules
            are evaluated together in partial tiles and the mask's tile kinds are combined with
            theirs, never through a dense ``[T, S]`` mask.
            Pass ``causal=False`` and no other rule to use the mask's rule alone.
        softmax_scale: a finite Python or NumPy number, ``D ** -0.5`` by default.
        mask_builder: a callable with no arguments returning what ``qkv_layouts`` takes.
        sliding_window: ``W`` or ``(left, right)``: visible iff
            ``q_pos - left <= kv_pos <= q_pos + right``.
        chunk_size: tile size of a boolean ``qkv_layouts`` (int or ``(q, kv)``).
        causal: ``q_pos >= kv_pos`` (default True, as the seed).
        fwd_blocks: :class:`BlockSizes` of the forward (``BlockSizes.forward`` by default).
        bwd_blocks: of the backward: one :class:`BlockSizes` for both of its kernels, or a pair
            ``(dkv, dq)``, one per kernel (``BlockSizes.backward`` by default).
        impl: ``"triton"``, ``"xla"`` (the dense :func:`reference`) or ``"auto"`` (Triton where the
            kernels support the call, else XLA).
        sequence_parallelism_mesh_axis_name: inside ``jax.shard_map``, the mesh axis the sequence
            is split over: the arrays are this shard's slices, the result the one of the whole
            sequence (:mod:`ejk_lite.sequence_parallel`).

    A pair is visible iff every rule given holds. A query row that sees no key gets zeros (and
    passes no gradient). Keys a row cannot see do not exist for it: a NaN in ``q``, ``k`` or ``v``
    makes NaN exactly the output rows that see it (the row's own ``q``: that row), and, for a
    finite cotangent, reaches a gradient only through visible pairs, as autodiff of softmax
    attention over the visible keys alone would (an inf may give inf or NaN there). Composes with
    ``jit``, ``grad`` and ``vmap``, nested too: mapped axes fold into the batch axis, one launch.
    Returns ``[B, Hq, T, Dv]`` in the query's dtype.
    """
    if sequence_parallelism_mesh_axis_name is not None:  # each shard holds a slice of the sequence
        return sequence_parallel.attention(blocksparse_attention, **locals())
    impl = resolve_impl(impl, auto="auto")  # "auto": resolved below, by what the kernels support
    if fwd_blocks is not None and not isinstance(fwd_blocks, BlockSizes):
        raise ValueError(f"fwd_blocks must be a BlockSizes, got {type(fwd_blocks).__name__}")
    if bwd_blocks is not None and not isinstance(bwd_blocks, BlockSizes) and not (
            isinstance(bwd_blocks, tuple) and len(bwd_blocks) == 2
            and all(isinstance(b, BlockSizes) for b in bwd_blocks)):
        raise ValueError(f"bwd_blocks must be a BlockSizes or a pair (dkv, dq) of them, "
                         f"got {bwd_blocks!r}")
    D = query.shape[-1] if hasattr(query, "shape") and len(query.shape) == 4 else 0
    # The defaults follow the wider of the two head dims: a value tile of 256 columns in a
    # D128 call's tiles (128 x 128, 3 stages) asked sm_90 for 327680 bytes (compiled as
    # jax-triton compiles), past Hopper's 232448.
    head_dim = max(D, value.shape[-1] if hasattr(value, "shape") and len(value.shape) == 4
                   else 0)
    dtype = getattr(query, "dtype", jnp.float32)
    default_block = (128, 128)
    spec, scale, bias, cap = _prepare(query, key, value, q_segment_ids, kv_segment_ids, q_positions,
                                      kv_positions, softmax_aux, bias, attention_mask,
                                      logits_soft_cap, qkv_layouts, softmax_scale, mask_builder,
                                      sliding_window, chunk_size, causal, default_block)
    pair_tiles = dict(bias=bias is not None,
                      mask=spec.rule is not None and spec.rule.attention_mask is not None)
    fwd = fwd_blocks or BlockSizes.forward(head_dim, dtype, **pair_tiles)
    dkv, dq = _pair(bwd_blocks or BlockSizes.backward(head_dim, dtype, **pair_tiles))
    fwd, dkv, dq = _fit(fwd, spec), _fit(dkv, spec), _fit(dq, spec)
    for blocks in (fwd, dkv, dq):
        power_of_two(blocks.block_q, "block_q")
        power_of_two(blocks.block_kv, "block_kv")
    unsupported = _triton_supported(query, value, fwd, dkv, dq)
    if impl == "triton" and unsupported:
        raise ValueError(f"impl='triton' cannot run this call: {unsupported}")
    if impl == "xla" or (impl == "auto" and unsupported):
        return _reference_spec(query, key, value, softmax_aux, bias, spec, scale, cap)
    B, H, T, _ = query.shape
    S, DV = key.shape[2], value.shape[3]
    if T == 0 or S == 0:  # nothing to attend to: zeros, and zero gradients
        return jnp.zeros((B, H, T, DV), query.dtype)
    rule = spec.rule
    other = None if rule is None else rule.other
    static = _Static(
        scale=scale, soft_cap=cap, fwd=fwd, dkv=dkv, dq=dq,
        causal=bool(rule is not None and rule.causal), window=None if rule is None else rule.window,
        has_segments=rule is not None and rule.q_segment_ids is not None,
        has_positions=rule is not None and rule.loads_positions,
        has_token_mask=rule is not None and rule.attention_mask is not None,
        clause2=None if other is None else (
            rule.op, other.causal, other.window, other.q_segment_ids is not None,
            other.loads_positions),
    )
    return _run(static, spec.layout_block, spec.combine, query, key, value, softmax_aux, bias, rule,
                spec.layout, spec.prebuilt, spec.extra)
