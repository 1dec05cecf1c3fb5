#!/usr/bin/env bash
# The recorded GPU check in one call (at most 10 minutes), and the benchmarks, one call per op:
#
#   here, first:   .venv/bin/python bench/gpu_check.py prepare      # commit id + ejk_lite wheel
#                  bash ../shared/gpu/fetch_wheels.sh                # jax-triton, nbclient, ...
#   on the GPU:    bash bench/run_on_gpu.sh check --out $OUT         # -> $OUT/gpu_check.json
#                  bash bench/run_on_gpu.sh benches --out $OUT --only cumsum  # -> $OUT/bench/
#   here, after:   copy $OUT/gpu_check.json (and bench/<op>.json) into bench/results/
#
# The wheels in .whl/ (carried along: git ignores them) are installed beside the system packages,
# into /tmp/site, unless that was done already. Everything else is bench/gpu_check.py.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -d /tmp/site ] && compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl
fi
export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec python3 bench/gpu_check.py "$@"
