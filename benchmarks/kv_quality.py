"""K/V format quality on real activations and on DiT-like synthetic data (CPU).

  python -m benchmarks.kv_quality                      # real (SmolLM2, T = 2048 and 4096) + synthetic
  python -m benchmarks.kv_quality --sample             # CI: the committed real sample only
  python -m benchmarks.kv_quality --rows format:       # the format's own classes and policies only

Real: post-RoPE q, k, v of six layers of SmolLM2-135M on real English text
(``benchmarks/real_activations.py``; needs the ``quality`` extra). Synthetic: the
DiT-like q, k, v of ``pallas_kernels.testing.dit_qkv`` (H3-like head dim 128).

For every row, K and V go through a quantizer (in the rotated basis, as the format
stores them) and back, and non-causal float32 attention with the quantized K/V is
compared with attention on the original values: cos and rel L1 per layer (all heads,
all query rows), then the median and the worst layer; and the worst single head.

Rows:
* the format's policies (through ``formats.quantize_reference``, format v2 since Dec 7:
  16-bit parameters; v3 since Dec 8: 5-bit classes): all int4, an int8 prefix of 256
  tokens, int4 K with int8 V, int8 K with int4 V, all int8, all k5v4, all k5v5, K per
  token;
* levers for a version 2, each alone and combined (fake quantization in numpy, same
  rounding as the format): 16-bit scales and stats, a Lloyd-Max 4-bit codebook fitted
  to the normalized group values, MSE-optimal clipping of each group's range, finer
  K groups, K smoothed by its per-channel mean (exact under softmax), K quantized
  before RoPE with RoPE applied after decoding (KVQuant's observation), and (real data)
  per-head classes: int8 K for the K/V heads whose int4 K hurts attention most.

``bits`` is K and V together per value at H3's head dim 128: codes, every scale and
zero, and the per-block stats (Sol's K mean and V sum). Writes
``benchmarks/results/kv_quality_<date>.json`` (``--out``).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

import formats as fmt  # noqa: E402
from formats.reference import attention_f32  # noqa: E402
from benchmarks import common  # noqa: E402

SAMPLE = os.path.join(ROOT, "benchmarks", "data", "smollm2_qkv_sample.npz")
REAL_LAYERS = (2, 7, 12, 17, 22, 27)
H3_HEAD_DIM = 128
REAL_ROPE_THETA = 1e5   # SmolLM2-135M's (the committed sample's positions are 0..1023)


# --------------------------------------------------------------------------------------
# Attention and metrics
# --------------------------------------------------------------------------------------
def attention(q, k, v, chunk=512):
  """Non-causal float32 attention with grouped heads: the one ``formats.calibrate`` uses."""
  return np.asarray(attention_f32(q, k, v, chunk=chunk))


def metrics(out, ref) -> dict:
  o, r = out.astype(np.float64), ref.astype(np.float64)
  cos = float((o * r).sum() / np.sqrt((o * o).sum() * (r * r).sum()))
  per_head = [float((o[:, h] * r[:, h]).sum() / np.sqrt((o[:, h] ** 2).sum() * (r[:, h] ** 2).sum()))
              for h in range(o.shape[1])]
  return {"cos": cos, "rel_l1": float(np.abs(o - r).sum() / np.abs(r).sum()), "worst_head_cos": min(per_head)}


# --------------------------------------------------------------------------------------
# Quantizers
# --------------------------------------------------------------------------------------
def rotations(d, seed_k=0, seed_v=1):
  return fmt.hadamard_rotation(d, seed_k), fmt.hadamard_rotation(d, seed_v)


def format_roundtrip(k, v, *, k_class="int4", v_class="int4", prefix=0, k_scheme="channel"):
  """The format through its own reference: (T, H, D) f32 in -> dequantized, un-rotated."""
  t, h, d = k.shape
  r_k, r_v = rotations(d)
  out = []
  for x, r, cls, role in ((k, r_k, k_class, "k"), (v, r_v, v_class, "v")):
    ranges = [(0, t, cls)] + ([(0, min(prefix, t), "int8")] if prefix else [])
    classes = fmt.resolve_block_classes(t, ranges)
    meta = fmt.PackedKVMeta(1, h, d, t, classes, k_scheme=k_scheme)
    xr = (x @ r)[None]
    packed = fmt.quantize_reference(xr, xr, meta)
    kd, vd = fmt.dequantize_reference(packed)
    out.append(np.asarray(kd if role == "k" else vd)[0] @ r.T)
  return out


@dataclasses.dataclass(frozen=True)
class Lever:
  """One fake-quantized 4-bit format: K in groups of ``k_tokens`` tokens x 1 channel,
  V in groups of 1 token x ``v_channels`` channels, asymmetric."""
  k_tokens: int = 64
  v_channels: int = 128          # at most D: the whole head vector at D = 64
  param_bits: int = 32           # scale and zero
  stat_bits: int = 32            # K mean and V sum per 64-token block
  codebook: bool = False         # Lloyd-Max levels instead of uniform ones
  v_codebook: bool = False       # ... for V only
  mse_clip: bool = False
  k_smooth: bool = False         # subtract K's per-channel mean over the sequence first
  k_pre_rope: bool = False       # quantize K before RoPE (KVQuant), apply RoPE after decoding
  k_bits: int | None = 4         # code bits; None keeps that side exact (where the error sits)
  v_bits: int | None = 4

  def bits(self, d=H3_HEAD_DIM) -> float | None:
    if self.k_bits is None or self.v_bits is None:
      return None
    k = self.k_bits + 2 * self.param_bits / self.k_tokens + self.stat_bits / 64
    v = self.v_bits + 2 * self.param_bits / min(self.v_channels, d) + self.stat_bits / 64
    return (k + v) / 2


@functools.lru_cache(maxsize=None)
def lloyd_max(group: int, levels: int = 16, iters: int = 60) -> np.ndarray:
  """Lloyd-Max levels on [0, 1] for min-max normalized groups of ``group`` Gaussian
  values (what a Hadamard-rotated vector looks like), endpoints kept at 0 and 1 (every
  group's min and max stay exact)."""
  rng = np.random.default_rng(0)
  g = rng.normal(size=(20000 // max(group // 16, 1) + 64, group))
  u = (g - g.min(1, keepdims=True)) / (g.max(1, keepdims=True) - g.min(1, keepdims=True))
  u = np.sort(u.ravel())
  c = np.linspace(0, 1, levels)
  for _ in range(iters):
    edges = (c[1:] + c[:-1]) / 2
    idx = np.searchsorted(edges, u)
    sums = np.bincount(idx, u, levels)
    counts = np.bincount(idx, minlength=levels)
    c = np.where(counts > 0, sums / np.maximum(counts, 1), c)
    c[0], c[-1] = 0.0, 1.0
  return c


def _quantize_groups(g, lever: Lever, group_size: int, bits: int):
  """g (..., n) groups of n values -> dequantized, by the lever's rules."""
  lo, hi = g.min(-1, keepdims=True), g.max(-1, keepdims=True)
  if lever.mse_clip:
    best, best_err = None, None
    mid = (lo + hi) / 2
    for shrink in (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7):
      l2, h2 = mid - (mid - lo) * shrink, mid + (hi - mid) * shrink
      out = _levels(g, l2, h2, lever, group_size, bits)
      err = ((out - g) ** 2).sum(-1, keepdims=True)
      if best is None:
        best, best_err = out, err
      else:
        take = err < best_err
        best, best_err = np.where(take, out, best), np.where(take, err, best_err)
    return best
  return _levels(g, lo, hi, lever, group_size, bits)


def _levels(g, lo, hi, lever, group_size, bits):
  span = hi - lo
  top = 2 ** bits - 1
  f16 = lambda a: np.clip(a, -65504.0, 65504.0).astype(np.float16).astype(np.float32)
  if lever.codebook:
    scale, zero = np.where(span > 0, span, 1.0), lo
    if lever.param_bits == 16:
      scale, zero = f16(scale), f16(zero)
    u = np.clip((g - zero) / scale, 0.0, 1.0)
    c = lloyd_max(group_size, 2 ** bits)
    idx = np.abs(u[..., None] - c).argmin(-1)
    return c[idx] * scale + zero
  # Uniform codes: the format's arithmetic (formats.packed_kv.asymmetric_params and
  # quantize_codes), 16-bit parameters rounded as format v2 stores them.
  step, zero = np.where(span > 0, span / top, 1.0), lo
  if lever.param_bits == 16:
    step, zero = f16(step), f16(zero)
    step = np.where(step > 0, step, 1.0)
  return np.clip(np.floor((g - zero) / step + 0.5), 0, top) * step + zero


def lever_roundtrip(k, v, lever: Lever, rope=None):
  """``rope``: (forward, inverse) RoPE on (T, H, D), needed by ``k_pre_rope``."""
  t, h, d = k.shape
  r_k, r_v = rotations(d)
  if lever.k_pre_rope:
    forward, inverse = rope
    kd, vd = lever_roundtrip(inverse(k), v, dataclasses.replace(lever, k_pre_rope=False))
    return forward(kd), vd
  kr = k @ r_k
  if lever.k_smooth:
    kr = kr - kr.mean(0, keepdims=True)   # exact: shifts every logit of a query by one constant
  nb = -(-t // lever.k_tokens)
  pad = nb * lever.k_tokens - t
  kp = np.pad(kr, ((0, pad), (0, 0), (0, 0)), mode="edge")
  kg = kp.reshape(nb, lever.k_tokens, h, d).transpose(0, 2, 3, 1)           # groups over tokens
  kq = (kr if lever.k_bits is None else
        _quantize_groups(kg, lever, lever.k_tokens, lever.k_bits).transpose(0, 3, 1, 2).reshape(-1, h, d)[:t])
  vc = min(lever.v_channels, d)
  vr = v @ r_v
  v_lever = dataclasses.replace(lever, codebook=lever.codebook or lever.v_codebook)
  vq = vr if lever.v_bits is None else _quantize_groups(vr.reshape(t, h, d // vc, vc), v_lever, vc,
                                                        lever.v_bits).reshape(t, h, d)
  return kq @ r_k.T, vq @ r_v.T


FORMAT_POLICIES = {
    "all int4": dict(),
    "int8 first 256 tokens": dict(prefix=256),
    "int4 K, int8 V": dict(v_class="int8"),
    "int8 K, int4 V": dict(k_class="int8"),
    "all int8": dict(k_class="int8", v_class="int8"),
    "all k5v4 (5-bit K, 4-bit V)": dict(k_class="k5v4", v_class="k5v4"),
    "all k5v5": dict(k_class="k5v5", v_class="k5v5"),
    "K per token, all int4": dict(k_scheme="token"),
}

LEVERS = {
    "v1 (fake quant)": Lever(),
    "format v2 (fake quant, check)": Lever(param_bits=16, stat_bits=16),
    "16-bit scales, zeros, stats": Lever(param_bits=16, stat_bits=16),
    "Lloyd-Max codebook": Lever(codebook=True),
    "MSE-optimal clipping": Lever(mse_clip=True),
    "K groups of 32 tokens": Lever(k_tokens=32),
    "K smoothed by its channel mean": Lever(k_smooth=True),
    "codebook + clipping": Lever(codebook=True, mse_clip=True),
    "16-bit + codebook + clipping": Lever(param_bits=16, stat_bits=16, codebook=True, mse_clip=True),
    "16-bit + K 32 + codebook + clipping": Lever(param_bits=16, stat_bits=16, k_tokens=32, codebook=True,
                                                 mse_clip=True),
    "16-bit + K 32 + V 64 + codebook + clipping": Lever(param_bits=16, stat_bits=16, k_tokens=32, v_channels=64,
                                                        codebook=True, mse_clip=True),
    "16-bit, 5-bit K, 4-bit V": Lever(param_bits=16, stat_bits=16, k_bits=5),
    "16-bit, 5-bit K, 4-bit V codebook": Lever(param_bits=16, stat_bits=16, k_bits=5, v_codebook=True),
    "16-bit, 5-bit K, 5-bit V codebook": Lever(param_bits=16, stat_bits=16, k_bits=5, v_bits=5, v_codebook=True),
    "K quantized before RoPE": Lever(k_pre_rope=True),
    "16-bit + K before RoPE + V 32 channels": Lever(param_bits=16, stat_bits=16, k_pre_rope=True, v_channels=32),
    # Where the error sits: one side exact.
    "split: K exact, V v1": Lever(k_bits=None),
    "split: K exact, V in 32-channel groups": Lever(k_bits=None, v_channels=32),
    "split: K exact, V in 16-channel groups": Lever(k_bits=None, v_channels=16),
    "split: K exact, V 5-bit": Lever(k_bits=None, v_bits=5),
    "split: V exact, K v1": Lever(v_bits=None),
    "split: V exact, K groups of 16 tokens": Lever(v_bits=None, k_tokens=16),
    "split: V exact, K 5-bit": Lever(v_bits=None, k_bits=5),
    "split: V exact, K 6-bit": Lever(v_bits=None, k_bits=6),
    "split: V exact, K before RoPE": Lever(v_bits=None, k_pre_rope=True),
}


# --------------------------------------------------------------------------------------
# Driver
# --------------------------------------------------------------------------------------
def evaluate(layers: dict, rows: dict, ropes: dict) -> list:
  """layers: {name: (q, k, v)}; rows: {row name: fn(k, v, rope) -> (kd, vd)}; ropes:
  {name: (forward, inverse)}, the RoPE each layer's q and k carry. One record per row
  with per-layer metrics, median and worst."""
  refs = {name: attention(*qkv) for name, qkv in layers.items()}
  out = []
  for row, fn in rows.items():
    per = {}
    for name, (q, k, v) in layers.items():
      kd, vd = fn(k, v, ropes[name])
      per[name] = metrics(attention(q, kd.astype(np.float32), vd.astype(np.float32)), refs[name])
    out.append(_record(row, per))
  return out


def _record(row: str, per: dict, **extra) -> dict:
  """One row's record from its per-layer metrics: median and worst layer; printed."""
  cos = [m["cos"] for m in per.values()]
  rec = {"row": row, "layers": per, "median_cos": float(np.median(cos)), "worst_cos": float(min(cos)),
         "median_rel_l1": float(np.median([m["rel_l1"] for m in per.values()])),
         "worst_head_cos": float(min(m["worst_head_cos"] for m in per.values())), **extra}
  print(f"  {row:45s} median cos {rec['median_cos']:.5f}  worst {rec['worst_cos']:.5f}  "
        f"rel L1 {rec['median_rel_l1']:.4f}  worst head {rec['worst_head_cos']:.4f}", flush=True)
  return rec


def per_head_rows(layers: dict, counts=(1, 2, 3, 6)) -> list:
  """Per-head precision classes: 16-bit parameters everywhere, int8 K for the ``n``
  K/V heads (over all layers) whose int4 K hurts attention most (measured with V
  exact). One record per n, as ``evaluate`` makes them, with its bits per value."""
  base = Lever(param_bits=16, stat_bits=16)
  refs = {name: attention(*qkv) for name, qkv in layers.items()}
  ranked = []
  for name, (q, k, v) in layers.items():
    kd, _ = lever_roundtrip(k, v, dataclasses.replace(base, v_bits=None))
    out, rep = attention(q, kd.astype(np.float32), v), q.shape[1] // k.shape[1]
    for h in range(k.shape[1]):
      sl = slice(h * rep, (h + 1) * rep)
      ranked.append((metrics(out[:, sl], refs[name][:, sl])["cos"], name, h))
  ranked.sort()
  records = []
  for n in counts:
    chosen = {(name, h) for _, name, h in ranked[:n]}
    per = {}
    for name, (q, k, v) in layers.items():
      kd, vd = lever_roundtrip(k, v, base)
      for h in range(k.shape[1]):
        if (name, h) in chosen:
          kd[:, h] = lever_roundtrip(k[:, h:h + 1], v[:, h:h + 1], dataclasses.replace(base, k_bits=8))[0][:, 0]
      per[name] = metrics(attention(q, kd.astype(np.float32), vd.astype(np.float32)), refs[name])
    records.append(_record(f"lever: 16-bit, int8 K on the {n} worst of {len(ranked)} K/V heads", per,
                           bits_d128=base.bits() + n / len(ranked) * (8 - 4) / 2))
  return records


def all_rows():
  rows = {f"format: {name}": functools.partial(lambda k, v, rope, kw: format_roundtrip(k, v, **kw), kw=kw)
          for name, kw in FORMAT_POLICIES.items()}
  rows.update({f"lever: {name}": functools.partial(lambda k, v, rope, lev: lever_roundtrip(k, v, lev, rope),
                                                   lev=lev)
               for name, lev in LEVERS.items()})
  return rows


def adjacent_pair_rope(tokens, head_dim, theta=REAL_ROPE_THETA):
  """(forward, inverse) of SmolLM2's RoPE (pairs (2i, 2i + 1), positions 0..T-1) on (T, H, D)."""
  ang = np.arange(tokens)[:, None] * theta ** (-np.arange(0, head_dim, 2) / head_dim)[None]
  cos, sin = np.cos(ang)[:, None], np.sin(ang)[:, None]

  def turn(x, sign):
    x0, x1 = x[..., 0::2], x[..., 1::2]
    return np.stack([x0 * cos - x1 * sign * sin, x0 * sign * sin + x1 * cos], -1).reshape(x.shape)
  return (lambda x: turn(x, 1.0)), (lambda x: turn(x, -1.0))


def real_layers(tokens, layers, sample: bool):
  """({name: (q, k, v)}, {name: rope}, info)."""
  if sample:
    z = np.load(SAMPLE)
    names = sorted({k[1:] for k in z.files})
    acts = {f"L{n}": (z["q" + n].astype(np.float32), z["k" + n].astype(np.float32), z["v" + n].astype(np.float32))
            for n in names}
    info = {"source": os.path.relpath(SAMPLE, ROOT)}
  else:
    from benchmarks import real_activations
    acts, info = real_activations.capture(tokens, layers)
    if info["rope_theta"] != REAL_ROPE_THETA:
      raise ValueError(f"the model's RoPE theta is {info['rope_theta']}, the sample's {REAL_ROPE_THETA}")
    acts = {f"L{l}": a for l, a in acts.items()}
  ropes = {n: adjacent_pair_rope(*a[1].shape[::2]) for n, a in acts.items()}
  return acts, ropes, info


def synthetic_layers(tokens, seeds, heads=4):
  """({name: (q, k, v)}, {name: rope}) from the DiT-like generator and its RoPE tables."""
  from pallas_kernels.testing import dit_qkv
  from pallas_kernels.rope import apply_rope_reference
  rot = (3 * H3_HEAD_DIM) // 4
  out, ropes = {}, {}
  for s in seeds:
    q, k, v, cos, sin = dit_qkv(tokens, heads, H3_HEAD_DIM, prefix_tokens=tokens // 10, rot_dim=rot, seed=s)
    out[f"seed{s}"] = (q[0], k[0], v[0])
    ropes[f"seed{s}"] = (lambda x, c=cos, n=sin: np.asarray(apply_rope_reference(x, c, n, rot)),
                         lambda x, c=cos, n=sin: np.asarray(apply_rope_reference(x, c, -n, rot)))
  return out, ropes


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--tokens", default="2048,4096", help="real-activation lengths")
  ap.add_argument("--synthetic-tokens", type=int, default=4096)
  ap.add_argument("--seeds", default="0,1,2")
  ap.add_argument("--sample", action="store_true", help="only the committed real sample (CI)")
  ap.add_argument("--save-sample", action="store_true", help="write the CI sample from the T=2048 capture")
  ap.add_argument("--rows", default=None, help="only rows whose name starts with one of these comma-separated "
                                             "prefixes (e.g. 'format:'); the default class's row always runs; "
                                             "the scorecard is left alone")
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  rows = all_rows()
  if args.rows:
    prefixes = tuple(p.strip() for p in args.rows.split(","))
    rows = {n: f for n, f in rows.items() if n.startswith(prefixes) or n == "format: all int4"}
  bits = {f"lever: {n}": lev.bits() for n, lev in LEVERS.items()}
  results = {"bits_per_value_d128": bits | {"format v1": Lever().bits(),
                                            "format v2": Lever(param_bits=16, stat_bits=16).bits()}}
  if args.sample:
    layers, ropes, info = real_layers(0, (), True)
    print(f"real sample ({info['source']})", flush=True)
    results["real_sample"] = {"info": info, "rows": evaluate(layers, rows, ropes)}
  else:
    for t in (int(x) for x in args.tokens.split(",")):
      layers, ropes, info = real_layers(t, REAL_LAYERS, False)
      print(f"real activations, T = {t}: {info}", flush=True)
      if args.save_sample and t == 2048:
        os.makedirs(os.path.dirname(SAMPLE), exist_ok=True)
        keep = {f"{r}{n[1:]}": a[:1024].astype(np.float16) for n, qkv in layers.items() if n in ("L7", "L22")
                for r, a in zip("qkv", qkv)}
        np.savez_compressed(SAMPLE, **keep)
      per_head = [] if args.rows else per_head_rows(layers)
      results[f"real_{t}"] = {"info": info, "rows": evaluate(layers, rows, ropes) + per_head}
    t = args.synthetic_tokens
    print(f"DiT-like synthetic, T = {t}", flush=True)
    layers, ropes = synthetic_layers(t, [int(s) for s in args.seeds.split(",")])
    results[f"synthetic_{t}"] = {"rows": evaluate(layers, rows, ropes)}
  out = args.out or os.path.join(common.RESULTS, f"kv_quality_{'sample_' if args.sample else ''}"
                                                 f"{__import__('datetime').date.today().isoformat()}.json")
  common.write_json(out, common.run_record() | results)
  if not args.sample and not args.rows:   # a partial run leaves the scorecard alone
    real = {r["row"]: r for r in results[f"real_{max(int(x) for x in args.tokens.split(','))}"]["rows"]}
    synth = {r["row"]: r for r in results[f"synthetic_{t}"]["rows"]}
    common.update_scorecard({"quality.real_median_cos_default": round(real["format: all int4"]["median_cos"], 5),
                             "quality.real_worst_cos_default": round(real["format: all int4"]["worst_cos"], 5),
                             "quality.bits_per_value_default": Lever(param_bits=16, stat_bits=16).bits(),
                             "quality.synthetic_min_cos_int4_4096" if t == 4096 else f"quality.synthetic_min_cos_int4_{t}":
                                 round(synth["format: all int4"]["worst_cos"], 5)},
                            card="cpu (float32 attention)", source=out, command=common.run_record()["command"])


if __name__ == "__main__":
  main()
