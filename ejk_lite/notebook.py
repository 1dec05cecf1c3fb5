"""Helpers for the book's notebooks: figures with live controls, the recorded GPU results, and
the checker of the exercises.

None is needed to use the kernels; they are here so that a chapter downloaded from the built
book and opened on a hosted notebook (where only the installed package is at hand) runs as it
does in a clone.

**Why ``live_figure`` and not ``ipywidgets.interact``.** ``interact`` draws into an ``Output``
widget. A notebook runner (nbclient: nbmake, the book build) mirrors an ``Output`` widget's
captured outputs back to the kernel with messages on the *shell* channel, the very socket on
which it is waiting for the cell's ``execute_reply``; sending there can swallow the wake-up for
the reply, which is then noticed only when the cell's timeout runs out (nbclient issue #312).
Measured on the H100: a cell that displays an ``Output`` widget and draws into it finished in
0.6 s and the runner went on 150 s later, exactly its cell timeout; with nbmake's 500 s timeout
the *Chunked cumsum* chapter "hung". ``live_figure`` uses no ``Output`` widget: the figure is an
ordinary output (so it is on the static page too) displayed with a ``display_id``, and the
controls, when moved in a live notebook, redraw it in place (``update_display_data``). Nothing
is sent on the shell channel while a runner executes the cell. The controls are displayed with
the widget view only, so the static page, which has no kernel to run them, omits them (the
book's ``_config.yml`` drops widget views from HTML) instead of showing dead sliders.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

__all__ = ["check_exercise", "live_figure", "recorded_results"]


def live_figure(draw: Callable[..., Any], placeholder: str | None = None,
                **controls: Any) -> None:
    """Draw ``draw(**values)`` now, and redraw it in place whenever a control changes.

    ``draw`` returns a matplotlib figure. Each keyword is an ipywidgets control (its ``value``
    is passed to ``draw`` under that name) or a plain value (passed as is). With
    ``placeholder``, that sentence stands where the figure will be until a control moves
    (for a figure whose first setting the page already shows elsewhere).
    """
    import ipywidgets as widgets
    import matplotlib.pyplot as plt
    from IPython.display import Markdown, display

    def figure():
        fig = draw(**{name: getattr(c, "value", c) for name, c in controls.items()})
        plt.close(fig)  # shown once, by the display below, not again at the end of the cell
        return fig

    handle = display(Markdown(f"*{placeholder}*") if placeholder else figure(),
                     display_id=True)
    live = [c for c in controls.values() if isinstance(c, widgets.Widget)]
    for control in live:
        control.observe(lambda _: handle.update(figure()), names="value")
    # The widget view only (no text/plain fallback): a live notebook shows the controls; the
    # static page, where nothing could run them, shows nothing.
    display({"application/vnd.jupyter.widget-view+json": {
        "model_id": widgets.HBox(live).model_id, "version_major": 2, "version_minor": 0}},
        raw=True)


def check_exercise(got: Any, expected: Any, *, rtol: float = 1e-5, atol: float = 1e-6,
                   name: str = "exercise") -> bool:
    """Compare an exercise's answer with the chapter's reference, element by element.

    Prints one line: ``PASS`` or ``FAIL``, and for a failure the first wrong element (its
    index, the value got, the value expected) and how many are wrong. Returns whether it
    passed; it never raises, so a chapter can show an unfinished exercise failing. Floats
    pass where ``|got - expected| <= atol + rtol * |expected|``, integers and booleans where
    they are equal. A NaN where a number was expected is wrong (in the interpreter, an output
    element the kernel never wrote is NaN); NaN where NaN is expected is right.
    """
    import numpy as np

    got, expected = np.asarray(got), np.asarray(expected)
    if got.shape != expected.shape:
        print(f"FAIL {name}: shape {got.shape}, expected {expected.shape}")
        return False
    # Integers and booleans compare exactly; anything else (bfloat16 included, which NumPy
    # does not count as inexact) as float64.
    exact = got.dtype.kind in "biu" and expected.dtype.kind in "biu"
    if exact:
        right = got == expected
    else:
        g, e = got.astype(np.float64), expected.astype(np.float64)
        with np.errstate(invalid="ignore"):
            right = (np.abs(g - e) <= atol + rtol * np.abs(e)) | (g == e)  # g == e: infs
        right |= np.isnan(g) & np.isnan(e)
    wrong = np.argwhere(~right)
    if len(wrong) == 0:
        print(f"PASS {name}: {got.size} element(s) match")
        return True
    index = tuple(int(i) for i in wrong[0])
    where = index if len(index) != 1 else index[0]

    def show(value):
        return str(value) if exact else f"{float(value):.6g}"

    print(f"FAIL {name}: {len(wrong)} of {got.size} element(s) wrong; the first at index "
          f"{where}: got {show(got[index])}, expected {show(expected[index])}")
    return False


class RecordedResults(dict):
    """What :func:`recorded_results` returns: ``{file stem: contents}``, and ``source``, where
    they were read or fetched from, and ``reason``, one sentence on why there are none ("" when
    there are), for a chapter to print instead of empty tables."""

    source: str = ""
    reason: str = ""


# The placeholder of _config.yml's repository URL (tools/sync_setup_cell.py): nothing to fetch.
PLACEHOLDER = "YOUR-ACCOUNT"
FETCH_TIMEOUT = 10  # seconds per file


def recorded_results(name: str | None = None) -> dict[str, dict]:
    """The GPU measurements in ``bench/results/*.json``, as ``{file stem: contents}``.

    Looked for in ``bench/results`` of the working directory or any folder above it (a clone:
    the chapters run in ``book/``). Where there is none (a chapter downloaded on its own), the
    files are fetched from the repository whose URL the chapter's setup cell exports as
    ``EJK_LITE_REPOSITORY`` (from ``_config.yml``): on GitHub, its default branch's raw files,
    the ones ``bench/results/index.json`` lists, each within ``FETCH_TIMEOUT`` seconds. ``name``
    picks one file. Returns ``{}`` when there are none: the result (a :class:`RecordedResults`)
    then says why in its ``reason``.
    """
    found = RecordedResults()
    for folder in [Path.cwd(), *Path.cwd().parents]:
        results = folder / "bench" / "results"
        if results.is_dir():
            paths = [p for p in sorted(results.glob(f"{name or '*'}.json")) if p.stem != "index"]
            found.update({p.stem: json.loads(p.read_text()) for p in paths})
            found.source = str(results)
            if not found:
                found.reason = f"No {name or 'results'} file in {results}."
            return found
    return _fetch_results(name, found)


def _fetch_results(name: str | None, found: RecordedResults) -> RecordedResults:
    import os
    import re
    import urllib.request

    url = os.environ.get("EJK_LITE_REPOSITORY", "")
    github = re.fullmatch(r"https://github\.com/([\w.-]+)/([\w.-]+?)(?:\.git)?/?", url)
    here = "There is no bench/results folder here"
    if not url:
        found.reason = (f"{here}, and no repository to fetch it from (EJK_LITE_REPOSITORY, "
                        "which the chapter's setup cell sets, is not set).")
    elif PLACEHOLDER in url:
        found.reason = (f"{here}, and the book's repository URL is still the placeholder {url}"
                        ": run the chapter in a clone, or set EJK_LITE_REPOSITORY to the "
                        "repository that holds bench/results.")
    elif github is None:
        found.reason = f"{here}, and {url} is not a GitHub repository to fetch it from."
    else:
        base = ("https://raw.githubusercontent.com/{}/{}/HEAD/bench/results/"
                .format(*github.groups()))

        def get(file):
            with urllib.request.urlopen(base + file, timeout=FETCH_TIMEOUT) as response:
                return json.loads(response.read())

        try:
            for stem in [name] if name else get("index.json")["names"]:
                found[stem] = get(f"{stem}.json")
            found.source = base
        except (OSError, ValueError, KeyError, TypeError) as error:
            found.clear()
            found.reason = f"{here}, and fetching it from {base} failed ({error})."
    return found
