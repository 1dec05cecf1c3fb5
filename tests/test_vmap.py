"""``jax.vmap`` of every op's Triton path: forward, gradient, nested, non-leading axes, jit.

The kernels' launches cannot be batched by JAX itself (jax-triton's primitive and the
interpreter's ``pure_callback`` have no batching rule). Each op folds the mapped axis into an axis
its kernels already treat as independent rows (``ejk_lite.launch.vmap_by_folding``), so a batch is
*one* launch; only a mapped ``cu_seqlens`` (a different packing per element) falls back to one
launch per element. Each test checks the batched results against the float64 reference applied
to each element, and reads the launches out of the traced program to check that they were
folded: one launch per kernel for the whole batch, none inside a loop.
"""

import functools
import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import TOLERANCE, rel_err
from ejk_lite import block_mean_pooling, chunk_global_cumsum, chunk_local_cumsum, mean_pooling, recurrent
from jax.extend.core import ClosedJaxpr, Jaxpr

from ejk_lite.launch import vmap_by_folding

cumsum = importlib.import_module("ejk_lite.cumsum")
pooling = importlib.import_module("ejk_lite.pooling")
rec = importlib.import_module("ejk_lite.linear_attention")

# Triton's interpreter turns a loop bound loaded from memory into an int through a shape-(1,)
# array, which NumPy deprecates; harmless here.
pytestmark = pytest.mark.filterwarnings("ignore:Conversion of an array with ndim > 0:DeprecationWarning")

TOL = TOLERANCE["float32"]


LAUNCHES = ("pure_callback", "triton_kernel_call")  # the interpreter's, jax-triton's
LOOPS = ("scan", "while")


def launches(fn, *args):
    """The kernel launches in the program ``fn(*args)`` traces to: for each, the sizes of its
    outputs (1-element stand-ins left out) and whether it sits inside a loop (``lax.map``)."""
    found = []

    def walk(jaxpr, in_loop):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in LAUNCHES:
                found.append((sorted(v.aval.size for v in eqn.outvars if v.aval.size > 1), in_loop))
            for param in eqn.params.values():
                for sub in param if isinstance(param, (list, tuple)) else [param]:
                    if isinstance(sub, (ClosedJaxpr, Jaxpr)):
                        walk(sub.jaxpr if isinstance(sub, ClosedJaxpr) else sub,
                             in_loop or eqn.primitive.name in LOOPS)

    walk(jax.make_jaxpr(fn)(*args).jaxpr, False)
    assert found, "no kernel launch in the program"
    return found


def assert_folded(batched, unbatched, size):
    """``batched`` (a batch of ``size``) launches what ``unbatched`` (one element) launches,
    each launch ``size`` times larger, none in a loop: the batch was folded into the rows."""
    assert all(not in_loop for _, in_loop in batched), "a launch runs in a loop (lax.map)"
    assert sorted(sizes for sizes, _ in batched) == sorted([n * size for n in sizes] for sizes, _ in unbatched)


def normal(rng, *shape):
    return jnp.asarray(rng.standard_normal(shape), jnp.float32)


def to64(x):
    return jnp.asarray(np.asarray(x), jnp.float64)


def check(rng, op, reference, args, in_axes=0):
    """vmap of ``op`` against the float64 ``reference`` per element (and against a loop of the
    unbatched ``op``): outputs, then the gradient of a random weighted sum both ways round (vmap
    of grad, grad of vmap), then nested vmap; each time, the launches must be folded.

    ``args`` carry the mapped axis where ``in_axes`` says; ``reference`` takes one element."""
    in_axes = (in_axes,) * len(args) if isinstance(in_axes, int) or in_axes is None else tuple(in_axes)
    size = next(a.shape[ax] for a, ax in zip(args, in_axes) if ax is not None)

    def element(i, arrays):
        return [a if ax is None else jnp.take(a, i, axis=ax) for a, ax in zip(arrays, in_axes)]

    out = jax.jit(jax.vmap(op, in_axes=in_axes))(*args)
    weights = jnp.asarray(rng.standard_normal(out.shape), jnp.float32)
    one = element(0, args)
    one_loss = jax.grad(lambda w, *a: jnp.sum(w * op(*a)), argnums=tuple(range(1, len(args) + 1)))
    assert_folded(launches(jax.vmap(op, in_axes=in_axes), *args), launches(op, *one), size)
    assert_folded(launches(jax.vmap(one_loss, in_axes=(0, *in_axes)), weights, *args),
                  launches(one_loss, weights[0], *one), size)
    with jax.enable_x64(True):
        refs = [np.asarray(reference(*map(to64, element(i, args)))) for i in range(size)]
        ref_grads = [[np.asarray(g) for g in jax.grad(lambda *a: jnp.sum(to64(weights[i]) * reference(*a)),
                                                      argnums=tuple(range(len(args))))(*map(to64, element(i, args)))]
                     for i in range(size)]
    assert rel_err(out, np.stack(refs)) < TOL
    # The same kernels on the same rows: a Python loop of the unbatched op agrees to rounding.
    assert rel_err(out, np.stack([np.asarray(op(*element(i, args))) for i in range(size)])) < 1e-6

    differentiable = tuple(range(len(args)))
    grads = jax.vmap(jax.grad(lambda w, *a: jnp.sum(w * op(*a)), argnums=tuple(d + 1 for d in differentiable)),
                     in_axes=(0, *in_axes))(weights, *args)
    total = jax.grad(lambda *a: jnp.sum(weights * jax.vmap(op, in_axes=in_axes)(*a)), argnums=differentiable)(*args)
    for j, ax in enumerate(in_axes):
        per_element = np.stack([ref_grads[i][j] for i in range(size)])
        assert rel_err(grads[j], per_element) < TOL, j
        # grad of vmap: the mapped axis where the argument had it; an unmapped argument sums.
        expected = per_element.sum(0) if ax is None else np.moveaxis(per_element, 0, ax)
        assert rel_err(total[j], expected) < TOL, j

    # Nested: a second mapped axis in front (of the mapped arguments), elements scaled by 1 and 0.5.
    scales = jnp.asarray([1.0, 0.5])  # 0.5: log-decays stay decays
    nested_args = [a if ax is None else scales.reshape((2,) + (1,) * a.ndim) * a for a, ax in zip(args, in_axes)]
    twice = jax.vmap(jax.vmap(op, in_axes=in_axes), in_axes=tuple(None if ax is None else 0 for ax in in_axes))
    nested = jax.jit(twice)(*nested_args)
    assert_folded(launches(twice, *nested_args), launches(op, *one), 2 * size)
    assert nested.shape == (2, *out.shape)
    assert rel_err(nested[0], np.stack(refs)) < TOL
    with jax.enable_x64(True):
        second = [np.asarray(reference(*map(to64, element(i, [a[1] if ax is not None else a
                                                                for a, ax in zip(nested_args, in_axes)]))))
                  for i in range(size)]
    assert rel_err(nested[1], np.stack(second)) < TOL
    return out


# ----------------------------------------------------------------------------------------------
# Chunked cumsums.
# ----------------------------------------------------------------------------------------------


CU = np.array([0, 7, 7, 18], np.int32)  # 3 sequences (one empty), 2 padding tokens of 20


@pytest.mark.parametrize("op", ["local", "global"])
@pytest.mark.parametrize("packed", [False, True])
def test_cumsum(rng, op, packed):
    cu = CU if packed else None
    if op == "local":
        fn = functools.partial(chunk_local_cumsum, chunk_size=4, reverse=True, softmax_scale=0.5, impl="triton")
        ref = functools.partial(cumsum.reference_local_cumsum, chunk_size=4, reverse=True, softmax_scale=0.5)
    else:
        fn = functools.partial(chunk_global_cumsum, softmax_scale=0.5, impl="triton")
        ref = functools.partial(cumsum.reference_global_cumsum, softmax_scale=0.5)
    B = 1 if packed else 2
    x = normal(rng, 3, B, 20, 2, 3)
    check(rng, lambda x: fn(x, cu_seqlens=cu), lambda x: ref(x, cu_seqlens=cu), [x])


@pytest.mark.parametrize("op", ["local", "global"])
def test_cumsum_head_first_on_a_middle_axis(rng, op):
    # [B, H, T] with the mapped axis between H and T: in_axes=2, out_axes=2.
    if op == "local":
        fn = functools.partial(chunk_local_cumsum, chunk_size=8, head_first=True, impl="triton")
        ref = functools.partial(cumsum.reference_local_cumsum, chunk_size=8, head_first=True)
    else:
        fn = functools.partial(chunk_global_cumsum, reverse=True, head_first=True, impl="triton")
        ref = functools.partial(cumsum.reference_global_cumsum, reverse=True, head_first=True)
    x = normal(rng, 2, 3, 4, 19)  # 4 mapped elements of [2, 3, 19]
    out = jax.vmap(fn, in_axes=2, out_axes=2)(x)
    with jax.enable_x64(True):
        expected = np.stack([np.asarray(ref(to64(x[:, :, i]))) for i in range(4)], axis=2)
    assert rel_err(out, expected) < TOL
    check(rng, fn, ref, [x], in_axes=2)


def test_cumsum_mapped_cu_seqlens_runs_each_element(rng):
    # A packing per element: nothing to fold into, one launch per element (lax.map).
    cus = jnp.asarray([[0, 7, 7, 18], [0, 1, 10, 20], [0, 0, 0, 5]], jnp.int32)
    x = normal(rng, 3, 1, 20, 2)
    out = jax.vmap(lambda x, c: chunk_local_cumsum(x, 4, cu_seqlens=c, impl="triton"))(x, cus)
    grad = jax.grad(lambda x: jnp.sum(jax.vmap(lambda x, c: chunk_global_cumsum(x, cu_seqlens=c, impl="triton"))(
        x, cus) ** 2))(x)
    with jax.enable_x64(True):
        ref = np.stack([np.asarray(cumsum.reference_local_cumsum(to64(x[i]), 4, cu_seqlens=np.asarray(cus[i])))
                        for i in range(3)])
        ref_grad = np.stack([np.asarray(jax.grad(lambda a: jnp.sum(cumsum.reference_global_cumsum(
            a, cu_seqlens=np.asarray(cus[i])) ** 2))(to64(x[i]))) for i in range(3)])
    assert rel_err(out, ref) < TOL and rel_err(grad, ref_grad) < TOL
    mapped = launches(jax.vmap(lambda x, c: chunk_local_cumsum(x, 4, cu_seqlens=c, impl="triton")), x, cus)
    assert all(in_loop for _, in_loop in mapped)


# ----------------------------------------------------------------------------------------------
# Mean pooling.
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("op", ["mean", "blocks"])
@pytest.mark.parametrize("packed", [False, True])
def test_pooling(rng, op, packed):
    # sequences cross token tiles, forward and backward
    config = pooling.PoolingConfig(block_hidden=16, fwd_tile_tokens=4, bwd_tile_tokens=4)
    if packed:
        x, cu = normal(rng, 3, 20, 2, 3), CU
    else:
        x, cu = normal(rng, 3, 2, 9, 6), None
    if op == "mean":
        fn = lambda x: mean_pooling(x, 2, cu, impl="triton", config=config)  # noqa: E731
        ref = lambda x: pooling.reference(x, cu)  # noqa: E731
    else:
        fn = lambda x: block_mean_pooling(x, 3, cu, chunk_size=2, impl="triton", config=config)  # noqa: E731
        ref = lambda x: pooling.reference_blocks(x, 3, cu)  # noqa: E731
    check(rng, fn, ref, [x])


def test_pooling_on_a_middle_axis_and_mapped_cu_seqlens(rng):
    x = normal(rng, 20, 4, 5)  # packed tokens, 4 mapped elements on axis 1, 5 features
    check(rng, lambda x: mean_pooling(x, 4, CU, impl="triton"), lambda x: pooling.reference(x, CU), [x], in_axes=1)
    cus = jnp.asarray([[0, 7, 7, 18], [0, 1, 10, 20], [0, 0, 0, 5], [0, 20, 20, 20]], jnp.int32)
    xs = jnp.moveaxis(x, 1, 0)
    pooled = jax.vmap(lambda x, c: block_mean_pooling(x, 4, c, total_blocks=9, impl="triton"))
    out = pooled(xs, cus)
    with jax.enable_x64(True):
        for i in range(4):
            ref = np.asarray(pooling.reference_blocks(to64(xs[i]), 4, np.asarray(cus[i])))
            assert rel_err(out[i, :len(ref)], ref) < TOL
            np.testing.assert_array_equal(out[i, len(ref):], 0)
    assert all(in_loop for _, in_loop in launches(pooled, xs, cus))  # one element at a time


# ----------------------------------------------------------------------------------------------
# Recurrent linear attention.
# ----------------------------------------------------------------------------------------------


def recurrent_inputs(rng, n, batch, seq_len, num_states):
    heads, kv_heads, key_dim, value_dim = 2, 1, 4, 3
    return dict(
        query=normal(rng, n, batch, seq_len, heads, key_dim), key=normal(rng, n, batch, seq_len, kv_heads, key_dim),
        value=normal(rng, n, batch, seq_len, kv_heads, value_dim),
        g=-jnp.abs(normal(rng, n, batch, seq_len, heads)), g_gamma=-jnp.abs(normal(rng, n, heads)),
        gk=-jnp.abs(normal(rng, n, batch, seq_len, heads, key_dim)),
        gv=-jnp.abs(normal(rng, n, batch, seq_len, heads, value_dim)),
        initial_state=normal(rng, n, num_states, heads, key_dim, value_dim))


@pytest.mark.parametrize("packed, mapped", [(False, "all"), (True, "all"), (False, "g_gamma_and_gates"),
                                            (True, "q_k_v")])
def test_recurrent(rng, packed, mapped):
    """Mapped: every input; only q, k, v (the rest broadcast to the batch); or only the per-head
    g_gamma (no batch axis: added to g) and the other gates."""
    cu = CU if packed else None
    inputs = recurrent_inputs(rng, 3, 1 if packed else 2, 20, 3 if packed else 2)
    names = list(inputs)
    mapped_names = {"all": names, "q_k_v": ["query", "key", "value"],
                    "g_gamma_and_gates": ["g_gamma", "gk", "gv"]}[mapped]
    args = [x if name in mapped_names else x[0] for name, x in inputs.items()]
    in_axes = [0 if name in mapped_names else None for name in names]

    def run(fn):
        def f(*arrays):
            o, state = fn(**dict(zip(names, arrays)), reverse=packed, cu_seqlens=cu)
            return jnp.concatenate([o.ravel(), state.ravel()])
        return f
    check(rng, run(functools.partial(recurrent, impl="triton")), run(rec.reference), args, in_axes=in_axes)


def test_recurrent_mapped_cu_seqlens(rng):
    cus = jnp.asarray([[0, 7, 7, 18], [0, 1, 10, 20]], jnp.int32)
    inputs = recurrent_inputs(rng, 2, 1, 20, 3)

    def fn(cu, **arrays):
        o, state = recurrent(**arrays, cu_seqlens=cu, impl="triton")
        return jnp.sum(o ** 2) + jnp.sum(state)

    value, grads = jax.vmap(jax.value_and_grad(lambda a, c: fn(c, **a)))(inputs, cus)
    with jax.enable_x64(True):
        for i in range(2):
            element = {name: to64(x[i]) for name, x in inputs.items()}

            def ref(a, i=i):
                o, state = rec.reference(**a, cu_seqlens=np.asarray(cus[i]))
                return jnp.sum(o ** 2) + jnp.sum(state)
            ref_value, ref_grads = jax.value_and_grad(ref)(element)
            assert abs(float(value[i]) - float(ref_value)) <= TOL * abs(float(ref_value))
            for name in inputs:
                assert rel_err(grads[name][i], ref_grads[name]) < TOL, name


# ----------------------------------------------------------------------------------------------
# The folding rule itself.
# ----------------------------------------------------------------------------------------------


def test_vmap_by_folding_broadcasts_unmapped_rows_and_keeps_stand_ins(rng):
    calls = []

    def rows(x, y, shared):  # rows of x and y (axis 0 of x, axis 1 of y) are independent
        calls.append((x.shape, y.shape))
        return x * y.sum(0)[:, None] + shared, jnp.ones((1,))

    fn = vmap_by_folding(rows, in_axes=(0, 1, None), out_axes=(0, None))
    x, y, shared = normal(rng, 4, 3, 2), normal(rng, 5, 3), normal(rng, 2)
    out, stand_in = jax.vmap(fn, in_axes=(0, None, None))(x, y, shared)
    expected = np.stack([np.asarray(x[i]) * np.asarray(y).sum(0)[:, None] + np.asarray(shared) for i in range(4)])
    assert rel_err(out, expected) < TOL and stand_in.shape == (4, 1)  # vmap broadcasts it
    assert calls[-1] == ((12, 2), (5, 12))  # folded: one call, y broadcast to the 4 elements
    del calls[:]
    mapped_shared = jax.vmap(fn, in_axes=(None, None, 0))
    out = mapped_shared(x[0], y, jnp.stack([shared, 2 * shared]))
    assert rel_err(out[0][1], expected[0] + np.asarray(shared)) < TOL
    # A mapped argument with no row axis: one element at a time, in a loop.
    assert all(call == ((3, 2), (5, 3)) for call in calls)
    assert "scan" in str(jax.make_jaxpr(mapped_shared)(x[0], y, jnp.stack([shared, 2 * shared])))
