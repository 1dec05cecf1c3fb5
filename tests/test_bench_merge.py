"""bench/attention.py --merge: a run of some shapes merged into the file of another run of the
same commit, as the race is recorded in two GPU calls (its 'commands' list both). Built from the
recorded bench/results/attention.json, split by shape: no GPU, nothing timed."""

from __future__ import annotations

import copy
import importlib
import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RECORDED = json.loads((ROOT / "bench" / "results" / "attention.json").read_text())
LAST_SHAPE = "B1 Hq16 Hkv16 T32768"
MEMORY = "XLA_PYTHON_CLIENT_MEM_FRACTION"  # bench/attention.py sets a default of its own


@pytest.fixture
def attention(monkeypatch):
    """bench/attention.py, for one test: what its import changes in the process (bench/ first on
    sys.path, its modules, a JAX memory fraction for the GPU workers) is undone after it."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))  # restores the whole of sys.path after
    monkeypatch.setitem(os.environ, MEMORY, os.environ.get(MEMORY, "0.85"))
    before = set(sys.modules)
    yield importlib.import_module("attention")
    for name in set(sys.modules) - before:
        if str(ROOT / "bench") in str(getattr(sys.modules[name], "__file__", "") or ""):
            del sys.modules[name]


def split_recorded(attention):
    """(the file of a first run: every shape but the last; what a second run's save() builds:
    the last shape's rows, no commit and no command, which write_result adds)."""
    first = copy.deepcopy(RECORDED)
    first.pop("commands")
    first["command"] = "bench/attention.py --out /root/out --shapes 0,1"
    first["rows"] = [r for r in first["rows"] if not r["name"].startswith(LAST_SHAPE)]
    first["summary"] = attention.summarize(first["rows"])
    payload = {k: v for k, v in copy.deepcopy(RECORDED).items()
               if k not in ("commit", "command", "commands", "op", "device", "date", "versions")}
    payload["rows"] = [r for r in payload["rows"] if r["name"].startswith(LAST_SHAPE)]
    payload.update(window_sweep=[], mask_build=[], not_run={}, failures=[])
    return first, payload


def test_a_run_merges_into_the_file_of_its_commit(attention, tmp_path, monkeypatch):
    first, payload = split_recorded(attention)
    assert first["rows"] and payload["rows"]
    path = tmp_path / "attention.json"
    path.write_text(json.dumps(first))
    monkeypatch.setenv("EJK_COMMIT", RECORDED["commit"])
    monkeypatch.setattr(sys, "argv", ["bench/attention.py", "--shapes", "2", "--merge"])
    merged = attention.merge(path, payload)
    assert merged["commands"] == [first["command"], "bench/attention.py --shapes 2 --merge"]
    assert sorted(r["name"] + r["impl"] + r["direction"] for r in merged["rows"]) == sorted(
        r["name"] + r["impl"] + r["direction"] for r in RECORDED["rows"])
    assert merged["summary"] == RECORDED["summary"]
    assert merged["window_sweep"] == first["window_sweep"]
    assert merged["mask_build"] == first["mask_build"]
    # save() merges after every case, again into the file written (write_result adds the
    # commit and the command): the commands stay two
    path.write_text(json.dumps(dict(merged, commit=RECORDED["commit"],
                                    command=" ".join(sys.argv))))
    again = attention.merge(path, payload)
    assert again["commands"] == merged["commands"] and again["rows"] == merged["rows"]


def test_a_run_of_another_commit_is_refused(attention, tmp_path, monkeypatch):
    first, payload = split_recorded(attention)
    path = tmp_path / "attention.json"
    path.write_text(json.dumps(first))
    monkeypatch.setenv("EJK_COMMIT", "0" * 40)
    with pytest.raises(SystemExit, match="one file holds one commit's figures"):
        attention.merge(path, payload)
