"""tools/check_exercises.py: a skeleton must FAIL and its solution PASS (on executed notebooks
made up here: no kernel is started)."""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tools"))
from check_exercises import problems  # noqa: E402


def executed(skeleton_says: str, solution_says: str, tag: str = "hide-cell"):
    """A notebook of one exercise, as it is after a run: the checker's and the solution's
    printed lines in their outputs."""
    checker = nbformat.v4.new_code_cell("check_x(x);")
    checker.outputs = [nbformat.v4.new_output("stream", name="stdout", text=skeleton_says)]
    solution = nbformat.v4.new_code_cell("# Solution\nassert check_x(x)",
                                         metadata={"tags": [tag]})
    solution.outputs = [nbformat.v4.new_output("stream", name="stdout", text=solution_says)]
    return nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x = 1"), checker,
                                           solution])


def test_an_exercise_that_fails_then_passes_is_right():
    nb = executed("FAIL x: 3 of 4 element(s) wrong; ...\n", "PASS x: 4 element(s) match\n")
    assert problems(nb, "ch") == ([], 1)


@pytest.mark.parametrize("skeleton, solution, wrong", [
    ("PASS x: 4 element(s) match\n", "PASS x: 4 element(s) match\n", "does not FAIL"),
    ("FAIL x: ...\n", "FAIL x: ...\n", "does not PASS"),
    ("FAIL x: ...\n", "PASS a\nFAIL b\n", "does not PASS"),  # every case must pass
    ("", "PASS x\n", "does not FAIL"),
])
def test_a_skeleton_that_passes_or_a_solution_that_fails_is_reported(skeleton, solution,
                                                                     wrong):
    found, count = problems(executed(skeleton, solution), "ch")
    assert count == 1 and len(found) == 1 and wrong in found[0], found


def test_a_chapter_without_exercises_is_reported():
    found, count = problems(executed("FAIL\n", "PASS\n", tag="hide-input"), "ch")
    assert count == 0 and "no exercise" in found[0]
