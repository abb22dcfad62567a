#!/usr/bin/env bash
# The main job: one H3-style attention layer through the streamed projection, packed
# K/V and dense + Sol attention, against the BF16 pipeline. GPU if present, else small on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
if python3 -c "import jax; assert jax.default_backend() == 'gpu'" 2>/dev/null; then
  exec python3 -m benchmarks.demo "$@"
fi
bash scripts/setup.sh
exec .venv/bin/python -m benchmarks.demo "$@"
