"""Precision chosen by measured error (issue 39): ``formats.calibrate`` against the best
uniform policy at the same bits, on real activations, held out (CPU).

  python3 -m benchmarks.kv_calibration            # SmolLM2, 6 layers, T = 2048 (~3 min)
  python3 -m benchmarks.kv_calibration --sample   # the committed 2-layer sample (CI)
  python3 -m benchmarks.kv_calibration --base k5v4 --upgrade int8 --max-bits 5.5   # the 5-bit classes

Calibration samples: the six layers of ``kv_quality`` (SmolLM2-135M, post-RoPE q, k,
v), tokens 0..T-1 of the text. Evaluation: the same layers on held-out tokens
4096..4096+T-1, a fresh sequence, so the policy is judged on text it did not see.
Attention is non-causal float32 (as a DiT's), its output compared by cos with the
exact one; K/V go through the format's own reference (v2).

Rows, each at its own average bits per value (D = 128):
* all int4: the default class;
* calibrated: ``calibrate(max_bits=5.25)``, int8 token ranges per layer, worst layer
  first;
* uniform: the same int8 ranges in every layer, chosen by the gains summed over the
  layers, as many as the calibrated policy's bits allow: the best policy that does
  not tell layers apart;
* all int8.
Writes ``results/kv_calibration_<date>.json`` and the scorecard's
``quality.calibrated_*`` entries.
"""
from __future__ import annotations

import argparse
import datetime
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

from benchmarks import common  # noqa: E402
from benchmarks.kv_quality import REAL_LAYERS, real_layers  # noqa: E402
from formats.reference import attention_f32  # noqa: E402
from formats.calibration import (BASE, UPGRADE, PrecisionPolicy, attention_cos, calibrate,  # noqa: E402
                                 class_bits, report_key, storage_roundtrip)

HELD_OUT_START = 4096


def evaluate(policy: PrecisionPolicy, layers: dict, refs: dict) -> dict:
  """Measured cos per layer with the policy's classes (against ``refs``, each layer's
  exact attention), median, worst, bits."""
  cos = {}
  for key, (q, k, v) in layers.items():
    kd, vd = storage_roundtrip(k, v, policy.block_classes(key))
    cos[report_key(key)] = attention_cos(attention_f32(q, kd, vd), refs[key])
  vals = list(cos.values())
  return {"cos": cos, "median_cos": float(np.median(vals)), "worst_cos": float(min(vals)),
          "bits_per_value": policy.bits_per_value(1, 128)}


def uniform_policy(calibrated: PrecisionPolicy, keys, max_bits: float) -> PrecisionPolicy:
  """The same upgrade ranges in every layer, ranked by the calibration's gains summed
  over layers, as many as ``max_bits`` allows (the calibrated policy's own budget)."""
  rep = calibrated.report
  gains = np.sum([rep["gains"][report_key(k)] for k in keys], axis=0)
  unit = rep["range_tokens"]
  t = calibrated.num_tokens
  spans = [(a, min(a + unit, t)) for a in range(0, t, unit)]
  up, base = class_bits(calibrated.upgrade), class_bits(calibrated.base)
  budget = (max_bits - base) / (up - base) * t       # upgraded tokens per layer
  chosen, used = [], 0
  for i in np.argsort(-gains):
    a, b = spans[i]
    if used + (b - a) > budget:
      continue
    chosen.append((a, b))
    used += b - a
  return PrecisionPolicy(t, {key: tuple(sorted(chosen)) for key in keys}, base=calibrated.base,
                         upgrade=calibrated.upgrade)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--tokens", type=int, default=2048)
  ap.add_argument("--max-bits", type=float, default=5.25)
  ap.add_argument("--range-blocks", type=int, default=1, help="token-range unit in 64-token blocks")
  ap.add_argument("--base", default=BASE, help="the class below (formats.CLASSES)")
  ap.add_argument("--upgrade", default=UPGRADE, help="the class the calibration spends bits on")
  ap.add_argument("--sample", action="store_true", help="the committed 2-layer sample, first half calibrates, "
                                                        "second half evaluates (T = 512)")
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  if args.sample:
    layers, _, info = real_layers(0, (), True)
    half = next(iter(layers.values()))[0].shape[0] // 2
    calib = {n: tuple(a[:half] for a in qkv) for n, qkv in layers.items()}
    held = {n: tuple(a[half:2 * half] for a in qkv) for n, qkv in layers.items()}
    info |= {"calibrate_tokens": [0, half], "held_out_tokens": [half, 2 * half]}
  else:
    from benchmarks import real_activations
    t = args.tokens
    calib, info_c = real_activations.capture(t, REAL_LAYERS, start=0)
    held, info_h = real_activations.capture(t, REAL_LAYERS, start=HELD_OUT_START)
    info = {"calibrate": info_c, "held_out": info_h}
  print(f"calibration data: {info}", flush=True)
  # Bits counted at H3's head dim 128, as kv_quality and kv_perplexity count them.
  pol = calibrate(calib, max_bits=args.max_bits, range_blocks=args.range_blocks, bits_head_dim=128,
                  base=args.base, upgrade=args.upgrade)
  keys = list(calib)
  t = pol.num_tokens
  all_base = PrecisionPolicy(t, {k: () for k in keys}, base=args.base, upgrade=args.upgrade)
  all_upgrade = PrecisionPolicy(t, {k: ((0, t),) for k in keys}, base=args.base, upgrade=args.upgrade)
  uni = uniform_policy(pol, keys, args.max_bits)
  refs = {where: {key: attention_f32(*qkv) for key, qkv in layers.items()}
          for where, layers in (("calibration tokens", calib), ("held-out tokens", held))}
  rows = []
  for name, p in ((f"all {args.base}" + (" (default)" if args.base == "int4" else ""), all_base),
                  (f"calibrated (max_bits {args.max_bits})", pol), ("uniform, same bits", uni),
                  (f"all {args.upgrade}", all_upgrade)):
    for where, layers in (("calibration tokens", calib), ("held-out tokens", held)):
      rows.append({"policy": name, "data": where, **evaluate(p, layers, refs[where])})
  print(common.table(rows, [("policy", "policy", "{}"), ("data", "data", "{}"), ("bits", "bits_per_value", "{:.3f}"),
                            ("median cos", "median_cos", "{:.5f}"), ("worst cos", "worst_cos", "{:.5f}")]))
  out = args.out or os.path.join(common.RESULTS, f"kv_calibration_{'sample_' if args.sample else ''}"
                                                 f"{datetime.date.today().isoformat()}.json")
  common.write_json(out, common.run_record() | {"info": info, "base_class": args.base,
                                                "upgrade_class": args.upgrade, "rows": rows,
                                                "policy": PrecisionPolicy.from_json(pol.to_json()).to_json(),
                                                "uniform_ranges": [list(r) for r in uni.ranges[keys[0]]]})
  if not args.sample:
    pick = {(r["policy"].split(" (")[0].split(",")[0], r["data"]): r for r in rows}
    cal, un = pick[("calibrated", "held-out tokens")], pick[("uniform", "held-out tokens")]
    bits = f"{args.max_bits:g}".replace(".", "p")
    entries = {f"quality.calibrated_worst_cos_{bits}bits": round(cal["worst_cos"], 5)}
    if (args.base, args.upgrade) == (BASE, UPGRADE):   # issue 39's comparison: int8 ranges on int4
      entries["quality.calibrated_worst_cos_gain"] = round(cal["worst_cos"] - un["worst_cos"], 5)
    common.update_scorecard(entries, card="cpu (float32 attention)", source=out, command=common.run_record()["command"])
  return rows


if __name__ == "__main__":
  main()
