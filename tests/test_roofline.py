"""ejk_lite.notebook's rooflines: the floor's arithmetic, each op's count of bytes and flops
(worked by hand on tiny sizes, and against the byte counts the benchmarks recorded), the rows a
chapter reads, and the label of a recorded figure. The figure is drawn once (not judged)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from ejk_lite.notebook import (
    DATASHEETS,
    H100_SXM,
    H200_SXM,
    Floor,
    attention_cost,
    chunked_cost,
    cumsum_cost,
    floor_ms,
    mean_pooling_cost,
    peaks_of,
    recorded_label,
    recurrent_cost,
    roofline_rows,
    roofline_table,
    row_cost,
)

RESULTS = Path(__file__).resolve().parent.parent / "bench" / "results"


def results(stem):
    return json.loads((RESULTS / f"{stem}.json").read_text())


def test_floor_is_the_larger_of_moving_and_computing():
    # 2 GB at 1000 GB/s: 2 ms; 3 TFLOP at 1000 TFLOP/s: 3 ms.
    f = floor_ms(2e9, 3e12, bandwidth_gbs=1000, tflops=1000)
    assert f == Floor(memory_ms=pytest.approx(2.0), compute_ms=pytest.approx(3.0))
    assert f.ms == pytest.approx(3.0) and f.bound == "compute"
    g = floor_ms(4e9, 3e12, bandwidth_gbs=1000, tflops=1000)
    assert g.ms == pytest.approx(4.0) and g.bound == "memory"


@pytest.mark.parametrize("args", [(1, 1, 0, 1), (1, 1, 1, -1), (-1, 1, 1, 1), (1, -1, 1, 1)])
def test_floor_refuses_impossible_figures(args):
    with pytest.raises(ValueError):
        floor_ms(*args)


def test_h100_ridge_and_units():
    # The datasheet's ridge: ~295 flops per byte for tensor cores, ~20 for float32.
    assert H100_SXM.tensor_tflops * 1e3 / H100_SXM.bandwidth_gbs == pytest.approx(295.2, abs=0.1)
    assert H100_SXM.tflops("fp32") == 67.0 and H100_SXM.tflops("tensor") == 989.0
    with pytest.raises(ValueError, match="unit"):
        H100_SXM.tflops("fp64")


def test_each_file_is_placed_against_its_own_gpu():
    # Both names as the GPUs report them (the results files' devices); the H200 has the
    # H100's chip and rates and 43% more bandwidth.
    assert peaks_of("NVIDIA H100 80GB HBM3") is H100_SXM
    assert peaks_of("NVIDIA H200") is H200_SXM
    assert H200_SXM.tensor_tflops == H100_SXM.tensor_tflops
    assert H200_SXM.bandwidth_gbs / H100_SXM.bandwidth_gbs == pytest.approx(1.43, abs=0.01)
    for unknown in ("NVIDIA H100 PCIe", "cpu", None):  # never another GPU's peaks
        with pytest.raises(ValueError, match=f"device {unknown!r}"):
            peaks_of(unknown)
    for stem in ("cumsum", "chunked", "attention"):
        data = results(stem)
        peaks = peaks_of(data["device"])
        assert peaks in DATASHEETS
        for r in roofline_rows(stem, data):
            assert r["peaks"] is peaks
            assert r["floor"].memory_ms == pytest.approx(
                r["cost"].bytes / (peaks.bandwidth_gbs * 1e9) * 1e3)
    # Given peaks win over the file's device.
    rows = roofline_rows("chunked", results("chunked"), peaks=H100_SXM)
    assert all(r["peaks"] is H100_SXM for r in rows)


def test_counts_worked_by_hand():
    # cumsum of a [2, 3] float32 array: read 6 x 4 B, write 6 x 4 B, 6 additions.
    c = cumsum_cost([2, 3], 4)
    assert (c.bytes, c.flops, c.unit) == (48, 6, "fp32") and c.intensity == 0.125
    # 5 tokens of 4 features into 2 means, bf16: (5 + 2) x 4 x 2 B; 20 adds forward, 8 divides
    # backward.
    assert mean_pooling_cost(5, 4, 2, "fwd")[:2] == (56, 20)
    assert mean_pooling_cost(5, 4, 2, "bwd")[:2] == (56, 8)
    # recurrence, one token of one head, K=2, V=3 (6 state elements), bf16:
    # fwd reads q, k (2 each), v (3), writes o (3): 10 values; 4 flops per state element.
    assert recurrent_cost(1, 1, 1, 2, 3, False, "fwd")[:2] == (20, 24)
    # with a per-key gate: + gk (2 values), + 1 flop per element (the decay).
    assert recurrent_cost(1, 1, 1, 2, 3, True, "fwd")[:2] == (24, 30)
    # fwd+bwd as one op: q, k, v, do in (2 + 2 + 3 + 3), o, dq, dk, dv out (3 + 2 + 2 + 3);
    # flops 4 (forward) + 4 (the sweep rebuilding h and forming dq) + 6 (the reverse sweep).
    assert recurrent_cost(1, 1, 1, 2, 3, False, "fwd+bwd")[:2] == (40, 14 * 6)
    # chunked, C=4, K=2, V=3, one token: q k^T 2*4*2, A v 2*4*3, q H and k^T v 2*2*3 each.
    fwd = 16 + 24 + 12 + 12
    c = chunked_cost(1, 1, 1, 2, 3, "g", "fwd", chunk=4)
    assert (c.bytes, c.flops, c.unit) == (2 * 10 + 2, fwd, "tensor")
    c = chunked_cost(1, 1, 1, 2, 3, "gk", "fwd+bwd", chunk=4)
    assert c[:2] == (2 * 20 + 2 * 2 * 2, 3 * fwd + 12)
    # grouped: 4 query heads, 2 key/value heads: q, o of 4 heads and k, v of 2 (K + V = 5 each),
    # the per-token flops of 4 heads.
    c = chunked_cost(1, 1, 4, 2, 3, "g", "fwd", chunk=4, kv_heads=2)
    assert c[:2] == (2 * 5 * (4 + 2) + 2 * 4, 4 * fwd)
    assert chunked_cost(1, 1, 4, 2, 3, "g", "fwd+bwd", chunk=4, kv_heads=2)[0] == (
        2 * 2 * 5 * (4 + 2) + 2 * 2 * 4)
    for kv_heads in (0, 3, 8, 2.0, True):  # not a divisor of H = 4 in 1..4, or not an int
        with pytest.raises(ValueError, match="kv_heads"):
            chunked_cost(1, 1, 4, 2, 3, "g", "fwd", kv_heads=kv_heads)
    # attention, 10 visible pairs, D=8: 4 x 8 flops each; q, k, v, o of 3 tokens, one head.
    c = attention_cost(1, 1, 1, 3, 8, 10, "fwd")
    assert (c.bytes, c.flops) == (4 * 3 * 8 * 2, 320)
    assert attention_cost(1, 1, 1, 3, 8, 10, "fwd+bwd")[:2] == (8 * 3 * 8 * 2, 1120)


@pytest.mark.parametrize("op, directions", [
    ("cumsum", ("fwd", "bwd")), ("mean_pooling", ("fwd", "bwd")),
    ("recurrent", ("fwd", "fwd+bwd")), ("chunked", ("fwd",)),
])
def test_counts_match_the_bytes_the_benchmarks_recorded(op, directions):
    data = results(op)
    checked = 0
    for row in data["rows"]:
        if row["direction"] in directions:
            assert row_cost(op, row).bytes == row["bytes"], row["name"]
            checked += 1
    assert checked >= 4


def test_rows_carry_both_floors_and_shares():
    data = results("attention")
    rows = roofline_rows("attention", data, impls=("triton",))
    assert rows and all(r["impl"] == "triton" and r["ours"] for r in rows)
    for r in rows:
        assert r["share"] == pytest.approx(r["floor"].ms / r["ms"])
        # compute-bound: the measured floor uses the recorded bf16 matmul rate
        expected = r["cost"].flops / (data["matmul_bf16_tflops"] * 1e12) * 1e3
        assert r["measured_floor"].ms == pytest.approx(expected)
        assert r["tflops"] == pytest.approx(r["cost"].flops / (r["ms"] * 1e-3) / 1e12)
    cumsum = roofline_rows("cumsum", results("cumsum"))
    big = [r for r in cumsum if "vector" in r["name"]]
    copy = results("cumsum")["copy_bandwidth_gbs"]
    assert all(r["measured_floor"].ms == pytest.approx(r["cost"].bytes / copy / 1e6)
               for r in big)
    # a file that kept no copy bandwidth (recurrent.json, once): no measured floor, never a
    # made-up one
    bare = {k: v for k, v in results("recurrent").items() if k != "copy_bandwidth_gbs"}
    assert all(r["measured_floor"] is None for r in roofline_rows("recurrent", bare))
    table = roofline_table(rows)
    assert table.count("<tr>") == len(rows) + 1 and "compute" in table


def test_table_drops_the_columns_asked_for():
    rows = roofline_rows("chunked", results("chunked"), impls=("chunked",))
    full = roofline_table(rows)
    narrow = roofline_table(rows, drop=("bound",))
    # one header and one cell per row fewer, and only the bound's
    assert full.count("<th") - narrow.count("<th") == 1 and ">bound</th>" not in narrow
    assert full.count("<td") - narrow.count("<td") == len(rows)
    assert ">memory</td>" in full and ">memory</td>" not in narrow
    assert narrow.count("<tr>") == len(rows) + 1
    for bad in (("bounds",), "bound", 3):  # a misspelt header; a string; not a sequence
        with pytest.raises(ValueError, match="drop"):
            roofline_table(rows, drop=bad)
    assert roofline_table(rows, drop=None) == full
    assert roofline_table(rows, drop=(n for n in ["bound"])) == narrow  # a generator, once


def test_recorded_label_names_file_commit_and_date():
    data = results("chunked")
    label = recorded_label(data, "chunked")
    assert label.startswith("recorded on ") and data["device"] in label
    for piece in ("bench/results/chunked.json", f"commit {data['commit'][:7]}", data["date"][:10]):
        assert piece in label
    for stem in ("cumsum", "mean_pooling", "recurrent", "attention"):  # measured with it
        assert f"commit {results(stem)['commit'][:7]}" in recorded_label(results(stem), stem)
    unlabelled = {k: v for k, v in results("cumsum").items() if k != "commit"}
    assert "commit not recorded" in recorded_label(unlabelled, "cumsum")
    copied = dict(results("recurrent"), source="TRANSCRIBED from a log")
    assert "transcribed" in recorded_label(copied, "recurrent")
    assert "transcribed" not in recorded_label(results("recurrent"), "recurrent")


def test_figure_draws_every_row():
    matplotlib = pytest.importorskip("matplotlib")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ejk_lite.notebook import roofline_figure

    rows = roofline_rows("chunked", results("chunked"))
    fig = roofline_figure(rows, copy_gbs=2000.0, matmul_tflops=600.0, title="t")
    ax = fig.axes[0]
    assert ax.get_xscale() == ax.get_yscale() == "log"
    points = [line for line in ax.lines if line.get_linestyle() == "None"]
    assert len(points) == len(rows)
    low, high = ax.get_xlim()
    assert all(low <= r["cost"].intensity <= high for r in rows)
    assert not math.isnan(high)
    plt.close(fig)
    # Rows placed on two GPUs (the same file's, whatever GPU it came from): one set of roofs
    # each, named in the legend; no rows, no roofs.
    both = [r for peaks in DATASHEETS
            for r in roofline_rows("chunked", results("chunked"), peaks=peaks)]
    fig = roofline_figure(both)
    legend = [t.get_text() for t in fig.legends[0].get_texts()]
    for peaks in DATASHEETS:
        assert f"datasheet roofs, {peaks.name}" in legend
    solid = [line for line in fig.axes[0].lines if line.get_linestyle() == "-"]
    assert len(solid) == len(DATASHEETS)
    plt.close(fig)
    with pytest.raises(ValueError, match="no rows"):
        roofline_figure([])
