"""Compile the cumsum kernels offline for sm_90 with the arguments jax-triton 0.3.1 gives them at
the benchmark's vector shape [4, 4096, 16, 128] (T = 4096, C = 2048): pointers divisible by 16,
int scalars with no divisibility hint, an int (or float) equal to 1 a constant, any other Python
float fp64. Summarises the PTX / SASS of each config: global load/store widths per thread,
conversions, float64 ops, shuffles / shared memory / barriers (the scan across threads),
registers, spills. CPU only.

    JAX_PLATFORMS=cpu python .scratch_cumsum/compile_probe.py [shipped|new|both] [filter] [--scale]

``shipped`` is .scratch_cumsum/cumsum_shipped.py (the measured code), ``new`` the worktree's
ejk_lite/cumsum.py. ``--scale`` compiles with softmax_scale != 1 (an fp64 argument).
"""
import collections, importlib, re, subprocess, sys, tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / ".scratch_cumsum")]
import jax
jax.devices = lambda *a, **k: [type("G", (), {"platform": "gpu"})()]  # compiled mode, no GPU needed
import ejk_lite  # noqa: F401
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

BIN = Path(triton.__file__).parent / "backends/nvidia/bin"
DT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
T, C = 4096, 2048


def compile_kernel(kernel, dtype, meta, num_warps, num_stages, scale_one=True):
    fn = kernel.fn if isinstance(kernel, triton.runtime.Autotuner) else kernel
    signature, attrs, constexprs = {}, {}, {}
    for i, name in enumerate(fn.arg_names):
        constexpr = i in fn.constexprs
        if constexpr:
            value = {"C": C, "NUM_STAGES": 1}.get(name, meta.get(name)) if name not in meta else meta[name]
            signature[name], constexprs[name] = "constexpr", value
        elif name.endswith("_ptr"):
            signature[name] = "*" + (DT[dtype] if name in ("x_ptr", "out_ptr") else "i32")
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif name == "num_seqs" or (name == "scale" and scale_one):
            signature[name], constexprs[name] = "constexpr", 1  # jax-triton: a scalar equal to 1
        else:
            signature[name] = {"scale": "fp64"}.get(name, "i32")
    src = ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options=dict(num_warps=num_warps, num_stages=num_stages))


def summarise(k):
    ptx = k.asm["ptx"]
    with tempfile.TemporaryDirectory() as tmp:
        p = Path(tmp) / "k.ptx"
        p.write_text(ptx)
        err = subprocess.run([str(BIN / "ptxas"), "-v", "-arch=sm_90a", str(p), "-o", str(Path(tmp) / "k.o")],
                             capture_output=True, text=True).stderr
        sass = subprocess.run([str(BIN / "cuobjdump"), "-sass", str(Path(tmp) / "k.o")],
                              capture_output=True, text=True).stdout
    ops = collections.Counter()
    for line in sass.splitlines():
        m = re.match(r"\s+/\*[0-9a-f]{4}\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", line)
        if m:
            ops[m.group(2)] += 1
    return dict(
        regs=int(re.findall(r"Used (\d+) registers", err)[0]),
        spill=re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", err)[0],
        ld=dict(collections.Counter(re.findall(r"ld\.global(?:\.[a-z0-9_]+)*", ptx))),
        st=dict(collections.Counter(re.findall(r"st\.global(?:\.[a-z0-9_]+)*", ptx))),
        cvt=sum(v for k, v in ops.items() if k.startswith("F2F")), f64=sum(v for k, v in ops.items() if k.startswith("D")),
        shfl=ops["SHFL.UP"] + ops["SHFL.IDX"] + ops["SHFL.BFLY"] + ops["SHFL.DOWN"],
        lds=ops["LDS"] + ops["LDS.64"] + ops["LDS.128"], sts=ops["STS"] + ops["STS.64"] + ops["STS.128"],
        bar=ops["BAR.SYNC.DEFER_BLOCKING"], cp_async=len(re.findall(r"cp\.async", ptx)),
        sass=sum(ops.values()), smem=k.metadata.shared), ptx, sass


def configs(module):
    if hasattr(module, "_local_configs"):  # the new module: tiles capped at the chunk (64)
        for cfg in module._local_configs(64):
            yield "local", module.chunk_local_cumsum_kernel, dict(CHUNK=64, **cfg.kwargs), cfg
    else:
        for cfg in module._LOCAL_CONFIGS:
            yield "local", module.chunk_local_cumsum_kernel, dict(CHUNK=64, BLOCK_T=64, **cfg.kwargs), cfg
    for cfg in module._GLOBAL_CONFIGS:
        yield "global", module.chunk_global_cumsum_kernel, dict(cfg.kwargs), cfg


def main():
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    which = args[0] if args else "both"
    filt = args[1] if len(args) > 1 else ""
    scale_one = "--scale" not in sys.argv
    out = ROOT / ".scratch_cumsum" / "asm"
    out.mkdir(exist_ok=True)
    names = ["cumsum_shipped", "ejk_lite.cumsum"] if which == "both" else \
        ["cumsum_shipped" if which == "shipped" else "ejk_lite.cumsum"]
    for modname in names:
        module = importlib.import_module(modname)
        label = "shipped" if modname == "cumsum_shipped" else "new"
        for dtype in ("float32", "bfloat16"):
            for op, kernel, meta, cfg in configs(module):
                meta = dict(meta, REVERSE=False, IS_VARLEN=False, TOKENS_CONTIGUOUS=False)
                tag = (f"{label} {op} {dtype} T{meta['BLOCK_T']} C{meta['BLOCK_C']} "
                       f"w{cfg.num_warps} s{cfg.num_stages}")
                if filt not in tag:
                    continue
                s, ptx, sass = summarise(compile_kernel(kernel, dtype, meta, cfg.num_warps, cfg.num_stages,
                                                        scale_one))
                (out / (tag.replace(" ", "_") + ".ptx")).write_text(ptx)
                (out / (tag.replace(" ", "_") + ".sass")).write_text(sass)
                per_elem = s["sass"] * cfg.num_warps / (meta["BLOCK_T"] * meta["BLOCK_C"])
                print(f"{tag:42s} warp-instr/elem={per_elem:.2f} " + " ".join(f"{k}={v}" for k, v in s.items()),
                      flush=True)


if __name__ == "__main__":
    main()
