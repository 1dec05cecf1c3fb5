"""ejk_lite.recurrent against a float64 reference: outputs, final state and every gradient.

Both implementations: the Triton kernels (``impl="triton"``, in the interpreter here) and the
XLA path (``impl="xla"``, the module's ``lax.scan`` reference, differentiated by JAX)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import TOLERANCE, WRAPPING_CU_SEQLENS, rel_err

from ejk_lite.linear_attention import RecurrentConfig, recurrent, reference

# The kernels, whatever "auto" picks on this machine.
triton_recurrent = functools.partial(recurrent, impl="triton")

ALL_GATES = ("g", "g_gamma", "gk", "gv")


def make_inputs(rng, *, batch=2, seq_len=11, heads=2, kv_heads=1, key_dim=6, value_dim=9,
                gates=(), gate_scale=1.0, num_states=None, with_state=True):
    """Random q/k/v, gates as logsigmoid(gate_scale * normal), and an initial state, in float64."""
    def normal(*shape):
        return rng.normal(size=shape)

    def log_gate(*shape):  # log(sigmoid(x)), computed stably
        return -np.logaddexp(0.0, -gate_scale * normal(*shape))

    inputs = dict(query=normal(batch, seq_len, heads, key_dim),
                  key=normal(batch, seq_len, kv_heads, key_dim),
                  value=normal(batch, seq_len, kv_heads, value_dim))
    gate_shapes = dict(g=(batch, seq_len, heads), g_gamma=(heads,), gk=(batch, seq_len, heads, key_dim),
                       gv=(batch, seq_len, heads, value_dim))
    for name in gates:
        inputs[name] = log_gate(*gate_shapes[name])
    if with_state:
        inputs["initial_state"] = normal(batch if num_states is None else num_states, heads, key_dim, value_dim)
    return inputs


def check_against_reference(rng, inputs, dtype=jnp.float32, use=("output", "final_state"), impl="triton",
                            config=None, **options):
    """Run ``recurrent`` (``impl``, ``config``) in ``dtype`` and the reference in float64 on the
    same (rounded) inputs; compare the output, the final state and the gradient of every array
    input."""
    op = functools.partial(recurrent, impl=impl, config=config)
    names = list(inputs)
    arrays = [jnp.asarray(inputs[name], dtype) for name in names]

    def call(fn, *arrays):
        o, final_state = fn(**dict(zip(names, arrays)), **options)
        return {"output": o, "final_state": final_state}

    def used(fn):  # only the outputs named in `use` reach the loss
        return lambda *arrays: {key: value for key, value in call(fn, *arrays).items() if key in use}

    outs, vjp = jax.vjp(used(op), *arrays)
    cotangents = {key: jnp.asarray(rng.normal(size=value.shape), value.dtype) for key, value in outs.items()}
    grads = vjp(cotangents)
    full = outs if len(outs) == 2 else call(op, *arrays)

    with jax.enable_x64(True):
        arrays64 = [jnp.asarray(np.asarray(a, np.float64)) for a in arrays]
        ref_full = call(reference, *arrays64)
        _, ref_vjp = jax.vjp(used(reference), *arrays64)
        cotangents64 = {key: jnp.asarray(np.asarray(c, np.float64)) for key, c in cotangents.items()}
        ref_grads = ref_vjp(cotangents64)
        ref_full, ref_grads = jax.tree.map(np.asarray, (ref_full, ref_grads))
        if "g_gamma" in names:
            # g_gamma's gradient is a sum over every token of terms of both signs, which can be far
            # smaller than the terms: as for any floating-point sum, its error is measured against
            # the sum of the terms' magnitudes (equal to the plain relative error when nothing
            # cancels). The terms are what a per-token gate g would get, probed with a zero g.
            def probed(probe):
                kwargs = dict(zip(names, arrays64))
                kwargs["g"] = kwargs["g"] + probe if "g" in kwargs else probe
                o, final_state = reference(**kwargs, **options)
                return {key: x for key, x in {"output": o, "final_state": final_state}.items() if key in use}
            per_token = np.asarray(jax.vjp(probed, jnp.zeros(arrays64[0].shape[:3]))[1](cotangents64)[0])
            g_gamma_scale = np.linalg.norm(np.abs(per_token).sum(axis=(0, 1)))

    assert full["output"].dtype == dtype and full["final_state"].dtype == jnp.float32
    errors = {key: rel_err(full[key], ref_full[key]) for key in full}
    for name, grad, ref_grad, array in zip(names, grads, ref_grads, arrays):
        assert grad.dtype == array.dtype, (name, grad.dtype)
        errors["d" + name] = rel_err(grad, ref_grad)
        if name == "g_gamma":
            errors["dg_gamma"] *= np.linalg.norm(ref_grad) / g_gamma_scale
    tolerance = TOLERANCE[jnp.dtype(dtype).name]
    report = ", ".join(f"{key} {error:.2e}" for key, error in errors.items())
    assert all(error <= tolerance for error in errors.values()), report


@pytest.mark.parametrize("gates,gate_scale", [
    ((), 1.0), (("g",), 1.0), (("g_gamma",), 1.0), (("gk",), 1.0), (("gv",), 1.0),
    (ALL_GATES, 0.1), (ALL_GATES, 1.0), (ALL_GATES, 10.0),
    (("gk", "gv"), 10.0), (("g", "g_gamma"), 10.0),
])
def test_gates(rng, gates, gate_scale):
    """Each gate alone and all together; scale 10 makes many decays exp(-large) (strong decay)."""
    check_against_reference(rng, make_inputs(rng, gates=gates, gate_scale=gate_scale))


@pytest.mark.parametrize("impl", ["triton", "xla"])
@pytest.mark.parametrize("gate", ["g", "gk", "gv"])
def test_gate_that_forgets_everything(rng, gate, impl):
    """A log-gate of -inf (exp = 0: the state, or for gv a value column, is reset there), twice
    in a row once: output, final state and every gradient, the gate's included, those of the
    float64 reference (whose gradient there is 0, never 0 * inf)."""
    inputs = make_inputs(rng, seq_len=40, gates=(gate,))
    inputs[gate][0, [3, 20, 21]] = -np.inf
    check_against_reference(rng, inputs, impl=impl)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize("packed", [False, True])
def test_xla_impl(rng, dtype, packed):
    """impl="xla" (the lax.scan reference, differentiated by JAX) against the float64 reference."""
    options = {}
    if packed:
        lengths = [4, 0, 1, 6]
        options = dict(cu_seqlens=jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32), reverse=True)
        inputs = make_inputs(rng, batch=1, seq_len=13, gates=ALL_GATES, num_states=len(lengths))
    else:
        inputs = make_inputs(rng, gates=ALL_GATES)
    check_against_reference(rng, inputs, dtype=dtype, impl="xla", **options)


@pytest.mark.parametrize("packed", [False, True])
def test_xla_and_triton_agree_on_every_gradient(rng, packed):
    """The two implementations side by side, in float32, under jax.jit (cu_seqlens traced)."""
    options = {}
    if packed:
        lengths = [5, 1, 0, 4]
        options["cu_seqlens"] = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
        inputs = make_inputs(rng, batch=1, seq_len=12, heads=4, kv_heads=2, gates=ALL_GATES,
                             num_states=len(lengths))
    else:
        inputs = make_inputs(rng, gates=ALL_GATES)
    names = list(inputs)
    arrays = [jnp.asarray(inputs[name], jnp.float32) for name in names]
    weights_o = jnp.asarray(rng.normal(size=arrays[0].shape[:3] + (arrays[2].shape[-1],)), jnp.float32)

    def loss(impl):
        @jax.jit
        def f(arrays, cu_seqlens=None):
            o, state = recurrent(**dict(zip(names, arrays)), cu_seqlens=cu_seqlens, impl=impl)
            return jnp.sum(o * weights_o) + jnp.sum(jnp.sin(state))
        return jax.value_and_grad(f)(arrays, options.get("cu_seqlens"))

    (value_xla, grads_xla), (value_triton, grads_triton) = loss("xla"), loss("triton")
    assert abs(float(value_xla - value_triton)) <= TOLERANCE["float32"] * abs(float(value_xla))
    for name, a, b in zip(names, grads_xla, grads_triton):
        assert a.dtype == b.dtype == jnp.float32, name
        assert rel_err(b, np.asarray(a, np.float64)) <= TOLERANCE["float32"], name


def test_xla_impl_under_vmap_grad_and_jit(rng):
    """impl="xla" composes like the kernels: vmap (cu_seqlens mapped too) of jit of grad equals a
    loop over the elements."""
    lengths = [[3, 0, 6], [1, 7, 1]]
    cus = jnp.asarray([np.concatenate([[0], np.cumsum(lens)]) for lens in lengths], jnp.int32)
    inputs = [make_inputs(rng, batch=1, seq_len=10, gates=ALL_GATES, num_states=3) for _ in lengths]
    names = list(inputs[0])
    stacked = [jnp.asarray(np.stack([x[name] for x in inputs]), jnp.float32) for name in names]

    def loss(arrays, cu_seqlens):
        o, state = recurrent(**dict(zip(names, arrays)), cu_seqlens=cu_seqlens, impl="xla")
        return jnp.sum(o ** 2) + jnp.sum(state)

    grads = jax.vmap(jax.jit(jax.grad(loss)))(stacked, cus)
    for i in range(len(lengths)):
        expected = jax.grad(loss)([x[i] for x in stacked], cus[i])
        for name, got, want in zip(names, grads, expected):
            assert rel_err(got[i], np.asarray(want, np.float64)) <= TOLERANCE["float32"], name


def test_float64_takes_the_xla_path(rng):
    """The kernels accumulate in float32: float64 is refused by impl="triton" (a ValueError naming
    the argument), and computed in float64 by impl="xla"."""
    arrays = {n: jnp.asarray(x, jnp.float32) for n, x in make_inputs(rng, gates=("g",)).items()}
    for name in ("query", "g", "initial_state"):
        with jax.enable_x64(True):
            bad = {**arrays, name: jnp.asarray(np.asarray(arrays[name]), jnp.float64)}
            with pytest.raises(ValueError, match=f"{name}: the Triton kernels take"):
                recurrent(**bad, impl="triton")
    with jax.enable_x64(True):
        arrays64 = {n: jnp.asarray(x, jnp.float64) for n, x in make_inputs(rng, gates=("g",)).items()}
        o, state = recurrent(**arrays64, impl="xla")
        ref_o, ref_state = reference(**arrays64)
        assert o.dtype == state.dtype == jnp.float64
        np.testing.assert_allclose(o, ref_o, rtol=1e-12, atol=1e-12)  # jitted: float64 rounding only
        np.testing.assert_allclose(state, ref_state, rtol=1e-12, atol=1e-12)


def test_impl_and_config_are_checked():
    q = jnp.zeros((1, 4, 2, 3))
    for bad in ("cuda", None, 1):
        with pytest.raises(ValueError, match="impl"):
            recurrent(q, q, q, impl=bad)
    with pytest.raises(ValueError, match="config"):
        recurrent(q, q, q, impl="triton", config=(4, 8, 1))
    for field, value in [("fwd_block_k", 6), ("bwd_block_v", 0), ("fwd_num_warps", 3), ("bwd_block_k", 4.0),
                         ("fwd_block_v", True)]:
        with pytest.raises(ValueError, match=f"RecurrentConfig.{field}"):
            RecurrentConfig(**{field: value})
    config = RecurrentConfig(fwd_block_k=np.int64(8), bwd_num_warps=np.int32(2))
    assert type(config.fwd_block_k) is int and type(config.bwd_num_warps) is int
    assert config.blocks("fwd", 128, 128) == (8, 8, 1) and config.blocks("bwd", 128, 128) == (128, 16, 2)
    # The defaults: all of K up to 128, narrow V tiles, warps by the tile's size.
    assert RecurrentConfig().blocks("fwd", 128, 128) == (128, 16, 4)
    assert RecurrentConfig().blocks("bwd", 64, 64) == (64, 8, 2)
    assert RecurrentConfig().blocks("fwd", 6, 9) == (8, 8, 1)


def test_reverse_without_initial_state_and_custom_scale(rng):
    inputs = make_inputs(rng, gates=ALL_GATES, with_state=False, key_dim=16, value_dim=5)
    check_against_reference(rng, inputs, reverse=True, softmax_scale=0.7)


@pytest.mark.parametrize("reverse", [False, True])
def test_packed_sequences(rng, reverse):
    """Sequences of 5, 0, 1, 7 and 3 tokens in one row, 2 padding tokens after them."""
    lengths = [5, 0, 1, 7, 3]
    cu_seqlens = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
    inputs = make_inputs(rng, batch=1, seq_len=sum(lengths) + 2, heads=4, kv_heads=2, key_dim=8, value_dim=5,
                         gates=ALL_GATES, num_states=len(lengths))
    check_against_reference(rng, inputs, reverse=reverse, cu_seqlens=cu_seqlens)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision(rng, dtype):
    inputs = make_inputs(rng, gates=ALL_GATES)
    check_against_reference(rng, inputs, dtype=dtype)


def test_half_precision_packed_reverse(rng):
    lengths = [4, 1, 0, 6]
    cu_seqlens = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
    inputs = make_inputs(rng, batch=1, seq_len=sum(lengths), heads=2, kv_heads=2, gates=ALL_GATES,
                         num_states=len(lengths))
    check_against_reference(rng, inputs, dtype=jnp.bfloat16, reverse=True, cu_seqlens=cu_seqlens)


@pytest.mark.parametrize("packed", [False, True])
def test_several_state_tiles(rng, packed):
    """Tiles smaller than K and V: outputs and gradients are sums of per-tile partials (the
    backward's tiles differ from the forward's: it recomputes the state on its own)."""
    config = RecurrentConfig(fwd_block_k=4, fwd_block_v=8, fwd_num_warps=1, bwd_block_k=2, bwd_block_v=4,
                             bwd_num_warps=2)
    options = {}
    if packed:
        lengths = [6, 0, 1, 5]
        options["cu_seqlens"] = jnp.asarray(np.concatenate([[0], np.cumsum(lengths)]), jnp.int32)
        inputs = make_inputs(rng, batch=1, seq_len=13, gates=ALL_GATES, num_states=len(lengths))
    else:
        inputs = make_inputs(rng, gates=ALL_GATES)
    check_against_reference(rng, inputs, reverse=packed, config=config, **options)  # K = 6, V = 9


@pytest.mark.parametrize("use", [("output",), ("final_state",)])
def test_only_one_result_used(rng, use):
    """The unused result's cotangent is a symbolic zero; the gradients must still be right."""
    check_against_reference(rng, make_inputs(rng, gates=ALL_GATES), use=use)


@pytest.mark.parametrize("reverse", [False, True])
def test_state_passing(rng, reverse):
    """Running a sequence in two calls, the first's final state starting the second, equals one call."""
    inputs = {name: jnp.asarray(x, jnp.float32)
              for name, x in make_inputs(rng, gates=ALL_GATES, seq_len=14).items()}
    o, final_state = triton_recurrent(**inputs, reverse=reverse)

    split = 6
    sequence_inputs = ("query", "key", "value", "g", "gk", "gv")
    first = {n: x[:, :split] if n in sequence_inputs else x for n, x in inputs.items()}
    second = {n: x[:, split:] if n in sequence_inputs else x for n, x in inputs.items()}
    if reverse:  # the walk starts at the end: the second half goes first
        first, second = second, first
    o_first, state = triton_recurrent(**first, reverse=reverse)
    o_second, final_state_two_calls = triton_recurrent(**{**second, "initial_state": state}, reverse=reverse)
    o_two_calls = jnp.concatenate([o_second, o_first] if reverse else [o_first, o_second], axis=1)
    assert rel_err(o_two_calls, o) <= TOLERANCE["float32"]
    assert rel_err(final_state_two_calls, final_state) <= TOLERANCE["float32"]


def test_no_tokens_in_any_sequence(rng):
    """Only empty sequences and padding: zero output, the state passes through, so does its gradient."""
    inputs = {n: jnp.asarray(x, jnp.float32)
              for n, x in make_inputs(rng, batch=1, seq_len=3, gates=ALL_GATES, num_states=2).items()}
    cu_seqlens = jnp.array([0, 0, 0], jnp.int32)
    names = list(inputs)
    (o, final_state), vjp = jax.vjp(lambda *a: triton_recurrent(**dict(zip(names, a)), cu_seqlens=cu_seqlens),
                                    *inputs.values())
    assert float(jnp.abs(o).max()) == 0.0
    np.testing.assert_array_equal(final_state, inputs["initial_state"])
    d_final_state = jnp.asarray(rng.normal(size=final_state.shape), jnp.float32)
    grads = dict(zip(inputs, vjp((jnp.asarray(rng.normal(size=o.shape), o.dtype), d_final_state))))
    np.testing.assert_array_equal(grads.pop("initial_state"), d_final_state)
    assert all(float(jnp.abs(grad).max()) == 0.0 for grad in grads.values())


def test_reference_against_numpy_loop(rng):
    """The reference itself, against the recurrence written as plain loops (GQA, packing, reverse)."""
    lengths = [3, 0, 4]
    cu_seqlens = np.concatenate([[0], np.cumsum(lengths)])
    inputs = make_inputs(rng, batch=1, seq_len=8, heads=4, kv_heads=2, key_dim=3, value_dim=2,
                         gates=ALL_GATES, num_states=3)
    scale = 0.6
    for reverse in (False, True):
        expected_o = np.zeros((1, 8, 4, 2))
        expected_state = np.zeros((3, 4, 3, 2))
        for n in range(3):
            for head in range(4):
                h = inputs["initial_state"][n, head].copy()
                tokens = range(cu_seqlens[n], cu_seqlens[n + 1])
                for t in (reversed(tokens) if reverse else tokens):
                    decay = np.exp(inputs["g"][0, t, head] + inputs["g_gamma"][head])
                    decay = decay * np.exp(inputs["gk"][0, t, head])[:, None] * np.exp(inputs["gv"][0, t, head])[None, :]
                    h = h * decay + np.outer(inputs["key"][0, t, head // 2], inputs["value"][0, t, head // 2])
                    expected_o[0, t, head] = scale * inputs["query"][0, t, head] @ h
                expected_state[n, head] = h
        with jax.enable_x64(True):
            o, state = reference(**{k: jnp.asarray(x) for k, x in inputs.items()}, softmax_scale=scale,
                                 reverse=reverse, cu_seqlens=jnp.asarray(cu_seqlens))
            o, state = np.asarray(o), np.asarray(state)
        np.testing.assert_allclose(o, expected_o, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(state, expected_state, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("change,argument", [
    (dict(key=(2, 5, 2, 4)), "key"),
    (dict(value=(2, 5, 3, 4)), "value"),
    (dict(value=(2, 6, 2, 4)), "value"),
    (dict(key=(2, 5, 3, 3), value=(2, 5, 3, 4)), "heads"),  # 3 kv heads do not divide 4 query heads
    (dict(g=(2, 5, 2)), "g"),
    (dict(g_gamma=(2, 4)), "g_gamma"),
    (dict(gk=(2, 5, 4, 4)), "gk"),
    (dict(gv=(2, 5, 4, 3)), "gv"),
    (dict(initial_state=(3, 4, 3, 4)), "initial_state"),
    (dict(query=(2, 5, 4)), "query"),
])
def test_bad_shapes(change, argument):
    shapes = dict(query=(2, 5, 4, 3), key=(2, 5, 2, 3), value=(2, 5, 2, 4))
    shapes.update(change)
    args = {name: jnp.zeros(shape) for name, shape in shapes.items()}
    with pytest.raises(ValueError, match=argument):
        recurrent(**args)


def test_bad_packing():
    q, k, v = jnp.zeros((1, 6, 2, 3)), jnp.zeros((1, 6, 2, 3)), jnp.zeros((1, 6, 2, 4))
    with pytest.raises(ValueError, match="cu_seqlens"):
        recurrent(q, k, v, cu_seqlens=jnp.array([0, 4, 2], jnp.int32))  # decreasing
    with pytest.raises(ValueError, match="cu_seqlens"):
        recurrent(q, k, v, cu_seqlens=jnp.array([0, 7], jnp.int32))  # past the 6 tokens
    with pytest.raises(ValueError, match="cu_seqlens"):
        recurrent(q, k, v, cu_seqlens=jnp.array([0.0, 6.0]))  # not integers
    with pytest.raises(ValueError, match="batch"):
        recurrent(jnp.zeros((2, 6, 2, 3)), jnp.zeros((2, 6, 2, 3)), jnp.zeros((2, 6, 2, 4)),
                  cu_seqlens=jnp.array([0, 6], jnp.int32))
    with pytest.raises(ValueError, match="initial_state"):  # 2 sequences, 1 state
        recurrent(q, k, v, initial_state=jnp.zeros((1, 2, 3, 4)), cu_seqlens=jnp.array([0, 2, 6], jnp.int32))


# ----------------------------------------------------------------------------------------------
# Arguments: dtypes, NumPy scalars, integer dtypes of cu_seqlens, empty key/value dimensions.
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("argument, dtype", [
    ("query", jnp.int32), ("key", jnp.bool_), ("value", jnp.int8), ("g", jnp.int32), ("g_gamma", jnp.bool_),
    ("gk", jnp.int16), ("gv", jnp.uint8), ("initial_state", jnp.int32),
])
def test_non_floating_inputs_are_refused(rng, argument, dtype):
    # A state of integers would be decayed and summed in integer arithmetic: no silent truncation.
    arrays = {n: jnp.asarray(x, jnp.float32) for n, x in make_inputs(rng, gates=ALL_GATES).items()}
    arrays[argument] = (arrays[argument] > 0).astype(dtype)
    with pytest.raises(ValueError, match=f"{argument} must have a floating dtype, got {jnp.dtype(dtype)}"):
        recurrent(**arrays)
    with pytest.raises(ValueError, match=argument):
        reference(**arrays)


def test_numpy_scalars_behave_like_python_numbers(rng):
    inputs = make_inputs(rng, gates=ALL_GATES)
    check_against_reference(rng, inputs, softmax_scale=np.float32(0.7), reverse=np.bool_(True))
    arrays = {n: jnp.asarray(x, jnp.float32) for n, x in inputs.items()}
    for bad in (True, np.bool_(False), "0.5", jnp.ones(2)):
        with pytest.raises(ValueError, match="softmax_scale"):
            recurrent(**arrays, softmax_scale=bad)


@pytest.mark.parametrize("dtype", ["int8", "uint8", "int16", "uint16", "uint32", "uint64", "int64"])
def test_cu_seqlens_of_any_integer_dtype(rng, dtype):
    lengths = [5, 0, 1, 7]
    cu_seqlens = np.concatenate([[0], np.cumsum(lengths)]).astype(dtype)
    inputs = make_inputs(rng, batch=1, seq_len=sum(lengths) + 2, gates=("g", "gk"), num_states=len(lengths))
    check_against_reference(rng, inputs, cu_seqlens=cu_seqlens)


@pytest.mark.parametrize("bad, match", WRAPPING_CU_SEQLENS)
def test_cu_seqlens_that_would_wrap_are_refused(bad, match):
    q = jnp.zeros((1, 12, 2, 3))
    with pytest.raises(ValueError, match=f"cu_seqlens.*{match}"):
        recurrent(q, q, q, cu_seqlens=bad)


@pytest.mark.parametrize("key_dim, value_dim", [(0, 5), (4, 0), (0, 0)])
def test_empty_key_or_value_dimension(rng, key_dim, value_dim):
    """An empty state (K = 0 or V = 0) holds nothing: o = (scale q) h is zero, the final state is
    empty, and every gradient is zero, as in the reference (no ZeroDivisionError for the default
    scale K ** -0.5: with K = 0 it multiplies nothing)."""
    arrays = {n: jnp.asarray(x, jnp.float32) for n, x in make_inputs(rng, key_dim=key_dim, value_dim=value_dim,
                                                                      gates=ALL_GATES).items()}
    names = list(arrays)
    for fn in (triton_recurrent, reference):
        (o, state), vjp = jax.vjp(lambda *a: fn(**dict(zip(names, a))), *arrays.values())
        assert o.shape == (2, 11, 2, value_dim) and state.shape == (2, 2, key_dim, value_dim)
        assert float(jnp.abs(o).sum()) == 0.0
        grads = vjp((jnp.asarray(rng.normal(size=o.shape), jnp.float32), jnp.zeros(state.shape)))
        for name, grad in zip(names, grads):
            assert grad.shape == arrays[name].shape, name
            assert float(jnp.abs(grad).sum()) == 0.0, name
