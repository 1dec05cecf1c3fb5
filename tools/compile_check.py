"""Compile every kernel a chapter launches for real GPUs, on a machine without one.

Triton's interpreter (what the book runs on a CPU) does not type-check kernels the way the
compiler does: a loop-carried float32 variable that turns float64, for instance, runs fine there
and stops the compile on a GPU. This script closes that gap without a GPU:

1. it executes the notebook (through nbclient, as nbmake does) with a recorder in front of
   ``ejk_lite``'s interpreter path, which notes each launch: kernel, argument types *as
   jax-triton would pass them* (a Python ``float`` becomes ``fp64``, an ``int`` ``i32``, any
   scalar equal to 1 a constant, arrays pointers to their dtype, 16-byte aligned) and
   compile-time constants;
2. it re-defines the notebook's ``@triton.jit`` functions in this process, where Triton is in
   compiled mode, and compiles each recorded launch to a cubin for the given architectures
   (Triton ships its own ptxas; no driver is needed).

    python tools/compile_check.py book/recurrence.ipynb [more.ipynb ...] [--arch 80 90]

Kernels that a chapter launches from the ``ejk_lite`` package are skipped (the unit tests run
those on the GPU). Exit status 1 if any launch fails to compile.

``--package SCRIPT`` does the same for the package's own kernels: SCRIPT (default
``tools/compile_calls.py``, the public ops over their features) runs in a subprocess, in the
interpreter, with the recorder; this process then imports ``ejk_lite`` in compiled mode (JAX is
told it has a GPU, so ``ejk_lite`` leaves ``TRITON_INTERPRET`` alone) and compiles every
recorded launch. It found, without a GPU, both compile failures of ``chunked_recurrent``'s
first GPU check (a ``tl.cumsum`` the scan lowering rejects; a shape built from a tuple).
Each launch is compiled with its own ``num_warps`` and ``num_stages``, and a kernel that asks for
more shared memory than the architecture gives a block fails too: the compiler lets it through,
the driver refuses it at launch. (With Triton's default three stages in place of its two, the
float32 attention forward asks for 262144 bytes, past sm_90's 232448: the check reports it.)::

    python tools/compile_check.py --package [tools/compile_calls.py] [--arch 90]

``--registers`` adds what ptxas says of each launch (registers a thread, spilled bytes, warnings
such as C7515, wgmma serialised): register pressure read without a GPU. For the attention
kernels at the race's tiles::

    python tools/compile_check.py --package tools/compile_calls_attention.py --arch 90 --registers
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

RECORDER = r'''
import json as _json, os as _os
import numpy as _np
import ejk_lite.launch as _launch

_RECORDS = []
_interpret = _launch._interpret


def _arg_type(a):
    if isinstance(a, bool):
        return ["i1", a]
    if isinstance(a, int):
        return ["i32" if -2**31 <= a < 2**31 else "i64", a]
    if isinstance(a, float):
        return ["fp64", a]                          # jax-triton: a Python float is fp64
    return ["*" + str(_np.dtype(a.dtype)), None]


def _recording_interpret(args, kernel, out_leaves, grid, metaparams, aliases, options=None):
    fn, meta = _launch._first_config(kernel, metaparams)
    raw = fn
    while hasattr(raw, "fn"):
        raw = raw.fn
    jsonable = {k: v for k, v in meta.items() if isinstance(v, (bool, int, float, str))}
    if hasattr(kernel, "configs"):  # autotuned: the first config's, as the interpreter runs
        options = dict(num_warps=kernel.configs[0].num_warps,
                       num_stages=kernel.configs[0].num_stages)
    jsonable.update({k: v for k, v in (options or {}).items() if v is not None})  # warps, stages
    for k, v in meta.items():  # a NamedTuple of constants (attention's LOGITS, RULE, SHAPE)
        if isinstance(v, tuple) and hasattr(v, "_fields"):
            jsonable[k] = {"namedtuple": [type(v).__module__, type(v).__qualname__],
                           "values": list(v)}
    _RECORDS.append(dict(name=raw.__name__, module=raw.__module__,
                         args=[_arg_type(a) for a in args],
                         outs=["*" + str(_np.dtype(s.dtype)) for s in out_leaves],
                         meta=jsonable, skipped_meta=sorted(set(meta) - set(jsonable))))
    return _interpret(args, kernel, out_leaves, grid, metaparams, aliases, options)


_launch._interpret = _recording_interpret
'''

DUMP = r'''
with open(_os.environ["EJK_COMPILE_RECORD"], "w") as _f:
    _json.dump(_RECORDS, _f)
'''

TRITON_TYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16", "float64": "fp64",
                "int8": "i8", "int16": "i16", "int32": "i32", "int64": "i64", "uint8": "u8",
                "uint16": "u16", "uint32": "u32", "uint64": "u64", "bool": "i1"}


def record_launches(notebook: Path, timeout: int) -> list[dict]:
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(str(notebook), as_version=4)
    nb.cells.insert(0, nbformat.v4.new_code_cell(RECORDER))
    nb.cells.append(nbformat.v4.new_code_cell(DUMP))
    with tempfile.TemporaryDirectory() as tmp:
        record = Path(tmp) / "launches.json"
        os.environ["EJK_COMPILE_RECORD"] = str(record)
        NotebookClient(nb, timeout=timeout, kernel_name="python3",
                       resources={"metadata": {"path": str(notebook.parent)}}).execute()
        return json.loads(record.read_text())


def notebook_kernels(notebook: Path, folder: Path) -> dict:
    """The notebook's top-level @triton.jit / @triton.autotune functions, defined afresh here.

    Triton reads a kernel's source with ``inspect``, so they are written to a module file first.
    """
    import importlib.util

    import nbformat

    pieces = ["import triton", "import triton.language as tl"]
    nb = nbformat.read(str(notebook), as_version=4)
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        try:
            tree = ast.parse(cell.source)
        except SyntaxError:
            continue
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and any(
                    "triton" in ast.unparse(d) for d in node.decorator_list):
                pieces.append(ast.get_source_segment(cell.source, node, padded=True)
                              if not node.decorator_list else
                              "\n".join(cell.source.splitlines()[node.decorator_list[0].lineno - 1:
                                                                 node.end_lineno]))
    path = folder / f"{notebook.stem}_kernels.py"
    path.write_text("\n\n\n".join(pieces) + "\n")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return vars(module)


# Shared memory a block may use, in bytes (CUDA's sharedMemPerBlockOptin): A100; RTX 30xx (A10,
# A40) and L4 (RTX 40xx); H100/H200.
SHARED_MEMORY = {80: 166912, 86: 101376, 89: 101376, 90: 232448}


def _error_lines(error: Exception) -> list[str]:
    """The non-empty lines of a failed compile's innermost error: Triton nests a helper's
    error inside its caller's, whose own lines show only the call site."""
    while error.__cause__ is not None:
        error = error.__cause__
    return [ln for ln in str(error).splitlines() if ln.strip()] or [repr(error)]


def compile_launch(fn, launch: dict, arch: int, compiled: list | None = None) -> int:
    """Compile one recorded launch for ``arch``; its shared memory in bytes. ``compiled``: a
    list the compiled kernel is appended to (for :func:`ptxas_resources`)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    jit_fn = fn.fn if isinstance(fn, triton.runtime.Autotuner) else fn
    names = list(jit_fn.arg_names)
    types = launch["args"] + [[t, None] for t in launch["outs"]]
    signature, constexprs = {}, {}
    for name, (t, value) in zip(names, types):
        if t.startswith("*"):
            t = "*" + TRITON_TYPES[t[1:]]
        # jax-triton 0.3.1 makes every scalar equal to 1 a constant (triton_lib.py: v == 1):
        # an int 1, a float 1.0 (the default scale of the cumsums), True.
        if value is not None and value == 1 and not t.startswith("*"):
            signature[name], constexprs[name] = "constexpr", 1
        else:
            signature[name] = t
    for name in names[len(types):]:
        signature[name] = "constexpr"
        if name in launch["meta"]:
            value = launch["meta"][name]
            if isinstance(value, dict) and "namedtuple" in value:  # rebuilt from the recorder's
                module, qualname = value["namedtuple"]
                value = getattr(importlib.import_module(module), qualname)(*value["values"])
            constexprs[name] = value
    options = {k: launch["meta"][k] for k in ("num_warps", "num_stages") if k in launch["meta"]}
    # jax-triton takes every array to be 16-byte aligned (tt.divisibility 16 on each pointer),
    # and the compiler vectorises loads on it: without it, the code is not the GPU's (the
    # attention forward at 128 x 128: 16-bit loads one element at a time, no cp.async).
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(names)
             if signature.get(name, "").startswith("*")}
    kernel = triton.compile(ASTSource(fn=jit_fn, signature=signature, constexprs=constexprs,
                                      attrs=attrs),
                            target=GPUTarget("cuda", arch, 32), options=options)
    if compiled is not None:
        compiled.append(kernel)
    # The driver refuses a launch that asks for more shared memory than a block may have; the
    # compiler does not check it (num_stages multiplies the buffers of every pipelined load).
    if kernel.metadata.shared > SHARED_MEMORY[arch]:
        raise RuntimeError(f"out of resources: shared memory {kernel.metadata.shared} bytes, "
                           f"sm_{arch} allows {SHARED_MEMORY[arch]}")
    return kernel.metadata.shared


def ptxas_resources(kernel, arch: int) -> str:
    """What ptxas says of a compiled kernel's PTX with ``-v``: registers a thread, spilled
    bytes, and its performance warnings (such as C7515, wgmma serialised), on one line. Triton's
    own ptxas, as the compile used; no driver needed. A dK/dV kernel that spills at 255
    registers shows it here without a GPU (bench/_probe_atomic_dq.py's docstring)."""
    import subprocess

    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(arch).path
    suffix = "a" if arch == 90 else ""  # sm_90a: the wgmma instructions need it
    with tempfile.TemporaryDirectory() as tmp:
        ptx = Path(tmp) / "kernel.ptx"
        ptx.write_text(kernel.asm["ptx"])
        run = subprocess.run([ptxas, "-v", f"--gpu-name=sm_{arch}{suffix}", str(ptx),
                              "-o", str(Path(tmp) / "kernel.cubin")], capture_output=True,
                             text=True)
    if run.returncode != 0:
        return f"ptxas failed: {(run.stderr or run.stdout).strip()[-300:]}"
    said = (run.stderr + run.stdout).splitlines()
    keep = [line.split("info    :")[-1].strip() for line in said
            if "registers" in line or "spill" in line or "Performance" in line]
    return "; ".join(keep)


def check(notebook: Path, archs: list[int], timeout: int) -> int:
    launches = record_launches(notebook, timeout)
    folder = Path(tempfile.mkdtemp(prefix="compile_check_"))
    kernels = notebook_kernels(notebook, folder)
    seen, failures, compiled, skipped = set(), 0, 0, set()
    for launch in launches:
        key = json.dumps([launch["name"], launch["args"], launch["outs"], launch["meta"]],
                         sort_keys=True)
        if key in seen:
            continue
        seen.add(key)
        if launch["module"] != "__main__" or launch["name"] not in kernels:
            skipped.add(f"{launch['module']}.{launch['name']}")
            continue
        for arch in archs:
            try:
                compile_launch(kernels[launch["name"]], launch, arch)
                compiled += 1
            except Exception as error:  # noqa: BLE001 (report every failure, then go on)
                failures += 1
                message = _error_lines(error)[-1][-300:]
                args = ", ".join(t for t, _ in launch["args"])
                print(f"FAIL sm_{arch} {launch['name']}({args}): {message}")
    print(f"{notebook}: {len(seen)} distinct launches, {compiled} compiles ok, {failures} failed; "
          f"skipped (package kernels): {', '.join(sorted(skipped)) or 'none'}")
    return failures


def record_script(script: Path) -> list[dict]:
    """Run ``script`` in a subprocess, in the interpreter, with the recorder: its launches."""
    with tempfile.TemporaryDirectory() as tmp:
        record, runner = Path(tmp) / "launches.json", Path(tmp) / "run.py"
        runner.write_text("import ejk_lite\n" + RECORDER + "\n" + script.read_text() + "\n" + DUMP)
        env = {**os.environ, "EJK_COMPILE_RECORD": str(record), "TRITON_INTERPRET": "1",
               "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
        subprocess.run([sys.executable, str(runner)], env=env, cwd=ROOT, check=True)
        return json.loads(record.read_text())


def check_package(script: Path, archs: list[int], show_shared: bool = False,
                  show_registers: bool = False) -> int:
    launches = record_script(script)
    import jax

    # ejk_lite settles the interpreter at import by asking JAX for a GPU: say there is one, so
    # that its kernels are defined in compiled mode here (nothing is launched).
    jax.devices = lambda *args, **kwargs: [type("PretendGpu", (), {"platform": "gpu"})()]
    sys.path.insert(0, str(ROOT))
    import ejk_lite  # noqa: F401

    seen, failures, compiled = set(), 0, 0
    for launch in launches:
        key = json.dumps([launch["module"], launch["name"], launch["args"], launch["outs"],
                          launch["meta"]], sort_keys=True)
        if key in seen or not launch["module"].startswith("ejk_lite"):
            continue
        seen.add(key)
        fn = getattr(importlib.import_module(launch["module"]), launch["name"])
        for arch in archs:
            try:
                built = []
                shared = compile_launch(fn, launch, arch, built)
                compiled += 1
                if show_shared:
                    print(f"ok sm_{arch} {launch['name']} {shared} bytes "
                          f"{json.dumps(launch['meta'], sort_keys=True)[:400]}")
                if show_registers:
                    meta = {k: v for k, v in launch["meta"].items()
                            if not isinstance(v, dict)}
                    print(f"ok sm_{arch} {launch['name']} {json.dumps(meta)[:300]}\n  "
                          + ptxas_resources(built[0], arch))
            except Exception as error:  # noqa: BLE001 (report every failure, then go on)
                failures += 1
                lines = _error_lines(error)
                print(f"FAIL sm_{arch} {launch['module']}.{launch['name']} "
                      f"{json.dumps(launch['meta'], sort_keys=True)[:200]}:\n  "
                      + "\n  ".join(lines[-8:])[-1500:])
    print(f"{script}: {len(seen)} distinct package launches, {compiled} compiles ok, "
          f"{failures} failed")
    return failures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=Path)
    parser.add_argument("--package", nargs="?", type=Path, const=ROOT / "tools" / "compile_calls.py",
                        help="compile the package kernels SCRIPT launches (default: "
                             "tools/compile_calls.py)")
    parser.add_argument("--arch", nargs="+", type=int, default=[80, 90],
                        help="compute capabilities to compile for (default: 80 90)")
    parser.add_argument("--timeout", type=int, default=900, help="seconds per cell")
    parser.add_argument("--shared", action="store_true",
                        help="--package: print each launch's shared memory, in bytes")
    parser.add_argument("--registers", action="store_true",
                        help="--package: print what ptxas -v says of each launch: registers "
                             "a thread, spilled bytes, performance warnings")
    args = parser.parse_args()
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("unset TRITON_INTERPRET: this process must compile (the notebook runs elsewhere)")
    if not args.notebooks and args.package is None:
        parser.error("give notebooks, --package, or both")
    failures = sum(check(nb.resolve(), args.arch, args.timeout) for nb in args.notebooks)
    if args.package is not None:
        failures += check_package(args.package.resolve(), args.arch, args.shared,
                                  args.registers)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
