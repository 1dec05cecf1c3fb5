"""Checks on the book's notebooks that the build does not make.

* every line of every code cell is at most 90 characters: the built page's code column shows
  about that many, and a longer line hides its end (a mask, an ``other=``, a cast) behind a
  scroll bar;
* no code cell draws into an ipywidgets ``Output`` widget (``interact`` and friends): see
  ``OUTPUT_WIDGET`` below;
* no notebook carries outputs or execution counts: notebooks are committed clean, and the book
  build and nbmake execute them afresh;
* every cell has an id of its own, as nbformat 4.5 asks (``CELL_ID``): nbformat warns of each
  missing one on every read ("will become a hard error in future nbformat versions") and makes
  up a new one in every copy it writes;
* every chapter opens with the current setup cell for hosted notebooks, holding the repository
  URL of ``_config.yml``; the ``git clone`` commands of ``README.md`` and ``book/index.md`` clone
  that URL; ``bench/results/index.json`` lists the results files (``python
  tools/sync_setup_cell.py`` writes all of these).

    python tools/check_book.py [book/x.ipynb ...]     # default: every book/*.ipynb, and the rest

Exit status 1, with one line per problem, if any check fails.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_LINE = 90
# ipywidgets' interact, interactive, interactive_output and Output draw into an Output widget,
# whose mirrored state made nbclient (nbmake, the book build) wait out a cell's whole timeout
# on the H100: the live figures go through ejk_lite.notebook.live_figure instead.
OUTPUT_WIDGET = re.compile(r"\b(interact|interactive|interactive_output|Output)\(")
# nbformat 4.5's cell id: 1 to 64 letters, digits, '-' and '_', unique within the notebook.
CELL_ID = re.compile(r"[a-zA-Z0-9_-]{1,64}")


def problems(path: Path) -> list[str]:
    found = []
    nb = json.loads(path.read_text())
    name = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    ids = [cell.get("id") for cell in nb["cells"]]
    for index, cell_id in enumerate(ids):
        if not isinstance(cell_id, str) or not CELL_ID.fullmatch(cell_id):
            found.append(f"{name} cell {index}: no valid cell id ({cell_id!r}): 1-64 of "
                         "[a-zA-Z0-9_-]")
        elif ids.index(cell_id) != index:
            found.append(f"{name} cell {index}: cell id {cell_id!r} is cell "
                         f"{ids.index(cell_id)}'s too")
    for index, cell in enumerate(nb["cells"]):
        if cell["cell_type"] != "code":
            continue
        where = f"{name} cell {index}"
        if cell.get("outputs"):
            found.append(f"{where}: has outputs (clear them before committing)")
        if cell.get("execution_count") is not None:
            found.append(f"{where}: has an execution count (clear outputs before committing)")
        for number, line in enumerate("".join(cell["source"]).splitlines(), 1):
            if OUTPUT_WIDGET.search(line):
                found.append(f"{where} line {number}: an Output widget ({line.strip()[:40]}): "
                             "use ejk_lite.notebook.live_figure, see its module docstring")
            if len(line) > MAX_LINE:
                found.append(f"{where} line {number}: {len(line)} > {MAX_LINE} characters: "
                             f"{line.strip()[:60]}...")
    return found


def sync_problems(paths: list[Path] | None) -> list[str]:
    """What ``tools/sync_setup_cell.py`` would change (``paths``: these chapters only)."""
    sys.path.insert(0, str(ROOT / "tools"))
    from sync_setup_cell import derived

    why = {".ipynb": "setup cell missing or out of date",
           ".md": "a `git clone` URL is not _config.yml's repository url",
           ".json": "does not list the files of bench/results"}
    return [f"{path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}: "
            f"{why[path.suffix]} (run python tools/sync_setup_cell.py)"
            for path, text in derived(paths).items()
            if not path.exists() or path.read_text() != text]


def main() -> int:
    chosen = [Path(p).resolve() for p in sys.argv[1:]]
    paths = chosen or sorted((ROOT / "book").glob("*.ipynb"))
    found = [p for path in paths for p in problems(path)] + sync_problems(chosen or None)
    for line in found:
        print(line)
    print(f"check_book: {len(paths)} notebook(s), {len(found)} problem(s)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
