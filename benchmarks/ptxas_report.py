"""ptxas's register / spill report for Mosaic-GPU attention variants (GPU machine only).

  MOSAIC_GPU_DUMP_PTXAS=1 python3 -m benchmarks.ptxas_report vtile,deqwg_magic_bf16

compiles each named variant of ``pallas_kernels.attention_mgpu`` at a small shape
(B=1, H=1, T=512) and runs it once; Mosaic-GPU prints ptxas -v for each compile
(``results/logs/ptxas_*.log`` hold earlier outputs).
"""
import sys

import jax

from benchmarks import probe_attention_mgpu as probe
from pallas_kernels import attention_mgpu as amg


def main(variants):
  for var in variants:
    print(f"=== {var}", flush=True)
    q, packed = probe.make_check_inputs(1, 1, 512, 0)
    jax.block_until_ready(amg.packed_attention_mgpu(q, packed, variant=var))
    print(f"=== done {var}", flush=True)


if __name__ == "__main__":
  main(sys.argv[1].split(","))
