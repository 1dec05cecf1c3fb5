"""Shared test helpers: fresh random inputs, float64 references, relative errors."""

import os
import zlib

import jax
import numpy as np
import pytest

import ejk_lite  # noqa: F401  (settles TRITON_INTERPRET before any test defines a kernel)
# The tolerances and the error metric, shared with bench/ (ejk_lite.testing says why each).
from ejk_lite.testing import TOLERANCE, relative_error, tolerance  # noqa: F401

jax.config.update("jax_enable_x64", False)

# cu_seqlens whose values would wrap on the way to a kernel, with the error each must raise:
# every op that takes cu_seqlens refuses them (validate_cu_seqlens).
WRAPPING_CU_SEQLENS = [
    (np.array([0, 9, 3, 12], np.uint8), "non-decreasing"),     # np.diff would say [9, 250, 9]
    (np.array([0, 9, 3, 12], np.uint32), "non-decreasing"),
    (np.array([0, 2**32 + 5], np.int64), "int32"),              # jnp.asarray would make it 5
    (np.array([0, 2**31 + 5], np.uint64), "int32"),
]


def rel_err(out, ref) -> float:
    """:func:`ejk_lite.testing.relative_error` in float64, failing the test on a NaN or an inf."""
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert np.all(np.isfinite(out)), "output has NaN/inf (an element was never written?)"
    return relative_error(out, ref)


@pytest.fixture
def rng(request):
    """A NumPy generator seeded from the test's name: fresh data per test, reproducible per test."""
    # crc32, not hash(): Python salts str hashes per process, which would change the data every run.
    seed = zlib.crc32(request.node.nodeid.encode()) if os.environ.get("EJK_RANDOM_SEED") is None \
        else int(os.environ["EJK_RANDOM_SEED"])
    return np.random.default_rng(seed)
