"""Sequence parallelism: attention and linear attention over one sequence split across devices.

A long sequence outgrows one device's memory along its length. Under ``jax.shard_map`` each
device (a *shard*) holds a slice of the sequence: with ``n`` shards along the mesh axis ``"sp"``,
shard ``i`` holds tokens ``i * L ... (i + 1) * L - 1`` of every ``[batch, ..., seq_len, ...]``
array (``L = seq_len / n``), as ``shard_map(..., in_specs=P(None, None, "sp"))`` splits them. The
ops take the axis name and return exactly what the same call on the whole sequence returns on one
device, gradients included::

    def layer(q, k, v, segment_ids):   # each shard's slice of the sequence
        return blocksparse_attention(q, k, v, q_segment_ids=segment_ids,
                                     kv_segment_ids=segment_ids,
                                     sequence_parallelism_mesh_axis_name="sp")

    o = jax.shard_map(layer, mesh=mesh, in_specs=(P(None, None, "sp"),) * 3 + (P(None, "sp"),),
                      out_specs=P(None, None, "sp"))(q, k, v, segment_ids)

**Attention: all-gather the keys and values.** Each shard gathers the whole K and V (and the keys'
segment ids and positions) over the axis, then runs the ordinary single-device kernel for its own
queries, whose positions are *global* (``i * L + arange(L)`` by default): the causal, window and
document rules are evaluated per shard from positions and ids, and the block mask lists only the
tiles a shard's queries see, so no ``[T, S]`` array is formed anywhere. The backward is autodiff
of ``all_gather``: a reduce-scatter that sums every shard's contribution to dK and dV and hands
each shard the slice it owns.

Why all-gather and not a ring (``ppermute`` of K/V blocks, each step's partial softmax merged
into the running one, the transfer overlapped with compute): a ring keeps only ``S / n`` keys per
shard, but it runs ``n`` kernel calls per layer whose partial results are merged outside the
kernel (a different rounding from one device), and its backward needs a second ring for dK/dV.
The all-gather holds all keys at once, ``S x H_kv x (D + Dv)`` elements per shard: with grouped
heads (``H_kv`` a fraction of ``H_q``) that is a fraction of what the queries, the outputs and the
layer's activations take, and the kernel is the single-device one, unchanged: one online softmax
over the same keys, so the result is the one-device result. It is the strategy of kvax, and one
of Transformer Engine's.

**Load balance.** Under a causal mask the last shard's queries see the whole sequence and the
first shard's only its own slice: with contiguous slices shard ``i`` does ``2i + 1`` units of work
(a unit: half an ``L x L`` tile of scores) out of ``n^2``. The *zigzag* layout splits the sequence
into ``2n`` chunks and gives shard ``i`` chunks ``i`` and ``2n - 1 - i``: every shard then does
the same work, ``n`` units. It is a layout of the whole model's tokens, chosen once (every
per-token layer is indifferent to the order): permute the tokens with :func:`zigzag` before
sharding, segment ids too, and pass the tokens' positions, ``zigzag_indices(T, n)`` (each
token's original index), sliced like the tokens; :func:`unzigzag` the outputs at the end, if
ever. The attention op sees only positions and segment ids, so nothing else changes: the block
mask handles keys in any order exactly. (Linear attention needs contiguous slices: its state
runs through the tokens in order. Its work is the same on every shard anyway.)

**Linear attention: exchange states.** A recurrence ``h_t = h_{t-1} * decay_t + k_t^T v_t`` is
affine in its initial state. Each shard runs the single-device kernel from a zero state for the
sequence that enters it from the previous shard, and so gets its outputs and end state *but for*
the state carried in. The shards all-gather their end states and the total decays of their
slices; each shard folds the states of the shards before it (``h_in[i+1] = h_in[i] * decay_i +
state_i``; after it for ``reverse``) to get its true incoming state, and corrects its outputs with
``scale * (q_t * exp(A_t)) @ h_in * exp(B_t)``, where ``A_t`` and ``B_t`` are the running sums of
the log-decays (along K and along V) from the shard's start to ``t``. Gradients are autodiff
through the kernel's own backward, the correction and the collectives.

Packed sequences (``cu_seqlens``) may cross shard boundaries: ``cu_seqlens`` is *global* (offsets
into the whole sequence, the same on every shard). Each shard runs the kernel on its slice with
the offsets clipped to it (sequences outside it become empty), and only the sequence crossing
each boundary carries a state over: one ``[H, K, V]`` state per shard is exchanged, however many
sequences are packed. A sequence that starts inside a shard starts from its ``initial_state``
there. Each sequence's final state comes from the shard that holds its last token.

Both ops need ``shard_map``'s default ``check_vma=True``: with it JAX types which values differ
between shards, and sums the gradients of arrays every shard shares (``softmax_aux``, ``g_gamma``,
``initial_state``) over the shards.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array

from ejk_lite.checks import static_float, static_int
from ejk_lite.cumsum import chunk_global_cumsum
from ejk_lite.launch import vary_like, varying_axes
from ejk_lite.packing import validate_cu_seqlens

AXIS_ARGUMENT = "sequence_parallelism_mesh_axis_name"


def _axis(name: Any) -> tuple[int, Array]:
    """The number of shards along the mesh axis ``name`` and this shard's index, or a
    ``ValueError`` naming the argument: not a string, not an axis of an enclosing ``shard_map``,
    or a ``shard_map`` that does not track which values vary over it."""
    if not isinstance(name, str):
        raise ValueError(f"{AXIS_ARGUMENT} must be a str (a mesh axis name), got {name!r}")
    try:
        size = jax.lax.axis_size(name)
    except NameError as error:
        raise ValueError(f"{AXIS_ARGUMENT}={name!r} is not an axis of an enclosing shard_map "
                         f"(call the op inside jax.shard_map over a mesh with that axis)"
                         ) from error
    index = jax.lax.axis_index(name)
    if name not in varying_axes(index):
        raise ValueError(f"{AXIS_ARGUMENT}={name!r}: the enclosing shard_map has check_vma=False; "
                         f"sequence parallelism needs check_vma=True (the default), which sums "
                         f"the gradients of replicated arguments over the shards")
    return int(size), index


def _gather(x: Array | None, axis_name: str, axis: int) -> Array | None:
    """Every shard's ``x`` concatenated along ``axis`` in shard order (the whole sequence)."""
    return None if x is None else jax.lax.all_gather(x, axis_name, axis=axis, tiled=True)


# ----------------------------------------------------------------------------------------------
# The zigzag layout: every shard the same causal work.
# ----------------------------------------------------------------------------------------------


def zigzag_indices(seq_len: int, num_shards: int) -> np.ndarray:
    """The token order of the zigzag layout: the sequence in ``2 * num_shards`` chunks, shard ``i``
    holding chunks ``i`` and ``2 * num_shards - 1 - i``. Entry ``j`` is the original index (the
    position) of the token that lands at index ``j``. ``seq_len`` must divide into the chunks."""
    seq_len = static_int(seq_len, "seq_len")
    num_shards = static_int(num_shards, "num_shards", minimum=1)
    if seq_len % (2 * num_shards):
        raise ValueError(f"seq_len ({seq_len}) must be a multiple of 2 * num_shards "
                         f"({2 * num_shards}): the zigzag layout splits it into that many chunks")
    chunks = np.arange(seq_len, dtype=np.int32).reshape(2 * num_shards, -1)
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * num_shards - 1 - i]])
                           for i in range(num_shards)])


def zigzag(x: Array, num_shards: int, axis: int = 1) -> Array:
    """``x`` with its sequence ``axis`` in zigzag order (see :func:`zigzag_indices`); then shard
    it contiguously."""
    return jnp.take(x, zigzag_indices(x.shape[axis], num_shards), axis=axis)


def unzigzag(x: Array, num_shards: int, axis: int = 1) -> Array:
    """The inverse of :func:`zigzag`: the sequence ``axis`` back in its original order."""
    return jnp.take(x, np.argsort(zigzag_indices(x.shape[axis], num_shards)), axis=axis)


# ----------------------------------------------------------------------------------------------
# Attention.
# ----------------------------------------------------------------------------------------------


def _check_ids(name: str, x: Any, length: int) -> None:
    """A shard's slice of segment ids or positions: ``[batch or 1, local length]``."""
    shape = getattr(x, "shape", None)
    if x is not None and (shape is None or len(shape) != 2 or shape[1] != length):
        raise ValueError(f"{name} must be this shard's slice [batch or 1, {length}] under "
                         f"{AXIS_ARGUMENT}, got shape {shape}")


def attention(fn: Callable[..., Array], *, query: Array, key: Array, value: Array,
              q_segment_ids: Array | None = None, kv_segment_ids: Array | None = None,
              q_positions: Array | None = None, kv_positions: Array | None = None,
              qkv_layouts: Any = None, mask_builder: Any = None,
              sequence_parallelism_mesh_axis_name: str, **options: Any) -> Array:
    """``fn`` (:func:`ejk_lite.blocksparse_attention`) on this shard's queries against every
    shard's keys, as the same call on the whole sequence would give them.

    Every array with a sequence axis is this shard's slice of it: ``query`` ``[B, Hq, L, D]``,
    ``key``/``value`` ``[B, Hkv, Lk, *]``, segment ids and positions ``[B or 1, L]`` (queries) and
    ``[B or 1, Lk]`` (keys). Positions are global and ``arange`` over the whole sequence by
    default (shard ``i``'s queries at ``i * L ...``). ``bias`` and ``attention_mask`` are sliced
    along the queries only: ``[..., L, n * Lk]`` (their key axis is the whole sequence). Block
    layouts (``qkv_layouts``, ``mask_builder``) describe the whole ``[T, S]`` matrix and are
    refused: give the rule (causal, window, segment ids) instead.
    """
    axis = sequence_parallelism_mesh_axis_name
    num_shards, index = _axis(axis)
    if qkv_layouts is not None or mask_builder is not None:
        raise ValueError(f"qkv_layouts and mask_builder describe the whole [T, S] matrix and are "
                         f"not supported with {AXIS_ARGUMENT}: give the rule instead (causal, "
                         f"sliding_window, segment ids, positions)")
    for name, x in (("query", query), ("key", key), ("value", value)):
        if len(getattr(x, "shape", ())) != 4:
            raise ValueError(f"{name} must be a 4-D array [batch, heads, seq_len, dim] (this "
                             f"shard's slice), got shape {getattr(x, 'shape', None)}")
    T, S = query.shape[2], key.shape[2]
    for name, x, length in (("q_segment_ids", q_segment_ids, T), ("q_positions", q_positions, T),
                            ("kv_segment_ids", kv_segment_ids, S),
                            ("kv_positions", kv_positions, S)):
        _check_ids(name, x, length)
    if options.get("causal", True) or options.get("sliding_window") is not None:
        # Positions matter only to these rules; elsewhere they would only cost a gather.
        if q_positions is None:
            q_positions = (index * T + jnp.arange(T, dtype=jnp.int32))[None]
        kv_positions = (jnp.arange(num_shards * S, dtype=jnp.int32)[None] if kv_positions is None
                        else _gather(kv_positions, axis, 1))
    else:
        q_positions = kv_positions = None
    kv_segment_ids = _gather(kv_segment_ids, axis, 1)
    key, value = _gather(key, axis, 2), _gather(value, axis, 2)
    # Arrays every shard shares (the sinks, a bias without a query axis) vary from here on, as
    # the gradient the kernel computes for them on each shard does; JAX sums it over the shards.
    arrays = dict(query=query, key=key, value=value, softmax_aux=options.pop("softmax_aux", None),
                  bias=options.pop("bias", None))
    varied = vary_like([x for x in arrays.values() if x is not None], query, key, value, index)
    arrays = dict(zip([k for k, x in arrays.items() if x is not None], varied))
    return fn(**arrays, q_segment_ids=q_segment_ids, kv_segment_ids=kv_segment_ids,
              q_positions=q_positions, kv_positions=kv_positions, **options)


# ----------------------------------------------------------------------------------------------
# Linear attention.
# ----------------------------------------------------------------------------------------------


def _crossing(cu: Array, boundary: Array) -> tuple[Array, Array]:
    """The sequence of a packing ``cu`` that holds token ``boundary``, and whether it also holds
    token ``boundary - 1`` (it crosses the boundary between them)."""
    seq = jnp.clip(jnp.searchsorted(cu, boundary, side="right") - 1, 0, cu.shape[0] - 2)
    return seq, (cu[seq] < boundary) & (boundary < cu[seq + 1])


def _log_decays(g, g_gamma, gk, gv, rows: tuple[int, int, int]) -> tuple[Array | None, ...]:
    """Per-token log-decays, float32, ``None`` where there is no decay: along K (``g + g_gamma
    + gk``: ``[B, L, H, 1]`` for the scalar gates alone, ``[B, L, H, K]`` with ``gk``) and along
    V (``gv``, ``[B, L, H, V]``). ``rows`` is ``(B, L, H)``. Scalar gates stay one column: a
    broadcast to ``[B, L, H, K]`` made every sum below K times the work (measured on 2 H200s,
    bench/results/multi_gpu.json at 81434ec: 2 GPUs slower than 1 with the scalar gate)."""
    a = None
    for term in (None if g is None else g[..., None],
                 None if g_gamma is None else jnp.broadcast_to(g_gamma[:, None], (*rows, 1)),
                 gk):
        if term is not None:
            a = term.astype(jnp.float32) if a is None else a + term.astype(jnp.float32)
    return a, None if gv is None else gv.astype(jnp.float32)


def _running(x: Array | None, mask: Array, reverse: bool,
             impl: str) -> tuple[Array | None, Array | None]:
    """Running sums of the log-decays ``x`` over the entering sequence's tokens (``mask``), from
    the shard's boundary to each token, and their total per row; ``(None, None)`` for none.

    The running sums are the package's own :func:`~ejk_lite.chunk_global_cumsum` (``impl`` as
    the op's): XLA's cumulative sum along a long axis took 2.76 ms of a 7.46 ms step for ``gk``
    at 65536 tokens per shard (2 H200s, bench/multi_gpu.py at cd1a8d5, profile)."""
    if x is None:
        return None, None
    x = jnp.where(mask, x, 0.0)
    column = x.shape[-1] == 1  # the scalar gates: [B, L, H], one sum per head
    running = chunk_global_cumsum(x[..., 0] if column else x, reverse=reverse, impl=impl)
    return (running[..., None] if column else running), jnp.sum(x, 1)


def linear_attention(fn: Callable[..., tuple[Array, Array]], *, query: Array, key: Array,
                     value: Array, g: Array | None = None, g_gamma: Array | None = None,
                     gk: Array | None = None, gv: Array | None = None,
                     softmax_scale: float | None = None, initial_state: Array | None = None,
                     reverse: bool = False, cu_seqlens: Array | None = None,
                     sequence_parallelism_mesh_axis_name: str,
                     **options: Any) -> tuple[Array, Array]:
    """``fn`` (:func:`ejk_lite.recurrent`, or an op with its arguments and results) on this
    shard's slice of the sequence, with the states of the other shards folded in: the output of
    the same call on the whole sequence, and its final state.

    ``query``, ``key``, ``value`` and the per-token gates are this shard's slices
    (``[B, L, H, *]``); ``g_gamma``, ``initial_state`` and ``cu_seqlens`` are the same on every
    shard (``P()``), with ``cu_seqlens`` the *global* offsets into the whole sequence of
    ``n * L`` tokens. Returns this shard's output slice ``[B, L, H, V]`` and the final state
    ``[N, H, K, V]`` of every sequence (the same on every shard).
    """
    axis = sequence_parallelism_mesh_axis_name
    num_shards, index = _axis(axis)
    if len(getattr(query, "shape", ())) != 4:
        raise ValueError(f"query must be a 4-D array [batch, seq_len, heads, key_dim] (this "
                         f"shard's slice), got shape {getattr(query, 'shape', None)}")
    batch, L, heads, key_dim = query.shape
    reverse = bool(reverse)
    total = num_shards * L
    if cu_seqlens is not None:
        validate_cu_seqlens(cu_seqlens, total_tokens=total)  # the global offsets, when concrete
        if batch != 1:
            raise ValueError(f"cu_seqlens packs sequences along one row: batch must be 1, "
                             f"got {batch}")
        cu = jnp.clip(jnp.asarray(cu_seqlens).astype(jnp.int32), 0, total)  # int32, in range
        cu = jax.lax.cummax(cu.at[0].set(0), axis=0)  # (a traced one: the nearest valid packing)
        num_sequences = cu.shape[0] - 1
        # A shard's slice of the packing: the offsets clipped to it, sequences outside it empty.
        local_cu = jnp.clip(cu - index * L, 0, L)
        if num_sequences == 0:  # every token is padding: zeros, which depend on nothing
            arrays = jax.lax.stop_gradient(dict(query=query, key=key, value=value, g=g,
                                                g_gamma=g_gamma, gk=gk, gv=gv,
                                                initial_state=initial_state))
            return fn(**arrays, softmax_scale=softmax_scale, reverse=reverse, cu_seqlens=local_cu,
                      **options)
    else:
        num_sequences = batch
        local_cu = None

    # Where the state comes in and goes out. In walking order (backwards for reverse) a shard's
    # first token is where the state of the shard before it enters, its last where its own
    # leaves. Per row ([B]): the sequence (state slot) that crosses each of the two boundaries,
    # whether one does, and how many of the shard's tokens the entering sequence holds.
    start, end = index * L, (index + 1) * L
    enter_at, leave_at = (end, start) if reverse else (start, end)
    if cu_seqlens is None:
        rows = jnp.arange(batch)
        enter_slot, leave_slot = rows, rows
        first, last = (num_shards - 1, 0) if reverse else (0, num_shards - 1)
        enters = jnp.broadcast_to(index != first, (batch,))
        leaves = jnp.broadcast_to(index != last, (batch,))
        entering_len = jnp.where(enters, L, 0)
    else:
        enter_slot, enters = _crossing(cu, enter_at)
        leave_slot, leaves = _crossing(cu, leave_at)
        inside = (end - jnp.maximum(cu[enter_slot], start) if reverse
                  else jnp.minimum(cu[enter_slot + 1], end) - start)
        entering_len = jnp.where(enters, inside, 0)
        enter_slot, leave_slot, enters, leaves, entering_len = (
            x[None] for x in (enter_slot, leave_slot, enters, leaves, entering_len))
    tokens = jnp.arange(L)
    entering = ((tokens >= L - entering_len[:, None]) if reverse
                else (tokens < entering_len[:, None]))  # [B, L]: the entering sequence's tokens

    # 1. The kernel on this shard's slice, the entering sequence from a zero state (every other
    #    sequence of the slice starts in it, from its own initial state).
    init = initial_state
    if init is None and len(getattr(value, "shape", ())) == 4:
        # Zeros made here vary over the axis like the data: a scan's carry (the XLA
        # implementation's) must keep its type, and one made inside it would vary over nothing.
        init = jnp.zeros((num_sequences, heads, key_dim, value.shape[-1]), jnp.float32)
    if init is not None:
        init = init.at[enter_slot].set(jnp.where(enters[:, None, None, None], 0,
                                                 init[enter_slot]))
    per_token = dict(query=query, key=key, value=value, g=g, gk=gk, gv=gv)
    shared = dict(g_gamma=g_gamma, initial_state=init)
    given = {k: x for k, x in {**per_token, **shared}.items() if x is not None}
    given = dict(zip(given, vary_like(list(given.values()), query, index)))
    o, final = fn(**given, softmax_scale=softmax_scale, reverse=reverse, cu_seqlens=local_cu,
                  **options)
    if num_shards == 1:
        # One shard holds the whole sequence: nothing entered it, nothing leaves it. Steps 2-4
        # would give the same, but with the shard index a constant XLA folds their masked
        # running sums at compile time: one fold took 13.5 s, the *Across devices* cell 150 s,
        # on the H100 (T = 1024, the GPU check of 42a4bba; 71 s once skipped).
        return o, jax.lax.psum(final, axis)  # the same on every shard, and typed so

    # 2. The decays of the entering sequence's tokens: running (from the boundary to each token)
    #    and total. Exp of a running sum of log-decays <= 0 only underflows, where the state
    #    carried in has decayed away.
    mask = entering[:, :, None, None]
    a, b = _log_decays(g, g_gamma, gk, gv, (batch, L, heads))
    impl = options.get("impl", "auto")
    running_a, total_a = _running(a, mask, reverse, impl)
    running_b, total_b = _running(b, mask, reverse, impl)
    no_decay = jnp.ones((batch, heads, 1), jnp.float32)
    decay_k = no_decay if a is None else jnp.exp(total_a)  # [B, H, K] or [B, H, 1]
    decay_v = no_decay if b is None else jnp.exp(total_b)  # [B, H, V] or [B, H, 1]

    # 3. Exchange: each shard's leaving state (from the zero start) and, if one sequence spans
    #    the whole shard (it enters and leaves), the decay that multiplies the state carried in.
    through = enters & (entering_len == L)
    leaving = jnp.where(leaves[:, None, None, None], final[leave_slot], 0.0)
    carried_k = jnp.where(through[:, None, None], decay_k, 0.0)
    carried_v = jnp.where(through[:, None, None], decay_v, 0.0)
    states, carried_k, carried_v = (jax.lax.all_gather(x, axis)
                                    for x in (leaving, carried_k, carried_v))

    def fold(h, shard):  # h: the state entering this shard; returns the one leaving it
        state, ck, cv = shard
        return h * ck[..., :, None] * cv[..., None, :] + state, h

    h0 = vary_like([jnp.zeros(leaving.shape, jnp.float32)], states)[0]
    _, incoming = jax.lax.scan(fold, h0, (states, carried_k, carried_v), reverse=reverse)
    h_in = jnp.where(enters[:, None, None, None], incoming[index], 0.0)  # [B, H, K, V]

    # 4. Correct the outputs of the entering sequence's tokens and its final state. The product
    #    rounds its operands as the kernel's own q @ h does (_output_kernel: to a 16-bit input's
    #    dtype) and accumulates in float32. It multiplies float32 arrays, exactly for 16-bit
    #    values at the default precision (TF32 on a GPU), full float32 ones at the highest: a
    #    CPU's dot has no 16-bit x 16-bit = float32 form.
    scale = static_float(softmax_scale, "softmax_scale") if softmax_scale is not None else (
        key_dim ** -0.5 if key_dim > 0 else 1.0)
    weight = jnp.where(mask, 1.0 if a is None else jnp.exp(running_a), 0.0)
    q = scale * query.astype(jnp.float32) * weight
    state = h_in
    narrow = jnp.dtype(query.dtype).itemsize == 2
    if narrow:
        q = q.astype(query.dtype).astype(jnp.float32)
        state = state.astype(query.dtype).astype(jnp.float32)
    correction = jnp.einsum("blhk,bhkv->blhv", q, state, precision=(
        jax.lax.Precision.DEFAULT if narrow else jax.lax.Precision.HIGHEST))
    if b is not None:
        correction = correction * jnp.exp(running_b)
    o = (o.astype(jnp.float32) + correction).astype(o.dtype)
    final = final.at[enter_slot].add(h_in * decay_k[..., :, None] * decay_v[..., None, :])

    # 5. Each sequence's final state is the one of the shard holding its last token (in walking
    #    order); a sum over the shards, one term nonzero, gives it to every shard.
    if cu_seqlens is None:
        owner = jnp.full((num_sequences,), 0 if reverse else num_shards - 1)
    else:
        last_token = cu[:-1] if reverse else cu[1:] - 1
        owner = jnp.clip(last_token // max(L, 1), 0, num_shards - 1)
    final = jax.lax.psum(jnp.where((owner == index)[:, None, None, None], final, 0.0), axis)
    return o, final
