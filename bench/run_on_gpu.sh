#!/usr/bin/env bash
# The recorded GPU check, one stage per call (each fits the GPU machine's 10-minute limit):
#
#   here, first:      .venv/bin/python bench/gpu_check.py prepare      # commit id + ejk_lite wheel
#                     bash ../shared/gpu/fetch_wheels.sh                # jax-triton, fla-core, nbmake...
#   on the GPU:       bash bench/run_on_gpu.sh tests    --out $OUT
#                     bash bench/run_on_gpu.sh chapters --out $OUT
#                     bash bench/run_on_gpu.sh benches  --out $OUT [--only cumsum,mean_pooling]
#                     bash bench/run_on_gpu.sh fresh    --out $OUT      # last: it pip-installs
#   here, after:      .venv/bin/python bench/gpu_check.py merge <the fetched folders>
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
