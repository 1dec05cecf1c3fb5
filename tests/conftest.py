"""Shared test helpers: fresh random inputs, float64 references, relative errors."""

import os
import zlib

import jax
import numpy as np
import pytest

import ejk_lite  # noqa: F401  (settles TRITON_INTERPRET before any test defines a kernel)

jax.config.update("jax_enable_x64", False)

# Relative-error tolerances by input dtype, ‖out − ref‖ / ‖ref‖ against a float64 reference.
TOLERANCE = {"float32": 1e-5, "float16": 2e-3, "bfloat16": 1.6e-2}


def rel_err(out, ref) -> float:
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert np.all(np.isfinite(out)), "output has NaN/inf (an element was never written?)"
    return float(np.linalg.norm(out - ref) / max(np.linalg.norm(ref), 1e-30))


@pytest.fixture
def rng(request):
    """A NumPy generator seeded from the test's name: fresh data per test, reproducible per test."""
    # crc32, not hash(): Python salts str hashes per process, which would change the data every run.
    seed = zlib.crc32(request.node.nodeid.encode()) if os.environ.get("EJK_RANDOM_SEED") is None \
        else int(os.environ["EJK_RANDOM_SEED"])
    return np.random.default_rng(seed)
