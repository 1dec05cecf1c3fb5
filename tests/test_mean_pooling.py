"""mean_pooling and block_mean_pooling, both implementations, against float64 NumPy.

The Triton kernels run in the interpreter on a machine without a GPU; there, outputs start as NaN,
so an element a kernel forgets to write fails ``rel_err``'s finiteness check.
"""

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import TOLERANCE, WRAPPING_CU_SEQLENS, rel_err
from ejk_lite import block_mean_pooling, mean_pooling

import ejk_lite.pooling as pooling  # the module (ejk_lite.mean_pooling is the function)

# Triton's interpreter turns a loop bound loaded from memory into an int through a shape-(1,)
# array, which NumPy deprecates; harmless here, and compiled kernels never see it.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

IMPLS = ["xla", "triton"]
DTYPES = ["float32", "bfloat16", "float16"]
# Lengths with a zero- and a one-token sequence, none a multiple of the chunk sizes used below.
LENGTHS = [5, 0, 1, 17, 9, 0, 3]


# ----------------------------------------------------------------------------------------------
# Float64 NumPy references.
# ----------------------------------------------------------------------------------------------


def numpy_mean_pooling(x, cu_seqlens):
    """Mean of each packed sequence of ``x`` (tokens, ...); zeros for an empty one."""
    return np.stack([x[a:b].mean(axis=0) if b > a else np.zeros(x.shape[1:])
                     for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:])])


def numpy_block_pooling(x, block_size, cu_seqlens):
    """One mean per block of ``block_size`` tokens within each packed sequence, in order."""
    blocks = [x[s:min(s + block_size, b)].mean(axis=0)
              for a, b in zip(cu_seqlens[:-1], cu_seqlens[1:]) for s in range(a, b, block_size)]
    return np.stack(blocks) if blocks else np.zeros((0, *x.shape[1:]))


def random_x(rng, shape, dtype):
    """A random array in ``dtype`` and the same values (after rounding) in float64."""
    x = jnp.asarray(rng.standard_normal(shape).astype(np.float32), dtype)
    return x, np.asarray(x.astype(jnp.float32), np.float64)


def cu_from_lengths(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


def assert_close(out, ref, dtype):
    assert out.dtype == jnp.dtype(dtype)
    assert rel_err(out, ref) < TOLERANCE[dtype]


# ----------------------------------------------------------------------------------------------
# Forward.
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_padded_with_head_axis(rng, impl, dtype):
    x, x64 = random_x(rng, (3, 37, 2, 5), dtype)  # (batch, seq_len, heads, head_dim)
    out = mean_pooling(x, chunk_size=8, impl=impl)
    assert out.shape == (3, 2, 5)
    assert_close(out, x64.mean(axis=1), dtype)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("seq_len", [0, 1])
def test_padded_zero_and_one_token(rng, impl, seq_len):
    x, x64 = random_x(rng, (2, seq_len, 6), "float32")
    out = np.asarray(mean_pooling(x, impl=impl))
    if seq_len == 0:
        np.testing.assert_array_equal(out, np.zeros((2, 6)))  # zeros, not NaN
    else:
        assert rel_err(out, x64[:, 0]) < TOLERANCE["float32"]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_packed(rng, impl, dtype):
    cu = cu_from_lengths(LENGTHS)
    x, x64 = random_x(rng, (cu[-1] + 3, 11), dtype)  # 3 padding tokens after the last sequence
    out = mean_pooling(x, chunk_size=4, cu_seqlens=jnp.asarray(cu), impl=impl)
    assert out.shape == (len(LENGTHS), 11)
    assert_close(out, numpy_mean_pooling(x64, cu), dtype)
    np.testing.assert_array_equal(np.asarray(out)[[1, 5]], 0)  # the empty sequences


@pytest.mark.parametrize("tokens_per_program", [1, 3, 8, 1000])
@pytest.mark.parametrize("packed", [False, True])
def test_triton_token_tiles_and_feature_tiles(rng, tokens_per_program, packed):
    """Sequences cut into pieces by token tiles (or not at all), and ragged feature tiles."""
    config = pooling.PoolingConfig(block_hidden=16, fwd_tile_tokens=tokens_per_program,
                                   bwd_tile_tokens=tokens_per_program)
    if packed:
        cu = cu_from_lengths(LENGTHS)
        x, x64 = random_x(rng, (cu[-1] + 2, 40), "float32")
        out = mean_pooling(x, 2, jnp.asarray(cu), impl="triton", config=config)
        ref = numpy_mean_pooling(x64, cu)
    else:
        x, x64 = random_x(rng, (3, 7, 40), "float32")
        out = mean_pooling(x, 2, impl="triton", config=config)
        ref = x64.mean(axis=1)
    assert rel_err(out, ref) < TOLERANCE["float32"]


@pytest.mark.parametrize("tile", [128, 256, 512])
def test_triton_long_sequences_inside_tiles(rng, tile):
    """Sequences of pooling._WALK_MIN_TOKENS tokens or more that lie inside a token tile, in
    tiles that few sequences overlap (the pieces kernel sums them) and in tiles that many do
    (the finish kernel does), with empty sequences at tile edges, and vmap over two rows."""
    least = pooling._WALK_MIN_TOKENS
    lengths = [least + 3, 0, least - 1, least, 0, 2 * least, 1, 0, 5, 7, least + 1, 0, 3 * least, 0]
    cu = cu_from_lengths(lengths)
    config = pooling.PoolingConfig(block_hidden=16, fwd_tile_tokens=tile)
    x, x64 = random_x(rng, (2, cu[-1] + 3, 40), "float32")
    out = jax.vmap(lambda x: mean_pooling(x, 16, jnp.asarray(cu), impl="triton", config=config))(x)
    ref = np.stack([numpy_mean_pooling(x64[r], cu) for r in range(2)])
    assert np.isfinite(np.asarray(out)).all()
    assert rel_err(out, ref) < TOLERANCE["float32"]


def test_triton_forward_and_backward_tiles_differ(rng):
    """The forward and the backward cut the tokens into tiles of their own sizes (fewer, longer
    programs forward): both must cover every token, sequences crossing either kind of edge."""
    config = pooling.PoolingConfig(fwd_programs=4, bwd_programs=32)
    cu = cu_from_lengths(LENGTHS + [40, 2, 23])
    x, x64 = random_x(rng, (cu[-1] + 3, 32), "float32")
    plan = pooling._plan(2, x.shape[0], 32, len(cu) - 1, None, config)
    assert plan.tile_tokens > plan.grad_tile_tokens
    f = lambda a: mean_pooling(a, 2, jnp.asarray(cu), impl="triton", config=config)  # noqa: E731
    assert rel_err(f(x), numpy_mean_pooling(x64, cu)) < TOLERANCE["float32"]
    weights = rng.standard_normal((len(cu) - 1, 32))
    grad = jax.grad(lambda a: jnp.sum(f(a) * weights))(x)
    lens = np.maximum(np.diff(cu), 1)
    expected = np.zeros(x.shape)
    for i, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        expected[a:b] = weights[i] / lens[i]
    assert rel_err(grad, expected) < TOLERANCE["float32"]


def test_auto_impl_and_chunk_size_not_a_power_of_two(rng):
    x, x64 = random_x(rng, (2, 13, 4), "float32")
    for chunk_size in (3, 13, 1000):
        assert rel_err(mean_pooling(x, chunk_size), x64.mean(axis=1)) < TOLERANCE["float32"]
    assert rel_err(mean_pooling(x, 5, impl="triton"), x64.mean(axis=1)) < TOLERANCE["float32"]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_blocks_padded(rng, impl, dtype):
    x, x64 = random_x(rng, (2, 19, 3, 4), dtype)
    out = block_mean_pooling(x, 8, impl=impl)  # blocks of 8, 8 and 3 tokens
    assert out.shape == (2, 3, 3, 4)
    ref = np.stack([numpy_block_pooling(x64[b], 8, [0, 19]) for b in range(2)])
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [1, 4, 64])
def test_blocks_packed(rng, impl, dtype, block_size):
    cu = cu_from_lengths(LENGTHS)
    x, x64 = random_x(rng, (cu[-1] + 2, 9), dtype)
    out = block_mean_pooling(x, block_size, jnp.asarray(cu), chunk_size=2, impl=impl)
    ref = numpy_block_pooling(x64, block_size, cu)
    assert out.shape == ref.shape
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("impl", IMPLS)
def test_blocks_padded_empty_sequences(rng, impl):
    x, _ = random_x(rng, (2, 0, 5), "float32")
    assert block_mean_pooling(x, 4, impl=impl).shape == (2, 0, 5)


# ----------------------------------------------------------------------------------------------
# Gradients, against autodiff of the float64 reference.
# ----------------------------------------------------------------------------------------------


def reference_gradient(fn, x64, weights):
    """d/dx sum(fn(x) * weights), by autodiff of the pure-JAX reference in float64."""
    with jax.enable_x64(True):
        return np.asarray(jax.grad(lambda a: jnp.sum(fn(a) * jnp.asarray(weights)))(jnp.asarray(x64)))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("op", ["mean", "blocks"])
@pytest.mark.parametrize("packed", [False, True])
def test_gradients(rng, impl, dtype, op, packed):
    if packed:
        cu = cu_from_lengths(LENGTHS)
        x, x64 = random_x(rng, (cu[-1] + 3, 2, 3), dtype)  # padding tokens get zero gradient
        cu_arg = jnp.asarray(cu)
    else:
        x, x64 = random_x(rng, (2, 21, 2, 3), dtype)
        cu = cu_arg = None
    if op == "mean":
        ours = lambda a: mean_pooling(a, 4, cu_arg, impl=impl)  # noqa: E731
        ref = lambda a: pooling.reference(a, cu)  # noqa: E731
    else:
        ours = lambda a: block_mean_pooling(a, 5, cu_arg, chunk_size=2, impl=impl)  # noqa: E731
        ref = lambda a: pooling.reference_blocks(a, 5, cu)  # noqa: E731
    weights = rng.standard_normal(ours(x).shape).astype(np.float32)
    grad = jax.grad(lambda a: jnp.sum(ours(a).astype(jnp.float32) * weights))(x)
    assert grad.shape == x.shape and grad.dtype == x.dtype
    assert rel_err(grad, reference_gradient(ref, x64, weights)) < TOLERANCE[dtype]


# ----------------------------------------------------------------------------------------------
# jit with a traced cu_seqlens.
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
def test_jit_value_and_grad_traced_cu_seqlens(rng, impl):
    cu = cu_from_lengths(LENGTHS)
    x, x64 = random_x(rng, (cu[-1] + 2, 6), "float32")
    weights = rng.standard_normal((len(LENGTHS), 6)).astype(np.float32)

    @jax.jit
    def loss(a, cu_seqlens):
        return jnp.sum(mean_pooling(a, 4, cu_seqlens, impl=impl) * weights)

    value, grad = jax.value_and_grad(loss)(x, jnp.asarray(cu))
    ref_value = np.sum(numpy_mean_pooling(x64, cu) * weights)
    assert abs(float(value) - ref_value) <= 1e-5 * np.abs(numpy_mean_pooling(x64, cu) * weights).sum()
    ref_grad = reference_gradient(lambda a: pooling.reference(a, cu), x64, weights)
    assert rel_err(grad, ref_grad) < TOLERANCE["float32"]


@pytest.mark.parametrize("impl", IMPLS)
def test_jit_blocks_traced_cu_seqlens(rng, impl):
    cu = cu_from_lengths(LENGTHS)
    x, x64 = random_x(rng, (cu[-1] + 2, 6), "float32")
    ref = numpy_block_pooling(x64, 4, cu)
    extra = 3  # total_blocks may exceed the true count: the extra rows are zeros

    @jax.jit
    def pooled(a, cu_seqlens):
        return block_mean_pooling(a, 4, cu_seqlens, total_blocks=len(ref) + extra, impl=impl)

    out = np.asarray(pooled(x, jnp.asarray(cu)))
    assert rel_err(out[:len(ref)], ref) < TOLERANCE["float32"]
    np.testing.assert_array_equal(out[len(ref):], 0)

    weights = rng.standard_normal(ref.shape).astype(np.float32)
    grad = jax.jit(jax.grad(lambda a, c: jnp.sum(pooled(a, c)[:len(ref)] * weights)))(x, jnp.asarray(cu))
    ref_grad = reference_gradient(lambda a: pooling.reference_blocks(a, 4, cu), x64, weights)
    assert rel_err(grad, ref_grad) < TOLERANCE["float32"]

    with pytest.raises(ValueError, match="total_blocks"):
        jax.jit(lambda a, c: block_mean_pooling(a, 4, c, impl=impl))(x, jnp.asarray(cu))


# ----------------------------------------------------------------------------------------------
# Random packings.
# ----------------------------------------------------------------------------------------------


@settings(max_examples=10, deadline=None)
@given(lengths=st.lists(st.integers(0, 12), min_size=1, max_size=5),
       padding=st.integers(0, 3),
       hidden=st.sampled_from([1, 3, 17]),
       chunk_size=st.sampled_from([1, 2, 4, 8]),
       block_size=st.sampled_from([1, 3, 4]),
       seed=st.integers(0, 2**31))
def test_random_packings(lengths, padding, hidden, chunk_size, block_size, seed):
    cu = cu_from_lengths(lengths)
    x, x64 = random_x(np.random.default_rng(seed), (cu[-1] + padding, hidden), "float32")
    ref_mean = numpy_mean_pooling(x64, cu)
    ref_blocks = numpy_block_pooling(x64, block_size, cu)
    for impl in IMPLS:
        out = mean_pooling(x, chunk_size, jnp.asarray(cu), impl=impl)
        assert rel_err(out, ref_mean) < TOLERANCE["float32"]
        blocks = block_mean_pooling(x, block_size, jnp.asarray(cu), chunk_size=chunk_size, impl=impl)
        assert blocks.shape == ref_blocks.shape
        if ref_blocks.size:
            assert rel_err(blocks, ref_blocks) < TOLERANCE["float32"]


# ----------------------------------------------------------------------------------------------
# Bad input.
# ----------------------------------------------------------------------------------------------

_X3 = jnp.ones((2, 5, 4), jnp.float32)
_X2 = jnp.ones((10, 4), jnp.float32)
_CU = jnp.asarray([0, 4, 10], jnp.int32)


@pytest.mark.parametrize("call, match", [
    (lambda: mean_pooling(_X2), "x must be padded"),
    (lambda: mean_pooling(jnp.ones((10,)), 4, _CU), "x must be packed"),
    (lambda: mean_pooling(jnp.ones((1, 10, 4)), 4, _CU), "no batch axis"),
    (lambda: mean_pooling(_X2, 4, jnp.asarray([1, 4, 10])), "cu_seqlens must start at 0"),
    (lambda: mean_pooling(_X2, 4, jnp.asarray([0, 6, 4])), "cu_seqlens must be non-decreasing"),
    (lambda: mean_pooling(_X2, 4, jnp.asarray([0, 4, 11])), r"cu_seqlens\[-1\]"),
    (lambda: mean_pooling(_X2, 4, jnp.asarray([[0, 4, 10]])), "cu_seqlens must be a 1-D"),
    (lambda: mean_pooling(_X2, 4, jnp.asarray([0.0, 4.0, 10.0])), "cu_seqlens must have an integer"),
    (lambda: mean_pooling(_X3, 0), "chunk_size"),
    (lambda: mean_pooling(_X3, -4), "chunk_size"),
    (lambda: mean_pooling(_X3, 2.0), "chunk_size"),
    (lambda: mean_pooling(_X3, impl="cuda"), "impl"),
    (lambda: mean_pooling(jnp.ones((2, 5, 4), jnp.int32)), "x must have a floating dtype"),
    (lambda: mean_pooling(_X3, config=pooling.PoolingConfig(block_hidden=24)), "PoolingConfig.block_hidden"),
    (lambda: mean_pooling(_X3, config=pooling.PoolingConfig(fwd_tile_tokens=0)), "PoolingConfig.fwd_tile_tokens"),
    (lambda: mean_pooling(_X3, config=pooling.PoolingConfig(fwd_num_stages=0)), "PoolingConfig.fwd_num_stages"),
    (lambda: mean_pooling(_X3, config=pooling.PoolingConfig(bwd_num_warps=3)), "PoolingConfig.bwd_num_warps"),
    (lambda: mean_pooling(_X3, config=pooling.PoolingConfig(fwd_programs=None)), "PoolingConfig.fwd_programs"),
    (lambda: mean_pooling(_X3, config=(16, 4)), "config"),
    (lambda: block_mean_pooling(_X3, 0), "block_size"),
    (lambda: block_mean_pooling(_X3, 2, chunk_size=0), "chunk_size"),
    (lambda: block_mean_pooling(_X2, 4, _CU, total_blocks=2), "total_blocks"),
    (lambda: block_mean_pooling(_X3, 4, total_blocks=3), "total_blocks"),
    (lambda: block_mean_pooling(_X2, 4), "x must be padded"),
    (lambda: block_mean_pooling(_X2, 4, jnp.asarray([0, 4, 12])), r"cu_seqlens\[-1\]"),
])
def test_bad_input_raises_value_error(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ----------------------------------------------------------------------------------------------
# Arguments: NumPy scalars are numbers, cu_seqlens of any integer dtype, values that would wrap.
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
def test_numpy_scalars_behave_like_python_numbers(rng, impl):
    # np.int64(4) used to reach the kernel launch as an array: a pointer where an int belongs.
    cu = cu_from_lengths(LENGTHS)
    x, x64 = random_x(rng, (cu[-1] + 2, 6), "float32")
    config = pooling.PoolingConfig(block_hidden=np.int64(16), fwd_tile_tokens=np.int32(3),
                                   bwd_tile_tokens=np.int64(5), fwd_num_warps=np.int8(2),
                                   bwd_num_warps=np.uint16(1), fwd_num_stages=np.uint8(2))
    assert all(type(getattr(config, f)) is int for f in ("block_hidden", "fwd_tile_tokens", "fwd_num_stages"))
    out = mean_pooling(x, np.int64(4), jnp.asarray(cu), impl=impl, config=config)
    assert rel_err(out, numpy_mean_pooling(x64, cu)) < TOLERANCE["float32"]
    ref = numpy_block_pooling(x64, 4, cu)
    out = block_mean_pooling(x, np.int64(4), jnp.asarray(cu), chunk_size=np.int32(2),
                             total_blocks=np.int64(len(ref)), impl=impl, config=config)
    assert rel_err(out, ref) < TOLERANCE["float32"]
    pooled = jax.jit(lambda a, c: block_mean_pooling(a, np.int64(4), c, total_blocks=np.uint16(len(ref)), impl=impl))
    assert rel_err(pooled(x, jnp.asarray(cu)), ref) < TOLERANCE["float32"]
    for name, call in [("block_size", lambda: block_mean_pooling(x, np.float64(4.0), jnp.asarray(cu), impl=impl)),
                       ("block_size", lambda: block_mean_pooling(x, True, jnp.asarray(cu), impl=impl)),
                       ("chunk_size", lambda: mean_pooling(x, np.bool_(True), jnp.asarray(cu), impl=impl)),
                       ("total_blocks", lambda: block_mean_pooling(x, 4, jnp.asarray(cu), total_blocks=20.0)),
                       ("PoolingConfig.fwd_num_warps",
                        lambda: pooling.PoolingConfig(fwd_num_warps=np.int64(3)))]:
        with pytest.raises(ValueError, match=name):
            call()


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", ["int8", "uint8", "int16", "uint16", "uint32", "uint64", "int64"])
def test_cu_seqlens_of_any_integer_dtype(rng, impl, dtype):
    cu = cu_from_lengths(LENGTHS)
    x, x64 = random_x(rng, (cu[-1] + 2, 6), "float32")
    out = mean_pooling(x, 4, cu.astype(dtype), impl=impl)
    assert rel_err(out, numpy_mean_pooling(x64, cu)) < TOLERANCE["float32"]
    out = block_mean_pooling(x, 4, cu.astype(dtype), impl=impl)
    assert rel_err(out, numpy_block_pooling(x64, 4, cu)) < TOLERANCE["float32"]
    out = jax.jit(lambda a, c: mean_pooling(a, 4, c, impl=impl))(x, jnp.asarray(cu.astype(dtype)))
    assert rel_err(out, numpy_mean_pooling(x64, cu)) < TOLERANCE["float32"]


@pytest.mark.parametrize("bad, match", WRAPPING_CU_SEQLENS)
def test_cu_seqlens_that_would_wrap_are_refused(rng, bad, match):
    x, _ = random_x(rng, (12, 3), "float32")
    for impl in IMPLS:
        with pytest.raises(ValueError, match=f"cu_seqlens.*{match}"):
            mean_pooling(x, 4, bad, impl=impl)
        with pytest.raises(ValueError, match=f"cu_seqlens.*{match}"):
            block_mean_pooling(x, 4, bad, impl=impl)


def test_default_config_is_the_measured_one():
    """config=None keeps the settings measured on an H100 (bench/mean_pooling.py): a change here
    changes GPU speed, so it must be deliberate."""
    plan = pooling._plan(32, 65536, 4096, 64, None, None)
    assert (plan.block_tokens, plan.block_hidden, plan.tile_tokens, plan.grad_tile_tokens) == (32, 256, 1024, 256)
    assert (plan.num_warps, plan.num_stages, plan.bwd_num_warps, plan.has_pieces) == (4, 3, 4, True)
    assert pooling._plan(32, 65536, 4096, 64, None, pooling.PoolingConfig()) == plan
