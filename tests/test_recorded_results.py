"""ejk_lite.notebook.recorded_results: from a clone's bench/results, fetched from the repository
by a chapter downloaded on its own (urlopen mocked: no network), or {} with a reason."""

from __future__ import annotations

import io
import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from ejk_lite.notebook import recorded_results

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "bench" / "results"
RAW = "https://raw.githubusercontent.com/someone/ejk_lite/HEAD/bench/results/"


@pytest.fixture
def alone(tmp_path, monkeypatch):
    """A downloaded chapter: no bench/results in the working directory or above it."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("EJK_LITE_REPOSITORY", raising=False)
    return tmp_path


def serve(monkeypatch, fail: Exception | None = None) -> list[str]:
    """urlopen answering RAW + file from this repository's bench/results; the URLs asked."""
    asked = []

    def urlopen(url, timeout=None):
        asked.append(url)
        assert timeout is not None and timeout <= 30
        if fail is not None:
            raise fail
        path = RESULTS / url.removeprefix(RAW)
        if not url.startswith(RAW) or not path.exists():
            raise urllib.error.HTTPError(url, 404, "Not Found", None, None)
        return io.BytesIO(path.read_bytes())

    monkeypatch.setattr(urllib.request, "urlopen", urlopen)
    return asked


def test_in_a_clone_reads_bench_results(monkeypatch):
    monkeypatch.chdir(ROOT / "book")
    found = recorded_results()
    stems = sorted(p.stem for p in RESULTS.glob("*.json") if p.stem != "index")
    assert sorted(found) == stems and found.reason == "" and found.source == str(RESULTS)
    assert set(recorded_results("cumsum")) == {"cumsum"}


def test_the_index_lists_the_results():
    names = json.loads((RESULTS / "index.json").read_text())["names"]
    assert names == sorted(p.stem for p in RESULTS.glob("*.json") if p.stem != "index")


def test_alone_fetches_from_the_repository(alone, monkeypatch):
    monkeypatch.setenv("EJK_LITE_REPOSITORY", "https://github.com/someone/ejk_lite")
    asked = serve(monkeypatch)
    found = recorded_results()
    assert asked[0] == RAW + "index.json"
    monkeypatch.chdir(ROOT)
    assert found == recorded_results() and found.source == RAW and found.reason == ""
    asked.clear()
    monkeypatch.chdir(alone)
    assert set(recorded_results("cumsum")) == {"cumsum"} and asked == [RAW + "cumsum.json"]


@pytest.mark.parametrize("url, words", [
    (None, ["EJK_LITE_REPOSITORY"]),
    ("https://github.com/YOUR-ACCOUNT/ejk_lite", ["placeholder", "clone"]),
    ("https://gitlab.com/someone/ejk_lite", ["not a GitHub repository"]),
])
def test_alone_without_a_repository_says_why(alone, monkeypatch, url, words):
    if url:
        monkeypatch.setenv("EJK_LITE_REPOSITORY", url)
    asked = serve(monkeypatch)
    found = recorded_results()
    assert found == {} and asked == []
    assert all(w in found.reason for w in words) and found.reason.endswith(".")


@pytest.mark.parametrize("fail", [urllib.error.URLError("Name or service not known"),
                                  TimeoutError("timed out")])
def test_alone_offline_says_why(alone, monkeypatch, fail):
    monkeypatch.setenv("EJK_LITE_REPOSITORY", "https://github.com/someone/ejk_lite")
    serve(monkeypatch, fail)
    found = recorded_results()
    assert found == {} and "fetching it from " + RAW + " failed" in found.reason


def test_alone_missing_file_says_why(alone, monkeypatch):
    monkeypatch.setenv("EJK_LITE_REPOSITORY", "https://github.com/someone/ejk_lite")
    serve(monkeypatch)
    found = recorded_results("no_such_op")
    assert found == {} and "404" in found.reason
