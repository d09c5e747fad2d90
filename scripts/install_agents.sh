#!/usr/bin/env bash
# Install the coding-agent CLIs the agent_cli presets drive (Claude Code, Codex) at the versions
# WHALE's tests ran, into .agents/ (ignored by git). Idempotent: quick when they are there.
# Needs Node.js with npm (Node >= 18). Then put them on PATH:  export PATH="$PWD/.agents/node_modules/.bin:$PATH"
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! command -v npm >/dev/null 2>&1; then
  echo "warning: npm not found; the agent CLIs are not installed (their tests are skipped)" >&2
  exit 0
fi
# the pins live in one place: whale/harness/agent.py (PRESETS)
SPECS=$(PYTHONPATH=$PWD "$PY" -c "from whale.harness.agent import PRESETS; print(' '.join(p.npm for p in PRESETS.values()))")
npm install --prefix .agents --no-save --no-fund --no-audit --loglevel=error $SPECS
for exe in claude codex; do
  .agents/node_modules/.bin/$exe --version
done
