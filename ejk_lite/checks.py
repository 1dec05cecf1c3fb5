"""Argument checks shared by every op: static numbers, configs, `impl`, dtypes and index arrays.

Every op takes some arguments that are *static*: Python numbers that pick a kernel's tiles, loop
bounds or constants, fixed while ``jax.jit`` traces. NumPy scalars (``np.int64(8)``, what indexing
a NumPy array gives) must behave exactly like the Python numbers they hold; a static number that
reached a kernel launch as a NumPy scalar would be taken for an array and passed as a pointer.
So every check here *returns* the Python value, and the ops use what it returns. ``bool`` (and
``np.bool_``) is refused where a number is meant: ``True`` is an ``int`` to Python, but almost
always a mistake for a size. Every error is a ``ValueError`` that names the argument.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


def static_int(value: Any, name: str, minimum: int = 0) -> int:
    """``value`` as a Python ``int`` if it is an integer (Python or NumPy) ``>= minimum``.

    Floats (even ``8.0``), bools and JAX arrays are refused: a JAX array may be a tracer, whose
    value is unknown while tracing; pass ``int(x)`` where it is concrete.
    """
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) \
            or value < minimum:
        what = {0: "a non-negative", 1: "a positive"}.get(minimum, f"an (>= {minimum})")
        raise ValueError(f"{name} must be {what} int (a Python or NumPy integer, static under "
                         f"jax.jit), got {value!r}")
    return int(value)


def static_float(value: Any, name: str) -> float:
    """``value`` as a Python ``float`` if it is a finite real number: Python, NumPy, or a concrete
    0-d JAX array of a real dtype (not a bool, not a tracer). ``nan`` and ``inf`` are refused:
    as a scale they would only turn every output into NaN or inf."""
    real = isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_))
    if not real and getattr(value, "shape", None) == () and hasattr(value, "dtype"):
        dtype = jnp.dtype(value.dtype)
        real = (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)) \
            and concrete_value(value) is not None
    if not real:
        raise ValueError(f"{name} must be a Python or NumPy real number (static under jax.jit), "
                         f"got {value!r}")
    if not np.isfinite(float(value)):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    return float(value)


def concrete_value(x: Any) -> np.ndarray | None:
    """``x`` as a NumPy array when its value is known now, ``None`` while it is being traced."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def check_floating(x: Any, name: str, optional: bool = False) -> None:
    """Raise unless ``x`` is an array of a floating dtype (or ``None`` when ``optional``).

    Integer and bool inputs are refused rather than computed in integer arithmetic (a mean or a
    decayed state of integers would be silently truncated).
    """
    if x is None and optional:
        return
    dtype = getattr(x, "dtype", None)
    if dtype is None or not hasattr(x, "shape"):
        raise ValueError(f"{name} must be an array, got {type(x).__name__}")
    if not jnp.issubdtype(dtype, jnp.floating):
        raise ValueError(f"{name} must have a floating dtype, got {dtype}")


# ----------------------------------------------------------------------------------------------
# Static ints that pick tiles: positive, powers of two.
# ----------------------------------------------------------------------------------------------


def next_power_of_2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``); a Python int, for tile sizes."""
    return 1 << max(0, int(n) - 1).bit_length()


def power_of_two(value: Any, name: str) -> int:
    """``value`` as a Python ``int`` if it is a positive power of two (``tl.arange`` sizes are)."""
    value = static_int(value, name, minimum=1)
    if value & (value - 1):
        raise ValueError(f"{name} must be a positive power of two, got {value!r}")
    return value


def optional_int(value: Any, name: str, minimum: int = 1, power_of_2: bool = False) -> int | None:
    """``None``, or ``value`` checked as :func:`static_int` (and :func:`power_of_two`)."""
    if value is None:
        return None
    return power_of_two(value, name) if power_of_2 else static_int(value, name, minimum=minimum)


def static_bool(value: Any, name: str) -> bool:
    """``value`` as a Python bool: ``True``, ``False`` or a NumPy bool. Anything else (``1``,
    ``"yes"``, a JAX array, which may be a tracer) is a ``ValueError`` naming ``name``."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    raise ValueError(f"{name} must be True or False, got {value!r}")


def validated_fields(config: Any, powers_of_two: tuple[str, ...] = (),
                     flags: tuple[str, ...] = ()) -> dict[str, int | bool | None]:
    """The fields of a config dataclass, each ``None`` or a static int ``>= 1`` (a power of two
    when named in ``powers_of_two``), as Python ints, or a bool when named in ``flags``; a
    ``ValueError`` names the bad field (``"RecurrentConfig.block_k must be ..."``). The ops'
    frozen configs call this from their ``__post_init__``, so an invalid config cannot be built
    at all."""
    cls = type(config).__name__
    return {f.name: static_bool(getattr(config, f.name), f"{cls}.{f.name}") if f.name in flags
            else optional_int(getattr(config, f.name), f"{cls}.{f.name}",
                              power_of_2=f.name in powers_of_two)
            for f in dataclasses.fields(config)}


def freeze_fields(config: Any, values: dict[str, Any]) -> None:
    """Store checked values on a frozen dataclass (from its ``__post_init__``)."""
    for name, value in values.items():
        object.__setattr__(config, name, value)


def check_config(config: Any, cls: type, name: str = "config") -> Any:
    """``config`` if it is ``None`` or a ``cls``; a ``ValueError`` naming ``name`` otherwise."""
    if config is not None and not isinstance(config, cls):
        raise ValueError(f"{name} must be a {cls.__name__} or None, got {config!r}")
    return config


# ----------------------------------------------------------------------------------------------
# Which implementation runs, and what Triton takes.
# ----------------------------------------------------------------------------------------------

IMPLS = ("auto", "xla", "triton")

#: Input dtypes the Triton kernels take: they accumulate in float32, so float64 would lose bits
#: silently (use ``impl="xla"`` for it).
TRITON_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


def resolve_impl(impl: Any, auto: str | None = None) -> str:
    """``"xla"`` or ``"triton"``: what ``impl`` (``"auto"``, ``"xla"`` or ``"triton"``) runs.

    ``"auto"`` is Triton on a GPU and XLA elsewhere: on a CPU the kernels run in Triton's
    interpreter, which is for testing, not for speed (pass ``impl="triton"`` to test them).
    An op may pass ``auto`` to say otherwise; attention resolves ``"auto"`` itself, to Triton
    wherever its kernels support the call, because its XLA path is the dense reference, which
    builds the whole ``[T, S]`` score matrix.
    """
    if not isinstance(impl, str) or impl not in IMPLS:
        raise ValueError(f"impl must be 'auto', 'xla' or 'triton', got {impl!r}")
    if impl != "auto":
        return impl
    if auto is not None:
        return auto
    from ejk_lite.launch import ON_GPU  # here: launch settles TRITON_INTERPRET when imported

    return "triton" if ON_GPU else "xla"


def check_triton_dtype(x: Any, name: str) -> None:
    """Raise unless the Triton kernels take ``x``'s dtype (float16, bfloat16 or float32)."""
    if jnp.dtype(x.dtype) not in TRITON_DTYPES:
        raise ValueError(f"{name}: the Triton kernels take float16, bfloat16 or float32, got "
                         f"{x.dtype}; use impl='xla'")


# ----------------------------------------------------------------------------------------------
# Index arrays (cu_seqlens, segment ids, block lists): integer arrays whose values address memory.
# ----------------------------------------------------------------------------------------------


def check_index_array(x: Any, name: str, ndim: int | None = None, optional: bool = False) -> None:
    """Raise unless ``x`` is an array of an integer dtype (of rank ``ndim`` when given).

    Index arrays must be integers: a float offset would be truncated, a bool one read as 0/1.
    Their *values* are another matter: checked where concrete, clamped inside the kernels where
    traced (see :mod:`ejk_lite.packing`).
    """
    if x is None and optional:
        return
    if not hasattr(x, "shape") or not hasattr(x, "dtype"):
        raise ValueError(f"{name} must be an integer array, got {type(x).__name__}")
    if ndim is not None and len(x.shape) != ndim:
        raise ValueError(f"{name} must be a {ndim}-D integer array, got shape {tuple(x.shape)}")
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise ValueError(f"{name} must have an integer dtype, got {x.dtype}")
