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

``--streamed`` (default ``streamed,streamed_int8``) splits each streamed method (the
default K/V: int4 with the int8 prefix) into its two parts, each timed alone over all
heads at once: the decode (``kv_dequant``, ``layout="bhtd"``, the method's store) and
the loop over the decoded stores (``sol_decoded.sol_over_stores``), with the loop's
cost per exact block against cuDNN.
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
  ap.add_argument("--streamed", default="streamed,streamed_int8",
                  help="streamed methods to split into decode and loop ('' for none)")
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
  record["streamed_parts"] = streamed_parts(args, q_rot, kr, vr, setting, cudnn_s, on_gpu)
  out = args.out or (os.path.join(tempfile.gettempdir(), "profile_sol_smoke.json") if args.cpu_smoke
                     else common.result_path("profile_sol", record["card"]))
  common.write_json(out, record)
  ok = [r for r in rows if "kernel_s" in r]
  print(common.table(ok, [("class", "cls", "{}"), ("warps", "warps", "{}"), ("stages", "stages", "{}"),
                          ("kernel ms", "kernel_s", "{:.4f}"), ("x cuDNN/block", "cost_vs_cudnn_per_block", "{:.2f}"),
                          ("TFLOP/s", "exact_tflops", "{:.0f}")]), flush=True)
  return record


def streamed_parts(args, q_rot, kr, vr, setting, cudnn_s, on_gpu) -> list:
  """Decode and loop of each streamed method, timed apart (every head in one group)."""
  from pallas_kernels import sol, sol_decoded
  from pallas_kernels.kv_dequant import dequantize_group
  from pallas_kernels.sol_routing import make_plan
  b, t, h, d = q_rot.shape
  prefix_blocks = setting.sink_blocks[1]
  classes = fmt.resolve_block_classes(t, [(0, prefix_blocks * fmt.BLOCK, "int8")])
  packed = jax.jit(fmt.quantize_reference, static_argnums=2)(kr, vr, fmt.PackedKVMeta(1, h, d, t, classes))
  out = []
  for method in filter(None, args.streamed.split(",")):
    cfg_sol = dataclasses.replace(setting, method=method)
    qk = sol.STREAMED_QK[method]
    plan = make_plan(q_rot, packed, cfg_sol)
    routing = jax.jit(lambda a, p, c=cfg_sol: sol.sol_routing(a, p, c))(q_rot, packed)
    frac = routing_stats(routing, cfg_sol.sink_blocks, (0, 0), plan.num_blocks)["exact_block_fraction_mean"]
    store = "int8_k" if qk == "int8" else "bf16"
    decode = jax.jit(lambda p, kg: dequantize_group(p, 0, h, unrotate_v=True, interpret=not on_gpu, layout="bhtd",
                                                    store=store, center=kg if store == "int8_k" else None))
    stores, _, decode_s, _ = timed(decode, packed, routing.k_global, runs=args.runs)
    if qk == "int8":
      k, k_scale, v = stores
    else:
      (k, v), k_scale = stores, None
    r_v = jnp.asarray(fmt.hadamard_rotation(d, packed.meta.rotation_seed_v))
    v_sum = jnp.einsum("bhnd,ed->bhne", packed.v_sum.astype(jnp.float32), r_v)
    cfg = sol_decoded.LoopConfig.from_plan(plan, d, qk)
    loop = jax.jit(lambda q, k, ks, v, vs, r: sol_decoded.sol_over_stores(
        q, k, ks, v, vs, r.k_global, r.blocks, r.counts, r.centroid, r.k_mean, None, None, cfg,
        interpret=not on_gpu))
    _, _, loop_s, _ = timed(loop, q_rot, k, k_scale, v, v_sum, routing, runs=args.runs)
    row = dict(method=method, decode_s=decode_s, loop_s=loop_s, exact_fraction=frac,
               loop_cost_vs_cudnn_per_block=loop_s / (cudnn_s * frac), store_bytes=sum(
                   x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(stores)))
    out.append(row)
    print(f"{method:14s} decode {decode_s * 1e3:8.1f} ms  loop {loop_s * 1e3:8.1f} ms  "
          f"({row['loop_cost_vs_cudnn_per_block']:.2f}x cuDNN per exact block)", flush=True)
    del stores, k, v
  return out


if __name__ == "__main__":
  main()
