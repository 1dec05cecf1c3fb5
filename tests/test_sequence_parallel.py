"""Sequence parallelism on a CPU mesh: the ops under ``jax.shard_map`` over 1, 2 and 4 shards give
the one-device answer and gradients (``ejk_lite.sequence_parallel``).

A CPU mesh needs ``XLA_FLAGS=--xla_force_host_platform_device_count=4`` before JAX starts, and
this process's JAX started long ago with one device: every case runs in a child process
(``sequence_parallel_child.py``), one per group, which prints one JSON line per case; the asserts
are here. Each case compares the sharded op's output and the gradient of every array argument
with the float64 reference on the whole sequence and with the same op on one device.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import pytest
from conftest import TOLERANCE

import ejk_lite

CHILD = Path(__file__).with_name("sequence_parallel_child.py")
# The child's devices: four CPU devices without a GPU; on a GPU machine its GPUs (one in the GPU
# check: the one-shard path).
DEVICES = len(jax.devices()) if ejk_lite.ON_GPU else 4
SHARDS = tuple(n for n in (1, 2, 4) if n <= DEVICES)

CASES = {
    "attention": ["causal", "window_both_sides", "documents", "documents_causal_window_sinks",
                  "bias_sliced_along_queries", "documents_bfloat16", "cross_attention_causal"],
    "zigzag": ["zigzag_causal", "zigzag_documents"],
    "recurrent": ["g", "g_gamma", "gk", "gv", "all", "all_reverse", "all_bfloat16", "all_scan"],
    "packed": ["packed_none", "packed_all", "packed_all_reverse", "packed_one_long",
               "packed_all_reverse_scan",
               "packed_empty_sequences", "packed_no_sequence"],
    "chunked": ["chunked_g", "chunked_all_reverse", "chunked_packed_all",
                "chunked_packed_all_reverse"],
}


def run_child(group: str) -> list[dict]:
    env = dict(os.environ)
    env["XLA_FLAGS"] = " ".join([env.get("XLA_FLAGS", ""),
                                 "--xla_force_host_platform_device_count=4"]).strip()
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, str(CHILD), group], capture_output=True, text=True,
                          env=env, timeout=1500)
    assert done.returncode == 0, f"exit status {done.returncode}\nstdout:\n{done.stdout[-2000:]}" \
                                 f"\nstderr:\n{done.stderr[-4000:]}"
    return [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]


@pytest.mark.heavy  # a child process each: 45-276 s on 2 cores (conftest)
@pytest.mark.parametrize("group", list(CASES))
def test_sharded_op_gives_the_one_device_answer_and_gradients(group):
    results = [r for r in run_child(group) if "shards" in r]
    assert sorted((r["case"], r["shards"]) for r in results) == \
        sorted((case, n) for case in CASES[group] for n in SHARDS)
    for result in results:
        for against in ("reference", "one_device"):
            errors = result[against]
            assert errors and "output" in errors and "d0" in errors, result
            bad = {k: e for k, e in errors.items() if not e < TOLERANCE[result["dtype"]]}
            assert not bad, (result["case"], result["shards"], against, bad)


def test_zigzag_layout_balances_causal_work():
    """Tiles each of 4 shards visits under a causal mask: the zigzag layout gives every shard the
    same number (and the total is the contiguous layout's); contiguous slices grow 1 : 3 : 5 : 7
    (plus the diagonal's partial tiles). The zigzag cases of the group above check the answers."""
    tiles = {r["case"]: r["tiles"] for r in run_child("balance")}
    contiguous, zigzag = tiles["balance_contiguous"], tiles["balance_zigzag"]
    assert sum(contiguous) == sum(zigzag)
    assert len(set(zigzag)) == 1, zigzag
    assert contiguous == sorted(contiguous) and contiguous[-1] > 4 * contiguous[0], contiguous


ERRORS = {
    "attention_unbound_axis": "sequence_parallelism_mesh_axis_name='nope' is not an axis",
    "attention_axis_not_a_str": "sequence_parallelism_mesh_axis_name must be a str",
    "attention_outside_shard_map": "sequence_parallelism_mesh_axis_name='sp' is not an axis",
    "attention_check_vma_off": "check_vma=True",
    "attention_layout": "qkv_layouts and mask_builder",
    "attention_positions_not_a_slice": "q_positions must be this shard's slice",
    "attention_seq_len_does_not_divide": "does not evenly divide",  # shard_map's own check
    "zigzag_seq_len_does_not_divide": "seq_len (12) must be a multiple of 2 * num_shards (8)",
    "recurrent_unbound_axis": "sequence_parallelism_mesh_axis_name='nope' is not an axis",
    "recurrent_axis_not_a_str": "sequence_parallelism_mesh_axis_name must be a str",
    "recurrent_cu_seqlens_past_the_end": "cu_seqlens[-1] = 9 is beyond the 8 tokens",
    "recurrent_cu_seqlens_batch": "cu_seqlens packs sequences along one row",
    "recurrent_seq_len_does_not_divide": "does not evenly divide",
    "chunked_unbound_axis": "sequence_parallelism_mesh_axis_name='nope' is not an axis",
    "chunked_gv": "gv (a decay along V) is not supported by chunked_recurrent",
    "chunked_chunk_size": "chunk_size must be 16, 32, 64 or 128",
}
if SHARDS[-1] == 1:  # one device: every length divides
    del ERRORS["attention_seq_len_does_not_divide"], ERRORS["recurrent_seq_len_does_not_divide"]


def test_bad_arguments_raise_value_errors_naming_them():
    results = {r["case"]: r for r in run_child("errors")}
    assert sorted(results) == sorted(ERRORS)
    for case, expected in ERRORS.items():
        assert results[case]["raised"] == "ValueError", results[case]
        assert expected in results[case]["message"], results[case]
