#!/usr/bin/env bash
# Everything the GPU machine checks, in one go: the unit tests through jax-triton, then each benchmark.
#   bash bench/run_on_gpu.sh OUT_DIR [test|bench|all] [op ...]
# Expects jax 0.11.2 + CUDA and triton 3.6.0. jax-triton 0.3.1 (and fla-core, the recurrent peer) may
# come as wheels in the folder $WHEELS, e.g. on a machine without internet:
#   pip download jax-triton==0.3.1 fla-core==0.6.0 --no-deps --only-binary=:all: --python-version 3.12 -d .whl
#   WHEELS=.whl bash bench/run_on_gpu.sh OUT_DIR
set -uo pipefail
out=${1:-bench/results}; what=${2:-all}; shift 2 2>/dev/null || true
ops=${*:-cumsum mean_pooling recurrent}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if [ -n "${WHEELS:-}" ]; then  # pure-Python wheels, installed beside (not into) the system packages
  python3 -m pip install -q --no-deps --target /tmp/ejk_site "$WHEELS"/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/ejk_site"
fi
status=0
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
if [ "$what" != bench ]; then
  python3 -m pytest -q -p no:cacheprovider tests -x 2>&1 | tee "$out/tests_gpu.log" | tail -25 || status=1
fi
if [ "$what" != test ]; then
  for op in $ops; do
    echo "== bench/$op.py"
    python3 "bench/$op.py" --out "$out" 2>&1 | grep -v -i "warning" | tee "$out/bench_$op.log" | tail -40 || status=1
  done
fi
exit $status
