"""Insert or refresh the setup cell (and the note before it) in every chapter of the book.

Each chapter must run on its own when downloaded from the built page and opened on a hosted GPU
notebook, so the setup cell is copied into every notebook rather than imported. This script holds
the one canonical text. It is idempotent: cells tagged ``setup`` and ``setup-note`` are removed and
inserted afresh right after the chapter's title cell.

    python tools/sync_setup_cell.py                 # every book/*.ipynb
    python tools/sync_setup_cell.py book/new.ipynb  # one chapter (a new one, say)
    python tools/sync_setup_cell.py --check         # exit 1 if any chapter is out of date
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

SETUP_CELL = '''\
# Setup for a hosted GPU notebook (Colab, Kaggle, a cloud VM). It does nothing where
# `import ejk_lite` already works (a clone set up as the README says); otherwise it
# installs ejk_lite and the GPU set the book was tested with. The runtime needs
# Python 3.12 and an NVIDIA GPU of compute capability 8.0 or newer (Ampere or newer:
# A100, L4, H100, ...) with a CUDA 13 driver. Where does your copy of ejk_lite live?
# A git URL, a path or a wheel:
EJK_LITE_SOURCE = "git+https://github.com/YOUR-ACCOUNT/ejk_lite"  # <- change this line
GPU_SET = ["jax[cuda13]==0.11.2", "triton==3.6.0", "jax-triton==0.3.1"]

import importlib.util
import os
import subprocess
import sys
from importlib import metadata


def _missing(requirement):  # "name[extra]==version" is not installed at that version
    name, version = requirement.split("==")
    try:
        return metadata.version(name.split("[")[0]) != version
    except metadata.PackageNotFoundError:
        return True


if importlib.util.find_spec("ejk_lite") is None:
    source = os.environ.get("EJK_LITE_SOURCE", EJK_LITE_SOURCE)  # the environment wins
    if "YOUR-ACCOUNT" in source:
        raise RuntimeError("Set EJK_LITE_SOURCE (top of this cell) to your ejk_lite")
    wanted = [r for r in GPU_SET if _missing(r)] + [source]
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", *wanted], check=True)
    importlib.invalidate_caches()'''

NOTE = '''\
> **Running this chapter.** The outputs on this page were computed when the book was built, by
> Triton's interpreter on a CPU, at the small sizes the code picks there; the GPU measurements
> are in `bench/results/` and plotted in the [Performance](performance.ipynb) chapter. To run
> the chapter on a GPU, download it (the download button at the top of the page) and open it
> in a notebook runtime with Python 3.12 and an NVIDIA GPU of compute capability 8.0 or newer
> (Ampere or newer: A100, L4, H100, ...) with a CUDA 13 driver. The setup cell below installs
> `ejk_lite` and the pinned GPU set (set its `EJK_LITE_SOURCE` first); where `import ejk_lite`
> already works it does nothing.'''

NOTES = {  # chapters whose outputs are not the interpreter's
    "performance": '''\
> **Reading this chapter.** The figures here are GPU measurements, read from
> `bench/results/*.json` (each file's device, date and versions are printed below); nothing is
> timed when the book is built. The other chapters' printed outputs come from Triton's
> interpreter on a CPU, at small sizes. The setup cell below matters only if you open the
> chapter on a hosted notebook; where `import ejk_lite` already works it does nothing.''',
}

TAGS = ("setup-note", "setup")


def lines(text: str) -> list[str]:
    parts = text.split("\n")
    return [p + "\n" for p in parts[:-1]] + [parts[-1]]


def setup_cells(chapter: str) -> list[dict]:
    note = {"cell_type": "markdown", "id": "ejk-setup-note", "metadata": {"tags": ["setup-note"]},
            "source": lines(NOTES.get(chapter, NOTE))}
    code = {"cell_type": "code", "execution_count": None, "id": "ejk-setup",
            "metadata": {"tags": ["setup", "hide-input"]}, "outputs": [],
            "source": lines(SETUP_CELL)}
    return [note, code]


def synced(nb: dict, chapter: str) -> dict:
    cells = [c for c in nb["cells"] if not set(c.get("metadata", {}).get("tags", [])) & set(TAGS)]
    title = next((i for i, c in enumerate(cells) if c["cell_type"] == "markdown"
                  and "".join(c["source"]).lstrip().startswith("# ")), None)
    if title is None:
        raise SystemExit(f"{chapter}: no markdown cell starting with a '# ' title")
    return {**nb, "cells": cells[:title + 1] + setup_cells(chapter) + cells[title + 1:]}


def dump(nb: dict) -> str:
    return json.dumps(nb, indent=1, ensure_ascii=False) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="*", type=Path)
    parser.add_argument("--check", action="store_true", help="change nothing; fail if out of date")
    args = parser.parse_args()
    stale = 0
    for path in args.notebooks or sorted((ROOT / "book").glob("*.ipynb")):
        text = path.read_text()
        new = dump(synced(json.loads(text), path.stem))
        if new != text:
            stale += 1
            if not args.check:
                path.write_text(new)
            print(f"{'out of date' if args.check else 'updated'}: {path}")
    return 1 if args.check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
