"""Benchmark the streamed QKV projection at MiniMax-H3 width against a plain BF16 GEMM.

GPU (H200):  python benchmarks/bench_streamed_qkv.py [--tokens 152263] [--configs 0,5]
CPU smoke:   python benchmarks/bench_streamed_qkv.py --tokens 300 --hidden 256 --heads 2
             --cpu-smoke   (interpret mode, under a minute)

Every measured configuration runs in a fresh subprocess, so that its
``peak_bytes_in_use`` belongs to it alone. A worker builds the inputs, runs the
kernel once (compile + run) and reads the peak, times the kernel, then times a
plain ``x @ W`` BF16 GEMM (cuBLAS through XLA) of the same shape in the same
process. The first worker also checks the kernel against
``streamed_qkv_reference`` on a head and a tail subset of rows (the reference on
all rows would build the very tensors the kernel avoids). One more worker measures
the BF16 GEMM's own peak memory, for contrast. The parent never touches the GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from benchmarks.run_info import package_versions  # noqa: E402

# Tuning variants of streamed_qkv. Shared memory per stage is (block_q + qh * D) *
# block_h * 2 B for Q (qh = q_heads_per_program) and (64 * nb + 2 * D) * block_h * 2 B
# for K/V (nb = kv_blocks_per_program); H200 allows 227 KiB per block, so
# block_h=128 needs K/V stages <= 2. Every entry spells out full_width_gemm, so the
# indices keep measuring the same thing when the defaults change. ptxas (sm_90,
# triton 3.6): 0-7 have no spill inside the GEMM loop (block_q=256 does, left out);
# full_width_gemm=True runs N=D dots, which needs 8 warps for that. 8-12 are the
# larger programs: kv_blocks_per_program=2 (two 64-token blocks share each W tile)
# has no spill in the loop at 8 warps; q_heads_per_program=2 (128 x 256 Q tile)
# spills inside the loop (~50 STL+LDL per step at 8 warps, ~30 at 16), so 10-12 are
# there to measure whether the better tile is still worth it.
CONFIGS = [
    dict(block_q=128, block_h=64, num_warps=(4, 8), num_stages=(3, 3),
         full_width_gemm=False),  # the defaults before full_width_gemm became one
    dict(block_q=128, block_h=64, num_warps=(8, 8), num_stages=(3, 3), full_width_gemm=False),
    dict(block_q=128, block_h=64, num_warps=(4, 8), num_stages=(4, 4), full_width_gemm=False),
    dict(block_q=128, block_h=128, num_warps=(8, 8), num_stages=(2, 2), full_width_gemm=False),
    dict(block_q=64, block_h=64, num_warps=(4, 8), num_stages=(4, 3), full_width_gemm=False),
    dict(block_q=128, block_h=64, num_warps=(8, 8), num_stages=(3, 3),
         full_width_gemm=True),  # the defaults
    dict(block_q=128, block_h=64, num_warps=(8, 8), num_stages=(4, 4), full_width_gemm=True),
    dict(block_q=128, block_h=128, num_warps=(8, 8), num_stages=(2, 2), full_width_gemm=True),
    dict(block_q=128, block_h=64, num_warps=(8, 8), num_stages=(3, 3), full_width_gemm=True,
         kv_blocks_per_program=2),
    dict(block_q=128, block_h=64, num_warps=(8, 8), num_stages=(3, 4), full_width_gemm=True,
         kv_blocks_per_program=2),
    dict(block_q=128, block_h=64, num_warps=(8, 8), num_stages=(3, 3), full_width_gemm=True,
         q_heads_per_program=2, kv_blocks_per_program=2),
    dict(block_q=128, block_h=64, num_warps=(16, 8), num_stages=(3, 3), full_width_gemm=True,
         q_heads_per_program=2, kv_blocks_per_program=2),
    dict(block_q=128, block_h=64, num_warps=(8, 8), num_stages=(4, 4), full_width_gemm=True,
         q_heads_per_program=2, kv_blocks_per_program=2),
]

GIB = 2.0 ** 30


# --------------------------------------------------------------------------------------
# Worker side (one process per measurement)
# --------------------------------------------------------------------------------------
def make_inputs(args):
  """H3-like inputs, built without big temporaries so the peak reading stays clean."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from benchmarks.quality import dit_grid
  from pallas_kernels import rope

  b, t, hidden, h, d = args.batch, args.tokens, args.hidden, args.heads, args.head_dim
  key = jax.random.PRNGKey(0)
  k1, k2, k3, k4 = jax.random.split(key, 4)
  # x = a 4096-row random base tiled over T, times a per-row gain: one fused XLA op
  # whose only large buffer is x itself.
  base = jax.random.normal(k1, (min(t, 4096), hidden), jnp.float32)
  gain = 1.0 + 0.25 * jax.random.normal(k2, (b, t, 1), jnp.float32)

  @jax.jit
  def build_x(base, gain):
    reps = -(-t // base.shape[0])
    rows = jnp.tile(base, (reps, 1))[:t]
    return (rows[None] * gain).astype(jnp.bfloat16)

  x = build_x(base, gain)
  w = (jax.random.normal(k3, (hidden, 3 * h * d), jnp.float32) / np.sqrt(hidden)).astype(
      jnp.bfloat16)
  rng = np.random.default_rng(0)
  pos = dit_grid(t, prefix_tokens=min(t // 20, 4096))
  angles = rope.rope_3d_angles(pos, freqs_per_axis=args.rot_dim // 6)
  cos, sin = rope.rope_tables(angles, d)
  kw = dict(q_norm_weight=jnp.asarray(1 + 0.1 * rng.normal(size=d), jnp.float32),
            k_norm_weight=jnp.asarray(1 + 0.1 * rng.normal(size=d), jnp.float32),
            rope_cos=jnp.asarray(cos), rope_sin=jnp.asarray(sin), rot_dim=args.rot_dim,
            heads=h, head_dim=d)
  del k4
  return x, w, kw


def block_classes(args):
  from formats import packed_kv as fmt
  t = args.tokens
  if args.policy == "int4":
    return fmt.resolve_block_classes(t)
  # Text prefix in bf16, reference frames in int8, generated video in int4.
  text, refs = max(t // 50, 1), max(t // 5, 2)
  return fmt.resolve_block_classes(t, [(0, text, "bf16"), (text, refs, "int8")])


def slice_packed(packed, b0, b1):
  """The blocks [b0, b1) of a PackedKV, as a PackedKV of their own (tests/bench only)."""
  from formats import packed_kv as fmt
  meta = packed.meta
  classes = meta.block_classes[b0:b1]
  t = min(meta.num_tokens, b1 * fmt.BLOCK) - b0 * fmt.BLOCK
  sub = fmt.PackedKVMeta(meta.batch, meta.heads, meta.head_dim, t, classes, meta.k_scheme,
                         meta.v_scheme, meta.rotation_seed_k, meta.rotation_seed_v)
  arrays = {}
  for cls in fmt.CLASSES:
    slots = meta.slots(cls)
    inside = [i for i, blk in enumerate(slots) if b0 <= blk < b1]
    s0, s1 = (inside[0], inside[-1] + 1) if inside else (0, 0)
    sfx = {"int4": "4", "int8": "8", "bf16": "_bf16"}[cls]
    for name in packed.arrays:
      if not name.endswith(sfx) or name in ("k_mean", "v_sum"):
        continue
      a = packed.arrays[name]
      scheme = meta.k_scheme if name[0] == "k" else meta.v_scheme
      if "codes" in name or cls == "bf16":
        arrays[name] = a[:, :, s0 * fmt.BLOCK:s1 * fmt.BLOCK]
      elif scheme == "channel":
        arrays[name] = a[:, :, s0:s1]
      else:
        arrays[name] = a[..., s0 * fmt.BLOCK:s1 * fmt.BLOCK]
  arrays["k_mean"] = packed.arrays["k_mean"][:, :, b0:b1]
  arrays["v_sum"] = packed.arrays["v_sum"][:, :, b0:b1]
  return fmt.PackedKV(sub, arrays)


def check_subsets(args, q, packed, x, w, kw, classes):
  """Kernel vs reference on a head and a tail row subset; returns metrics."""
  import jax
  import numpy as np

  from benchmarks.quality import cosine, rel_err
  from formats import packed_kv as fmt
  from pallas_kernels.streamed_qkv import reference_rotated_qkv, streamed_qkv_reference

  nb = packed.meta.num_blocks
  n = max(1, min(args.check_rows // fmt.BLOCK, nb))
  out = {}
  for name, (b0, b1) in (("head", (0, n)), ("tail", (max(0, nb - n), nb))):
    r0, r1 = b0 * fmt.BLOCK, min(args.tokens, b1 * fmt.BLOCK)
    sub_kw = dict(kw, rope_cos=kw["rope_cos"][r0:r1], rope_sin=kw["rope_sin"][r0:r1])
    xs = x[:, r0:r1]
    q_ref, ref = streamed_qkv_reference(xs, w, **sub_kw, block_classes=classes[b0:b1])
    got = slice_packed(packed, b0, b1)
    _, k32, v32 = reference_rotated_qkv(xs, w, None, **sub_kw)
    kd, vd = jax.jit(fmt.dequantize_reference)(got)
    kr, vr = jax.jit(fmt.dequantize_reference)(ref)
    qs = np.asarray(q[:, r0:r1], np.float32)
    qr = np.asarray(q_ref, np.float32)
    m = {"rows": [r0, r1], "q_rel_err": rel_err(qs, qr), "q_cos": cosine(qs, qr),
         "k_rel_err_vs_f32": rel_err(kd, k32), "k_ref_rel_err_vs_f32": rel_err(kr, k32),
         "v_rel_err_vs_f32": rel_err(vd, v32), "v_ref_rel_err_vs_f32": rel_err(vr, v32)}
    code_diff = []
    for arr_name in got.arrays:
      a, r = np.asarray(got.arrays[arr_name]), np.asarray(ref.arrays[arr_name])
      if a.size == 0:
        continue
      if "codes" in arr_name:
        if arr_name.endswith("4"):
          a, r = (np.concatenate([c & 15, c >> 4], -1) for c in (a, r))
        code_diff.append(np.abs(a.astype(np.int32) - r.astype(np.int32)))
      elif "bf16" not in arr_name:
        af, rf = a.astype(np.float64), r.astype(np.float64)
        m[f"{arr_name}_max_rel"] = float(np.abs(af - rf).max() / max(np.abs(rf).max(), 1e-30))
    if code_diff:
      flat = np.concatenate([c.ravel() for c in code_diff])
      m["codes_max_diff"] = int(flat.max())
      m["codes_diff_frac"] = float((flat != 0).mean())
    m["all_finite"] = bool(all(np.isfinite(np.asarray(a, np.float32)).all()
                               for a in got.arrays.values()) and np.isfinite(qs).all())
    m["ok"] = bool(m["q_rel_err"] < 1e-2 and m["q_cos"] > 0.9999 and m["all_finite"]
                   and m.get("codes_max_diff", 0) <= 1 and m.get("codes_diff_frac", 0) < 2e-3
                   and m["k_rel_err_vs_f32"] <= 1.02 * m["k_ref_rel_err_vs_f32"] + 1e-6
                   and m["v_rel_err_vs_f32"] <= 1.02 * m["v_ref_rel_err_vs_f32"] + 1e-6)
    out[name] = m
  return out


def _timed(fn, warmup, iters):
  """Median wall-clock seconds of fn() (which blocks until its result is ready)."""
  for _ in range(warmup):
    fn()
  times = []
  for _ in range(iters):
    t0 = time.perf_counter()
    fn()
    times.append(time.perf_counter() - t0)
  return statistics.median(times), times


def _mem(dev):
  stats = dev.memory_stats() or {}
  return stats.get("bytes_in_use"), stats.get("peak_bytes_in_use")


def worker(args):
  import jax
  import jax.numpy as jnp

  from pallas_kernels.streamed_qkv import streamed_qkv

  dev = jax.devices()[0]
  res = {"device": getattr(dev, "device_kind", str(dev)), "platform": dev.platform}
  x, w, kw = make_inputs(args)
  jax.block_until_ready((x, w, kw["rope_cos"]))
  in_use0, peak0 = _mem(dev)
  res.update(inputs_in_use=in_use0, peak_before=peak0)
  flops = 2.0 * args.batch * args.tokens * args.hidden * 3 * args.heads * args.head_dim

  if args.worker == "gemm":
    gemm = jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.bfloat16))
    out = jax.block_until_ready(gemm(x, w))
    _, peak1 = _mem(dev)
    res.update(peak=peak1, out_bytes=out.size * 2)
    print("RESULT " + json.dumps(res), flush=True)
    return

  cfg = json.loads(args.worker_config)
  cfg = {k: tuple(v) if isinstance(v, list) else v for k, v in cfg.items()}
  classes = block_classes(args)
  run = lambda: jax.block_until_ready(streamed_qkv(x, w, **kw, block_classes=classes, **cfg))
  t0 = time.perf_counter()
  q, packed = run()
  res["first_call_s"] = time.perf_counter() - t0
  _, peak1 = _mem(dev)
  res.update(peak=peak1, q_bytes=q.size * 2, packed_bytes=packed.nbytes(),
             packed_detail={k: int(v.size * v.dtype.itemsize) for k, v in packed.arrays.items()})
  # The peak reading belongs to the kernel only if building the inputs peaked lower.
  res["peak_is_kernel"] = bool(peak1 is not None and peak0 is not None and peak1 > peak0)
  # XLA's own accounting (an extra compile, so only in the checking worker).
  ma = None
  if args.check:
    ma = streamed_qkv.trace(x, w, **kw, block_classes=classes, **cfg).lower().compile()
    ma = ma.memory_analysis()
  if ma is not None:
    res["xla_memory_analysis"] = {k: int(getattr(ma, k)) for k in (
        "temp_size_in_bytes", "output_size_in_bytes", "argument_size_in_bytes",
        "alias_size_in_bytes") if hasattr(ma, k)}
  if args.check:
    res["check"] = check_subsets(args, q, packed, x, w, kw, classes)
  del q, packed

  def once():
    out = run()
    del out

  med, times = _timed(once, args.warmup, args.iters)
  res.update(kernel_s=med, kernel_times=times, kernel_tflops=flops / med / 1e12)
  gemm = jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.bfloat16))
  med, times = _timed(lambda: jax.block_until_ready(gemm(x, w)), max(args.warmup, 1), args.iters)
  res.update(gemm_s=med, gemm_times=times, gemm_tflops=flops / med / 1e12)
  print("RESULT " + json.dumps(res), flush=True)


# --------------------------------------------------------------------------------------
# Parent side
# --------------------------------------------------------------------------------------
def _spawn(args, extra, timeout):
  cmd = [sys.executable, os.path.abspath(__file__)] + _shape_argv(args) + extra
  env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
  if args.cpu_smoke:
    env["JAX_PLATFORMS"] = "cpu"
  t0 = time.perf_counter()
  try:
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
  except subprocess.TimeoutExpired:
    return {"error": f"timed out after {timeout} s"}
  for line in p.stdout.splitlines():
    if line.startswith("RESULT "):
      out = json.loads(line[len("RESULT "):])
      out["wall_s"] = time.perf_counter() - t0
      return out
  return {"error": f"exit {p.returncode}: " + (p.stderr or p.stdout)[-3000:]}


def _shape_argv(args):
  return ["--tokens", str(args.tokens), "--hidden", str(args.hidden), "--heads",
          str(args.heads), "--head-dim", str(args.head_dim), "--rot-dim", str(args.rot_dim),
          "--batch", str(args.batch), "--policy", args.policy, "--iters", str(args.iters),
          "--warmup", str(args.warmup), "--check-rows", str(args.check_rows)]


def _fmt_cfg(c):
  return (f"bq={c['block_q']} bh={c['block_h']} warps={tuple(c['num_warps'])} "
          f"stages={tuple(c['num_stages'])}" + (" full" if c.get("full_width_gemm") else "")
          + (f" qh={c['q_heads_per_program']}" if c.get("q_heads_per_program", 1) > 1 else "")
          + (f" kvb={c['kv_blocks_per_program']}" if c.get("kv_blocks_per_program", 1) > 1
             else ""))


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--tokens", type=int, default=152263)
  ap.add_argument("--hidden", type=int, default=5376)
  ap.add_argument("--heads", type=int, default=56)
  ap.add_argument("--head-dim", type=int, default=128)
  ap.add_argument("--rot-dim", type=int, default=96)
  ap.add_argument("--batch", type=int, default=1)
  ap.add_argument("--policy", choices=("int4", "mixed"), default="int4")
  ap.add_argument("--iters", type=int, default=5)
  ap.add_argument("--warmup", type=int, default=2)
  ap.add_argument("--check-rows", type=int, default=1024)
  ap.add_argument("--configs", default="all", help="'all' or comma-separated CONFIGS indices")
  ap.add_argument("--timeout", type=int, default=420, help="seconds per worker process")
  ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results",
                                                "streamed_qkv_h200.json"))
  ap.add_argument("--cpu-smoke", action="store_true",
                  help="interpret mode on CPU, two configs, one timed run each; JSON to the "
                       "temp dir unless --out is given")
  ap.add_argument("--worker", choices=("kernel", "gemm"), help=argparse.SUPPRESS)
  ap.add_argument("--worker-config", help=argparse.SUPPRESS)
  ap.add_argument("--check", action="store_true", help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.rot_dim % 6:
    ap.error("--rot-dim must be a multiple of 6 (3 RoPE axes, split-half)")
  if args.worker:
    return worker(args)

  if args.cpu_smoke:
    args.iters, args.warmup, args.check_rows = 1, 0, min(args.check_rows, 128)
    if args.out == ap.get_default("out"):
      # Smoke numbers are meaningless: keep them out of benchmarks/results.
      args.out = os.path.join(tempfile.gettempdir(), "streamed_qkv_cpu_smoke.json")
  if args.configs == "all":
    # The smoke run covers both GEMM variants, not the tile sweep.
    idx = [0, 5] if args.cpu_smoke else range(len(CONFIGS))
  else:
    idx = [int(i) for i in args.configs.split(",")]
  configs = [CONFIGS[i] for i in idx]

  b, t, hid, h, d = args.batch, args.tokens, args.hidden, args.heads, args.head_dim
  inputs = {"x": b * t * hid * 2, "w_qkv": hid * 3 * h * d * 2, "rope_tables": 2 * t * d * 4}
  print(f"streamed_qkv: B={b} T={t} hidden={hid} H={h} D={d} rot_dim={args.rot_dim} "
        f"policy={args.policy}")
  results = []
  for i, cfg in enumerate(configs):
    extra = ["--worker", "kernel", "--worker-config", json.dumps(cfg)]
    extra += ["--check"] if i == 0 else []
    r = _spawn(args, extra, args.timeout)
    r["config"] = cfg
    results.append(r)
    status = r.get("error", "")[:200] or f"{r['kernel_s'] * 1e3:.1f} ms"
    print(f"  [{i}] {_fmt_cfg(cfg)}: {status}", flush=True)
  gemm_mem = _spawn(args, ["--worker", "gemm"], args.timeout)

  ok = [r for r in results if "error" not in r]
  if ok:
    r0 = ok[0]
    expected = {"q": r0["q_bytes"], "packed_kv": r0["packed_bytes"]}
    print()
    print(f"{'config':49s} {'kernel ms':>9s} {'TFLOP/s':>8s} {'gemm ms':>8s} {'TFLOP/s':>8s} "
          f"{'ratio':>6s} {'peak-in GiB':>11s} {'overhead MiB':>12s}")
    for r in ok:
      above = (r["peak"] - r["inputs_in_use"]) if r.get("peak") is not None else None
      over = above - sum(expected.values()) if above is not None else None
      r["peak_above_inputs"], r["overhead_bytes"] = above, over
      print(f"{_fmt_cfg(r['config']):49s} {r['kernel_s'] * 1e3:9.2f} {r['kernel_tflops']:8.1f} "
            f"{r['gemm_s'] * 1e3:8.2f} {r['gemm_tflops']:8.1f} {r['kernel_s'] / r['gemm_s']:6.2f} "
            + (f"{above / GIB:11.3f} {over / 2 ** 20:12.1f}" if above is not None else
               f"{'n/a':>11s} {'n/a':>12s}"))
    print(f"expected above inputs: Q {expected['q'] / GIB:.3f} GiB + packed K/V "
          f"{expected['packed_kv'] / GIB:.3f} GiB (codes, scales, zeros, stats) = "
          f"{sum(expected.values()) / GIB:.3f} GiB; inputs {sum(inputs.values()) / GIB:.3f} GiB")
    xla = r0.get("xla_memory_analysis")
    if xla:
      print(f"XLA memory analysis of the kernel program: temp "
            f"{xla.get('temp_size_in_bytes', 0) / 2 ** 20:.1f} MiB, outputs "
            f"{xla.get('output_size_in_bytes', 0) / GIB:.3f} GiB")
    if gemm_mem.get("peak") is not None:
      print(f"plain BF16 x@W peak above inputs: "
            f"{(gemm_mem['peak'] - gemm_mem['inputs_in_use']) / GIB:.3f} GiB")
    for name, m in r0.get("check", {}).items():
      print(f"check {name} rows {m['rows']}: ok={m['ok']} q rel {m['q_rel_err']:.2e} "
            f"cos {m['q_cos']:.6f} codes diff frac {m.get('codes_diff_frac', 0):.1e} "
            f"K err {m['k_rel_err_vs_f32']:.4f} (ref {m['k_ref_rel_err_vs_f32']:.4f}) "
            f"V err {m['v_rel_err_vs_f32']:.4f} (ref {m['v_ref_rel_err_vs_f32']:.4f})")
  report = {
      "command": " ".join(shlex.quote(a) for a in [sys.executable] + sys.argv),
      "device": ok[0]["device"] if ok else None,
      "versions": package_versions(),
      "shape": {"batch": b, "tokens": t, "hidden": hid, "heads": h, "head_dim": d,
                "rot_dim": args.rot_dim, "policy": args.policy},
      "timing": {"iters": args.iters, "warmup": args.warmup, "stat": "median wall clock"},
      "input_bytes": inputs,
      "expected_output_bytes": expected if ok else None,
      "results": results,
      "gemm_memory": gemm_mem,
      "best": min(ok, key=lambda r: r["kernel_s"])["config"] if ok else None,
  }
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(report, f, indent=1)
  print(f"wrote {args.out}")
  checks = ok[0].get("check", {}) if ok else {}
  return 0 if ok and all(m["ok"] for m in checks.values()) else 1


if __name__ == "__main__":
  sys.exit(main())
