"""What FP8 attention costs in quality and buys in speed, lever by lever (issue 40):
cuDNN's FP8 flash attention (JAX's private entry point) against cuDNN BF16, in one
process.

  python -m benchmarks.fp8_levers            # GPU
  python -m benchmarks.fp8_levers --cpu-smoke

Quality (cos and relative L2 against float32 attention) on DiT-like data at T = 16,384
and on the committed real-activation sample, for each lever on its own and together:
per-tensor scales (cuDNN's recipe), per-head scales (one call per head), K smoothing
(subtract K's mean over tokens, which softmax ignores), V smoothing (subtract V's mean
over tokens and add it back after: rows of P sum to one, so the FP8 output carries only
the residual), and the Hadamard rotation our format already applies. Speed at
T = 152,320 (56 heads): BF16 whole, FP8 whole, FP8 per head group (the streamed
design's unit, each group with its own scales).
"""
from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks import common  # noqa: E402

E4M3_MAX = 448.0


def cudnn_fp8():
  """cuDNN FP8 attention as f(q8, k8, v8, descales..., scale) in BTNH, or None."""
  try:
    from jax._src.cudnn import fused_attention_stablehlo as fas
  except ImportError:
    return None
  if not hasattr(fas, "_dot_product_attention_fp8"):
    return None
  one = jnp.ones((1, 1, 1, 1), jnp.float32)

  def attend(q8, k8, v8, dq, dk, dv, scale_o, scale):
    params = dict(descale_q=dq, descale_k=dk, descale_v=dv, descale_s=one / E4M3_MAX, scale_s=one * E4M3_MAX,
                  scale_o=scale_o, descale_o=one, descale_dO=one, descale_dP=one, scale_dQ=one, scale_dK=one,
                  scale_dV=one, scale_dP=one)
    return fas._dot_product_attention_fp8(q8, k8, v8, params, scale, False, fas.AttentionLayout.BTNH.value,
                                          fas.check_cudnn_version())[0]
  return attend


def to_e4m3(x):
  amax = jnp.maximum(jnp.max(jnp.abs(x)).astype(jnp.float32), 1e-30)
  s = amax / E4M3_MAX
  return (x.astype(jnp.float32) / s).astype(jnp.float8_e4m3fn), s.reshape(1, 1, 1, 1)


def fp8_attention(attend, q, k, v, scale, *, per_head=False, smooth_k=False, smooth_v=False):
  """(B, T, H, D) f32 in, f32 out, through cuDNN FP8 with the chosen levers."""
  q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
  vmean = jnp.zeros_like(v[:, :1])
  if smooth_k:
    k = k - k.mean(axis=1, keepdims=True)
  if smooth_v:
    vmean = v.mean(axis=1, keepdims=True)
    v = v - vmean

  def run(q, k, v):
    (q8, dq), (k8, dk), (v8, dv) = to_e4m3(q), to_e4m3(k), to_e4m3(v)
    # cuDNN applies the descales itself and returns scale_o * O in e4m3. |O| <= max|v|,
    # so scale_o = 448 / max|v| = 1 / dv puts O on e4m3's whole range; dividing by it
    # undoes that.
    scale_o = 1.0 / dv
    o8 = attend(q8, k8, v8, dq, dk, dv, scale_o, scale)
    return o8.astype(jnp.float32) / scale_o.reshape(())
  if per_head:
    out = jnp.concatenate([run(q[:, :, i:i + 1], k[:, :, i:i + 1], v[:, :, i:i + 1]) for i in range(q.shape[2])], 2)
  else:
    out = run(q, k, v)
  return out + vmean


def quality_rows(attend, name, q, k, v, rows):
  from pallas_kernels.testing import cosine, rel_err
  from formats import packed_kv as fmt
  d = q.shape[-1]
  scale = d ** -0.5
  ref = np.asarray(jax.nn.dot_product_attention(q, k, v, scale=scale, implementation="xla"))
  b16 = jax.nn.dot_product_attention(*(x.astype(jnp.bfloat16) for x in (q, k, v)), scale=scale,
                                     implementation="cudnn" if jax.default_backend() == "gpu" else "xla")
  rows.append({"data": name, "lever": "bf16 cudnn", "cos": cosine(b16, ref), "rel_err": rel_err(b16, ref)})
  rk, rv = (jnp.asarray(fmt.hadamard_rotation(d, s)) for s in (0, 1))
  levers = [("fp8 per-tensor", {}, False), ("fp8 per-head", dict(per_head=True), False),
            ("fp8 smooth K", dict(smooth_k=True), False), ("fp8 smooth V", dict(smooth_v=True), False),
            ("fp8 rotated", {}, True),
            ("fp8 per-head + smooth K,V", dict(per_head=True, smooth_k=True, smooth_v=True), False),
            ("fp8 all (per-head, smooth K,V, rotated)", dict(per_head=True, smooth_k=True, smooth_v=True), True)]
  for lever, kw, rotated in levers:
    try:
      if rotated:
        o = fp8_attention(attend, q @ rk, k @ rk, v @ rv, scale, **kw) @ rv.T
      else:
        o = fp8_attention(attend, q, k, v, scale, **kw)
      rows.append({"data": name, "lever": lever, "cos": cosine(o, ref), "rel_err": rel_err(o, ref)})
    except Exception as e:  # noqa: BLE001 - a lever cuDNN refuses is a result
      rows.append({"data": name, "lever": lever, "error": str(e).splitlines()[0][:300]})


def speed_rows(attend, t, h, d, group, rows, repeats):
  ks = jax.random.split(jax.random.key(0), 3)
  q, k, v = (jax.random.normal(kk, (1, t, h, d), jnp.bfloat16) for kk in ks)
  scale = d ** -0.5
  bf16 = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, scale=scale, implementation="cudnn"))
  whole = jax.jit(lambda q, k, v: fp8_attention(attend, q, k, v, scale).astype(jnp.bfloat16))

  @jax.jit
  def grouped(q, k, v):
    outs = [fp8_attention(attend, q[:, :, i:i + group], k[:, :, i:i + group], v[:, :, i:i + group],
                          scale).astype(jnp.bfloat16) for i in range(0, h, group)]
    return jnp.concatenate(outs, 2)

  @jax.jit
  def prequantized(q8, k8, v8):  # the attention kernel alone, inputs already e4m3
    one = jnp.ones((1, 1, 1, 1), jnp.float32)
    return attend(q8, k8, v8, one, one, one, one, scale)

  q8, k8, v8 = ((x.astype(jnp.float32) / 4).astype(jnp.float8_e4m3fn) for x in (q, k, v))
  t_b, _ = common.time_fn(lambda: bf16(q, k, v), 1, repeats)
  rows.append({"tokens": t, "variant": "cudnn bf16", "time_s": t_b, "vs_bf16": 1.0})
  for name, fn in (("fp8 whole (quantize + attend)", lambda: whole(q, k, v)),
                   (f"fp8 groups of {group} heads", lambda: grouped(q, k, v)),
                   ("fp8 kernel alone (e4m3 in)", lambda: prequantized(q8, k8, v8))):
    try:
      t_x, _ = common.time_fn(fn, 1, repeats)
      rows.append({"tokens": t, "variant": name, "time_s": t_x, "vs_bf16": t_x / t_b})
    except Exception as e:  # noqa: BLE001
      rows.append({"tokens": t, "variant": name, "error": str(e).splitlines()[0][:300]})


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--quality-tokens", type=int, default=16384)
  ap.add_argument("--speed-tokens", type=int, nargs="*", default=[152320, 38272])
  ap.add_argument("--group", type=int, default=8)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--cpu-smoke", action="store_true")
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  from benchmarks.kv_quality import SAMPLE
  from pallas_kernels.testing import dit_qkv
  attend = cudnn_fp8() if jax.default_backend() == "gpu" else None
  if attend is None:
    if not args.cpu_smoke:
      sys.exit("cuDNN FP8 attention needs a GPU and jax._src.cudnn's private FP8 entry point")
    # CPU smoke: an emulation with the same rounding points (e4m3 inputs, P scaled by 448, e4m3 out)
    def attend(q8, k8, v8, dq, dk, dv, scale_o, scale):
      dq, dk, dv, scale_o = (x.reshape(()) for x in (dq, dk, dv, scale_o))
      s = jnp.einsum("bqhd,bkhd->bhqk", q8.astype(jnp.float32), k8.astype(jnp.float32)) * scale * dq * dk
      p = jnp.exp(s - s.max(-1, keepdims=True))  # flash-style: P before the row sum, in (0, 1]
      p8 = (p * E4M3_MAX).astype(jnp.float8_e4m3fn).astype(jnp.float32) / E4M3_MAX
      o = jnp.einsum("bhqk,bkhd->bqhd", p8, v8.astype(jnp.float32) * dv)
      o = o / jnp.moveaxis(p.sum(-1), 1, 2)[..., None] * scale_o
      return o.astype(jnp.float8_e4m3fn)
    args.quality_tokens, args.speed_tokens = 512, []
  card = common.device_name()
  qrows, srows = [], []
  q, k, v, _, _ = dit_qkv(args.quality_tokens, 4, 128)
  quality_rows(attend, f"dit T={args.quality_tokens}", *map(jnp.asarray, (q, k, v)), qrows)
  del q, k, v
  sample = np.load(SAMPLE)
  for layer in sorted({int(n[1:]) for n in sample.files}):
    q = jnp.asarray(sample[f"q{layer}"], jnp.float32)[None]
    rep = q.shape[2] // sample[f"k{layer}"].shape[1]
    k, v = (jnp.repeat(jnp.asarray(sample[f"{r}{layer}"], jnp.float32)[None], rep, axis=2) for r in "kv")
    quality_rows(attend, f"smollm2 layer {layer} (non-causal)", q, k, v, qrows)
  for t in args.speed_tokens:
    speed_rows(attend, t, 56, 128, args.group, srows, args.repeats)
  print(f"card: {card}")
  print(common.table(qrows, [("data", "data", "{}"), ("lever", "lever", "{}"), ("cos", "cos", "{:.6f}"),
                             ("rel L2", "rel_err", "{:.5f}"), ("error", "error", "{}")]))
  if srows:
    print(common.table(srows, [("T", "tokens", "{}"), ("variant", "variant", "{}"), ("s", "time_s", "{:.4f}"),
                               ("vs bf16", "vs_bf16", "{:.3f}"), ("error", "error", "{}")]))
  out = args.out or common.result_path("fp8_levers" + ("_cpu_smoke" if args.cpu_smoke else ""), card)
  common.write_json(out, common.run_record() | {"card": card, "quality": qrows, "speed": srows})


if __name__ == "__main__":
  main()
