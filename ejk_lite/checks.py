"""Argument checks shared by the ops: static numbers and floating-point arrays.

Every op takes some arguments that are *static*: Python numbers that pick a kernel's tiles, loop
bounds or constants, fixed while ``jax.jit`` traces. NumPy scalars (``np.int64(8)``, what indexing
a NumPy array gives) must behave exactly like the Python numbers they hold; a static number that
reached a kernel launch as a NumPy scalar would be taken for an array and passed as a pointer.
So every check here *returns* the Python value, and the ops use what it returns. ``bool`` (and
``np.bool_``) is refused where a number is meant: ``True`` is an ``int`` to Python, but almost
always a mistake for a size. Every error is a ``ValueError`` that names the argument.
"""

from __future__ import annotations

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
