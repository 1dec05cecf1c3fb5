"""Do the book's exercises fail as committed and pass with their solutions?

Every exercise of a chapter is three code cells: the skeleton (a hole filled with a deliberately
wrong line), the checker, which calls ``ejk_lite.notebook.check_exercise`` and prints ``PASS``
or ``FAIL`` lines, and the solution, tagged ``hide-cell``, which redefines the skeleton and
``assert``s the checker. nbmake and the book build run the notebook, so a wrong *solution*
stops them; nothing there notices a skeleton that passes (an exercise with nothing left to do).
This script executes a notebook (as nbmake does) and checks, for every solution cell that
calls a ``check_*`` function, that the checker cell before it printed at least one ``FAIL``
and that the solution printed ``PASS`` lines and no ``FAIL``.

    python tools/check_exercises.py book/x.ipynb [more ...] [--timeout 900]

Prints one line per exercise; exit 1 if any is wrong, or if a chapter has no exercise.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

CHECK_CALL = re.compile(r"\bassert\s+check_\w+\(")


def stdout(cell) -> str:
    return "".join(o.get("text", "") for o in cell.get("outputs", [])
                   if o.get("output_type") == "stream")


def problems(nb, name: str) -> tuple[list[str], int]:
    """(one line per problem, how many exercises) of an executed notebook."""
    code = [c for c in nb.cells if c.cell_type == "code"]
    found, exercises = [], 0
    for before, cell in zip(code, code[1:]):
        if "hide-cell" not in cell.metadata.get("tags", []) or \
                not CHECK_CALL.search(cell.source):
            continue
        exercises += 1
        first = cell.source.splitlines()[0][:60]
        skeleton, solution = stdout(before), stdout(cell)
        if not re.search(r"^FAIL ", skeleton, re.M):
            found.append(f"{name}: the skeleton before the solution {first!r} does not "
                         f"FAIL: {skeleton.strip()[:200]!r}")
        if not re.search(r"^PASS ", solution, re.M) or re.search(r"^FAIL ", solution, re.M):
            found.append(f"{name}: the solution {first!r} does not PASS: "
                         f"{solution.strip()[:200]!r}")
        print(f"{name}: exercise {exercises}: skeleton "
              f"{'FAIL' if 'FAIL ' in skeleton else 'no FAIL'}, solution "
              f"{'PASS' if 'PASS ' in solution and 'FAIL ' not in solution else 'not PASS'}")
    if not exercises:
        found.append(f"{name}: no exercise (a hide-cell solution that asserts a check_*)")
    return found, exercises


def main() -> int:
    import nbformat
    from nbclient import NotebookClient

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument("--timeout", type=int, default=900, help="seconds per cell")
    args = parser.parse_args()
    found = []
    for path in args.notebooks:
        path = path.resolve()
        nb = nbformat.read(str(path), as_version=4)
        NotebookClient(nb, timeout=args.timeout, kernel_name="python3",
                       resources={"metadata": {"path": str(path.parent)}}).execute()
        found += problems(nb, path.name)[0]
    for line in found:
        print(line)
    print(f"check_exercises: {len(args.notebooks)} notebook(s), {len(found)} problem(s)")
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
