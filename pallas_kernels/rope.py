"""Partial split-half RoPE as used by MiniMax-H3 (3 axes t/h/w, 16 frequencies each).

The kernels take full-width tables ``cos, sin`` of shape (T, D) float32: channels
``[0, rot_dim)`` are rotated split-half (channel c pairs with c + rot_dim/2), the
rest pass through (cos = 1, sin = 0). ``rope(x) = x * cos + partner(x) * sin`` with
``partner(x) = x @ rope_partner_matrix(D, rot_dim)``; the kernels compute the
partner as a small exact bf16 dot because Triton cannot slice a loaded value.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def rope_3d_angles(positions_thw, freqs_per_axis: int = 16, theta: float = 1e4) -> np.ndarray:
  """(T, 3) integer (t, h, w) positions -> (T, 3 * freqs_per_axis) float32 angles."""
  pos = np.asarray(positions_thw, np.float64)
  if pos.ndim != 2 or pos.shape[1] != 3:
    raise ValueError(f"positions must be (T, 3) (t, h, w), got {pos.shape}")
  inv_freq = theta ** (-np.arange(freqs_per_axis, dtype=np.float64) / freqs_per_axis)
  return np.concatenate([pos[:, a:a + 1] * inv_freq[None] for a in range(3)], axis=1).astype(np.float32)


def rope_tables(angles, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
  """(T, rot_dim/2) angles -> full-width (T, head_dim) cos and sin tables, float32."""
  angles = np.asarray(angles, np.float64)
  t, half = angles.shape
  if 2 * half > head_dim:
    raise ValueError(f"rot_dim = {2 * half} exceeds head_dim = {head_dim}")
  cos = np.ones((t, head_dim), np.float64)
  sin = np.zeros((t, head_dim), np.float64)
  cos[:, :half] = cos[:, half:2 * half] = np.cos(angles)
  sin[:, :half] = sin[:, half:2 * half] = np.sin(angles)
  return cos.astype(np.float32), sin.astype(np.float32)


def rope_partner_matrix(head_dim: int, rot_dim: int) -> np.ndarray:
  """(D, D) matrix P with entries in {-1, 0, 1} such that x @ P = partner(x)."""
  if rot_dim % 2 or not 0 <= rot_dim <= head_dim:
    raise ValueError(f"rot_dim must be even and in [0, {head_dim}], got {rot_dim}")
  half = rot_dim // 2
  p = np.zeros((head_dim, head_dim), np.float32)
  for c in range(half):
    p[c + half, c] = -1.0
    p[c, c + half] = 1.0
  return p


def apply_rope_reference(x: jax.Array, cos: jax.Array, sin: jax.Array, rot_dim: int) -> jax.Array:
  """x (..., T, H, D) with tables (T, D): the plain definition, in float32."""
  half = rot_dim // 2
  x = x.astype(jnp.float32)
  x1, x2, rest = x[..., :half], x[..., half:rot_dim], x[..., rot_dim:]
  partner = jnp.concatenate([-x2, x1, jnp.zeros_like(rest)], axis=-1)
  return x * cos[:, None, :] + partner * sin[:, None, :]


def h3_positions(frames: int, height: int, width: int, prefix_tokens: int = 0) -> np.ndarray:
  """(prefix + F*H*W, 3) positions: a conditioning prefix on the t axis, then a video grid."""
  pre = np.stack([np.arange(prefix_tokens), np.zeros(prefix_tokens), np.zeros(prefix_tokens)], 1)
  f, h, w = np.meshgrid(np.arange(frames), np.arange(height), np.arange(width), indexing="ij")
  grid = np.stack([f.ravel() + prefix_tokens, h.ravel(), w.ravel()], 1)
  return np.concatenate([pre, grid], 0).astype(np.int32)
