"""The recorded GPU check: unit tests, every chapter under nbmake, every benchmark -> gpu_check.json.

One command on the GPU machine may run 10 minutes, so the work is split into stages, each of which
writes its own part file ``<out>/gpu_check_part_<stage>[_<tag>].json`` (rewritten after every
chapter or benchmark, so a run cut off at its time limit still returns what it finished). The
``merge`` stage, run here after fetching the parts, assembles ``bench/results/gpu_check.json``.

    python bench/gpu_check.py prepare                     # HERE, before the GPU runs (needs git)
    python bench/gpu_check.py tests    --out $OUT [--tag a] [pytest args, e.g. tests/test_x.py]
    python bench/gpu_check.py chapters --out $OUT [--only performance,recurrence]
    python bench/gpu_check.py benches  --out $OUT [--only cumsum,mean_pooling] [--quick]
    python bench/gpu_check.py fresh    --out $OUT [--only introduction]
    python bench/gpu_check.py merge    DIR [DIR ...]      # HERE: the fetched part files

* ``prepare`` writes ``bench/results/.commit`` (``git rev-parse HEAD`` and any uncommitted changes
  to the files the check runs: the GPU copy of the tree has no ``.git``), builds an ``ejk_lite``
  wheel into ``.whl/`` and adds ``absl-py`` (jax-triton's dependency) there, for ``fresh``.
* ``tests`` runs pytest with a JUnit XML report and counts passed / failed / skipped / errors.
* ``chapters`` runs each ``book/*.ipynb`` (found by glob) under nbmake in its own process, timed;
  a chapter whose notebook kernel did not start (nbmake's ``INTERNAL ERROR``) is retried once and
  the attempts are recorded (see ``nbmake_patience.py``).
* ``benches`` runs each ``bench/*.py`` script (found by glob; not this file, ``common.py``,
  ``nbmake_patience.py`` or ``_*.py``) with ``--out <out>/bench``, timed; ok = exit status 0.
* ``fresh`` shows the hosted-notebook path: a chapter copied out of the repository, run under
  nbmake where ``ejk_lite`` and jax-triton do not import, so that its setup cell installs them
  from ``.whl`` (``PIP_NO_INDEX=1``, ``PIP_FIND_LINKS=.whl``, ``EJK_LITE_SOURCE=ejk_lite``).

Every part records the date, the device (``nvidia-smi``), the versions of the packages that matter
and the commit. Exit status: 0 when everything the stage ran passed.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
COMMIT_FILE = ROOT / "bench" / "results" / ".commit"
RESULT = ROOT / "bench" / "results" / "gpu_check.json"
NOT_BENCHES = {"common", "gpu_check", "nbmake_patience"}
PACKAGES = ["jax", "jaxlib", "jax-cuda13-plugin", "triton", "jax-triton", "torch", "fla-core",
            "numpy", "nbmake", "ipykernel"]


# ----------------------------------------------------------------------------------------------
# What every part records.
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
        return {"device": name, "driver": driver, "memory": memory, "compute_capability": capability}
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


def header(stage: str) -> dict:
    return {"stage": stage, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(
        timespec="seconds"), **commit_info(), **device(), "versions": versions()}


def write_part(out: Path, name: str, part: dict) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"gpu_check_part_{name}.json"
    path.write_text(json.dumps(part, indent=2) + "\n")
    return path


def run_logged(cmd: list[str], log: Path, timeout: float, env: dict | None = None,
               cwd: Path = ROOT) -> tuple[int, float]:
    """Run ``cmd`` in its own process group, output to ``log``; (exit status, seconds).

    Past ``timeout`` seconds the whole group is killed and the status is 124.
    """
    start = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=cwd,
                                env=env, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = 124
            f.write(f"\n[gpu_check] killed after {timeout:.0f} s\n")
    return rc, round(time.perf_counter() - start, 1)


def plain(path: Path) -> str:
    """A log's text without terminal colour codes (nbmake colours its tracebacks)."""
    return re.sub(r"\x1b\[[0-9;]*m", "", path.read_text(errors="replace"))


def tail(path: Path, lines: int = 15) -> str:
    return "\n".join(plain(path).splitlines()[-lines:])


def child_env(extra_path: str | None = None) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    paths = [str(ROOT)] + ([extra_path] if extra_path else []) + \
        [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    return env


def kernel_spec_dir() -> Path:
    """A JUPYTER_PATH folder whose ``python3`` kernel is this interpreter, whatever else is installed.

    Notebooks name the kernel ``python3``; a kernelspec of that name found in any Jupyter data
    folder (``~/.local/share/jupyter``, ``/usr/local/share/jupyter``, ...) would take precedence
    over ipykernel's built-in one, possibly with another interpreter. This one comes first.
    """
    folder = Path(tempfile.mkdtemp(prefix="gpu_check_kernels_"))
    spec = folder / "kernels" / "python3"
    spec.mkdir(parents=True)
    (spec / "kernel.json").write_text(json.dumps({
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "Python 3", "language": "python"}))
    return folder


def selected(names: list[str], only: str | None) -> list[str]:
    if not only:
        return names
    wanted = [n.strip() for n in only.split(",") if n.strip()]
    unknown = sorted(set(wanted) - set(names))
    if unknown:
        sys.exit(f"unknown: {', '.join(unknown)}; choose from {', '.join(names)}")
    return [n for n in names if n in wanted]


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
          + (f" + uncommitted changes to {len(changed)} file(s): they travel too" if changed else ""))
    wheels = ROOT / ".whl"
    wheels.mkdir(exist_ok=True)
    for old in wheels.glob("ejk_lite-*.whl"):
        old.unlink()
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(wheels), str(ROOT)], check=True)
    shutil.rmtree(ROOT / "build", ignore_errors=True)
    if not list(wheels.glob("absl_py-*.whl")):  # jax-triton's one dependency the GPU machine lacks
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps",
                        "--only-binary=:all:", "-d", str(wheels), "absl-py>=1.4"], check=True)
    print("ejk_lite wheel:", ", ".join(p.name for p in wheels.glob("ejk_lite-*.whl")))
    return 0


def tests(args, pytest_args: list[str]) -> int:
    out = Path(args.out)
    name = "tests" + (f"_{args.tag}" if args.tag else "")
    part = header("tests")
    out.mkdir(parents=True, exist_ok=True)
    xml, log = out / f"{name}.xml", out / f"{name}.log"
    cmd = [sys.executable, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider",
           f"--junitxml={xml}", *(pytest_args or ["tests"])]
    rc, seconds = run_logged(cmd, log, args.timeout, env=child_env())
    counts = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0}
    failed = []
    if xml.exists():
        for case in ET.parse(xml).getroot().iter("testcase"):
            kinds = {child.tag for child in case}
            test_id = f"{case.get('classname')}::{case.get('name')}"
            if "failure" in kinds:
                counts["failed"] += 1
                failed.append(test_id)
            elif "error" in kinds:
                counts["errors"] += 1
                failed.append(test_id)
            elif "skipped" in kinds:
                counts["skipped"] += 1
            else:
                counts["passed"] += 1
    part["tests"] = {"args": pytest_args or ["tests"], "exit_status": rc, "seconds": seconds,
                     **counts, "failed_ids": failed, "complete": xml.exists() and rc != 124}
    if failed or rc not in (0, 5):
        part["tests"]["log_tail"] = tail(log, 40)
    write_part(out, name, part)
    print(json.dumps(part["tests"], indent=1))
    return 0 if rc == 0 else 1


def chapters(args) -> int:
    out = Path(args.out)
    names = selected(sorted(p.stem for p in (ROOT / "book").glob("*.ipynb")), args.only)
    name = "chapters" + (f"_{args.tag}" if args.tag else "")
    part = header("chapters")
    part["chapters"] = {}
    (out / "chapters").mkdir(parents=True, exist_ok=True)
    env = child_env(str(ROOT / "bench"))
    env["JUPYTER_PATH"] = str(kernel_spec_dir())
    part["kernel"] = [sys.executable, "-m", "ipykernel_launcher"]
    status = 0
    for chapter in names:
        attempts = []
        for attempt in (1, 2):
            log = out / "chapters" / f"{chapter}.{attempt}.log"
            cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                   "-p", "nbmake_patience", "--nbmake", f"--nbmake-timeout={args.cell_timeout}",
                   f"book/{chapter}.ipynb"]
            rc, seconds = run_logged(cmd, log, args.timeout, env=env)
            text = plain(log)
            no_kernel = "NBMAKE INTERNAL ERROR" in text
            attempts.append({"exit_status": rc, "seconds": seconds,
                             "kernel_did_not_start": no_kernel})
            if no_kernel:  # nbclient logs why: died at start, or no reply within the timeout
                why = [ln.strip() for ln in text.splitlines() if "starting new kernel" in ln]
                attempts[-1]["why"] = why[-1][-300:] if why else tail(log, 3)
            if rc == 0 or not no_kernel:
                break
        result = {"passed": rc == 0, "seconds": seconds, "attempts": len(attempts)}
        if len(attempts) > 1 or rc != 0:
            result["attempt_details"] = attempts
        if rc != 0:
            result["log_tail"] = tail(log, 30)
            status = 1
        part["chapters"][chapter] = result
        write_part(out, name, part)
        print(f"{chapter:24s} {'passed' if rc == 0 else 'FAILED'}  {seconds:7.1f} s"
              + (f"  ({len(attempts)} attempts)" if len(attempts) > 1 else ""), flush=True)
    return status


def benches(args) -> int:
    out = Path(args.out)
    scripts = sorted(p.stem for p in (ROOT / "bench").glob("*.py")
                     if p.stem not in NOT_BENCHES and not p.stem.startswith("_"))
    names = selected(scripts, args.only)
    name = "benches" + (f"_{args.tag}" if args.tag else "")
    part = header("benches")
    part["benches"] = {}
    bench_out = Path(args.bench_out) if args.bench_out else out / "bench"
    bench_out.mkdir(parents=True, exist_ok=True)
    status = 0
    for script in names:
        log = out / f"bench_{script}.log"
        cmd = [sys.executable, f"bench/{script}.py", "--out", str(bench_out)]
        cmd += ["--quick"] if args.quick else []
        rc, seconds = run_logged(cmd, log, args.timeout, env=child_env())
        result = {"ok": rc == 0, "seconds": seconds, "quick": args.quick}
        if rc != 0:
            result["exit_status"] = rc
            result["log_tail"] = tail(log, 30)
            status = 1
        part["benches"][script] = result
        write_part(out, name, part)
        print(f"{script:24s} {'ok' if rc == 0 else 'FAILED'}  {seconds:7.1f} s", flush=True)
    return status


def fresh(args) -> int:
    """A downloaded chapter on a runtime without ejk_lite: its setup cell must install it."""
    out = Path(args.out)
    wheels = ROOT / ".whl"
    if not list(wheels.glob("ejk_lite-*.whl")):
        sys.exit("no .whl/ejk_lite-*.whl: run `python bench/gpu_check.py prepare` before the GPU run")
    part = header("fresh")
    part["fresh"] = {}
    status = 0
    for chapter in selected(sorted(p.stem for p in (ROOT / "book").glob("*.ipynb")),
                            args.only or "introduction"):
        work = Path(tempfile.mkdtemp(prefix="fresh_"))
        site = work / "site"              # nbmake and its kernel only: no ejk_lite, no jax-triton
        keep = [w for w in wheels.glob("*.whl")
                if not w.name.startswith(("ejk_lite-", "jax_triton-", "fla_core-", "absl_py-"))]
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                        "--no-compile", "--target", str(site), *map(str, keep)], check=True)
        shutil.copy(ROOT / "book" / f"{chapter}.ipynb", work / f"{chapter}.ipynb")
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        env.update(PYTHONPATH=f"{site}{os.pathsep}{ROOT / 'bench'}", PYTHONUNBUFFERED="1",
                   PIP_NO_INDEX="1", PIP_FIND_LINKS=str(wheels), EJK_LITE_SOURCE="ejk_lite",
                   PIP_BREAK_SYSTEM_PACKAGES="1", PIP_DISABLE_PIP_VERSION_CHECK="1",
                   JUPYTER_PATH=str(kernel_spec_dir()))
        check = subprocess.run([sys.executable, "-c", "import ejk_lite"], env=env, cwd=work,
                               capture_output=True)
        log = out / f"fresh_{chapter}.log"
        out.mkdir(parents=True, exist_ok=True)
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
               "nbmake_patience", "--nbmake", f"--nbmake-timeout={args.cell_timeout}",
               f"{chapter}.ipynb"]
        rc, seconds = run_logged(cmd, log, args.timeout, env=env, cwd=work)
        after = subprocess.run([sys.executable, "-c", "import importlib.util as u, ejk_lite; "
                                "print(ejk_lite.__file__, 'GPU' if ejk_lite.ON_GPU else 'no GPU', "
                                "'jax_triton', u.find_spec('jax_triton').origin)"],
                               env=env, cwd=work, capture_output=True, text=True)
        result = {"passed": rc == 0, "seconds": seconds,
                  "ejk_lite_importable_before": check.returncode == 0,
                  "installed_by_setup_cell": after.stdout.strip() or after.stderr.strip()[-300:]}
        if rc != 0:
            result["log_tail"] = tail(log, 30)
            status = 1
        part["fresh"][chapter] = result
        write_part(out, "fresh", part)
        print(json.dumps({chapter: result}, indent=1), flush=True)
    return status


def merge(dirs: list[str], result_path: Path = RESULT) -> int:
    parts = []
    for d in dirs:
        parts += [json.loads(p.read_text()) for p in sorted(Path(d).rglob("gpu_check_part_*.json"))]
    if not parts:
        sys.exit(f"no gpu_check_part_*.json under {', '.join(dirs)}")
    first = parts[0]
    result = {"commit": first.get("commit"), "uncommitted": first.get("uncommitted"),
              "date": max(p["date"] for p in parts),
              **{k: first.get(k) for k in ("device", "driver", "memory", "compute_capability")},
              "versions": first.get("versions")}
    disagree = {k for p in parts for k in ("commit", "device", "versions") if p.get(k) != first.get(k)}
    if disagree:
        result["warning"] = f"the parts disagree on {', '.join(sorted(disagree))}: see 'runs'"
    totals = {"passed": 0, "failed": 0, "skipped": 0, "errors": 0, "seconds": 0.0, "failed_ids": []}
    result["tests"], result["chapters"], result["benches"], result["fresh_notebook"] = totals, {}, {}, {}
    for p in parts:
        if "tests" in p:
            for k in ("passed", "failed", "skipped", "errors", "seconds"):
                totals[k] += p["tests"][k]
            totals["failed_ids"] += p["tests"]["failed_ids"]
            totals.setdefault("runs", []).append({k: p["tests"][k] for k in
                                                  ("args", "exit_status", "seconds", "complete")})
        result["chapters"].update(p.get("chapters", {}))
        result["benches"].update(p.get("benches", {}))
        result["fresh_notebook"].update(p.get("fresh", {}))
    totals["seconds"] = round(totals["seconds"], 1)
    result["not_run"] = {
        "chapters": sorted({p.stem for p in (ROOT / "book").glob("*.ipynb")} - set(result["chapters"])),
        "benches": sorted({p.stem for p in (ROOT / "bench").glob("*.py") if p.stem not in NOT_BENCHES
                           and not p.stem.startswith("_")} - set(result["benches"]))}
    result["all_passed"] = bool(
        totals.get("runs") and not any(result["not_run"].values()) and totals["failed"] == totals["errors"] == 0
        and all(r["complete"] for r in totals["runs"])
        and result["chapters"] and all(c["passed"] for c in result["chapters"].values())
        and all(b["ok"] for b in result["benches"].values())
        and all(f["passed"] for f in result["fresh_notebook"].values()))
    result["runs"] = [{k: p.get(k) for k in ("stage", "date", "commit", "device")} for p in parts]
    result_path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"{result_path}: tests {totals['passed']} passed, {totals['failed']} failed, "
          f"{totals['skipped']} skipped, {totals['errors']} errors; chapters "
          + ", ".join(f"{c} {'ok' if r['passed'] else 'FAILED'}" for c, r in result["chapters"].items())
          + "; benches " + ", ".join(f"{b} {'ok' if r['ok'] else 'FAILED'}"
                                     for b, r in result["benches"].items())
          + f"; all passed: {result['all_passed']}")
    return 0 if result["all_passed"] else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n", 2)[2])
    parser.add_argument("stage", choices=["prepare", "tests", "chapters", "benches", "fresh", "merge"])
    parser.add_argument("dirs", nargs="*", help="merge: folders holding the part files")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench/results/gpu_check"),
                        help="folder for the part files and logs (default: $OUT)")
    parser.add_argument("--tag", default="", help="suffix of the part file, to split a stage")
    parser.add_argument("--only", default=None, help="comma-separated chapters or bench scripts")
    parser.add_argument("--quick", action="store_true", help="benches: tiny shapes (CPU try-out)")
    parser.add_argument("--bench-out", default=None, help="benches: their JSON (default <out>/bench)")
    parser.add_argument("--result", default=str(RESULT), help="merge: the JSON to write")
    parser.add_argument("--timeout", type=float, default=560,
                        help="seconds per chapter, bench script or pytest run before it is killed")
    parser.add_argument("--cell-timeout", type=int, default=500, help="nbmake's per-cell timeout")
    args, rest = parser.parse_known_args()
    if args.stage == "prepare":
        return prepare(args)
    if args.stage == "tests":
        return tests(args, args.dirs + rest)
    if rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.stage == "merge":
        return merge(args.dirs or [args.out], Path(args.result))
    return {"chapters": chapters, "benches": benches, "fresh": fresh}[args.stage](args)


if __name__ == "__main__":
    sys.exit(main())
