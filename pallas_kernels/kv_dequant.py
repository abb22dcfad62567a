"""Decode one head group of a PackedKV into a bounded bf16 scratch: in the layout cuDNN
flash attention takes (``packed_attention(method="streamed")``), or as the bf16 store
of a PackedKV (``sol_attention(method="streamed")``).

Why: cuDNN is the fastest attention on every NVIDIA GPU it supports, and it reads
bf16. Decoding the whole K and V would bring back the global expansion the format
exists to avoid, so the streamed path decodes g heads at a time (g from a byte
budget) and hands each group to cuDNN; this kernel is that decode. It is
memory-bound: it reads the group's codes and scales once and writes bf16 once, with
no float32 intermediate in memory.

Kernel layout
-------------
* Grid ``(g, NB, B)``: one program per (head of the group, 64-token block, batch row).
* The group's first head is an int32 input (``head0``), not a static number, so one
  compiled kernel serves every group of a ``fori_loop``. The packed arrays come in
  per batch row (BlockSpec ``(None, H, ...)``) and the kernel indexes the head
  itself.
* A block's class is data: for each role, ``{k,v}_widths[blk]`` / ``{k,v}_slots[blk]``
  pick the store of that code width and the slot, one ``pl.when`` branch per width the
  role has blocks at. Every class (int4, k5v4, k5v5, int8, bf16) and every K/V scheme
  decodes here, the ragged last block included (its rows past T are not stored). A
  5-bit code is the int4 layout's nibble plus 16 times its bit in the fifth-bit plane.
* Outputs are (B, T, g, D) bf16 (cuDNN's BTNH layout, ``layout="bthd"``), written
  with masked row stores, or (B, g, NB * 64, D) (one 64-row slot per block,
  ``layout="bhtd"``: what Sol's exact loop reads), whose rows past T are written as
  zeros so a reader may load whole tiles without masks and stay NaN-free.
* ``store="int8_k"`` (``bhtd`` only) writes K for 8-bit Q.K dots: ``k - center``
  (``center`` (B, H, D) f32, Sol's global key mean, which shifts every logit of a
  row by one constant, so softmax is unchanged while K's channel offsets leave the
  8-bit range) as int8 codes with one f32 scale per token (absmax / 127, rounded
  half away from zero), V in bf16 as always.
* ``unrotate_v``: V is multiplied by ``R_v^T`` before it is rounded, so attention's
  output ``P (V R_v^T) = (P V) R_v^T`` comes out un-rotated with no pass over it.
* Everything works on the two channel halves of the format's split-half packing
  (Triton cannot slice a loaded value).

``dequantize_group_reference`` defines it.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from formats import packed_kv as fmt
from pallas_kernels.backend import (INT4_OFFSET, NamedInputs, int4_halves, int8_codes, int8_to_bf16,
                                    quantize_rows_int8, unrotate_halves)

BLOCK = fmt.BLOCK


def dequantize_group_reference(packed: fmt.PackedKV, head0: int, heads: int, *, unrotate_v: bool):
  """(K, V) of heads ``[head0, head0 + heads)`` as (B, T, heads, D) bf16, in float32
  then rounded once: K in the rotated basis, V un-rotated by ``R_v^T`` if asked."""
  k, v = fmt.dequantize_reference(packed)
  k, v = k[:, :, head0:head0 + heads], v[:, :, head0:head0 + heads]
  if unrotate_v:
    r_v = jnp.asarray(fmt.hadamard_rotation(packed.meta.head_dim, packed.meta.rotation_seed_v))
    v = jnp.einsum("bthd,ed->bthe", v, r_v, precision=lax.Precision.HIGHEST)
  return k.astype(jnp.bfloat16), v.astype(jnp.bfloat16)


def dequantize_group_int8_k_reference(packed: fmt.PackedKV, head0: int, heads: int, center, *, unrotate_v: bool):
  """``store="int8_k"``'s definition: (K codes (B, heads, NB*64, D) int8, K scales
  (B, heads, NB*64) f32, V (B, heads, NB*64, D) bf16), rows past T zero."""
  k, v = fmt.dequantize_reference(packed)
  b, t, _, d = k.shape
  pad = packed.meta.num_blocks * BLOCK - t
  k = k[:, :, head0:head0 + heads] - jnp.asarray(center, jnp.float32)[:, None, head0:head0 + heads]
  codes, scale = quantize_rows_int8(jnp.pad(k, ((0, 0), (0, pad), (0, 0), (0, 0))).transpose(0, 2, 1, 3))
  live = (jnp.arange(t + pad) < t)
  codes, scale = jnp.where(live[:, None], codes, 0), jnp.where(live, scale, 0.0)
  _, v = dequantize_group_reference(packed, head0, heads, unrotate_v=unrotate_v)
  v = jnp.pad(v, ((0, 0), (0, pad), (0, 0), (0, 0))).transpose(0, 2, 1, 3)
  return codes.astype(jnp.int8), scale, v


def _kernel(*refs, names, meta: fmt.PackedKVMeta, unrotate_v, layout, store):
  r = dict(zip(names, refs))
  d = meta.head_dim
  dh = d // 2
  lo_c, hi_c = pl.ds(0, dh), pl.ds(dh, dh)
  h = r["head0"][0] + pl.program_id(0)
  blk = pl.program_id(1)
  valid = (blk * BLOCK + jnp.arange(BLOCK)) < meta.num_tokens
  out_rows = pl.ds(blk * BLOCK, BLOCK)

  def codes_f32(role, width, rows):
    """The slot's codes as f32 halves (exact)."""
    if width == 8:
      c8 = r[role + "_codes8"]
      return (int8_to_bf16(c8[h, rows, lo_c]).astype(jnp.float32),
              int8_to_bf16(c8[h, rows, hi_c]).astype(jnp.float32))
    lo, hi = int4_halves(r[f"{role}_codes{width}"][h, rows, :])
    lo, hi = lo.astype(jnp.float32) - INT4_OFFSET, hi.astype(jnp.float32) - INT4_OFFSET
    if width == 5:  # each half's fifth bits: D/16 bytes of the plane
      plane, nb = r[role + "_bits5"], dh // 8
      lo = lo + 16.0 * fmt.unpack_bits(plane[h, rows, pl.ds(0, nb)]).astype(jnp.float32)
      hi = hi + 16.0 * fmt.unpack_bits(plane[h, rows, pl.ds(nb, nb)]).astype(jnp.float32)
    return lo, hi

  def decoded(role, width, slot):
    """(64, D/2) f32 halves of the slot's values: code * scale + zero."""
    rows = pl.ds(slot * BLOCK, BLOCK)
    if width == 16:
      x = r[role + "_bf16"]
      return x[h, rows, lo_c].astype(jnp.float32), x[h, rows, hi_c].astype(jnp.float32)
    c_lo, c_hi = codes_f32(role, width, rows)
    s_ref, z_ref = r[f"{role}_scale{width}"], r[f"{role}_zero{width}"]
    scheme = meta.k_scheme if role == "k" else meta.v_scheme
    if scheme == "channel":  # (H, N, D): one row per slot
      params = [(s_ref[h, slot, c][None, :], z_ref[h, slot, c][None, :]) for c in (lo_c, hi_c)]
      params = [(s.astype(jnp.float32), z.astype(jnp.float32)) for s, z in params]
    else:  # (H, groups, N * 64): one column per token, group g for half g (token_g64)
      groups = 2 if scheme == "token_g64" else 1
      params = [(s_ref[h, g % groups, rows][:, None].astype(jnp.float32),
                 z_ref[h, g % groups, rows][:, None].astype(jnp.float32)) for g in (0, 1)]
    (s_lo, z_lo), (s_hi, z_hi) = params
    return c_lo * s_lo + z_lo, c_hi * s_hi + z_hi

  m = valid[:, None]

  def write(ref, lo, hi):
    if layout == "bthd":  # rows past T are not in the output
      plgpu.store(ref.at[out_rows, lo_c], lo, mask=m)
      plgpu.store(ref.at[out_rows, hi_c], hi, mask=m)
    else:                 # the slot is whole: rows past T become zeros
      ref[out_rows, lo_c] = jnp.where(m, lo, jnp.zeros_like(lo))
      ref[out_rows, hi_c] = jnp.where(m, hi, jnp.zeros_like(hi))

  for role in ("k", "v"):
    width, slot = r[role + "_widths"][blk], r[role + "_slots"][blk]
    for w in meta.widths(role):
      @pl.when(width == w)
      def _(w=w, role=role, slot=slot):
        lo, hi = decoded(role, w, slot)
        if role == "k" and store == "int8_k":
          # quantize_rows_int8 over the two halves (Triton cannot slice a loaded value).
          lo, hi = lo - r["center"][h, lo_c][None, :], hi - r["center"][h, hi_c][None, :]
          amax = jnp.maximum(jnp.abs(lo).max(-1), jnp.abs(hi).max(-1))
          write(r["k_out"], int8_codes(lo, amax), int8_codes(hi, amax))
          r["k_scale_out"][out_rows] = jnp.where(valid, amax * (1.0 / 127.0), 0.0)
          return
        if role == "v" and unrotate_v:
          lo, hi = unrotate_halves(lo, hi, r["ht"], lo_c, hi_c, d)
        write(r[role + "_out"], lo.astype(jnp.bfloat16), hi.astype(jnp.bfloat16))


LAYOUTS = ("bthd", "bhtd")
STORES = ("bf16", "int8_k")


def dequantize_group(packed: fmt.PackedKV, head0, heads: int, *, unrotate_v: bool, interpret: bool,
                     num_warps: int = 4, layout: str = "bthd", store: str = "bf16", center=None):
  """(K, V) of heads ``[head0, head0 + heads)``: (B, T, heads, D) bf16 each, or with
  ``layout="bhtd"`` (B, heads, NB * 64, D), the rows of block ``b`` at ``b * 64``.
  ``store="int8_k"`` (``bhtd`` only, ``center`` (B, H, D) f32 required): (K codes
  int8, K scales (B, heads, NB * 64) f32, V bf16), as
  ``dequantize_group_int8_k_reference`` defines.

  ``head0``: a Python int or a traced int32 scalar (the group loop's index).
  """
  if layout not in LAYOUTS:
    raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
  if store not in STORES:
    raise ValueError(f"store must be one of {STORES}, got {store!r}")
  if store == "int8_k" and (layout != "bhtd" or center is None):
    raise ValueError("store='int8_k' needs layout='bhtd' and center=(B, H, D) float32 (Sol's k_global)")
  meta = packed.meta
  b, t, d = meta.batch, meta.num_tokens, meta.head_dim
  inputs = NamedInputs()
  inputs.add_whole("head0", jnp.reshape(jnp.asarray(head0, jnp.int32), (1,)))
  per_batch = lambda x: pl.BlockSpec((None,) + x.shape[1:], lambda j, blk, bi: (bi,) + (0,) * (x.ndim - 1))
  for role in ("k", "v"):
    inputs.add_whole(role + "_widths", jnp.asarray(meta.block_widths(role)))
    inputs.add_whole(role + "_slots", jnp.asarray(meta.block_slots(role)))
    for w in meta.widths(role):
      for name in fmt.store_names(role, w):
        inputs.add_spec(name, packed.arrays[name], per_batch(packed.arrays[name]))
  if unrotate_v:
    inputs.add_whole("ht", jnp.asarray(fmt.hadamard_signs(d, meta.rotation_seed_v).T, jnp.bfloat16))
  if store == "int8_k":
    center = jnp.asarray(center, jnp.float32)
    if center.shape != (b, meta.heads, d):
      raise ValueError(f"center must be (B, H, D) = {(b, meta.heads, d)}, got {tuple(center.shape)}")
    inputs.add_spec("center", center, per_batch(center))
  if layout == "bthd":
    out_spec = pl.BlockSpec((None, t, None, d), lambda j, blk, bi: (bi, 0, j, 0))
    shape = jax.ShapeDtypeStruct((b, t, heads, d), jnp.bfloat16)
  else:
    rows = meta.num_blocks * BLOCK
    out_spec = pl.BlockSpec((None, None, rows, d), lambda j, blk, bi: (bi, j, 0, 0))
    shape = jax.ShapeDtypeStruct((b, heads, rows, d), jnp.bfloat16)
  names, out_specs, out_shapes = ("k_out", "v_out"), [out_spec, out_spec], [shape, shape]
  if store == "int8_k":
    names = ("k_out", "k_scale_out", "v_out")
    out_specs = [out_spec, pl.BlockSpec((None, None, rows), lambda j, blk, bi: (bi, j, 0)), out_spec]
    out_shapes = [jax.ShapeDtypeStruct(shape.shape, jnp.int8), jax.ShapeDtypeStruct((b, heads, rows), jnp.float32),
                  shape]
  return pl.pallas_call(
      functools.partial(_kernel, names=inputs.ref_names(*names), meta=meta, unrotate_v=unrotate_v,
                        layout=layout, store=store),
      grid=(heads, meta.num_blocks, b),
      in_specs=inputs.specs,
      out_specs=out_specs,
      out_shape=out_shapes,
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=1),
      interpret=interpret,
      name="kv_dequant",
  )(*inputs.args)
