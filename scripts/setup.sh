#!/usr/bin/env bash
# Creates .venv (Python 3.11) with the pinned runtime and test dependencies, once.
# torch==2.13.0 is the CPU wheel. On a CUDA machine test.sh and demo.sh use the python3
# that already has a CUDA jax and torch instead of this venv.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
if [ ! -x .venv/bin/python ] || ! .venv/bin/python -c "import jax, torch, pytest" 2>/dev/null; then
  "$PY" -m venv .venv
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q "jax[cpu]>=0.10.2,<0.13" "torch==2.13.0" numpy absl-py "pytest>=8" matplotlib
fi
