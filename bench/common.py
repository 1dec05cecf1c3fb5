"""The harness every benchmark script shares: the machine, its measured ceilings, timing, JSON.

Each ``bench/<op>.py`` checks its kernels against a float64 reference, times them and the peers the
issue names, and writes ``<out_dir>/<op>.json``. Run one on the GPU machine as::

    python bench/<op>.py --out bench/results

Timing: the device time of each call, from the profiler (``device_samples_ms``: the durations of
the kernels and copies the GPU ran, summed), after an L2 flush, JAX and torch alike. What CUDA
events would add, the host's dispatch and wait, is not the kernels' and stays out;
``dispatch_overhead_ms`` (an empty jitted function) says how much it is. ``time_stats_ms`` gives
the spread: min / median / max over a fixed number of samples. The ceilings (copy, matmul) are
device times as well.

Also here, so that every script says them the same way: what "right" means
(:func:`relative_error` and :func:`tolerance`, from :mod:`ejk_lite.testing`, the tests' own),
the forward and forward + backward of a JAX function (:func:`forward_and_backward`), one result
row (:func:`row`), the results file (:func:`write_result`), a run's log, failures and exit
status (:class:`Run`), and a first call as a new user's process makes it: in a fresh child
process (:func:`fresh_child`, :func:`run_as_child`), phase by phase (:func:`first_call`). The
peers that run in PyTorch, and the bridge to them, are in ``peers.py``.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

#: The argument that makes a script a fresh child (:func:`fresh_child`), run for its parent.
CHILD = "--child"
IS_CHILD = sys.argv[1:2] == [CHILD]
#: What a fresh child starts from: this process's environment as it started, before ejk_lite's
#: import (below) settled ``TRITON_INTERPRET`` and before a parent's own setting (next): what a
#: user's process would start from.
STARTING_ENV = dict(os.environ)
if not IS_CHILD and getattr(sys.modules.get("__main__"), "FRESH_CHILDREN", False):
    # A script that says ``FRESH_CHILDREN = True`` before importing this module is the parent of
    # fresh children, which only starts them and writes the file: its JAX, started by ejk_lite's
    # import, must not take 75 % of the GPU's memory from them. Before that import, or too late.
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"

import jax
import jax.numpy as jnp
import numpy as np

import ejk_lite  # before triton: without a GPU it selects the interpreter
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from ejk_lite.testing import TOLERANCE, relative_error, tolerance  # noqa: E402, F401


# ----------------------------------------------------------------------------------------------
# The machine and the command line.
# ----------------------------------------------------------------------------------------------


def parse_args(description: str, extra: Callable[[argparse.ArgumentParser], None] | None = None
               ) -> argparse.Namespace:
    """``--out`` and ``--quick``, and whatever ``extra(parser)`` adds."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", default="bench/results", help="folder for the JSON result")
    parser.add_argument("--quick", action="store_true",
                        help="small shapes, to try the script on CPU")
    if extra is not None:
        extra(parser)
    return parser.parse_args()


def versions() -> dict[str, str]:
    import triton

    found = {"python": platform.python_version(), "jax": jax.__version__,
             "triton": triton.__version__}
    try:
        import jaxlib

        found["jaxlib"] = jaxlib.__version__
    except ImportError:
        pass
    from importlib.metadata import PackageNotFoundError, version

    for name in ("jax-triton", "torch", "fla-core"):  # the peers' too, where installed
        try:
            found[name.replace("-", "_")] = version(name)
        except PackageNotFoundError:
            pass
    return found


def commit() -> str | None:
    """The commit the measured tree was taken from: ``$EJK_COMMIT``, else
    ``bench/results/.commit`` (``python bench/gpu_check.py prepare``), else ``git rev-parse
    HEAD``. ``.commit`` is stale where git knows the commit it names and HEAD is another (prepare
    was not run since): then HEAD, said on stderr. A git that does not know it is older than the
    tree (the GPU machine's copy may hold the ``.git`` of an earlier call): then ``.commit``."""
    if os.environ.get("EJK_COMMIT"):
        return os.environ["EJK_COMMIT"]
    root = Path(__file__).resolve().parent.parent

    def git(*args):
        try:
            return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True,
                                  check=True).stdout.strip()
        except Exception:  # noqa: BLE001 (no git, or it does not know the commit)
            return None

    head = git("rev-parse", "HEAD")
    recorded = root / "bench" / "results" / ".commit"
    if recorded.exists():
        named = json.loads(recorded.read_text()).get("commit")
        if head is None or named == head or git("cat-file", "-e", f"{named}^{{commit}}") is None:
            return named
        print(f"bench/results/.commit names {named}, HEAD is {head}: stale, recording HEAD",
              file=sys.stderr)
    return head


def device_name() -> str:
    device = jax.devices()[0]
    return getattr(device, "device_kind", device.platform)


# ----------------------------------------------------------------------------------------------
# Timing: device time from the profiler, after an L2 flush.
# ----------------------------------------------------------------------------------------------


def median_ms(fn: Callable[[], Any], warmup_ms: int = 50, rep_ms: int = 300, calls: int = 8
              ) -> float:
    """Median time of one ``fn()`` in milliseconds, measured by ``triton.testing.do_bench``.

    Each timed run queues ``calls`` calls (JAX dispatches asynchronously) and then waits for the
    last one, so the GPU stays busy and a host round trip is paid once per run, not per call.
    """
    import triton.testing

    def run():
        out = None
        for _ in range(calls):
            out = fn()
        jax.block_until_ready(out)

    run()  # compile outside the measurement
    median = triton.testing.do_bench(run, warmup=warmup_ms, rep=rep_ms, return_mode="median")
    return float(median) / calls


_L2_FLUSH = None


def spread(times_ms: list[float], calls: int = 1) -> dict[str, float]:
    """min / median / max of per-call times (each sample ran ``calls`` calls), and the sample
    count."""
    per_call = [t / calls for t in times_ms]
    return {"min_ms": float(min(per_call)), "median_ms": float(np.median(per_call)),
            "max_ms": float(max(per_call)), "samples": len(per_call), "calls_per_sample": calls}


def time_stats_ms(fn: Callable[[], Any], samples: int = 10, warmup: int = 3,
                  one_trace: bool = False) -> dict[str, float]:
    """min / median / max ms of one ``fn()`` over ``samples`` samples (see :func:`spread`).

    On a GPU, the device time of one call (:func:`device_samples_ms`). Without a GPU, the wall
    clock of single calls (which only shows that the script runs).
    """
    jax.block_until_ready(fn())  # compile outside the measurement
    if ejk_lite.ON_GPU:
        return spread(device_samples_ms(lambda: jax.block_until_ready(fn()), samples, warmup,
                                        one_trace=one_trace))
    times = []
    for _ in range(samples):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append((time.perf_counter() - start) * 1e3)
    return spread(times)


def probe_line(label: str, fn: Callable[[Any], Any], x: Any, expected: Any, failures: list[str],
               copy_gbs: float | None, checked: bool = True) -> str:
    """One printed line of a probe (``bench/_probe_*.py``): ``fn(x)`` checked against
    ``expected`` (float64) by the tests' metric and tolerance, a failure (an error past it, or an
    exception) appended to ``failures`` and the probe going on; with ``copy_gbs`` (on a GPU) also
    timed: min / median / max ms of 10 samples, the GB/s of reading ``x`` once and writing as
    many bytes, and that share of ``copy_gbs``. ``checked=False``: a bound whose result is
    knowingly wrong (its error is printed, not judged)."""
    try:
        err = relative_error(fn(x), expected)
    except Exception as e:  # noqa: BLE001  (a probe: report and go on)
        failures.append(f"{label}: {type(e).__name__}: {str(e)[:300]}")
        return f"{label} FAILED {failures[-1]}"
    ok = not checked or err <= tolerance(x.dtype)
    if not ok:
        failures.append(f"{label}: relative error {err:.2e}")
    line = f"{label} rel err {err:.1e}{'' if ok else ' FAILED'}"
    if copy_gbs is not None:
        st = time_stats_ms(lambda: fn(x), 10)
        gbs = 2 * x.nbytes / st["median_ms"] / 1e6
        line += (f"  {st['median_ms']:.4f} ms ({st['min_ms']:.4f}-{st['max_ms']:.4f})"
                 f"  {gbs:6.0f} GB/s  {100 * gbs / copy_gbs:5.1f}% of copy")
    return line


def device_samples_ms(run: Callable[[], Any], samples: int = 10, warmup: int = 3,
                      grad_to_none: list[Any] | None = None, one_trace: bool = False
                      ) -> list[float]:
    """``samples`` device times of ``run()`` in ms, each after an L2 flush: the durations of the
    kernels and copies the GPU ran during the call, as the profiler (CUPTI) saw them, summed.

    Events around a call time the host too: the dispatch, and the wait for the result. Measured
    on the H100 (8399fe5): a chunk-local cumsum of ``[8, 8192, 16]`` float32 runs 0.003 ms on
    the device, and CUDA events around calls queued back to back gave 0.066 ms, the host's pace.
    The profiler sees JAX's kernels and torch's alike, so every implementation is timed the same
    way. ``run`` may return before its work is done: the device is synchronized before the
    trace stops. Sums leave out the gaps between the kernels of a call.

    ``one_trace``: one profiler trace for all the samples instead of one each, split at the L2
    flushes (torch's fill kernels, which the trace holds too): for JAX calls only, since a
    ``run`` that launches torch fills of its own would split wrong (and raise). On the H100, in a
    small process, both ways gave the same medians (0.1790 / 0.1786 ms for an axpb of 256 MiB,
    0.9010 / 0.9015 ms for an attention forward; a probe, not recorded), in 0.0-0.1 s instead
    of 0.2-5.5 s.
    """
    global _L2_FLUSH
    from triton import runtime

    driver = runtime.driver.active
    device = driver.get_device_interface()
    if _L2_FLUSH is None:
        _L2_FLUSH = driver.get_empty_cache_for_benchmark()
    for _ in range(warmup):
        run()
    device.synchronize()

    def flush() -> None:  # before every sample: a cold L2, and the device idle
        for x in grad_to_none or ():
            x.grad = None
        driver.clear_cache(_L2_FLUSH)
        device.synchronize()

    def call() -> None:
        run()
        device.synchronize()

    if one_trace:
        times: list[float] = []
        for _, duration, name in _gpu_events(lambda: [(flush(), call()) for _ in range(samples)]):
            if "FillFunctor" in name:  # torch's zero_(): the flush that starts a sample
                times.append(0.0)
            elif times:
                times[-1] += duration / 1e6
        if len(times) != samples or min(times) == 0:
            raise RuntimeError(f"one trace: {len(times)} flushes for {samples} samples, or a "
                               "sample without GPU work")
        return times
    times = []
    for _ in range(samples):
        flush()
        busy = sum(duration for _, duration, _ in _gpu_events(call))
        if busy == 0:
            raise RuntimeError("the profiler saw no GPU work: nothing to time")
        times.append(busy / 1e6)
    return times


def _gpu_events(body: Callable[[], Any]) -> list[tuple[int, int, str]]:
    """``(start_ns, duration_ns, name)`` of every kernel and copy the GPU ran during ``body()``,
    in order of start, as one profiler trace recorded them (``body`` must synchronize)."""
    with tempfile.TemporaryDirectory() as folder:
        jax.profiler.start_trace(folder, profiler_options=_profile_options())
        body()
        jax.profiler.stop_trace()
        (path,) = Path(folder).rglob("*.xplane.pb")
        data = jax.profiler.ProfileData.from_file(str(path))
    return sorted(((event.start_ns, event.duration_ns, event.name) for plane in data.planes
                   if plane.name.startswith("/device:GPU") for line in plane.lines
                   if line.name.startswith("Stream") for event in line.events))


def _profile_options() -> Any:
    """What the device timer asks of the profiler: the GPU's activity, without the HLO of every
    compiled program (JAX's default puts them all into each trace) and without tracing Python
    calls (JAX's default traces them). In bench/_ab_attention.py, a process holding 18 compiled
    attention programs, no round of 18 timings finished in 140 s with JAX's defaults; with these
    two off, each timing of its first round took 0.0-0.2 s (H100, 2026-11-24, every run of that
    day). Which of the two mattered was not measured apart."""
    options = jax.profiler.ProfileOptions()
    options.enable_hlo_proto = False
    options.python_tracer_level = 0
    return options


def device_median_ms(fn: Callable[[], Any]) -> float:
    """The median device time of one ``fn()`` (a JAX function), over 10 samples."""
    jax.block_until_ready(fn())
    return float(np.median(device_samples_ms(lambda: jax.block_until_ready(fn()))))


def dispatch_overhead_ms() -> float:
    """Median time of a jitted function that does almost nothing: the floor under every figure."""
    x = jnp.ones((8,), jnp.float32)
    f = jax.jit(lambda a: a + 1)
    return median_ms(lambda: f(x))


# ----------------------------------------------------------------------------------------------
# Ceilings: the copy bandwidth and the bf16 matmul rate, measured.
# ----------------------------------------------------------------------------------------------


@triton.jit
def _copy_kernel(x_ptr, y_ptr, N: tl.constexpr, BLOCK: tl.constexpr, HINTS: tl.constexpr = False):
    """y = x, BLOCK elements a program: the plainest streaming kernel, one of the copy ceilings.
    ``N`` is a constexpr: as a runtime scalar Triton cannot tell the mask ``offs < N`` is constant
    over aligned runs, and reads one element at a time (1.1 TB/s on the H100, e8687f1).
    ``HINTS``: loads ``evict_first``, stores ``.cs`` (streaming), for a kernel tried with those
    hints, whose ceiling must be tried with them too (H200: 4178 GB/s against 4308 without,
    bench/_probe_cumsum_walk.py)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < N, eviction_policy="evict_first" if HINTS else "")
    tl.store(y_ptr + offs, x, mask=offs < N, cache_modifier=".cs" if HINTS else "")


# What the last ceilings() measured, method by method; write_result records it with every file.
CEILINGS: dict[str, Any] = {}


def copy_methods_gbs(n_bytes: int = 1 << 30,
                     timer: Callable[[Callable[[], Any]], float] | None = None,
                     hinted: bool = False) -> dict[str, float]:
    """Read + write bandwidth of ``n_bytes`` of bf16 moved by several methods, GB/s each: an XLA
    elementwise op (``a * 1.5``), XLA's copy of an array (``jnp.copy`` under ``jit``, a
    device-to-device copy) and a Triton copy kernel at two block sizes (``hinted``: also with
    the cache hints of ``_copy_kernel``). Each method's result is checked exactly first (a
    method that moved nothing would look fast)."""
    from ejk_lite.launch import triton_call

    timer = timer or device_median_ms
    n = n_bytes // 2
    x = jax.random.normal(jax.random.key(0), (n,), jnp.bfloat16)
    scaled = (np.asarray(x, np.float32) * 1.5).astype(jnp.bfloat16)  # exact: 1.5 x rounds once

    def triton_copy(block, hints=False):
        return jax.jit(lambda a: triton_call(a, kernel=_copy_kernel, grid=(-(-n // block),),
                                             out_shape=jax.ShapeDtypeStruct(a.shape, a.dtype),
                                             N=n, BLOCK=block, HINTS=hints))

    methods = {"xla a * 1.5": (jax.jit(lambda a: a * 1.5), scaled),
               "xla jnp.copy": (jax.jit(jnp.copy), np.asarray(x)),
               "triton copy, 1024 a program": (triton_copy(1024), np.asarray(x)),
               "triton copy, 8192 a program": (triton_copy(8192), np.asarray(x))}
    if hinted:
        for block in (1024, 4096):
            methods[f"triton copy, {block} a program, hinted"] = (triton_copy(block, True),
                                                                  np.asarray(x))
    found = {}
    for name, (fn, want) in methods.items():
        if not np.array_equal(np.asarray(fn(x)), want):
            raise RuntimeError(f"copy ceiling: {name} did not give the expected result")
        found[name] = 2 * n_bytes / (timer(lambda: fn(x)) * 1e-3) / 1e9
        if found[name] > 20_000:  # no memory moves 20 TB/s: the result was aliased, not copied
            raise RuntimeError(f"copy ceiling: {name} at {found[name]:.0f} GB/s moved nothing")
    return found


def copy_bandwidth_gbs(n_bytes: int = 1 << 30) -> float:
    """Measured device-memory bandwidth: the best of :func:`copy_methods_gbs` over ``n_bytes``
    (all recorded in ``CEILINGS``)."""
    methods = copy_methods_gbs(n_bytes)
    CEILINGS["copy_gbs_by_method"] = methods
    CEILINGS["copy_bytes"] = n_bytes
    return max(methods.values())


def matmul_tflops(n: int = 8192, timer: Callable[[Callable[[], Any]], float] | None = None
                  ) -> float:
    """bf16 matrix-product TFLOP/s, the best of XLA's ``n x n @ n x n`` with a bf16 and with a
    float32 result (``preferred_element_type``), and ``n x n @ n x 2n``; recorded in ``CEILINGS``
    method by method. Each product is checked on one row against NumPy first."""
    timer = timer or device_median_ms
    ka, kb = jax.random.split(jax.random.key(1))
    a = jax.random.normal(ka, (n, n), jnp.bfloat16)
    b = jax.random.normal(kb, (n, 2 * n), jnp.bfloat16)
    b_square = b[:, :n]
    methods = {
        f"xla {n}^3, bf16 out": (jax.jit(lambda x, y: x @ y), (a, b_square), 2 * n ** 3),
        f"xla {n}^3, f32 out": (jax.jit(lambda x, y: jnp.matmul(
            x, y, preferred_element_type=jnp.float32)), (a, b_square), 2 * n ** 3),
        f"xla {n} x {n} x {2 * n}, bf16 out": (jax.jit(lambda x, y: x @ y), (a, b), 4 * n ** 3),
    }
    found = {}
    for name, (fn, args, flops) in methods.items():
        got = np.asarray(fn(*args)[0], np.float64)
        want = np.asarray(args[0][0], np.float64) @ np.asarray(args[1], np.float64)
        if not np.linalg.norm(got - want) <= 1e-2 * np.linalg.norm(want):
            raise RuntimeError(f"matmul ceiling: {name} gave a wrong row")
        found[name] = flops / (timer(lambda: fn(*args)) * 1e-3) / 1e12
    CEILINGS["matmul_bf16_tflops_by_method"] = found
    return max(found.values())


def wall_ms(fn: Callable[[], Any], reps: int = 3) -> float:
    """Median wall time of ``reps`` calls after a warm-up: for slow peers (the lax.scan), and
    CPUs."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append((time.perf_counter() - start) * 1e3)
    return float(np.median(times))


def ceilings() -> tuple[float, float]:
    """(copy bandwidth in GB/s, dispatch overhead in ms): measured on the GPU (1 GiB, the best of
    several methods, each recorded in ``CEILINGS``); rough on a CPU (1 MiB, the wall clock)."""
    if ejk_lite.ON_GPU:
        return copy_bandwidth_gbs(), dispatch_overhead_ms()
    methods = copy_methods_gbs(1 << 20, timer=wall_ms)
    CEILINGS.update(copy_gbs_by_method=methods, copy_bytes=1 << 20)
    nothing = jax.jit(lambda a: a + 1)
    return max(methods.values()), wall_ms(lambda: nothing(jnp.ones((8,))))


# ----------------------------------------------------------------------------------------------
# Correctness: the tests' metric and tolerances (ejk_lite.testing), and what a race checks.
# ----------------------------------------------------------------------------------------------


def past_tolerance(errors: dict[str, float], dtype: Any, what: str) -> list[str]:
    """One failure line for each error past :func:`tolerance` of ``dtype``: ``errors["out"]`` is
    an output's, every other entry a gradient's (``dq``, ``dquery``, ...)."""
    limits = {name: tolerance(dtype, gradient=name != "out") for name in errors}
    return [f"{what} {name}: rel err {e:.3g} > {limits[name]:.3g}" for name, e in errors.items()
            if not e <= limits[name]]


def compare(out: Any, grads: dict[str, Any], ref_out: Any, ref_grads: dict[str, Any]
            ) -> dict[str, float]:
    """Relative errors of an output and its gradients: ``out``, and ``d<name>`` for each entry of
    ``ref_grads``."""
    return {"out": relative_error(out, ref_out),
            **{f"d{name}": relative_error(grads[name], ref_grads[name]) for name in ref_grads}}


def worst(errors: dict[str, float], direction: str) -> float:
    """What a row's ``rel_err`` holds: the output's error (fwd), else the worst gradient's."""
    return errors["out"] if direction == "fwd" else max(e for n, e in errors.items() if n != "out")


def forward_and_backward(fn: Callable[..., Any]) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """``fn(x, *rest)`` jitted, and ``(x, d_o, *rest) -> (output, gradient of x)`` jitted: the
    pullback of the cotangent ``d_o`` (``x`` a pytree of the differentiated arrays, ``rest`` the
    arguments that are not differentiated: masks, segment ids)."""
    def fwd_bwd(x, d_o, *rest):
        out, pullback = jax.vjp(lambda x_: fn(x_, *rest), x)
        return out, pullback(d_o)[0]

    return jax.jit(fn), jax.jit(fwd_bwd)


# ----------------------------------------------------------------------------------------------
# Rows, results files, tables.
# ----------------------------------------------------------------------------------------------


def row(name: str, impl: str, direction: str, shape: Any, dtype: str, median: float | None = None,
        bytes_moved: float | None = None, flops: float | None = None, copy_gbs: float | None = None,
        rel_err: float | None = None, stats: dict[str, float] | None = None, **extra: Any
        ) -> dict[str, Any]:
    """One measurement in the common schema the *Performance* chapter plots.

    ``direction`` is "fwd", "bwd" or "fwd+bwd"; ``impl`` names the implementation ("triton", "xla",
    "scan", "fla", ...). ``bytes_moved`` is the fewest bytes the op must move (each input read once,
    each output written once): GB/s and % of the measured copy bandwidth follow from it. ``stats``
    (:func:`time_stats_ms`) gives the median and the spread; or ``median`` alone.
    """
    if stats is not None:
        median = stats["median_ms"]
        extra = {**{k: v for k, v in stats.items() if k != "median_ms"}, **extra}
    result = {"name": name, "impl": impl, "direction": direction, "shape": str(shape),
              "dtype": dtype, "median_ms": median, "rel_err": rel_err}
    if bytes_moved is not None:
        result["bytes"] = bytes_moved
        result["gbs"] = bytes_moved / (median * 1e-3) / 1e9
        if copy_gbs:
            result["pct_of_copy"] = 100 * result["gbs"] / copy_gbs
    if flops is not None:
        result["tflops"] = flops / (median * 1e-3) / 1e12
    result.update(extra)
    return result


def write_result(out_dir: str, op: str, payload: dict[str, Any]) -> Path:
    """Write ``<out_dir>/<op>.json`` with the machine, date and versions added to ``payload``.

    ``payload`` should hold ``rows`` (a list of :func:`row` dicts) and the ceilings it was measured
    against (``copy_bandwidth_gbs``, ``dispatch_overhead_ms``).
    """
    result = {
        "op": op,
        "device": device_name(),
        "date": datetime.date.today().isoformat(),
        "versions": versions(),
        "commit": commit(),
        "command": " ".join(sys.argv),
        **({"ceilings": dict(CEILINGS)} if CEILINGS else {}),
        **payload,
    }
    path = Path(out_dir) / f"{op}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2))
    return path


def print_table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    widths = [max(len(c), *(len(_fmt(r.get(c))) for r in rows)) for c in columns]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for r in rows:
        print("  ".join(_fmt(r.get(c)).ljust(w) for c, w in zip(columns, widths)))


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


# ----------------------------------------------------------------------------------------------
# A run: its log, failures, time budget and exit status.
# ----------------------------------------------------------------------------------------------


class Run:
    """A benchmark run: its log (the elapsed time on every line), its failures, the cases it did
    not run and why, an optional time budget, and its end (exit status 1 after any failure)."""

    def __init__(self, budget_s: float | None = None):
        self.start = time.perf_counter()
        self.budget_s = budget_s
        self.failures: list[str] = []
        self.not_run: dict[str, str] = {}

    def log(self, message: str) -> None:
        print(f"[{time.perf_counter() - self.start:7.1f}s] {message}", flush=True)

    def out_of_time(self, what: str) -> bool:
        """True (and ``what`` recorded as not run) once the time budget is spent."""
        if self.budget_s is None or time.perf_counter() - self.start < self.budget_s:
            return False
        self.not_run[what] = f"skipped: the time budget ({self.budget_s:.0f} s) was spent"
        self.log(f"  {what}: skipped, time budget spent")
        return True

    def finish(self) -> None:
        """The failures, on stderr, and exit status 1 if there are any (call it after the file is
        written)."""
        if self.failures:
            print(f"FAILED ({len(self.failures)}):", *self.failures, sep="\n  ", file=sys.stderr)
            sys.exit(1)


# ----------------------------------------------------------------------------------------------
# A first call as a new user's process makes it: in a fresh child, timed phase by phase.
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Child:
    """What a fresh child (:func:`fresh_child`) gave back: its result (``{}`` when it printed
    none), exit status (None: killed at its time limit), standard error, wall time from start to
    end (imports included) and ``error``: None when it exited 0, else why not."""
    result: dict[str, Any]
    returncode: int | None
    stderr: str
    seconds: float
    error: str | None


def fresh_child(script: str, arguments: dict[str, Any], timeout_s: float | None = None,
                env: dict[str, str] | None = None) -> Child:
    """Run ``script`` as a fresh child: ``python script --child '<arguments as JSON>'``, which
    hands ``arguments`` to its measurement through :func:`run_as_child`.

    A first call in a process that compiled nothing yet: an empty Triton cache
    (``TRITON_CACHE_DIR``, a new temporary folder, removed after) and no JAX compilation cache
    (``JAX_ENABLE_COMPILATION_CACHE=false``); in a process that ran a kernel before, Triton finds
    it compiled in its cache, and the jax-triton import and Triton's specialiser are paid for.
    The environment is :data:`STARTING_ENV` with ``env`` over it. The result is the last line
    of the child's standard output, a JSON object. ``error``, past ``timeout_s`` or on a non-zero
    exit status: the result's ``failures`` joined, else the status and the end of stderr.
    """
    with tempfile.TemporaryDirectory(prefix="triton_fresh_") as cache:
        child_env = {**STARTING_ENV, **(env or {}), "TRITON_CACHE_DIR": cache,
                     "JAX_ENABLE_COMPILATION_CACHE": "false"}
        command = [sys.executable, str(script), CHILD, json.dumps(arguments)]
        started = time.perf_counter()
        try:
            child = subprocess.run(command, env=child_env, text=True, capture_output=True,
                                   timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return Child({}, None, "", time.perf_counter() - started,
                         f"timed out after {timeout_s} s")
    seconds = time.perf_counter() - started
    lines = child.stdout.strip().splitlines()
    result = json.loads(lines[-1]) if lines and lines[-1].startswith("{") else {}
    error = None if child.returncode == 0 else (
        "; ".join(result.get("failures", [])) or f"exit status {child.returncode}: "
        + child.stderr.strip()[-1500:])
    return Child(result, child.returncode, child.stderr, seconds, error)


def run_as_child(measure: Callable[..., dict[str, Any]]) -> int:
    """In a fresh child (:data:`IS_CHILD`): ``measure(**arguments)``, the arguments the parent
    gave :func:`fresh_child`, its result printed as one line of JSON. The exit status is 1 when
    the result lists ``failures`` (a wrong result), else 0."""
    result = measure(**json.loads(sys.argv[2]))
    print(json.dumps(result), flush=True)
    return 1 if result.get("failures") else 0


def first_call(fn: Any, *args: Any) -> tuple[Any, Any, dict[str, float]]:
    """The first call of ``fn(*args)`` (a ``jax.jit`` function), split into its phases: the
    result (until ``block_until_ready``), the compiled function, and seconds in ``lower``
    (tracing; jax-triton's import and Triton's specialiser, once per process; Triton's compile
    of each new kernel to PTX), ``xla`` (XLA's compile) and ``first_run`` (ptxas turning each
    kernel's PTX into machine code, loading it, ``@triton.autotune``'s trials, the run). Their
    sum is the first call's time."""
    start = time.perf_counter()
    lowered = fn.lower(*args)
    lowered_at = time.perf_counter()
    compiled = lowered.compile()
    compiled_at = time.perf_counter()
    result = jax.block_until_ready(compiled(*args))
    end = time.perf_counter()
    return result, compiled, {"lower": lowered_at - start, "xla": compiled_at - lowered_at,
                              "first_run": end - compiled_at}
