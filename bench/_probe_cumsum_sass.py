"""Probe (not a bench, no GPU needed): the sm_90 SASS of chunk_global_cumsum's walk on the
tensor cores, compiled offline as jax-triton compiles it (tools/compile_check.py's
compile_launch), at the benchmark's shape (bfloat16, C = 16 x 128 = 2048 columns, no packed
sequences).

Why: issue 19 wants the bf16 global vector cumsum at >= 85% of copy, and the package's walk sits
at the line (84.0-85.2 over three runs of bench/cumsum.py, session 32), while the walk's loads and
stores alone reach 88.6-91.7 (bench/_probe_cumsum_walk.py, session 31). This prints what the
loop of one tile costs: instruction counts of the whole kernel (both walks: the products and the
tl.cumsum one an infinite total falls back to) and of the main loop alone, the kinds of global
loads and stores, and the shared memory a program asks for.

What it gave (session 32, triton 3.6.0), at the listed forward tile 64 x 64, 8 warps, 7 stages:
73728 bytes of shared memory; the main loop 148 instructions a thread per block of 4096 elements
(0.29 warp instructions an element: not issue-bound; the reverse sum's tile, 8 stages, 138),
8 HGMMA (the two products, 64x32x16 per warpgroup), the store converted from the products'
layout through shared memory (STS, BAR, LDS) to STG.E.128, loads LDGSTS.E.BYPASS.128 (cp.async,
16 bytes). The pipeliner carries six stages of 64 x 64 offset and mask tensors as loop state
(40 IMAD, 17 ISETP, 8 P2R in the loop). A walk giving the load and the store a scalar shift
plus one loop-invariant offset tile, and the store a mask of its own (8a44637, session 33)
carried scalars instead: 129 instructions forward, 125 reverse, no P2R. It was not faster on the
H200 (bench/_probe_cumsum_tiles.py, one run, three passes each, % of copy: forward at 7 stages
85.5, 83.5, 85.7 against 87.3, 85.4, 88.2; reverse at 8 stages 84.0, 86.4, 84.6 against 86.8,
85.4, 84.9) and was reverted (7ab7b85). 64 x 32 with 4 warps at 8 and 10 stages
asks for 45056 and 53248 bytes (two programs an SM fit; loops of 151 and 163 instructions, 128
in the variant at 8), 64 x 64 with 4 warps at 8 stages 81920 (262).

    python bench/_probe_cumsum_sass.py                       # the listed forward tile
    python bench/_probe_cumsum_sass.py --tile 64 32 4 8 --reverse --dump /tmp/walk
"""
from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import jax

# ejk_lite settles the interpreter at import by asking JAX for a GPU: say there is one, so that
# its kernels are defined in compiled mode here (nothing is launched), as tools/compile_check.py.
jax.devices = lambda *args, **kwargs: [type("PretendGpu", (), {"platform": "gpu"})()]
ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tools")]
import ejk_lite.cumsum as cumsum  # noqa: E402
import triton  # noqa: E402
from compile_check import compile_launch  # noqa: E402


def compile_walk(block_t, block_c, num_warps, num_stages, reverse, tokens=4096, columns=2048):
    """The global kernel for one bfloat16 tile on the tensor cores, compiled for sm_90 by
    tools/compile_check.py from a launch as its recorder writes one: the arrays, T, num_seqs,
    scale (the default 1.0, which jax-triton 0.3.1 and compile_launch make a constant, as every
    scalar equal to 1), then the output."""
    launch = dict(
        args=[["*bfloat16", None], ["*int32", None], ["i32", tokens], ["i32", 1], ["fp64", 1.0]],
        outs=["*bfloat16"],
        meta=dict(C=columns, BLOCK_T=block_t, BLOCK_C=block_c, NUM_STAGES=num_stages, SPLIT=1,
                  USE_DOT=True, PREFETCH=False, REVERSE=reverse, IS_VARLEN=False,
                  TOKENS_CONTIGUOUS=False, num_warps=num_warps, num_stages=num_stages))
    compiled = []
    compile_launch(cumsum.chunk_global_cumsum_kernel, launch, 90, compiled)
    return compiled[0]


def sass_of(kernel) -> str:
    tool = Path(triton.__file__).parent / "backends/nvidia/bin/cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout


def opcodes(lines) -> collections.Counter:
    pattern = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[0-9T]\s+)?([A-Z][A-Z0-9]*)")
    return collections.Counter(m.group(1) for line in lines if (m := pattern.search(line)))


def main_loop(sass: str) -> list[str]:
    """The lines of the loop holding the first HGMMA: from its backward branch's target to it."""
    lines = sass.splitlines()
    first = next(i for i, line in enumerate(lines) if "HGMMA" in line)
    for i in range(first, len(lines)):
        branch = re.search(r"BRA (0x[0-9a-f]+)", lines[i])
        address = re.search(r"/\*([0-9a-f]{4,})\*/", lines[i])
        if branch and address and int(branch.group(1), 16) < int(address.group(1), 16):
            target = int(branch.group(1), 16)
            start = next(j for j, line in enumerate(lines)
                         if (a := re.search(r"/\*([0-9a-f]{4,})\*/", line))
                         and int(a.group(1), 16) == target)
            if start <= first:
                return lines[start:i + 1]
    raise SystemExit("no loop around the first HGMMA")


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tile", type=int, nargs=4, default=(64, 64, 8, 7),
                   metavar=("BLOCK_T", "BLOCK_C", "WARPS", "STAGES"))
    p.add_argument("--reverse", action="store_true", help="the reverse sum (the backward's)")
    p.add_argument("--dump", help="write PREFIX.ttgir and PREFIX.sass")
    args = p.parse_args()
    kernel = compile_walk(*args.tile, reverse=args.reverse)
    sass = sass_of(kernel)
    if args.dump:
        Path(args.dump + ".ttgir").write_text(kernel.asm["ttgir"])
        Path(args.dump + ".sass").write_text(sass)
    loop = main_loop(sass)
    print(f"tile {args.tile} reverse={args.reverse}: shared memory {kernel.metadata.shared} bytes")
    print("global stores", sorted(set(re.findall(r"\bSTG\.[\w.]+", sass))),
          "loads", sorted(set(re.findall(r"\b(?:LDGSTS|LDG)\.[\w.]+", sass))))
    counts = opcodes(loop)
    warps_per_element = sum(counts.values()) * args.tile[2] / (args.tile[0] * args.tile[1])
    print(f"main loop: {sum(counts.values())} instructions a thread, "
          f"{warps_per_element:.2f} warp instructions an element")
    print("  " + ", ".join(f"{op} {n}" for op, n in counts.most_common()))
    print("whole kernel:", ", ".join(f"{op} {n}" for op, n in opcodes(sass.splitlines())
                                     .most_common(12)))


if __name__ == "__main__":
    main()
