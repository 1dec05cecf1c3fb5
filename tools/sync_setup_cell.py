"""Keep what a downloaded chapter needs in step with ``_config.yml``: the setup cell (and the
note before it) in every chapter, the clone commands of the README and the landing page, and
``bench/results/index.json``.

Each chapter must run on its own when downloaded from the built page and opened on a hosted
notebook, so the setup cell is copied into every notebook rather than imported. This script holds
the one canonical text and writes into it the repository URL of ``_config.yml`` (``repository:
url:``, the one place to change it). It is idempotent: cells tagged ``setup`` and ``setup-note``
are removed and inserted afresh right after the chapter's title cell; every ``git clone <URL>``
in ``README.md`` and ``book/index.md`` gets the URL; ``bench/results/index.json`` lists the
results files, for a chapter that fetches them from the repository (``ejk_lite.notebook``).

    python tools/sync_setup_cell.py                 # every book/*.ipynb, the README, the index
    python tools/sync_setup_cell.py book/new.ipynb  # one chapter (a new one, say)
    python tools/sync_setup_cell.py --check         # exit 1 if anything is out of date

Standard library only: ``tools/check_book.py`` imports it before anything is installed.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PLACEHOLDER = "YOUR-ACCOUNT"  # in _config.yml's URL until the book has a public repository
CLONE_PAGES = ("README.md", "book/index.md")  # their `git clone <URL>` lines
RESULTS = ROOT / "bench" / "results"

# The canonical setup cell. @REPOSITORY@ becomes _config.yml's URL. Every line <= 90 characters
# (tools/check_book.py). tests/test_setup_cell.py runs it, as synced into a chapter, with mocks.
SETUP_CELL = '''\
# Setup, where `import ejk_lite` does not work yet (Colab, Kaggle, a cloud VM, a laptop);
# where it works (a clone set up as the README says) the cell does nothing. It checks the
# runtime, installs what is missing and says when to restart. Python 3.12 with an NVIDIA
# GPU of compute capability >= 8.0 (A100, L4, H100, ...) and a CUDA 13 driver: the GPU
# set. No GPU: the CPU set, and the chapter runs in Triton's interpreter, at small sizes.
REPOSITORY = "@REPOSITORY@"  # from _config.yml
EJK_LITE_SOURCE = ""  # ejk_lite's git URL, path or wheel ("": git+REPOSITORY); or set
# the environment variable EJK_LITE_SOURCE
GPU_SET = {"jax[cuda13]": "==0.11.2", "triton": "==3.6.0", "jax-triton": "==0.3.1",
           "matplotlib": "", "ipywidgets": ""}
CPU_SET = {"jax": "==0.11.2", "triton": "==3.6.0", "numpy": "<2.4",  # the interpreter
           "matplotlib": "", "ipywidgets": ""}                       # needs numpy < 2.4
WATCHED = ["jax", "jaxlib", "jax-cuda13-plugin", "triton", "jax-triton", "numpy",
           "matplotlib", "ipywidgets"]

import importlib.util, os, platform, re, subprocess, sys
from importlib import metadata


def _version(name):  # the installed version of a distribution, or None
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _meets(have, pin):  # version `have` (None: absent) meets "==1.2.3", "<1.2" or ""
    if have is None or not pin:
        return have is not None
    key = lambda v: [int(n) for n in re.findall(r"\\d+", v)[:3]]
    return have == pin[2:] if pin[:2] == "==" else key(have) < key(pin[1:])


def setup_plan(python, smi, have):
    """([requirement to install], a sentence on the runtime), or RuntimeError: one
    sentence on what is missing. python: "3.12.1"; smi: nvidia-smi's "name,
    compute_cap, driver_version" lines or None; have: {distribution: version or None}"""
    if not python.startswith("3.12."):
        raise RuntimeError(f"This runtime has Python {python}; the pinned packages need "
                           "Python 3.12: choose a runtime with Python 3.12.")
    said = "No NVIDIA GPU here: the chapter runs in Triton's interpreter, at small sizes."
    pins = CPU_SET
    if smi is not None:
        gpu, cap, driver = [s.strip() for s in smi.strip().splitlines()[0].split(",")]
        # Triton 3.6 compiles bf16 tl.dot only from sm_80. Stop, not fall back: a GPU
        # runtime's jax may still find the GPU; one without runs the interpreter.
        if float(cap) < 8.0:
            raise RuntimeError(f"This GPU ({gpu}, compute capability {cap}) is too old "
                               "for the kernels, which need 8.0 or newer (A100, L4, "
                               "H100, ...): choose one, or a runtime without GPU, where "
                               "the chapter runs in Triton's interpreter.")
        # CUDA 13.0 needs an NVIDIA Linux driver >= 580 (580.65.06 in the toolkit and
        # driver table of NVIDIA's CUDA 13.0 release notes).
        if int(driver.split(".")[0]) < 580:
            raise RuntimeError(f"This GPU's driver ({driver}) is too old for CUDA 13, "
                               "which needs 580 or newer: choose a newer runtime.")
        said, pins = f"{gpu} (compute capability {cap}, driver {driver}).", GPU_SET
    parts = {"jax[cuda13]": ["jax", "jax-cuda13-plugin"]}  # the plugin, even if jax is in
    wanted = [name + pin for name, pin in pins.items()
              if not all(_meets(have.get(d), pin) for d in parts.get(name, [name]))]
    return wanted, said


def restart_needed(before, after, jax_loaded):  # replaced, or added to a loaded jax
    return [d for d in after if after[d] != before[d] and (before[d] or jax_loaded
            and before["jax"] and d.startswith("jax-cuda"))]


def setup():
    os.environ.setdefault("EJK_LITE_REPOSITORY", REPOSITORY)  # for ejk_lite.notebook
    if importlib.util.find_spec("ejk_lite") is not None:
        return
    try:
        smi = subprocess.run(["nvidia-smi", "--format=csv,noheader",
                              "--query-gpu=name,compute_cap,driver_version"],
                             capture_output=True, text=True)
        smi = smi.stdout if smi.returncode == 0 and smi.stdout.strip() else None
    except OSError:  # no nvidia-smi: no NVIDIA driver
        smi = None
    before = {d: _version(d) for d in WATCHED}
    wanted, said = setup_plan(platform.python_version(), smi, before)
    source = os.environ.get("EJK_LITE_SOURCE") or EJK_LITE_SOURCE or f"git+{REPOSITORY}"
    if "YOUR-ACCOUNT" in source:
        raise RuntimeError("The book's repository URL is a placeholder: set "
                           "EJK_LITE_SOURCE (top of this cell) to ejk_lite's git URL, "
                           "path or wheel.")
    print(said, "Installing", ", ".join(wanted + [source]))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", *wanted, source],
                   check=True)
    importlib.invalidate_caches()
    after = {d: _version(d) for d in WATCHED}
    changed = restart_needed(before, after, "jax" in sys.modules)
    if changed:
        print(f"Changed {', '.join(changed)}. Restart the runtime (Runtime > Restart "
              "session) and run the cells again.")


setup()'''

NOTE = '''\
> **Running this chapter.** The outputs on this page were computed when the book was built, by
> Triton's interpreter on a CPU, at the small sizes the code picks there; the GPU measurements
> are in `bench/results/` and plotted in the [Performance](performance.ipynb) chapter. To run
> the chapter yourself, download it (the download button at the top of the page) and open it in
> a notebook runtime with Python 3.12: on an NVIDIA GPU of compute capability 8.0 or newer
> (Ampere or newer: A100, L4, H100, ...) with a CUDA 13 driver it runs on the GPU, with no GPU
> in the interpreter. The setup cell below checks the runtime, installs what is missing
> (`ejk_lite` from `EJK_LITE_SOURCE`, the pinned GPU or CPU set) and says when to restart;
> where `import ejk_lite` already works it does nothing.'''

NOTES = {  # chapters whose outputs are not the interpreter's
    "performance": '''\
> **Reading this chapter.** The figures here are GPU measurements, read from
> `bench/results/*.json` (each file's device, date and versions are printed below); nothing is
> timed when the book is built. Downloaded on its own, the chapter fetches those files from the
> book's repository. The other chapters' printed outputs come from Triton's interpreter on a
> CPU, at small sizes. The setup cell below matters only if you open the chapter on a hosted
> notebook; where `import ejk_lite` already works it does nothing.''',
}

TAGS = ("setup-note", "setup")


def repository_url(config: Path = ROOT / "_config.yml") -> str:
    """``repository: url:`` of ``_config.yml``, read without a YAML parser."""
    inside = False
    for line in config.read_text().splitlines():
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        if not line[0].isspace():
            inside = line.split("#")[0].strip() == "repository:"
        elif inside and line.strip().startswith("url:"):
            return line.split(":", 1)[1].split(" #")[0].strip().strip("\"'")
    raise SystemExit(f"{config}: no 'url:' under 'repository:'")


def setup_cell(url: str | None = None) -> str:
    return SETUP_CELL.replace("@REPOSITORY@", url or repository_url())


def lines(text: str) -> list[str]:
    parts = text.split("\n")
    return [p + "\n" for p in parts[:-1]] + [parts[-1]]


def setup_cells(chapter: str, url: str | None = None) -> list[dict]:
    note = {"cell_type": "markdown", "id": "ejk-setup-note", "metadata": {"tags": ["setup-note"]},
            "source": lines(NOTES.get(chapter, NOTE))}
    code = {"cell_type": "code", "execution_count": None, "id": "ejk-setup",
            "metadata": {"tags": ["setup", "hide-input"]}, "outputs": [],
            "source": lines(setup_cell(url))}
    return [note, code]


def synced(nb: dict, chapter: str, url: str | None = None) -> dict:
    cells = [c for c in nb["cells"] if not set(c.get("metadata", {}).get("tags", [])) & set(TAGS)]
    title = next((i for i, c in enumerate(cells) if c["cell_type"] == "markdown"
                  and "".join(c["source"]).lstrip().startswith("# ")), None)
    if title is None:
        raise SystemExit(f"{chapter}: no markdown cell starting with a '# ' title")
    return {**nb, "cells": cells[:title + 1] + setup_cells(chapter, url) + cells[title + 1:]}


def dump(nb: dict) -> str:
    return json.dumps(nb, indent=1, ensure_ascii=False) + "\n"


def with_clone_url(text: str, url: str) -> str:
    """``text`` with every ``git clone <URL>`` cloning ``url``."""
    return re.sub(r"(git clone )(\S+)", lambda m: m.group(1) + url, text)


def results_index() -> str:
    """``bench/results/index.json``: the names of the results files, which a chapter
    downloaded on its own fetches from the repository (``ejk_lite.notebook``)."""
    names = sorted(p.stem for p in RESULTS.glob("*.json") if p.stem != "index")
    return json.dumps({"about": "the files of bench/results, written by "
                       "tools/sync_setup_cell.py", "names": names}, indent=1) + "\n"


def derived(notebooks: list[Path] | None = None) -> dict[Path, str]:
    """Every file this script writes, with the text it should have."""
    url = repository_url()
    paths = notebooks or sorted((ROOT / "book").glob("*.ipynb"))
    files = {p: dump(synced(json.loads(p.read_text()), p.stem, url)) for p in paths}
    if not notebooks:
        files.update({ROOT / page: with_clone_url((ROOT / page).read_text(), url)
                      for page in CLONE_PAGES})
        files[RESULTS / "index.json"] = results_index()
    return files


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=Path)
    parser.add_argument("--check", action="store_true", help="change nothing; fail if out of date")
    args = parser.parse_args()
    stale = 0
    for path, new in derived([p.resolve() for p in args.notebooks]).items():
        if not path.exists() or path.read_text() != new:
            stale += 1
            if not args.check:
                path.write_text(new)
            print(f"{'out of date' if args.check else 'updated'}: {path}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
