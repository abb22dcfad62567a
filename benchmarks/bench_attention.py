"""Speed of dense packed-K/V attention vs cuDNN BF16 attention (jax and torch), one process.

  XLA_PYTHON_CLIENT_PREALLOCATE=false python -m benchmarks.bench_attention \\
      [--tokens 152263 --heads 56 --head-dim 128] [--out benchmarks/results/attention_h200.json]

On the GPU: checks the kernel against ``packed_attention_reference`` on a subset of
query rows, then times (median of --repeats after --warmup) a small sweep of
block_q / num_warps / num_stages and code-generation variants of our kernel
(INT4 K "channel" / V "token", the format defaults), jax cuDNN
``dot_product_attention`` and torch SDPA on the cuDNN backend on BF16 q/k/v, and
jax's own Pallas-Triton BF16 flash attention (keys padded to a multiple of 128).
Prints a table with ratios to cuDNN and writes JSON with the command, device and
versions.

  python -m benchmarks.bench_attention --tokens 256 --heads 2 --cpu-smoke

runs everything tiny in interpret mode on a CPU (torch cuDNN skipped).
"""
from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with torch

import argparse  # noqa: E402
import json  # noqa: E402
import platform  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import formats as fmt  # noqa: E402
from benchmarks.quality import quality  # noqa: E402
from benchmarks.run_info import package_versions  # noqa: E402
from pallas_kernels.attention import mgpu_unsupported_reason, packed_attention, packed_attention_reference  # noqa: E402

# (block_q, num_warps, num_stages, _tune); the first entry is packed_attention's
# default. Offline sm_90 compiles with triton 3.6 showed block_q=128 needs 8 warps (4
# spill ~1.3 KB) and block_q=256 spills at any warp count, yet 256/16/1 measured
# fastest on the H200 (3.24 s against 3.50 s for 128/8/3 at T = 152k).
# The first entry is packed_attention's default call: on an H200 that is the Hopper fast
# path (Mosaic-GPU for the full int4 blocks, Triton for the rest); the others force the
# Triton kernel alone (backend="triton").
SWEEP = [
    (256, None, None, {}, "auto"),
    (256, 16, 1, {}),
    (128, 8, 3, {}),
    (128, 8, 2, {}),
    (128, 8, 1, {}),
    (64, 4, 2, {}),
    (64, 4, 1, {}),
    (64, 8, 2, {}),
    (128, 8, 2, {"k_math": "bf16"}),
    (128, 8, 2, {"convert": "cast", "k_math": "f32", "v_exact": False}),
]


def _time(fn, warmup, repeats, sync):
  """Median wall seconds of fn() over repeats after warmup calls."""
  for _ in range(warmup):
    sync(fn())
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    sync(fn())
    times.append(time.perf_counter() - t0)
  return statistics.median(times), times


def _versions():
  v = package_versions()
  try:
    import torch
    v["torch_cuda"] = torch.version.cuda
    v["cudnn_torch"] = torch.backends.cudnn.version() if torch.cuda.is_available() else None
  except Exception:  # noqa: BLE001
    pass
  return v


def _make_inputs(b, t, h, d, seed, prefix_tokens=0):
  """Random rotated bf16 q and PackedKV (INT4, format-default schemes), built on the
  device; also returns bf16 k, v for the cuDNN baselines."""
  kq, kk, kv, ko = jax.random.split(jax.random.key(seed), 4)
  q = jax.random.normal(kq, (b, t, h, d), jnp.bfloat16)
  k = (jax.random.normal(kk, (b, t, h, d), jnp.float32)
       + jax.random.normal(ko, (d,), jnp.float32)).astype(jnp.bfloat16)  # DiT-like channel offsets
  v = jax.random.normal(kv, (b, t, h, d), jnp.bfloat16)
  ranges = [(0, prefix_tokens, "int8")] if prefix_tokens else []
  meta = fmt.PackedKVMeta(b, h, d, t, fmt.resolve_block_classes(t, ranges))
  quant = jax.jit(lambda k, v: fmt.quantize_reference(k, v, meta))
  packed = quant(k, v)  # the arrays are the format; k, v stay only for the baselines
  jax.block_until_ready(packed.arrays)
  return q, k, v, packed


def _reference_rows(q_sub, packed, q_seg=None, kv_seg=None, chunk=32):
  """packed_attention_reference on q_sub's rows, in chunks: at H3 size one 256-row float32
  score tensor is 8.7 GB, more than an H100 has left beside the inputs."""
  out = []
  for i in range(0, q_sub.shape[1], chunk):
    seg = None if q_seg is None else q_seg[i:i + chunk]
    out.append(np.asarray(packed_attention_reference(q_sub[:, i:i + chunk], packed, q_segment_ids=seg,
                                                     kv_segment_ids=kv_seg)))
  return np.concatenate(out, axis=1)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--tokens", type=int, default=152263)
  ap.add_argument("--heads", type=int, default=56)
  ap.add_argument("--head-dim", type=int, default=128)
  ap.add_argument("--batch", type=int, default=1)
  ap.add_argument("--warmup", type=int, default=1)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--check-rows", type=int, default=256, help="query rows checked against the reference")
  ap.add_argument("--sweep", type=int, default=len(SWEEP), help="how many SWEEP entries to time")
  ap.add_argument("--varlen-segments", type=int, default=8,
                  help="also time a packed batch of this many equal segments (<= 1: skip)")
  ap.add_argument("--seed", type=int, default=0)
  ap.add_argument("--prefix-tokens", type=int, default=0,
                  help="a conditioning prefix of this many tokens kept at int8 (H3's text/refs/audio)")
  ap.add_argument("--mgpu-variants", default="",
                  help="comma-separated attention_mgpu.VARIANTS names: also time packed_attention's fast "
                       "path with each (_mgpu_variant), after the sweep")
  ap.add_argument("--cpu-smoke", action="store_true", help="tiny interpret-mode run on a CPU")
  ap.add_argument("--out", default=None,
                  help="default benchmarks/results/attention_h200.json (attention_cpu_smoke.json with --cpu-smoke)")
  args = ap.parse_args(argv)
  from pallas_kernels.attention_mgpu import DEFAULT_VARIANT, VARIANTS
  variants = [v for v in args.mgpu_variants.split(",") if v]
  unknown = [v for v in variants if v not in VARIANTS]
  if unknown:
    sys.exit(f"unknown --mgpu-variants {unknown}; use names from attention_mgpu.VARIANTS")
  if args.out is None:
    name = "attention_cpu_smoke.json" if args.cpu_smoke else "attention_h200.json"
    args.out = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", name)
  b, t, h, d = args.batch, args.tokens, args.heads, args.head_dim
  on_gpu = jax.default_backend() == "gpu"
  if not on_gpu and not args.cpu_smoke:
    sys.exit("no GPU visible to JAX: pass --cpu-smoke for a tiny interpret-mode run")
  interpret = not on_gpu
  flops = 4.0 * b * h * t * t * d
  sync = jax.block_until_ready
  device = str(jax.devices()[0].device_kind) if on_gpu else platform.processor() or "cpu"
  print(f"device={device} B={b} T={t} H={h} D={d} interpret={interpret}", flush=True)

  t0 = time.time()
  q, k, v, packed = _make_inputs(b, t, h, d, args.seed, args.prefix_tokens)
  class_counts = {c: len(packed.meta.slots(c)) for c in fmt.CLASSES}
  print(f"inputs built in {time.time() - t0:.1f}s; packed K/V {packed.nbytes() / 2**30:.3f} GiB "
        f"vs bf16 K+V {2 * k.nbytes / 2**30:.3f} GiB", flush=True)

  # Correctness on a row subset: the reference dequantizes all of K/V (f32), which
  # is fine for a check, never for the timed path.
  rows = np.unique(np.linspace(0, t - 1, min(args.check_rows, t)).astype(np.int32))
  q_sub = q[:, rows]
  ref = _reference_rows(q_sub, packed)
  check = {}
  results = []
  configs = list(SWEEP[: args.sweep]) + [(256, None, None, {}, "auto", v) for v in variants]
  for block_q, warps, stages, tune, *backend in configs:
    backend, variant = (backend + [None])[:2] if backend else ("triton", None)
    if backend == "auto":
      name = f"packed backend=auto, variant {variant}" if variant else "packed default (backend=auto)"
    else:
      name = f"packed triton bq={block_q} w={warps} s={stages}" + (f" {tune}" if tune else "")
    kw = dict(block_q=block_q, num_warps=warps, num_stages=stages, interpret=interpret, _tune=tune or None,
              backend=backend, _mgpu_variant=variant)
    entry = {"impl": "packed_attention", "backend": backend, "block_q": block_q, "num_warps": warps,
             "num_stages": stages, "tune": tune, "classes": class_counts}
    if backend == "auto":
      entry["mgpu_variant"] = variant or DEFAULT_VARIANT
      entry["fast_path"] = mgpu_unsupported_reason(q, packed, interpret=interpret, variant=variant) or "used"
    try:
      out_sub = np.asarray(packed_attention(q_sub, packed, **kw), np.float32)
      entry["check_vs_reference"] = quality(out_sub, ref)
      fn = lambda kw=kw: packed_attention(q, packed, **kw)
      med, all_t = _time(fn, args.warmup, args.repeats, sync)
      entry |= {"seconds": med, "all_seconds": all_t, "tflops": flops / med / 1e12}
      if not check:
        check = entry["check_vs_reference"]
    except Exception as e:  # noqa: BLE001 -- keep the sweep going, record why
      entry["error"] = f"{type(e).__name__}: {e}"[:2000]
      traceback.print_exc()
    results.append((name, entry))
    print(f"  {name}: {entry.get('seconds', float('nan')):.4f}s "
          f"check rel_l2={entry.get('check_vs_reference', {}).get('rel_l2', float('nan')):.2e}", flush=True)

  # Packed varlen batch: N equal segments (cu_seqlens). The kernel visits only the
  # key blocks that can meet each q tile's segments, so the ideal is the dense
  # time / N (plus the blocks straddling segment borders).
  if args.varlen_segments > 1:
    from pallas_kernels.attention import segment_ids_from_cu_seqlens
    n_seg = args.varlen_segments
    seg = segment_ids_from_cu_seqlens(np.linspace(0, t, n_seg + 1).astype(np.int32), t)
    name = f"packed_int4 default, {n_seg} segments (varlen)"
    entry = {"impl": "packed_attention_int4 varlen", "segments": n_seg}
    try:
      kw = dict(q_segment_ids=seg, kv_segment_ids=seg, interpret=interpret)
      out_sub = np.asarray(packed_attention(q_sub, packed, q_segment_ids=seg[rows], kv_segment_ids=seg,
                                            interpret=interpret), np.float32)
      entry["check_vs_reference"] = quality(out_sub, _reference_rows(q_sub, packed, seg[rows], seg))
      med, all_t = _time(lambda: packed_attention(q, packed, **kw), args.warmup, args.repeats, sync)
      dense = results[0][1].get("seconds") if results else None
      entry |= {"seconds": med, "all_seconds": all_t, "tflops": flops / n_seg / med / 1e12,
                "dense_default_seconds": dense, "speedup_vs_dense": dense / med if dense else None}
    except Exception as e:  # noqa: BLE001
      entry["error"] = f"{type(e).__name__}: {e}"[:2000]
      traceback.print_exc()
    results.append((name, entry))
    print(f"  {name}: {entry.get('seconds', float('nan')):.4f}s "
          f"(x{entry.get('speedup_vs_dense') or float('nan'):.2f} vs dense)", flush=True)

  # jax cuDNN (or XLA on CPU) on bf16 q/k/v.
  impl = "cudnn" if on_gpu else "xla"
  entry = {"impl": f"jax.nn.dot_product_attention[{impl}] bf16"}
  try:
    jfn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation=impl))
    med, all_t = _time(lambda: jfn(q, k, v), args.warmup, args.repeats, sync)
    entry |= {"seconds": med, "all_seconds": all_t, "tflops": flops / med / 1e12}
  except Exception as e:  # noqa: BLE001
    entry["error"] = f"{type(e).__name__}: {e}"[:2000]
    traceback.print_exc()
  results.append((f"jax dot_product_attention {impl}", entry))
  print(f"  jax {impl}: {entry.get('seconds', float('nan')):.4f}s", flush=True)

  # jax's Pallas-Triton BF16 flash attention: the ceiling for a Triton kernel here.
  if on_gpu:
    from jax.experimental.pallas.ops.gpu import attention as pallas_mha
    t_pad = -(-t // 128) * 128
    entry = {"impl": "jax pallas-triton mha bf16 (example kernel)", "keys_padded_to": t_pad}
    try:
      pad = lambda x: jnp.pad(x, ((0, 0), (0, t_pad - t), (0, 0), (0, 0)))
      qp, kp, vp = pad(q), pad(k), pad(v)
      mfn = jax.jit(lambda q, k, v: pallas_mha.mha(q, k, v, None, sm_scale=d ** -0.5))
      med, all_t = _time(lambda: mfn(qp, kp, vp), args.warmup, args.repeats, sync)
      entry |= {"seconds": med, "all_seconds": all_t, "tflops": 4.0 * b * h * t_pad * t_pad * d / med / 1e12}
      del qp, kp, vp
    except Exception as e:  # noqa: BLE001
      entry["error"] = f"{type(e).__name__}: {e}"[:2000]
      traceback.print_exc()
    results.append(("jax pallas-triton mha bf16", entry))
    print(f"  pallas mha bf16: {entry.get('seconds', float('nan')):.4f}s", flush=True)

  # torch SDPA on the cuDNN backend on the same bf16 data.
  if on_gpu:
    entry = {"impl": "torch sdpa cudnn bf16"}
    try:
      import torch
      from torch.nn.attention import SDPBackend, sdpa_kernel
      # (B, H, T, D) contiguous, SDPA's usual layout (DLPack import is zero-copy).
      tq, tk, tv = (torch.from_dlpack(x).permute(0, 2, 1, 3).contiguous() for x in (q, k, v))
      with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        tfn = lambda: torch.nn.functional.scaled_dot_product_attention(tq, tk, tv)
        med, all_t = _time(tfn, args.warmup, args.repeats, lambda _: torch.cuda.synchronize())
      entry |= {"seconds": med, "all_seconds": all_t, "tflops": flops / med / 1e12}
    except Exception as e:  # noqa: BLE001
      entry["error"] = f"{type(e).__name__}: {e}"[:2000]
      traceback.print_exc()
    results.append(("torch sdpa cudnn", entry))
    print(f"  torch cudnn: {entry.get('seconds', float('nan')):.4f}s", flush=True)

  base = {n: e.get("seconds") for n, e in results}
  cudnn = base.get("jax dot_product_attention cudnn") or base.get("torch sdpa cudnn") or \
      base.get("jax dot_product_attention xla")
  print(f"\n{'implementation':62s} {'seconds':>9s} {'TFLOP/s':>8s} {'x cuDNN(jax)':>12s}")
  for name, e in results:
    s = e.get("seconds")
    ratio = s / cudnn if (s and cudnn) else None
    e["ratio_to_jax_cudnn"] = ratio
    if s is None:
      print(f"{name:62s} {'error':>9s}  {e.get('error', '')[:60]}")
    else:
      print(f"{name:62s} {s:9.4f} {e['tflops']:8.1f} {ratio if ratio else float('nan'):12.3f}")
  best = min((e for n, e in results if e["impl"] == "packed_attention" and "seconds" in e),
             key=lambda e: e["seconds"], default=None)
  record = {
      "command": " ".join(["XLA_PYTHON_CLIENT_PREALLOCATE=" + os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", ""),
                           os.path.basename(sys.executable), "-m", "benchmarks.bench_attention",
                           *(argv if argv is not None else sys.argv[1:])]),
      "device": device, "backend": jax.default_backend(), "interpret": interpret,
      "shape": {"B": b, "T": t, "H": h, "D": d}, "flops": flops,
      "packed_bytes": packed.nbytes(), "bf16_kv_bytes": 2 * k.nbytes,
      "versions": _versions(), "warmup": args.warmup, "repeats": args.repeats,
      "check_rows": len(rows), "check_first_config": check,
      "results": [{"name": n, **e} for n, e in results],
      "best_packed": best, "best_ratio_to_jax_cudnn": best and best.get("ratio_to_jax_cudnn"),
  }
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(record, f, indent=1)
  print(f"\nwrote {args.out}")


if __name__ == "__main__":
  main()
