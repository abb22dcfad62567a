"""Quality metrics and DiT-like synthetic data, shared by tests and benchmarks (and by
users who want to check a format choice on data with a video DiT's structure).

Random Gaussian Q/K/V make attention nearly uniform and routing meaningless, so
quality is measured on data with the structure of a video DiT: tokens on a 3D
(t, h, w) grid carrying smooth fields, QK RMSNorm, per-channel key offsets, a few
outlier channels, 3D partial RoPE and a conditioning prefix with other statistics.
"""
from __future__ import annotations

import numpy as np

from pallas_kernels.rope import apply_rope_reference, h3_positions, rope_3d_angles, rope_tables


def rel_err(out, ref) -> float:
  """||out - ref||_2 / ||ref||_2, in float64."""
  out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
  return float(np.linalg.norm(out - ref) / np.linalg.norm(ref))


def rel_l1(out, ref) -> float:
  """sum|out - ref| / sum|ref|, in float64."""
  out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
  return float(np.abs(out - ref).sum() / np.abs(ref).sum())


def cosine(out, ref) -> float:
  out, ref = np.asarray(out, np.float64).ravel(), np.asarray(ref, np.float64).ravel()
  return float(out @ ref / (np.linalg.norm(out) * np.linalg.norm(ref)))


def quality(out, ref) -> dict:
  return {"cos": cosine(out, ref), "rel_l1": rel_l1(out, ref), "rel_l2": rel_err(out, ref)}


def group_scale_zero(x, tok_group, chan_group, levels=15, symmetric=False, param_bits=16):
  """x (B, T, H, D), T a multiple of tok_group: one (scale, zero) per group of tok_group
  tokens x chan_group channels, broadcast back to x's shape (float32; asymmetric:
  zero = group min; symmetric: zero = -amax). ``param_bits`` 16 rounds them as format
  v2 stores them (``formats.packed_kv.round_params``); 32 keeps float32 (format v1)."""
  x = np.asarray(x, np.float32)
  b, t, h, d = x.shape
  g = x.reshape(b, t // tok_group, tok_group, h, d // chan_group, chan_group)
  if symmetric:
    amax = np.abs(g).max(axis=(2, 5), keepdims=True)
    scale, zero = np.where(amax > 0, 2 * amax / levels, 1.0), -amax
  else:
    zero, hi = g.min(axis=(2, 5), keepdims=True), g.max(axis=(2, 5), keepdims=True)
    scale = np.where(hi > zero, (hi - zero) / levels, 1.0)
  if param_bits == 16:
    f16 = lambda a: np.clip(a, -65504.0, 65504.0).astype(np.float16).astype(np.float32)
    scale, zero = f16(scale), f16(zero)
    scale = np.where(scale > 0, scale, 1.0)
  elif param_bits != 32:
    raise ValueError(f"param_bits must be 16 or 32, got {param_bits}")
  full = lambda a: np.broadcast_to(a, g.shape).reshape(x.shape).astype(np.float32)
  return full(scale), full(zero)


def fake_quant(x, tok_group, chan_group, levels=15, symmetric=False, param_bits=16):
  """x (B, T, H, D) quantized to levels + 1 codes per group (``group_scale_zero``) with
  the format's rounding, returned dequantized in float32."""
  x = np.asarray(x, np.float32)
  scale, zero = group_scale_zero(x, tok_group, chan_group, levels, symmetric, param_bits)
  codes = np.clip(np.floor((x - zero) / scale + 0.5), 0, levels)
  return (codes * scale + zero).astype(np.float32)


def _smooth_field(rng, pos, channels, waves=6):
  """(T, channels) sum of low-frequency sinusoids over normalized (t, h, w)."""
  span = np.maximum(pos.max(0, keepdims=True), 1)
  p = pos / span
  freq = rng.normal(0.0, 2.5, (waves, 3))
  phase = rng.uniform(0, 2 * np.pi, (waves,))
  basis = np.sin(p @ freq.T * np.pi + phase)                 # (T, waves)
  return basis @ rng.normal(0.0, 1.0, (waves, channels)) / np.sqrt(waves)


def _rms_norm(x, weight, eps=1e-5):
  return x / np.sqrt(np.mean(x * x, -1, keepdims=True) + eps) * weight


def dit_grid(num_tokens: int, prefix_tokens: int):
  """A (t, h, w) grid with about num_tokens - prefix video tokens, and its positions."""
  video = num_tokens - prefix_tokens
  hw = max(int(round((video / 8) ** 0.5)), 1)
  frames = -(-video // (hw * hw))
  pos = h3_positions(frames, hw, hw, prefix_tokens)[:num_tokens]
  return pos


def dit_qkv(num_tokens: int, heads: int, head_dim: int, *, batch: int = 1, prefix_tokens: int = 0,
            rot_dim: int | None = None, seed: int = 0, outlier_channels: int = 4):
  """Post-norm, post-RoPE (B, T, H, D) float32 q, k, v with DiT-like structure.

  Returns (q, k, v, cos, sin) where cos/sin are the (T, D) RoPE tables used.
  """
  rng = np.random.default_rng(seed)
  rot_dim = (3 * head_dim) // 4 if rot_dim is None else rot_dim
  pos = dit_grid(num_tokens, prefix_tokens)
  angles = rope_3d_angles(pos, freqs_per_axis=rot_dim // 6) if rot_dim % 6 == 0 else \
      pos[:, :1] * 10000.0 ** (-np.arange(rot_dim // 2) / (rot_dim // 2))
  cos, sin = rope_tables(angles, head_dim)
  out = []
  for role in ("q", "k", "v"):
    per_b = []
    for _ in range(batch):
      latent = 32
      field = _smooth_field(rng, pos.astype(np.float64), latent)
      field += 0.35 * rng.normal(size=field.shape)
      if prefix_tokens:
        field[:prefix_tokens] = 1.5 * rng.normal(size=(prefix_tokens, latent))
      heads_out = []
      for _ in range(heads):
        x = field @ rng.normal(0.0, 1.0 / np.sqrt(latent), (latent, head_dim))
        x += 0.25 * rng.normal(size=x.shape)
        if role == "v":
          x[:, rng.choice(head_dim, outlier_channels, replace=False)] *= 6.0
          heads_out.append(x)
          continue
        weight = 1.0 + 0.2 * rng.normal(size=head_dim)
        weight[rng.choice(head_dim, outlier_channels, replace=False)] *= 4.0
        x = _rms_norm(x, weight)
        if role == "k":
          x += rng.normal(0.0, 1.5, head_dim) * (rng.uniform(size=head_dim) < 0.25)
        heads_out.append(x)
      per_b.append(np.stack(heads_out, 1))
    out.append(np.stack(per_b, 0).astype(np.float32))
  q, k, v = out
  q = np.asarray(apply_rope_reference(q, cos, sin, rot_dim))
  k = np.asarray(apply_rope_reference(k, cos, sin, rot_dim))
  return q, k, v, cos, sin
