"""ptxas's register / spill report for Mosaic-GPU attention variants (GPU machine only).

  MOSAIC_GPU_DUMP_PTXAS=1 python3 -m benchmarks.ptxas_report vtile,deqwg_magic_bf16 [516]

compiles each named variant of ``pallas_kernels.attention_mgpu`` at a small shape
(B=1, H=1, T=512) and runs it once; Mosaic-GPU prints ptxas -v for each compile
(``results/logs/ptxas_*.log`` hold earlier outputs). A second argument Tq runs the
fast path's first pass (``_attention_call``) over q of that many rows instead: a Tq
that is not a multiple of 8 compiles the q-through-registers path.
"""
import functools
import sys

import jax
import jax.numpy as jnp

from benchmarks import probe_attention_mgpu as probe
from pallas_kernels import attention_mgpu as amg


def main(variants, tq=None):
  for var in variants:
    print(f"=== {var}" + (f" Tq={tq}" if tq else ""), flush=True)
    q, packed = probe.make_check_inputs(1, 1, 512, 0)
    if tq is None:
      jax.block_until_ready(amg.packed_attention_mgpu(q, packed, variant=var))
    else:
      q = jnp.pad(q, ((0, 0), (0, tq - q.shape[1]), (0, 0), (0, 0)))
      call = functools.partial(amg._attention_call, cfg=amg.make_config(variant=var), sm_scale=0.088,
                               save_lse=True)
      jax.block_until_ready(jax.jit(call)(q, *amg.int4_store_operands(packed)))
    print(f"=== done {var}", flush=True)


if __name__ == "__main__":
  main(sys.argv[1].split(","), int(sys.argv[2]) if len(sys.argv) > 2 else None)
