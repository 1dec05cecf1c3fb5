"""Benchmark ejk_lite.blocksparse_attention: the race against cuDNN, FlexAttention, Pallas and XLA.

bf16, forward and forward + backward (gradients of q, k, v for a random output cotangent), on

* masks: ``causal``; ``window`` = causal + sliding window 1024 (``left 1024, right 0``: query ``i``
  sees keys ``i - 1024 .. i``); ``documents`` = 8 packed documents of random lengths per batch row
  (fixed seed) + causal;
* shapes: B4 Hq16 Hkv16 T8192 D128, B4 Hq16 Hkv4 T8192 D128 (grouped heads), B1 Hq16 Hkv16 T32768 D128.

Peers, each at its strongest, in the same process on the same inputs:

* ``cudnn``: ``jax.nn.dot_product_attention(implementation="cudnn")`` on [B, T, H, D] (transposed
  outside the timed region): ``is_causal=True``, the window as ``local_window_size=(1024, 0)``. The
  public API has no segment ids; documents go through cuDNN's packed (ragged) layout, the internal
  ``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention`` with per-document lengths and
  offsets (``cudnn_packed``), or, if that cannot run, the public API with a dense boolean mask
  (``cudnn_mask``);
* ``flex``: PyTorch ``torch.compile(flex_attention)`` with ``create_block_mask`` (128 x 128 blocks,
  ``_compile=True``) for the same mask, ``enable_gqa`` for grouped heads;
* ``pallas_mha``: ``jax.experimental.pallas.ops.gpu.attention.mha`` on [B, T, H, D], causal, and
  documents through its ``segment_ids`` (no window; grouped heads: K/V repeated inside the timed
  function); the backward's block sizes are the faster of the default (32) and 64;
* ``xla_sdpa`` (``jax.nn.dot_product_attention(implementation="xla")``) and ``xla_einsum`` (a plain
  einsum-softmax-einsum in [B, H, T, D] with the mask computed from iotas and segment ids), where
  the B x H x T x S float32 logits fit (not at T=32768: 64 GiB).

Work, two counts (both in the JSON, the same count for every implementation of a case):

* ``tflops`` (FlexAttention's convention): visited (q-block, kv-block) pairs of the mask at 128 x 128
  blocks, summed over batch rows and query heads, x 128 x 128 x 4 x D (two matmuls, 2 flops a
  multiply-add); forward + backward = 3.5 x forward (FlashAttention's convention: backward = 2.5 x);
* ``tflops_dense_equiv``: visible (query, key) token pairs x 4 x D (x 3.5): the work a kernel that
  skipped every masked pair would do. Its ratio to ``tflops`` is the useful share of the visited tiles.

Checks (the script exits non-zero, after writing the JSON, if any fails): ours against the float32
dense reference (``ejk_lite.attention.reference``, highest matmul precision, from the same bf16
inputs) on a slice: the first ``max(2, G)`` query heads (one whole group) and the first and last
512 queries (positions passed explicitly); gradients with the cotangent restricted to that slice,
so that ours (at the timed shape, the timed function) and the reference compute the same dq, dk, dv.
Every peer against ours on the full output and full gradients. Relative L2 errors, float32, on
the device.

The masks ours is given are built once per case (as FlexAttention's are) with ``make_block_mask``
at ours' forward block sizes, from arrays passed to ``jit``: the segment ids, or ``arange``
positions for causal and window (a mask built from constants alone would be folded by XLA at
compile time, slowly, and never timed); ``causal=False`` in the call, as the mask carries its rule.

Also recorded: ``make_block_mask`` time under ``jit`` for every race mask and for documents +
causal + window 1024 at B=8, T=S=32768, 128 x 128 (``mask_build``), FlexAttention's
``create_block_mask`` time for its masks, and ``window_sweep``: ours' forward at B4 H16 T8192 for
windows 512 ... 4096 and causal, against the number of visited blocks (time should follow them).

Timing: device time from the profiler (``common.device_samples_ms``), >= 10 samples, each after an
L2 flush; min / median / max per figure (``common.time_stats_ms``); compilation and autotuning happen before. Progress lines carry the
elapsed time; the JSON is rewritten after every case, so a run cut short keeps what it measured.

    python bench/attention.py --out bench/results                  # GPU (~6 min on an H100)
    python bench/attention.py --out bench/results --shapes 2 --merge   # one shape, merged into the JSON
    python bench/attention.py --quick --out /tmp/bench_attention    # tiny shapes, CPU interpreter
"""

from __future__ import annotations

import os
import sys

# JAX takes 75 % of the GPU by default; the XLA peers need more, torch (FlexAttention) needs ~4 GiB.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.85")
if "--quick" in sys.argv[1:]:
    # --quick is for CPUs, where XLA's LLVM optimisation of make_block_mask takes 30-100 s a compile
    # (level 0: 2-4 s); the code it makes only has to be right, not fast.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

import dataclasses  # noqa: E402
import functools  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any, Callable  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import ejk_lite  # noqa: E402

if ejk_lite.ON_GPU and hasattr(ejk_lite.launch, "_import_jax_triton"):
    # jax-triton first (through ejk_lite), as bench/recurrent.py does before torch's Triton kernels.
    ejk_lite.launch._import_jax_triton()
from common import (  # noqa: E402
    ceilings,
    device_samples_ms,
    matmul_tflops,
    parse_args,
    print_table,
    row,
    spread,
    time_stats_ms,
    wall_ms,
    write_result,
)
from ejk_lite.attention import BlockSizes, reference  # noqa: E402

OP = "attention"
DTYPE = jnp.bfloat16
COUNT_BLOCK = 128  # FlexAttention's block: the visited-block FLOP count is taken at 128 x 128
N_DOCS = 8
SHAPES = [
    dict(batch=4, heads=16, kv_heads=16, seq_len=8192, dim=128),
    dict(batch=4, heads=16, kv_heads=4, seq_len=8192, dim=128),
    dict(batch=1, heads=16, kv_heads=16, seq_len=32768, dim=128),
]
QUICK_SHAPES = [  # one batch and length, so that both shapes reuse the compiled mask builders
    dict(batch=2, heads=2, kv_heads=2, seq_len=256, dim=32),
    dict(batch=2, heads=2, kv_heads=1, seq_len=256, dim=32),
]
GPU = dict(window=1024, sweep=[512, 1024, 2048, 4096, None], check_queries=1024, samples=10,
           build=dict(batch=8, seq_len=32768, window=1024), count_block=128)
QUICK = dict(window=64, sweep=[64, None], check_queries=64, samples=3,
             build=dict(batch=2, seq_len=512, window=64), count_block=64)
TOL = {"out": 2e-2, "grad": 4e-2}  # relative L2, bf16 results (vs float32 reference, or vs ours)
XLA_LOGITS_LIMIT = 12 * 2**30  # skip the XLA peers when the float32 logits B*H*T*S*4 exceed this
# (at 16 GiB, B4 H16 T8192, they asked for 40 GiB and ran out on the H100: 20 s lost a case, 3d37e18)

START = time.perf_counter()


def log(message: str) -> None:
    print(f"[{time.perf_counter() - START:7.1f}s] {message}", flush=True)


# ----------------------------------------------------------------------------------------------
# Masks: what each case means, its block counts, its visible pairs.
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Mask:
    key: str  # "causal" | "window" | "documents"
    label: str
    window: tuple[int, int] | None  # (left, right)
    documents: bool


def race_masks(window: int) -> list[Mask]:
    return [Mask("causal", "causal", None, False),
            Mask("window", f"causal + sliding window (left {window}, right 0)", (window, 0), False),
            Mask("documents", f"{N_DOCS} packed documents (random lengths, fixed seed) + causal", None, True)]


def make_documents(seed: int, batch: int, seq_len: int, n_docs: int = N_DOCS) -> np.ndarray:
    """Segment ids ``[batch, seq_len]`` int32: ``n_docs`` contiguous documents of random lengths per row."""
    rng = np.random.default_rng(seed)
    ids = np.empty((batch, seq_len), np.int32)
    for b in range(batch):
        cuts = np.sort(rng.choice(np.arange(1, seq_len), n_docs - 1, replace=False))
        ids[b] = np.searchsorted(cuts, np.arange(seq_len), side="right")
    return ids


def document_lengths(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row: document lengths ``[B, M]`` and start offsets ``[B, M]`` (contiguous, ids 0..M-1)."""
    n = int(ids.max()) + 1
    lengths = np.stack([np.bincount(r, minlength=n) for r in ids]).astype(np.int32)
    starts = np.concatenate([np.zeros((ids.shape[0], 1), np.int32), np.cumsum(lengths, 1)[:, :-1]], 1)
    return lengths, starts.astype(np.int32)


def rule_kwargs(mask: Mask, seg: jax.Array | None) -> dict[str, Any]:
    kw: dict[str, Any] = dict(causal=True)
    if mask.window is not None:
        kw["sliding_window"] = mask.window
    if mask.documents:
        kw["q_segment_ids"] = seg
        kw["kv_segment_ids"] = seg
    return kw


@functools.lru_cache(maxsize=None)
def build_fn(mask: Mask, seq_len: int, q_block: int, kv_block: int):
    """A jitted ``make_block_mask`` for ``mask`` (one per mask and size: jit's cache is reused).

    Its arguments are the segment ids (documents) or ``arange`` positions ``[1, T]`` (causal,
    window), so that every mask has an array input: a mask built from constants alone would be
    folded by XLA at compile time (slowly), and its build would not be timed at all.
    """
    def build(ids):
        kw = rule_kwargs(mask, ids if mask.documents else None)
        if not mask.documents:
            kw.update(q_positions=ids, kv_positions=ids)
        return ejk_lite.make_block_mask(seq_len, seq_len, q_block=q_block, kv_block=kv_block, **kw)

    return jax.jit(build)


def build_arg(mask: Mask, seg: jax.Array, seq_len: int) -> jax.Array:
    return seg if mask.documents else jnp.arange(seq_len, dtype=jnp.int32)[None]


def visited_blocks(block_mask, batch: int, heads: int) -> int:
    """Visited tiles summed over batch rows and query heads (``kinds`` broadcasts over 1-sized axes)."""
    kinds = np.asarray(block_mask.kinds)
    bm, hm = kinds.shape[:2]
    return int(np.count_nonzero(kinds)) * (batch // bm) * (heads // hm)


def key_intervals(mask: Mask, seg: np.ndarray | None, batch: int, seq_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Each query's visible keys, ``lo .. q`` (contiguous documents, causal, optional left window):
    ``lo`` ``[batch, T]`` and ``q`` ``[T]``."""
    q = np.arange(seq_len, dtype=np.int64)
    if seg is None:
        starts = np.zeros((batch, seq_len), np.int64)
    else:
        new_doc = np.concatenate([np.ones((seg.shape[0], 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)
        starts = np.maximum.accumulate(np.where(new_doc, q[None], 0), axis=1)
    lo = starts if mask.window is None else np.maximum(starts, q[None] - mask.window[0])
    return lo, q


def visible_pairs(mask: Mask, seg: np.ndarray | None, batch: int, seq_len: int) -> int:
    """Visible (query, key) pairs summed over batch rows, one head."""
    lo, q = key_intervals(mask, seg, batch, seq_len)
    return int(np.sum(q[None] - lo + 1))


def count_blocks(mask: Mask, seg: np.ndarray | None, batch: int, seq_len: int, q_block: int, kv_block: int) -> int:
    """Visited (q-block, kv-block) tiles summed over batch rows, one head, computed in NumPy from the
    key intervals (independent of the library's builder): a tile is visited iff some query of the
    q-block sees some key of the kv-block."""
    lo, q = key_intervals(mask, seg, batch, seq_len)
    n_q, n_k = -(-seq_len // q_block), -(-seq_len // kv_block)
    rows = q // q_block
    total = 0
    for b in range(lo.shape[0]):
        cover = np.zeros((n_q, n_k + 1), np.int64)  # +1 at each query's first block, -1 after its last
        np.add.at(cover, (rows, lo[b] // kv_block), 1)
        np.add.at(cover, (rows, q // kv_block + 1), -1)
        total += int(np.count_nonzero(np.cumsum(cover, axis=1)[:, :n_k]))
    return total


# ----------------------------------------------------------------------------------------------
# Errors on the device (float32): full outputs are too large to bring to the host each time.
# ----------------------------------------------------------------------------------------------


@jax.jit
def _err_parts(out, ref):
    o, r = out.astype(jnp.float32), ref.astype(jnp.float32)
    return jnp.sum(jnp.square(o - r)), jnp.sum(jnp.square(r)), jnp.all(jnp.isfinite(o))


def rel_err(out, ref) -> float:
    """``||out - ref|| / ||ref||`` in float32 on the device; NaN/inf in ``out`` gives ``inf``."""
    if tuple(out.shape) != tuple(ref.shape):
        raise ValueError(f"shapes differ: {tuple(out.shape)} vs {tuple(ref.shape)}")
    diff, norm, finite = jax.device_get(_err_parts(out, ref))
    if not finite:
        return float("inf")
    return float(math.sqrt(float(diff)) / max(math.sqrt(float(norm)), 1e-30))


# ----------------------------------------------------------------------------------------------
# Ours.
# ----------------------------------------------------------------------------------------------


def ours_call(q, k, v, block_mask):
    # A prebuilt BlockMask carries its rule: causal=False so that no second rule is combined with it.
    return ejk_lite.blocksparse_attention(q, k, v, qkv_layouts=block_mask, causal=False)


def jax_fwd_bwd(fn: Callable[..., jax.Array]) -> Callable[..., Any]:
    """``(q, k, v, d_o, *extra) -> (o, (dq, dk, dv))`` for ``fn(q, k, v, *extra)``, jitted."""
    def run(q, k, v, d_o, *extra):
        o, pullback = jax.vjp(lambda q_, k_, v_: fn(q_, k_, v_, *extra), q, k, v)
        return o, pullback(d_o)

    return jax.jit(run)


def check_slice(shape: dict, check_queries: int) -> tuple[int, int, np.ndarray]:
    """Query heads, key/value heads and query indices the reference check covers."""
    group = shape["heads"] // shape["kv_heads"]
    heads = min(shape["heads"], max(2, group))
    heads = -(-heads // group) * group  # whole groups
    T = shape["seq_len"]
    half = min(check_queries, T) // 2
    index = np.unique(np.concatenate([np.arange(half), np.arange(T - half, T)]))
    return heads, heads // group, index


def reference_check(shape, mask, q, k, v, d_o, seg, o_full, fwd_bwd, block_mask, check_queries,
                    with_grads: bool) -> dict[str, float]:
    """Ours (full shape, the timed functions) against the float32 dense reference on a slice."""
    hq, hkv, index = check_slice(shape, check_queries)
    B, T = shape["batch"], shape["seq_len"]
    idx = jnp.asarray(index)
    f32 = lambda x: x.astype(jnp.float32)  # noqa: E731
    qs = f32(q[:, :hq][:, :, idx])
    ks, vs = f32(k[:, :hkv]), f32(v[:, :hkv])
    pos = jnp.broadcast_to(idx.astype(jnp.int32)[None], (B, idx.shape[0]))
    kw: dict[str, Any] = dict(causal=True, q_positions=pos,
                              kv_positions=jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None], (B, T)))
    if mask.window is not None:
        kw["sliding_window"] = mask.window
    if mask.documents:
        kw["q_segment_ids"] = seg[:, idx]
        kw["kv_segment_ids"] = seg

    def ref(q_, k_, v_):
        return reference(q_, k_, v_, **kw)

    errors = {}
    with jax.default_matmul_precision("highest"):
        if not with_grads:
            ref_o = jax.jit(ref)(qs, ks, vs)
        else:
            d_os = f32(d_o[:, :hq][:, :, idx])
            ref_o, (rdq, rdk, rdv) = jax.jit(lambda a, b, c, g: _vjp(ref, a, b, c, g))(qs, ks, vs, d_os)
    errors["out"] = rel_err(o_full[:, :hq][:, :, idx], ref_o)
    if with_grads:
        # The cotangent restricted to the slice: the other rows pass nothing to dk and dv.
        d_o_slice = jnp.zeros_like(d_o).at[:, :hq, idx].set(d_o[:, :hq][:, :, idx])
        _, (dq, dk, dv) = fwd_bwd(q, k, v, d_o_slice, block_mask)
        errors["dq"] = rel_err(dq[:, :hq][:, :, idx], rdq)
        errors["dk"] = rel_err(dk[:, :hkv], rdk)
        errors["dv"] = rel_err(dv[:, :hkv], rdv)
        del dq, dk, dv, d_o_slice
    return errors


def _vjp(fn, q, k, v, g):
    o, pullback = jax.vjp(fn, q, k, v)
    return o, pullback(g)


# ----------------------------------------------------------------------------------------------
# Peers. Each returns {"fwd": stats, "fwd+bwd": stats, "err": {...}, "impl": name, ...} or raises.
# ----------------------------------------------------------------------------------------------


def race_jax(fn, args, extra, d_o, to_ours, ours_o, ours_grads, samples) -> dict[str, Any]:
    """Time and check a JAX peer ``fn(q, k, v, *extra)`` whose layout ``to_ours`` maps back."""
    fwd = jax.jit(fn)
    o = fwd(*args, *extra)
    err = {"out": rel_err(to_ours(o), ours_o)}
    del o
    fwd_stats = time_stats_ms(lambda: fwd(*args, *extra), samples)
    fwd_bwd = jax_fwd_bwd(fn)
    o, grads = fwd_bwd(*args, d_o, *extra)
    for name, g, ours in zip(("dq", "dk", "dv"), grads, ours_grads):
        err[name] = rel_err(to_ours(g), ours)
    del o, grads
    fwd_bwd_stats = time_stats_ms(lambda: fwd_bwd(*args, d_o, *extra), samples)
    return {"fwd": fwd_stats, "fwd+bwd": fwd_bwd_stats, "err": err}


def bthd(x):
    return jnp.swapaxes(x, 1, 2)


def peer_cudnn(ctx) -> dict[str, Any]:
    mask, shape = ctx["mask"], ctx["shape"]
    scale = shape["dim"] ** -0.5
    args = tuple(bthd(x) for x in (ctx["q"], ctx["k"], ctx["v"]))
    d_o = bthd(ctx["d_o"])
    if not mask.documents:
        kw = dict(is_causal=True, scale=scale, implementation="cudnn")
        if mask.window is not None:
            kw["local_window_size"] = mask.window

        def fn(q, k, v):
            return jax.nn.dot_product_attention(q, k, v, **kw)

        result = race_jax(fn, args, (), d_o, bthd, ctx["ours_o"], ctx["ours_grads"], ctx["samples"])
        result.update(impl="cudnn", peer="cuDNN: jax.nn.dot_product_attention(implementation='cudnn', "
                      + ("is_causal=True)" if mask.window is None
                         else f"is_causal=True, local_window_size={mask.window})"))
        return result
    # Documents: cuDNN's packed layout (lengths [B, M], offsets [B, M + 1] padded with -1).
    lengths, starts = document_lengths(ctx["seg_np"])
    seqlen = jnp.asarray(lengths)
    offsets = jnp.asarray(np.concatenate([starts, -np.ones((starts.shape[0], 1), np.int32)], 1))
    failure = None
    try:
        from jax._src.cudnn.fused_attention_stablehlo import MaskType
        from jax._src.cudnn.fused_attention_stablehlo import dot_product_attention as cudnn_dpa

        def packed(q, k, v, seqlen, offsets):
            return cudnn_dpa(q, k, v, None, None, seqlen, seqlen, offsets, offsets, scale=scale,
                             mask_type=MaskType.PADDING_CAUSAL, qkv_layout="BTNH")

        result = race_jax(packed, args, (seqlen, offsets), d_o, bthd, ctx["ours_o"], ctx["ours_grads"],
                          ctx["samples"])
        result.update(impl="cudnn_packed",
                      peer="cuDNN packed layout: jax._src.cudnn.fused_attention_stablehlo.dot_product_attention"
                           "(q_seqlen, kv_seqlen, q_offsets, kv_offsets, mask_type=PADDING_CAUSAL)")
        if within_tolerance(result["err"]):
            return result
        failure = f"packed layout disagrees with ours ({result['err']})"
    except Exception as error:  # noqa: BLE001  (internal API: any failure falls back to the public one)
        failure = f"packed layout failed: {type(error).__name__}: {str(error)[:300]}"
    log(f"    cudnn: {failure}; trying the public API with a dense mask")
    dense = jnp.asarray(ctx["seg_np"][:, None, :, None] == ctx["seg_np"][:, None, None, :])

    def masked(q, k, v, m):
        return jax.nn.dot_product_attention(q, k, v, mask=m, is_causal=True, scale=scale, implementation="cudnn")

    result = race_jax(masked, args, (dense,), d_o, bthd, ctx["ours_o"], ctx["ours_grads"], ctx["samples"])
    result.update(impl="cudnn_mask", note=failure,
                  peer="cuDNN: jax.nn.dot_product_attention(mask=dense [B,1,T,S] document mask, is_causal=True, "
                       "implementation='cudnn')")
    return result


def peer_pallas(ctx) -> dict[str, Any]:
    from jax.experimental.pallas.ops.gpu import attention as pallas_attention

    mask, shape = ctx["mask"], ctx["shape"]
    if mask.window is not None:
        raise NotImplementedError("Pallas mha has no sliding window")
    group = shape["heads"] // shape["kv_heads"]
    scale = shape["dim"] ** -0.5
    interpret = not ejk_lite.ON_GPU
    seg = jnp.asarray(ctx["seg_np"]) if mask.documents else None
    args = tuple(bthd(x) for x in (ctx["q"], ctx["k"], ctx["v"]))
    d_o = bthd(ctx["d_o"])
    T = shape["seq_len"]
    candidates = ctx["pallas_bwd_choice"].get(ctx["shape_name"])
    sizes = [candidates] if candidates else [32, 64]

    def make(bwd):
        block = min(128, T)
        blocks = pallas_attention.BlockSizes(block_q=block, block_k=block, block_q_dkv=min(bwd, T),
                                             block_kv_dkv=min(bwd, T), block_q_dq=min(bwd, T),
                                             block_kv_dq=min(bwd, T))

        def fn(q, k, v, *seg_arg):
            if group > 1:  # mha takes as many K/V heads as query heads
                k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
            return pallas_attention.mha(q, k, v, seg_arg[0] if seg_arg else None, sm_scale=scale, causal=True,
                                        block_sizes=blocks, interpret=interpret)
        return fn

    extra = (seg,) if seg is not None else ()
    best, wrong, tried = None, None, {}
    for bwd in sizes:
        try:
            result = race_jax(make(bwd), args, extra, d_o, bthd, ctx["ours_o"], ctx["ours_grads"], ctx["samples"])
        except Exception as error:  # noqa: BLE001  (a block size that does not compile is skipped)
            tried[bwd] = f"{type(error).__name__}: {str(error)[:200]}"
            if len(sizes) == 1:
                raise
            continue
        if not within_tolerance(result["err"]):  # never pick a wrong configuration for its speed
            tried[bwd] = f"wrong result: {result['err']}"
            wrong = wrong or (bwd, result)
            continue
        tried[bwd] = result["fwd+bwd"]["median_ms"]
        if best is None or result["fwd+bwd"]["median_ms"] < best[1]["fwd+bwd"]["median_ms"]:
            best = (bwd, result)
    best = best or wrong  # all wrong: report one, so that the check fails the run
    if best is None:
        raise RuntimeError(f"no backward block size ran: {tried}")
    ctx["pallas_bwd_choice"][ctx["shape_name"]] = best[0]
    result = best[1]
    result.update(impl="pallas_mha", backward_block=best[0], backward_blocks_tried=tried,
                  peer="JAX Pallas GPU: jax.experimental.pallas.ops.gpu.attention.mha(causal=True"
                       + (", segment_ids" if mask.documents else "") + ")"
                       + (f", K/V heads repeated x{group} inside the timed function" if group > 1 else ""))
    return result


def within_tolerance(err: dict[str, float]) -> bool:
    return all(e <= TOL["out" if name == "out" else "grad"] for name, e in err.items())


def xla_fits(shape) -> str | None:
    logits = shape["batch"] * shape["heads"] * shape["seq_len"] ** 2 * 4
    if logits > XLA_LOGITS_LIMIT:
        return f"float32 logits B*H*T*S*4 = {logits / 2**30:.0f} GiB do not fit the GPU"
    return None


def peer_xla_sdpa(ctx) -> dict[str, Any]:
    mask, shape = ctx["mask"], ctx["shape"]
    if (reason := xla_fits(shape)) and ejk_lite.ON_GPU:
        raise MemoryError(reason)
    scale = shape["dim"] ** -0.5
    args = tuple(bthd(x) for x in (ctx["q"], ctx["k"], ctx["v"]))
    kw = dict(is_causal=True, scale=scale, implementation="xla")
    if mask.window is not None:
        kw["local_window_size"] = mask.window
    extra = ()
    if mask.documents:
        extra = (jnp.asarray(ctx["seg_np"][:, None, :, None] == ctx["seg_np"][:, None, None, :]),)

    def fn(q, k, v, *m):
        return jax.nn.dot_product_attention(q, k, v, mask=m[0] if m else None, **kw)

    result = race_jax(fn, args, extra, bthd(ctx["d_o"]), bthd, ctx["ours_o"], ctx["ours_grads"], ctx["samples"])
    result.update(impl="xla_sdpa", peer="XLA: jax.nn.dot_product_attention(implementation='xla')"
                  + (" with a dense [B,1,T,S] document mask" if mask.documents else ""))
    return result


def peer_xla_einsum(ctx) -> dict[str, Any]:
    mask, shape = ctx["mask"], ctx["shape"]
    if (reason := xla_fits(shape)) and ejk_lite.ON_GPU:
        raise MemoryError(reason)
    scale = shape["dim"] ** -0.5
    B, H, Hkv, T = shape["batch"], shape["heads"], shape["kv_heads"], shape["seq_len"]
    group = H // Hkv
    seg = jnp.asarray(ctx["seg_np"]) if mask.documents else None

    def fn(q, k, v, *seg_arg):
        qg = q.reshape(B, Hkv, group, T, q.shape[-1])
        s = jnp.einsum("bhgtd,bhsd->bhgts", qg, k, preferred_element_type=jnp.float32) * scale
        pos = jnp.arange(T)
        visible = pos[:, None] >= pos[None, :]
        if mask.window is not None:
            visible &= pos[:, None] - mask.window[0] <= pos[None, :]
        visible = visible[None, None, None]
        if seg_arg:
            visible = visible & (seg_arg[0][:, :, None] == seg_arg[0][:, None, :])[:, None, None]
        s = jnp.where(visible, s, -jnp.inf)
        p = jax.nn.softmax(s, axis=-1).astype(v.dtype)
        o = jnp.einsum("bhgts,bhsd->bhgtd", p, v, preferred_element_type=jnp.float32)
        return o.astype(q.dtype).reshape(B, H, T, v.shape[-1])

    extra = (seg,) if seg is not None else ()
    result = race_jax(fn, (ctx["q"], ctx["k"], ctx["v"]), extra, ctx["d_o"], lambda x: x, ctx["ours_o"],
                      ctx["ours_grads"], ctx["samples"])
    result.update(impl="xla_einsum", peer="XLA: einsum, mask from iotas and segment ids, float32 softmax, einsum")
    return result


# ----------------------------------------------------------------------------------------------
# FlexAttention (PyTorch): only where torch with CUDA is installed.
# ----------------------------------------------------------------------------------------------


def load_torch():
    if not ejk_lite.ON_GPU:
        return None, "no GPU (FlexAttention runs in PyTorch on CUDA)"
    try:
        import torch
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except Exception as error:  # noqa: BLE001
        return None, f"{type(error).__name__}: {error}"
    if not torch.cuda.is_available():
        return None, "torch sees no CUDA device"
    # Every case is a new mask or shape, i.e. a recompile: past dynamo's limit (8) it would run
    # flex_attention eagerly (dense, slow) without a word. Raise the limits.
    for name in ("cache_size_limit", "recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 1024)
    for name in ("accumulated_cache_size_limit", "accumulated_recompile_limit"):
        if hasattr(torch._dynamo.config, name):
            setattr(torch._dynamo.config, name, 4096)
    return (torch, torch.compile(flex_attention), create_block_mask), None


def to_torch(torch, x):
    return torch.from_dlpack(jax.block_until_ready(x)).clone()


def torch_rel_err(torch, out, ref) -> float:
    o, r = out.detach().float(), ref.float()
    if tuple(o.shape) != tuple(r.shape):
        raise ValueError(f"shapes differ: {tuple(o.shape)} vs {tuple(r.shape)}")
    if not bool(torch.isfinite(o).all()):
        return float("inf")
    return float(torch.linalg.vector_norm(o - r) / torch.linalg.vector_norm(r).clamp_min(1e-30))


def peer_flex(ctx) -> dict[str, Any]:
    if ctx["torch"] is None:
        raise RuntimeError(ctx["torch_missing"])
    torch, flex, create_block_mask = ctx["torch"]
    mask, shape = ctx["mask"], ctx["shape"]
    B, H, Hkv, T, D = shape["batch"], shape["heads"], shape["kv_heads"], shape["seq_len"], shape["dim"]
    samples = ctx["samples"]
    q, k, v, d_o = (to_torch(torch, x) for x in (ctx["q"], ctx["k"], ctx["v"], ctx["d_o"]))
    doc = to_torch(torch, jnp.asarray(ctx["seg_np"])) if mask.documents else None
    left = None if mask.window is None else mask.window[0]

    if mask.documents:
        def mask_mod(b, h, q_idx, kv_idx):
            return (doc[b, q_idx] == doc[b, kv_idx]) & (q_idx >= kv_idx)
    elif left is not None:
        def mask_mod(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx <= left)
    else:
        def mask_mod(b, h, q_idx, kv_idx):
            return q_idx >= kv_idx

    def build():
        kw = dict(device="cuda", BLOCK_SIZE=128)
        try:
            return create_block_mask(mask_mod, B if mask.documents else None, None, T, T, _compile=True, **kw)
        except TypeError:  # a torch without _compile
            return create_block_mask(mask_mod, B if mask.documents else None, None, T, T, **kw)

    block_mask = build()
    build_stats = spread(device_samples_ms(build, samples=min(samples, 5), warmup=1))
    counts = block_mask.kv_num_blocks.to(torch.int64)
    if block_mask.full_kv_num_blocks is not None:
        counts = counts + block_mask.full_kv_num_blocks.to(torch.int64)
    flex_blocks = int(counts.sum()) * (B // counts.shape[0]) * (H // counts.shape[1])
    gqa = H != Hkv

    def call(q_, k_, v_):
        return flex(q_, k_, v_, block_mask=block_mask, scale=D ** -0.5, enable_gqa=gqa)

    ours_o = to_torch(torch, ctx["ours_o"])
    with torch.no_grad():
        o = call(q, k, v)
        err = {"out": torch_rel_err(torch, o, ours_o)}
        del o

        def run_fwd():
            call(q, k, v)

        fwd_stats = spread(device_samples_ms(run_fwd, samples))
    del ours_o
    leaves = [x.detach().requires_grad_(True) for x in (q, k, v)]

    def run_fwd_bwd():
        call(*leaves).backward(d_o)

    run_fwd_bwd()
    for name, leaf, ours in zip(("dq", "dk", "dv"), leaves, ctx["ours_grads"]):
        err[name] = torch_rel_err(torch, leaf.grad, to_torch(torch, ours))
    fwd_bwd_stats = spread(device_samples_ms(run_fwd_bwd, samples, grad_to_none=leaves))
    del leaves, q, k, v, d_o, block_mask
    torch.cuda.empty_cache()
    return {"fwd": fwd_stats, "fwd+bwd": fwd_bwd_stats, "err": err, "impl": "flex",
            "peer": "PyTorch FlexAttention: torch.compile(flex_attention) + create_block_mask(BLOCK_SIZE=128)"
                    + (", enable_gqa=True" if gqa else ""),
            "flex_visited_blocks": flex_blocks, "flex_mask_build": build_stats}


PEERS = {"cudnn": peer_cudnn, "flex": peer_flex, "pallas": peer_pallas, "xla_sdpa": peer_xla_sdpa,
         "xla_einsum": peer_xla_einsum}


def peer_unavailable(name: str, mask: Mask, shape: dict, torch_missing: str | None) -> str | None:
    """Why a peer cannot run a case at all, decided before trying (None: try it)."""
    if name == "cudnn" and not ejk_lite.ON_GPU:
        return "no GPU (cuDNN needs CUDA)"
    if name == "flex" and torch_missing:
        return torch_missing
    if name == "pallas" and mask.window is not None:
        return "Pallas mha has no sliding window (causal and segment ids only)"
    if name.startswith("xla") and ejk_lite.ON_GPU and (reason := xla_fits(shape)):
        return reason
    return None


# ----------------------------------------------------------------------------------------------
# The race.
# ----------------------------------------------------------------------------------------------


def make_inputs(shape: dict, seed: int):
    B, H, Hkv, T, D = shape["batch"], shape["heads"], shape["kv_heads"], shape["seq_len"], shape["dim"]
    kq, kk, kv, kd = jax.random.split(jax.random.key(seed), 4)
    return (jax.random.normal(kq, (B, H, T, D), DTYPE), jax.random.normal(kk, (B, Hkv, T, D), DTYPE),
            jax.random.normal(kv, (B, Hkv, T, D), DTYPE), jax.random.normal(kd, (B, H, T, D), DTYPE))


def shape_name(shape: dict) -> str:
    return f"B{shape['batch']} Hq{shape['heads']} Hkv{shape['kv_heads']} T{shape['seq_len']} D{shape['dim']}"


def main():
    def extra(parser):
        parser.add_argument("--shapes", default=None, help="comma-separated indices into the shape list (default: all)")
        parser.add_argument("--masks", default="causal,window,documents", help="comma-separated mask keys")
        parser.add_argument("--peers", default=",".join(PEERS), help="comma-separated peers to run")
        parser.add_argument("--samples", type=int, default=None, help="timed samples per figure")
        parser.add_argument("--no-sweep", action="store_true", help="skip the window sweep")
        parser.add_argument("--no-build", action="store_true", help="skip the B=8 T=32768 mask-building timing")
        parser.add_argument("--budget-s", type=float, default=None,
                            help="start nothing new after this many seconds (default 480 on a GPU, none with --quick)")
        parser.add_argument("--merge", action="store_true",
                            help="merge into an existing attention.json (cases of this run replace theirs)")

    args = parse_args(__doc__.splitlines()[0], extra)
    cfg = QUICK if args.quick else GPU
    samples = args.samples or cfg["samples"]
    all_shapes = QUICK_SHAPES if args.quick else SHAPES
    shapes = all_shapes if args.shapes is None else [all_shapes[int(i)] for i in args.shapes.split(",")]
    masks = [m for m in race_masks(cfg["window"]) if m.key in args.masks.split(",")]
    peers = [p for p in args.peers.split(",") if p]
    for p in peers:
        if p not in PEERS:
            raise SystemExit(f"unknown peer {p!r}; choose from {sorted(PEERS)}")
    count_block = cfg["count_block"]
    budget_s = args.budget_s if args.budget_s is not None else (None if args.quick else 480.0)

    def out_of_time(what: str) -> bool:
        """True (and recorded) once the time budget is spent: the run then only writes what it has."""
        if budget_s is None or time.perf_counter() - START < budget_s:
            return False
        not_run[what] = f"skipped: the time budget ({budget_s:.0f} s) was spent"
        log(f"  {what}: skipped, time budget spent")
        return True

    torch_bundle, torch_missing = load_torch() if "flex" in peers else (None, "not requested")
    log(f"device {jax.devices()[0]}, torch: {'ok' if torch_bundle else torch_missing}")
    copy_gbs, dispatch_ms = ceilings()
    matmul_tflops = measure_matmul(args.quick)
    log(f"ceilings: copy {copy_gbs:.0f} GB/s, dispatch {dispatch_ms:.3f} ms, bf16 matmul {matmul_tflops:.0f} TFLOP/s")

    rows: list[dict] = []
    sweep_rows: list[dict] = []
    build_rows: list[dict] = []
    not_run: dict[str, str] = {}
    failures: list[str] = []
    pallas_bwd_choice: dict[str, int] = {}
    versions = peer_versions(torch_bundle)

    def save(partial: bool) -> Path:
        payload = dict(
            quick=args.quick, partial=partial, copy_bandwidth_gbs=copy_gbs, dispatch_overhead_ms=dispatch_ms,
            matmul_bf16_tflops=matmul_tflops, peer_versions=versions,
            target=("at least FlexAttention's speed on every mask, forward and forward+backward; time "
                    "proportional to the visited blocks (window_sweep)"),
            definitions=dict(
                tflops=(f"visited (q-block, kv-block) pairs of the mask at {count_block}x{count_block} "
                        f"(FlexAttention's convention), summed over batch rows and query heads, "
                        f"x {count_block}*{count_block} x 4 x D; "
                        "fwd+bwd = 3.5 x fwd (backward = 2.5 x forward, FlashAttention's convention); the same "
                        "count for every implementation of a case"),
                tflops_dense_equiv="visible (query, key) token pairs x 4 x D (x 3.5 for fwd+bwd)",
                visited_blocks=f"tiles at {count_block}x{count_block}, summed over batch rows and query heads",
                visited_blocks_fwd="the same at ours' forward block sizes (block_q x block_kv)",
                rel_err=("triton rows: against the float32 dense reference on a slice (fwd: output; fwd+bwd: the "
                         "worst of dq, dk, dv); peer rows: rel_err_vs_ours on the full output / gradients"),
                timing="device time from the profiler (kernels summed) after an L2 flush; min / median / max over `samples` samples",
            ),
            masks={m.key: m.label for m in race_masks(cfg["window"])},
            summary=summarize(rows), not_run=not_run, failures=failures, rows=rows,
            window_sweep=sweep_rows, mask_build=build_rows,
            notes=NOTES,
        )
        if args.merge:
            payload = merge(Path(args.out) / f"{OP}.json", payload)
        return write_result(args.out, OP, payload)

    # First: one build, cheap, which a run cut short by its time budget would otherwise lose.
    if not args.no_build and not out_of_time("mask build (issue 8)"):
        try:
            build_rows.append(time_issue8_build(cfg, samples))
            log(f"mask build {build_rows[-1]['what']}: {build_rows[-1]['median_ms']:.3f} ms")
        except Exception as error:  # noqa: BLE001
            traceback.print_exc()
            failures.append(f"mask build (issue 8) raised {type(error).__name__}: {str(error)[:300]}")

    for shape in shapes:
        si = all_shapes.index(shape)  # seeds follow the shape, whichever subset runs
        sname = shape_name(shape)
        B, H, Hkv, T, D = shape["batch"], shape["heads"], shape["kv_heads"], shape["seq_len"], shape["dim"]
        fwd_blocks, bwd_blocks = BlockSizes.forward(D), BlockSizes.backward(D)
        q, k, v, d_o = make_inputs(shape, seed=si)
        seg_np = make_documents(seed=1000 + si, batch=B, seq_len=T)
        seg = jnp.asarray(seg_np)
        log(f"== {sname}  (ours: forward blocks {fwd_blocks.block_q}x{fwd_blocks.block_kv}, "
            f"backward {bwd_blocks.block_q}x{bwd_blocks.block_kv})")
        for mask in masks:
            name = f"{sname} {mask.key}"
            if out_of_time(f"{name} (all)"):
                continue
            seg_case = seg_np if mask.documents else None
            try:
                # The mask: built once (as FlexAttention's is), at ours' forward block sizes; the build
                # is timed apart (mask_build).
                build = build_fn(mask, T, fwd_blocks.block_q, fwd_blocks.block_kv)
                ids = build_arg(mask, seg, T)
                ours_mask = jax.block_until_ready(build(ids))
                build_stats = time_stats_ms(lambda: build(ids), samples)
                build_rows.append(dict(name=name, what=f"make_block_mask under jit, {mask.label}",
                                       blocks=[fwd_blocks.block_q, fwd_blocks.block_kv],
                                       batch=B if mask.documents else 1, seq_len=T, **build_stats))
                # Work: tiles counted in NumPy (at 128 x 128 for the FLOPs; at ours' forward blocks to
                # check the library's mask), visible pairs in closed form.
                blocks = count_blocks(mask, seg_case, B, T, count_block, count_block) * H
                blocks_fwd = count_blocks(mask, seg_case, B, T, fwd_blocks.block_q, fwd_blocks.block_kv) * H
                listed = visited_blocks(ours_mask, B, H)
                if listed != blocks_fwd:
                    failures.append(f"{name}: make_block_mask lists {listed} tiles at "
                                    f"{fwd_blocks.block_q}x{fwd_blocks.block_kv}, NumPy counts {blocks_fwd}")
                pairs = visible_pairs(mask, seg_case, B, T) * H
                if args.quick:  # the closed form against the library's own dense mask
                    dense_pairs = int(np.sum(np.asarray(ours_mask.token_mask()))) * (B // ours_mask.kinds.shape[0]) * H
                    if dense_pairs != pairs:
                        failures.append(f"{name}: visible pairs {pairs} (closed form) != {dense_pairs} (token_mask)")
                flops = {"fwd": blocks * count_block * count_block * 4 * D}
                flops["fwd+bwd"] = 3.5 * flops["fwd"]
                dense_flops = {"fwd": pairs * 4 * D, "fwd+bwd": 3.5 * pairs * 4 * D}

                fwd = jax.jit(ours_call)
                fwd_bwd = jax_fwd_bwd(ours_call)
                ours_o = fwd(q, k, v, ours_mask)
                _, ours_grads = fwd_bwd(q, k, v, d_o, ours_mask)
                errors = reference_check(shape, mask, q, k, v, d_o, seg, ours_o, fwd_bwd, ours_mask,
                                         cfg["check_queries"], with_grads=True)
                ref_err = {"fwd": errors["out"], "fwd+bwd": max(errors["dq"], errors["dk"], errors["dv"])}
                for what, e in errors.items():
                    if not e <= TOL["out" if what == "out" else "grad"]:
                        failures.append(f"{name} triton {what}: rel err {e:.3g} vs the reference")
                ours_stats = {"fwd": time_stats_ms(lambda: fwd(q, k, v, ours_mask), samples),
                              "fwd+bwd": time_stats_ms(lambda: fwd_bwd(q, k, v, d_o, ours_mask), samples)}
            except Exception as error:  # noqa: BLE001  (recorded; the other cases still run)
                traceback.print_exc()
                failures.append(f"{name} triton raised {type(error).__name__}: {str(error)[:300]}")
                save(partial=True)
                continue

            common_fields = dict(shape=[B, H, Hkv, T, D], dtype="bfloat16", mask=mask.key, visited_blocks=blocks,
                                 visited_blocks_fwd=blocks_fwd, visible_pairs=pairs,
                                 visited_fraction=blocks / (B * H * (-(-T // count_block)) ** 2))
            for direction in ("fwd", "fwd+bwd"):
                st = ours_stats[direction]
                rows.append(row(name, "triton", direction, median=st["median_ms"], flops=flops[direction],
                                rel_err=ref_err[direction], **common_fields,
                                **{k_: v_ for k_, v_ in st.items() if k_ != "median_ms"},
                                tflops_dense_equiv=dense_flops[direction] / (st["median_ms"] * 1e-3) / 1e12,
                                rel_err_detail=errors, check="float32 dense reference on a slice",
                                mask_build_ms=build_stats["median_ms"],
                                fwd_blocks=[fwd_blocks.block_q, fwd_blocks.block_kv],
                                bwd_blocks=[bwd_blocks.block_q, bwd_blocks.block_kv]))
            log(f"  {mask.key:9s} triton  fwd {ours_stats['fwd']['median_ms']:8.3f} ms  "
                f"fwd+bwd {ours_stats['fwd+bwd']['median_ms']:8.3f} ms  ref err {errors}  "
                f"build {build_stats['median_ms']:.3f} ms")

            ctx = dict(mask=mask, shape=shape, shape_name=sname, q=q, k=k, v=v, d_o=d_o, seg_np=seg_np,
                       ours_o=ours_o, ours_grads=ours_grads, samples=samples, torch=torch_bundle,
                       torch_missing=torch_missing, pallas_bwd_choice=pallas_bwd_choice)
            for peer in peers:
                if out_of_time(f"{name} {peer}"):
                    continue
                reason = peer_unavailable(peer, mask, shape, torch_missing)
                if reason:
                    not_run[f"{name} {peer}"] = reason
                    continue
                try:
                    result = PEERS[peer](ctx)
                except Exception as error:  # noqa: BLE001  (a peer that cannot run is reported, not fatal)
                    reason = f"{type(error).__name__}: {str(error)[:400]}"
                    not_run[f"{name} {peer}"] = reason
                    log(f"  {mask.key:9s} {peer}: not run: {reason}")
                    gc.collect()
                    continue
                impl = result["impl"]
                for what, e in result["err"].items():
                    if not e <= TOL["out" if what == "out" else "grad"]:
                        failures.append(f"{name} {impl} {what}: rel err {e:.3g} vs ours")
                if "flex_visited_blocks" in result and result["flex_visited_blocks"] != blocks:
                    failures.append(f"{name}: FlexAttention visits {result['flex_visited_blocks']} blocks, "
                                    f"ours' mask at {count_block} lists {blocks}: the masks differ")
                for direction in ("fwd", "fwd+bwd"):
                    st = result[direction]
                    err = result["err"]["out"] if direction == "fwd" else max(
                        result["err"][n] for n in ("dq", "dk", "dv"))
                    extra_fields = {k_: v_ for k_, v_ in result.items()
                                    if k_ not in ("fwd", "fwd+bwd", "err", "impl")}
                    rows.append(row(name, impl, direction, median=st["median_ms"], flops=flops[direction],
                                    **common_fields, **{k_: v_ for k_, v_ in st.items() if k_ != "median_ms"},
                                    tflops_dense_equiv=dense_flops[direction] / (st["median_ms"] * 1e-3) / 1e12,
                                    rel_err_vs_ours=err, rel_err_detail=result["err"],
                                    speedup_of_ours=st["median_ms"] / ours_stats[direction]["median_ms"],
                                    **extra_fields))
                log(f"  {mask.key:9s} {impl:12s} fwd {result['fwd']['median_ms']:8.3f} ms  "
                    f"fwd+bwd {result['fwd+bwd']['median_ms']:8.3f} ms  err vs ours "
                    f"{ {n: round(e, 5) for n, e in result['err'].items()} }")
                del result
                gc.collect()
            del ctx, ours_o, ours_grads, ours_mask
            gc.collect()
            save(partial=True)

        if si == 0 and not args.no_sweep:
            sweep(shape, q, k, v, cfg, samples, count_block, sweep_rows, failures, out_of_time)
            save(partial=True)
        del q, k, v, d_o, seg
        gc.collect()

    path = save(partial=False)
    log(f"wrote {path}")
    if not_run:
        reasons: dict[str, list[str]] = {}
        for case, reason in not_run.items():
            reasons.setdefault(reason, []).append(case)
        print("not run:")
        for reason, cases in reasons.items():
            print(f"  {reason}: {len(cases)} case(s), e.g. {cases[0]}")
    if sweep_rows:
        print_table(sweep_rows, ["name", "visited_blocks", "median_ms", "min_ms", "max_ms", "ms_per_1k_blocks",
                                 "rel_err"])
    if build_rows:
        print_table(build_rows, ["name", "batch", "seq_len", "median_ms", "min_ms", "max_ms"])
    if rows:
        print(f"TFLOP/s (visited {count_block}x{count_block} blocks; dense-equivalent figures in the JSON), "
              f"medians of {samples} samples; x_flex = FlexAttention's time / ours")
        print_table(compact(rows), ["case", "dir", "ours_ms", "ours", "cudnn", "flex", "pallas_mha", "xla_sdpa",
                                    "xla_einsum", "x_flex", "ref_err"])
    if failures:
        print(f"FAILED ({len(failures)}):")
        for f in failures:
            print("  " + f)
        sys.exit(1)


NOTES = ("bf16 inputs; ours (impl 'triton') is called with a BlockMask prebuilt at its forward block sizes "
         "(qkv_layouts=, causal=False), as FlexAttention is given its prebuilt BlockMask; ours' forward+backward "
         "builds the backward's mask (its own block sizes) from the rule inside the timed call. Masks are built "
         "from arrays passed to jit (segment ids; arange positions for causal/window), so that XLA cannot fold "
         "a build into a constant; mask_build holds those make_block_mask times. Peer errors are measured against ours; ours against the float32 "
         "dense reference on a slice (first max(2, G) query heads, first and last half of check queries). "
         "XLA peers are skipped where the float32 logits exceed 24 GiB. Pallas mha has no window; with "
         "grouped heads its K/V are repeated inside the timed function. cuDNN takes documents through its "
         "packed layout (an internal JAX API) or, failing that, a dense mask.")


def sweep(shape, q, k, v, cfg, samples, count_block, sweep_rows, failures, out_of_time):
    """Ours' forward over windows (and causal) on one shape: time against visited blocks."""
    B, H, T, D = shape["batch"], shape["heads"], shape["seq_len"], shape["dim"]
    fwd_blocks = BlockSizes.forward(D)
    fwd = jax.jit(ours_call)
    for w in cfg["sweep"]:
        if out_of_time(f"sweep window {w}"):
            continue
        mask = (Mask("causal", "causal", None, False) if w is None
                else Mask(f"window{w}", f"causal + window (left {w}, right 0)", (w, 0), False))
        try:
            ours_mask = jax.block_until_ready(
                build_fn(mask, T, fwd_blocks.block_q, fwd_blocks.block_kv)(build_arg(mask, None, T)))
            blocks = count_blocks(mask, None, B, T, count_block, count_block) * H
            blocks_fwd = count_blocks(mask, None, B, T, fwd_blocks.block_q, fwd_blocks.block_kv) * H
            if visited_blocks(ours_mask, B, H) != blocks_fwd:
                failures.append(f"sweep window {w}: make_block_mask lists {visited_blocks(ours_mask, B, H)} "
                                f"tiles, NumPy counts {blocks_fwd}")
            o = fwd(q, k, v, ours_mask)
            err = reference_check(shape, mask, q, k, v, None, None, o, None, ours_mask, cfg["check_queries"],
                                  with_grads=False)["out"]
            del o
            if not err <= TOL["out"]:
                failures.append(f"sweep window {w}: rel err {err:.3g} vs the reference")
            st = time_stats_ms(lambda: fwd(q, k, v, ours_mask), samples)
        except Exception as error:  # noqa: BLE001
            traceback.print_exc()
            failures.append(f"sweep window {w} raised {type(error).__name__}: {str(error)[:300]}")
            continue
        pairs = visible_pairs(mask, None, B, T) * H
        sweep_rows.append(dict(name=f"{shape_name(shape)} {mask.key}", window="causal" if w is None else w,
                               visited_blocks=blocks, visited_blocks_fwd=blocks_fwd, visible_pairs=pairs,
                               ms_per_1k_blocks=st["median_ms"] / blocks * 1e3,
                               tflops=blocks * count_block ** 2 * 4 * D / (st["median_ms"] * 1e-3) / 1e12,
                               rel_err=err, **st))
        log(f"  sweep {str(w):>6s}: {blocks} blocks, {st['median_ms']:.3f} ms")


def time_issue8_build(cfg, samples) -> dict[str, Any]:
    b = cfg["build"]
    B, T, W = b["batch"], b["seq_len"], b["window"]
    seg = jnp.asarray(make_documents(seed=7, batch=B, seq_len=T))
    mask = Mask("documents+window", f"documents + causal + window {W}", (W, 0), True)
    build = build_fn(mask, T, 128, 128)
    stats = time_stats_ms(lambda: build(seg), samples)
    return dict(name=f"B{B} T=S={T} documents+causal+window{W}",
                what=f"make_block_mask under jit, {N_DOCS} documents + causal + window ({W}, 0), 128x128 blocks",
                blocks=[128, 128], batch=B, seq_len=T, **stats)


def measure_matmul(quick: bool) -> float:
    """bf16 matmul TFLOP/s (8192^3 on the GPU, the best of several XLA products, each recorded
    with the results: common.matmul_tflops): the compute ceiling beside the figures."""
    return matmul_tflops(256 if quick else 8192, timer=None if ejk_lite.ON_GPU else wall_ms)


def peer_versions(torch_bundle) -> dict[str, str]:
    found = {}
    if torch_bundle is not None:
        found["torch"] = torch_bundle[0].__version__
    try:
        from jax._src.cudnn.fused_attention_stablehlo import check_cudnn_version

        found["cudnn"] = str(check_cudnn_version())
    except Exception as error:  # noqa: BLE001
        found["cudnn"] = f"unavailable ({type(error).__name__})"
    return found


def compact(rows: list[dict]) -> list[dict]:
    """One line per case and direction: ours' time, and every implementation's TFLOP/s."""
    lines: dict[tuple[str, str], dict] = {}
    for r in rows:
        line = lines.setdefault((r["name"], r["direction"]), {"case": r["name"], "dir": r["direction"]})
        column = "cudnn" if r["impl"].startswith("cudnn") else ("ours" if r["impl"] == "triton" else r["impl"])
        line[column] = r.get("tflops")
        if r["impl"] == "triton":
            line["ours_ms"] = r["median_ms"]
            line["ref_err"] = r.get("rel_err")
    for (name, direction), line in lines.items():
        flex = next((r for r in rows if r["name"] == name and r["direction"] == direction and r["impl"] == "flex"),
                    None)
        ours = line.get("ours_ms")
        if flex is not None and ours:
            line["x_flex"] = flex["median_ms"] / ours
    return list(lines.values())


def summarize(rows: list[dict]) -> dict[str, Any]:
    """Per case and direction: ours' median, each peer's, the speed-up of ours, and the target verdict."""
    cases: dict[tuple[str, str], dict[str, dict]] = {}
    for r in rows:
        cases.setdefault((r["name"], r["direction"]), {})[r["impl"]] = r
    out = {}
    for (name, direction), impls in cases.items():
        ours = impls.get("triton")
        if ours is None:
            continue
        entry = {"ours_ms": round(ours["median_ms"], 4), "ours_tflops": round(ours.get("tflops", 0.0), 1)}
        for impl, r in impls.items():
            if impl != "triton":
                entry[f"{impl}_ms"] = round(r["median_ms"], 4)
                entry[f"speedup_vs_{impl}"] = round(r["median_ms"] / ours["median_ms"], 3)
        if "flex" in impls:
            entry["target_met"] = ours["median_ms"] <= impls["flex"]["median_ms"]
        out[f"{name} {direction}"] = entry
    return out


def merge(path: Path, payload: dict) -> dict:
    """Cases measured now replace the same cases in an existing result; everything else is kept."""
    if not path.exists():
        return payload
    old = json.loads(path.read_text())
    names = {r["name"] for r in payload["rows"]}
    rows = [r for r in old.get("rows", []) if r["name"] not in names] + payload["rows"]
    merged = dict(payload, rows=rows, summary=summarize(rows))
    for key in ("window_sweep", "mask_build"):
        new_names = {r["name"] for r in payload[key]}
        merged[key] = [r for r in old.get(key, []) if r["name"] not in new_names] + payload[key]
    merged["not_run"] = {**{c: r for c, r in old.get("not_run", {}).items()
                            if not any(c.startswith(n + " ") for n in names)}, **payload["not_run"]}
    merged["failures"] = payload["failures"]
    return merged


if __name__ == "__main__":
    main()
