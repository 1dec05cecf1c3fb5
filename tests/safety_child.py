"""Run by ``test_safety.py`` in a child process: one op on garbage ``cu_seqlens``.

A kernel that reads or writes outside its arrays raises nothing: it corrupts memory, and the
process dies (SIGSEGV or "double free or corruption" in Triton's interpreter, an illegal address
on a GPU), sometimes only at exit. So every case runs here, away from pytest, and the parent
checks the exit status and what was printed::

    python safety_child.py OP LAYER

``OP`` is ``local``, ``global``, ``mean``, ``blocks``, ``recurrent`` or ``chunked``. ``LAYER`` is

* ``public``: the op as a user calls it, with ``cu_seqlens`` traced under ``jax.jit`` (its values
  unknown, so unchecked), forward and gradient. The answer must be the float64 reference's on the
  packing :func:`ejk_lite.packing.sanitize_cu_seqlens` makes of the garbage: prints, per garbage
  kind, one JSON line of relative errors;
* ``kernels``: the launches themselves with the sanitization bypassed, garbage ``cu_seqlens`` (and
  garbage block lists) straight into the kernels: only their own clamps keep them in bounds.
  Prints one JSON line per kind that survived.

Each kind's name is printed before it runs, so a crash names the case that caused it.
"""

import importlib
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np

import ejk_lite  # noqa: F401  (settles TRITON_INTERPRET before the kernels are defined)
from ejk_lite import (block_mean_pooling, chunk_global_cumsum, chunk_local_cumsum, chunked_recurrent, mean_pooling,
                      recurrent)
from ejk_lite.packing import sanitize_cu_seqlens

cumsum = importlib.import_module("ejk_lite.cumsum")
pooling = importlib.import_module("ejk_lite.pooling")
rec = importlib.import_module("ejk_lite.linear_attention")
chk = importlib.import_module("ejk_lite.chunked")

T = 12  # tokens
INT_MIN, INT_MAX = -2**31, 2**31 - 1
# Four offsets (three sequences) each: one compile serves every int32 kind.
GARBAGE = {
    "negative": np.array([0, -5, 7, 12], np.int32),
    "int_min": np.array([0, INT_MIN, 5, 12], np.int32),
    "int_max": np.array([0, INT_MAX, 3, 12], np.int32),
    "decreasing": np.array([0, 9, 3, 12], np.int32),
    "not_from_zero": np.array([5, 2, 8, 8], np.int32),
    "beyond_the_end": np.array([0, 5, 2**20, INT_MAX], np.int32),
    "uint32_wraps_negative": np.array([0, 2**32 - 3, 4, 12], np.uint32),
}
# Rows of (sequence, chunk) for the block kernels: out of range both ways.
GARBAGE_BLOCKS = np.array([[0, 0], [INT_MAX, 5], [INT_MIN, -7], [5, -1], [1, 2**30], [2, INT_MIN], [-1, -1]],
                          np.int32)


def rel_err(out, ref):
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    if not np.all(np.isfinite(out)):
        return float("inf")
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


def public(op, rng):
    """``(fn(x, cu), reference(x64, concrete valid cu), x)`` for the op, on fresh random data."""
    if op in ("local", "global"):
        x = rng.standard_normal((1, T, 3))
        if op == "local":
            return (lambda a, cu: chunk_local_cumsum(a, 4, reverse=True, cu_seqlens=cu, impl="triton"),
                    lambda a, cu: cumsum.reference_local_cumsum(a, 4, reverse=True, cu_seqlens=cu), x)
        return (lambda a, cu: chunk_global_cumsum(a, cu_seqlens=cu, impl="triton"),
                lambda a, cu: cumsum.reference_global_cumsum(a, cu_seqlens=cu), x)
    if op == "mean":
        return (lambda a, cu: mean_pooling(a, 4, cu, impl="triton"), pooling.reference,
                rng.standard_normal((T, 5)))
    if op == "blocks":
        blocks = 8  # at least the blocks of any packing of 12 tokens into 3 sequences: the rest are 0

        def reference(a, cu):
            ref = pooling.reference_blocks(a, 4, cu)
            return jnp.concatenate([ref, jnp.zeros((blocks - ref.shape[0], *ref.shape[1:]), ref.dtype)])
        return (lambda a, cu: block_mean_pooling(a, 4, cu, total_blocks=blocks, impl="triton"), reference,
                rng.standard_normal((T, 5)))

    # recurrent and chunked: q, k, v and a decay g, all cut from one array so that one gradient
    # covers them (chunked: a per-key decay gk as well).
    def split(a):
        q, k, v = a[..., 0:3], a[..., 3:6], a[..., 6:8]
        if op == "chunked":
            return q, k, v, -jnp.abs(a[..., 8]), -jnp.abs(a[..., 9:12])
        return q, k, v, -jnp.abs(a[..., 8])

    def run(fn):
        def f(a, cu):
            o, state = fn(*split(a), cu_seqlens=cu)
            return jnp.concatenate([o.ravel(), state.ravel()])
        return f
    if op == "chunked":
        return (run(lambda q, k, v, g, gk, **kw: chunked_recurrent(q, k, v, g=g, gk=gk, chunk_size=16, impl="triton", **kw)),
                run(lambda q, k, v, g, gk, **kw: rec.reference(q, k, v, g=g, gk=gk, **kw)),
                rng.standard_normal((1, T, 2, 12)))
    return run(lambda *a, **kw: recurrent(*a, **kw, impl="triton")), \
        run(lambda q, k, v, g, **kw: rec.reference(q, k, v, g=g, **kw)), \
        rng.standard_normal((1, T, 2, 9))


def run_public(op):
    rng = np.random.default_rng(sum(map(ord, op)))
    fn, reference, x = public(op, rng)
    shape = jax.eval_shape(fn, jnp.asarray(x, jnp.float32), jnp.asarray(GARBAGE["decreasing"])).shape
    weights = jnp.asarray(rng.standard_normal(shape), jnp.float32)
    forward = jax.jit(fn)
    gradient = jax.jit(jax.grad(lambda a, cu: jnp.sum(weights * fn(a, cu))))
    # The pooling references are Python loops over the offsets, which must be concrete; the
    # others take them traced, and compile once for every kind.
    if op not in ("mean", "blocks"):
        reference = jax.jit(reference)
    for kind, cu in GARBAGE.items():
        print(kind, flush=True)
        xf = jnp.asarray(x, jnp.float32)
        out, grad = forward(xf, jnp.asarray(cu)), gradient(xf, jnp.asarray(cu))
        valid = np.asarray(sanitize_cu_seqlens(jnp.asarray(cu), T))
        with jax.enable_x64(True):
            x64, w64 = jnp.asarray(np.asarray(xf), jnp.float64), jnp.asarray(np.asarray(weights), jnp.float64)
            ref = np.asarray(reference(x64, valid))
            ref_grad = np.asarray(jax.grad(lambda a: jnp.sum(w64 * reference(a, valid)))(x64))
        print(json.dumps({"kind": kind, "valid": valid.tolist(), "output": rel_err(out, ref),
                          "gradient": rel_err(grad, ref_grad)}), flush=True)


def run_kernels(op):
    """The launches on garbage, traced under ``jax.jit`` (eagerly, the launch code would refuse
    concrete garbage before any kernel saw it)."""
    rng = np.random.default_rng(0)
    f32 = jnp.float32
    if op in ("local", "global"):
        x = jnp.asarray(rng.standard_normal((1, T, 3)), f32)

        # The global sum of a small input takes two passes (config None); a pinned config takes
        # the single pass, here with its walks split over three programs each, and with the next
        # block loaded ahead (prefetch: its tokens past the segment must not be read).
        configs = [None] if op == "local" else [None, cumsum.CumsumConfig(block_t=4, block_c=4,
                                                                        split=3),
                                                cumsum.CumsumConfig(block_t=4, block_c=4, num_stages=1,
                                                                    prefetch=True)]

        def launches(x, cu):
            return [cumsum._launch(x, cu, 4 if op == "local" else None, reverse, 1.0, False, f32,
                                   config)
                    for reverse in (False, True) for config in configs]
    elif op in ("mean", "blocks"):
        x = jnp.asarray(rng.standard_normal((2, T, 5)), f32)  # two rows, as vmap folds them
        plan = pooling._plan(4, T, 5, 3, None, pooling.PoolingConfig(fwd_tile_tokens=4, bwd_tile_tokens=4))
        block_plan = pooling._BlockPlan(4, 16, 1, 2, 8, plan)

        def launches(x, cu):
            if op == "mean":
                out, vjp = jax.vjp(lambda a: pooling._mean_pool_triton(a, cu, plan), x)
            else:
                blocks = jnp.asarray(GARBAGE_BLOCKS)
                out, vjp = jax.vjp(lambda a: pooling._block_pool_triton(a, cu, blocks, block_plan), x)
            return out, vjp(out)
    elif op == "chunked":
        x = jnp.asarray(rng.standard_normal((2, T, 2, 3)), f32)  # two rows, as vmap folds them

        def launches(q, cu):  # forward and backward launches, without _chunked_jit's sanitization
            results = []
            # chunk 32: two 16-token sub-chunks, so the per-key kernels' blocks between
            # sub-chunks and their programs for a second sub-chunk run on garbage too
            for reverse, chunk in ((False, 16), (True, 16), (False, 32), (True, 32)):
                static = chk._Static(scale=0.5, chunk_size=chunk, reverse=reverse, config=chk.ChunkedConfig())
                for a in (-jnp.abs(q[..., 0]), -jnp.abs(q)):  # a scalar gate, a per-key gate
                    # (with gk: the decayed q, k and Gamma the backward takes; else stand-ins)
                    o, state, A, *decayed = chk._forward_launch(static, q, q, q, a, None, cu)
                    results.append(chk._backward_launch(static, q, q, q, a, None, cu, A, o, state, *decayed))
            return results
    else:
        x = jnp.asarray(rng.standard_normal((2, T, 2, 3)), f32)  # two rows, as vmap folds them
        config = rec.RecurrentConfig()

        def launches(q, cu):  # the forward and backward launches, without _recurrent_jit's sanitization
            args = (q, q, q, -jnp.abs(q[..., 0]), None, None, None, None, cu)
            results = []
            for reverse in (False, True):
                o_parts, state = rec._forward_launch(0.5, reverse, config, *args)
                results.append(rec._backward_launch(0.5, reverse, config, *args, o_parts[0].reshape(q.shape),
                                                    state))
            return results
    launches = jax.jit(launches)
    for kind, cu in GARBAGE.items():
        print(kind, flush=True)
        jax.block_until_ready(launches(x, jnp.asarray(cu).astype(jnp.int32)))  # a wrapping cast
        print(json.dumps({"kind": kind, "survived": True}), flush=True)


if __name__ == "__main__":
    operation, layer = sys.argv[1:3]
    (run_public if layer == "public" else run_kernels)(operation)
