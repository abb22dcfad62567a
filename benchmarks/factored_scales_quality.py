"""Quality of int4 K/V formats whose scales factor out of the tensor-core dots (CPU).

Why this exists. On the H200 the Mosaic-GPU kernel's remaining gap to cuDNN is the
conversion of K/V codes to bf16 (benchmarks/NOTES.md, "The levers"): format v1 gives
every K value its own scale (per channel, per 64-key block) and every V value its
token's, so each value costs an unpack and an FMA before the dot, 2 instructions per
value in the PTX. A format whose scales can be applied outside the dots leaves the
converter only the unpack (codes become exact small integers in bf16). Which scale
layouts allow that, and what the kernel would do instead:

* K ``chS``: one (scale, zero) per channel, constant over a super-block of S keys.
  q.k = (q * s) . code + q . z: the compute warpgroups rescale their Q tile once per S
  keys (rounded to bf16, which this study simulates), and q . z is one bias per row
  and super-block. S = 64 is format v1's K, where that rescale would cost more than
  the conversion it saves; from S = 256 on it is amortized over two or more key steps.
* K ``blk64``: one (scale, zero) for all channels of a 64-key block: a scalar per
  block on the logits, free in the softmax's FMA.
* K ``tok`` (softmax-exact smoothed): one (scale, zero) per key, after subtracting the
  per-channel mean over all keys (a per-row constant in the logits): one multiply per
  logit on the compute warpgroups.
* V ``chS``: one (scale, zero) per channel per super-block of S keys:
  P v = s * (P code) + z * rowsum(P), applied when the softmax leaves a super-block,
  to a second accumulator.
* V ``tok``: format v1's V (one per token; into P: one multiply per probability).

Only quality is measured here: fake-quantized K/V (the format's asymmetric 16-level
rounding), float32 softmax attention, against float32 attention on the unquantized
values, on the DiT-like data of ``benchmarks.quality.dit_qkv``. Whether the cheaper
conversion delivers its speed is a GPU question this file does not answer.

  python -m benchmarks.factored_scales_quality [--tokens 4096 --heads 4 --seeds 0 1 2]

Writes benchmarks/results/factored_scales_quality.json (or --out) and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import formats as fmt  # noqa: E402
from benchmarks.quality import dit_qkv, fake_quant, group_scale_zero, quality  # noqa: E402
from benchmarks.common import package_versions  # noqa: E402

GOAL_INT4 = {"cos": 0.999, "rel_l1": 0.05}


def _ragged(fn, x, tok_group, *args, **kw):
  """fn over x's token axis in groups of tok_group, the last group possibly short
  (edge padding adds no new min/max, so the short group is quantized on its own)."""
  t = x.shape[1]
  pad = -t % tok_group
  xp = np.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0)), mode="edge") if pad else x
  out = fn(xp, tok_group, *args, **kw)
  return tuple(o[:, :t] for o in out) if isinstance(out, tuple) else out[:, :t]


def quantize_case(x, spec: str):
  """Fake-quantized int4 x (B, T, H, D) for a spec: 'chS', 'blk64', 'tok', 'tok_smoothed'.
  Returns (dequantized, per-value scale for a Q rescale or None)."""
  d = x.shape[-1]
  if spec.startswith("ch"):
    s = int(spec[2:])
    scale, _ = _ragged(group_scale_zero, x, s, 1)
    return _ragged(fake_quant, x, s, 1), scale
  if spec == "blk64":
    return _ragged(fake_quant, x, 64, d), None
  if spec == "tok":
    return fake_quant(x, 1, d), None
  if spec == "tok_smoothed":
    mu = x.mean(axis=1, keepdims=True)
    return fake_quant(x - mu, 1, d) + mu, None
  raise ValueError(f"unknown spec {spec!r}")


def attention(q, k, v, sm_scale, *, k_scale=None, k_group=None, split=0, chunk=512):
  """float32 softmax attention (B, T, H, D). With k_scale (per-value scales of keys
  [split, T), constant over groups of k_group keys counted from split), the logits of
  each group use q' = bf16(q * s) / s: what a kernel that rescales its bf16 Q tile by
  the group's scales computes. Keys before split (the int8 prefix) use q as is."""
  tk = k.shape[1]
  outs = []
  for i in range(0, q.shape[1], chunk):
    qc = np.asarray(q[:, i:i + chunk], np.float32)
    if k_scale is None:
      s = np.einsum("bqhd,bkhd->bhqk", qc, k)
    else:
      parts = [np.einsum("bqhd,bkhd->bhqk", qc, k[:, :split])]
      for g0 in range(0, tk - split, k_group):
        sg = k_scale[:, g0:g0 + 1]                      # (B, 1, H, D): constant over the group
        qg = np.asarray(jnp.asarray(qc * sg, jnp.bfloat16), np.float32) / sg
        parts.append(np.einsum("bqhd,bkhd->bhqk", qg, k[:, split + g0:split + g0 + k_group]))
      s = np.concatenate(parts, axis=-1)
    s = s * sm_scale
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    outs.append(np.einsum("bhqk,bkhd->bqhd", p, v))
  return np.concatenate(outs, axis=1)


# (name, K spec, V spec, V rotated?, simulate the bf16 Q rescale?)
CASES = (
    ("v1: K ch64, V tok", "ch64", "tok", True, False),
    ("K ch256, V tok", "ch256", "tok", True, False),
    ("K ch256 (bf16 Q rescale), V tok", "ch256", "tok", True, True),
    ("K ch1024, V tok", "ch1024", "tok", True, False),
    ("K ch1024 (bf16 Q rescale), V tok", "ch1024", "tok", True, True),
    ("K ch4096, V tok", "ch4096", "tok", True, False),
    ("K blk64, V tok", "blk64", "tok", True, False),
    ("K tok smoothed, V tok", "tok_smoothed", "tok", True, False),
    ("K ch64, V ch256", "ch64", "ch256", True, False),
    ("K ch64, V ch256 unrotated", "ch64", "ch256", False, False),
    ("K ch64, V ch1024", "ch64", "ch1024", True, False),
    ("K ch64, V ch1024 unrotated", "ch64", "ch1024", False, False),
    ("K ch256, V ch256 (bf16 Q rescale)", "ch256", "ch256", True, True),
    ("K ch1024, V ch1024 (bf16 Q rescale)", "ch1024", "ch1024", True, True),
)


def run_seed(t, h, d, prefix, seed, cases, log):
  q, k, v, _, _ = dit_qkv(t, h, d, prefix_tokens=prefix, seed=seed)
  sm_scale = d ** -0.5
  ref = attention(q, k, v, sm_scale)
  r_k, r_v = fmt.hadamard_rotation(d, 0), fmt.hadamard_rotation(d, 1)
  q_bf16 = np.asarray(jnp.asarray(q @ r_k, jnp.bfloat16), np.float32)
  k_rot = (k @ r_k).astype(np.float32)
  v_by_basis = {True: (v @ r_v).astype(np.float32), False: v}
  p = -(-prefix // fmt.BLOCK) * fmt.BLOCK  # mixed policy: the boundary block takes the prefix's class
  k8, v8 = fake_quant(k_rot[:, :p], 64, 1, 255), {r: fake_quant(x[:, :p], 1, d, 255) for r, x in v_by_basis.items()}
  rows = []
  for name, k_spec, v_spec, v_rot, q_rescale in cases:
    for policy in ("int4", "int4+prefix_int8"):
      lo = 0 if policy == "int4" else p        # int4 region; super-blocks start there
      kq, ks = quantize_case(k_rot[:, lo:], k_spec)
      vq, _ = quantize_case(v_by_basis[v_rot][:, lo:], v_spec)
      if lo:
        kq, vq = np.concatenate([k8, kq], 1), np.concatenate([v8[v_rot], vq], 1)
      kw = {"k_scale": ks, "k_group": int(k_spec[2:]), "split": lo} if q_rescale else {}
      out = attention(q_bf16, kq, vq, sm_scale, **kw)
      if v_rot:
        out = out @ r_v.T
      qv = quality(out, ref)
      ok = qv["cos"] >= GOAL_INT4["cos"] and qv["rel_l1"] <= GOAL_INT4["rel_l1"]
      rows.append({"seed": seed, "tokens": t, "case": name, "k": k_spec, "v": v_spec, "v_rotated": v_rot,
                   "q_rescale_bf16": q_rescale, "policy": policy, **qv, "goal": "pass" if ok else "miss"})
      log(f"T={t} seed {seed} {name:38s} {policy:16s} cos {qv['cos']:.6f} rel_l1 {qv['rel_l1']:.4f} "
          f"{rows[-1]['goal']}")
  return rows


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--tokens", type=int, nargs="+", default=[4096])
  ap.add_argument("--heads", type=int, default=4)
  ap.add_argument("--head-dim", type=int, default=128)
  ap.add_argument("--prefix-frac", type=float, default=0.1)
  ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
  ap.add_argument("--cases", nargs="*", default=None, help="case names to run (default all)")
  ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "factored_scales_quality.json"))
  args = ap.parse_args(argv)
  cases = CASES if not args.cases else tuple(c for c in CASES if c[0] in args.cases)
  t0 = time.time()
  rows = []
  for t in args.tokens:
    for seed in args.seeds:
      rows += run_seed(t, args.heads, args.head_dim, int(round(args.prefix_frac * t)), seed, cases,
                       lambda s: print(s, flush=True))
  summary = {}
  for r in rows:
    summary.setdefault(f"T={r['tokens']} | {r['case']} | {r['policy']}", []).append(r)
  summary = {key: {"cos_mean": float(np.mean([r["cos"] for r in rs])), "cos_worst": min(r["cos"] for r in rs),
                   "rel_l1_mean": float(np.mean([r["rel_l1"] for r in rs])),
                   "rel_l1_worst": max(r["rel_l1"] for r in rs), "seeds": [r["seed"] for r in rs],
                   "goal_all_seeds": "pass" if all(r["goal"] == "pass" for r in rs) else "miss"}
             for key, rs in summary.items()}
  result = {
      "command": shlex.join([os.path.basename(sys.executable), "-m", "benchmarks.factored_scales_quality",
                             *(argv if argv is not None else sys.argv[1:])]),
      "shape": {"B": 1, "T": args.tokens, "H": args.heads, "D": args.head_dim, "prefix_frac": args.prefix_frac},
      "goal_int4": GOAL_INT4, "versions": package_versions(), "seconds": round(time.time() - t0, 1),
      "rows": rows, "summary": summary,
  }
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(result, f, indent=1)
  print(f"\n{'T | case | policy':72s} {'cos mean':>9s} {'worst':>9s} {'relL1 mean':>10s} {'worst':>7s} goal")
  for key, s in summary.items():
    print(f"{key:72s} {s['cos_mean']:9.6f} {s['cos_worst']:9.6f} {s['rel_l1_mean']:10.4f} "
          f"{s['rel_l1_worst']:7.4f} {s['goal_all_seeds']}")
  print(f"\nwrote {args.out} in {result['seconds']} s")


if __name__ == "__main__":
  main()
