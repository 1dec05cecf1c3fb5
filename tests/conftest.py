"""Shared test helpers: fresh random inputs, float64 references, relative errors, offline
compiles."""

import os
import re
import subprocess
import sys
import time
import zlib
from pathlib import Path

# The README runs the tests under pytest-xdist, a worker per core: on a GPU every worker (and each
# chapter's kernel) would otherwise take 75% of the GPU's memory when JAX starts. Set before
# ejk_lite (and with it JAX's backend) is imported.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import jax  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

import ejk_lite  # noqa: E402,F401  (settles TRITON_INTERPRET before any test defines a kernel)
# The tolerances and the error metric, shared with bench/ (ejk_lite.testing says why each).
from ejk_lite.testing import TOLERANCE, relative_error, tolerance  # noqa: E402,F401

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


#: For the tests that compile kernels offline for other GPUs (tools/compile_check.py): CPU work
#: that needs no GPU and gives the same answer on any machine. CI runs them on every commit; on a
#: GPU they are skipped, since they only lengthen the GPU check (at 3228032 the three slowest of
#: its tests, 163-214 s each of 538 s at 16 workers).
def offline_compile(test):
    """Skipped on a GPU; on a CPU one of the ``heavy`` tests that run first."""
    skip = pytest.mark.skipif(ejk_lite.ON_GPU, reason="an offline compile (CPU work, the same "
                              "on any machine): CI runs it")
    return pytest.mark.heavy(skip(test))


def pytest_configure(config):
    config.addinivalue_line("markers", "heavy: minutes of CPU each; run before the other tests")


def pytest_collection_modifyitems(config, items):
    """The ``heavy`` tests first, one worker's at a time. Measured on 2 cores under 2 workers,
    cold Triton cache: the offline compiles 77-421 s each, the sequence-parallel children
    45-276 s; the other 1784 tests 4764 s in all, 2.7 s each on average (at 8c9ff8a). Started
    last, one of them would keep one worker busy for minutes after the others ran out of tests.

    pytest-xdist's worksteal hands each of W workers a contiguous range of the tests (sized by
    xdist's arithmetic, repeated below), and an idle worker takes the tail of a busy one's range.
    So the heavy tests are dealt round-robin to the heads of the ranges. All of them at the head
    of the first range (at c484a63) queued them on one worker, one after another: in the GPU check
    there, with its 5 children so queued, the tests ran past 560 s."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    heavy = [item for item in items if item.get_closest_marker("heavy")]
    light = [item for item in items if not item.get_closest_marker("heavy")]
    ordered, left = [], len(items)
    for w in range(workers):
        size = left // (workers - w)  # xdist's WorkStealingScheduling.check_schedule: num_send
        left -= size
        head = heavy[w::workers]
        tail = max(size - len(head), 0)
        ordered += head + light[:tail]
        del light[:tail]
    items[:] = ordered + light  # light is empty unless a range got more heavy tests than its size


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """``EJK_TEST_TIMING=<file>``: a line for each test's start and one for its end, appended as
    they happen, where the test runs (a pytest-xdist worker). The GPU check reads it: the slowest
    tests, and those still running when it was killed (at c484a63 its tests ran past 560 s at
    97%, and nothing said which were left)."""
    path = os.environ.get("EJK_TEST_TIMING")
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    if path:
        _timing_line(path, f"{time.time():.3f} {worker} start {item.nodeid}")
    yield
    if path:
        _timing_line(path, f"{time.time():.3f} {worker} end {item.nodeid}")


def _timing_line(path: str, line: str) -> None:
    # One write with O_APPEND: lines from several workers do not interleave.
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def compiled_package_launches(child: str, arch: int, shared_memory: int | None = None) -> int:
    """Run ``tools/compile_check.py --package tests/<child> --arch <arch>`` (the child's launches,
    recorded in the interpreter, compiled as jax-triton compiles them); assert that none failed
    and return how many compiled. ``shared_memory``: handed to the child as
    ``EJK_LITE_TEST_SHARED_MEMORY``, the bytes a block of the GPU it stands for may use."""
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # it must compile
    if shared_memory is not None:
        env["EJK_LITE_TEST_SHARED_MEMORY"] = str(shared_memory)
    done = subprocess.run([sys.executable, str(root / "tools" / "compile_check.py"), "--package",
                           str(root / "tests" / child), "--arch", str(arch)],
                          capture_output=True, text=True, cwd=root, env=env, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    found = re.search(r"(\d+) distinct package launches, (\d+) compiles ok, (\d+) failed",
                      done.stdout)
    assert found and found[3] == "0", done.stdout[-3000:]
    return int(found[2])
