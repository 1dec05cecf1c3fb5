"""Same-process A/B of attention versions: which one is faster, with the GPU's drift taken out.

Separate processes (``bench/_ab.py``) differed by up to 10 % from run to run on the same code, more
than the differences looked for. Here every version is imported in one process, as a renamed copy
of the package (``ejk_new``, ``ejk_old``, ...), and the timings are interleaved: ``--reps`` rounds,
each timing every (version, mask, direction) once (10 samples, device time); the median of the
round medians is reported, with the spread of the rounds.

    here:    python bench/_ab_attention.py prepare .scratch/ab [--base REV]   # the copies
    GPU:     python bench/_ab_attention.py run .scratch/ab --out bench/results   # -> ab_attention.json

The versions: ``new``, the working tree; ``old``, 139f93b (before issue 17's safety work);
``fast``, the working tree without the NaN containment's retry launch (``_launch`` returns after the
first launch: flags written and never read): a lower bound for the design, wrong on NaN inputs,
timed to show what the containment costs; ``base`` (with ``--base REV``), the package at REV, to
time one change against the commit before it. ``--versions`` picks which of them run.
Every version's output and gradients are compared with ``new``'s at every timed configuration;
the run fails past a relative difference of 1e-2 (bf16).
"""

from __future__ import annotations

import argparse
import importlib
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time

OLD = "139f93bc004980ce62b4365ac35c8b6f1eda1191"
CONTAINMENT = [("    if not first:\n        return outs\n", "    if True:\n        return outs\n")]


def _copy(src: pathlib.Path, dest: pathlib.Path, name: str, edits=()) -> None:
    """``src`` (an ejk_lite package) as the package ``name`` in ``dest``."""
    target = dest / name
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(src, target, ignore=shutil.ignore_patterns("__pycache__"))
    for f in target.glob("*.py"):
        text = f.read_text().replace("ejk_lite", name)
        for a, b in edits:
            if f.name == "attention.py":
                if a not in text:
                    raise SystemExit(f"{name}: {a!r} not found in attention.py")
                text = text.replace(a, b)
        f.write_text(text)


def _copy_rev(root: pathlib.Path, rev: str, dest: pathlib.Path, name: str) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        archive = subprocess.run(["git", "-C", str(root), "archive", rev, "ejk_lite"],
                                 check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=archive, check=True)
        _copy(pathlib.Path(tmp) / "ejk_lite", dest, name)


def _rev(root: pathlib.Path, rev: str) -> str:
    return subprocess.run(["git", "-C", str(root), "rev-parse", rev], capture_output=True,
                          text=True, check=True).stdout.strip()


def prepare(dest: pathlib.Path, base: str | None) -> None:
    root = pathlib.Path(__file__).resolve().parent.parent
    dest.mkdir(parents=True, exist_ok=True)
    _copy(root / "ejk_lite", dest, "ejk_new")
    _copy(root / "ejk_lite", dest, "ejk_fast", CONTAINMENT)
    _copy_rev(root, OLD, dest, "ejk_old")
    (dest / "COMMIT").write_text(_rev(root, "HEAD"))
    dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "ejk_lite"],
                           capture_output=True, text=True, check=True).stdout.strip()
    (dest / "DIRTY").unlink(missing_ok=True)
    if dirty:  # new is the working tree: say so in the record
        (dest / "DIRTY").write_text(dirty)
    if base:
        _copy_rev(root, base, dest, "ejk_base")
        (dest / "BASE").write_text(_rev(root, base))
    print("prepared", sorted(p.name for p in dest.iterdir()))


def run(src: pathlib.Path, out: str | None, reps: int, versions: str) -> None:
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
    sys.path.insert(0, str(src))
    import common
    import jax
    import jax.numpy as jnp
    import numpy as np

    start = time.perf_counter()
    names = tuple(versions.split(","))
    if names[0] != "new":
        raise SystemExit("--versions must start with new (every version is checked against it)")
    mods = {n: importlib.import_module("ejk_" + n) for n in names}
    rng = np.random.default_rng(0)
    B, H, T, D = 4, 16, 8192, 128
    q, k, v, ct = (jnp.asarray(rng.standard_normal((B, H, T, D)), jnp.bfloat16) for _ in range(4))
    bounds = np.sort(rng.choice(np.arange(1, T), 7, replace=False))
    seg = jnp.asarray(np.broadcast_to(np.searchsorted(bounds, np.arange(T), side="right"), (B, T)),
                      jnp.int32)
    masks = {"causal": dict(causal=True),
             "documents": dict(causal=True, q_segment_ids=seg, kv_segment_ids=seg),
             "window 1024": dict(causal=True, sliding_window=(1024, 0))}
    fns, worst = {}, 0.0
    for mask, kw in masks.items():
        results = {}
        for n, m in mods.items():
            fb = m.BlockSizes.forward(D, jnp.bfloat16)
            built = jax.jit(lambda m=m: m.make_block_mask(T, T, q_block=fb.block_q,
                                                          kv_block=fb.block_kv, **kw))()
            fn = (lambda q, k, v, m=m, built=built:
                  m.blocksparse_attention(q, k, v, qkv_layouts=built, causal=False))
            fns[n, mask, "fwd"] = jax.jit(fn)
            fns[n, mask, "fwd+bwd"] = jax.jit(lambda q, k, v, fn=fn: jax.vjp(fn, q, k, v)[1](ct))
            results[n] = [fns[n, mask, "fwd"](q, k, v), *fns[n, mask, "fwd+bwd"](q, k, v)]
        for n in names[1:]:  # every version against new: output, dq, dk, dv
            for a, b in zip(results[n], results["new"]):
                a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
                worst = max(worst, float(np.linalg.norm(a - b) / np.linalg.norm(b)))
    print(f"largest relative difference to new: {worst} ({time.perf_counter() - start:.0f} s)",
          flush=True)
    if not worst <= 1e-2:
        raise SystemExit(f"versions disagree: {worst}")
    described = {"new": (src / "COMMIT").read_text().strip()
                 + (" + uncommitted changes" if (src / "DIRTY").exists() else ""),
                 "fast": "new without the retry launch", "old": OLD,
                 "base": (src / "BASE").read_text().strip() if (src / "BASE").exists() else ""}
    rounds = {key: [] for key in fns}
    for done in range(1, reps + 1):  # the file is rewritten after every round: a run cut short
        for key, f in fns.items():   # by a time limit keeps the rounds it finished
            began = time.perf_counter()
            rounds[key].append(common.time_stats_ms(lambda: f(q, k, v), samples=10,
                                                    one_trace=True)["median_ms"])
            if done == 1:  # where a round's time goes (a round once took over 140 s)
                print(f"  {' '.join(key):28s} {time.perf_counter() - began:6.1f} s", flush=True)
        table = {}
        for (n, mask, direction), xs in rounds.items():
            table.setdefault(f"{mask} {direction}", {})[n] = {
                "median_ms": float(np.median(xs)), "min_ms": float(min(xs)),
                "max_ms": float(max(xs))}
        print(f"round {done} of {reps}:", flush=True)
        for row, cells in table.items():
            print(f"  {row:22s}", "  ".join(f"{n} {c['median_ms']:.3f}" for n, c in cells.items()))
        record = {"shape": dict(B=B, H=H, T=T, D=D), "dtype": "bfloat16",
                  "versions": {n: described[n] for n in names},
                  "rounds": done, "samples_per_round": 10, "largest_relative_difference": worst,
                  "median_of_round_medians": table}
        if out:
            print("wrote", common.write_result(out, "ab_attention", record), flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("what", choices=("prepare", "run"))
    parser.add_argument("dir")
    parser.add_argument("--out")
    parser.add_argument("--reps", type=int, default=8)
    parser.add_argument("--base", help="prepare: also the package at this revision, as 'base'")
    parser.add_argument("--versions", default="new,fast,old",
                        help="run: which versions, new first (new, fast, old, base)")
    args = parser.parse_args()
    if args.what == "prepare":
        prepare(pathlib.Path(args.dir), args.base)
    else:
        run(pathlib.Path(args.dir), args.out, args.reps, args.versions)
