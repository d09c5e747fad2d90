#!/usr/bin/env bash
# One weight step + one evaluation with the hf engine on CUDA (issue: weight phase GPU smoke).
# On the GPU machine, carry the wheels it lacks in .whl/ (pydantic, pydantic-core, typing-inspection,
# annotated-types), e.g. from here:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 --platform manylinux_2_17_x86_64 \
#       -d .whl pydantic pydantic-core typing-inspection annotated-types
set -euo pipefail
cd "$(dirname "$0")/.."
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/whale-site .whl/*.whl
  export PYTHONPATH=/tmp/whale-site${PYTHONPATH:+:$PYTHONPATH}
fi
export HF_HUB_OFFLINE=1 OMP_WAIT_POLICY=PASSIVE
timeout 300 python3 scripts/gpu_smoke.py --device "${1:-cuda}"
