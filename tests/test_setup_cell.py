"""The chapters' setup cell, run as synced into a chapter, on fake runtimes.

No real pip and no real nvidia-smi: ``subprocess.run``, ``importlib.metadata.version``,
``platform.python_version`` and ``importlib.util.find_spec("ejk_lite")`` are mocked, so these
tests are fast and run on a CPU. Each fake runtime has a set of installed distributions, an
nvidia-smi (or none) and a Python version; the fake pip "installs" what it is asked for.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
from sync_setup_cell import PLACEHOLDER, repository_url  # noqa: E402

PLACEHOLDER_URL = f"https://github.com/{PLACEHOLDER}/ejk_lite"
A100 = "NVIDIA A100-SXM4-40GB, 8.0, 580.65.06\n"
H100_TWO = "NVIDIA H100 80GB HBM3, 9.0, 580.159.04\nNVIDIA H100 80GB HBM3, 9.0, 580.159.04\n"
T4 = "Tesla T4, 7.5, 550.54.15\n"
OLD_DRIVER = "NVIDIA A100-SXM4-40GB, 8.0, 535.104.05\n"
GPU_READY = {"jax": "0.11.2", "jaxlib": "0.11.2", "jax-cuda13-plugin": "0.11.2",
             "triton": "3.6.0", "jax-triton": "0.3.1", "numpy": "2.5.2", "matplotlib": "3.11.2",
             "ipywidgets": "8.1.9"}
CPU_ONLY_JAX = {"jax": "0.11.2", "jaxlib": "0.11.2", "triton": "3.6.0", "numpy": "2.3.5"}
# What the fake pip installs for each requirement (name without extras/pins: version).
PIP_GIVES = {"jax[cuda13]": {"jax": "0.11.2", "jaxlib": "0.11.2", "jax-cuda13-plugin": "0.11.2"},
             "jax": {"jax": "0.11.2", "jaxlib": "0.11.2"}, "triton": {"triton": "3.6.0"},
             "jax-triton": {"jax-triton": "0.3.1"}, "numpy": {"numpy": "2.3.5"},
             "matplotlib": {"matplotlib": "3.11.2"}, "ipywidgets": {"ipywidgets": "8.1.9"}}


def setup_source(chapter: str = "introduction") -> str:
    """The setup cell's text as synced into a chapter (not a copy)."""
    nb = json.loads((ROOT / "book" / f"{chapter}.ipynb").read_text())
    [cell] = [c for c in nb["cells"] if "setup" in c.get("metadata", {}).get("tags", [])]
    return "".join(cell["source"])


class Runtime:
    """A fake notebook runtime: installed distributions, nvidia-smi, Python, pip calls."""

    def __init__(self, monkeypatch, installed=None, smi=None, python="3.12.1",
                 ejk_lite_importable=False, source="/somewhere/ejk_lite"):
        self.installed = dict(installed or {})
        self.smi, self.pip, self.smi_calls = smi, [], 0
        real_find_spec = importlib.util.find_spec

        def find_spec(name, *args, **kwargs):
            if name == "ejk_lite" and not ejk_lite_importable:
                return None
            return real_find_spec(name, *args, **kwargs)

        monkeypatch.setattr(importlib.metadata, "version", self.version)
        monkeypatch.setattr(subprocess, "run", self.run)
        monkeypatch.setattr(platform, "python_version", lambda: python)
        monkeypatch.setattr(importlib.util, "find_spec", find_spec)
        monkeypatch.delenv("EJK_LITE_REPOSITORY", raising=False)
        if source is None:
            monkeypatch.delenv("EJK_LITE_SOURCE", raising=False)
        else:
            monkeypatch.setenv("EJK_LITE_SOURCE", source)

    def version(self, name):
        if self.installed.get(name) is None:
            raise importlib.metadata.PackageNotFoundError(name)
        return self.installed[name]

    def run(self, cmd, **kwargs):
        if cmd[0] == "nvidia-smi":
            self.smi_calls += 1
            if self.smi is None:
                raise FileNotFoundError(2, "No such file or directory", "nvidia-smi")
            if isinstance(self.smi, int):  # nvidia-smi there, but failing
                return subprocess.CompletedProcess(cmd, self.smi, "", "NVIDIA-SMI has failed")
            return subprocess.CompletedProcess(cmd, 0, self.smi, "")
        assert cmd[:5] == [sys.executable, "-m", "pip", "install", "-q"], cmd
        assert kwargs.get("check"), "a failed pip must stop the cell"
        self.pip.append(cmd[5:])
        for requirement in cmd[5:]:
            name = re.split(r"[=<>]", requirement)[0]
            self.installed.update(PIP_GIVES.get(name, {"ejk_lite": "0.1.0"}))
        return subprocess.CompletedProcess(cmd, 0, "", "")

    def run_cell(self, text: str | None = None) -> dict:
        namespace = {}
        exec(compile(text or setup_source(), "<setup cell>", "exec"), namespace)
        return namespace


def one_sentence(message: str) -> bool:
    return message.endswith(".") and message.count(". ") == 0


# ---- the cell's text ----------------------------------------------------------------------


def test_every_chapter_has_the_same_cell_with_the_configured_url():
    texts = {setup_source(p.stem) for p in (ROOT / "book").glob("*.ipynb")}
    assert len(texts) == 1
    assert f'REPOSITORY = "{repository_url()}"' in texts.pop()


# ---- the decision: setup_plan and restart_needed, pure ------------------------------------


@pytest.fixture
def cell(monkeypatch):
    """The cell's functions, from running it where ejk_lite imports (it then installs nothing)."""
    runtime = Runtime(monkeypatch, ejk_lite_importable=True)
    namespace = runtime.run_cell()
    assert runtime.pip == [] and runtime.smi_calls == 0
    return namespace


def test_plan_no_gpu_installs_the_cpu_set(cell):
    wanted, said = cell["setup_plan"]("3.12.1", None, {})
    assert wanted == ["jax==0.11.2", "triton==3.6.0", "numpy<2.4", "matplotlib", "ipywidgets"]
    assert "No NVIDIA GPU" in said and "interpreter" in said and one_sentence(said)


def test_plan_no_gpu_replaces_a_numpy_too_new_for_the_interpreter(cell):
    wanted, _ = cell["setup_plan"]("3.12.1", None, {**CPU_ONLY_JAX, "numpy": "2.4.1",
                                                     "matplotlib": "3.9", "ipywidgets": "8.1"})
    assert wanted == ["numpy<2.4"]


def test_plan_gpu_installs_the_gpu_set(cell):
    wanted, said = cell["setup_plan"]("3.12.1", A100, {})
    assert wanted == ["jax[cuda13]==0.11.2", "triton==3.6.0", "jax-triton==0.3.1",
                      "matplotlib", "ipywidgets"]
    assert said.startswith("NVIDIA A100-SXM4-40GB (compute capability 8.0, driver 580.65.06)")


def test_plan_cpu_only_jax_gets_the_cuda_plugin(cell):
    wanted, _ = cell["setup_plan"]("3.12.1", H100_TWO, CPU_ONLY_JAX)
    assert "jax[cuda13]==0.11.2" in wanted and "triton==3.6.0" not in wanted


def test_plan_everything_there_installs_nothing_more(cell):
    assert cell["setup_plan"]("3.12.1", A100, GPU_READY)[0] == []
    assert cell["setup_plan"]("3.12.1", None, GPU_READY)[0] == ["numpy<2.4"]


@pytest.mark.parametrize("python, smi, words", [
    ("3.11.9", None, ["Python 3.11.9", "Python 3.12"]),
    ("3.13.0", A100, ["Python 3.13.0", "Python 3.12"]),
    ("3.12.1", T4, ["Tesla T4", "compute capability 7.5", "8.0", "interpreter"]),
    ("3.12.1", "Tesla V100-SXM2-16GB, 7.0, 580.65.06", ["V100", "7.0"]),
    ("3.12.1", OLD_DRIVER, ["535.104.05", "CUDA 13", "580"]),
])
def test_plan_refuses_with_one_sentence(cell, python, smi, words):
    with pytest.raises(RuntimeError) as error:
        cell["setup_plan"](python, smi, {})
    message = str(error.value)
    assert all(w in message for w in words), message
    assert one_sentence(message), message


def test_restart_needed(cell):
    restart = cell["restart_needed"]
    none = dict.fromkeys(GPU_READY)
    assert restart(none, GPU_READY, False) == []            # a clean install
    assert restart(none, GPU_READY, True) == []             # (jax cannot be loaded: absent)
    old = {**GPU_READY, "triton": "3.4.0"}                  # a torch-pinned triton, replaced
    assert restart(old, GPU_READY, False) == ["triton"]
    no_plugin = {**GPU_READY, "jax-cuda13-plugin": None}    # the plugin added to jax 0.11.2:
    assert restart(no_plugin, GPU_READY, True) == ["jax-cuda13-plugin"]   # jax was imported
    assert restart(no_plugin, GPU_READY, False) == []                     # jax not imported
    assert restart(GPU_READY, GPU_READY, True) == []


# ---- the whole cell on fake runtimes ------------------------------------------------------


def test_cell_where_ejk_lite_imports_does_nothing_but_export_the_url(monkeypatch):
    runtime = Runtime(monkeypatch, ejk_lite_importable=True)
    runtime.run_cell()
    assert runtime.pip == [] and runtime.smi_calls == 0
    assert os.environ["EJK_LITE_REPOSITORY"] == repository_url()


@pytest.mark.parametrize("smi", [None, 9], ids=["no nvidia-smi", "nvidia-smi fails"])
def test_cell_no_gpu(monkeypatch, capsys, smi):
    runtime = Runtime(monkeypatch, smi=smi)
    runtime.run_cell()
    assert runtime.pip == [["jax==0.11.2", "triton==3.6.0", "numpy<2.4", "matplotlib",
                            "ipywidgets", "/somewhere/ejk_lite"]]
    out = capsys.readouterr().out
    assert "No NVIDIA GPU" in out and "Restart" not in out


def test_cell_gpu_from_scratch(monkeypatch, capsys):
    runtime = Runtime(monkeypatch, smi=A100)
    runtime.run_cell()
    assert runtime.pip == [["jax[cuda13]==0.11.2", "triton==3.6.0", "jax-triton==0.3.1",
                            "matplotlib", "ipywidgets", "/somewhere/ejk_lite"]]
    assert "Restart" not in capsys.readouterr().out


def test_cell_cpu_only_jax_gets_the_plugin_and_a_restart(monkeypatch, capsys):
    import jax  # noqa: F401  (imported in this process, as after a cell that used it)

    runtime = Runtime(monkeypatch, smi=A100, installed={**CPU_ONLY_JAX, "matplotlib": "3.10",
                                                        "ipywidgets": "8.1.9"})
    runtime.run_cell()
    assert runtime.pip == [["jax[cuda13]==0.11.2", "jax-triton==0.3.1", "/somewhere/ejk_lite"]]
    assert runtime.installed["jax-cuda13-plugin"] == "0.11.2"
    out = capsys.readouterr().out
    assert "Changed jax-cuda13-plugin. Restart the runtime (Runtime > Restart session) and " \
           "run the cells again." in out


def test_cell_replacing_a_torch_pinned_triton_asks_for_a_restart(monkeypatch, capsys):
    runtime = Runtime(monkeypatch, smi=A100, installed={**GPU_READY, "triton": "3.5.1"})
    runtime.run_cell()
    assert runtime.pip == [["triton==3.6.0", "/somewhere/ejk_lite"]]
    assert "Changed triton. Restart the runtime" in capsys.readouterr().out


def test_cell_everything_there_installs_only_ejk_lite(monkeypatch, capsys):
    runtime = Runtime(monkeypatch, smi=A100, installed=GPU_READY)
    runtime.run_cell()
    assert runtime.pip == [["/somewhere/ejk_lite"]]
    assert "Restart" not in capsys.readouterr().out


@pytest.mark.parametrize("kind, smi, python", [("T4", T4, "3.12.1"),
                                                ("old driver", OLD_DRIVER, "3.12.1"),
                                                ("Python 3.11", None, "3.11.9")])
def test_cell_stops_before_installing(monkeypatch, kind, smi, python):
    runtime = Runtime(monkeypatch, smi=smi, python=python)
    with pytest.raises(RuntimeError):
        runtime.run_cell()
    assert runtime.pip == []


def test_cell_placeholder_url_asks_for_ejk_lite_source(monkeypatch):
    text = setup_source().replace(f'"{repository_url()}"', f'"{PLACEHOLDER_URL}"')
    runtime = Runtime(monkeypatch, smi=None, source=None)
    with pytest.raises(RuntimeError, match="EJK_LITE_SOURCE") as error:
        runtime.run_cell(text)
    assert one_sentence(str(error.value)) and runtime.pip == []


def test_cell_real_url_installs_from_it(monkeypatch):
    url = "https://github.com/someone/ejk_lite"
    text = setup_source().replace(f'"{repository_url()}"', f'"{url}"')
    runtime = Runtime(monkeypatch, smi=None, source=None)
    runtime.run_cell(text)
    assert runtime.pip[0][-1] == f"git+{url}"
    assert os.environ["EJK_LITE_REPOSITORY"] == url
