#!/usr/bin/env bash
# The plugin's tests, run for real on vLLM's CPU build: installs .venv-vllm (install-cpu.sh)
# unless it is there, then runs them. CI runs this after streamrl's own suite.
#   bash plugins/streamrl-vllm/test.sh [pytest args]
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
[ -x "$root/.venv-vllm/bin/python" ] || bash "$here/install-cpu.sh" "$root/.venv-vllm"
cd "$here" && "$root/.venv-vllm/bin/python" -m pytest "$@"
