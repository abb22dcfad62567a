#!/usr/bin/env bash
# Creates .venv (Python 3.11) with the pinned runtime and test dependencies and installs
# this project into it (editable), once. torch==2.13.0 is the CPU wheel. On a CUDA machine
# test.sh and demo.sh use the python3 that already has a CUDA jax and torch instead.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
ready() {
  .venv/bin/python - <<'PY' 2>/dev/null
import os, sys
os.chdir("/")  # the project must import from anywhere, not only from its checkout
import jax, torch, pytest, matplotlib, comfy_kitchen, diffusers, pallas_kernels, torch_bridge, formats
PY
}
if [ -x .venv/bin/python ] && ready; then
  exit 0
fi
echo "setup: creating .venv with $PY and installing jax[cpu] (<0.13), torch 2.13.0 (CPU), numpy, absl-py,"
echo "setup: pytest, matplotlib, comfy-kitchen 0.2.40 (the peer the tests cross-check against) and diffusers"
echo "setup: 0.42.1 (its video transformers are what the drop-in processors are tested against)."
echo "setup: first run only; it downloads about 700 MB and takes a few minutes."
"$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "jax[cpu]>=0.10.2,<0.13" "torch==2.13.0" numpy absl-py "pytest>=8" matplotlib \
  "comfy-kitchen==0.2.40" "diffusers==0.42.1"
echo "setup: installing this project into .venv (editable: pip install -e .)"
.venv/bin/python -m pip install -q --no-deps -e .
ready || { echo "setup: .venv is incomplete; delete it and run again" >&2; exit 1; }
echo "setup: done"
