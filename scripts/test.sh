#!/usr/bin/env bash
# The test suite: CPU, interpret mode, small shapes. On a GPU machine whose python3 has
# a CUDA jax (the H200 image), that python3 runs it; add `-m gpu` for the GPU tests.
set -euo pipefail
cd "$(dirname "$0")/.."
if python3 -c "import jax, torch, pytest, sys; sys.exit(jax.default_backend() != 'gpu')" 2>/dev/null; then
  exec python3 -m pytest -q "$@"
fi
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
