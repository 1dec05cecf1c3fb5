"""The triton_call front door: argument convention, poisoning, dtypes, jit and custom_vjp."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import triton
import triton.language as tl

from ejk_lite import INTERPRETER, triton_call
from conftest import rel_err


@triton.jit
def axpy_kernel(x_ptr, y_ptr, n, alpha, out_ptr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    x = tl.load(x_ptr + offsets, mask=mask).to(tl.float32)
    y = tl.load(y_ptr + offsets, mask=mask).to(tl.float32)
    tl.store(out_ptr + offsets, (alpha * x + y).to(out_ptr.dtype.element_ty), mask=mask)


def axpy(alpha, x, y, n=None):
    n = x.size if n is None else n
    return triton_call(
        x, y, n, alpha,
        kernel=axpy_kernel,
        out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
        grid=lambda meta: (triton.cdiv(x.size, meta["BLOCK"]),),
        BLOCK=128,
    )


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_scalar_arguments_and_dtypes(rng, dtype):
    x = rng.standard_normal(1000).astype(np.float32)
    y = rng.standard_normal(1000).astype(np.float32)
    alpha = float(rng.uniform(0.5, 2.0))
    out = jax.jit(axpy, static_argnums=0)(alpha, jnp.asarray(x, dtype), jnp.asarray(y, dtype))
    assert out.dtype == jnp.dtype(dtype)
    ref = alpha * np.asarray(jnp.asarray(x, dtype), np.float64) + np.asarray(jnp.asarray(y, dtype), np.float64)
    tol = {"float32": 1e-6, "float16": 1e-3, "bfloat16": 8e-3}[dtype]
    assert rel_err(np.asarray(out, np.float64), ref) < tol


@pytest.mark.skipif(not INTERPRETER, reason="poisoning is a feature of the interpreter path")
def test_unwritten_elements_are_nan(rng):
    x = jnp.asarray(rng.standard_normal(300), jnp.float32)
    out = np.asarray(axpy(2.0, x, x, n=299))  # the kernel is told to stop one element short
    assert np.isnan(out[-1])
    assert not np.isnan(out[:-1]).any()


@triton.jit
def two_outputs_kernel(x_ptr, n, sum_ptr, idx_ptr, BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets, mask=offsets < n, other=0.0)
    tl.store(sum_ptr, tl.sum(x, axis=0))
    tl.store(idx_ptr + offsets, offsets, mask=offsets < n)


def test_several_outputs_and_int_dtypes(rng):
    x = jnp.asarray(rng.standard_normal(50), jnp.float32)
    total, idx = triton_call(
        x, 50, kernel=two_outputs_kernel, grid=(1,), BLOCK=64,
        out_shape=(jax.ShapeDtypeStruct((), jnp.float32), jax.ShapeDtypeStruct((50,), jnp.int32)),
    )
    np.testing.assert_allclose(float(total), float(np.asarray(x, np.float64).sum()), rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(idx), np.arange(50))


@triton.jit
def double_prefix_kernel(x_ptr, start_ptr, n, out_ptr, BLOCK: tl.constexpr):
    """out[:n] = 2 x[:n]; the rest of out is not written (out aliases start)."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offsets, mask=offsets < n)
    tl.store(out_ptr + offsets, 2 * x, mask=offsets < n)


@pytest.mark.parametrize("blocks", [1, 0])
def test_an_aliased_output_starts_as_its_input(rng, blocks):
    """input_output_aliases (jax-triton's convention: indices among the array arguments): what
    the kernel does not write keeps the input's values; with an empty grid, all of it does."""
    x, start = (jnp.asarray(rng.standard_normal(300), jnp.float32) for _ in range(2))
    out = triton_call(x, start, 120, kernel=double_prefix_kernel, grid=(blocks * 3,), BLOCK=128,
                      out_shape=jax.ShapeDtypeStruct((300,), jnp.float32),
                      input_output_aliases={1: 0})
    out, x, start = np.asarray(out), np.asarray(x), np.asarray(start)
    written = 120 if blocks else 0
    np.testing.assert_array_equal(out[:written], 2 * x[:written])
    np.testing.assert_array_equal(out[written:], start[written:])


def test_custom_vjp_and_grad(rng):
    @jax.custom_vjp
    def scaled_add(x, y):
        return axpy(3.0, x, y)

    scaled_add.defvjp(lambda x, y: (scaled_add(x, y), None), lambda _, g: (axpy(3.0, g, jnp.zeros_like(g)), g))
    x = jnp.asarray(rng.standard_normal(200), jnp.float32)
    y = jnp.asarray(rng.standard_normal(200), jnp.float32)
    w = jnp.asarray(rng.standard_normal(200), jnp.float32)
    gx, gy = jax.jit(jax.grad(lambda a, b: jnp.sum(w * scaled_add(a, b)), argnums=(0, 1)))(x, y)
    np.testing.assert_allclose(np.asarray(gx), 3.0 * np.asarray(w), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(gy), np.asarray(w), rtol=1e-6)


@triton.autotune(configs=[triton.Config({"BLOCK": 64}), triton.Config({"BLOCK": 256})], key=["n"])
@triton.jit
def autotuned_copy_kernel(x_ptr, n, out_ptr, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(out_ptr + offsets, tl.load(x_ptr + offsets, mask=offsets < n), mask=offsets < n)


def test_autotuned_kernel(rng):
    x = jnp.asarray(rng.standard_normal(1000), jnp.float32)
    out = triton_call(x, x.size, kernel=autotuned_copy_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                      grid=lambda meta: (triton.cdiv(x.size, meta["BLOCK"]),))
    np.testing.assert_array_equal(np.asarray(out), np.asarray(x))


def test_bad_out_shape_is_a_value_error():
    with pytest.raises(ValueError, match="out_shape"):
        triton_call(jnp.ones(4), kernel=axpy_kernel, out_shape=(4,), grid=(1,))


@pytest.mark.skipif(not INTERPRETER, reason="only a machine without a GPU switches to the interpreter")
def test_importing_triton_first_is_a_clear_error():
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", "import triton; import ejk_lite"],
                            capture_output=True, text=True, env=env)
    assert result.returncode != 0
    assert "Import ejk_lite before triton" in result.stderr


_SPECIALIZER_CHILD = r"""
import sys, types
import ejk_lite.launch as launch
import triton._C.libtriton as libtriton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import CUDABackend

if sys.argv[1] == "imported":  # a program that imported torch first: left alone
    import torch
    launch._start_specializer_without_torch()
    assert sys.modules["torch"] is torch
    print("ok")
    raise SystemExit
launch._start_specializer_without_torch()
assert "torch" not in sys.modules, "the specialiser's start imported torch"
assert not any(isinstance(f, launch._RefuseTorchInThisThread) for f in sys.meta_path)
# what jax-triton asks: a scalar, and an array-like known by its data_ptr (a pointer, 16-aligned)
backend = CUDABackend(GPUTarget("cuda", 90, 32))
assert libtriton.native_specialize_impl(backend, 7, False, True, True) == ("i32", "")
array = types.SimpleNamespace(data_ptr=lambda: 64, dtype="fp32")
assert libtriton.native_specialize_impl(backend, array, False, True, True) == ("*fp32", "D")
assert "torch" not in sys.modules, "Triton's specialiser imported torch"
import torch  # importable as before
assert torch.FAKE
print("ok")
"""


@pytest.mark.parametrize("case", ["not imported", "imported"])
def test_specializer_starts_without_torch(case, tmp_path):
    """Triton's native specialiser imports torch on its first call (2.3 s of a first float32
    attention forward + gradient on the H100, bench/results/attention_fp32.json): ejk_lite
    starts it with the import failing. In a fresh process (the start happens once), with a
    stand-in ``torch`` module on the path, so that the test means the same with or without
    torch installed. The "imported" case checks only that a process which imported torch first
    is left alone."""
    import os
    import subprocess
    import sys

    (tmp_path / "torch.py").write_text("FAKE = True\nclass Tensor:\n    pass\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(tmp_path), os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    child = subprocess.run([sys.executable, "-c", _SPECIALIZER_CHILD, case.split()[0]],
                           capture_output=True, text=True, timeout=120, env=env)
    assert child.returncode == 0 and child.stdout.strip().endswith("ok"), child.stderr[-2000:]


_TORCH_KERNEL_CHILD = r"""
import ejk_lite.launch as launch
launch._start_specializer_without_torch()  # as ejk_lite's first GPU compile does
import sys
assert "torch" not in sys.modules, "the specialiser's start imported torch"
import torch
import triton
import triton.language as tl


@triton.jit
def double(x_ptr, y_ptr, N: tl.constexpr):
    offsets = tl.arange(0, N)
    tl.store(y_ptr + offsets, tl.load(x_ptr + offsets) * 2)


x = torch.randn(64, device="cuda")
y = torch.full_like(x, float("nan"))
double[(1,)](x, y, N=64)
torch.cuda.synchronize()
assert torch.equal(y, x * 2), (x, y)
print("ok")
"""


@pytest.mark.skipif(INTERPRETER, reason="torch's Triton kernels need a GPU")
def test_torch_triton_kernels_run_after_the_specializer_started_without_torch(tmp_path):
    """The claim of ``_start_specializer_without_torch``: a torch program that launches Triton
    kernels after ejk_lite's first compile, in the same process, still works (its tensors are
    specialised as any array with a ``data_ptr``). The child is a file: ``@triton.jit`` reads
    its kernel's source, which ``python -c`` does not keep."""
    import importlib.util
    import subprocess
    import sys

    if importlib.util.find_spec("torch") is None:
        pytest.skip("torch is not installed")
    import os

    script = tmp_path / "torch_kernel_child.py"
    script.write_text(_TORCH_KERNEL_CHILD)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [os.getcwd(), os.environ.get("PYTHONPATH", "")]))
    child = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                           timeout=300, env=env)
    assert child.returncode == 0 and child.stdout.strip().endswith("ok"), child.stderr[-3000:]


def test_shared_memory_past_the_gpu_is_a_value_error(monkeypatch):
    """jax-triton compiles a kernel while XLA lowers the call and never loads it, so a kernel
    asking for more shared memory than the GPU gives a block failed only inside XLA, at run time.
    ejk_lite wraps jax-triton's compile step to raise a ValueError at lowering instead, for its
    own launches of one config, naming the kernel, its tiles and the op's argument that chose
    them. Autotune configs and a program's own launches pass (jaxlib's autotuner skips configs
    the GPU cannot launch). The wrapping, here on a stand-in for jax-triton's two functions, so
    that it runs without a GPU (test_attention.py has the real thing, on a GPU)."""
    import types

    import ejk_lite.launch as launch

    shared = {"bytes": 0}
    lib = types.SimpleNamespace()

    def compile_ttir_inplace(module, backend, options, compute_capability, platform):
        return types.SimpleNamespace(name="axpy_kernel", shared_mem_bytes=shared["bytes"])

    def get_or_create_triton_kernel(backend_init, platform, fn, arg_dtypes, scalar_args, *,
                                    num_warps, num_stages, metaparams, **_):
        options = types.SimpleNamespace(num_warps=num_warps or 4, num_stages=num_stages or 3)
        return lib.compile_ttir_inplace(None, None, options, 90, platform)  # as jax-triton: a global

    lib.compile_ttir_inplace = compile_ttir_inplace
    lib.get_or_create_triton_kernel = get_or_create_triton_kernel
    launch._check_shared_memory_when_compiling(lib, 232448)
    wrapped = lib.compile_ttir_inplace
    launch._check_shared_memory_when_compiling(lib, 232448)  # a second time changes nothing
    assert lib.compile_ttir_inplace is wrapped and wrapped is not compile_ttir_inplace
    # what triton_call records of two launches of one config, one naming the op's argument
    named = {"BLOCK": 128, "EVEN": True}
    monkeypatch.setitem(launch._PINNED_LAUNCHES, launch._launch_key(axpy_kernel, 8, 3, named),
                        "config")
    monkeypatch.setitem(launch._PINNED_LAUNCHES, launch._launch_key(axpy_kernel, None, None,
                                                                    {"BLOCK": 64}),
                        "the op's tile configuration")

    def compile_for(num_warps, num_stages, metaparams):
        return lib.get_or_create_triton_kernel(None, "cuda", axpy_kernel, [], [],
                                               num_warps=num_warps, num_stages=num_stages,
                                               metaparams=metaparams)

    shared["bytes"] = 232448  # all a block may have: compiles
    assert compile_for(8, 3, named).name
    shared["bytes"] = 232449
    with pytest.raises(ValueError, match=r"axpy_kernel \(BLOCK=128, num_warps=8, num_stages=3\) "
                                         r"needs 232449 bytes .* allows 232448\. .* in config\."):
        compile_for(8, 3, named)
    # an op that named no argument: the kernel, its tiles and jax-triton's defaults
    with pytest.raises(ValueError, match=r"axpy_kernel \(BLOCK=64, num_warps=4, num_stages=3\) .*"
                                         r"in the op's tile configuration\."):
        compile_for(None, None, {"BLOCK": 64})
    # not one of ejk_lite's launches of one config (an autotune config, a program's own): left
    # to jaxlib, whose autotuner skips what the GPU cannot launch
    assert compile_for(8, 3, {"BLOCK": 256}).name
    # without a CUDA driver there is no limit to check against
    launch._check_shared_memory("axpy_kernel", 10**9, None, 4, 3,
                                launch._launch_key(axpy_kernel, 8, 3, named))
