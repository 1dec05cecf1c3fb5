"""Benchmark mean_pooling and block_mean_pooling: Triton against XLA, forward and backward.

Cases (bf16, as in the issue):

* padded ``(8, 8192, 4096)``;
* packed: 64 random-length sequences totalling 65,536 tokens, hidden 4096, ``cu_seqlens`` a
  traced argument of the jitted function (as in training, where it changes every batch);
* block_mean_pooling with ``block_size=64`` on both.

The peers are what a JAX user would write: ``jnp.mean`` for padded input, ``jax.ops.segment_sum``
for packed input (``impl="xla"``, float32 accumulation like the kernels), and for packed
``mean_pooling`` the two faster plain-JAX forms as well (issue 19: the peer at its strongest):
``xla_cumsum``, running sums in float32 and their differences at ``cu_seqlens``, and
``xla_onehot``, a one-hot ``[tokens, sequences]`` matrix times ``x`` on the tensor cores
(float32 accumulation); both differentiated by JAX. Pooling is memory-bound:
the forward must read ``x`` once, the backward must write ``dx`` once, so each row reports GB/s and
the share of the copy bandwidth measured in the same process. A sweep over the Triton tiling
(tokens per program, features per program, pipeline stages, chunk_size) is stored under
``tiling_sweep`` in the JSON to pick the defaults from.

Checks, before timing: forward outputs against float64 NumPy on the host; gradients against
``dout / len`` broadcast over each sequence's tokens, computed in float32 on the device (exact to
~1e-7, far below bf16's rounding) and compared in float32. The file is written, then the script
exits 1 if any relative error is past ``TOL``. Times: min / median / max over ``SAMPLES``
(``common.time_stats_ms``).

    python bench/mean_pooling.py --out bench/results          # on the GPU
    python bench/mean_pooling.py --quick --out /tmp/bench_mp  # tiny shapes, any machine
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ejk_lite  # noqa: E402, F401  (first: settles the Triton backend)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from common import (  # noqa: E402
    ceilings,
    parse_args,
    print_table,
    relative_error,
    time_stats_ms,
    write_result,
)

pooling = importlib.import_module("ejk_lite.pooling")
PoolingConfig = pooling.PoolingConfig

BLOCK_SIZE = 64
SWEEP_BUDGET_S = 40  # the whole script must stay under ~3 minutes on an H100
SAMPLES = 10
TOL = 1e-2  # relative L2 error of bf16 results (their rounding is ~4e-3)
PLAIN_JAX = ("xla_cumsum", "xla_onehot")  # packed mean_pooling peers besides impl="xla"


# ----------------------------------------------------------------------------------------------
# Cases and references.
# ----------------------------------------------------------------------------------------------


def make_cases(quick: bool, rng: np.random.Generator) -> list[dict]:
    if quick:
        batch, seq_len, hidden, num_seqs, total = 2, 100, 48, 5, 200
    else:
        batch, seq_len, hidden, num_seqs, total = 8, 8192, 4096, 64, 65536
    cuts = np.sort(rng.choice(np.arange(1, total), num_seqs - 1, replace=False))
    cu = np.concatenate([[0], cuts, [total]]).astype(np.int32)
    key_padded, key_packed = jax.random.split(jax.random.key(int(rng.integers(1 << 31))))
    return [
        dict(name=f"padded {batch}x{seq_len}x{hidden}", cu=None,
             x=jax.random.normal(key_padded, (batch, seq_len, hidden), jnp.bfloat16)),
        dict(name=f"packed {num_seqs} seqs, {total} tok x{hidden}", cu=cu,
             x=jax.random.normal(key_packed, (total, hidden), jnp.bfloat16)),
    ]


def as_packed(case: dict) -> tuple[np.ndarray, np.ndarray]:
    """The case's x as a host float32 (tokens, F) matrix and its cu_seqlens."""
    x = case["x"]
    if case["cu"] is None:
        batch, seq_len = x.shape[:2]
        return np.asarray(x.astype(jnp.float32)).reshape(batch * seq_len, -1), np.arange(batch + 1) * seq_len
    return np.asarray(x.astype(jnp.float32)), case["cu"]


def segments(cu: np.ndarray, block_size: int | None) -> np.ndarray:
    """Row ranges pooled into one output row each: sequences, or blocks within sequences."""
    if block_size is None:
        return np.stack([cu[:-1], cu[1:]], axis=1)
    return np.array([(s, min(s + block_size, b)) for a, b in zip(cu[:-1], cu[1:]) for s in range(a, b, block_size)])


def running_sum(x32: np.ndarray) -> np.ndarray:
    """``running[t] = x[0] + ... + x[t - 1]`` in float64, so a range's sum is a difference."""
    running = np.zeros((x32.shape[0] + 1, x32.shape[1]), np.float64)
    np.cumsum(x32, axis=0, dtype=np.float64, out=running[1:])
    return running


def numpy_reference(running: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    """Float64 means of the row ranges ``bounds``."""
    lengths = np.maximum(bounds[:, 1] - bounds[:, 0], 1)[:, None]
    return (running[bounds[:, 1]] - running[bounds[:, 0]]) / lengths




def gradient_checker(dout, bounds: np.ndarray, num_tokens: int):
    """``check(dx)``: ‖dx − dout/len broadcast‖ / ‖that‖ in float32 on the device (tokens in no
    segment expect 0), compiled once per case."""
    rows = np.full(num_tokens, -1, np.int32)
    for i, (a, b) in enumerate(bounds):
        rows[a:b] = i
    lengths = jnp.asarray(np.maximum(bounds[:, 1] - bounds[:, 0], 1), jnp.float32)
    dout2 = dout.reshape(bounds.shape[0], -1).astype(jnp.float32) / lengths[:, None]
    rows = jnp.asarray(rows)

    @jax.jit
    def errors(dx):
        expected = jnp.where(rows[:, None] >= 0, dout2[jnp.maximum(rows, 0)], 0.0)
        got = dx.reshape(num_tokens, -1).astype(jnp.float32)
        bad = ~jnp.all(jnp.isfinite(got))
        return jnp.linalg.norm(got - expected), jnp.linalg.norm(expected), bad

    def check(dx) -> float:
        diff, norm, bad = errors(dx)
        return float("inf") if bool(bad) else float(diff) / max(float(norm), 1e-30)

    return check


# ----------------------------------------------------------------------------------------------
# One measurement: forward and backward of one implementation on one case.
# ----------------------------------------------------------------------------------------------


def cumsum_mean(x, cu_seqlens):
    """Packed means from running sums: float32, differences at ``cu_seqlens``, empty -> 0."""
    running = jnp.cumsum(x.astype(jnp.float32), axis=0)
    running = jnp.concatenate([jnp.zeros((1, x.shape[1]), jnp.float32), running])
    sums = running[cu_seqlens[1:]] - running[cu_seqlens[:-1]]
    lengths = jnp.maximum(jnp.diff(cu_seqlens), 1).astype(jnp.float32)
    return (sums / lengths[:, None]).astype(x.dtype)


def onehot_mean(x, cu_seqlens):
    """Packed means as a product: one-hot ``[tokens, sequences]`` (tokens past the last sequence
    in none) times ``x``, float32 accumulation."""
    num_seqs = cu_seqlens.shape[0] - 1
    seq = jnp.searchsorted(cu_seqlens, jnp.arange(x.shape[0]), side="right") - 1
    onehot = jax.nn.one_hot(jnp.where(seq < num_seqs, seq, -1), num_seqs, dtype=x.dtype)
    sums = jnp.einsum("ts,th->sh", onehot, x, preferred_element_type=jnp.float32)
    lengths = jnp.maximum(jnp.diff(cu_seqlens), 1).astype(jnp.float32)
    return (sums / lengths[:, None]).astype(x.dtype)


def pooled_fn(case: dict, impl: str, block_size: int | None, chunk_size: int,
              config: PoolingConfig | None):
    """A jitted ``f(x, cu_seqlens)`` (cu_seqlens traced for packed input)."""
    num_blocks = None if block_size is None or case["cu"] is None else len(segments(case["cu"], block_size))
    if impl in PLAIN_JAX:
        return jax.jit(cumsum_mean if impl == "xla_cumsum" else onehot_mean)

    def f(x, cu_seqlens):
        if block_size is None:
            return pooling.mean_pooling(x, chunk_size, cu_seqlens, impl=impl, config=config)
        return pooling.block_mean_pooling(x, block_size, cu_seqlens, chunk_size, total_blocks=num_blocks,
                                          impl=impl, config=config)

    return jax.jit(f)


def measure(case, impl, block_size, copy_gbs, chunk_size=32, config=None, check=True) -> list[dict]:
    x = case["x"]
    cu = None if case["cu"] is None else jnp.asarray(case["cu"])
    kind = "blocks" if block_size is not None else "mean"
    f = pooled_fn(case, impl, block_size, chunk_size, config)

    out = f(x, cu)
    fwd_err = relative_error(out.reshape(case[f"ref_{kind}"].shape), case[f"ref_{kind}"]) if check else None
    fwd_stats = time_stats_ms(lambda: f(x, cu), SAMPLES)

    # Time the backward alone: the pullback of a forward run outside the timed function.
    _, pullback = jax.vjp(lambda a: f(a, cu), x)
    backward = jax.jit(pullback)
    dout = case[f"dout_{kind}"]
    (dx,) = backward(dout)
    bwd_err = case[f"check_{kind}"](dx) if check else None
    bwd_stats = time_stats_ms(lambda: backward(dout), SAMPLES)

    op = "mean_pooling" if block_size is None else f"block_mean_pooling(block_size={block_size})"
    fwd_bytes = x.nbytes + out.nbytes
    bwd_bytes = x.nbytes + dout.nbytes
    rows = []
    for direction, st, n_bytes, err in (("fwd", fwd_stats, fwd_bytes, fwd_err),
                                        ("bwd", bwd_stats, bwd_bytes, bwd_err)):
        ms = st["median_ms"]
        gbs = n_bytes / (ms * 1e-3) / 1e9
        rows.append(dict(name=f"{op} {case['name']}", impl=impl, direction=direction, dtype=str(x.dtype),
                         median_ms=ms, min_ms=st["min_ms"], max_ms=st["max_ms"],
                         samples=st["samples"], calls_per_sample=st["calls_per_sample"], gbs=gbs,
                         pct_of_copy=100 * gbs / copy_gbs, rel_err=err, bytes=n_bytes))
    return rows


# ----------------------------------------------------------------------------------------------


def tiling_variants(quick: bool) -> list[tuple[int, PoolingConfig]]:
    """(chunk_size, PoolingConfig) pairs to sweep for mean_pooling; fields left out are the defaults.

    Short on purpose: the defaults came from a wider sweep on an H100 (see the module docstring
    of ``ejk_lite.mean_pooling``); these show the neighbours of the defaults."""
    if quick:
        return [(32, PoolingConfig()),
                (32, PoolingConfig(fwd_tile_tokens=64, bwd_tile_tokens=64, fwd_num_stages=1)),
                (8, PoolingConfig(block_hidden=16, fwd_tile_tokens=24, bwd_tile_tokens=24))]
    return [(32, PoolingConfig()), (32, PoolingConfig(fwd_num_stages=1)),
            (32, PoolingConfig(fwd_tile_tokens=256, bwd_tile_tokens=256)),
            (16, PoolingConfig(block_hidden=128))]


def main() -> None:
    args = parse_args(__doc__.splitlines()[0])
    rng = np.random.default_rng(0)
    copy_gbs, overhead_ms = ceilings()
    cases = make_cases(args.quick, rng)
    for case in cases:
        x32, cu = as_packed(case)
        running = running_sum(x32)
        for kind, block_size in (("mean", None), ("blocks", BLOCK_SIZE)):
            bounds = segments(cu, block_size)
            case[f"ref_{kind}"] = numpy_reference(running, bounds)
            out_shape = pooled_fn(case, "xla", block_size, 32, None).eval_shape(case["x"], case["cu"]).shape
            case[f"dout_{kind}"] = jax.random.normal(jax.random.key(1), out_shape, case["x"].dtype)
            case[f"check_{kind}"] = gradient_checker(case[f"dout_{kind}"], bounds, x32.shape[0])
        del x32, running

    rows = []
    for case in cases:
        for block_size in (None, BLOCK_SIZE):
            packed_mean = block_size is None and case["cu"] is not None
            for impl in ("triton", "xla", *(PLAIN_JAX if packed_mean else ())):
                rows += measure(case, impl, block_size, copy_gbs)

    sweep = []
    started = time.perf_counter()
    for case, (chunk_size, config) in itertools.product(cases, tiling_variants(args.quick)):
        if time.perf_counter() - started > SWEEP_BUDGET_S:
            print(f"tiling sweep stopped after {SWEEP_BUDGET_S} s")
            break
        changed = [f"{f.name}={getattr(config, f.name)}" for f in dataclasses.fields(config)
                   if getattr(config, f.name) != f.default]
        label = ", ".join([f"chunk_size={chunk_size}"] + changed)
        sweep += [{**r, "variant": label} for r in measure(case, "triton", None, copy_gbs, chunk_size, config)]

    # Speed-ups over XLA (impl="xla") and over the fastest plain-JAX form, same case and direction.
    for r in rows:
        peers = [p for p in rows if p["impl"] != "triton" and p["name"] == r["name"]
                 and p["direction"] == r["direction"]]
        xla = next(p for p in peers if p["impl"] == "xla")
        best = min(peers, key=lambda p: p["median_ms"])
        r["speedup_vs_xla"] = xla["median_ms"] / r["median_ms"]
        if r["impl"] == "triton":
            r["best_plain_jax"] = best["impl"]
            r["speedup_vs_best_plain_jax"] = best["median_ms"] / r["median_ms"]
            r["meets_target"] = r["pct_of_copy"] >= 85 and r["speedup_vs_best_plain_jax"] > 1
    failures = [f"{r['name']} {r['impl']} {r['direction']}: rel_err {r['rel_err']:.3g} > {TOL}"
                for r in rows + sweep if not r["rel_err"] <= TOL]

    payload = dict(
        copy_bandwidth_gbs=copy_gbs,
        dispatch_overhead_ms=overhead_ms,
        block_size=BLOCK_SIZE,
        target="triton >= 85% of copy bandwidth (fwd: read x once; bwd: write dx once) and faster "
               "than the fastest plain-JAX form",
        peers=dict(xla="ejk_lite.pooling impl='xla': jnp.mean (padded), jax.ops.segment_sum (packed)",
                   xla_cumsum="packed mean_pooling: float32 running sums, differences at cu_seqlens",
                   xla_onehot="packed mean_pooling: one-hot [tokens, sequences] @ x, float32 "
                              "accumulation"),
        tolerance=TOL, samples=SAMPLES, failures=failures, passed=not failures,
        references=dict(fwd="float64 NumPy on the host", bwd="dout / len broadcast, float32 on the device"),
        rows=rows,
        tiling_sweep=sweep,
    )
    path = write_result(args.out, "mean_pooling", payload)

    print(f"\ntiling sweep (mean_pooling, triton); copy bandwidth {copy_gbs:.0f} GB/s")
    print_table(sweep, ["name", "variant", "direction", "median_ms", "pct_of_copy", "rel_err"])
    print(f"\nwrote {path}; copy bandwidth {copy_gbs:.0f} GB/s, dispatch overhead {overhead_ms:.3f} ms")
    print_table(rows, ["name", "impl", "direction", "median_ms", "gbs", "pct_of_copy", "speedup_vs_xla", "rel_err",
                       "meets_target"])
    if failures:
        print(f"FAILED ({len(failures)}):", *failures, sep="\n  ", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
