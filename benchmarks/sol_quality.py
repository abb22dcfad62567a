"""Where Sol's error comes from: routing basis, K/V precision, or the algorithm (CPU).

  python -m benchmarks.sol_quality                       # T = 4096, 4 heads, D = 128, 3 seeds
  python -m benchmarks.sol_quality --tokens 1024 --seeds 0 --heads 2   # quick

On DiT-like q, k, v (``pallas_kernels.testing.dit_qkv``), every row is Sol at the same
settings against float32 dense attention on the unquantized q, k, v:

* ``peer, own basis``: comfy-kitchen's eager ``sol_attn`` on the bf16 q, k, v as a
  torch caller holds them (exact arithmetic: the algorithm's own error);
* ``peer, rotated basis``: the same on the Hadamard-rotated q, k, v our format stores;
* ``ours bf16 / int8 / int4``: ``sol_attention_reference`` over a PackedKV of that class
  (rotated basis; int4 is format v1's default).

The peer's CUDA kernel adds its own INT8 rounding to the first row; that step needs
the GPU (``bench_sol``). Routing's tau threshold compares block-mean logits, which do
not change under a rotation of q and k together, but the pooled term's variance
estimate is per channel, hence basis dependent: the two peer rows separate the
basis from the precision. Writes ``benchmarks/results/sol_quality_<date>.json``.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from benchmarks import common  # noqa: E402

SETTINGS = {"tau=1": dict(tau=1.0), "tau=0": dict(tau=0.0), "topk 0.1": dict(topk_ratio=0.1)}


def run(tokens, heads, seeds, head_dim=128):
  import jax.numpy as jnp
  import torch
  from comfy_kitchen.backends.eager.sol_attn import sol_attn as peer

  from formats import packed_kv as fmt
  from formats.reference import attention_f32
  from pallas_kernels import Sol, sol
  from pallas_kernels.testing import dit_qkv, quality

  rk, rv = fmt.hadamard_rotation(head_dim, 0), fmt.hadamard_rotation(head_dim, 1)
  bf = lambda x: np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))
  rows = []
  for seed in seeds:
    q, k, v, _, _ = dit_qkv(tokens, heads, head_dim, prefix_tokens=tokens // 8, seed=seed)
    ref = np.asarray(attention_f32(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), sm_scale=head_dim ** -0.5))
    nb = -(-tokens // fmt.BLOCK)
    packs = {}
    for name, cls in (("bf16", 2), ("int8", 1), ("int4", 0)):
      meta = fmt.PackedKVMeta(1, heads, head_dim, tokens, (cls,) * nb)
      packs[name] = fmt.quantize_reference(jnp.asarray(k @ rk), jnp.asarray(v @ rv), meta)
    q_rot = jnp.asarray(q @ rk, jnp.bfloat16)
    for setting, kw in SETTINGS.items():
      t_kw = dict(kw, sink_blocks=[0, -(-tokens // 8) // fmt.BLOCK])
      th = lambda a: torch.from_numpy(np.ascontiguousarray(a))
      outs = {"peer, own basis": peer(th(bf(q)), th(bf(k)), th(bf(v)), **t_kw).numpy(),
              "peer, rotated basis": peer(th(bf(q @ rk)), th(bf(k @ rk)), th(bf(v @ rv)), **t_kw).numpy() @ rv.T}
      exact = {}
      cfg = Sol(**t_kw)  # max_exact None: the reference's uncapped lists, as before
      for name, packed in packs.items():
        out = sol.sol_attention_reference(q_rot, packed, cfg)
        ex = sol.sol_exact_blocks_reference(q_rot, packed, cfg)
        outs[f"ours {name}"] = np.asarray(out, np.float32)
        exact[f"ours {name}"] = float(np.asarray(ex).mean())
      for name, out in outs.items():
        m = quality(out, ref)
        rows.append({"seed": seed, "setting": setting, "row": name, "cos": m["cos"], "rel_l1": m["rel_l1"],
                     "exact_fraction": exact.get(name)})
        print(f"  seed {seed} {setting:8s} {name:20s} cos {m['cos']:.5f} rel L1 {m['rel_l1']:.4f}"
              + (f"  exact blocks {exact[name]:.3f}" if name in exact else ""), flush=True)
  return rows


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--tokens", type=int, default=4096)
  ap.add_argument("--heads", type=int, default=4)
  ap.add_argument("--seeds", default="0,1,2")
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  rows = run(args.tokens, args.heads, [int(s) for s in args.seeds.split(",")])
  summary = {}
  for r in rows:
    summary.setdefault(f"{r['setting']} | {r['row']}", []).append(r["cos"])
  print("\nmedian cos over seeds")
  for key, vals in summary.items():
    print(f"  {key:36s} {np.median(vals):.5f}  (worst {min(vals):.5f})")
  out = args.out or os.path.join(common.RESULTS, f"sol_quality_{datetime.date.today().isoformat()}.json")
  common.write_json(out, common.run_record() | {"tokens": args.tokens, "heads": args.heads, "rows": rows,
                                                "median_cos": {k: float(np.median(v)) for k, v in summary.items()}})


if __name__ == "__main__":
  main()
