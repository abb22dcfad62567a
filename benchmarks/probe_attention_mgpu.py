"""Probe the prototype Mosaic-GPU packed int4 attention (pallas_kernels/attention_mgpu.py).

On an H200 (one process, a few minutes):

  python3 -m benchmarks.probe_attention_mgpu --out $OUT/attention_mgpu_probe.json

1. lowers every variant for CUDA (records the error text if one does not lower);
2. checks every variant against ``packed_attention_reference(..., keep_rotated=True)``
   (float32) at B=1 H=2 T=1024 and B=2 H=3 T=4096 on fresh random inputs (rel L2,
   rel L1, cos); an exception is recorded with its traceback and the next variant runs;
3. times every variant that passed (cos > 0.999 at every check shape) at B=1 H=56
   D=128 T=152,320 (a multiple of 128 near MiniMax-H3's 152,263), next to jax cuDNN
   BF16 attention, our Pallas-Triton packed kernel (block_q=256, 16 warps, 1 stage)
   and jax's own Mosaic-GPU FA3 example kernel (f16: its SMEM scratch is f16);
   median of --repeats runs after --warmup, wall clock around block_until_ready;
4. prints a table and writes JSON (command, device, versions, all results).

  python3 -m benchmarks.probe_attention_mgpu --lower-only

runs only step 1 (works on a CPU-only jaxlib: it lowers for the "cuda" platform).
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import platform
import statistics
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import formats as fmt  # noqa: E402
from benchmarks.quality import quality  # noqa: E402
from benchmarks.run_info import package_versions  # noqa: E402
from pallas_kernels import attention_mgpu as amg  # noqa: E402

D = 128
CHECK_SHAPES = [(1, 2, 1024), (2, 3, 4096)]  # (B, H, T), Tq = T
COS_PASS = 0.999


def _ensure_device_info_for_cpu_lowering():
  """Some Mosaic-GPU code asks the default device for core_count / compute
  capability. On a CPU-only jaxlib, lowering for "cuda" then needs a stand-in."""
  if jax.default_backend() == "gpu":
    return
  import jax.extend.backend as jeb

  class _H100Like:
    core_count = 132
    compute_capability = "9.0"
    device_kind = "cpu stand-in for sm_90"

  jeb.get_default_device = lambda: _H100Like()


def _packed_specs(b, h, t):
  meta = fmt.PackedKVMeta(b, h, D, t, (0,) * (t // fmt.BLOCK))
  arrays = {n: jax.ShapeDtypeStruct(s, jnp.dtype(dt)) for n, (s, dt) in fmt.buffer_specs(meta).items()}
  return fmt.PackedKV(meta, arrays)


def lower_variant(variant, b, h, t):
  """Lower one variant for CUDA at (B, H, T); returns None or the error text."""
  packed = _packed_specs(b, h, t)
  q = jax.ShapeDtypeStruct((b, t, h, D), jnp.bfloat16)
  fn = jax.jit(lambda q, p: amg.packed_attention_mgpu(q, p, variant=variant))
  try:
    fn.trace(q, packed).lower(lowering_platforms=("cuda",))
    return None
  except Exception:  # noqa: BLE001
    return traceback.format_exc()[-6000:]


def make_check_inputs(b, h, t, seed):
  """DiT-ish random rotated q, packed K/V (via the float reference quantizer)."""
  kq, kk, ko, kv = jax.random.split(jax.random.key(seed), 4)
  q = (jax.random.normal(kq, (b, t, h, D), jnp.float32) * 1.5).astype(jnp.bfloat16)
  k = jax.random.normal(kk, (b, t, h, D), jnp.float32) + 0.5 * jax.random.normal(ko, (D,), jnp.float32)
  v = jax.random.normal(kv, (b, t, h, D), jnp.float32)
  meta = fmt.PackedKVMeta(b, h, D, t, (0,) * (t // fmt.BLOCK))
  packed = jax.jit(lambda k, v: fmt.quantize_reference(k, v, meta))(k, v)
  return q, packed


def make_bench_inputs(b, h, t, seed):
  """Cheap 152k inputs built on the device: random codes and scales (not a quantized
  tensor, but the same format, bytes and work); bf16 q/k/v for the baselines."""
  keys = jax.random.split(jax.random.key(seed), 10)
  nb = t // fmt.BLOCK
  meta = fmt.PackedKVMeta(b, h, D, t, (0,) * nb)
  specs = fmt.buffer_specs(meta)

  def build():
    arrays = {n: jnp.zeros(s, jnp.dtype(dt)) for n, (s, dt) in specs.items()}
    arrays["k_codes4"] = jax.random.bits(keys[0], specs["k_codes4"][0], jnp.uint8)
    arrays["v_codes4"] = jax.random.bits(keys[1], specs["v_codes4"][0], jnp.uint8)
    arrays["k_scale4"] = jax.random.uniform(keys[2], specs["k_scale4"][0], jnp.float32, 0.05, 0.3)
    arrays["k_zero4"] = jax.random.normal(keys[3], specs["k_zero4"][0], jnp.float32) - 1.0
    arrays["v_scale4"] = jax.random.uniform(keys[4], specs["v_scale4"][0], jnp.float32, 0.05, 0.3)
    arrays["v_zero4"] = jax.random.normal(keys[5], specs["v_zero4"][0], jnp.float32) - 1.0
    q = jax.random.normal(keys[6], (b, t, h, D), jnp.bfloat16)
    k = jax.random.normal(keys[7], (b, t, h, D), jnp.bfloat16)
    v = jax.random.normal(keys[8], (b, t, h, D), jnp.bfloat16)
    return q, k, v, arrays

  q, k, v, arrays = jax.jit(build)()
  packed = fmt.PackedKV(meta, arrays)
  jax.block_until_ready((q, k, v, packed.arrays))
  return q, k, v, packed


def _time(fn, warmup, repeats):
  for _ in range(warmup):
    jax.block_until_ready(fn())
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    jax.block_until_ready(fn())
    times.append(time.perf_counter() - t0)
  return statistics.median(times), times


def interpret_check(variants, b=1, h=2, t=256, tq=256):
  """Run each variant in Mosaic-GPU *interpret* mode on the CPU against the reference.

  Best effort, written against jax 0.10.2 internals: the interpreter cannot run
  ``plgpu.load`` with layouts, ``layout_cast``, ``run_state`` accumulators, register-A
  or transposed-B wgmma, so those are patched here (layouts are then not checked: the
  lowering step checks them). It does simulate the three warpgroups, TMA copies and
  mbarriers with real threads, so it catches wrong algebra, slot/phase bugs and
  deadlocks. The memory warpgroup not waiting on the last consumed-barrier phases is
  expected (same as jax's FA3 kernel); the interpreter's end-of-kernel check for that
  is relaxed. It does not model registers: a setmaxnreg split past the launch pool
  passes here and hangs on the GPU (MgpuConfig rejects it).
  """
  import inspect
  import textwrap
  from jax import lax
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu
  from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks as gcb
  from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call as ipc
  from jax._src.pallas.mosaic_gpu.interpret import params as ip
  from jax._src.pallas.mosaic_gpu.interpret import shared_memory as shm
  from jax._src.state import types as st
  from pallas_kernels.attention import packed_attention_reference

  plgpu.layout_cast = lambda x, layout: x
  plgpu.broadcasted_iota = lambda dt, shape, dim, layout=None: lax.broadcasted_iota(dt, shape, dim)
  amg._smem_load = lambda ref, idx, *, layout: ref[...]
  amg._accumulate = lambda body, acc: acc + pl.run_scoped(
      lambda r: (body(r), r[...])[1], plgpu.ACC(acc.shape, jnp.float32))
  src = inspect.getsource(gcb.wgmma)
  for old, new in [
      ("b_transforms = jax.tree.map(int, _remove_noop_transforms(b_transforms))",
       "b_transforms = jax.tree.map(int, _remove_noop_transforms(b_transforms))\n"
       "  _bt = any(isinstance(t, _TT) for t in b_transforms)\n"
       "  b_transforms = tuple(t for t in b_transforms if not isinstance(t, _TT))"),
      ("a_allocation_key = HostAllocationKey.from_array(a_allocation_key_as_array)",
       "_areg = np.ndim(a_allocation_key_as_array) == 2\n"
       "  a_allocation_key = None if _areg else HostAllocationKey.from_array(a_allocation_key_as_array)"),
      ("  a, _, _ = shared_memory.get_buffer_content(\n      a_allocation_key,",
       "  a = np.asarray(a_allocation_key_as_array) if _areg else None\n"
       "  if not _areg:\n    a, _, _ = shared_memory.get_buffer_content(\n      a_allocation_key,"),
      ("res = acc + np.matmul(a, b, dtype=acc_dtype)",
       "b = np.swapaxes(b, -1, -2) if _bt else b\n"
       "  res = acc + np.matmul(a.astype(np.float32), b.astype(np.float32)).astype(acc_dtype)")]:
    if old not in src:
      return {"error": f"interpreter source changed; cannot patch wgmma ({old[:40]}...)"}
    src = src.replace(old, new)
  ns = dict(gcb.__dict__, _TT=st.TransposeTransform)
  exec(textwrap.dedent(src), ns)
  gcb.wgmma = ns["wgmma"]

  def _dealloc(self):
    with self.cv:
      self.ref_count -= 1

  shm.Barrier.deallocate = _dealloc

  q, packed = make_check_inputs(b, h, t, 0)
  q = q[:, :tq]
  ref = np.asarray(packed_attention_reference(q, packed, keep_rotated=True), np.float32)
  results = {}
  for var in variants:
    t0 = time.time()
    try:
      with ip.force_gpu_interpret_mode(ip.InterpretGPUParams(num_cores_or_threads=3, detect_races=True)):
        out = np.asarray(amg.packed_attention_mgpu(q, packed, variant=var).astype(jnp.float32))
      results[var] = quality(out, ref) | {"races": bool(ipc.get_races().races_found),
                                          "seconds": time.time() - t0}
    except Exception:  # noqa: BLE001
      results[var] = {"error": _err(traceback.format_exc())}
      ipc.reset_gpu_interpret_mode_state()
    print(f"  interpret {var:12s}: {results[var]}", flush=True)
  return results


def _err(e_text):
  return e_text if len(e_text) < 6000 else "..." + e_text[-6000:]


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", default=None, help="JSON path (default benchmarks/results/attention_mgpu_probe.json)")
  # The default set fits one 10-minute device call; name others to compare them.
  ap.add_argument("--variants", default="bq128,vtile,vtile_bf16,vtile_bf16_nosched",
                  help="comma-separated names of VARIANTS or DIAGNOSTIC_VARIANTS")
  ap.add_argument("--lower-only", action="store_true", help="only lower every variant for CUDA (CPU is fine)")
  ap.add_argument("--tokens", type=int, default=152320, help="T of the timed shape (multiple of 128)")
  ap.add_argument("--heads", type=int, default=56)
  ap.add_argument("--warmup", type=int, default=1)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--seed", type=int, default=None, help="default: fresh random")
  ap.add_argument("--skip-baselines", action="store_true")
  ap.add_argument("--skip-triton", action="store_true", help="time cuDNN and the FA3 example but not our Triton kernel")
  ap.add_argument("--watchdog", type=float, default=150.0,
                  help="seconds one step (compile + run) may take before the process dumps its stacks and "
                       "exits (a hung kernel); the JSON's 'current' names the step")
  ap.add_argument("--interpret-check", action="store_true",
                  help="CPU only: run every variant in Mosaic-GPU interpret mode at a tiny shape (jax 0.10.2 internals)")
  args = ap.parse_args(argv)
  if args.out is None:
    args.out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "attention_mgpu_probe.json")
  seed = args.seed if args.seed is not None else int.from_bytes(os.urandom(4), "little") % (2**31)
  variants = [v for v in args.variants.split(",") if v]
  on_gpu = jax.default_backend() == "gpu"
  device = str(jax.devices()[0].device_kind) if on_gpu else (platform.processor() or "cpu")
  _ensure_device_info_for_cpu_lowering()
  b_t, h_t, t_t = 1, args.heads, args.tokens
  print(f"device={device} backend={jax.default_backend()} jax={jax.__version__} seed={seed}", flush=True)

  record = {
      "command": " ".join([os.path.basename(sys.executable), "-m", "benchmarks.probe_attention_mgpu",
                           *(argv if argv is not None else sys.argv[1:])]),
      "argv": list(sys.argv),
      "device": device, "backend": jax.default_backend(), "versions": package_versions(),
      "seed": seed, "check_shapes": [dict(B=b, H=h, T=t, Tq=t) for b, h, t in CHECK_SHAPES],
      "timed_shape": dict(B=b_t, H=h_t, T=t_t, Tq=t_t, D=D), "warmup": args.warmup, "repeats": args.repeats,
      "cos_pass": COS_PASS, "variants": {}, "baselines": {},
  }

  def save(current=None):
    record["current"] = current
    if current is not None and on_gpu:
      faulthandler.dump_traceback_later(args.watchdog, exit=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
      json.dump(record, f, indent=1)

  # 1. Lowering (all shapes used later; cheap).
  for var in variants:
    entry = record["variants"].setdefault(var, {})
    try:
      cfg = amg.make_config(variant=var)
      entry["config"] = {k: getattr(cfg, k) for k in cfg.__dataclass_fields__}
    except Exception:  # noqa: BLE001
      entry["config_error"] = _err(traceback.format_exc())
      continue
    lowered = {}
    for b, h, t in CHECK_SHAPES + [(b_t, h_t, t_t)]:
      err = lower_variant(var, b, h, t)
      lowered[f"B{b}_H{h}_T{t}"] = "ok" if err is None else err
    entry["lowering"] = lowered
    entry["lowers"] = all(v == "ok" for v in lowered.values())
    print(f"  lower {var:12s}: {'ok' if entry['lowers'] else 'FAILED'}", flush=True)
    if not entry["lowers"]:
      print(next(v for v in lowered.values() if v != "ok"), flush=True)
  save()
  if args.interpret_check:
    record["interpret_check"] = interpret_check(variants)
    save()
  if args.lower_only or args.interpret_check:
    print(f"\nwrote {args.out}")
    return
  if not on_gpu:
    sys.exit("no GPU visible to JAX: only --lower-only works here")

  from pallas_kernels.attention import packed_attention, packed_attention_reference

  # 2. Correctness at small shapes.
  for i, (b, h, t) in enumerate(CHECK_SHAPES):
    q, packed = make_check_inputs(b, h, t, seed + i)
    ref = np.asarray(packed_attention_reference(q, packed, keep_rotated=True), np.float32)
    key = f"B{b}_H{h}_T{t}"
    try:  # the Triton kernel on the same inputs, as a yardstick for the error level
      tri = np.asarray(packed_attention(q, packed, keep_rotated=True, backend="triton").astype(jnp.float32))
      record["baselines"].setdefault("triton_check", {})[key] = quality(tri, ref)
    except Exception:  # noqa: BLE001
      record["baselines"].setdefault("triton_check", {})[key] = {"error": _err(traceback.format_exc())}
    for var in variants:
      entry = record["variants"][var]
      checks = entry.setdefault("check", {})
      save(f"check {var} {key}")
      try:
        out = amg.packed_attention_mgpu(q, packed, variant=var)
        out = np.asarray(out.astype(jnp.float32))
        qual = quality(out, ref)
        qual["finite"] = bool(np.isfinite(out).all())
        checks[key] = qual
        print(f"  check {var:12s} {key}: cos={qual['cos']:.6f} rel_l2={qual['rel_l2']:.3e}", flush=True)
      except Exception:  # noqa: BLE001
        checks[key] = {"error": _err(traceback.format_exc())}
        print(f"  check {var:12s} {key}: ERROR\n{checks[key]['error'][-3000:]}", flush=True)
    del q, packed, ref
    save()
  for var in variants:
    entry = record["variants"][var]
    checks = entry.get("check", {})
    if var in amg.DIAGNOSTIC_VARIANTS:  # wrong by design: timed whenever it runs at all
      entry["diagnostic"] = "timing only; the output is wrong by design"
      entry["passed"] = bool(checks) and all("error" not in c for c in checks.values())
    else:
      entry["passed"] = bool(checks) and all(
          "error" not in c and c.get("finite") and c["cos"] > COS_PASS for c in checks.values())

  # 3. Timing at the H3-like shape.
  flops = 4.0 * b_t * h_t * t_t * t_t * D
  t0 = time.time()
  q, k, v, packed = make_bench_inputs(b_t, h_t, t_t, seed)
  print(f"bench inputs built in {time.time() - t0:.1f}s", flush=True)
  rows = []

  def timed(name, fn):
    save(f"time {name}")
    try:
      med, all_t = _time(fn, args.warmup, args.repeats)
      e = {"seconds": med, "all_seconds": all_t, "tflops": flops / med / 1e12}
    except Exception:  # noqa: BLE001
      e = {"error": _err(traceback.format_exc())}
      print(e["error"][-3000:], flush=True)
    rows.append((name, e))
    print(f"  time {name:44s}: {e.get('seconds', float('nan')):.4f}s", flush=True)
    return e

  if not args.skip_baselines:
    cud = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn"))
    record["baselines"]["cudnn_bf16"] = timed("jax cuDNN bf16", lambda: cud(q, k, v))
    if not args.skip_triton:
      record["baselines"]["triton_packed_int4"] = timed(
          "triton packed int4 (bq256 w16 s1)",
          lambda: packed_attention(q, packed, keep_rotated=True, block_q=256, num_warps=16, num_stages=1,
                                   backend="triton"))
    try:
      from jax.experimental.pallas.ops.gpu import attention_mgpu as jax_fa3
      cfg = jax_fa3.TuningConfig(block_q=64, block_kv=128, max_concurrent_steps=2)
      q16, k16, v16 = (x.astype(jnp.float16) for x in (q, k, v))
      e = timed("jax mosaic-gpu FA3 example (f16)", lambda: jax_fa3.attention(q16, k16, v16, config=cfg))
      # The same kernel at 64 keys per step, the step size of most of our variants.
      cfg64 = jax_fa3.TuningConfig(block_q=64, block_kv=64, max_concurrent_steps=2)
      record["baselines"]["jax_mgpu_fa3_f16_bkv64"] = timed(
          "jax mosaic-gpu FA3 example (f16, block_kv 64)",
          lambda: jax_fa3.attention(q16, k16, v16, config=cfg64))
      del q16, k16, v16
    except Exception:  # noqa: BLE001
      e = {"error": _err(traceback.format_exc())}
      rows.append(("jax mosaic-gpu FA3 example (f16)", e))
    record["baselines"]["jax_mgpu_fa3_f16"] = e
  k = v = None  # free the bf16 K/V before timing ours

  for var in variants:
    entry = record["variants"][var]
    if not entry.get("passed"):
      entry["timing"] = {"skipped": "did not pass the correctness check"}
      rows.append((f"mgpu {var}", {"error": "skipped (check failed)"}))
      continue
    entry["timing"] = timed(f"mgpu {var}", lambda var=var: amg.packed_attention_mgpu(q, packed, variant=var))

  # 4. Table.
  cudnn = record["baselines"].get("cudnn_bf16", {}).get("seconds")
  print(f"\n{'implementation':46s} {'seconds':>9s} {'TFLOP/s':>8s} {'x cuDNN':>8s}  check (worst cos)")
  for name, e in rows:
    s = e.get("seconds")
    ratio = s / cudnn if (s and cudnn) else None
    e["ratio_to_cudnn"] = ratio
    chk = ""
    if name.startswith("mgpu "):
      cs = record["variants"][name[5:]].get("check", {}).values()
      cos = [c["cos"] for c in cs if "cos" in c]
      chk = f"{min(cos):.6f}" if cos else "error"
    if s is None:
      print(f"{name:46s} {'error':>9s}  {str(e.get('error', ''))[-60:].strip()}")
    else:
      print(f"{name:46s} {s:9.4f} {e['tflops']:8.1f} {ratio if ratio else float('nan'):8.3f}  {chk}")
  for var in variants:
    entry = record["variants"][var]
    if not entry.get("passed"):
      print(f"  {var}: lowers={entry.get('lowers')} passed=False")
  faulthandler.cancel_dump_traceback_later()
  save()
  print(f"\nwrote {args.out}")


if __name__ == "__main__":
  main()
