"""chunk_local_cumsum / chunk_global_cumsum: both implementations against float64 NumPy loops."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import TOLERANCE, WRAPPING_CU_SEQLENS, rel_err
from ejk_lite import chunk_global_cumsum, chunk_local_cumsum
from ejk_lite.cumsum import (_GLOBAL_16_BIT_TILES, _GLOBAL_TILES, _LOCAL_TILES, CumsumConfig,
                             reference_global_cumsum, reference_local_cumsum)

# every tile of the global kernel's autotune lists, once (the 16-bit ones add the tensor cores')
_ALL_GLOBAL_TILES = list(dict.fromkeys(t for tiles in _GLOBAL_16_BIT_TILES.values() for t in tiles))

IMPLS = ["xla", "triton"]
OPS = ["local", "global"]


def numpy_cumsum(x, chunk_size=None, reverse=False, scale=None, cu_seqlens=None, head_first=False):
    """The definition, in float64 loops: walk each chunk (or whole sequence) keeping a running sum.

    Tokens past cu_seqlens[-1] belong to no sequence and stay 0.
    """
    x = np.asarray(x, np.float64)
    if head_first:
        x = np.swapaxes(x, 1, 2)  # put the tokens on axis 1
    out = np.zeros_like(x)
    batch, tokens = x.shape[:2]
    bounds = [0, tokens] if cu_seqlens is None else [int(c) for c in cu_seqlens]
    for b in range(batch):
        for bos, eos in zip(bounds[:-1], bounds[1:]):
            step = eos - bos if chunk_size is None else chunk_size
            for chunk_start in range(bos, eos, max(step, 1)):
                chunk = list(range(chunk_start, min(chunk_start + step, eos)))
                running = np.zeros(x.shape[2:])
                for t in (reversed(chunk) if reverse else chunk):
                    running = running + x[b, t]
                    out[b, t] = running
    if scale is not None:
        out = out * scale
    return np.swapaxes(out, 1, 2) if head_first else out


def run(op, x, impl, chunk_size=16, reverse=False, scale=None, cu_seqlens=None, head_first=False, output_dtype=None):
    if op == "local":
        return chunk_local_cumsum(x, chunk_size, reverse=reverse, softmax_scale=scale, cu_seqlens=cu_seqlens,
                                  head_first=head_first, output_dtype=output_dtype, impl=impl)
    return chunk_global_cumsum(x, reverse=reverse, cu_seqlens=cu_seqlens, softmax_scale=scale,
                               head_first=head_first, output_dtype=output_dtype, impl=impl)


def expected(op, x, chunk_size=16, **kw):
    return numpy_cumsum(x, chunk_size if op == "local" else None, **kw)


def make_input(rng, shape, dtype="float32"):
    return jnp.asarray(rng.standard_normal(shape), dtype)


def shape_of(layout, batch, tokens, heads=3, features=5):
    return {"scalar": (batch, tokens, heads), "vector": (batch, tokens, heads, features),
            "scalar_head_first": (batch, heads, tokens), "vector_head_first": (batch, heads, tokens, features)}[layout]


def cu_from_lengths(lengths):
    return np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)


LAYOUTS = ["scalar", "vector", "scalar_head_first", "vector_head_first"]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("reverse", [False, True])
def test_matches_numpy(rng, impl, op, layout, reverse):
    head_first = layout.endswith("head_first")
    x = make_input(rng, shape_of(layout, batch=2, tokens=75))  # 75: not a multiple of the chunk
    out = run(op, x, impl, reverse=reverse, head_first=head_first)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert rel_err(out, expected(op, x, reverse=reverse, head_first=head_first)) < TOLERANCE["float32"]


@pytest.mark.parametrize("impl", IMPLS)
def test_reverse_global_cumsum_of_packed_sequences_exactly(impl):
    s = jnp.asarray([1.0, 2.0, 3.0, 4.0]).reshape(1, 4, 1)
    cu = jnp.asarray([0, 1, 4])
    np.testing.assert_array_equal(np.asarray(chunk_global_cumsum(s, reverse=True, cu_seqlens=cu, impl=impl)).ravel(),
                                  [1, 9, 7, 4])
    np.testing.assert_array_equal(np.asarray(chunk_global_cumsum(s, cu_seqlens=cu, impl=impl)).ravel(), [1, 2, 5, 9])
    np.testing.assert_array_equal(np.asarray(chunk_local_cumsum(s, 2, reverse=True, cu_seqlens=cu, impl=impl)).ravel(),
                                  [1, 5, 3, 4])


# Zero-length and one-token sequences, a sequence longer than two 64-token blocks, and 3 padding
# tokens past cu_seqlens[-1].
VARLEN_LENGTHS = [0, 1, 130, 0, 20, 1]
VARLEN_PADDING = 3


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op,chunk_size", [("local", 16), ("local", 128), ("global", None)])
@pytest.mark.parametrize("layout", ["scalar", "vector_head_first"])
@pytest.mark.parametrize("reverse", [False, True])
def test_packed_sequences(rng, impl, op, chunk_size, layout, reverse):
    cu = cu_from_lengths(VARLEN_LENGTHS)
    head_first = layout.endswith("head_first")
    x = make_input(rng, shape_of(layout, batch=1, tokens=int(cu[-1]) + VARLEN_PADDING, features=4))
    out = run(op, x, impl, chunk_size=chunk_size, reverse=reverse, cu_seqlens=jnp.asarray(cu), head_first=head_first)
    ref = expected(op, x, chunk_size=chunk_size, reverse=reverse, cu_seqlens=cu, head_first=head_first)
    assert rel_err(out, ref) < TOLERANCE["float32"]
    padding = np.asarray(out)[:, :, -VARLEN_PADDING:] if head_first else np.asarray(out)[:, -VARLEN_PADDING:]
    assert np.all(padding == 0), "tokens past cu_seqlens[-1] must be 0"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("reverse", [False, True])
def test_chunks_of_one_token(rng, impl, reverse):
    cu = cu_from_lengths([3, 0, 1, 4])
    x = make_input(rng, (1, 10, 2))
    out = run("local", x, impl, chunk_size=1, reverse=reverse, scale=2.0, cu_seqlens=jnp.asarray(cu))
    assert rel_err(out, numpy_cumsum(x, 1, reverse=reverse, scale=2.0, cu_seqlens=cu)) < TOLERANCE["float32"]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_dtypes(rng, impl, op, dtype):
    x = make_input(rng, (2, 90, 4, 3), dtype)
    out = run(op, x, impl, reverse=True)
    assert out.dtype == jnp.dtype(dtype)
    assert rel_err(out, expected(op, x, reverse=True)) < TOLERANCE[dtype]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op", OPS)
def test_output_dtype_and_float32_accumulation(rng, impl, op):
    # bf16 inputs, float32 output: the sums of 300 tokens must be float32-accurate, which only an
    # float32 accumulator gives (a bf16 one would be off by about 1e-2).
    x = make_input(rng, (1, 300, 2), "bfloat16")
    out = run(op, x, impl, chunk_size=256, output_dtype=jnp.float32)
    assert out.dtype == jnp.float32
    assert rel_err(out, expected(op, x, chunk_size=256)) < TOLERANCE["float32"]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op", OPS)
def test_softmax_scale(rng, impl, op):
    scale = float(rng.uniform(0.1, 2.0))
    cu = cu_from_lengths([5, 0, 40])
    x = make_input(rng, (1, 45, 2, 3))
    out = run(op, x, impl, scale=scale, cu_seqlens=jnp.asarray(cu))
    assert rel_err(out, expected(op, x, scale=scale, cu_seqlens=cu)) < TOLERANCE["float32"]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op", OPS)
def test_jit_with_traced_cu_seqlens(rng, impl, op):
    traces = []

    @jax.jit
    def f(x, cu):
        traces.append(1)
        return run(op, x, impl, chunk_size=8, reverse=True, cu_seqlens=cu)

    x = make_input(rng, (1, 50, 3))
    for lengths in ([10, 0, 33, 1, 6], [1, 1, 0, 17, 25]):  # same number of sequences: one trace
        cu = cu_from_lengths(lengths)
        out = f(x, jnp.asarray(cu))
        assert rel_err(out, expected(op, x, chunk_size=8, reverse=True, cu_seqlens=cu)) < TOLERANCE["float32"]
    assert len(traces) == 1


def reference(op, x, chunk_size=16, **kw):
    if op == "local":
        return reference_local_cumsum(x, chunk_size, **kw)
    return reference_global_cumsum(x, **kw)


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("reverse", [False, True])
def test_reference_matches_numpy(rng, op, reverse):
    cu = cu_from_lengths([7, 0, 1, 30])
    x = make_input(rng, (1, 3, 40, 2))
    kw = dict(reverse=reverse, cu_seqlens=cu, head_first=True)
    assert rel_err(reference(op, x, softmax_scale=0.5, **kw), expected(op, x, scale=0.5, **kw)) < TOLERANCE["float32"]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("case", ["dense_reverse", "packed_vector_head_first"])
def test_gradients_match_float64_autodiff(rng, impl, op, case):
    if case == "dense_reverse":
        shape, kw = (2, 70, 3), dict(reverse=True)
    else:
        shape, kw = (1, 2, 70, 3), dict(cu_seqlens=cu_from_lengths([0, 33, 1, 30]), head_first=True)
    x = make_input(rng, shape)
    weights = make_input(rng, shape)  # grad of sum(weights * out): a cotangent that is not all ones
    scale = 0.7

    def loss(x):
        return jnp.sum(weights * run(op, x, impl, scale=scale, **kw))

    grad = jax.jit(jax.grad(loss))(x)
    with jax.enable_x64(True):
        x64, w64 = (jnp.asarray(np.asarray(a), jnp.float64) for a in (x, weights))
        ref = jax.grad(lambda x: jnp.sum(w64 * reference(op, x, softmax_scale=scale, **kw)))(x64)
        ref = np.asarray(ref)
    assert grad.dtype == x.dtype
    assert rel_err(grad, ref) < TOLERANCE["float32"]


@pytest.mark.parametrize("impl", IMPLS)
def test_gradient_has_the_input_dtype(rng, impl):
    x = make_input(rng, (1, 20, 2), "bfloat16")
    grad = jax.grad(lambda x: jnp.sum(chunk_local_cumsum(x, 8, output_dtype=jnp.float32, impl=impl)))(x)
    assert grad.dtype == jnp.bfloat16
    # The gradient of sum(cumsum(x)) is the reverse cumsum of ones: small integers, exact in bf16.
    np.testing.assert_array_equal(np.asarray(grad, np.float32), numpy_cumsum(np.ones(x.shape), 8, reverse=True))


@settings(max_examples=15, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 20), min_size=1, max_size=5),
    padding=st.integers(0, 3),
    chunk_size=st.sampled_from([1, 2, 4, 8, 32]),
    reverse=st.booleans(),
    op=st.sampled_from(OPS),
    layout=st.sampled_from(LAYOUTS),
    seed=st.integers(0, 2**31 - 1),
)
def test_random_packings(lengths, padding, chunk_size, reverse, op, layout, seed):
    cu = cu_from_lengths(lengths)
    head_first = layout.endswith("head_first")
    shape = shape_of(layout, batch=1, tokens=int(cu[-1]) + padding, heads=2, features=3)
    x = make_input(np.random.default_rng(seed), shape)
    kw = dict(chunk_size=chunk_size, reverse=reverse, cu_seqlens=cu, head_first=head_first)
    ref = expected(op, x, **kw)
    for impl in IMPLS:
        out = run(op, x, impl, **{**kw, "cu_seqlens": jnp.asarray(cu)})
        if x.size == 0:
            assert out.shape == x.shape
        else:
            assert rel_err(out, ref) < TOLERANCE["float32"], impl


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("op", OPS)
def test_empty_inputs(impl, op):
    for x, cu in [(jnp.zeros((2, 0, 3)), None), (jnp.zeros((1, 0, 3, 2)), jnp.asarray([0, 0, 0]))]:
        out = run(op, x, impl, cu_seqlens=cu)
        assert out.shape == x.shape and out.dtype == x.dtype


@pytest.mark.parametrize("impl", IMPLS)
def test_bad_arguments_raise_value_errors(impl):
    x = jnp.ones((1, 8, 2))
    cases = [
        ("chunk_size", lambda: chunk_local_cumsum(x, 3, impl=impl)),
        ("chunk_size", lambda: chunk_local_cumsum(x, 0, impl=impl)),
        ("chunk_size", lambda: chunk_local_cumsum(x, 4.0, impl=impl)),
        ("chunk_size", lambda: chunk_local_cumsum(x, True, impl=impl)),
        ("g", lambda: chunk_local_cumsum(jnp.ones((8, 2)), 4, impl=impl)),
        ("s", lambda: chunk_global_cumsum(jnp.ones((1, 8, 2, 2, 2)), impl=impl)),
        ("s", lambda: chunk_global_cumsum(jnp.ones((1, 8, 2), jnp.int32), impl=impl)),
        ("batch", lambda: chunk_global_cumsum(jnp.ones((2, 8, 2)), cu_seqlens=jnp.asarray([0, 8]), impl=impl)),
        ("cu_seqlens", lambda: chunk_global_cumsum(x, cu_seqlens=jnp.asarray([1, 8]), impl=impl)),
        ("cu_seqlens", lambda: chunk_local_cumsum(x, 4, cu_seqlens=jnp.asarray([0, 5, 3]), impl=impl)),
        ("cu_seqlens", lambda: chunk_local_cumsum(x, 4, cu_seqlens=jnp.asarray([0, 9]), impl=impl)),
        ("cu_seqlens", lambda: chunk_global_cumsum(x, cu_seqlens=jnp.asarray([0.0, 8.0]), impl=impl)),
        ("cu_seqlens", lambda: chunk_global_cumsum(x, cu_seqlens=jnp.asarray([[0, 8]]), impl=impl)),
        ("softmax_scale", lambda: chunk_global_cumsum(x, softmax_scale="big", impl=impl)),
        ("output_dtype", lambda: chunk_global_cumsum(x, output_dtype=jnp.int32, impl=impl)),
    ]
    for name, call in cases:
        with pytest.raises(ValueError, match=name):
            call()
    with pytest.raises(ValueError, match="impl"):
        chunk_global_cumsum(x, impl="cuda")


# ----------------------------------------------------------------------------------------------
# Pinned tiles: config= instead of the autotuner.
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", OPS)
@pytest.mark.parametrize("config", [CumsumConfig(), CumsumConfig(block_t=4, block_c=2, num_warps=1, num_stages=1),
                                    CumsumConfig(block_t=128, block_c=64, num_warps=8),
                                    CumsumConfig(block_t=2, block_c=256, num_warps=1, num_stages=3),
                                    CumsumConfig(block_t=4, block_c=4, num_warps=2, num_stages=1, prefetch=True)])
def test_pinned_config(rng, op, config):
    """A pinned config (tiles smaller and larger than the data, a block_t above the chunk size, a
    pipelined walk of short, wide blocks, a walk that holds the next block in registers) gives
    the same sums and gradients; the backward uses the same config."""
    cu = cu_from_lengths([5, 0, 11, 1])
    x = make_input(rng, (1, 19, 3, 5))
    fn = chunk_local_cumsum if op == "local" else chunk_global_cumsum
    kwargs = dict(chunk_size=8) if op == "local" else {}
    out = fn(x, **kwargs, reverse=True, cu_seqlens=jnp.asarray(cu), impl="triton", config=config)
    assert rel_err(out, expected(op, x, 8, reverse=True, cu_seqlens=cu)) < TOLERANCE["float32"]
    weights = make_input(rng, x.shape)
    grad = jax.grad(lambda a: jnp.sum(weights * fn(a, **kwargs, cu_seqlens=jnp.asarray(cu), impl="triton",
                                                   config=config)))(x)
    assert rel_err(grad, expected(op, weights, 8, reverse=True, cu_seqlens=cu)) < TOLERANCE["float32"]


def test_config_is_validated():
    for field, value in [("block_t", 6), ("block_c", 0), ("num_warps", 3), ("num_stages", 0), ("block_t", 8.0),
                         ("block_c", True), ("num_warps", None), ("split", 0), ("split", None),
                         ("split", 2.0), ("tensor_cores", 1), ("tensor_cores", None), ("prefetch", 1),
                         ("prefetch", "yes")]:
        with pytest.raises(ValueError, match=f"CumsumConfig.{field}"):
            CumsumConfig(**{field: value})
    with pytest.raises(ValueError, match="config"):
        chunk_global_cumsum(jnp.ones((1, 8, 2)), impl="triton", config={"block_t": 4})
    config = CumsumConfig(block_t=np.int64(16), block_c=np.int32(8))
    assert type(config.block_t) is int and type(config.block_c) is int and hash(config) == hash(CumsumConfig(16, 8))
    assert CumsumConfig(tensor_cores=np.bool_(True)).tensor_cores is True
    for block_t, block_c in [(8, 16), (16, 8)]:  # tl.dot needs 16 rows and columns at least
        with pytest.raises(ValueError, match="at least 16 with tensor_cores"):
            CumsumConfig(block_t, block_c, tensor_cores=True)
    with pytest.raises(ValueError, match="CumsumConfig.num_stages must be 1 with prefetch=True, got 3"):
        CumsumConfig(prefetch=True)
    assert CumsumConfig(num_stages=1, prefetch=np.bool_(True)).prefetch is True


# ----------------------------------------------------------------------------------------------
# Arguments: NumPy scalars are numbers, cu_seqlens of any integer dtype, values that would wrap.
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", IMPLS)
def test_numpy_scalars_behave_like_python_numbers(rng, impl):
    cu = cu_from_lengths([5, 0, 11])
    x = make_input(rng, (1, 19, 2))
    out = chunk_local_cumsum(x, np.int64(4), softmax_scale=np.float32(0.5), cu_seqlens=jnp.asarray(cu), impl=impl)
    assert rel_err(out, numpy_cumsum(x, 4, scale=0.5, cu_seqlens=cu)) < TOLERANCE["float32"]
    out = chunk_global_cumsum(x, reverse=np.bool_(True), softmax_scale=np.int32(2), impl=impl)
    assert rel_err(out, numpy_cumsum(x, reverse=True, scale=2.0)) < TOLERANCE["float32"]
    for bad in (np.float64(4.0), np.bool_(True), jnp.int32(4)):
        with pytest.raises(ValueError, match="chunk_size"):
            chunk_local_cumsum(x, bad, impl=impl)
    for bad in (True, np.bool_(True), "2"):
        with pytest.raises(ValueError, match="softmax_scale"):
            chunk_global_cumsum(x, softmax_scale=bad, impl=impl)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", ["int8", "uint8", "int16", "uint16", "uint32", "uint64", "int64"])
def test_cu_seqlens_of_any_integer_dtype(rng, impl, dtype):
    # 120 tokens (int8 holds the offsets) in chunks of 16, 3 padding tokens after them.
    lengths = [40, 0, 57, 3, 20]
    cu = cu_from_lengths(lengths)
    x = make_input(rng, (1, 123, 2))
    for op in OPS:
        out = run(op, x, impl, chunk_size=16, reverse=True, cu_seqlens=cu.astype(dtype))
        ref = expected(op, x, chunk_size=16, reverse=True, cu_seqlens=cu)
        assert rel_err(out, ref) < TOLERANCE["float32"], op
    traced = jax.jit(lambda x, c: run("local", x, impl, chunk_size=16, cu_seqlens=c))(x, jnp.asarray(cu.astype(dtype)))
    assert rel_err(traced, expected("local", x, chunk_size=16, cu_seqlens=cu)) < TOLERANCE["float32"]


@pytest.mark.parametrize("bad, match", WRAPPING_CU_SEQLENS)
def test_cu_seqlens_that_would_wrap_are_refused(rng, bad, match):
    x = make_input(rng, (1, 12, 2))
    for op in OPS:
        for impl in IMPLS:
            with pytest.raises(ValueError, match=f"cu_seqlens.*{match}"):
                run(op, x, impl, cu_seqlens=bad)


def test_default_config_is_the_autotuners_first():
    """CumsumConfig() pins what the interpreter runs with config=None: each kernel's first
    autotune config (the local kernel's token block is min(64, chunk_size) either way)."""
    import ejk_lite.cumsum as cumsum

    config = CumsumConfig()
    for configs in (cumsum._GLOBAL_CONFIGS, *cumsum._GLOBAL_16_BIT_CONFIGS.values()):
        first = configs[0]
        assert (config.block_t, config.block_c, config.num_warps, config.num_stages, config.split,
                config.tensor_cores, config.prefetch) == (
                    first.kwargs["BLOCK_T"], first.kwargs["BLOCK_C"], first.num_warps, first.num_stages,
                    first.kwargs["SPLIT"], first.kwargs["USE_DOT"], first.kwargs["PREFETCH"])
    assert cumsum._local_configs(64)[0].kwargs["BLOCK_C"] == config.block_c


def test_each_direction_takes_its_own_16_bit_list(monkeypatch):
    """A 16-bit global walk launches the autotuner of its direction's list (the forward's
    tensor-core tile at 7 stages, the reverse sum's at 8: the comment above _GLOBAL_TILES), a
    float32 one the walk's list; the gradient, a reverse sum, takes the reverse list."""
    import ejk_lite.cumsum as cumsum

    launched = []

    def spy(*args, kernel, **kwargs):
        launched.append(kernel)
        return triton_call(*args, kernel=kernel, **kwargs)

    triton_call = cumsum.triton_call
    monkeypatch.setattr(cumsum, "triton_call", spy)
    # 8200 tokens: past the two-pass path's 128 chunks of 64, so one walk
    x = jax.random.normal(jax.random.key(0), (1, 8200, 1), jnp.bfloat16)
    for reverse in (False, True):
        launched.clear()
        chunk_global_cumsum(x, reverse=reverse, impl="triton")
        assert launched == [cumsum._global_16_bit_autotuned[reverse]]
    launched.clear()
    jax.grad(lambda x: chunk_global_cumsum(x, impl="triton").astype(jnp.float32).sum())(x)
    assert launched == [cumsum._global_16_bit_autotuned[False],
                        cumsum._global_16_bit_autotuned[True]]
    launched.clear()
    chunk_global_cumsum(x.astype(jnp.float32), reverse=True, impl="triton")
    assert launched == [cumsum._global_autotuned]


def test_configs_of_tiles():
    """_configs turns the tile tuples of both kernels into triton.Configs (the global ones with
    SPLIT), one per tile."""
    import ejk_lite.cumsum as cumsum

    (local,) = cumsum._configs([(8, 256, 1, 3)])
    assert local.kwargs == {"BLOCK_T": 8, "BLOCK_C": 256, "NUM_STAGES": 3}
    assert (local.num_warps, local.num_stages) == (1, 3)
    for configs, tiles in [(cumsum._GLOBAL_CONFIGS, _GLOBAL_TILES),
                           *[(cumsum._GLOBAL_16_BIT_CONFIGS[r], _GLOBAL_16_BIT_TILES[r])
                             for r in (False, True)]]:
        assert len(configs) == len(tiles)
        for config, (block_t, block_c, num_warps, stages, split, dot, prefetch) in zip(configs, tiles):
            assert config.kwargs == {"BLOCK_T": block_t, "BLOCK_C": block_c, "NUM_STAGES": stages,
                                     "SPLIT": split, "USE_DOT": dot, "PREFETCH": prefetch}
            assert (config.num_warps, config.num_stages) == (num_warps, stages)
            assert not prefetch or stages == 1  # as CumsumConfig asks
    # 32-bit inputs never take the tensor cores (their products would be TF32); 16-bit ones may
    assert not any(t[5] for t in _GLOBAL_TILES)
    assert all(any(t[5] for t in tiles) for tiles in _GLOBAL_16_BIT_TILES.values())
    assert any(t[6] for t in _GLOBAL_TILES)


@pytest.mark.parametrize("chunk_size", [1, 8, 64, 256])
def test_local_autotune_list_fits_the_chunk(chunk_size):
    """The local kernel's autotune list for a chunk size: no block taller than a chunk, a chunk of
    one block not pipelined, no tile twice, and the first entry CumsumConfig()'s."""
    import ejk_lite.cumsum as cumsum

    tiles = [(c.kwargs["BLOCK_T"], c.kwargs["BLOCK_C"], c.num_warps, c.kwargs["NUM_STAGES"])
             for c in cumsum._local_configs(chunk_size)]
    assert len(set(tiles)) == len(tiles) and tiles[0][:3] == (min(64, chunk_size), 32, 4)
    assert all(block_t <= chunk_size and (stages == 1 or block_t < chunk_size) for block_t, _, _, stages in tiles)
    for block_t, block_c, num_warps, stages in _LOCAL_TILES:  # each listed tile is there, capped
        block_t = min(block_t, chunk_size)
        assert (block_t, block_c, num_warps, 1 if block_t == chunk_size else stages) in tiles


@pytest.mark.parametrize("op, tile", [("local", t) for t in _LOCAL_TILES]
                         + [("global", t) for t in _ALL_GLOBAL_TILES])
def test_every_autotune_tile(rng, op, tile):
    """Each tile the autotuner may pick, pinned, gives the right sums (the interpreter runs only
    the first one when autotuning): packed sequences, columns not a multiple of the tile; the
    tiles that scan on the tensor cores in float16, which takes them (the sums in float32; the
    interpreter hands bfloat16 to a kernel as float32, so float16 is what runs them on a CPU)."""
    config = CumsumConfig(*tile)
    cu = cu_from_lengths([5, 0, 70, 1])
    dtype = "float16" if config.tensor_cores else "float32"
    x = make_input(rng, (1, 80, 3, 7), dtype)
    fn = chunk_local_cumsum if op == "local" else chunk_global_cumsum
    kwargs = dict(chunk_size=64) if op == "local" else {}
    for reverse in (False, True):
        out = fn(x, **kwargs, reverse=reverse, cu_seqlens=jnp.asarray(cu), impl="triton", config=config,
                 output_dtype=jnp.float32)
        assert rel_err(out, expected(op, x, 64, reverse=reverse, cu_seqlens=cu)) < TOLERANCE["float32"]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("split, dtype", [(1, "bfloat16"), (3, "float32"), (4, "float16"),
                                         (2, "bfloat16")])
@pytest.mark.parametrize("tensor_cores", [False, True])
def test_split_walks(rng, layout, split, dtype, tensor_cores):
    """The global kernel with ``split`` programs a sequence, pinned to 16-token blocks: packed
    sequences of 37 (not a whole number of blocks), 0, 1, 16 and 5 tokens, 4 padding tokens after
    them, and one unpacked sequence of 75 (split 4: spans of 32, 32, 11 and an empty one); both
    directions; columns fewer than a tile (scalar: 3) and more (vector: 21); sums in float32 and
    the gradient in the input dtype. With ``tensor_cores`` the 16-bit inputs scan on the tensor
    cores (float32 sums all the same: a carry rounded to 16 bits fails the float32 tolerance);
    float32 ones take tl.cumsum. (On a CPU only float16 does: the interpreter hands bfloat16 to a
    kernel as float32.) Even splits hold the next block in registers (prefetch) instead of
    pipelining."""
    head_first = layout.endswith("head_first")
    prefetch = split % 2 == 0
    config = CumsumConfig(block_t=16, block_c=16, num_warps=4, num_stages=1 if prefetch else 2, split=split,
                          tensor_cores=tensor_cores, prefetch=prefetch)
    cu = cu_from_lengths([37, 0, 1, 16, 5])
    for batch, tokens, cu_seqlens in [(1, int(cu[-1]) + 4, cu), (2, 75, None)]:
        x = make_input(rng, shape_of(layout, batch, tokens, heads=3, features=7), dtype)
        packed = None if cu_seqlens is None else jnp.asarray(cu_seqlens)
        for reverse in (False, True):
            out = chunk_global_cumsum(x, reverse=reverse, cu_seqlens=packed, head_first=head_first,
                                      output_dtype=jnp.float32, impl="triton", config=config)
            ref = numpy_cumsum(x, reverse=reverse, cu_seqlens=cu_seqlens, head_first=head_first)
            assert rel_err(out, ref) < TOLERANCE["float32"], (batch, reverse)
        weights = make_input(rng, x.shape, dtype)
        grad = jax.grad(lambda a: jnp.sum(weights.astype(jnp.float32) * chunk_global_cumsum(
            a, cu_seqlens=packed, head_first=head_first, output_dtype=jnp.float32, impl="triton",
            config=config)))(x)
        assert grad.dtype == x.dtype
        ref = numpy_cumsum(weights, reverse=True, cu_seqlens=cu_seqlens, head_first=head_first)
        assert rel_err(grad, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("two_pass", [False, True])
def test_one_and_two_pass_global_cumsum(rng, monkeypatch, layout, reverse, two_pass):
    """Autotuned (config=None), the global cumsum runs in two passes on inputs of at most
    _TWO_PASS_MAX_BYTES with few walks (chunk totals, then chunks that start from the totals
    before them), one walk per sequence otherwise; both, forced: a sequence of more than 64 chunks of 64 (with
    the interpreter's 32-column tile the carry sums 64 totals a step), lengths that are no multiple of a chunk, empty and one-token
    sequences, padding after cu_seqlens[-1], traced cu_seqlens, and unpacked rows."""
    import ejk_lite.cumsum as cumsum

    monkeypatch.setattr(cumsum, "_TWO_PASS_MAX_BYTES", 1 << 40 if two_pass else 0)
    monkeypatch.setattr(cumsum, "_TWO_PASS_MAX_WALKS", 1 << 40)
    monkeypatch.setattr(cumsum, "_TWO_PASS_MAX_CHUNKS", 1 << 40)
    head_first = layout.endswith("head_first")
    cu = cu_from_lengths([4161, 0, 1, 64, 26])
    x = make_input(rng, shape_of(layout, 1, int(cu[-1]) + 3, heads=2, features=1))
    fn = jax.jit(lambda x, cu: chunk_global_cumsum(x, reverse=reverse, cu_seqlens=cu, head_first=head_first,
                                                   impl="triton"))
    out = fn(x, jnp.asarray(cu))
    assert rel_err(out, numpy_cumsum(x, reverse=reverse, cu_seqlens=cu, head_first=head_first)) < TOLERANCE["float32"]
    x = make_input(rng, shape_of(layout, 2, 130, heads=3, features=5))
    out = chunk_global_cumsum(x, reverse=reverse, head_first=head_first, impl="triton")
    assert rel_err(out, numpy_cumsum(x, reverse=reverse, head_first=head_first)) < TOLERANCE["float32"]


@pytest.mark.parametrize("config", [None, CumsumConfig(block_t=16, block_c=16, split=3),
                                    CumsumConfig(block_t=16, block_c=16, tensor_cores=True),
                                    CumsumConfig(block_t=16, block_c=16, split=3, tensor_cores=True)])
@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_infinite_gates(rng, monkeypatch, config, reverse, dtype):
    """A -inf gate (log 0) makes the sums from it on -inf and leaves the ones before it alone; a
    +inf after it makes them NaN, as does a NaN: sequential semantics on every path (two passes,
    one walk, split walks, whose programs start from the sums of the spans before theirs, and
    the scan on the tensor cores, whose products would make the sums before an inf NaN: its
    walks with an inf or a NaN are walked again with tl.cumsum). Both 16-bit dtypes: the
    interpreter hands bfloat16 to a kernel as float32 (ejk_lite/launch.py), so on a CPU only
    float16 takes the tensor cores."""
    import ejk_lite.cumsum as cumsum

    for two_pass in ([False, True] if config is None else [False]):
        monkeypatch.setattr(cumsum, "_TWO_PASS_MAX_BYTES", 1 << 40 if two_pass else 0)
        monkeypatch.setattr(cumsum, "_TWO_PASS_MAX_WALKS", 1 << 40)
        monkeypatch.setattr(cumsum, "_TWO_PASS_MAX_CHUNKS", 1 << 40)
        x = np.asarray(make_input(rng, (2, 70, 4), dtype), np.float32)
        x[0, 20, 0] = -np.inf  # mid-block: tokens 16-19 must stay finite
        x[0, 21, 1], x[0, 50, 1] = -np.inf, np.inf
        x[1, 37, 2] = np.nan
        x = jnp.asarray(x, dtype)
        out = np.asarray(chunk_global_cumsum(x, reverse=reverse, output_dtype=jnp.float32, impl="triton",
                                             config=config), np.float64)
        ref = numpy_cumsum(x, reverse=reverse)
        np.testing.assert_array_equal(np.isnan(out), np.isnan(ref))
        np.testing.assert_array_equal(np.isposinf(out), np.isposinf(ref))
        np.testing.assert_array_equal(np.isneginf(out), np.isneginf(ref))
        finite = np.isfinite(ref)
        np.testing.assert_allclose(out[finite], ref[finite], rtol=1e-5, atol=1e-4)


def launched_kernels(monkeypatch):
    """A function of (x, cu_seqlens, config) giving the names of the kernels the autotuned
    (or pinned) global cumsum launches on x, and the cumsum: the path is chosen while tracing."""
    import ejk_lite.cumsum as cumsum

    launched = []
    real = cumsum.triton_call
    monkeypatch.setattr(cumsum, "triton_call", lambda *a, kernel, **k: (
        launched.append(getattr(kernel, "fn", kernel).__name__), real(*a, kernel=kernel, **k))[1])

    def kernels(x, cu_seqlens=None, config=None, reverse=False):
        jax.clear_caches()  # trace again: the choice is made while tracing
        launched.clear()
        out = chunk_global_cumsum(x, reverse=reverse, cu_seqlens=cu_seqlens, impl="triton",
                                  config=config)
        return launched[:], out

    return kernels


TWO_PASSES = ["chunk_sums_kernel", "chunk_local_cumsum_kernel"]
ONE_PASS = ["chunk_global_cumsum_kernel"]


def test_two_pass_only_for_small_inputs_with_few_walks(monkeypatch):
    """The autotuned global cumsum takes two passes for an input of at most _TWO_PASS_MAX_BYTES
    with at most _TWO_PASS_MAX_WALKS one-pass walks (rows x 32-column tiles x sequences) and at
    most _TWO_PASS_MAX_CHUNKS chunks of _TWO_PASS_CHUNK tokens (T bounds every sequence), else
    one; a pinned config always one."""
    import ejk_lite.cumsum as cumsum

    launched = launched_kernels(monkeypatch)

    def kernels(shape, config=None, cu_seqlens=None):
        cu = None if cu_seqlens is None else jnp.asarray(cu_seqlens)
        return launched(jnp.ones(shape), cu, config)[0]

    monkeypatch.setattr(cumsum, "_TWO_PASS_MAX_WALKS", 4)
    assert kernels((4, 8, 32)) == TWO_PASSES  # 4 walks
    assert kernels((5, 8, 32)) == ONE_PASS
    assert kernels((2, 8, 65)) == ONE_PASS  # 2 x 3 column tiles
    assert kernels((4, 8, 32), CumsumConfig()) == ONE_PASS
    monkeypatch.setattr(cumsum, "_TWO_PASS_MAX_CHUNKS", 2)  # of 64 tokens
    assert kernels((1, 128, 1)) == TWO_PASSES
    assert kernels((1, 129, 1)) == ONE_PASS
    assert kernels((1, 129, 1), cu_seqlens=[0, 64, 129]) == ONE_PASS  # T bounds the lengths
    assert kernels((1, 128, 1), cu_seqlens=[0, 64, 100]) == TWO_PASSES
    monkeypatch.setattr(cumsum, "_TWO_PASS_MAX_BYTES", 4 * 8 * 32 * 4 - 1)
    assert kernels((4, 8, 32)) == ONE_PASS


@pytest.mark.parametrize("reverse", [False, True])
def test_long_sequence_walks_in_one_pass(rng, monkeypatch, reverse):
    """Two passes re-add every earlier chunk total for each chunk (quadratic in a sequence's
    chunks): a sequence of one token more than _TWO_PASS_MAX_CHUNKS chunks takes the one pass,
    one of exactly that many the two; both give the float64 sums."""
    import ejk_lite.cumsum as cumsum

    launched = launched_kernels(monkeypatch)
    limit = cumsum._TWO_PASS_MAX_CHUNKS * cumsum._TWO_PASS_CHUNK
    for tokens, path in [(limit + 1, ONE_PASS), (limit, TWO_PASSES)]:
        x = make_input(rng, (1, tokens, 2))
        kernels, out = launched(x, reverse=reverse)
        assert kernels == path, tokens
        assert rel_err(out, numpy_cumsum(x, reverse=reverse)) < TOLERANCE["float32"], tokens
