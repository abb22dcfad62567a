"""Pick the default K and V quantization schemes by measured attention quality.

Runs on the CPU (quality does not depend on the device): DiT-like q/k/v, rotated,
packed with every (K scheme, V scheme) pair at int4 and int8, dequantized with the
format's reference, then plain float32 softmax attention is compared with the same
attention on the unquantized values.

  python -m benchmarks.quant_schemes [--tokens 4096 --heads 4]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys

import jax
import numpy as np

from pallas_kernels.testing import dit_qkv, quality
from formats import packed_kv as fmt
from formats.reference import attention_f32


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--tokens", type=int, default=4096)
  ap.add_argument("--heads", type=int, default=4)
  ap.add_argument("--head-dim", type=int, default=128)
  ap.add_argument("--seeds", type=int, default=2)
  ap.add_argument("--out", default="benchmarks/results/quant_schemes.json")
  args = ap.parse_args(argv)
  rows = []
  for seed in range(args.seeds):
    q, k, v, _, _ = dit_qkv(args.tokens, args.heads, args.head_dim, prefix_tokens=args.tokens // 10, seed=seed)
    rk = fmt.hadamard_rotation(args.head_dim, 0)
    rv = fmt.hadamard_rotation(args.head_dim, 1)
    qr, kr, vr = q @ rk, k @ rk, v @ rv
    ref = attention_f32(q, k, v)
    for cls in ("int4", "int8"):
      classes = (fmt.CLASS_ID[cls],) * (-(-args.tokens // fmt.BLOCK))
      for ks in fmt.K_SCHEMES:
        for vs in fmt.V_SCHEMES:
          meta = fmt.PackedKVMeta(1, args.heads, args.head_dim, args.tokens, classes, ks, vs)
          kd, vd = fmt.dequantize_reference(fmt.quantize_reference(kr, vr, meta))
          out = attention_f32(qr, kd, vd) @ rv.T
          row = {"seed": seed, "class": cls, "k_scheme": ks, "v_scheme": vs,
                 "k_rel_l2": quality(kd, kr)["rel_l2"], "v_rel_l2": quality(vd, vr)["rel_l2"],
                 **{f"attn_{n}": x for n, x in quality(out, ref).items()}}
          rows.append(row)
          print(f"seed {seed} {cls} K={ks:8s} V={vs:10s} k_err {row['k_rel_l2']:.4f} v_err "
                f"{row['v_rel_l2']:.4f} attn cos {row['attn_cos']:.6f} rel_l1 {row['attn_rel_l1']:.4f}",
                flush=True)
  summary = {}
  for r in rows:
    key = f"{r['class']}/K={r['k_scheme']}/V={r['v_scheme']}"
    summary.setdefault(key, []).append((r["attn_cos"], r["attn_rel_l1"]))
  summary = {k: {"attn_cos_mean": float(np.mean([c for c, _ in v])),
                 "attn_rel_l1_mean": float(np.mean([l for _, l in v]))} for k, v in summary.items()}
  print("\nmean over seeds:")
  for k, v in summary.items():
    print(f"  {k:32s} cos {v['attn_cos_mean']:.6f}  rel_l1 {v['attn_rel_l1_mean']:.4f}")
  os.makedirs(os.path.dirname(args.out), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump({"command": " ".join([sys.executable, "-m", "benchmarks.quant_schemes", *(argv or sys.argv[1:])]),
               "device": platform.processor() or platform.machine(), "jax": jax.__version__,
               "args": vars(args), "rows": rows, "summary": summary}, f, indent=1)


if __name__ == "__main__":
  main()
