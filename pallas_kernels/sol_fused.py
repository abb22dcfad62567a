"""Sol's fused kernel: the exact loop decodes int4 / int8 / bf16 tiles of the packed
K/V in registers (no scratch). ``sol.py``'s docstring states the semantics and
``sol_reference`` defines them; ``sol_decoded`` is the kernel over decoded stores.

Kernel layout
-------------
Grid ``(query blocks, H, B)``:

* Q tile (64 x D) in two channel halves (Triton cannot slice loaded values; the
  int4 byte holds channel j and j + D/2), kept in bf16.
* Exact loop: the sink range, then the list (a ``sink_q`` block walks all blocks).
  With one class the store holds every block in order, so the list entry is the
  only dependent scalar load per block; with several, an int32 table gives
  ``slot * 4 + class branch`` and a ``lax.switch`` picks the store. Live rows come
  from T arithmetically, or from a ``block_len`` table. Tiles are dequantized in
  registers as in ``packed_attention`` (codes enter the bf16 dots through the
  0x4300 bit trick), with ``kg`` folded into the K zero point so the centred key
  enters the dot. Dead key rows get -inf logits and zero V scales (NaN-safe).
* Pooled loop: 64 key blocks per step from ``k_mean`` / ``v_sum``; membership in
  the exact set comes from the sorted list (a 64 x 64 compare against a window that
  advances with a pointer) and the sink range. The pooled value dot runs on a
  two-term bf16 split of ``v_sum``.
* One online softmax (base 2, m starts at a finite -1e30, masked logits -inf), then
  ``R_v^T`` as in the dense kernel.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from formats import packed_kv as fmt
from pallas_kernels.backend import dot as _dot
from pallas_kernels.backend import (INT4_OFFSET, LOG2E, M_INIT, NamedInputs, int4_halves, int8_to_bf16,
                                    refuse_outside_fused, split_bf16, unrotate_halves)
from pallas_kernels.sol_routing import (BLOCK, SolPlan, SolRouting, block_lengths, normalize_key_bias, pooled_step,
                                        walk_exact_blocks)


@dataclasses.dataclass(frozen=True)
class _KConfig:
  """Everything static the kernel body needs."""
  head_dim: int
  num_tokens: int
  num_blocks: int
  qk_scale: float          # sm_scale * log2(e)
  k_scheme: str
  v_scheme: str
  branches: tuple          # class names present, in table branch order
  sink_blocks: tuple
  sink_q: tuple
  tail: bool
  has_key_bias: bool
  has_block_len: bool
  keep_rotated: bool


def _kernel(*refs, names, cfg: _KConfig):
  r = dict(zip(names, refs))
  o_ref = r["out"]
  d = cfg.head_dim
  half = d // 2
  lo, hi = pl.ds(0, half), pl.ds(half, half)
  qb = pl.program_id(0)
  ar = jnp.arange(BLOCK, dtype=jnp.int32)
  q_rows = qb * BLOCK + ar
  row_mask = jnp.broadcast_to((q_rows < cfg.num_tokens)[:, None], (BLOCK, half))
  q_tile = pl.ds(qb * BLOCK, BLOCK)
  q_lo = plgpu.load(r["q"].at[q_tile, lo], mask=row_mask, other=0.0)
  q_hi = plgpu.load(r["q"].at[q_tile, hi], mask=row_mask, other=0.0)
  kg_lo, kg_hi = r["kg"][lo], r["kg"][hi]
  qks = cfg.qk_scale
  q_kg = None
  if cfg.k_scheme == "token":
    # Token scales apply outside the dot, so the centring term is a row constant.
    q_sum = q_lo.astype(jnp.float32).sum(-1) + q_hi.astype(jnp.float32).sum(-1)
    q_kg = ((q_lo.astype(jnp.float32) * kg_lo[None, :]).sum(-1)
            + (q_hi.astype(jnp.float32) * kg_hi[None, :]).sum(-1)) * qks

  def codes(cls, role, rows):
    """(lo, hi) bf16 code operands of one tile, equal to code + offset; and offset."""
    if cls == "int4":
      return (*int4_halves(r[f"{role}_codes4"][rows, :]), INT4_OFFSET)
    return int8_to_bf16(r[f"{role}_codes8"][rows, lo]), int8_to_bf16(r[f"{role}_codes8"][rows, hi]), 0.0

  def logits(cls, slot, rows):
    """(64, 64) centred logits, log2 units, of one exact tile (before masking)."""
    if cls == "bf16":
      k_lo = (r["k_bf16"][rows, lo].astype(jnp.float32) - kg_lo[None, :]).astype(jnp.bfloat16)
      k_hi = (r["k_bf16"][rows, hi].astype(jnp.float32) - kg_hi[None, :]).astype(jnp.bfloat16)
      return (_dot(q_lo, k_lo, trans_b=True) + _dot(q_hi, k_hi, trans_b=True)) * qks
    c_lo, c_hi, off = codes(cls, "k", rows)
    sfx = "4" if cls == "int4" else "8"
    if cfg.k_scheme == "channel":
      sc_ref, z_ref = r["k_scale" + sfx], r["k_zero" + sfx]

      def deq(c, chans, kg):
        scale = sc_ref[slot, chans].astype(jnp.float32) * qks
        zero = (z_ref[slot, chans].astype(jnp.float32) - kg) * qks - off * scale
        return (c.astype(jnp.float32) * scale[None, :] + zero[None, :]).astype(jnp.bfloat16)
      return _dot(q_lo, deq(c_lo, lo, kg_lo), trans_b=True) + _dot(q_hi, deq(c_hi, hi, kg_hi), trans_b=True)
    raw = _dot(q_lo, c_lo, trans_b=True) + _dot(q_hi, c_hi, trans_b=True)
    scale = r["k_scale" + sfx + "_g0"][rows].astype(jnp.float32) * qks
    zero = r["k_zero" + sfx + "_g0"][rows].astype(jnp.float32) * qks - off * scale
    return raw * scale[None, :] + q_sum[:, None] * zero[None, :] - q_kg[:, None]

  def pv(cls, p, rows, live):
    """(lo, hi) halves of p @ V of one tile; dead rows read as zero (NaN-safe)."""
    if cls == "bf16":
      pb = p.astype(jnp.bfloat16)
      vm = jnp.broadcast_to(live[:, None], (BLOCK, half))
      v_lo = plgpu.load(r["v_bf16"].at[rows, lo], mask=vm, other=0.0)
      v_hi = plgpu.load(r["v_bf16"].at[rows, hi], mask=vm, other=0.0)
      return _dot(pb, v_lo), _dot(pb, v_hi)
    c_lo, c_hi, off = codes(cls, "v", rows)
    sfx = "4" if cls == "int4" else "8"

    def group(g):
      scale = plgpu.load(r[f"v_scale{sfx}_g{g}"].at[rows], mask=live, other=0.0).astype(jnp.float32)
      zero = plgpu.load(r[f"v_zero{sfx}_g{g}"].at[rows], mask=live, other=0.0).astype(jnp.float32)
      ps = (p * scale[None, :]).astype(jnp.bfloat16)
      corr = (p * zero[None, :]).sum(-1) - off * ps.astype(jnp.float32).sum(-1)
      return ps, corr[:, None]

    if cfg.v_scheme == "token":
      ps, corr = group(0)
      return _dot(ps, c_lo) + corr, _dot(ps, c_hi) + corr
    ps_lo, corr_lo = group(0)
    ps_hi, corr_hi = group(1)
    return _dot(ps_lo, c_lo) + corr_lo, _dot(ps_hi, c_hi) + corr_hi

  def live_rows(blk):
    """Live rows of key block ``blk``: arithmetic unless the caller gave block_len,
    so the exact loop's only dependent scalar load is the list entry itself."""
    if cfg.has_block_len:
      return r["lens"][blk]
    return jnp.minimum(cfg.num_tokens - blk * BLOCK, BLOCK)

  def exact_tile(cls, slot, blk, carry):
    m, l, o_lo, o_hi = carry
    rows = pl.ds(slot * BLOCK, BLOCK)
    live = ar < live_rows(blk)
    sc = logits(cls, slot, rows)
    if cfg.has_key_bias:
      keys = blk * BLOCK + ar
      sc = sc + plgpu.load(r["kb"].at[pl.ds(blk * BLOCK, BLOCK)], mask=keys < cfg.num_tokens, other=0.0)[None, :]
    sc = jnp.where(jnp.broadcast_to(live[None, :], (BLOCK, BLOCK)), sc, -jnp.inf)
    m_new = jnp.maximum(m, sc.max(axis=-1))
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(sc - m_new[:, None])
    l = l * alpha + p.sum(axis=-1)
    pv_lo, pv_hi = pv(cls, p, rows, live)
    return m_new, l, o_lo * alpha[:, None] + pv_lo, o_hi * alpha[:, None] + pv_hi

  def exact_block(blk, carry):
    if len(cfg.branches) == 1:  # one class: its store holds every block in order
      return exact_tile(cfg.branches[0], blk, blk, carry)
    code = r["table"][blk]
    slot = code >> 2
    fns = [functools.partial(exact_tile, cls) for cls in cfg.branches]
    return lax.switch(code & 3, fns, slot, blk, carry)

  carry = (jnp.full((BLOCK,), M_INIT, jnp.float32), jnp.zeros((BLOCK,), jnp.float32),
           jnp.zeros((BLOCK, half), jnp.float32), jnp.zeros((BLOCK, half), jnp.float32))
  nb = cfg.num_blocks
  blocks_ref = r["blocks"]
  carry, count, n_tiles = walk_exact_blocks(exact_block, carry, blocks_ref, r["counts"], qb, num_blocks=nb,
                                            sink_blocks=cfg.sink_blocks, sink_q=cfg.sink_q)

  if cfg.tail:
    cen_lo, cen_hi = r["cen"][qb, lo], r["cen"][qb, hi]
    c_kg = (cen_lo * kg_lo).sum() + (cen_hi * kg_hi).sum()

    def pooled(t, state):
      carry, ptr = state
      m, l, o_lo, o_hi = carry
      bids = t * BLOCK + ar
      in_range = bids < nb
      tiles = pl.ds(t * BLOCK, BLOCK)
      tmask = jnp.broadcast_to(in_range[:, None], (BLOCK, half))
      km_lo = plgpu.load(r["km"].at[tiles, lo], mask=tmask, other=0.0).astype(jnp.float32)
      km_hi = plgpu.load(r["km"].at[tiles, hi], mask=tmask, other=0.0).astype(jnp.float32)
      s = ((km_lo * cen_lo[None, :]).sum(-1) + (km_hi * cen_hi[None, :]).sum(-1) - c_kg) * qks
      m_new, alpha, pb, l, ptr = pooled_step(s, m, l, blocks_ref, r.get("lens"), qb, t, ptr, count, num_blocks=nb,
                                             num_tokens=cfg.num_tokens, sink_blocks=cfg.sink_blocks)

      def pv_half(chans):
        vs = plgpu.load(r["vs"].at[tiles, chans], mask=tmask, other=0.0).astype(jnp.float32)
        a, b = split_bf16(vs)  # one more dot, no f32 dot
        return _dot(pb, a) + _dot(pb, b)
      o_lo = o_lo * alpha[:, None] + pv_half(lo)
      o_hi = o_hi * alpha[:, None] + pv_half(hi)
      return (m_new, l, o_lo, o_hi), ptr

    carry, _ = lax.fori_loop(0, n_tiles, pooled, (carry, jnp.int32(0)))

  _, l, o_lo, o_hi = carry
  inv = 1.0 / jnp.where(l > 0.0, l, 1.0)  # l == 0: nothing to attend, o is 0
  o_lo = o_lo * inv[:, None]
  o_hi = o_hi * inv[:, None]
  if not cfg.keep_rotated:
    o_lo, o_hi = unrotate_halves(o_lo, o_hi, r["ht"], lo, hi, d)
  plgpu.store(o_ref.at[q_tile, lo], o_lo.astype(o_ref.dtype), mask=row_mask)
  plgpu.store(o_ref.at[q_tile, hi], o_hi.astype(o_ref.dtype), mask=row_mask)


def _block_table(meta) -> np.ndarray:
  """(NB,) int32 ``slot * 4 + branch``; branches are the present classes in order (the
  kernel reads classes whose K and V share a width, so K's slots are V's)."""
  present = [fmt.CLASS_ID[c] for c in fmt.CLASSES if meta.slots(c)]
  branch = np.asarray([present.index(c) for c in meta.block_classes], np.int32)
  return meta.block_slots("k") * 4 + branch


def fused_sol(q, packed, routing: SolRouting, key_bias, block_len, plan: SolPlan, *, keep_rotated, interpret,
              num_warps, num_stages, overwrite_q=False):
  meta = packed.meta
  refuse_outside_fused(meta.block_classes, "Sol method='fused'",
                       "use Sol(method='streamed') or 'streamed_int8' (raise scratch_bytes if auto fell back to fused)")
  b, t, h, d = q.shape
  nb = plan.num_blocks
  branches = tuple(c for c in fmt.CLASSES if meta.slots(c))
  cfg = _KConfig(head_dim=d, num_tokens=t, num_blocks=nb, qk_scale=plan.log2_scale, k_scheme=meta.k_scheme,
                 v_scheme=meta.v_scheme, branches=branches, sink_blocks=plan.sink_blocks, sink_q=plan.sink_q,
                 tail=plan.tail, has_key_bias=key_bias is not None, has_block_len=block_len is not None,
                 keep_rotated=keep_rotated)
  inputs = NamedInputs()
  add = inputs.add

  per_bh = lambda i, j, k: (k, j, 0, 0)
  shared = lambda n: (lambda i, j, k: (0,) * n)
  add("q", q, (None, t, None, d), lambda i, j, k: (k, 0, j, 0))
  if len(branches) > 1:
    add("table", jnp.asarray(_block_table(meta)), (nb,), shared(1))
  if block_len is not None:
    add("lens", block_lengths(t, block_len), (nb,), shared(1))
  add("kg", routing.k_global, (None, None, d), lambda i, j, k: (k, j, 0))
  add("blocks", routing.blocks, (None, None) + routing.blocks.shape[2:], per_bh)
  add("counts", routing.counts, (None, None, nb), lambda i, j, k: (k, j, 0))
  if plan.tail:
    add("cen", routing.centroid, (None, None, nb, d), per_bh)
    add("km", routing.k_mean, (None, None, nb, d), per_bh)
    add("vs", packed.v_sum, (None, None, nb, d), per_bh)
  if key_bias is not None:
    kb = normalize_key_bias(key_bias, b, t) * LOG2E
    add("kb", kb, (None, t), lambda i, j, k: (k, 0))
  if not keep_rotated:
    ht = fmt.hadamard_signs(d, meta.rotation_seed_v).T
    add("ht", jnp.asarray(ht, jnp.bfloat16), (d, d), shared(2))
  for cls in branches:
    for role in ("k", "v"):
      if cls == "bf16":
        a = packed.arrays[f"{role}_bf16"]
        add(f"{role}_bf16", a, (None, None) + a.shape[2:], per_bh)
        continue
      sfx = "4" if cls == "int4" else "8"
      codes = packed.arrays[f"{role}_codes{sfx}"]
      add(f"{role}_codes{sfx}", codes, (None, None) + codes.shape[2:], per_bh)
      scheme = meta.k_scheme if role == "k" else meta.v_scheme
      for part in ("scale", "zero"):
        a = packed.arrays[f"{role}_{part}{sfx}"]
        if scheme == "channel":
          add(f"{role}_{part}{sfx}", a, (None, None) + a.shape[2:], per_bh)
          continue
        for g in range(a.shape[2]):  # one 1-D ref per channel group
          add(f"{role}_{part}{sfx}_g{g}", a, (None, None, None, a.shape[3]), lambda i, j, k, g=g: (k, j, g, 0))
  kernel = functools.partial(_kernel, names=inputs.ref_names("out"), cfg=cfg)
  return pl.pallas_call(
      kernel,
      grid=(nb, h, b),
      in_specs=inputs.specs,
      out_specs=pl.BlockSpec((None, t, None, d), lambda i, j, k: (k, 0, j, 0)),
      out_shape=jax.ShapeDtypeStruct(q.shape, jnp.bfloat16),
      # Each program reads its own q tile before it writes the same output tile, and
      # no other program touches it, so the output may take q's buffer.
      input_output_aliases={0: 0} if overwrite_q else {},
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name="sol_attention",
  )(*inputs.args)

