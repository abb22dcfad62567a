#!/usr/bin/env bash
# The test suite: CPU, interpret mode, small shapes. On a GPU machine add `-m gpu`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
