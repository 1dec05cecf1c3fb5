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
(float32 accumulation); both differentiated by JAX (``peers.cumsum_mean``, ``peers.onehot_mean``).
Pooling is memory-bound: the forward must read ``x`` once, the backward must write ``dx`` once, so
each row reports GB/s and the share of the copy bandwidth measured in the same process. A sweep
over the Triton tiling (tokens per program, features per program, pipeline stages, chunk_size) is
stored under ``tiling_sweep`` in the JSON to pick the defaults from.

Checks, before timing: forward outputs against float64 NumPy on the host; gradients against
``dout / len`` broadcast over each sequence's tokens, computed in float32 on the device (exact to
~1e-7, far below bf16's rounding) and compared in float32. The file is written, then the script
exits 1 if any relative error is past bf16's tolerance (``ejk_lite.testing``, the tests' own).
Times: min / median / max over ``SAMPLES`` (``common.time_stats_ms``).

    python bench/mean_pooling.py --out bench/results          # on the GPU
    python bench/mean_pooling.py --quick --out /tmp/bench_mp  # tiny shapes, any machine
"""

from __future__ import annotations

import dataclasses
import itertools
import sys
import time
from pathlib import Path
from typing import Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ejk_lite  # noqa: E402, F401  (first: settles the Triton backend)
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import peers  # noqa: E402
from common import (  # noqa: E402
    Run,
    ceilings,
    parse_args,
    print_table,
    relative_error,
    row,
    time_stats_ms,
    tolerance,
    write_result,
)
from ejk_lite import pooling  # noqa: E402
from ejk_lite.pooling import PoolingConfig  # noqa: E402

BLOCK_SIZE = 64
SWEEP_BUDGET_S = 40  # the whole script must stay under ~3 minutes on an H100
SAMPLES = 10
TOL = tolerance(jnp.bfloat16)  # the outputs and gradients are bf16
SIZES = dict(batch=8, seq_len=8192, hidden=4096, num_seqs=64, total=65536)
QUICK_SIZES = dict(batch=2, seq_len=100, hidden=48, num_seqs=5, total=200)
#: Packed mean_pooling's peers besides impl="xla", in plain JAX.
PLAIN_JAX = {"xla_cumsum": peers.cumsum_mean, "xla_onehot": peers.onehot_mean}


@dataclasses.dataclass
class Case:
    """One input, padded (``cu`` None) or packed, and for each pooling ("mean", "blocks") its
    float64 reference, the cotangent of its output and the gradient that cotangent must give."""
    name: str
    x: jax.Array
    cu: np.ndarray | None
    ref: dict[str, np.ndarray] = dataclasses.field(default_factory=dict)
    dout: dict[str, jax.Array] = dataclasses.field(default_factory=dict)
    expected_dx: dict[str, Callable[[], jax.Array]] = dataclasses.field(default_factory=dict)


def make_cases(quick: bool, rng: np.random.Generator) -> list[Case]:
    s = QUICK_SIZES if quick else SIZES
    batch, seq_len, hidden, num_seqs, total = (s[k] for k in SIZES)
    cuts = np.sort(rng.choice(np.arange(1, total), num_seqs - 1, replace=False))
    cu = np.concatenate([[0], cuts, [total]]).astype(np.int32)
    key_padded, key_packed = jax.random.split(jax.random.key(int(rng.integers(1 << 31))))
    cases = [Case(f"padded {batch}x{seq_len}x{hidden}", cu=None,
                  x=jax.random.normal(key_padded, (batch, seq_len, hidden), jnp.bfloat16)),
             Case(f"packed {num_seqs} seqs, {total} tok x{hidden}", cu=cu,
                  x=jax.random.normal(key_packed, (total, hidden), jnp.bfloat16))]
    for case in cases:
        x32 = np.asarray(case.x.astype(jnp.float32)).reshape(-1, hidden)
        cu = np.arange(batch + 1) * seq_len if case.cu is None else case.cu
        running = np.zeros((x32.shape[0] + 1, hidden), np.float64)  # a range's sum: a difference
        np.cumsum(x32, axis=0, dtype=np.float64, out=running[1:])
        for kind, block_size in (("mean", None), ("blocks", BLOCK_SIZE)):
            bounds = segments(cu, block_size)
            lengths = np.maximum(bounds[:, 1] - bounds[:, 0], 1)[:, None]
            case.ref[kind] = (running[bounds[:, 1]] - running[bounds[:, 0]]) / lengths
            out = pooled_fn(case, "xla", block_size, 32, None).eval_shape(case.x, case.cu)
            case.dout[kind] = jax.random.normal(jax.random.key(1), out.shape, case.x.dtype)
            case.expected_dx[kind] = expected_gradient(case.dout[kind], bounds, x32.shape[0])
    return cases


def segments(cu: np.ndarray, block_size: int | None) -> np.ndarray:
    """Row ranges pooled into one output row each: sequences, or blocks within sequences."""
    if block_size is None:
        return np.stack([cu[:-1], cu[1:]], axis=1)
    return np.array([(s, min(s + block_size, b)) for a, b in zip(cu[:-1], cu[1:])
                     for s in range(a, b, block_size)])


def expected_gradient(dout: jax.Array, bounds: np.ndarray, num_tokens: int
                      ) -> Callable[[], jax.Array]:
    """The gradient ``[tokens, F]`` of the means for ``dout``: ``dout / len`` broadcast over each
    segment's tokens, 0 on tokens in none; float32, on the device, made when asked for (it is as
    large as ``x`` in float32, so it lives only while a gradient is compared with it)."""
    rows = np.full(num_tokens, -1, np.int32)
    for i, (a, b) in enumerate(bounds):
        rows[a:b] = i
    lengths = jnp.asarray(np.maximum(bounds[:, 1] - bounds[:, 0], 1), jnp.float32)
    per_row = dout.reshape(bounds.shape[0], -1).astype(jnp.float32) / lengths[:, None]
    rows = jnp.asarray(rows)
    return jax.jit(lambda: jnp.where(rows[:, None] >= 0, per_row[jnp.maximum(rows, 0)], 0.0))


def pooled_fn(case: Case, impl: str, block_size: int | None, chunk_size: int,
              config: PoolingConfig | None):
    """A jitted ``f(x, cu_seqlens)`` (cu_seqlens traced for packed input)."""
    if impl in PLAIN_JAX:
        return jax.jit(PLAIN_JAX[impl])
    num_blocks = None if block_size is None or case.cu is None else len(segments(case.cu,
                                                                                 block_size))

    def f(x, cu_seqlens):
        if block_size is None:
            return pooling.mean_pooling(x, chunk_size, cu_seqlens, impl=impl, config=config)
        return pooling.block_mean_pooling(x, block_size, cu_seqlens, chunk_size,
                                          total_blocks=num_blocks, impl=impl, config=config)

    return jax.jit(f)


def measure(case: Case, impl: str, block_size: int | None, copy_gbs: float, chunk_size: int = 32,
            config: PoolingConfig | None = None) -> list[dict]:
    """Forward and backward of one implementation on one case: checked, then timed."""
    x, cu = case.x, None if case.cu is None else jnp.asarray(case.cu)
    kind = "blocks" if block_size is not None else "mean"
    f = pooled_fn(case, impl, block_size, chunk_size, config)

    out = f(x, cu)
    fwd_err = relative_error(out.reshape(case.ref[kind].shape), case.ref[kind])
    fwd_stats = time_stats_ms(lambda: f(x, cu), SAMPLES)

    # Time the backward alone: the pullback of a forward run outside the timed function.
    _, pullback = jax.vjp(lambda a: f(a, cu), x)
    backward = jax.jit(pullback)
    dout = case.dout[kind]
    (dx,) = backward(dout)
    bwd_err = relative_error(dx.reshape(-1, x.shape[-1]), case.expected_dx[kind]())
    bwd_stats = time_stats_ms(lambda: backward(dout), SAMPLES)

    op = "mean_pooling" if block_size is None else f"block_mean_pooling(block_size={block_size})"
    return [row(f"{op} {case.name}", impl, direction, list(x.shape), str(x.dtype), stats=stats,
                bytes_moved=n_bytes, copy_gbs=copy_gbs, rel_err=err)
            for direction, stats, n_bytes, err in (
                ("fwd", fwd_stats, x.nbytes + out.nbytes, fwd_err),  # read x, write the means
                ("bwd", bwd_stats, x.nbytes + dout.nbytes, bwd_err))]  # read dout, write dx


def tiling_variants(quick: bool) -> list[tuple[int, PoolingConfig]]:
    """(chunk_size, PoolingConfig) pairs to sweep for mean_pooling (fields left out: defaults).

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
    run = Run()
    copy_gbs, overhead_ms = ceilings()
    cases = make_cases(args.quick, np.random.default_rng(0))

    rows = []
    for case in cases:
        for block_size in (None, BLOCK_SIZE):
            packed_mean = block_size is None and case.cu is not None
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
        sweep += [{**r, "variant": label}
                  for r in measure(case, "triton", None, copy_gbs, chunk_size, config)]

    # Speed-ups over XLA (impl="xla") and over the fastest plain-JAX form, same case and direction.
    for r in rows:
        others = [p for p in rows if p["impl"] != "triton" and p["name"] == r["name"]
                  and p["direction"] == r["direction"]]
        xla = next(p for p in others if p["impl"] == "xla")
        best = min(others, key=lambda p: p["median_ms"])
        r["speedup_vs_xla"] = xla["median_ms"] / r["median_ms"]
        if r["impl"] == "triton":
            r["best_plain_jax"] = best["impl"]
            r["speedup_vs_best_plain_jax"] = best["median_ms"] / r["median_ms"]
            r["meets_target"] = r["pct_of_copy"] >= 85 and r["speedup_vs_best_plain_jax"] > 1
    run.failures = [f"{r['name']} {r['impl']} {r['direction']}: rel_err {r['rel_err']:.3g} > {TOL}"
                    for r in rows + sweep if not r["rel_err"] <= TOL]

    payload = dict(
        copy_bandwidth_gbs=copy_gbs,
        dispatch_overhead_ms=overhead_ms,
        block_size=BLOCK_SIZE,
        target="triton >= 85% of copy bandwidth (fwd: read x once; bwd: write dx once) and faster "
               "than the fastest plain-JAX form",
        peers=dict(xla="ejk_lite.pooling impl='xla': jnp.mean (padded), jax.ops.segment_sum "
                       "(packed)",
                   xla_cumsum="packed mean_pooling: float32 running sums, differences at "
                              "cu_seqlens",
                   xla_onehot="packed mean_pooling: one-hot [tokens, sequences] @ x, float32 "
                              "accumulation"),
        tolerance=TOL, samples=SAMPLES, failures=run.failures, passed=not run.failures,
        references=dict(fwd="float64 NumPy on the host",
                        bwd="dout / len broadcast, float32 on the device"),
        rows=rows,
        tiling_sweep=sweep,
    )
    path = write_result(args.out, "mean_pooling", payload)

    print(f"\ntiling sweep (mean_pooling, triton); copy bandwidth {copy_gbs:.0f} GB/s")
    print_table(sweep, ["name", "variant", "direction", "median_ms", "pct_of_copy", "rel_err"])
    print(f"\nwrote {path}; copy bandwidth {copy_gbs:.0f} GB/s, dispatch overhead "
          f"{overhead_ms:.3f} ms")
    print_table(rows, ["name", "impl", "direction", "median_ms", "gbs", "pct_of_copy",
                       "speedup_vs_xla", "rel_err", "meets_target"])
    run.finish()


if __name__ == "__main__":
    main()
