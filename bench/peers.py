"""The peers our kernels race, each at its strongest, and the bridge to those that run in PyTorch.

* PyTorch: :func:`to_torch` / :func:`from_torch` (DLPack, on the device, copied) and
  :func:`torch_race`, which times a torch function forward and forward + backward with the same
  device timer as ours (``common.device_samples_ms``) and hands its results back as JAX arrays,
  so that every error is computed by the one metric (``common.relative_error``);
* flash-linear-attention's chunk and fused recurrent kernels (:func:`load_fla`, :func:`fla_race`);
* attention: cuDNN, FlexAttention, JAX's Pallas ``mha``, XLA's ``dot_product_attention`` and a
  plain einsum (:data:`ATTENTION`), each a function of an :class:`AttentionCase`;
* mean pooling over packed sequences in plain JAX: :func:`cumsum_mean`, :func:`onehot_mean`.

The torch peers only run on a GPU: on a CPU their loaders say why not, and the scripts record it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

import ejk_lite
from common import device_samples_ms, forward_and_backward, relative_error, spread, \
    time_stats_ms, tolerance

# ----------------------------------------------------------------------------------------------
# PyTorch: the bridge, and a race of a torch function.
# ----------------------------------------------------------------------------------------------


def to_torch(torch: Any, x: jax.Array) -> Any:
    """A JAX array as a torch tensor on the same device (DLPack), copied: torch owns its memory."""
    return torch.from_dlpack(jax.block_until_ready(x)).clone()


def from_torch(t: Any) -> jax.Array:
    """A torch tensor as a JAX array on the same device (DLPack) of a fresh torch copy, that JAX
    alone holds. (``from_dlpack(..., copy=True)`` is refused by the GPU's PJRT plugin: "PJRT C API
    does not support HostBufferSemantics other than ...", H100, jax 0.11.2.)"""
    import torch

    copy = t.detach().contiguous().clone()
    torch.cuda.synchronize()  # the copy is finished before JAX reads it
    return jax.dlpack.from_dlpack(copy)


def torch_race(torch: Any, call: Callable[[dict], Any], inputs: dict[str, jax.Array],
               d_o: jax.Array, samples: int, forward_only: bool = False
               ) -> tuple[jax.Array, dict[str, jax.Array] | None, dict]:
    """``call(tensors)`` on torch copies of ``inputs``: its output and the gradient of every input
    for the cotangent ``d_o`` (as JAX arrays), and its times ``{"fwd": ..., "fwd+bwd": ...}``
    (:func:`common.spread` of device times; the forward under ``no_grad``). ``forward_only``:
    the output and ``{"fwd": ...}``, gradients None."""
    tensors = {name: to_torch(torch, x) for name, x in inputs.items()}
    d_o_t = to_torch(torch, d_o)
    with torch.no_grad():
        out = from_torch(call(tensors))
        fwd = spread(device_samples_ms(lambda: call(tensors), samples))
    if forward_only:
        del tensors, d_o_t
        torch.cuda.empty_cache()
        return out, None, {"fwd": fwd}
    leaves = {name: t.detach().requires_grad_(True) for name, t in tensors.items()}

    def forward_backward():
        call(leaves).backward(d_o_t)

    forward_backward()
    grads = {name: from_torch(t.grad) for name, t in leaves.items()}
    fwd_bwd = spread(device_samples_ms(forward_backward, samples,
                                       grad_to_none=list(leaves.values())))
    del leaves, tensors, d_o_t
    torch.cuda.empty_cache()
    return out, grads, {"fwd": fwd, "fwd+bwd": fwd_bwd}


# ----------------------------------------------------------------------------------------------
# flash-linear-attention (PyTorch), on a GPU where it is installed.
# ----------------------------------------------------------------------------------------------

#: fla's kernel racing each of ours ("chunked": ejk_lite.chunked_recurrent, "recurrent":
#: ejk_lite.recurrent), by gate: "g" a scalar gate [B, T, H], "gk" a per-key gate [B, T, H, K].
FLA = {("chunked", "g"): "fla.ops.simple_gla.chunk_simple_gla",
       ("chunked", "gk"): "fla.ops.gla.chunk_gla",
       ("recurrent", "g"): "fla.ops.simple_gla.fused_recurrent_simple_gla",
       ("recurrent", "gk"): "fla.ops.gla.fused_recurrent_gla"}
FLA_BROADCAST = "fla.ops.gla.chunk_gla, the scalar gate broadcast along K"


def load_fla() -> tuple[dict | None, str | None]:
    """``({"torch", "kernels", "versions"}, None)``, or ``(None, why not)``."""
    if not ejk_lite.ON_GPU:
        return None, "no GPU (fla's kernels run in PyTorch on CUDA)"
    try:
        import fla
        import torch
        from fla.ops.gla import chunk_gla, fused_recurrent_gla
        from fla.ops.simple_gla import chunk_simple_gla, fused_recurrent_simple_gla
    except Exception as error:  # noqa: BLE001 (not installed, or no CUDA torch)
        return None, f"{type(error).__name__}: {error}"
    if not torch.cuda.is_available():
        return None, "torch sees no CUDA device"
    kernels = {("chunked", "g"): chunk_simple_gla, ("chunked", "gk"): chunk_gla,
               ("recurrent", "g"): fused_recurrent_simple_gla,
               ("recurrent", "gk"): fused_recurrent_gla}
    versions = {"torch": torch.__version__, "fla": getattr(fla, "__version__", "?")}
    return dict(torch=torch, kernels=kernels, versions=versions), None


def gla_inputs(seed: int, batch: int, seq_len: int, heads: int, dim: int, gate: str | None,
               kv_heads: int | None = None, strong: bool = False
               ) -> tuple[dict[str, jax.Array], jax.Array]:
    """What ours and fla's kernels both take, bf16 fresh normals: ``query`` ``[B, T, H, K]``,
    ``key`` and ``value`` (``kv_heads`` heads), and a log-decay gate, ``g`` ``[B, T, H]`` or
    ``gk`` ``[B, T, H, K]`` (``gate`` None: none); and a cotangent of the output. ``strong``:
    ``log_sigmoid`` of ``N(0, 1)`` instead, -0.8 a token, every chunk of 64 past
    ``ChunkedConfig.fast_decay`` (20)."""
    kq, kk, kv, kg, kd = jax.random.split(jax.random.key(seed), 5)
    shape = (batch, seq_len, heads, dim)
    kv_shape = (batch, seq_len, kv_heads or heads, dim)
    inputs = dict(query=jax.random.normal(kq, shape, jnp.bfloat16),
                  key=jax.random.normal(kk, kv_shape, jnp.bfloat16),
                  value=jax.random.normal(kv, kv_shape, jnp.bfloat16))
    if gate is not None:  # log-decays in (-inf, 0), most of them mild, as a trained GLA layer has
        logits = jax.random.normal(kg, shape[:3] if gate == "g" else shape, jnp.float32) + (
            0.0 if strong else 4.0)
        inputs[gate] = jax.nn.log_sigmoid(logits).astype(jnp.bfloat16)
    return inputs, jax.random.normal(kd, shape, jnp.bfloat16)


def prefix(inputs: dict[str, jax.Array], length: int) -> dict[str, jax.Array]:
    """The first ``length`` tokens of each of ``gla_inputs``' arrays."""
    return {name: x[:, :length] for name, x in inputs.items()}


def fla_call(fla: dict, form: str, gate: str | None, scale: float,
             broadcast: bool = False) -> Callable[[dict], Any]:
    """fla's kernel racing ours of ``form`` ("chunked" or "recurrent") as a function of torch
    copies of our inputs (``query``, ``key``, ``value`` and the gate ``gate``: "g", "gk", or None
    for none) that returns the output. fla (>= 0.2, ``[B, T, H, K]`` layouts) takes natural-log
    gates, as ours. ``broadcast``: a scalar gate run through ``chunk_gla`` as a per-key gate equal
    along K (the same function; the gradient of g is the sum of gk's along K)."""
    kernel = fla["kernels"][form, "gk" if broadcast else (gate or "g")]
    # chunk_simple_gla, chunk_gla and fused_recurrent_simple_gla take the gate as g=;
    # fused_recurrent_gla as gk=.
    keyword = "gk" if (form, gate) == ("recurrent", "gk") else "g"

    def call(t):
        gates = {}
        if gate is not None:
            g = t[gate]
            gates[keyword] = g.unsqueeze(-1).expand(*g.shape, t["query"].shape[-1]) if broadcast \
                else g
        return kernel(t["query"], t["key"], t["value"], **gates, scale=scale, initial_state=None,
                      output_final_state=False)[0]

    return call


def fla_race(fla: dict, form: str, gate: str | None, inputs: dict[str, jax.Array], d_o: jax.Array,
             scale: float, samples: int, broadcast: bool = False, forward_only: bool = False):
    """:func:`fla_call`'s kernel on ``inputs``: :func:`torch_race`'s output, gradients and
    times (``forward_only``: the output and the forward's times)."""
    call = fla_call(fla, form, gate, scale, broadcast)
    return torch_race(fla["torch"], call, inputs, d_o, samples, forward_only=forward_only)


# ----------------------------------------------------------------------------------------------
# Attention. Every peer takes an AttentionCase and gives a Result, or raises (then it is recorded
# as not run). Errors are against ours, on the full output and full gradients.
# ----------------------------------------------------------------------------------------------

# Skip the XLA peers when the float32 logits B*H*T*S*4 exceed this (at 16 GiB, B4 H16 T8192, they
# asked for 40 GiB and ran out on the H100: 20 s lost a case, 3d37e18).
XLA_LOGITS_LIMIT = 12 * 2**30


@dataclasses.dataclass
class AttentionCase:
    """One case of the race: ours' inputs and results ([B, H, T, D], bf16), and the mask's rule:
    causal, with an optional ``window`` ``(left, right)`` and ``segment_ids`` (documents)."""
    q: jax.Array
    k: jax.Array
    v: jax.Array
    d_o: jax.Array
    window: tuple[int, int] | None
    segment_ids: np.ndarray | None
    ours_o: jax.Array
    ours_grads: tuple[jax.Array, jax.Array, jax.Array]
    samples: int
    memo: dict  # what a peer found on one mask and keeps for the shape's others
    torch: tuple | None = None  # load_flex()'s bundle, for FlexAttention

    @property
    def group(self) -> int:
        return self.q.shape[1] // self.k.shape[1]

    @property
    def scale(self) -> float:
        return self.q.shape[-1] ** -0.5

    def dense_mask(self) -> jax.Array:
        """The documents as a dense boolean ``[B, 1, T, S]`` (same document)."""
        seg = self.segment_ids
        return jnp.asarray(seg[:, None, :, None] == seg[:, None, None, :])


@dataclasses.dataclass
class Result:
    impl: str
    stats: dict[str, dict]  # "fwd", "fwd+bwd": common.spread
    err: dict[str, float]  # "out", "dq", "dk", "dv": against ours
    fields: dict[str, Any]  # recorded in its rows: "peer" (what ran), and what else it found

    def within_tolerance(self) -> bool:
        return all(e <= tolerance(jnp.bfloat16, gradient=n != "out") for n, e in self.err.items())


def bthd(x: jax.Array) -> jax.Array:
    """[B, H, T, D] <-> [B, T, H, D] (the layout of jax.nn.dot_product_attention and Pallas)."""
    return jnp.swapaxes(x, 1, 2)


def race_jax(case: AttentionCase, impl: str, peer: str, fn: Callable[..., jax.Array],
             extra: tuple = (), layout: Callable[[jax.Array], jax.Array] = bthd, **fields
             ) -> Result:
    """Time and check a JAX peer ``fn(q, k, v, *extra)`` on ``layout``'s inputs (transposed
    outside the timed functions); ``layout`` maps its results back to ours'."""
    args = tuple(layout(x) for x in (case.q, case.k, case.v))
    fwd, fwd_bwd = forward_and_backward(lambda x, *e: fn(*x, *e))
    o = fwd(args, *extra)
    err = {"out": relative_error(layout(o), case.ours_o)}
    del o
    stats = {"fwd": time_stats_ms(lambda: fwd(args, *extra), case.samples)}
    d_o = layout(case.d_o)
    o, grads = fwd_bwd(args, d_o, *extra)
    for name, g, ours in zip(("dq", "dk", "dv"), grads, case.ours_grads):
        err[name] = relative_error(layout(g), ours)
    del o, grads
    stats["fwd+bwd"] = time_stats_ms(lambda: fwd_bwd(args, d_o, *extra), case.samples)
    return Result(impl, stats, err, dict(peer=peer, **fields))


def xla_fits(case_shape: dict) -> str | None:
    """Why the XLA peers' float32 logits do not fit the GPU, or None."""
    s = case_shape
    logits = s["batch"] * s["heads"] * s["seq_len"] ** 2 * 4
    if logits > XLA_LOGITS_LIMIT:
        return f"float32 logits B*H*T*S*4 = {logits / 2**30:.0f} GiB do not fit the GPU"
    return None


def document_lengths(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row: document lengths ``[B, M]`` and start offsets ``[B, M]`` (contiguous documents,
    ids 0 .. M-1)."""
    n = int(ids.max()) + 1
    lengths = np.stack([np.bincount(r, minlength=n) for r in ids]).astype(np.int32)
    starts = np.concatenate([np.zeros((ids.shape[0], 1), np.int32), np.cumsum(lengths, 1)[:, :-1]],
                            1)
    return lengths, starts.astype(np.int32)


def cudnn(case: AttentionCase, log: Callable[[str], None] = print) -> Result:
    """cuDNN through ``jax.nn.dot_product_attention(implementation="cudnn")``; documents through
    its packed layout (an internal JAX API), or, if that fails, the public API with a dense mask."""
    if case.segment_ids is None:
        kw = dict(is_causal=True, scale=case.scale, implementation="cudnn")
        if case.window is not None:
            kw["local_window_size"] = case.window
        window = "" if case.window is None else f", local_window_size={case.window}"
        return race_jax(case, "cudnn", "cuDNN: jax.nn.dot_product_attention("
                        f"implementation='cudnn', is_causal=True{window})",
                        lambda q, k, v: jax.nn.dot_product_attention(q, k, v, **kw))
    # Documents: cuDNN's packed layout (lengths [B, M], offsets [B, M + 1] padded with -1).
    lengths, starts = document_lengths(case.segment_ids)
    seqlen = jnp.asarray(lengths)
    offsets = jnp.asarray(np.concatenate([starts, -np.ones((starts.shape[0], 1), np.int32)], 1))
    try:
        from jax._src.cudnn.fused_attention_stablehlo import MaskType
        from jax._src.cudnn.fused_attention_stablehlo import dot_product_attention as cudnn_dpa

        def packed(q, k, v, seqlen, offsets):
            return cudnn_dpa(q, k, v, None, None, seqlen, seqlen, offsets, offsets,
                             scale=case.scale, mask_type=MaskType.PADDING_CAUSAL, qkv_layout="BTNH")

        result = race_jax(case, "cudnn_packed", "cuDNN packed layout: jax._src.cudnn."
                          "fused_attention_stablehlo.dot_product_attention(q_seqlen, kv_seqlen, "
                          "q_offsets, kv_offsets, mask_type=PADDING_CAUSAL)", packed,
                          (seqlen, offsets))
        if result.within_tolerance():
            return result
        failure = f"packed layout disagrees with ours ({result.err})"
    except Exception as error:  # noqa: BLE001 (internal API: any failure: the public one)
        failure = f"packed layout failed: {type(error).__name__}: {str(error)[:300]}"
    log(f"    cudnn: {failure}; trying the public API with a dense mask")

    def masked(q, k, v, m):
        return jax.nn.dot_product_attention(q, k, v, mask=m, is_causal=True, scale=case.scale,
                                            implementation="cudnn")

    return race_jax(case, "cudnn_mask", "cuDNN: jax.nn.dot_product_attention(mask=dense [B,1,T,S] "
                    "document mask, is_causal=True, implementation='cudnn')", masked,
                    (case.dense_mask(),), note=failure)


def pallas(case: AttentionCase, log: Callable[[str], None] = print) -> Result:
    """JAX's Pallas GPU ``mha``: causal, documents through ``segment_ids``, no window; grouped
    heads with K/V repeated inside the timed function. The backward's block size: the faster of
    32 (the default) and 64, picked on the shape's first mask and kept for its others."""
    from jax.experimental.pallas.ops.gpu import attention as pallas_attention

    if case.window is not None:
        raise NotImplementedError("Pallas mha has no sliding window")
    group, T = case.group, case.q.shape[2]
    extra = () if case.segment_ids is None else (jnp.asarray(case.segment_ids),)
    sizes = [case.memo["pallas_bwd"]] if "pallas_bwd" in case.memo else [32, 64]

    def make(bwd):
        block, bwd = min(128, T), min(bwd, T)
        blocks = pallas_attention.BlockSizes(block_q=block, block_k=block, block_q_dkv=bwd,
                                             block_kv_dkv=bwd, block_q_dq=bwd, block_kv_dq=bwd)

        def fn(q, k, v, *seg):
            if group > 1:  # mha takes as many K/V heads as query heads
                k, v = jnp.repeat(k, group, axis=2), jnp.repeat(v, group, axis=2)
            return pallas_attention.mha(q, k, v, seg[0] if seg else None, sm_scale=case.scale,
                                        causal=True, block_sizes=blocks,
                                        interpret=not ejk_lite.ON_GPU)
        return fn

    peer = ("JAX Pallas GPU: jax.experimental.pallas.ops.gpu.attention.mha(causal=True"
            + (", segment_ids" if extra else "") + ")"
            + (f", K/V heads repeated x{group} inside the timed function" if group > 1 else ""))
    best, wrong, tried = None, None, {}
    for bwd in sizes:
        try:
            result = race_jax(case, "pallas_mha", peer, make(bwd), extra, backward_block=bwd)
        except Exception as error:  # noqa: BLE001 (a block size that does not compile is skipped)
            tried[bwd] = f"{type(error).__name__}: {str(error)[:200]}"
            if len(sizes) == 1:
                raise
            continue
        if not result.within_tolerance():  # never pick a wrong configuration for its speed
            tried[bwd] = f"wrong result: {result.err}"
            wrong = wrong or result
            continue
        tried[bwd] = result.stats["fwd+bwd"]["median_ms"]
        if best is None or tried[bwd] < best.stats["fwd+bwd"]["median_ms"]:
            best = result
    best = best or wrong  # all wrong: report one, so that the check fails the run
    if best is None:
        raise RuntimeError(f"no backward block size ran: {tried}")
    case.memo["pallas_bwd"] = best.fields["backward_block"]
    best.fields["backward_blocks_tried"] = tried
    return best


def xla_sdpa(case: AttentionCase, log: Callable[[str], None] = print) -> Result:
    """``jax.nn.dot_product_attention(implementation="xla")``; documents as a dense mask."""
    kw = dict(is_causal=True, scale=case.scale, implementation="xla")
    if case.window is not None:
        kw["local_window_size"] = case.window
    extra = () if case.segment_ids is None else (case.dense_mask(),)

    def fn(q, k, v, *m):
        return jax.nn.dot_product_attention(q, k, v, mask=m[0] if m else None, **kw)

    return race_jax(case, "xla_sdpa", "XLA: jax.nn.dot_product_attention(implementation='xla')"
                    + (" with a dense [B,1,T,S] document mask" if extra else ""), fn, extra)


def xla_einsum(case: AttentionCase, log: Callable[[str], None] = print) -> Result:
    """A plain einsum-softmax-einsum in [B, H, T, D], the mask from iotas and segment ids."""
    B, H, T, _ = case.q.shape
    Hkv, group, window = case.k.shape[1], case.group, case.window
    extra = () if case.segment_ids is None else (jnp.asarray(case.segment_ids),)

    def fn(q, k, v, *seg):
        qg = q.reshape(B, Hkv, group, T, q.shape[-1])
        s = jnp.einsum("bhgtd,bhsd->bhgts", qg, k, preferred_element_type=jnp.float32) * case.scale
        pos = jnp.arange(T)
        visible = pos[:, None] >= pos[None, :]
        if window is not None:
            visible &= pos[:, None] - window[0] <= pos[None, :]
        visible = visible[None, None, None]
        if seg:
            visible = visible & (seg[0][:, :, None] == seg[0][:, None, :])[:, None, None]
        p = jax.nn.softmax(jnp.where(visible, s, -jnp.inf), axis=-1).astype(v.dtype)
        o = jnp.einsum("bhgts,bhsd->bhgtd", p, v, preferred_element_type=jnp.float32)
        return o.astype(q.dtype).reshape(B, H, T, v.shape[-1])

    return race_jax(case, "xla_einsum", "XLA: einsum, mask from iotas and segment ids, float32 "
                    "softmax, einsum", fn, extra, layout=lambda x: x)


def load_flex() -> tuple[tuple | None, str | None]:
    """``((torch, compiled flex_attention, create_block_mask), None)``, or ``(None, why not)``."""
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


def flex(case: AttentionCase, log: Callable[[str], None] = print) -> Result:
    """PyTorch FlexAttention (``torch.compile``) with ``create_block_mask`` at 128 x 128 for the
    same mask, built once (its build timed apart: ``flex_mask_build``)."""
    torch, flex_attention, create_block_mask = case.torch
    B, H, T, D = case.q.shape
    Hkv, window = case.k.shape[1], case.window
    doc = None if case.segment_ids is None else to_torch(torch, jnp.asarray(case.segment_ids))

    if doc is not None:
        def mask_mod(b, h, q_idx, kv_idx):
            return (doc[b, q_idx] == doc[b, kv_idx]) & (q_idx >= kv_idx)
    elif window is not None:
        def mask_mod(b, h, q_idx, kv_idx):
            return (q_idx >= kv_idx) & (q_idx - kv_idx <= window[0])
    else:
        def mask_mod(b, h, q_idx, kv_idx):
            return q_idx >= kv_idx

    def build():
        batch = B if doc is not None else None
        try:
            return create_block_mask(mask_mod, batch, None, T, T, device="cuda", BLOCK_SIZE=128,
                                     _compile=True)
        except TypeError:  # a torch without _compile
            return create_block_mask(mask_mod, batch, None, T, T, device="cuda", BLOCK_SIZE=128)

    block_mask = build()
    build_stats = spread(device_samples_ms(build, samples=min(case.samples, 5), warmup=1))
    counts = block_mask.kv_num_blocks.to(torch.int64)
    if block_mask.full_kv_num_blocks is not None:
        counts = counts + block_mask.full_kv_num_blocks.to(torch.int64)
    visited = int(counts.sum()) * (B // counts.shape[0]) * (H // counts.shape[1])
    gqa = H != Hkv

    def call(t):
        return flex_attention(t["q"], t["k"], t["v"], block_mask=block_mask, scale=D ** -0.5,
                              enable_gqa=gqa)

    o, grads, stats = torch_race(torch, call, dict(q=case.q, k=case.k, v=case.v), case.d_o,
                                 case.samples)
    err = {"out": relative_error(o, case.ours_o)}
    err.update({f"d{n}": relative_error(grads[n], ours) for n, ours in zip("qkv", case.ours_grads)})
    del o, grads, block_mask
    return Result("flex", stats, err, dict(
        peer="PyTorch FlexAttention: torch.compile(flex_attention) + create_block_mask("
             "BLOCK_SIZE=128)" + (", enable_gqa=True" if gqa else ""),
        flex_visited_blocks=visited, flex_mask_build=build_stats))


#: The attention peers by their --peers name.
ATTENTION = {"cudnn": cudnn, "flex": flex, "pallas": pallas, "xla_sdpa": xla_sdpa,
             "xla_einsum": xla_einsum}


def attention_versions(torch_bundle: tuple | None) -> dict[str, str]:
    found = {}
    if torch_bundle is not None:
        found["torch"] = torch_bundle[0].__version__
    try:
        from jax._src.cudnn.fused_attention_stablehlo import check_cudnn_version

        found["cudnn"] = str(check_cudnn_version())
    except Exception as error:  # noqa: BLE001
        found["cudnn"] = f"unavailable ({type(error).__name__})"
    return found


# ----------------------------------------------------------------------------------------------
# Mean pooling over packed sequences, in plain JAX (what a user would write; JAX differentiates).
# ----------------------------------------------------------------------------------------------


def cumsum_mean(x: jax.Array, cu_seqlens: jax.Array) -> jax.Array:
    """Packed means from running sums: float32, differences at ``cu_seqlens``, empty -> 0."""
    running = jnp.cumsum(x.astype(jnp.float32), axis=0)
    running = jnp.concatenate([jnp.zeros((1, x.shape[1]), jnp.float32), running])
    sums = running[cu_seqlens[1:]] - running[cu_seqlens[:-1]]
    lengths = jnp.maximum(jnp.diff(cu_seqlens), 1).astype(jnp.float32)
    return (sums / lengths[:, None]).astype(x.dtype)


def onehot_mean(x: jax.Array, cu_seqlens: jax.Array) -> jax.Array:
    """Packed means as a product: one-hot ``[tokens, sequences]`` (tokens past the last sequence
    in none) times ``x``, float32 accumulation."""
    num_seqs = cu_seqlens.shape[0] - 1
    seq = jnp.searchsorted(cu_seqlens, jnp.arange(x.shape[0]), side="right") - 1
    onehot = jax.nn.one_hot(jnp.where(seq < num_seqs, seq, -1), num_seqs, dtype=x.dtype)
    sums = jnp.einsum("ts,th->sh", onehot, x, preferred_element_type=jnp.float32)
    lengths = jnp.maximum(jnp.diff(cu_seqlens), 1).astype(jnp.float32)
    return (sums / lengths[:, None]).astype(x.dtype)
