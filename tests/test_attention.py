"""ejk_lite.blocksparse_attention against float64 references: the output and every gradient.

Each case runs the Triton kernels (``impl="triton"``) with small explicit block sizes -- different
for the forward and the backward, so both the multi-block paths and the backward's own block mask
are exercised -- and compares the output and the gradients of query, key, value, ``softmax_aux``
and ``bias`` (through ``jax.vjp`` with a random cotangent) with ``attention.reference`` evaluated in
float64 on the same rounded inputs. Some cases also check the forward against a softmax written here
in NumPy, so that a misreading shared by the reference and the kernels (the sink's place in the
denominator, soft cap before bias, rows with nothing visible) cannot pass unnoticed.
"""

import dataclasses
import functools
import importlib

import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TOLERANCE, compiled_package_launches, offline_compile, rel_err, tolerance

import ejk_lite
from ejk_lite import BlockMask, blocksparse_attention, make_block_mask
from ejk_lite.attention import BlockSizes, reference

FWD, BWD = BlockSizes(16, 16), BlockSizes(32, 16)  # small tiles: several blocks, and fwd != bwd
DIFFERENTIABLE = ("query", "key", "value", "softmax_aux", "bias")


# ----------------------------------------------------------------------------------------------
# Inputs, the independent NumPy softmax, and the comparison.
# ----------------------------------------------------------------------------------------------


def make_inputs(rng, *, B=1, H=2, H_kv=1, T=40, S=None, D=24, Dv=None, sinks=False, bias_shape=None,
                q_scale=1.0):
    S = T if S is None else S
    Dv = D if Dv is None else Dv
    arrays = dict(query=q_scale * rng.normal(size=(B, H, T, D)), key=rng.normal(size=(B, H_kv, S, D)),
                  value=rng.normal(size=(B, H_kv, S, Dv)))
    if sinks:  # sinks that matter: comparable to a row's sum of exponentials, one dominating
        arrays["softmax_aux"] = np.r_[4.0, rng.normal(1.5, 1.0, size=H - 1)]
    if bias_shape is not None:
        arrays["bias"] = rng.normal(size=bias_shape)
    return arrays


def document_ids(rng, n, batch):
    """Sorted segment ids of packed documents (one-token and empty documents included)."""
    rows = []
    for _ in range(batch):
        lengths = [1, 0] + list(rng.multinomial(n - 1, rng.dirichlet(np.ones(4))))
        rows.append(np.repeat(np.arange(len(lengths)), lengths))
    return np.stack(rows).astype(np.int32)


def restarting_positions(ids):
    out = np.empty_like(ids)
    for b, row in enumerate(ids):
        starts = np.r_[0, np.flatnonzero(np.diff(row)) + 1]
        out[b] = np.arange(len(row)) - np.repeat(starts, np.diff(np.r_[starts, len(row)]))
    return out


def numpy_visible(T, S, q_segment_ids=None, kv_segment_ids=None, q_positions=None, kv_positions=None,
                  causal=True, sliding_window=None, attention_mask=None, **_):
    vis = np.ones((1, 1, T, S), bool)
    if q_segment_ids is not None:
        vis = vis & (q_segment_ids[:, None, :, None] == kv_segment_ids[:, None, None, :])
    qp = np.arange(T)[None] if q_positions is None else q_positions
    kp = np.arange(S)[None] if kv_positions is None else kv_positions
    d = kp[:, None, None, :].astype(np.int64) - qp[:, None, :, None]
    if causal:
        vis = vis & (d <= 0)
    if sliding_window is not None:
        left, right = (sliding_window, sliding_window) if np.isscalar(sliding_window) else sliding_window
        vis = vis & (-left <= d) & (d <= right)
    if attention_mask is not None:
        vis = vis & (np.asarray(attention_mask) != 0)
    return vis


def numpy_attention(query, key, value, softmax_aux=None, bias=None, *, logits_soft_cap=None,
                    softmax_scale=None, **options):
    """p_ij = e^{s_ij} / (e^{sink_h} + sum_j visible e^{s_ij}); s = cap tanh(scale q.k / cap) + bias."""
    B, H, T, D = query.shape
    S = key.shape[2]
    G = H // key.shape[1]
    k, v = np.repeat(key, G, axis=1), np.repeat(value, G, axis=1)
    s = np.einsum("bhtd,bhsd->bhts", query, k) * (D ** -0.5 if softmax_scale is None else softmax_scale)
    if logits_soft_cap is not None:
        s = logits_soft_cap * np.tanh(s / logits_soft_cap)
    if bias is not None:
        s = s + bias
    visible = np.broadcast_to(numpy_visible(T, S, **options), s.shape)
    out = np.zeros((B, H, T, value.shape[-1]))
    for b, h, t in np.ndindex(B, H, T):
        row = s[b, h, t][visible[b, h, t]]
        terms = list(row) + ([softmax_aux[h]] if softmax_aux is not None else [])
        if not terms:
            continue  # nothing visible, no sink: zeros
        m = max(terms)
        e = np.exp(row - m)
        denominator = e.sum() + (np.exp(softmax_aux[h] - m) if softmax_aux is not None else 0.0)
        out[b, h, t] = e @ v[b, h][visible[b, h, t]] / denominator
    return out


def run(arrays, dtype, options, *, fwd=FWD, bwd=BWD, cotangent_rng=None):
    """The kernels' output and gradients (of every array in ``arrays``) and the float64 reference's."""
    names = list(arrays)
    xs = [jnp.asarray(arrays[name], dtype) for name in names]

    def call(fn, *xs, **extra):
        return fn(**dict(zip(names, xs)), **options, **extra)

    out, vjp = jax.vjp(lambda *xs: call(blocksparse_attention, *xs, impl="triton", fwd_blocks=fwd,
                                        bwd_blocks=bwd), *xs)
    cotangent = jnp.asarray(cotangent_rng.normal(size=out.shape), dtype)
    grads = vjp(cotangent)
    with jax.enable_x64(True):
        xs64 = [jnp.asarray(np.asarray(x, np.float64)) for x in xs]
        ref, ref_vjp = jax.vjp(lambda *xs: call(reference, *xs), *xs64)
        ref_grads = ref_vjp(jnp.asarray(np.asarray(cotangent, np.float64)))
        ref, ref_grads = np.asarray(ref), [np.asarray(g) for g in ref_grads]
    inputs64 = {name: np.asarray(x, np.float64) for name, x in zip(names, xs)}
    return out, dict(zip(names, grads)), ref, dict(zip(names, ref_grads)), inputs64


def check(rng, arrays, options, dtype=jnp.float32, *, numpy_check=False, fwd=FWD, bwd=BWD):
    """Compare output and gradients with the float64 reference (and the NumPy softmax if asked)."""
    out, grads, ref, ref_grads, inputs64 = run(arrays, dtype, options, fwd=fwd, bwd=bwd, cotangent_rng=rng)
    B, H, T, _ = arrays["query"].shape
    assert out.shape == (B, H, T, arrays["value"].shape[-1]) and out.dtype == dtype
    tol, grad_tol = tolerance(dtype), tolerance(dtype, gradient=True)  # ejk_lite.testing: why
    errors = {"output": rel_err(out, ref)}
    for name, grad in grads.items():
        assert grad.shape == arrays[name].shape and grad.dtype == dtype, name
        errors[f"d{name}"] = rel_err(grad, ref_grads[name])
    failed = {k: e for k, e in errors.items() if e > (tol if k == "output" else grad_tol)}
    assert not failed, f"errors {errors} (tolerance {tol}, gradients {grad_tol})"
    if numpy_check:
        expected = numpy_attention(**inputs64, **options)
        assert rel_err(ref, expected) < 1e-12, "attention.reference disagrees with the NumPy softmax"
        assert rel_err(out, expected) <= tol
    return out, grads, ref, ref_grads


# ----------------------------------------------------------------------------------------------
# The cases of issue 9, forward and every gradient.
# ----------------------------------------------------------------------------------------------


def documents(rng, B, T, S=None, window=None, causal=True):
    q_ids = document_ids(rng, T, B)
    kv_ids = q_ids if S is None else document_ids(rng, S, B)
    return dict(q_segment_ids=q_ids, kv_segment_ids=kv_ids, q_positions=restarting_positions(q_ids),
                kv_positions=restarting_positions(kv_ids), causal=causal, sliding_window=window)


def padding_mask(rng, B, T, S):
    """Keys past each row's length are padding, and so are queries past another (rows with nothing)."""
    t, s = np.arange(T)[:, None], np.arange(S)[None, :]
    return np.stack([(s < rng.integers(S // 3, S)) & (t < rng.integers(T // 2, T)) for _ in range(B)])[:, None]


def prefix_lm_mask(rng, B, T):
    t, s = np.arange(T)[:, None], np.arange(T)[None, :]
    return np.stack([(s < rng.integers(1, T)) | (s <= t) for _ in range(B)])[:, None]


# name: (dtype, make_inputs keywords, options (a function of rng), check against NumPy too)
CASES = {
    "dense": (jnp.float32, dict(T=40, D=32), lambda rng: dict(causal=False), True),
    "causal_nonmultiple_dv": (jnp.float32, dict(T=45, D=24, Dv=40), lambda rng: dict(causal=True), False),
    "causal_window": (jnp.float32, dict(T=64, D=16), lambda rng: dict(causal=True, sliding_window=9), False),
    "two_sided_window_gqa1": (jnp.float32, dict(T=50, H=4, H_kv=1),
                              lambda rng: dict(causal=False, sliding_window=(7, 3)), True),
    "documents_gqa2": (jnp.float32, dict(B=2, T=56, H=4, H_kv=2), lambda rng: documents(rng, 2, 56), True),
    "documents_window": (jnp.float32, dict(B=2, T=48),
                         lambda rng: documents(rng, 2, 48, window=(4, 4), causal=False), False),
    "cross_attention": (jnp.float32, dict(T=24, S=56, H=4, H_kv=2, D=40, Dv=24),
                        lambda rng: dict(causal=True, q_positions=np.arange(32, 56, dtype=np.int32)[None]),
                        True),
    "sinks": (jnp.float32, dict(T=40, sinks=True, H=4, H_kv=2), lambda rng: dict(causal=True), True),
    "soft_cap_large_logits": (jnp.float32, dict(T=40, D=32, q_scale=12.0),
                              lambda rng: dict(causal=True, logits_soft_cap=2.0), True),
    "soft_cap_then_bias": (jnp.float32, dict(T=33, D=32, q_scale=12.0, bias_shape=(1, 2, 33, 33)),
                           lambda rng: dict(causal=False, logits_soft_cap=2.0), True),
    "bias_full": (jnp.float32, dict(B=2, T=37, bias_shape=(2, 2, 37, 37)), lambda rng: dict(causal=True),
                  False),
    "bias_heads_keys": (jnp.float32, dict(B=2, T=37, S=45, bias_shape=(1, 2, 1, 45)),
                        lambda rng: dict(causal=False), False),
    "bias_2d": (jnp.float32, dict(T=37, bias_shape=(37, 37)), lambda rng: dict(causal=True), False),
    "padding_mask": (jnp.float32, dict(B=2, T=40, S=50), lambda rng: dict(
        causal=False, attention_mask=padding_mask(rng, 2, 40, 50)), True),
    "prefix_lm_mask": (jnp.float32, dict(B=2, T=40), lambda rng: dict(
        causal=False, attention_mask=prefix_lm_mask(rng, 2, 40)), False),
    "one_token": (jnp.float32, dict(T=1, sinks=True), lambda rng: dict(causal=True), True),
    "one_query": (jnp.float32, dict(T=1, S=40), lambda rng: dict(
        causal=True, sliding_window=20, q_positions=np.array([[39]], np.int32)), True),
    # Low precision: several features at once (each feature has an fp32 case of its own above).
    "bf16_documents_sinks": (jnp.bfloat16, dict(B=2, T=56, H=4, H_kv=2, sinks=True),
                             lambda rng: documents(rng, 2, 56), False),
    "bf16_soft_cap_bias": (jnp.bfloat16, dict(T=40, q_scale=12.0, bias_shape=(1, 2, 1, 40)),
                           lambda rng: dict(causal=True, logits_soft_cap=2.0), False),
    "fp16_window_mask": (jnp.float16, dict(B=2, T=45, H=4, H_kv=1, D=40, Dv=24), lambda rng: dict(
        causal=True, sliding_window=(12, 0), attention_mask=padding_mask(rng, 2, 45, 45)), False),
    "fp16_cross_documents": (jnp.float16, dict(B=2, T=33, S=48), lambda rng: documents(rng, 2, 33, 48),
                             False),
}


@pytest.mark.parametrize("case", list(CASES))
def test_against_float64_reference(case, rng):
    dtype, shapes, options, numpy_check = CASES[case]
    options = options(rng)
    arrays = make_inputs(rng, **shapes)
    if "logits_soft_cap" in options:  # the logits reach far beyond the cap
        raw = np.einsum("bhtd,bhsd->bhts", arrays["query"][:, :1], arrays["key"][:, :1]) * shapes.get("D", 24) ** -0.5
        assert np.abs(raw).max() >= 5 * options["logits_soft_cap"]
    check(rng, arrays, options, dtype, numpy_check=numpy_check)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_backward_kernels_at_their_own_sizes(dtype, rng):
    """``bwd_blocks=(dkv, dq)``: each backward kernel walks a mask built at its own tiles. Lengths
    that are multiples of every tile (the kernels' unmasked fast path for full tiles), with
    documents, a soft cap, a bias and sinks, every gradient checked."""
    arrays = make_inputs(rng, B=2, T=64, H=4, H_kv=2, D=32, sinks=True, q_scale=6.0,
                         bias_shape=(1, 4, 64, 64))
    options = dict(documents(rng, 2, 64), logits_soft_cap=4.0)
    check(rng, arrays, options, dtype, fwd=BlockSizes(32, 32),
          bwd=(BlockSizes(16, 32), BlockSizes(32, 16)))


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("T, S", [(64, 64), (70, 90)])
def test_partial_and_full_tiles_in_one_loop(T, S, dtype, rng):
    """The forward walks a query block's partial and then its full tiles in one loop
    (``_fwd_tiles``), the token rule under a branch. Long documents at 16 x 16 tiles, so that
    rows hold tiles of both kinds (the test fails if full tiles are read from the wrong place);
    GQA; lengths that are and are not multiples of the tiles; float32 (NaN containment in the
    loop) and bfloat16 (the optimistic launch); every gradient."""
    def ids(lengths):  # two batch rows of documents, the second's reversed
        row = np.repeat(np.arange(len(lengths)), lengths)
        return np.stack([row, row[-1] - row[::-1]]).astype(np.int32)

    arrays = make_inputs(rng, B=2, T=T, S=S, H=4, H_kv=2, D=32)
    options = dict(q_segment_ids=ids([1, 0, T - 17, 16]),
                   kv_segment_ids=ids([1, 0, T - 17, S - T + 16]))
    mask = make_block_mask(T, S, q_block=16, kv_block=16, **options)
    assert int(mask.full_count.sum()) >= 10 and int(mask.partial_count.sum()) >= 10
    check(rng, arrays, options, dtype, fwd=BlockSizes(16, 16))


@offline_compile  # on a GPU, test_tiles_past_shared_memory launches them for real
def test_default_tiles_fit_shared_memory():
    """The default tiles compile for sm_90 within its shared memory (232448 bytes a block), with
    a bias and with a dense attention_mask, each a tile per pair in every pipeline stage, and
    with a value head dim of 256 at D128 (keyed by D alone, the forward's defaults asked for
    327680 bytes there). Compiled as jax-triton compiles (``tools/compile_check.py``), offline,
    so that a machine without a GPU sees it too (test_tiles_past_shared_memory is the same
    check on a GPU for the bias and the mask)."""
    # forward, dK/dV and dQ, each with a bias, with a mask and at D128 / DV256: nothing
    # skipped, nothing failed
    assert compiled_package_launches("shared_memory_child.py", arch=90) >= 9


@pytest.mark.parametrize("bad", [jnp.ones(3, bool), 1, "yes", None])
@pytest.mark.parametrize("name", ["bias", "mask"])
@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_defaults_refuse_what_is_not_a_bool(direction, name, bad):
    """``bias`` and ``mask`` of ``BlockSizes.forward`` and ``.backward`` say whether the call has
    one: an array (the bias itself, passed by mistake) or another non-bool is a ValueError
    naming the argument, not an error from ``bias or mask`` deep inside."""
    with pytest.raises(ValueError, match=f"^{name} must be True or False"):
        getattr(BlockSizes, direction)(128, jnp.bfloat16, **{name: bad}, shared_memory=166912)


@offline_compile
@pytest.mark.parametrize("arch, limit", [(80, 166912), (89, 101376)])
def test_default_tiles_fit_smaller_gpus(arch, limit):
    """On a GPU with less shared memory than Hopper's (an A100: 166912 bytes a block; sm_86 and
    sm_89, RTX 30xx and 40xx, A10, L4: 101376), the default tiles take fewer stages or smaller
    tiles and compile within it: bfloat16 D64, D128 and D256, float32 D128 and D256, plain,
    with a bias and with a mask, forward and backward (the Hopper defaults ask for up to 327680
    bytes on sm_80: tools/forward_shared_memory.py). The backward keeps its defaults, which fit
    both, but for float32 at D256 (196608 bytes on sm_80)."""
    assert compiled_package_launches("smaller_gpu_attention_child.py", arch=arch,
                                     shared_memory=limit) >= 45


@pytest.mark.parametrize("limit", [None, 232448, 300000, 230000, 166912, 101376, 40000])
@pytest.mark.parametrize("dtype, head_dim", [(jnp.bfloat16, 128), (jnp.bfloat16, 64),
                                             (jnp.float16, 96), (jnp.float32, 128),
                                             (jnp.float32, 64), (jnp.bfloat16, 256),
                                             (jnp.float32, 192), (jnp.bfloat16, 512)])
@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_defaults_follow_shared_memory(direction, limit, dtype, head_dim, monkeypatch):
    """``BlockSizes.forward`` and ``.backward`` keep the Hopper defaults where a block has
    Hopper's shared memory or more (or no driver says); with less, the first config of
    ``_SMALLER_FORWARDS`` (``_SMALLER_BACKWARDS``) from the Hopper default on (fewer stages,
    then smaller tiles) whose recorded sm_80 bytes fit; the smallest where none fits; the
    default where nothing is listed (the backward but for float32 past head dim 128, any head
    dim past 256).
    Never more stages than the Hopper default: 230000 bytes hold the plain default's three
    stages with a mask on sm_80 (229376), but the default with a mask takes two."""
    from ejk_lite.attention import (_SM80_BACKWARD_SHARED, _SM80_FORWARD_SHARED,
                                    _SMALLER_BACKWARDS, _SMALLER_FORWARDS, _shared_bytes)
    from ejk_lite.checks import next_power_of_2

    monkeypatch.setattr(ejk_lite.attention, "max_shared_memory", lambda: None)  # "no driver"
    lists, table = ((_SMALLER_FORWARDS, _SM80_FORWARD_SHARED) if direction == "forward"
                    else (_SMALLER_BACKWARDS, _SM80_BACKWARD_SHARED))
    itemsize = jnp.dtype(dtype).itemsize
    key = (itemsize, next_power_of_2(max(head_dim, 64)))  # the lists' key: padded head dim
    for bias, mask in [(False, False), (True, False), (False, True), (True, True)]:
        if direction == "forward":
            hopper = BlockSizes._hopper_forward(head_dim, dtype, bias or mask)
            plain = BlockSizes._hopper_forward(head_dim, dtype, False)  # the list starts from it
        else:
            hopper = plain = BlockSizes._hopper_backward(head_dim, dtype)
        got = getattr(BlockSizes, direction)(head_dim, dtype, bias=bias, mask=mask,
                                             shared_memory=limit)
        tiles = (got.block_q, got.block_kv, got.num_warps, got.num_stages)
        if limit is None or limit >= 232448 or key not in lists:
            assert got == hopper
            continue
        configs = lists[key]
        assert configs[0] == (plain.block_q, plain.block_kv, plain.num_warps, plain.num_stages)
        configs = configs[configs.index(
            (hopper.block_q, hopper.block_kv, hopper.num_warps, hopper.num_stages)):]
        fits = [c for c in configs if _shared_bytes(table, key + c, bias, mask) <= limit]
        assert tiles == (fits[0] if fits else configs[-1]), (bias, mask)
        assert got.num_stages <= hopper.num_stages, (bias, mask)
        if fits:
            assert _shared_bytes(table, key + tiles, bias, mask) <= limit
    # Literal cases, not the search restated: at D256 the Hopper defaults ask sm_80 for 139264
    # bytes (bf16 and float32 forward) and 196608 (float32 backward, its dK/dV kernel).
    picked = {("forward", jnp.bfloat16, 256, 101376): (64, 64, 4, 1),
              ("forward", jnp.float32, 192, 101376): (16, 16, 4, 1),
              ("forward", jnp.float32, 192, 166912): (32, 32, 4, 1),
              ("backward", jnp.float32, 192, 166912): (32, 16, 4, 1),
              ("backward", jnp.float32, 192, 101376): (16, 16, 4, 1),
              ("backward", jnp.bfloat16, 256, 101376): (32, 32, 4, 1)}
    if (direction, dtype, head_dim, limit) in picked:
        got = getattr(BlockSizes, direction)(head_dim, dtype, shared_memory=limit)
        assert (got.block_q, got.block_kv, got.num_warps, got.num_stages) == picked[
            direction, dtype, head_dim, limit]
    if direction == "backward":
        return
    # Literal cases, not the search restated: just below Hopper's limit a bf16 D128 call with a
    # mask keeps the default's two stages (the list's first, three, fits sm_80's 229376 bytes).
    if limit == 230000 and (dtype, head_dim) == (jnp.bfloat16, 128):
        got = BlockSizes.forward(head_dim, dtype, mask=True, shared_memory=limit)
        assert (got.block_q, got.block_kv, got.num_warps, got.num_stages) == (128, 128, 8, 2)
    # an A100 does not take the Hopper default of bfloat16 D128 (229376 bytes on sm_80)
    if limit == 166912 and (dtype, head_dim) == (jnp.bfloat16, 128):
        assert BlockSizes.forward(head_dim, dtype, shared_memory=limit).num_stages == 2


@pytest.mark.skipif(not ejk_lite.ON_GPU, reason="jax-triton compiles for the GPU only on a GPU")
@pytest.mark.parametrize("pair", ["bias", "attention_mask"])
def test_tiles_past_shared_memory(pair, rng):
    """On the GPU, with a bias and with a dense attention_mask at bfloat16 D128: the default tiles
    launch and are right, forward and every gradient; 128 x 128 tiles in three stages (the
    forward's default before a tile per pair was counted) ask for more shared memory than sm_90
    has, 360448 / 262144 bytes against 232448, and are a ValueError naming ``fwd_blocks`` where
    they were an error inside XLA at run time."""
    B, H, T = 1, 2, 300
    arrays = make_inputs(rng, B=B, H=H, T=T, D=128, bias_shape=(B, H, T, T) if pair == "bias" else None)
    options = {} if pair == "bias" else dict(attention_mask=rng.random((B, 1, T, T)) < 0.6)
    check(rng, arrays, options, jnp.bfloat16, fwd=None, bwd=None)
    limit = ejk_lite.launch.max_shared_memory()
    if limit is None or limit >= {"bias": 360448, "attention_mask": 262144}[pair]:
        pytest.skip(f"this GPU's blocks may have {limit} bytes of shared memory")
    inputs = {name: jnp.asarray(x, jnp.bfloat16) for name, x in arrays.items()}
    with pytest.raises(ValueError, match=rf"_attention_fwd_kernel \(.*num_stages=3\) needs \d+ "
                                         rf"bytes of shared memory .* allows {limit}\. .* fwd_blocks\."):
        blocksparse_attention(**inputs, **options, fwd_blocks=BlockSizes(128, 128, 8, 3),
                              impl="triton")


@pytest.mark.parametrize("sinks", [False, True])
def test_fully_masked_rows(sinks, rng):
    """Rows with no visible key: output exactly 0, gradients finite and 0 for those rows."""
    B, T, S = 2, 40, 37
    arrays = make_inputs(rng, B=B, T=T, S=S, H=4, H_kv=2, sinks=sinks, bias_shape=(B, 4, T, S))
    mask = rng.random((B, 1, T, S)) < 0.5
    empty_rows = [(0, 3), (0, 17), (1, 0), (1, 39)] + [(b, t) for b in range(B) for t in range(20, 36)]
    for b, t in empty_rows:
        mask[b, :, t] = False
    options = dict(causal=False, attention_mask=mask)
    out, grads, _, _ = check(rng, arrays, options, numpy_check=True)
    rows = tuple(np.array(empty_rows).T)
    np.testing.assert_array_equal(np.asarray(out)[rows[0], :, rows[1]], 0.0)
    np.testing.assert_array_equal(np.asarray(grads["query"])[rows[0], :, rows[1]], 0.0)
    np.testing.assert_array_equal(np.asarray(grads["bias"])[rows[0], :, rows[1]], 0.0)
    for name, grad in grads.items():
        assert np.all(np.isfinite(np.asarray(grad))), name

    # Documents whose keys are all absent (cross-attention), as segment ids rather than a token mask.
    q_ids = np.repeat([[0, 1, 2]], [13, 14, 13], axis=1).astype(np.int32)
    kv_ids = np.repeat([[0, 2]], [20, 17], axis=1).astype(np.int32)
    arrays = make_inputs(rng, T=T, S=S, sinks=sinks)
    out, grads, _, _ = check(rng, arrays, dict(causal=False, q_segment_ids=q_ids, kv_segment_ids=kv_ids),
                             numpy_check=True)
    np.testing.assert_array_equal(np.asarray(out)[:, :, 13:27], 0.0)
    np.testing.assert_array_equal(np.asarray(grads["query"])[:, :, 13:27], 0.0)


# ----------------------------------------------------------------------------------------------
# Block layouts, prebuilt masks, mask builders.
# ----------------------------------------------------------------------------------------------


def strided_layout(H, nq, nk, stride=2):
    i, j = np.arange(nq)[:, None], np.arange(nk)[None, :]
    return np.stack([((i - j + h) % stride == 0) | (j == 0) for h in range(H)])


def layout_tokens(layout, block, T, S):
    return layout[:, np.arange(T) // block[0]][:, :, np.arange(S) // block[1]][None]


def test_bool_layout_with_chunk_size(rng):
    """A strided [H, nQ, nK] layout of 32-token tiles, with causal: the reference must agree, and the
    visible pairs are exactly causal & layout."""
    T = S = 70
    layout = strided_layout(2, 3, 3)
    arrays = make_inputs(rng, T=T)
    options = dict(causal=True, qkv_layouts=layout, chunk_size=32)
    check(rng, arrays, options)
    expected = numpy_attention(**arrays, causal=True,
                               attention_mask=layout_tokens(layout, (32, 32), T, S))
    out = blocksparse_attention(**{k: jnp.asarray(v, jnp.float32) for k, v in arrays.items()}, **options,
                                impl="triton", fwd_blocks=FWD, bwd_blocks=BWD)
    assert rel_err(out, expected) <= TOLERANCE["float32"]


def test_prebuilt_block_mask_equals_rule(rng):
    """A BlockMask from make_block_mask as qkv_layouts (causal=False) equals the same rule given to
    the op, output and gradients, and both match the float64 reference."""
    B, T = 2, 50
    doc = documents(rng, B, T, window=(10, 0))
    mask = make_block_mask(T, T, q_block=16, kv_block=16, **doc)
    arrays = make_inputs(rng, B=B, T=T, H=4, H_kv=2)
    seed = int(rng.integers(2**31))
    prebuilt = run(arrays, jnp.float32, dict(qkv_layouts=mask, causal=False),
                   cotangent_rng=np.random.default_rng(seed))
    by_rule = run(arrays, jnp.float32, doc, cotangent_rng=np.random.default_rng(seed))
    tol = TOLERANCE["float32"]
    for result in (prebuilt, by_rule):
        out, grads, ref, ref_grads, _ = result
        assert rel_err(out, ref) <= tol
        for name in grads:
            assert rel_err(grads[name], ref_grads[name]) <= tol, name
    np.testing.assert_allclose(np.asarray(prebuilt[0]), np.asarray(by_rule[0]), rtol=1e-6, atol=1e-6)
    for name in prebuilt[1]:
        np.testing.assert_allclose(np.asarray(prebuilt[1][name]), np.asarray(by_rule[1][name]), rtol=1e-5,
                                   atol=1e-6)
    assert rel_err(prebuilt[0], numpy_attention(**arrays, **doc)) <= tol


def test_prebuilt_mask_keeping_the_backwards_blocks(rng, monkeypatch):
    """A mask that keeps its lists at the backward's block sizes (BlockMask.keeping): the call
    builds no mask (a spy on the builder fails it), and output and gradients equal those of the
    mask rebuilt inside the call, and the float64 reference's."""
    B, T = 2, 50
    doc = documents(rng, B, T, window=(10, 0))
    mask = make_block_mask(T, T, q_block=FWD.block_q, kv_block=FWD.block_kv, **doc)
    arrays = make_inputs(rng, B=B, T=T, H=4, H_kv=2)
    seed = int(rng.integers(2**31))
    rebuilt = run(arrays, jnp.float32, dict(qkv_layouts=mask, causal=False),
                  cotangent_rng=np.random.default_rng(seed))
    keeping = mask.keeping((BWD.block_q, BWD.block_kv))
    for name in ("ejk_lite.attention", "ejk_lite.masking"):
        monkeypatch.setattr(importlib.import_module(name), "build_block_mask",
                            lambda *a, **k: pytest.fail("a mask was built inside the call"))
    kept = run(arrays, jnp.float32, dict(qkv_layouts=keeping, causal=False),
               cotangent_rng=np.random.default_rng(seed))
    out, grads, ref, ref_grads, _ = kept
    assert rel_err(out, ref) <= TOLERANCE["float32"]
    np.testing.assert_array_equal(np.asarray(out), np.asarray(rebuilt[0]))
    for name in grads:
        assert rel_err(grads[name], ref_grads[name]) <= TOLERANCE["float32"], name
        np.testing.assert_array_equal(np.asarray(grads[name]), np.asarray(rebuilt[1][name]))


def test_mask_builder(rng):
    """mask_builder returns a block layout (tiles of chunk_size) or a BlockMask."""
    T = 48
    layout = strided_layout(1, 3, 3, stride=3)[0]
    arrays = make_inputs(rng, T=T)
    check(rng, arrays, dict(causal=True, mask_builder=lambda: layout, chunk_size=16))
    window = make_block_mask(T, T, q_block=32, kv_block=32, sliding_window=(5, 5))
    out, _, _, _ = check(rng, arrays, dict(causal=True, mask_builder=lambda: window))
    expected = numpy_attention(**arrays, causal=True, sliding_window=(5, 5))
    assert rel_err(out, expected) <= TOLERANCE["float32"]


# ----------------------------------------------------------------------------------------------
# Transformations: jit, vmap (and grad under vmap); impl="xla"; empty sequences.
# ----------------------------------------------------------------------------------------------


def test_jit_with_traced_ids(rng):
    B, T = 2, 40
    doc = documents(rng, B, T, window=6)
    arrays = make_inputs(rng, B=B, T=T, sinks=True)
    xs = {k: jnp.asarray(v, jnp.float32) for k, v in arrays.items()}

    @jax.jit
    def loss(xs, q_ids, q_pos):
        o = blocksparse_attention(**xs, q_segment_ids=q_ids, kv_segment_ids=q_ids, q_positions=q_pos,
                                  kv_positions=q_pos, causal=True, sliding_window=6, impl="triton",
                                  fwd_blocks=FWD, bwd_blocks=BWD)
        return jnp.sum(o * jnp.cos(o)), o

    (value, out), grads = jax.value_and_grad(loss, has_aux=True)(xs, doc["q_segment_ids"], doc["q_positions"])
    with jax.enable_x64(True):
        xs64 = {k: jnp.asarray(v, jnp.float64) for k, v in arrays.items()}

        def ref_loss(xs):
            o = reference(**xs, **doc)
            return jnp.sum(o * jnp.cos(o)), o

        (_, ref), ref_grads = jax.value_and_grad(ref_loss, has_aux=True)(xs64)
    assert rel_err(out, ref) <= TOLERANCE["float32"]
    for name in grads:
        assert rel_err(grads[name], ref_grads[name]) <= TOLERANCE["float32"], name


def test_vmap_and_grad_under_vmap(rng):
    N, B, T = 2, 1, 37
    arrays = make_inputs(rng, B=B, T=T, H=4, H_kv=2)
    q = jnp.asarray(rng.normal(size=(N, *arrays["query"].shape)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(N, *arrays["key"].shape)), jnp.float32)
    v = jnp.asarray(arrays["value"], jnp.float32)  # shared by every element of the mapped axis
    options = dict(causal=True, sliding_window=(8, 0))

    def attend(q, k, v, fn=blocksparse_attention, **extra):
        return fn(q, k, v, **options, **extra)

    kernels = functools.partial(attend, impl="triton", fwd_blocks=FWD, bwd_blocks=BWD)
    out = jax.vmap(kernels, in_axes=(0, 0, None))(q, k, v)
    grads = jax.vmap(jax.grad(lambda q, k, v: jnp.sum(kernels(q, k, v) ** 2), argnums=(0, 1, 2)),
                     in_axes=(0, 0, None))(q, k, v)
    with jax.enable_x64(True):
        q64, k64, v64 = (jnp.asarray(np.asarray(x), jnp.float64) for x in (q, k, v))
        ref = np.stack([np.asarray(attend(q64[n], k64[n], v64, fn=reference)) for n in range(N)])
        ref_grads = [jax.grad(lambda q, k, v: jnp.sum(attend(q, k, v, fn=reference) ** 2), argnums=(0, 1, 2))(
            q64[n], k64[n], v64) for n in range(N)]
    assert rel_err(out, ref) <= TOLERANCE["float32"]
    for i in range(3):
        expected = np.stack([np.asarray(g[i]) for g in ref_grads])
        assert rel_err(grads[i], expected) <= TOLERANCE["float32"], i


def test_impl_xla_is_the_reference(rng):
    arrays = make_inputs(rng, B=2, T=30, S=42, sinks=True, bias_shape=(1, 2, 30, 42))
    xs = {k: jnp.asarray(v, jnp.float32) for k, v in arrays.items()}
    options = dict(documents(rng, 2, 30, 42, window=(9, 2)), logits_soft_cap=3.0)
    out = blocksparse_attention(**xs, **options, impl="xla")
    np.testing.assert_array_equal(np.asarray(out), np.asarray(reference(**xs, **options)))
    assert rel_err(out, numpy_attention(**{k: np.asarray(v, np.float64) for k, v in xs.items()}, **options)) \
        <= TOLERANCE["float32"]


@pytest.mark.parametrize("T, S", [(0, 16), (16, 0), (0, 0)])
def test_empty_sequences(T, S, rng):
    arrays = {k: jnp.asarray(v, jnp.float32) for k, v in make_inputs(rng, T=T, S=S, D=16, Dv=8).items()}
    f = functools.partial(blocksparse_attention, causal=True, impl="triton", fwd_blocks=FWD, bwd_blocks=BWD)
    out, vjp = jax.vjp(f, arrays["query"], arrays["key"], arrays["value"])
    assert out.shape == (1, 2, T, 8) and out.dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(out), 0.0)
    for grad, x in zip(vjp(jnp.ones_like(out)), arrays.values()):
        assert grad.shape == x.shape
        np.testing.assert_array_equal(np.asarray(grad), 0.0)


# ----------------------------------------------------------------------------------------------
# Bad input: a ValueError naming the argument.
# ----------------------------------------------------------------------------------------------


def bad_inputs():
    q, k, v = np.zeros((2, 4, 16, 8), np.float32), np.zeros((2, 2, 24, 8), np.float32), \
        np.zeros((2, 2, 24, 8), np.float32)
    ids_q, ids_k = np.zeros((2, 16), np.int32), np.zeros((2, 24), np.int32)
    return [
        ("key/value heads", dict(key=np.zeros((2, 3, 24, 8), np.float32), value=np.zeros((2, 3, 24, 8), np.float32))),
        ("query", dict(query=np.zeros((2, 4, 16), np.float32))),
        ("key", dict(key=np.zeros((2, 2, 24, 6), np.float32))),
        ("value", dict(value=np.zeros((2, 2, 20, 8), np.float32))),
        ("key and value", dict(key=np.zeros((1, 2, 24, 8), np.float32), value=np.zeros((1, 2, 24, 8), np.float32))),
        ("query", dict(query=np.zeros((2, 4, 16, 8), np.int32))),
        ("softmax_aux", dict(softmax_aux=np.zeros((2,), np.float32))),
        ("softmax_aux", dict(softmax_aux=np.zeros((1, 4), np.float32))),
        ("bias", dict(bias=np.zeros((2, 4, 16, 23), np.float32))),
        ("bias", dict(bias=np.zeros((3, 1, 1, 1), np.float32))),
        ("bias", dict(bias=np.zeros((1, 2, 4, 16, 24), np.float32))),
        ("q_segment_ids", dict(q_segment_ids=np.zeros((2, 15), np.int32), kv_segment_ids=ids_k)),
        ("kv_segment_ids", dict(q_segment_ids=ids_q, kv_segment_ids=np.zeros((2, 1, 24), np.int32))),
        ("kv_segment_ids", dict(q_segment_ids=ids_q)),
        ("q_positions", dict(q_positions=np.zeros((2, 16), np.float32))),
        ("kv_positions", dict(kv_positions=np.zeros((3, 24), np.int32))),
        ("attention_mask", dict(attention_mask=np.ones((2, 1, 16, 16), bool))),
        ("attention_mask", dict(attention_mask=np.ones((2, 3, 16, 24), bool))),
        ("sliding_window", dict(sliding_window=-2)),
        ("sliding_window", dict(sliding_window=(4, -1))),
        ("impl", dict(impl="cuda")),
        ("logits_soft_cap", dict(logits_soft_cap=-1.0)),
        ("qkv_layouts", dict(qkv_layouts=make_block_mask(16, 16, q_block=16, kv_block=16))),
        ("qkv_layouts.kept.0. covers", dict(qkv_layouts=dataclasses.replace(
            make_block_mask(16, 24, q_block=16, kv_block=16),
            kept=(make_block_mask(16, 16, q_block=16, kv_block=16, causal=True),)))),
        ("layout", dict(qkv_layouts=np.ones((3, 3), bool), chunk_size=16)),
        ("chunk_size", dict(qkv_layouts=np.ones((1, 1), bool), chunk_size=24)),
        ("fwd_blocks", dict(fwd_blocks=(16, 16))),
        ("block_q", dict(fwd_blocks=BlockSizes(24, 16))),
        ("bwd_blocks", dict(bwd_blocks=(BlockSizes(16, 16),) * 3)),
        ("block_kv", dict(bwd_blocks=(BlockSizes(16, 16), BlockSizes(16, 48)))),
        ("qkv_layouts or mask_builder", dict(qkv_layouts=np.ones((1, 1), bool), mask_builder=lambda: None)),
        # Values that used to give NaN, zeros or nonsense without a word.
        ("q_positions", dict(q_positions=np.full((2, 16), 2**30, np.int64))),
        ("kv_positions", dict(kv_positions=np.full((2, 24), -2**30, np.int32), sliding_window=4)),
        ("logits_soft_cap", dict(logits_soft_cap=float("inf"))),
        ("logits_soft_cap", dict(logits_soft_cap=float("nan"))),
        ("logits_soft_cap", dict(logits_soft_cap=True)),
        ("softmax_scale", dict(softmax_scale=float("nan"))),
        ("softmax_scale", dict(softmax_scale=np.float32("inf"))),
        ("softmax_scale", dict(softmax_scale=True)),
        ("softmax_scale", dict(softmax_scale=jnp.float32(0.5))),
        ("bias", dict(bias=True)),
        ("bias", dict(bias=[0.5])),
        ("query, key and value must have one dtype", dict(query=q.astype(np.float16))),
        ("qkv_layouts.kinds", dict(qkv_layouts=jax.vmap(lambda ids: make_block_mask(
            16, 24, q_block=16, kv_block=16, q_segment_ids=ids, kv_segment_ids=ids[:, :1].repeat(24, 1)))(
                np.zeros((3, 1, 16), np.int32)), causal=False)),
    ], dict(query=q, key=k, value=v)


BAD, BASE = bad_inputs()


@pytest.mark.parametrize("name, kwargs", BAD, ids=[f"{n}-{i}" for i, (n, _) in enumerate(BAD)])
def test_bad_input_names_the_argument(name, kwargs):
    arguments = dict(BASE, **kwargs)
    with pytest.raises(ValueError, match=name):
        blocksparse_attention(**arguments)


@pytest.mark.parametrize("field, value", [("block_q", 16.0), ("block_kv", True), ("num_warps", "4"),
                                          ("num_stages", np.float64(2))])
def test_block_sizes_take_ints_only(field, value):
    with pytest.raises(ValueError, match=f"BlockSizes.{field}"):
        BlockSizes(**dict(dict(block_q=16, block_kv=16), **{field: value}))


# ----------------------------------------------------------------------------------------------
# Arguments that used to fail deep inside, or to be misread: now the right answer.
# ----------------------------------------------------------------------------------------------


def test_numpy_scalars_and_a_number_as_bias(rng):
    """NumPy scalars for logits_soft_cap, softmax_scale and the block sizes are taken as Python
    numbers; a Python number as bias broadcasts like a 0-d array (with sinks it changes the result)."""
    arrays = make_inputs(rng, T=40, D=32, q_scale=8.0, sinks=True)
    options = dict(causal=True, logits_soft_cap=np.float32(3.0), softmax_scale=np.float64(0.2), bias=0.75)
    blocks = BlockSizes(np.int64(16), np.int32(16), np.int64(4), np.int8(2))
    assert type(blocks.block_q) is int and blocks == BWD.__class__(16, 16)
    xs = {k: jnp.asarray(v, jnp.float32) for k, v in arrays.items()}
    out = blocksparse_attention(**xs, **options, impl="triton", fwd_blocks=blocks, bwd_blocks=BWD)
    with jax.enable_x64(True):
        ref = reference(**{k: jnp.asarray(v, jnp.float64) for k, v in arrays.items()}, causal=True,
                        logits_soft_cap=3.0, softmax_scale=0.2, bias=jnp.full((1, 1, 1, 1), 0.75))
        without_bias = reference(**{k: jnp.asarray(v, jnp.float64) for k, v in arrays.items()},
                                 causal=True, logits_soft_cap=3.0, softmax_scale=0.2)
    assert rel_err(out, ref) <= TOLERANCE["float32"]
    assert rel_err(ref, without_bias) > 1e-3  # the sink makes a uniform bias matter
    expected = numpy_attention(**arrays, bias=0.75, logits_soft_cap=3.0, softmax_scale=0.2, causal=True)
    assert rel_err(out, expected) <= TOLERANCE["float32"]


def test_wide_segment_ids_never_merge(rng):
    """int64 segment ids that differ by a multiple of 2**32 are different documents (they used to
    be cast to int32 and merge): equal to the same documents numbered 0, 1, 2, ..."""
    B, T = 2, 48
    doc = documents(rng, B, T)
    ids = doc["q_segment_ids"]
    wide = ids.astype(np.int64) * 2**32 + 5  # every id the same modulo 2**32
    arrays = make_inputs(rng, B=B, T=T)
    narrow_options = dict(doc)
    wide_options = dict(doc, q_segment_ids=wide, kv_segment_ids=wide)
    out, grads, ref, ref_grads, inputs64 = run(arrays, jnp.float32, wide_options, cotangent_rng=rng)
    expected = numpy_attention(**inputs64, **narrow_options)
    assert rel_err(out, expected) <= TOLERANCE["float32"]
    assert rel_err(ref, expected) <= 1e-12
    for name in grads:
        assert rel_err(grads[name], ref_grads[name]) <= TOLERANCE["float32"], name
    # Traced (under jit, with 64-bit integers enabled): the same answer.
    with jax.enable_x64(True):
        xs = {k: jnp.asarray(v, jnp.float32) for k, v in arrays.items()}
        traced = jax.jit(lambda xs, q_ids, kv_ids: blocksparse_attention(
            **xs, **dict(wide_options, q_segment_ids=q_ids, kv_segment_ids=kv_ids), impl="triton",
            fwd_blocks=FWD, bwd_blocks=BWD))(xs, jnp.asarray(wide), jnp.asarray(wide + 2**40))
        assert rel_err(traced, expected) > 0.1  # q and kv ids now differ everywhere: nothing visible
        same = jax.jit(lambda xs, ids: blocksparse_attention(
            **xs, **dict(wide_options, q_segment_ids=ids, kv_segment_ids=ids), impl="triton",
            fwd_blocks=FWD, bwd_blocks=BWD))(xs, jnp.asarray(wide))
    assert rel_err(same, expected) <= TOLERANCE["float32"]


# ----------------------------------------------------------------------------------------------
# A prebuilt mask with the call's own rules, and masks combined: exact, and no dense mask.
# ----------------------------------------------------------------------------------------------


def token_by_token_arrays(jaxpr, T, S):
    """Shapes of every value in ``jaxpr`` (and the jaxprs inside it) with a T and an S axis."""
    found = []

    def walk(j):
        for var in [*j.invars, *j.outvars, *j.constvars, *(v for e in j.eqns for v in e.outvars)]:
            shape = tuple(getattr(getattr(var, "aval", None), "shape", ()))
            if T in shape and S in shape and (T != S or shape.count(T) >= 2):
                found.append(shape)
        for eqn in j.eqns:
            for param in eqn.params.values():
                for inner in param if isinstance(param, (list, tuple)) else [param]:
                    if isinstance(inner, jax.extend.core.ClosedJaxpr):
                        walk(inner.jaxpr)
                    elif isinstance(inner, jax.extend.core.Jaxpr):
                        walk(inner)

    walk(jaxpr.jaxpr)
    return found


def prebuilt_cases(rng, B, T):
    """name: (mask arguments of make_block_mask, the call's rule arguments)."""
    doc = documents(rng, B, T)
    ids, pos = doc["q_segment_ids"], doc["q_positions"]
    docs = dict(q_segment_ids=ids, kv_segment_ids=ids)
    layout = strided_layout(1, T // 32, T // 32)[0]
    return {
        # the mask's rule implies the call's: the mask as it is
        "causal_mask_default_causal": (dict(causal=True), dict()),
        # causal on the documents' own positions, and on arange: two clauses
        "documents_default_causal": (doc, dict()),
        # one clause, merged: segment ids added to a causal mask
        "causal_mask_with_segments": (dict(causal=True), dict(docs)),
        # one clause, merged: a window on the call's positions, the mask has none
        "documents_with_window": (dict(docs), dict(causal=True, sliding_window=(9, 0))),
        # one clause, merged: the same positions (equal values), a window and causal added
        "positions_with_window": (dict(docs, q_positions=pos, kv_positions=pos, sliding_window=(4, 4)),
                                  dict(q_positions=pos.copy(), kv_positions=pos.copy())),
        # a layout and a rule by "and", the call's causal on top
        "layout_and_window_default_causal": (dict(layout=layout, layout_block=32,
                                                  sliding_window=(5, 5)), dict()),
        # a layout alone, the call's documents and causal
        "layout_with_documents": (dict(layout=layout, layout_block=32), dict(doc)),
    }


@pytest.mark.parametrize("case", ["causal_mask_default_causal", "documents_default_causal",
                                  "causal_mask_with_segments", "documents_with_window",
                                  "positions_with_window", "layout_and_window_default_causal",
                                  "layout_with_documents"])
def test_prebuilt_mask_and_the_calls_rule(case, rng):
    """A prebuilt BlockMask given with rules of the call's own (causal=True by default): every rule
    holds, output and gradients equal the float64 reference and a NumPy softmax over the pairs
    both allow, and neither the forward's nor the backward's jaxpr has a value with a T and an S
    axis (it used to build the dense [B, H, T, S] token mask inside every call)."""
    B, T = 2, 64
    mask_kw, call_kw = prebuilt_cases(rng, B, T)[case]
    mask = make_block_mask(T, T, q_block=16, kv_block=16, **mask_kw)
    arrays = make_inputs(rng, B=B, T=T, H=4, H_kv=2)
    options = dict(call_kw, qkv_layouts=mask)
    out, _, _, _ = check(rng, arrays, options)
    visible = numpy_visible(T, T, **dict(dict(causal=True), **call_kw)) & np.asarray(mask.token_mask())
    expected = numpy_attention(**{k: np.asarray(jnp.asarray(v, jnp.float32), np.float64)
                                  for k, v in arrays.items()}, causal=False, attention_mask=visible)
    assert rel_err(out, expected) <= TOLERANCE["float32"]

    xs = [jnp.asarray(arrays[n], jnp.float32) for n in ("query", "key", "value")]

    def attend(q, k, v):
        return blocksparse_attention(q, k, v, **options, impl="triton", fwd_blocks=FWD, bwd_blocks=BWD)

    grad = jax.grad(lambda *xs: jnp.sum(attend(*xs) ** 2), argnums=(0, 1, 2))
    for fn in (attend, grad):
        assert token_by_token_arrays(jax.make_jaxpr(fn)(*xs), T, T) == [], fn


@pytest.mark.parametrize("op", ["and", "or"])
def test_combined_masks_without_a_dense_mask(op, rng):
    """``a & b`` and ``a | b`` of two rules that do not merge (causal on two sets of positions):
    one mask of two clauses, exact, evaluated by the kernels in partial tiles, no dense mask."""
    B, T = 2, 64
    doc = documents(rng, B, T)
    shifted = dict(q_positions=doc["q_positions"] + 3, kv_positions=doc["q_positions"])
    a = make_block_mask(T, T, q_block=16, kv_block=16, **doc)
    b = make_block_mask(T, T, q_block=16, kv_block=16, causal=True, sliding_window=(40, 2), **shifted)
    mask = a & b if op == "and" else a | b
    assert mask.rule.other is not None and mask.rule.op == op
    arrays = make_inputs(rng, B=B, T=T, H=4, H_kv=2, sinks=True)
    options = dict(qkv_layouts=mask, causal=False)
    out, _, _, _ = check(rng, arrays, options)
    va = numpy_visible(T, T, **doc)
    vb = numpy_visible(T, T, causal=True, sliding_window=(40, 2), **shifted)
    expected = numpy_attention(**{k: np.asarray(jnp.asarray(v, jnp.float32), np.float64)
                                  for k, v in arrays.items()}, causal=False,
                               attention_mask=va & vb if op == "and" else va | vb)
    assert rel_err(out, expected) <= TOLERANCE["float32"]
    xs = [jnp.asarray(arrays[n], jnp.float32) for n in arrays]
    grad = jax.grad(lambda *xs: jnp.sum(blocksparse_attention(
        *xs[:3], softmax_aux=xs[3], **options, impl="triton", fwd_blocks=FWD, bwd_blocks=BWD) ** 2),
        argnums=(0, 1, 2, 3))
    assert token_by_token_arrays(jax.make_jaxpr(grad)(*xs), T, T) == []


def test_prebuilt_mask_rules_that_do_not_combine(rng):
    """Where exactness would need a dense mask, a ValueError says what to pass."""
    T = 32
    a = make_block_mask(T, T, q_block=16, kv_block=16, causal=True)
    b = make_block_mask(T, T, q_block=16, kv_block=16, sliding_window=3,
                        q_positions=np.arange(T, dtype=np.int32)[None] * 2)
    layout_or = make_block_mask(T, T, q_block=16, kv_block=16, causal=True, combine="or",
                                layout=np.eye(2, dtype=bool))
    xs = {k: jnp.asarray(v, jnp.float32) for k, v in make_inputs(rng, T=T).items()}
    ids = np.zeros((1, T), np.int32)
    for mask in (a | b, layout_or):  # the call's default causal=True on top: three clauses / or
        with pytest.raises(ValueError, match="causal=False"):
            blocksparse_attention(**xs, qkv_layouts=mask, sliding_window=2, q_segment_ids=ids,
                                  kv_segment_ids=ids, q_positions=ids + 5, kv_positions=ids)
    out = blocksparse_attention(**xs, qkv_layouts=a | b, causal=False, impl="triton",
                                fwd_blocks=FWD, bwd_blocks=BWD)  # as it is: fine
    assert rel_err(out, reference(**xs, qkv_layouts=a | b, causal=False)) <= TOLERANCE["float32"]


@pytest.mark.parametrize("case", ["documents", "bias_and_sinks"])
def test_nested_vmap_and_grad(case, rng):
    """vmap of vmap (two mapped axes), forward and every gradient, against the float64 reference
    mapped the same way. Mapped axes fold into the batch axis (one launch); the second case maps a
    [1, H, T, S] bias along one axis with B = 2, which the rule launches once per element instead
    of copying it B times, and shares the sinks."""
    N1, N2, B, H, H_kv, T = 2, 3, 2, 4, 2, 40
    shape = lambda *lead, last: (*lead, B, last[0], T, last[1])  # noqa: E731
    q = rng.normal(size=shape(N1, N2, last=(H, 16)))
    k = rng.normal(size=shape(N2, last=(H_kv, 16)))  # mapped along the inner axis only
    v = rng.normal(size=shape(N1, N2, last=(H_kv, 16)))
    if case == "documents":
        ids = np.stack([documents(rng, B, T)["q_segment_ids"] for _ in range(N1)])  # outer axis only
        extra, extra_axes = (ids,), (0,)
        options = lambda ids: dict(q_segment_ids=ids, kv_segment_ids=ids, causal=True)  # noqa: E731
    else:
        bias = rng.normal(size=(N1, 1, H, T, T))  # outer axis only
        sinks = rng.normal(size=(H,))
        extra, extra_axes = (bias, sinks), (0, None)
        options = lambda bias, sinks: dict(bias=bias, softmax_aux=sinks, causal=True)  # noqa: E731

    def loss(fn, q, k, v, *extra, **kw):
        o = fn(q, k, v, **options(*extra), **kw)
        return jnp.sum(o * jnp.cos(o)), o

    def nested(fn, dtype, **kw):
        inner = jax.vmap(jax.value_and_grad(functools.partial(loss, fn, **kw), argnums=(0, 1, 2),
                                            has_aux=True),
                         in_axes=(0, 0, 0) + (None,) * len(extra))
        outer = jax.vmap(inner, in_axes=(0, None, 0) + extra_axes)
        xs = [jnp.asarray(x, dtype) for x in (q, k, v)]
        more = [jnp.asarray(x) if np.issubdtype(np.asarray(x).dtype, np.integer) else jnp.asarray(x, dtype)
                for x in extra]
        (_, out), grads = outer(*xs, *more)
        return out, grads

    out, grads = nested(blocksparse_attention, jnp.float32, impl="triton", fwd_blocks=FWD, bwd_blocks=BWD)
    with jax.enable_x64(True):
        ref, ref_grads = nested(reference, jnp.float64)
    assert out.shape == (N1, N2, B, H, T, 16)
    assert rel_err(out, ref) <= TOLERANCE["float32"]
    for got, want in zip(grads, ref_grads):
        assert rel_err(got, want) <= TOLERANCE["float32"]
