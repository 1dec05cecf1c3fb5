"""Packed-sequence utilities against plain-Python references that are obviously right.

The references walk the sequences one by one in Python loops: no searchsorted, no cumsum tricks,
so they cannot share a bug with the vectorised code under test. Zero-length sequences (at the
start, in the middle, at the end, several in a row) are the case that matters most: the naive
``(position_ids == 0).cumsum() - 1`` labelling gets every token after an empty sequence wrong.
"""

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ejk_lite import (
    cdiv,
    identity_dtype_convert,
    prepare_chunk_indices,
    prepare_chunk_offsets,
    prepare_cu_seqlens_from_mask,
    prepare_lens,
    prepare_lens_from_mask,
    prepare_position_ids,
    prepare_sequence_ids,
    prepare_token_indices,
    validate_cu_seqlens,
)
from ejk_lite.packing import checked_cu_seqlens, sanitize_cu_seqlens
from conftest import rel_err

# ------------------------------------------------------------------------------------------------
# References: one Python loop per sequence.
# ------------------------------------------------------------------------------------------------


def cu_seqlens_of(lengths):
    return np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)]).astype(np.int32)


def reference_tokens(lengths, total_tokens):
    """(sequence_id, position_id) of every token, then (-1, -1) for each padding token."""
    rows = [(seq, pos) for seq, length in enumerate(lengths) for pos in range(length)]
    rows += [(-1, -1)] * (total_tokens - len(rows))
    return np.array(rows, dtype=np.int64).reshape(total_tokens, 2)


def reference_chunks(lengths, chunk_size, total_chunks):
    """(sequence_id, chunk_id) of every chunk, then (-1, -1) for each spare row."""
    rows = [(seq, c) for seq, length in enumerate(lengths) for c in range(math.ceil(length / chunk_size))]
    rows += [(-1, -1)] * (total_chunks - len(rows))
    return np.array(rows, dtype=np.int64).reshape(total_chunks, 2)


def reference_chunk_offsets(lengths, chunk_size):
    offsets = [0]
    for length in lengths:
        offsets.append(offsets[-1] + math.ceil(length / chunk_size))
    return np.array(offsets)


def check_everything(lengths, chunk_size, padding, spare_chunks):
    """Every cu_seqlens-derived function, eager, against the references."""
    cu = jnp.asarray(cu_seqlens_of(lengths))
    n_tokens = int(sum(lengths))
    n_chunks = sum(math.ceil(length / chunk_size) for length in lengths)

    np.testing.assert_array_equal(prepare_lens(cu), lengths)

    # Sizes taken from the concrete cu_seqlens, then with padding / spare rows.
    for total, expect in ((None, reference_tokens(lengths, n_tokens)),
                          (n_tokens + padding, reference_tokens(lengths, n_tokens + padding))):
        seq = prepare_sequence_ids(cu, total_tokens=total)
        pos = prepare_position_ids(cu, total_tokens=total)
        both = prepare_token_indices(cu, total_tokens=total)
        assert seq.dtype == pos.dtype == both.dtype == cu.dtype
        np.testing.assert_array_equal(seq, expect[:, 0])
        np.testing.assert_array_equal(pos, expect[:, 1])
        np.testing.assert_array_equal(both, expect)

    np.testing.assert_array_equal(prepare_chunk_offsets(cu, chunk_size), reference_chunk_offsets(lengths, chunk_size))
    for total, expect in ((None, reference_chunks(lengths, chunk_size, n_chunks)),
                          (n_chunks + spare_chunks, reference_chunks(lengths, chunk_size, n_chunks + spare_chunks))):
        chunks = prepare_chunk_indices(cu, chunk_size, total_chunks=total)
        assert chunks.dtype == cu.dtype
        np.testing.assert_array_equal(chunks, expect)


# ------------------------------------------------------------------------------------------------
# Small functions.
# ------------------------------------------------------------------------------------------------


def test_cdiv_on_ints_and_arrays(rng):
    for a in [0, 1, 63, 64, 65, 1000]:
        for b in [1, 7, 64]:
            assert cdiv(a, b) == math.ceil(a / b)
    a = rng.integers(0, 10_000, size=50)
    np.testing.assert_array_equal(cdiv(jnp.asarray(a), 48), [math.ceil(x / 48) for x in a])


def test_lens_and_cu_seqlens_from_mask(rng):
    mask = rng.random((6, 11)) < 0.6
    mask[2] = False  # an empty row: length 0
    mask[4] = True
    lens = prepare_lens_from_mask(jnp.asarray(mask))
    assert lens.dtype == jnp.int32
    np.testing.assert_array_equal(lens, [sum(bool(v) for v in row) for row in mask])

    cu = prepare_cu_seqlens_from_mask(jnp.asarray(mask))
    assert cu.dtype == jnp.int32 and cu.shape == (7,)
    np.testing.assert_array_equal(cu, cu_seqlens_of(np.asarray(lens)))
    # Round trip: the lengths come back out, and the packed tokens are the mask's True entries.
    np.testing.assert_array_equal(prepare_lens(cu), lens)
    np.testing.assert_array_equal(prepare_position_ids(cu), np.concatenate([np.arange(n) for n in lens]))

    assert prepare_cu_seqlens_from_mask(jnp.asarray(mask), out_dtype=jnp.int16).dtype == jnp.int16


def test_zero_length_sequences_get_the_right_ids():
    # Empty sequences at the start, in the middle (two in a row) and at the end.
    lengths = [0, 2, 0, 0, 3, 1, 0]
    cu = jnp.asarray(cu_seqlens_of(lengths))
    expect = reference_tokens(lengths, sum(lengths))
    np.testing.assert_array_equal(prepare_sequence_ids(cu), expect[:, 0])
    # The naive labelling counts sequence starts, and an empty sequence has none: it is wrong here.
    naive = np.cumsum(np.asarray(prepare_position_ids(cu)) == 0) - 1
    assert not np.array_equal(naive, expect[:, 0])
    check_everything(lengths, chunk_size=2, padding=3, spare_chunks=2)


@pytest.mark.parametrize("lengths", [[], [0], [0, 0, 0], [1], [1, 1, 1], [5], [64, 1, 65]])
def test_edge_cases(lengths):
    """No sequences, only empty ones, one-token ones, exact multiples of the chunk size."""
    check_everything(lengths, chunk_size=64 if 64 in lengths else 2, padding=2, spare_chunks=1)


def test_numpy_and_int64_inputs_are_accepted():
    cu = np.array([0, 3, 3, 7])  # NumPy's default int64
    np.testing.assert_array_equal(prepare_sequence_ids(cu), [0, 0, 0, 2, 2, 2, 2])
    np.testing.assert_array_equal(prepare_chunk_indices(cu, 3), [[0, 0], [2, 0], [2, 1]])


# Hypothesis runs the jitted functions on fixed shapes, so each chunk size compiles once and the
# examples stay cheap; the packings inside those shapes vary freely (zeros are drawn often).
NUM_SEQS, MAX_LEN = 6, 40
TOTAL_TOKENS = NUM_SEQS * MAX_LEN + 3  # always some padding


@functools.partial(jax.jit, static_argnames=("chunk_size",))
def all_outputs(cu, chunk_size):
    total_chunks = cdiv(TOTAL_TOKENS, chunk_size) + NUM_SEQS  # a bound from shapes alone
    return (prepare_lens(cu), prepare_sequence_ids(cu, total_tokens=TOTAL_TOKENS),
            prepare_position_ids(cu, total_tokens=TOTAL_TOKENS), prepare_token_indices(cu, total_tokens=TOTAL_TOKENS),
            prepare_chunk_offsets(cu, chunk_size), prepare_chunk_indices(cu, chunk_size, total_chunks=total_chunks))


@settings(max_examples=30, deadline=None)
@given(
    lengths=st.lists(st.one_of(st.just(0), st.integers(1, 3), st.integers(4, MAX_LEN)),
                     min_size=NUM_SEQS, max_size=NUM_SEQS),
    chunk_size=st.sampled_from([1, 2, 3, 4, 8, 16]),
)
def test_random_packings_under_jit(lengths, chunk_size):
    lens, seq, pos, both, offsets, chunks = all_outputs(jnp.asarray(cu_seqlens_of(lengths)), chunk_size)
    tokens = reference_tokens(lengths, TOTAL_TOKENS)
    np.testing.assert_array_equal(lens, lengths)
    np.testing.assert_array_equal(seq, tokens[:, 0])
    np.testing.assert_array_equal(pos, tokens[:, 1])
    np.testing.assert_array_equal(both, tokens)
    np.testing.assert_array_equal(offsets, reference_chunk_offsets(lengths, chunk_size))
    np.testing.assert_array_equal(chunks, reference_chunks(lengths, chunk_size, chunks.shape[0]))


@settings(max_examples=8, deadline=None)
@given(lengths=st.lists(st.one_of(st.just(0), st.integers(1, 9)), max_size=5), chunk_size=st.sampled_from([1, 3, 4]))
def test_random_packings_eager(lengths, chunk_size):
    """Eagerly, with sizes read from the values and with padding: any number of sequences."""
    check_everything(lengths, chunk_size, padding=2, spare_chunks=1)


# ------------------------------------------------------------------------------------------------
# Under jax.jit: the output sizes are static arguments.
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lengths", [[3, 0, 5, 1], [0, 7], [2, 2, 0]])
def test_under_jit_with_static_sizes(lengths):
    cu = jnp.asarray(cu_seqlens_of(lengths))
    total_tokens, total_chunks, chunk_size = sum(lengths) + 4, 7, 2  # padding tokens and spare chunks

    @jax.jit
    def everything(cu):
        return (prepare_sequence_ids(cu, total_tokens=total_tokens),
                prepare_position_ids(cu, total_tokens=total_tokens),
                prepare_token_indices(cu, total_tokens=total_tokens),
                prepare_chunk_indices(cu, chunk_size, total_chunks=total_chunks),
                prepare_chunk_offsets(cu, chunk_size),
                prepare_lens(cu))

    seq, pos, both, chunks, offsets, lens = everything(cu)
    tokens = reference_tokens(lengths, total_tokens)
    np.testing.assert_array_equal(seq, tokens[:, 0])
    np.testing.assert_array_equal(pos, tokens[:, 1])
    np.testing.assert_array_equal(both, tokens)
    np.testing.assert_array_equal(chunks, reference_chunks(lengths, chunk_size, total_chunks))
    np.testing.assert_array_equal(offsets, reference_chunk_offsets(lengths, chunk_size))
    np.testing.assert_array_equal(lens, lengths)

    # The same compiled function serves another packing with the same number of sequences.
    other = [lengths[-1], *lengths[:-1]]
    seq2, *_ = everything(jnp.asarray(cu_seqlens_of(other)))
    np.testing.assert_array_equal(seq2, reference_tokens(other, total_tokens)[:, 0])


@pytest.mark.parametrize("fn, argname", [
    (prepare_sequence_ids, "total_tokens"),
    (prepare_position_ids, "total_tokens"),
    (prepare_token_indices, "total_tokens"),
    (lambda cu: prepare_chunk_indices(cu, 4), "total_chunks"),
])
def test_under_jit_without_static_size_says_what_to_pass(fn, argname):
    cu = jnp.asarray(cu_seqlens_of([3, 1]))
    with pytest.raises(ValueError, match=f"jax.jit.*{argname}="):
        jax.jit(fn)(cu)


# ------------------------------------------------------------------------------------------------
# Bad input: a ValueError that names the argument.
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad, match", [
    (np.array([[0, 3]], np.int32), "1-D"),
    (np.zeros((0,), np.int32), "1-D"),
    (np.array([0.0, 3.0], np.float32), "integer dtype"),
    (np.array([1, 3], np.int32), "start at 0"),
    (np.array([0, 4, 2], np.int32), "non-decreasing"),
])
def test_validate_cu_seqlens_errors(bad, match):
    with pytest.raises(ValueError, match=f"my_cu.*{match}"):
        validate_cu_seqlens(jnp.asarray(bad), name="my_cu")
    # Every function that reads cu_seqlens refuses it too (instead of a silent wrong answer).
    for fn in (prepare_sequence_ids, prepare_position_ids, prepare_token_indices,
               lambda cu: prepare_chunk_offsets(cu, 2), lambda cu: prepare_chunk_indices(cu, 2)):
        with pytest.raises(ValueError, match=f"cu_seqlens.*{match}"):
            fn(jnp.asarray(bad))


@pytest.mark.parametrize("dtype", ["uint8", "uint16", "uint32", "uint64", "int8", "int16", "int64"])
def test_decreasing_cu_seqlens_of_every_integer_dtype_is_refused(dtype):
    # In an unsigned dtype the difference of a decrease wraps to a large positive number: the
    # check must compare neighbours, not look at np.diff.
    bad = np.array([0, 5, 3, 9], dtype)
    with pytest.raises(ValueError, match="non-decreasing"):
        validate_cu_seqlens(bad)
    with pytest.raises(ValueError, match="non-decreasing"):
        checked_cu_seqlens(bad, 9)
    with pytest.raises(ValueError, match="non-decreasing"):
        prepare_sequence_ids(bad)


def test_values_beyond_int32_are_refused_before_they_wrap():
    # With 64-bit types off, jnp.asarray turns 2**32 + 3 into 3 without a word: check first.
    for bad in (np.array([0, 2**32 + 3], np.int64), np.array([0, 2**31], np.uint64),
                np.array([0, 2**31], np.uint32)):
        with pytest.raises(ValueError, match="int32"):
            validate_cu_seqlens(bad)
        with pytest.raises(ValueError, match="cu_seqlens"):
            prepare_sequence_ids(bad)
        with pytest.raises(ValueError, match="cu_seqlens"):
            checked_cu_seqlens(bad, 2**40)


@pytest.mark.parametrize("dtype", ["int8", "uint8", "int16", "uint16", "uint32", "uint64", "int64"])
def test_narrow_and_unsigned_dtypes_give_the_right_answer(rng, dtype):
    # 3 padding tokens (-1 ids, which an unsigned dtype could not hold) and 120 tokens, close to
    # int8's limit: token and chunk indices are computed in int32, not in the caller's dtype.
    lengths = [int(n) for n in rng.integers(0, 30, size=6)]
    lengths[2] = 0
    lengths.append(120 - sum(lengths))
    cu = cu_seqlens_of(lengths).astype(dtype)
    total = 123
    seq = prepare_sequence_ids(cu, total_tokens=total)
    assert seq.dtype == jnp.int32
    tokens = reference_tokens(lengths, total)
    np.testing.assert_array_equal(seq, tokens[:, 0])
    np.testing.assert_array_equal(prepare_position_ids(cu, total_tokens=total), tokens[:, 1])
    np.testing.assert_array_equal(prepare_chunk_indices(cu, 7, total_chunks=30),
                                  reference_chunks(lengths, 7, 30))
    np.testing.assert_array_equal(prepare_chunk_offsets(cu, 7), reference_chunk_offsets(lengths, 7))
    kernel_offsets = checked_cu_seqlens(cu, total)
    assert kernel_offsets.dtype == jnp.int32
    np.testing.assert_array_equal(kernel_offsets, cu_seqlens_of(lengths))
    # Traced, the same.
    ids = jax.jit(lambda c: prepare_sequence_ids(c, total_tokens=total))(jnp.asarray(cu))
    np.testing.assert_array_equal(ids, tokens[:, 0])


@settings(max_examples=20, deadline=None)
@given(lengths=st.lists(st.integers(0, 9), min_size=1, max_size=6), padding=st.integers(0, 3))
def test_sanitize_leaves_a_valid_packing_alone(lengths, padding):
    cu = cu_seqlens_of(lengths)
    total = int(cu[-1]) + padding
    np.testing.assert_array_equal(sanitize_cu_seqlens(jnp.asarray(cu), total), cu)
    np.testing.assert_array_equal(jax.jit(sanitize_cu_seqlens, static_argnums=1)(jnp.asarray(cu), total), cu)


@pytest.mark.parametrize("garbage, dtype, expect", [
    ([0, -5, 7, 12], "int32", [0, 0, 7, 10]),                 # negative
    ([0, -2**31, 5, 2**31 - 1], "int32", [0, 0, 5, 10]),      # INT_MIN, INT_MAX
    ([0, 9, 3, 12], "int32", [0, 9, 9, 10]),                  # decreasing
    ([4, 2, 8, 8], "int32", [0, 2, 8, 8]),                    # not starting at 0
    ([0, 9, 3, 12], "uint32", [0, 9, 9, 10]),                 # unsigned, decreasing
    ([0, 2**32 - 1, 3, 4], "uint32", [0, 10, 10, 10]),        # would be -1 as int32
    ([0, -100, 100, 5], "int8", [0, 0, 10, 10]),              # narrow
])
def test_sanitize_makes_garbage_a_valid_packing(garbage, dtype, expect):
    cu = np.array(garbage, np.int64).astype(dtype)
    out = jax.jit(sanitize_cu_seqlens, static_argnums=1)(jnp.asarray(cu), 10)
    assert out.dtype == jnp.int32
    np.testing.assert_array_equal(out, expect)


def test_sanitize_clips_int64_before_casting():
    with jax.enable_x64(True):
        out = sanitize_cu_seqlens(jnp.asarray([0, 2**33 + 3, 5], jnp.int64), 10)
    np.testing.assert_array_equal(out, [0, 10, 10])  # not 3, what a wrapping cast would give


def test_validate_cu_seqlens_total_tokens_and_tracing():
    cu = jnp.asarray(cu_seqlens_of([3, 0, 4]))
    assert validate_cu_seqlens(cu, total_tokens=7) is None
    with pytest.raises(ValueError, match=r"cu_seqlens\[-1\] = 7 is beyond the 6 tokens"):
        validate_cu_seqlens(cu, total_tokens=6)

    def traced(cu):  # values unknown while tracing: only shape and dtype can be checked
        validate_cu_seqlens(cu, total_tokens=1)
        return cu

    np.testing.assert_array_equal(jax.jit(traced)(cu), cu)
    with pytest.raises(ValueError, match="integer dtype"):
        jax.jit(traced)(cu.astype(jnp.float32))


def test_bad_sizes_are_value_errors():
    cu = jnp.asarray(cu_seqlens_of([3, 5]))
    with pytest.raises(ValueError, match="total_tokens=7 is less than cu_seqlens"):
        prepare_sequence_ids(cu, total_tokens=7)
    with pytest.raises(ValueError, match="total_tokens must be a non-negative"):
        prepare_position_ids(cu, total_tokens=-1)
    with pytest.raises(ValueError, match="total_chunks=3 is less than the 5 chunks"):
        prepare_chunk_indices(cu, 2, total_chunks=3)
    for chunk_size in (0, -2, 2.0, True, jnp.int32(2)):
        with pytest.raises(ValueError, match="chunk_size must be a positive int"):
            prepare_chunk_offsets(cu, chunk_size)
        with pytest.raises(ValueError, match="chunk_size must be a positive int"):
            prepare_chunk_indices(cu, chunk_size)


# ------------------------------------------------------------------------------------------------
# identity_dtype_convert: the identity going forward, a dtype cast going back.
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("x_dtype, grad_dtype", [("bfloat16", "float32"), ("float32", "bfloat16"),
                                                 ("float16", "float32")])
def test_identity_dtype_convert(rng, x_dtype, grad_dtype):
    convert = identity_dtype_convert(jnp.dtype(grad_dtype))
    x = jnp.asarray(rng.standard_normal(37), x_dtype)
    y = convert(x)
    assert y.dtype == x.dtype
    np.testing.assert_array_equal(np.asarray(y, np.float32), np.asarray(x, np.float32))

    cotangent = jnp.asarray(rng.standard_normal(37), x_dtype)
    _, pullback = jax.vjp(convert, x)
    (grad,) = pullback(cotangent)
    assert grad.dtype == jnp.dtype(grad_dtype)
    # The cast is the only change: compare with the cotangent rounded to the gradient dtype.
    expect = np.asarray(cotangent.astype(grad_dtype), np.float64)
    assert rel_err(np.asarray(grad, np.float64), expect) == 0.0

    # Inside a larger jitted gradient, the cast happens where the function sits.
    w = jnp.asarray(rng.standard_normal(37), jnp.float32)
    g = jax.jit(jax.grad(lambda x: jnp.sum(w * convert(x).astype(jnp.float32))))(x)
    assert g.dtype == jnp.dtype(grad_dtype)
    assert rel_err(np.asarray(g, np.float64), np.asarray(w.astype(x_dtype).astype(grad_dtype), np.float64)) == 0.0
