"""The fused projection kernel: x @ W_qkv with the whole Q/K/V epilogue in the same
Pallas kernel (``streamed_qkv(method="fused")``).

It needs no scratch at all: each program holds one head of one token tile in
registers, runs its GEMM, finishes it and stores only its final form. The
``chunked`` method (``qkv_epilogue``) runs the GEMM through cuBLAS instead and is
faster on GPUs (``benchmarks/NOTES.md``); this kernel stays as the zero-scratch
choice and the one that needs no vendor GEMM.

Kernels (Pallas, Triton backend; interpret mode on CPU):

* Q call, grid ``(H, cdiv(T, block_q), B)``. Heads vary fastest, so programs that
  run together share their x tile in L2. Each program runs the GEMM for one head
  (two D/2-channel halves), then RMSNorm -> partial RoPE -> rotation by R_k and a
  masked BF16 store.
* One K/V call per precision class that has blocks, grid ``(H, slots, B)``. A
  program owns one 64-token block (``slot_table[slot]``, an int32 input read in
  the kernel: Pallas-Triton has no scalar prefetch) of one head, computes K and V
  from one x tile, the block stats (K mean, V sum over live tokens), quantizes and
  packs. Codes, scales and zeros go through BlockSpecs indexed by the slot; the
  stats rows are written in place into (B, H, NB, D) buffers that every class call
  aliases, so each block's row is written by exactly the call that owns it.

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

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from formats import packed_kv as fmt
from pallas_kernels import backend
from pallas_kernels.backend import dot
from pallas_kernels.qkv_ops import (EpilogueConstants, add_bias, class_array_names, finish_block,
                                           norm_rope, rotate)

BLOCK = fmt.BLOCK


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


def _q_kernel(*refs, has_bias, quadrants, t, hidden, bq, bh, dh, layout, full_width, qh):
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
    lo, hi = add_bias(lo, hi, b_ref, dh, off=2 * dh * j)
    lo, hi = norm_rope(lo, hi, nw_ref, cos_ref, sin_ref, p_ref, row0, bq, valid, dh=dh,
                       layout=layout, quadrants=quadrants)
    lo, hi = rotate(lo, hi, h_ref, sign_ref, dh=dh)
    # q_ref is (T, D) at qh = 1 (head axis squeezed), else (T, qh, D).
    at = (lambda c0: q_ref.at[pl.ds(row0, bq), pl.ds(c0, dh)]) if qh == 1 else (
        lambda c0: q_ref.at[pl.ds(row0, bq), jnp.int32(j), pl.ds(c0, dh)])
    plgpu.store(at(0), lo.astype(q_ref.dtype), mask=m)
    plgpu.store(at(dh), hi.astype(q_ref.dtype), mask=m)


def _kv_kernel(*refs, cls, has_bias, quadrants, k_scheme, v_scheme, t, hidden, bh, dh, layout,
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
    k_lo, k_hi = add_bias(k_lo, k_hi, bk_ref, dh)
    k_lo, k_hi = norm_rope(k_lo, k_hi, nw_ref, cos_ref, sin_ref, p_ref, row0, BLOCK, valid,
                           dh=dh, layout=layout, quadrants=quadrants)
    k_lo, k_hi = rotate(k_lo, k_hi, h_ref, sk_ref, dh=dh)
    finish_block(k_lo, k_hi, kmean_ref, k_out, blk, valid, width=fmt.CLASS_WIDTHS[cls][0], scheme=k_scheme, t=t,
                 dh=dh, mean=True, slot=slot)
    v_lo, v_hi = add_bias(v_lo, v_hi, bv_ref, dh)
    v_lo, v_hi = rotate(v_lo, v_hi, h_ref, sv_ref, dh=dh)
    finish_block(v_lo, v_hi, vsum_ref, v_out, blk, valid, width=fmt.CLASS_WIDTHS[cls][1], scheme=v_scheme, t=t,
                 dh=dh, mean=False, slot=slot)


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
  if not isinstance(n, (int, np.integer)) or isinstance(n, bool) or n < 16 or n & (n - 1):
    raise ValueError(f"{name} must be a power of two >= 16, got {n}")


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
    sshape = jax.ShapeDtypeStruct(fmt.scale_shape(meta, role, fmt.CLASS_WIDTHS[cls][0]), jnp.dtype(fmt.PARAM_DTYPE))
    if nblk > 1:
      sspec = _head_spec(sshape.shape)
    elif scheme == "channel":
      sspec = pl.BlockSpec((None, None, 1, d), lambda h, s, bb: (bb, h, s, 0))
    else:
      sspec = _token_scale_spec(2 if scheme == "token_g64" else 1)
    shapes += [codes, sshape, sshape]
    specs += [codes_spec, sspec, sspec]
  return shapes, specs


def check_tiles(block_q, block_h, q_heads_per_program, kv_blocks_per_program, num_warps, num_stages):
  """Raise ValueError on tile settings this kernel cannot run (at ``ProjectionTuning``'s
  construction; the head count is checked against ``q_heads_per_program`` per call)."""
  _pow2(block_q, "block_q")
  _pow2(block_h, "block_h")
  qh, nblk = q_heads_per_program, kv_blocks_per_program
  if qh not in (1, 2, 4):
    raise ValueError(f"q_heads_per_program must be 1, 2 or 4, got {qh!r}")
  if nblk not in (1, 2):
    raise ValueError(f"kv_blocks_per_program must be 1 or 2, got {nblk!r}")
  if any(v not in (1, 2, 4, 8, 16) for v in _per_call(num_warps, DEFAULT_NUM_WARPS, "num_warps")):
    raise ValueError(f"num_warps must be a power of two up to 16 (or a (q, kv) pair of them), got {num_warps!r}")
  if any(not 1 <= v <= 8 for v in _per_call(num_stages, DEFAULT_NUM_STAGES, "num_stages")):
    raise ValueError(f"num_stages must be in 1..8 (or a (q, kv) pair of them), got {num_stages!r}")


def unsupported_layout_reason(layout) -> str | None:
  """Why this kernel cannot run ``layout`` (None when it can): each program sees one
  head of a token tile, so neither a norm across heads nor per-head tables fit."""
  if layout.norm == "across":
    return "a QK norm across heads needs every head of a token at once"
  if layout.norm == "head_layer":
    return "a LayerNorm QK norm is applied by the chunked method's epilogue only"
  if layout.rope_per_head:
    return "per-head RoPE tables are read by the chunked method only"
  return None


def fused_qkv(x, w_qkv, bias, cos, sin, consts: EpilogueConstants, meta, *, interpret, block_q,
              block_h, num_warps, num_stages, full_width_gemm, q_heads_per_program,
              kv_blocks_per_program):
  """(Q (B, T, H, D) bf16, PackedKV) from x; inputs already validated (``streamed_qkv``).

  ``block_q`` is the Q token tile, ``block_h`` the hidden (GEMM-K) tile; K/V tiles
  are always one 64-token block. ``num_warps`` / ``num_stages``: an int for every
  call, or a (Q call, K/V calls) pair; None picks ``DEFAULT_NUM_WARPS`` /
  ``DEFAULT_NUM_STAGES``. ``full_width_gemm``: one N = D dot per step instead of two
  N = D/2 dots (pair it with 8 warps; see ``_gemm_halves``). ``q_heads_per_program``
  (1, 2 or 4, dividing H): one x tile feeds an N = q_heads_per_program * D GEMM;
  ``kv_blocks_per_program`` (1 or 2): each W tile feeds the dots of that many 64-token
  blocks. Larger values raise the GEMM's FLOPs per loaded byte at the cost of registers.
  """
  reason = unsupported_layout_reason(consts.layout)
  if reason is not None:
    raise NotImplementedError(f"method='fused' cannot run this layout: {reason}; use method='chunked'")
  qh, nblk = q_heads_per_program, kv_blocks_per_program
  b, t, hidden = x.shape
  hh, d, nb = meta.heads, meta.head_dim, meta.num_blocks
  dh = d // 2
  bq = min(block_q, max(16, pl.next_power_of_2(t)))
  quadrants = consts.quadrants
  warps = _per_call(num_warps, DEFAULT_NUM_WARPS, "num_warps")
  stages = _per_call(num_stages, DEFAULT_NUM_STAGES, "num_stages")
  q_params = plgpu.CompilerParams(num_warps=warps[0], num_stages=stages[0])
  kv_params = plgpu.CompilerParams(num_warps=warps[1], num_stages=stages[1])
  p_mat, h_half, sk, sv = consts.p_mat, consts.h_half, consts.signs_k, consts.signs_v
  qn, kn = consts.q_norm, consts.k_norm

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
                        hidden=hidden, bq=bq, bh=block_h, dh=dh, layout=consts.layout,
                        full_width=full_width_gemm, qh=qh),
      grid=(hh // qh, pl.cdiv(t, bq), b),
      in_specs=q_specs + const_specs,
      out_specs=q_out_spec,
      out_shape=jax.ShapeDtypeStruct((b, t, hh, d), jnp.bfloat16),
      compiler_params=q_params, interpret=interpret, name="streamed_qkv_q",
  )(*q_args, qn, cos, sin, p_mat, h_half, sk)

  # ---- K/V, one call per class ------------------------------------------------------
  # NaN start: a block that no class call wrote would show up at once.
  stats = [jnp.full((b, hh, nb, d), jnp.nan, jnp.dtype(fmt.STAT_DTYPE)) for _ in range(2)]
  stats_spec = pl.BlockSpec((None, None, nb, d), lambda h, s, bb: (bb, h, 0, 0))
  arrays = {}
  for cls in backend.FUSED_CLASSES:  # other classes: the chunked method (resolve_method)
    slots = meta.slots(cls)
    n = len(slots)
    if n == 0:  # the format still lists the store, with a zero-length token axis (below)
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
                          k_scheme=meta.k_scheme, v_scheme=meta.v_scheme, t=t, hidden=hidden,
                          bh=block_h, dh=dh, layout=consts.layout, full_width=full_width_gemm,
                          nblk=nblk, n=n),
        grid=(hh, pl.cdiv(n, nblk), b),
        in_specs=kv_specs,
        out_specs=[stats_spec, stats_spec] + cls_specs,
        out_shape=[jax.ShapeDtypeStruct((b, hh, nb, d), jnp.dtype(fmt.STAT_DTYPE))] * 2 + cls_shapes,
        input_output_aliases={n_in - 2: 0, n_in - 1: 1},
        compiler_params=kv_params, interpret=interpret, name=f"streamed_qkv_kv_{cls}",
    )(*kv_args)
    stats = outs[:2]
    arrays.update(zip(class_array_names(cls), outs[2:]))
  arrays["k_mean"], arrays["v_sum"] = stats
  specs = fmt.buffer_specs(meta)
  return q, fmt.PackedKV(meta, {name: arrays[name] if name in arrays else jnp.zeros(*specs[name])
                                for name in fmt.ARRAY_NAMES})
