"""RoPE tables and definitions: MiniMax-H3's partial split-half RoPE (3 axes t/h/w, 16
frequencies each) and the adjacent-pair style of Wan, HunyuanVideo and LTX-Video.

The kernels take full-width tables ``cos, sin`` of shape (T, D) float32 (or (T, H*D),
each head its own frequencies): channels ``[0, rot_dim)`` rotate, the rest pass
through (cos = 1, sin = 0). ``rope(x) = x * cos + partner(x) * sin`` with
``partner(x) = x @ rope_partner_matrix(D, rot_dim, style)``: style ``"half"`` pairs
channel c with c + rot_dim/2, style ``"pairs"`` channel 2i with 2i + 1 (the complex
multiply, with each angle's cos and sin repeated for its pair of channels). The
kernels compute the partner as a small exact bf16 dot because Triton cannot slice a
loaded value.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

STYLES = ("half", "pairs")


def rope_3d_angles(positions_thw, freqs_per_axis: int = 16, theta: float = 1e4) -> np.ndarray:
  """(T, 3) integer (t, h, w) positions -> (T, 3 * freqs_per_axis) float32 angles."""
  pos = np.asarray(positions_thw, np.float64)
  if pos.ndim != 2 or pos.shape[1] != 3:
    raise ValueError(f"positions must be (T, 3) (t, h, w), got {pos.shape}")
  inv_freq = theta ** (-np.arange(freqs_per_axis, dtype=np.float64) / freqs_per_axis)
  return np.concatenate([pos[:, a:a + 1] * inv_freq[None] for a in range(3)], axis=1).astype(np.float32)


def rope_tables(angles, head_dim: int, style: str = "half") -> tuple[np.ndarray, np.ndarray]:
  """(T, rot_dim/2) angles -> full-width (T, head_dim) cos and sin tables, float32:
  angle i on channels i and i + rot_dim/2 (``half``) or 2i and 2i + 1 (``pairs``)."""
  if style not in STYLES:
    raise ValueError(f"RoPE style must be one of {STYLES}, got {style!r}")
  angles = np.asarray(angles, np.float64)
  t, half = angles.shape
  if 2 * half > head_dim:
    raise ValueError(f"rot_dim = {2 * half} exceeds head_dim = {head_dim}")
  cos = np.ones((t, head_dim), np.float64)
  sin = np.zeros((t, head_dim), np.float64)
  if style == "half":
    cos[:, :half] = cos[:, half:2 * half] = np.cos(angles)
    sin[:, :half] = sin[:, half:2 * half] = np.sin(angles)
  else:
    cos[:, 0:2 * half:2] = cos[:, 1:2 * half:2] = np.cos(angles)
    sin[:, 0:2 * half:2] = sin[:, 1:2 * half:2] = np.sin(angles)
  return cos.astype(np.float32), sin.astype(np.float32)


def rope_partner_matrix(head_dim: int, rot_dim: int, style: str = "half") -> np.ndarray:
  """(D, D) matrix P with entries in {-1, 0, 1} such that ``x @ P = partner(x)``:
  ``half``: partner[c] = -x[c + r/2], partner[c + r/2] = x[c] for c < r/2;
  ``pairs``: partner[2i] = -x[2i + 1], partner[2i + 1] = x[2i] for 2i + 1 < r."""
  if style not in STYLES:
    raise ValueError(f"RoPE style must be one of {STYLES} (rotate-half, adjacent pairs), got {style!r}")
  if rot_dim % 2 or not 0 <= rot_dim <= head_dim:
    raise ValueError(f"rot_dim must be even and in [0, {head_dim}], got {rot_dim}")
  p = np.zeros((head_dim, head_dim), np.float32)
  half = rot_dim // 2
  for i in range(half):
    a, b = (i, i + half) if style == "half" else (2 * i, 2 * i + 1)
    p[b, a] = -1.0
    p[a, b] = 1.0
  return p


def apply_rope_reference(x: jax.Array, cos: jax.Array, sin: jax.Array, rot_dim: int,
                         style: str = "half") -> jax.Array:
  """x (..., T, H, D) with tables (T, D) (or (T, H*D): each head its own): the plain
  definition, in float32."""
  x = jnp.asarray(x, jnp.float32)
  t, h, d = x.shape[-3:]
  p = jnp.asarray(rope_partner_matrix(d, rot_dim, style))
  partner = jnp.einsum("...d,de->...e", x, p, precision=jax.lax.Precision.HIGHEST)
  cos = jnp.asarray(cos, jnp.float32).reshape(t, -1, d)
  sin = jnp.asarray(sin, jnp.float32).reshape(t, -1, d)
  return x * cos + partner * sin


def h3_positions(frames: int, height: int, width: int, prefix_tokens: int = 0) -> np.ndarray:
  """(prefix + F*H*W, 3) positions: a conditioning prefix on the t axis, then a video grid."""
  pre = np.stack([np.arange(prefix_tokens), np.zeros(prefix_tokens), np.zeros(prefix_tokens)], 1)
  f, h, w = np.meshgrid(np.arange(frames), np.arange(height), np.arange(width), indexing="ij")
  grid = np.stack([f.ravel() + prefix_tokens, h.ravel(), w.ravel()], 1)
  return np.concatenate([pre, grid], 0).astype(np.int32)
