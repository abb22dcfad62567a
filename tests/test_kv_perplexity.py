"""The end-to-end perplexity benchmark's mechanism, without the model download: the
per-layer K/V hook of ``real_activations.SmolLM2`` on a tiny random model of the same
architecture (2 layers, head dim 64 as SmolLM2's, grouped heads), and the storages'
bit counts against the issue's table."""
import numpy as np
import pytest

from benchmarks import kv_perplexity as kvp
from benchmarks.real_activations import SmolLM2

TOKENS = 96   # one full 64-token group and one partial: the padding path runs too


@pytest.fixture(scope="module")
def tiny():
  rng = np.random.default_rng(0)
  vocab, hidden, ffn, layers = 64, 128, 96, 2
  normal = lambda *shape: (rng.normal(size=shape) / np.sqrt(shape[-1])).astype(np.float32)
  w = {"token_embd.weight": rng.normal(size=(vocab, hidden)).astype(np.float32),
       "output_norm.weight": np.ones(hidden, np.float32)}
  for i in range(layers):
    w |= {f"blk.{i}.attn_norm.weight": np.ones(hidden, np.float32), f"blk.{i}.ffn_norm.weight": np.ones(hidden, np.float32),
          f"blk.{i}.attn_q.weight": 2 * normal(hidden, hidden), f"blk.{i}.attn_k.weight": 2 * normal(64, hidden),
          f"blk.{i}.attn_v.weight": normal(64, hidden), f"blk.{i}.attn_output.weight": normal(hidden, hidden),
          f"blk.{i}.ffn_gate.weight": normal(ffn, hidden), f"blk.{i}.ffn_up.weight": normal(ffn, hidden),
          f"blk.{i}.ffn_down.weight": normal(hidden, ffn)}
  model = SmolLM2.from_weights(w, heads=2, kv_heads=1, theta=1e4, eps=1e-5)
  return model, rng.integers(0, vocab, TOKENS).astype(np.int32)


def test_hook_sees_every_layer_post_rope_and_identity_changes_nothing(tiny):
  model, ids = tiny
  seen = {}

  def identity(layer, k, v):
    seen[layer] = (k.copy(), v.copy())
    return k, v
  ref = np.asarray(model.logits(ids))
  assert np.array_equal(np.asarray(model.logits(ids, identity)), ref)
  assert sorted(seen) == [0, 1]
  captured = model.capture(ids, (0, 1))
  for layer, (k, v) in seen.items():   # what the hook gets is capture's post-RoPE k, v
    np.testing.assert_array_equal(k, captured[layer][1])
    np.testing.assert_array_equal(v, captured[layer][2])


def test_storages_move_logits_by_their_precision(tiny):
  model, ids = tiny
  rows = kvp.storages()
  ref = np.asarray(model.logits(ids))
  err = {}
  for name in ("bf16", "v2 int8", "v2 int4", "int4 16-bit + K pre-RoPE + V32"):
    out = np.asarray(model.logits(ids, kvp.kv_store_for(rows[name], TOKENS, model)))
    err[name] = float(np.abs(out - ref).max() / np.abs(ref).max())
  assert 0 < err["bf16"] < 2e-2 and 0 < err["v2 int8"] < 2e-2
  assert err["v2 int8"] < err["v2 int4"] < 0.3
  assert 0 < err["int4 16-bit + K pre-RoPE + V32"] < 0.3
  # Causal: with K/V as computed, a prefix's logits do not depend on what follows it.
  np.testing.assert_allclose(np.asarray(model.logits(ids[:64])), ref[:64], rtol=1e-4, atol=1e-4)


def test_scores_and_summary(tiny):
  model, ids = tiny
  logits, ref = kvp.window_scores(model, ids)
  assert ref["nll"].shape == (TOKENS - 1,) and np.all(ref["kl"] == 0) and ref["top1_same"].all()
  store = kvp.kv_store_for(kvp.storages()["v2 int4"], TOKENS, model)
  _, q = kvp.window_scores(model, ids, store, logits)
  assert np.all(q["kl"] > -1e-6) and q["kl"].mean() > 0
  s = kvp.summarize({"bf16": ref["nll"], "q": q["nll"]}, "bf16")
  assert s["bf16"]["delta_pct"] == 0
  assert np.isclose(s["q"]["ppl"] / s["bf16"]["ppl"] - 1, s["q"]["delta_pct"] / 100)


def test_bits_are_the_issue_table():
  bits = {n: s.bits for n, s in kvp.storages().items()}
  assert bits["v1 int4"] == 5.25 and bits["v2 int4"] == bits["int4 16-bit"] == 4.625
  assert bits["int4 16-bit + K32 + codebook + clip"] == 4.875 and bits["K5 V4 16-bit"] == 5.125
  assert bits["K8 V4 16-bit"] == bits["v2 K8 V4"] == 6.625 and bits["v2 int8"] == 8.625
  rows = kvp.storages()
  summary = {n: {"delta_pct": d} for n, d in (("bf16", 0.0), ("v1 int4", 0.4), ("v2 int4", 0.05),
                                              ("v2 int8", 0.01))}
  assert kvp.fewest_bits_within(summary, rows, 0.1) == (4.625, "v2 int4")
  assert kvp.fewest_bits_within(summary, rows, 0.01) == (8.625, "v2 int8")
  assert kvp.fewest_bits_within(summary, rows, 0.001) is None


def test_calibrated_storages_pick_classes_per_layer(tiny, monkeypatch):
  """``--calibrated``: each layer's class from formats.calibrate on the calibration
  tokens, bits the mean of the layers' classes, the round trip at each layer's class
  (a layer at int8 moves its K/V less than at its base)."""
  model, ids = tiny
  # Two policies for a two-layer model: room for exactly one upgraded layer, and none.
  monkeypatch.setattr(kvp, "CALIBRATED", (("one", "k5v4", "int8", (5.125 + 8.625) / 2 + 1e-6),
                                          ("none", "int4", "k5v5", 4.625)))
  rows = kvp.calibrated_storages(model, ids, tokens=TOKENS)
  one, none = rows["one"], rows["none"]
  assert one.bits == (5.125 + 8.625) / 2 and none.bits == 4.625 and one.per_layer
  upgraded = [int(x) for x in one.source.split("int8 in layers [")[1].rstrip("]").split(",") if x.strip()]
  assert len(upgraded) == 1 and "k5v5 in layers []" in none.source
  seen = {}
  store = kvp.kv_store_for(one, TOKENS, model)
  model.logits(ids, lambda layer, k, v: seen.setdefault(layer, (k, v, *store(layer, k, v))) and store(layer, k, v))
  err = {layer: float(np.abs(kd - k).max() / np.abs(k).max()) for layer, (k, v, kd, vd) in seen.items()}
  up, base = upgraded[0], 1 - upgraded[0]
  assert err[up] < 0.2 * err[base], err   # 8-bit steps are 8x finer than 5-bit ones
