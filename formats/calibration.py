"""Precision chosen by measured error: ``calibrate`` picks which token ranges of which
layers (and timesteps) are stored in a higher class (``upgrade``, int8 by default)
rather than the base class (``base``, int4 by default), from a few calibration
samples, and returns the choice as a ``PrecisionPolicy`` that the JAX layer and the
torch module accept (``policy.block_classes(key, num_tokens)``).

How it measures. For every sample (one layer, or one layer at one timestep) it runs
float32 attention (non-causal, as a DiT's) three ways: on the exact q, k, v (the
reference), with all of K and V stored in the base class through the format's own
reference (``quantize_reference`` -> ``dequantize_reference``, rotation included), and
once per token range with that range alone in the upgrade class. The last gives each
range's measured gain, the drop in the attention output's error ``1 - cos`` when that
range is upgraded. Gains of several ranges are treated as additive when the policy is built (a
first-order estimate; every reported figure is measured again on the final policy).

How it chooses. Spending ``(upgrade bits - base bits) x range tokens`` bits per
upgrade (``class_bits``: int8 8.625, k5v5 5.625, k5v4 5.125, int4 4.625 at D = 128,
K and V together), it repeatedly upgrades the best
remaining range, by gain per bit, of the sample whose estimated cos is lowest: the
worst layer first, since the worst layer is what a model feels. It stops when the
average over all samples would pass ``max_bits``, or when every sample's estimate
reaches ``target_cos`` (the fewest bits that meet it).

What it cannot choose: a class per head. The format stores one class per 64-token
block for all heads of a call (FORMAT.md), so heads share their block's class.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Hashable, Mapping

import jax.numpy as jnp
import numpy as np

from formats import packed_kv as fmt
from formats.reference import attention_f32

__all__ = ["PrecisionPolicy", "attention_cos", "calibrate", "class_bits", "report_key",
           "storage_roundtrip"]

UPGRADE = "int8"   # the default upgrade class
BASE = "int4"      # the default base class


# --------------------------------------------------------------------------------------
# The policy: data the layer and the module accept
# --------------------------------------------------------------------------------------
def report_key(key) -> str:
  """A calibration key as the report's and the JSON's string key (layer 3 -> "3",
  (3, 0.5) -> "[3, 0.5]")."""
  return json.dumps(key if not isinstance(key, tuple) else list(key))


def _key_from_str(s: str):
  k = json.loads(s)
  return tuple(k) if isinstance(k, list) else k


@dataclasses.dataclass(frozen=True)
class PrecisionPolicy:
  """Per-key token ranges in the ``upgrade`` class on a ``base`` class (int8 on int4
  by default), for sequences of ``num_tokens``.

  ``ranges`` maps a key (a layer index, or a ``(layer, timestep)`` tuple: whatever
  the calibration samples were keyed by) to ``((start, end), ...)`` token ranges
  stored in ``upgrade``. ``block_classes(key, num_tokens)`` gives the per-block classes;
  ``formats.KVStorage(policy=policy, policy_key=key)`` is how ``streamed_qkv``,
  ``attention_layer`` and the torch module take them. ``report``
  carries the calibration's measured figures (JSON-safe).
  """
  num_tokens: int
  ranges: Mapping[Hashable, tuple]
  report: Mapping = dataclasses.field(default_factory=dict, compare=False)
  base: str = BASE
  upgrade: str = UPGRADE

  def __post_init__(self):
    for name in ("base", "upgrade"):
      if getattr(self, name) not in fmt.CLASS_ID:
        raise ValueError(f"{name} {getattr(self, name)!r} is not a class; use one of {fmt.CLASSES}")
    if fmt.class_rank(self.upgrade) <= fmt.class_rank(self.base):
      raise ValueError(f"upgrade {self.upgrade!r} must be a higher class than base {self.base!r} "
                       f"(lowest to highest: {fmt.PRECISION_ORDER})")

  def block_classes(self, key, num_tokens: int | None = None) -> tuple[int, ...]:
    t = self.num_tokens if num_tokens is None else int(num_tokens)
    if t != self.num_tokens:
      raise ValueError(f"this policy was calibrated for T = {self.num_tokens}, not T = {t}: its token ranges "
                       f"are positions in that sequence; calibrate again on samples of {t} tokens")
    if key not in self.ranges:
      raise KeyError(f"no calibrated classes for key {key!r}; the policy knows {sorted(map(str, self.ranges))}")
    return fmt.resolve_block_classes(t, [(a, b, self.upgrade) for a, b in self.ranges[key]], default=self.base)

  def bits_per_value(self, heads: int = 1, head_dim: int = 128) -> float:
    """Average stored bits per K/V value over all keys (at ``head_dim``)."""
    return float(np.mean([fmt.bits_per_value(fmt.PackedKVMeta(1, heads, head_dim, self.num_tokens,
                                                              self.block_classes(k))) for k in self.ranges]))

  def to_json(self) -> str:
    return json.dumps({"num_tokens": self.num_tokens, "base": self.base, "upgrade": self.upgrade,
                       "ranges": {report_key(k): [list(r) for r in v] for k, v in self.ranges.items()},
                       "report": dict(self.report)})

  @staticmethod
  def from_json(text: str) -> "PrecisionPolicy":
    d = json.loads(text)
    return PrecisionPolicy(int(d["num_tokens"]),
                           {_key_from_str(k): tuple(tuple(r) for r in v) for k, v in d["ranges"].items()},
                           d.get("report", {}), d.get("base", BASE), d.get("upgrade", UPGRADE))


# --------------------------------------------------------------------------------------
# Measurement helpers (float32, plain jnp)
# --------------------------------------------------------------------------------------
def attention_cos(out, ref) -> float:
  o, r = np.asarray(out, np.float64).ravel(), np.asarray(ref, np.float64).ravel()
  return float(o @ r / np.sqrt((o @ o) * (r @ r)))


def storage_roundtrip(k, v, block_classes) -> tuple[np.ndarray, np.ndarray]:
  """(T, H, D) float32 K and V through the format (rotate, quantize, dequantize,
  un-rotate) with the given block classes."""
  t, h, d = k.shape
  meta = fmt.PackedKVMeta(1, h, d, t, tuple(block_classes))
  rk = fmt.hadamard_rotation(d, meta.rotation_seed_k)
  rv = fmt.hadamard_rotation(d, meta.rotation_seed_v)
  packed = fmt.quantize_reference(jnp.asarray(k @ rk)[None], jnp.asarray(v @ rv)[None], meta)
  kd, vd = fmt.dequantize_reference(packed)
  return np.asarray(kd[0]) @ rk.T, np.asarray(vd[0]) @ rv.T


def _check_sample(key, sample):
  if not (isinstance(sample, (tuple, list)) and len(sample) == 3):
    raise ValueError(f"sample {key!r} must be a (q, k, v) tuple")
  q, k, v = (np.asarray(a, np.float32) for a in sample)
  if q.ndim == 4:
    if q.shape[0] != 1 or k.shape[0] != 1 or v.shape[0] != 1:
      raise ValueError(f"sample {key!r}: pass one batch row, (1, T, H, D) or (T, H, D); got {q.shape}")
    q, k, v = q[0], k[0], v[0]
  if q.ndim != 3 or k.shape != v.shape or k.ndim != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
    raise ValueError(f"sample {key!r}: q (T, Hq, D), k and v (T, Hk, D) expected, got {q.shape}, {k.shape}, "
                     f"{v.shape}")
  if q.shape[1] % k.shape[1]:
    raise ValueError(f"sample {key!r}: query heads {q.shape[1]} are not a multiple of K/V heads {k.shape[1]}")
  if k.shape[2] not in fmt.SUPPORTED_HEAD_DIMS:
    raise ValueError(f"sample {key!r}: head_dim {k.shape[2]} is not one of {fmt.SUPPORTED_HEAD_DIMS}")
  return q, k, v


# --------------------------------------------------------------------------------------
# Calibration
# --------------------------------------------------------------------------------------
def class_bits(cls: str, head_dim: int = 128) -> float:
  """Stored bits per K/V value of one precision class at ``head_dim``."""
  return fmt.bits_per_value(fmt.PackedKVMeta(1, 1, head_dim, fmt.BLOCK, (fmt.CLASS_ID[cls],)))


def calibrate(samples: Mapping[Hashable, tuple], *, max_bits: float = 5.25, target_cos: float | None = None,
              range_blocks: int = 2, bits_head_dim: int | None = None, base: str = BASE,
              upgrade: str = UPGRADE) -> PrecisionPolicy:
  """Choose ``upgrade`` token ranges on a ``base`` class per sample key to maximize the
  worst key's attention cos.

  samples: ``{key: (q, k, v)}``, each (T, Hq, D) / (T, Hk, D) float32 (or with a
  leading batch axis of 1): post-norm, post-RoPE, un-rotated, as the layer computes
  them, all of the same T. Keys are layer indices or ``(layer, timestep)`` tuples.
  max_bits: the average stored bits per value over all keys (K and V); at least the
  base class's (int4: 4.625 at D = 128). target_cos: stop once every key's estimate reaches it.
  range_blocks: the token-range unit, in 64-token blocks. bits_head_dim: the head dim
  at which bits are counted (default: the samples'; per-token V parameters cost more
  bits per value at D = 64 than at 128).
  base / upgrade: the classes (names) below and above, e.g. ``base="k5v4"``.
  Returns a ``PrecisionPolicy`` whose ``report`` holds each key's measured cos, all
  in the base class and with the policy, the average bits, and the per-range gains.
  """
  if not samples:
    raise ValueError("calibrate needs at least one (q, k, v) sample")
  data = {key: _check_sample(key, s) for key, s in samples.items()}
  ts = {q.shape[0] for q, _, _ in data.values()}
  if len(ts) != 1:
    raise ValueError(f"every sample must have the same T, got {sorted(ts)}")
  t = ts.pop()
  d = next(iter(data.values()))[1].shape[2] if bits_head_dim is None else int(bits_head_dim)
  if d not in fmt.SUPPORTED_HEAD_DIMS:
    raise ValueError(f"bits_head_dim {d} is not one of {fmt.SUPPORTED_HEAD_DIMS}")
  PrecisionPolicy(t, {}, base=base, upgrade=upgrade)    # checks the pair, naming the fix
  base_bits, up_bits = class_bits(base, d), class_bits(upgrade, d)
  if max_bits < base_bits:
    raise ValueError(f"max_bits={max_bits} is below the {base} class's {base_bits:.3f} bits per value")
  if range_blocks < 1:
    raise ValueError(f"range_blocks must be >= 1, got {range_blocks}")
  nb = -(-t // fmt.BLOCK)
  spans = [(i * fmt.BLOCK, min((i + range_blocks) * fmt.BLOCK, t)) for i in range(0, nb, range_blocks)]

  refs, err4, gains = {}, {}, {}
  all4 = fmt.resolve_block_classes(t, default=base)
  for key, (q, k, v) in data.items():
    refs[key] = attention_f32(q, k, v)
    kd, vd = storage_roundtrip(k, v, all4)
    err4[key] = 1.0 - attention_cos(attention_f32(q, kd, vd), refs[key])
    g = []
    for a, b in spans:
      kd, vd = storage_roundtrip(k, v, fmt.resolve_block_classes(t, [(a, b, upgrade)], default=base))
      g.append(err4[key] - (1.0 - attention_cos(attention_f32(q, kd, vd), refs[key])))
    gains[key] = np.asarray(g)

  # Greedy: the key with the worst estimated cos takes its best remaining range per bit.
  keys = list(data)
  budget = (max_bits - base_bits) * len(keys) * t      # extra bit-tokens, summed over keys
  cost = lambda span: (up_bits - base_bits) * (span[1] - span[0])
  est = dict(err4)
  chosen = {key: [] for key in keys}
  left = {key: set(range(len(spans))) for key in keys}
  spent = 0.0
  while True:
    open_keys = [key for key in keys if left[key] and (target_cos is None or 1.0 - est[key] < target_cos)]
    if not open_keys:
      break
    key = max(open_keys, key=lambda kk: est[kk])
    i = max(left[key], key=lambda j: gains[key][j] / cost(spans[j]))
    if spent + cost(spans[i]) > budget + 1e-9:
      # The worst key's best range does not fit: try its cheapest fitting one, else stop.
      fitting = [j for j in left[key] if spent + cost(spans[j]) <= budget + 1e-9]
      if not fitting:
        break
      i = max(fitting, key=lambda j: gains[key][j] / cost(spans[j]))
    left[key].discard(i)
    if gains[key][i] <= 0:
      left[key].clear()   # nothing on this key helps any more
      continue
    chosen[key].append(spans[i])
    est[key] -= gains[key][i]
    spent += cost(spans[i])

  ranges = {key: tuple(sorted(chosen[key])) for key in keys}
  policy = PrecisionPolicy(t, ranges, base=base, upgrade=upgrade)
  measured = {}
  for key, (q, k, v) in data.items():
    kd, vd = storage_roundtrip(k, v, policy.block_classes(key))
    measured[report_key(key)] = attention_cos(attention_f32(q, kd, vd), refs[key])
  report = {"tokens": t, "max_bits": max_bits, "bits_head_dim": d, "target_cos": target_cos,
            "range_tokens": range_blocks * fmt.BLOCK, "base": base, "upgrade": upgrade,
            "cos_all_base": {report_key(k): 1.0 - e for k, e in err4.items()},
            "cos_policy": measured,
            "bits_per_value": policy.bits_per_value(1, d),
            "gains": {report_key(k): [float(x) for x in g] for k, g in gains.items()}}
  return PrecisionPolicy(t, ranges, report, base, upgrade)
