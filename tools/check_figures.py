"""How large does each figure's text print on the built page? Fails below 9 pt (12 px).

The built page shows a figure at most ``--column`` pixels wide (about 750 px at a 1280-px
window): a PNG wider than that is scaled down, and its text with it. This script executes a
notebook (as nbmake does) with a hook on the inline backend's PNG output that measures, for every
figure shown, the PNG's width (tight bounding box, as the inline backend saves it) and the height
on the page of every piece of text in it: ``fontsize * dpi / 72 * min(1, column / png_width)``.

    python tools/check_figures.py book/x.ipynb [more ...] [--column 750] [--min-px 12] [--save DIR]

Prints one line per figure (cell, size, smallest text) and each text below the limit; exit 1 if
any text is.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

HOOK = r'''
import json as _json, os as _os
import matplotlib.pyplot as _plt
from matplotlib.figure import Figure as _Figure
from matplotlib.text import Text as _Text

_FIGURES = []
_COLUMN, _MIN_PX = float(_os.environ["CHECK_FIGURES_COLUMN"]), float(_os.environ["CHECK_FIGURES_MIN_PX"])
_plt.figure(); _plt.close()          # activates the inline backend, which registers its formatter
_png = get_ipython().display_formatter.formatters["image/png"]
_inline_png = _png.lookup_by_type(_Figure)


def _measure(fig):
    drawn, draw = [], _Text.draw

    def recording_draw(self, renderer):      # only the texts a draw really reaches
        drawn.append(self)
        return draw(self, renderer)

    _Text.draw = recording_draw
    try:
        fig.canvas.draw()
    finally:
        _Text.draw = draw
    renderer = fig.canvas.get_renderer()
    width_px = (fig.get_tightbbox(renderer).width + 0.2) * fig.dpi
    scale = min(1.0, _COLUMN / width_px)
    texts = []
    for t in dict.fromkeys(drawn):
        if t.get_visible() and t.get_text().strip():
            px = t.get_fontsize() * fig.dpi / 72 * scale
            texts.append((round(px, 1), t.get_text().strip()[:50]))
    texts.sort()
    _FIGURES.append(dict(cell=_CELL[0], width_in=round(fig.get_figwidth(), 2),
                         height_in=round(fig.get_figheight(), 2), png_px=round(width_px),
                         scale=round(scale, 2), smallest=texts[:1],
                         small=[t for t in texts if t[0] < _MIN_PX]))


def _measuring_png(fig, *args, **kwargs):
    _measure(fig)
    return _inline_png(fig, *args, **kwargs)


_png.for_type(_Figure, _measuring_png)
_CELL = [None]
'''

DUMP = r'''
with open(_os.environ["CHECK_FIGURES_OUT"], "w") as _f:
    _json.dump(_FIGURES, _f)
'''


def run(notebook: Path, column: float, min_px: float, timeout: int,
        save: Path | None = None) -> list[dict]:
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.read(str(notebook), as_version=4)
    cells = [nbformat.v4.new_code_cell(HOOK)]
    for index, cell in enumerate(nb.cells):
        if cell.cell_type == "code":  # tell the hook which cell of the original is running
            cells.append(nbformat.v4.new_code_cell(f"_CELL[0] = {index}"))
        cells.append(cell)
    nb.cells = cells + [nbformat.v4.new_code_cell(DUMP)]
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "figures.json"
        os.environ.update(CHECK_FIGURES_OUT=str(out), CHECK_FIGURES_COLUMN=str(column),
                          CHECK_FIGURES_MIN_PX=str(min_px))
        NotebookClient(nb, timeout=timeout, kernel_name="python3",
                       resources={"metadata": {"path": str(notebook.parent)}}).execute()
        if save:  # the PNGs as the page shows them, to look at
            import base64

            save.mkdir(parents=True, exist_ok=True)
            cell = None
            for c in nb.cells:
                if c.cell_type == "code" and c.source.startswith("_CELL[0] = "):
                    cell = c.source.split("= ")[1]
                for k, output in enumerate(c.get("outputs", [])):
                    if "image/png" in output.get("data", {}):
                        name = save / f"{notebook.stem}_cell{cell}_{k}.png"
                        name.write_bytes(base64.b64decode(output["data"]["image/png"]))
        return json.loads(out.read_text())


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("notebooks", nargs="+", type=Path)
    parser.add_argument("--column", type=float, default=750, help="page column width, px")
    parser.add_argument("--min-px", type=float, default=12, help="smallest text allowed, px")
    parser.add_argument("--timeout", type=int, default=900)
    parser.add_argument("--save", type=Path, default=None, help="write each figure's PNG here")
    args = parser.parse_args()
    bad = 0
    for notebook in args.notebooks:
        for fig in run(notebook.resolve(), args.column, args.min_px, args.timeout, args.save):
            smallest = fig["smallest"][0] if fig["smallest"] else ("-", "")
            print(f"{notebook.name} cell {fig['cell']}: {fig['width_in']}x{fig['height_in']} in, "
                  f"{fig['png_px']} px wide, shown at {fig['scale']:.2f}; smallest text "
                  f"{smallest[0]} px {smallest[1]!r}")
            for px, text in fig["small"]:
                print(f"    {px:5.1f} px  {text!r}")
            bad += len(fig["small"])
    print(f"check_figures: {bad} text(s) below {args.min_px} px")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
