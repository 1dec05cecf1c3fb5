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
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import Array


def cdiv(a: Any, b: int) -> Any:
    """Ceiling division, ``ceil(a / b)`` for non-negative integers; works on ints and arrays."""
    return (a + b - 1) // b


def concrete_value(x: Any) -> np.ndarray | None:
    """``x`` as a NumPy array when its value is known now, ``None`` while it is being traced."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def validate_cu_seqlens(cu_seqlens: Any, total_tokens: int | None = None, name: str = "cu_seqlens") -> None:
    """Raise ``ValueError`` (naming ``name``) unless ``cu_seqlens`` is a valid packing.

    Shape and dtype are always checked. Values are checked when they are concrete (not traced):
    starts at 0, never decreases, and ends at or before ``total_tokens`` when that is given.
    """
    if not hasattr(cu_seqlens, "shape") or len(cu_seqlens.shape) != 1 or cu_seqlens.shape[0] < 1:
        raise ValueError(f"{name} must be a 1-D array [0, len_0, len_0 + len_1, ...], "
                         f"got shape {getattr(cu_seqlens, 'shape', None)}")
    if not jnp.issubdtype(cu_seqlens.dtype, jnp.integer):
        raise ValueError(f"{name} must have an integer dtype, got {cu_seqlens.dtype}")
    values = concrete_value(cu_seqlens)
    if values is None:
        return
    if values[0] != 0:
        raise ValueError(f"{name} must start at 0, got {values[0]}")
    if np.any(np.diff(values) < 0):
        raise ValueError(f"{name} must be non-decreasing, got {values.tolist()}")
    if total_tokens is not None and values[-1] > total_tokens:
        raise ValueError(f"{name}[-1] = {values[-1]} is beyond the {total_tokens} tokens of the input")


def _static_size(size: int | None, derive, what: str, argname: str, fn: str) -> int:
    if size is not None:
        if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or size < 0:
            raise ValueError(f"{fn}: {argname} must be a non-negative Python int (static under jax.jit), "
                             f"got {size!r}")
        return int(size)
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
    cu_seqlens = jnp.asarray(cu_seqlens)
    validate_cu_seqlens(cu_seqlens)
    total_tokens = _static_size(total_tokens, lambda: _last(cu_seqlens), "tokens", "total_tokens", fn)
    last = _last(cu_seqlens)
    if last is not None and last > total_tokens:
        raise ValueError(f"{fn}: total_tokens={total_tokens} is less than cu_seqlens[-1] = {last}")
    return cu_seqlens, total_tokens


def _sequence_ids(cu_seqlens: Array, total_tokens: int) -> Array:
    tokens = jnp.arange(total_tokens, dtype=cu_seqlens.dtype)
    ids = jnp.searchsorted(cu_seqlens[1:], tokens, side="right").astype(cu_seqlens.dtype)
    return jnp.where(tokens < cu_seqlens[-1], ids, -1)


def _position_ids(cu_seqlens: Array, sequence_ids: Array) -> Array:
    tokens = jnp.arange(sequence_ids.shape[0], dtype=cu_seqlens.dtype)
    return jnp.where(sequence_ids >= 0, tokens - cu_seqlens[jnp.maximum(sequence_ids, 0)], -1)


def prepare_chunk_offsets(cu_seqlens: Array, chunk_size: int) -> Array:
    """Where each sequence's chunks start in the list of all chunks: ``[0, n_0, n_0 + n_1, ...]``.

    Sequence ``i`` is cut into ``n_i = ceil(len_i / chunk_size)`` chunks (zero for an empty one).
    """
    _check_chunk_size(chunk_size)
    cu_seqlens = jnp.asarray(cu_seqlens)
    validate_cu_seqlens(cu_seqlens)
    counts = cdiv(prepare_lens(cu_seqlens), chunk_size)
    return jnp.concatenate([jnp.zeros((1,), cu_seqlens.dtype), jnp.cumsum(counts).astype(cu_seqlens.dtype)])


def prepare_chunk_indices(cu_seqlens: Array, chunk_size: int, total_chunks: int | None = None) -> Array:
    """``[total_chunks, 2]`` rows of ``(sequence_id, chunk_id_within_sequence)``.

    This is the work list of a kernel with one program per chunk: program ``p`` handles tokens
    ``cu_seqlens[s] + c * chunk_size`` up to the end of that chunk, where ``(s, c)`` is row ``p``.
    """
    cu_seqlens = jnp.asarray(cu_seqlens)
    offsets = prepare_chunk_offsets(cu_seqlens, chunk_size)
    total_chunks = _static_size(total_chunks, lambda: _last(offsets), "chunks", "total_chunks",
                                "prepare_chunk_indices")
    needed = _last(offsets)
    if needed is not None and total_chunks < needed:
        raise ValueError(f"prepare_chunk_indices: total_chunks={total_chunks} is less than the {needed} chunks "
                         f"of cu_seqlens with chunk_size={chunk_size}")
    chunks = jnp.arange(total_chunks, dtype=cu_seqlens.dtype)
    seq = jnp.searchsorted(offsets[1:], chunks, side="right").astype(cu_seqlens.dtype)
    seq_clamped = jnp.minimum(seq, offsets.shape[0] - 2)
    valid = chunks < offsets[-1]
    return jnp.stack([jnp.where(valid, seq, -1), jnp.where(valid, chunks - offsets[seq_clamped], -1)], axis=1)


def identity_dtype_convert(dtype: Any):
    """An identity function whose gradient is cast to ``dtype`` on the way back.

    Useful in mixed precision: ``f = identity_dtype_convert(jnp.float32); y = f(x_bf16)`` leaves
    the forward value alone and hands ``x``'s consumers an fp32 cotangent.
    """

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


def _check_chunk_size(chunk_size: Any) -> None:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, (int, np.integer)) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
