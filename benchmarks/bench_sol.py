"""Sol attention at MiniMax-H3 shape: time, quality and routing bytes, against comfy-kitchen's
CUDA ``sol_attn`` (the peer, same bf16 q/k/v by DLPack, same settings), our dense packed
path and cuDNN BF16, in the same run. Writes ``results/sol_<card>_<date>.json`` and the
scorecard's ``sol.*`` (time ratio and cos difference against the peer per setting).

  python -m benchmarks.bench_sol                    # H200: B=1, H=56, D=128, T=152,263
  python -m benchmarks.bench_sol --cpu-smoke        # CPU, tiny, interpret mode (< 1 min)

Data is DiT-like (a jnp port of ``pallas_kernels.testing.dit_qkv``'s structure, generated on
the device: smooth fields over the (t, h, w) grid behind a conditioning prefix, QK
RMSNorm with outlier channels, per-channel key offsets, V outliers, 3D partial RoPE):
random data would make routing meaningless. K/V are packed by
``formats.quantize_reference`` (int4, the prefix in ``--prefix-class``). Quality compares
a fixed subset of query rows with float32 attention on the unquantized q, k, v. Every
variant sees the same inputs: cuDNN gets BF16 q/k/v, ours get rotated BF16 q and the
packed K/V. Sol is timed as routing alone, kernel alone (routing given) and both.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from pallas_kernels.testing import dit_grid, quality
from benchmarks.common import package_versions  # noqa: E402
from formats import packed_kv as fmt
from pallas_kernels import rope as rope_lib

H3 = dict(tokens=152_263, heads=56, head_dim=128)
# Sol settings timed by default. "prefix" in sink_blocks means the conditioning prefix's blocks.
# tau = 0 routes about half the blocks at this shape (CPU estimate), past the default
# list capacity, hence its own max_exact.
DEFAULT_CONFIGS = (
    {"tau": 1.0, "sink_blocks": "prefix"},
    {"tau": 0.0, "sink_blocks": "prefix", "max_exact": 2048},
    {"topk_ratio": 0.1, "sink_blocks": "prefix"},
)
# The settings comfy-kitchen's ``sol_attn`` takes (not our list capacity, method or launch).
PEER_KEYS = ("tau", "topk_ratio", "sink_blocks", "sink_q", "tail")


# --------------------------------------------------------------------------------------
# DiT-like data on the device
# --------------------------------------------------------------------------------------
def dit_qkv_device(key, tokens: int, heads: int, head_dim: int, prefix_tokens: int, rot_dim: int = 96,
                   outlier_channels: int = 4):
  """Post-norm, post-RoPE (1, T, H, D) float32 q, k, v, unrotated, built with jnp.

  Same recipe as ``quality.dit_qkv`` (which is numpy and too slow at 152k tokens);
  per-head work runs under ``lax.map`` so only one head's temporaries exist at once.
  """
  pos = dit_grid(tokens, prefix_tokens)
  cos, sin = rope_lib.rope_tables(rope_lib.rope_3d_angles(pos, freqs_per_axis=rot_dim // 6), head_dim)
  p = jnp.asarray(pos / np.maximum(pos.max(0, keepdims=True), 1), jnp.float32)
  is_prefix = jnp.arange(tokens) < prefix_tokens
  latent, waves = 32, 6

  def role(key, kind):
    kf, kp, km, kn, kpre, kh = jax.random.split(key, 6)
    freq = jax.random.normal(kf, (waves, 3)) * 2.5
    phase = jax.random.uniform(kp, (waves,)) * 2 * np.pi
    basis = jnp.sin(p @ freq.T * np.pi + phase)
    field = basis @ jax.random.normal(km, (waves, latent)) / np.sqrt(waves)
    field = field + 0.35 * jax.random.normal(kn, field.shape)
    field = jnp.where(is_prefix[:, None], 1.5 * jax.random.normal(kpre, field.shape), field)

    def head(k):
      kw, kx, ko, kg, ks, kb, ku = jax.random.split(k, 7)
      x = field @ (jax.random.normal(kw, (latent, head_dim)) / np.sqrt(latent))
      x = x + 0.25 * jax.random.normal(kx, x.shape)
      outlier = jnp.zeros((head_dim,), bool).at[jax.random.choice(ko, head_dim, (outlier_channels,),
                                                                  replace=False)].set(True)
      if kind == "v":
        return jnp.where(outlier[None], 6.0 * x, x)
      weight = 1.0 + 0.2 * jax.random.normal(kg, (head_dim,))
      weight = jnp.where(outlier, 4.0 * weight, weight)
      x = x * lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-5) * weight
      if kind == "k":
        offset = jax.random.normal(kb, (head_dim,)) * 1.5 * (jax.random.uniform(ku, (head_dim,)) < 0.25)
        x = x + offset
      return x
    x = lax.map(head, jax.random.split(kh, heads))            # (H, T, D)
    x = x.transpose(1, 0, 2)[None]                              # (1, T, H, D)
    if kind != "v":
      x = rope_lib.apply_rope_reference(x, jnp.asarray(cos), jnp.asarray(sin), rot_dim)
    return x

  role = jax.jit(role, static_argnums=1)
  kq, kk, kv = jax.random.split(key, 3)
  return role(kq, "q"), role(kk, "k"), role(kv, "v")


def reference_rows(q, k, v, rows, sm_scale):
  """float32 softmax attention of query rows ``rows`` over all keys: (R, H, D)."""
  def one_head(args):
    qh, kh, vh = args
    s = jnp.dot(qh, kh.T, precision=lax.Precision.HIGHEST) * sm_scale
    return jnp.dot(jax.nn.softmax(s, -1), vh, precision=lax.Precision.HIGHEST)
  qr = q[0, rows].transpose(1, 0, 2)
  out = lax.map(one_head, (qr, k[0].transpose(1, 0, 2), v[0].transpose(1, 0, 2)))
  return out.transpose(1, 0, 2)


# --------------------------------------------------------------------------------------
# Timing and reporting helpers
# --------------------------------------------------------------------------------------
def timed(fn, *args, runs: int):
  """(output, first-call seconds incl. compile, median seconds over ``runs``, all runs)."""
  t0 = time.perf_counter()
  out = jax.block_until_ready(fn(*args))
  first = time.perf_counter() - t0
  times = []
  for _ in range(runs):
    t0 = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - t0)
  return out, first, float(np.median(times)), times


def attention_tflops(tokens, heads, head_dim, seconds, fraction=1.0):
  return 4.0 * tokens * tokens * heads * head_dim * fraction / seconds / 1e12


def device_info():
  dev = jax.devices()[0]
  return {"platform": dev.platform, "device_kind": getattr(dev, "device_kind", str(dev)),
          "host": platform.machine()}


def routing_stats(routing, plan_sinks, sink_q, nb):
  """Exact-block fraction and list statistics of one routing."""
  counts = np.asarray(routing.counts)
  dropped = np.asarray(routing.dropped)
  s0, s1 = plan_sinks
  q0, q1 = sink_q
  qb = np.arange(nb)
  dense_row = (qb >= q0) & (qb < q1)
  # Listed blocks never include the sink range, so the exact count adds it back.
  exact = np.where(dense_row[None, None], nb, counts + (s1 - s0))
  return {"exact_block_fraction_mean": float(exact.mean() / nb), "exact_blocks_mean": float(exact.mean()),
          "listed_max": int(counts.max()), "listed_p99": float(np.percentile(counts, 99)),
          "capacity": int(routing.blocks.shape[-1]), "dropped_total": int(dropped.sum()),
          "rows_with_drops": float((dropped > 0).mean()), "routing_bytes": int(routing.nbytes())}


# --------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------
def comfy_peer(qb, kb, vb):
  """comfy-kitchen's CUDA ``sol_attn`` on the same bf16 q, k, v (zero-copy torch views),
  as ``fn(kwargs, runs) -> (out as a jax array, first, median, times)``; None when the
  package is missing. Its output comes back to JAX by DLPack for the same quality rows."""
  try:
    import torch
    import comfy_kitchen
  except ImportError:
    return None
  tq, tk, tv = (torch.from_dlpack(x) for x in (qb, kb, vb))

  def run(kw, runs):
    def call():
      return comfy_kitchen.sol_attn(tq, tk, tv, **kw)
    t0 = time.perf_counter()
    out = call()
    torch.cuda.synchronize()
    first = time.perf_counter() - t0
    times = []
    for _ in range(runs):
      del out
      t0 = time.perf_counter()
      out = call()
      torch.cuda.synchronize()
      times.append(time.perf_counter() - t0)
    return jnp.from_dlpack(out.contiguous()), first, float(np.median(times)), times
  return run


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--tokens", type=int, default=H3["tokens"])
  ap.add_argument("--heads", type=int, default=H3["heads"])
  ap.add_argument("--head-dim", type=int, default=H3["head_dim"])
  ap.add_argument("--prefix-tokens", type=int, default=None, help="conditioning prefix (default T/10)")
  ap.add_argument("--prefix-class", default="int8", choices=fmt.CLASSES)
  ap.add_argument("--runs", type=int, default=3)
  ap.add_argument("--quality-rows", type=int, default=512)
  ap.add_argument("--configs", default=None,
                  help="JSON list of pallas_kernels.Sol kwargs (sink_blocks may be \"prefix\")")
  ap.add_argument("--max-exact", type=int, default=None, help="routed-list capacity (default: Sol's)")
  ap.add_argument("--methods", default="fused,streamed,streamed_int8",
                  help="Sol methods timed for every setting (streamed*: head groups decoded first)")
  ap.add_argument("--launch", default="4x2",
                  help="warps x stages of the streamed methods' kernel, comma-separated (a sweep)")
  ap.add_argument("--skip-dense", action="store_true", help="skip our dense packed path")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--cpu-smoke", action="store_true", help="tiny shapes, interpret mode, CPU")
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  if args.cpu_smoke:
    jax.config.update("jax_platforms", "cpu")
    args.tokens, args.heads, args.runs = min(args.tokens, 700), min(args.heads, 2), 1
    args.quality_rows = min(args.quality_rows, 64)
  if args.out is None:
    # The smoke run checks the script, it measures nothing worth keeping in the repo.
    from benchmarks import common
    args.out = (os.path.join(tempfile.gettempdir(), "sol_cpu_smoke.json") if args.cpu_smoke
                else common.result_path("sol", common.device_name()))
  configs = json.loads(args.configs) if args.configs else list(DEFAULT_CONFIGS)
  if args.cpu_smoke and not args.configs:
    configs = configs[1:2]
  launches = [tuple(int(x) for x in l.split("x")) for l in args.launch.split(",")]
  configs = [dict(c) if m == "fused" else dict(c, method=m, num_warps=w, num_stages=st)
             for c in configs for m in args.methods.split(",")
             for w, st in (((4, 2),) if m == "fused" else launches)]

  # Imported after the platform choice so nothing touches a GPU in smoke mode.
  from pallas_kernels import Dense, Sol
  from pallas_kernels import attention as dense
  from pallas_kernels import sol

  t, h, d = args.tokens, args.heads, args.head_dim
  prefix = t // 10 if args.prefix_tokens is None else args.prefix_tokens
  prefix_blocks = -(-prefix // fmt.BLOCK)
  nb = -(-t // fmt.BLOCK)
  sm_scale = 1.0 / math.sqrt(d)
  on_gpu = jax.default_backend() == "gpu"
  record = {"command": " ".join([sys.executable, "-m", "benchmarks.bench_sol", *(argv or sys.argv[1:])]),
            "device": device_info(), "versions": package_versions(), "args": vars(args),
            "shape": {"batch": 1, "tokens": t, "heads": h, "head_dim": d, "prefix_tokens": prefix,
                      "num_blocks": nb},
            "results": {}}
  res = record["results"]
  print(f"device {record['device']}  T={t} H={h} D={d} prefix={prefix}", flush=True)

  t0 = time.perf_counter()
  q, k, v = dit_qkv_device(jax.random.key(args.seed), t, h, d, prefix)
  jax.block_until_ready((q, k, v))
  rows = np.sort(np.random.default_rng(args.seed).choice(t, size=min(args.quality_rows, t), replace=False))
  rows = jnp.asarray(rows, jnp.int32)
  ref = np.asarray(jax.jit(reference_rows)(q, k, v, rows, sm_scale))
  rk = jnp.asarray(fmt.hadamard_rotation(d, 0))
  rv = jnp.asarray(fmt.hadamard_rotation(d, 1))
  rot = jax.jit(lambda x, r: jnp.einsum("bthd,de->bthe", x, r, precision=lax.Precision.HIGHEST))
  classes = fmt.resolve_block_classes(t, [(0, prefix, args.prefix_class)] if prefix else [])
  meta = fmt.PackedKVMeta(1, h, d, t, classes)
  packed = jax.jit(fmt.quantize_reference, static_argnums=2)(rot(k, rk), rot(v, rv), meta)
  q_rot = rot(q, rk).astype(jnp.bfloat16)
  qb, kb, vb = (x.astype(jnp.bfloat16) for x in (q, k, v))
  del q, k, v
  jax.block_until_ready((packed, q_rot, qb, kb, vb))
  record["setup_s"] = time.perf_counter() - t0
  record["packed_bytes"] = packed.nbytes()
  pick = jax.jit(lambda o: o[0, rows].astype(jnp.float32))

  def report(name, out, first, med, times, fraction=1.0, extra=None):
    qual = quality(np.asarray(pick(out)), ref)
    entry = {"time_s": med, "times_s": times, "first_call_s": first,
             "tflops_dense_equivalent": attention_tflops(t, h, d, med), **qual, **(extra or {})}
    if fraction < 1.0:
      entry["tflops_executed"] = attention_tflops(t, h, d, med, fraction)
    res[name] = entry
    print(f"{name:48s} {med * 1e3:9.2f} ms  cos {qual['cos']:.6f}  rel_l1 {qual['rel_l1']:.4f}", flush=True)
    return entry

  impl = "cudnn" if on_gpu else None
  cudnn = jax.jit(lambda a, b, c: jax.nn.dot_product_attention(a, b, c, implementation=impl))
  out, first, med, times = timed(cudnn, qb, kb, vb, runs=args.runs)
  report("cudnn_bf16" if on_gpu else "xla_bf16", out, first, med, times)
  del out
  peer = comfy_peer(qb, kb, vb) if on_gpu else None   # the caller's bf16 q, k, v, shared by DLPack
  if peer is None:
    record["peer"] = "comfy-kitchen sol_attn not run (" + ("not importable" if on_gpu else "CPU") + ")"
  del qb, kb, vb

  dense_out = None
  if not args.skip_dense:
    dense_fn = jax.jit(lambda a, p: dense.packed_attention(a, p, Dense()))
    dense_out, first, med, times = timed(dense_fn, q_rot, packed, runs=args.runs)
    report("dense_packed", dense_out, first, med, times)
    dense_rows = np.asarray(pick(dense_out))
    del dense_out

  peer_runs = {}  # setting -> (the peer's median time, its cos)
  for cfg in configs:
    kw = dict(cfg)
    if kw.get("sink_blocks") == "prefix":
      kw["sink_blocks"] = [0, prefix_blocks]
    if args.max_exact is not None:
      kw.setdefault("max_exact", args.max_exact)
    name = "sol " + ",".join(f"{k}={v}" for k, v in kw.items())
    # A setting without a method is the fused kernel (the name then carries no method=).
    cfg_sol = Sol(**{"method": "fused", **kw})
    route = jax.jit(lambda a, p, c=cfg_sol: sol.sol_routing(a, p, c))
    routing, r_first, r_med, r_times = timed(route, q_rot, packed, runs=args.runs)
    sinks = tuple(min(x, nb) for x in cfg_sol.sink_blocks or (0, 0))
    stats = routing_stats(routing, sinks, tuple(min(x, nb) for x in cfg_sol.sink_q or (0, 0)), nb)
    stats["routing_time_s"] = r_med
    stats["routing_first_call_s"] = r_first
    stats["routing_nbytes_formula"] = sol.routing_nbytes(1, h, t, d, stats["capacity"])
    kern = jax.jit(lambda a, p, r, c=cfg_sol: sol.sol_attention(a, p, c, routing=r))
    out, k_first, k_med, k_times = timed(kern, q_rot, packed, routing, runs=args.runs)
    stats["kernel_time_s"] = k_med
    stats["kernel_first_call_s"] = k_first
    full = jax.jit(lambda a, p, c=cfg_sol: sol.sol_attention(a, p, c))
    out, first, med, times = timed(full, q_rot, packed, runs=args.runs)
    if not args.skip_dense:
      stats["vs_dense_packed"] = quality(np.asarray(pick(out)), dense_rows)
    ours = report(name, out, first, med, times, fraction=stats["exact_block_fraction_mean"], extra=stats)
    setting = tuple(sorted((k, str(v)) for k, v in kw.items() if k not in ("method", "num_warps", "num_stages")))
    if peer is not None and setting not in peer_runs:  # the peer once per setting
      p_kw = {k: v for k, v in kw.items() if k in PEER_KEYS}
      p_out, p_first, p_med, p_times = peer(p_kw, args.runs)
      peer_runs[setting] = (p_med, report("comfy " + name, p_out, p_first, p_med, p_times)["cos"])
      del p_out
    if setting in peer_runs:
      ours["vs_comfy_time"] = med / peer_runs[setting][0]
      ours["cos_minus_comfy"] = ours["cos"] - peer_runs[setting][1]
    print(f"{'':48s} routing {r_med * 1e3:.2f} ms, kernel {k_med * 1e3:.2f} ms, exact "
          f"{stats['exact_block_fraction_mean']:.3f}, listed max {stats['listed_max']}/{stats['capacity']}, "
          f"dropped {stats['dropped_total']}, routing bytes {stats['routing_bytes'] / 2**20:.1f} MiB", flush=True)
    del out, routing

  stats = jax.devices()[0].memory_stats() or {}
  record["peak_bytes_in_use"] = stats.get("peak_bytes_in_use")
  os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(record, f, indent=1)
  print(f"wrote {args.out}", flush=True)
  if peer is not None:
    from benchmarks import common
    keys = {"tau=1.0,sink_blocks": "tau1", "tau=0.0,sink_blocks": "tau0", "topk_ratio=0.1,sink_blocks": "topk01"}
    entries = {}
    for name, e in res.items():
      for pre, tag in keys.items():
        if name.startswith("sol " + pre) and "vs_comfy_time" in e and "method=" not in name:
          entries[f"sol.vs_comfy_{tag}"] = round(e["vs_comfy_time"], 3)
          entries[f"sol.cos_minus_comfy_{tag}"] = round(e["cos_minus_comfy"], 5)
    common.update_scorecard(entries, card=common.device_name(), source=args.out, command=record["command"])
  return record


if __name__ == "__main__":
  main()
