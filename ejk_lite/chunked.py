"""Chunked linear attention: the training-speed form of :func:`ejk_lite.recurrent`.

The recurrence (see :mod:`ejk_lite.recurrent`) is, per query head, with the K-side log-decay
``a_t = g_t + g_gamma + gk_t`` (a vector along K; a scalar gate is the same number in every
column)::

    h_t = exp(a_t)[:, None] * h_{t-1} + k_t^T v_t            o_t = scale * q_t h_t

Walked token by token it is a chain of tiny outer products. Cut the walk into chunks of ``C``
tokens (``chunk_size``, 64 by default) and write ``G_i`` for the cumulative log-decay *inside*
a chunk, ``G_i = a_first + ... + a_i`` (``chunk_local_cumsum``), ``Gamma = G_last`` for the
whole chunk's decay and ``H`` for the state before the chunk. Unrolling the recurrence over one
chunk gives, for token ``i`` of the chunk::

    o_i    = scale * (q_i * exp(G_i)) H  +  sum_{j <= i} A_ij v_j
    A_ij   = scale * sum_k q_ik k_jk exp(G_ik - G_jk)                    (j <= i, else 0)
    H_next = exp(Gamma)[:, None] * H  +  sum_j (k_j * exp(Gamma - G_j))^T v_j

The first term of ``o`` is a ``[C, K] x [K, V]`` matrix product, the second ``[C, C] x [C, V]``,
the state update ``[K, C] x [C, V]``: tensor-core work. Only the hand-off of ``H`` from chunk to
chunk is sequential, ``T / C`` steps instead of ``T``.

**Numerical safety.** The log-decays are ``<= 0``, so ``G`` only decreases along the walk and
``exp(G_i - G_j)`` is at most 1 whenever ``j`` comes before ``i``. With strong decay (log-gates of
-40 per token, say) ``G`` reaches -2500 within a chunk: ``exp(-G)`` is ``inf`` in float32, so the
textbook factorisation ``(q_i exp(G_i)) . (k_j exp(-G_j))`` gives ``0 * inf = NaN``. Every
exponent here is the decay over a span of tokens *in walking order*, never positive:

* between chunks: ``q_i * exp(G_i)`` (from the chunk's start to ``i``) and
  ``k_j * exp(Gamma - G_j)`` (from ``j`` to the chunk's end), both at most 1;
* inside a chunk with a scalar gate: the ``C x C`` decay matrix ``exp(where(i >= j, G_i - G_j,
  -inf))`` multiplies ``q k^T`` elementwise (masked entries are ``exp(-inf) = 0``, never
  ``inf * 0``);
* inside a chunk with a per-key gate the decay differs per column of K, so ``A`` is no longer a
  plain product. The chunk is cut into sub-chunks of 16 tokens. For a pair of different
  sub-chunks (queries in ``I``, keys in an earlier ``J``) take ``b``, the boundary just before
  ``I``: ``exp(G_i - G_j) = exp(G_i - G_b) * exp(G_b - G_j)`` with ``j <= b < i``, both factors
  at most 1, so ``A_IJ = (q_I exp(G_I - G_b)) (k_J exp(G_b - G_J))^T`` is a matrix product
  again. On the diagonal sub-chunks (``i`` and ``j`` in the same 16 tokens) there is no such
  ``b``: the ``16 x 16 x BK`` terms are computed elementwise, walking one key column ``j`` (or
  query row ``i``) at a time (the forward: a program per sub-chunk; the backward: a program per
  chunk, the same step of every sub-chunk at once), with ``exp(G_i - G_j)`` for ``i >= j``
  only, held as a running product
  of the factors ``exp(a_s) <= 1`` of the tokens in between (one more factor a step; the other
  rows keep 1 and are masked out).

The chunk-level decays the states and the output need (``q exp(G)``, ``k exp(Gamma - G)``,
``Gamma``) come out of the same sums, so the forward's attention kernel (either gate) writes them
and the states and output kernels read no gates.

**Accuracy.** ``G_i - G_j`` written as a difference of two cumulative sums carries the rounding
error of ``|G|`` (a thousand, for strong decays) into an exponent that may be near 0: measured,
that lost two orders of magnitude (2e-6 against the 8e-8 of the token-by-token walk, log-gates to
-15 per token, C = 64). So the kernels take the per-token log-decays ``a`` themselves and form each
exponent as a *direct* sum over exactly the tokens it spans: the cumulative sum of the chunk's
rows from its start, a reverse one of the rows shifted by one for the span to its end, sums
of whole sub-chunks for the spans between two sub-chunks. With ``a <= 0`` such sums never
cancel. On the diagonal blocks, for every pair ``j <= i``, the decay over ``(j, i]`` is grown
one token at a time as a product (one key column per step, every row taking the factor
``exp(a)`` of the token after that column): the factors the token-by-token walk multiplies, one
``exp`` per column and step rather than one per entry, each product at most 1. Rows outside the
sequence (a short chunk) read ``a = 0``: no decay, so the sums and products cover exactly the
tokens inside it.

**Mild gates** (per-key gate, 16-bit inputs). All this care is for chunks whose decay is
strong. Where no key column of a chunk decays by more than ``exp(-fast_decay)``
(``ChunkedConfig``, 20 by default), the textbook factorisation is safe: ``exp(G_i) <= 1`` and
``exp(-G_j) <= exp(20) = 4.9e8``, so ``A`` is one tensor-core product per K tile,
``(q exp(G)) (k exp(-G))^T``, lower triangle kept, diagonal blocks included
(``_gk_fast_kernel``). Its exponents are differences of sums of at most 20 in size: they lose
about ``20 * 2^-24`` to rounding, far below a 16-bit input's own (``2^-8``, ``2^-11``), which is
why float32 inputs never take it. A first pass over the chunk's gates decides, per chunk and
head, and the backward follows its flags (``_gk_fast_grads_kernel``: ``dq~`` and ``dk~`` as two
products through the same factors); the careful kernels take the other chunks (and any chunk
with a NaN gate). With the gates a trained layer has (the benchmark's: ``log_sigmoid`` of
``N(4, 1)``, -0.03 a token, -4 at most over a chunk of 64) every chunk takes it; with log-gates
of -1 a token and chunks of 64, none does. The same bound serves one level down: in a chunk
too strong for it, a diagonal sub-chunk block is one product per K tile whose key columns
decay by no more than ``exp(-fast_decay)`` over the sub-chunk, ``(q exp(G)) (k exp(-G))^T``
with ``G`` summed from the sub-chunk's first row (``_gk_diagonal_kernel``), instead of the
walk: with log-gates of -1 a token, a sub-chunk of 16 decays by about ``exp(-16)``.

**Backward.** Write ``D`` for the gradient reaching ``H_next`` (one walk over the chunks in the
other direction carries it: ``D_prev = exp(Gamma) * D + (scale q exp(G))^T do``). With
``dA_ij = do_i . v_j``::

    dq_i = scale * (exp(G_i) * (do_i H^T) + sum_{j <= i} dA_ij k_j exp(G_i - G_j))
    dk_j = exp(Gamma - G_j) * (v_j D^T) + sum_{i >= j} dA_ij scale q_i exp(G_i - G_j)
    dv_j = sum_{i >= j} A_ij do_i + (k_j exp(Gamma - G_j)) D

The gates reach the loss only through ``G``. ``G_i`` appears with a plus sign where token ``i``
is a query and with a minus sign where it is a key, and ``Gamma`` (the last row's ``G``) in the
state update, so::

    dG_i = scale q_i * dq~_i - k_i * dk~_i   (+ at the chunk's last row: sum_V D * P)

Written with the full ``dq`` and ``dk`` this cancels catastrophically for strong decays: both
contain the diagonal term ``dA_ii q_i k_i`` (exponent 0), whose contributions cancel exactly, and
what is left can be smaller by ``exp(-40)``. So ``dq~`` and ``dk~`` leave out every term whose
``G`` dependence cancels: the diagonal ``j = i`` of ``A`` and, at the chunk's last token, its own
``k^T v`` in the state update; ``P`` is the state just before that last token's ``k^T v``
(``exp(Gamma) H + sum_{j < last} (k_j exp(Gamma - G_j))^T v_j``). What is summed then is only
terms that genuinely depend on the gates. ``a``'s gradient is the transpose of the cumulative
sum, the suffix sums of ``dG`` within each chunk (``chunk_local_cumsum`` the other way); JAX
differentiates the sums that fold ``g``, ``g_gamma`` and ``gk`` into ``a``. With a gate the
forward keeps ``q exp(G)``, ``k exp(Gamma - G)`` (two arrays of ``q``'s size, in its dtype)
and ``Gamma`` for the backward, whose states, ``D`` and ``dv`` then read no gates.

**The forward alone.** When no gradient is asked (the ``custom_vjp``'s primal), nothing need be
kept, and a scalar gate (or none) takes three kernels of its own. ``_gate_sums_kernel`` sums the
gates of each chunk once: every row's log-decay to its chunk's end, and the chunk's ``Gamma``, a
number a row and one a chunk. The state walk reads them and decays ``k`` as it loads it, so its
sequential steps sum nothing (summed inside the walk, they cost more than the walk itself).
``_fused_output_kernel`` forms ``A`` in registers, scaling the rows of ``q H`` by ``exp(G_i)``
after the product (a scalar per row). Neither ``A`` nor decayed copies of ``q`` and ``k`` go
through memory. A walk's steps are sequential, so few long sequences leave most of the GPU idle:
without packing, and with fewer walks than ``min_walk_programs`` (``ChunkedConfig``), the walk
is cut into ``S`` segments walked at once, each but the first from a zero state.
``_segments_kernel`` then walks the segments' last states ``F_s`` (``S`` steps):
``E_{s+1} = exp(Gamma_s) E_s + F_s``, ``Gamma_s`` the decay over segment ``s``; and
``_fused_output_kernel`` adds to a chunk's state the ``E_s`` of its segment, decayed from the
segment's start to the chunk (a direct sum of the chunks' ``Gamma``).

**Layouts.** Chunks are counted from each sequence's first token. ``reverse=True`` walks each
sequence from its last token: the kernels visit a chunk's rows in walking order (row ``r`` of
memory chunk ``m`` is token ``start + (m + 1) C - 1 - r``), and visit the chunks last to first,
so every formula above holds as written, in walking order. Grouped heads: key/value head ``j``
serves query heads ``j G ... (j + 1) G - 1``; each query head has its own state and gates; the
key/value gradients are computed per query head and summed over the group.

Kernels (``BT`` = chunk size, ``N`` sequences, ``NT`` chunk slots per batch row, ``S`` segments
of a walk: 1 but where the forward alone cuts its walk):

====================  =====================  ===================================================
kernel                grid                   computes
====================  =====================  ===================================================
_gate_sums_kernel     (NT, B)                the forward alone, scalar gate: each row's decay
                                             to its chunk's end, Gamma per chunk (every head)
_states_kernel        (V/BV, K/BK, N*H*S)    walks the chunks: H at every chunk's start, final
                                             state (forward; again in the backward); the
                                             forward alone decays k's rows as it loads them
_segments_kernel      (V/BV, K/BK, B * H)    the forward alone, a walk cut into segments: the
                                             state handed to each segment, the final state
_attention_kernel     (NT, B * H)            A, the masked intra-chunk attention [BT, BT]
                                             (scalar gate or none); with a gate q exp(G),
                                             k exp(Gamma - G), Gamma, as the next
_gk_fast_kernel       (NT, B * H)            per-key gate, mild chunks: A whole, q exp(G),
                                             k exp(Gamma - G), Gamma; which chunks it took
_gk_attention_kernel  (NT, B * H)            the same with a per-key gate, the other chunks,
                                             but for the diagonal sub-chunk blocks
_gk_diagonal_kernel   (NT * BT/BC, B * H)    per-key gates: A's diagonal sub-chunk blocks
                                             (one product a K tile where the sub-chunk is mild)
_output_kernel        (V/BV, NT, B * H)      o = scale (q exp(G)) H + A v
_fused_output_kernel  (V/BV, NT, B * H)      the forward alone, scalar gate or none: o from q,
                                             k, v, the gates and H (A formed in registers;
                                             H completed for a walk cut into segments)
_state_grads_kernel   (V/BV, K/BK, N * H)    walks the chunks backwards: D for every chunk,
                                             d initial_state
_dA_kernel            (NT, B * H)            dA = do v^T (masked); the scalar gate's intra dG
_gk_fast_grads_kernel (K/BK, NT, B * H)      per-key gate, the chunks _gk_fast_kernel took:
                                             dq, dk, dG inside the chunk, two products
_intra_grads_kernel   (K/BK, NT, B * H)      per-key gates only: dq, dk, dG inside the chunk,
                                             the other chunks
_dv_kernel            (V/BV, NT, B * H)      dv = A^T do + (k exp(Gamma - G)) D
_inter_grads_kernel   (K/BK, NT, B * H)      dq, dk, dG: the state terms, plus the intra-chunk
                                             ones (computed here for scalar gates)
====================  =====================  ===================================================
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import triton
import triton.language as tl
from jax import Array

from ejk_lite import sequence_parallel
from ejk_lite.checks import resolve_impl, static_int
from ejk_lite.cumsum import chunk_local_cumsum
from ejk_lite.launch import ON_GPU, max_shared_memory, triton_call, vmap_by_folding
from ejk_lite.packing import cdiv, prepare_chunk_indices, prepare_chunk_offsets, sanitize_cu_seqlens

# recurrent's argument checks and its plain-JAX reference: one import, so that moving them is a
# one-line change.
from ejk_lite.linear_attention import _scale, _validate, reference

__all__ = ["chunked_recurrent", "ChunkedConfig", "KernelConfig", "reference"]

_TRITON_DTYPES = (jnp.float16, jnp.bfloat16, jnp.float32)
_MAX_GRID_YZ = 65535  # CUDA's limit on the grid's 2nd and 3rd axes
_WHOLE_WALK = 1 << 30  # the steps of a walk that is not cut into segments: more than any has
# The shortest segment of a cut walk: shorter ones would add more to _segments_kernel's walk and
# the output's corrections than they take off the walk.
_MIN_SEGMENT = 16
# The longest: a chunk's decay from its segment's start is a sum over a vector of the segment's
# chunks (_segment_decay), kept short; longer walks take more segments.
_MAX_SEGMENT = 1024
# fast_decay's ceiling: exp(40) = 2.4e17 keeps k exp(-G) and the masked products far from
# float32's (and bfloat16's) overflow at 3.4e38 for any sane q and k.
_MAX_FAST_DECAY = 40.0


# ----------------------------------------------------------------------------------------------
# Configuration.
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class KernelConfig:
    """Tiles and launch settings of one kernel. ``block_k`` / ``block_v`` are the K / V tile
    widths (powers of two >= 16, the smallest ``tl.dot`` operand side; cut down to the next power
    of two of K / V at launch). ``unroll`` (a power of two up to 16): how many steps of the walks
    over a sub-chunk's diagonal block run unrolled (per-key-gate intra-chunk kernels; at most the
    sub-chunk). A kernel that does not tile an axis or walk ignores the setting."""

    block_k: int = 64
    block_v: int = 64
    num_warps: int = 4
    num_stages: int = 2
    unroll: int = 1

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            object.__setattr__(self, field.name, static_int(value, f"KernelConfig.{field.name}"))
        for name in ("block_k", "block_v"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"KernelConfig.{name} must be a power of two >= 16, got {value}")
        if self.num_warps not in (1, 2, 4, 8, 16):
            raise ValueError(f"KernelConfig.num_warps must be 1, 2, 4, 8 or 16, got {self.num_warps}")
        if self.num_stages < 1:
            raise ValueError(f"KernelConfig.num_stages must be >= 1, got {self.num_stages}")
        if self.unroll not in (1, 2, 4, 8, 16):
            raise ValueError(f"KernelConfig.unroll must be 1, 2, 4, 8 or 16, got {self.unroll}")


# The most shared memory the defaults take a block (float32, K or V >= 128; ChunkedConfig.default).
_FLOAT32_DEFAULT_SHARED = 131072


@dataclasses.dataclass(frozen=True)
class ChunkedConfig:
    """One :class:`KernelConfig` per kernel (see the module docstring), the sub-chunk size of the
    per-key-gate intra-chunk kernels, and how a float32 ``tl.dot`` multiplies.

    ``float32_dot`` (Triton's ``input_precision`` for float32 operands): ``"tf32x3"``, three TF32
    tensor-core products that keep float32 accuracy, or ``"ieee"``, plain FMAs. Products of
    16-bit inputs use the tensor cores in their own dtype with float32 accumulation (the
    per-key-gate intra-chunk products' operands, decayed in float32, are rounded to it first).
    """

    # The state walks: few programs walk many chunks at long sequences (B1 T32768 H8 K=V=64:
    # 16 programs, 512 chunks each), so their loads are pipelined (3 stages) over narrower
    # tiles. Measured (H100, bf16, per-kernel medians over one trace; bench/_probe_chunked_gk.py,
    # not recorded), per-key gate at that shape: _states_kernel 1.22 -> 0.84 ms and
    # _state_grads_kernel 0.56 -> 0.41 from BV64 2 stages; at this tree BV16 would take
    # 0.43 -> 0.40 there but 0.11 -> 0.155 at B4 T4096 H16 K=V=128.
    # With the decays loaded a chunk ahead (H200, bf16, bench/_probe_chunked_gk.py, per-kernel
    # medians over one trace, not recorded), the forward alone with a scalar gate at B1 T32768
    # H8 K=V=64: _states_kernel 0.282 ms at BV32 3 stages (BV16 0.307, BV64 0.337, 2 stages
    # 0.545, 4 stages 0.308, 5 0.281, 8 warps 0.298, BK32 0.271), fla's chunk_fwd_kernel_h 0.204;
    # at B4 T4096 H16 K=V=128 0.091 (BV64 0.083, fla 0.069).
    states: KernelConfig = KernelConfig(block_v=32, num_stages=3)
    # The forward alone's walk (_states_kernel decaying k's rows, after _gate_sums_kernel):
    # these tiles, halved (V first, down to 32) while the walk would launch fewer than
    # min_walk_programs programs. Measured (H200, bf16, scalar gate, per-kernel medians over one
    # trace, two machines; bench/_probe_chunked_gk.py --forward-only, not recorded): at B4 T4096
    # H16 K=V=128 (256 programs) 0.082 ms at BK64 BV64 4 stages, 4 or 8 warps, against 0.091 at
    # the walk's tiles above (BK32 BV32 0.145); at B1 T32768 H8 K=V=64 (32 programs once halved
    # to BK32 BV32) 0.255 at 8 warps 4 stages (4 warps 0.265, 2 warps 0.519; 3 or 5 stages
    # 0.264 at 4 warps), against 0.277 above; fla's chunk_fwd_kernel_h 0.204 there, whose
    # autotuning picks BK32 BV32 4 stages too. Deeper look-ahead of the decays (two or three
    # chunks, in registers) lost, 0.47-1.2 ms; decaying v instead of k did not help,
    # 0.245-0.268 against 0.254-0.265 on two machines. Later (H200, the same probe, medians of
    # 10, checked), BV128: _states_kernel 0.082 -> 0.078 ms at B4 T4096 H16 K=V=128 (128
    # programs; the forward 0.209 -> 0.205) and 0.091 -> 0.070 at B8 T2048 (0.217 -> 0.198);
    # 3 stages alike (0.078, 0.070), 4 warps 0.080 and 0.069, BK128 BV128 0.089 and 0.074, BK128
    # BV64 0.088 and 0.074, BK64 BV64 at 2 stages 0.103 and 0.107. K=V=64 caps BV at 64.
    states_alone: KernelConfig = KernelConfig(block_k=64, block_v=128, num_warps=8, num_stages=4)
    min_walk_programs: int = 128
    # Still short of min_walk_programs once narrowed (a few long sequences, no packing), the
    # forward alone cuts its walk into segments walked at once (see _segments_kernel), enough
    # for about split_programs programs; False: one walk a sequence. Measured (H200, bf16,
    # scalar gate, B1 T32768 H8 K=V=64, 32 programs of BK32 BV32; bench/_probe_chunked_gk.py
    # --forward-only, medians of 10, checked, not recorded): forward 0.324 ms as one walk,
    # 0.149 cut for 128 programs (_states_kernel 0.259 -> 0.074, _segments_kernel 0.003,
    # _fused_output_kernel 0.058 -> 0.064), 0.126 for 256, 0.120 for 512.
    split_walk: bool = True
    split_programs: int = 512
    # Measured (H100, bf16, B4 T4096 H16 K=V=128, per-kernel medians over one trace; probes,
    # not recorded): _gk_attention_kernel 0.40 ms at BK64 4 warps (at this tree: BK32 4 warps
    # with one stage 0.42, BK32 2 warps 0.44, BK16 2 warps 0.43, BK64 2 warps 0.69, BK16 one
    # warp 0.71; a program per pair of sub-chunks instead, branch gk-att-pair, 0.53 at best).
    # Earlier, with the products between sub-chunks on operands in the input dtype
    # (.scratch probe of 41f5d0e's tree), _gk_attention_kernel 0.43 ms at BK64 4 warps (BK32
    # 0.46, BK16 0.53, BK64 8 warps 0.68; 0.48 at BK32 with float32 operands);
    # _gk_diagonal_kernel 0.28 ms at BK128 one warp (2 warps 0.32; BK64: one warp 0.37, 2
    # warps 0.43, 4 warps 0.42, one warp unrolled by 2 0.44; BK128 4 warps 0.42, 8 warps
    # 0.56). Earlier (bench/_probe_chunked_gk.py at c96caac): the walk in _intra_grads_kernel
    # 1.38 ms at unroll 1, 1.25 at 2, 1.10 at 4, 1.21 at 8; BK16 or BK64 instead of BK32 (at
    # 41f5d0e's tree) took 0.94 / 0.34 ms more forward + backward.
    # The per-key gate's attention in two kernels instead (ee2326f, reverted): the sums and
    # decayed rows in one, the products between sub-chunks in the other. Neither spills offline
    # (sm_90, ptxas: 113 and 100 registers at BK16 4 warps, where _gk_attention_kernel at BK64
    # spills 1252 bytes at 255), yet the pair lost (H200, bf16, B4 T4096 H16 K=V=128, medians
    # of 10, bench/_probe_chunked_gk.py at 81434ec): forward 0.877 ms at BK16 4 warps, 0.970
    # with the products at BK32 8 warps, 1.005 with both there, against 0.862 for this one;
    # forward + backward 2.969, 3.062 and 3.093 against 2.949 (per kernel, products at BK32 8
    # warps: 0.32 ms for the sums and rows, 0.20 for the products).
    attention: KernelConfig = KernelConfig()
    # _gk_fast_kernel, one program per chunk. Measured (H200, bf16, B4 T4096 H16
    # K=V=128, mild gates, per-kernel medians over one trace; bench/_probe_chunked_gk.py
    # --forward-only, not recorded): 0.264 ms at BK32 2 warps 1 stage (2 stages 0.292, 3 0.285;
    # one warp 0.379, BK16 2 warps 0.342, BK64 2 warps 0.493, BK64 4 warps 0.341, BK128 4 warps
    # 0.340, 8 warps 0.368), against 0.407 + 0.267 for _gk_attention_kernel and
    # _gk_diagonal_kernel. Its rows are addressed from the chunk's first row in 32 bits: with
    # 64-bit offsets per element, as the other kernels, it took 0.386 ms at BK64 4 warps (0.341
    # after).
    fast: KernelConfig = KernelConfig(block_k=32, num_warps=2, num_stages=1)
    # _gk_fast_grads_kernel (same shape and gates as fast): 0.338 ms at BK64 4 warps (1 stage
    # 0.338; BK32 2 warps 0.495, BK32 4 warps 0.466, BK64 8 warps 0.424, BK128 8 warps 0.386),
    # against 1.015 for _intra_grads_kernel alone; forward + backward 2.578 -> 1.931 ms.
    fast_grads: KernelConfig = KernelConfig()
    # _gk_diagonal_kernel, with strong gates (log_sigmoid of N(0, 1): every chunk takes it) at
    # B4 T4096 H16 K=V=128 (H200, bf16, medians of 10, checked): 0.154 ms per call with the
    # one-product shortcut for mild sub-chunks (fast_decay), 0.263 walking every K tile; the
    # forward 0.780 against 0.843 ms, forward + backward 2.860 against 2.904.
    diagonal: KernelConfig = KernelConfig(block_k=128, num_warps=1)
    output: KernelConfig = KernelConfig()
    # _fused_output_kernel: the forward alone with a scalar gate or none (no A, no decayed q and
    # k written: o from q, k, v and the states; the walk reads _gate_sums_kernel's decays).
    # Measured (H200, bf16, B4 T4096 H16 K=V=128, scalar gate, per-kernel medians over one
    # trace; bench/_probe_chunked_gk.py --forward-only, not recorded): 0.117 ms at BV128 3 stages
    # (2 stages 0.125, 8 warps 0.127; BV64 4 warps 0.147, 8 warps 0.160), fla's
    # chunk_fwd_kernel_o 0.131. Chunks of 128 for the forward alone (half the states written
    # and read) lost at every race shape (H200, bf16, medians of 10, checked; best of six tile
    # choices): forward 0.248 against 0.208 ms at B4 T4096 H16 K=V=128, 0.253 against 0.217 at
    # B8 T2048, 0.177 against 0.120 at B1 T32768 H8 K=V=64. Their [128, 128] scores took this
    # kernel from 0.119 to 0.167 ms at BV128 8 warps 2 stages (at the first shape). Split into
    # two programs of 64 rows, the second also attending to the first block's keys (branch
    # attempt/fused-output-rows): 0.152 ms, the forward 0.216 with the states' walk at 0.060
    # (BK64 BV64 8 warps 3 stages; 0.083 in chunks of 64).
    fused_output: KernelConfig = KernelConfig(block_v=128, num_stages=3)
    state_grads: KernelConfig = KernelConfig(block_v=32, num_stages=3)
    dA: KernelConfig = KernelConfig()
    intra_grads: KernelConfig = KernelConfig(block_k=32, unroll=4)
    dv: KernelConfig = KernelConfig()
    inter_grads: KernelConfig = KernelConfig()
    sub_chunk: int = 16
    float32_dot: str = "tf32x3"
    # The per-key gate's shortcut (_gk_fast_kernel) for chunks that decay by no more
    # than exp(-fast_decay) in any key column, and (_gk_diagonal_kernel) for the diagonal
    # sub-chunk blocks of the other chunks, per K tile; 16-bit inputs only; None: never. See
    # the module docstring ("Mild gates") for the bound.
    fast_decay: float | None = 20.0

    @staticmethod
    def default(dtype: Any = jnp.bfloat16, key_dim: int = 128, value_dim: int = 128,
                shared_memory: int | None = None) -> ChunkedConfig:
        """The config a call with ``config=None`` takes: for products in ``dtype`` (the result
        type of query, key and value), head dims ``key_dim`` / ``value_dim``, on a GPU whose
        blocks may use ``shared_memory`` bytes (``None``: GPU 0's, from the driver; no driver:
        Hopper's).

        ``ChunkedConfig()``, timed on Hopper GPUs, except for float32 products with K or V of
        128 or more:

        * ``attention`` (``_gk_attention_kernel``, the per-key gate's) at one stage instead of
          two, on every GPU. Measured (H200, float32, B4 T4096 H16 K=V=128, per-key gate,
          ``bench/_probe_chunked_gk.py --dtype float32``, medians of 10, checked against the
          float32 reference, not recorded): the kernel 1.050 -> 0.828 ms, forward 2.224 ->
          2.006 ms, forward + backward 6.357 -> 6.135; at B2 T4096 H8, forward 0.608 ->
          0.561 (``bench/_probe_smaller_gpu_defaults.py``). Timed at K = V = 128 only;
          larger head dims take it untimed. bfloat16 was even in the same run (forward
          0.4595 / 0.4586 ms, forward + backward 1.8709 / 1.8725): kept at two.
        * On a GPU with less than 131072 bytes a block, ``fused_output`` at 2 stages too: at 3
          it compiles to 131072 bytes for sm_89 (``tools/compile_check.py --package --arch 89
          --shared``), past the 101376 of sm_86 and sm_89 (RTX 30xx and 40xx, A10, L4), where
          the driver would refuse the launch; at 2, 65536 (and ``attention`` at one stage
          65536, at two 131072). Compiled, not timed on such a GPU (on an H200 both were
          right, ``bench/_probe_smaller_gpu_defaults.py``). 16-bit inputs, and float32 ones
          with K and V below 128, fit there with the defaults (same check)."""
        given = dtype
        try:
            dtype = jnp.dtype(dtype)
        except TypeError:  # not a dtype, nor anything that names one ("x")
            dtype = None
        if dtype is None or dtype not in map(jnp.dtype, _TRITON_DTYPES):
            raise ValueError(f"dtype must be float16, bfloat16 or float32, got {given!r}")
        key_dim = static_int(key_dim, "key_dim")  # 0 is a valid head dim: an empty state
        value_dim = static_int(value_dim, "value_dim")
        if shared_memory is None:
            limit = max_shared_memory()
        else:
            limit = static_int(shared_memory, "shared_memory", minimum=1)
        config = ChunkedConfig()
        if dtype.itemsize < 4 or max(key_dim, value_dim) < 128:
            return config
        config = dataclasses.replace(
            config, attention=dataclasses.replace(config.attention, num_stages=1))
        if limit is None or limit >= _FLOAT32_DEFAULT_SHARED:
            return config
        return dataclasses.replace(
            config, fused_output=dataclasses.replace(config.fused_output, num_stages=2))

    @classmethod
    def kernel_fields(cls) -> tuple[str, ...]:
        """The names of the fields that hold a :class:`KernelConfig`, one per kernel."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.type in (KernelConfig, "KernelConfig"))

    def __post_init__(self):
        for name in self.kernel_fields():
            value = getattr(self, name)
            if not isinstance(value, KernelConfig):
                raise ValueError(f"ChunkedConfig.{name} must be a KernelConfig, got {value!r}")
        for name in ("min_walk_programs", "split_programs"):
            value = static_int(getattr(self, name), f"ChunkedConfig.{name}", minimum=1)
            object.__setattr__(self, name, value)
        if not isinstance(self.split_walk, (bool, np.bool_)):
            raise ValueError(f"ChunkedConfig.split_walk must be a bool, got {self.split_walk!r}")
        object.__setattr__(self, "split_walk", bool(self.split_walk))
        sub = static_int(self.sub_chunk, "ChunkedConfig.sub_chunk", minimum=1)
        if sub not in (16, 32, 64):
            raise ValueError(f"ChunkedConfig.sub_chunk must be 16, 32 or 64, got {sub!r}")
        object.__setattr__(self, "sub_chunk", sub)
        if self.float32_dot not in ("tf32x3", "ieee"):
            raise ValueError(f"ChunkedConfig.float32_dot must be 'tf32x3' or 'ieee', got "
                             f"{self.float32_dot!r}")
        bound = self.fast_decay
        if bound is not None:
            is_real = isinstance(bound, (int, float, np.integer, np.floating)) and not isinstance(
                bound, (bool, np.bool_))
            if not is_real or not 0.0 <= float(bound) <= _MAX_FAST_DECAY:
                raise ValueError(f"ChunkedConfig.fast_decay must be None or a number in [0, "
                                 f"{_MAX_FAST_DECAY:g}], got {bound!r}")
            object.__setattr__(self, "fast_decay", float(bound))


@dataclasses.dataclass(frozen=True)
class _Static:
    """Everything static about one call (hashable: a jit static argument)."""

    scale: float
    chunk_size: int
    reverse: bool
    config: ChunkedConfig


# ----------------------------------------------------------------------------------------------
# Helpers shared by the kernels: which tokens a program owns, and the decays between them.
#
# The kernels take the per-token log-decays a (not their cumulative sums) and form every exponent
# as a *direct* sum of a over exactly the tokens it spans: a prefix sum from the chunk's start, a
# suffix sum to its end, or the sum between two tokens. With a <= 0 such sums never cancel, so
# each is accurate to a few float32 roundings of its own size. A difference of two cumulative
# sums, G_i - G_j, would carry the rounding error of |G| ~ C * |a| (a thousand, for strong
# decays) into an exponent that may be near 0: measured, that cost two orders of magnitude of
# accuracy (2e-6 against the 8e-8 of the token-by-token walk) at log-gates of -15 per token.
# ----------------------------------------------------------------------------------------------

# A log-decay at or below this is a decay of exactly 0 in float32 (exp underflows below about
# -104), and so is every span that contains it: clamping to it changes no result. It keeps -inf
# (a gate that forgets everything) out of the sums, where a sum that met it is -inf and the
# masks and products around it (0 * -inf) would make NaN; the gradient of a clamped gate is 0,
# as exp's is (_chunked_bwd). The kernels clamp as they load, so a lone ``gk`` reaches them in
# its own dtype with no pass over it first (H100, bf16, B4 T4096 H16 K=V=128: that pass, a
# conversion to float32 and the clamp in XLA, took 0.066 ms of the forward's 1.03).
_LOG_DECAY_FLOOR = tl.constexpr(-1e4)


@triton.jit
def _log_decay(x):
    """Log-decays as loaded (any float dtype), in float32 and clamped to the floor. A NaN stays
    NaN, as in the reference: the default maximum (maxnum) returns the other operand on the GPU,
    which would turn a NaN gate into one that silently forgets everything."""
    return tl.maximum(x.to(tl.float32), _LOG_DECAY_FLOOR, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _chunk_of_program(cu_seqlens, chunk_indices, i_t, T, num_seqs, IS_VARLEN: tl.constexpr):
    """(chunk within its sequence, sequence start, sequence end) of chunk slot ``i_t``, tokens
    counted within the batch row. Without packing, a row is one sequence and slot ``i_t`` is its
    chunk ``i_t``. With packing, ``chunk_indices`` lists (sequence, chunk) per slot; spare slots
    (-1, -1) get an empty sequence. Every index read from memory is clamped: whatever the
    arrays hold, ``0 <= start <= end <= T``."""
    if IS_VARLEN:
        i_s = tl.load(chunk_indices + 2 * i_t)
        i_c = tl.load(chunk_indices + 2 * i_t + 1)
        live = (i_s >= 0) & (i_c >= 0)
        i_s = tl.minimum(tl.maximum(i_s, 0), num_seqs - 1)
        i_c = tl.maximum(i_c, 0)
        start = tl.minimum(tl.maximum(tl.load(cu_seqlens + i_s), 0), T)
        end = tl.minimum(tl.maximum(tl.load(cu_seqlens + i_s + 1), start), T)
        end = tl.where(live, end, start)
    else:
        i_c = i_t
        start = 0
        end = T
    return i_c, start, end


@triton.jit
def _head_chunk_of_program(cu_seqlens, chunk_indices, i_t, i_bh, T, num_seqs, H: tl.constexpr,
                           H_KV: tl.constexpr, IS_VARLEN: tl.constexpr):
    """The opening of every kernel with a program per chunk and head: (batch row, query head, the
    key/value head serving it, then :func:`_chunk_of_program`'s chunk, start and end) of chunk
    slot ``i_t`` of batch row and query head ``i_bh``. The caller returns at once where the
    chunk is empty (``start + i_c * BT >= end``: a spare slot)."""
    i_b, i_h = i_bh // H, i_bh % H
    i_c, start, end = _chunk_of_program(cu_seqlens, chunk_indices, i_t, T, num_seqs, IS_VARLEN)
    return i_b, i_h, i_h // (H // H_KV), i_c, start, end


@triton.jit
def _sequence_of_program(cu_seqlens, chunk_offsets, i_n, T, NT_SLOTS, num_seqs, IS_VARLEN: tl.constexpr):
    """(batch row, start, end, first chunk slot) of sequence ``i_n`` (of ``B * num_seqs``)."""
    if IS_VARLEN:
        i_b = i_n // num_seqs
        i_s = i_n % num_seqs
        start = tl.minimum(tl.maximum(tl.load(cu_seqlens + i_s), 0), T)
        end = tl.minimum(tl.maximum(tl.load(cu_seqlens + i_s + 1), start), T)
        first = tl.minimum(tl.maximum(tl.load(chunk_offsets + i_s), 0), NT_SLOTS)
    else:
        i_b = i_n
        start = 0
        end = T
        first = 0
    return i_b, start, end, first


@triton.jit
def _chunk_gamma(chunk_decay, slot, live, i_h, offs_k, mask_k, H: tl.constexpr, K: tl.constexpr,
                 PER_KEY: tl.constexpr):
    """Gamma, the log-decay over the whole chunk in ``slot`` (flat over batch rows, clamped by the
    caller), for head ``i_h``: ``[BK]`` from ``[B * NT_SLOTS, H, K]`` (PER_KEY) or a scalar from
    ``[B * NT_SLOTS, H]``; 0 where not ``live``. The state walks load it a chunk ahead."""
    if PER_KEY:
        gamma = tl.load(chunk_decay + (slot * H + i_h) * K + offs_k, mask=mask_k & live, other=0.0)
    else:
        gamma = tl.load(chunk_decay + slot * H + i_h, mask=live, other=0.0)
    return gamma


@triton.jit
def _rows(r, i_c, start, end, row_base, BT: tl.constexpr, REVERSE: tl.constexpr):
    """Tokens (flat, int64) of walking rows ``r`` of chunk ``i_c``, and which lie in the chunk.

    Chunks are counted from the sequence's start. Forwards, row r is token start + i_c BT + r;
    walking in reverse, the chunk's rows are visited last token first. A short chunk is short at
    its walking end (forwards) or walking start (reverse). Rows outside ``[0, BT)`` are outside."""
    if REVERSE:
        pos = start + (i_c + 1) * BT - 1 - r
    else:
        pos = start + i_c * BT + r
    valid = (pos >= start) & (pos < end) & (r >= 0) & (r < BT)
    return row_base + pos, valid


@triton.jit
def _first_row(i_c, start, BT: tl.constexpr, REVERSE: tl.constexpr):
    """(token of walking row 0 of chunk ``i_c``, within the batch row; +1 or -1): walking row
    ``r`` is token ``first + r * step`` (see :func:`_rows`)."""
    if REVERSE:
        first = start + (i_c + 1) * BT - 1
        step = -1
    else:
        first = start + i_c * BT
        step = 1
    return first, step


@triton.jit
def _last_row(i_c, start, end, BT: tl.constexpr, REVERSE: tl.constexpr):
    """The walking row the walk leaves the chunk from."""
    if REVERSE:  # one return, after the static if: Triton checks every return's type
        last = BT - 1
    else:
        last = tl.minimum(end - start - i_c * BT, BT) - 1
    return last


@triton.jit
def _load_gates(a, tok, valid, i_h, offs_k, mask_k, H: tl.constexpr, K: tl.constexpr):
    """Per-key log-decays of rows ``tok``, ``[rows, BK]`` fp32, 0 outside the sequence (no
    decay: the sums below then cover exactly the tokens inside)."""
    return _log_decay(tl.load(a + (tok[:, None] * H + i_h) * K + offs_k[None, :],
                              mask=valid[:, None] & mask_k[None, :], other=0.0))


@triton.jit
def _chunk_decays(a, r, i_c, start, end, row_base, i_h, offs_k, mask_k, H: tl.constexpr, K: tl.constexpr,
                  BT: tl.constexpr, USE_GK: tl.constexpr, REVERSE: tl.constexpr):
    """For the chunk's rows ``r = 0 .. BT - 1``: the log-decay from the chunk's start to each row
    (inclusive: ``G_i``), from each row to the chunk's end (exclusive: ``Gamma - G_j``), and over the
    whole chunk (``Gamma``), each a direct sum, ``[BT, BK]`` and ``[BK]``. The exclusive suffix is
    the reverse cumulative sum of the rows shifted by one, not ``Gamma - G_j``. A scalar gate's
    sums are formed on ``[BT]`` vectors and broadcast along K.

    Every sum is ``tl.cumsum``: exact float32 additions. (Earlier versions formed them as
    products with a triangle of ones on the tensor cores, two TF32 products to keep float32
    accuracy, because ``tl.cumsum`` next to a product failed to compile in the first version of
    these kernels, with Triton 3.6 on the H100. It compiles now, and it is faster: H100 probe,
    bf16, B4 T4096 H16 K=V=128, forward + backward, per-key gate 4.10 -> 4.01 ms, scalar gate
    1.66 -> 1.53; B1 T32768 H8 K=V=64: 3.72 -> 3.69 and 2.11 -> 2.02.)"""
    if USE_GK:
        tok, valid = _rows(r, i_c, start, end, row_base, BT, REVERSE)
        tok1, valid1 = _rows(r + 1, i_c, start, end, row_base, BT, REVERSE)
        b_a = _load_gates(a, tok, valid, i_h, offs_k, mask_k, H, K)
        b_a1 = _load_gates(a, tok1, valid1, i_h, offs_k, mask_k, H, K)
        from_start, to_end = tl.cumsum(b_a, axis=0), tl.cumsum(b_a1, axis=0, reverse=True)
        total = tl.sum(b_a, axis=0)
    else:
        b_a, from_start, to_end = _scalar_decays(a, r, i_c, start, end, row_base, i_h, H, BT, REVERSE)
        along_k = tl.zeros_like(offs_k).to(tl.float32)
        from_start = from_start[:, None] + along_k[None, :]
        to_end = to_end[:, None] + along_k[None, :]
        total = tl.sum(b_a, axis=0) + along_k
    return from_start, to_end, total


@triton.jit
def _scalar_decays(a, r, i_c, start, end, row_base, i_h, H: tl.constexpr, BT: tl.constexpr,
                   REVERSE: tl.constexpr):
    """A scalar gate's log-decays of the chunk's rows ``r`` (``[BT]``, 0 outside the sequence),
    and their direct sums from the chunk's start to each row (inclusive) and from each row to
    the chunk's end (exclusive: the reverse cumulative sum of the rows shifted by one)."""
    tok, valid = _rows(r, i_c, start, end, row_base, BT, REVERSE)
    tok1, valid1 = _rows(r + 1, i_c, start, end, row_base, BT, REVERSE)
    b_a = _log_decay(tl.load(a + tok * H + i_h, mask=valid, other=0.0))
    b_a1 = _log_decay(tl.load(a + tok1 * H + i_h, mask=valid1, other=0.0))
    return b_a, tl.cumsum(b_a, axis=0), tl.cumsum(b_a1, axis=0, reverse=True)


@triton.jit
def _decay_matrix(b_a):
    """The scalar gate's ``[rows, rows]`` decay matrix: ``exp(sum of a over (j, i])``
    for rows i, j, and 0 where ``j > i``. Each sum is a cumulative sum along i of the
    rows after j (``X[s, j] = a_s [s > j]``): direct, never a difference; the masked
    entries are ``exp(-inf) = 0``, never ``inf * 0``."""
    c = tl.arange(0, b_a.shape[0])
    span = tl.cumsum(tl.where(c[:, None] > c[None, :], b_a[:, None], 0.0), axis=0)
    return tl.exp(tl.where(c[:, None] >= c[None, :], span, float("-inf")))


@triton.jit
def _load_rows(ptr, tok, valid, cols, mask_cols, STRIDE: tl.constexpr):
    """A ``[rows, cols]`` tile of a ``[tokens, STRIDE]`` view (head offset already in ``ptr``);
    rows outside the sequence read as 0."""
    return tl.load(ptr + tok[:, None] * STRIDE + cols[None, :], mask=valid[:, None] & mask_cols[None, :],
                   other=0.0)


@triton.jit
def _row_of_each(ptr, j, i_c, start, end, row_base, offs_k, mask_k, STRIDE: tl.constexpr,
                 NC: tl.constexpr, BC: tl.constexpr, BT: tl.constexpr, REVERSE: tl.constexpr):
    """Walking row ``j`` of every sub-chunk, ``[NC, 1, BK]`` fp32 (one row a sub-chunk, to be
    broadcast over its rows): 0 for ``j`` past the sub-chunk or a row outside the sequence."""
    sub = tl.arange(0, NC)[:, None, None]
    tok, valid = _rows(sub * BC + j, i_c, start, end, row_base, BT, REVERSE)
    return tl.load(ptr + tok * STRIDE + offs_k[None, None, :],
                   mask=valid & (j < BC) & mask_k[None, None, :], other=0.0).to(tl.float32)


@triton.jit
def _decay_step(decay, a_row, rows):
    """One token more in the spans of ``rows``: ``decay * exp(a_row)`` there, as it was
    elsewhere.

    The diagonal blocks' decays ``exp(sum of a over (j, i])`` are grown this way, one
    token per step, as running products of factors ``exp(a_s) <= 1``, the factors the
    token-by-token walk multiplies: never above 1, never a difference of sums, and one
    ``exp`` per column a step for all the rows of a sub-chunk (``a_row`` is
    ``[NC, 1, BK]``) instead of one per entry."""
    return tl.where(rows, decay * tl.exp(a_row), decay)


# ----------------------------------------------------------------------------------------------
# Forward kernels.
# ----------------------------------------------------------------------------------------------


@triton.jit
def _gate_sums_kernel(
    a, cu_seqlens, chunk_indices, T, NT_SLOTS, num_seqs,
    to_end, gamma,  # outputs: [B * T, H] and [B * NT_SLOTS, H], fp32
    H: tl.constexpr, HP: tl.constexpr, BT: tl.constexpr, REVERSE: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    # The forward alone, scalar gate: one program per chunk, every head ([BT, HP], a row of a
    # read at once). For each row, the log-decay from it to the chunk's end (exclusive: the
    # reverse cumulative sum of the rows shifted by one, a direct sum as everywhere here), and
    # the whole chunk's, Gamma. The state walk then reads a number a row and one a chunk, and
    # sums nothing: summed inside the walk, the scan and the exponentials sat in every one of its
    # sequential steps (H200, bf16, B1 T32768 H8 K=V=64: _states_kernel 0.75 ms against 0.27
    # with the decays precomputed).
    i_t, i_b = tl.program_id(0), tl.program_id(1)
    i_c, start, end = _chunk_of_program(cu_seqlens, chunk_indices, i_t, T, num_seqs, IS_VARLEN)
    if start + i_c * BT >= end:
        return
    r = tl.arange(0, BT)
    heads = tl.arange(0, HP)
    tok, valid = _rows(r, i_c, start, end, i_b.to(tl.int64) * T, BT, REVERSE)
    tok1, valid1 = _rows(r + 1, i_c, start, end, i_b.to(tl.int64) * T, BT, REVERSE)
    mask_h = heads[None, :] < H
    b_a = _log_decay(tl.load(a + tok[:, None] * H + heads[None, :], mask=valid[:, None] & mask_h, other=0.0))
    b_a1 = _log_decay(tl.load(a + tok1[:, None] * H + heads[None, :], mask=valid1[:, None] & mask_h, other=0.0))
    tl.store(to_end + tok[:, None] * H + heads[None, :], tl.cumsum(b_a1, axis=0, reverse=True),
             mask=valid[:, None] & mask_h)
    tl.store(gamma + (i_b.to(tl.int64) * NT_SLOTS + i_t) * H + heads, tl.sum(b_a, axis=0), mask=heads < H)


@triton.jit
def _states_kernel(
    k, v, decay, chunk_decay, h0, cu_seqlens, chunk_offsets, T, NT_SLOTS, num_seqs,
    # outputs: the state at every chunk's start [B * NT_SLOTS, H, K, V]; final [N * S, H, K, V]
    # (with segments, each segment's own: see SEGMENT)
    states, ht,
    H: tl.constexpr, H_KV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_G: tl.constexpr, DECAY_ROWS: tl.constexpr, HAS_H0: tl.constexpr,
    REVERSE: tl.constexpr, IS_VARLEN: tl.constexpr, F32_DOT: tl.constexpr,
    S: tl.constexpr = 1, SEGMENT: tl.constexpr = 1 << 30,
):
    # One program: a [BK, BV] tile of one query head's state, carried in fp32 through the chunks
    # of one sequence. Each step is one [BK, BT] x [BT, BV] product. USE_G: k is already
    # k exp(Gamma - G), per query head (the attention kernels'), and chunk_decay holds Gamma per
    # chunk slot [B * NT_SLOTS, H, K]. DECAY_ROWS instead (the forward alone, scalar gate): k is
    # the key, decay each row's log-decay to its chunk's end [B * T, H] and chunk_decay Gamma
    # [B * NT_SLOTS, H] (_gate_sums_kernel's), and k's rows are decayed here.
    # S > 1 (the forward alone, few long sequences): the walk is cut into S segments of SEGMENT
    # steps, a program each, all walked at once. A segment other than the first starts from 0,
    # so its states lack the decayed state it was handed; ht gets each segment's last state, and
    # _segments_kernel and _fused_output_kernel add the rest (see _segments_kernel).
    i_v, i_k, i_nhs = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_nh, i_s = i_nhs // S, i_nhs % S
    i_n, i_h = i_nh // H, i_nh % H
    i_kv = i_h // (H // H_KV)
    i_b, start, end, first = _sequence_of_program(cu_seqlens, chunk_offsets, i_n, T, NT_SLOTS, num_seqs,
                                                  IS_VARLEN)
    length = end - start
    num_chunks = tl.cdiv(length, BT)

    # The rows of a chunk are read in memory order: the product sums over them, so their order
    # does not matter (the decays were summed in walking order). Every pointer is the sequence's
    # first row, plus a chunk's offset (one 64-bit number a step), plus offsets within the chunk
    # computed once.
    r = tl.arange(0, BT)
    offs_k = i_k * BK + tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    mask_k, mask_v = offs_k < K, offs_v < V
    mask_h = mask_k[:, None] & mask_v[None, :]
    state_tile = offs_k[:, None] * V + offs_v[None, :]
    seq = i_b.to(tl.int64) * T + start  # the sequence's first token, flat
    if USE_G and not DECAY_ROWS:  # k exp(Gamma - G), per query head
        k_seq = k + (seq * H + i_h) * K
        K_ROW: tl.constexpr = H * K
    else:
        k_seq = k + (seq * H_KV + i_kv) * K
        K_ROW: tl.constexpr = H_KV * K
    v_seq = v + (seq * H_KV + i_kv) * V
    k_tile = r[:, None] * K_ROW + offs_k[None, :]
    v_tile = r[:, None] * (H_KV * V) + offs_v[None, :]
    slots = i_b.to(tl.int64) * NT_SLOTS + first  # the sequence's first chunk slot
    last_slot = i_b.to(tl.int64) * NT_SLOTS + NT_SLOTS - 1  # clamped to it, as every index read

    # The decays are loaded one chunk ahead, into registers: loads this small (a vector) are not
    # pipelined by the compiler, and each would put a memory latency into every step of the walk
    # (H200, bf16, B1 T32768 H8 K=V=64, per-key gate: _states_kernel 0.446 -> 0.274 ms,
    # _state_grads_kernel 0.431 -> 0.290).
    h = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_H0:
        h += tl.load(h0 + (i_n.to(tl.int64) * H + i_h) * K * V + state_tile, mask=mask_h & (i_s == 0), other=0.0)
    lo = i_s * SEGMENT  # this program's steps of the walk: lo .. hi - 1
    hi = tl.minimum(lo + SEGMENT, num_chunks)
    i_c = num_chunks - 1 - lo if REVERSE else lo
    some = lo < hi
    if USE_G:  # Gamma per key column (the attention kernels') or per chunk (DECAY_ROWS)
        b_gamma = _chunk_gamma(chunk_decay, tl.minimum(slots + i_c, last_slot), some, i_h, offs_k, mask_k, H, K,
                               not DECAY_ROWS)
    if DECAY_ROWS:
        b_d = tl.load(decay + (seq + i_c * BT + r) * H + i_h, mask=some & (i_c * BT + r < length), other=0.0)
    for i in range(lo, hi):
        i_c = num_chunks - 1 - i if REVERSE else i
        more = i + 1 < hi
        i_next = tl.where(more, i_c - 1 if REVERSE else i_c + 1, 0)
        slot, slot_next = tl.minimum(slots + i_c, last_slot), tl.minimum(slots + i_next, last_slot)
        tl.store(states + (slot * H + i_h) * K * V + state_tile, h.to(states.dtype.element_ty), mask=mask_h)

        row0 = i_c * BT  # the chunk's first row within the sequence
        valid = row0 + r < length
        b_v = tl.load(v_seq + row0.to(tl.int64) * (H_KV * V) + v_tile, mask=valid[:, None] & mask_v[None, :],
                      other=0.0)
        b_k = tl.load(k_seq + row0.to(tl.int64) * K_ROW + k_tile, mask=valid[:, None] & mask_k[None, :],
                      other=0.0)
        if DECAY_ROWS:
            # k_j exp(Gamma - G_j), rounded to k's dtype as the attention kernel's decayed rows
            # are, and h decays by the whole chunk's Gamma.
            d_next = tl.load(decay + (seq + i_next * BT + r) * H + i_h, mask=more & (i_next * BT + r < length),
                             other=0.0)
            gamma_next = _chunk_gamma(chunk_decay, slot_next, more, i_h, offs_k, mask_k, H, K, False)
            b_k = (b_k.to(tl.float32) * tl.exp(b_d)[:, None]).to(b_k.dtype)
            h = h * tl.exp(b_gamma)
            b_d, b_gamma = d_next, gamma_next
        elif USE_G:
            gamma_next = _chunk_gamma(chunk_decay, slot_next, more, i_h, offs_k, mask_k, H, K, True)
            h = h * tl.exp(b_gamma)[:, None]
            b_gamma = gamma_next
        h += tl.dot(tl.trans(b_k), b_v, input_precision=F32_DOT)

    tl.store(ht + ((i_n.to(tl.int64) * S + i_s) * H + i_h) * K * V + state_tile, h, mask=mask_h)


@triton.jit
def _segment_decay(chunk_decay, slots, i_s, until, num_chunks, i_h, H: tl.constexpr, SEGMENT: tl.constexpr,
                   REVERSE: tl.constexpr):
    """The log-decay over the steps of segment ``i_s`` before step ``until`` (a scalar gate's
    Gamma per chunk slot, ``[B * NT_SLOTS, H]``, from the sequence's first slot ``slots``): one
    direct sum of the chunks' Gammas."""
    step = i_s * SEGMENT + tl.arange(0, SEGMENT)
    chunk = num_chunks - 1 - step if REVERSE else step
    take = (step < until) & (step < num_chunks)
    return tl.sum(tl.load(chunk_decay + (slots + tl.maximum(chunk, 0)) * H + i_h, mask=take, other=0.0))


@triton.jit
def _segments_kernel(
    gamma, seg_final, T,
    seg_start, ht,  # outputs: the state handed to each segment [B * S, H, K, V] fp32; final [B, H, K, V]
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    S: tl.constexpr, SEGMENT: tl.constexpr, USE_G: tl.constexpr, REVERSE: tl.constexpr,
):
    # The walk over segments (no packing: a batch row is one sequence of T tokens). Segment 0's
    # walk started from the initial state, so its last state is the state E_1 handed to segment
    # 1; every later segment s walked from 0, and E_{s+1} = exp(Gamma_s) E_s + F_s, with F_s its
    # last state (seg_final, _states_kernel's ht) and Gamma_s the decay over the whole segment.
    # S steps instead of T / BT. A chunk's state is then its segment's local one plus E_s
    # decayed from the segment's start to the chunk (_fused_output_kernel adds it).
    i_v, i_k, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h = i_bh // H, i_bh % H
    num_chunks = tl.cdiv(T, BT)
    offs_k = i_k * BK + tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    mask_h = (offs_k < K)[:, None] & (offs_v < V)[None, :]
    tile = offs_k[:, None] * V + offs_v[None, :]
    row = i_b.to(tl.int64) * S  # this sequence's first segment
    h = tl.load(seg_final + (row * H + i_h) * K * V + tile, mask=mask_h, other=0.0)
    for i_s in range(1, S):
        tl.store(seg_start + ((row + i_s) * H + i_h) * K * V + tile, h, mask=mask_h)
        if USE_G:
            h *= tl.exp(_segment_decay(gamma, i_b.to(tl.int64) * num_chunks, i_s, (i_s + 1) * SEGMENT,
                                       num_chunks, i_h, H, SEGMENT, REVERSE))
        h += tl.load(seg_final + ((row + i_s) * H + i_h) * K * V + tile, mask=mask_h, other=0.0)
    tl.store(ht + (i_b.to(tl.int64) * H + i_h) * K * V + tile, h, mask=mask_h)


@triton.jit
def _attention_kernel(
    q, k, a, cu_seqlens, chunk_indices, T, NT_SLOTS, num_seqs,
    # outputs: A [B * T, H, BT] (_scores_dtype): row = token, column = walking index of the key
    # in its chunk; with a gate (else 1-element stand-ins), as _gk_attention_kernel's: q exp(G) and
    # k exp(Gamma - G) [B * T, H, K] in the query's dtype, Gamma [B * NT_SLOTS, H, K] fp32
    A, qd, kd, gamma,
    H: tl.constexpr, H_KV: tl.constexpr, K: tl.constexpr, SCALE: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr,
    USE_G: tl.constexpr, REVERSE: tl.constexpr, IS_VARLEN: tl.constexpr, F32_DOT: tl.constexpr,
):
    # Scalar gate or none. One program per chunk: one [BT, BK] x [BK, BT] product per K tile and
    # the decay matrix applied after. With a gate it also writes the decayed q and k and Gamma,
    # as _gk_attention_kernel does: the state walks then multiply precomputed rows instead of
    # summing and exponentiating the gates at every step of their sequential loop (H100, bf16,
    # B1 T32768 H8 K=V=64, 16 programs walking 512 chunks each: _states_kernel 0.78 -> 0.43 ms,
    # the forward 0.92 -> 0.59).
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h, i_kv, i_c, start, end = _head_chunk_of_program(cu_seqlens, chunk_indices, i_t, i_bh, T, num_seqs,
                                                             H, H_KV, IS_VARLEN)
    if start + i_c * BT >= end:
        return
    row_base = i_b.to(tl.int64) * T
    r = tl.arange(0, BT)
    tok, valid = _rows(r, i_c, start, end, row_base, BT, REVERSE)
    if USE_G:  # the log-decays from the chunk's start to i, from j to its end, and over it all
        b_g, from_start, to_end = _scalar_decays(a, r, i_c, start, end, row_base, i_h, H, BT, REVERSE)
        slot = i_b.to(tl.int64) * NT_SLOTS + i_t

    b_a = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(0, tl.cdiv(K, BK)):
        offs_k = i_k * BK + tl.arange(0, BK)
        mask_k = offs_k < K
        b_q = _load_rows(q + i_h * K, tok, valid, offs_k, mask_k, H * K)
        b_k = _load_rows(k + i_kv * K, tok, valid, offs_k, mask_k, H_KV * K)
        b_a += tl.dot(b_q, tl.trans(b_k.to(b_q.dtype)), input_precision=F32_DOT)
        if USE_G:  # rounded to the input dtype, as the states and the output multiply them
            out = (tok[:, None] * H + i_h) * K + offs_k[None, :]
            out_mask = valid[:, None] & mask_k[None, :]
            tl.store(qd + out, (b_q.to(tl.float32) * tl.exp(from_start)[:, None]).to(qd.dtype.element_ty),
                     mask=out_mask)
            tl.store(kd + out, (b_k.to(tl.float32) * tl.exp(to_end)[:, None]).to(kd.dtype.element_ty),
                     mask=out_mask)
            tl.store(gamma + (slot * H + i_h) * K + offs_k, tl.sum(b_g, axis=0) + tl.zeros([BK], tl.float32),
                     mask=mask_k)
    if USE_G:
        b_a *= _decay_matrix(b_g)
    else:
        b_a = tl.where(r[:, None] >= r[None, :], b_a, 0.0)
    tl.store(A + (tok[:, None] * H + i_h) * BT + r[None, :], (b_a * SCALE).to(A.dtype.element_ty),
             mask=valid[:, None])


@triton.jit
def _mild_product(acc, b_qg, b_k, from_start, BF16: tl.constexpr, F32_DOT: tl.constexpr):
    """``acc + (q exp(G)) (k exp(-G))^T`` for rows whose decays are mild (``G`` summed from the
    first row, ``b_qg`` already ``q exp(G)``): _gk_fast_kernel's whole chunk, _gk_diagonal_kernel's
    sub-chunk. The operands: bfloat16 keeps float32's range; float16 may not hold ``k exp(-G)``,
    so its operands stay float32, multiplied as TF32 (float16's mantissa)."""
    b_kg = b_k * tl.exp(-from_start)
    if BF16:
        b_qg, b_kg = b_qg.to(tl.bfloat16), b_kg.to(tl.bfloat16)
    return tl.dot(b_qg, tl.trans(b_kg), acc=acc, input_precision=F32_DOT)


@triton.jit
def _gk_fast_kernel(
    q, k, a, cu_seqlens, chunk_indices, T, NT_SLOTS, num_seqs,
    # outputs, for the chunks it takes (fast = 1): A [B * T, H, BT] whole, q exp(G),
    # k exp(Gamma - G), Gamma, as _gk_attention_kernel and _gk_diagonal_kernel write them
    # together; fast [B * NT_SLOTS, H] int32 for every chunk, 0 where they are to write them
    A, qd, kd, gamma, fast,
    H: tl.constexpr, H_KV: tl.constexpr, K: tl.constexpr, SCALE: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, FAST_DECAY: tl.constexpr,
    REVERSE: tl.constexpr, IS_VARLEN: tl.constexpr, F32_DOT: tl.constexpr,
):
    # Per-key gate, mild chunks (see "Mild gates" in the module docstring). One program per
    # chunk. A first pass over the K tiles sums the chunk's log-decays per key column; if none
    # is below -FAST_DECAY, A is one product per K tile, (q exp(G)) (k exp(-G))^T, lower
    # triangle kept: exp(G_i) <= 1 and exp(-G_j) <= exp(FAST_DECAY), so nothing overflows
    # (entries above the diagonal, dropped, are at most exp(FAST_DECAY) times q_i . k_j).
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h, i_kv, i_c, start, end = _head_chunk_of_program(cu_seqlens, chunk_indices, i_t, i_bh, T, num_seqs,
                                                             H, H_KV, IS_VARLEN)
    slot = i_b.to(tl.int64) * NT_SLOTS + i_t
    if start + i_c * BT >= end:
        return
    # Addresses: the chunk's first walking row as one 64-bit offset, the rows from it in 32 bits
    # (a [BT, BK] tile of 64-bit offsets costs twice the registers and instructions).
    r = tl.arange(0, BT)
    first, step = _first_row(i_c, start, BT, REVERSE)
    rel = r * step  # rows from the first, in tokens
    valid = (first + rel >= start) & (first + rel < end)
    valid1 = (first + rel + step >= start) & (first + rel + step < end) & (r < BT - 1)
    tok0 = i_b.to(tl.int64) * T + first
    q += (tok0 * H + i_h) * K
    k += (tok0 * H_KV + i_kv) * K
    a += (tok0 * H + i_h) * K
    qd += (tok0 * H + i_h) * K
    kd += (tok0 * H + i_h) * K
    A += (tok0 * H + i_h) * BT

    least = 0.0  # the chunk's strongest decay over any key column, as a log
    total = 0.0  # and the sum of every log-decay in it: NaN if any is
    for i_k in range(0, tl.cdiv(K, BK)):
        offs_k = i_k * BK + tl.arange(0, BK)
        column = tl.sum(_load_gates(a, rel, valid, 0, offs_k, offs_k < K, H, K), axis=0)
        least = tl.minimum(least, tl.min(column, axis=0))
        total += tl.sum(column, axis=0)
    # A chunk with a NaN gate is left to the careful kernels, which make NaN exactly the
    # entries whose span holds it.
    take = (least >= -FAST_DECAY) & (total == total)
    tl.store(fast + slot * H + i_h, take.to(tl.int32))
    if take:
        b_A = tl.zeros([BT, BT], dtype=tl.float32)
        for i_k in range(0, tl.cdiv(K, BK)):
            offs_k = i_k * BK + tl.arange(0, BK)
            mask_k = offs_k < K
            b_q = _load_rows(q, rel, valid, offs_k, mask_k, H * K).to(tl.float32)
            b_k = _load_rows(k, rel, valid, offs_k, mask_k, H_KV * K).to(tl.float32)
            b_a = _load_gates(a, rel, valid, 0, offs_k, mask_k, H, K)
            b_a1 = _load_gates(a, rel + step, valid1, 0, offs_k, mask_k, H, K)
            # Direct sums, as _chunk_decays': from the chunk's start to i, from j to its end.
            from_start = tl.cumsum(b_a, axis=0)
            b_qg = b_q * tl.exp(from_start)
            out = rel[:, None] * (H * K) + offs_k[None, :]
            out_mask = valid[:, None] & mask_k[None, :]
            tl.store(qd + out, b_qg.to(qd.dtype.element_ty), mask=out_mask)
            tl.store(kd + out, (b_k * tl.exp(tl.cumsum(b_a1, axis=0, reverse=True))).to(kd.dtype.element_ty),
                     mask=out_mask)
            tl.store(gamma + (slot * H + i_h) * K + offs_k, tl.sum(b_a, axis=0), mask=mask_k)
            b_A = _mild_product(b_A, b_qg, b_k, from_start, q.dtype.element_ty == tl.bfloat16, F32_DOT)
        b_A = tl.where(r[:, None] >= r[None, :], b_A, 0.0)
        tl.store(A + rel[:, None] * (H * BT) + r[None, :], (b_A * SCALE).to(A.dtype.element_ty),
                 mask=valid[:, None])


@triton.jit
def _gk_attention_kernel(
    q, k, a, cu_seqlens, chunk_indices, T, NT_SLOTS, num_seqs,
    fast,  # [B * NT_SLOTS, H] int32: chunks _gk_fast_kernel took (USE_FAST), skipped
    # outputs (aliased, as _gk_fast_kernel left them, with USE_FAST): A [B * T, H, BT]
    # as _attention_kernel's, but for its diagonal sub-chunk blocks (_gk_diagonal_kernel's);
    # q exp(G) and k exp(Gamma - G) [B * T, H, K] in the query's dtype; Gamma
    # [B * NT_SLOTS, H, K] fp32
    A_in, qd_in, kd_in, gamma_in, A, qd, kd, gamma,
    H: tl.constexpr, H_KV: tl.constexpr, K: tl.constexpr, SCALE: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, USE_FAST: tl.constexpr,
    REVERSE: tl.constexpr, IS_VARLEN: tl.constexpr, F32_DOT: tl.constexpr,
):
    # Per-key gate. One program per chunk, every sub-chunk of it, a loop over K tiles: the blocks
    # of A between sub-chunks, tensor-core products. The sums of a also give the chunk-level
    # decays the states and the output need, so it writes the decayed q and k and Gamma for
    # them: they then read neither the gates nor sum anything.
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h, i_kv, i_c, start, end = _head_chunk_of_program(cu_seqlens, chunk_indices, i_t, i_bh, T, num_seqs,
                                                             H, H_KV, IS_VARLEN)
    if start + i_c * BT >= end:
        return
    if USE_FAST:
        if tl.load(fast + (i_b.to(tl.int64) * NT_SLOTS + i_t) * H + i_h) != 0:
            return
    row_base = i_b.to(tl.int64) * T
    NC: tl.constexpr = BT // BC
    r = tl.arange(0, BT)
    sub, local = r // BC, r % BC  # each row's sub-chunk, and its row within it
    tok, valid = _rows(r, i_c, start, end, row_base, BT, REVERSE)
    tok1, valid1 = _rows(r + 1, i_c, start, end, row_base, BT, REVERSE)
    valid1 = valid1 & (local < BC - 1)  # the next row, within the sub-chunk

    b_off = tl.zeros([BT, BT], dtype=tl.float32)  # blocks of earlier sub-chunks
    dtype = q.dtype.element_ty
    for i_k in range(0, tl.cdiv(K, BK)):
        offs_k = i_k * BK + tl.arange(0, BK)
        mask_k = offs_k < K
        b_q = _load_rows(q + i_h * K, tok, valid, offs_k, mask_k, H * K).to(tl.float32)
        b_k = _load_rows(k + i_kv * K, tok, valid, offs_k, mask_k, H_KV * K).to(tl.float32)
        b_a = _load_gates(a, tok, valid, i_h, offs_k, mask_k, H, K)
        # Within each sub-chunk, as [NC, BC, BK]: the log-decay from its start to i (from_sub),
        # and from j (exclusive) to its end (after, the reverse cumulative sum of the rows
        # shifted by one): direct sums, never a difference.
        from_sub = tl.reshape(tl.cumsum(tl.reshape(b_a, (NC, BC, BK)), axis=1), (BT, BK))
        b_a1 = _load_gates(a, tok1, valid1, i_h, offs_k, mask_k, H, K)
        after = tl.reshape(tl.cumsum(tl.reshape(b_a1, (NC, BC, BK)), axis=1, reverse=True),
                           (BT, BK))

        # Queries in sub-chunk I, keys in an earlier J, b the boundary before I:
        # exp(G_i - G_b) exp(G_b - G_j), both factors <= 1. The first is the sum from I's start
        # to i (from_sub); the second the sum from j to its sub-chunk's end (after) plus the whole
        # of every sub-chunk between J and I, added one sub-chunk at a time as I moves on: sums
        # of log-decays <= 0. The same walk adds up, for each row, the sub-chunks before its own
        # (before).
        before = tl.zeros([BT, BK], dtype=tl.float32)
        if NC > 1:
            b_qg = b_q * tl.exp(from_sub)
            for i_ci in tl.static_range(1, NC):
                passed = tl.sum(tl.where((sub == i_ci - 1)[:, None], b_a, 0.0), axis=0)
                after = tl.where((sub < i_ci - 1)[:, None], after + passed[None, :], after)
                before = tl.where((sub >= i_ci)[:, None], before + passed[None, :], before)
                # Operands rounded to the input dtype, as the states' and the output's are.
                b_kg = tl.where((sub < i_ci)[:, None], b_k * tl.exp(after), 0.0).to(dtype)
                b_qi = tl.where((sub == i_ci)[:, None], b_qg, 0.0).to(dtype)  # I's rows only
                b_off = tl.dot(b_qi, tl.trans(b_kg), acc=b_off, input_precision=F32_DOT)
            passed = tl.sum(tl.where((sub == NC - 1)[:, None], b_a, 0.0), axis=0)
            after = tl.where((sub < NC - 1)[:, None], after + passed[None, :], after)
        # From the chunk's start to i, and from j to the chunk's end: q exp(G), k exp(Gamma - G),
        # rounded to the input dtype, as the states and the output multiply them.
        out = (tok[:, None] * H + i_h) * K + offs_k[None, :]
        out_mask = valid[:, None] & mask_k[None, :]
        tl.store(qd + out, (b_q * tl.exp(from_sub + before)).to(qd.dtype.element_ty), mask=out_mask)
        tl.store(kd + out, (b_k * tl.exp(after)).to(kd.dtype.element_ty), mask=out_mask)
        slot = i_b.to(tl.int64) * NT_SLOTS + i_t
        tl.store(gamma + (slot * H + i_h) * K + offs_k, tl.sum(b_a, axis=0), mask=mask_k)

    # Later sub-chunks are zero (A is lower-triangular in walking order), as b_off holds them.
    tl.store(A + (tok[:, None] * H + i_h) * BT + r[None, :], (b_off * SCALE).to(A.dtype.element_ty),
             mask=valid[:, None] & (sub[:, None] != sub[None, :]))


@triton.jit
def _gk_diagonal_kernel(
    q, k, a, cu_seqlens, chunk_indices, T, NT_SLOTS, num_seqs,
    fast,  # as _gk_attention_kernel's: chunks _gk_fast_kernel took, skipped
    A_in, A,  # A (aliased, from _gk_attention_kernel): its diagonal sub-chunk blocks written here
    H: tl.constexpr, H_KV: tl.constexpr, K: tl.constexpr, SCALE: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, UNROLL: tl.constexpr,
    USE_FAST: tl.constexpr, REVERSE: tl.constexpr, IS_VARLEN: tl.constexpr,
    FAST_DECAY: tl.constexpr = None, F32_DOT: tl.constexpr = "ieee",
):
    # Per-key gate. One program per sub-chunk: its [BC, BC] block of A, one key column j at a
    # time from the last; decay holds exp(sum of a over (j, i]) for the rows i > j (1 for the
    # others), grown by the row after j at each step (_decay_step). Small tiles, a program
    # each: many programs in flight hide the latency of the walk's row loads.
    # FAST_DECAY (16-bit inputs; None: never): a K tile in which no key column of the
    # sub-chunk decays by more than exp(-FAST_DECAY) takes one product instead of the walk,
    # (q exp(G)) (k exp(-G))^T with G summed from the sub-chunk's first row, as _gk_fast_kernel
    # does for a whole chunk: the chunk's decay may be strong while its sub-chunks' are mild.
    i_tc, i_bh = tl.program_id(0), tl.program_id(1)
    NC: tl.constexpr = BT // BC
    i_t, i_s = i_tc // NC, i_tc % NC
    i_b, i_h, i_kv, i_c, start, end = _head_chunk_of_program(cu_seqlens, chunk_indices, i_t, i_bh, T, num_seqs,
                                                             H, H_KV, IS_VARLEN)
    if start + i_c * BT >= end:
        return
    if USE_FAST:
        if tl.load(fast + (i_b.to(tl.int64) * NT_SLOTS + i_t) * H + i_h) != 0:
            return
    row_base = i_b.to(tl.int64) * T
    c = tl.arange(0, BC)
    tok, valid = _rows(i_s * BC + c, i_c, start, end, row_base, BT, REVERSE)

    b_d = tl.zeros([BC, BC], dtype=tl.float32)
    for i_k in range(0, tl.cdiv(K, BK)):
        offs_k = i_k * BK + tl.arange(0, BK)
        mask_k = offs_k < K
        b_q = _load_rows(q + i_h * K, tok, valid, offs_k, mask_k, H * K).to(tl.float32)
        # Two levels: a Python bool assigned to a variable is a tensor to Triton, so an `if` on
        # it compiles both branches, and the product's would read gates never loaded where
        # FAST_DECAY is None.
        if FAST_DECAY is None:
            b_d = _diagonal_walk(b_d, b_q, k, a, c, i_s, i_c, i_h, i_kv, start, end, row_base, offs_k, mask_k,
                                 H, H_KV, K, BT, BC, BK, UNROLL, REVERSE)
        else:
            b_a = _load_gates(a, tok, valid, i_h, offs_k, mask_k, H, K)
            column = tl.sum(b_a, axis=0)
            total = tl.sum(column, axis=0)  # NaN if a gate is: the walk makes NaN exactly
            if (tl.min(column, axis=0) >= -FAST_DECAY) & (total == total):
                b_k = _load_rows(k + i_kv * K, tok, valid, offs_k, mask_k, H_KV * K).to(tl.float32)
                from_first = tl.cumsum(b_a, axis=0)  # exp(G_i - G_j): the decay over (j, i]
                b_d = _mild_product(b_d, b_q * tl.exp(from_first), b_k, from_first,
                                    q.dtype.element_ty == tl.bfloat16, F32_DOT)
            else:
                b_d = _diagonal_walk(b_d, b_q, k, a, c, i_s, i_c, i_h, i_kv, start, end, row_base, offs_k,
                                     mask_k, H, H_KV, K, BT, BC, BK, UNROLL, REVERSE)
    tl.store(A + (tok[:, None] * H + i_h) * BT + i_s * BC + c[None, :],
             (tl.where(c[None, :] <= c[:, None], b_d, 0.0) * SCALE).to(A.dtype.element_ty),
             mask=valid[:, None])


@triton.jit
def _diagonal_walk(b_d, b_q, k, a, c, i_s, i_c, i_h, i_kv, start, end, row_base, offs_k, mask_k,
                   H: tl.constexpr, H_KV: tl.constexpr, K: tl.constexpr, BT: tl.constexpr, BC: tl.constexpr,
                   BK: tl.constexpr, UNROLL: tl.constexpr, REVERSE: tl.constexpr):
    """_gk_diagonal_kernel's walk over one K tile: ``b_d`` plus the sub-chunk's ``[BC, BC]``
    block, one key column at a time, each decay a running product of factors at most 1."""
    decay = tl.full([BC, BK], 1.0, tl.float32)
    for j0 in range(0, BC, UNROLL):
        for u in tl.static_range(UNROLL):
            j = BC - 1 - (j0 + u)
            tok_n, valid_n = _rows(i_s * BC + j + 1, i_c, start, end, row_base, BT, REVERSE)
            a_next = _log_decay(tl.load(a + (tok_n * H + i_h) * K + offs_k,
                                        mask=mask_k & valid_n & (j + 1 < BC), other=0.0))
            decay = _decay_step(decay, a_next[None, :], (c > j)[:, None])
            tok_j, valid_j = _rows(i_s * BC + j, i_c, start, end, row_base, BT, REVERSE)
            k_j = tl.load(k + (tok_j * H_KV + i_kv) * K + offs_k, mask=mask_k & valid_j,
                          other=0.0).to(tl.float32)
            b_d += tl.where(c[None, :] == j, tl.sum(b_q * k_j[None, :] * decay, axis=1)[:, None], 0.0)
    return b_d


@triton.jit
def _output_kernel(
    q, v, states, A, cu_seqlens, chunk_indices, T, NT_SLOTS, num_seqs,
    o,  # output [B * T, H, V] in the query's dtype
    H: tl.constexpr, H_KV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, SCALE: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    REVERSE: tl.constexpr, IS_VARLEN: tl.constexpr, F32_DOT: tl.constexpr,
):
    # One program: a [BT, BV] tile of the output of one chunk: o = scale (q exp(G)) H + A v,
    # q already q exp(G) with a gate (the attention kernels').
    i_v, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h, i_kv, i_c, start, end = _head_chunk_of_program(cu_seqlens, chunk_indices, i_t, i_bh, T, num_seqs,
                                                             H, H_KV, IS_VARLEN)
    if start + i_c * BT >= end:
        return
    row_base = i_b.to(tl.int64) * T
    r = tl.arange(0, BT)
    tok, valid = _rows(r, i_c, start, end, row_base, BT, REVERSE)
    offs_v = i_v * BV + tl.arange(0, BV)
    mask_v = offs_v < V
    slot = i_b.to(tl.int64) * NT_SLOTS + i_t
    h_base = states + (slot * H + i_h) * K * V

    b_o = tl.zeros([BT, BV], dtype=tl.float32)
    for i_k in range(0, tl.cdiv(K, BK)):
        offs_k = i_k * BK + tl.arange(0, BK)
        mask_k = offs_k < K
        b_q = _load_rows(q + i_h * K, tok, valid, offs_k, mask_k, H * K)
        b_h = tl.load(h_base + offs_k[:, None] * V + offs_v[None, :], mask=mask_k[:, None] & mask_v[None, :],
                      other=0.0)
        b_o += tl.dot(b_q, b_h.to(b_q.dtype), input_precision=F32_DOT)
    b_o *= SCALE
    b_a = _load_rows(A + i_h * BT, tok, valid, r, r < BT, H * BT)
    b_v = _load_rows(v + i_kv * V, tok, valid, offs_v, mask_v, H_KV * V)
    b_o += tl.dot(b_a.to(b_v.dtype), b_v, input_precision=F32_DOT)
    tl.store(o + (tok[:, None] * H + i_h) * V + offs_v[None, :], b_o.to(o.dtype.element_ty),
             mask=valid[:, None] & mask_v[None, :])


@triton.jit
def _fused_output_kernel(
    q, k, v, a, states, cu_seqlens, chunk_indices, T, NT_SLOTS, num_seqs,
    chunk_decay, seg_start,  # with S > 1: Gamma per chunk slot [B * NT_SLOTS, H]; _segments_kernel's
    o,  # output [B * T, H, V] in the query's dtype
    H: tl.constexpr, H_KV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, SCALE: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_G: tl.constexpr, REVERSE: tl.constexpr, IS_VARLEN: tl.constexpr, F32_DOT: tl.constexpr,
    S: tl.constexpr = 1, SEGMENT: tl.constexpr = 1 << 30,
):
    # The forward alone (no gradient asked), scalar gate or none: one program computes a [BT, BV]
    # tile of one chunk's output from the inputs and the chunk's state, with nothing kept for a
    # backward: o = scale (exp(G) * (q H) + ((q k^T) * D) v). A scalar gate's exp(G_i) scales a
    # whole row, so it multiplies q H after the product (no decayed copy of q is written), and D
    # is _decay_matrix. q k^T is recomputed for every V tile (one tile at V <= BV).
    i_v, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h, i_kv, i_c, start, end = _head_chunk_of_program(cu_seqlens, chunk_indices, i_t, i_bh, T, num_seqs,
                                                             H, H_KV, IS_VARLEN)
    if start + i_c * BT >= end:
        return
    # Walking row r is token first + r * step: one 64-bit base a chunk, 32-bit offsets from it.
    first, step = _first_row(i_c, start, BT, REVERSE)
    r = tl.arange(0, BT)
    pos = first + r * step
    valid = (pos >= start) & (pos < end)
    row = (r * step)[:, None]
    base = i_b.to(tl.int64) * T + first
    offs_v = i_v * BV + tl.arange(0, BV)
    mask_v = offs_v < V
    slot = i_b.to(tl.int64) * NT_SLOTS + i_t
    h_base = states + (slot * H + i_h) * K * V
    if S > 1:  # a segmented walk (no packing): the state handed to this chunk's segment, decayed
        w = NT_SLOTS - 1 - i_c if REVERSE else i_c  # the step of the walk that reached this chunk
        i_s = w // SEGMENT
        handed = i_s > 0  # segment 0 started from the initial state: its states are whole
        e_base = seg_start + ((i_b.to(tl.int64) * S + i_s) * H + i_h) * K * V
        e_decay = 0.0
        if USE_G:
            e_decay = _segment_decay(chunk_decay, i_b.to(tl.int64) * NT_SLOTS, i_s, w, NT_SLOTS, i_h, H, SEGMENT,
                                     REVERSE)

    b_o = tl.zeros([BT, BV], dtype=tl.float32)
    b_s = tl.zeros([BT, BT], dtype=tl.float32)
    for i_k in range(0, tl.cdiv(K, BK)):
        offs_k = i_k * BK + tl.arange(0, BK)
        mask_k = offs_k < K
        mask_qk = valid[:, None] & mask_k[None, :]
        b_q = tl.load(q + (base * H + i_h) * K + row * (H * K) + offs_k[None, :], mask=mask_qk, other=0.0)
        b_k = tl.load(k + (base * H_KV + i_kv) * K + row * (H_KV * K) + offs_k[None, :], mask=mask_qk,
                      other=0.0)
        b_h = tl.load(h_base + offs_k[:, None] * V + offs_v[None, :], mask=mask_k[:, None] & mask_v[None, :],
                      other=0.0)
        if S > 1:
            b_e = tl.load(e_base + offs_k[:, None] * V + offs_v[None, :],
                          mask=handed & mask_k[:, None] & mask_v[None, :], other=0.0)
            b_h = b_h.to(tl.float32) + tl.exp(e_decay) * b_e
        b_o += tl.dot(b_q, b_h.to(b_q.dtype), input_precision=F32_DOT)
        b_s += tl.dot(b_q, tl.trans(b_k.to(b_q.dtype)), input_precision=F32_DOT)
    if USE_G:
        b_g = _log_decay(tl.load(a + base * H + i_h + r * step * H, mask=valid, other=0.0))
        b_o *= tl.exp(tl.cumsum(b_g, axis=0))[:, None]
        b_s *= _decay_matrix(b_g)
    else:
        b_s = tl.where(r[:, None] >= r[None, :], b_s, 0.0)
    b_v = tl.load(v + (base * H_KV + i_kv) * V + row * (H_KV * V) + offs_v[None, :],
                  mask=valid[:, None] & mask_v[None, :], other=0.0)
    b_o = b_o * SCALE + tl.dot((b_s * SCALE).to(b_v.dtype), b_v, input_precision=F32_DOT)
    tl.store(o + (base * H + i_h) * V + row * (H * V) + offs_v[None, :], b_o.to(o.dtype.element_ty),
             mask=valid[:, None] & mask_v[None, :])


# ----------------------------------------------------------------------------------------------
# Backward kernels.
# ----------------------------------------------------------------------------------------------


@triton.jit
def _state_grads_kernel(
    q, do, a, dht, cu_seqlens, chunk_offsets, T, NT_SLOTS, num_seqs,
    dstates, dh0,  # outputs: D (gradient of the state after each chunk); d initial_state
    H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, SCALE: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_G: tl.constexpr, HAS_DHT: tl.constexpr, HAS_H0: tl.constexpr,
    REVERSE: tl.constexpr, IS_VARLEN: tl.constexpr, F32_DOT: tl.constexpr,
):
    # The walk of _states_kernel run backwards: dH = exp(Gamma) dH + (scale q exp(G))^T do.
    # USE_G: q is already q exp(G) and a holds Gamma per chunk slot (the attention kernels').
    i_v, i_k, i_nh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_n, i_h = i_nh // H, i_nh % H
    i_b, start, end, first = _sequence_of_program(cu_seqlens, chunk_offsets, i_n, T, NT_SLOTS, num_seqs,
                                                  IS_VARLEN)
    row_base = i_b.to(tl.int64) * T
    num_chunks = tl.cdiv(end - start, BT)

    r = tl.arange(0, BT)
    offs_k = i_k * BK + tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    mask_k, mask_v = offs_k < K, offs_v < V
    mask_h = mask_k[:, None] & mask_v[None, :]
    state_tile = offs_k[:, None] * V + offs_v[None, :]

    dh = tl.zeros([BK, BV], dtype=tl.float32)
    if HAS_DHT:
        dh += tl.load(dht + (i_n.to(tl.int64) * H + i_h) * K * V + state_tile, mask=mask_h, other=0.0)
    slots = i_b.to(tl.int64) * NT_SLOTS + first  # the sequence's first chunk slot
    last_slot = i_b.to(tl.int64) * NT_SLOTS + NT_SLOTS - 1  # clamped to it, as every index read
    if USE_G:  # Gamma one chunk ahead, as in _states_kernel
        i_c = 0 if REVERSE else num_chunks - 1
        b_gamma = _chunk_gamma(a, tl.minimum(slots + i_c, last_slot), num_chunks > 0, i_h, offs_k, mask_k, H, K,
                               True)
    for i in range(0, num_chunks):
        i_c = i if REVERSE else num_chunks - 1 - i
        slot = tl.minimum(slots + i_c, last_slot)
        tl.store(dstates + (slot * H + i_h) * K * V + state_tile, dh.to(dstates.dtype.element_ty),
                 mask=mask_h)

        tok, valid = _rows(r, i_c, start, end, row_base, BT, REVERSE)
        b_q = _load_rows(q + i_h * K, tok, valid, offs_k, mask_k, H * K)
        b_do = _load_rows(do + i_h * V, tok, valid, offs_v, mask_v, H * V)
        if USE_G:
            more = i + 1 < num_chunks
            i_next = tl.where(more, i_c + 1 if REVERSE else i_c - 1, 0)
            gamma_next = _chunk_gamma(a, tl.minimum(slots + i_next, last_slot), more, i_h, offs_k, mask_k, H, K,
                                      True)
            dh = dh * tl.exp(b_gamma)[:, None]
            b_gamma = gamma_next
        dh += SCALE * tl.dot(tl.trans(b_q), b_do.to(b_q.dtype), input_precision=F32_DOT)

    if HAS_H0:
        tl.store(dh0 + (i_n.to(tl.int64) * H + i_h) * K * V + state_tile, dh, mask=mask_h)


@triton.jit
def _dA_kernel(
    v, do, A, cu_seqlens, chunk_indices, T, num_seqs,
    dA, dg_intra,  # outputs: dA [B * T, H, BT] fp32; the scalar gate's intra-chunk dG [B * T, H]
    H: tl.constexpr, H_KV: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BV: tl.constexpr,
    SCALAR_GATE: tl.constexpr, REVERSE: tl.constexpr, IS_VARLEN: tl.constexpr, F32_DOT: tl.constexpr,
):
    # dA_ij = do_i . v_j for j <= i (walking order), summed over V tiles.
    i_t, i_bh = tl.program_id(0), tl.program_id(1)
    i_b, i_h, i_kv, i_c, start, end = _head_chunk_of_program(cu_seqlens, chunk_indices, i_t, i_bh, T, num_seqs,
                                                             H, H_KV, IS_VARLEN)
    if start + i_c * BT >= end:
        return
    row_base = i_b.to(tl.int64) * T
    r = tl.arange(0, BT)
    tok, valid = _rows(r, i_c, start, end, row_base, BT, REVERSE)

    b_da = tl.zeros([BT, BT], dtype=tl.float32)
    for i_v in range(0, tl.cdiv(V, BV)):
        offs_v = i_v * BV + tl.arange(0, BV)
        mask_v = offs_v < V
        b_do = _load_rows(do + i_h * V, tok, valid, offs_v, mask_v, H * V)
        b_v = _load_rows(v + i_kv * V, tok, valid, offs_v, mask_v, H_KV * V)
        b_da += tl.dot(b_do, tl.trans(b_v.to(b_do.dtype)), input_precision=F32_DOT)
    b_da = tl.where(r[:, None] >= r[None, :], b_da, 0.0)
    tl.store(dA + (tok[:, None] * H + i_h) * BT + r[None, :], b_da, mask=valid[:, None])
    if SCALAR_GATE:
        # A_ij depends on G_i - G_j only: dG_i gets +dA_ij A_ij as a query and -dA_ji A_ji as a key.
        # The diagonal (exponent 0) cancels exactly and is left out.
        b_a = _load_rows(A + i_h * BT, tok, valid, r, r < BT, H * BT)
        m = tl.where(r[:, None] > r[None, :], b_da * b_a, 0.0)
        tl.store(dg_intra + tok * H + i_h, tl.sum(m, axis=1) - tl.sum(m, axis=0), mask=valid)


@triton.jit
def _gk_fast_grads_kernel(
    q, k, a, dA, cu_seqlens, chunk_indices, T, NT_SLOTS, num_seqs,
    fast,  # [B * NT_SLOTS, H] int32: the chunks the forward's _gk_fast_kernel took
    dq, dk, dg,  # outputs [B * T, H, K] fp32, as _intra_grads_kernel's, for those chunks
    H: tl.constexpr, H_KV: tl.constexpr, K: tl.constexpr, SCALE: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr,
    REVERSE: tl.constexpr, IS_VARLEN: tl.constexpr, F32_DOT: tl.constexpr,
):
    # Per-key gate, mild chunks: _intra_grads_kernel's sums as two products through exp(G) and
    # exp(-G), as _gk_fast_kernel formed A (the same bound holds: the forward decided):
    #     dq~ = exp(G) * ((dA below the diagonal) (k exp(-G)))
    #     dk~ = exp(-G) * ((dA below the diagonal)^T (scale q exp(G)))
    # One program: one chunk, one K tile.
    i_k, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h, i_kv, i_c, start, end = _head_chunk_of_program(cu_seqlens, chunk_indices, i_t, i_bh, T, num_seqs,
                                                             H, H_KV, IS_VARLEN)
    if start + i_c * BT >= end:
        return
    if tl.load(fast + (i_b.to(tl.int64) * NT_SLOTS + i_t) * H + i_h) == 0:
        return
    r = tl.arange(0, BT)
    first, step = _first_row(i_c, start, BT, REVERSE)
    rel = r * step
    valid = (first + rel >= start) & (first + rel < end)
    tok0 = i_b.to(tl.int64) * T + first  # addresses as _gk_fast_kernel's
    offs_k = i_k * BK + tl.arange(0, BK)
    mask_k = offs_k < K

    b_q = _load_rows(q + (tok0 * H + i_h) * K, rel, valid, offs_k, mask_k, H * K).to(tl.float32) * SCALE
    b_k = _load_rows(k + (tok0 * H_KV + i_kv) * K, rel, valid, offs_k, mask_k, H_KV * K).to(tl.float32)
    b_a = _load_gates(a + (tok0 * H + i_h) * K, rel, valid, 0, offs_k, mask_k, H, K)
    b_da = tl.load(dA + (tok0 * H + i_h) * BT + rel[:, None] * (H * BT) + r[None, :], mask=valid[:, None],
                   other=0.0)
    from_start = tl.cumsum(b_a, axis=0)
    to_query, to_key = tl.exp(from_start), tl.exp(-from_start)
    below = tl.where(r[:, None] > r[None, :], b_da, 0.0)
    b_qg, b_kg = b_q * to_query, b_k * to_key
    if q.dtype.element_ty == tl.bfloat16:  # operands as _gk_fast_kernel's
        below, b_qg, b_kg = below.to(tl.bfloat16), b_qg.to(tl.bfloat16), b_kg.to(tl.bfloat16)
    b_dq = tl.dot(below, b_kg, input_precision=F32_DOT) * to_query
    b_dk = tl.dot(tl.trans(below), b_qg, input_precision=F32_DOT) * to_key
    # dG from the terms that depend on the gates; then the diagonal dA_ii, as _intra_grads_kernel.
    b_dg = b_q * b_dq - b_k * b_dk
    diag = tl.sum(tl.where(r[:, None] == r[None, :], b_da, 0.0), axis=1)
    b_dq += diag[:, None] * b_k
    b_dk += diag[:, None] * b_q
    out = (tok0 * H + i_h) * K + rel[:, None] * (H * K) + offs_k[None, :]
    out_mask = valid[:, None] & mask_k[None, :]
    tl.store(dq + out, b_dq, mask=out_mask)
    tl.store(dk + out, b_dk, mask=out_mask)
    tl.store(dg + out, b_dg, mask=out_mask)


@triton.jit
def _intra_grads_kernel(
    q, k, a, dA, cu_seqlens, chunk_indices, T, NT_SLOTS, num_seqs,
    fast,  # with USE_FAST: chunks _gk_fast_grads_kernel took, skipped
    # outputs [B * T, H, K] fp32: intra-chunk dq~ (w.r.t. scale q), dk, dG (aliased, as
    # _gk_fast_grads_kernel left them, with USE_FAST)
    dq_in, dk_in, dg_in, dq, dk, dg,
    H: tl.constexpr, H_KV: tl.constexpr, K: tl.constexpr, SCALE: tl.constexpr,
    BT: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, UNROLL: tl.constexpr,
    USE_FAST: tl.constexpr, REVERSE: tl.constexpr, IS_VARLEN: tl.constexpr, F32_DOT: tl.constexpr,
):
    # Per-key gates only. One program: one chunk (every sub-chunk), one K tile; the decays are
    # formed as in _gk_attention_kernel. Token i as a query sees keys j <= i; as a key, queries
    # after it.
    i_k, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    NC: tl.constexpr = BT // BC
    i_b, i_h, i_kv, i_c, start, end = _head_chunk_of_program(cu_seqlens, chunk_indices, i_t, i_bh, T, num_seqs,
                                                             H, H_KV, IS_VARLEN)
    if start + i_c * BT >= end:
        return
    if USE_FAST:
        if tl.load(fast + (i_b.to(tl.int64) * NT_SLOTS + i_t) * H + i_h) != 0:
            return
    row_base = i_b.to(tl.int64) * T
    r = tl.arange(0, BT)
    sub, local = r // BC, r % BC
    tok, valid = _rows(r, i_c, start, end, row_base, BT, REVERSE)
    sub3 = tl.arange(0, NC)[:, None, None]
    local3 = tl.arange(0, BC)[None, :, None]
    tok3, valid3 = _rows(sub3 * BC + local3, i_c, start, end, row_base, BT, REVERSE)
    offs_k = i_k * BK + tl.arange(0, BK)
    mask_k = offs_k < K

    # The whole tiles first: the walks' loads of single rows then find them in L1.
    b_q = _load_rows(q + i_h * K, tok, valid, offs_k, mask_k, H * K).to(tl.float32) * SCALE
    b_k = _load_rows(k + i_kv * K, tok, valid, offs_k, mask_k, H_KV * K).to(tl.float32)
    b_a = _load_gates(a, tok, valid, i_h, offs_k, mask_k, H, K)
    b_da = tl.load(dA + (tok * H + i_h)[:, None] * BT + r[None, :], mask=valid[:, None], other=0.0)

    # The diagonal blocks, strictly below the diagonal, as [NC, BC, BK] tiles (a sub-chunk
    # each). dq~_i += dA_ij k_j exp(sum of a over (j, i]) for j < i: one column j of every
    # sub-chunk at a time from the last, the decays grown as in _gk_attention_kernel.
    # The same steps add up from_sub and after, as _gk_attention_kernel's.
    da3_rows = dA + (tok3 * H + i_h) * BT + sub3 * BC  # [NC, BC, 1]: the row's diagonal block
    dq3 = tl.zeros([NC, BC, BK], dtype=tl.float32)
    decay = tl.full([NC, BC, BK], 1.0, tl.float32)
    from_sub = tl.zeros([NC, BC, BK], dtype=tl.float32)
    after = tl.zeros([NC, BC, BK], dtype=tl.float32)
    run = tl.zeros([NC, 1, BK], dtype=tl.float32)
    for j0 in range(0, BC, UNROLL):
        for u in tl.static_range(UNROLL):
            j = BC - 1 - (j0 + u)
            a_next = _log_decay(_row_of_each(a + i_h * K, j + 1, i_c, start, end, row_base, offs_k, mask_k,
                                             H * K, NC, BC, BT, REVERSE))
            decay = _decay_step(decay, a_next, local3 > j)
            from_sub += tl.where(local3 > j, a_next, 0.0)
            run += a_next
            after = tl.where(local3 == j, run, after)
            k_j = _row_of_each(k + i_kv * K, j, i_c, start, end, row_base, offs_k, mask_k, H_KV * K,
                               NC, BC, BT, REVERSE)
            da_j = tl.load(da3_rows + j, mask=valid3 & (local3 > j), other=0.0)  # dA_ij, j < i
            dq3 += da_j * k_j * decay
    # dk_j += sum_{i > j} dA_ij scale q_i exp(sum of a over (j, i]): the same decays walked the
    # other way, one row i of every sub-chunk at a time from the first, the rows j < i taking
    # the token i each step.
    dk3 = tl.zeros([NC, BC, BK], dtype=tl.float32)
    decay = tl.full([NC, BC, BK], 1.0, tl.float32)
    for i0 in range(0, BC, UNROLL):
        for u in tl.static_range(UNROLL):
            i = i0 + u
            a_i = _log_decay(_row_of_each(a + i_h * K, i, i_c, start, end, row_base, offs_k, mask_k, H * K,
                                          NC, BC, BT, REVERSE))
            decay = _decay_step(decay, a_i, local3 < i)
            q_i = _row_of_each(q + i_h * K, i, i_c, start, end, row_base, offs_k, mask_k, H * K,
                               NC, BC, BT, REVERSE) * SCALE
            tok_i, valid_i = _rows(sub3 * BC + i, i_c, start, end, row_base, BT, REVERSE)
            # dA_ij: row i of each sub-chunk, the column of row j (its own sub-chunk's block)
            da_i = tl.load(dA + (tok_i * H + i_h) * BT + sub3 * BC + local3,
                           mask=valid_i & (local3 < i), other=0.0)
            dk3 += da_i * q_i * decay
    b_dq = tl.reshape(dq3, (BT, BK))
    b_dk = tl.reshape(dk3, (BT, BK))
    from_sub += _log_decay(_row_of_each(a + i_h * K, 0, i_c, start, end, row_base, offs_k, mask_k, H * K,
                                        NC, BC, BT, REVERSE))
    from_sub = tl.reshape(from_sub, (BT, BK))
    after = tl.reshape(after, (BT, BK))

    if NC > 1:
        # As queries, keys in earlier sub-chunks, through the boundary at I's start (see
        # _gk_attention_kernel): dq~_i = exp(G_i - G_b) sum_J dA_iJ (k_J exp(G_b - G_J)).
        b_dq_off = tl.zeros([BT, BK], dtype=tl.float32)
        dtype = q.dtype.element_ty
        keys = after
        for i_ci in tl.static_range(1, NC):
            passed = tl.sum(tl.where((sub == i_ci - 1)[:, None], b_a, 0.0), axis=0)
            keys = tl.where((sub < i_ci - 1)[:, None], keys + passed[None, :], keys)
            b_kg = tl.where((sub < i_ci)[:, None], b_k * tl.exp(keys), 0.0).to(dtype)
            # I's rows (earlier columns: b_kg); operands in the input dtype, as the forward's
            da_i = tl.where((sub == i_ci)[:, None], b_da, 0.0).to(dtype)
            b_dq_off = tl.dot(da_i, b_kg, acc=b_dq_off, input_precision=F32_DOT)
        b_dq += b_dq_off * tl.exp(from_sub)
        # As keys, queries in later sub-chunks, through the boundary e at J's end:
        # dk_j = exp(G_e - G_j) sum_I dA_Ij^T (scale q_I exp(G_I - G_e)), the second exponent the
        # sum from I's start to i plus every sub-chunk between J and I (added as J moves back).
        b_dk_off = tl.zeros([BT, BK], dtype=tl.float32)
        queries = from_sub
        for n in tl.static_range(1, NC):
            i_cj = NC - 1 - n  # J, from the last but one back to the first
            passed = tl.sum(tl.where((sub == i_cj + 1)[:, None], b_a, 0.0), axis=0)
            queries = tl.where((sub > i_cj + 1)[:, None], queries + passed[None, :], queries)
            b_qg = tl.where((sub > i_cj)[:, None], b_q * tl.exp(queries), 0.0).to(dtype)
            da_j = tl.where((sub == i_cj)[None, :], b_da, 0.0).to(dtype)  # J's columns (rows: b_qg)
            b_dk_off = tl.dot(tl.trans(da_j), b_qg, acc=b_dk_off, input_precision=F32_DOT)
        b_dk += b_dk_off * tl.exp(after)

    # dG from the terms that depend on the gates; then the diagonal dA_ii (exponent 0).
    b_dg = b_q * b_dq - b_k * b_dk
    diag = tl.load(dA + (tok * H + i_h) * BT + r, mask=valid, other=0.0)
    b_dq += diag[:, None] * b_k
    b_dk += diag[:, None] * b_q
    out = (tok[:, None] * H + i_h) * K + offs_k[None, :]
    out_mask = valid[:, None] & mask_k[None, :]
    tl.store(dq + out, b_dq, mask=out_mask)
    tl.store(dk + out, b_dk, mask=out_mask)
    tl.store(dg + out, b_dg, mask=out_mask)


@triton.jit
def _dv_kernel(
    k, do, A, dstates, cu_seqlens, chunk_indices, T, NT_SLOTS, num_seqs,
    dv,  # output [B * T, H, V] fp32, per query head
    H: tl.constexpr, H_KV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_G: tl.constexpr, REVERSE: tl.constexpr, IS_VARLEN: tl.constexpr,
    F32_DOT: tl.constexpr,
):
    # dv = A^T do + (k exp(Gamma - G)) D. USE_G: k is already k exp(Gamma - G), per query head
    # (the attention kernels').
    i_v, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h, i_kv, i_c, start, end = _head_chunk_of_program(cu_seqlens, chunk_indices, i_t, i_bh, T, num_seqs,
                                                             H, H_KV, IS_VARLEN)
    if start + i_c * BT >= end:
        return
    row_base = i_b.to(tl.int64) * T
    r = tl.arange(0, BT)
    tok, valid = _rows(r, i_c, start, end, row_base, BT, REVERSE)
    offs_v = i_v * BV + tl.arange(0, BV)
    mask_v = offs_v < V
    slot = i_b.to(tl.int64) * NT_SLOTS + i_t
    d_base = dstates + (slot * H + i_h) * K * V

    b_do = _load_rows(do + i_h * V, tok, valid, offs_v, mask_v, H * V)
    b_a = _load_rows(A + i_h * BT, tok, valid, r, r < BT, H * BT)
    b_dv = tl.dot(tl.trans(b_a.to(b_do.dtype)), b_do, input_precision=F32_DOT)
    for i_k in range(0, tl.cdiv(K, BK)):
        offs_k = i_k * BK + tl.arange(0, BK)
        mask_k = offs_k < K
        if USE_G:
            b_k = _load_rows(k + i_h * K, tok, valid, offs_k, mask_k, H * K)
        else:
            b_k = _load_rows(k + i_kv * K, tok, valid, offs_k, mask_k, H_KV * K)
        b_d = tl.load(d_base + offs_k[:, None] * V + offs_v[None, :], mask=mask_k[:, None] & mask_v[None, :],
                      other=0.0)
        b_dv += tl.dot(b_k, b_d.to(b_k.dtype), input_precision=F32_DOT)
    tl.store(dv + (tok[:, None] * H + i_h) * V + offs_v[None, :], b_dv, mask=valid[:, None] & mask_v[None, :])


@triton.jit
def _inter_grads_kernel(
    q, k, v, a, do, states, dstates, dA, dq_intra, dk_intra, dg_intra,
    cu_seqlens, chunk_indices, T, NT_SLOTS, num_seqs, total_tokens,
    dq, dk, dg,  # outputs fp32: dq, dk [B * T, H, K] per query head; dG [B*T, H, K] or [NK, B*T, H]
    H: tl.constexpr, H_KV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, SCALE: tl.constexpr,
    BT: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
    USE_G: tl.constexpr, USE_GK: tl.constexpr, REVERSE: tl.constexpr, IS_VARLEN: tl.constexpr,
    F32_DOT: tl.constexpr,
):
    # One program: one chunk, one K tile. The state terms (a loop over V tiles) and, for scalar
    # gates or none, the intra-chunk ones; per-key gates bring theirs from _intra_grads_kernel.
    i_k, i_t, i_bh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_b, i_h, i_kv, i_c, start, end = _head_chunk_of_program(cu_seqlens, chunk_indices, i_t, i_bh, T, num_seqs,
                                                             H, H_KV, IS_VARLEN)
    if start + i_c * BT >= end:
        return
    row_base = i_b.to(tl.int64) * T
    r = tl.arange(0, BT)
    tok, valid = _rows(r, i_c, start, end, row_base, BT, REVERSE)
    offs_k = i_k * BK + tl.arange(0, BK)
    mask_k = offs_k < K
    slot = i_b.to(tl.int64) * NT_SLOTS + i_t
    tile_base = (slot * H + i_h) * K * V

    b_dq = tl.zeros([BT, BK], dtype=tl.float32)  # do H^T
    b_dk = tl.zeros([BT, BK], dtype=tl.float32)  # v D^T
    b_hd = tl.zeros([BK], dtype=tl.float32)      # sum_V H * D
    for i_v in range(0, tl.cdiv(V, BV)):
        offs_v = i_v * BV + tl.arange(0, BV)
        mask_v = offs_v < V
        b_do = _load_rows(do + i_h * V, tok, valid, offs_v, mask_v, H * V)
        b_v = _load_rows(v + i_kv * V, tok, valid, offs_v, mask_v, H_KV * V)
        mask_h = mask_k[:, None] & mask_v[None, :]
        b_h = tl.load(states + tile_base + offs_k[:, None] * V + offs_v[None, :], mask=mask_h, other=0.0)
        b_d = tl.load(dstates + tile_base + offs_k[:, None] * V + offs_v[None, :], mask=mask_h, other=0.0)
        b_dq += tl.dot(b_do, tl.trans(b_h).to(b_do.dtype), input_precision=F32_DOT)
        b_dk += tl.dot(b_v.to(b_do.dtype), tl.trans(b_d).to(b_do.dtype), input_precision=F32_DOT)
        b_hd += tl.sum(b_h.to(tl.float32) * b_d.to(tl.float32), axis=1)

    b_q = _load_rows(q + i_h * K, tok, valid, offs_k, mask_k, H * K).to(tl.float32) * SCALE
    b_k = _load_rows(k + i_kv * K, tok, valid, offs_k, mask_k, H_KV * K).to(tl.float32)
    if USE_G:
        from_start, to_end, total = _chunk_decays(a, r, i_c, start, end, row_base, i_h, offs_k, mask_k, H, K,
                                                  BT, USE_GK, REVERSE)
        b_dq *= tl.exp(from_start)
        b_dk *= tl.exp(to_end)
        b_hd *= tl.exp(total)
        # The state terms of dG. At the chunk's last row the k^T v term's exp(Gamma - G_last) = 1
        # cancels exactly between "-k dk" and "sum_V D * H_next": leave it out of both.
        is_last = r == _last_row(i_c, start, end, BT, REVERSE)
        b_kdk = tl.where(is_last[:, None], 0.0, b_k * b_dk)
        b_dg = b_q * b_dq - b_kdk
        b_dg += tl.where(is_last[:, None], (b_hd + tl.sum(b_kdk, axis=0))[None, :], 0.0)

    out = (tok[:, None] * H + i_h) * K + offs_k[None, :]
    out_mask = valid[:, None] & mask_k[None, :]
    if USE_GK:
        b_dq += tl.load(dq_intra + out, mask=out_mask, other=0.0)
        b_dk += tl.load(dk_intra + out, mask=out_mask, other=0.0)
        b_dg += tl.load(dg_intra + out, mask=out_mask, other=0.0)
        tl.store(dg + out, b_dg, mask=out_mask)
    else:
        # Intra-chunk terms over the whole chunk: dq~ = (dA * M) k, dk = (dA * M)^T (scale q), with
        # M the decay matrix (scalar gate) or the causal mask (already applied to dA).
        b_da = _load_rows(dA + i_h * BT, tok, valid, r, r < BT, H * BT)
        if USE_G:
            b_da *= _decay_matrix(_log_decay(tl.load(a + tok * H + i_h, mask=valid, other=0.0)))
            # This K tile's share of the scalar gate's state terms (summed over K tiles outside).
            tl.store(dg + (i_k * total_tokens + tok) * H + i_h, tl.sum(b_dg, axis=1), mask=valid)
        b_dq += tl.dot(b_da, b_k, input_precision=F32_DOT)
        b_dk += tl.dot(tl.trans(b_da), b_q, input_precision=F32_DOT)
    tl.store(dq + out, b_dq * SCALE, mask=out_mask)
    tl.store(dk + out, b_dk, mask=out_mask)


# ----------------------------------------------------------------------------------------------
# Launchers.
# ----------------------------------------------------------------------------------------------


def _or_stand_in(x: Array | None, dtype=jnp.float32) -> Array:
    """Kernels take a pointer for every optional input; an absent one gets a 1-element stand-in."""
    return jnp.zeros((1,), dtype) if x is None else x


def _fit(config: KernelConfig, key_dim: int, value_dim: int) -> tuple[int, int]:
    """(BK, BV): the configured tiles, no wider than K / V rounded up to a power of two (>= 16)."""
    return (min(config.block_k, max(16, triton.next_power_of_2(key_dim))),
            min(config.block_v, max(16, triton.next_power_of_2(value_dim))))


def _check_grid(**sizes: int) -> None:
    for name, size in sizes.items():
        if size > _MAX_GRID_YZ:
            raise ValueError(f"{size} {name} exceed CUDA's grid limit of {_MAX_GRID_YZ} (the sizes of "
                             f"any vmapped axes count too)")


def _layout(query, a, cu_seqlens, chunk_size):
    """Sizes, chunk bookkeeping and the flags every kernel takes."""
    batch, seq_len, num_heads, _ = query.shape
    per_row = 1 if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if cu_seqlens is None:
        slots = cdiv(seq_len, chunk_size)
        chunk_indices = chunk_offsets = jnp.zeros((1,), jnp.int32)  # never read
        cu = jnp.zeros((1,), jnp.int32)
    else:
        # The number of chunks depends on the lengths, traced under jax.jit: launch an upper bound
        # (each sequence adds at most one short chunk); the spare slots are (-1, -1) and idle.
        slots = cdiv(seq_len, chunk_size) + per_row
        chunk_indices = prepare_chunk_indices(cu_seqlens, chunk_size, total_chunks=slots).astype(jnp.int32)
        chunk_offsets = prepare_chunk_offsets(cu_seqlens, chunk_size).astype(jnp.int32)
        cu = cu_seqlens.astype(jnp.int32)
    _check_grid(**{"chunk slots": slots, "batch rows x heads (and sequences x heads)":
                   batch * per_row * num_heads})
    flags = dict(USE_G=a is not None, USE_GK=a is not None and a.ndim == 4,
                 IS_VARLEN=cu_seqlens is not None)
    return per_row, slots, cu, chunk_indices, chunk_offsets, flags


def _dot_precision(dtype, config: ChunkedConfig) -> str:
    return config.float32_dot if jnp.dtype(dtype) == jnp.float32 else "tf32"


def _walk_tiles(config: KernelConfig, key_dim: int, value_dim: int, walks: int, min_programs: int):
    """(BK, BV) for a state walk of ``walks`` sequences x heads: the configured tiles (_fit),
    halved, V first and not below 32, while the walk would launch fewer than ``min_programs``
    programs (few long sequences: each program's steps are sequential, so more of them in
    flight is what shortens the walk)."""
    block_k, block_v = _fit(config, key_dim, value_dim)
    while walks * cdiv(key_dim, block_k) * cdiv(value_dim, block_v) < min_programs:
        if block_v > 32 and block_v >= block_k:
            block_v //= 2
        elif block_k > 32:
            block_k //= 2
        else:
            break
    return block_k, block_v


def _walk_plan(config: ChunkedConfig, key_dim: int, value_dim: int, walks: int, num_chunks: int,
               packed: bool) -> tuple[int, int, int, int]:
    """(BK, BV, S, SEGMENT) of the forward alone's walk: _walk_tiles, then, without packing and
    still short of ``min_walk_programs`` programs, the walk cut (for about ``split_programs``
    programs) into ``S`` segments of ``SEGMENT`` steps, a power of two from _MIN_SEGMENT to
    _MAX_SEGMENT, walked at once (_segments_kernel). ``S = 1``: one walk (always with packing,
    whose sequences the segments would have to follow)."""
    block_k, block_v = _walk_tiles(config.states_alone, key_dim, value_dim, walks, config.min_walk_programs)
    programs = walks * cdiv(key_dim, block_k) * cdiv(value_dim, block_v)
    if packed or not config.split_walk or programs >= config.min_walk_programs:
        return block_k, block_v, 1, _WHOLE_WALK
    wanted = cdiv(config.split_programs, programs)
    segment = min(max(triton.next_power_of_2(cdiv(num_chunks, wanted)), _MIN_SEGMENT), _MAX_SEGMENT)
    segments = cdiv(num_chunks, segment)
    if segments == 1 or walks * segments > _MAX_GRID_YZ:  # the walks' grid axis
        return block_k, block_v, 1, _WHOLE_WALK
    return block_k, block_v, segments, segment


def _run_states(static, num_heads, k, v, gamma, h0, cu, chunk_offsets, per_row, slots, flags, state_dtype,
                to_end=None, plan=None):
    """The states at every chunk's start and the final state. With a gate ``k`` is the attention
    kernel's decayed k (per query head) and ``gamma`` its Gamma; without, ``gamma`` is None. With
    ``to_end`` (a scalar gate's decays from each row to its chunk's end, _gate_sums_kernel's),
    ``k`` is the key and ``gamma`` a scalar per chunk and head. ``plan``: the forward alone's
    walk (_walk_plan: its tiles and segments); the final states are then each segment's."""
    batch, seq_len, _, key_dim = k.shape
    num_kv_heads = v.shape[2]
    value_dim = v.shape[3]
    num_seqs = batch * per_row
    if plan is None:
        kernel_config, name = static.config.states, "config.states"
        (block_k, block_v), segments, segment = _fit(kernel_config, key_dim, value_dim), 1, _WHOLE_WALK
    else:
        kernel_config, name = static.config.states_alone, "config.states_alone"
        block_k, block_v, segments, segment = plan
    return triton_call(
        k, v, _or_stand_in(to_end), _or_stand_in(gamma), _or_stand_in(h0), cu, chunk_offsets, seq_len, slots,
        per_row,
        kernel=_states_kernel,
        out_shape=[jax.ShapeDtypeStruct((batch * slots, num_heads, key_dim, value_dim), state_dtype),
                   jax.ShapeDtypeStruct((num_seqs * segments, num_heads, key_dim, value_dim), jnp.float32)],
        grid=(cdiv(value_dim, block_v), cdiv(key_dim, block_k), num_seqs * num_heads * segments),
        num_warps=kernel_config.num_warps, num_stages=kernel_config.num_stages, config_argument=name,
        H=num_heads, H_KV=num_kv_heads, K=key_dim, V=value_dim, BT=static.chunk_size, BK=block_k, BV=block_v,
        USE_G=flags["USE_G"], DECAY_ROWS=to_end is not None, HAS_H0=h0 is not None, REVERSE=static.reverse,
        IS_VARLEN=flags["IS_VARLEN"], F32_DOT=_dot_precision(k.dtype, static.config), S=segments,
        SEGMENT=segment,
    )


def _scores_dtype(dtype, a):
    """The scores A are stored in the inputs' dtype where they only feed products (in which
    they are rounded to it): halves their traffic, the same results. The scalar gate's
    gradient reads them elementwise (_dA_kernel): float32 then."""
    return jnp.float32 if a is not None and a.ndim == 3 else _state_dtype(dtype)


def _state_dtype(dtype):
    """States between chunks are stored in the inputs' dtype (they feed 16-bit tensor-core
    products); the walk itself carries them in float32."""
    return jnp.float32 if jnp.dtype(dtype) == jnp.float32 else dtype


def _forward_launch(static, query, key, value, a, h0, cu_seqlens):
    """The forward kernels: ``(o, final_state, A, q exp(G), k exp(Gamma - G), Gamma)``, the last
    three (kept for the backward) only with a gate, else 1-element stand-ins."""
    batch, seq_len, num_heads, key_dim = query.shape
    num_kv_heads, value_dim = key.shape[2], value.shape[3]
    per_row, slots, cu, chunk_indices, chunk_offsets, flags = _layout(query, a, cu_seqlens, static.chunk_size)
    cfg, bt = static.config, static.chunk_size
    precision = _dot_precision(query.dtype, cfg)

    block_k, _ = _fit(cfg.attention, key_dim, value_dim)
    attention = dict(H=num_heads, H_KV=num_kv_heads, K=key_dim, SCALE=static.scale, BT=bt, BK=block_k,
                     REVERSE=static.reverse, IS_VARLEN=flags["IS_VARLEN"], F32_DOT=precision,
                     config_argument="config.attention",
                     num_warps=cfg.attention.num_warps, num_stages=cfg.attention.num_stages)
    A_shape = jax.ShapeDtypeStruct((batch, seq_len, num_heads, bt), _scores_dtype(query.dtype, a))
    if flags["USE_G"]:
        # A, and the decayed q and k and Gamma: the states and the output then take no gates.
        per_head = jax.ShapeDtypeStruct((batch, seq_len, num_heads, key_dim), query.dtype)
        decayed_shapes = [per_head, per_head,
                          jax.ShapeDtypeStruct((batch * slots, num_heads, key_dim), jnp.float32)]
        if flags["USE_GK"]:
            # Mild chunks first, in one product each; the careful kernels then take the others.
            use_fast = _uses_fast(static, query.dtype, a)
            if use_fast:
                block_k, _ = _fit(cfg.fast, key_dim, value_dim)
                outs = triton_call(
                    query, key, a, cu, chunk_indices, seq_len, slots, per_row,
                    kernel=_gk_fast_kernel,
                    out_shape=[A_shape, *decayed_shapes,
                               jax.ShapeDtypeStruct((batch * slots, num_heads), jnp.int32)],
                    grid=(slots, batch * num_heads), FAST_DECAY=cfg.fast_decay,
                    **{**attention, "BK": block_k, "num_warps": cfg.fast.num_warps,
                       "num_stages": cfg.fast.num_stages, "config_argument": "config.fast"},
                )
                *outs, fast = outs
            else:  # stand-ins, never read
                outs = [_or_stand_in(None, x.dtype) for x in (A_shape, *decayed_shapes)]
                fast = _or_stand_in(None, jnp.int32)
            A, q_decayed, k_decayed, gamma = triton_call(
                query, key, a, cu, chunk_indices, seq_len, slots, per_row, fast, *outs,
                kernel=_gk_attention_kernel, out_shape=[A_shape, *decayed_shapes],
                input_output_aliases={6: 0, 7: 1, 8: 2, 9: 3} if use_fast else None,
                grid=(slots, batch * num_heads), BC=min(cfg.sub_chunk, bt), USE_FAST=use_fast,
                **attention,
            )
            sub = min(cfg.sub_chunk, bt)
            block_k, _ = _fit(cfg.diagonal, key_dim, value_dim)
            A = triton_call(
                query, key, a, cu, chunk_indices, seq_len, slots, per_row, fast, A,
                kernel=_gk_diagonal_kernel, out_shape=A_shape, grid=(slots * (bt // sub), batch * num_heads),
                input_output_aliases={6: 0},
                config_argument="config.diagonal",
                num_warps=cfg.diagonal.num_warps, num_stages=cfg.diagonal.num_stages,
                H=num_heads, H_KV=num_kv_heads, K=key_dim, SCALE=static.scale, BT=bt, BC=sub, BK=block_k,
                UNROLL=min(cfg.diagonal.unroll, sub), USE_FAST=use_fast, REVERSE=static.reverse,
                IS_VARLEN=flags["IS_VARLEN"], FAST_DECAY=cfg.fast_decay if use_fast else None,
                F32_DOT=precision,
            )
        else:
            A, q_decayed, k_decayed, gamma = triton_call(
                query, key, a, cu, chunk_indices, seq_len, slots, per_row,
                kernel=_attention_kernel, out_shape=[A_shape, *decayed_shapes],
                grid=(slots, batch * num_heads), USE_G=True, **attention,
            )
        states, final_state = _run_states(static, num_heads, k_decayed, value, gamma, h0, cu, chunk_offsets,
                                          per_row, slots, flags, _state_dtype(query.dtype))
        decayed = (q_decayed, k_decayed, gamma.reshape(batch, slots, num_heads, key_dim))
        query = q_decayed
    else:
        decayed = (jnp.zeros((1,), query.dtype),) * 2 + (jnp.zeros((1,), jnp.float32),)
        states, final_state = _run_states(static, num_heads, key, value, None, h0, cu, chunk_offsets,
                                          per_row, slots, flags, _state_dtype(query.dtype))
        stand_in = jax.ShapeDtypeStruct((1,), jnp.float32)
        A, *_ = triton_call(  # no gate: a is None, a stand-in takes its place
            query, key, _or_stand_in(None), cu, chunk_indices, seq_len, slots, per_row,
            kernel=_attention_kernel, out_shape=[A_shape] + [stand_in] * 3, grid=(slots, batch * num_heads),
            USE_G=False, **attention,
        )
    block_k, block_v = _fit(cfg.output, key_dim, value_dim)
    o = triton_call(
        query, value, states, A, cu, chunk_indices, seq_len, slots, per_row,
        kernel=_output_kernel,
        out_shape=jax.ShapeDtypeStruct((batch, seq_len, num_heads, value_dim), query.dtype),
        grid=(cdiv(value_dim, block_v), slots, batch * num_heads),
        config_argument="config.output",
        num_warps=cfg.output.num_warps, num_stages=cfg.output.num_stages,
        H=num_heads, H_KV=num_kv_heads, K=key_dim, V=value_dim, SCALE=static.scale, BT=bt, BK=block_k,
        BV=block_v, REVERSE=static.reverse, IS_VARLEN=flags["IS_VARLEN"], F32_DOT=precision,
    )
    fast = fast.reshape(batch, slots, num_heads) if _uses_fast(static, query.dtype, a) \
        else _or_stand_in(None, jnp.int32)
    return (o, final_state, A, *decayed, fast)


def _forward_alone_launch(static, query, key, value, a, h0, cu_seqlens):
    """The forward when no gradient is asked, with a scalar gate or none: ``(o, final_state)``
    from _gate_sums_kernel (with a gate), the state walk (decaying k's rows as it loads them)
    and _fused_output_kernel. Nothing is written for a backward (A, the decayed q and k)."""
    batch, seq_len, num_heads, key_dim = query.shape
    num_kv_heads, value_dim = key.shape[2], value.shape[3]
    per_row, slots, cu, chunk_indices, chunk_offsets, flags = _layout(query, a, cu_seqlens, static.chunk_size)
    cfg = static.config
    to_end = gamma = None
    if a is not None:
        to_end, gamma = triton_call(
            a, cu, chunk_indices, seq_len, slots, per_row,
            kernel=_gate_sums_kernel,
            out_shape=[jax.ShapeDtypeStruct(a.shape, jnp.float32),
                       jax.ShapeDtypeStruct((batch * slots, num_heads), jnp.float32)],
            grid=(slots, batch), H=num_heads, HP=max(triton.next_power_of_2(num_heads), 2),
            BT=static.chunk_size, REVERSE=static.reverse, IS_VARLEN=flags["IS_VARLEN"],
        )
    plan = _walk_plan(cfg, key_dim, value_dim, batch * per_row * num_heads, slots, flags["IS_VARLEN"])
    states, final_state = _run_states(static, num_heads, key, value, gamma, h0, cu, chunk_offsets, per_row,
                                      slots, flags, _state_dtype(query.dtype), to_end=to_end, plan=plan)
    block_k, block_v, segments, segment = plan
    seg_start = None
    if segments > 1:  # final_state holds each segment's last state: walk the segments
        seg_start, final_state = triton_call(
            _or_stand_in(gamma), final_state, seq_len,
            kernel=_segments_kernel,
            out_shape=[jax.ShapeDtypeStruct(final_state.shape, jnp.float32),
                       jax.ShapeDtypeStruct((batch, num_heads, key_dim, value_dim), jnp.float32)],
            grid=(cdiv(value_dim, block_v), cdiv(key_dim, block_k), batch * num_heads),
            H=num_heads, K=key_dim, V=value_dim, BT=static.chunk_size, BK=block_k, BV=block_v, S=segments,
            SEGMENT=segment, USE_G=flags["USE_G"], REVERSE=static.reverse,
            config_argument="config.states_alone",  # its tiles are the walk's
        )
    block_k, block_v = _fit(cfg.fused_output, key_dim, value_dim)
    o = triton_call(
        query, key, value, _or_stand_in(a), states, cu, chunk_indices, seq_len, slots, per_row,
        _or_stand_in(gamma), _or_stand_in(seg_start),
        kernel=_fused_output_kernel,
        out_shape=jax.ShapeDtypeStruct((batch, seq_len, num_heads, value_dim), query.dtype),
        grid=(cdiv(value_dim, block_v), slots, batch * num_heads),
        config_argument="config.fused_output",
        num_warps=cfg.fused_output.num_warps, num_stages=cfg.fused_output.num_stages,
        H=num_heads, H_KV=num_kv_heads, K=key_dim, V=value_dim, SCALE=static.scale, BT=static.chunk_size,
        BK=block_k, BV=block_v, USE_G=flags["USE_G"], REVERSE=static.reverse, IS_VARLEN=flags["IS_VARLEN"],
        F32_DOT=_dot_precision(query.dtype, cfg), S=segments, SEGMENT=segment,
    )
    return o, final_state


def _uses_fast(static, dtype, a) -> bool:
    """Whether the per-key gate's mild chunks take one product each (_gk_fast_kernel)."""
    return (a is not None and a.ndim == 4 and static.config.fast_decay is not None
            and jnp.dtype(dtype) != jnp.float32)


def _backward_launch(static, query, key, value, a, h0, cu_seqlens, A, d_o, d_final_state,
                     q_decayed, k_decayed, gamma, fast):
    """The backward kernels: ``(dq, dk, dv, dg_terms, d initial_state)``, dk and dv per query head.
    With a gate the states, D and dv take the forward's decayed q and k and Gamma."""
    batch, seq_len, num_heads, key_dim = query.shape
    num_kv_heads, value_dim = key.shape[2], value.shape[3]
    per_row, slots, cu, chunk_indices, chunk_offsets, flags = _layout(query, a, cu_seqlens, static.chunk_size)
    cfg, bt = static.config, static.chunk_size
    f32 = jnp.float32
    precision = _dot_precision(query.dtype, cfg)
    use_g, use_gk = flags["USE_G"], flags["USE_GK"]
    common = dict(H=num_heads, K=key_dim, BT=bt, REVERSE=static.reverse, IS_VARLEN=flags["IS_VARLEN"],
                  F32_DOT=precision)
    gated = dict(USE_G=use_g)

    def per_token(size, dtype=f32):
        return jax.ShapeDtypeStruct((batch, seq_len, num_heads, size), dtype)

    # dq, and dk and dv when no query heads share a key/value head, are final where the kernels
    # write them: in the inputs' dtype, which saves a conversion each. Shared heads' dk and dv
    # are summed over the group in float32 first.
    grads_dtype = query.dtype if num_kv_heads == num_heads else f32
    state_dtype = _state_dtype(query.dtype)
    a_ = _or_stand_in(a)
    num_seqs = batch * per_row

    # The states again (cheaper to recompute than to keep), then D, walking the other way.
    if use_g:
        states, _ = _run_states(static, num_heads, k_decayed, value, gamma, h0, cu, chunk_offsets, per_row,
                                slots, flags, state_dtype)
    else:
        states, _ = _run_states(static, num_heads, key, value, None, h0, cu, chunk_offsets, per_row, slots,
                                flags, state_dtype)
    block_k, block_v = _fit(cfg.state_grads, key_dim, value_dim)
    dstates, dh0 = triton_call(
        q_decayed if use_g else query, d_o, gamma if use_g else a_, _or_stand_in(d_final_state), cu,
        chunk_offsets, seq_len, slots, per_row,
        kernel=_state_grads_kernel,
        out_shape=[jax.ShapeDtypeStruct((batch * slots, num_heads, key_dim, value_dim), state_dtype),
                   jax.ShapeDtypeStruct((num_seqs, num_heads, key_dim, value_dim) if h0 is not None else (1,),
                                        f32)],
        grid=(cdiv(value_dim, block_v), cdiv(key_dim, block_k), num_seqs * num_heads),
        config_argument="config.state_grads",
        num_warps=cfg.state_grads.num_warps, num_stages=cfg.state_grads.num_stages,
        V=value_dim, SCALE=static.scale, BK=block_k, BV=block_v, HAS_DHT=d_final_state is not None,
        HAS_H0=h0 is not None, **gated, **common,
    )

    scalar_gate = use_g and not use_gk
    _, block_v = _fit(cfg.dA, key_dim, value_dim)
    dA, dg_intra = triton_call(
        value, d_o, A, cu, chunk_indices, seq_len, per_row,
        kernel=_dA_kernel,
        out_shape=[per_token(bt),
                   jax.ShapeDtypeStruct((batch, seq_len, num_heads) if scalar_gate else (1,), f32)],
        grid=(slots, batch * num_heads),
        config_argument="config.dA",
        num_warps=cfg.dA.num_warps, num_stages=cfg.dA.num_stages,
        H=num_heads, H_KV=num_kv_heads, V=value_dim, BT=bt, BV=block_v, SCALAR_GATE=scalar_gate,
        REVERSE=static.reverse, IS_VARLEN=flags["IS_VARLEN"], F32_DOT=precision,
    )

    if use_gk:
        # The chunks the forward took in one product, likewise; the careful kernel the others.
        use_fast = fast is not None
        if use_fast:
            block_k, _ = _fit(cfg.fast_grads, key_dim, value_dim)
            intra = triton_call(
                query, key, a, dA, cu, chunk_indices, seq_len, slots, per_row, fast,
                kernel=_gk_fast_grads_kernel, out_shape=[per_token(key_dim)] * 3,
                grid=(cdiv(key_dim, block_k), slots, batch * num_heads),
                config_argument="config.fast_grads",
                num_warps=cfg.fast_grads.num_warps, num_stages=cfg.fast_grads.num_stages,
                H_KV=num_kv_heads, SCALE=static.scale, BK=block_k, **common,
            )
        else:  # stand-ins, never read
            intra, fast = [jnp.zeros((1,), f32)] * 3, jnp.zeros((1,), jnp.int32)
        sub = min(cfg.sub_chunk, bt)
        block_k, _ = _fit(cfg.intra_grads, key_dim, value_dim)
        dq_intra, dk_intra, dg_intra = triton_call(
            query, key, a, dA, cu, chunk_indices, seq_len, slots, per_row, fast, *intra,
            kernel=_intra_grads_kernel,
            out_shape=[per_token(key_dim)] * 3,
            input_output_aliases={7: 0, 8: 1, 9: 2} if use_fast else None,
            grid=(cdiv(key_dim, block_k), slots, batch * num_heads),
            config_argument="config.intra_grads",
            num_warps=cfg.intra_grads.num_warps, num_stages=cfg.intra_grads.num_stages,
            H_KV=num_kv_heads, SCALE=static.scale, BC=sub, BK=block_k,
            UNROLL=min(cfg.intra_grads.unroll, sub), USE_FAST=use_fast, **common,
        )
    else:
        dq_intra = dk_intra = jnp.zeros((1,), f32)

    block_k, block_v = _fit(cfg.dv, key_dim, value_dim)
    dv = triton_call(
        k_decayed if use_g else key, d_o, A, dstates, cu, chunk_indices, seq_len, slots, per_row,
        kernel=_dv_kernel,
        out_shape=per_token(value_dim, grads_dtype),
        grid=(cdiv(value_dim, block_v), slots, batch * num_heads),
        config_argument="config.dv",
        num_warps=cfg.dv.num_warps, num_stages=cfg.dv.num_stages,
        H_KV=num_kv_heads, V=value_dim, BK=block_k, BV=block_v, **gated, **common,
    )

    block_k, block_v = _fit(cfg.inter_grads, key_dim, value_dim)
    num_k_tiles = cdiv(key_dim, block_k)
    if use_gk:
        dg_shape = (batch, seq_len, num_heads, key_dim)
    elif use_g:
        dg_shape = (num_k_tiles, batch, seq_len, num_heads)  # per-K-tile shares, summed below
    else:
        dg_shape = (1,)
    dq, dk, dg = triton_call(
        query, key, value, a_, d_o, states, dstates, dA, dq_intra, dk_intra,
        dg_intra if use_gk else jnp.zeros((1,), f32), cu, chunk_indices, seq_len, slots, per_row,
        batch * seq_len,
        kernel=_inter_grads_kernel,
        out_shape=[per_token(key_dim, query.dtype), per_token(key_dim, grads_dtype),
                   jax.ShapeDtypeStruct(dg_shape, f32)],
        grid=(num_k_tiles, slots, batch * num_heads),
        config_argument="config.inter_grads",
        num_warps=cfg.inter_grads.num_warps, num_stages=cfg.inter_grads.num_stages,
        H_KV=num_kv_heads, V=value_dim, SCALE=static.scale, BK=block_k, BV=block_v, USE_GK=use_gk, **gated,
        **common,
    )
    if scalar_gate:
        dg = dg_intra + dg.sum(0)
    elif not use_g:
        dg = jnp.zeros((1,), f32)
    return dq, dk, dv, dg, dh0


# Under jax.vmap the launches fold the mapped axis into the batch: q, k, v, a, A, do, the states
# and the decayed q, k and Gamma have one (axis 0); cu_seqlens has none (mapped, the launches run
# one element at a time).
_FWD_IN_AXES = (0, 0, 0, 0, 0, None)
_BWD_IN_AXES = (0, 0, 0, 0, 0, None, 0, 0, 0, 0, 0, 0, 0)


def _valid_tokens(cu_seqlens, seq_len):
    """With packing, which tokens of the row belong to a sequence (the rest are never visited)."""
    return None if cu_seqlens is None else (jnp.arange(seq_len) < cu_seqlens[-1])[:, None, None]


def _empty(query, value, cu_seqlens):
    batch, seq_len, num_heads, key_dim = query.shape
    num_seqs = batch if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return num_seqs * num_heads * key_dim * value.shape[3] == 0 or batch * seq_len == 0


def _forward(static, query, key, value, a, h0, cu_seqlens, residuals=True):
    """``(o, final_state, A, residuals)``; with ``residuals=False`` (the forward alone) A and the
    residuals may be None: a scalar gate or none then takes _forward_alone_launch."""
    batch, seq_len, num_heads, key_dim = query.shape
    value_dim = value.shape[3]
    num_seqs = batch if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if _empty(query, value, cu_seqlens):  # nothing to walk: o = q h is 0, the state passes through
        o = jnp.zeros((batch, seq_len, num_heads, value_dim), query.dtype)
        state = jnp.zeros((num_seqs, num_heads, key_dim, value_dim), jnp.float32) if h0 is None else h0
        A = jnp.zeros((batch, seq_len, num_heads, static.chunk_size), _scores_dtype(query.dtype, a))
        return o, state.astype(jnp.float32), A, None
    if not residuals and (a is None or a.ndim == 3):
        launch = vmap_by_folding(functools.partial(_forward_alone_launch, static), in_axes=_FWD_IN_AXES,
                                 out_axes=(0, 0))
        o, final_state = launch(query, key, value, a, h0, cu_seqlens)
        valid = _valid_tokens(cu_seqlens, seq_len)
        if valid is not None:
            o = jnp.where(valid, o, 0).astype(o.dtype)
        return o, final_state, None, None
    use_g, use_fast = a is not None, _uses_fast(static, query.dtype, a)
    launch = vmap_by_folding(functools.partial(_forward_launch, static), in_axes=_FWD_IN_AXES,
                             out_axes=(0, 0, 0) + (0 if use_g else None,) * 3 + (0 if use_fast else None,))
    o, final_state, A, *decayed, fast = launch(query, key, value, a, h0, cu_seqlens)
    valid = _valid_tokens(cu_seqlens, seq_len)
    if valid is not None:
        o = jnp.where(valid, o, 0).astype(o.dtype)
    # With a gate: q exp(G), k exp(Gamma - G) and Gamma, for the backward; and which chunks the
    # per-key gate took in one product (else None).
    return o, final_state, A, (*decayed, fast if use_fast else None) if use_g else None


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _chunked(static, query, key, value, a, h0, cu_seqlens):
    o, final_state, _, _ = _forward(static, query, key, value, a, h0, cu_seqlens, residuals=False)
    return o, final_state


def _chunked_fwd(static, *primals):
    # With symbolic_zeros=True each array argument arrives as a CustomVJPPrimal (value, perturbed).
    query, key, value, a, h0, cu_seqlens = [None if p is None else p.value for p in primals]
    o, final_state, A, decayed = _forward(static, query, key, value, a, h0, cu_seqlens)
    return (o, final_state), (query, key, value, a, h0, cu_seqlens, A, decayed)


def _chunked_bwd(static, residuals, cotangents):
    query, key, value, a, h0, cu_seqlens, A, decayed = residuals
    d_o, d_final_state = cotangents
    if isinstance(d_o, jax.custom_derivatives.SymbolicZero):  # only final_state was used
        d_o = jnp.zeros(d_o.shape, d_o.dtype)
    if isinstance(d_final_state, jax.custom_derivatives.SymbolicZero):
        d_final_state = None
    batch, seq_len, num_heads, key_dim = query.shape
    num_kv_heads, value_dim = value.shape[2], value.shape[3]
    group = num_heads // num_kv_heads
    f32 = jnp.float32

    if _empty(query, value, cu_seqlens):
        dq = dk = jnp.zeros((batch, seq_len, num_heads, key_dim), f32)
        dv = jnp.zeros((batch, seq_len, num_heads, value_dim), f32)
        dg_terms = None if a is None else jnp.zeros(a.shape, f32)
        dh0 = None if h0 is None else (jnp.zeros(h0.shape, f32) if d_final_state is None else d_final_state)
    else:
        use_g, use_gk = a is not None, a is not None and a.ndim == 4
        # Where each output's batch rows are (None: a 1-element stand-in).
        out_axes = (0, 0, 0, 0 if use_g else None, 0 if h0 is not None else None)
        launch = vmap_by_folding(functools.partial(_backward_launch, static), in_axes=_BWD_IN_AXES,
                                 out_axes=out_axes)
        dq, dk, dv, dg_terms, dh0 = launch(query, key, value, a, h0, cu_seqlens, A, d_o.astype(query.dtype),
                                           d_final_state, *(decayed or (None,) * 4))
        valid = _valid_tokens(cu_seqlens, seq_len)
        if valid is not None:
            dq, dk, dv = (jnp.where(valid, x, 0) for x in (dq, dk, dv))
        if use_g:
            # The kernels give the gradient with respect to G, a's cumulative sum within each chunk
            # in walking order; a's is its transpose, the suffix sums within the same chunks
            # (which also zero the tokens outside every sequence).
            dg_terms = chunk_local_cumsum(dg_terms, static.chunk_size, reverse=not static.reverse,
                                          cu_seqlens=cu_seqlens)
        else:
            dg_terms = None
        if h0 is None:
            dh0 = None

    # The kernels clamped a at the floor: below it (and at -inf) its gradient is 0; a NaN's
    # gradient is what the kernels made of it.
    da = None if dg_terms is None else jnp.where(a < _LOG_DECAY_FLOOR.value, 0, dg_terms)

    def grouped(x):  # a key/value head's gradient sums over the query heads it serves
        return x.reshape(batch, seq_len, num_kv_heads, group, x.shape[-1]).sum(3)

    def cast(x, like):
        return None if like is None else x.astype(like.dtype)

    return (cast(dq, query), cast(grouped(dk), key), cast(grouped(dv), value), cast(da, a), cast(dh0, h0),
            None)


_chunked.defvjp(_chunked_fwd, _chunked_bwd, symbolic_zeros=True)


# ----------------------------------------------------------------------------------------------
# The public function.
# ----------------------------------------------------------------------------------------------


def _log_decays(g, g_gamma, gk, shape):
    """a: the log-decay along K, ``a = g + g_gamma + gk``: ``[B, T, H]`` for scalar gates,
    ``[B, T, H, K]`` with ``gk``; None without gates. A lone ``gk`` as it is (the kernels read
    any of their dtypes), a sum in float32. Plain JAX: JAX differentiates it, so the kernels'
    gradient with respect to a becomes the gates' gradients (sums). Not clamped: the kernels
    clamp as they load (_log_decay)."""
    batch, seq_len, num_heads, _ = shape
    f32 = jnp.float32
    if g is None and g_gamma is None and gk is None:
        return None
    if g is None and g_gamma is None and jnp.dtype(gk.dtype) in map(jnp.dtype, _TRITON_DTYPES):
        return gk
    a = jnp.zeros((batch, seq_len, num_heads), f32)  # the scalar part, g + g_gamma
    if g is not None:
        a = a + g.astype(f32)
    if g_gamma is not None:
        a = a + g_gamma.astype(f32)
    if gk is not None:
        a = gk.astype(f32) + a[..., None]
    return a


@functools.partial(jax.jit, static_argnums=(0,))
def _chunked_jit(static, query, key, value, g, g_gamma, gk, initial_state, cu_seqlens):
    if cu_seqlens is not None:
        # Traced values were not checked: the kernels get the nearest valid packing, so that none
        # of them can be sent outside its arrays. (cu_seqlens gets no gradient.)
        cu_seqlens = sanitize_cu_seqlens(cu_seqlens, query.shape[1])
    dtype = jnp.result_type(query.dtype, key.dtype, value.dtype)  # one dtype for the products
    a = _log_decays(g, g_gamma, gk, query.shape)
    h0 = None if initial_state is None else initial_state.astype(jnp.float32)
    o, final_state = _chunked(static, query.astype(dtype), key.astype(dtype), value.astype(dtype), a, h0,
                              cu_seqlens)
    return o.astype(query.dtype), final_state


def chunked_recurrent(
    query: Array,
    key: Array,
    value: Array,
    g: Array | None = None,
    g_gamma: Array | None = None,
    gk: Array | None = None,
    gv: Array | None = None,
    softmax_scale: float | None = None,
    initial_state: Array | None = None,
    reverse: bool = False,
    cu_seqlens: Array | None = None,
    chunk_size: int = 64,
    impl: str = "auto",
    config: ChunkedConfig | None = None,
    sequence_parallelism_mesh_axis_name: str | None = None,
) -> tuple[Array, Array]:
    """Recurrent linear attention computed chunk-wise with Triton kernels (the training form).

    Same arguments, layouts and results as :func:`ejk_lite.recurrent` (see there), computed in
    chunks of ``chunk_size`` tokens: tensor-core products inside a chunk, the state handed from
    chunk to chunk. Differentiable in every array argument; composes with ``jit``, ``grad`` and
    ``vmap``.

    Args:
        query, key, value, g, g_gamma, gk, softmax_scale, initial_state, reverse, cu_seqlens: as
            in :func:`ejk_lite.recurrent`.
        gv: not supported by the chunked form (a decay along V does not factor into the
            products); passing it raises ``ValueError``: use :func:`ejk_lite.recurrent`.
        chunk_size: 16, 32, 64 or 128 (static).
        impl: ``"triton"``, ``"xla"`` (recurrent's plain-JAX reference, a scan over tokens) or
            ``"auto"`` (Triton on a GPU, else XLA: on a CPU the kernels run in Triton's
            interpreter, for testing; pass ``impl="triton"`` there to test them).
        config: a :class:`ChunkedConfig` (tiles, warps and stages per kernel); ``None``:
            :meth:`ChunkedConfig.default` for the inputs' dtype, head dims and GPU.

    Returns:
        ``(o, final_state)``: ``o`` ``[B, T, H, V]`` in the query's dtype, ``final_state``
        ``[N, H, K, V]`` in float32.

    Raises:
        ValueError: naming the argument, for anything :func:`ejk_lite.recurrent` refuses, a ``gv``,
        a bad ``chunk_size``, ``impl`` or ``config``, float64 inputs with ``impl="triton"``, or
        (Triton) a chunk of ``chunk_size * H * max(K, V) >= 2**31`` elements.
    """
    if sequence_parallelism_mesh_axis_name is not None:  # each shard holds a slice of the sequence
        return sequence_parallel.linear_attention(chunked_recurrent, **locals())
    # "auto": Triton on a GPU, XLA elsewhere (as every op), until the kernels pass on a GPU.
    impl = resolve_impl(impl)
    cu_seqlens = _validate(query, key, value, g, g_gamma, gk, gv, initial_state, cu_seqlens)
    if gv is not None:
        raise ValueError("gv (a decay along V) is not supported by chunked_recurrent: it does not factor "
                         "into the chunk's matrix products; use ejk_lite.recurrent")
    chunk_size = static_int(chunk_size, "chunk_size", minimum=1)
    if chunk_size not in (16, 32, 64, 128):
        raise ValueError(f"chunk_size must be 16, 32, 64 or 128, got {chunk_size}")
    if config is not None and not isinstance(config, ChunkedConfig):
        raise ValueError(f"config must be a ChunkedConfig, got {type(config).__name__}")
    scale = _scale(softmax_scale, query.shape[-1])
    reverse = bool(reverse)
    supported = all(jnp.dtype(x.dtype) in map(jnp.dtype, _TRITON_DTYPES) for x in (query, key, value))
    if impl == "triton" and not supported:
        raise ValueError(f"impl='triton' takes float16, bfloat16 or float32 query/key/value, got "
                         f"{query.dtype}/{key.dtype}/{value.dtype}; use impl='xla'")
    if impl == "xla":
        return reference(query, key, value, g, g_gamma, gk, None, scale, initial_state, reverse, cu_seqlens)
    num_heads, key_dim, value_dim = query.shape[2], query.shape[3], value.shape[3]
    if config is None:  # the products' dtype, as _chunked_jit computes it
        config = ChunkedConfig.default(jnp.result_type(query.dtype, key.dtype, value.dtype),
                                       key_dim, value_dim)
    if max(chunk_size * num_heads * max(key_dim, value_dim), key_dim * value_dim) >= 2**31:
        # Several kernels address a chunk's rows (and a state's tile) in 32 bits from a 64-bit
        # base: cheaper than 64-bit offsets per element (see ChunkedConfig.fast).
        raise ValueError(f"chunk_size x heads x max(K, V) = {chunk_size} x {num_heads} x "
                         f"{max(key_dim, value_dim)} (or K x V = {key_dim} x {value_dim}) reaches 2**31 "
                         f"elements, past the kernels' 32-bit offsets within a chunk; use a smaller "
                         f"chunk_size or impl='xla'")
    static = _Static(scale=scale, chunk_size=chunk_size, reverse=reverse, config=config)
    return _chunked_jit(static, query, key, value, g, g_gamma, gk, initial_state, cu_seqlens)
