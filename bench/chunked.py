"""Benchmark ejk_lite.chunked_recurrent against flash-linear-attention's chunk kernels, bf16.

Two gates at each of the issue's shapes (``SHAPES``), forward and forward + backward (``jax.vjp``
of the output with a random cotangent; the final state is not used):

* a scalar gate ``g`` ``[B, T, H]``: peers ``fla.ops.simple_gla.chunk_simple_gla`` and
  ``fused_recurrent_simple_gla``. Where fla refuses ``chunk_simple_gla``'s backward (fla 0.6,
  Triton < 3.7.1 on Hopper), forward + backward races ``chunk_gla`` with the gate broadcast
  along K, and the forward the faster of that and ``chunk_simple_gla``'s forward, which runs
  (each row's ``peer`` names the kernel timed);
* a per-key gate ``gk`` ``[B, T, H, K]``: peers ``fla.ops.gla.chunk_gla`` (which calls it ``g``)
  and ``fused_recurrent_gla``; mild, as a trained layer's, so that every chunk takes our
  one-product shortcut (``ejk_lite.chunked``, "Mild gates");
* at the first shape also ``gk-strong`` (rows named "... gk strong"): the per-key gate with
  strong decays, where every chunk takes our careful kernels. The same peers.

Our chunked op races fla's chunk kernel; our token-by-token :func:`ejk_lite.recurrent` races fla's
fused recurrent one. The grouped-heads shape (``kv_heads``) runs ours only: fla has no grouped
key/value heads. The peers run
in PyTorch on the same arrays (``torch.from_dlpack``). Both sides compute the same function: fla
(>= 0.2, ``[B, T, H, K]`` layouts) takes natural-log gates (it multiplies them by 1/ln 2 itself
before its ``exp2``), ``h_t = exp(g_t) h_{t-1} + k_t^T v_t``, ``o_t = scale q_t h_t``, with
``scale = K ** -0.5`` passed explicitly to both.

Checks, for every timed configuration of ours (the script writes the JSON, then exits 1 if one
fails): output and every input's gradient against fla's on the full inputs, and against the float32
``ejk_lite.linear_attention.reference`` (a ``lax.scan``) on the first ``CHECK_SEQ_LEN`` tokens;
relative L2 error within ``TOL`` (bf16's, from ``ejk_lite.testing``). fla runs through
``peers.fla_race``. The commit comes from ``$EJK_COMMIT`` or
``bench/results/.commit`` (``python bench/gpu_check.py prepare``), else ``git rev-parse HEAD``.

    python bench/chunked.py --out bench/results                  # GPU, every shape
    python bench/chunked.py --shapes 2,3 --merge --out bench/results   # some shapes, kept beside
                                                                 # the file's others (same commit)
    python bench/chunked.py --shapes 0 --gates gk --merge --refusals OLD.json --out DIR
    python bench/chunked.py --quick --out /tmp/bench_chunked     # tiny shapes, CPU interpreter

The file is written after every (shape, gate), so a run cut short keeps what it finished, and
``--merge`` keeps the file's other (shape, gate) pairs. ``--refusals`` takes fla's refusals from
an earlier results file of the same fla, torch and Triton on the same device (fla refuses by
its own check of the Triton version, whatever our commit): asking again cost 113 s (H100,
8c02bab) and 138 s (H100, c96caac: the refusal logged at 181 s, after 43 s of start-up).

One shape's race does not fit one 10-minute GPU call from a cold start: fla autotunes every
kernel (H100, c96caac, ``--shapes 0``: the scalar gate had not finished some 390 s after the
refusal above, when ``timeout 575`` stopped the call). fla keeps its autotuning
results in Triton's cache directory (``FLA_CACHE_RESULTS``, on by default), so carry the
``*.autotune.json`` files from one call to the next: each call then picks up where the last
stopped, and a warm call times without autotuning. In the call::

    export TRITON_CACHE_DIR=/tmp/tcache; mkdir -p $TRITON_CACHE_DIR
    [ -f .scratch/race/autotune.tgz ] && tar xzf .scratch/race/autotune.tgz -C $TRITON_CACHE_DIR
    timeout 500 python3 bench/chunked.py --shapes 0 --gates g --merge ... --out .scratch/race
    cp -r .scratch/race $OUT/; (cd $TRITON_CACHE_DIR && find . -name '*.autotune.json' \
        | tar czf $OUT/autotune.tgz -T -)

and here, after it, copy ``autotune.tgz`` and ``chunked.json`` back into ``.scratch/race`` (and
carry ``.scratch/race``).
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import jax.numpy as jnp  # noqa: E402

import ejk_lite  # noqa: E402

if ejk_lite.ON_GPU:
    # Import jax-triton now, through ejk_lite, which keeps TRITON_CACHE_DIR usable for fla's
    # kernels.
    ejk_lite.launch._import_jax_triton()
import peers  # noqa: E402
from common import (  # noqa: E402
    Run,
    ceilings,
    commit,
    compare,
    device_name,
    forward_and_backward,
    parse_args,
    past_tolerance,
    print_table,
    row,
    time_stats_ms,
    tolerance,
    versions,
    worst,
    write_result,
)
from ejk_lite.chunked import chunked_recurrent  # noqa: E402
from ejk_lite.linear_attention import recurrent, reference  # noqa: E402
from ejk_lite.notebook import chunked_cost  # noqa: E402

OP = "chunked"
SHAPES = [dict(batch=4, seq_len=4096, heads=16, dim=128),
          dict(batch=8, seq_len=2048, heads=16, dim=128),
          dict(batch=1, seq_len=32768, heads=8, dim=64),
          dict(batch=4, seq_len=4096, heads=16, kv_heads=4, dim=128)]  # grouped: ours only
QUICK_SHAPES = [dict(batch=1, seq_len=40, heads=2, dim=16),  # 40: a short last chunk (C = 16)
                dict(batch=1, seq_len=40, heads=2, kv_heads=1, dim=16)]
GATES = ("g", "gk", "gk-strong")
# "gk-strong": the per-key gate with strong decays (peers.gla_inputs' strong), at these shapes
# only: every chunk then takes our careful kernels, none the one-product shortcut
# (ejk_lite.chunked, "Mild gates"); fla's kernels are the same for either. Its rows: gate "gk",
# "strong": true, named "<shape> gk strong".
STRONG = "gk-strong"
STRONG_SHAPES = (0,)
CHECK_SEQ_LEN = 256  # prefix checked against the float32 reference (quick: the whole sequence)
SAMPLES = 10
QUICK_SAMPLES = 3
TOL = {"out": tolerance(jnp.bfloat16), "grad": tolerance(jnp.bfloat16, gradient=True)}
# Our kernels, also in --quick runs on a CPU (where impl="auto" would pick the reference).
OURS = {"chunked": functools.partial(chunked_recurrent, impl="triton"),
        "recurrent": functools.partial(recurrent, impl="triton")}
QUICK_CHUNK_SIZE = 16  # several chunks in a short sequence
# The ``impl`` of fla's rows, by the op of ours they race.
FLA_IMPL = {"chunked": "fla", "recurrent": "fla_recurrent"}
DIRECTIONS = ("fwd", "fwd+bwd")


def functions(op, scale):
    """``op``'s output jitted, and its output and the gradients of every input for a cotangent
    of the output (final state unused)."""
    return forward_and_backward(lambda inputs: op(**inputs, softmax_scale=scale)[0])


def case_name(shape: dict, case: str) -> str:
    """A row's name: the shape and the case of ``GATES`` ("gk-strong" as "gk strong")."""
    return f"{shape_name(shape)} {'gk strong' if case == STRONG else case}"


def shape_name(shape: dict) -> str:
    heads = f"{shape['heads']}/{shape['kv_heads']}" if shape.get("kv_heads") else shape["heads"]
    return f"B{shape['batch']} T{shape['seq_len']} H{heads} K=V={shape['dim']}"


def fla_peer(run, fla, form, gate, inputs, d_o, scale, samples, refused):
    """fla's kernels racing ours of ``form`` on these inputs: ``({direction: the kernel timed},
    (output, gradients, {direction: times}))``, or None where fla refuses (then the race is
    missing: a failure of the run)."""
    name = peers.FLA[form, gate]
    if name in refused:
        # Refused earlier in this run, or in the file --merge keeps (same commit, so the same
        # fla and Triton, and same device): not asked again. Asking cost 113 s of autotuning
        # before the refusal (chunk_simple_gla's forward, shape 0, H100, 8c02bab).
        run.log(f"{name}: refused before, not asked again ({refused[name][:100]})")
    else:
        try:
            race = peers.fla_race(fla, form, gate, inputs, d_o, scale, samples)
            return dict.fromkeys(DIRECTIONS, name), race
        except RuntimeError as error:
            # fla 0.6 refuses chunk_simple_gla with Triton < 3.7.1 on Hopper (its issue 640:
            # wrong gated gradients). Recorded; its chunk_gla computes the same function with
            # the gate broadcast along K, and runs.
            refused[name] = f"{type(error).__name__}: {str(error)[:300]}"
            run.log(f"{name} refused: {refused[name]}")
    if (form, gate) != ("chunked", "g"):
        run.failures.append(f"{name} refused and no stand-in: no race for our {form} ({gate})")
        return None
    names = dict.fromkeys(DIRECTIONS, peers.FLA_BROADCAST)
    o, grads, stats = peers.fla_race(fla, form, gate, inputs, d_o, scale, samples,
                                     broadcast=True)
    # fla's refusal sits in chunk_simple_gla's backward (chunk_bwd_dqkwg, fla 0.6): its
    # forward runs, and a forward's race takes fla's faster kernel for the gate, the
    # broadcast chunk_gla's or its own, checked like any peer (its output is the one compared).
    try:
        own_o, _, own = peers.fla_race(fla, form, gate, inputs, d_o, scale, samples,
                                       forward_only=True)
    except RuntimeError as error:
        run.log(f"{name}'s forward refused too: {type(error).__name__}: {str(error)[:200]}")
    else:
        run.log(f"{name}'s forward alone: {own['fwd']['median_ms']:.4g} ms; "
                f"{peers.FLA_BROADCAST}: {stats['fwd']['median_ms']:.4g} ms")
        if own["fwd"]["median_ms"] < stats["fwd"]["median_ms"]:
            names["fwd"] = f"{name}, its forward alone: its backward is refused"
            o, stats = own_o, dict(stats, fwd=own["fwd"])
    return names, (o, grads, stats)


def run_shape(run, index, shape, ops, fla, samples, quick, copy_gbs, rows, refused, gates, write):
    """The ``gates`` at one shape: ours against the float32 reference and fla's peers (rows
    appended; ``write()`` after each gate)."""
    b, t, h, d = shape["batch"], shape["seq_len"], shape["heads"], shape["dim"]
    h_kv = shape.get("kv_heads") or h
    scale = d ** -0.5
    check_len = t if quick else min(t, CHECK_SEQ_LEN)
    for case in gates:
        if case == STRONG and index not in STRONG_SHAPES:
            continue
        name = case_name(shape, case)
        gate, strong = ("gk", True) if case == STRONG else (case, False)
        # Inputs seeded by the shape's index and the gate: the same with or without --merge
        # (the strong gate's q, k, v and logits are the mild one's, shifted).
        inputs, d_o = peers.gla_inputs(2 * index + (gate == "gk"), b, t, h, d, gate,
                                       shape.get("kv_heads"), strong=strong)
        dims = [b, t, h, d]
        # Fewest bytes, bf16: q, k, v, the gate and o once (fwd); fwd+bwd: those and d_o read,
        # o and every input's gradient written: twice as many (ejk_lite.notebook.chunked_cost).
        q_bytes, kv_bytes = b * t * h * d * 2, b * t * h_kv * d * 2
        gate_bytes = q_bytes if gate == "gk" else b * t * h * 2
        io_bytes = 2 * q_bytes + 2 * kv_bytes + gate_bytes
        bytes_moved = {"fwd": io_bytes, "fwd+bwd": 2 * io_bytes}
        for direction, n_bytes in bytes_moved.items():  # one count, here and in the book
            assert n_bytes == chunked_cost(b, t, h, d, d, gate, direction,
                                           kv_heads=h_kv).bytes, direction

        # The float32 reference on a prefix (the same bf16 values, widened), once for both of
        # ours: its output and gradients come back in float32.
        short, short_d_o = peers.prefix(inputs, check_len), d_o[:, :check_len]
        wide = {n: x.astype(jnp.float32) for n, x in short.items()}
        ref_o, ref_grads = functions(reference, scale)[1](wide, short_d_o.astype(jnp.float32))
        # Where a shape's minutes go (a run of shape 0 did not finish in 320 s on the H100,
        # fla's autotuning included): a line per step.
        run.log(f"{name}: float32 reference on {check_len} tokens done")

        for impl, op in ops.items():
            peer = None
            if fla is not None and h_kv == h:  # fla has no grouped key/value heads
                peer = fla_peer(run, fla, impl, gate, inputs, d_o, scale, samples, refused)
                run.log(f"{name} {impl}: fla's "
                        f"{' / '.join(dict.fromkeys(peer[0].values())) if peer else 'peer'} timed")
            fwd, fwd_bwd = functions(op, scale)
            err_ref = compare(*fwd_bwd(short, short_d_o), ref_o, ref_grads)
            run.log(f"{name} {impl}: ours checked against the reference")
            err_fla = None
            if peer is not None:
                peer_names, (fla_o, fla_grads, fla_stats) = peer
                err_fla = compare(*fwd_bwd(inputs, d_o), fla_o, fla_grads)
                del fla_o, fla_grads
            for against, err in (("reference", err_ref), ("fla", err_fla)):
                if err is not None:
                    run.failures += past_tolerance(err, jnp.bfloat16, f"{name} {impl} vs {against}")

            stats = {"fwd": time_stats_ms(lambda: fwd(inputs), samples),
                     "fwd+bwd": time_stats_ms(lambda: fwd_bwd(inputs, d_o), samples)}
            for direction in DIRECTIONS:
                st = stats[direction]
                extra = dict(rel_err_vs_reference=err_ref, checked_seq_len=check_len, kv_heads=h_kv)
                if peer is not None:
                    extra["peer"] = peer_names[direction]
                    extra["rel_err_vs_fla"] = err_fla
                    extra["speedup_vs_fla"] = fla_stats[direction]["median_ms"] / st["median_ms"]
                rows.append(row(name, impl, direction, dims, "bfloat16", stats=st,
                                bytes_moved=bytes_moved[direction], copy_gbs=copy_gbs,
                                rel_err=worst(err_ref, direction), gate=gate, strong=strong,
                                **extra))
            run.log(f"{name} {impl}: fwd {stats['fwd']['median_ms']:.4g} ms, fwd+bwd "
                    f"{stats['fwd+bwd']['median_ms']:.4g} ms; vs reference {fmt_err(err_ref)}"
                    + (f"; vs fla {fmt_err(err_fla)}" if err_fla else ""))
            if peer is not None:
                for direction in DIRECTIONS:
                    rows.append(row(name, FLA_IMPL[impl], direction, dims, "bfloat16",
                                    stats=fla_stats[direction], bytes_moved=bytes_moved[direction],
                                    copy_gbs=copy_gbs, gate=gate, strong=strong,
                                    peer=peer_names[direction], races=impl, kv_heads=h_kv))
            del peer
        del inputs, d_o
        run.log(f"wrote {write()}")  # after every gate: a run cut short keeps what it finished


def kept_rows(out: str, run_names: set[str], this_commit: str | None, quick: bool
              ) -> tuple[list, dict, list, list, dict]:
    """``--merge``: the rows, fla's refusals, commands and failures of the file in ``out`` for
    the (shape, gate) pairs this run does not measure (``run_names``: "<shape> <gate>"), and the
    refusals it took from an earlier file; refused unless that file was measured on the same
    commit and the same device."""
    path = Path(out) / f"{OP}.json"
    if not path.exists():
        return [], {}, [], [], {}
    old = json.loads(path.read_text())
    if (old.get("commit"), old.get("quick"), old.get("device")) != (this_commit, quick,
                                                                     device_name()):
        sys.exit(f"--merge: {path} was measured on {old.get('commit')} (quick={old.get('quick')}, "
                 f"{old.get('device')}), this run on {this_commit} ({device_name()}): run every "
                 "shape instead")
    rows = [r for r in old["rows"] if r["name"] not in run_names]
    failures = [f for f in old.get("failures", [])  # those of the shapes kept, and general ones
                if not any(f.startswith(name + " ") for name in run_names)]
    return (rows, old.get("peers_refused", {}), old.get("commands", [old.get("command")]),
            failures, old.get("peers_refused_earlier") or {})


def earlier_refusals(path: str, fla_versions: dict) -> tuple[dict[str, str], str | None]:
    """(fla's refusals, commit) recorded in the results file ``path``, where it ran the same
    fla, torch and Triton on the same device as this run (fla refuses by its own check of the
    Triton version); exits otherwise."""
    old = json.loads(Path(path).read_text())
    here = (fla_versions, versions()["triton"], device_name())
    there = (old.get("peer_versions"), old.get("versions", {}).get("triton"), old.get("device"))
    if here != there:
        sys.exit(f"--refusals: {path} ran {there}, this run {here}: its refusals may not hold")
    return dict(old.get("peers_refused") or {}), old.get("commit")


def main():
    def extra(parser):
        parser.add_argument("--shapes", help="indices into SHAPES to run, e.g. 0,2 (default all)")
        parser.add_argument("--merge", action="store_true",
                            help="keep the file in --out's rows of the other (shape, gate) pairs "
                                 "(same commit)")
        parser.add_argument("--gates", default=",".join(GATES),
                            help=f"the gates to run, of {','.join(GATES)} (default all)")
        parser.add_argument("--refusals", help="an earlier results file whose fla refusals hold "
                            "here (same fla, torch, Triton and device: checked)")

    args = parse_args(__doc__.splitlines()[0], extra)
    quick = args.quick
    every = QUICK_SHAPES if quick else SHAPES
    picked = [int(i) for i in args.shapes.split(",")] if args.shapes else range(len(every))
    shapes = [(i, every[i]) for i in picked]
    gates = list(dict.fromkeys(args.gates.split(",")))  # each once, in the order given
    if not gates or any(g not in GATES for g in gates):
        sys.exit(f"--gates: each of {', '.join(GATES)}, got {args.gates!r}")
    this_run = [case_name(s, g) for i, s in shapes for g in gates
                if g != STRONG or i in STRONG_SHAPES]
    samples = QUICK_SAMPLES if quick else SAMPLES
    ops = dict(OURS)
    if quick:
        ops["chunked"] = functools.partial(ops["chunked"], chunk_size=QUICK_CHUNK_SIZE)
    run = Run()
    fla, fla_missing = peers.load_fla()
    run.log(f"fla: {'loaded ' + str(fla['versions']) if fla else 'not run: ' + fla_missing}")
    copy_gbs, dispatch_ms = ceilings()
    rows, refused, earlier, refused_earlier = [], {}, [], {}
    if args.merge:
        rows, refused, earlier, run.failures, refused_earlier = kept_rows(
            args.out, set(this_run), commit(), quick)
    if args.refusals and fla is not None:
        earlier_refused, earlier_commit = earlier_refusals(args.refusals, fla["versions"])
        for name, why in earlier_refused.items():
            if name not in refused:
                refused[name] = why
                refused_earlier[name] = (f"as recorded in {args.refusals} (commit "
                                         f"{earlier_commit}; same fla, torch, Triton, device)")
    if fla is None and ejk_lite.ON_GPU:
        run.failures.append(f"peer fla not run on the GPU: {fla_missing}")

    def write():
        # Every (shape, gate) of the benchmark not in the file yet: it passes only with none
        # (a run cut short, or one of some shapes, is not the race).
        done = {r["name"] for r in rows}
        pending = [p for p in (case_name(s, g) for i, s in enumerate(every) for g in GATES
                               if g != STRONG or i in STRONG_SHAPES) if p not in done]
        payload = dict(
            commit=commit(), commands=[*earlier, " ".join(sys.argv)], quick=quick,
            copy_bandwidth_gbs=copy_gbs,
            dispatch_overhead_ms=dispatch_ms,
            peer_fla=(f"fla {fla['versions']['fla']} (torch {fla['versions']['torch']}): "
                      + ", ".join(f"{n} ({impl}, {gate})"
                                  for (impl, gate), n in peers.FLA.items()))
            if fla else f"not run: {fla_missing}",
            peer_versions=fla["versions"] if fla else None,
            peers_refused=refused,
            peers_refused_earlier=refused_earlier or None,
            target="at least fla's speed at every shape, forward and forward+backward: our "
                   "chunked op against fla's chunk kernels, our recurrent one against its fused "
                   "recurrent",
            tolerance=TOL,
            speedups_vs_fla={f"{r['name']} {r['impl']} {r['direction']}":
                             round(r["speedup_vs_fla"], 3) for r in rows if "speedup_vs_fla" in r},
            failures=run.failures, pending=pending, passed=not run.failures and not pending,
            rows=rows,
            notes=("bf16 q, k, v, log-gates and cotangent; fp32 state. fwd: the output; fwd+bwd: "
                   "jax.vjp of the output (final state unused) with a random cotangent, every "
                   "input's gradient (fla: loss.backward with the same cotangent). Times: min / "
                   f"median / max over {samples} samples: on a GPU the device time from the "
                   "profiler, L2 flushed before each (common.device_samples_ms, ours and fla "
                   "alike); on a CPU (--quick) the wall clock of the interpreter, which only "
                   "shows that the script runs. rel_err: the worst of the output (fwd) or of "
                   "the gradients (fwd+bwd) "
                   "against the float32 lax.scan reference on the first checked_seq_len tokens; "
                   "rel_err_vs_reference / rel_err_vs_fla hold each one (vs fla: full inputs, the "
                   "racing fla kernel's result as the reference). fla rows: 'races' names our op "
                   "it races (impl 'fla': the chunk kernels; 'fla_recurrent': the fused "
                   "recurrent ones). H16/4: 16 query heads, 4 key/value heads (ours only). "
                   "Gates: log_sigmoid(N(4, 1)) (mild: every chunk takes ours' one-product "
                   "shortcut); rows with strong true ('gk strong'): log_sigmoid(N(0, 1)), every "
                   "chunk ours' careful kernels. "
                   "bytes: each input and output once."),
        )
        return write_result(args.out, OP, payload)

    for index, shape in shapes:
        run_shape(run, index, shape, ops, fla, samples, quick, copy_gbs, rows, refused, gates,
                  write)
    print_table(rows, ["name", "impl", "direction", "median_ms", "min_ms", "max_ms", "gbs",
                       "rel_err", "speedup_vs_fla"])
    run.finish()


def fmt_err(err: dict[str, float]) -> str:
    return " ".join(f"{name} {e:.2g}" for name, e in err.items())


if __name__ == "__main__":
    main()
