"""Dense flash attention over packed low-bit K/V (formats/, version 1).

``packed_attention`` runs one Pallas kernel (Triton on a GPU, interpret mode
elsewhere). Q is BF16 in the rotated basis; K/V tiles are read straight from the
class stores (int4, int8, bf16), unpacked and dequantized in registers right before
their dots, and every class shares one online softmax. No buffer holding all of K or
V in high precision is ever created, in any path.

Kernel layout (why it looks like this)
--------------------------------------
* Grid ``(q tiles, H, B)``; q tiles vary fastest so neighbouring programs share
  one head's K/V in L2. Refs are whole per-(batch, head) arrays; ragged tails use
  masked loads/stores (Triton needs power-of-two tiles).
* Everything works on two channel halves (lo = ``[0, D/2)``, hi = ``[D/2, D)``):
  the int4 byte holds channel j (low nibble) and j + D/2 (high nibble), so
  ``codes & 0xF`` / ``codes >> 4`` are the halves and nothing slices a loaded value
  (Pallas-Triton cannot). Each logit tile is two dots, each PV product two dots.
* One static loop per class store, each a ``fori_loop`` over its slots (64-token
  blocks). Masks cost nothing on full blocks without segments or a padding mask:
  only the ragged last block is masked, from static positions. With segment ids or
  a padding mask the slot's global block comes from an int32 table read in-kernel
  (Pallas-Triton has no scalar prefetch), and each q tile loops only over the slots
  whose keys can meet its segments (``slot_ranges``, computed outside in O(T)), so
  a packed varlen batch costs the sum of its segments' squares, not T^2.
* Code -> bf16 is a bit trick, not a conversion: ``0x4300 | c`` is the bf16 number
  ``128 + c`` (exact for c < 128); one packed bf16 subtract (exact) removes the 128.
  The nibble masks run on 16-bit lanes, two codes per instruction. int8 codes use
  the f32 twin (``0x4B000000 | c`` is ``2^23 + c``) and an exact cast to bf16.
* Scales: K "channel" (per block, per channel) dequantizes the 64 x D tile in
  registers (64*D FMAs; scaling the block_q x D query tile instead costs more) in
  f32, then rounds once to bf16, like bf16 K storage. ``_tune={"k_math": "bf16"}``
  uses packed bf16 FMAs (two values per instruction, ~8% fewer loop instructions)
  but rounds the zero point too: kernel-vs-reference error goes from ~4.4e-3 to
  ~7.5e-3 rel L2 on DiT-like data (the int4 error itself is ~5e-2). K "token" and
  V "token"/"token_g64" apply scales outside the dots:
  ``S = (q @ c^T) * s_t + rowsum(q) * z_t`` and
  ``O += (p * s_t) @ (c - mid) + p @ (z_t + mid * s_t)`` (mid = 8 / 128: centered
  codes keep the MMA accumulator near the size of the output, see ``pv``); the V zero
  term is one number per row and group, so it accumulates in a (block_q,) vector and
  joins O once at the end.
* Offline sm_90 compiles of this kernel's Triton IR (pip triton 3.6, ptxas -v)
  guided the choices: block_q=128 needs num_warps=8 (no spill at num_stages=1, 24
  bytes at 2-3); the loop body went from ~1000 to ~720 SASS instructions per
  iteration (~720 with bf16 K math) with the bit tricks, exp2-folded sm_scale and
  the row-wise V zero term (jax's BF16 Pallas flash attention: ~370 per 64 keys).
* Softmax in base 2: logits stay raw (q.k) and ``sm_scale * log2(e)`` enters the
  exp2 argument as one FMA, so no scale touches K, its scales or the logit tile. m
  starts at a finite -1e30 and masked logits are -inf: a query row that sees no
  valid key gets l = 0 and outputs exactly 0.
* Output un-rotation by ``R_v^T`` multiplies by the +-1 Hadamard matrix in bf16
  quadrants (exact) on a two-term bf16 split of the f32 output, then by 1/sqrt(D).

Hopper fast path (``backend="auto"``, the default)
-------------------------------------------------
On an sm_90 GPU, for head_dim 128, the default K/V schemes, no segments or mask and
Tq of at least one q tile (2 x the variant's block_q rows: 256 with the default;
``mgpu_unsupported_reason``), ``packed_attention`` runs two kernels over one online
softmax (``_fast_path_call``):
1. the Mosaic-GPU wgmma kernel (``attention_mgpu._attention_call``) over every full
   int4 block for every whole q tile, writing its normalized output (rotated
   basis) and its lse;
2. this kernel with ``init``: it starts from (m = lse, l = 1, o), which is exactly the
   state of an online softmax that has seen those keys, visits the int8 and bf16 blocks
   and a ragged int4 last block, then finishes and un-rotates as usual;
3. this kernel alone for the q rows past the last whole tile.
The first pass's output crosses to the second in bf16 (one extra rounding of the int4
part's output). With overwrite_q (or ``_out``) the first pass runs in head groups of 8
into a small buffer, so the peak stays one Q plus 1/7 of one, not two.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from formats import packed_kv as fmt
from pallas_kernels.backend import NamedInputs, dot, on_gpu, resolve_interpret, resolve_sm_scale, unrotate_halves

BLOCK = fmt.BLOCK
_LOG2E = math.log2(math.e)
_M_INIT = -1e30  # finite, so exp2(m_prev - m_new) never sees inf - inf
_INT4_OFFSET = 128.0  # bf16 0x4300 | c == 128 + c
_CODE_MID = {"int4": 8.0, "int8": 128.0}  # V codes enter the dots as code - mid (v_exact)


# --------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------
def segment_ids_from_cu_seqlens(cu_seqlens, num_tokens: int) -> jax.Array:
  """(T,) int32 segment ids from cumulative sequence lengths ``[0, l0, l0+l1, ...]``.

  Token t gets the index of the sequence holding it. Tokens at or past
  ``cu_seqlens[-1]`` get -1: they attend only among themselves, so drop them with
  ``kv_mask`` (and ignore their outputs) when they are padding.
  """
  cu = jnp.asarray(cu_seqlens)
  if cu.ndim != 1 or cu.shape[0] < 1 or not jnp.issubdtype(cu.dtype, jnp.integer):
    raise ValueError(f"cu_seqlens must be a 1-D integer array [0, ..., total], got {cu.dtype}{list(cu.shape)}")
  if num_tokens <= 0:
    raise ValueError(f"num_tokens must be positive, got {num_tokens}")
  try:
    c = np.asarray(cu)
  except jax.errors.TracerArrayConversionError:  # under jit: values unknown, skip the check
    c = None
  if c is not None:
    if c[0] != 0 or np.any(np.diff(c) < 0):
      raise ValueError(f"cu_seqlens must start at 0 and be non-decreasing, got {c.tolist()}")
  t = jnp.arange(num_tokens, dtype=jnp.int32)
  ids = jnp.searchsorted(cu[1:].astype(jnp.int32), t, side="right").astype(jnp.int32)
  return jnp.where(t >= cu[-1], -1, ids).astype(jnp.int32)


def _as_batched_ids(ids, batch: int, length: int, name: str) -> jax.Array:
  """Segment ids as (B, T) int32; a (T,) array is shared by every batch row."""
  ids = jnp.asarray(ids)
  if not jnp.issubdtype(ids.dtype, jnp.integer):
    raise ValueError(f"{name} must be an integer array, got {ids.dtype}")
  if ids.shape == (length,):
    ids = jnp.broadcast_to(ids[None], (batch, length))
  if ids.shape != (batch, length):
    raise ValueError(f"{name} must have shape (B, T) = {(batch, length)} or ({length},), got {tuple(ids.shape)}")
  return ids.astype(jnp.int32)


def _validate(q, packed, sm_scale, q_segment_ids, kv_segment_ids, kv_mask):
  """Check every input; return (sm_scale, q_seg, kv_seg, kv_mask) normalized."""
  meta = fmt.check_query(q, packed)
  b, tq, h, d = q.shape
  if (q_segment_ids is None) != (kv_segment_ids is None):
    raise ValueError("pass both q_segment_ids and kv_segment_ids, or neither")
  if q_segment_ids is not None:
    q_segment_ids = _as_batched_ids(q_segment_ids, b, tq, "q_segment_ids")
    kv_segment_ids = _as_batched_ids(kv_segment_ids, b, meta.num_tokens, "kv_segment_ids")
  if kv_mask is not None:
    kv_mask = jnp.asarray(kv_mask)
    if kv_mask.dtype != jnp.bool_ or kv_mask.shape != (b, meta.num_tokens):
      raise ValueError(f"kv_mask must be bool (B, Tkv) = {(b, meta.num_tokens)}, "
                       f"got {kv_mask.dtype}{list(kv_mask.shape)}")
  sm_scale = resolve_sm_scale(sm_scale, d)
  return sm_scale, q_segment_ids, kv_segment_ids, kv_mask


def slot_ranges(q_seg, kv_seg, kv_mask, slots, *, batch: int, tq: int, tkv: int, block_q: int):
  """Per (batch, q tile): the slot range ``[first, stop)`` of one class to visit.

  A 64-key block can hold a key visible to a query tile only if the block's interval of
  valid-key segment ids meets the tile's interval of segment ids. Slots are in global
  block order, so the meeting slots lie in ``[first, stop)``; the kernel skips the rest
  and still masks every visited key. With sorted segment ids (cu_seqlens) this turns
  a packed batch's cost from T^2 into the sum of its segments' squares; unsorted ids
  give a wider, still correct, range. Returns two (B, q tiles) int32 arrays.
  """
  big, small = jnp.iinfo(jnp.int32).max, jnp.iinfo(jnp.int32).min
  if q_seg is None:  # padding mask only: one segment, masked keys belong to none
    q_seg = jnp.zeros((batch, tq), jnp.int32)
    kv_seg = jnp.zeros((batch, tkv), jnp.int32)
  ok = jnp.ones((batch, tkv), bool) if kv_mask is None else kv_mask

  def tile_bounds(lo_ids, hi_ids, tile):
    n = -(-lo_ids.shape[1] // tile)
    pad = ((0, 0), (0, n * tile - lo_ids.shape[1]))
    lo = jnp.pad(lo_ids, pad, constant_values=big).reshape(batch, n, tile).min(-1)
    hi = jnp.pad(hi_ids, pad, constant_values=small).reshape(batch, n, tile).max(-1)
    return lo, hi

  q_lo, q_hi = tile_bounds(q_seg, q_seg, block_q)
  k_lo, k_hi = tile_bounds(jnp.where(ok, kv_seg, big), jnp.where(ok, kv_seg, small), BLOCK)
  idx = jnp.asarray(slots, jnp.int32)
  k_lo, k_hi = k_lo[:, idx], k_hi[:, idx]
  meet = (k_lo[:, None, :] <= q_hi[:, :, None]) & (k_hi[:, None, :] >= q_lo[:, :, None])
  pos = jnp.arange(len(slots), dtype=jnp.int32)
  stop = jnp.max(jnp.where(meet, pos + 1, 0), -1)
  first = jnp.minimum(jnp.min(jnp.where(meet, pos, len(slots)), -1), stop)
  return first.astype(jnp.int32), stop.astype(jnp.int32)


# --------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------
def attention_f32(q, k, v, *, sm_scale, q_segment_ids=None, kv_segment_ids=None, kv_mask=None):
  """Plain float32 softmax attention, (B, T, H, D); fully masked rows give 0."""
  q, k, v = (jnp.asarray(x, jnp.float32) for x in (q, k, v))
  s = jnp.einsum("bqhd,bkhd->bhqk", q, k, precision=lax.Precision.HIGHEST) * sm_scale
  ok = jnp.ones((q.shape[0], 1, q.shape[1], k.shape[1]), bool)
  if q_segment_ids is not None:
    ok = ok & (q_segment_ids[:, None, :, None] == kv_segment_ids[:, None, None, :])
  if kv_mask is not None:
    ok = ok & kv_mask[:, None, None, :]
  s = jnp.where(ok, s, -jnp.inf)
  m = jnp.max(s, axis=-1, keepdims=True)
  p = jnp.where(ok, jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)), 0.0)
  l = p.sum(-1, keepdims=True)
  p = p / jnp.where(l > 0, l, 1.0)
  return jnp.einsum("bhqk,bkhd->bqhd", p, v, precision=lax.Precision.HIGHEST)


def packed_attention_reference(q, packed, *, sm_scale=None, q_segment_ids=None, kv_segment_ids=None,
                               kv_mask=None, keep_rotated=False, **_unused):
  """Float32 jnp reference of ``packed_attention`` (same arguments, f32 output).

  Dequantizes all of K and V (``formats.dequantize_reference``): tests and
  benchmarks only. Extra kernel arguments (block_q, interpret...) are ignored.
  """
  sm_scale, qs, ks, km = _validate(q, packed, sm_scale, q_segment_ids, kv_segment_ids, kv_mask)
  k, v = fmt.dequantize_reference(packed)
  o = attention_f32(q, k, v, sm_scale=sm_scale, q_segment_ids=qs, kv_segment_ids=ks, kv_mask=km)
  if keep_rotated:
    return o
  r_v = jnp.asarray(fmt.hadamard_rotation(packed.meta.head_dim, packed.meta.rotation_seed_v))
  return jnp.einsum("bqhd,ed->bqhe", o, r_v, precision=lax.Precision.HIGHEST)


# --------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Config:
  """Everything static the kernel body needs."""
  head_dim: int
  tq: int
  tkv: int
  block_q: int
  qk_scale: float          # sm_scale * log2(e)
  k_scheme: str
  v_scheme: str
  classes: tuple           # ((class name, first slot, slot count), ...): slots [first, count) are visited
  tail: tuple | None       # (class name, global block) of a ragged last block, else None
  has_segments: bool
  has_kv_mask: bool
  keep_rotated: bool
  init: bool = False       # start from a first pass's state (o_prev, lse) instead of empty
  q_tile_offset: int = 0   # program i handles q tile i + q_tile_offset
  convert: str = "magic"   # code -> bf16: "magic" (bit trick) or "cast" (int -> float)
  k_math: str = "f32"      # int4 K "channel" dequant arithmetic: "f32" or "bf16" (packed)
  v_exact: bool = True     # V: dots on centered codes code - mid (bf16, exact); see pv()


def _int4_halves(codes, convert: str):
  """(rows, D/2) uint8 bytes -> lo, hi bf16 tiles equal to code + offset; and offset."""
  if convert == "magic":
    # Widen once: two 16-bit lanes per register, so each mask/shift/or is one
    # instruction for two codes.
    w = codes.astype(jnp.uint16)
    lo = lax.bitcast_convert_type((w & jnp.uint16(0xF)) | jnp.uint16(0x4300), jnp.bfloat16)
    hi = lax.bitcast_convert_type((w >> jnp.uint16(4)) | jnp.uint16(0x4300), jnp.bfloat16)
    return lo, hi, _INT4_OFFSET
  lo = (codes & jnp.uint8(0xF)).astype(jnp.float32).astype(jnp.bfloat16)
  hi = (codes >> jnp.uint8(4)).astype(jnp.float32).astype(jnp.bfloat16)
  return lo, hi, 0.0


def _int8_bf16(codes, convert: str):
  """uint8 codes (<= 255, exact in bf16) -> bf16."""
  if convert == "magic":
    word = codes.astype(jnp.uint32) | jnp.uint32(0x4B000000)  # f32 2^23 + c
    return (lax.bitcast_convert_type(word, jnp.float32) - 8388608.0).astype(jnp.bfloat16)
  return codes.astype(jnp.float32).astype(jnp.bfloat16)


def _kernel(*refs, names, cfg: _Config):
  r = dict(zip(names, refs))
  o_ref = r["out"]
  d, bq = cfg.head_dim, cfg.block_q
  half = d // 2
  lo, hi = pl.ds(0, half), pl.ds(half, half)
  i = pl.program_id(0) + cfg.q_tile_offset
  q_rows = i * bq + jnp.arange(bq, dtype=jnp.int32)
  row_ok = q_rows < cfg.tq
  row_mask = jnp.broadcast_to(row_ok[:, None], (bq, half))
  q_tile = pl.ds(i * bq, bq)
  q_lo = plgpu.load(r["q"].at[q_tile, lo], mask=row_mask, other=0.0)
  q_hi = plgpu.load(r["q"].at[q_tile, hi], mask=row_mask, other=0.0)
  q_sum = None
  if cfg.k_scheme == "token":
    q_sum = q_lo.astype(jnp.float32).sum(-1) + q_hi.astype(jnp.float32).sum(-1)
  q_seg = None
  if cfg.has_segments:
    q_seg = plgpu.load(r["q_seg"].at[q_tile], mask=row_ok, other=-1)
  qk_scale = cfg.qk_scale
  v_groups = 2 if cfg.v_scheme == "token_g64" else 1

  def key_mask(blk):
    """(valid keys (64,), logit mask (bq, 64)) of global block ``blk``."""
    pos = blk * BLOCK + jnp.arange(BLOCK, dtype=jnp.int32)
    valid = pos < cfg.tkv
    keys = pl.ds(blk * BLOCK, BLOCK)
    ok = valid
    if cfg.has_kv_mask:
      ok = ok & (plgpu.load(r["kv_valid"].at[keys], mask=valid, other=0) != 0)
    ok = jnp.broadcast_to(ok[None, :], (bq, BLOCK))
    if cfg.has_segments:
      kv_seg = plgpu.load(r["kv_seg"].at[keys], mask=valid, other=-2)
      ok = ok & (q_seg[:, None] == kv_seg[None, :])
    return valid, ok

  def codes(role, cls, rows):
    """Code tiles (lo, hi) as bf16 equal to code + offset, and the offset."""
    if cls == "int4":
      return _int4_halves(r[role + "_codes4"][rows, :], cfg.convert)
    c8 = r[role + "_codes8"]
    return _int8_bf16(c8[rows, lo], cfg.convert), _int8_bf16(c8[rows, hi], cfg.convert), 0.0

  def logits(cls, s, rows):
    """(bq, 64) f32 raw logits q.k of slot ``s`` of class ``cls`` (no sm_scale)."""
    if cls == "bf16":
      k_lo, k_hi = r["k_bf16"][rows, lo], r["k_bf16"][rows, hi]
      return dot(q_lo, k_lo, trans_b=True) + dot(q_hi, k_hi, trans_b=True)
    c_lo, c_hi, off = codes("k", cls, rows)
    sfx = "4" if cls == "int4" else "8"
    if cfg.k_scheme == "channel":
      sc_ref, z_ref = r["k_scale" + sfx], r["k_zero" + sfx]

      def deq(c, chans):
        scale, zero = sc_ref[s, chans], z_ref[s, chans]
        if cfg.k_math == "bf16" and cls == "int4":
          # Packed bf16 FMAs on exact codes: two values per instruction. Rounding
          # scale/zero to bf16 adds an error ~10x below the int4 step.
          c = c - jnp.asarray(off, jnp.bfloat16) if off else c
          return c * scale.astype(jnp.bfloat16)[None, :] + zero.astype(jnp.bfloat16)[None, :]
        zero = zero - off * scale
        return (c.astype(jnp.float32) * scale[None, :] + zero[None, :]).astype(jnp.bfloat16)

      return dot(q_lo, deq(c_lo, lo), trans_b=True) + dot(q_hi, deq(c_hi, hi), trans_b=True)
    raw = dot(q_lo, c_lo, trans_b=True) + dot(q_hi, c_hi, trans_b=True)
    scale = r["k_scale" + sfx + "_g0"][rows]
    zero = r["k_zero" + sfx + "_g0"][rows] - off * scale
    return raw * scale[None, :] + q_sum[:, None] * zero[None, :]

  def pv(cls, p, rows, valid, o, z):
    """(o_lo, o_hi) + p @ V codes * scales, and z + the V zero-point terms."""
    o_lo, o_hi = o
    if cls == "bf16":
      pb = p.astype(jnp.bfloat16)
      vm = None if valid is None else jnp.broadcast_to(valid[:, None], (BLOCK, half))
      v_lo = plgpu.load(r["v_bf16"].at[rows, lo], mask=vm, other=0.0 if vm is not None else None)
      v_hi = plgpu.load(r["v_bf16"].at[rows, hi], mask=vm, other=0.0 if vm is not None else None)
      return (dot(pb, v_lo) + o_lo, dot(pb, v_hi) + o_hi), z
    c_lo, c_hi, off = codes("v", cls, rows)
    if cfg.v_exact:
      # Centered codes (code - mid, exact in bf16), so the running o holds sums of
      # small numbers. Raw codes (mean ~mid) make o ~ sum p * mid * s, which the zero
      # term cancels only at the end: at T = 152k, where the output is ~1e-3 of that,
      # the H200's MMA accumulation error then reached 12% rel L2 (interpret mode, in
      # exact f32, did not show it). The zero point becomes z + mid * s (the
      # group's midpoint), applied with the f32 p: one (64,) FMA per tile, not a
      # row sum of the rounded p * s (7% of the loop on the H200).
      mid = _CODE_MID[cls]
      c_lo = c_lo - jnp.asarray(off + mid, jnp.bfloat16)
      c_hi = c_hi - jnp.asarray(off + mid, jnp.bfloat16)
      off = 0.0
    else:
      mid = 0.0
    sfx = "4" if cls == "int4" else "8"
    z = list(z)
    pss = []
    for g in range(v_groups):
      sc_ref, z_ref = r[f"v_scale{sfx}_g{g}"], r[f"v_zero{sfx}_g{g}"]
      # Masked tiles zero the scales of keys past the end: p is 0 there, but a
      # stale NaN scale would still poison p * scale.
      if valid is None:
        scale, zero = sc_ref[rows], z_ref[rows]
      else:
        scale = plgpu.load(sc_ref.at[rows], mask=valid, other=0.0)
        zero = plgpu.load(z_ref.at[rows], mask=valid, other=0.0)
      pg = (p * scale[None, :]).astype(jnp.bfloat16)
      if mid:
        zero = zero + mid * scale
      corr = (p * zero[None, :]).sum(-1)
      if off:  # the offset term uses the rounded pg, the exact partner of the dot
        corr = corr - off * pg.astype(jnp.float32).sum(-1)
      pss.append(pg)
      z[g] = z[g] + corr
    p_hi = pss[-1]
    return (dot(pss[0], c_lo) + o_lo, dot(p_hi, c_hi) + o_hi), tuple(z)

  def tile(cls, s, carry, blk=None):
    """One K/V block. ``blk`` (global block index) given means: apply masks."""
    m, l, o_lo, o_hi, z = carry
    rows = pl.ds(s * BLOCK, BLOCK)
    sc = logits(cls, s, rows)
    valid = None
    if blk is not None:
      valid, ok = key_mask(blk)
      sc = jnp.where(ok, sc, -jnp.inf)
    # m is in raw logit units; sm_scale * log2(e) rides in the exp2 argument's FMA.
    m_new = jnp.maximum(m, sc.max(axis=-1))
    alpha = jnp.exp2((m - m_new) * qk_scale)
    p = jnp.exp2(sc * qk_scale - (m_new * qk_scale)[:, None])
    l = l * alpha + p.sum(axis=-1)
    # Rescale first, then add the dots: Triton folds "dot + acc" into the MMA.
    o = (o_lo * alpha[:, None], o_hi * alpha[:, None])
    z = tuple(zg * alpha for zg in z)
    (o_lo, o_hi), z = pv(cls, p, rows, valid, o, z)
    return m_new, l, o_lo, o_hi, z

  # The V zero-point terms are the same for every channel of a group, so they
  # accumulate per row (z) and join o once at the end.
  carry = (jnp.full((bq,), _M_INIT, jnp.float32), jnp.zeros((bq,), jnp.float32),
           jnp.zeros((bq, half), jnp.float32), jnp.zeros((bq, half), jnp.float32),
           tuple(jnp.zeros((bq,), jnp.float32) for _ in range(v_groups)))
  if cfg.init:
    # A first pass over other keys left o = its normalized output and lse = m + log(l)
    # (raw logit units, base 2 scaled by qk_scale): that is the state (m = lse, l = 1,
    # o) of an online softmax that has seen those keys, so this pass simply continues.
    lse = plgpu.load(r["lse"].at[q_tile], mask=row_ok, other=0.0)
    o_lo = plgpu.load(r["o_prev"].at[q_tile, lo], mask=row_mask, other=0.0).astype(jnp.float32)
    o_hi = plgpu.load(r["o_prev"].at[q_tile, hi], mask=row_mask, other=0.0).astype(jnp.float32)
    carry = (lse, jnp.ones((bq,), jnp.float32), o_lo, o_hi, carry[4])
  masked = cfg.has_segments or cfg.has_kv_mask
  for cls, first, n in cfg.classes:
    if masked:
      assert first == 0, "segment/mask passes visit whole classes"
      # Only the slots that can hold a visible key for this q tile (slot_ranges).
      table = r["slots_" + cls]
      body = lambda s, c, cls=cls, table=table: tile(cls, s, c, blk=table[s])
      carry = lax.fori_loop(r["first_" + cls][i], r["stop_" + cls][i], body, carry)
      continue
    n_full = n - 1 if (cfg.tail is not None and cfg.tail[0] == cls) else n
    if n_full > first:
      carry = lax.fori_loop(first, n_full, lambda s, c, cls=cls: tile(cls, s, c), carry)
    if n_full < n and n_full >= first:
      carry = tile(cls, n_full, carry, blk=cfg.tail[1])

  _, l, o_lo, o_hi, z = carry
  inv = 1.0 / jnp.where(l > 0.0, l, 1.0)  # l == 0: no valid key, o is 0
  o_lo = (o_lo + z[0][:, None]) * inv[:, None]
  o_hi = (o_hi + z[-1][:, None]) * inv[:, None]
  if not cfg.keep_rotated:
    o_lo, o_hi = unrotate_halves(o_lo, o_hi, r["ht"], lo, hi, d)
  plgpu.store(o_ref.at[q_tile, lo], o_lo.astype(o_ref.dtype), mask=row_mask)
  plgpu.store(o_ref.at[q_tile, hi], o_hi.astype(o_ref.dtype), mask=row_mask)


def _packed_attention_impl(q, packed, *, sm_scale, q_seg, kv_seg, kv_mask, keep_rotated, interpret,
                           block_q, num_warps, num_stages, tune=(), out=None, overwrite_q=False,
                           q_tiles=None, head_offset=0, num_heads=None, init=None, class_first=None):
  """Build and run the pallas_call. ``out`` (optional) is aliased as the output buffer;
  ``overwrite_q`` aliases q itself (safe: each program reads its q tile before it
  writes the same tile of the output, and no other program touches that tile).

  Partial passes (the Hopper fast path, ``_fast_path``): only q tiles
  ``[q_tiles[0], q_tiles[1])`` and heads ``[head_offset, head_offset + num_heads)``
  are computed (the rest of the aliased output is left as it is); ``class_first``
  maps a class to the first slot to visit; ``init = (o_prev, lse)`` continues from a
  first pass's normalized output (B, Tq, num_heads, D) and lse (B, num_heads, rows >=
  the q tiles visited), and
  ``o_prev is out`` means the pass reads and overwrites the same buffer.
  """
  meta = packed.meta
  b, tq, h, d = q.shape
  num_heads = h if num_heads is None else num_heads
  t0, t1 = (0, pl.cdiv(tq, block_q)) if q_tiles is None else q_tiles
  masked = q_seg is not None or kv_mask is not None
  starts = class_first or {}
  classes = tuple((c, starts.get(c, 0), len(meta.slots(c))) for c in fmt.CLASSES if meta.slots(c))
  tail = None
  if meta.num_tokens % BLOCK:
    tail = (fmt.CLASSES[meta.block_classes[-1]], meta.num_blocks - 1)
  cfg = _Config(head_dim=d, tq=tq, tkv=meta.num_tokens, block_q=block_q, qk_scale=sm_scale * _LOG2E,
                k_scheme=meta.k_scheme, v_scheme=meta.v_scheme, classes=classes, tail=tail,
                has_segments=q_seg is not None, has_kv_mask=kv_mask is not None,
                keep_rotated=keep_rotated, init=init is not None, q_tile_offset=t0, **dict(tune))

  inputs = NamedInputs()
  add = inputs.add

  per_bh = lambda i, j, k: (k, j + head_offset, 0, 0)
  bhtd = lambda i, j, k: (k, 0, j + head_offset, 0)
  add("q", q, (None, tq, None, d), bhtd)
  if not keep_rotated:
    ht = fmt.hadamard_signs(d, meta.rotation_seed_v).T
    add("ht", jnp.asarray(ht, jnp.bfloat16), (d, d), lambda i, j, k: (0, 0))
  for cls, _, n in classes:
    for role in ("k", "v"):
      if cls == "bf16":
        add(f"{role}_bf16", packed.arrays[f"{role}_bf16"], (None, None, n * BLOCK, d), per_bh)
        continue
      sfx = "4" if cls == "int4" else "8"
      codes = packed.arrays[f"{role}_codes{sfx}"]
      add(f"{role}_codes{sfx}", codes, (None, None) + codes.shape[2:], per_bh)
      for part in ("scale", "zero"):
        a = packed.arrays[f"{role}_{part}{sfx}"]
        scheme = meta.k_scheme if role == "k" else meta.v_scheme
        if scheme == "channel":
          add(f"{role}_{part}{sfx}", a, (None, None) + a.shape[2:], per_bh)
          continue
        # Token schemes: one 1-D ref per channel group, so the kernel never
        # indexes a ref with a constant group number.
        for g in range(a.shape[2]):
          add(f"{role}_{part}{sfx}_g{g}", a, (None, None, None, a.shape[3]),
              lambda i, j, k, g=g: (k, j + head_offset, g, 0))
    if masked:
      slots = meta.slots(cls)
      add("slots_" + cls, jnp.asarray(slots, jnp.int32), (n,), lambda i, j, k: (0,))
      first, stop = slot_ranges(q_seg, kv_seg, kv_mask, slots, batch=b, tq=tq, tkv=meta.num_tokens,
                                block_q=block_q)
      add("first_" + cls, first, (None, first.shape[1]), lambda i, j, k: (k, 0))
      add("stop_" + cls, stop, (None, stop.shape[1]), lambda i, j, k: (k, 0))
  if q_seg is not None:
    add("q_seg", q_seg, (None, tq), lambda i, j, k: (k, 0))
    add("kv_seg", kv_seg, (None, meta.num_tokens), lambda i, j, k: (k, 0))
  if kv_mask is not None:
    add("kv_valid", kv_mask.astype(jnp.int32), (None, meta.num_tokens), lambda i, j, k: (k, 0))
  aliases = {0: 0} if overwrite_q else {}
  if init is not None:
    o_prev, lse = init
    add("lse", lse, (None, None, lse.shape[2]), lambda i, j, k: (k, j, 0))  # covers the init rows
    if o_prev is out:  # read and overwritten in place: one buffer, passed once
      assert o_prev.shape == q.shape and head_offset == 0 and num_heads == h
      out = None
      aliases = {len(inputs.args): 0}
    # o_prev holds num_heads heads: indexed without the offset.
    add("o_prev", o_prev, (None, tq, None, d), lambda i, j, k: (k, 0, j, 0))
  if out is not None:
    aliases = {len(inputs.args): 0}
    add("out_init", out, (None, tq, None, d), bhtd)

  # Defaults per block_q: the fastest measured on the H200 at T = 152k
  # (results/attention_h200.json): 256 -> 16 warps, 1 stage (3.24 s); 128 -> 8 warps,
  # 3 stages (3.50 s); 64 -> 4 warps, 2 stages (3.50 s).
  default_warps, default_stages = {16: (4, 2), 32: (4, 2), 64: (4, 2), 128: (8, 3)}.get(block_q, (16, 1))
  num_warps = default_warps if num_warps is None else num_warps
  num_stages = default_stages if num_stages is None else num_stages
  kernel = functools.partial(_kernel, names=inputs.ref_names("out"), cfg=cfg)
  return pl.pallas_call(
      kernel,
      grid=(t1 - t0, num_heads, b),
      in_specs=inputs.specs,
      out_specs=pl.BlockSpec((None, tq, None, d), bhtd),
      out_shape=jax.ShapeDtypeStruct(q.shape, jnp.bfloat16),
      input_output_aliases=aliases,
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name="packed_attention",
  )(*inputs.args)


_STATIC = ("sm_scale", "keep_rotated", "interpret", "block_q", "num_warps", "num_stages", "tune", "overwrite_q")


def _packed_attention_call(q, packed, q_seg, kv_seg, kv_mask, out, *, sm_scale, keep_rotated, interpret,
                           block_q, num_warps, num_stages, tune, overwrite_q):
  return _packed_attention_impl(q, packed, sm_scale=sm_scale, q_seg=q_seg, kv_seg=kv_seg, kv_mask=kv_mask,
                                keep_rotated=keep_rotated, interpret=interpret, block_q=block_q,
                                num_warps=num_warps, num_stages=num_stages, tune=tune, out=out,
                                overwrite_q=overwrite_q)


_packed_attention_jit = jax.jit(_packed_attention_call, static_argnames=_STATIC)
# q donated: at top level its buffer becomes the output instead of being copied.
_packed_attention_jit_donate_q = jax.jit(_packed_attention_call, static_argnames=_STATIC, donate_argnums=(0,))


# --------------------------------------------------------------------------------------
# Hopper fast path: the Mosaic-GPU (wgmma) kernel for the int4 keys, this kernel for the rest
# --------------------------------------------------------------------------------------
_MGPU_HEAD_GROUP = 8   # heads per Mosaic-GPU launch when the output goes into a given buffer


def _int4_full_slots(meta) -> int:
  """int4 slots that hold 64 live tokens (a ragged last block, if int4, is the last slot)."""
  n4 = len(meta.slots("int4"))
  ragged_int4 = meta.num_tokens % BLOCK and meta.block_classes[-1] == fmt.CLASS_ID["int4"]
  return n4 - 1 if ragged_int4 else n4


def _mgpu_tile_rows(variant) -> int:
  """q rows per CTA of a Mosaic-GPU variant (its two compute warpgroups)."""
  from pallas_kernels import attention_mgpu as amg
  return 2 * amg.make_config(variant=variant or amg.DEFAULT_VARIANT).block_q


def mgpu_unsupported_reason(q, packed, *, masked=False, interpret=False, variant=None):
  """None if ``packed_attention``'s Hopper fast path (Mosaic-GPU ``variant``, default
  ``attention_mgpu.DEFAULT_VARIANT``) can run these inputs, else why not."""
  meta = packed.meta
  tq = q.shape[1]
  rows = _mgpu_tile_rows(variant)
  if meta.head_dim != 128:
    return f"it supports head_dim 128, got {meta.head_dim}"
  if meta.k_scheme != "channel" or meta.v_scheme != "token":
    return f"it supports k_scheme 'channel' / v_scheme 'token', got {meta.k_scheme!r} / {meta.v_scheme!r}"
  if masked:
    return "segment ids and kv_mask run on the Triton kernel (varlen block skipping)"
  if tq < rows:
    return f"Tq={tq} is below one {rows}-row tile"
  if _int4_full_slots(meta) < 1:
    return "there is no full int4 block"
  if interpret or not on_gpu():
    return "it needs a CUDA GPU (interpret mode runs the Triton kernel)"
  cc = str(getattr(jax.devices()[0], "compute_capability", ""))
  if not cc.startswith("9"):
    return f"it needs a Hopper GPU (compute capability 9.x, wgmma), found {cc or 'unknown'}"
  return None


@dataclasses.dataclass(frozen=True)
class _FastPathPlan:
  """How the fast path splits the work (``_fast_path_plan``)."""
  cfg: object            # the Mosaic-GPU variant's MgpuConfig
  kv_steps: int          # Mosaic-GPU key steps (cfg.block_kv keys each) over the full int4 blocks
  int4_done: int         # int4 slots those steps cover: the continuation starts there
  n_tiles: int           # whole Mosaic-GPU q tiles
  block_q: int           # the Triton passes' q tile
  cont_tiles: tuple      # Triton q tiles [first, stop) of the continuation (the whole tiles)
  tail_tiles: tuple      # Triton q tiles [first, stop) of the ragged q rows (may be empty)


def _fast_path_plan(meta, tq, block_q, variant) -> _FastPathPlan:
  from pallas_kernels import attention_mgpu as amg

  cfg = amg.make_config(variant=variant)
  sub = cfg.block_kv // BLOCK
  kv_steps = _int4_full_slots(meta) // sub
  rows = _mgpu_tile_rows(variant)
  n_tiles = tq // rows
  if n_tiles < 1:
    raise ValueError(f"Tq={tq} is below one {rows}-row tile of variant {variant!r}")
  bq = math.gcd(block_q, rows)  # the Triton tile: a power of two dividing the Mosaic-GPU tile
  cont_tiles = (0, n_tiles * rows // bq)
  return _FastPathPlan(cfg=cfg, kv_steps=kv_steps, int4_done=kv_steps * sub, n_tiles=n_tiles, block_q=bq,
                       cont_tiles=cont_tiles, tail_tiles=(cont_tiles[1], pl.cdiv(tq, bq)))


def _fast_path_call(q, packed, out, *, sm_scale, keep_rotated, block_q, num_warps, num_stages, tune,
                    overwrite_q, variant, interpret=False, _first_pass=None):
  """Mosaic-GPU over (full int4 blocks) x (whole q tiles), saving its lse; then
  the Triton kernel continues those rows over the other blocks (int8, bf16, a ragged
  int4 tail) and un-rotates, and computes the ragged q rows past the last whole tile.

  Without a target buffer the Mosaic-GPU output is the result buffer, passed through
  both Triton passes in place. With one (q's own buffer for overwrite_q, or ``out``),
  heads go in groups of _MGPU_HEAD_GROUP: each group's first-pass state lives in a
  small (B, Tq, group, D) buffer, and the continuation writes the target's heads of
  that group, which no later pass reads. Peak memory is then the target plus that
  group buffer (1/7 of a Q at H = 56), not a second Q.
  ``interpret`` / ``_first_pass`` (a stand-in for the Mosaic-GPU call, such as
  ``attention_mgpu.attention_call_reference``) let the CPU tests run the composition.
  """
  from pallas_kernels import attention_mgpu as amg

  b, tq, h, d = q.shape
  plan = _fast_path_plan(packed.meta, tq, block_q, variant)
  cont_tiles, tail_tiles = plan.cont_tiles, plan.tail_tiles
  ops = amg.int4_store_operands(packed)
  tri = functools.partial(_packed_attention_impl, packed=packed, sm_scale=sm_scale, q_seg=None, kv_seg=None,
                          kv_mask=None, keep_rotated=keep_rotated, interpret=interpret, block_q=plan.block_q,
                          num_warps=num_warps, num_stages=num_stages, tune=tune)
  first = {"int4": plan.int4_done}
  mgpu = functools.partial(_first_pass or amg._attention_call, cfg=plan.cfg, sm_scale=sm_scale,
                           num_q_tiles=plan.n_tiles, kv_steps=plan.kv_steps, save_lse=True)

  target = q if overwrite_q else out
  if target is None:
    o, lse = mgpu(q, *ops)
    o = tri(q, init=(o, lse), out=o, q_tiles=cont_tiles, class_first=first)
    if tail_tiles[0] < tail_tiles[1]:
      o = tri(q, out=o, q_tiles=tail_tiles)
    return o

  # Into the target: the ragged q rows first (no later pass reads or writes them), then
  # head groups. With overwrite_q the current buffer is both q and the output.
  buf = target
  qin = lambda: buf if overwrite_q else q
  dest = lambda: None if overwrite_q else buf
  if tail_tiles[0] < tail_tiles[1]:
    buf = tri(qin(), out=dest(), overwrite_q=overwrite_q, q_tiles=tail_tiles)
  group = max(g for g in range(1, min(h, _MGPU_HEAD_GROUP) + 1) if h % g == 0)
  for h0 in range(0, h, group):
    o, lse = mgpu(qin(), *ops, head_offset=h0, num_heads=group)
    buf = tri(qin(), init=(o, lse), out=dest(), overwrite_q=overwrite_q, q_tiles=cont_tiles,
              head_offset=h0, num_heads=group, class_first=first)
  return buf


_FAST_STATIC = ("sm_scale", "keep_rotated", "block_q", "num_warps", "num_stages", "tune", "overwrite_q",
                "variant")
_fast_path_jit = jax.jit(_fast_path_call, static_argnames=_FAST_STATIC)
_fast_path_jit_donate_q = jax.jit(_fast_path_call, static_argnames=_FAST_STATIC, donate_argnums=(0,))


def packed_attention(q, packed, *, sm_scale=None, q_segment_ids=None, kv_segment_ids=None, kv_mask=None,
                     keep_rotated=False, overwrite_q=False, interpret=None, block_q=256, num_warps=None,
                     num_stages=None, backend="auto", _tune=None, _out=None, _mgpu_variant=None):
  """Dense attention of BF16 ``q`` over a ``formats.PackedKV``; returns (B, Tq, H, D) bf16.

  q: (B, Tq, H, D) bf16, already rotated by ``R_k`` (seed ``meta.rotation_seed_k``);
  Tq may differ from the packed ``num_tokens``. sm_scale defaults to 1/sqrt(D).
  q_segment_ids (B, Tq) / kv_segment_ids (B, Tkv) int32 (or (T,), shared by the
  batch): a query sees only keys of its own segment. kv_mask (B, Tkv) bool: True =
  valid key. A query row with no visible key outputs exactly 0. The output is
  un-rotated by ``R_v^T`` unless ``keep_rotated`` (then fold ``R_v^T`` into W_o).
  overwrite_q: write the output into q's buffer (q is donated and must not be used
  afterwards), which saves one (B, Tq, H, D) bf16 buffer of peak memory; inside a
  larger jit, XLA reuses the buffer when q is dead after this call.
  block_q: query tile (power of two >= 16); num_warps/num_stages: Triton knobs,
  by default the fastest measured for the block_q (256: 16 warps, 1 stage).
  backend: "auto" (default) runs the Hopper fast path when it applies
  (``mgpu_unsupported_reason`` is None: an sm_90 GPU, head_dim 128, the default K/V
  schemes, no segments or mask): the Mosaic-GPU wgmma kernel
  (``attention_mgpu.py``) takes every full int4 block for every whole q tile (256 rows),
  and this Triton kernel continues its online softmax over the other blocks (int8,
  bf16, a ragged int4 tail) and the ragged q rows. "triton" always runs this kernel
  alone; "mgpu" asks for the fast path and raises if it cannot run.
  ``_tune`` (a dict of ``_Config`` code-generation variants, e.g.
  ``{"convert": "cast"}``; Triton passes only), ``_out`` (a buffer aliased as the
  output, for NaN-poisoning tests) and ``_mgpu_variant`` (a name from
  ``attention_mgpu.VARIANTS`` for the fast path's first pass) are for tests and benchmarks.
  """
  sm_scale, q_seg, kv_seg, kv_mask = _validate(q, packed, sm_scale, q_segment_ids, kv_segment_ids, kv_mask)
  if block_q < 16 or block_q & (block_q - 1):
    raise ValueError(f"block_q must be a power of two >= 16, got {block_q}")
  tune = tuple(sorted((_tune or {}).items()))
  unknown = {k for k, _ in tune} - {"convert", "k_math", "v_exact"}
  if unknown:
    raise ValueError(f"unknown _tune keys {sorted(unknown)}")
  if _out is not None and (_out.shape != q.shape or _out.dtype != jnp.bfloat16):
    raise ValueError(f"_out must be bfloat16{list(q.shape)}, got {_out.dtype}{list(_out.shape)}")
  if overwrite_q and _out is not None:
    raise ValueError("overwrite_q and _out both name the output buffer; pass one")
  if backend not in ("auto", "triton", "mgpu"):
    raise ValueError(f"backend must be 'auto', 'triton' or 'mgpu', got {backend!r}")
  interpret = resolve_interpret(interpret)
  if backend != "triton":
    from pallas_kernels.attention_mgpu import DEFAULT_VARIANT, VARIANTS
    if _mgpu_variant is not None and _mgpu_variant not in VARIANTS:
      raise ValueError(f"unknown _mgpu_variant {_mgpu_variant!r}; use one of {sorted(VARIANTS)}")
    reason = mgpu_unsupported_reason(q, packed, masked=q_seg is not None or kv_mask is not None,
                                     interpret=interpret, variant=_mgpu_variant)
    if reason is not None and backend == "mgpu":
      raise NotImplementedError(f"backend='mgpu' cannot run: {reason}; use backend='auto' or 'triton'")
    if reason is None:
      call = _fast_path_jit_donate_q if overwrite_q else _fast_path_jit
      return call(q, packed, _out, sm_scale=sm_scale, keep_rotated=bool(keep_rotated), block_q=int(block_q),
                  num_warps=num_warps, num_stages=num_stages, tune=tune, overwrite_q=bool(overwrite_q),
                  variant=_mgpu_variant or DEFAULT_VARIANT)
  call = _packed_attention_jit_donate_q if overwrite_q else _packed_attention_jit
  return call(q, packed, q_seg, kv_seg, kv_mask, _out, sm_scale=sm_scale,
              keep_rotated=bool(keep_rotated), interpret=interpret,
              block_q=int(block_q), num_warps=num_warps, num_stages=num_stages,
              tune=tune, overwrite_q=bool(overwrite_q))
