"""The recorded GPU check: the unit tests and every chapter on a GPU, in one call -> gpu_check.json.

    python bench/gpu_check.py prepare                          # HERE, before the GPU call (git)
    python bench/gpu_check.py check --out $OUT                 # on the GPU: the whole check
        [--only packed_sequences,introduction] [--tests='tests/test_packing.py -k empty']
        [--workers 16] [--fresh introduction] [--chapter-limit 330] [--budget 560]
    python bench/gpu_check.py benches --out $OUT --only cumsum  # on the GPU: one call per op
    python bench/gpu_check.py notebook book/<chapter>.ipynb --record <file>.json  # one chapter

A trial here, without a GPU (Triton's interpreter; ``--workers 0`` where pytest-xdist is missing):

    python bench/gpu_check.py check --out /tmp/check --only packed_sequences,introduction
        --tests=tests/test_packing.py --workers 2 --fresh=

* ``prepare`` writes ``bench/results/.commit`` (``git rev-parse HEAD`` and any uncommitted changes
  to the files the check runs: the GPU copy of the tree has no ``.git``), builds an ``ejk_lite``
  wheel into ``.whl/`` and adds ``absl-py`` (jax-triton's dependency) there, for the fresh notebook.
* ``check`` runs everything at once, which fits one 10-minute call where one thing after another
  did not (H100: the tests took 678 s serially, 157 s under ``pytest -n 8``; the 8 chapters, each
  in a kernel of its own, started together, all finished within ~180 s). The suite has grown:
  on 2026-11-24, 1301 tests took 539 s with 12 workers, 1304 took 387 s with 16 (the machine's
  16 cores; the 10 chapters ran beside them and finished within 300 s):
  - the unit tests under pytest-xdist (``--workers``, ``--dist worksteal``), counted from a JUnit
    XML report; ``tests_timing.log`` (tests/conftest.py, ``EJK_TEST_TIMING``) gives the slowest
    tests and, if the tests are killed, those still running; a test running past ``HUNG_TEST``
    seconds has its stacks written to ``tests.log``;
  - every ``book/*.ipynb`` (found by glob), each run by ``notebook`` in a process of its own,
    started a second apart (``--stagger``);
  - the hosted-notebook path: a chapter (``--fresh``) copied out of the repository and run where
    ``ejk_lite`` and jax-triton do not import, so that its setup cell installs them from ``.whl``
    (``PIP_NO_INDEX=1``, ``PIP_FIND_LINKS=.whl``, ``EJK_LITE_SOURCE=ejk_lite``).
  All share the GPU (``XLA_PYTHON_CLIENT_PREALLOCATE=false``: JAX would otherwise take 75% of its
  memory in each process). A chapter still running after ``--chapter-limit`` seconds, or anything
  still running ``--budget`` seconds after the start, is killed with its kernel and recorded as
  timed out, with the cell it was in. Then ``<out>/gpu_check.json`` is written: commit, date,
  device, versions, the test counts, each chapter (seconds, its slowest cells when it took over a
  minute, the error), the fresh notebook, ``wall_seconds`` and ``all_passed`` (every test, chapter
  and the fresh notebook ran and passed). Logs go beside it.
* ``benches`` runs ``bench/<op>.py --out <out>/bench`` for the op of ``--only``, one call per op
  (they time, so they run alone, and the longest takes minutes); their record is that JSON,
  ``bench/results/<op>.json`` once copied. The check's ``all_passed`` does not depend on them.
* ``notebook`` runs one notebook with nbclient in a kernel of its own (this interpreter, reached
  over IPC sockets: eight kernels started at once over TCP once raced for a port, ``ZMQError:
  Address already in use``), keeping ``--record`` up to date cell by cell; it prints each cell as
  it starts, so its log is a trace of where a chapter hangs.

Exit status: 0 when everything passed (for ``check``: the whole check, nothing left out).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parent.parent
COMMIT_FILE = ROOT / "bench" / "results" / ".commit"
WHEELS = ROOT / ".whl"
NOT_BENCHES = {"common", "gpu_check", "peers"}  # the harness and the peers, no op
PACKAGES = ["jax", "jaxlib", "jax-cuda13-plugin", "triton", "jax-triton", "torch", "fla-core",
            "numpy", "pytest", "pytest-xdist", "nbclient", "jupyter-client", "ipykernel"]
FULL_TESTS = ["tests"]
SLOW_CHAPTER = 60  # seconds: a chapter slower than this lists its slowest cells
SLOWEST = 5
SLOWEST_TESTS = 10


# ----------------------------------------------------------------------------------------------
# What the record says about the run, and small helpers.
# ----------------------------------------------------------------------------------------------


def commit_info() -> dict:
    """The commit the tree was taken from: $EJK_COMMIT, else bench/results/.commit."""
    if os.environ.get("EJK_COMMIT"):
        return {"commit": os.environ["EJK_COMMIT"], "uncommitted": None}
    if COMMIT_FILE.exists():
        return json.loads(COMMIT_FILE.read_text())
    return {"commit": None, "uncommitted": None}


def device() -> dict:
    try:
        line = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,compute_cap",
             "--format=csv,noheader"], capture_output=True, text=True, timeout=60).stdout
        name, driver, memory, capability = [s.strip() for s in line.splitlines()[0].split(",")]
        return {"device": name, "driver": driver, "memory": memory,
                "compute_capability": capability}
    except Exception as error:  # noqa: BLE001 (no GPU here: say so)
        return {"device": f"no GPU ({type(error).__name__})"}


def versions() -> dict:
    from importlib import metadata

    found = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            found[name] = None
    return found


def plain(text: str) -> str:
    """Text without terminal colour codes (IPython colours its tracebacks)."""
    return re.sub(r"\x1b\[[0-9;]*m", "", text)


def tail(text: str, lines: int) -> str:
    return "\n".join(plain(text).splitlines()[-lines:])


def first_line(source: str) -> str:
    return source.strip().split("\n", 1)[0][:100]


def python_env(path: list, **extra: str) -> dict:
    """This environment with ``path`` as PYTHONPATH, output unbuffered, ``extra`` added."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", **extra)
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(str(p) for p in path))
    return env


def repo_env(**extra: str) -> dict:
    """Where ``import ejk_lite`` is this tree's (then whatever PYTHONPATH had: /tmp/site)."""
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return python_env([ROOT, *inherited], **extra)


def kernel_spec_dir(folder: Path) -> Path:
    """A JUPYTER_PATH folder whose ``python3`` kernel is this interpreter, whatever is installed.

    Notebooks name the kernel ``python3``; a kernelspec of that name found in any Jupyter data
    folder (``~/.local/share/jupyter``, ``/usr/local/share/jupyter``, ...) would take precedence
    over ipykernel's built-in one, possibly with another interpreter. This one comes first.
    """
    spec = folder / "kernels" / "python3"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3", "language": "python"}))
    return folder


def chapter_names() -> list[str]:
    return sorted(p.stem for p in (ROOT / "book").glob("*.ipynb"))


def selected(names: list[str], only: str | None) -> list[str]:
    if not only:
        return names
    wanted = [n.strip() for n in only.split(",") if n.strip()]
    unknown = sorted(set(wanted) - set(names))
    if unknown:
        sys.exit(f"unknown: {', '.join(unknown)}; choose from {', '.join(names)}")
    return [n for n in names if n in wanted]


# ----------------------------------------------------------------------------------------------
# Jobs: commands run side by side, each killed past its limit.
# ----------------------------------------------------------------------------------------------


class Job:
    """A command in the background, its output in ``log``; ``record``: the JSON it keeps, if any."""

    def __init__(self, name: str, cmd: list[str], log: Path, env: dict, cwd: Path = ROOT,
                 limit: float = math.inf, record: Path | None = None):
        self.name, self.cmd, self.log, self.env, self.cwd = name, cmd, log, env, cwd
        self.limit, self.record = limit, record
        self.rc, self.seconds, self.ended, self.timed_out = None, None, None, False

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        self.began = time.perf_counter()
        with open(self.log, "w") as f:
            self.proc = subprocess.Popen(self.cmd, stdout=f, stderr=subprocess.STDOUT,
                                         cwd=self.cwd, env=self.env)

    def kill(self) -> None:
        """SIGKILL the job and every process under it: pytest-xdist's workers, a notebook's
        kernel (which jupyter_client starts in a session of its own, out of our process group)."""
        try:
            root = psutil.Process(self.proc.pid)
            family = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            family = []
        for process in family:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass
        self.proc.wait()
        self.timed_out = True

    def result(self) -> dict:
        """What ``record`` says (the job may have been killed before it wrote anything)."""
        if self.record and self.record.exists():
            return json.loads(self.record.read_text())
        return {}


def wait(jobs: list[Job], deadline: float = math.inf) -> None:
    """Wait for the started jobs; kill any past its own limit or past ``deadline``."""
    running = list(jobs)
    while running:
        time.sleep(0.5)
        now = time.perf_counter()
        for job in list(running):
            if job.proc.poll() is None:
                if now < min(job.began + job.limit, deadline):
                    continue
                job.kill()
            job.rc, job.seconds = job.proc.returncode, round(now - job.began, 1)
            job.ended = time.time()  # the clock of the notebook record's "since"
            running.remove(job)
            outcome = "TIMED OUT" if job.timed_out else "passed" if job.rc == 0 else "FAILED"
            print(f"{job.name:32s} {outcome:9s} {job.seconds:7.1f} s", flush=True)


# ----------------------------------------------------------------------------------------------
# The check's parts: tests, chapters, the fresh notebook.
# ----------------------------------------------------------------------------------------------


HUNG_TEST = 180  # seconds: a test running longer has every thread's stack written to tests.log


def tests_job(args, out: Path) -> Job:
    # As in the README: a worker out of tests takes queued ones from a busy one (under xdist's
    # default, --dist load, the tests queued behind a slow one wait for it). -n 0 would still
    # need xdist.
    workers = ["-n", str(args.workers), "--dist", "worksteal"] if args.workers else []
    cmd = [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", *workers,
           "-o", f"faulthandler_timeout={HUNG_TEST}", f"--junitxml={out / 'tests.xml'}",
           *shlex.split(args.tests)]
    timing = out / "tests_timing.log"
    timing.unlink(missing_ok=True)
    return Job("tests", cmd, out / "tests.log",
               repo_env(XLA_PYTHON_CLIENT_PREALLOCATE="false", EJK_TEST_TIMING=str(timing)))


def timing_of_tests(path: Path, killed_at: float | None) -> dict:
    """From tests/conftest.py's EJK_TEST_TIMING lines: the slowest tests and, when the tests were
    killed, those still running then (with how long they had run)."""
    started, seconds = {}, {}
    lines = path.read_text().splitlines() if path.exists() else []
    for line in lines:
        when, _, event, nodeid = line.split(" ", 3)
        if event == "start":
            started[nodeid] = float(when)
        elif nodeid in started:
            seconds[nodeid] = round(float(when) - started.pop(nodeid), 1)
    slowest = sorted(seconds.items(), key=lambda kv: kv[1], reverse=True)[:SLOWEST_TESTS]
    result = {"slowest": dict(slowest)}
    if killed_at is not None:
        result["running_when_killed"] = {n: round(killed_at - t, 1) for n, t in started.items()}
    return result


def tests_result(job: Job, args, out: Path) -> dict:
    xml = out / "tests.xml"
    counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
    failed = []
    if xml.exists():
        for case in ET.parse(xml).getroot().iter("testcase"):
            kinds = {child.tag for child in case}
            kind = next((k for k in ("failure", "error", "skipped") if k in kinds), "passed")
            counts[{"failure": "failed", "error": "errors"}.get(kind, kind)] += 1
            if kind in ("failure", "error"):
                failed.append(f"{case.get('classname')}::{case.get('name')}")
    result = {"args": shlex.split(args.tests), "workers": args.workers, "exit_status": job.rc,
              "seconds": job.seconds, **counts, "failed_ids": failed,
              "timed_out": job.timed_out, "complete": xml.exists() and not job.timed_out,
              **timing_of_tests(out / "tests_timing.log", job.ended if job.timed_out else None)}
    if failed or job.rc not in (0, 5):  # 5: nothing collected
        result["log_tail"] = tail(job.log.read_text(errors="replace"), 40)
    return result


def notebook_job(name: str, notebook: Path, folder: Path, env: dict, limit: float,
                 cwd: Path = ROOT) -> Job:
    record = folder / f"{notebook.stem}.json"
    cmd = [sys.executable, str(Path(__file__).resolve()), "notebook", str(notebook),
           "--record", str(record)]
    return Job(name, cmd, folder / f"{notebook.stem}.log", env, cwd=cwd, limit=limit,
               record=record)


def chapter_result(job: Job) -> dict:
    """passed, seconds, the slowest cells of a slow chapter, and what went wrong."""
    record = job.result()
    result = {"passed": job.rc == 0 and record.get("passed", False), "seconds": job.seconds}
    if "kernel_start_seconds" in record:
        result["kernel_start_seconds"] = record["kernel_start_seconds"]
    if job.seconds > SLOW_CHAPTER:
        cells = sorted(record.get("cells", []), key=lambda c: c["seconds"], reverse=True)
        result["slowest_cells"] = cells[:SLOWEST]
    if job.timed_out:
        running = record.get("running") or {"cell": None}  # None: the kernel had not started
        if "since" in running:
            running["seconds"] = round(job.ended - running.pop("since"), 1)
        result["error"] = {"ename": "timed out", "evalue": f"killed after {job.seconds:.0f} s",
                           **running}
    elif not result["passed"]:
        result["error"] = record.get("error") or {"ename": "no record",
                                                  "evalue": f"exit status {job.rc}"}
    if not result["passed"]:
        result["log_tail"] = tail(job.log.read_text(errors="replace"), 12)
    return result


FRESH_PROBE = ("import importlib.util as u, json; print(json.dumps({m: getattr(u.find_spec(m), "
               "'origin', None) for m in ('ejk_lite', 'jax_triton')}))")


class Fresh:
    """A downloaded chapter on a runtime without ejk_lite: its setup cell must install it.

    Its folder holds the notebook and ``site``: the notebook runner's packages (nbclient, ipykernel,
    ... from ``.whl``) without ejk_lite or jax-triton; the kernel sees those and the system's
    packages, where the setup cell installs ejk_lite and jax-triton. Afterwards they are
    uninstalled, so that a later check on the same machine (it stays up between calls) again
    starts without them.
    """

    def __init__(self, chapter: str, args, out: Path, folder: Path):
        self.folder = folder
        site = folder / "site"
        keep = [w for w in WHEELS.glob("*.whl")
                if not w.name.startswith(("ejk_lite-", "jax_triton-", "fla_core-", "absl_py-"))]
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                        "--no-compile", "--target", str(site), *map(str, keep)], check=True)
        notebook = folder / f"{chapter}.ipynb"
        shutil.copy(ROOT / "book" / notebook.name, notebook)
        self.env = python_env([site], PIP_NO_INDEX="1", PIP_FIND_LINKS=str(WHEELS),
                              EJK_LITE_SOURCE="ejk_lite", PIP_BREAK_SYSTEM_PACKAGES="1",
                              PIP_DISABLE_PIP_VERSION_CHECK="1",
                              XLA_PYTHON_CLIENT_PREALLOCATE="false")
        self.before = self.probe()
        self.job = notebook_job(f"fresh {chapter}", notebook, out / "fresh", self.env,
                                args.chapter_limit, cwd=folder)

    def probe(self) -> dict:
        """Where ejk_lite and jax_triton import from in the kernel's environment (None: nowhere)."""
        return json.loads(subprocess.run([sys.executable, "-c", FRESH_PROBE], env=self.env,
                                         cwd=self.folder, capture_output=True, text=True,
                                         check=True).stdout)

    def result(self) -> dict:
        installed = {m: p for m, p in self.probe().items() if p and not self.before[m]}
        if installed:
            subprocess.run([sys.executable, "-m", "pip", "uninstall", "-q", "-y", *installed],
                           env=self.env, capture_output=True)
        result = chapter_result(self.job)
        if self.before["ejk_lite"]:  # then the setup cell had nothing to do: no evidence
            result.update(passed=False, error={
                "ename": "not fresh", "evalue": "ejk_lite imported before the setup cell ran"})
        result.update(importable_before=self.before, installed_by_setup_cell=installed)
        return result


# ----------------------------------------------------------------------------------------------
# Stages.
# ----------------------------------------------------------------------------------------------


def prepare(args) -> int:
    def git(*cmd):
        return subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True,
                              check=True).stdout.rstrip("\n")

    changed = git("status", "--porcelain", "--", "ejk_lite", "book", "tests", "bench",
                  ":!bench/results").splitlines()
    info = {"commit": git("rev-parse", "HEAD"), "uncommitted": [c[3:] for c in changed]}
    COMMIT_FILE.parent.mkdir(parents=True, exist_ok=True)
    COMMIT_FILE.write_text(json.dumps(info) + "\n")
    print(f"{COMMIT_FILE.relative_to(ROOT)}: {info['commit']}"
          + (f" + uncommitted changes to {len(changed)} file(s): they travel too"
             if changed else ""))
    WHEELS.mkdir(exist_ok=True)
    for old in WHEELS.glob("ejk_lite-*.whl"):
        old.unlink()
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "-w", str(WHEELS), str(ROOT)], check=True)
    shutil.rmtree(ROOT / "build", ignore_errors=True)
    if not list(WHEELS.glob("absl_py-*.whl")):  # jax-triton's dependency the GPU machine lacks
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "--only-binary=:all:", "-d", str(WHEELS), "absl-py>=1.4"], check=True)
    print("ejk_lite wheel:", ", ".join(p.name for p in WHEELS.glob("ejk_lite-*.whl")))
    return 0


def check(args) -> int:
    began = time.perf_counter()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    chapters = selected(chapter_names(), args.only)
    if args.fresh and selected(chapter_names(), args.fresh) and not list(
            WHEELS.glob("ejk_lite-*.whl")):
        sys.exit("no .whl/ejk_lite-*.whl: run `python bench/gpu_check.py prepare` first")
    env = repo_env(XLA_PYTHON_CLIENT_PREALLOCATE="false")
    tests = tests_job(args, out) if args.tests else None
    runs = {c: notebook_job(c, ROOT / "book" / f"{c}.ipynb", out / "chapters", env,
                            args.chapter_limit) for c in chapters}
    started = []
    folder = Path(tempfile.mkdtemp(prefix="gpu_check_"))
    try:
        for job in filter(None, [tests, *runs.values()]):
            job.start()
            started.append(job)
            time.sleep(args.stagger)
        fresh = Fresh(args.fresh, args, out, folder) if args.fresh else None  # meanwhile: pip
        if fresh:
            fresh.job.start()
            started.append(fresh.job)
        wait(started, deadline=began + args.budget)
        parts = {"tests": tests_result(tests, args, out) if tests else None,
                 "chapters": {c: chapter_result(job) for c, job in runs.items()},
                 "fresh_notebook": {args.fresh: fresh.result()} if fresh else {}}
    finally:
        for job in started:
            if job.proc.poll() is None:
                job.kill()
        shutil.rmtree(folder, ignore_errors=True)
    not_run = [f"chapter {c}" for c in chapter_names() if c not in runs]
    if shlex.split(args.tests) != FULL_TESTS:
        not_run.append(f"the full tests (ran: {args.tests})" if args.tests else "the tests")
    if not fresh:
        not_run.append("the fresh notebook")
    tests = parts["tests"]
    passed = [tests and tests["complete"] and tests["exit_status"] == 0,
              *(c["passed"] for c in parts["chapters"].values()),
              *(f["passed"] for f in parts["fresh_notebook"].values())]
    record = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        **commit_info(), **device(), "versions": versions(),
        "wall_seconds": round(time.perf_counter() - began, 1),
        "all_passed": not not_run and all(passed), "not_run": not_run, **parts,
        "benches": "recorded apart, one call per op: bench/results/<op>.json"}
    path = out / "gpu_check.json"
    path.write_text(json.dumps(record, indent=2) + "\n")
    chapters_passed = sum(c["passed"] for c in record["chapters"].values())
    print(f"{path}: "
          + (f"tests {tests['passed']} passed, {tests['failed']} failed, "
             f"{tests['errors']} errors; " if tests else "")
          + f"chapters {chapters_passed}/{len(runs)} passed; "
          + "".join(f"fresh {'passed' if f['passed'] else 'FAILED'}; "
                    for f in record["fresh_notebook"].values())
          + f"{record['wall_seconds']:.0f} s; all passed: {record['all_passed']}"
          + (f" (not run: {', '.join(not_run)})" if not_run else ""))
    return 0 if record["all_passed"] else 1


def benches(args) -> int:
    scripts = sorted(p.stem for p in (ROOT / "bench").glob("*.py")
                     if p.stem not in NOT_BENCHES and not p.stem.startswith("_"))
    bench_out = Path(args.bench_out) if args.bench_out else Path(args.out) / "bench"
    bench_out.mkdir(parents=True, exist_ok=True)
    status = 0
    for script in selected(scripts, args.only):
        cmd = [sys.executable, f"bench/{script}.py", "--out", str(bench_out)]
        job = Job(script, cmd + (["--quick"] if args.quick else []),
                  Path(args.out) / f"bench_{script}.log", repo_env(), limit=args.timeout)
        job.start()
        wait([job])
        if job.rc != 0:
            print(tail(job.log.read_text(errors="replace"), 30))
            status = 1
    return status


def notebook(args) -> int:
    """Run one notebook with nbclient; ``--record`` says, after every cell, how far it got."""
    import nbclient
    import nbformat
    from nbclient.exceptions import CellExecutionError
    from traitlets.config import Config

    path, record_path = Path(args.notebook).resolve(), Path(args.record)
    record_path.parent.mkdir(parents=True, exist_ok=True)
    nb = nbformat.read(path, as_version=4)
    record = {"notebook": str(path), "passed": False, "cells": [], "running": None,
              "error": None}
    began = time.perf_counter()

    def save() -> None:  # whole or not at all: the check may read it at any moment
        part = record_path.with_suffix(".part")
        part.write_text(json.dumps(record, indent=1) + "\n")
        part.replace(record_path)

    def kernel_ready(**_) -> None:
        record["kernel_start_seconds"] = round(time.perf_counter() - began, 1)
        save()

    def cell_starts(cell, cell_index, **_) -> None:
        record["running"] = {"cell": cell_index, "source": first_line(cell.source),
                             "since": time.time()}
        print(f"[{time.perf_counter() - began:7.1f} s] cell {cell_index}: "
              f"{first_line(cell.source)}", flush=True)
        save()

    def cell_done(cell, cell_index, execute_reply, **_) -> None:
        timing = cell.metadata["execution"]  # nbclient's record_timing, from the kernel's clock
        if {"iopub.execute_input", "shell.execute_reply"} <= timing.keys():
            seconds = (datetime.datetime.fromisoformat(timing["shell.execute_reply"])
                       - datetime.datetime.fromisoformat(timing["iopub.execute_input"])
                       ).total_seconds()
        else:  # the input's echo had not come back (nbclient waits 4 s for it)
            seconds = time.time() - record["running"]["since"]
        done = {"cell": cell_index, "source": first_line(cell.source),
                "seconds": round(seconds, 1)}
        record["cells"].append(done)
        record["running"] = None
        reply = execute_reply["content"]
        if reply["status"] == "error":  # nbclient raises CellExecutionError next
            record["error"] = {**done, "ename": reply["ename"], "evalue": reply["evalue"][-300:],
                               "tail": tail("\n".join(reply["traceback"]), 15)}
        save()

    with tempfile.TemporaryDirectory(prefix="ejk_kernel_") as folder:
        os.environ["JUPYTER_PATH"] = str(kernel_spec_dir(Path(folder)))
        client = nbclient.NotebookClient(
            nb, kernel_name="python3", timeout=None, startup_timeout=args.startup_timeout,
            resources={"metadata": {"path": str(path.parent)}},
            config=Config({"KernelManager": {"transport": "ipc", "ip": f"{folder}/ipc"}}),
            on_notebook_start=kernel_ready, on_cell_execute=cell_starts,
            on_cell_executed=cell_done)
        save()
        try:
            client.execute()
            record.update(passed=True, error=None)
        except CellExecutionError:
            pass  # cell_done has recorded it
        except Exception as error:  # noqa: BLE001 (a dead kernel, one that did not start, ...)
            record["error"] = {**(record["running"] or {"cell": None}),
                               "ename": type(error).__name__, "evalue": str(error)[-500:]}
            record["error"].pop("since", None)
    save()
    print(f"{path.name}: {'passed' if record['passed'] else 'FAILED'} in "
          f"{time.perf_counter() - began:.0f} s")
    return 0 if record["passed"] else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n", 2)[2])
    stages = parser.add_subparsers(dest="stage", required=True)
    stages.add_parser("prepare", help="HERE: .commit and the wheels in .whl/")
    on_gpu = argparse.ArgumentParser(add_help=False)
    on_gpu.add_argument("--out", default=os.environ.get("OUT"), required=not os.environ.get("OUT"),
                        help="folder for gpu_check.json and the logs (default: $OUT)")
    run = stages.add_parser("check", parents=[on_gpu], help="the GPU check, in one call")
    run.add_argument("--only", help="comma-separated chapters (default: all)")
    run.add_argument("--tests", default=" ".join(FULL_TESTS),
                     help="pytest's arguments, one string ('': no tests); default: %(default)s")
    run.add_argument("--workers", type=int, default=16, help="pytest -n (0: no xdist)")
    run.add_argument("--fresh", default="introduction",
                     help="the chapter run as a downloaded notebook ('': none)")
    run.add_argument("--chapter-limit", type=float, default=330,
                     help="seconds a chapter may take before it is killed")
    run.add_argument("--budget", type=float, default=560,
                     help="seconds after which everything still running is killed (the call "
                          "has 600, less the wheels' install)")
    run.add_argument("--stagger", type=float, default=1.0,
                     help="seconds between the starts of the tests and chapters")
    bench = stages.add_parser("benches", parents=[on_gpu], help="bench/<op>.py, one after another")
    bench.add_argument("--only", help="comma-separated ops (bench scripts)")
    bench.add_argument("--quick", action="store_true", help="tiny shapes (CPU try-out)")
    bench.add_argument("--bench-out", help="their JSON (default <out>/bench)")
    bench.add_argument("--timeout", type=float, default=560,
                       help="seconds per script before it is killed")
    one = stages.add_parser("notebook", help="one notebook, cell by cell (what check runs)")
    one.add_argument("notebook")
    one.add_argument("--record", required=True, help="the JSON kept up to date")
    one.add_argument("--startup-timeout", type=int, default=300,
                     help="seconds for the kernel to start (nbclient's 60 fell short on a busy "
                          "GPU machine)")
    args = parser.parse_args()
    return {"prepare": prepare, "check": check, "benches": benches,
            "notebook": notebook}[args.stage](args)


if __name__ == "__main__":
    sys.exit(main())
