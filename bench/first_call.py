"""First-call time of every public op, forward and forward + backward: compile + autotune + run.

What a new user waits for at the first call of an op in a fresh process. One case per public op
(``CASES``) at its benchmark's shape, bf16, each direction in a process of its own: an empty
Triton cache (``TRITON_CACHE_DIR``, a new temporary folder) and no JAX compilation cache
(``JAX_ENABLE_COMPILATION_CACHE=false``), so that nothing compiled before is found
(``common.fresh_child``, as ``bench/attention_fp32.py``). The child times:

* ``first_s``: the first call, until ``block_until_ready``, split into ``phases``
  (``common.first_call``): ``lower`` (tracing, importing jax-triton and starting Triton's
  specialiser, once per process as for a user, and Triton's compile of each kernel to PTX),
  ``xla`` (XLA's compile) and ``first_run`` (ptxas, loading the modules, the autotuning of
  ``@triton.autotune`` kernels, the run);
* ``second_s``: the second call (wall time, host included: not a kernel timing, see
  ``bench/<op>.py`` for those);
* the relative error of the first call's result against the float32 reference (the op's
  ``impl="xla"`` or its module's ``reference``, on the same bf16 inputs widened): on the whole
  input, or on a slice the op's structure makes exact where the reference is too slow or too
  large at full size (``checked`` says which): a causal attention's first queries see only the
  first keys, and a recurrence's first tokens only the first tokens (the output and dquery); its
  last tokens' dkey and dvalue depend only on the last tokens (the backward state runs from the
  end), while its gate's gradient needs the whole sequence and is not checked. The child exits 1
  past bf16's tolerance (``ejk_lite.testing``, the tests' own).

``fwd``: the output; ``fwd+bwd``: ``jax.vjp`` of the output with a random cotangent, gradients of
every differentiable input. The parent writes ``first_call.json`` after every case (``cases``,
rows of the common schema with ``first_s``, ``second_s``, ``phases``, but no device time, so not
``rows``, which the *Performance* chapter charts; a failed case has its ``error``), and
exits 1 if any case failed or ran past ``--case-timeout-s``. Cases left when ``--budget-s`` is
spent are listed in ``not_run`` (the defaults, 400 s and 150 s a case, end a run within ~560 s,
the limit ``bench/gpu_check.py benches`` gives a script). Children run one at a time: with
``--jobs N`` N at once, whose compiles then share the CPU (and the GPU's memory: no
preallocation), and take longer.

    python bench/first_call.py --out bench/results                 # GPU
    python bench/first_call.py --quick --out /tmp/fc               # tiny shapes, CPU interpreter
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent))
FRESH_CHILDREN = True  # for common, imported next: this parent leaves the GPU to its children
import common  # noqa: E402  (first: it settles the environment, then the Triton backend)
import ejk_lite  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import peers  # noqa: E402
from ejk_lite import (  # noqa: E402
    block_mean_pooling,
    blocksparse_attention,
    chunk_global_cumsum,
    chunk_local_cumsum,
    chunked_recurrent,
    mean_pooling,
    recurrent,
)
from ejk_lite import attention, linear_attention  # noqa: E402

DTYPE = jnp.bfloat16
DIRECTIONS = ("fwd", "fwd+bwd")
BUDGET_S = 400  # then the cases left are not run
CASE_TIMEOUT_S = 150  # then a child is killed: a failure


@dataclasses.dataclass(frozen=True)
class Case:
    """One op at its benchmark's shape: its inputs, our call and the reference, what is checked.

    ``inputs(shape)`` gives the differentiated arrays (a dict: gradient ``d<name>``) and the
    other arguments (traced, as ``cu_seqlens`` is in training); ``ours`` and ``reference`` take
    them as ``(arrays, *other)``, the reference in float32. ``sliced``: ``(token axis, tokens,
    tokens with --quick, arrays whose gradient the first tokens determine, those the last tokens
    determine)``; None: checked whole."""
    name: str
    shape: dict[str, int]
    quick: dict[str, int]
    inputs: Callable[[dict[str, int]], tuple[dict[str, jax.Array], tuple]]
    ours: Callable[..., jax.Array]
    reference: Callable[..., jax.Array]
    sliced: tuple[int, int, int, tuple[str, ...], tuple[str, ...]] | None = None


def normal(seed: int, shape: tuple[int, ...]) -> jax.Array:
    return jax.random.normal(jax.random.key(seed), shape, DTYPE)


@functools.lru_cache
def packing(total: int, num_seqs: int) -> np.ndarray:
    """``cu_seqlens`` of ``num_seqs`` random lengths summing to ``total`` (bench/mean_pooling.py's
    seed): also what the traced argument holds, to count the blocks (a static number)."""
    cuts = np.sort(np.random.default_rng(0).choice(np.arange(1, total), num_seqs - 1, False))
    return np.concatenate([[0], cuts, [total]]).astype(np.int32)


def gates(name: str) -> Callable[[dict[str, int]], tuple[dict[str, jax.Array], tuple]]:
    return lambda s: ({name: normal(0, (s["B"], s["T"], s["H"], s["S"]))}, ())


def packed(s: dict[str, int]) -> tuple[dict[str, jax.Array], tuple]:
    return {"x": normal(0, (s["tokens"], s["hidden"]))}, (jnp.asarray(packing(s["tokens"],
                                                                             s["seqs"])),)


def block_means(impl: str, a: dict, cu: jax.Array) -> jax.Array:
    cu_values = packing(a["x"].shape[0], cu.shape[0] - 1)
    blocks = int(np.sum(-(-np.diff(cu_values) // 64)))
    return block_mean_pooling(a["x"], 64, cu, total_blocks=blocks, impl=impl)


def gla(gate: str) -> Callable[[dict[str, int]], tuple[dict[str, jax.Array], tuple]]:
    return lambda s: (peers.gla_inputs(0, s["B"], s["T"], s["H"], s["K"], gate)[0], ())


def qkv(s: dict[str, int]) -> tuple[dict[str, jax.Array], tuple]:
    return {name: normal(i, (s["B"], s["H"], s["T"], s["D"]))
            for i, name in enumerate(("query", "key", "value"))}, ()


def scan(a: dict) -> jax.Array:
    return linear_attention.reference(**a)[0]


CUMSUM = dict(shape=dict(B=4, T=4096, H=16, S=128), quick=dict(B=1, T=96, H=2, S=16))
POOLING = dict(shape=dict(tokens=65536, hidden=4096, seqs=64),
               quick=dict(tokens=200, hidden=48, seqs=5))
GLA = dict(shape=dict(B=4, T=4096, H=16, K=128), quick=dict(B=1, T=80, H=2, K=16),
           sliced=(1, 256, 32, ("query",), ("key", "value")))  # 80: a short last chunk of 64
CASES = [
    Case("chunk_local_cumsum", **CUMSUM, inputs=gates("g"),
         ours=lambda a: chunk_local_cumsum(a["g"], 64, impl="triton"),
         reference=lambda a: chunk_local_cumsum(a["g"], 64, impl="xla")),
    Case("chunk_global_cumsum", **CUMSUM, inputs=gates("s"),
         ours=lambda a: chunk_global_cumsum(a["s"], impl="triton"),
         reference=lambda a: chunk_global_cumsum(a["s"], impl="xla")),
    Case("mean_pooling packed", **POOLING, inputs=packed,
         ours=lambda a, cu: mean_pooling(a["x"], 32, cu, impl="triton"),
         reference=lambda a, cu: mean_pooling(a["x"], 32, cu, impl="xla")),
    Case("block_mean_pooling packed", **POOLING, inputs=packed,
         ours=functools.partial(block_means, "triton"),
         reference=functools.partial(block_means, "xla")),
    Case("recurrent g", **GLA, inputs=gla("g"),
         ours=lambda a: recurrent(**a, impl="triton")[0], reference=scan),
    Case("chunked_recurrent g", **GLA, inputs=gla("g"),
         ours=lambda a: chunked_recurrent(**a, impl="triton")[0], reference=scan),
    Case("chunked_recurrent gk", **GLA, inputs=gla("gk"),
         ours=lambda a: chunked_recurrent(**a, impl="triton")[0], reference=scan),
    # The default call: causal, the mask built inside, impl "auto" (the kernels, also in the
    # interpreter).
    Case("blocksparse_attention causal", shape=dict(B=4, H=16, T=8192, D=128),
         quick=dict(B=1, H=2, T=256, D=32), inputs=qkv,
         ours=lambda a: blocksparse_attention(a["query"], a["key"], a["value"]),
         reference=lambda a: attention.reference(a["query"], a["key"], a["value"], causal=True),
         sliced=(2, 1024, 64, ("query",), ())),
]


def label(shape: dict[str, int]) -> str:
    return " ".join(f"{k}{v}" for k, v in shape.items())


# ----------------------------------------------------------------------------------------------
# The child: one case and direction, in a fresh process.
# ----------------------------------------------------------------------------------------------


def widened(tree: Any) -> Any:
    return jax.tree.map(lambda a: a.astype(jnp.float32) if jnp.issubdtype(a.dtype, jnp.floating)
                        else a, tree)


def measure(case: Case, direction: str, quick: bool) -> dict[str, Any]:
    """The first and second call's times and the first call's errors (see the docstring)."""
    x, rest = case.inputs(case.quick if quick else case.shape)
    fwd, fwd_bwd = common.forward_and_backward(case.ours)
    d_o = None
    if direction == "fwd+bwd":  # the cotangent's shape from the reference: tracing ours here
        # would do part of the first call's work (and import jax-triton) before the clock starts
        d_o = normal(99, jax.eval_shape(case.reference, widened(x), *rest).shape)
    fn, args = (fwd, (x, *rest)) if direction == "fwd" else (fwd_bwd, (x, d_o, *rest))
    jax.block_until_ready(args)
    result, compiled, phases = common.first_call(fn, *args)
    start = time.perf_counter()
    jax.block_until_ready(compiled(*args))
    second_s = time.perf_counter() - start
    out, grads = result if direction == "fwd+bwd" else (result, None)
    with jax.default_matmul_precision("highest"):  # the reference's: not TF32 on a GPU
        errors, checked = check(case, direction, quick, x, rest, d_o, out, grads)
    failures = [line.strip() for line in common.past_tolerance(errors, DTYPE, "")]
    return {"first_s": sum(phases.values()), "second_s": second_s,
            "phases": {k: round(v, 3) for k, v in phases.items()}, "errors": errors,
            "checked": checked, "failures": failures}


def check(case: Case, direction: str, quick: bool, x: dict, rest: tuple, d_o: jax.Array | None,
          out: jax.Array, grads: dict | None) -> tuple[dict[str, float], str]:
    """Relative errors of the output (and gradients) against the float32 reference, and what
    was compared."""
    ref_fwd, ref_fwd_bwd = common.forward_and_backward(case.reference)
    if case.sliced is None:
        if grads is None:
            return {"out": common.relative_error(out, ref_fwd(widened(x), *rest))}, "whole"
        return common.compare(out, grads, *ref_fwd_bwd(widened(x), widened(d_o), *rest)), "whole"
    axis, tokens, quick_tokens, first, last = case.sliced
    n = quick_tokens if quick else tokens
    length = out.shape[axis]
    part = {"first": lambda a: jax.lax.slice_in_dim(a, 0, n, axis=axis),
            "last": lambda a: jax.lax.slice_in_dim(a, length - n, length, axis=axis)}
    if grads is None:
        ref = ref_fwd(widened(jax.tree.map(part["first"], x)))
        return ({"out": common.relative_error(part["first"](out), ref)},
                f"out on the first {n} tokens")
    errors = {}
    for where, names in (("first", ("out",) + first), ("last", last)):
        if names == ():
            continue
        ref_out, ref_grads = ref_fwd_bwd(widened(jax.tree.map(part[where], x)),
                                         widened(part[where](d_o)))
        if "out" in names:
            errors["out"] = common.relative_error(part[where](out), ref_out)
        errors |= {f"d{name}": common.relative_error(part[where](grads[name]), ref_grads[name])
                   for name in names if name != "out"}
    unchecked = [f"d{name}" for name in x if name not in first + last]
    return errors, (f"out, {', '.join('d' + n for n in first)} on the first {n} tokens"
                    + (f"; {', '.join('d' + n for n in last)} on the last {n}" if last else "")
                    + (f"; not {', '.join(unchecked)} (the whole sequence)" if unchecked else ""))


# ----------------------------------------------------------------------------------------------
# The parent: every case and direction, each in a child.
# ----------------------------------------------------------------------------------------------


def run_child(case: Case, direction: str, args: Any, run: common.Run) -> dict[str, Any] | None:
    """One child's row (None: not run, the budget was spent)."""
    what = f"{case.name} {direction}"
    if run.out_of_time(what):
        return None
    shape = case.quick if args.quick else case.shape
    env = {}
    if args.jobs > 1:  # several children on one GPU: each would take 75 % of it
        env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
    if args.quick:  # a CPU: XLA's LLVM optimisation of the mask builder takes 30-100 s
        env["XLA_FLAGS"] = (common.STARTING_ENV.get("XLA_FLAGS", "")
                            + " --xla_backend_optimization_level=0").strip()
    child = common.fresh_child(__file__, dict(case=case.name, direction=direction,
                                              quick=args.quick), args.case_timeout_s, env)
    found, error = child.result, child.error
    errors = found.get("errors", {})
    r = common.row(f"{case.name} {label(shape)}", "triton", direction, label(shape), "bfloat16",
                   rel_err=common.worst(errors, direction) if errors else None,
                   first_s=found.get("first_s"), second_s=found.get("second_s"),
                   phases=found.get("phases"), errors=errors, checked=found.get("checked"),
                   process_s=child.seconds, ok=error is None, error=error)
    if error:
        run.failures.append(f"{what}: {error}")
    summary = "" if r["first_s"] is None else (
        f"first {r['first_s']:6.2f} s ("
        + ", ".join(f"{k} {v:.2f}" for k, v in r["phases"].items())
        + f"), second {r['second_s']:.3f} s, rel err {r['rel_err']:.1e}")
    run.log(f"{what:38s} {summary}" + (f"  FAILED: {error[:300]}" if error else ""))
    return r


def main() -> int:
    if common.IS_CHILD:  # one case and direction, in a fresh process; the parent names the case
        return common.run_as_child(lambda case, direction, quick: measure(
            next(c for c in CASES if c.name == case), direction, quick))

    def extra(parser):
        parser.add_argument("--ops", help="comma-separated ops or case names (default: all), "
                                          "e.g. chunked_recurrent,mean_pooling")
        parser.add_argument("--budget-s", type=float, default=BUDGET_S,
                            help="seconds after which the cases left are not run (default "
                                 "%(default)s)")
        parser.add_argument("--case-timeout-s", type=float, default=CASE_TIMEOUT_S,
                            help="seconds a child may take (default %(default)s)")
        parser.add_argument("--jobs", type=int, default=1, help="children at once (default 1)")

    args = common.parse_args(__doc__.splitlines()[0], extra)
    wanted = args.ops.split(",") if args.ops else [c.name for c in CASES]
    unknown = [w for w in wanted if not any(w in (c.name, c.name.split()[0]) for c in CASES)]
    if unknown:
        sys.exit(f"--ops: no case {', '.join(unknown)} (the cases: "
                 f"{', '.join(c.name for c in CASES)}; an op name picks its cases)")
    cases = [c for c in CASES if c.name in wanted or c.name.split()[0] in wanted]
    run = common.Run(args.budget_s)
    rows: list[dict] = []

    def write() -> Path:
        return common.write_result(args.out, "first_call", dict(
            quick=args.quick, gpu=ejk_lite.ON_GPU, jobs=args.jobs,
            tolerance={"out": common.tolerance(DTYPE),
                       "gradient": common.tolerance(DTYPE, gradient=True)},
            failures=run.failures, passed=not run.failures,
            not_run=run.not_run, cases=rows,  # not "rows": no device time for the charts
            notes="Each (op, direction) in a fresh process: empty Triton cache, no JAX "
                  "compilation cache. first_s: wall time of the first call (trace, Triton's "
                  "compiles, XLA's compile, ptxas, autotuning, the run) until "
                  "block_until_ready, its phases in phases; second_s: the wall time of the "
                  "second call; process_s: the child's whole life (imports, inputs, the "
                  "reference). rel_err: the first call's result against the float32 reference, "
                  "the worst gradient for fwd+bwd (errors: each one; checked: on what). "
                  f"jobs: children at once (1: each alone). bf16 inputs."))

    with concurrent.futures.ThreadPoolExecutor(args.jobs) as pool:
        for r in pool.map(lambda job: run_child(*job, args, run),
                          [(c, d) for c in cases for d in DIRECTIONS]):
            if r is not None:
                rows.append(r)
                write()
    path = write()
    run.log(f"wrote {path}")
    common.print_table(rows, ["name", "direction", "first_s", "second_s", "rel_err", "ok"])
    run.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
