"""Benchmark ejk_lite.blocksparse_attention: the race against cuDNN, FlexAttention, Pallas and XLA.

bf16, forward and forward + backward (gradients of q, k, v for a random output cotangent), on

* masks: ``causal``; ``window`` = causal + sliding window 1024 (``left 1024, right 0``: query
  ``i`` sees keys ``i - 1024 .. i``); ``documents`` = 8 packed documents of random lengths per
  batch row (fixed seed) + causal;
* shapes: B4 Hq16 Hkv16 T8192 D128, B4 Hq16 Hkv4 T8192 D128 (grouped heads), B1 Hq16 Hkv16
  T32768 D128.

Peers (``peers.ATTENTION``), each at its strongest, in the same process on the same inputs:

* ``cudnn``: ``jax.nn.dot_product_attention(implementation="cudnn")`` on [B, T, H, D] (transposed
  outside the timed region): ``is_causal=True``, the window as ``local_window_size=(1024, 0)``.
  The public API has no segment ids; documents go through cuDNN's packed (ragged) layout, the
  internal ``jax._src.cudnn.fused_attention_stablehlo.dot_product_attention`` with per-document
  lengths and offsets (``cudnn_packed``), or, if that cannot run, the public API with a dense
  boolean mask (``cudnn_mask``);
* ``flex``: PyTorch ``torch.compile(flex_attention)`` with ``create_block_mask`` (128 x 128
  blocks, ``_compile=True``) for the same mask, ``enable_gqa`` for grouped heads;
* ``pallas_mha``: ``jax.experimental.pallas.ops.gpu.attention.mha`` on [B, T, H, D], causal, and
  documents through its ``segment_ids`` (no window; grouped heads: K/V repeated inside the timed
  function); the backward's block sizes are the faster of the default (32) and 64;
* ``xla_sdpa`` (``jax.nn.dot_product_attention(implementation="xla")``) and ``xla_einsum`` (a
  plain einsum-softmax-einsum in [B, H, T, D] with the mask computed from iotas and segment ids),
  where the B x H x T x S float32 logits fit (not at T=32768: 64 GiB).

Work, two counts (both in the JSON, the same count for every implementation of a case):

* ``tflops`` (FlexAttention's convention): visited (q-block, kv-block) pairs of the mask at
  128 x 128 blocks, summed over batch rows and query heads, x 128 x 128 x 4 x D (two matmuls, 2
  flops a multiply-add); forward + backward = 3.5 x forward (FlashAttention's convention:
  backward = 2.5 x);
* ``tflops_dense_equiv``: visible (query, key) token pairs x 4 x D (x 3.5): the work a kernel that
  skipped every masked pair would do. Its ratio to ``tflops`` is the useful share of the visited
  tiles.

Checks (the script exits non-zero, after writing the JSON, if any fails), within bf16's tolerance
(``ejk_lite.testing``, the tests' own): ours against the float32 dense reference
(``ejk_lite.attention.reference``, highest matmul precision, from the same bf16 inputs) on a
slice: the first ``max(2, G)`` query heads (one whole group) and the first and last 512 queries
(positions passed explicitly); gradients with the cotangent restricted to that slice, so that
ours (at the timed shape, the timed function) and the reference compute the same dq, dk, dv.
Every peer against ours on the full output and full gradients. Relative L2 errors, float32, on
the device.

The masks ours is given are built once per case (as FlexAttention's are) with ``make_block_mask``
at ours' forward block sizes, keeping the backward's (``BlockMask.keeping``); ``causal=False`` in
the call, as the mask carries its rule. Causal and window masks have no positions: the kernels
then take a token's index for its position and load none, as FlexAttention's ``mask_mod``
compares indices. The build is timed apart (``mask_build``) from arrays passed to ``jit``: the
segment ids, or ``arange`` positions for causal and window (a mask built from constants alone
would be folded by XLA at compile time, and never timed).

Also recorded: ``make_block_mask`` time under ``jit`` for every race mask and for documents +
causal + window 1024 at B=8, T=S=32768, 128 x 128 (``mask_build``), FlexAttention's
``create_block_mask`` time for its masks, and ``window_sweep``: ours' forward at B4 H16 T8192 for
windows 512 ... 4096 and causal, against the number of visited blocks (time should follow them).

Timing: device time from the profiler (``common.device_samples_ms``), >= 10 samples, each after an
L2 flush; min / median / max per figure (``common.time_stats_ms``); compilation and autotuning
happen before. Progress lines carry the elapsed time; the JSON is rewritten after every case, so
a run cut short keeps what it measured.

    python bench/attention.py --out bench/results                  # GPU (~6 min on an H100)
    python bench/attention.py --out bench/results --shapes 2 --merge   # one shape, merged in
    python bench/attention.py --quick --out /tmp/bench_attention    # tiny shapes, CPU interpreter
"""

from __future__ import annotations

import os
import sys

# JAX takes 75 % of the GPU by default; the XLA peers need more, torch (FlexAttention) ~4 GiB.
os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.85")
if "--quick" in sys.argv[1:]:
    # --quick is for CPUs, where XLA's LLVM optimisation of make_block_mask takes 30-100 s a
    # compile (level 0: 2-4 s); the code it makes only has to be right, not fast.
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                               + " --xla_backend_optimization_level=0").strip()

import dataclasses  # noqa: E402
import functools  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import ejk_lite  # noqa: E402

if ejk_lite.ON_GPU and hasattr(ejk_lite.launch, "_import_jax_triton"):
    # jax-triton first (through ejk_lite), as bench/recurrent.py does before torch's Triton kernels.
    ejk_lite.launch._import_jax_triton()
import peers  # noqa: E402
from common import (  # noqa: E402
    Run,
    ceilings,
    commit,
    compare,
    forward_and_backward,
    matmul_tflops,
    parse_args,
    past_tolerance,
    print_table,
    relative_error,
    row,
    time_stats_ms,
    tolerance,
    wall_ms,
    worst,
    write_result,
)
from ejk_lite.attention import BlockSizes, reference  # noqa: E402

OP = "attention"
DTYPE = jnp.bfloat16
N_DOCS = 8
SHAPES = [dict(batch=4, heads=16, kv_heads=16, seq_len=8192, dim=128),
          dict(batch=4, heads=16, kv_heads=4, seq_len=8192, dim=128),
          dict(batch=1, heads=16, kv_heads=16, seq_len=32768, dim=128)]
QUICK_SHAPES = [  # one batch and length, so that both shapes reuse the compiled mask builders
    dict(batch=2, heads=2, kv_heads=2, seq_len=256, dim=32),
    dict(batch=2, heads=2, kv_heads=1, seq_len=256, dim=32)]
GPU = dict(window=1024, sweep=[512, 1024, 2048, 4096, None], check_queries=1024, samples=10,
           build=dict(batch=8, seq_len=32768, window=1024), count_block=128, check_pairs=False)
QUICK = dict(window=64, sweep=[64, None], check_queries=64, samples=3,
             build=dict(batch=2, seq_len=512, window=64), count_block=64,
             check_pairs=True)  # visible pairs: the closed form against the dense token mask
TOL = {"out": tolerance(DTYPE), "grad": tolerance(DTYPE, gradient=True)}  # vs reference or ours


# ----------------------------------------------------------------------------------------------
# Masks: what each case means, its block counts, its visible pairs.
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Mask:
    key: str  # "causal" | "window" | "documents" | "window<w>" (sweep)
    label: str
    window: tuple[int, int] | None  # (left, right)
    documents: bool


def race_masks(window: int) -> list[Mask]:
    return [Mask("causal", "causal", None, False),
            Mask("window", f"causal + sliding window (left {window}, right 0)", (window, 0), False),
            Mask("documents", f"{N_DOCS} packed documents (random lengths, fixed seed) + causal",
                 None, True)]


def make_documents(seed: int, batch: int, seq_len: int, n_docs: int = N_DOCS) -> np.ndarray:
    """Segment ids ``[batch, seq_len]`` int32: ``n_docs`` contiguous documents of random lengths
    per row."""
    rng = np.random.default_rng(seed)
    ids = np.empty((batch, seq_len), np.int32)
    for b in range(batch):
        cuts = np.sort(rng.choice(np.arange(1, seq_len), n_docs - 1, replace=False))
        ids[b] = np.searchsorted(cuts, np.arange(seq_len), side="right")
    return ids


def rule_kwargs(mask: Mask, seg: jax.Array | None) -> dict[str, Any]:
    kw: dict[str, Any] = dict(causal=True)
    if mask.window is not None:
        kw["sliding_window"] = mask.window
    if mask.documents:
        kw.update(q_segment_ids=seg, kv_segment_ids=seg)
    return kw


@functools.lru_cache(maxsize=None)
def build_fn(mask: Mask, seq_len: int, q_block: int, kv_block: int, keep: tuple = (),
             positions: bool = True):
    """A jitted ``make_block_mask`` for ``mask`` (one per mask and size: jit's cache is reused),
    also holding its lists at each block size in ``keep`` (``BlockMask.keeping``).

    Its arguments are the segment ids (documents) or ``arange`` positions ``[1, T]`` (causal,
    window), so that every mask has an array input: a mask built from constants alone would be
    folded by XLA at compile time, and its build would not be timed at all. ``positions=False``
    leaves causal and window masks without positions (the argument unused): their rule then
    says that a token's position is its index, which the kernels compute rather than load, as
    FlexAttention's ``mask_mod`` compares indices. The race times the build with them and
    attends with the mask built without.
    """
    def build(ids):
        kw = rule_kwargs(mask, ids if mask.documents else None)
        if not mask.documents and positions:
            kw.update(q_positions=ids, kv_positions=ids)
        built = ejk_lite.make_block_mask(seq_len, seq_len, q_block=q_block, kv_block=kv_block, **kw)
        return built.keeping(*keep)

    return jax.jit(build)


def build_arg(mask: Mask, seg: jax.Array, seq_len: int) -> jax.Array:
    return seg if mask.documents else jnp.arange(seq_len, dtype=jnp.int32)[None]


def visited_blocks(block_mask, batch: int, heads: int) -> int:
    """Visited tiles summed over batch rows and query heads (``kinds`` broadcasts over 1-sized
    axes)."""
    kinds = np.asarray(block_mask.kinds)
    bm, hm = kinds.shape[:2]
    return int(np.count_nonzero(kinds)) * (batch // bm) * (heads // hm)


def key_intervals(mask: Mask, seg: np.ndarray | None, batch: int, seq_len: int
                  ) -> tuple[np.ndarray, np.ndarray]:
    """Each query's visible keys, ``lo .. q`` (contiguous documents, causal, optional left
    window): ``lo`` ``[batch, T]`` and ``q`` ``[T]``."""
    q = np.arange(seq_len, dtype=np.int64)
    if seg is None:
        starts = np.zeros((batch, seq_len), np.int64)
    else:
        new_doc = np.concatenate([np.ones((seg.shape[0], 1), bool), seg[:, 1:] != seg[:, :-1]], 1)
        starts = np.maximum.accumulate(np.where(new_doc, q[None], 0), axis=1)
    lo = starts if mask.window is None else np.maximum(starts, q[None] - mask.window[0])
    return lo, q


def visible_pairs(mask: Mask, seg: np.ndarray | None, batch: int, seq_len: int) -> int:
    """Visible (query, key) pairs summed over batch rows, one head."""
    lo, q = key_intervals(mask, seg, batch, seq_len)
    return int(np.sum(q[None] - lo + 1))


def count_blocks(mask: Mask, seg: np.ndarray | None, batch: int, seq_len: int, q_block: int,
                 kv_block: int) -> int:
    """Visited (q-block, kv-block) tiles summed over batch rows, one head, computed in NumPy from
    the key intervals (independent of the library's builder): a tile is visited iff some query of
    the q-block sees some key of the kv-block."""
    lo, q = key_intervals(mask, seg, batch, seq_len)
    n_q, n_k = -(-seq_len // q_block), -(-seq_len // kv_block)
    rows = q // q_block
    total = 0
    for b in range(lo.shape[0]):
        cover = np.zeros((n_q, n_k + 1), np.int64)  # +1 at a query's first block, -1 after its last
        np.add.at(cover, (rows, lo[b] // kv_block), 1)
        np.add.at(cover, (rows, q // kv_block + 1), -1)
        total += int(np.count_nonzero(np.cumsum(cover, axis=1)[:, :n_k]))
    return total


# ----------------------------------------------------------------------------------------------
# Ours, and its check against the float32 dense reference.
# ----------------------------------------------------------------------------------------------


def ours_call(qkv, block_mask):
    # A prebuilt BlockMask carries its rule: causal=False so that no second rule is combined.
    return ejk_lite.blocksparse_attention(*qkv, qkv_layouts=block_mask, causal=False)


OURS_FWD, OURS_FWD_BWD = forward_and_backward(ours_call)  # (q, k, v), [d_o,] block_mask


def check_slice(shape: dict, check_queries: int) -> tuple[int, int, np.ndarray]:
    """Query heads, key/value heads and query indices the reference check covers."""
    group = shape["heads"] // shape["kv_heads"]
    heads = min(shape["heads"], max(2, group))
    heads = -(-heads // group) * group  # whole groups
    T = shape["seq_len"]
    half = min(check_queries, T) // 2
    index = np.unique(np.concatenate([np.arange(half), np.arange(T - half, T)]))
    return heads, heads // group, index


def reference_check(shape, mask, qkv, d_o, seg, o_full, block_mask, check_queries
                    ) -> dict[str, float]:
    """Ours (full shape, the timed functions) against the float32 dense reference on a slice:
    ``out``, and ``dq``, ``dk``, ``dv`` unless ``d_o`` is None."""
    hq, hkv, index = check_slice(shape, check_queries)
    B, T = shape["batch"], shape["seq_len"]
    idx = jnp.asarray(index)
    q, k, v = qkv
    sliced = (q[:, :hq][:, :, idx], k[:, :hkv], v[:, :hkv])
    pos = jnp.broadcast_to(idx.astype(jnp.int32)[None], (B, idx.shape[0]))
    kw: dict[str, Any] = dict(causal=True, q_positions=pos, kv_positions=jnp.broadcast_to(
        jnp.arange(T, dtype=jnp.int32)[None], (B, T)))
    if mask.window is not None:
        kw["sliding_window"] = mask.window
    if mask.documents:
        kw.update(q_segment_ids=seg[:, idx], kv_segment_ids=seg)
    ref_fwd, ref_fwd_bwd = forward_and_backward(lambda x: reference(*x, **kw))
    wide = tuple(x.astype(jnp.float32) for x in sliced)
    with jax.default_matmul_precision("highest"):
        if d_o is None:
            return {"out": relative_error(o_full[:, :hq][:, :, idx], ref_fwd(wide))}
        d_os = d_o[:, :hq][:, :, idx]
        ref_o, ref_grads = ref_fwd_bwd(wide, d_os.astype(jnp.float32))
    # The cotangent restricted to the slice: the other rows pass nothing to dk and dv.
    d_o_slice = jnp.zeros_like(d_o).at[:, :hq, idx].set(d_os)
    _, (dq, dk, dv) = OURS_FWD_BWD(qkv, d_o_slice, block_mask)
    ours = dict(q=dq[:, :hq][:, :, idx], k=dk[:, :hkv], v=dv[:, :hkv])
    return compare(o_full[:, :hq][:, :, idx], ours, ref_o, dict(zip("qkv", ref_grads)))


# ----------------------------------------------------------------------------------------------
# The race.
# ----------------------------------------------------------------------------------------------


def shape_name(shape: dict) -> str:
    return (f"B{shape['batch']} Hq{shape['heads']} Hkv{shape['kv_heads']} T{shape['seq_len']} "
            f"D{shape['dim']}")


def make_inputs(shape: dict, seed: int):
    """q, k, v and the output's cotangent, [B, H, T, D] bf16 fresh normals."""
    B, H, Hkv, T, D = (shape[k] for k in ("batch", "heads", "kv_heads", "seq_len", "dim"))
    kq, kk, kv, kd = jax.random.split(jax.random.key(seed), 4)
    return (jax.random.normal(kq, (B, H, T, D), DTYPE),
            jax.random.normal(kk, (B, Hkv, T, D), DTYPE),
            jax.random.normal(kv, (B, Hkv, T, D), DTYPE),
            jax.random.normal(kd, (B, H, T, D), DTYPE))


def peer_unavailable(name: str, mask: Mask, shape: dict, torch_missing: str | None) -> str | None:
    """Why a peer cannot run a case at all, decided before trying (None: try it)."""
    if name == "cudnn" and not ejk_lite.ON_GPU:
        return "no GPU (cuDNN needs CUDA)"
    if name == "flex" and torch_missing:
        return torch_missing
    if name == "pallas" and mask.window is not None:
        return "Pallas mha has no sliding window (causal and segment ids only)"
    if name.startswith("xla") and ejk_lite.ON_GPU and (reason := peers.xla_fits(shape)):
        return reason
    return None


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


def race(run: Run, shape: dict, mask: Mask, inputs, seg_np: np.ndarray, cfg: dict, samples: int,
         peer_names: list[str], torch_bundle, torch_missing, memo: dict, rows: list[dict],
         build_rows: list[dict]) -> None:
    """One mask at one shape: ours built, checked and timed, then every peer against ours."""
    B, H, T, D = shape["batch"], shape["heads"], shape["seq_len"], shape["dim"]
    name, count_block = f"{shape_name(shape)} {mask.key}", cfg["count_block"]
    fwd_blocks, bwd_blocks = BlockSizes.forward(D), BlockSizes.backward(D)
    q, k, v, d_o = inputs
    qkv, seg_case = (q, k, v), seg_np if mask.documents else None
    try:
        # The mask: built once (as FlexAttention's is, with what its backward walks), at ours'
        # forward block sizes and kept at the backward's; the build is timed apart (mask_build),
        # from positions given as an array, while the race's mask has none (build_fn).
        keep = ((bwd_blocks.block_q, bwd_blocks.block_kv),)
        build = build_fn(mask, T, fwd_blocks.block_q, fwd_blocks.block_kv, keep)
        ids = build_arg(mask, jnp.asarray(seg_np), T)
        ours_mask = jax.block_until_ready(build_fn(mask, T, fwd_blocks.block_q,
                                                   fwd_blocks.block_kv, keep,
                                                   positions=False)(ids))
        build_stats = time_stats_ms(lambda: build(ids), samples)
        build_rows.append(dict(name=name, what=f"make_block_mask under jit, {mask.label}, "
                                              "keeping the backward's block sizes",
                               blocks=[fwd_blocks.block_q, fwd_blocks.block_kv],
                               kept_blocks=[[bwd_blocks.block_q, bwd_blocks.block_kv]],
                               batch=B if mask.documents else 1, seq_len=T, **build_stats))
        # Work: tiles counted in NumPy (at 128 x 128 for the FLOPs; at ours' forward blocks to
        # check the library's mask), visible pairs in closed form.
        blocks = count_blocks(mask, seg_case, B, T, count_block, count_block) * H
        blocks_fwd = count_blocks(mask, seg_case, B, T, fwd_blocks.block_q,
                                  fwd_blocks.block_kv) * H
        if (listed := visited_blocks(ours_mask, B, H)) != blocks_fwd:
            run.failures.append(f"{name}: make_block_mask lists {listed} tiles at "
                                f"{fwd_blocks.block_q}x{fwd_blocks.block_kv}, NumPy counts "
                                f"{blocks_fwd}")
        pairs = visible_pairs(mask, seg_case, B, T) * H
        if cfg["check_pairs"]:  # the closed form against the library's own dense mask
            dense = int(np.sum(np.asarray(ours_mask.token_mask())))
            dense *= (B // ours_mask.kinds.shape[0]) * H
            if dense != pairs:
                run.failures.append(f"{name}: visible pairs {pairs} (closed form) != {dense} "
                                    "(token_mask)")
        flops = {"fwd": blocks * count_block * count_block * 4 * D}
        flops["fwd+bwd"] = 3.5 * flops["fwd"]
        dense_flops = {"fwd": pairs * 4 * D, "fwd+bwd": 3.5 * pairs * 4 * D}

        ours_o = OURS_FWD(qkv, ours_mask)
        _, ours_grads = OURS_FWD_BWD(qkv, d_o, ours_mask)
        seg = None if seg_case is None else jnp.asarray(seg_case)
        errors = reference_check(shape, mask, qkv, d_o, seg, ours_o, ours_mask,
                                 cfg["check_queries"])
        run.failures += past_tolerance(errors, DTYPE, f"{name} triton vs the reference")
        ours = {"fwd": time_stats_ms(lambda: OURS_FWD(qkv, ours_mask), samples),
                "fwd+bwd": time_stats_ms(lambda: OURS_FWD_BWD(qkv, d_o, ours_mask), samples)}
    except Exception as error:  # noqa: BLE001 (recorded; the other cases still run)
        traceback.print_exc()
        run.failures.append(f"{name} triton raised {type(error).__name__}: {str(error)[:300]}")
        return

    common = dict(shape=[B, H, shape["kv_heads"], T, D], dtype="bfloat16", mask=mask.key,
                  visited_blocks=blocks, visited_blocks_fwd=blocks_fwd, visible_pairs=pairs,
                  visited_fraction=blocks / (B * H * (-(-T // count_block)) ** 2))
    for direction, st in ours.items():
        rows.append(row(name, "triton", direction, stats=st, flops=flops[direction],
                        rel_err=worst(errors, direction), **common,
                        tflops_dense_equiv=tflops(dense_flops[direction], st["median_ms"]),
                        rel_err_detail=errors, check="float32 dense reference on a slice",
                        mask_build_ms=build_stats["median_ms"],
                        fwd_blocks=[fwd_blocks.block_q, fwd_blocks.block_kv],
                        bwd_blocks=[bwd_blocks.block_q, bwd_blocks.block_kv]))
    run.log(f"  {mask.key:9s} triton  fwd {ours['fwd']['median_ms']:8.3f} ms  fwd+bwd "
            f"{ours['fwd+bwd']['median_ms']:8.3f} ms  ref err {errors}  build "
            f"{build_stats['median_ms']:.3f} ms")

    case = peers.AttentionCase(q, k, v, d_o, mask.window, seg_case, ours_o, ours_grads, samples,
                               memo, torch_bundle)
    for peer in peer_names:
        if run.out_of_time(f"{name} {peer}"):
            continue
        if reason := peer_unavailable(peer, mask, shape, torch_missing):
            run.not_run[f"{name} {peer}"] = reason
            continue
        try:
            result = peers.ATTENTION[peer](case, run.log)
        except Exception as error:  # noqa: BLE001 (a peer that cannot run is reported, not fatal)
            run.not_run[f"{name} {peer}"] = reason = f"{type(error).__name__}: {str(error)[:400]}"
            run.log(f"  {mask.key:9s} {peer}: not run: {reason}")
            gc.collect()
            continue
        run.failures += past_tolerance(result.err, DTYPE, f"{name} {result.impl} vs ours")
        if result.fields.get("flex_visited_blocks", blocks) != blocks:
            run.failures.append(f"{name}: FlexAttention visits "
                                f"{result.fields['flex_visited_blocks']} blocks, ours' mask at "
                                f"{count_block} lists {blocks}: the masks differ")
        for direction, st in result.stats.items():
            rows.append(row(name, result.impl, direction, stats=st, flops=flops[direction],
                            **common, tflops_dense_equiv=tflops(dense_flops[direction],
                                                                st["median_ms"]),
                            rel_err_vs_ours=worst(result.err, direction), rel_err_detail=result.err,
                            speedup_of_ours=st["median_ms"] / ours[direction]["median_ms"],
                            **result.fields))
        run.log(f"  {mask.key:9s} {result.impl:12s} fwd {result.stats['fwd']['median_ms']:8.3f} ms"
                f"  fwd+bwd {result.stats['fwd+bwd']['median_ms']:8.3f} ms  err vs ours "
                f"{ {n: round(e, 5) for n, e in result.err.items()} }")
        del result
        gc.collect()


def sweep(run: Run, shape: dict, qkv, cfg: dict, samples: int) -> list[dict]:
    """Ours' forward over windows (and causal) on one shape: time against visited blocks."""
    B, H, T, D = shape["batch"], shape["heads"], shape["seq_len"], shape["dim"]
    fwd_blocks, count_block = BlockSizes.forward(D), cfg["count_block"]
    found = []
    for w in cfg["sweep"]:
        if run.out_of_time(f"sweep window {w}"):
            continue
        mask = (Mask("causal", "causal", None, False) if w is None
                else Mask(f"window{w}", f"causal + window (left {w}, right 0)", (w, 0), False))
        try:
            build = build_fn(mask, T, fwd_blocks.block_q, fwd_blocks.block_kv, positions=False)
            ours_mask = jax.block_until_ready(build(build_arg(mask, None, T)))  # as the race's
            blocks = count_blocks(mask, None, B, T, count_block, count_block) * H
            blocks_fwd = count_blocks(mask, None, B, T, fwd_blocks.block_q,
                                      fwd_blocks.block_kv) * H
            if (listed := visited_blocks(ours_mask, B, H)) != blocks_fwd:
                run.failures.append(f"sweep window {w}: make_block_mask lists {listed} tiles, "
                                    f"NumPy counts {blocks_fwd}")
            err = reference_check(shape, mask, qkv, None, None, OURS_FWD(qkv, ours_mask), ours_mask,
                                  cfg["check_queries"])
            run.failures += past_tolerance(err, DTYPE, f"sweep window {w}")
            st = time_stats_ms(lambda: OURS_FWD(qkv, ours_mask), samples)
        except Exception as error:  # noqa: BLE001
            traceback.print_exc()
            run.failures.append(f"sweep window {w} raised {type(error).__name__}: "
                                f"{str(error)[:300]}")
            continue
        found.append(dict(name=f"{shape_name(shape)} {mask.key}",
                          window="causal" if w is None else w,
                          visited_blocks=blocks, visited_blocks_fwd=blocks_fwd,
                          visible_pairs=visible_pairs(mask, None, B, T) * H,
                          ms_per_1k_blocks=st["median_ms"] / blocks * 1e3,
                          tflops=tflops(blocks * count_block ** 2 * 4 * D, st["median_ms"]),
                          rel_err=err["out"], **st))
        run.log(f"  sweep {str(w):>6s}: {blocks} blocks, {st['median_ms']:.3f} ms")
    return found


def time_issue8_build(cfg: dict, samples: int) -> dict[str, Any]:
    """``make_block_mask`` under jit for documents + causal + window at B8 T=S=32768, 128 x 128."""
    B, T, W = (cfg["build"][k] for k in ("batch", "seq_len", "window"))
    seg = jnp.asarray(make_documents(seed=7, batch=B, seq_len=T))
    build = build_fn(Mask("documents+window", f"documents + causal + window {W}", (W, 0), True),
                     T, 128, 128)
    return dict(name=f"B{B} T=S={T} documents+causal+window{W}",
                what=f"make_block_mask under jit, {N_DOCS} documents + causal + window ({W}, 0), "
                     "128x128 blocks",
                blocks=[128, 128], batch=B, seq_len=T, **time_stats_ms(lambda: build(seg), samples))


# ----------------------------------------------------------------------------------------------
# The results file: summary, merge, what the figures mean.
# ----------------------------------------------------------------------------------------------


def by_case(rows: list[dict]) -> dict[tuple[str, str], dict[str, dict]]:
    """``{(name, direction): {impl: row}}``."""
    cases: dict[tuple[str, str], dict[str, dict]] = {}
    for r in rows:
        cases.setdefault((r["name"], r["direction"]), {})[r["impl"]] = r
    return cases


def summarize(rows: list[dict]) -> dict[str, Any]:
    """Per case and direction: ours' median, each peer's, the speed-up of ours, and the target
    verdict."""
    out = {}
    for (name, direction), impls in by_case(rows).items():
        if (ours := impls.get("triton")) is None:
            continue
        entry = {"ours_ms": round(ours["median_ms"], 4),
                 "ours_tflops": round(ours.get("tflops", 0.0), 1)}
        for impl, r in impls.items():
            if impl != "triton":
                entry[f"{impl}_ms"] = round(r["median_ms"], 4)
                entry[f"speedup_vs_{impl}"] = round(r["median_ms"] / ours["median_ms"], 3)
        if "flex" in impls:
            entry["target_met"] = ours["median_ms"] <= impls["flex"]["median_ms"]
        out[f"{name} {direction}"] = entry
    return out


def compact(rows: list[dict]) -> list[dict]:
    """One line per case and direction: ours' time, and every implementation's TFLOP/s."""
    lines = []
    for (name, direction), impls in by_case(rows).items():
        line = {"case": name, "dir": direction}
        for impl, r in impls.items():
            column = "cudnn" if impl.startswith("cudnn") else ("ours" if impl == "triton" else impl)
            line[column] = r.get("tflops")
        if (ours := impls.get("triton")) is not None:
            line.update(ours_ms=ours["median_ms"], ref_err=ours.get("rel_err"))
            if "flex" in impls:
                line["x_flex"] = impls["flex"]["median_ms"] / ours["median_ms"]
        lines.append(line)
    return lines


def merge(path: Path, payload: dict) -> dict:
    """Cases measured now replace the same cases in an existing result; everything else is kept."""
    if not path.exists():
        return payload
    old = json.loads(path.read_text())
    # A run's payload has no commit and no command yet (write_result adds them): compare with
    # the ones it will get. (A whole result file, merged by hand, has its own.)
    this_commit = payload.get("commit") or commit()
    command = payload.get("command") or " ".join(sys.argv)
    if old.get("commit") != this_commit:
        raise SystemExit(f"--merge: {path} is of commit {old.get('commit')}, this run of "
                         f"{this_commit}; one file holds one commit's figures")
    names = {r["name"] for r in payload["rows"]}
    rows = [r for r in old.get("rows", []) if r["name"] not in names] + payload["rows"]
    merged = dict(payload, rows=rows, summary=summarize(rows))
    for key in ("window_sweep", "mask_build"):
        new_names = {r["name"] for r in payload[key]}
        merged[key] = [r for r in old.get(key, []) if r["name"] not in new_names] + payload[key]
    merged["not_run"] = {**{c: r for c, r in old.get("not_run", {}).items()
                            if not any(c.startswith(n + " ") for n in names)}, **payload["not_run"]}
    merged["failures"] = payload["failures"]
    # save() merges after every case, into the file it wrote after the case before: this run's
    # command once, last.
    merged["commands"] = [c for c in old.get("commands", [old["command"]]) if c != command] + [
        command]
    return merged


NOTES = ("bf16 inputs; ours (impl 'triton') is called with a BlockMask prebuilt at its forward "
         "block sizes and keeping its lists at the backward's (BlockMask.keeping; qkv_layouts=, "
         "causal=False), as FlexAttention is given its prebuilt BlockMask, which holds what its "
         "backward walks: no mask is built inside a timed call. Causal and window masks have no "
         "positions (the kernels compare indices, as FlexAttention's mask_mod). mask_build "
         "holds make_block_mask times with the segment ids or arange positions passed to jit, "
         "so that XLA cannot fold a build into a constant. Peer errors are measured against ours; "
         "ours against the float32 dense reference on a slice (first max(2, G) query heads, first "
         "and last half of check queries). XLA peers are skipped where the float32 logits exceed "
         f"{peers.XLA_LOGITS_LIMIT / 2**30:.0f} GiB. Pallas mha has no window; with grouped heads "
         "its K/V are repeated inside the timed function. cuDNN takes documents through its "
         "packed layout (an internal JAX API) or, failing that, a dense mask.")


def definitions(count_block: int) -> dict[str, str]:
    return dict(
        tflops=(f"visited (q-block, kv-block) pairs of the mask at {count_block}x{count_block} "
                f"(FlexAttention's convention), summed over batch rows and query heads, "
                f"x {count_block}*{count_block} x 4 x D; "
                "fwd+bwd = 3.5 x fwd (backward = 2.5 x forward, FlashAttention's convention); the "
                "same count for every implementation of a case"),
        tflops_dense_equiv="visible (query, key) token pairs x 4 x D (x 3.5 for fwd+bwd)",
        visited_blocks=f"tiles at {count_block}x{count_block}, summed over batch rows and query "
                       "heads",
        visited_blocks_fwd="the same at ours' forward block sizes (block_q x block_kv)",
        rel_err=("triton rows: against the float32 dense reference on a slice (fwd: output; "
                 "fwd+bwd: the worst of dq, dk, dv); peer rows: rel_err_vs_ours on the full output "
                 "/ gradients"),
        timing="device time from the profiler (kernels summed) after an L2 flush; min / median / "
               "max over `samples` samples",
    )


def main():
    def extra(parser):
        parser.add_argument("--shapes", default=None,
                            help="comma-separated indices into the shape list (default: all)")
        parser.add_argument("--masks", default="causal,window,documents",
                            help="comma-separated mask keys")
        parser.add_argument("--peers", default=",".join(peers.ATTENTION),
                            help="comma-separated peers to run")
        parser.add_argument("--samples", type=int, default=None, help="timed samples per figure")
        parser.add_argument("--no-sweep", action="store_true", help="skip the window sweep")
        parser.add_argument("--no-build", action="store_true",
                            help="skip the B=8 T=32768 mask-building timing")
        parser.add_argument("--budget-s", type=float, default=None,
                            help="start nothing new after this many seconds (default 480 on a "
                                 "GPU, none with --quick)")
        parser.add_argument("--merge", action="store_true",
                            help="merge into an existing attention.json (cases of this run "
                                 "replace theirs)")

    args = parse_args(__doc__.splitlines()[0], extra)
    cfg = QUICK if args.quick else GPU
    samples = args.samples or cfg["samples"]
    all_shapes = QUICK_SHAPES if args.quick else SHAPES
    shapes = all_shapes if args.shapes is None else [all_shapes[int(i)]
                                                     for i in args.shapes.split(",")]
    masks = [m for m in race_masks(cfg["window"]) if m.key in args.masks.split(",")]
    peer_names = [p for p in args.peers.split(",") if p]
    for p in peer_names:
        if p not in peers.ATTENTION:
            raise SystemExit(f"unknown peer {p!r}; choose from {sorted(peers.ATTENTION)}")
    run = Run(args.budget_s if args.budget_s is not None else (None if args.quick else 480.0))

    torch_bundle, torch_missing = (peers.load_flex() if "flex" in peer_names
                                   else (None, "not requested"))
    run.log(f"device {jax.devices()[0]}, torch: {'ok' if torch_bundle else torch_missing}")
    copy_gbs, dispatch_ms = ceilings()
    # bf16 matmul TFLOP/s (8192^3 on the GPU, the best of several XLA products, each recorded
    # with the results): the compute ceiling beside the figures.
    matmul = matmul_tflops(256 if args.quick else 8192,
                           timer=None if ejk_lite.ON_GPU else wall_ms)
    run.log(f"ceilings: copy {copy_gbs:.0f} GB/s, dispatch {dispatch_ms:.3f} ms, bf16 matmul "
            f"{matmul:.0f} TFLOP/s")
    rows: list[dict] = []
    sweep_rows: list[dict] = []
    build_rows: list[dict] = []
    versions = peers.attention_versions(torch_bundle)

    def save(partial: bool) -> Path:
        payload = dict(
            quick=args.quick, partial=partial, copy_bandwidth_gbs=copy_gbs,
            dispatch_overhead_ms=dispatch_ms, matmul_bf16_tflops=matmul, peer_versions=versions,
            target=("at least FlexAttention's speed on every mask, forward and forward+backward; "
                    "time proportional to the visited blocks (window_sweep)"),
            definitions=definitions(cfg["count_block"]), tolerance=TOL,
            masks={m.key: m.label for m in race_masks(cfg["window"])},
            summary=summarize(rows), not_run=run.not_run, failures=run.failures, rows=rows,
            window_sweep=sweep_rows, mask_build=build_rows, notes=NOTES)
        if args.merge:
            payload = merge(Path(args.out) / f"{OP}.json", payload)
        return write_result(args.out, OP, payload)

    # First: one build, cheap, which a run cut short by its time budget would otherwise lose.
    if not args.no_build and not run.out_of_time("mask build (issue 8)"):
        try:
            build_rows.append(time_issue8_build(cfg, samples))
            run.log(f"mask build {build_rows[-1]['what']}: {build_rows[-1]['median_ms']:.3f} ms")
        except Exception as error:  # noqa: BLE001
            traceback.print_exc()
            run.failures.append(f"mask build (issue 8) raised {type(error).__name__}: "
                                f"{str(error)[:300]}")

    for shape in shapes:
        index = all_shapes.index(shape)  # seeds follow the shape, whichever subset runs
        D = shape["dim"]
        inputs = make_inputs(shape, seed=index)
        seg_np = make_documents(seed=1000 + index, batch=shape["batch"], seq_len=shape["seq_len"])
        run.log(f"== {shape_name(shape)}  (ours: forward blocks "
                f"{BlockSizes.forward(D).block_q}x{BlockSizes.forward(D).block_kv}, backward "
                f"{BlockSizes.backward(D).block_q}x{BlockSizes.backward(D).block_kv})")
        memo: dict = {}  # what a peer found on the shape's first mask (Pallas' backward blocks)
        for mask in masks:
            if not run.out_of_time(f"{shape_name(shape)} {mask.key} (all)"):
                race(run, shape, mask, inputs, seg_np, cfg, samples, peer_names, torch_bundle,
                     torch_missing, memo, rows, build_rows)
                gc.collect()
                save(partial=True)
        if index == 0 and not args.no_sweep:
            sweep_rows += sweep(run, shape, inputs[:3], cfg, samples)
            save(partial=True)
        del inputs
        gc.collect()

    run.log(f"wrote {save(partial=False)}")
    reasons: dict[str, list[str]] = {}
    for case, reason in run.not_run.items():
        reasons.setdefault(reason, []).append(case)
    if reasons:
        print("not run:")
    for reason, cases in reasons.items():
        print(f"  {reason}: {len(cases)} case(s), e.g. {cases[0]}")
    if sweep_rows:
        print_table(sweep_rows, ["name", "visited_blocks", "median_ms", "min_ms", "max_ms",
                                 "ms_per_1k_blocks", "rel_err"])
    if build_rows:
        print_table(build_rows, ["name", "batch", "seq_len", "median_ms", "min_ms", "max_ms"])
    if rows:
        print(f"TFLOP/s (visited {cfg['count_block']}x{cfg['count_block']} blocks; "
              f"dense-equivalent figures in the JSON), medians of {samples} samples; x_flex = "
              "FlexAttention's time / ours")
        print_table(compact(rows), ["case", "dir", "ours_ms", "ours", "cudnn", "flex",
                                    "pallas_mha", "xla_sdpa", "xla_einsum", "x_flex", "ref_err"])
    run.finish()


if __name__ == "__main__":
    main()
