"""Where our Sol kernel's time goes (issue 37): the exact-block kernel alone (routing
given), per K/V storage class and launch configuration, next to cuDNN BF16 dense
attention on the same data, in one process.

  python -m benchmarks.profile_sol                  # T = 152,263, 56 heads, tau = 1
  python -m benchmarks.profile_sol --cpu-smoke      # tiny, interpret mode

Every class stores all blocks the same way (int4, int8 or bf16), so the difference
between rows is the decode in the inner loop: the bf16 row is the kernel with no
decode at all. Each row reports the kernel's time, its cost per exact block against
cuDNN's per block (``cost_vs_cudnn_per_block`` = kernel time / (cuDNN time x exact
fraction)), and the bytes of K/V it reads per exact block. Writes
``results/profile_sol_<card>_<date>.json``.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile

import jax
import jax.numpy as jnp
from jax import lax

from benchmarks import common
from benchmarks.bench_sol import H3, dit_qkv_device, routing_stats, timed
from formats import packed_kv as fmt


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--tokens", type=int, default=H3["tokens"])
  ap.add_argument("--heads", type=int, default=H3["heads"])
  ap.add_argument("--tau", type=float, default=1.0)
  ap.add_argument("--classes", default="int4,int8,bf16")
  ap.add_argument("--launch", default="4x2,4x3,8x2,8x3", help="num_warps x num_stages")
  ap.add_argument("--runs", type=int, default=2)
  ap.add_argument("--cpu-smoke", action="store_true")
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  if args.cpu_smoke:
    jax.config.update("jax_platforms", "cpu")
    args.tokens, args.heads, args.runs, args.launch = 700, 2, 1, "4x2"
  from pallas_kernels import Sol, sol

  t, h, d = args.tokens, args.heads, H3["head_dim"]
  prefix = t // 10
  nb = -(-t // fmt.BLOCK)
  on_gpu = jax.default_backend() == "gpu"
  q, k, v = dit_qkv_device(jax.random.key(0), t, h, d, prefix)
  rk, rv = (jnp.asarray(fmt.hadamard_rotation(d, s)) for s in (0, 1))
  rot = jax.jit(lambda x, r: jnp.einsum("bthd,de->bthe", x, r, precision=lax.Precision.HIGHEST))
  kr, vr = rot(k, rk), rot(v, rv)
  q_rot = rot(q, rk).astype(jnp.bfloat16)
  qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, k, v))
  del q, k, v
  rows = []
  record = common.run_record() | {"card": common.device_name(), "args": vars(args), "rows": rows}
  impl = "cudnn" if on_gpu else None
  dense = jax.jit(lambda a, b, c: jax.nn.dot_product_attention(a, b, c, implementation=impl))
  _, _, cudnn_s, _ = timed(dense, qb, kb, vb, runs=args.runs)
  record["cudnn_bf16_s"] = cudnn_s
  del qb, kb, vb
  print(f"{record['card']}: T={t} H={h} tau={args.tau}; cuDNN bf16 dense {cudnn_s * 1e3:.1f} ms", flush=True)
  setting = Sol(tau=args.tau, sink_blocks=(0, -(-prefix // fmt.BLOCK)), method="fused")
  routing = None
  for cls in args.classes.split(","):
    meta = fmt.PackedKVMeta(1, h, d, t, (fmt.CLASS_ID[cls],) * nb)
    packed = jax.jit(fmt.quantize_reference, static_argnums=2)(kr, vr, meta)
    if routing is None:  # the routing reads only the stats and q: one for every class
      routing = jax.jit(lambda a, p: sol.sol_routing(a, p, setting))(q_rot, packed)
      stats = routing_stats(routing, setting.sink_blocks, (0, 0), nb)
      record["routing"] = stats
      frac = stats["exact_block_fraction_mean"]
    kv_bytes_per_block = packed.nbytes() / (h * nb)
    for launch in args.launch.split(","):
      warps, stages = (int(x) for x in launch.split("x"))
      try:  # Sol(...) checks the launch: an unsupported one is reported like a failed compile
        cfg = dataclasses.replace(setting, num_warps=warps, num_stages=stages)
        kern = jax.jit(lambda a, p, r, c=cfg: sol.sol_attention(a, p, c, routing=r))
        _, first, med, times = timed(kern, q_rot, packed, routing, runs=args.runs)
      except Exception as e:  # noqa: BLE001 - a launch config may not compile
        rows.append(dict(cls=cls, warps=warps, stages=stages, error=str(e).splitlines()[0][:300]))
        print(f"{cls:5s} {warps}x{stages}: failed {rows[-1]['error'][:120]}", flush=True)
        continue
      row = dict(cls=cls, warps=warps, stages=stages, kernel_s=med, times_s=times, first_call_s=first,
                 exact_fraction=frac, cost_vs_cudnn_per_block=med / (cudnn_s * frac),
                 kv_bytes_per_block=kv_bytes_per_block,
                 exact_tflops=4.0 * t * t * h * d * frac / med / 1e12)
      rows.append(row)
      print(f"{cls:5s} {warps}x{stages}: {med * 1e3:8.1f} ms  {row['cost_vs_cudnn_per_block']:.2f}x cuDNN per "
            f"exact block  {row['exact_tflops']:.0f} TFLOP/s executed", flush=True)
    del packed
  out = args.out or (os.path.join(tempfile.gettempdir(), "profile_sol_smoke.json") if args.cpu_smoke
                     else common.result_path("profile_sol", record["card"]))
  common.write_json(out, record)
  ok = [r for r in rows if "kernel_s" in r]
  print(common.table(ok, [("class", "cls", "{}"), ("warps", "warps", "{}"), ("stages", "stages", "{}"),
                          ("kernel ms", "kernel_s", "{:.4f}"), ("x cuDNN/block", "cost_vs_cudnn_per_block", "{:.2f}"),
                          ("TFLOP/s", "exact_tflops", "{:.0f}")]), flush=True)
  return record


if __name__ == "__main__":
  main()
