"""Sol's kernel over one head group's decoded stores: the exact loop at tensor-core speed.

``sol_attention(method="streamed" | "streamed_int8")`` decodes each head group of the
packed K/V with the one decoder (``kv_dequant``, ``layout="bhtd"``) into plain
(B, g, NB * 64, D) stores, one 64-row slot per block and zeros past T, then runs this
kernel over them. The loop never sees the packed format: it loads whole 64 x D tiles
and multiplies them, which the fused kernel in ``sol.py`` cannot do (its int4 byte holds
channels j and j + D/2, so every tile there is two half-width dots plus a decode).

Semantics are ``sol.sol_attention_reference``'s (the module docstring of ``sol.py``);
``exact_loop_reference`` below states them over the stores, which is what the tests
hold this kernel to.

Kernel layout
-------------
Grid ``(query blocks, g, B)``: one program per 64-row query tile and head.

* Q tile (64 x D) loaded once. ``qk="bf16"``: bf16 dots; the centring by the global key
  mean ``kg`` is a row constant ``q . kg`` taken once, not a subtraction per tile.
  ``qk="int8"``: Q is quantized in registers to int8 per row (absmax / 127) and the
  store holds K - kg as int8 per token (``kv_dequant``'s ``store="int8_k"``), so the
  logits are ``(q8 . k8) * scale_q * scale_k`` from one int8 dot with int32 sums;
  P.V stays bf16.
* Exact loop: the sink range, then the routed list, the next list entry loaded while
  the current tile computes (the only dependent load). A ``sink_q`` block walks
  every key block. Live key rows come from T arithmetically (or a ``block_len``
  table), masked only when some block can be ragged. V is loaded unmasked (rows past T
  are zeros in the store) except under block_len, where the caller's dead rows may hold
  anything, NaN included, and are read as zeros.
* Pooled loop: 64 key blocks per step from the block stats, exactly as in the fused
  kernel but whole-D: logit ``s * c . (k_mean - kg)``, weight = live rows, value the
  block's V sum (two bf16 terms, so the sum keeps ~16 bits).
* One online softmax in base 2. The output is already un-rotated when the decoder
  un-rotated V (and the caller the V sums): there is no pass over it here.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from formats import packed_kv as fmt
from pallas_kernels.backend import M_INIT, NamedInputs, quantize_rows_int8, split_bf16
from pallas_kernels.backend import dot as _dot
from pallas_kernels.sol_routing import pooled_step, walk_exact_blocks

BLOCK = fmt.BLOCK
QK_PRECISIONS = ("bf16", "int8")


@dataclasses.dataclass(frozen=True)
class LoopConfig:
  """Everything static the kernel body needs (hashable)."""
  head_dim: int
  num_tokens: int
  num_blocks: int
  qk_scale: float          # sm_scale * log2(e)
  sink_blocks: tuple
  sink_q: tuple
  tail: bool
  qk: str                  # "bf16" or "int8"
  has_key_bias: bool
  has_block_len: bool

  def __post_init__(self):
    if self.qk not in QK_PRECISIONS:
      raise ValueError(f"qk must be one of {QK_PRECISIONS}, got {self.qk!r}")

  @classmethod
  def from_plan(cls, plan, head_dim: int, qk: str, *, has_key_bias: bool = False, has_block_len: bool = False):
    """The loop's statics from a call's ``sol_routing.SolPlan``."""
    return cls(head_dim=head_dim, num_tokens=plan.num_tokens, num_blocks=plan.num_blocks, qk_scale=plan.log2_scale,
               sink_blocks=plan.sink_blocks, sink_q=plan.sink_q, tail=plan.tail, qk=qk, has_key_bias=has_key_bias,
               has_block_len=has_block_len)


def _kernel(*refs, names, cfg: LoopConfig):
  r = dict(zip(names, refs))
  o_ref = r["out"]
  qb = pl.program_id(0)
  ar = jnp.arange(BLOCK, dtype=jnp.int32)
  q_tile = pl.ds(qb * BLOCK, BLOCK)
  row_live = ((qb * BLOCK + ar) < cfg.num_tokens)[:, None]
  q = plgpu.load(r["q"].at[q_tile, :], mask=row_live, other=0.0)
  qf = q.astype(jnp.float32)
  qks = cfg.qk_scale
  k_ref, v_ref = r["k"], r["v"]
  if cfg.qk == "int8":
    q_op, q_scale = quantize_rows_int8(qf)
    q_scale = q_scale * qks
  else:
    q_op = q
    q_shift = (qf * r["kg"][...][None, :]).sum(-1) * qks   # q . kg: centring as a row constant
  # Rows can be dead only in a ragged last block or under block_len.
  masked = cfg.has_block_len or cfg.num_tokens % BLOCK != 0

  def logits(rows):
    if cfg.qk == "int8":
      raw = lax.dot_general(q_op, k_ref[rows, :], (((1,), (1,)), ((), ())), preferred_element_type=jnp.int32)
      return raw.astype(jnp.float32) * q_scale[:, None] * r["k_scale"][rows][None, :]
    return _dot(q_op, k_ref[rows, :], trans_b=True) * qks - q_shift[:, None]

  def live_rows(blk):
    if cfg.has_block_len:
      return r["lens"][blk]
    return jnp.minimum(cfg.num_tokens - blk * BLOCK, BLOCK)

  def exact_tile(blk, carry):
    m, l, acc = carry
    rows = pl.ds(blk * BLOCK, BLOCK)
    s = logits(rows)
    if cfg.has_key_bias:
      keys = blk * BLOCK + ar
      s = s + plgpu.load(r["kb"].at[rows], mask=keys < cfg.num_tokens, other=0.0)[None, :]
    if masked:
      live = ar < live_rows(blk)
      s = jnp.where(jnp.broadcast_to(live[None, :], (BLOCK, BLOCK)), s, -jnp.inf)
    m_new = jnp.maximum(m, s.max(axis=-1))
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(s - m_new[:, None])
    l = l * alpha + p.sum(axis=-1)
    if cfg.has_block_len:
      # The caller's dead rows inside T are whatever the projection wrote there; their P
      # is 0, but 0 * NaN is not, so they are read as zeros (rows past T are zeros).
      v = plgpu.load(v_ref.at[rows, :], mask=jnp.broadcast_to(live[:, None], (BLOCK, cfg.head_dim)), other=0.0)
    else:
      v = v_ref[rows, :]
    acc = acc * alpha[:, None] + _dot(p.astype(jnp.bfloat16), v)
    return m_new, l, acc

  d = cfg.head_dim
  carry = (jnp.full((BLOCK,), M_INIT, jnp.float32), jnp.zeros((BLOCK,), jnp.float32),
           jnp.zeros((BLOCK, d), jnp.float32))
  nb = cfg.num_blocks
  blocks_ref = r["blocks"]
  carry, count, n_pool_tiles = walk_exact_blocks(exact_tile, carry, blocks_ref, r["counts"], qb, num_blocks=nb,
                                                 sink_blocks=cfg.sink_blocks, sink_q=cfg.sink_q)

  if cfg.tail:
    cen = r["cen"][qb, :]
    c_kg = (cen * r["kg"][...]).sum()

    def pooled(t, state):
      carry, ptr = state
      m, l, acc = carry
      bids = t * BLOCK + ar
      in_range = bids < nb
      tiles = pl.ds(t * BLOCK, BLOCK)
      tmask = jnp.broadcast_to(in_range[:, None], (BLOCK, d))
      km = plgpu.load(r["km"].at[tiles, :], mask=tmask, other=0.0).astype(jnp.float32)
      s = ((km * cen[None, :]).sum(-1) - c_kg) * qks
      m_new, alpha, pb, l, ptr = pooled_step(s, m, l, blocks_ref, r.get("lens"), qb, t, ptr, count, num_blocks=nb,
                                             num_tokens=cfg.num_tokens, sink_blocks=cfg.sink_blocks)
      vs_hi, vs_lo = split_bf16(plgpu.load(r["vs"].at[tiles, :], mask=tmask, other=0.0))
      acc = acc * alpha[:, None] + _dot(pb, vs_hi) + _dot(pb, vs_lo)
      return (m_new, l, acc), ptr

    carry, _ = lax.fori_loop(0, n_pool_tiles, pooled, (carry, jnp.int32(0)))

  _, l, acc = carry
  o = acc * (1.0 / jnp.where(l > 0.0, l, 1.0))[:, None]   # l == 0: nothing to attend, o is 0
  plgpu.store(o_ref.at[q_tile, :], o.astype(o_ref.dtype), mask=row_live)


def sol_over_stores(q, k, k_scale, v, v_sum, kg, blocks, counts, centroid, k_mean, key_bias, lengths,
                    cfg: LoopConfig, *, interpret: bool, num_warps: int = 4, num_stages: int = 2):
  """(B, T, g, D) bf16 Sol output of one head group over its decoded stores.

  q (B, T, g, D) bf16 rotated by R_k; k (B, g, NB*64, D) bf16 (``qk="bf16"``) or int8
  codes of K - kg with ``k_scale`` (B, g, NB*64) f32 (``qk="int8"``); v (B, g, NB*64, D)
  bf16 and v_sum (B, g, NB, D) f32 in the basis the output should have; kg (B, g, D)
  f32; blocks / counts / centroid / k_mean: the group's ``SolRouting`` fields;
  key_bias (B, T) f32 in log2 units or None; lengths (NB,) int32 (block_len) or None.
  """
  b, t, g, d = q.shape
  nb = cfg.num_blocks
  inputs = NamedInputs()
  add = inputs.add
  per_head = lambda n: (lambda i, j, k: (k, j) + (0,) * n)
  add("q", q, (None, t, None, d), lambda i, j, k: (k, 0, j, 0))
  add("k", k, (None, None) + k.shape[2:], per_head(2))
  if cfg.qk == "int8":
    add("k_scale", k_scale, (None, None, k_scale.shape[2]), per_head(1))
  add("v", v, (None, None) + v.shape[2:], per_head(2))
  add("kg", kg, (None, None, d), per_head(1))
  add("blocks", blocks, (None, None) + blocks.shape[2:], per_head(2))
  add("counts", counts, (None, None, nb), per_head(1))
  if cfg.tail:
    add("cen", centroid, (None, None, nb, d), per_head(2))
    add("km", k_mean, (None, None, nb, d), per_head(2))
    add("vs", v_sum, (None, None, nb, d), per_head(2))
  if cfg.has_key_bias:
    add("kb", key_bias, (None, t), lambda i, j, k: (k, 0))
  if cfg.has_block_len:
    inputs.add_whole("lens", lengths)
  return pl.pallas_call(
      functools.partial(_kernel, names=inputs.ref_names("out"), cfg=cfg),
      grid=(nb, g, b),
      in_specs=inputs.specs,
      out_specs=pl.BlockSpec((None, t, None, d), lambda i, j, k: (k, 0, j, 0)),
      out_shape=jax.ShapeDtypeStruct(q.shape, jnp.bfloat16),
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name=f"sol_over_stores_{cfg.qk}",
  )(*inputs.args)


def exact_loop_reference(q, k, k_scale, v, v_sum, kg, blocks, counts, centroid, k_mean, key_bias, lengths,
                         cfg: LoopConfig):
  """Float32 jnp definition of ``sol_over_stores`` (same arguments, f32 output):
  dense O(T**2) scores, the exact set read back from the routing lists. Tests only."""
  b, t, g, d = q.shape
  nb = cfg.num_blocks
  rows = nb * BLOCK
  qks = cfg.qk_scale
  qf = jnp.pad(q.astype(jnp.float32), ((0, 0), (0, rows - t), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
  if cfg.qk == "int8":
    qc, qs = quantize_rows_int8(qf)
    s = jnp.einsum("bhqd,bhkd->bhqk", qc.astype(jnp.float32), k.astype(jnp.float32),
                   precision=lax.Precision.HIGHEST) * (qs * qks)[..., None] * k_scale[:, :, None, :]
  else:
    kc = k.astype(jnp.float32)
    s = (jnp.einsum("bhqd,bhkd->bhqk", qf, kc, precision=lax.Precision.HIGHEST)
         - jnp.einsum("bhqd,bhd->bhq", qf, kg, precision=lax.Precision.HIGHEST)[..., None]) * qks
  if key_bias is not None:
    s = s + jnp.pad(key_bias, ((0, 0), (0, rows - t)))[:, None, None, :]
  j = jnp.arange(nb)
  listed = (blocks[..., None] == j) & (jnp.arange(blocks.shape[-1])[:, None] < counts[..., None, None])
  exact = listed.any(-2)                                                   # (B, g, NB, NB)
  s0, s1 = cfg.sink_blocks
  q0, q1 = cfg.sink_q
  exact = exact | ((j >= s0) & (j < s1))[None, None, None, :] | ((j >= q0) & (j < q1))[None, None, :, None]
  if lengths is None:
    lengths = jnp.minimum(t - j * BLOCK, BLOCK)
  pos = jnp.arange(rows)
  live = (pos % BLOCK) < lengths[pos // BLOCK]
  blk = pos // BLOCK
  s = jnp.where(exact[:, :, blk][..., blk] & live, s, -jnp.inf)
  proxy = jnp.einsum("bhnd,bhmd->bhnm", centroid, k_mean.astype(jnp.float32) - kg[:, :, None],
                     precision=lax.Precision.HIGHEST) * qks
  pool = jnp.where(exact | (not cfg.tail), -jnp.inf, proxy)[:, :, blk]     # (B, g, rows, NB)
  m = jnp.maximum(s.max(-1), pool.max(-1))[..., None]
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p, pp = jnp.exp2(s - m), jnp.exp2(pool - m)
  num = (jnp.einsum("bhqk,bhkd->bhqd", p, v.astype(jnp.float32), precision=lax.Precision.HIGHEST)
         + jnp.einsum("bhqn,bhnd->bhqd", pp, v_sum, precision=lax.Precision.HIGHEST))
  den = p.sum(-1) + (pp * lengths.astype(jnp.float32)).sum(-1)
  o = num / jnp.where(den > 0, den, 1.0)[..., None]
  return o.transpose(0, 2, 1, 3)[:, :t]


