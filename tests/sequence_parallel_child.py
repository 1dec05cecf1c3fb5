"""Run by ``test_sequence_parallel.py`` in a child process whose JAX sees four CPU devices.

``--xla_force_host_platform_device_count`` must be set before JAX starts, so these cases cannot
run in the pytest process (whose JAX has long started with one device)::

    XLA_FLAGS=--xla_force_host_platform_device_count=4 python sequence_parallel_child.py GROUP

``GROUP`` is ``attention``, ``zigzag``, ``balance``, ``recurrent``, ``packed``, ``chunked`` or
``errors``.
Every case runs the op under ``jax.shard_map`` on a mesh of 1, 2 and 4 shards and prints, per
mesh, one JSON line: the relative errors of the output and of every gradient against the float64
reference on the whole sequence (``"reference"``) and against the same op on one device
(``"one_device"``). ``balance`` prints the tiles each shard visits; an error case prints the
exception's type and message. The parent asserts.
"""

import functools
import importlib
import inspect
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import ejk_lite  # noqa: F401  (settles TRITON_INTERPRET before the kernels are defined)
from ejk_lite import (BlockSizes, blocksparse_attention, chunked_recurrent, make_block_mask,
                      recurrent)
from ejk_lite import sequence_parallel as sp
from ejk_lite.attention import reference as attention_reference

# recurrent's module (the package's name for it may change; the function says where it lives)
recurrent_reference = importlib.import_module(recurrent.__module__).reference

# 1, 2 and 4 shards on the CPU mesh; on one GPU (the GPU check) the one-shard path.
SHARDS = tuple(n for n in (1, 2, 4) if n <= len(jax.devices()))
# The kernels, where the op also has an XLA implementation (which "auto" picks on a CPU).
RECURRENT = (functools.partial(recurrent, impl="triton")
             if "impl" in inspect.signature(recurrent).parameters else recurrent)
# chunked_recurrent's kernels, in the smallest chunks: slices of one, two or three chunks.
CHUNKED = functools.partial(chunked_recurrent, chunk_size=16, impl="triton")
BLOCKS = BlockSizes(16, 16)  # the smallest tl.dot tile: several tiles per shard
rng = np.random.default_rng(20260)


def mesh(n):
    return jax.make_mesh((n,), ("sp",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=jax.devices()[:n])


def rel_err(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    if out.shape != ref.shape:
        return f"shape {out.shape} != {ref.shape}"
    if not np.all(np.isfinite(out)):
        return float("inf")
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def compare(case, sharded, one_device, reference, arrays):
    """Output and gradients (of every array argument, by ``jax.vjp`` with one random cotangent)
    of ``sharded(n)`` (the op over ``n`` shards) for every ``n`` in ``SHARDS``, against
    ``one_device`` (float32) and ``reference`` (float64), each computed once."""
    one_out, one_vjp = jax.vjp(jax.jit(one_device), *arrays)
    cotangent = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype), one_out)
    one_grads = jax.jit(one_vjp)(cotangent)
    with jax.enable_x64(True):
        arrays64 = [jnp.asarray(np.asarray(a), jnp.float64) for a in arrays]
        ref_out, ref_vjp = jax.vjp(jax.jit(reference), *arrays64)
        ref_grads = jax.jit(ref_vjp)(jax.tree.map(
            lambda c: jnp.asarray(np.asarray(c), jnp.float64), cotangent))
    for n in SHARDS:
        out, vjp = jax.vjp(jax.jit(sharded(n)), *arrays)
        grads = jax.jit(vjp)(cotangent)
        results = {"reference": {}, "one_device": {}}
        for name, got, one, ref in [("output", out, one_out, ref_out),
                                    *((f"d{i}", g, o, r) for i, (g, o, r)
                                      in enumerate(zip(grads, one_grads, ref_grads)))]:
            for k, (a, b, c) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(one),
                                              jax.tree.leaves(ref))):
                key = name if k == 0 else f"{name}.{k}"
                results["reference"][key] = rel_err(a, c)
                results["one_device"][key] = rel_err(a, b)
        print(json.dumps({"case": case, "shards": n, "dtype": jnp.dtype(arrays[0].dtype).name,
                          **results}), flush=True)


# ----------------------------------------------------------------------------------------------
# Attention.
# ----------------------------------------------------------------------------------------------

B, HQ, HKV, T, D = 2, 2, 1, 48, 16  # 48 tokens: 12 per shard of 4, not a multiple of the tile


def attention_inputs(t=T, dtype=jnp.float32, s=None):
    def normal(*shape):
        return jnp.asarray(rng.normal(size=shape), dtype)
    s = t if s is None else s
    return [normal(B, HQ, t, D), normal(B, HKV, s, D), normal(B, HKV, s, D)]


def documents(t):
    """Segment ids [B, t]: documents of several lengths, crossing shard boundaries, different per
    row (one row a single document)."""
    lengths = [[5, 14, 1, 20, t - 40], [t]]
    return jnp.asarray(np.stack([np.repeat(np.arange(len(row)), row) for row in lengths]),
                       jnp.int32)


ATTENTION_CASES = {
    "causal": dict(),
    "window_both_sides": dict(causal=False, sliding_window=(5, 9)),
    "documents": dict(segments=True),
    "documents_causal_window_sinks": dict(segments=True, sliding_window=(6, 0), sinks=True),
    "bias_sliced_along_queries": dict(bias=True),
    "documents_bfloat16": dict(segments=True, dtype=jnp.bfloat16),
    # 48 queries against 32 keys (8 per shard of 4), causal on the default positions
    "cross_attention_causal": dict(kv_len=32),
}


def run_attention_case(name, spec, zigzag=False):
    """The op sharded over 1, 2 and 4 shards against the whole-sequence op. ``zigzag``: the tokens
    in the zigzag layout (permuted before sharding, positions passed), the output put back in
    order. Sinks are one array every shard shares; a bias ``[B, Hq, T, S]`` is sliced along the
    queries (its key axis is the whole sequence)."""
    options = dict(spec)
    segments, dtype = options.pop("segments", False), options.pop("dtype", jnp.float32)
    kv_len = options.pop("kv_len", T)
    extras = {}  # differentiable arguments after q, k, v: name -> (array, in_spec)
    if options.pop("sinks", False):
        extras["softmax_aux"] = (jnp.asarray(rng.normal(size=HQ), dtype), P())
    if options.pop("bias", False):
        extras["bias"] = (jnp.asarray(rng.normal(size=(B, HQ, T, T)), dtype),
                          P(None, None, "sp", None))
    arrays = attention_inputs(dtype=dtype, s=kv_len) + [x for x, _ in extras.values()]
    seg = documents(T) if segments else None

    def whole(fn, q, k, v, *more):
        kw = dict(options, **dict(zip(extras, more)))
        if seg is not None:
            kw.update(q_segment_ids=seg, kv_segment_ids=seg)
        return fn(q, k, v, **kw)

    def sharded(n, q, k, v, *more):
        # The layout: tokens permuted (zigzag) or not, then sliced contiguously by shard_map.
        def layout(x, axis):
            return sp.zigzag(x, n, axis) if zigzag else x
        ids = [] if seg is None else [layout(seg, 1)]
        ids += [jnp.asarray(sp.zigzag_indices(T, n))[None]] if zigzag else []

        def local(q, k, v, *rest):
            rest = list(rest)
            kw = dict(options, **{name: rest.pop(0) for name in extras})
            if seg is not None:
                s = rest.pop(0)
                kw.update(q_segment_ids=s, kv_segment_ids=s)
            if zigzag:
                p = rest.pop(0)
                kw.update(q_positions=p, kv_positions=p)
            return blocksparse_attention(q, k, v, fwd_blocks=BLOCKS, bwd_blocks=BLOCKS,
                                         sequence_parallelism_mesh_axis_name="sp", **kw)

        seq = P(None, None, "sp")
        in_specs = (seq,) * 3 + tuple(spec for _, spec in extras.values()) \
            + (P(None, "sp"),) * len(ids)
        f = jax.shard_map(local, mesh=mesh(n), in_specs=in_specs, out_specs=seq)
        out = f(layout(q, 2), layout(k, 2), layout(v, 2), *more, *ids)
        return sp.unzigzag(out, n, 2) if zigzag else out

    one = functools.partial(whole, functools.partial(blocksparse_attention, fwd_blocks=BLOCKS,
                                                     bwd_blocks=BLOCKS))
    compare(name, lambda n: functools.partial(sharded, n), one,
            functools.partial(whole, attention_reference), arrays)


def group_attention():
    for name, spec in ATTENTION_CASES.items():
        run_attention_case(name, spec)


def group_zigzag():
    for name in ("causal", "documents"):
        run_attention_case(f"zigzag_{name}", ATTENTION_CASES[name], zigzag=True)


def group_balance():
    # The balance itself: tiles each shard's queries visit under a causal mask (its work), from
    # the block mask the kernel would use, contiguous slices against the zigzag layout.
    t, n, block = 256, 4, 16
    for layout, order in (("contiguous", np.arange(t)), ("zigzag", sp.zigzag_indices(t, n))):
        tiles = []
        for i in range(n):
            q_pos = jnp.asarray(order[i * t // n:(i + 1) * t // n])[None]
            mask = make_block_mask(t // n, t, q_block=block, kv_block=block, causal=True,
                                   q_positions=q_pos, kv_positions=jnp.asarray(order)[None])
            tiles.append(int(np.sum(np.asarray(mask.kinds) != 0)))
        print(json.dumps({"case": f"balance_{layout}", "tiles": tiles}), flush=True)


# ----------------------------------------------------------------------------------------------
# Linear attention.
# ----------------------------------------------------------------------------------------------

RB, RH, RHKV, RK, RV = 2, 2, 1, 5, 6


def recurrent_inputs(batch, t, gates, with_state, num_states=None, gate_scale=1.0,
                     dtype=jnp.float32):
    def normal(*shape):
        return rng.normal(size=shape)

    def log_gate(*shape):  # log(sigmoid(x)): decays in (0, 1)
        return -np.logaddexp(0.0, -gate_scale * normal(*shape))

    arrays = dict(query=normal(batch, t, RH, RK), key=normal(batch, t, RHKV, RK),
                  value=normal(batch, t, RHKV, RV))
    shapes = dict(g=(batch, t, RH), g_gamma=(RH,), gk=(batch, t, RH, RK), gv=(batch, t, RH, RV))
    for gate in gates:
        arrays[gate] = log_gate(*shapes[gate])
    if with_state:
        arrays["initial_state"] = normal(num_states or batch, RH, RK, RV)
    return {k: jnp.asarray(x, dtype) for k, x in arrays.items()}


def run_recurrent_case(name, arrays, cu_seqlens=None, reverse=False, reference=None, op=None):
    """``op`` (``RECURRENT`` by default) over 1, 2 and 4 shards against it on one device and the
    float64 reference."""
    op = op or RECURRENT
    names = list(arrays)
    sequence_axis = {"query", "key", "value", "g", "gk", "gv"}
    specs = tuple(P(None, "sp") if k in sequence_axis else P() for k in names)

    def call(fn, *xs, **kw):
        return fn(**dict(zip(names, xs)), reverse=reverse, cu_seqlens=cu_seqlens, **kw)

    def sharded(n):
        local = functools.partial(call, functools.partial(sp.linear_attention, op),
                                  sequence_parallelism_mesh_axis_name="sp")
        return jax.shard_map(local, mesh=mesh(n), in_specs=specs, out_specs=(P(None, "sp"), P()))

    compare(name, sharded, functools.partial(call, op),
            functools.partial(call, reference or recurrent_reference), [arrays[k] for k in names])


GATES = {"g": ("g",), "g_gamma": ("g_gamma",), "gk": ("gk",), "gv": ("gv",),
         "all": ("g", "g_gamma", "gk", "gv")}


def group_recurrent():
    t = 16  # 4 tokens per shard of 4
    for gate, gates in GATES.items():
        # gv without an initial state: the first shard's state starts at zero.
        run_recurrent_case(gate, recurrent_inputs(RB, t, gates, with_state=gate != "gv"))
    run_recurrent_case("all_reverse", recurrent_inputs(RB, t, GATES["all"], with_state=True),
                       reverse=True)
    run_recurrent_case("all_bfloat16", recurrent_inputs(RB, t, GATES["all"], with_state=True,
                                                        dtype=jnp.bfloat16))
    # The plain-JAX scan (an op's impl="xla") through the same exchange, no initial state.
    run_recurrent_case("all_scan", recurrent_inputs(RB, t, GATES["all"], with_state=False),
                       op=recurrent_reference)


def group_packed():
    t = 24  # 6 tokens per shard of 4, 12 per shard of 2
    # Sequences: [0, 5), an empty one, [5, 13) across two boundaries (of 4 shards: tokens 5 |
    # 6-11 | 12, one whole shard in between), [13, 18) ending on a boundary, [18, 21), and three
    # tokens of padding that belong to none.
    cu = np.array([0, 5, 5, 13, 18, 21], np.int32)
    for gate, gates, reverse in (("none", (), False), ("all", GATES["all"], False),
                                 ("all", GATES["all"], True)):
        arrays = recurrent_inputs(1, t, gates, with_state=True, num_states=len(cu) - 1)
        run_recurrent_case(f"packed_{gate}{'_reverse' if reverse else ''}", arrays,
                           cu_seqlens=cu, reverse=reverse)
    # One sequence over every shard, ending before the last token; no initial state.
    run_recurrent_case("packed_one_long", recurrent_inputs(1, t, ("g", "gv"), with_state=False),
                       cu_seqlens=np.array([0, 22], np.int32))
    run_recurrent_case("packed_all_reverse_scan", recurrent_inputs(1, t, GATES["all"],
                                                                   with_state=False),
                       cu_seqlens=cu, reverse=True, op=recurrent_reference)
    # Sequences without tokens, and no sequence at all: every token is padding, its output zero
    # (the reference's scan cannot index a state of no sequence: zeros are the definition).
    run_recurrent_case("packed_empty_sequences", recurrent_inputs(1, t, ("g",), with_state=True,
                                                                  num_states=2),
                       cu_seqlens=np.array([0, 0, 0], np.int32))

    def no_sequence(query, value, **_):
        return (jnp.zeros((*query.shape[:3], value.shape[-1]), query.dtype),
                jnp.zeros((0, RH, RK, RV), jnp.promote_types(query.dtype, jnp.float32)))

    run_recurrent_case("packed_no_sequence", recurrent_inputs(1, t, ("g",), with_state=False),
                       cu_seqlens=np.array([0], np.int32), reference=no_sequence)


def group_chunked():
    """``chunked_recurrent`` through the same exchange: its own kernels on each slice, which the
    chunks do not divide (a shard's last chunk is short, and of 4 shards every chunk is)."""
    t = 40  # 10 tokens per shard of 4; 20 per shard of 2 (a chunk of 16 and a short one)
    gates = ("g", "g_gamma", "gk")  # every gate it takes (gv does not factor into chunks)
    run_recurrent_case("chunked_g", recurrent_inputs(RB, t, ("g",), with_state=True),
                       op=CHUNKED)
    run_recurrent_case("chunked_all_reverse", recurrent_inputs(RB, t, gates, with_state=True),
                       reverse=True, op=CHUNKED)
    # Sequences: [0, 3), an empty one, [3, 30) across the boundaries at 10 and 20 (of 4 shards:
    # one whole shard in between; of 2: across the chunk boundary at 16 too) and ending on the
    # one at 30, [30, 34) starting on it, [34, 38), and two tokens of padding.
    cu = np.array([0, 3, 3, 30, 34, 38], np.int32)
    for reverse in (False, True):
        arrays = recurrent_inputs(1, t, gates, with_state=True, num_states=len(cu) - 1)
        run_recurrent_case(f"chunked_packed_all{'_reverse' if reverse else ''}", arrays,
                           cu_seqlens=cu, reverse=reverse, op=CHUNKED)


# ----------------------------------------------------------------------------------------------
# Bad arguments.
# ----------------------------------------------------------------------------------------------


def raises(case, thunk):
    try:
        thunk()
    except Exception as error:  # the parent checks the type and the message
        print(json.dumps({"case": case, "raised": type(error).__name__,
                          "message": str(error)}), flush=True)
    else:
        print(json.dumps({"case": case, "raised": None}), flush=True)


def group_errors():
    q, k, v = attention_inputs(t=16)
    seq = P(None, None, "sp")

    def attn(axis_name, check_vma=True, **kw):
        local = functools.partial(blocksparse_attention, fwd_blocks=BLOCKS, bwd_blocks=BLOCKS,
                                  sequence_parallelism_mesh_axis_name=axis_name, **kw)
        return jax.shard_map(local, mesh=mesh(min(2, SHARDS[-1])), in_specs=(seq,) * 3,
                             out_specs=seq,
                             check_vma=check_vma)(q, k, v)

    raises("attention_unbound_axis", lambda: attn("nope"))
    raises("attention_axis_not_a_str", lambda: attn(0))
    raises("attention_outside_shard_map", lambda: blocksparse_attention(
        q, k, v, sequence_parallelism_mesh_axis_name="sp"))
    raises("attention_check_vma_off", lambda: attn("sp", check_vma=False))
    raises("attention_layout", lambda: attn("sp", qkv_layouts=np.ones((1, 1), bool),
                                            chunk_size=16))
    raises("attention_positions_not_a_slice", lambda: attn(
        "sp", q_positions=jnp.arange(17)[None], kv_positions=jnp.arange(17)[None]))
    odd = 2 * SHARDS[-1] + 1  # a length no mesh of more than one shard divides
    if SHARDS[-1] > 1:
        raises("attention_seq_len_does_not_divide", lambda: jax.shard_map(
            lambda q, k, v: blocksparse_attention(q, k, v,
                                                  sequence_parallelism_mesh_axis_name="sp"),
            mesh=mesh(SHARDS[-1]), in_specs=(seq,) * 3, out_specs=seq)(
                q[:, :, :odd], k[:, :, :odd], v[:, :, :odd]))
    raises("zigzag_seq_len_does_not_divide", lambda: sp.zigzag_indices(12, 4))

    arrays = recurrent_inputs(1, 8, ("g",), with_state=False)

    def rec(axis_name="sp", cu=None, n=min(2, SHARDS[-1]), xs=arrays):
        local = functools.partial(recurrent, sequence_parallelism_mesh_axis_name=axis_name,
                                  cu_seqlens=cu)
        return jax.shard_map(local, mesh=mesh(n), in_specs=(P(None, "sp"),) * len(xs),
                             out_specs=(P(None, "sp"), P()))(*xs.values())

    raises("recurrent_unbound_axis", lambda: rec("nope"))
    raises("recurrent_axis_not_a_str", lambda: rec(("sp",)))
    raises("recurrent_cu_seqlens_past_the_end", lambda: rec(cu=np.array([0, 3, 9], np.int32)))
    raises("recurrent_cu_seqlens_batch", lambda: rec(cu=np.array([0, 3, 8], np.int32),
                                                     xs=recurrent_inputs(2, 8, (), False)))
    if SHARDS[-1] > 1:
        raises("recurrent_seq_len_does_not_divide", lambda: rec(n=SHARDS[-1], xs=recurrent_inputs(
            1, odd, (), False)))

    def chunked(axis_name="sp", xs=arrays, **kw):
        def local(*values):  # by name: gv is not the fourth argument
            return CHUNKED(**dict(zip(xs, values)), sequence_parallelism_mesh_axis_name=axis_name,
                           **kw)
        return jax.shard_map(local, mesh=mesh(min(2, SHARDS[-1])),
                             in_specs=(P(None, "sp"),) * len(xs),
                             out_specs=(P(None, "sp"), P()))(*xs.values())

    raises("chunked_unbound_axis", lambda: chunked("nope"))
    raises("chunked_gv", lambda: chunked(xs=recurrent_inputs(1, 8, ("gv",), False)))
    raises("chunked_chunk_size", lambda: chunked(chunk_size=8))


if __name__ == "__main__":
    globals()[f"group_{sys.argv[1]}"]()
