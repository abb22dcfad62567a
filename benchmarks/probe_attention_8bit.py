"""Can a Pallas-Triton flash attention run its dots on Hopper's 8-bit tensor cores, and
how fast against cuDNN BF16 (issue 40)? One plain kernel, four dot precisions.

  python -m benchmarks.probe_attention_8bit              # GPU
  python -m benchmarks.probe_attention_8bit --cpu-smoke  # interpret mode, tiny

Inputs are pre-quantized (this probes the attention loop, not the decode): Q and K
int8 per token (K after subtracting its mean over tokens, which softmax ignores), V
e4m3 per channel, P e4m3 scaled by 448 (its values lie in (0, 1] before the row sum),
accumulators f32, output bf16. Variants: ``bf16`` (both dots bf16), ``i8qk`` (int8 QK,
bf16 PV), ``i8qk_f8pv`` (int8 QK, e4m3 PV), ``f8`` (e4m3 QK and PV). Quality: cos
against float32 attention on DiT-like data; speed: non-causal, B = 1, against cuDNN.
"""
from __future__ import annotations

import argparse
import functools
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import pallas as pl  # noqa: E402
from jax.experimental.pallas import triton as plgpu  # noqa: E402

from benchmarks import common  # noqa: E402

E4M3 = jnp.float8_e4m3fn
P_SCALE = 448.0
VARIANTS = ("bf16", "i8qk", "i8qk_f8pv", "f8")


def quantize(q, k, v, variant):
  """(B, T, H, D) f32 -> kernel operands (H, T, D) and their scales."""
  to_h = lambda x: jnp.transpose(x[0], (1, 0, 2))
  q, k, v = to_h(q), to_h(k), to_h(v)
  k = k - k.mean(axis=1, keepdims=True)       # softmax-exact smoothing
  if variant in ("i8qk", "i8qk_f8pv"):
    sq = jnp.maximum(jnp.abs(q).max(-1), 1e-30) / 127.0
    sk = jnp.maximum(jnp.abs(k).max(-1), 1e-30) / 127.0
    qc = jnp.round(q / sq[..., None]).astype(jnp.int8)
    kc = jnp.round(k / sk[..., None]).astype(jnp.int8)
  elif variant == "f8":
    sq = jnp.maximum(jnp.abs(q).max(-1), 1e-30) / 448.0
    sk = jnp.maximum(jnp.abs(k).max(-1), 1e-30) / 448.0
    qc, kc = (q / sq[..., None]).astype(E4M3), (k / sk[..., None]).astype(E4M3)
  else:
    sq, sk = jnp.ones(q.shape[:2]), jnp.ones(k.shape[:2])
    qc, kc = q.astype(jnp.bfloat16), k.astype(jnp.bfloat16)
  if variant in ("i8qk_f8pv", "f8"):
    sv = jnp.maximum(jnp.abs(v).max(1), 1e-30) / 448.0          # (H, D) per channel
    vc = (v / sv[:, None]).astype(E4M3)
  else:
    sv, vc = jnp.ones((v.shape[0], v.shape[2])), v.astype(jnp.bfloat16)
  return qc, kc, vc, sq.astype(jnp.float32), sk.astype(jnp.float32), sv.astype(jnp.float32)


def _kernel(q_ref, k_ref, v_ref, sq_ref, sk_ref, sv_ref, o_ref, *, t, bk, variant, sm_scale):
  q = q_ref[...]
  sq = sq_ref[...] * (sm_scale * 1.4426950408889634)
  bq = q.shape[0]
  d = q.shape[1]

  def body(i, carry):
    m, l, acc = carry
    rows = pl.ds(i * bk, bk)
    k = k_ref[rows, :]
    if variant in ("i8qk", "i8qk_f8pv"):
      s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)
      s = s.astype(jnp.float32)
    else:
      s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    s = s * sq[:, None] * sk_ref[rows][None, :]
    m_new = jnp.maximum(m, s.max(-1))
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(s - m_new[:, None])
    l = l * alpha + p.sum(-1)
    v = v_ref[rows, :]
    if variant in ("i8qk_f8pv", "f8"):
      pv = jnp.dot((p * P_SCALE).astype(E4M3), v, preferred_element_type=jnp.float32)
    else:
      pv = jnp.dot(p.astype(jnp.bfloat16), v, preferred_element_type=jnp.float32)
    return m_new, l, acc * alpha[:, None] + pv

  carry = (jnp.full((bq,), -1e30, jnp.float32), jnp.zeros((bq,), jnp.float32), jnp.zeros((bq, d), jnp.float32))
  m, l, acc = jax.lax.fori_loop(0, t // bk, body, carry)
  scale = (1.0 / P_SCALE) if variant in ("i8qk_f8pv", "f8") else 1.0
  o_ref[...] = (acc * (scale / l)[:, None] * sv_ref[...][None, :]).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("variant", "bq", "bk", "warps", "stages", "interpret"))
def attention_8bit(qc, kc, vc, sq, sk, sv, *, variant, bq=128, bk=64, warps=8, stages=2, interpret=False):
  h, t, d = qc.shape
  assert t % bq == 0 and t % bk == 0, "probe: T a multiple of the tiles"
  return pl.pallas_call(
      functools.partial(_kernel, t=t, bk=bk, variant=variant, sm_scale=d ** -0.5),
      grid=(t // bq, h),
      in_specs=[pl.BlockSpec((None, bq, d), lambda i, j: (j, i, 0)),
                pl.BlockSpec((None, t, d), lambda i, j: (j, 0, 0)),
                pl.BlockSpec((None, t, d), lambda i, j: (j, 0, 0)),
                pl.BlockSpec((None, bq), lambda i, j: (j, i)),
                pl.BlockSpec((None, t), lambda i, j: (j, 0)),
                pl.BlockSpec((None, d), lambda i, j: (j, 0))],
      out_specs=pl.BlockSpec((None, bq, d), lambda i, j: (j, i, 0)),
      out_shape=jax.ShapeDtypeStruct((h, t, d), jnp.bfloat16),
      compiler_params=plgpu.CompilerParams(num_warps=warps, num_stages=stages),
      interpret=interpret, name=f"attention_{variant}")(qc, kc, vc, sq, sk, sv)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--quality-tokens", type=int, default=8192)
  ap.add_argument("--speed-tokens", type=int, nargs="*", default=[38272, 152320])
  ap.add_argument("--heads", type=int, default=56)
  ap.add_argument("--configs", default="128x64x8x2,128x128x8x2,128x64x4x3,64x64x4x2",
                  help="bq x bk x warps x stages")
  ap.add_argument("--cpu-smoke", action="store_true")
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  from pallas_kernels.testing import cosine, dit_qkv
  interpret = jax.default_backend() != "gpu"
  if interpret and not args.cpu_smoke:
    sys.exit("no GPU: pass --cpu-smoke")
  if args.cpu_smoke:
    args.quality_tokens, args.speed_tokens, args.configs = 256, [], "64x64x4x2"
  configs = [tuple(int(x) for x in c.split("x")) for c in args.configs.split(",")]
  card = common.device_name()
  rows = []
  q, k, v, _, _ = dit_qkv(args.quality_tokens, 4, 128)
  q, k, v = map(jnp.asarray, (q, k, v))
  ref = jax.nn.dot_product_attention(q, k, v, scale=128 ** -0.5, implementation="xla")
  ref_h = jnp.transpose(ref[0], (1, 0, 2))
  if not interpret:
    b16 = jax.nn.dot_product_attention(*(x.astype(jnp.bfloat16) for x in (q, k, v)), implementation="cudnn")
    rows.append({"kind": "quality", "variant": "cudnn bf16", "cos": cosine(jnp.transpose(b16[0], (1, 0, 2)), ref_h)})
  for variant in VARIANTS:
    bq, bk, w, s = configs[0]
    try:
      out = attention_8bit(*quantize(q, k, v, variant), variant=variant, bq=bq, bk=bk, warps=w, stages=s,
                           interpret=interpret)
      rows.append({"kind": "quality", "variant": variant, "cos": cosine(out, ref_h)})
    except Exception as e:  # noqa: BLE001 - a dot Triton refuses is a result
      rows.append({"kind": "quality", "variant": variant, "error": str(e).splitlines()[0][:300]})
  for t in args.speed_tokens:
    keys = jax.random.split(jax.random.key(0), 3)
    qs, ks, vs = (jax.random.normal(kk, (1, t, args.heads, 128), jnp.float32) for kk in keys)
    qb, kb, vb = (x.astype(jnp.bfloat16) for x in (qs, ks, vs))
    cud = jax.jit(lambda a, b, c: jax.nn.dot_product_attention(a, b, c, implementation="cudnn"))
    t_ref, _ = common.time_fn(lambda: cud(qb, kb, vb), 1, 3)
    rows.append({"kind": "speed", "tokens": t, "variant": "cudnn bf16", "time_s": t_ref, "vs_cudnn": 1.0})
    qb = kb = vb = None  # free before the 8-bit variants
    for variant in VARIANTS:
      ops = jax.block_until_ready(quantize(qs, ks, vs, variant))
      for bq, bk, w, s in configs:
        name = f"{variant} {bq}x{bk} w{w} s{s}"
        try:
          fn = lambda: attention_8bit(*ops, variant=variant, bq=bq, bk=bk, warps=w, stages=s)
          tt, _ = common.time_fn(fn, 1, 3)
          rows.append({"kind": "speed", "tokens": t, "variant": name, "time_s": tt, "vs_cudnn": tt / t_ref})
        except Exception as e:  # noqa: BLE001
          rows.append({"kind": "speed", "tokens": t, "variant": name, "error": str(e).splitlines()[0][:300]})
      ops = None
    del qs, ks, vs
  print(f"card: {card}")
  print(common.table(rows, [("kind", "kind", "{}"), ("T", "tokens", "{}"), ("variant", "variant", "{}"),
                            ("cos", "cos", "{:.6f}"), ("s", "time_s", "{:.4f}"), ("vs cuDNN", "vs_cudnn", "{:.3f}"),
                            ("error", "error", "{}")]))
  out = args.out or common.result_path("probe_attention_8bit" + ("_cpu_smoke" if args.cpu_smoke else ""), card)
  common.write_json(out, common.run_record() | {"card": card, "rows": rows})


if __name__ == "__main__":
  main()
