"""The one float32 softmax attention every reference, test and quality benchmark measures
against. Plain jnp, O(T^2) per query chunk: never a production path."""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

__all__ = ["attention_f32", "attention_lse_f32"]


@functools.partial(jax.jit, static_argnames=("sm_scale",))
def _attend(q, k, v, q_seg, kv_seg, kv_mask, *, sm_scale):
  """(o, lse) of (B, R, Hq, D) queries over (B, T, Hk, D) keys; Hq a multiple of Hk."""
  rep = q.shape[2] // k.shape[2]
  if rep > 1:
    k, v = jnp.repeat(k, rep, 2), jnp.repeat(v, rep, 2)
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=lax.Precision.HIGHEST) * sm_scale
  ok = jnp.ones((q.shape[0], 1, q.shape[1], k.shape[1]), bool)
  if q_seg is not None:
    ok = ok & (q_seg[:, None, :, None] == kv_seg[:, None, None, :])
  if kv_mask is not None:
    ok = ok & kv_mask[:, None, None, :]
  s = jnp.where(ok, s, -jnp.inf)
  m = jnp.max(s, axis=-1, keepdims=True)
  p = jnp.where(ok, jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
  l = p.sum(-1, keepdims=True)
  o = jnp.einsum("bhqk,bkhd->bqhd", p / jnp.where(l > 0, l, 1.0), v, precision=lax.Precision.HIGHEST)
  lse = jnp.where(l[..., 0] > 0, jnp.log(jnp.where(l[..., 0] > 0, l[..., 0], 1.0)) + m[..., 0], -jnp.inf)
  return o, lse


def attention_lse_f32(q, k, v, *, sm_scale=None, q_segment_ids=None, kv_segment_ids=None, kv_mask=None,
                      chunk: int | None = 512):
  """(o, lse): non-causal float32 attention and each row's log-sum-exp of its scaled
  logits ((B, Hq, Tq); -inf for a row that sees no key, whose output is 0).

  q (B, Tq, Hq, D); k, v (B, Tk, Hk, D) with Hq a multiple of Hk (grouped heads), or
  all three without the batch axis. sm_scale: None -> 1/sqrt(D). Segment ids (B, T)
  int: a query sees keys of its own segment; kv_mask (B, Tk) bool: True = valid key.
  ``chunk``: query rows per step (bounds the (Hq, chunk, Tk) scores); None: all at once.
  """
  unbatched = jnp.ndim(q) == 3
  q, k, v = (jnp.asarray(x, jnp.float32) for x in (q, k, v))
  if unbatched:
    q, k, v = q[None], k[None], v[None]
  sm_scale = float(q.shape[-1] ** -0.5 if sm_scale is None else sm_scale)
  tq = q.shape[1]
  step = tq if chunk is None else int(chunk)
  outs, lses = [], []
  for r in range(0, tq, step):
    qs = None if q_segment_ids is None else q_segment_ids[:, r:r + step]
    o, lse = _attend(q[:, r:r + step], k, v, qs, kv_segment_ids, kv_mask, sm_scale=sm_scale)
    outs.append(o)
    lses.append(lse)
  o, lse = (jnp.concatenate(outs, 1), jnp.concatenate(lses, 2)) if len(outs) > 1 else (outs[0], lses[0])
  return (o[0], lse[0]) if unbatched else (o, lse)


def attention_f32(q, k, v, **kw):
  """The output of ``attention_lse_f32`` (same arguments) alone."""
  return attention_lse_f32(q, k, v, **kw)[0]
