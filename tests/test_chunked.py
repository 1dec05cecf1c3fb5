"""ejk_lite.chunked_recurrent against a float64 reference and against ejk_lite.recurrent: outputs,
final state and every gradient; packing, reverse, grouped heads, strong decay, chunk sizes."""

import dataclasses
import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TOLERANCE, compiled_package_launches, offline_compile, rel_err

import ejk_lite
from ejk_lite.chunked import ChunkedConfig, KernelConfig, _forward, _Static, _walk_plan, _walk_tiles
from ejk_lite.chunked import chunked_recurrent as _chunked_recurrent

# The kernels, wherever the tests run ("auto" is XLA, the reference itself, on a CPU).
chunked_recurrent = functools.partial(_chunked_recurrent, impl="triton")

# recurrent's module (renamed in parallel; one place to change) and its reference.
recurrent_module = importlib.import_module("ejk_lite.linear_attention")
reference = recurrent_module.reference

ALL_GATES = ("g", "g_gamma", "gk")


def make_inputs(rng, *, batch=2, seq_len=37, heads=2, kv_heads=1, key_dim=6, value_dim=9,
                gates=(), gate_scale=1.0, num_states=None, with_state=True):
    """Random q/k/v, gates as logsigmoid(gate_scale * normal), and an initial state, in float64."""
    def normal(*shape):
        return rng.normal(size=shape)

    def log_gate(*shape):  # log(sigmoid(x)), computed stably
        return -np.logaddexp(0.0, -gate_scale * normal(*shape))

    inputs = dict(query=normal(batch, seq_len, heads, key_dim),
                  key=normal(batch, seq_len, kv_heads, key_dim),
                  value=normal(batch, seq_len, kv_heads, value_dim))
    gate_shapes = dict(g=(batch, seq_len, heads), g_gamma=(heads,), gk=(batch, seq_len, heads, key_dim))
    for name in gates:
        inputs[name] = log_gate(*gate_shapes[name])
    if with_state:
        inputs["initial_state"] = normal(batch if num_states is None else num_states, heads, key_dim, value_dim)
    return inputs


def packing(lengths):
    return jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)


def check(rng, inputs, dtype=jnp.float32, use=("output", "final_state"), against_recurrent=True, **options):
    """Run chunked_recurrent in ``dtype`` and the reference in float64 on the same (rounded)
    inputs; compare the output, the final state and the gradient of every array input. With
    ``against_recurrent``, also compare everything with ``ejk_lite.recurrent`` in ``dtype``."""
    names = list(inputs)
    arrays = [jnp.asarray(inputs[name], dtype) for name in names]
    recurrent_options = {k: v for k, v in options.items() if k not in ("chunk_size", "config", "impl")}

    def call(fn, opts, *arrays):
        o, final_state = fn(**dict(zip(names, arrays)), **opts)
        return {"output": o, "final_state": final_state}

    def used(fn, opts):  # only the outputs named in `use` reach the loss
        return lambda *arrays: {key: value for key, value in call(fn, opts, *arrays).items() if key in use}

    outs, vjp = jax.vjp(used(chunked_recurrent, options), *arrays)
    cotangents = {key: jnp.asarray(rng.normal(size=value.shape), value.dtype) for key, value in outs.items()}
    grads = vjp(cotangents)
    full = outs if len(outs) == 2 else call(chunked_recurrent, options, *arrays)
    # The forward alone (no gradient asked) has kernels of its own for scalar gates or none.
    alone = call(chunked_recurrent, options, *arrays)

    with jax.enable_x64(True):
        arrays64 = [jnp.asarray(np.asarray(a, np.float64)) for a in arrays]
        ref_full = call(reference, recurrent_options, *arrays64)
        _, ref_vjp = jax.vjp(used(reference, recurrent_options), *arrays64)
        cotangents64 = {key: jnp.asarray(np.asarray(c, np.float64)) for key, c in cotangents.items()}
        ref_grads = ref_vjp(cotangents64)
        ref_full, ref_grads = jax.tree.map(np.asarray, (ref_full, ref_grads))
        if "g_gamma" in names:
            # g_gamma's gradient sums terms of both signs over every token: its error is measured
            # against the sum of the terms' magnitudes (as in tests/test_recurrent.py), the terms
            # being what a per-token gate g would get, probed with a zero g.
            def probed(probe):
                kwargs = dict(zip(names, arrays64))
                kwargs["g"] = kwargs["g"] + probe if "g" in kwargs else probe
                o, final_state = reference(**kwargs, **recurrent_options)
                return {key: x for key, x in {"output": o, "final_state": final_state}.items() if key in use}
            per_token = np.asarray(jax.vjp(probed, jnp.zeros(arrays64[0].shape[:3]))[1](cotangents64)[0])
            g_gamma_scale = np.linalg.norm(np.abs(per_token).sum(axis=(0, 1)))

    assert full["output"].dtype == dtype and full["final_state"].dtype == jnp.float32
    tolerance = TOLERANCE[jnp.dtype(dtype).name]
    errors = {key: rel_err(full[key], ref_full[key]) for key in full}
    errors.update({f"{key} alone": rel_err(alone[key], ref_full[key]) for key in alone})
    for name, grad, ref_grad, array in zip(names, grads, ref_grads, arrays):
        assert grad.dtype == array.dtype, (name, grad.dtype)
        errors["d" + name] = rel_err(grad, ref_grad)
        if name == "g_gamma":
            errors["dg_gamma"] *= np.linalg.norm(ref_grad) / g_gamma_scale
    report = ", ".join(f"{key} {error:.2e}" for key, error in errors.items())
    assert all(error <= tolerance for error in errors.values()), report

    if against_recurrent:
        rec_outs, rec_vjp = jax.vjp(used(ejk_lite.recurrent, recurrent_options), *arrays)
        rec_grads = rec_vjp(cotangents)
        # Both are within `tolerance` of the reference, so within twice that of each other.
        diffs = {key: rel_err(outs[key], rec_outs[key]) for key in outs}
        for name, grad, rec_grad in zip(names, grads, rec_grads):
            diffs["d" + name] = rel_err(grad, rec_grad)
        if "g_gamma" in names:
            index = names.index("g_gamma")
            diffs["dg_gamma"] *= np.linalg.norm(np.asarray(rec_grads[index], np.float64)) / g_gamma_scale
        report = ", ".join(f"{key} {error:.2e}" for key, error in diffs.items())
        assert all(error <= 2 * tolerance for error in diffs.values()), "against recurrent: " + report


# ----------------------------------------------------------------------------------------------
# Gates, decay strength, reverse, chunk sizes.
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("gates,gate_scale", [
    ((), 1.0), (("g",), 1.0), (("g_gamma",), 1.0), (("gk",), 1.0),
    (ALL_GATES, 0.1), (ALL_GATES, 1.0), (ALL_GATES, 10.0),
    (("gk",), 10.0), (("g", "g_gamma"), 10.0), (("g",), 0.1),
])
def test_gates(rng, gates, gate_scale):
    """Each gate alone and all together; scale 10 makes many decays exp(-large) (strong decay)."""
    check(rng, make_inputs(rng, gates=gates, gate_scale=gate_scale), chunk_size=16)


@pytest.mark.parametrize("gates", [("gk",), ("g",), ("g", "g_gamma", "gk")])
@pytest.mark.parametrize("reverse", [False, True])
def test_strong_decay(rng, gates, reverse):
    """Log-gates down to -40 per token: exp(+cumsum) would overflow float32 within a chunk. Half
    the gates are strong, half nearly 1, so that the strong ones sit between live terms."""
    inputs = make_inputs(rng, seq_len=45, gates=())
    shapes = dict(g=(2, 45, 2), g_gamma=(2,), gk=(2, 45, 2, 6))
    for name in gates:
        strong = rng.uniform(size=shapes[name]) < 0.5
        inputs[name] = np.where(strong, -40.0 * rng.uniform(0.5, 1.0, size=shapes[name]),
                                -0.05 * rng.uniform(size=shapes[name]))
    check(rng, inputs, chunk_size=32, reverse=reverse)


@pytest.mark.parametrize("gate", ["g", "gk"])
def test_gate_that_forgets_everything(rng, gate):
    """A log-gate of -inf (exp = 0: the state is reset there): the float64 reference's output and
    final state, and finite gradients of q, k, v and the gate equal to its (inside the kernels a
    product with -inf would give NaN; the kernels clamp the gate, whose gradient is 0 there)."""
    inputs = make_inputs(rng, batch=1, seq_len=40, gates=(gate,), with_state=False)
    inputs[gate][0, [3, 20, 21]] = -np.inf
    names = ("query", "key", "value", gate)

    def run(fn, arrays, **options):
        def loss(q, k, v, g):
            o, state = fn(q, k, v, **{gate: g}, **options)
            return (o * 0.5).sum() + state.sum(), (o, state)
        return jax.grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(*arrays)

    arrays = [jnp.asarray(inputs[n], jnp.float32) for n in names]
    grads, outs = run(chunked_recurrent, arrays, chunk_size=16)
    with jax.enable_x64(True):
        arrays64 = [jnp.asarray(np.asarray(a, np.float64)) for a in arrays]
        ref_grads, ref_outs = jax.tree.map(np.asarray, run(reference, arrays64))
    tolerance = TOLERANCE["float32"]
    for what, got, want in zip(("output", "final state") + names, outs + grads, ref_outs + ref_grads):
        assert np.all(np.isfinite(np.asarray(got))), what
        assert rel_err(got, want) < tolerance, what


@pytest.mark.parametrize("gate", ["g", "gk"])
def test_nan_gate_is_not_a_reset(rng, gate):
    """A NaN log-gate makes the outputs it reaches NaN, as the reference's: the kernels clamp
    the gates at a floor, and a clamp that returned the floor for NaN (Triton's default maximum,
    on the GPU; the CPU interpreter keeps NaN) would reset the state there instead, silently."""
    inputs = make_inputs(rng, batch=1, seq_len=40, gates=(gate,), with_state=False)
    inputs[gate][0, 5, 0] = np.nan  # head 0, token 5 (one key column of gk)
    o, _ = chunked_recurrent(**{n: jnp.asarray(x, jnp.float32) for n, x in inputs.items()}, chunk_size=16)
    o = np.asarray(o)
    assert np.isnan(o[0, 5:, 0]).all(), "outputs at and after the NaN gate are not all NaN"
    assert np.isfinite(o[0, :5, 0]).all() and np.isfinite(o[0, :, 1]).all()


@pytest.mark.parametrize("chunk_size, seq_len", [(16, 50), (32, 70), (64, 100), (64, 21), (128, 150)])
def test_chunk_sizes(rng, chunk_size, seq_len):
    """Lengths that are not multiples of the chunk (and one shorter than a chunk). Chunks of 128
    with 32-token sub-chunks: with the default 16, eight sub-chunks, this one test took 151 s of
    compiling in the H100 GPU check (the per-key kernels unroll their loops over sub-chunks)."""
    inputs = make_inputs(rng, batch=1, seq_len=seq_len, gates=ALL_GATES, key_dim=20, value_dim=12)
    config = ChunkedConfig(sub_chunk=32) if chunk_size == 128 else None
    check(rng, inputs, chunk_size=chunk_size, config=config)


@pytest.mark.parametrize("chunk_size", [16, 64])
def test_reverse_without_initial_state_and_custom_scale(rng, chunk_size):
    inputs = make_inputs(rng, gates=ALL_GATES, with_state=False, key_dim=16, value_dim=5)
    check(rng, inputs, chunk_size=chunk_size, reverse=True, softmax_scale=0.7)


def test_grouped_heads(rng):
    """Four query heads share two key/value heads; K != V."""
    inputs = make_inputs(rng, heads=4, kv_heads=2, key_dim=12, value_dim=20, gates=("g", "gk"))
    check(rng, inputs, chunk_size=16)


@pytest.mark.parametrize("packed,gates", [(False, ALL_GATES), (True, ALL_GATES), (True, ("g", "g_gamma"))])
def test_several_tiles_and_sub_chunks(rng, packed, gates):
    """Tiles narrower than K and V (three of each) and 32-token sub-chunks in 64-token chunks,
    their walks unrolled by two; scalar gates alone take the forward's own kernels."""
    tiles = KernelConfig(block_k=16, block_v=16, num_warps=2, num_stages=1, unroll=2)
    every_kernel = ChunkedConfig.kernel_fields()
    assert len(every_kernel) == 13, every_kernel
    config = ChunkedConfig(**dict.fromkeys(every_kernel, tiles), sub_chunk=32, float32_dot="ieee")
    options = dict(chunk_size=64, config=config)
    if packed:
        lengths = [40, 0, 1, 29]
        options["cu_seqlens"] = packing(lengths)
        inputs = make_inputs(rng, batch=1, seq_len=72, key_dim=40, value_dim=36, gates=gates,
                             num_states=len(lengths))
    else:
        inputs = make_inputs(rng, batch=1, seq_len=70, key_dim=40, value_dim=36, gates=gates)
    check(rng, inputs, reverse=packed, **options)


# ----------------------------------------------------------------------------------------------
# Packed sequences and states.
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("gates", [("gk",), ("g", "g_gamma")])
def test_packed_sequences(rng, reverse, gates):
    """Sequences of 5, 0, 1, 37, 17 and 1 tokens in one row, 3 padding tokens after them."""
    lengths = [5, 0, 1, 37, 17, 1]
    inputs = make_inputs(rng, batch=1, seq_len=sum(lengths) + 3, heads=4, kv_heads=2, key_dim=8, value_dim=5,
                         gates=gates, num_states=len(lengths))
    check(rng, inputs, chunk_size=16, reverse=reverse, cu_seqlens=packing(lengths))


@pytest.mark.parametrize("gates", [ALL_GATES, ("gk",)])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision(rng, dtype, gates):
    """A lone gk reaches the kernels in its own dtype; with other gates, as a float32 sum."""
    check(rng, make_inputs(rng, gates=gates), dtype=dtype, chunk_size=16)


def test_half_precision_packed_reverse(rng):
    lengths = [20, 1, 0, 14]
    inputs = make_inputs(rng, batch=1, seq_len=sum(lengths), heads=2, kv_heads=2, gates=ALL_GATES,
                         num_states=len(lengths))
    check(rng, inputs, dtype=jnp.bfloat16, chunk_size=16, reverse=True, cu_seqlens=packing(lengths))


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("fast_decay", [20.0, None])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_mild_and_strong_chunks(rng, dtype, fast_decay, reverse):
    """Per-key gates mild in most chunks (one product each, _gk_fast_kernel) and far past the
    bound in one chunk of one head (the careful kernels), in one packed call; and with the
    shortcut off (fast_decay None), the careful kernels everywhere."""
    lengths = [40, 1, 23]
    inputs = make_inputs(rng, batch=1, seq_len=sum(lengths), heads=2, kv_heads=2, key_dim=20,
                         gates=("gk",), gate_scale=0.3, num_states=len(lengths))
    inputs["gk"][:, 16:32, 1] *= 40
    check(rng, inputs, dtype=dtype, chunk_size=16, reverse=reverse, cu_seqlens=packing(lengths),
          config=ChunkedConfig(fast_decay=fast_decay))


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_strong_chunks_of_mild_sub_chunks(rng, dtype, reverse):
    """Per-key gates too strong for a chunk's one product (about -0.7 a token: -45 over 64) but
    mild over each sub-chunk of 16 (-11): the diagonal blocks take one product per K tile
    (_gk_diagonal_kernel's FAST_DECAY), but where one key tile of one sub-chunk is far past the
    bound (the walk). Two K tiles of 16 over K = 20; packed, a length off the chunk."""
    lengths = [70, 1, 45]
    inputs = make_inputs(rng, batch=1, seq_len=sum(lengths), heads=2, kv_heads=1, key_dim=20,
                         gates=("gk",), gate_scale=0.3, num_states=len(lengths))
    inputs["gk"][:, 16:32, 1, :8] *= 40
    config = ChunkedConfig(diagonal=KernelConfig(block_k=16, num_warps=1))
    check(rng, inputs, dtype=dtype, chunk_size=64, reverse=reverse, cu_seqlens=packing(lengths),
          config=config)


@pytest.mark.parametrize("use", [("output",), ("final_state",)])
def test_only_one_result_used(rng, use):
    """The unused result's cotangent is a symbolic zero; the gradients must still be right."""
    check(rng, make_inputs(rng, gates=ALL_GATES), use=use, chunk_size=16)


@pytest.mark.parametrize("reverse", [False, True])
def test_state_passing(rng, reverse):
    """Running a sequence in two calls, the first's final state starting the second, equals one call."""
    inputs = {name: jnp.asarray(x, jnp.float32)
              for name, x in make_inputs(rng, gates=ALL_GATES, seq_len=40).items()}
    o, final_state = chunked_recurrent(**inputs, reverse=reverse, chunk_size=16)

    split = 21
    sequence_inputs = ("query", "key", "value", "g", "gk")
    first = {n: x[:, :split] if n in sequence_inputs else x for n, x in inputs.items()}
    second = {n: x[:, split:] if n in sequence_inputs else x for n, x in inputs.items()}
    if reverse:  # the walk starts at the end: the second half goes first
        first, second = second, first
    o_first, state = chunked_recurrent(**first, reverse=reverse, chunk_size=16)
    o_second, final_state_two_calls = chunked_recurrent(**{**second, "initial_state": state}, reverse=reverse,
                                                        chunk_size=16)
    o_two_calls = jnp.concatenate([o_second, o_first] if reverse else [o_first, o_second], axis=1)
    assert rel_err(o_two_calls, o) <= TOLERANCE["float32"]
    assert rel_err(final_state_two_calls, final_state) <= TOLERANCE["float32"]


def test_no_tokens_in_any_sequence(rng):
    """Only empty sequences and padding: zero output, the state passes through, so does its gradient."""
    inputs = {n: jnp.asarray(x, jnp.float32)
              for n, x in make_inputs(rng, batch=1, seq_len=3, gates=ALL_GATES, num_states=2).items()}
    cu_seqlens = jnp.array([0, 0, 0], jnp.int32)
    names = list(inputs)
    (o, final_state), vjp = jax.vjp(
        lambda *a: chunked_recurrent(**dict(zip(names, a)), cu_seqlens=cu_seqlens, chunk_size=16),
        *inputs.values())
    assert float(jnp.abs(o).max()) == 0.0
    np.testing.assert_array_equal(final_state, inputs["initial_state"])
    d_final_state = jnp.asarray(rng.normal(size=final_state.shape), jnp.float32)
    grads = dict(zip(inputs, vjp((jnp.asarray(rng.normal(size=o.shape), o.dtype), d_final_state))))
    np.testing.assert_array_equal(grads.pop("initial_state"), d_final_state)
    assert all(float(jnp.abs(grad).max()) == 0.0 for grad in grads.values())


@pytest.mark.parametrize("key_dim, value_dim", [(0, 5), (4, 0)])
def test_empty_key_or_value_dimension(rng, key_dim, value_dim):
    arrays = {n: jnp.asarray(x, jnp.float32)
              for n, x in make_inputs(rng, key_dim=key_dim, value_dim=value_dim, gates=ALL_GATES).items()}
    names = list(arrays)
    (o, state), vjp = jax.vjp(lambda *a: chunked_recurrent(**dict(zip(names, a))), *arrays.values())
    assert o.shape == (2, 37, 2, value_dim) and state.shape == (2, 2, key_dim, value_dim)
    assert float(jnp.abs(o).sum()) == 0.0
    grads = vjp((jnp.asarray(rng.normal(size=o.shape), jnp.float32), jnp.zeros(state.shape)))
    for name, grad in zip(names, grads):
        assert grad.shape == arrays[name].shape, name
        assert float(jnp.abs(grad).sum()) == 0.0, name


# ----------------------------------------------------------------------------------------------
# jit with traced packing, vmap, impl, arguments.
# ----------------------------------------------------------------------------------------------


def test_jit_with_traced_cu_seqlens(rng):
    lengths = [7, 0, 20, 1]
    inputs = {n: jnp.asarray(x, jnp.float32) for n, x in
              make_inputs(rng, batch=1, seq_len=30, gates=("g", "gk"), num_states=len(lengths)).items()}
    cu_seqlens = packing(lengths)
    eager = chunked_recurrent(**inputs, cu_seqlens=cu_seqlens, chunk_size=16)
    jitted = jax.jit(lambda cu: chunked_recurrent(**inputs, cu_seqlens=cu, chunk_size=16))(cu_seqlens)
    for x, y in zip(eager, jitted):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    # Garbage offsets under jit (unchecked): the nearest valid packing, finite numbers, no crash.
    garbage = jnp.array([3, -5, 100, 2, 9], jnp.int32)
    o, state = jax.jit(lambda cu: chunked_recurrent(**inputs, cu_seqlens=cu, chunk_size=16))(garbage)
    assert np.all(np.isfinite(np.asarray(o))) and np.all(np.isfinite(np.asarray(state)))


@pytest.mark.parametrize("gates", [ALL_GATES, ("g",)])
def test_vmap_and_grad(rng, gates):
    """vmap over a leading axis (mapped g_gamma too), of the gradient as well, equals a loop;
    per-key and scalar gates (each keeps its own decayed rows for the backward)."""
    per_item = [{n: jnp.asarray(x, jnp.float32) for n, x in make_inputs(rng, seq_len=20, gates=gates).items()}
                for _ in range(2)]

    def loss(inputs):
        o, state = chunked_recurrent(**inputs, chunk_size=16)
        return jnp.sum(o * jnp.cos(o)) + jnp.sum(state ** 2)

    check_vmap_of_grad(loss, per_item)


def check_vmap_of_grad(loss, per_item, grad_tol=1e-6):
    """vmap of the value and gradient of ``loss`` over the stacked items equals a loop (the
    gradients within ``grad_tol``)."""
    stacked = jax.tree.map(lambda *x: jnp.stack(x), *per_item)
    values, grads = jax.vmap(jax.value_and_grad(loss))(stacked)
    for i, item in enumerate(per_item):
        value, grad = jax.value_and_grad(loss)(item)
        assert rel_err(values[i], value) <= 1e-6
        for name in item:
            assert rel_err(grads[name][i], grad[name]) <= grad_tol, name


def test_vmap_and_grad_mild_and_strong_chunks(rng):
    """bfloat16 per-key gates, one element mild everywhere (one product a chunk), the other with
    a strong chunk (the careful kernels there): the forward's flags folded and unfolded with the
    batch; vmap of the gradient equals a loop."""
    per_item = []
    for strong in (False, True):
        item = make_inputs(rng, seq_len=40, key_dim=20, gates=("gk",), gate_scale=0.3)
        if strong:
            item["gk"][:, 16:32] *= 40
        per_item.append({n: jnp.asarray(x, jnp.bfloat16) for n, x in item.items()})

    def loss(inputs):
        o, state = chunked_recurrent(**inputs, chunk_size=16)
        return jnp.sum(o.astype(jnp.float32) ** 2) + jnp.sum(state ** 2)

    # The fold itself, exactly: the forward's flags (which chunks took one product) under vmap
    # are each item's own, the mild item's all set, the strong chunk's not.
    static = _Static(scale=20 ** -0.5, chunk_size=16, reverse=False, config=ChunkedConfig())

    def flags(item):
        args = (item["query"], item["key"], item["value"], item["gk"],
                item["initial_state"].astype(jnp.float32), None)
        return _forward(static, *args)[3][3]

    stacked = jax.tree.map(lambda *x: jnp.stack(x), *per_item)
    folded = jax.vmap(flags)(stacked)
    for i, item in enumerate(per_item):
        np.testing.assert_array_equal(folded[i], flags(item))
    assert np.asarray(folded[0]).all() and not np.asarray(folded[1]).all()
    # The gradients: in the interpreter the two agree to float32's rounding. On the GPU their
    # bfloat16 gradients differ in a few last bits (H200, 98dff7f: dgk 4.8e-5, where the loop and
    # the batched call round some sum differently; which one was not traced), so there the
    # bound is 1e-3: rounding, with the flags' fold checked exactly above.
    check_vmap_of_grad(loss, per_item, grad_tol=1e-3 if ejk_lite.ON_GPU else 1e-6)


def test_vmap_mapped_cu_seqlens(rng):
    """Each element its own packing: the launches run one element at a time; equals a loop."""
    inputs = {n: jnp.asarray(x, jnp.float32) for n, x in
              make_inputs(rng, batch=1, seq_len=24, gates=("gk",), num_states=3).items()}
    cus = jnp.stack([packing([10, 0, 14]), packing([1, 17, 3])])
    outs = jax.vmap(lambda cu: chunked_recurrent(**inputs, cu_seqlens=cu, chunk_size=16))(cus)
    for i in range(2):
        expected = chunked_recurrent(**inputs, cu_seqlens=cus[i], chunk_size=16)
        for x, y in zip(outs, expected):
            assert rel_err(x[i], y) <= 1e-6


def test_impl_xla_and_float64(rng):
    inputs = make_inputs(rng, gates=ALL_GATES)
    arrays = {n: jnp.asarray(x, jnp.float32) for n, x in inputs.items()}
    o, state = chunked_recurrent(**arrays, impl="xla", reverse=True)
    o_ref, state_ref = reference(**arrays, reverse=True)
    np.testing.assert_array_equal(np.asarray(o), np.asarray(o_ref))
    np.testing.assert_array_equal(np.asarray(state), np.asarray(state_ref))
    with jax.enable_x64(True):
        arrays64 = {n: jnp.asarray(x) for n, x in inputs.items()}
        o64, _ = chunked_recurrent(**arrays64, impl="xla")  # float64: the reference
        assert o64.dtype == jnp.float64
        np.testing.assert_array_equal(np.asarray(o64), np.asarray(reference(**arrays64)[0]))
        with pytest.raises(ValueError, match="impl='triton'.*float64"):
            chunked_recurrent(**arrays64, impl="triton")


def test_gv_is_refused_with_a_pointer_to_recurrent(rng):
    arrays = {n: jnp.asarray(x, jnp.float32) for n, x in make_inputs(rng, gates=("gk",)).items()}
    gv = jnp.zeros((2, 37, 2, 9))
    with pytest.raises(ValueError, match="gv.*recurrent"):
        chunked_recurrent(**arrays, gv=gv)


@pytest.mark.parametrize("change,argument", [
    (dict(key=(2, 5, 2, 4)), "key"),
    (dict(value=(2, 6, 2, 4)), "value"),
    (dict(key=(2, 5, 3, 3), value=(2, 5, 3, 4)), "heads"),
    (dict(g=(2, 5, 2)), "g"),
    (dict(g_gamma=(2, 4)), "g_gamma"),
    (dict(gk=(2, 5, 4, 4)), "gk"),
    (dict(initial_state=(3, 4, 3, 4)), "initial_state"),
    (dict(query=(2, 5, 4)), "query"),
])
def test_bad_shapes(change, argument):
    shapes = dict(query=(2, 5, 4, 3), key=(2, 5, 2, 3), value=(2, 5, 2, 4))
    shapes.update(change)
    args = {name: jnp.zeros(shape) for name, shape in shapes.items()}
    with pytest.raises(ValueError, match=argument):
        chunked_recurrent(**args)


@pytest.mark.parametrize("kwargs, argument", [
    (dict(chunk_size=48), "chunk_size"), (dict(chunk_size=8), "chunk_size"), (dict(chunk_size=16.0), "chunk_size"),
    (dict(chunk_size=True), "chunk_size"), (dict(impl="cuda"), "impl"), (dict(config={"states": 1}), "config"),
    (dict(softmax_scale="0.5"), "softmax_scale"), (dict(cu_seqlens=jnp.array([0, 4, 2], jnp.int32)), "cu_seqlens"),
    (dict(g=jnp.zeros((1, 6, 2), jnp.int32)), "g"),
])
def test_bad_arguments(kwargs, argument):
    q, k, v = jnp.zeros((1, 6, 2, 3)), jnp.zeros((1, 6, 2, 3)), jnp.zeros((1, 6, 2, 4))
    with pytest.raises(ValueError, match=argument):
        chunked_recurrent(q, k, v, **kwargs)


@pytest.mark.parametrize("heads, key_dim, value_dim", [(1024, 32768, 64), (2, 8, 2**27)])
def test_refuses_chunks_past_32_bit_offsets(heads, key_dim, value_dim):
    # Traced only (jax.eval_shape): the arrays are never allocated. The first shape's chunk of 64
    # holds 64 x 1024 x 32768 = 2**31 elements (a chunk of 32, half that, is taken); the second
    # shape's state tile K x V is 2**30, its chunk 2**34.
    q = jax.ShapeDtypeStruct((1, 64, heads, key_dim), jnp.bfloat16)
    v = jax.ShapeDtypeStruct((1, 64, heads, value_dim), jnp.bfloat16)
    with pytest.raises(ValueError, match="chunk_size x heads x max"):
        jax.eval_shape(lambda q, k, v: chunked_recurrent(q, k, v, impl="triton"), q, q, v)
    if value_dim == 64:
        jax.eval_shape(lambda q, k, v: chunked_recurrent(q, k, v, impl="triton", chunk_size=32), q, q, v)
    jax.eval_shape(lambda q, k, v: chunked_recurrent(q, k, v, impl="xla"), q, q, v)  # no such bound


@pytest.mark.parametrize("make, field", [
    (lambda: KernelConfig(block_k=8), "block_k"), (lambda: KernelConfig(block_v=48), "block_v"),
    (lambda: KernelConfig(num_warps=3), "num_warps"), (lambda: KernelConfig(num_stages=0), "num_stages"),
    (lambda: KernelConfig(block_k=32.0), "block_k"), (lambda: KernelConfig(num_warps=True), "num_warps"),
    (lambda: KernelConfig(unroll=3), "unroll"),
    (lambda: ChunkedConfig(sub_chunk=8), "sub_chunk"), (lambda: ChunkedConfig(float32_dot="tf32"), "float32_dot"),
    (lambda: ChunkedConfig(states=(64, 64)), "states"),
    (lambda: ChunkedConfig(fast_decay=-1.0), "fast_decay"), (lambda: ChunkedConfig(fast_decay=41), "fast_decay"),
    (lambda: ChunkedConfig(fast_decay="20"), "fast_decay"), (lambda: ChunkedConfig(fast_decay=True), "fast_decay"),
    (lambda: ChunkedConfig(min_walk_programs=0), "min_walk_programs"),
    (lambda: ChunkedConfig(min_walk_programs=True), "min_walk_programs"),
    (lambda: ChunkedConfig(split_walk=1), "split_walk"),
    (lambda: ChunkedConfig(split_programs=0), "split_programs"),
])
def test_bad_config(make, field):
    with pytest.raises(ValueError, match=field):
        make()


@pytest.mark.parametrize("key_dim, value_dim, walks, tiles", [
    (64, 64, 8, (32, 32)),     # B1 H8 K=V=64: 8 programs at 64 x 64, 32 once halved twice
    (64, 64, 64, (64, 32)),    # 64 -> 128 programs with V halved once
    (128, 128, 64, (64, 128)),  # B4 H16 K=V=128: 128 programs already
    (64, 64, 1, (32, 32)),     # never below 32
    (16, 48, 2, (16, 32)),     # tiles cut to K first (16), then V halved from 64 to 32
])
def test_walk_tiles(key_dim, value_dim, walks, tiles):
    """The forward alone's walk narrows its tiles, V first, while it has fewer than 128 programs."""
    config = ChunkedConfig()
    assert _walk_tiles(config.states_alone, key_dim, value_dim, walks, config.min_walk_programs) == tiles


@pytest.mark.parametrize("key_dim, value_dim, walks, num_chunks, packed, plan", [
    (64, 64, 8, 512, False, (32, 32, 16, 32)),   # B1 T32768 H8: 32 programs x 16 segments
    (128, 128, 64, 64, False, (64, 128, 1, 1 << 30)),  # B4 T4096 H16: 128 programs, one walk
    (64, 64, 8, 512, True, (32, 32, 1, 1 << 30)),  # packed: never cut
    (16, 16, 1, 20, False, (16, 16, 2, 16)),     # segments of at least 16 steps
    (64, 64, 2, 512, False, (32, 32, 32, 16)),   # 8 programs: 64 segments of 8 wanted, 32 of 16
    (16, 16, 1, 16, False, (16, 16, 1, 1 << 30)),  # one segment: one walk
    (64, 64, 16, 65535, False, (32, 32, 64, 1024)),  # 8 segments of 8192 wanted: at most 1024
])
def test_walk_plan(key_dim, value_dim, walks, num_chunks, packed, plan):
    assert _walk_plan(ChunkedConfig(), key_dim, value_dim, walks, num_chunks, packed) == plan
    assert _walk_plan(ChunkedConfig(split_walk=False), key_dim, value_dim, walks, num_chunks, packed)[2] == 1


def test_walk_plan_grid_limit():
    """Segments multiply the walks on the grid's third axis (at most 65535), not the K tiles."""
    config = ChunkedConfig(split_programs=10**6)  # segments of 16 steps: 3000 of them
    assert _walk_plan(config, 64, 64, 16, 48_000, False) == (32, 32, 3000, 16)  # 16 x 3000 = 48000
    assert _walk_plan(config, 64, 64, 22, 48_000, False)[2] == 1  # 22 x 3000 = 66000: one walk


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("gates", [("g",), ("g", "g_gamma"), ()])
def test_segmented_walk(rng, reverse, gates):
    """The forward alone's walk cut into 3 segments (16, 16 and 6 chunks: few short walks, no
    packing), walked at once: each chunk's state is its segment's plus the state handed to the
    segment, decayed to the chunk (checked with the rest by check)."""
    inputs = make_inputs(rng, batch=2, seq_len=16 * 37 + 5, key_dim=16, value_dim=24, gates=gates,
                         gate_scale=0.3)
    assert _walk_plan(ChunkedConfig(), 16, 24, 2 * 2, 38, False)[2:] == (3, 16)
    check(rng, inputs, chunk_size=16, reverse=reverse)


def test_segmented_walk_under_vmap(rng):
    """vmap folds the items into the batch: the segments are each item's own."""
    items = [make_inputs(rng, batch=1, seq_len=16 * 20, key_dim=16, value_dim=16, gates=("g",)) for _ in range(2)]
    stacked = {n: jnp.asarray(np.stack([item[n] for item in items]), jnp.float32) for n in items[0]}
    run = functools.partial(chunked_recurrent, chunk_size=16)
    outs = jax.vmap(lambda inputs: run(**inputs))(stacked)
    for i, item in enumerate(items):
        out = run(**{n: jnp.asarray(x, jnp.float32) for n, x in item.items()})
        for got, want in zip(outs, out):
            assert rel_err(got[i], want) <= 1e-6


def test_config_numpy_ints_and_hashable():
    config = ChunkedConfig(states=KernelConfig(block_k=np.int64(32), block_v=16))
    assert config.states.block_k == 32 and type(config.states.block_k) is int
    assert hash(config) == hash(ChunkedConfig(states=KernelConfig(block_k=32, block_v=16)))


@pytest.mark.parametrize("limit", [None, 232448, 166912, 131072, 131071, 120000, 101376])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16])
@pytest.mark.parametrize("key_dim, value_dim", [(128, 128), (64, 128), (128, 64), (64, 64),
                                                (256, 256), (0, 128), (128, 0), (0, 0)])
def test_default_config_follows_shared_memory(dtype, limit, key_dim, value_dim, monkeypatch):
    """``ChunkedConfig.default``: ``ChunkedConfig()``, except float32 inputs with K or V of 128
    or more, which take ``attention`` at 1 stage on every GPU, and on one whose blocks have less
    than 131072 bytes ``fused_output`` at 2 stages too; ``None`` asks the driver (none here:
    Hopper's)."""
    monkeypatch.setattr(ejk_lite.chunked, "max_shared_memory", lambda: None)  # "no driver"
    got = ChunkedConfig.default(dtype, key_dim, value_dim, shared_memory=limit)
    float32_wide = dtype == jnp.float32 and max(key_dim, value_dim) >= 128
    smaller = float32_wide and limit in (131071, 120000, 101376)
    assert got.fused_output.num_stages == (2 if smaller else 3)
    assert got.attention.num_stages == (1 if float32_wide else 2)
    assert dataclasses.replace(got, fused_output=ChunkedConfig().fused_output,
                               attention=ChunkedConfig().attention) == ChunkedConfig()


@pytest.mark.parametrize("dtypes, smaller", [(("float32",) * 3, True), (("bfloat16",) * 3, False),
                                             (("bfloat16", "float32", "float32"), True),
                                             (("float32", "bfloat16", "bfloat16"), True),
                                             (("bfloat16", "float16", "bfloat16"), True)])
def test_default_config_of_a_call(dtypes, smaller, monkeypatch):
    """With ``config=None`` a call takes ``ChunkedConfig.default`` of the products' dtype (the
    result type of query, key and value, which the kernels compute in: a bfloat16 query with
    float32 keys runs float32 kernels) and its head dims, on the driver's shared memory."""
    taken = []
    monkeypatch.setattr(ejk_lite.chunked, "max_shared_memory", lambda: 101376)
    monkeypatch.setattr(ejk_lite.chunked, "_chunked_jit",
                        lambda static, *args: taken.append(static.config))
    q, k, v = (jnp.zeros((1, 16, 1, 128), d) for d in dtypes)
    _chunked_recurrent(q, k, v, impl="triton")
    assert taken == [ChunkedConfig.default(jnp.float32 if smaller else jnp.bfloat16,
                                           shared_memory=101376)]
    assert (taken[0].attention.num_stages == 1) == smaller
    _chunked_recurrent(q, k, v, impl="triton", config=ChunkedConfig())  # a given config is kept
    assert taken[-1] == ChunkedConfig()


@pytest.mark.parametrize("bad", [None, "x", jnp.float64, jnp.int32, jnp.ones(3, jnp.int32)])
def test_default_config_refuses_other_dtypes(bad):
    """Not a dtype the kernels take (None would be NumPy's float64): a ValueError naming it."""
    with pytest.raises(ValueError, match="^dtype must be float16, bfloat16 or float32"):
        ChunkedConfig.default(bad, shared_memory=101376)
    with pytest.raises(ValueError, match="shared_memory"):
        ChunkedConfig.default(jnp.float32, shared_memory=1.5e5)


@offline_compile
def test_default_config_fits_smaller_gpus():
    """On sm_86 and sm_89 (RTX 30xx and 40xx, A10, L4: 101376 bytes a block) the default config
    compiles within the shared memory for float32 and bfloat16 at K = V = 128, every gate,
    forward and backward (``tools/compile_check.py --package``). With ``ChunkedConfig()`` there,
    float32 fails in 3 launches (``_fused_output_kernel`` and ``_gk_attention_kernel`` at
    131072 bytes)."""
    assert compiled_package_launches("smaller_gpu_chunked_child.py", arch=89,
                                     shared_memory=101376) >= 20
