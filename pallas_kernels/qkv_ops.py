"""In-kernel building blocks of the QKV projection epilogue, shared by both projection
kernels (``qkv_fused``: GEMM and epilogue in one kernel; ``qkv_epilogue``: the epilogue
over a cuBLAS row chunk).

Every function works on loaded values of one head of one token tile, held as two
channel halves ``lo = [0, D/2)`` and ``hi = [D/2, D)``: Triton cannot slice a loaded
value, and the format's split-half nibble packing is then just ``lo | hi << 4``.

The epilogue dots (RoPE partner, Hadamard rotation) multiply by matrices with
entries in {-1, 0, 1}, exact in BF16. The f32 operand is split into two BF16 terms
(``hi + lo``, 16 significant bits), so the results match the f32 reference to ~1e-5
relative. Measured on random data (T=512, D=128, all int8): with the split, 0.02% of
int8 codes differ from the reference (by one step) and Q's relative error is 1e-4; a
single BF16 pass flips 8-11% of the codes and gives Q an error of 2.8e-3. The
rotation uses the Sylvester structure ``H_D = [[H, H], [H, -H]]``:
``[a, b] @ H_D = [(a + b) @ H, (a - b) @ H]``, two half-size dots instead of four.
RoPE skips the quadrants of its partner matrix that are all zero (one of four at
rot_dim 96, D 128).
"""
from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from formats import packed_kv as fmt
from pallas_kernels import rope
from pallas_kernels.backend import sign_dot, split_bf16

BLOCK = fmt.BLOCK


def load_halves(ref, dh, off=0):
  """ref[off:off+D] of a vector ref as two (1, D/2) f32 rows."""
  return (plgpu.load(ref.at[pl.ds(off, dh)]).astype(jnp.float32)[None, :],
          plgpu.load(ref.at[pl.ds(off + dh, dh)]).astype(jnp.float32)[None, :])


def norm_rope(lo, hi, nw_ref, cos_ref, sin_ref, p_ref, row0, rows, valid, *, dh, layout, quadrants,
              mean_square=None, head=0, added_nw_ref=None, added_rows=None):
  """The layout's QK norm, then its RoPE, on one head's halves.

  ``layout.norm``: ``head`` normalizes by this head's mean square; ``across`` by
  ``mean_square`` (rows,), the token's mean square over all heads, which the caller
  computes (no program sees every head), with this head's slice of the (H*D,) weight;
  ``head_layer`` centres the head's row, normalizes by its variance, then applies the
  (2D,) parameters' weight and bias; ``none`` skips both. ``head`` (traced) picks the weight slice and, with
  ``layout.rope_per_head``, the table columns. ``added_nw_ref`` / ``added_rows`` (rows,)
  bool: joint attention's second norm weight, taken by the rows that are added tokens.
  """
  d = 2 * dh
  if layout.norm != "none":
    if layout.norm == "head_layer":   # LayerNorm: centre the head's row first
      mean = ((jnp.sum(lo, axis=1) + jnp.sum(hi, axis=1)) / d)[:, None]
      lo, hi = lo - mean, hi - mean
    ms = mean_square if layout.norm == "across" else (jnp.sum(lo * lo, axis=1) + jnp.sum(hi * hi, axis=1)) / d
    r = jax.lax.rsqrt(ms + layout.eps)[:, None]
    off = head * d if layout.norm == "across" else 0

    def params(off):   # the norm's (lo, hi) halves at ``off``, the added tokens' on their rows
      p_lo, p_hi = load_halves(nw_ref, dh, off)
      if added_nw_ref is not None:
        a_lo, a_hi = load_halves(added_nw_ref, dh, off)
        p_lo, p_hi = (jnp.where(added_rows[:, None], a, w) for a, w in ((a_lo, p_lo), (a_hi, p_hi)))
      return p_lo, p_hi

    w_lo, w_hi = params(off)
    lo, hi = lo * r * w_lo, hi * r * w_hi
    if layout.norm == "head_layer":   # its bias follows its weight
      b_lo, b_hi = params(d)
      lo, hi = lo + b_lo, hi + b_hi
  if not quadrants:  # rot_dim == 0
    return lo, hi
  m = valid[:, None]
  col = head * d if layout.rope_per_head else 0
  tab = lambda ref, c0: plgpu.load(ref.at[pl.ds(row0, rows), pl.ds(col + c0, dh)], mask=m, other=0.0)
  # rope = y * cos + (y @ P) * sin, with y @ P by quadrant (all-zero quadrants are
  # skipped at trace time). Ordered so that few full tiles are live at once.
  parts = {"lo": split_bf16(lo), "hi": split_bf16(hi)}
  out = {"lo": lo * tab(cos_ref, 0), "hi": hi * tab(cos_ref, dh)}
  for dst, c0 in (("lo", 0), ("hi", dh)):
    partner = None
    for src, dd in quadrants:
      if dd != dst:
        continue
      quad = plgpu.load(p_ref.at[pl.ds(0 if src == "lo" else dh, dh), pl.ds(c0, dh)])
      term = sign_dot(parts[src], quad)
      partner = term if partner is None else partner + term
    if partner is not None:
      out[dst] = out[dst] + partner * tab(sin_ref, c0)
  return out["lo"], out["hi"]


def rotate(lo, hi, h_ref, sign_ref, *, dh):
  """[lo, hi] @ diag(signs) H_D / sqrt(D), with H_D = [[H, H], [H, -H]]."""
  s_lo, s_hi = load_halves(sign_ref, dh)
  u_lo, u_hi = lo * s_lo, hi * s_hi
  h_half = plgpu.load(h_ref)
  scale = 1.0 / math.sqrt(2 * dh)
  return (sign_dot(split_bf16(u_lo + u_hi), h_half) * scale,
          sign_dot(split_bf16(u_lo - u_hi), h_half) * scale)


def add_bias(lo, hi, b_ref, dh, off=0, added_ref=None, added_rows=None):
  """lo/hi + the bias halves; with ``added_ref``, the rows flagged in ``added_rows`` take
  that bias instead (joint attention's added tokens)."""
  if b_ref is None:
    return lo, hi
  b_lo, b_hi = load_halves(b_ref, dh, off)
  if added_ref is not None:
    a_lo, a_hi = load_halves(added_ref, dh, off)
    b_lo, b_hi = (jnp.where(added_rows[:, None], a, b) for a, b in ((a_lo, b_lo), (a_hi, b_hi)))
  return lo + b_lo, hi + b_hi


def store_row(ref, row, col0, vec):
  """ref[row, col0:col0+len(vec)] = vec, through a (1, n) slice (row may be traced)."""
  plgpu.store(ref.at[pl.ds(row, 1), pl.ds(col0, vec.shape[0])], vec[None, :].astype(ref.dtype))


def quantize_store(lo, hi, valid, scheme, width, refs, dh, slot=None):
  """Quantize one block's (64, D/2) halves to ``width``-bit codes (4, 5 or 8) and store
  them with their scales and zeros; ``refs``: the store's refs in ``fmt.store_names``
  order (codes, the fifth-bit plane at width 5, scale, zero).

  Same arithmetic as formats.quantize_reference (asymmetric_params, quantize_codes).
  ``slot``: None when the refs are this block's BlockSpec blocks, else the refs
  are a head's whole arrays and the block goes to slot ``slot``.
  """
  codes_ref, scale_ref, zero_ref = refs[0], refs[-2], refs[-1]
  levels = fmt.CODE_LEVELS[width]
  srow = 0 if slot is None else slot  # channel scheme: one row per slot
  c0 = 0 if slot is None else slot * BLOCK  # token schemes: BLOCK columns per slot
  at_rows = (lambda ref, col, w: ref.at[:, pl.ds(col, w)]) if slot is None else (
      lambda ref, col, w: ref.at[pl.ds(slot * BLOCK, BLOCK), pl.ds(col, w)])
  if scheme == "channel":
    vm = valid[:, None]
    params = []
    for val in (lo, hi):
      mn = jnp.min(jnp.where(vm, val, jnp.inf), axis=0)
      mx = jnp.max(jnp.where(vm, val, -jnp.inf), axis=0)
      params.append(fmt.asymmetric_params(mn, mx, levels))
    (s_lo, z_lo), (s_hi, z_hi) = params
    store_row(scale_ref, srow, 0, s_lo)
    store_row(scale_ref, srow, dh, s_hi)
    store_row(zero_ref, srow, 0, z_lo)
    store_row(zero_ref, srow, dh, z_hi)
    s_lo, z_lo, s_hi, z_hi = s_lo[None, :], z_lo[None, :], s_hi[None, :], z_hi[None, :]
  elif scheme == "token":
    mn = jnp.minimum(jnp.min(lo, axis=1), jnp.min(hi, axis=1))
    mx = jnp.maximum(jnp.max(lo, axis=1), jnp.max(hi, axis=1))
    s, z = fmt.asymmetric_params(mn, mx, levels)
    store_row(scale_ref, 0, c0, s)
    store_row(zero_ref, 0, c0, z)
    s_lo = s_hi = s[:, None]
    z_lo = z_hi = z[:, None]
  else:  # token_g64: one group per half
    s_lo, z_lo = fmt.asymmetric_params(jnp.min(lo, axis=1), jnp.max(lo, axis=1), levels)
    s_hi, z_hi = fmt.asymmetric_params(jnp.min(hi, axis=1), jnp.max(hi, axis=1), levels)
    store_row(scale_ref, 0, c0, s_lo)
    store_row(scale_ref, 1, c0, s_hi)
    store_row(zero_ref, 0, c0, z_lo)
    store_row(zero_ref, 1, c0, z_hi)
    s_lo, z_lo, s_hi, z_hi = s_lo[:, None], z_lo[:, None], s_hi[:, None], z_hi[:, None]
  c_lo = fmt.quantize_codes(lo, s_lo, z_lo, levels).astype(jnp.int32)
  c_hi = fmt.quantize_codes(hi, s_hi, z_hi, levels).astype(jnp.int32)
  if width == 8:
    plgpu.store(at_rows(codes_ref, 0, dh), c_lo.astype(jnp.uint8))
    plgpu.store(at_rows(codes_ref, dh, dh), c_hi.astype(jnp.uint8))
    return
  # The low four bits split-half packed (the int4 layout); width 5 adds the fifth-bit
  # plane, channel c at bit c % 8 of byte c // 8, each half its own D/16 bytes.
  packed = ((c_lo & 0xF) | ((c_hi & 0xF) << 4)).astype(jnp.uint8)
  plgpu.store(codes_ref if slot is None else at_rows(codes_ref, 0, dh), packed)
  if width == 5:
    nb = dh // 8
    plgpu.store(at_rows(refs[1], 0, nb), fmt.pack_bits(c_lo >> 4))
    plgpu.store(at_rows(refs[1], nb, nb), fmt.pack_bits(c_hi >> 4))


def block_stats(lo, hi, stat_ref, blk, valid, *, t, dh, mean):
  """Zero the rows past T, write the block's stat row (K mean or V sum over live
  rows) to row ``blk`` of ``stat_ref``; return the masked halves."""
  # The format zero-pads the tail block; padded rows carry bias/norm residue here.
  vm = valid[:, None]
  lo, hi = jnp.where(vm, lo, 0.0), jnp.where(vm, hi, 0.0)
  s_lo, s_hi = jnp.sum(lo, axis=0), jnp.sum(hi, axis=0)
  if mean:
    count = jnp.minimum(t - blk * BLOCK, BLOCK).astype(jnp.float32)
    s_lo, s_hi = s_lo / count, s_hi / count
  store_row(stat_ref, blk, 0, s_lo)
  store_row(stat_ref, blk, dh, s_hi)
  return lo, hi


def store_width(lo, hi, valid, outs, *, width, scheme, dh, slot):
  """Store one block's halves in the ``width``-bit store of its role: ``outs`` is the
  bf16 store ref (width 16), or the refs of ``fmt.store_names`` (codes...)."""
  if width == 16:
    rows = slice(None) if slot is None else pl.ds(slot * BLOCK, BLOCK)
    plgpu.store(outs.at[rows, pl.ds(0, dh)], lo.astype(outs.dtype))
    plgpu.store(outs.at[rows, pl.ds(dh, dh)], hi.astype(outs.dtype))
  else:
    quantize_store(lo, hi, valid, scheme, width, outs, dh, slot=slot)


def finish_block(lo, hi, stat_ref, outs, blk, valid, *, width, scheme, t, dh, mean, slot):
  """``block_stats`` then ``store_width``."""
  lo, hi = block_stats(lo, hi, stat_ref, blk, valid, t=t, dh=dh, mean=mean)
  store_width(lo, hi, valid, outs, width=width, scheme=scheme, dh=dh, slot=slot)


def rope_quadrants(head_dim, rot_dim, style="half"):
  """(src half, dst half) pairs where the RoPE partner matrix is nonzero."""
  p = rope.rope_partner_matrix(head_dim, rot_dim, style)
  dh = head_dim // 2
  halves = {"lo": slice(0, dh), "hi": slice(dh, head_dim)}
  return tuple((s, d) for s in halves for d in halves if np.any(p[halves[s], halves[d]]))


@dataclasses.dataclass(frozen=True)
class EpilogueConstants:
  """The small constant operands of the epilogue, built once per call.

  ``p_mat``: the (D, D) RoPE partner matrix, bf16 (exact); ``h_half``: the unsigned
  Sylvester H_{D/2}, bf16; ``signs_k`` / ``signs_v``: the (D,) sign vectors of R_k and
  R_v (``diag(s) H_D`` has first column s, since H_D's first column is all ones);
  ``q_norm`` / ``k_norm``: the RMSNorm weights, f32 ((D,) or (H*D,) by the layout;
  a (D,) placeholder without a norm); ``quadrants``: the nonzero (source half,
  destination half) pairs of ``p_mat``; ``layout``: the ``QKVLayout`` (both static).
  """
  p_mat: jax.Array
  h_half: jax.Array
  signs_k: jax.Array
  signs_v: jax.Array
  q_norm: jax.Array
  k_norm: jax.Array
  quadrants: tuple
  layout: object
  added_q_norm: jax.Array | None = None
  added_k_norm: jax.Array | None = None


def epilogue_constants(layout, seed_k, seed_v, q_norm_weight, k_norm_weight, added_weights=None):
  """``added_weights``: joint attention's ``QKVWeights`` of the added tokens, whose norm
  weights (under a norm) ride along as ``added_q_norm`` / ``added_k_norm``."""
  d = layout.head_dim
  sk, sv = (jnp.asarray(fmt.hadamard_signs(d, seed)[:, 0]) for seed in (seed_k, seed_v))
  weight = lambda w: jnp.zeros((d,), jnp.float32) if w is None else jnp.asarray(w, jnp.float32)
  added = {}
  if added_weights is not None and layout.norm != "none":
    added = dict(added_q_norm=weight(added_weights.q_norm_weight), added_k_norm=weight(added_weights.k_norm_weight))
  return EpilogueConstants(
      p_mat=jnp.asarray(rope.rope_partner_matrix(d, layout.rot_dim, layout.rope), jnp.bfloat16),
      h_half=jnp.asarray(fmt.sylvester(d // 2), jnp.bfloat16), signs_k=sk, signs_v=sv,
      q_norm=weight(q_norm_weight), k_norm=weight(k_norm_weight),
      quadrants=rope_quadrants(d, layout.rot_dim, layout.rope), layout=layout, **added)


def class_array_names(cls):
  """PackedKV array names of one class (K's store, then V's), in kernel output order."""
  wk, wv = fmt.CLASS_WIDTHS[cls]
  return fmt.store_names("k", wk) + fmt.store_names("v", wv)
