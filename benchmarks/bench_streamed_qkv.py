"""Speed and device-level memory of the streamed QKV projection against a plain cuBLAS
GEMM, in one process (``streamed_qkv`` methods: ``chunked`` at several scratch budgets,
``fused``).

  python -m benchmarks.bench_streamed_qkv                       # GPU: T = 38,247 and 152,263
  python -m benchmarks.bench_streamed_qkv --tokens 300 --hidden 256 --heads 2 --cpu-smoke

Per T: XLA's cuBLAS BF16 ``x @ W`` of the same shape (the peer), then each variant:
one checked call (codes and Q against ``streamed_qkv_reference`` on a head and a tail
row subset), then the timed calls. Device-level peak: the lowest ``cudaMemGetInfo``
free seen while the variant runs, against the free memory before it, with JAX's
platform allocator so that every buffer is returned between variants. Writes JSON
(``benchmarks/results/streamed_qkv_<card>_<date>.json``) and updates the scorecard.
"""
from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ.setdefault("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")  # device-level peaks per variant

import argparse  # noqa: E402
import sys  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from benchmarks import common  # noqa: E402
from pallas_kernels.qkv_projection import ProjectionTuning  # noqa: E402
from pallas_kernels.qkv_layout import QKVLayout, QKVWeights  # noqa: E402

def make_inputs(args):
  """H3-like inputs, built without big temporaries so the peak reading stays clean:
  x, the ``QKVWeights`` and ``streamed_qkv``'s keyword arguments (layout, RoPE tables)."""
  import jax
  import jax.numpy as jnp
  import numpy as np

  from pallas_kernels.testing import dit_grid
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
  weights = QKVWeights(w, q_norm_weight=jnp.asarray(1 + 0.1 * rng.normal(size=d), jnp.float32),
                       k_norm_weight=jnp.asarray(1 + 0.1 * rng.normal(size=d), jnp.float32))
  kw = dict(rope_cos=jnp.asarray(cos), rope_sin=jnp.asarray(sin), layout=QKVLayout.h3(h, d, args.rot_dim))
  del k4
  return x, weights, kw


def kv_storage(args):
  """The ``KVStorage`` of ``--policy``."""
  from formats import KVStorage
  t = args.tokens
  if args.policy == "int4":
    return KVStorage()
  # Text prefix in bf16, reference frames in int8, generated video in int4.
  text, refs = max(t // 50, 1), max(t // 5, 2)
  return KVStorage(token_ranges=((0, text, "bf16"), (text, refs, "int8")))


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


def check_subsets(args, q, packed, x, weights, kw, storage):
  """Kernel vs reference on a head and a tail row subset; returns metrics."""
  import dataclasses

  import jax
  import numpy as np

  from pallas_kernels.testing import cosine, rel_err
  from formats import packed_kv as fmt
  from pallas_kernels.qkv_projection import projected_qkv_f32, streamed_qkv_reference

  nb = packed.meta.num_blocks
  classes = storage.classes_for(args.tokens)
  n = max(1, min(args.check_rows // fmt.BLOCK, nb))
  out = {}
  for name, (b0, b1) in (("head", (0, n)), ("tail", (max(0, nb - n), nb))):
    r0, r1 = b0 * fmt.BLOCK, min(args.tokens, b1 * fmt.BLOCK)
    sub_kw = dict(kw, rope_cos=kw["rope_cos"][r0:r1], rope_sin=kw["rope_sin"][r0:r1])
    xs = x[:, r0:r1]
    sub_storage = dataclasses.replace(storage, token_ranges=(), policy=None, policy_key=None,
                                      block_classes=classes[b0:b1])
    q_ref, ref = streamed_qkv_reference(xs, weights, **sub_kw, storage=sub_storage)
    got = slice_packed(packed, b0, b1)
    _, k32, v32 = projected_qkv_f32(xs, weights, **sub_kw, storage=sub_storage)
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


VARIANTS = (("chunked_128mib", dict(method="chunked", scratch_bytes=128 << 20)),
            ("chunked_512mib", dict(method="chunked", scratch_bytes=512 << 20)),
            ("chunked_2gib", dict(method="chunked", scratch_bytes=2 << 30)),
            ("chunked_512mib_epilogue_8warps", dict(method="chunked", scratch_bytes=512 << 20,
                                                     tuning=ProjectionTuning(epilogue_num_warps=8))),
            ("chunked_512mib_bf16_gemm", dict(method="chunked", scratch_bytes=512 << 20,
                                               tuning=ProjectionTuning(gemm_dtype="bfloat16"))),
            ("fused", dict(method="fused")))


def run_tokens(args, tokens):
  import dataclasses

  import jax
  import jax.numpy as jnp

  from pallas_kernels.qkv_projection import streamed_qkv

  args.tokens = tokens
  x, weights, kw = make_inputs(args)
  w = weights.w_qkv
  storage = kv_storage(args)
  jax.block_until_ready((x, weights, kw["rope_cos"]))
  on_gpu = jax.default_backend() == "gpu"
  gemm = jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.bfloat16))
  rows = []

  def measure(name, fn, extra):
    rec = {"tokens": tokens, "variant": name, **extra}
    free0 = common.device_free_bytes() if on_gpu else None
    try:
      if on_gpu:
        with common.LowWater() as lw:
          out = jax.block_until_ready(fn())
        rec["peak_above_start_gib"] = (free0 - lw.low) / common.GIB
      else:
        out = jax.block_until_ready(fn())
      rec["time_s"], rec["times_s"] = common.time_fn(fn, args.warmup, args.iters)
      rec["ok"] = True
      return rec, out
    except Exception as e:  # noqa: BLE001 - an OOM at one budget is a result
      rec.update(ok=False, error=str(e).splitlines()[0][:300])
      return rec, None
    finally:
      rows.append(rec)

  base, _ = measure("cublas_gemm_bf16", lambda: gemm(x, w), {})
  for name, cfg in VARIANTS:
    if args.variants and name not in args.variants.split(","):
      continue
    fn = lambda cfg=cfg: streamed_qkv(x, weights, **kw, storage=storage, **cfg)
    # JSON-able record of the settings (a ProjectionTuning as its fields)
    config = {k: dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v for k, v in cfg.items()}
    rec, out = measure(name, fn, {"config": config})
    if out is not None:
      q, packed = out
      rec["check"] = check_subsets(args, q, packed, x, weights, kw, storage)
      rec["check_ok"] = all(m["ok"] for m in rec["check"].values())
      del q, packed, out
    if rec.get("time_s") and base.get("time_s"):
      rec["vs_cublas"] = rec["time_s"] / base["time_s"]
  return rows


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--tokens", default="38247,152263", help="comma-separated T values")
  ap.add_argument("--hidden", type=int, default=5376)
  ap.add_argument("--heads", type=int, default=56)
  ap.add_argument("--head-dim", type=int, default=128)
  ap.add_argument("--rot-dim", type=int, default=96)
  ap.add_argument("--batch", type=int, default=1)
  ap.add_argument("--policy", choices=("int4", "mixed"), default="int4")
  ap.add_argument("--iters", type=int, default=5)
  ap.add_argument("--warmup", type=int, default=1)
  ap.add_argument("--check-rows", type=int, default=1024)
  ap.add_argument("--variants", default="", help="comma-separated VARIANTS names (default: all)")
  ap.add_argument("--cpu-smoke", action="store_true", help="tiny interpret-mode run on a CPU")
  ap.add_argument("--out", default=None, help="default benchmarks/results/streamed_qkv_<card>_<date>.json")
  args = ap.parse_args(argv)
  import jax
  if jax.default_backend() != "gpu" and not args.cpu_smoke:
    sys.exit("no GPU visible to JAX: pass --cpu-smoke for a tiny interpret-mode run")
  card = common.device_name()
  rows = []
  for t in (int(v) for v in str(args.tokens).split(",")):
    rows += run_tokens(args, t)
  print(f"card: {card}")
  print(common.table(rows, [("T", "tokens", "{}"), ("variant", "variant", "{}"), ("s", "time_s", "{:.4f}"),
                            ("vs cuBLAS", "vs_cublas", "{:.3f}"), ("peak GiB", "peak_above_start_gib", "{:.3f}"),
                            ("check", "check_ok", "{}")]))
  out = args.out or common.result_path("streamed_qkv" + ("_cpu_smoke" if args.cpu_smoke else ""), card)
  rec = common.run_record() | {"card": card, "shape": vars(args), "rows": rows}
  common.write_json(out, rec)
  if not args.cpu_smoke:
    pick = {(r["tokens"], r["variant"]): r.get("vs_cublas") for r in rows}
    common.update_scorecard({"projection.chunked_vs_cublas_152k": pick.get((152263, "chunked_512mib")),
                             "projection.chunked_128mib_vs_cublas_152k": pick.get((152263, "chunked_128mib"))},
                            card=card, source=out, command=rec["command"])


if __name__ == "__main__":
  main()
