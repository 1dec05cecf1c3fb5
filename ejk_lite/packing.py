"""Packed (variable-length) sequences and the index arrays kernels need to walk them.

A packed batch stores several sequences back to back along one token axis, with no padding.
``cu_seqlens`` (cumulative sequence lengths) says where each one starts and ends::

    lengths    = [3, 0, 2, 4]
    cu_seqlens = [0, 3, 3, 5, 9]       # sequence i is tokens cu_seqlens[i] : cu_seqlens[i+1]

From it we derive, per token, which sequence it belongs to and its position inside it, and, per
chunk of ``chunk_size`` tokens, which sequence and which chunk of that sequence a program handles.

Every function here is right for zero-length sequences (they own no tokens and no chunks). The
output length of the per-token and per-chunk functions depends on the *values* of ``cu_seqlens``;
under ``jax.jit`` those values are unknown while tracing, so pass the size as a static argument
(``total_tokens=`` / ``total_chunks=``). Without it the function needs a concrete ``cu_seqlens``
and says so.

**One convention inside every op** (cumsum, mean pooling, recurrent): a packed input is
``[rows, T, ...]``, ``rows`` independent copies of the token axis that all share one
``cu_seqlens``; token ``t`` of row ``r`` sits at ``r * T + t``. Each kernel walks the sequences
``cu_seqlens[i]:cu_seqlens[i + 1]`` of every row. A padded (unpacked) batch is the case
without ``cu_seqlens``, every row one sequence of ``T`` tokens (mean pooling instead packs it
into one row with ``cu_seqlens = [0, T, 2T, ...]``: its kernels split tokens, not sequences,
between programs). Why rows: ``jax.vmap`` folds a
mapped axis into the rows (:func:`ejk_lite.launch.vmap_by_folding`), so a batch of packed inputs
is still one launch; and it is flash-linear-attention's ``[1, T, ...]`` layout with the ``1``
allowed to grow. What callers pass is unchanged: ``[1, T, ...]`` for the cumsums and
``recurrent`` (:func:`check_packed_batch` insists on the ``1``), ``(T, ...)`` for mean pooling,
which becomes one row of ``T`` tokens.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array, lax

from ejk_lite.checks import check_index_array, concrete_value, static_int

# Kernels index tokens with int32; offsets beyond it cannot describe a real array anyway.
INT32_MAX = 2**31 - 1


def cdiv(a: Any, b: int) -> Any:
    """Ceiling division, ``ceil(a / b)`` for non-negative integers; works on ints and arrays."""
    return (a + b - 1) // b


def validate_cu_seqlens(cu_seqlens: Any, total_tokens: int | None = None, name: str = "cu_seqlens") -> None:
    """Raise ``ValueError`` (naming ``name``) unless ``cu_seqlens`` is a valid packing.

    Shape and dtype are always checked: 1-D, any integer dtype (signed or unsigned, 8 to 64
    bits). Values are checked when they are concrete (not traced): starts at 0, never decreases,
    fits in int32 and ends at or before ``total_tokens`` when that is given. Check the array as
    the caller gave it, before ``jnp.asarray``: with 64-bit types off, that silently wraps int64
    values into int32.
    """
    if not hasattr(cu_seqlens, "shape") or len(cu_seqlens.shape) != 1 or cu_seqlens.shape[0] < 1:
        raise ValueError(f"{name} must be a 1-D array [0, len_0, len_0 + len_1, ...], "
                         f"got shape {getattr(cu_seqlens, 'shape', None)}")
    check_index_array(cu_seqlens, name)
    values = concrete_value(cu_seqlens)
    if values is None:
        return
    if values[0] != 0:
        raise ValueError(f"{name} must start at 0, got {values[0]}")
    # Compare neighbours, never subtract them: in an unsigned dtype a decrease wraps around to a
    # large positive difference (np.diff([5, 3]) is 254 in uint8).
    if np.any(values[1:] < values[:-1]):
        raise ValueError(f"{name} must be non-decreasing, got {values.tolist()}")
    if values[-1] > INT32_MAX:
        raise ValueError(f"{name}[-1] = {values[-1]} does not fit in int32 (the kernels' index type)")
    if total_tokens is not None and values[-1] > total_tokens:
        raise ValueError(f"{name}[-1] = {values[-1]} is beyond the {total_tokens} tokens of the input")


def check_packed_batch(batch: int, name: str, shape: tuple[int, ...]) -> None:
    """Packed input (with ``cu_seqlens``) is one row ``[1, T, ...]``: raise unless ``batch == 1``."""
    if batch != 1:
        raise ValueError(f"cu_seqlens packs sequences along one batch entry: {name} must have batch "
                         f"size 1, got shape {tuple(shape)}")


def checked_cu_seqlens(cu_seqlens: Any, total_tokens: int, name: str = "cu_seqlens") -> Any:
    """``cu_seqlens`` validated against ``total_tokens`` tokens (see :func:`validate_cu_seqlens`).

    Concrete values come back as a NumPy int32 array: checked first, so the cast is exact
    whatever the caller's integer dtype (int8 ... uint64), and a NumPy array stays a constant
    (its values known) under ``jax.jit``. Traced values come back as they are: the ops pass them
    through :func:`sanitize_cu_seqlens`, which casts them, before any kernel sees them.
    """
    validate_cu_seqlens(cu_seqlens, total_tokens=total_tokens, name=name)
    values = concrete_value(cu_seqlens)
    return cu_seqlens if values is None else values.astype(np.int32)


def sanitize_cu_seqlens(cu_seqlens: Array, total_tokens: int) -> Array:
    """The nearest valid packing of ``total_tokens`` tokens: int32, starts at 0, non-decreasing,
    every offset in ``[0, total_tokens]``. A valid ``cu_seqlens`` comes back unchanged.

    Under ``jax.jit`` the values of ``cu_seqlens`` cannot be checked, and kernels index memory
    with them: a negative or decreasing offset would make a kernel read and write outside its
    arrays. The ops pass every ``cu_seqlens`` through this right before launching, so kernels only
    ever see a valid packing: garbage offsets give garbage numbers, never a crash. It costs a few
    O(num_seqs) operations (a clip and a cumulative maximum), nothing per token.
    """
    cu = jnp.asarray(cu_seqlens)
    if cu.dtype.itemsize < 4:  # int8/int16/uint8/uint16: widen (exactly) so that T fits
        cu = cu.astype(jnp.int32)
    # Clip in the caller's dtype, then cast: a huge int64 offset becomes T instead of wrapping.
    cu = jnp.clip(cu, 0, total_tokens).astype(jnp.int32)
    return lax.cummax(cu.at[0].set(0), axis=0)


def _index_array(cu_seqlens: Any) -> Array:
    """A validated ``cu_seqlens`` in the signed dtype the per-token and per-chunk functions use:
    int32, or int64 for a 64-bit input (under ``jax_enable_x64``). A narrow or unsigned dtype
    could not hold the token indices or the ``-1`` that marks padding."""
    validate_cu_seqlens(cu_seqlens)
    values = concrete_value(cu_seqlens)
    dtype = jnp.int64 if jnp.dtype(cu_seqlens.dtype).itemsize == 8 and jax.config.jax_enable_x64 \
        else jnp.int32
    # Concrete values were checked to fit int32, so the cast is exact; cast NumPy values before
    # jnp.asarray, which would wrap int64 values silently with 64-bit types off.
    return jnp.asarray(values.astype(dtype)) if values is not None else cu_seqlens.astype(dtype)


def _static_size(size: int | None, derive, what: str, argname: str, fn: str) -> int:
    if size is not None:
        return static_int(size, f"{fn}: {argname}")
    values = derive()
    if values is None:
        raise ValueError(f"{fn}: the number of {what} depends on the values of cu_seqlens, which are "
                         f"not known under jax.jit; pass it as a static argument {argname}=...")
    return int(values)


def prepare_lens(cu_seqlens: Array) -> Array:
    """Length of each sequence: ``cu_seqlens[1:] - cu_seqlens[:-1]``."""
    cu_seqlens = jnp.asarray(cu_seqlens)
    return cu_seqlens[1:] - cu_seqlens[:-1]


def prepare_lens_from_mask(mask: Array) -> Array:
    """Length of each row of a ``[batch, seq_len]`` boolean mask (number of True), as int32."""
    return mask.sum(axis=-1, dtype=jnp.int32)


def prepare_cu_seqlens_from_mask(mask: Array, out_dtype: Any = jnp.int32) -> Array:
    """``cu_seqlens`` for packing the True tokens of each row of a ``[batch, seq_len]`` mask."""
    lens = prepare_lens_from_mask(mask).astype(out_dtype)
    return jnp.concatenate([jnp.zeros((1,), out_dtype), jnp.cumsum(lens, dtype=out_dtype)])


def prepare_sequence_ids(cu_seqlens: Array, total_tokens: int | None = None) -> Array:
    """Which sequence each token belongs to, e.g. ``[0, 0, 0, 2, 2, ...]`` for lengths ``[3, 0, 2]``.

    Token ``t`` belongs to the sequence ``i`` with ``cu_seqlens[i] <= t < cu_seqlens[i + 1]``:
    the number of sequence *ends* at or before ``t``, which skips empty sequences correctly.
    Tokens at or past ``cu_seqlens[-1]`` (padding, when ``total_tokens`` is larger) get ``-1``.
    """
    cu_seqlens, total_tokens = _token_args(cu_seqlens, total_tokens, "prepare_sequence_ids")
    return _sequence_ids(cu_seqlens, total_tokens)


def prepare_position_ids(cu_seqlens: Array, total_tokens: int | None = None) -> Array:
    """Position of each token inside its sequence, e.g. ``[0, 1, 2, 0, 1, ...]``; ``-1`` for padding."""
    cu_seqlens, total_tokens = _token_args(cu_seqlens, total_tokens, "prepare_position_ids")
    return _position_ids(cu_seqlens, _sequence_ids(cu_seqlens, total_tokens))


def prepare_token_indices(cu_seqlens: Array, total_tokens: int | None = None) -> Array:
    """``[total_tokens, 2]`` rows of ``(sequence_id, position_id)``."""
    cu_seqlens, total_tokens = _token_args(cu_seqlens, total_tokens, "prepare_token_indices")
    seq = _sequence_ids(cu_seqlens, total_tokens)
    return jnp.stack([seq, _position_ids(cu_seqlens, seq)], axis=1)


def _token_args(cu_seqlens: Any, total_tokens: int | None, fn: str) -> tuple[Array, int]:
    """Validate ``cu_seqlens`` and settle the (static) number of tokens for a per-token function."""
    cu_seqlens = _index_array(cu_seqlens)
    total_tokens = _static_size(total_tokens, lambda: _last(cu_seqlens), "tokens", "total_tokens", fn)
    last = _last(cu_seqlens)
    if last is not None and last > total_tokens:
        raise ValueError(f"{fn}: total_tokens={total_tokens} is less than cu_seqlens[-1] = {last}")
    return cu_seqlens, total_tokens


# jnp.searchsorted's default ("scan") is a while loop of log2(n) + 1 steps: on a GPU, a few small
# kernels per step, and the loop condition read back each step. "scan_unrolled" is the same
# binary search, unrolled.
# Measured (H100, block_mean_pooling packed forward, bf16, device time, 2026-11-24): 0.234 ms with
# the default, 0.201 ms unrolled, 0.191 ms with the index lists built outside (a concrete
# cu_seqlens). ("compare_all" was as fast there, but it builds a [tokens, sequences] array.)
_SEARCH = "scan_unrolled"


def _sequence_ids(cu_seqlens: Array, total_tokens: int) -> Array:
    tokens = jnp.arange(total_tokens, dtype=cu_seqlens.dtype)
    ids = jnp.searchsorted(cu_seqlens[1:], tokens, side="right",
                           method=_SEARCH).astype(cu_seqlens.dtype)
    return jnp.where(tokens < cu_seqlens[-1], ids, -1)


def _position_ids(cu_seqlens: Array, sequence_ids: Array) -> Array:
    tokens = jnp.arange(sequence_ids.shape[0], dtype=cu_seqlens.dtype)
    return jnp.where(sequence_ids >= 0, tokens - cu_seqlens[jnp.maximum(sequence_ids, 0)], -1)


def prepare_chunk_offsets(cu_seqlens: Array, chunk_size: int) -> Array:
    """Where each sequence's chunks start in the list of all chunks: ``[0, n_0, n_0 + n_1, ...]``.

    Sequence ``i`` is cut into ``n_i = ceil(len_i / chunk_size)`` chunks (zero for an empty one).
    """
    chunk_size = _check_chunk_size(chunk_size)
    cu_seqlens = _index_array(cu_seqlens)
    counts = cdiv(prepare_lens(cu_seqlens), chunk_size)
    return jnp.concatenate([jnp.zeros((1,), cu_seqlens.dtype), jnp.cumsum(counts).astype(cu_seqlens.dtype)])


def prepare_chunk_indices(cu_seqlens: Array, chunk_size: int, total_chunks: int | None = None) -> Array:
    """``[total_chunks, 2]`` rows of ``(sequence_id, chunk_id_within_sequence)``.

    This is the work list of a kernel with one program per chunk: program ``p`` handles tokens
    ``cu_seqlens[s] + c * chunk_size`` up to the end of that chunk, where ``(s, c)`` is row ``p``.
    """
    chunk_size = _check_chunk_size(chunk_size)
    cu_seqlens = _index_array(cu_seqlens)
    offsets = prepare_chunk_offsets(cu_seqlens, chunk_size)
    total_chunks = _static_size(total_chunks, lambda: _last(offsets), "chunks", "total_chunks",
                                "prepare_chunk_indices")
    needed = _last(offsets)
    if needed is not None and total_chunks < needed:
        raise ValueError(f"prepare_chunk_indices: total_chunks={total_chunks} is less than the {needed} chunks "
                         f"of cu_seqlens with chunk_size={chunk_size}")
    chunks = jnp.arange(total_chunks, dtype=cu_seqlens.dtype)
    seq = jnp.searchsorted(offsets[1:], chunks, side="right", method=_SEARCH).astype(cu_seqlens.dtype)
    seq_clamped = jnp.minimum(seq, offsets.shape[0] - 2)
    valid = chunks < offsets[-1]
    return jnp.stack([jnp.where(valid, seq, -1), jnp.where(valid, chunks - offsets[seq_clamped], -1)], axis=1)


def identity_dtype_convert(dtype: Any):
    """An identity function whose gradient is cast to ``dtype`` on the way back.

    Useful in mixed precision: ``f = identity_dtype_convert(jnp.float32); y = f(x_bf16)`` leaves
    the forward value alone and hands ``x``'s consumers an fp32 cotangent. ``dtype`` must be a
    floating dtype (checked here, not when the gradient is taken).
    """
    try:
        dtype = jnp.dtype(dtype)
    except TypeError as error:
        raise ValueError(f"dtype must be a floating dtype, got {dtype!r}") from error
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"dtype must be a floating dtype, got {dtype}")

    @jax.custom_vjp
    def identity(x):
        return x

    def forward(x):
        return x, None

    def backward(_, cotangent):
        return (cotangent.astype(dtype),)

    identity.defvjp(forward, backward)
    return identity


def _last(x: Array) -> int | None:
    values = concrete_value(x)
    return None if values is None else int(values[-1])


def _check_chunk_size(chunk_size: Any) -> int:
    return static_int(chunk_size, "chunk_size", minimum=1)
