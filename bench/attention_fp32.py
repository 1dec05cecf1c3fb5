"""float32 block-sparse attention: cold start and warm time of each ``BlockSizes.float32_dot``.

float32 is what people try first, and with plain FMA dots (``"ieee"``) its first call was slow to
compile (an H100 user measured 22 s for the forward and 92 s for its gradient) and its warm time
far behind bfloat16. ``"tf32x3"`` (three TF32 tensor-core products) keeps float32 accuracy.
Each run is a fresh process (``common.fresh_child``: empty Triton cache, no JAX compilation
cache), and times:

* ``cold``: the first forward, then the first gradient (whose forward kernel is compiled
  already), and their sum: what a new user waits for. Each is split into its phases
  (``common.first_call``): ``lower`` (tracing, and Triton's compile of each new kernel to PTX),
  ``xla`` (XLA's compile) and ``first_run`` (ptxas turning each kernel's PTX into machine code,
  then the run);
* ``warm``: min / median / max device time of the forward and of the gradient (10 samples);
* the relative error of the output and of dq, dk, dv against the float64 reference; the run
  fails (exit 1) past float32's tolerance, 1e-5 (``ejk_lite.testing``, the tests' own);
* ``torch_imported``: whether the child had imported torch by its end (the device timer, through
  Triton's driver, imports it after the cold phases: the phases show the comparison).

The runs: each ``float32_dot`` with the shipped defaults, and two same-run comparisons for
``"tf32x3"``: ``torch_import`` lets Triton's specialiser import torch, as it did before
``launch._start_specializer_without_torch`` (torch is installed on the GPU machine);
``backward_64x64`` takes the backward tiles float32 had before 32 x 32.

    python bench/attention_fp32.py --out bench/results     # on a GPU; --quick: tiny, on a CPU
"""

from __future__ import annotations

import sys

FRESH_CHILDREN = True  # for common, imported next: this parent leaves the GPU to its children
import common  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import ejk_lite  # noqa: E402
from ejk_lite import BlockSizes, blocksparse_attention  # noqa: E402
from ejk_lite.attention import reference  # noqa: E402

#: (name, float32_dot, variant): see the module docstring.
RUNS = (("tf32x3", "tf32x3", "shipped"), ("tf32x3, torch_import", "tf32x3", "torch_import"),
        ("tf32x3, backward_64x64", "tf32x3", "backward_64x64"), ("ieee", "ieee", "shipped"))
SHAPE = dict(B=2, Hq=16, Hkv=4, T=2000, D=128)  # the shape of the user's report
QUICK = dict(B=1, Hq=2, Hkv=1, T=40, D=32)
TOLERANCE = {"forward": common.tolerance(jnp.float32),
             "gradient": common.tolerance(jnp.float32, gradient=True)}


def measure(setting: str, variant: str, shape: dict) -> dict:
    """In this (fresh) process: cold and warm times and errors of one ``float32_dot``."""
    if variant == "torch_import":
        import ejk_lite.launch

        ejk_lite.launch._start_specializer_without_torch = lambda: None
    B, Hq, Hkv, T, D = (shape[k] for k in ("B", "Hq", "Hkv", "T", "D"))
    fwd_blocks = BlockSizes.forward(D, jnp.float32)
    bwd_blocks = BlockSizes.backward(D, jnp.float32)
    if variant == "backward_64x64":
        bwd_blocks = BlockSizes(64, 64, num_warps=4, num_stages=1)
    fwd_blocks = BlockSizes(**{**fwd_blocks.__dict__, "float32_dot": setting})
    bwd_blocks = BlockSizes(**{**bwd_blocks.__dict__, "float32_dot": setting})
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((B, Hq, T, D)), jnp.float32)
    k, v = (jnp.asarray(rng.standard_normal((B, Hkv, T, D)), jnp.float32) for _ in range(2))
    w = jnp.asarray(rng.standard_normal((B, Hq, T, D)), jnp.float32)

    def attention(q, k, v):
        return blocksparse_attention(q, k, v, causal=True, impl="triton",
                                     fwd_blocks=fwd_blocks, bwd_blocks=bwd_blocks)

    forward = jax.jit(attention)
    gradient = jax.jit(jax.grad(lambda q, k, v: jnp.sum(w * attention(q, k, v)), (0, 1, 2)))
    cold, phases = {}, {}
    for name, fn in (("forward", forward), ("gradient", gradient)):
        _, _, seconds = common.first_call(fn, q, k, v)
        phases[name] = {phase: round(s, 2) for phase, s in seconds.items()}
        cold[f"{name}_s"] = round(sum(seconds.values()), 2)
    cold["forward_plus_gradient_s"] = round(cold["forward_s"] + cold["gradient_s"], 2)
    warm = {"forward": common.time_stats_ms(lambda: forward(q, k, v)),
            "gradient": common.time_stats_ms(lambda: gradient(q, k, v))}
    with jax.enable_x64(True):
        q64, k64, v64, w64 = (jnp.asarray(np.asarray(x), jnp.float64) for x in (q, k, v, w))
        ref = reference(q64, k64, v64, causal=True)
        ref_grads = jax.grad(lambda q, k, v: jnp.sum(w64 * reference(q, k, v, causal=True)),
                             (0, 1, 2))(q64, k64, v64)
    errors = {"forward": common.relative_error(forward(q, k, v), ref),
              "gradient": {n: common.relative_error(g, r) for n, g, r in
                           zip(("dq", "dk", "dv"), gradient(q, k, v), ref_grads)}}
    return {"float32_dot": setting, "variant": variant,
            "backward_blocks": {f: getattr(bwd_blocks, f) for f in
                                ("block_q", "block_kv", "num_warps", "num_stages")},
            "cold": cold, "cold_phases": phases, "warm": warm, "relative_error": errors,
            "torch_imported": "torch" in sys.modules}


def main() -> int:
    if common.IS_CHILD:  # one setting, in a fresh process
        return common.run_as_child(measure)
    args = common.parse_args(__doc__.splitlines()[0])
    shape = QUICK if args.quick else SHAPE
    runs, failed = [], []
    for name, setting, variant in RUNS:
        child = common.fresh_child(__file__, dict(setting=setting, variant=variant, shape=shape))
        if child.error:
            print(child.stderr[-3000:], file=sys.stderr)
            return 1
        run = {"name": name, **child.result}
        runs.append(run)
        errors = run["relative_error"]
        if errors["forward"] > TOLERANCE["forward"] or \
                max(errors["gradient"].values()) > TOLERANCE["gradient"]:
            failed.append(name)
        print(f"{name:23s} cold: forward {run['cold']['forward_s']:6.1f} s, gradient "
              f"{run['cold']['gradient_s']:6.1f} s | warm median: forward "
              f"{run['warm']['forward']['median_ms']:8.2f} ms, gradient "
              f"{run['warm']['gradient']['median_ms']:8.2f} ms | error: forward "
              f"{errors['forward']:.1e}, gradients {max(errors['gradient'].values()):.1e}")
    path = common.write_result(args.out, "attention_fp32", {
        "shape": {**shape, "dtype": "float32", "mask": "causal"},
        "gpu": ejk_lite.ON_GPU, "tolerance": TOLERANCE, "runs": runs})
    print(f"wrote {path}")
    if failed:
        print(f"relative error past the tolerance with {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
