"""Float32 jnp reference of Sol attention: the definition the kernels are tested against.

Dense O(T**2) scores over ``formats.dequantize_reference`` K/V: tests only.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from formats import packed_kv as fmt
from pallas_kernels.attention_config import Sol
from pallas_kernels.backend import LOG2E
from pallas_kernels.sol_routing import (BLOCK, _centroids, _pooled_keys, _route_rows, _unrotation, block_lengths,
                                        make_plan, normalize_key_bias)


def sol_attention_reference(q, packed, attention: Sol | None = None, *, key_bias=None, block_len=None,
                            keep_rotated=False):
  """Float32 jnp reference of ``sol_attention`` (same arguments, f32 output).

  A ``Sol`` with ``max_exact=None`` here means no list capacity (the algorithm as
  published); give the kernel's capacity to model its cut. The method and launch
  settings are ignored.
  """
  return _reference(q, packed, attention, key_bias, block_len, keep_rotated)[0]


def sol_exact_blocks_reference(q, packed, attention: Sol | None = None, *, block_len=None):
  """The (B, H, NB, NB) bool matrix of the blocks the reference attends exactly."""
  return _reference(q, packed, attention, None, block_len, False)[1]


def _reference(q, packed, attention, key_bias, block_len, keep_rotated):
  plan = make_plan(q, packed, Sol() if attention is None else attention, uncapped=True)
  if block_len is not None:
    block_lengths(plan.num_tokens, block_len)
  if key_bias is not None:
    key_bias = normalize_key_bias(key_bias, q.shape[0], q.shape[1])
  return _reference_jit(q, packed, key_bias, block_len, plan=plan, keep_rotated=bool(keep_rotated))


@functools.partial(jax.jit, static_argnames=("plan", "keep_rotated"))
def _reference_jit(q, packed, key_bias, block_len, *, plan, keep_rotated):
  meta = packed.meta
  b, t, h, d = q.shape
  nb = plan.num_blocks
  lengths = block_lengths(t, block_len)
  unrotation = _unrotation(meta)
  km, kg, kvar = _pooled_keys(packed, lengths if block_len is not None else None, unrotation)
  kcc = km - kg[:, :, None]
  cen = _centroids(q, lengths)
  j = jnp.arange(nb)
  routed, proxy, _ = _route_rows(cen, kcc, kvar, j.astype(jnp.int32), plan, unrotation)
  s0, s1 = plan.sink_blocks
  q0, q1 = plan.sink_q
  exact = routed | ((j >= s0) & (j < s1))[None, None, None, :] | ((j >= q0) & (j < q1))[None, None, :, None]

  k, v = fmt.dequantize_reference(packed)
  pos = jnp.arange(t)
  blk = pos // BLOCK
  live = (pos % BLOCK) < lengths[blk]
  ls = plan.log2_scale
  s_tok = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k - kg[:, None],
                     precision=lax.Precision.HIGHEST) * ls
  if key_bias is not None:
    s_tok = s_tok + (key_bias * LOG2E)[:, None, None, :]
  ex_tok = exact[:, :, blk][..., blk]                                # (B, H, T, T)
  s_tok = jnp.where(ex_tok & live[None, None, None, :], s_tok, -jnp.inf)
  s_blk = jnp.where(exact[:, :, blk], -jnp.inf, proxy[:, :, blk])    # (B, H, T, NB)
  if not plan.tail:
    s_blk = jnp.full_like(s_blk, -jnp.inf)
  m = jnp.maximum(s_tok.max(-1), s_blk.max(-1))[..., None]
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p_tok = jnp.exp2(s_tok - m)
  p_blk = jnp.exp2(s_blk - m)
  v_live = jnp.where(live[None, :, None, None], v, 0.0)
  num = (jnp.einsum("bhqk,bkhd->bhqd", p_tok, v_live, precision=lax.Precision.HIGHEST)
         + jnp.einsum("bhqn,bhnd->bhqd", p_blk, packed.v_sum.astype(jnp.float32), precision=lax.Precision.HIGHEST))
  den = p_tok.sum(-1) + (p_blk * lengths.astype(jnp.float32)).sum(-1)
  o = (num / jnp.where(den > 0, den, 1.0)[..., None]).transpose(0, 2, 1, 3)
  if not keep_rotated:
    r_v = jnp.asarray(fmt.hadamard_rotation(d, meta.rotation_seed_v))
    o = jnp.einsum("bqhd,ed->bqhe", o, r_v, precision=lax.Precision.HIGHEST)
  return o, exact


