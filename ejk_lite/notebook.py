"""Helpers for the book's notebooks: figures with live controls, listings and diffs of code
(highlighted, never re-wrapped), the recorded GPU results, the checker of the exercises, and
the rooflines (what an op must move and compute, the floor that sets on a GPU, and one figure
for every chapter).

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

import dataclasses
import json
import math
import re
from pathlib import Path
from typing import Any, Callable, NamedTuple

__all__ = ["DATASHEETS", "H100_SXM", "H200_SXM", "Cost", "Floor", "Peaks", "check_exercise", "code_diff", "compare_times",
           "floor_ms",
           "live_figure", "recorded_label", "recorded_results", "roofline_figure",
           "peaks_of", "roofline_rows", "roofline_table", "row_cost", "show_code", "show_diff",
           "source_of"]


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


# The book's rule: a code line on the built page is at most this wide (tools/check_book.py).
PAGE_WIDTH = 90


def source_of(obj: Any, name: str = "obj") -> str:
    """The source of a function (a ``@triton.jit`` one through its Python function, ``.fn``),
    or a string of code as it is, dedented. Anything else is a ``ValueError`` naming ``name``."""
    import inspect
    import textwrap

    if isinstance(obj, str):
        return textwrap.dedent(obj).strip("\n")
    fn = getattr(obj, "fn", obj)  # a @triton.jit function keeps the Python function in .fn
    if not (inspect.isfunction(fn) or inspect.ismethod(fn)):
        raise ValueError(f"{name} must be a function, a @triton.jit function or a string of "
                         f"code, got {type(obj).__name__}")
    return textwrap.dedent(inspect.getsource(fn)).strip("\n")


def _fits(text: str, width: int | None, name: str) -> str:
    # Nothing is reflowed: a line too wide for the page is an error, so that an edit of the
    # shipped code that breaks the page fails the chapter instead of spilling off it.
    if width is not None and (not isinstance(width, int) or isinstance(width, bool)
                              or width < 1):
        raise ValueError(f"width must be a positive int or None, got {width!r}")
    if width is not None:
        for number, line in enumerate(text.splitlines(), 1):
            if len(line) > width:
                raise ValueError(f"{name}: line {number} has {len(line)} characters, more than "
                                 f"the page's {width}: {line.strip()[:60]!r}")
    return text


class _Highlighted:
    """Code shown highlighted in a notebook (HTML) and as plain text elsewhere."""

    def __init__(self, text: str, language: str):
        self.text, self.language = text, language

    def _repr_html_(self) -> str:
        from pygments import highlight
        from pygments.formatters import HtmlFormatter
        from pygments.lexers import get_lexer_by_name

        # Colours inline: IPython's Code styles its classes under `.output_html`, a class the
        # built page's outputs do not carry, and there the diff's + and - lines came out black.
        return highlight(self.text, get_lexer_by_name(self.language),
                         HtmlFormatter(noclasses=True, style="default"))

    def __repr__(self) -> str:
        return self.text


def _display_code(text: str, language: str) -> None:
    from IPython.display import display

    display(_Highlighted(text, language))


def show_code(obj: Any, *, width: int | None = PAGE_WIDTH) -> None:
    """Display a function's source (or a string of code), highlighted, exactly as written.

    Lines are never re-wrapped: one wider than ``width`` characters (the page's) is a
    ``ValueError`` (``width=None`` allows any)."""
    text = source_of(obj, "obj")
    _display_code(_fits(text, width, _label(obj, "obj")), "python")


def _label(obj: Any, default: str) -> str:
    return getattr(getattr(obj, "fn", obj), "__name__", default)


def code_diff(old: Any, new: Any, *, context: int = 3) -> str:
    """The unified diff (``difflib``) of two functions' sources (or strings of code), with
    ``context`` unchanged lines around each change; "" where they are the same."""
    if not isinstance(context, int) or isinstance(context, bool) or context < 0:
        raise ValueError(f"context must be an int >= 0, got {context!r}")
    import difflib

    before, after = source_of(old, "old"), source_of(new, "new")
    lines = difflib.unified_diff(before.splitlines(), after.splitlines(),
                                 fromfile=_label(old, "old"), tofile=_label(new, "new"),
                                 n=context, lineterm="")
    return "\n".join(lines)


def show_diff(old: Any, new: Any, *, context: int = 3, width: int | None = PAGE_WIDTH) -> None:
    """Display what ``new`` changes from ``old`` (functions or strings of code) as a unified
    diff, highlighted: ``-`` lines removed, ``+`` lines added, ``context`` unchanged lines
    around each change. ``width`` bounds the lines as :func:`show_code` does (a diff's line is
    its line of code after one character)."""
    text = code_diff(old, new, context=context)
    if not text:
        raise ValueError("old and new are the same code: no diff to show")
    _display_code(_fits(text, width, f"diff of {_label(old, 'old')}"), "diff")


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


def compare_times(ms: float, other_ms: float, *, tie: float = 0.05) -> str:
    """How a measured time compares with another, in words: for the sentences a chapter
    computes from :func:`recorded_results` instead of typing them, so that a new run of the
    benchmarks cannot leave the prose saying the opposite of the figures.

    ``"2.1× faster than"`` where ``ms`` is the shorter (the ratio is ``other_ms / ms``),
    ``"1.3× slower than"`` where it is the longer, ``"about as fast as"`` where the longer is
    at most ``tie`` (a fraction: 0.05 is 5%) above the shorter. Both times in one unit, > 0.
    """
    for name, value in (("ms", ms), ("other_ms", other_ms)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) \
                or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name} must be a finite time > 0, got {value!r}")
    if isinstance(tie, bool) or not isinstance(tie, (int, float)) or not 0 <= tie < 1:
        raise ValueError(f"tie must be a fraction in [0, 1), got {tie!r}")
    ratio = max(ms, other_ms) / min(ms, other_ms)
    if ratio <= 1 + tie:
        return "about as fast as"
    return f"{ratio:.1f}× {'faster' if ms < other_ms else 'slower'} than"


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


# ----------------------------------------------------------------------------------------------
# Rooflines: the fewest bytes an op must move and the flops it must do, the floor these set on a
# GPU, and one figure that every chapter draws the same way.
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Peaks:
    """A GPU's peak figures, as its maker's datasheet states them.

    ``name``: short, for a figure's legend. ``bandwidth_gbs``: device memory, GB/s.
    ``tensor_tflops``: bf16/fp16 tensor-core products with float32 accumulation, dense (no
    structured sparsity). ``fp32_tflops``: ordinary float32 arithmetic on the CUDA cores, a fused
    multiply-add counted as two flops. ``reported_as``: the names the GPU gives itself (JAX's
    ``device_kind``, the ``device`` of a results file), by which :func:`peaks_of` finds it.
    """

    device: str
    bandwidth_gbs: float
    tensor_tflops: float
    fp32_tflops: float
    source: str
    name: str
    reported_as: tuple[str, ...]

    def tflops(self, unit: str) -> float:
        """The peak of ``unit``: ``"tensor"`` (work done with ``tl.dot``) or ``"fp32"``."""
        if unit not in ("tensor", "fp32"):
            raise ValueError(f"unit must be 'tensor' or 'fp32', got {unit!r}")
        return self.tensor_tflops if unit == "tensor" else self.fp32_tflops


H100_SXM = Peaks(
    device="NVIDIA H100 SXM5 80 GB (HBM3)", bandwidth_gbs=3350.0, tensor_tflops=989.0,
    fp32_tflops=67.0,
    source="NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column: GPU memory bandwidth "
           "3.35 TB/s; BF16 Tensor Core 1,979 TFLOPS, a figure quoted with 2:4 structured "
           "sparsity, so 989 TFLOPS dense; FP32 67 TFLOPS",
    name="H100 SXM", reported_as=("NVIDIA H100 80GB HBM3",))

# The same Hopper chip with faster memory (HBM3e): the same peak rates, 43% more bandwidth. A
# results file measured on one is placed against its own roofs, never the H100's.
H200_SXM = Peaks(
    device="NVIDIA H200 SXM 141 GB (HBM3e)", bandwidth_gbs=4800.0, tensor_tflops=989.0,
    fp32_tflops=67.0,
    source="NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column: GPU memory bandwidth "
           "4.8 TB/s; BF16 Tensor Core 1,979 TFLOPS, a figure quoted with 2:4 structured "
           "sparsity, so 989 TFLOPS dense; FP32 67 TFLOPS",
    name="H200 SXM", reported_as=("NVIDIA H200",))

#: Every GPU whose datasheet peaks the book knows.
DATASHEETS = (H100_SXM, H200_SXM)


def peaks_of(device: str | None) -> Peaks:
    """The datasheet :class:`Peaks` of the GPU that reports itself as ``device`` (a results
    file's ``device``); a ``ValueError`` for one not in :data:`DATASHEETS`, rather than another
    GPU's peaks (an H100 PCIe, say, has 2.0 TB/s, not the SXM's 3.35)."""
    for peaks in DATASHEETS:
        if device in peaks.reported_as:
            return peaks
    known = ", ".join(repr(n) for p in DATASHEETS for n in p.reported_as)
    raise ValueError(f"peaks_of: no datasheet peaks for device {device!r} (known: {known}); "
                     "pass peaks= explicitly")


class Cost(NamedTuple):
    """What an op must do: ``bytes`` moved (each input read once, each output written once),
    ``flops``, and the ``unit`` that does them (``"tensor"``: ``tl.dot``; ``"fp32"``: plain
    float32 arithmetic)."""

    bytes: float
    flops: float
    unit: str

    @property
    def intensity(self) -> float:
        """Arithmetic intensity: flops per byte moved."""
        return self.flops / self.bytes


class Floor(NamedTuple):
    """The time to move the bytes at full bandwidth and the time to do the flops at full rate;
    the larger of the two (``ms``) is the floor, and names what ``bound`` the op."""

    memory_ms: float
    compute_ms: float

    @property
    def ms(self) -> float:
        return max(self.memory_ms, self.compute_ms)

    @property
    def bound(self) -> str:
        return "memory" if self.memory_ms >= self.compute_ms else "compute"


def floor_ms(n_bytes: float, flops: float, bandwidth_gbs: float, tflops: float) -> Floor:
    """The floor of an op that moves ``n_bytes`` and does ``flops`` on a machine that moves
    ``bandwidth_gbs`` GB/s and computes ``tflops`` TFLOP/s: ``max(bytes / bandwidth, flops /
    rate)`` (both parts are in the result). No implementation runs faster than the floor; how
    close it comes is the measured time's share of it."""
    if not (bandwidth_gbs > 0 and tflops > 0):
        raise ValueError(f"bandwidth_gbs and tflops must be > 0, got {bandwidth_gbs}, {tflops}")
    if n_bytes < 0 or flops < 0:
        raise ValueError(f"n_bytes and flops must be >= 0, got {n_bytes}, {flops}")
    return Floor(memory_ms=n_bytes / (bandwidth_gbs * 1e9) * 1e3,
                 compute_ms=flops / (tflops * 1e12) * 1e3)


# The count of each op, as its chapter works it out (the chapters show the arithmetic and check
# it against these). Sizes: B batch, T tokens, H heads, K and V key and value widths.


def cumsum_cost(shape, itemsize: int) -> Cost:
    """A cumulative sum (local or global, either direction): read every element, write every
    sum, one addition per element."""
    n = math.prod(shape)
    return Cost(bytes=2 * n * itemsize, flops=n, unit="fp32")


def mean_pooling_cost(tokens: int, features: int, outputs: int, direction: str,
                      itemsize: int = 2) -> Cost:
    """Mean pooling of ``tokens`` rows of ``features`` into ``outputs`` means (sequences or
    blocks). Forward: read x, write the means, one addition per element of x. Backward: read
    the means' gradient, write x's, one division per mean (then copies)."""
    n_bytes = (tokens + outputs) * features * itemsize
    flops = tokens * features if direction == "fwd" else outputs * features
    return Cost(bytes=n_bytes, flops=flops, unit="fp32")


def recurrent_cost(B: int, T: int, H: int, K: int, V: int, gated: bool, direction: str,
                   itemsize: int = 2) -> Cost:
    """The token-by-token recurrence (``ejk_lite.recurrent``), no ``tl.dot``: per token and
    state element the forward decays (1 flop, with a gate), adds k v^T (2) and forms q h (2).
    The backward's forward sweep rebuilds h (1 + 2) and forms dq (2); its reverse sweep decays
    dh (1), adds q^T do (2) and forms dk and dv (2 + 2). ``fwd+bwd`` is one op: q, k, v, the
    per-key gate and do read once; o and every gradient written once."""
    g = int(bool(gated))
    per_token = (2 * K + 2 * V + g * K) if direction == "fwd" else (4 * K + 4 * V + 2 * g * K)
    per_state = (4 + g) if direction == "fwd" else (4 + g) + (4 + g) + (6 + g)
    return Cost(bytes=B * T * H * per_token * itemsize, flops=B * T * H * K * V * per_state,
                unit="fp32")


def chunked_cost(B: int, T: int, H: int, K: int, V: int, gate: str, direction: str,
                 chunk: int = 64, itemsize: int = 2, kv_heads: int | None = None) -> Cost:
    """The chunked recurrence (``ejk_lite.chunked_recurrent``) in chunks of ``chunk`` tokens,
    its products on tensor cores. Per token, forward: q k^T over the chunk's whole C x C tile
    (2 C K), A v (2 C V), q H (2 K V) and the state update k^T v (2 K V). The backward does two
    products for each forward one (the gradients of both factors) and recomputes the states
    (2 K V more). ``gate``: ``"g"`` (one per token and head) or ``"gk"`` (one per key
    feature); the per-key gate's elementwise work on the diagonal sub-chunks is not counted.
    ``kv_heads``: grouped key/value heads (default ``H``), whose k, v (and dk, dv) are smaller."""
    H_kv = H if kv_heads is None else kv_heads
    if not isinstance(H_kv, int) or isinstance(H_kv, bool) or not 1 <= H_kv <= H or H % H_kv:
        raise ValueError(f"kv_heads must be an int dividing H = {H} (grouped heads), got "
                         f"{kv_heads!r}")
    gate_bytes = {"g": B * T * H, "gk": B * T * H * K}[gate] * itemsize
    forward = 2 * chunk * K + 2 * chunk * V + 4 * K * V
    per_head = B * T * (K + V) * itemsize  # q and o (or k and v) of one head
    if direction == "fwd":
        n_bytes, per_token = per_head * (H + H_kv) + gate_bytes, forward
    else:  # and do, dq (dk, dv)
        n_bytes = 2 * per_head * (H + H_kv) + 2 * gate_bytes
        per_token = 3 * forward + 2 * K * V
    return Cost(bytes=n_bytes, flops=B * T * H * per_token, unit="tensor")


def attention_cost(B: int, Hq: int, Hkv: int, T: int, D: int, visible_pairs: float,
                   direction: str, itemsize: int = 2) -> Cost:
    """Softmax attention over ``visible_pairs`` (query, key) pairs (summed over batch rows and
    query heads). Forward: q k^T and p v, 2 D flops each per pair; read q, k, v, write o.
    ``fwd+bwd``: FlashAttention's count, 3.5 x the forward (the backward's five products: q k^T
    again, do v^T, p^T do, ds^T q, ds k); q, k, v, do read once, o, dq, dk, dv written once."""
    if direction == "fwd":
        n_bytes, flops = 2 * B * T * D * (Hq + Hkv) * itemsize, 4 * D * visible_pairs
    else:
        n_bytes, flops = 4 * B * T * D * (Hq + Hkv) * itemsize, 3.5 * 4 * D * visible_pairs
    return Cost(bytes=n_bytes, flops=flops, unit="tensor")


_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def _pooling_sizes(name: str, n_bytes: float) -> tuple[int, int, int]:
    """(tokens, features, outputs) of a bench/mean_pooling.py case, from its name. A packed
    batch's block count depends on its random lengths: read off the recorded bytes."""
    padded = re.search(r"padded (\d+)x(\d+)x(\d+)", name)
    packed = re.search(r"packed (\d+) seqs, (\d+) tok x(\d+)", name)
    block = re.search(r"block_size=(\d+)", name)
    if padded:
        b, t, f = map(int, padded.groups())
        tokens, outputs = b * t, b * (-(-t // int(block.group(1))) if block else 1)
    elif packed:
        seqs, tokens, f = map(int, packed.groups())
        outputs = int(n_bytes) // (2 * f) - tokens if block else seqs
    else:
        raise ValueError(f"not a mean pooling case: {name!r}")
    return tokens, f, outputs


def _shape(row: dict) -> list[int]:
    shape = row["shape"]  # a list, or its JSON text (bench/cumsum.py writes "[8, 8192, 16]")
    return [int(n) for n in (json.loads(shape) if isinstance(shape, str) else shape)]


def row_cost(op: str, row: dict, chunk: int = 64) -> Cost | None:
    """The :class:`Cost` of one row of ``bench/results/<op>.json`` (None for an op with no
    count here). ``chunk``: the chunked recurrence's chunk size (the benchmark's default)."""
    direction = row["direction"]
    if op == "cumsum":
        return cumsum_cost(_shape(row), _ITEMSIZE[row["dtype"]])
    if op == "mean_pooling":
        return mean_pooling_cost(*_pooling_sizes(row["name"], row["bytes"]), direction)
    if op == "recurrent":
        B, T, H, D = _shape(row)
        return recurrent_cost(B, T, H, D, D, row["name"].endswith(" gk"), direction)
    if op == "chunked":
        B, T, H, D = _shape(row)
        return chunked_cost(B, T, H, D, D, row["gate"], direction, chunk,
                            kv_heads=row.get("kv_heads"))
    if op == "attention":
        B, Hq, Hkv, T, D = _shape(row)
        return attention_cost(B, Hq, Hkv, T, D, row["visible_pairs"], direction)
    return None


OURS = ("triton", "chunked", "recurrent")  # our kernels' impl names in bench/results


def roofline_rows(op: str, data: dict, impls=None, peaks: Peaks | None = None) -> list[dict]:
    """Each timed row of a results file (``impls``: only these implementations; the file's own
    row under ``row``, its shape as a list under ``shape``) with its cost, the achieved rates
    and two floors. ``floor``: from the datasheet's ``peaks`` (default: those of the file's
    ``device``, :func:`peaks_of`; each row keeps them under ``peaks``).
    ``measured_floor``: from the ceilings measured in the same run, the copy bandwidth
    (``copy_bandwidth_gbs``) and, for tensor-core work where the file has one, a bf16 matrix
    product's rate (``matmul_bf16_tflops``); the datasheet's rate otherwise. None where the file
    has no copy bandwidth. ``share`` and ``measured_share``: the floor as a share of the
    measured time, 1 at the floor."""
    copy_gbs, matmul = data.get("copy_bandwidth_gbs"), data.get("matmul_bf16_tflops")
    peaks = peaks or peaks_of(data.get("device"))
    found = []
    for row in data.get("rows", []):
        if impls is not None and row["impl"] not in impls or not row.get("median_ms"):
            continue
        cost = row_cost(op, row)
        if cost is None:
            continue
        ms = row["median_ms"]
        floor = floor_ms(cost.bytes, cost.flops, peaks.bandwidth_gbs, peaks.tflops(cost.unit))
        rate = matmul if cost.unit == "tensor" and matmul else peaks.tflops(cost.unit)
        measured = floor_ms(cost.bytes, cost.flops, copy_gbs, rate) if copy_gbs else None
        found.append(dict(
            op=op, name=row["name"], impl=row["impl"], direction=row["direction"],
            dtype=row.get("dtype", ""), ours=row["impl"] in OURS, row=row, peaks=peaks,
            shape=_shape(row) if "shape" in row else None, cost=cost, ms=ms,
            tflops=cost.flops / (ms * 1e-3) / 1e12, gbs=cost.bytes / (ms * 1e-3) / 1e9,
            floor=floor, measured_floor=measured, share=floor.ms / ms,
            measured_share=None if measured is None else measured.ms / ms))
    return found


def recorded_label(data: dict, stem: str) -> str:
    """"recorded on <device> (bench/results/<stem>.json, commit ..., date ...)": how a chapter
    labels a GPU figure it shows."""
    commit = data.get("commit")
    commit = f"commit {commit[:7]}" if commit else "commit not recorded"
    line = (f"recorded on an {data.get('device', 'unknown GPU')} (bench/results/{stem}.json, "
            f"{commit}, {str(data.get('date', 'date not recorded'))[:10]})")
    if str(data.get("source", "")).startswith("TRANSCRIBED"):
        line += ", transcribed from the run's log (the file's `source` says why)"
    return line


def roofline_table(rows: list[dict], case=None, drop=()) -> str:
    """An HTML table of :func:`roofline_rows`: the intensity (flop/B), which resource bounds
    it, the two floors, the measured time and the share of each floor reached. ``case(row)``:
    the text of the first column. ``drop``: headers of columns to leave out, where a chapter
    says their content once instead (every row memory-bound, say) and the page is narrow; a
    name that is not a header is a ``ValueError``."""
    from html import escape

    case = case or (lambda r: f"{r['name']}, {r['dtype']}")
    header = ["case", "impl", "pass", "flop/B", "bound", "floor, datasheet (ms)",
              "floor, measured ceilings (ms)", "measured (ms)", "share of the datasheet floor",
              "share of the measured floor"]
    given = drop
    # A tuple once: a generator would be used up by the check.
    drop = tuple(drop or ()) if not isinstance(drop, (str, int)) else None
    if drop is None or any(name not in header for name in drop):
        raise ValueError(f"roofline_table: drop must be a sequence of column headers from "
                         f"{header}, got {given!r}")
    kept = [i for i, name in enumerate(header) if name not in drop]

    def pct(x):
        return "n/a" if x is None else f"{100 * x:.1f}%"

    body = []
    for r in rows:
        cells = [escape(case(r)), escape(r["impl"]), escape(r["direction"]),
                 f"{r['cost'].intensity:.3g}", r["floor"].bound, f"{r['floor'].ms:.4f}",
                 "n/a" if r["measured_floor"] is None else f"{r['measured_floor'].ms:.4f}",
                 f"{r['ms']:.4f}", pct(r["share"]), pct(r["measured_share"])]
        body.append("<tr>" + "".join(
            f"<td style='padding:2px 6px;text-align:{'left' if i < 3 else 'right'}'>"
            f"{cells[i]}</td>" for i in kept) + "</tr>")
    head = "".join(f"<th style='padding:2px 6px;vertical-align:bottom'>{escape(header[i])}</th>"
                   for i in kept)
    return (f"<table style='font-size:0.85em;border-collapse:collapse'><tr>{head}</tr>"
            + "".join(body) + "</table>")


# One colour per op, the same in every chapter; peers in neutral tones, hollow.
OP_COLOURS = {"cumsum": "tab:blue", "mean_pooling": "tab:orange", "recurrent": "tab:green",
              "chunked": "tab:purple", "attention": "tab:red"}
PEER_COLOURS = ("0.25", "tab:brown", "tab:olive", "tab:cyan", "tab:pink", "0.6")
DIRECTION_MARKERS = {"fwd": "o", "bwd": "s", "fwd+bwd": "D"}


def roofline_figure(rows: list[dict], *, peaks: Peaks | None = None,
                    copy_gbs: float | None = None,
                    matmul_tflops: float | None = None, group=None, title: str | None = None,
                    figsize=(7.5, 5.6)):
    """The roofline: arithmetic intensity (flops per byte) against achieved TFLOP/s, log-log.

    The roofs are the datasheet's (``peaks``; default: those the rows were placed by, one set
    of roofs per GPU, the second in grey): bandwidth x intensity up to the tensor-core peak
    (solid) and up to the float32 peak (dashed); with ``copy_gbs``, the measured copy
    bandwidth's slope (dotted); with ``matmul_tflops``, a measured matrix product's rate
    (dash-dot). Each row of :func:`roofline_rows` is a point: its colour names its group
    (``group(row)``; default: the op for our rows, the implementation for a peer's; our first
    group has its op's colour of ``OP_COLOURS``, in every chapter), its marker the pass; peers
    are hollow. A point on a roof is at its floor.
    """
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    devices = [peaks] if peaks else list(dict.fromkeys(r["peaks"] for r in rows))
    if not devices:
        raise ValueError("roofline_figure: no rows, so no GPU to draw the roofs of: pass peaks=")
    first = devices[0]
    group = group or (lambda r: r["op"] if r["ours"] else r["impl"])
    colours, filled, peers = {}, {}, iter(PEER_COLOURS)
    for r in rows:
        g = group(r)
        if g not in colours:  # our first group in its op's colour
            own = OP_COLOURS.get(r["op"]) if r["ours"] else None
            colours[g] = own if own and own not in colours.values() else next(peers)
            filled[g] = r["ours"]
    intensities = [r["cost"].intensity for r in rows] or [1.0]
    rates = [r["tflops"] for r in rows] or [1.0]
    ridge = max(p.tensor_tflops * 1e3 / p.bandwidth_gbs for p in devices)
    x_lo = 10 ** math.floor(math.log10(min(intensities) / 2))
    x_hi = 10 ** math.ceil(math.log10(max(max(intensities) * 2, ridge * 4)))
    y_lo = 10 ** math.floor(math.log10(min(rates) / 2))
    y_hi = 10 ** math.ceil(math.log10(max(p.tensor_tflops for p in devices) * 1.5))

    fig, ax = plt.subplots(figsize=figsize)
    xs = [x_lo * (x_hi / x_lo) ** (i / 200) for i in range(201)]

    def roof(bandwidth, peak):
        return [min(x * bandwidth / 1e3, peak) for x in xs]

    lines, labelled = [], set()
    for device, ink in zip(devices, ("black", "0.6", "tab:olive")):
        ax.plot(xs, roof(device.bandwidth_gbs, device.tensor_tflops), color=ink, lw=1.8)
        ax.plot(xs, roof(device.bandwidth_gbs, device.fp32_tflops), color=ink, lw=1.2, ls="--")
        for what, peak in (("tensor cores", device.tensor_tflops),
                           ("float32", device.fp32_tflops)):
            if peak not in labelled:  # GPUs of one chip share their peak rates: said once
                labelled.add(peak)
                ax.text(x_hi / 1.2, peak * 1.12, f"{what} {peak:.0f}", ha="right",
                        va="bottom", fontsize=10)
        lines.append(Line2D([], [], color=ink, lw=1.8, label=f"datasheet roofs, {device.name}"))
    if copy_gbs:
        ax.plot(xs, roof(copy_gbs, first.tensor_tflops), color="0.45", lw=1.2, ls=":")
        lines.append(Line2D([], [], color="0.45", ls=":",
                            label=f"measured copy {copy_gbs / 1e3:.2f} TB/s"))
    if matmul_tflops:
        ax.axhline(matmul_tflops, color="0.45", lw=1.2, ls="-.")
        lines.append(Line2D([], [], color="0.45", ls="-.",
                            label=f"measured bf16 matmul {matmul_tflops:.0f} TFLOP/s"))
    for r in rows:
        colour = colours[group(r)]
        ax.plot(r["cost"].intensity, r["tflops"], DIRECTION_MARKERS.get(r["direction"], "o"),
                ms=8, mec=colour, mew=1.6, mfc=colour if r["ours"] else "none", ls="none")
    ax.set(xscale="log", yscale="log", xlim=(x_lo, x_hi), ylim=(y_lo, y_hi))
    ax.set_xlabel("arithmetic intensity (flop per byte of the fewest bytes)")
    ax.set_ylabel("achieved TFLOP/s")
    if title:
        ax.set_title(title)
    handles = [Line2D([], [], marker="o", ls="none", ms=8, mec=c, mew=1.6,
                      mfc=c if filled[g] else "none", label=g) for g, c in colours.items()]
    handles += [Line2D([], [], marker=m, ls="none", ms=8, mec="black", mfc="none", label=d)
                for d, m in DIRECTION_MARKERS.items() if any(r["direction"] == d for r in rows)]
    fig.legend(handles=handles + lines, loc="lower center", ncols=3, frameon=False,
               fontsize=10)
    rows_of_legend = -(-len(handles + lines) // 3)
    fig.tight_layout(rect=(0, (0.15 + 0.24 * rows_of_legend) / figsize[1], 1, 1))
    # The bandwidth's label along its roof, a third of the way to the ridge (the angle is
    # taken once the axes have their final size); the first GPU's, as the legend names it.
    x_text = x_lo * (min(ridge, x_hi) / x_lo) ** 0.3
    y_text = x_text * first.bandwidth_gbs / 1e3
    a, b = ax.transData.transform([(x_text, y_text), (x_text * 10, y_text * 10)])
    named = f" ({first.name})" if len(devices) > 1 else ""
    ax.text(x_text, y_text * 1.5, f"{first.bandwidth_gbs / 1e3:.2f} TB/s{named}", fontsize=10,
            rotation=math.degrees(math.atan2(b[1] - a[1], b[0] - a[0])),
            rotation_mode="anchor", ha="left", va="bottom")
    return fig
