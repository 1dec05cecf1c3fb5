"""Probe (not a bench, no GPU needed): does Triton warp-specialize an attention loop for sm_90?

Session 25, for issue 19's cuDNN gap (causal attention at 0.70-0.78x cuDNN on the H200). cuDNN
and FlashAttention-3 split a Hopper block into producer warps (loads) and consumer warp groups
(products), with ``setmaxnreg`` moving registers between them and ``mbarrier`` handing tiles
over. Triton 3.6 has ``tl.range(..., warp_specialize=True)``. This compiles one online-softmax
loop for sm_90 offline (no driver), with and without it, with pointer loads and with in-kernel
tensor descriptors (TMA), and counts what the PTX holds.

What it gave (triton 3.6.0, 128 x 64 tiles, D 128, 8 warps, 3 stages): the same PTX with and
without the flag, both ways: no ``setmaxnreg``; 12 ``wgmma.mma_async`` each; ``mbarrier`` 0
with pointers, 18 with descriptors (the TMA loads' own, in both). On sm_90 the flag changes
nothing in this Triton: it is no lever for the gap. (In-kernel descriptors need a global
scratch buffer, which jax-triton 0.3.1 does not pass: jax-triton issues 346, 348.)

    python3 bench/_probe_warp_specialize.py
"""
from __future__ import annotations

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


@triton.jit
def pointer_loop(q_ptr, k_ptr, o_ptr, T, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
                 WS: tl.constexpr):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    d, n = tl.arange(0, D), tl.arange(0, BN)
    q = tl.load(q_ptr + rows[:, None] * D + d[None, :])
    acc = tl.zeros([BM, D], tl.float32)
    m = tl.full([BM], -float("inf"), tl.float32)
    for start in tl.range(0, T, BN, warp_specialize=WS):
        k = tl.load(k_ptr + (start + n)[:, None] * D + d[None, :])
        s = tl.dot(q, tl.trans(k))
        m_new = tl.maximum(m, tl.max(s, 1))
        acc = acc * tl.exp(m - m_new)[:, None]
        acc = tl.dot(tl.exp(s - m_new[:, None]).to(tl.bfloat16), k, acc)
        m = m_new
    tl.store(o_ptr + rows[:, None] * D + d[None, :], acc)


@triton.jit
def descriptor_loop(q_ptr, k_ptr, o_ptr, T, BM: tl.constexpr, BN: tl.constexpr,
                    D: tl.constexpr, WS: tl.constexpr):
    q_desc = tl.make_tensor_descriptor(q_ptr, shape=[T, D], strides=[D, 1], block_shape=[BM, D])
    k_desc = tl.make_tensor_descriptor(k_ptr, shape=[T, D], strides=[D, 1], block_shape=[BN, D])
    q = q_desc.load([tl.program_id(0) * BM, 0])
    acc = tl.zeros([BM, D], tl.float32)
    m = tl.full([BM], -float("inf"), tl.float32)
    for start in tl.range(0, T, BN, warp_specialize=WS):
        k = k_desc.load([start, 0])
        s = tl.dot(q, tl.trans(k))
        m_new = tl.maximum(m, tl.max(s, 1))
        acc = acc * tl.exp(m - m_new)[:, None]
        acc = tl.dot(tl.exp(s - m_new[:, None]).to(tl.bfloat16), k, acc)
        m = m_new
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    d = tl.arange(0, D)
    tl.store(o_ptr + rows[:, None] * D + d[None, :], acc)


def main():
    signature = {"q_ptr": "*bf16", "k_ptr": "*bf16", "o_ptr": "*fp32", "T": "i32",
                 "BM": "constexpr", "BN": "constexpr", "D": "constexpr", "WS": "constexpr"}
    for kernel in (pointer_loop, descriptor_loop):
        for ws in (False, True):
            src = ASTSource(kernel, signature=signature,
                            constexprs={"BM": 128, "BN": 64, "D": 128, "WS": ws})
            compiled = triton.compile(src, target=GPUTarget("cuda", 90, 128),
                                      options={"num_warps": 8, "num_stages": 3})
            ptx = compiled.asm["ptx"]
            print(f"{kernel.__name__:16} warp_specialize={ws!s:5}  setmaxnreg "
                  f"{ptx.count('setmaxnreg')}  wgmma {ptx.count('wgmma.mma_async')}  mbarrier "
                  f"{ptx.count('mbarrier')}  shared {compiled.metadata.shared} bytes")


if __name__ == "__main__":
    main()
