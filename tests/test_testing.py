"""ejk_lite.testing: the one error metric and tolerance table of the tests and the benchmarks."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ejk_lite.testing import GRADIENT_SLACK, TOLERANCE, relative_error, tolerance


def test_host_and_device_give_the_same_error(rng):
    ref = rng.normal(size=(3, 50))
    out = ref + 1e-3 * rng.normal(size=ref.shape)
    expected = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    host = relative_error(out, ref)  # NumPy: float64 on the host
    device = relative_error(jnp.asarray(out, jnp.float32), jnp.asarray(ref, jnp.float32))
    assert host == pytest.approx(expected, rel=1e-12)
    assert device == pytest.approx(expected, rel=1e-3)  # float32 inputs, float32 sums
    with jax.enable_x64(True):  # a float64 reference stays float64: compared on the host
        assert relative_error(jnp.asarray(out), jnp.asarray(ref)) == pytest.approx(expected,
                                                                                   rel=1e-12)


@pytest.mark.parametrize("where", ["host", "device"])
def test_nan_or_inf_in_the_output_is_an_infinite_error(rng, where):
    ref = rng.normal(size=(4, 8)).astype(np.float32)
    for bad in (np.nan, np.inf):
        out = ref.copy()
        out[1, 2] = bad
        args = (out, ref) if where == "host" else (jnp.asarray(out), jnp.asarray(ref))
        assert relative_error(*args) == float("inf")


def test_shapes_must_match():
    with pytest.raises(ValueError, match="shapes differ"):
        relative_error(np.zeros((2, 3)), np.zeros((3, 2)))
    with pytest.raises(ValueError, match="shapes differ"):
        relative_error(jnp.zeros((6,)), jnp.zeros((1, 6)))  # no broadcasting


def test_a_zero_reference_does_not_divide_by_zero():
    assert relative_error(np.zeros(3), np.zeros(3)) == 0.0
    assert relative_error(np.ones(3), np.zeros(3)) > 1e20


def test_tolerance_by_dtype_and_gradient():
    assert tolerance(jnp.float32) == tolerance(np.float32, gradient=True) == TOLERANCE["float32"]
    for dtype in ("bfloat16", "float16"):
        assert tolerance(dtype) == TOLERANCE[dtype]
        assert tolerance(jnp.dtype(dtype), gradient=True) == GRADIENT_SLACK * TOLERANCE[dtype]
    with pytest.raises(ValueError, match="dtype: no tolerance for int32"):
        tolerance(jnp.int32)
