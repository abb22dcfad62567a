#!/usr/bin/env bash
# One device call: the public-API attention benchmark at H3 size (all int4, then an int8
# prefix), then a slice of `pytest -m gpu`. Everything lands under $OUT.
set -uo pipefail
export XLA_PYTHON_CLIENT_PREALLOCATE=false
dev=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | tr -cd 'A-Za-z0-9' | tr A-Z a-z)
mkdir -p "$OUT/logs"
nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv > "$OUT/logs/nvidia_smi_v7.txt"
( time python3 -m benchmarks.bench_attention --sweep 1 --varlen-segments 0 \
    --mgpu-variants deqwg2_bkv128_pk_nab --out "$OUT/attention_${dev}_v7.json" ) > "$OUT/logs/bench_attention_v7.log" 2>&1
( time python3 -m benchmarks.bench_attention --sweep 1 --varlen-segments 0 --prefix-tokens 4096 \
    --mgpu-variants deqwg2_bkv128_pk_nab --out "$OUT/attention_${dev}_v7_prefix4096.json" ) > "$OUT/logs/bench_attention_v7_prefix4096.log" 2>&1
log="$OUT/logs/pytest_gpu_v7_$(echo "$@" | sed 's/tests\/test_//g; s/\.py//g' | tr ' ' '-' | cut -c1-60).log"
echo "# $(head -2 "$OUT/logs/nvidia_smi_v7.txt" | tail -1); $(date -u +%F); python3 -m pytest -q -m gpu $*" > "$log"
( time timeout "${PYTEST_BUDGET:-330}" python3 -m pytest -q -m gpu "$@" ) >> "$log" 2>&1
tail -n 30 "$OUT"/logs/*.log
