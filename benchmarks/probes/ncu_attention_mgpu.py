"""One launch of each Mosaic-GPU attention kernel, for Nsight Compute (GPU machine only).

  ncu --clock-control none --kernel-name regex:mosaic_gpu --launch-skip 2 --launch-count 2 --section WarpStateStats \
      --section SourceCounters -o /tmp/ncu python3 -m benchmarks.probes.ncu_attention_mgpu deqwg_magic_bf16,fa3_bkv64

Each name is a variant of ``pallas_kernels.attention_mgpu`` (diagnostics included) or
``fa3_bkv64`` / ``fa3_bkv128``: jax's FA3 example (f16) at 64 / 128 keys per step, the
skeleton without dequantization. One shape, B=1, H=2, T=32,768 (256 CTAs, two waves of
the H200's 132 SMs): small enough for ncu's replays, large enough for steady state.
Every kernel is first compiled and run once (N warm launches for N names), then run
once more in the same order, so ``--launch-skip N --launch-count N`` profiles the second
round (the script prints which launch is which).
"""
import sys

import jax
import jax.numpy as jnp

from benchmarks import probe_attention_mgpu as probe
from pallas_kernels import attention_mgpu as amg


def main(names, b=1, h=2, t=32768):
  q, k, v, packed = probe.make_bench_inputs(b, h, t, seed=0)
  q16, k16, v16 = (x.astype(jnp.float16) for x in (q, k, v))
  calls = []
  for name in names:
    if name.startswith("fa3_bkv"):
      from jax.experimental.pallas.ops.gpu import attention_mgpu as jax_fa3
      cfg = jax_fa3.TuningConfig(block_q=64, block_kv=int(name[len("fa3_bkv"):]), max_concurrent_steps=2)
      calls.append((name, lambda cfg=cfg: jax_fa3.attention(q16, k16, v16, config=cfg)))
    else:
      calls.append((name, lambda name=name: amg.packed_attention_mgpu(q, packed, variant=name)))
  for name, fn in calls:  # compile + warm (not profiled when --launch-skip counts these)
    jax.block_until_ready(fn())
  for i, (name, fn) in enumerate(calls):
    print(f"profiled launch {len(calls) + i}: {name}", flush=True)
    jax.block_until_ready(fn())


if __name__ == "__main__":
  main(sys.argv[1].split(","))
