"""One front door for launching Triton kernels from JAX, with or without a GPU.

``triton_call`` has jax-triton's calling convention::

    out = triton_call(x, y, n, kernel=add_kernel, out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
                      grid=(triton.cdiv(n, 1024),), BLOCK=1024)

* positional arguments are the kernel's leading parameters, in order: JAX arrays become pointers,
  Python ``int``/``float`` (and NumPy scalars, taken as the Python numbers they hold) become
  scalar arguments;
* one pointer per ``out_shape`` entry is appended **after** all positional arguments;
* keywords that are not launch options are ``tl.constexpr`` meta-parameters;
* ``grid`` is a tuple, or a callable that receives the meta-parameters and returns one.

On a machine with a CUDA GPU the call goes to jax-triton, which compiles the kernel and embeds it
in the XLA program (a kernel of one config that needs more shared memory than the GPU gives a
block is a ``ValueError`` there, naming the op's argument that chose its tiles: see
:func:`_check_shared_memory`). On a machine without one, the *same* ``@triton.jit`` function
runs in Triton's interpreter (``TRITON_INTERPRET=1``), called from inside the XLA program
through ``jax.pure_callback``. Both paths compose with ``jax.jit`` and ``jax.custom_vjp``; neither has a
JVP or batching rule of its own, so differentiable ops wrap their launches in ``custom_vjp``, and
ops that support ``jax.vmap`` wrap them in :func:`vmap_by_folding` (or :func:`vmap_sequentially`).

The interpreter path differs from the GPU in three deliberate ways:

* every output is filled with a poison value (NaN, or the most negative integer) before the
  launch, so elements a kernel forgets to write show up in tests;
* ``bfloat16`` tensors are handed to the kernel as ``float32`` (the interpreter's bf16 arithmetic
  is wrong); results are rounded back to ``bfloat16`` afterwards;
* an ``@triton.autotune`` kernel runs with its first config (there is no device to benchmark).

Importing ``ejk_lite`` decides which path to use, once: if JAX sees no GPU it sets
``TRITON_INTERPRET=1`` before any ejk_lite kernel is defined. Triton reads that variable each time
``@triton.jit`` decorates a function, so kernels you define after ``import ejk_lite`` (in a notebook,
say) are interpreted too. Triton's own library (``tl.sum``, ``tl.cumsum``, ...) is made of ``@jit``
functions decorated when ``triton`` is first imported, so on a machine without a GPU
``import ejk_lite`` must come before ``import triton`` (or set ``TRITON_INTERPRET=1`` yourself); the
import says so if it comes too late. Set ``TRITON_INTERPRET=1`` yourself to force the interpreter on
a GPU.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.abc
import os
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np


def _jax_sees_a_gpu() -> bool:
    try:
        return any(device.platform == "gpu" for device in jax.devices())
    except RuntimeError:  # no backend could be initialised at all
        return False


ON_GPU: bool = _jax_sees_a_gpu()
if not ON_GPU and os.environ.get("TRITON_INTERPRET", "0") != "1":
    if "triton" in sys.modules:
        raise ImportError(
            "ejk_lite: JAX sees no GPU, so Triton kernels must run in Triton's interpreter, but triton was "
            "imported before ejk_lite without TRITON_INTERPRET=1 and its library is already compiled-mode. "
            "Import ejk_lite before triton, or set TRITON_INTERPRET=1 before starting Python.")
    os.environ["TRITON_INTERPRET"] = "1"

#: True when ``triton_call`` runs kernels in Triton's interpreter (no GPU, or forced by the user).
INTERPRETER: bool = os.environ.get("TRITON_INTERPRET", "0") == "1"

import triton  # noqa: E402  (must come after TRITON_INTERPRET is settled)

GridLike = tuple[int, ...] | Callable[[dict[str, Any]], tuple[int, ...]]


def triton_call(
    *args: Any,
    kernel: Any,
    out_shape: Any,
    grid: GridLike,
    num_warps: int | None = None,
    num_stages: int | None = None,
    input_output_aliases: dict[int, int] | None = None,
    config_argument: str | None = None,
    **metaparams: Any,
) -> Any:
    """Launch ``kernel`` on ``grid`` and return the arrays described by ``out_shape``.

    ``out_shape`` is a ``jax.ShapeDtypeStruct`` (one output) or a list/tuple of them; the result
    has the same structure. See the module docstring for the argument convention.
    ``input_output_aliases`` maps an input's index among the array arguments to an output's: the
    output starts as that input (jax-triton's convention; the kernel gets both pointers).
    ``config_argument``: the op's argument that chose this launch's tiles (``"fwd_blocks"``),
    named by the error raised where they ask for more shared memory than the GPU has (see
    :func:`_check_shared_memory`; an autotuned kernel's configs are not checked: jaxlib's
    autotuner skips those the GPU cannot launch).
    """
    aliases = dict(input_output_aliases or {})
    # A NumPy scalar (np.int64(8), what indexing a NumPy array gives) is a number, not an array:
    # passed on as it is, it would become a pointer to one element.
    args = tuple(a.item() if isinstance(a, np.generic) else a for a in args)
    metaparams = {k: v.item() if isinstance(v, np.generic) else v for k, v in metaparams.items()}
    out_leaves, out_tree = jax.tree_util.tree_flatten(out_shape)
    for i, leaf in enumerate(out_leaves):
        if not (hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
            raise ValueError(f"out_shape[{i}] must have .shape and .dtype (a jax.ShapeDtypeStruct), got {leaf!r}")
    for i, arg in enumerate(args):
        if not (isinstance(arg, (int, float, bool, jax.Array, np.ndarray)) or hasattr(arg, "shape")):
            raise ValueError(f"triton_call argument {i} must be an array or a Python int/float, got {type(arg)}")

    resolved_grid = _resolve_grid(grid, kernel, metaparams)
    if any(g == 0 for g in resolved_grid):
        # Nothing to launch: every output stays poisoned, exactly as an unwritten element would
        # (or stays its aliased input).
        arrays = [a for a in args if not isinstance(a, (bool, int, float))]
        starts = {o: arrays[i] for i, o in aliases.items()}
        outs = [starts[i] if i in starts else jnp.full(s.shape, _poison(np.dtype(s.dtype)), s.dtype)
                for i, s in enumerate(out_leaves)]
        return jax.tree_util.tree_unflatten(out_tree, outs)

    if not INTERPRETER:
        jax_triton = _import_jax_triton()
        if not isinstance(kernel, triton.runtime.Autotuner):
            key = _launch_key(kernel, num_warps, num_stages, metaparams)
            _PINNED_LAUNCHES[key] = config_argument or "the op's tile configuration"
        outs = jax_triton.triton_call(
            *args, kernel=kernel, out_shape=out_shape, grid=grid,
            num_warps=num_warps, num_stages=num_stages, input_output_aliases=aliases,
            **metaparams,
        )
        outs = jax.tree_util.tree_leaves(outs)
    else:
        # (num_warps and num_stages mean nothing to the interpreter; tools/compile_check.py
        # records them here, to compile each launch as a GPU would)
        outs = _interpret(args, kernel, out_leaves, resolved_grid, metaparams, aliases,
                          dict(num_warps=num_warps, num_stages=num_stages))
    # Under shard_map the outputs vary over the mesh axes the inputs vary over (a callback's
    # results would otherwise be typed as the same on every shard).
    outs = vary_like(outs, *[a for a in args if hasattr(a, "shape")])
    return jax.tree_util.tree_unflatten(out_tree, outs)


def varying_axes(x: Any) -> frozenset:
    """The manual mesh axes of an enclosing ``shard_map`` over which ``x`` varies (none outside)."""
    aval = jax.typeof(x)
    vma = getattr(aval, "vma", None)  # its name in other JAX releases
    if vma is None:
        vma = getattr(getattr(aval, "manual_axis_type", None), "varying", ())
    return frozenset(vma)


def vary_like(values: Sequence[Any], *operands: Any) -> list[Any]:
    """``values`` typed to vary over every manual mesh axis any of ``operands`` varies over.

    Inside ``shard_map`` JAX types each value by the mesh axes it may differ over, and checks the
    types where they must agree: a loop's carry, a ``custom_vjp``'s cotangents. A constant, or
    what a callback returns, varies over nothing; computed from a shard's data it must vary as
    that data does. Outside ``shard_map`` this returns ``values`` unchanged."""
    axes = frozenset().union(*(varying_axes(x) for x in operands))
    out = []
    for x in values:
        missing = tuple(sorted(axes - varying_axes(x)))
        out.append(jax.lax.pcast(x, missing, to="varying") if missing else x)
    return out


_JAX_TRITON_LOCK = threading.Lock()
_specializer_started = False


def _import_jax_triton():
    """Import jax-triton (lazily: it needs a GPU jaxlib), keeping Triton's cache directory, and
    start Triton's specialiser without torch (once, under a lock: tracing may run in threads).

    jax-triton 0.3.1 sets ``TRITON_CACHE_DIR`` to ``""`` when imported; after that Triton's own
    runtime (``triton.testing.do_bench``, PyTorch Triton kernels in the same process) can no
    longer compile anything. Put back what was there, or Triton's default. (Measured on an H100
    with triton 3.6.0: jax-triton's launches work the same with the directory restored.)
    """
    global _specializer_started
    with _JAX_TRITON_LOCK:
        if "jax_triton" not in sys.modules:
            cache_dir = os.environ.get("TRITON_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".triton", "cache")
            import jax_triton  # noqa: F401

            os.environ["TRITON_CACHE_DIR"] = cache_dir
        if not _specializer_started:  # also when the program imported jax-triton itself
            _specializer_started = True
            _start_specializer_without_torch()
            _check_shared_memory_when_compiling(sys.modules["jax_triton"].triton_lib,
                                                max_shared_memory())
    return sys.modules["jax_triton"]


# ----------------------------------------------------------------------------------------------
# Shared memory, checked when a kernel is compiled.
#
# jax-triton compiles a kernel while XLA lowers the call, and hands the binary to XLA without
# loading it; Triton's own loader, which refuses a kernel that asks for more shared memory than
# a block may have, never runs. Such a kernel failed only when XLA ran it: on the H200, the
# attention forward's former default (128 x 128 tiles, 3 stages) with a float32 bias stopped
# the program with "JaxRuntimeError: INTERNAL: CustomCall failed: Shared memory requested
# (360448 b) exceeds device resources (232448 b)". The check below makes it a ValueError at
# lowering, naming the kernel, its tiles and the op's argument that chose them.
#
# Only ejk_lite's own launches of one config are checked. jaxlib's autotuner already skips an
# autotune config the GPU cannot launch (AutotunedKernelCall::Autotune, CanLaunchOnDevice), so an
# autotuned kernel still runs on a GPU with less shared memory than some of its configs ask for;
# and a program's own jax-triton launches are left as jax-triton makes them.
# ----------------------------------------------------------------------------------------------

# ejk_lite's launches of one config, by (kernel, num_warps, num_stages, meta-parameters): the
# argument of the op that chose the tiles.
_PINNED_LAUNCHES: dict[tuple, str] = {}
_COMPILING = threading.local()  # the launch jax-triton is compiling, in this thread
_CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97  # cuda.h


def _launch_key(kernel: Any, num_warps: int | None, num_stages: int | None,
                metaparams: dict[str, Any]) -> tuple:
    return kernel, num_warps, num_stages, tuple(sorted(metaparams.items()))


@functools.cache
def max_shared_memory(device: int = 0) -> int | None:
    """Bytes of shared memory one block may use on CUDA device ``device``: the opt-in maximum,
    the figure Triton's loader checks (232448 on an H100 or H200). ``None`` without a CUDA
    driver. Asked once per device: the ops' defaults ask at every call, and each ask would load
    the driver's library and initialise it again."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    value = ctypes.c_int()
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetAttribute(
            ctypes.byref(value), _CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN, device) != 0:
        return None
    return value.value


def _check_shared_memory(kernel_name: str, shared: int, limit: int | None, num_warps: int,
                         num_stages: int, launch: tuple | None) -> None:
    """Raise a ValueError if one of ejk_lite's launches of one config (``launch``, a key of
    :data:`_PINNED_LAUNCHES`) compiled to a kernel asking for more than ``limit`` bytes of shared
    memory. Other launches (an autotune config, a program's own) pass."""
    if limit is None or shared <= limit or launch not in _PINNED_LAUNCHES:
        return
    tiles = ", ".join(f"{k}={v}" for k, v in launch[3] if k.isupper() and isinstance(v, int)
                      and not isinstance(v, bool))
    raise ValueError(
        f"{kernel_name} ({tiles + ', ' if tiles else ''}num_warps={num_warps}, "
        f"num_stages={num_stages}) needs {shared} bytes of shared memory per program; this GPU "
        f"allows {limit}. Choose smaller tiles or fewer stages in {_PINNED_LAUNCHES[launch]}.")


def _check_shared_memory_when_compiling(triton_lib: Any, limit: int | None) -> None:
    """Wrap jax-triton's compile step (0.3.1: ``get_or_create_triton_kernel`` calls
    ``compile_ttir_inplace`` on a cache miss) with :func:`_check_shared_memory` at ``limit``
    bytes. A kernel that fails the check is not cached, so every call that would launch it
    raises."""
    get_or_create, compile_ttir = (getattr(triton_lib, "get_or_create_triton_kernel", None),
                                   getattr(triton_lib, "compile_ttir_inplace", None))
    if get_or_create is None or compile_ttir is None or getattr(compile_ttir, "_ejk_lite", False):
        return  # another jax-triton (its launches fail at run time, as before), or done

    def get_or_create_checked(*args, **kwargs):
        _COMPILING.launch = _launch_key(args[2], kwargs.get("num_warps"), kwargs.get("num_stages"),
                                        kwargs.get("metaparams", {}))
        try:
            return get_or_create(*args, **kwargs)
        finally:
            _COMPILING.launch = None

    def compile_checked(module, backend, options, *args, **kwargs):
        result = compile_ttir(module, backend, options, *args, **kwargs)
        _check_shared_memory(result.name, result.shared_mem_bytes, limit, options.num_warps,
                             options.num_stages, getattr(_COMPILING, "launch", None))
        return result

    compile_checked._ejk_lite = True
    triton_lib.get_or_create_triton_kernel = get_or_create_checked
    triton_lib.compile_ttir_inplace = compile_checked


class _RefuseTorchInThisThread(importlib.abc.MetaPathFinder):
    """An import hook under which ``import torch`` fails, in the thread that installed it only."""

    def __init__(self) -> None:
        self.thread = threading.get_ident()

    def find_spec(self, name, path=None, target=None):
        if name == "torch" and threading.get_ident() == self.thread:
            raise ModuleNotFoundError("torch is hidden while Triton's specialiser starts (ejk_lite)",
                                      name="torch")
        return None


def _start_specializer_without_torch() -> None:
    """Start Triton's argument specialiser without importing PyTorch, unless it is imported.

    jax-triton asks Triton's native specialiser (``libtriton.native_specialize_impl``) to type
    every kernel argument. Its first call imports ``torch``, to recognise ``torch.Tensor`` by
    type, and carries on without it when the import fails. Where torch is installed (Colab, our
    GPU machine) that import lengthened every process's first compile, for a JAX program that
    never passes a torch tensor: on the H100 (triton 3.6.0, torch 2.11) a first float32 forward +
    gradient of attention took 11.3 s without it and 13.6 s with it, the forward's lowering
    2.05 s against 4.58 s (bench/results/attention_fp32.json). So the first call is made here,
    with ``import torch`` made to fail in this thread only (other threads import as usual), and
    torch is importable again as soon as the call returns. A torch program that later launches
    Triton kernels in the same process still works: the specialiser recognises its tensors as it
    does any array with a ``data_ptr``, a few type checks later (tests/test_launch.py runs one on
    a GPU). Only on Triton 3.6, whose call was checked: none of the modules it imports on the
    way keeps the failed import (one that did would hold ``torch = None`` for good); another
    version's might.
    """
    if "torch" in sys.modules:  # already paid for: let Triton use it
        return
    if not triton.__version__.startswith("3.6."):
        return
    import triton._C.libtriton as libtriton

    start = getattr(libtriton, "native_specialize_impl", None)
    if start is None:
        return
    hook = _RefuseTorchInThisThread()
    sys.meta_path.insert(0, hook)
    try:
        start(None, 2, False, True, True)  # any int: only the one-time set-up matters
    except Exception:  # noqa: BLE001 (a Triton that rejects this call sets itself up later)
        pass
    finally:
        sys.meta_path.remove(hook)


# ----------------------------------------------------------------------------------------------
# The interpreter path.
# ----------------------------------------------------------------------------------------------


def _first_config(kernel: Any, metaparams: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """Unwrap ``@triton.autotune``: the interpreter runs the first config's meta-parameters."""
    if isinstance(kernel, triton.runtime.Autotuner):
        config = kernel.configs[0]
        return kernel.fn, {**config.kwargs, **metaparams}
    return kernel, metaparams


def _resolve_grid(grid: GridLike, kernel: Any, metaparams: dict[str, Any]) -> tuple[int, ...]:
    _, full_metaparams = _first_config(kernel, metaparams)
    resolved = grid(full_metaparams) if callable(grid) else grid
    resolved = tuple(int(g) for g in (resolved if isinstance(resolved, Sequence) else (resolved,)))
    if not 1 <= len(resolved) <= 3 or any(g < 0 for g in resolved):
        raise ValueError(f"grid must be 1 to 3 non-negative ints, got {resolved}")
    return resolved


def _poison(dtype: np.dtype) -> Any:
    if np.issubdtype(dtype, np.floating) or dtype == ml_dtypes.bfloat16:
        return np.nan
    if dtype == np.bool_:
        return True
    return np.iinfo(dtype).min


def _host_dtype(dtype: np.dtype) -> np.dtype:
    """The dtype a tensor has inside the interpreter: bf16 is widened to fp32."""
    return np.dtype(np.float32) if dtype == ml_dtypes.bfloat16 else np.dtype(dtype)


class _HostTensor:
    """Just enough of ``torch.Tensor`` for Triton's interpreter, over a C-contiguous ndarray.

    The interpreter copies each argument's storage "to the host", runs the kernel there and
    copies back. Our arrays already live on the host, so the storage is the array itself and the
    copies are no-ops.
    """

    def __init__(self, array: np.ndarray):
        self.array = array

    @property
    def dtype(self) -> np.dtype:
        return self.array.dtype

    def data_ptr(self) -> int:
        return self.array.ctypes.data

    def untyped_storage(self) -> _HostTensor:
        return self

    def cpu(self) -> _HostTensor:
        return self

    def storage_offset(self) -> int:
        return 0

    def size(self) -> tuple[int, ...]:
        return self.array.shape

    def stride(self) -> tuple[int, ...]:
        return tuple(s // self.array.itemsize for s in self.array.strides)

    def element_size(self) -> int:
        return self.array.itemsize

    def new_empty(self, *_shape: Any, **_kwargs: Any) -> _HostTensor:
        return _HostTensor(np.empty(0, self.array.dtype))

    def set_(self, storage: _HostTensor, *_layout: Any) -> _HostTensor:
        self.array = storage.array
        return self

    def copy_(self, other: _HostTensor) -> _HostTensor:
        if other.array is not self.array:
            np.copyto(self.array, other.array)
        return self


# The interpreter patches triton.language while a kernel runs: one launch at a time.
_INTERPRETER_LOCK = threading.Lock()


def _interpret(args, kernel, out_leaves, grid, metaparams, aliases, options=None):
    fn, metaparams = _first_config(kernel, metaparams)
    array_positions = [i for i, a in enumerate(args) if not isinstance(a, (int, float, bool))]
    arrays = [args[i] for i in array_positions]
    out_dtypes = [np.dtype(s.dtype) for s in out_leaves]

    def run_on_host(*host_arrays):
        call_args = list(args)
        for i, a in zip(array_positions, host_arrays):
            a = np.asarray(a)
            call_args[i] = _HostTensor(np.array(a, dtype=_host_dtype(a.dtype), order="C", copy=True))
        outs = [np.full(s.shape, _poison(d), dtype=_host_dtype(d)) for s, d in zip(out_leaves, out_dtypes)]
        for i, o in aliases.items():  # an aliased output starts as its input
            outs[o][...] = np.asarray(host_arrays[i], dtype=outs[o].dtype)
        with _INTERPRETER_LOCK:
            fn[grid](*call_args, *[_HostTensor(o) for o in outs], **metaparams)
        return tuple(o.astype(d) for o, d in zip(outs, out_dtypes))

    result_shapes = tuple(jax.ShapeDtypeStruct(s.shape, s.dtype) for s in out_leaves)
    return list(jax.pure_callback(run_on_host, result_shapes, *arrays))


def vmap_sequentially(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Give ``fn`` (whose body launches kernels) a batching rule: one call per mapped element.

    Neither jax-triton's primitive nor the interpreter's ``pure_callback`` can be batched, so
    ``jax.vmap`` of a function that launches kernels fails without this. The rule runs ``fn`` once
    per element of the mapped axis (``lax.map``), with the unmapped arguments shared; outputs are
    all mapped. Ops whose kernels have a batch axis of their own fold the mapped axis into it
    instead, which launches once: see :func:`vmap_by_folding`.
    """

    @jax.custom_batching.custom_vmap
    def mapped(*args):
        return fn(*args)

    @mapped.def_vmap
    def rule(axis_size, in_batched, *args):
        return _map_sequentially(mapped, args, in_batched)

    return mapped


def _map_sequentially(fn, args, in_batched):
    """``lax.map`` of ``fn`` over the batched leaves of ``args``: the body of a sequential rule."""
    leaves, tree = jax.tree_util.tree_flatten(args)
    flags = jax.tree_util.tree_leaves(in_batched)
    batched = [leaf for leaf, flag in zip(leaves, flags) if flag]

    def one(batched_leaves):
        it = iter(batched_leaves)
        merged = [next(it) if flag else leaf for leaf, flag in zip(leaves, flags)]
        return fn(*jax.tree_util.tree_unflatten(tree, merged))

    out = jax.lax.map(one, batched)
    return out, jax.tree_util.tree_map(lambda _: True, out)


def vmap_by_folding(
    fn: Callable[..., Any],
    in_axes: Sequence[int | None],
    out_axes: int | Sequence[int | None],
    prepare: Callable[[int, list[Any], list[bool]], tuple[list[Any], list[bool]]] | None = None,
) -> Callable[..., Any]:
    """Give ``fn`` (whose body launches kernels) a batching rule that launches *once*, folding
    the mapped axis into an axis of independent rows that its kernels already have.

    ``fn`` takes positional arguments, each an array or ``None``. ``in_axes[i]`` names the axis of
    argument ``i`` that holds independent rows (a batch axis): under ``jax.vmap`` element ``j`` of
    the mapped axis becomes rows ``j * d ... (j + 1) * d - 1`` of it, a reshape that copies nothing
    when the axis is the leading one. An unmapped argument that has such an axis (one array for
    every element) is broadcast along the mapped axis first, a copy. ``None`` marks an argument
    every row shares (``cu_seqlens``, say): if it is mapped, the rows would differ in more than
    their data and nothing can be folded; the rule then falls back to one call per element
    (``lax.map``, as :func:`vmap_sequentially`). ``out_axes`` (one per output leaf, or one for
    all) says where the rows of each output are; ``None`` marks an output that is the same for
    every element (a stand-in), returned unmapped.

    ``prepare(axis_size, args, batched)`` may rewrite the arguments before folding, to turn a
    mapped argument that has no row axis into one that has (``recurrent`` adds a mapped per-head
    decay into its per-token gates).

    The rule calls the wrapped function again on the folded arguments, so nested ``vmap`` folds
    every mapped axis into the same rows; it composes with ``jax.jit`` and, inside a
    ``custom_vjp``'s forward and backward, with ``jax.grad``.
    """
    in_axes = tuple(in_axes)

    @jax.custom_batching.custom_vmap
    def mapped(*args):
        return fn(*args)

    @mapped.def_vmap
    def rule(axis_size, in_batched, *args):
        args, batched = list(args), [flag is True for flag in in_batched]
        if prepare is not None:
            args, batched = prepare(axis_size, args, batched)
        if any(flag and axis is None for flag, axis in zip(batched, in_axes)):
            flags = tuple(None if arg is None else flag for arg, flag in zip(args, batched))
            return _map_sequentially(mapped, tuple(args), flags)
        folded = [None if arg is None or axis is None else
                  _fold(arg if flag else _broadcast(arg, axis_size), axis)
                  for arg, flag, axis in zip(args, batched, in_axes)]
        folded = [arg if f is None else f for arg, f in zip(args, folded)]
        out = mapped(*folded)
        leaves, tree = jax.tree_util.tree_flatten(out)
        axes = [out_axes] * len(leaves) if isinstance(out_axes, int) else list(out_axes)
        if len(axes) != len(leaves):
            raise ValueError(f"vmap_by_folding: {len(axes)} out_axes for {len(leaves)} outputs")
        leaves = [leaf if axis is None else _unfold(leaf, axis, axis_size)
                  for leaf, axis in zip(leaves, axes)]
        return (jax.tree_util.tree_unflatten(tree, leaves),
                jax.tree_util.tree_unflatten(tree, [axis is not None for axis in axes]))

    return mapped


def _broadcast(x: Any, axis_size: int) -> Any:
    return jnp.broadcast_to(x, (axis_size, *x.shape))


def _fold(x: Any, axis: int) -> Any:
    """``x`` with its leading (mapped) axis merged into ``axis`` of the rest, as the major part."""
    n = x.shape[0]
    x = jnp.moveaxis(x, 0, axis)
    return x.reshape(*x.shape[:axis], n * x.shape[axis + 1], *x.shape[axis + 2:])


def _unfold(x: Any, axis: int, n: int) -> Any:
    """The inverse of :func:`_fold`: split ``n`` off the front of ``axis`` and move it first."""
    x = x.reshape(*x.shape[:axis], n, x.shape[axis] // n, *x.shape[axis + 1:])
    return jnp.moveaxis(x, axis, 0)
