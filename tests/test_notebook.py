"""ejk_lite.notebook.live_figure in a real kernel (recorded_results: test_recorded_results.py).

``live_figure`` is checked the way a notebook front end uses it: a kernel runs the cell, then a
control is moved by the comm message a browser would send, and the figure must be redrawn in
place (an ``update_display_data`` for the same display id). Nothing may travel on the shell
channel from the runner during the cell (no ``Output`` widget): that is what made nbclient stall
(see the module's docstring).
"""

from __future__ import annotations

import queue

import numpy as np
import pytest

jupyter_client = pytest.importorskip("jupyter_client")

CELL = """
import matplotlib
matplotlib.use("module://matplotlib_inline.backend_inline")
import matplotlib.pyplot as plt
from ipywidgets import IntSlider
from ejk_lite.notebook import live_figure

n = IntSlider(value=3, min=1, max=9)


def draw(n, colour):
    fig, ax = plt.subplots(figsize=(2, 1))
    ax.plot(range(n), color=colour)
    return fig


live_figure(draw, n=n, colour="red")
print("slider", n.model_id)
"""


def messages_until_idle(kc, parent_id, timeout=60):
    found = []
    while True:
        try:
            msg = kc.get_iopub_msg(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"no idle status within {timeout} s; got {found}")
        if msg["parent_header"].get("msg_id") != parent_id:
            continue
        found.append(msg)
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return found


@pytest.fixture(scope="module")
def kernel():
    km, kc = jupyter_client.manager.start_new_kernel(kernel_name="python3",
                                                     startup_timeout=120)
    yield kc
    kc.stop_channels()
    km.shutdown_kernel(now=True)


def test_live_figure_draws_then_redraws_in_place(kernel):
    kc = kernel
    msg_id = kc.execute(CELL)
    found = messages_until_idle(kc, msg_id)
    reply = kc.get_shell_msg(timeout=60)
    assert reply["content"]["status"] == "ok", reply["content"]
    kinds = [(m["msg_type"], sorted(m["content"].get("data", {}))) for m in found]
    shown = [m for m in found if m["msg_type"] == "display_data"]
    # First the figure, with a display id; then the controls, as a widget view only.
    assert "image/png" in shown[0]["content"]["data"], kinds
    display_id = shown[0]["content"]["transient"]["display_id"]
    assert list(shown[1]["content"]["data"]) == [
        "application/vnd.jupyter.widget-view+json"], kinds
    assert not [m for m in found if m["msg_type"] == "comm_msg"
                and "msg_id" in m["content"]["data"].get("state", {})], \
        "an Output widget captured the cell's output"
    text = "".join(m["content"]["text"] for m in found if m["msg_type"] == "stream")
    slider = text.split("slider ")[1].split()[0]

    # Move the slider as a browser would: a comm message with the new state.
    update = kc.session.msg("comm_msg", content={
        "comm_id": slider, "data": {"method": "update", "state": {"value": 7},
                                    "buffer_paths": []}})
    kc.shell_channel.send(update)
    redrawn = messages_until_idle(kc, update["header"]["msg_id"])
    updates = [m for m in redrawn if m["msg_type"] == "update_display_data"]
    assert len(updates) == 1, [m["msg_type"] for m in redrawn]
    assert updates[0]["content"]["transient"]["display_id"] == display_id
    assert updates[0]["content"]["data"]["image/png"] != shown[0]["content"]["data"]["image/png"]



# check_exercise: the checker the chapters' exercises print PASS or FAIL with.

def test_check_exercise_passes_within_tolerance(capsys):
    from ejk_lite.notebook import check_exercise

    expected = np.linspace(-3.0, 5.0, 24).reshape(4, 6)
    assert check_exercise(expected.astype(np.float32), expected, name="close")
    assert capsys.readouterr().out == "PASS close: 24 element(s) match\n"
    ints = np.arange(7, dtype=np.int32)
    assert check_exercise(ints, ints.astype(np.int64))
    with_nan = np.array([1.0, np.nan, np.inf])
    assert check_exercise(with_nan, with_nan)  # NaN and inf where they are expected
    import ml_dtypes

    halves = np.array([0.5, 1.5, -2.0], ml_dtypes.bfloat16)
    assert check_exercise(halves, halves.astype(np.float64))
    assert not check_exercise(halves, [0.5, 1.5, -3.0])


def test_check_exercise_names_the_first_wrong_element(capsys):
    from ejk_lite.notebook import check_exercise

    expected = np.arange(12, dtype=np.float64).reshape(3, 4)
    got = expected.copy()
    got[1, 2] += 0.5
    got[2, 3] = np.nan  # an element the kernel never wrote, in the interpreter
    assert not check_exercise(got, expected, name="tiles")
    assert capsys.readouterr().out == (
        "FAIL tiles: 2 of 12 element(s) wrong; the first at index (1, 2): got 6.5, "
        "expected 6\n")
    assert not check_exercise(np.array([1, 2, 4]), np.array([1, 2, 3]))
    assert "index 2: got 4, expected 3" in capsys.readouterr().out
    assert not check_exercise(np.array([1.0, 2.0 + 1e-3]), np.array([1.0, 2.0]))
    assert not check_exercise(np.full(3, np.nan), np.zeros(3))
    assert "got nan, expected 0" in capsys.readouterr().out.splitlines()[-1]


def test_check_exercise_fails_on_a_shape_mismatch_without_raising(capsys):
    from ejk_lite.notebook import check_exercise

    assert not check_exercise(np.zeros((2, 3)), np.zeros((3, 2)), name="shape")
    assert capsys.readouterr().out == "FAIL shape: shape (2, 3), expected (3, 2)\n"


# show_code, show_diff: the shipped code and the chapters' kernel versions, highlighted.

OLD = "\n".join(["def kernel(x):"] + [f"    a{i} = x + {i}" for i in range(12)]
                + ["    return a11"])


def test_code_diff_shows_the_changed_lines_and_only_nearby_context():
    from ejk_lite.notebook import code_diff

    new = OLD.replace("a5 = x + 5", "a5 = x * 5").replace("return a11", "return a11, a5")
    diff = code_diff(OLD, new, context=2).splitlines()
    assert diff[:2] == ["--- old", "+++ new"]
    assert "-    a5 = x + 5" in diff and "+    a5 = x * 5" in diff
    assert "-    return a11" in diff and "+    return a11, a5" in diff
    assert "     a4 = x + 4" in diff and "     a10 = x + 10" in diff  # 2 lines of context
    assert not any("a0 =" in line or "a2 =" in line or "a8 =" in line for line in diff)
    assert code_diff(OLD, OLD) == ""


def test_sources_of_triton_jit_functions_are_unwrapped(capsys):
    import triton
    import triton.language as tl

    from ejk_lite.notebook import code_diff, show_code, show_diff, source_of

    @triton.jit
    def scale_v1(x_ptr, N: tl.constexpr):
        x = tl.load(x_ptr + tl.arange(0, N))
        tl.store(x_ptr + tl.arange(0, N), x * 2)

    @triton.jit
    def scale_v2(x_ptr, N: tl.constexpr):
        x = tl.load(x_ptr + tl.arange(0, N))
        tl.store(x_ptr + tl.arange(0, N), x * 3)

    text = source_of(scale_v1)
    assert text.startswith("@triton.jit\ndef scale_v1(x_ptr, N: tl.constexpr):")
    assert text.endswith("x * 2)")
    diff = code_diff(scale_v1, scale_v2, context=0).splitlines()
    assert diff[:2] == ["--- scale_v1", "+++ scale_v2"]
    assert [line for line in diff if line[:1] in "+-" and line[:3] not in ("---", "+++")] == [
        "-def scale_v1(x_ptr, N: tl.constexpr):", "+def scale_v2(x_ptr, N: tl.constexpr):",
        "-    tl.store(x_ptr + tl.arange(0, N), x * 2)",
        "+    tl.store(x_ptr + tl.arange(0, N), x * 3)"]
    show_code(scale_v1)  # outside IPython, display prints the Code's text
    show_diff(scale_v1, scale_v2)
    out = capsys.readouterr().out
    assert "def scale_v1" in out and "+    tl.store(x_ptr + tl.arange(0, N), x * 3)" in out


def test_highlighted_code_carries_its_colours_inline():
    # The built page's outputs are not inside IPython's `.output_html`: class-based styles
    # missed there, and a diff's + and - lines showed black.
    from ejk_lite.notebook import _Highlighted, code_diff

    new = OLD.replace("a5 = x + 5", "a5 = x * 5")
    html = _Highlighted(code_diff(OLD, new), "diff")._repr_html_()
    added = next(line for line in html.splitlines() if "a5 = x * 5" in line)
    removed = next(line for line in html.splitlines() if "a5 = x + 5" in line)
    assert 'style="color:' in added and 'style="color:' in removed
    assert added.split('style="color: ')[1][:7] != removed.split('style="color: ')[1][:7]
    assert repr(_Highlighted("x = 1", "python")) == "x = 1"


def test_show_code_and_diff_name_a_bad_argument():
    from ejk_lite.notebook import code_diff, show_code, show_diff

    with pytest.raises(ValueError, match="obj must be a function"):
        show_code(42)
    with pytest.raises(ValueError, match="new must be a function"):
        code_diff(OLD, None)
    with pytest.raises(ValueError, match="context must be"):
        code_diff(OLD, OLD, context=-1)
    with pytest.raises(ValueError, match="old and new are the same"):
        show_diff(OLD, OLD)
    for width in (0, -3, 2.5, True, "90"):
        with pytest.raises(ValueError, match="width must be a positive int or None"):
            show_code(OLD, width=width)
    wide = "def f():\n    return " + "1 + " * 30 + "1"
    with pytest.raises(ValueError, match="line 2 has 132 characters"):
        show_code(wide)
    show_code(wide, width=None)


def test_compare_times_says_faster_slower_or_about_the_same():
    from ejk_lite.notebook import compare_times

    assert compare_times(1.0, 2.1) == "2.1× faster than"
    assert compare_times(2.6, 2.0) == "1.3× slower than"
    assert compare_times(np.float64(3.0), 1) == "3.0× slower than"  # numpy floats, ints
    # within the tie (5% by default) either way: about the same; just past it: a ratio
    assert compare_times(1.0, 1.04) == compare_times(1.04, 1.0) == "about as fast as"
    assert compare_times(1.0, 1.06) == "1.1× faster than"
    assert compare_times(1.0, 1.06, tie=0.1) == "about as fast as"
    assert compare_times(1.0, 1.0, tie=0.0) == "about as fast as"


def test_compare_times_names_a_bad_argument():
    from ejk_lite.notebook import compare_times

    for bad in (0.0, -1.0, float("nan"), float("inf"), None, True, "1"):
        with pytest.raises(ValueError, match="ms must be a finite time > 0"):
            compare_times(bad, 1.0)
        with pytest.raises(ValueError, match="other_ms must be a finite time > 0"):
            compare_times(1.0, bad)
    for tie in (-0.1, 1.0, True, None):
        with pytest.raises(ValueError, match="tie must be a fraction"):
            compare_times(1.0, 2.0, tie=tie)
