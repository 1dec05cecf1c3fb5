"""Recurrent linear attention: one K x V state per head, decayed by gates and updated once per token.

For every query head the recurrence (Katharopoulos et al. 2020, "Transformers are RNNs"; gated
as in Yang et al. 2024, "Gated Linear Attention Transformers with Hardware-Efficient Training") is::

    h_t = h_{t-1} * exp(g_t + g_gamma) * exp(gk_t)[:, None] * exp(gv_t)[None, :] + k_t^T v_t
    o_t = (softmax_scale * q_t) @ h_t

with the gates in log space (``<= 0`` for a decay): ``g`` one scalar per head and token, ``g_gamma``
one constant per head, ``gk`` a vector along K and ``gv`` one along V. Everything that multiplies
the state along K folds into a single log-decay ``a_t = g_t + g_gamma + gk_t`` and the V side is
``b_t = gv_t``, so every kernel below sees just ``h * exp(a_t)[:, None] * exp(b_t)[None, :]``.

The kernels are *fused recurrent*: a program owns a ``[BK, BV]`` tile of one head's state in fp32
registers and walks that head's sequence token by token. Nothing of size T x K x V is ever stored.
With several K tiles the output ``o_t = q_t h_t`` (a sum over K) comes out as one partial per K
tile, summed afterwards; the same holds for every other sum over a tiled axis.

**Backward.** Write ``dH_t`` for the gradient reaching ``h_t`` from the outputs at and after ``t``
and from the final state. Walking backwards from ``dH_T = dh_final + scale q_T^T do_T``::

    dH_t   = exp(a_{t+1})[:, None] * exp(b_{t+1})[None, :] * dH_{t+1} + scale q_t^T do_t
    dk_t   = dH_t v_t           dv_t = dH_t^T k_t          d initial_state = decay_1 * dH_1
    dq_t   = scale * h_t do_t^T                            (needs h_t: a second forward walk)

The two walks are independent, so one launch runs them side by side.

The gates' gradients would need ``h_{t-1}`` in the backward walk, which we do not have
(recovering it by dividing by the decay underflows for strong decay). The GLA paper's trick avoids
it: with ``A_t`` the running sum of ``a``, the state unrolls to
``h_t = exp(A_t) * (h_0 + sum_{r<=t} exp(-A_r) k_r^T v_r)`` (per K row), so ``A_t`` reaches the
loss only through ``q_t exp(A_t)``, ``k_t exp(-A_t)`` and, at the last step, the final state::

    dL/dA_s = q_s * dq_s - k_s * dk_s   (+ sum_V h_T * dh_final at the last step)
    dL/da_t = sum_{s >= t} dL/dA_s      a suffix sum in walking order

and the same along V with ``o_s * do_s - v_s * dv_s``. Written this way it loses digits when the
decay is strong: ``q_s * dq_s`` and ``k_s * dk_s`` then nearly cancel. With ``P_s = decay_s *
h_{s-1}`` (the state before token s's own ``k^T v``) and ``dh_s = decay_{s+1} * dH_{s+1}``, the
common part ``scale (q_s . k_s)(v_s . do_s)`` cancels exactly, and what is left is small when the
decay is strong, so it is computed accurately::

    dL/dA_s = scale * q_s * (P_s do_s) - k_s * (dh_s v_s)      (no second term at the last step)
    last step also: + sum_V P_T * dh_final

The kernels write these per-token terms (the forward walk knows ``P_s``, the backward walk
``dh_s``) and one reverse cumulative sum (``ejk_lite.chunk_global_cumsum``) turns them into the
gradient. ``g`` gets the sum over K of ``dL/da`` and ``g_gamma`` its sum over every token.

Grouped heads: key/value head ``j`` serves query heads ``j * G ... (j + 1) * G - 1`` with
``G = H_q // H_kv``; each query head has its own state and gates and the key/value gradients are
summed over the group.

``jax.vmap`` folds the mapped axis into the batch, so a batch of inputs is one launch of each
kernel (with packing, every row of the folded batch holds the same sequences); only a mapped
``cu_seqlens`` runs one element at a time.

Implementations (``impl=``): ``"triton"``, the kernels below; ``"xla"``, the module's
:func:`reference` (a ``lax.scan`` over time, differentiated by JAX); ``"auto"``, Triton on a GPU
and XLA elsewhere. Tiles (``config=``): a :class:`RecurrentConfig`, per direction.

The module reads top to bottom as every op of ejk_lite: the checks and the reference, the
kernels, the launchers ``_fwd`` / ``_bwd``, one ``custom_vjp``, the public function.
(The module is ``ejk_lite.linear_attention``; ``ejk_lite.recurrent`` is the function.)
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import triton
import triton.language as tl
from jax import Array, lax

from ejk_lite.checks import (
    check_config,
    check_floating,
    check_triton_dtype,
    freeze_fields,
    next_power_of_2,
    resolve_impl,
    static_float,
    validated_fields,
)
from ejk_lite.cumsum import chunk_global_cumsum
from ejk_lite.launch import triton_call, vmap_by_folding
from ejk_lite import sequence_parallel
from ejk_lite.packing import (
    cdiv,
    check_packed_batch,
    checked_cu_seqlens,
    prepare_sequence_ids,
    sanitize_cu_seqlens,
)

__all__ = ["recurrent", "reference", "RecurrentConfig"]


# ----------------------------------------------------------------------------------------------
# Argument checks, shared by the kernels and the reference.
# ----------------------------------------------------------------------------------------------


def _check_shape(name: str, x: Any, expected: tuple[int, ...], meaning: str) -> None:
    if x is not None and tuple(x.shape) != expected:
        raise ValueError(f"{name} must have shape {meaning} = {expected}, got {tuple(x.shape)}")


def _validate(query, key, value, g, g_gamma, gk, gv, initial_state, cu_seqlens) -> Array | None:
    """Raise ``ValueError`` naming the bad argument; return ``cu_seqlens`` checked (or None)."""
    for name, x in (("query", query), ("key", key), ("value", value)):
        if not hasattr(x, "shape") or len(x.shape) != 4:
            raise ValueError(f"{name} must be a 4-D array [batch, seq_len, heads, dim], "
                             f"got shape {getattr(x, 'shape', None)}")
    # A state of integers (or bools) would be decayed and summed in integer arithmetic: refuse.
    for name, x in (("query", query), ("key", key), ("value", value), ("g", g),
                    ("g_gamma", g_gamma), ("gk", gk), ("gv", gv), ("initial_state", initial_state)):
        check_floating(x, name, optional=name not in ("query", "key", "value"))
    batch, seq_len, num_heads, key_dim = query.shape
    num_kv_heads, value_dim = key.shape[2], value.shape[3]
    _check_shape("key", key, (batch, seq_len, num_kv_heads, key_dim), "[batch, seq_len, kv_heads, key_dim]")
    _check_shape("value", value, (batch, seq_len, num_kv_heads, value_dim), "[batch, seq_len, kv_heads, value_dim]")
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(f"key/value heads ({num_kv_heads}) must divide the query heads ({num_heads})")
    _check_shape("g", g, (batch, seq_len, num_heads), "[batch, seq_len, heads]")
    _check_shape("g_gamma", g_gamma, (num_heads,), "[heads]")
    _check_shape("gk", gk, (batch, seq_len, num_heads, key_dim), "[batch, seq_len, heads, key_dim]")
    _check_shape("gv", gv, (batch, seq_len, num_heads, value_dim), "[batch, seq_len, heads, value_dim]")
    if cu_seqlens is None:
        num_sequences = batch
    else:
        cu_seqlens = checked_cu_seqlens(cu_seqlens, seq_len)
        check_packed_batch(batch, "query", query.shape)
        num_sequences = cu_seqlens.shape[0] - 1
    _check_shape("initial_state", initial_state, (num_sequences, num_heads, key_dim, value_dim),
                 "[num_sequences, heads, key_dim, value_dim]")
    return cu_seqlens


def _scale(softmax_scale: Any, key_dim: int) -> float:
    """``softmax_scale`` as a Python float; ``key_dim ** -0.5`` by default (1 for an empty key
    dimension, where it multiplies nothing: the output is zero)."""
    if softmax_scale is not None:
        return static_float(softmax_scale, "softmax_scale")
    return key_dim ** -0.5 if key_dim > 0 else 1.0


# ----------------------------------------------------------------------------------------------
# The reference: the recurrence written out as a scan over time.
# ----------------------------------------------------------------------------------------------


def reference(
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
) -> tuple[Array, Array]:
    """Recurrent linear attention as a ``lax.scan`` over time; same arguments and results as ``recurrent``.

    For each query head (its own state ``h`` of shape ``[K, V]``), token by token::

        h_t = h_{t-1} * exp(g_t + g_gamma) * exp(gk_t)[:, None] * exp(gv_t)[None, :] + k_t^T v_t
        o_t = (softmax_scale * q_t) @ h_t

    Key/value head ``j`` serves query heads ``j * G ... (j + 1) * G - 1`` (``G = H_q // H_kv``).
    With ``cu_seqlens`` the single row holds several sequences, each with its own state; tokens past
    ``cu_seqlens[-1]`` belong to none and get a zero output. ``reverse=True`` walks each sequence
    from its last token to its first. Computes in float32 (float64 for float64 inputs); the output
    has the query's dtype and the final state ``[N, H, K, V]`` is float32 (float64 for float64).
    """
    cu_seqlens = _validate(query, key, value, g, g_gamma, gk, gv, initial_state, cu_seqlens)
    batch, seq_len, num_heads, key_dim = query.shape
    num_sequences = batch if cu_seqlens is None else cu_seqlens.shape[0] - 1
    value_dim = value.shape[-1]
    group = num_heads // key.shape[2]
    scale = _scale(softmax_scale, key_dim)
    dtype = jnp.promote_types(query.dtype, jnp.float32)

    # Everything per query head, time axis first: [T, B, H, ...].
    def time_major(x, repeat=1):
        x = jnp.repeat(x.astype(dtype), repeat, axis=2) if repeat > 1 else x.astype(dtype)
        return jnp.moveaxis(x, 1, 0)

    q = time_major(query) * scale
    k = time_major(key, group)
    v = time_major(value, group)
    # Fold the gates into two log-decays: one along K (g, g_gamma, gk) and one along V (gv).
    log_decay_k = jnp.zeros((seq_len, batch, num_heads, key_dim), dtype)
    if g is not None:
        log_decay_k = log_decay_k + time_major(g)[..., None]
    if g_gamma is not None:
        log_decay_k = log_decay_k + g_gamma.astype(dtype)[:, None]
    if gk is not None:
        log_decay_k = log_decay_k + time_major(gk)
    log_decay_v = jnp.zeros((seq_len, batch, num_heads, value_dim), dtype) if gv is None else time_major(gv)

    def update(h, q_t, k_t, v_t, a_k, a_v):
        h = h * jnp.exp(a_k)[..., :, None] * jnp.exp(a_v)[..., None, :] + k_t[..., :, None] * v_t[..., None, :]
        # HIGHEST: on a GPU the default precision of a float32 dot may be TF32 (10-bit mantissa).
        return h, jnp.einsum("...k,...kv->...v", q_t, h, precision=lax.Precision.HIGHEST)

    if initial_state is None:
        h0 = jnp.zeros((num_sequences, num_heads, key_dim, value_dim), dtype)
    else:
        h0 = initial_state.astype(dtype)

    xs = (q, k, v, log_decay_k, log_decay_v)
    if cu_seqlens is None:
        # One sequence per batch row: all rows step together.
        def step(h, x):
            return update(h, *x)
        final_state, o = jax.lax.scan(step, h0, xs, reverse=reverse)
    else:
        # One packed row: the carry holds every sequence's state and token t updates only its own
        # sequence's (reverse=True then meets each sequence's tokens last to first, as it should).
        sequence_ids = prepare_sequence_ids(cu_seqlens, total_tokens=seq_len)

        def step(states, x):
            seq, (q_t, k_t, v_t, a_k, a_v) = x[0], x[1:]
            slot = jnp.maximum(seq, 0)
            h, o_t = update(states[slot], q_t[0], k_t[0], v_t[0], a_k[0], a_v[0])
            valid = seq >= 0
            states = states.at[slot].set(jnp.where(valid, h, states[slot]))
            return states, jnp.where(valid, o_t, 0)[None]

        final_state, o = jax.lax.scan(step, h0, (sequence_ids, *xs), reverse=reverse)
    return jnp.moveaxis(o, 0, 1).astype(query.dtype), final_state



# ----------------------------------------------------------------------------------------------
# The Triton kernels.
#
# Every kernel walks a sequence token by token, and a step does little arithmetic: its time is
# mostly the latency of loading that token's vectors. So each walk loads token i + 1's vectors
# while it works on token i (software prefetch, one token ahead): on an H100 that made the walks
# about 2.5x faster. (The loop bodies call one helper, _load_token, per token and nothing else:
# each call of a @triton.jit function is slow in Triton's interpreter, which runs the tests on CPU.)
#
# The kernels' own signatures are flat (jax-triton passes one pointer per array); they group what
# the helpers need at once: ``ins``, the per-token inputs advanced to this program's head, as one
# tuple; ``walk``, where this program's walk goes (from ``_walk_start``, the one preamble of all
# three walks); ``outs``, the outputs advanced to this program's tile and head. Flags follow
# flash-linear-attention: USE_* for an optional input, IS_VARLEN for packed sequences.
# ----------------------------------------------------------------------------------------------


@triton.jit
def _sequence_bounds(cu_seqlens, i_n, seq_len, seqs_per_row, IS_VARLEN: tl.constexpr):
    """First and one-past-last token of sequence ``i_n`` in the flattened [B * T] token axis.

    With packing, sequence ``i_n`` is sequence ``i_n % seqs_per_row`` of row
    ``i_n // seqs_per_row``: the rows share ``cu_seqlens`` (there are several only when
    ``jax.vmap`` folded a mapped axis into the batch)."""
    if IS_VARLEN:
        row = i_n // seqs_per_row
        i_s = i_n % seqs_per_row
        # Clamped (the launch already hands over a valid packing; this is the second line of
        # defence): whatever cu_seqlens holds, the walk stays inside its row.
        start = tl.minimum(tl.maximum(tl.load(cu_seqlens + i_s), 0), seq_len)
        end = tl.minimum(tl.maximum(tl.load(cu_seqlens + i_s + 1), start), seq_len)
        bos = row.to(tl.int64) * seq_len + start
        eos = row.to(tl.int64) * seq_len + end
    else:
        bos = i_n.to(tl.int64) * seq_len
        eos = bos + seq_len
    return bos, eos


@triton.jit
def _walk_start(cu_seqlens, g_gamma, i_v, i_k, i_nh, seq_len, seqs_per_row,
                H: tl.constexpr, K: tl.constexpr, V: tl.constexpr, BK: tl.constexpr, BV: tl.constexpr,
                USE_G_GAMMA: tl.constexpr, BACKWARDS: tl.constexpr, IS_VARLEN: tl.constexpr):
    """Where the walk of program ``(i_v, i_k, i_nh)`` goes: ``(i_h, walk)``.

    The program owns V tile ``i_v`` and K tile ``i_k`` of the state of query head ``i_h`` of
    sequence ``i_nh // H``. ``walk = (first, step, n, a0, offs_k, offs_v, state)``: it visits the
    ``n`` tokens ``first + i * step`` (``step = -1`` walking ``BACKWARDS``, from the last token);
    ``a0`` is the head's constant log-decay ``g_gamma`` (0 without it); ``offs_k`` / ``offs_v``
    are the tile's columns and ``state`` the offsets of its ``[BK, BV]`` block in a ``[N, H, K, V]``
    state.
    """
    i_n, i_h = i_nh // H, i_nh % H
    bos, eos = _sequence_bounds(cu_seqlens, i_n, seq_len, seqs_per_row, IS_VARLEN)
    if BACKWARDS:
        first, step = eos - 1, -1
    else:
        first, step = bos, 1
    offs_k = i_k * BK + tl.arange(0, BK)
    offs_v = i_v * BV + tl.arange(0, BV)
    state = i_nh.to(tl.int64) * K * V + offs_k[:, None] * V + offs_v[None, :]
    a0 = 0.0
    if USE_G_GAMMA:
        a0 = tl.load(g_gamma + i_h).to(tl.float32)
    return i_h, (first, step, eos - bos, a0, offs_k, offs_v, state)


@triton.jit
def _head_inputs(q, k, v, do, g, gk, gv, i_h,
                 H: tl.constexpr, H_KV: tl.constexpr, K: tl.constexpr, V: tl.constexpr):
    """The per-token inputs advanced to query head ``i_h`` (and its key/value head), as one tuple;
    token ``t``'s vector then sits ``t`` token strides further (see ``_load_token``)."""
    i_kv = i_h // (H // H_KV)
    return (q + i_h * K, k + i_kv * K, v + i_kv * V, do + i_h * V, g + i_h, gk + i_h * K, gv + i_h * V)


@triton.jit
def _load_token(ins, tok, valid, a0, offs_k, offs_v,
                H: tl.constexpr, H_KV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
                BK: tl.constexpr, BV: tl.constexpr, LOAD_Q: tl.constexpr, LOAD_DO: tl.constexpr,
                USE_G: tl.constexpr, USE_GK: tl.constexpr, USE_GV: tl.constexpr):
    """Token ``tok``'s vectors in fp32: q, k, v, do (where asked for) and the log-decays ``a``
    (along K) and ``b`` (along V). Nothing is read when ``valid`` is false (the prefetch past the
    last token)."""
    q, k, v, do, g, gk, gv = ins
    mask_k, mask_v = (offs_k < K) & valid, (offs_v < V) & valid
    b_k = tl.load(k + tok * (H_KV * K) + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    b_v = tl.load(v + tok * (H_KV * V) + offs_v, mask=mask_v, other=0.0).to(tl.float32)
    b_q = tl.zeros([BK], dtype=tl.float32)
    if LOAD_Q:
        b_q = tl.load(q + tok * (H * K) + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    b_do = tl.zeros([BV], dtype=tl.float32)
    if LOAD_DO:
        b_do = tl.load(do + tok * (H * V) + offs_v, mask=mask_v, other=0.0).to(tl.float32)
    b_a = tl.zeros([BK], dtype=tl.float32) + a0
    if USE_G:
        b_a += tl.load(g + tok * H, mask=valid, other=0.0).to(tl.float32)
    if USE_GK:
        b_a += tl.load(gk + tok * (H * K) + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    b_b = tl.zeros([BV], dtype=tl.float32)
    if USE_GV:
        b_b = tl.load(gv + tok * (H * V) + offs_v, mask=mask_v, other=0.0).to(tl.float32)
    return b_q, b_k, b_v, b_do, b_a, b_b


@triton.jit
def _forward_kernel(
    q, k, v, g, g_gamma, gk, gv, h0, cu_seqlens,  # inputs; an absent one is a 1-element stand-in
    seq_len, total_tokens, seqs_per_row,
    o, ht,  # outputs: o as [NK, B * T, H, V] partials over K tiles, ht [N, H, K, V] fp32
    H: tl.constexpr, H_KV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, SCALE: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    USE_G: tl.constexpr, USE_G_GAMMA: tl.constexpr, USE_GK: tl.constexpr, USE_GV: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr, REVERSE: tl.constexpr, IS_VARLEN: tl.constexpr,
):
    K_DECAY: tl.constexpr = USE_G or USE_G_GAMMA or USE_GK
    i_v, i_k, i_nh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    i_h, walk = _walk_start(cu_seqlens, g_gamma, i_v, i_k, i_nh, seq_len, seqs_per_row,
                            H, K, V, BK, BV, USE_G_GAMMA, REVERSE, IS_VARLEN)
    first, step, n, a0, offs_k, offs_v, state = walk
    ins = _head_inputs(q, k, v, q, g, gk, gv, i_h, H, H_KV, K, V)  # no do: q stands in
    o += (i_k.to(tl.int64) * total_tokens * H + i_h) * V  # this K tile's partial, head i_h
    mask_v = offs_v < V
    mask_h = (offs_k < K)[:, None] & mask_v[None, :]

    h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_INITIAL_STATE:
        h += tl.load(h0 + state, mask=mask_h, other=0.0).to(tl.float32)
    nq, nk, nv, _, na, nb = _load_token(ins, first, n > 0, a0, offs_k, offs_v, H, H_KV, K, V, BK, BV,
                                        True, False, USE_G, USE_GK, USE_GV)
    for i in range(0, n):
        b_q, b_k, b_v, b_a, b_b = nq, nk, nv, na, nb
        nq, nk, nv, _, na, nb = _load_token(ins, first + (i + 1) * step, i + 1 < n, a0, offs_k, offs_v,
                                            H, H_KV, K, V, BK, BV, True, False, USE_G, USE_GK, USE_GV)
        if K_DECAY:
            h = h * tl.exp(b_a)[:, None]
        if USE_GV:
            h = h * tl.exp(b_b)[None, :]
        h += b_k[:, None] * b_v[None, :]
        b_o = tl.sum(h * (b_q * SCALE)[:, None], axis=0)
        tok = first + i * step
        tl.store(o + tok * (H * V) + offs_v, b_o.to(o.dtype.element_ty), mask=mask_v)

    tl.store(ht + state, h, mask=mask_h)


@triton.jit
def _dq_walk(ins, outs, h0, dht, walk, SCALE: tl.constexpr,
             H: tl.constexpr, H_KV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
             BK: tl.constexpr, BV: tl.constexpr, K_DECAY: tl.constexpr,
             USE_G: tl.constexpr, USE_GK: tl.constexpr, USE_GV: tl.constexpr,
             USE_INITIAL_STATE: tl.constexpr, USE_DHT: tl.constexpr):
    # The forward walk again, recomputing the state, for dq_t = scale * h_t do_t. Splitting
    # h_t = P_t + k_t^T v_t, with P_t = decay_t * h_{t-1}, gives dq_t = scale * (P_t do_t + k_t (v_t . do_t)).
    # The gates need only the first part, so it is written out on its own (times q_t), and so is
    # the final state's share sum_V(P_T * dh_final) from the last step.
    first, step, n, a0, offs_k, offs_v, state = walk
    dq, q_dq, o_do, last_k, last_v = outs
    GATED: tl.constexpr = K_DECAY or USE_GV
    mask_k, mask_v = offs_k < K, offs_v < V
    mask_h = mask_k[:, None] & mask_v[None, :]

    h = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_INITIAL_STATE:
        h += tl.load(h0 + state, mask=mask_h, other=0.0).to(tl.float32)
    h_decayed = tl.zeros([BK, BV], dtype=tl.float32)
    nq, nk, nv, ndo, na, nb = _load_token(ins, first, n > 0, a0, offs_k, offs_v, H, H_KV, K, V, BK, BV,
                                          GATED, True, USE_G, USE_GK, USE_GV)
    for i in range(0, n):
        b_q, b_k, b_v, b_do, b_a, b_b = nq, nk, nv, ndo, na, nb
        nq, nk, nv, ndo, na, nb = _load_token(ins, first + (i + 1) * step, i + 1 < n, a0, offs_k, offs_v,
                                              H, H_KV, K, V, BK, BV, GATED, True, USE_G, USE_GK, USE_GV)
        tok = first + i * step
        if K_DECAY:  # h becomes P_t = decay_t * h_{t-1}
            h = h * tl.exp(b_a)[:, None]
        if USE_GV:
            h = h * tl.exp(b_b)[None, :]
        if GATED and USE_DHT:
            h_decayed = h
        b_h_do = tl.sum(h * b_do[None, :], axis=1)
        b_dq = SCALE * (b_h_do + b_k * tl.sum(b_v * b_do))
        tl.store(dq + tok * (H * K) + offs_k, b_dq, mask=mask_k)
        if K_DECAY:
            tl.store(q_dq + tok * (H * K) + offs_k, SCALE * b_q * b_h_do, mask=mask_k)
        if USE_GV:
            b_q_h = tl.sum(h * (b_q * SCALE)[:, None], axis=0)
            tl.store(o_do + tok * (H * V) + offs_v, b_q_h * b_do, mask=mask_v)
        h += b_k[:, None] * b_v[None, :]

    if GATED and USE_DHT:  # (zero for an empty sequence)
        last_dh = h_decayed * tl.load(dht + state, mask=mask_h, other=0.0)
        if K_DECAY:
            tl.store(last_k + offs_k, tl.sum(last_dh, axis=1), mask=mask_k)
        if USE_GV:
            tl.store(last_v + offs_v, tl.sum(last_dh, axis=0), mask=mask_v)


@triton.jit
def _dkv_walk(ins, outs, dht, walk, SCALE: tl.constexpr,
              H: tl.constexpr, H_KV: tl.constexpr, K: tl.constexpr, V: tl.constexpr,
              BK: tl.constexpr, BV: tl.constexpr, K_DECAY: tl.constexpr,
              USE_G: tl.constexpr, USE_GK: tl.constexpr, USE_GV: tl.constexpr,
              USE_INITIAL_STATE: tl.constexpr, USE_DHT: tl.constexpr):
    # The reverse walk. `dh` carries decay_{t+1} * dH_{t+1}, the gradient reaching h_t from later
    # tokens (the final state's cotangent at the start). At token t:
    #     dH_t = dh + scale * q_t^T do_t
    #     dk_t = dH_t v_t   = dh v_t   + scale * q_t (do_t . v_t)
    #     dv_t = dH_t^T k_t = dh^T k_t + scale * do_t (q_t . k_t)
    # The gates' per-token terms are -k_t * (dh v_t) and -v_t * (dh^T k_t), except at the
    # sequence's last token (this walk's first), where they cancel against the final state's share.
    first, step, n, a0, offs_k, offs_v, state = walk
    dk, dv, k_dh_v, v_dh_k, dh0 = outs
    mask_k, mask_v = offs_k < K, offs_v < V
    mask_h = mask_k[:, None] & mask_v[None, :]

    dh = tl.zeros([BK, BV], dtype=tl.float32)
    if USE_DHT:
        dh += tl.load(dht + state, mask=mask_h, other=0.0).to(tl.float32)
    nq, nk, nv, ndo, na, nb = _load_token(ins, first, n > 0, a0, offs_k, offs_v, H, H_KV, K, V, BK, BV,
                                          True, True, USE_G, USE_GK, USE_GV)
    for i in range(0, n):
        b_q, b_k, b_v, b_do, b_a, b_b = nq, nk, nv, ndo, na, nb
        nq, nk, nv, ndo, na, nb = _load_token(ins, first + (i + 1) * step, i + 1 < n, a0, offs_k, offs_v,
                                              H, H_KV, K, V, BK, BV, True, True, USE_G, USE_GK, USE_GV)
        tok = first + i * step
        b_q = b_q * SCALE
        b_dh_v = tl.sum(dh * b_v[None, :], axis=1)
        b_dh_k = tl.sum(dh * b_k[:, None], axis=0)
        tl.store(dk + tok * (H * K) + offs_k, b_dh_v + b_q * tl.sum(b_do * b_v), mask=mask_k)
        tl.store(dv + tok * (H * V) + offs_v, b_dh_k + b_do * tl.sum(b_q * b_k), mask=mask_v)
        if K_DECAY:
            tl.store(k_dh_v + tok * (H * K) + offs_k, tl.where(i > 0, -b_k * b_dh_v, 0.0), mask=mask_k)
        if USE_GV:
            tl.store(v_dh_k + tok * (H * V) + offs_v, tl.where(i > 0, -b_v * b_dh_k, 0.0), mask=mask_v)
        dh += b_q[:, None] * b_do[None, :]  # dH_t
        if K_DECAY:  # decay_t * dH_t, for the token before
            dh = dh * tl.exp(b_a)[:, None]
        if USE_GV:
            dh = dh * tl.exp(b_b)[None, :]

    if USE_INITIAL_STATE:
        tl.store(dh0 + state, dh, mask=mask_h)


@triton.jit
def _backward_kernel(
    q, k, v, g, g_gamma, gk, gv, h0, cu_seqlens, do, dht,
    seq_len, total_tokens, seqs_per_row,
    dq, q_dq, o_do, last_k, last_v, dk, dv, k_dh_v, v_dh_k, dh0,  # outputs, fp32; see _bwd
    H: tl.constexpr, H_KV: tl.constexpr, K: tl.constexpr, V: tl.constexpr, SCALE: tl.constexpr,
    BK: tl.constexpr, BV: tl.constexpr,
    USE_G: tl.constexpr, USE_G_GAMMA: tl.constexpr, USE_GK: tl.constexpr, USE_GV: tl.constexpr,
    USE_INITIAL_STATE: tl.constexpr, USE_DHT: tl.constexpr, REVERSE: tl.constexpr,
    IS_VARLEN: tl.constexpr,
):
    # The two walks of the backward do not depend on each other, so one launch runs both side by
    # side: programs 0 .. N*H - 1 (along the last grid axis) walk forwards for dq, the rest backwards
    # for dk, dv and d initial_state. Each walk is latency-bound, so together they take about as
    # long as one.
    K_DECAY: tl.constexpr = USE_G or USE_G_GAMMA or USE_GK
    i_v, i_k, i_nh = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    num_walks = tl.num_programs(2) // 2
    if i_nh < num_walks:
        i_h, dq_walk = _walk_start(cu_seqlens, g_gamma, i_v, i_k, i_nh, seq_len, seqs_per_row,
                                   H, K, V, BK, BV, USE_G_GAMMA, REVERSE, IS_VARLEN)
        rows_k = (i_v.to(tl.int64) * total_tokens * H + i_h) * K  # partials over V tiles, head i_h
        rows_v = (i_k.to(tl.int64) * total_tokens * H + i_h) * V  # partials over K tiles
        _dq_walk(_head_inputs(q, k, v, do, g, gk, gv, i_h, H, H_KV, K, V),
                 (dq + rows_k, q_dq + rows_k, o_do + rows_v,
                  last_k + (i_v.to(tl.int64) * num_walks + i_nh) * K,
                  last_v + (i_k.to(tl.int64) * num_walks + i_nh) * V),
                 h0, dht, dq_walk, SCALE, H, H_KV, K, V, BK, BV, K_DECAY, USE_G, USE_GK, USE_GV,
                 USE_INITIAL_STATE, USE_DHT)
    else:
        i_h, dkv_walk = _walk_start(cu_seqlens, g_gamma, i_v, i_k, i_nh - num_walks, seq_len, seqs_per_row,
                                    H, K, V, BK, BV, USE_G_GAMMA, not REVERSE, IS_VARLEN)
        rows_k = (i_v.to(tl.int64) * total_tokens * H + i_h) * K
        rows_v = (i_k.to(tl.int64) * total_tokens * H + i_h) * V
        _dkv_walk(_head_inputs(q, k, v, do, g, gk, gv, i_h, H, H_KV, K, V),
                  (dk + rows_k, dv + rows_v, k_dh_v + rows_k, v_dh_k + rows_v, dh0),
                  dht, dkv_walk, SCALE, H, H_KV, K, V, BK, BV, K_DECAY, USE_G, USE_GK, USE_GV,
                  USE_INITIAL_STATE, USE_DHT)


# ----------------------------------------------------------------------------------------------
# Launch wrappers.
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class RecurrentConfig:
    """Tiles of the Triton kernels, per direction: ``fwd_*`` for the forward kernel, ``bwd_*`` for
    the backward one (which recomputes the state itself, so its tiles need not match).

    Every kernel works on ``[block_k, block_v]`` tiles of the fp32 state (powers of two).
    ``None`` fields are chosen from K and V (:meth:`blocks`); ``RecurrentConfig()`` (or
    ``config=None``) is the shipped default. There are no pipeline stages to set: the walks
    prefetch one token ahead by hand (a loop whose trip count is the sequence's length, carrying
    the state, is not one Triton's pipeliner helps).
    """

    fwd_block_k: int | None = None
    fwd_block_v: int | None = None
    fwd_num_warps: int | None = None
    bwd_block_k: int | None = None
    bwd_block_v: int | None = None
    bwd_num_warps: int | None = None

    def __post_init__(self):
        freeze_fields(self, validated_fields(self, powers_of_two=tuple(f.name for f in dataclasses.fields(self))))

    def blocks(self, direction: str, key_dim: int, value_dim: int) -> tuple[int, int, int]:
        """``(BK, BV, num_warps)`` of ``direction`` (``"fwd"`` or ``"bwd"``).

        The defaults: a step of a walk costs about one memory latency (partly hidden by the
        prefetch) however little it computes, so speed comes from many small programs running
        side by side. A tile takes all of K (up to 128), so the output needs no sum over K
        tiles, and V is cut into narrow tiles: 16 columns next to K = 128, 8 next to smaller K.
        Measured on an H100 (bf16, B=4, T=4096, H=16, K=V=128): 1.9 ms forward, 12 ms forward +
        backward. Wider V tiles, more or fewer warps, and cutting K instead in the backward all
        measured slower. Both directions default to the same tiles.
        """
        block_k = getattr(self, f"{direction}_block_k") or min(next_power_of_2(max(key_dim, 1)), 128)
        block_v = getattr(self, f"{direction}_block_v") or min(next_power_of_2(max(value_dim, 1)),
                                                               16 if block_k >= 128 else 8)
        num_warps = getattr(self, f"{direction}_num_warps") or (
            4 if block_k * block_v >= 2048 else (2 if block_k * block_v >= 512 else 1))
        return block_k, block_v, num_warps


def _flags(g, g_gamma, gk, gv, initial_state, reverse, cu_seqlens) -> dict[str, bool]:
    """The kernels' flags: which optional inputs there are, the direction, packing."""
    return dict(
        USE_G=g is not None, USE_G_GAMMA=g_gamma is not None, USE_GK=gk is not None,
        USE_GV=gv is not None, USE_INITIAL_STATE=initial_state is not None,
        REVERSE=bool(reverse), IS_VARLEN=cu_seqlens is not None,
    )


def _gated(flags: dict[str, bool]) -> tuple[bool, bool]:
    """Whether the state decays along K (g, g_gamma or gk) and along V (gv)."""
    return flags["USE_G"] or flags["USE_G_GAMMA"] or flags["USE_GK"], flags["USE_GV"]


def _or_stand_in(x: Array | None, dtype=jnp.float32) -> Array:
    """Kernels take a pointer for every optional input; an absent one gets a 1-element stand-in."""
    return jnp.zeros((1,), dtype) if x is None else x


def _valid_tokens(cu_seqlens: Array | None, seq_len: int) -> Array | None:
    """With packing, which tokens of the row belong to a sequence (the rest are never visited)."""
    return None if cu_seqlens is None else (jnp.arange(seq_len) < cu_seqlens[-1])[:, None, None]


# Under jax.vmap the kernels' launches fold the mapped axis into the batch: q, k, v, the per-token
# gates, do and the states have one (axis 0), and with packing every row of the batch holds the
# same sequences (_sequence_bounds). cu_seqlens has none: mapped, it gives every element its own
# packing, and the launches run one element at a time. A mapped g_gamma is added to g first.
# In the order of the launches' arguments: query, key, value, g, g_gamma, gk, gv, initial_state,
# cu_seqlens, and in the backward d_o, d_final_state.
_IN_AXES = (0, 0, 0, 0, None, 0, 0, 0, None, 0, 0)
_MAX_GRID_Z = 65535  # CUDA's limit on the 3rd grid dimension, along which the walks run


def _gamma_into_g(axis_size, args, batched):
    """``prepare`` for ``vmap_by_folding``: a mapped ``g_gamma`` ``[H]`` has no batch axis to fold
    into, but the kernels only ever use ``g + g_gamma`` (in float32): hand them that as ``g``.
    The gates' gradients are computed from the kernels' per-token terms, which do not change."""
    if not batched[4]:
        return args, batched
    query, g, g_gamma = args[0], args[3], args[4]
    batch, seq_len, num_heads = query.shape[-4:-1]
    gates = jnp.zeros((), jnp.float32) if g is None else g.astype(jnp.float32)
    if g is not None and not batched[3]:
        gates = gates[None]
    gates = gates + g_gamma.astype(jnp.float32)[:, None, None, :]
    args, batched = list(args), list(batched)
    args[3] = jnp.broadcast_to(gates, (axis_size, batch, seq_len, num_heads))
    args[4] = None
    batched[3], batched[4] = True, False
    return args, batched


def _launch_sizes(query, cu_seqlens):
    """(number of sequences, sequences per row, tokens) of a launch; the batch may be folded."""
    batch, seq_len = query.shape[:2]
    per_row = 1 if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return batch * per_row, per_row, batch * seq_len


def _check_grid(programs: int) -> None:
    """One program per sequence and head along the grid's third axis (two in the backward)."""
    if programs > _MAX_GRID_Z:
        raise ValueError(f"{programs} programs along the grid's third axis (one per sequence x "
                         f"head, two in the backward, times the sizes of any vmapped axes) exceed "
                         f"CUDA's limit of {_MAX_GRID_Z}")


def _forward_launch(scale, reverse, config, query, key, value, g, g_gamma, gk, gv, initial_state,
                    cu_seqlens):
    """The forward kernel: ``o`` as partials over K tiles ``[NK, B * T, H, V]``, and the final
    state ``[N, H, K, V]`` (with packing, N = B * sequences per row)."""
    _, seq_len, num_heads, key_dim = query.shape
    num_kv_heads, value_dim = value.shape[2], value.shape[3]
    num_seqs, per_row, total_tokens = _launch_sizes(query, cu_seqlens)
    _check_grid(num_seqs * num_heads)
    block_k, block_v, num_warps = config.blocks("fwd", key_dim, value_dim)
    num_k_tiles, num_v_tiles = cdiv(key_dim, block_k), cdiv(value_dim, block_v)
    f32 = jnp.float32
    return triton_call(
        query, key, value, _or_stand_in(g), _or_stand_in(g_gamma), _or_stand_in(gk),
        _or_stand_in(gv), _or_stand_in(initial_state), _or_stand_in(cu_seqlens, jnp.int32),
        seq_len, total_tokens, per_row,
        kernel=_forward_kernel,
        out_shape=[jax.ShapeDtypeStruct((num_k_tiles, total_tokens, num_heads, value_dim),
                                        query.dtype if num_k_tiles == 1 else f32),
                   jax.ShapeDtypeStruct((num_seqs, num_heads, key_dim, value_dim), f32)],
        grid=(num_v_tiles, num_k_tiles, num_seqs * num_heads), num_warps=num_warps,
        config_argument="config",
        H=num_heads, H_KV=num_kv_heads, K=key_dim, V=value_dim, SCALE=float(scale),
        BK=block_k, BV=block_v, **_flags(g, g_gamma, gk, gv, initial_state, reverse, cu_seqlens),
    )


def _fwd(scale, reverse, config,
             query, key, value, g, g_gamma, gk, gv, initial_state, cu_seqlens):
    batch, seq_len, num_heads, key_dim = query.shape
    num_kv_heads, value_dim = value.shape[2], value.shape[3]
    num_seqs = batch if cu_seqlens is None else cu_seqlens.shape[0] - 1
    total_tokens = batch * seq_len
    f32 = jnp.float32
    # Nothing to walk: no sequence, no token, or an empty state (K = 0 or V = 0: o = q h is 0).
    if num_seqs * num_heads * key_dim * value_dim == 0 or total_tokens == 0:
        o = jnp.zeros((batch, seq_len, num_heads, value_dim), query.dtype)
        h0 = jnp.zeros((num_seqs, num_heads, key_dim, value_dim), f32) if initial_state is None else initial_state
        return o, h0.astype(f32)

    launch = vmap_by_folding(functools.partial(_forward_launch, scale, reverse, config),
                             in_axes=_IN_AXES, out_axes=(1, 0), prepare=_gamma_into_g)
    o_parts, final_state = launch(query, key, value, g, g_gamma, gk, gv, initial_state, cu_seqlens)
    o = o_parts.sum(0, dtype=f32) if o_parts.shape[0] > 1 else o_parts[0]
    valid = _valid_tokens(cu_seqlens, seq_len)
    if valid is not None:
        o = jnp.where(valid, o, 0)
    return o.astype(query.dtype).reshape(batch, seq_len, num_heads, value_dim), final_state


def _backward_launch(scale, reverse, config, query, key, value, g, g_gamma, gk, gv, initial_state,
                     cu_seqlens, d_o, d_final_state):
    """The backward kernel's ten outputs, fp32 partials over state tiles (see ``_bwd``)."""
    _, seq_len, num_heads, key_dim = query.shape
    num_kv_heads, value_dim = value.shape[2], value.shape[3]
    num_seqs, per_row, total_tokens = _launch_sizes(query, cu_seqlens)
    _check_grid(2 * num_seqs * num_heads)
    f32 = jnp.float32
    flags = _flags(g, g_gamma, gk, gv, initial_state, reverse, cu_seqlens)
    gated_k, gated_v = _gated(flags)
    has_dht = d_final_state is not None
    last_needed = has_dht and (gated_k or gated_v)
    block_k, block_v, num_warps = config.blocks("bwd", key_dim, value_dim)
    num_k_tiles, num_v_tiles = cdiv(key_dim, block_k), cdiv(value_dim, block_v)

    def partials(num_tiles, rows, size, needed=True):  # fp32 per-tile partial sums (or a stand-in)
        return jax.ShapeDtypeStruct((num_tiles, rows, num_heads, size) if needed else (1,), f32)

    return triton_call(
        query, key, value, _or_stand_in(g), _or_stand_in(g_gamma), _or_stand_in(gk),
        _or_stand_in(gv), _or_stand_in(initial_state), _or_stand_in(cu_seqlens, jnp.int32), d_o,
        _or_stand_in(d_final_state), seq_len, total_tokens, per_row,
        kernel=_backward_kernel,
        out_shape=[partials(num_v_tiles, total_tokens, key_dim),                    # dq
                   partials(num_v_tiles, total_tokens, key_dim, gated_k),           # q * dq (P)
                   partials(num_k_tiles, total_tokens, value_dim, gated_v),         # o * do (P)
                   partials(num_v_tiles, num_seqs, key_dim, last_needed and gated_k),    # final
                   partials(num_k_tiles, num_seqs, value_dim, last_needed and gated_v),  # state's
                   partials(num_v_tiles, total_tokens, key_dim),                    # dk
                   partials(num_k_tiles, total_tokens, value_dim),                  # dv
                   partials(num_v_tiles, total_tokens, key_dim, gated_k),           # -k * (dh v)
                   partials(num_k_tiles, total_tokens, value_dim, gated_v),         # -v (dh^T k)
                   jax.ShapeDtypeStruct((num_seqs, num_heads, key_dim, value_dim)
                                        if initial_state is not None else (1,), f32)],
        grid=(num_v_tiles, num_k_tiles, 2 * num_seqs * num_heads), num_warps=num_warps,
        config_argument="config",
        H=num_heads, H_KV=num_kv_heads, K=key_dim, V=value_dim, SCALE=float(scale),
        BK=block_k, BV=block_v, USE_DHT=has_dht, **flags,
    )


def _bwd(scale, reverse, config, residuals, cotangents):
    query, key, value, g, g_gamma, gk, gv, initial_state, cu_seqlens = residuals
    d_o, d_final_state = cotangents
    if isinstance(d_o, jax.custom_derivatives.SymbolicZero):  # only final_state was used
        d_o = jnp.zeros(d_o.shape, d_o.dtype)
    has_dht = not isinstance(d_final_state, jax.custom_derivatives.SymbolicZero)
    batch, seq_len, num_heads, key_dim = query.shape
    num_kv_heads, value_dim = value.shape[2], value.shape[3]
    group = num_heads // num_kv_heads
    num_seqs = batch if cu_seqlens is None else cu_seqlens.shape[0] - 1
    total_tokens = batch * seq_len
    state_shape = (num_seqs, num_heads, key_dim, value_dim)
    f32 = jnp.float32
    flags = _flags(g, g_gamma, gk, gv, initial_state, reverse, cu_seqlens)
    gated_k, gated_v = _gated(flags)

    if num_seqs * num_heads * key_dim * value_dim == 0 or total_tokens == 0:
        # Nothing was walked: the state passed straight through, and nothing reached o.
        dq, dk, dlog_k = (jnp.zeros((batch, seq_len, num_heads, key_dim), f32),) * 3
        dv, dlog_v = (jnp.zeros((batch, seq_len, num_heads, value_dim), f32),) * 2
        dh0 = d_final_state if has_dht else jnp.zeros(state_shape, f32)
    else:
        last_needed = has_dht and (gated_k or gated_v)
        # Where each output's batch rows are (None: a 1-element stand-in, not computed).
        out_axes = (1, 1 if gated_k else None, 1 if gated_v else None,
                    1 if last_needed and gated_k else None, 1 if last_needed and gated_v else None,
                    1, 1, 1 if gated_k else None, 1 if gated_v else None,
                    0 if initial_state is not None else None)
        launch = vmap_by_folding(functools.partial(_backward_launch, scale, reverse, config),
                                 in_axes=_IN_AXES, out_axes=out_axes, prepare=_gamma_into_g)
        (dq_parts, q_dq_parts, o_do_parts, last_k, last_v, dk_parts, dv_parts, k_dh_v_parts, v_dh_k_parts,
         dh0) = launch(query, key, value, g, g_gamma, gk, gv, initial_state, cu_seqlens, d_o,
                       d_final_state if has_dht else None)

        valid = _valid_tokens(cu_seqlens, seq_len)

        def finish(*parts):  # sum the tile partials, zero the tokens outside every sequence
            x = sum(p.sum(0) for p in parts)
            if valid is not None:
                x = jnp.where(valid, x, 0)
            return x

        def gate_gradient(token_terms, last_share):
            """dL/d(log-decay) at each token: the suffix sum, in walking order, of the per-token
            terms, plus the final state's share, which belongs to each sequence's last token."""
            if last_needed:
                last_share = last_share.sum(0)  # [N, H, D]
                if cu_seqlens is None:
                    last_token = jnp.arange(num_seqs) * seq_len + (0 if reverse else seq_len - 1)
                else:
                    ends = cu_seqlens[:-1] if reverse else cu_seqlens[1:] - 1
                    empty = cu_seqlens[1:] == cu_seqlens[:-1]  # no last token: drop its share
                    last_token = jnp.where(empty, total_tokens, ends)
                token_terms = token_terms.at[last_token].add(last_share, mode="drop")
            return chunk_global_cumsum(token_terms.reshape(batch, seq_len, num_heads, -1), reverse=not reverse,
                                       cu_seqlens=cu_seqlens)

        dq, dk, dv = finish(dq_parts), finish(dk_parts), finish(dv_parts)
        dlog_k = gate_gradient(finish(q_dq_parts, k_dh_v_parts), last_k) if gated_k else None
        dlog_v = gate_gradient(finish(o_do_parts, v_dh_k_parts), last_v) if gated_v else None
        dq, dk = dq.reshape(batch, seq_len, num_heads, key_dim), dk.reshape(batch, seq_len, num_heads, key_dim)
        dv = dv.reshape(batch, seq_len, num_heads, value_dim)

    def grouped(x):  # a key/value head's gradient sums over the query heads it serves
        return x.reshape(batch, seq_len, num_kv_heads, group, x.shape[-1]).sum(3)

    def cast(x, like):
        return None if like is None else x.astype(like.dtype)

    return (
        cast(dq, query), cast(grouped(dk), key), cast(grouped(dv), value),
        cast(dlog_k.sum(-1) if g is not None else None, g),
        cast(dlog_k.sum((0, 1, 3)) if g_gamma is not None else None, g_gamma),
        cast(dlog_k, gk), cast(dlog_v, gv), cast(dh0, initial_state),
        None,  # cu_seqlens: integer, no gradient
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def _recurrent_triton(scale, reverse, config, query, key, value, g, g_gamma, gk, gv, initial_state,
                      cu_seqlens):
    return _fwd(scale, reverse, config, query, key, value, g, g_gamma, gk, gv, initial_state, cu_seqlens)


def _vjp_fwd(scale, reverse, config, *primals):
    # With symbolic_zeros=True each array argument arrives as a CustomVJPPrimal (value, perturbed).
    primals = [None if p is None else p.value for p in primals]
    o, final_state = _fwd(scale, reverse, config, *primals)
    return (o, final_state), tuple(primals)


# symbolic_zeros: when the caller ignores final_state, its cotangent arrives as a SymbolicZero and
# the reverse sweep skips it instead of reading a tensor of zeros.
_recurrent_triton.defvjp(_vjp_fwd, _bwd, symbolic_zeros=True)


@functools.partial(jax.jit, static_argnums=(0, 1, 2, 3))
def _recurrent_jit(impl, scale, reverse, config, query, key, value, g, g_gamma, gk, gv, initial_state,
                   cu_seqlens):
    if cu_seqlens is not None:
        # Traced values were not checked: both implementations get the nearest valid packing, so
        # that no kernel can be sent outside its arrays (and the two agree even on garbage).
        # (cu_seqlens gets no gradient.)
        cu_seqlens = sanitize_cu_seqlens(cu_seqlens, query.shape[1])
    if impl == "xla":
        return reference(query, key, value, g, g_gamma, gk, gv, scale, initial_state, reverse, cu_seqlens)
    return _recurrent_triton(scale, reverse, config, query, key, value, g, g_gamma, gk, gv,
                             initial_state, cu_seqlens)


def recurrent(
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
    *,
    impl: str = "auto",
    config: RecurrentConfig | None = None,
    sequence_parallelism_mesh_axis_name: str | None = None,
) -> tuple[Array, Array]:
    """Recurrent linear attention, differentiable in every array argument.

    Args:
        query: ``[B, T, H, K]``.
        key: ``[B, T, H_kv, K]`` with ``H % H_kv == 0`` (grouped heads).
        value: ``[B, T, H_kv, V]``.
        g: ``[B, T, H]`` log-decay, one per head and token (GLA with a scalar gate).
        g_gamma: ``[H]`` fixed log-decay per head (Lightning attention / RetNet style).
        gk: ``[B, T, H, K]`` log-decay along K.
        gv: ``[B, T, H, V]`` log-decay along V.
        softmax_scale: multiplies the query; ``K ** -0.5`` by default. A Python or NumPy number
            (static).
        initial_state: ``[N, H, K, V]`` state before the first token of each sequence.
        reverse: walk every sequence from its last token to its first.
        cu_seqlens: ``[N + 1]`` int offsets of N sequences packed in a batch of 1. Tokens past
            ``cu_seqlens[-1]`` belong to no sequence; their output is zero. Checked when
            concrete; traced under ``jax.jit``, invalid values are replaced by the nearest valid
            packing (:func:`ejk_lite.packing.sanitize_cu_seqlens`): wrong numbers, never a crash.
        impl: ``"triton"`` (the kernels; float16, bfloat16 or float32), ``"xla"`` (:func:`reference`,
            a ``lax.scan``; any floating dtype) or ``"auto"`` (Triton on a GPU, else XLA).
        config: a :class:`RecurrentConfig` for the Triton kernels; ``None``: the defaults.
        sequence_parallelism_mesh_axis_name: inside ``jax.shard_map``, the mesh axis the sequence
            is split over: per-token arrays are this shard's slices, ``cu_seqlens`` the global
            offsets (:mod:`ejk_lite.sequence_parallel`).

    Returns:
        ``(o, final_state)``: ``o`` ``[B, T, H, V]`` in the query's dtype and ``final_state``
        ``[N, H, K, V]`` in float32 (N = B without ``cu_seqlens``; float64 for float64 inputs
        with ``impl="xla"``). Gradients come back in each
        input's dtype; ``g_gamma``'s is the sum of what ``g`` would get. An empty state (K = 0 or
        V = 0) is allowed: it holds nothing, so ``o`` and every gradient are zero.

    Raises:
        ValueError: naming the argument, for a wrong shape, a non-floating array (integer or bool
        inputs would run the recurrence in integer arithmetic), an invalid ``cu_seqlens`` or a
        ``softmax_scale`` that is not a number.
    """
    if sequence_parallelism_mesh_axis_name is not None:  # each shard holds a slice of the sequence
        return sequence_parallel.linear_attention(recurrent, **locals())
    impl = resolve_impl(impl)
    config = RecurrentConfig() if check_config(config, RecurrentConfig) is None else config
    cu_seqlens = _validate(query, key, value, g, g_gamma, gk, gv, initial_state, cu_seqlens)
    if impl == "triton":
        for name, x in (("query", query), ("key", key), ("value", value), ("g", g), ("g_gamma", g_gamma),
                        ("gk", gk), ("gv", gv), ("initial_state", initial_state)):
            if x is not None:
                check_triton_dtype(x, name)
    scale = _scale(softmax_scale, query.shape[-1])
    return _recurrent_jit(impl, scale, bool(reverse), config,
                          query, key, value, g, g_gamma, gk, gv, initial_state, cu_seqlens)
