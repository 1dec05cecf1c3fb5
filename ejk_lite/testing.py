"""What "right" means for the tests and the benchmarks: one error metric, one tolerance table.

Every check in ``tests/`` and ``bench/`` compares an output with a reference by the relative L2
error ``‖out − ref‖ / ‖ref‖`` (:func:`relative_error`) and accepts it within :func:`tolerance` of
the output's dtype. The reference is float64 (NumPy, or JAX under ``enable_x64``) where the arrays
are small; the benchmarks' large outputs are compared on the device in float32 instead, with a
float32 reference or another implementation's bf16 result, which the same table covers: float32's
own rounding (~6e-8) is far below every entry.

Nothing here is imported by the ops: it is a helper for whoever checks them.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

#: Relative L2 error allowed, by the dtype of the result, against a float64 reference: a few times
#: each dtype's rounding (float32 2^-24, float16 2^-11, bfloat16 2^-8) on sums of many terms.
TOLERANCE = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}

#: Gradients in bfloat16 / float16: on a GPU the kernels feed p and dS to ``tl.dot`` in the input
#: dtype (as every FlashAttention backward does), and dQ / dK sum T or S such rounded products:
#: their error is a few times the output's, whose only rounding is the final store.
GRADIENT_SLACK = 3.0


def tolerance(dtype: Any, gradient: bool = False) -> float:
    """The relative error allowed for a result of ``dtype``: :data:`TOLERANCE`, times
    :data:`GRADIENT_SLACK` for a gradient in a 16-bit dtype."""
    name = jnp.dtype(dtype).name
    if name not in TOLERANCE:
        raise ValueError(f"dtype: no tolerance for {name} (only {', '.join(TOLERANCE)})")
    slack = GRADIENT_SLACK if gradient and name != "float32" else 1.0
    return TOLERANCE[name] * slack


def relative_error(out: Any, ref: Any) -> float:
    """``‖out − ref‖ / ‖ref‖``; ``inf`` where ``out`` holds a NaN or an inf (an element a kernel
    never wrote shows as NaN in the interpreter). Shapes must be equal (``ValueError``).

    With a NumPy array or a float64 one on either side (a precise reference), both go to the host
    and the error is computed in float64 (a JAX array of a narrower dtype goes through float32).
    With other JAX arrays on both sides it is computed on their device, in float32, and only
    three numbers come back: a benchmark's outputs are too large to copy to the host every check.
    """
    if tuple(np.shape(out)) != tuple(np.shape(ref)):
        raise ValueError(f"shapes differ: {tuple(np.shape(out))} vs {tuple(np.shape(ref))}")
    if all(isinstance(x, jax.Array) and x.dtype != jnp.float64 for x in (out, ref)):
        diff, norm, finite = (float(x) for x in jax.device_get(_error_parts(out, ref)))
    else:
        out, ref = _host_float64(out), _host_float64(ref)
        diff, norm = float(np.sum(np.square(out - ref))), float(np.sum(np.square(ref)))
        finite = bool(np.all(np.isfinite(out)))
    if not finite:
        return float("inf")
    return math.sqrt(diff) / max(math.sqrt(norm), 1e-30)


@jax.jit
def _error_parts(out: jax.Array, ref: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    o, r = out.astype(jnp.float32), ref.astype(jnp.float32)
    return jnp.sum(jnp.square(o - r)), jnp.sum(jnp.square(r)), jnp.all(jnp.isfinite(o))


def _host_float64(x: Any) -> np.ndarray:
    if isinstance(x, jax.Array) and x.dtype != jnp.float64:
        x = x.astype(jnp.float32)
    return np.asarray(x, np.float64)
