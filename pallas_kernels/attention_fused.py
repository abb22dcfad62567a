"""The fused dense attention kernel over packed low-bit K/V (``packed_attention(method="fused")``).

One Pallas kernel (Triton on a GPU, interpret mode elsewhere). Q is BF16 in the
rotated basis; K/V tiles are read straight from the class stores (int4, int8, bf16),
unpacked and dequantized in registers right before their dots, and every class shares
one online softmax. It needs no scratch at all, so it serves what the streamed path
(cuDNN on a bounded bf16 scratch, ``attention.py``) cannot: segment ids and key
masks, GPUs without cuDNN flash attention, CPU interpret mode, and zero-scratch runs.
``attention.packed_attention_reference`` defines it.

Kernel layout (why it looks like this)
--------------------------------------
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
  f32, then rounds once to bf16, like bf16 K storage. K "token" and
  V "token"/"token_g64" apply scales outside the dots:
  ``S = (q @ c^T) * s_t + rowsum(q) * z_t`` and
  ``O += (p * s_t) @ (c - mid) + p @ (z_t + mid * s_t)`` (mid = 8 / 128: centered
  codes keep the MMA accumulator near the size of the output, see ``pv``); the V zero
  term is one number per row and group, so it accumulates in a (block_q,) vector and
  joins O once at the end.
* Offline sm_90 compiles of this kernel's Triton IR (pip triton 3.6, ptxas -v)
  guided the choices: block_q=128 needs num_warps=8 (no spill at num_stages=1, 24
  bytes at 2-3); the loop body went from ~1000 to ~720 SASS instructions per
  iteration with the bit tricks, exp2-folded sm_scale and
  the row-wise V zero term (jax's BF16 Pallas flash attention: ~370 per 64 keys).
* Softmax in base 2: logits stay raw (q.k) and ``sm_scale * log2(e)`` enters the
  exp2 argument as one FMA, so no scale touches K, its scales or the logit tile. m
  starts at a finite -1e30 and masked logits are -inf: a query row that sees no
  valid key gets l = 0 and outputs exactly 0.
* Output un-rotation by ``R_v^T`` multiplies by the +-1 Hadamard matrix in bf16
  quadrants (exact) on a two-term bf16 split of the f32 output, then by 1/sqrt(D).

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
from pallas_kernels.backend import (INT4_OFFSET, LN2, LOG2E, M_INIT, NamedInputs, dot, int4_halves, int8_to_bf16,
                                    refuse_outside_fused, unrotate_halves)

BLOCK = fmt.BLOCK
_CODE_MID = {"int4": 8.0, "int8": 128.0}  # V codes enter the dots as code - mid (see pv)


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
  classes: tuple           # ((class name, slot count), ...) of the classes that have blocks
  tail: tuple | None       # (class name, global block) of a ragged last block, else None
  has_segments: bool
  has_kv_mask: bool
  keep_rotated: bool
  return_lse: bool = False


def _kernel(*refs, names, cfg: _Config):
  r = dict(zip(names, refs))
  o_ref = r["out"]
  d, bq = cfg.head_dim, cfg.block_q
  half = d // 2
  lo, hi = pl.ds(0, half), pl.ds(half, half)
  i = pl.program_id(0)
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
      return (*int4_halves(r[role + "_codes4"][rows, :]), INT4_OFFSET)
    c8 = r[role + "_codes8"]
    return int8_to_bf16(c8[rows, lo]), int8_to_bf16(c8[rows, hi]), 0.0

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
        scale, zero = sc_ref[s, chans].astype(jnp.float32), z_ref[s, chans].astype(jnp.float32)
        zero = zero - off * scale
        return (c.astype(jnp.float32) * scale[None, :] + zero[None, :]).astype(jnp.bfloat16)

      return dot(q_lo, deq(c_lo, lo), trans_b=True) + dot(q_hi, deq(c_hi, hi), trans_b=True)
    raw = dot(q_lo, c_lo, trans_b=True) + dot(q_hi, c_hi, trans_b=True)
    scale = r["k_scale" + sfx + "_g0"][rows].astype(jnp.float32)
    zero = r["k_zero" + sfx + "_g0"][rows].astype(jnp.float32) - off * scale
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
    sfx = "4" if cls == "int4" else "8"
    z = list(z)
    pss = []
    for g in range(v_groups):
      sc_ref, z_ref = r[f"v_scale{sfx}_g{g}"], r[f"v_zero{sfx}_g{g}"]
      # Masked tiles zero the scales of keys past the end: p is 0 there, but a
      # stale NaN scale would still poison p * scale.
      if valid is None:
        scale, zero = sc_ref[rows].astype(jnp.float32), z_ref[rows].astype(jnp.float32)
      else:
        scale = plgpu.load(sc_ref.at[rows], mask=valid, other=0.0).astype(jnp.float32)
        zero = plgpu.load(z_ref.at[rows], mask=valid, other=0.0).astype(jnp.float32)
      pg = (p * scale[None, :]).astype(jnp.bfloat16)
      pss.append(pg)
      z[g] = z[g] + (p * (zero + mid * scale)[None, :]).sum(-1)
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
  carry = (jnp.full((bq,), M_INIT, jnp.float32), jnp.zeros((bq,), jnp.float32),
           jnp.zeros((bq, half), jnp.float32), jnp.zeros((bq, half), jnp.float32),
           tuple(jnp.zeros((bq,), jnp.float32) for _ in range(v_groups)))
  masked = cfg.has_segments or cfg.has_kv_mask
  for cls, n in cfg.classes:
    if masked:
      # Only the slots that can hold a visible key for this q tile (slot_ranges).
      table = r["slots_" + cls]
      body = lambda s, c, cls=cls, table=table: tile(cls, s, c, blk=table[s])
      carry = lax.fori_loop(r["first_" + cls][i], r["stop_" + cls][i], body, carry)
      continue
    n_full = n - 1 if (cfg.tail is not None and cfg.tail[0] == cls) else n
    if n_full > 0:
      carry = lax.fori_loop(0, n_full, lambda s, c, cls=cls: tile(cls, s, c), carry)
    if n_full < n:
      carry = tile(cls, n_full, carry, blk=cfg.tail[1])

  m, l, o_lo, o_hi, z = carry
  if cfg.return_lse:  # natural-log sum of exp(sm_scale * logits); -inf for a row with no key
    lse = jnp.where(l > 0.0, (m * qk_scale + jnp.log2(jnp.where(l > 0.0, l, 1.0))) * LN2, -jnp.inf)
    plgpu.store(r["lse"].at[q_tile], lse, mask=row_ok)
  inv = 1.0 / jnp.where(l > 0.0, l, 1.0)  # l == 0: no valid key, o is 0
  o_lo = (o_lo + z[0][:, None]) * inv[:, None]
  o_hi = (o_hi + z[-1][:, None]) * inv[:, None]
  if not cfg.keep_rotated:
    o_lo, o_hi = unrotate_halves(o_lo, o_hi, r["ht"], lo, hi, d)
  plgpu.store(o_ref.at[q_tile, lo], o_lo.astype(o_ref.dtype), mask=row_mask)
  plgpu.store(o_ref.at[q_tile, hi], o_hi.astype(o_ref.dtype), mask=row_mask)


def fused_attention(q, packed, *, sm_scale, q_seg, kv_seg, kv_mask, keep_rotated, interpret,
                    block_q, num_warps, num_stages, out=None, overwrite_q=False, return_lse=False):
  """Build and run the pallas_call (inputs validated by ``attention.packed_attention``).

  ``out`` (optional) is aliased as the output buffer; ``overwrite_q`` aliases q itself
  (safe: each program reads its q tile before it writes the same tile of the output,
  and no other program touches that tile). ``return_lse`` also returns the (B, H, Tq)
  f32 log-sum-exp of each row's scaled logits (for merging partial attentions).
  """
  meta = packed.meta
  refuse_outside_fused(meta.block_classes, "dense attention method='fused'",
                       "method='streamed' reads every class (segment ids and kv_mask need the fused method: "
                       "store those blocks as int4, int8 or bf16)")
  b, tq, h, d = q.shape
  masked = q_seg is not None or kv_mask is not None
  classes = tuple((c, len(meta.slots(c))) for c in fmt.CLASSES if meta.slots(c))
  tail = None
  if meta.num_tokens % BLOCK:
    tail = (fmt.CLASSES[meta.block_classes[-1]], meta.num_blocks - 1)
  cfg = _Config(head_dim=d, tq=tq, tkv=meta.num_tokens, block_q=block_q, qk_scale=sm_scale * LOG2E,
                k_scheme=meta.k_scheme, v_scheme=meta.v_scheme, classes=classes, tail=tail,
                has_segments=q_seg is not None, has_kv_mask=kv_mask is not None,
                keep_rotated=keep_rotated, return_lse=bool(return_lse))

  inputs = NamedInputs()
  add = inputs.add

  per_bh = lambda i, j, k: (k, j, 0, 0)
  bhtd = lambda i, j, k: (k, 0, j, 0)
  add("q", q, (None, tq, None, d), bhtd)
  if not keep_rotated:
    ht = fmt.hadamard_signs(d, meta.rotation_seed_v).T
    add("ht", jnp.asarray(ht, jnp.bfloat16), (d, d), lambda i, j, k: (0, 0))
  for cls, n in classes:
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
              lambda i, j, k, g=g: (k, j, g, 0))
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
  if out is not None:
    aliases = {len(inputs.args): 0}
    add("out_init", out, (None, tq, None, d), bhtd)

  # Defaults per block_q: the fastest measured on the H200 at T = 152k
  # (results/attention_h200.json): 256 -> 16 warps, 1 stage (3.24 s); 128 -> 8 warps,
  # 3 stages (3.50 s); 64 -> 4 warps, 2 stages (3.50 s).
  default_warps, default_stages = {16: (4, 2), 32: (4, 2), 64: (4, 2), 128: (8, 3)}.get(block_q, (16, 1))
  num_warps = default_warps if num_warps is None else num_warps
  num_stages = default_stages if num_stages is None else num_stages
  out_names = ("out", "lse") if return_lse else ("out",)
  out_specs = [pl.BlockSpec((None, tq, None, d), bhtd)]
  out_shape = [jax.ShapeDtypeStruct(q.shape, jnp.bfloat16)]
  if return_lse:
    out_specs.append(pl.BlockSpec((None, None, tq), lambda i, j, k: (k, j, 0)))
    out_shape.append(jax.ShapeDtypeStruct((b, h, tq), jnp.float32))
  kernel = functools.partial(_kernel, names=inputs.ref_names(*out_names), cfg=cfg)
  res = pl.pallas_call(
      kernel,
      grid=(pl.cdiv(tq, block_q), h, b),
      in_specs=inputs.specs,
      out_specs=out_specs,
      out_shape=out_shape,
      input_output_aliases=aliases,
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name="packed_attention",
  )(*inputs.args)
  return tuple(res) if return_lse else res[0]
