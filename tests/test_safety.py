"""Garbage ``cu_seqlens`` under ``jax.jit`` must never take the process down.

Under ``jax.jit`` the values of ``cu_seqlens`` are unknown, so nothing can check them, and the
kernels index memory with them. Negative, huge, decreasing or wrapped offsets used to send the
kernels outside their arrays: SIGSEGV or heap corruption in Triton's interpreter, an illegal
address on a GPU. Two defences, each tested on its own, in a child process (a crash there fails
the test instead of killing pytest; see ``safety_child.py``):

* the ops hand the kernels ``sanitize_cu_seqlens(cu_seqlens)``, the nearest valid packing: the
  answer on garbage is then the float64 reference's answer on that packing ("public");
* the kernels clamp every index they load from memory before using it as an address: launched
  directly on garbage, without the sanitization, they must still survive ("kernels").
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import ejk_lite
from conftest import TOLERANCE

CHILD = Path(__file__).with_name("safety_child.py")
OPS = ["local", "global", "mean", "blocks", "recurrent", "chunked"]
KINDS = ["negative", "int_min", "int_max", "decreasing", "not_from_zero", "beyond_the_end", "uint32_wraps_negative"]


def run_child(op, layer):
    env = dict(os.environ)
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, str(CHILD), op, layer], capture_output=True, text=True, env=env,
                          timeout=600)
    lines = done.stdout.splitlines()
    started = [line for line in lines if not line.startswith("{")]
    report = f"exit status {done.returncode}; last case started: {started[-1] if started else None}\n" \
             f"stderr:\n{done.stderr[-3000:]}"
    assert done.returncode == 0, report
    results = {r["kind"]: r for r in (json.loads(line) for line in lines if line.startswith("{"))}
    assert sorted(results) == sorted(KINDS), report
    return results


@pytest.mark.parametrize("op", OPS)
def test_garbage_cu_seqlens_under_jit_gives_the_sanitized_packings_answer(op):
    for kind, result in run_child(op, "public").items():
        assert result["output"] < TOLERANCE["float32"], (kind, result)
        assert result["gradient"] < TOLERANCE["float32"], (kind, result)


@pytest.mark.parametrize("op", OPS)
def test_kernels_stay_in_bounds_on_garbage_without_the_sanitization(op):
    for kind, result in run_child(op, "kernels").items():
        assert result["survived"], kind
