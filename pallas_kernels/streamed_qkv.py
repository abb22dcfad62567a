"""Streamed fused QKV projection: x @ W_qkv with the whole Q/K/V epilogue fused in.

Out of one pass over ``x`` come Q (BF16, rotated basis) and a ``PackedKV`` (format
v1, ``formats/packed_kv.py``). The full BF16 QKV (T x 3HD) never exists, and no
full-precision copy of all of K or V does either: each program holds one head of
one token tile in registers, finishes it and stores only its final form.

Kernels (Pallas, Triton backend; interpret mode on CPU):

* Q call, grid ``(H, cdiv(T, block_q), B)``. Heads vary fastest, so programs that
  run together share their x tile in L2. Each program runs the GEMM for one head
  (two D/2-channel halves, see below), then RMSNorm -> partial RoPE -> rotation by
  R_k and a masked BF16 store.
* One K/V call per precision class that has blocks, grid ``(H, slots, B)``. A
  program owns one 64-token block (``slot_table[slot]``, an int32 input read in
  the kernel: Pallas-Triton has no scalar prefetch) of one head, computes K and V
  from one x tile, the block stats (K mean, V sum over live tokens), quantizes and
  packs. Codes, scales and zeros go through BlockSpecs indexed by the slot; the
  stats rows are written in place into (B, H, NB, D) buffers that every class call
  aliases, so each block's row is written by exactly the call that owns it.

Triton cannot slice a loaded value, so every head vector lives as two halves
``lo = [0, D/2)`` and ``hi = [D/2, D)``, loaded from and stored to ref slices.
The split-half nibble packing of the format then is just ``lo | hi << 4``.

The epilogue dots (RoPE partner, Hadamard rotation) multiply by matrices with
entries in {-1, 0, 1}, exact in BF16. The f32 operand is split into two BF16
terms (``hi + lo``, 16 significant bits), so the results match the f32 reference
to ~1e-5 relative. Measured on random data (T=512, D=128, all int8): with the
split, 0.02% of int8 codes differ from the reference (by one step) and Q's
relative error is 1e-4; a single BF16 pass flips 8-11% of the codes and gives Q
an error of 2.8e-3. The rotation uses the Sylvester structure
``H_D = [[H, H], [H, -H]]``: ``[a, b] @ H_D = [(a + b) @ H, (a - b) @ H]``, two
half-size dots instead of four. RoPE skips the quadrants of its partner matrix
that are all zero (one of four at rot_dim 96, D 128).

Register pressure (ptxas for sm_90, triton 3.6, H3 shapes): the Q call at
block_q 128 and 4 warps does not spill; the K/V calls hold four 64x64 f32
accumulators and spill inside the GEMM loop at 4 warps, only in the epilogue at 8.
With ``full_width_gemm`` (the default; 112.9 ms vs 153.6 ms on an H200 at T=152263)
both calls need 8 warps to keep the loop spill-free, hence ``DEFAULT_NUM_WARPS``.
Larger programs (opt-in): ``kv_blocks_per_program=2`` (two 64-token blocks share
each W tile, 2 x 64x256 accumulators) stays spill-free in the loop at 8 warps;
``q_heads_per_program=2`` (a 128x256 Q tile) spills inside the loop (~50 STL+LDL
per step at 8 warps, ~30 at 16) because head 1's accumulator stays live through
head 0's epilogue.
"""
from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from formats import packed_kv as fmt
from pallas_kernels import backend, rope
from pallas_kernels.backend import dot, sign_dot, split_bf16

__all__ = ["streamed_qkv", "streamed_qkv_reference", "reference_rotated_qkv"]

BLOCK = fmt.BLOCK


# --------------------------------------------------------------------------------------
# Validation and metadata
# --------------------------------------------------------------------------------------
def _check_inputs(x, w_qkv, bias, q_norm_weight, k_norm_weight, rope_cos, rope_sin, rot_dim,
                  heads, head_dim, block_classes, k_scheme, v_scheme, seed_k, seed_v):
  """Raise ValueError on malformed inputs; return the PackedKVMeta of the output."""
  if head_dim not in fmt.SUPPORTED_HEAD_DIMS:
    raise ValueError(f"head_dim={head_dim} is not supported; use one of {fmt.SUPPORTED_HEAD_DIMS}")
  if not isinstance(heads, (int, np.integer)) or heads <= 0:
    raise ValueError(f"heads must be a positive int, got {heads!r}")
  if x.ndim != 3:
    raise ValueError(f"x must be (B, T, hidden), got shape {tuple(x.shape)}")
  if jnp.dtype(x.dtype) != jnp.bfloat16:
    raise ValueError(f"x must be bfloat16, got {x.dtype}")
  if w_qkv.ndim != 2 or jnp.dtype(w_qkv.dtype) != jnp.bfloat16:
    raise ValueError(f"w_qkv must be a 2-D bfloat16 array, got {w_qkv.dtype}{list(w_qkv.shape)}")
  b, t, hidden = x.shape
  width = 3 * heads * head_dim
  if tuple(w_qkv.shape) != (hidden, width):
    raise ValueError(f"w_qkv must be (hidden, 3*H*D) = {(hidden, width)}, got {tuple(w_qkv.shape)}")
  if bias is not None:
    if tuple(bias.shape) != (width,):
      raise ValueError(f"bias must be (3*H*D,) = ({width},), got {tuple(bias.shape)}")
    if jnp.dtype(bias.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
      raise ValueError(f"bias must be bfloat16 or float32, got {bias.dtype}")
  for name, wgt in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
    if tuple(wgt.shape) != (head_dim,):
      raise ValueError(f"{name} must be ({head_dim},), got {tuple(wgt.shape)}")
  if not isinstance(rot_dim, (int, np.integer)) or rot_dim % 2 or not 0 <= rot_dim <= head_dim:
    raise ValueError(f"rot_dim must be even and in [0, {head_dim}], got {rot_dim!r}")
  for name, tab in (("rope_cos", rope_cos), ("rope_sin", rope_sin)):
    if tuple(tab.shape) != (t, head_dim):
      raise ValueError(f"{name} must be (T, D) = {(t, head_dim)} (full-width table from "
                       f"rope.rope_tables), got {tuple(tab.shape)}")
  if block_classes is None:
    block_classes = (fmt.CLASS_ID["int4"],) * (-(-t // BLOCK))
  return fmt.PackedKVMeta(b, heads, head_dim, t, tuple(int(c) for c in block_classes),
                          k_scheme, v_scheme, int(seed_k), int(seed_v))


# --------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------
def _rms_norm(x, weight, eps):
  return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * weight


_REF_STATIC = ("rot_dim", "heads", "head_dim", "rotation_seed_k", "rotation_seed_v", "eps")


@functools.partial(jax.jit, static_argnames=_REF_STATIC)
def reference_rotated_qkv(x, w_qkv, bias, *, q_norm_weight, k_norm_weight, rope_cos, rope_sin,
                          rot_dim, heads, head_dim, rotation_seed_k=0, rotation_seed_v=1,
                          eps=1e-5):
  """Full float32 (B, T, H, D) q, k, v in the rotated basis, before any rounding.

  Tests and references only: this is exactly the tensor the kernel never builds.
  """
  b, t, _ = x.shape
  hi = jax.lax.Precision.HIGHEST  # GPUs would otherwise use TF32 for f32 matmuls
  y = jnp.dot(x.astype(jnp.float32), w_qkv.astype(jnp.float32), precision=hi)
  if bias is not None:
    y = y + bias.astype(jnp.float32)
  q, k, v = (y.reshape(b, t, 3, heads, head_dim)[:, :, i] for i in range(3))
  cos, sin = jnp.asarray(rope_cos, jnp.float32), jnp.asarray(rope_sin, jnp.float32)
  r_k = jnp.asarray(fmt.hadamard_rotation(head_dim, rotation_seed_k))
  r_v = jnp.asarray(fmt.hadamard_rotation(head_dim, rotation_seed_v))

  def qk_epilogue(z, weight):
    z = _rms_norm(z, jnp.asarray(weight, jnp.float32), eps)
    z = rope.apply_rope_reference(z, cos, sin, rot_dim)
    return jnp.dot(z, r_k, precision=hi)

  return qk_epilogue(q, q_norm_weight), qk_epilogue(k, k_norm_weight), jnp.dot(v, r_v, precision=hi)


@functools.partial(jax.jit, static_argnames=_REF_STATIC + ("block_classes", "k_scheme",
                                                          "v_scheme"))
def streamed_qkv_reference(x, w_qkv, bias=None, *, q_norm_weight, k_norm_weight, rope_cos,
                           rope_sin, rot_dim, heads, head_dim, block_classes=None,
                           k_scheme="channel", v_scheme="token", rotation_seed_k=0,
                           rotation_seed_v=1, eps=1e-5):
  """Plain float32 jnp definition of the kernel. It materializes everything."""
  meta = _check_inputs(x, w_qkv, bias, q_norm_weight, k_norm_weight, rope_cos, rope_sin,
                       rot_dim, heads, head_dim, block_classes, k_scheme, v_scheme,
                       rotation_seed_k, rotation_seed_v)
  q, k, v = reference_rotated_qkv(
      x, w_qkv, bias, q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight,
      rope_cos=rope_cos, rope_sin=rope_sin, rot_dim=rot_dim, heads=heads, head_dim=head_dim,
      rotation_seed_k=rotation_seed_k, rotation_seed_v=rotation_seed_v, eps=eps)
  return q.astype(jnp.bfloat16), fmt.quantize_reference(k, v, meta)


# --------------------------------------------------------------------------------------
# In-kernel building blocks (operate on loaded values; never slice them)
# --------------------------------------------------------------------------------------
def _gemm_halves(x_ref, w_refs, row0s, rows, valids, hidden, bh, dh, full_width, heads=1):
  """x[row0:row0+rows] @ w for each row0 in row0s and each w_ref (hidden, heads*D).

  Returns ``out[r][w]``: a list of ``heads`` (lo, hi) pairs for row tile r and w_ref w.
  Every W tile is loaded once per step and feeds the dots of all row tiles, and one
  x tile feeds all heads: more FLOPs per loaded byte than one tile per program.
  Rows past T are masked to zero, and so is a ragged tail of the hidden dim.
  ``full_width``: run N = heads*D dots and split the accumulator once at the end
  (lax.split lowers to tt.split; plain value slicing has no Triton lowering)
  instead of N = D/2 dots per step. Wider wgmma, but more registers: ptxas
  shows no spill in the loop only at 8 warps.
  """
  ragged_k = hidden % bh != 0
  n_acc = 1 if full_width else 2 * heads
  width = 2 * dh * heads // n_acc
  accs = [[[jnp.zeros((rows, width), jnp.float32)] * n_acc for _ in w_refs] for _ in row0s]

  def body(kk, accs):
    k0 = pl.multiple_of(kk * bh, bh)
    kmask = (k0 + jnp.arange(bh)) < hidden if ragged_k else None
    xts = []
    for row0, valid in zip(row0s, valids):
      xmask = valid[:, None] if kmask is None else valid[:, None] & kmask[None, :]
      xts.append(plgpu.load(x_ref.at[pl.ds(row0, rows), pl.ds(k0, bh)], mask=xmask, other=0.0))
    # Triton rejects `other` without `mask`.
    wkw = {} if kmask is None else dict(mask=kmask[:, None], other=0.0)
    new = [[list(pair) for pair in racc] for racc in accs]
    for w, w_ref in enumerate(w_refs):
      for j in range(n_acc):
        wt = plgpu.load(w_ref.at[pl.ds(k0, bh), pl.ds(j * width, width)], **wkw)
        for r, xt in enumerate(xts):
          new[r][w][j] = new[r][w][j] + dot(xt, wt)
    return new

  accs = jax.lax.fori_loop(0, pl.cdiv(hidden, bh), body, accs)
  out = []
  for racc in accs:
    row = []
    for a in racc:
      parts = jnp.split(a[0], 2 * heads, axis=1) if full_width else a
      row.append([(parts[2 * i], parts[2 * i + 1]) for i in range(heads)])
    out.append(row)
  return out


def _load_halves(ref, dh, off=0):
  """ref[off:off+D] of a vector ref as two (1, D/2) f32 rows."""
  return (plgpu.load(ref.at[pl.ds(off, dh)]).astype(jnp.float32)[None, :],
          plgpu.load(ref.at[pl.ds(off + dh, dh)]).astype(jnp.float32)[None, :])


def _norm_rope(lo, hi, nw_ref, cos_ref, sin_ref, p_ref, row0, rows, valid, *, dh, eps,
               quadrants):
  """RMSNorm(weight) then partial split-half RoPE on one head's halves."""
  ms = (jnp.sum(lo * lo, axis=1) + jnp.sum(hi * hi, axis=1)) / (2 * dh)
  r = jax.lax.rsqrt(ms + eps)[:, None]
  w_lo, w_hi = _load_halves(nw_ref, dh)
  lo, hi = lo * r * w_lo, hi * r * w_hi
  if not quadrants:  # rot_dim == 0
    return lo, hi
  m = valid[:, None]
  tab = lambda ref, c0: plgpu.load(ref.at[pl.ds(row0, rows), pl.ds(c0, dh)], mask=m, other=0.0)
  # rope = y * cos + (y @ P) * sin, with y @ P by quadrant (all-zero quadrants are
  # skipped at trace time). Ordered so that few full tiles are live at once.
  parts = {"lo": split_bf16(lo), "hi": split_bf16(hi)}
  out = {"lo": lo * tab(cos_ref, 0), "hi": hi * tab(cos_ref, dh)}
  for dst, c0 in (("lo", 0), ("hi", dh)):
    partner = None
    for src, d in quadrants:
      if d != dst:
        continue
      quad = plgpu.load(p_ref.at[pl.ds(0 if src == "lo" else dh, dh), pl.ds(c0, dh)])
      term = sign_dot(parts[src], quad)
      partner = term if partner is None else partner + term
    if partner is not None:
      out[dst] = out[dst] + partner * tab(sin_ref, c0)
  return out["lo"], out["hi"]


def _rotate(lo, hi, h_ref, sign_ref, *, dh):
  """[lo, hi] @ diag(signs) H_D / sqrt(D), with H_D = [[H, H], [H, -H]]."""
  s_lo, s_hi = _load_halves(sign_ref, dh)
  u_lo, u_hi = lo * s_lo, hi * s_hi
  h_half = plgpu.load(h_ref)
  scale = 1.0 / math.sqrt(2 * dh)
  return (sign_dot(split_bf16(u_lo + u_hi), h_half) * scale,
          sign_dot(split_bf16(u_lo - u_hi), h_half) * scale)


def _add_bias(lo, hi, b_ref, dh, off=0):
  if b_ref is None:
    return lo, hi
  b_lo, b_hi = _load_halves(b_ref, dh, off)
  return lo + b_lo, hi + b_hi


def _store_row(ref, row, col0, vec):
  """ref[row, col0:col0+len(vec)] = vec, through a (1, n) slice (row may be traced)."""
  plgpu.store(ref.at[pl.ds(row, 1), pl.ds(col0, vec.shape[0])], vec[None, :])


def _quantize_store(lo, hi, valid, scheme, levels, codes_ref, scale_ref, zero_ref, dh,
                    slot=None):
  """Quantize one block's (64, D/2) halves and store codes, scales, zeros.

  Same arithmetic as formats.quantize_reference (asymmetric_params, quantize_codes).
  ``slot``: None when the refs are this block's BlockSpec blocks, else the refs
  are a head's whole arrays and the block goes to slot ``slot``.
  """
  srow = 0 if slot is None else slot  # channel scheme: one row per slot
  c0 = 0 if slot is None else slot * BLOCK  # token schemes: BLOCK columns per slot
  codes = (lambda col, w: codes_ref.at[:, pl.ds(col, w)]) if slot is None else (
      lambda col, w: codes_ref.at[pl.ds(slot * BLOCK, BLOCK), pl.ds(col, w)])
  if scheme == "channel":
    vm = valid[:, None]
    params = []
    for val in (lo, hi):
      mn = jnp.min(jnp.where(vm, val, jnp.inf), axis=0)
      mx = jnp.max(jnp.where(vm, val, -jnp.inf), axis=0)
      params.append(fmt.asymmetric_params(mn, mx, levels))
    (s_lo, z_lo), (s_hi, z_hi) = params
    _store_row(scale_ref, srow, 0, s_lo)
    _store_row(scale_ref, srow, dh, s_hi)
    _store_row(zero_ref, srow, 0, z_lo)
    _store_row(zero_ref, srow, dh, z_hi)
    s_lo, z_lo, s_hi, z_hi = s_lo[None, :], z_lo[None, :], s_hi[None, :], z_hi[None, :]
  elif scheme == "token":
    mn = jnp.minimum(jnp.min(lo, axis=1), jnp.min(hi, axis=1))
    mx = jnp.maximum(jnp.max(lo, axis=1), jnp.max(hi, axis=1))
    s, z = fmt.asymmetric_params(mn, mx, levels)
    _store_row(scale_ref, 0, c0, s)
    _store_row(zero_ref, 0, c0, z)
    s_lo = s_hi = s[:, None]
    z_lo = z_hi = z[:, None]
  else:  # token_g64: one group per half
    s_lo, z_lo = fmt.asymmetric_params(jnp.min(lo, axis=1), jnp.max(lo, axis=1), levels)
    s_hi, z_hi = fmt.asymmetric_params(jnp.min(hi, axis=1), jnp.max(hi, axis=1), levels)
    _store_row(scale_ref, 0, c0, s_lo)
    _store_row(scale_ref, 1, c0, s_hi)
    _store_row(zero_ref, 0, c0, z_lo)
    _store_row(zero_ref, 1, c0, z_hi)
    s_lo, z_lo, s_hi, z_hi = s_lo[:, None], z_lo[:, None], s_hi[:, None], z_hi[:, None]
  c_lo = fmt.quantize_codes(lo, s_lo, z_lo, levels).astype(jnp.int32)
  c_hi = fmt.quantize_codes(hi, s_hi, z_hi, levels).astype(jnp.int32)
  if levels == fmt.LEVELS["int4"]:
    packed = (c_lo | (c_hi << 4)).astype(jnp.uint8)
    plgpu.store(codes_ref if slot is None else codes(0, dh), packed)
  else:
    plgpu.store(codes(0, dh), c_lo.astype(jnp.uint8))
    plgpu.store(codes(dh, dh), c_hi.astype(jnp.uint8))


# --------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------
def _q_kernel(*refs, has_bias, quadrants, t, hidden, bq, bh, dh, eps, full_width, qh):
  refs = list(refs)
  x_ref, w_ref = refs.pop(0), refs.pop(0)
  b_ref = refs.pop(0) if has_bias else None
  nw_ref, cos_ref, sin_ref, p_ref, h_ref, sign_ref, q_ref = refs
  row0 = pl.program_id(1) * bq
  valid = (row0 + jnp.arange(bq)) < t
  [[heads]] = _gemm_halves(x_ref, [w_ref], [row0], bq, [valid], hidden, bh, dh, full_width,
                           heads=qh)
  m = valid[:, None]
  for j, (lo, hi) in enumerate(heads):  # one head after the other, as at qh = 1
    lo, hi = _add_bias(lo, hi, b_ref, dh, off=2 * dh * j)
    lo, hi = _norm_rope(lo, hi, nw_ref, cos_ref, sin_ref, p_ref, row0, bq, valid, dh=dh,
                        eps=eps, quadrants=quadrants)
    lo, hi = _rotate(lo, hi, h_ref, sign_ref, dh=dh)
    # q_ref is (T, D) at qh = 1 (head axis squeezed), else (T, qh, D).
    at = (lambda c0: q_ref.at[pl.ds(row0, bq), pl.ds(c0, dh)]) if qh == 1 else (
        lambda c0: q_ref.at[pl.ds(row0, bq), jnp.int32(j), pl.ds(c0, dh)])
    plgpu.store(at(0), lo.astype(q_ref.dtype), mask=m)
    plgpu.store(at(dh), hi.astype(q_ref.dtype), mask=m)


def _kv_kernel(*refs, cls, has_bias, quadrants, k_scheme, v_scheme, t, hidden, bh, dh, eps,
               full_width, nblk, n):
  refs = list(refs)
  tab_ref, x_ref, wk_ref, wv_ref = refs[:4]
  refs = refs[4:]
  bk_ref, bv_ref = (refs.pop(0), refs.pop(0)) if has_bias else (None, None)
  nw_ref, cos_ref, sin_ref, p_ref, h_ref, sk_ref, sv_ref = refs[:7]
  # refs[7:9] are the stats inputs, aliased to the first two outputs.
  kmean_ref, vsum_ref, *outs = refs[9:]
  if nblk == 1:  # outputs are this slot's BlockSpec blocks
    slots = [None]
    blks = [tab_ref[pl.program_id(1)]]
  else:
    # Outputs are a head's whole arrays. With an odd slot count the last program
    # computes its last slot twice and writes the same values twice.
    slots = [jnp.minimum(pl.program_id(1) * nblk + i, n - 1) for i in range(nblk)]
    blks = [tab_ref[s] for s in slots]
  row0s = [blk * BLOCK for blk in blks]
  valids = [(row0 + jnp.arange(BLOCK)) < t for row0 in row0s]
  res = _gemm_halves(x_ref, [wk_ref, wv_ref], row0s, BLOCK, valids, hidden, bh, dh, full_width)
  if cls == "bf16":
    k_out, v_out = outs
  else:
    k_out, v_out = outs[:3], outs[3:]
  for slot, blk, row0, valid, ([(k_lo, k_hi)], [(v_lo, v_hi)]) in zip(slots, blks, row0s,
                                                                      valids, res):
    # K is finished and stored before V's epilogue starts, to keep register use down.
    k_lo, k_hi = _add_bias(k_lo, k_hi, bk_ref, dh)
    k_lo, k_hi = _norm_rope(k_lo, k_hi, nw_ref, cos_ref, sin_ref, p_ref, row0, BLOCK, valid,
                            dh=dh, eps=eps, quadrants=quadrants)
    k_lo, k_hi = _rotate(k_lo, k_hi, h_ref, sk_ref, dh=dh)
    _finish_block(k_lo, k_hi, kmean_ref, k_out, blk, valid, cls=cls, scheme=k_scheme, t=t,
                  dh=dh, mean=True, slot=slot)
    v_lo, v_hi = _add_bias(v_lo, v_hi, bv_ref, dh)
    v_lo, v_hi = _rotate(v_lo, v_hi, h_ref, sv_ref, dh=dh)
    _finish_block(v_lo, v_hi, vsum_ref, v_out, blk, valid, cls=cls, scheme=v_scheme, t=t,
                  dh=dh, mean=False, slot=slot)


def _finish_block(lo, hi, stat_ref, outs, blk, valid, *, cls, scheme, t, dh, mean, slot):
  """Mask the tail, write the block stat row, then the class's stored form."""
  # The format zero-pads the tail block; padded rows carry bias/norm residue here.
  vm = valid[:, None]
  lo, hi = jnp.where(vm, lo, 0.0), jnp.where(vm, hi, 0.0)
  s_lo, s_hi = jnp.sum(lo, axis=0), jnp.sum(hi, axis=0)
  if mean:
    count = jnp.minimum(t - blk * BLOCK, BLOCK).astype(jnp.float32)
    s_lo, s_hi = s_lo / count, s_hi / count
  _store_row(stat_ref, blk, 0, s_lo)
  _store_row(stat_ref, blk, dh, s_hi)
  if cls == "bf16":
    rows = slice(None) if slot is None else pl.ds(slot * BLOCK, BLOCK)
    plgpu.store(outs.at[rows, pl.ds(0, dh)], lo.astype(outs.dtype))
    plgpu.store(outs.at[rows, pl.ds(dh, dh)], hi.astype(outs.dtype))
  else:
    codes_ref, scale_ref, zero_ref = outs
    _quantize_store(lo, hi, valid, scheme, fmt.LEVELS[cls], codes_ref, scale_ref, zero_ref, dh,
                    slot=slot)


# --------------------------------------------------------------------------------------
# Host side
# --------------------------------------------------------------------------------------
def _rope_quadrants(head_dim, rot_dim):
  """(src half, dst half) pairs where the RoPE partner matrix is nonzero."""
  p = rope.rope_partner_matrix(head_dim, rot_dim)
  dh = head_dim // 2
  halves = {"lo": slice(0, dh), "hi": slice(dh, head_dim)}
  return tuple((s, d) for s in halves for d in halves if np.any(p[halves[s], halves[d]]))


def _sylvester(n):
  """Unsigned Sylvester Hadamard matrix H_n (entries +-1), as in formats.hadamard_signs."""
  h = np.ones((1, 1), np.float32)
  while h.shape[0] < n:
    h = np.block([[h, h], [h, -h]])
  return h


# Per-call (Q, K/V) defaults; see the module docstring for the spill measurements.
DEFAULT_NUM_WARPS = (8, 8)
DEFAULT_NUM_STAGES = (3, 3)
DEFAULT_FULL_WIDTH_GEMM = True  # H200, H3 shapes: 112.9 ms vs 153.6 ms for N = D/2 dots


def _per_call(value, default, name):
  """None -> default; an int -> both calls; a pair -> (Q call, K/V calls)."""
  if value is None:
    return default
  if isinstance(value, (int, np.integer)):
    return (int(value), int(value))
  if isinstance(value, tuple) and len(value) == 2:
    return tuple(default[i] if v is None else int(v) for i, v in enumerate(value))
  raise ValueError(f"{name} must be None, an int or a (q, kv) pair, got {value!r}")


def _pow2(n, name):
  if n < 16 or n & (n - 1):
    raise ValueError(f"{name} must be a power of two >= 16, got {n}")


def _class_array_names(cls):
  """PackedKV array names of one class, in kernel output order."""
  if cls == "bf16":
    return ("k_bf16", "v_bf16")
  sfx = "4" if cls == "int4" else "8"
  return tuple(f"{r}_{a}{sfx}" for r in "kv" for a in ("codes", "scale", "zero"))


def _token_scale_spec(groups):
  return pl.BlockSpec((None, None, groups, BLOCK), lambda h, s, b: (b, h, 0, s))


def _head_spec(shape):
  """BlockSpec of one head's whole (B, H, ...) array."""
  return pl.BlockSpec((None, None) + tuple(shape[2:]),
                      lambda h, s, bb: (bb, h) + (0,) * (len(shape) - 2))


def _class_out(meta, cls, n, nblk=1):
  """out_shape and out_specs of one class call (after the two stats outputs).

  nblk = 1: BlockSpecs of one slot; else each head's whole arrays (the kernel
  writes its slots with pl.ds).
  """
  b, hh, d = meta.batch, meta.heads, meta.head_dim
  if cls == "bf16":
    shape = jax.ShapeDtypeStruct((b, hh, n * BLOCK, d), jnp.bfloat16)
    spec = pl.BlockSpec((None, None, BLOCK, d), lambda h, s, bb: (bb, h, s, 0))
    if nblk > 1:
      spec = _head_spec(shape.shape)
    return [shape, shape], [spec, spec]
  cw = d // 2 if cls == "int4" else d
  codes = jax.ShapeDtypeStruct((b, hh, n * BLOCK, cw), jnp.uint8)
  codes_spec = pl.BlockSpec((None, None, BLOCK, cw), lambda h, s, bb: (bb, h, s, 0))
  if nblk > 1:
    codes_spec = _head_spec(codes.shape)
  shapes, specs = [], []
  for role in ("k", "v"):
    scheme = meta.k_scheme if role == "k" else meta.v_scheme
    sshape = jax.ShapeDtypeStruct(fmt.scale_shape(meta, role, cls), jnp.float32)
    if nblk > 1:
      sspec = _head_spec(sshape.shape)
    elif scheme == "channel":
      sspec = pl.BlockSpec((None, None, 1, d), lambda h, s, bb: (bb, h, s, 0))
    else:
      sspec = _token_scale_spec(2 if scheme == "token_g64" else 1)
    shapes += [codes, sshape, sshape]
    specs += [codes_spec, sspec, sspec]
  return shapes, specs


_STATIC = ("rot_dim", "heads", "head_dim", "block_classes", "k_scheme", "v_scheme",
           "rotation_seed_k", "rotation_seed_v", "eps", "interpret", "block_q", "block_h",
           "num_warps", "num_stages", "full_width_gemm", "q_heads_per_program",
           "kv_blocks_per_program")


@functools.partial(jax.jit, static_argnames=_STATIC)
def streamed_qkv(x, w_qkv, bias=None, *, q_norm_weight, k_norm_weight, rope_cos, rope_sin,
                 rot_dim, heads, head_dim, block_classes=None, k_scheme="channel",
                 v_scheme="token", rotation_seed_k=0, rotation_seed_v=1, eps=1e-5,
                 interpret=None, block_q=128, block_h=64, num_warps=None, num_stages=None,
                 full_width_gemm=DEFAULT_FULL_WIDTH_GEMM, q_heads_per_program=1,
                 kv_blocks_per_program=1):
  """x (B, T, hidden) bf16 @ w_qkv -> (Q (B, T, H, D) bf16 rotated, PackedKV).

  See ``streamed_qkv_reference`` for the exact math. ``block_q`` is the Q token
  tile, ``block_h`` the hidden (GEMM-K) tile; K/V tiles are always one 64-token
  block. ``num_warps`` / ``num_stages``: an int for every call, or a (Q call,
  K/V calls) pair; None picks ``DEFAULT_NUM_WARPS`` / ``DEFAULT_NUM_STAGES``.
  ``full_width_gemm``: one N = D dot per step instead of two N = D/2 dots (pair it
  with 8 warps; see ``_gemm_halves``).
  ``q_heads_per_program``: heads per Q program (1, 2 or 4; must divide ``heads``).
  One x tile then feeds an N = q_heads_per_program * D GEMM; each head's epilogue
  runs as at 1. ``kv_blocks_per_program`` (1 or 2): 64-token blocks per K/V
  program; each W tile then feeds the dots of all of them. Larger values raise
  the GEMM's FLOPs per loaded byte at the cost of registers (see the module
  docstring).
  """
  meta = _check_inputs(x, w_qkv, bias, q_norm_weight, k_norm_weight, rope_cos, rope_sin,
                       rot_dim, heads, head_dim, block_classes, k_scheme, v_scheme,
                       rotation_seed_k, rotation_seed_v)
  _pow2(block_q, "block_q")
  _pow2(block_h, "block_h")
  qh, nblk = q_heads_per_program, kv_blocks_per_program
  if qh not in (1, 2, 4):
    raise ValueError(f"q_heads_per_program must be 1, 2 or 4, got {qh!r}")
  if heads % qh:
    raise ValueError(f"q_heads_per_program={qh} must divide heads={heads}")
  if nblk not in (1, 2):
    raise ValueError(f"kv_blocks_per_program must be 1 or 2, got {nblk!r}")
  interpret = backend.resolve_interpret(interpret)
  b, t, hidden = x.shape
  hh, d, dh, nb = heads, head_dim, head_dim // 2, meta.num_blocks
  bq = min(block_q, max(16, pl.next_power_of_2(t)))
  quadrants = _rope_quadrants(d, rot_dim)
  warps = _per_call(num_warps, DEFAULT_NUM_WARPS, "num_warps")
  stages = _per_call(num_stages, DEFAULT_NUM_STAGES, "num_stages")
  q_params = plgpu.CompilerParams(num_warps=warps[0], num_stages=stages[0])
  kv_params = plgpu.CompilerParams(num_warps=warps[1], num_stages=stages[1])

  # Small constant operands: the +-1/0 matrices in BF16 (exact), the signs in f32.
  p_mat = jnp.asarray(rope.rope_partner_matrix(d, rot_dim), jnp.bfloat16)
  # diag(s) H_D has first column s, since H_D's first column is all ones.
  sk, sv = (jnp.asarray(fmt.hadamard_signs(d, seed)[:, 0])
            for seed in (rotation_seed_k, rotation_seed_v))
  h_half = jnp.asarray(_sylvester(dh), jnp.bfloat16)
  cos = jnp.asarray(rope_cos, jnp.float32)
  sin = jnp.asarray(rope_sin, jnp.float32)
  qn = jnp.asarray(q_norm_weight, jnp.float32)
  kn = jnp.asarray(k_norm_weight, jnp.float32)

  # BlockSpecs: x and the tables are whole (per batch row) and read with masked
  # pl.ds loads; W is cut per head (one D-wide column block per role).
  full = lambda *shape: pl.BlockSpec(shape, lambda *_: (0,) * len(shape))
  x_spec = pl.BlockSpec((None, t, hidden), lambda h, i, bb: (bb, 0, 0))
  w_spec = lambda role: pl.BlockSpec((hidden, d), lambda h, i, bb: (0, role * hh + h))
  b_spec = lambda role: pl.BlockSpec((d,), lambda h, i, bb: (role * hh + h,))
  const_specs = [full(d), full(t, d), full(t, d), full(d, d), full(dh, dh), full(d)]

  # ---- Q --------------------------------------------------------------------------
  # Q is role 0, so block h of qh * D columns holds heads [h * qh, (h + 1) * qh).
  q_args = [x, w_qkv] + ([bias] if bias is not None else [])
  q_specs = [x_spec, pl.BlockSpec((hidden, qh * d), lambda h, i, bb: (0, h))] + (
      [pl.BlockSpec((qh * d,), lambda h, i, bb: (h,))] if bias is not None else [])
  q_out_spec = (pl.BlockSpec((None, t, None, d), lambda h, i, bb: (bb, 0, h, 0)) if qh == 1
                else pl.BlockSpec((None, t, qh, d), lambda h, i, bb: (bb, 0, h, 0)))
  q = pl.pallas_call(
      functools.partial(_q_kernel, has_bias=bias is not None, quadrants=quadrants, t=t,
                        hidden=hidden, bq=bq, bh=block_h, dh=dh, eps=eps,
                        full_width=full_width_gemm, qh=qh),
      grid=(hh // qh, pl.cdiv(t, bq), b),
      in_specs=q_specs + const_specs,
      out_specs=q_out_spec,
      out_shape=jax.ShapeDtypeStruct((b, t, hh, d), jnp.bfloat16),
      compiler_params=q_params, interpret=interpret, name="streamed_qkv_q",
  )(*q_args, qn, cos, sin, p_mat, h_half, sk)

  # ---- K/V, one call per class ------------------------------------------------------
  # NaN start: a block that no class call wrote would show up at once.
  stats = [jnp.full((b, hh, nb, d), jnp.nan, jnp.float32) for _ in range(2)]
  stats_spec = pl.BlockSpec((None, None, nb, d), lambda h, s, bb: (bb, h, 0, 0))
  arrays = {}
  for cls in fmt.CLASSES:
    slots = meta.slots(cls)
    n = len(slots)
    if n == 0:  # the format still lists the class, with a zero-length token axis
      specs = fmt.buffer_specs(meta)
      for name in _class_array_names(cls):
        arrays[name] = jnp.zeros(*specs[name])
      continue
    table = jnp.asarray(np.asarray(slots, np.int32))
    kv_args = [table, x, w_qkv, w_qkv] + ([bias, bias] if bias is not None else [])
    kv_specs = [full(n), x_spec, w_spec(1), w_spec(2)] + (
        [b_spec(1), b_spec(2)] if bias is not None else [])
    kv_args += [kn, cos, sin, p_mat, h_half, sk, sv, *stats]
    kv_specs += [full(d), full(t, d), full(t, d), full(d, d), full(dh, dh), full(d), full(d),
                 stats_spec, stats_spec]
    cls_shapes, cls_specs = _class_out(meta, cls, n, nblk)
    n_in = len(kv_args)
    outs = pl.pallas_call(
        functools.partial(_kv_kernel, cls=cls, has_bias=bias is not None, quadrants=quadrants,
                          k_scheme=k_scheme, v_scheme=v_scheme, t=t, hidden=hidden,
                          bh=block_h, dh=dh, eps=eps, full_width=full_width_gemm,
                          nblk=nblk, n=n),
        grid=(hh, pl.cdiv(n, nblk), b),
        in_specs=kv_specs,
        out_specs=[stats_spec, stats_spec] + cls_specs,
        out_shape=[jax.ShapeDtypeStruct((b, hh, nb, d), jnp.float32)] * 2 + cls_shapes,
        input_output_aliases={n_in - 2: 0, n_in - 1: 1},
        compiler_params=kv_params, interpret=interpret, name=f"streamed_qkv_kv_{cls}",
    )(*kv_args)
    stats = outs[:2]
    arrays.update(zip(_class_array_names(cls), outs[2:]))
  arrays["k_mean"], arrays["v_sum"] = stats
  return q, fmt.PackedKV(meta, {name: arrays[name] for name in fmt.ARRAY_NAMES})
