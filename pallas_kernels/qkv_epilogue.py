"""The projection epilogue over one row chunk: f32 ``y = x[rows] @ W_qkv`` -> the final
Q and PackedKV buffers, written in place (``streamed_qkv(method="chunked")``).

Why a separate epilogue: cuBLAS runs the GEMM faster than any Pallas GEMM we wrote
(``benchmarks/NOTES.md``), so ``streamed_qkv`` computes the projection one row chunk at
a time into a bounded f32 scratch, and this one kernel does everything else for the
chunk: the bias, the layout's QK norm and RoPE (``qkv_layout.QKVLayout``), the Hadamard
rotation, the block stats, quantization of every precision class, nibble packing. Its outputs alias the final
buffers (``input_output_aliases``), so nothing is concatenated or copied afterwards.

Kernel layout
-------------
* Grid ``(H, rows / 64)``: one program per (head, 64-token block of the chunk). The
  chunk's first token row, its row offset in y and its batch row are int32 inputs
  (``pos``), not static numbers, so one compiled kernel serves every chunk of a
  ``fori_loop``.
* ``y`` is one whole (rows, 3HD) f32 ref; a program loads its (64, D/2) halves of
  columns ``h`` (Q), ``H + h`` (K) and ``2H + h`` (V) with masked ``pl.ds`` loads,
  from a row offset (``shift``) that lets the last chunk of a ragged sequence start
  64-aligned. The final buffers are each head's arrays over all batch rows (the batch
  row is data too), written with masked ``pl.ds`` stores at the block's row, slot or
  stat row.
* A block's precision class is data, not code: for each role, ``{k,v}_widths[blk]``
  and ``{k,v}_slots[blk]`` (int32 tables over the global blocks) pick the store of that
  code width with ``pl.when``, one branch per width the role has blocks at.
* A norm across heads needs each token's mean square over all H*D channels of q and
  of k, which no (head, block) program sees: the caller computes it per chunk in jnp
  (``across_head_mean_squares``, one reduction XLA fuses) and passes it as ``ms``.
* The math is ``qkv_ops``'s, shared with the fused kernel, so both methods
  give the same codes up to rounding ties (the GEMM's accumulation order differs).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from formats import packed_kv as fmt
from pallas_kernels import rope
from pallas_kernels.backend import NamedInputs
from pallas_kernels.qkv_layout import QKVLayout, rms_norm_reference
from pallas_kernels.qkv_ops import EpilogueConstants, add_bias, block_stats, norm_rope, rotate, store_width

BLOCK = fmt.BLOCK


# --------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------
def rotated_qkv_reference(y, bias, *, layout: QKVLayout, q_norm_weight=None, k_norm_weight=None, rope_cos,
                          rope_sin, rotation_seed_k=0, rotation_seed_v=1):
  """f32 (B, T, H, D) q, k, v in the rotated basis from the projection ``y`` (B, T, 3HD).

  The epilogue's definition: bias, the layout's QK norm and RoPE, then ``R_k`` on q
  and k and ``R_v`` on v, all in float32.
  """
  b, t, _ = y.shape
  h, d = layout.heads, layout.head_dim
  hi = jax.lax.Precision.HIGHEST  # GPUs would otherwise use TF32 for f32 matmuls
  y = y.astype(jnp.float32)
  if bias is not None:
    y = y + bias.astype(jnp.float32)
  q, k, v = (y.reshape(b, t, 3, h, d)[:, :, i] for i in range(3))
  r_k = jnp.asarray(fmt.hadamard_rotation(d, rotation_seed_k))
  r_v = jnp.asarray(fmt.hadamard_rotation(d, rotation_seed_v))

  def qk_epilogue(z, weight):
    z = rms_norm_reference(z, weight, layout)
    z = rope.apply_rope_reference(z, rope_cos, rope_sin, layout.rot_dim, layout.rope)
    return jnp.dot(z, r_k, precision=hi)

  return qk_epilogue(q, q_norm_weight), qk_epilogue(k, k_norm_weight), jnp.dot(v, r_v, precision=hi)


def across_head_mean_squares(y, bias, layout: QKVLayout):
  """(2, rows) f32: each row's mean square over the q and over the k columns of the
  projection ``y`` (rows, 3HD), bias included: the norm across heads' statistic."""
  hd = layout.heads * layout.head_dim
  qk = y[:, :2 * hd].astype(jnp.float32)
  if bias is not None:
    qk = qk + bias[:2 * hd].astype(jnp.float32)
  return jnp.mean(jnp.square(qk).reshape(-1, 2, hd), axis=-1).T


# --------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _Config:
  t: int
  layout: QKVLayout
  k_scheme: str
  v_scheme: str
  quadrants: tuple
  k_widths: tuple       # the code widths K has blocks at (each gets a store branch)
  v_widths: tuple
  added_from: int | None = None   # joint attention: the first token of the added part


def _kernel(*refs, names, cfg: _Config):
  r = dict(zip(names, refs))
  lay = cfg.layout
  d, dh, h = lay.head_dim, lay.head_dim // 2, pl.program_id(0)
  j = pl.program_id(1)
  row0 = r["pos"][0] + j * BLOCK              # this program's first token row
  yrow = r["pos"][1] + j * BLOCK              # ... and its row in y
  bi = r["pos"][2]                            # batch row
  blk = row0 // BLOCK
  valid = (row0 + jnp.arange(BLOCK)) < cfg.t
  m = valid[:, None]
  rows = pl.ds(row0, BLOCK)
  out = lambda name: _AtRow(r[name + "_out"], bi)  # this batch row's (head's) buffer
  # Joint attention: rows from added_from on are the added tokens, with their own bias
  # and norm weights (a block may hold both kinds).
  added_rows = None if cfg.added_from is None else (row0 + jnp.arange(BLOCK)) >= cfg.added_from

  def projected(role):
    col = (("q", "k", "v").index(role) * lay.heads + h) * d
    y = r["y"]
    lo = plgpu.load(y.at[pl.ds(yrow, BLOCK), pl.ds(col, dh)], mask=m, other=0.0).astype(jnp.float32)
    hi = plgpu.load(y.at[pl.ds(yrow, BLOCK), pl.ds(col + dh, dh)], mask=m, other=0.0).astype(jnp.float32)
    return add_bias(lo, hi, r.get("bias_" + role), dh, added_ref=r.get("added_bias_" + role), added_rows=added_rows)

  def qk(role, norm):
    lo, hi = projected(role)
    ms = None
    if lay.norm == "across":
      ms = plgpu.load(r["ms_" + role].at[pl.ds(yrow, BLOCK)], mask=valid, other=1.0)
    lo, hi = norm_rope(lo, hi, r[norm], r["cos"], r["sin"], r["p_mat"], row0, BLOCK, valid, dh=dh,
                       layout=lay, quadrants=cfg.quadrants, mean_square=ms, head=h,
                       added_nw_ref=r.get("added_" + norm), added_rows=added_rows)
    return rotate(lo, hi, r["h_half"], r["signs_k"], dh=dh)

  lo, hi = qk("q", "q_norm")
  plgpu.store(out("q").at[rows, pl.ds(0, dh)], lo.astype(jnp.bfloat16), mask=m)
  plgpu.store(out("q").at[rows, pl.ds(dh, dh)], hi.astype(jnp.bfloat16), mask=m)

  def finish(role, lo, hi, scheme):
    lo, hi = block_stats(lo, hi, out("k_mean" if role == "k" else "v_sum"), blk, valid, t=cfg.t, dh=dh,
                         mean=role == "k")
    width, slot = r[role + "_widths"][blk], r[role + "_slots"][blk]
    for w in (cfg.k_widths if role == "k" else cfg.v_widths):
      names = fmt.store_names(role, w)
      outs = out(names[0]) if w == 16 else tuple(out(n) for n in names)

      @pl.when(width == w)
      def _(w=w, outs=outs):
        store_width(lo, hi, valid, outs, width=w, scheme=scheme, dh=dh, slot=slot)

  # K is finished and stored before V is loaded, to keep register use down.
  finish("k", *qk("k", "k_norm"), cfg.k_scheme)
  lo, hi = projected("v")
  finish("v", *rotate(lo, hi, r["h_half"], r["signs_v"], dh=dh), cfg.v_scheme)


class _AtRow:
  """A ref seen at one leading index (the batch row): ``view.at[idx]`` is
  ``ref.at[(row, *idx)]``, one indexer, which the Triton lowering takes (the shared
  store helpers index their refs with ``.at[...]`` only)."""

  def __init__(self, ref, row):
    self.ref, self.row, self.dtype = ref, row, ref.dtype

  @property
  def at(self):
    return self

  def __getitem__(self, idx):
    return self.ref.at[(self.row, *(idx if isinstance(idx, tuple) else (idx,)))]


def buffer_names(meta) -> tuple:
  """The buffers the kernel writes, in output order: q, the stats, then the arrays of
  each store that has blocks (K's, then V's)."""
  names = ["q", "k_mean", "v_sum"]
  for role in ("k", "v"):
    for w in meta.widths(role):
      names += fmt.store_names(role, w)
  return tuple(names)


def _buffer_shapes(meta) -> dict:
  specs = fmt.buffer_specs(meta)
  shapes = {"q": ((meta.batch, meta.num_tokens, meta.heads, meta.head_dim), jnp.dtype(jnp.bfloat16))}
  return shapes | {n: (specs[n][0], jnp.dtype(specs[n][1])) for n in buffer_names(meta)[1:]}


def _head_spec(name, shape):
  """Each head's buffer over all batch rows (the batch row is data): Q is (B, T, H, D),
  the PackedKV arrays (B, H, ...)."""
  if name == "q":
    return pl.BlockSpec((shape[0], shape[1], None, shape[3]), lambda hh, j: (0, 0, hh, 0))
  return pl.BlockSpec((shape[0], None) + tuple(shape[2:]), lambda hh, j: (0, hh) + (0,) * (len(shape) - 2))


def _nothing(*refs):
  del refs


def empty_buffers(meta, *, interpret: bool) -> dict:
  """Uninitialized Q and PackedKV buffers for the chunks to fill (a pallas_call that
  writes nothing: no memset pass over 3+ GiB). Interpret mode fills them with NaN."""
  shapes = _buffer_shapes(meta)
  names = buffer_names(meta)
  whole = lambda shape: pl.BlockSpec(shape, lambda i: (0,) * len(shape))
  outs = pl.pallas_call(
      _nothing, grid=(1,), in_specs=[],
      out_specs=[whole(shapes[n][0]) for n in names],
      out_shape=[jax.ShapeDtypeStruct(*shapes[n]) for n in names],
      compiler_params=plgpu.CompilerParams(num_warps=1, num_stages=1),
      interpret=interpret, name="qkv_buffers")()
  return dict(zip(names, outs))


def epilogue_call(y, bias, row0, shift, batch_index, buffers, cos, sin, consts: EpilogueConstants, meta, *,
                  interpret: bool, num_warps: int = 4, num_stages: int = 1, added_from: int | None = None,
                  added_bias=None):
  """Run the epilogue of one chunk into ``buffers`` (aliased) and return them.

  y: (rows, 3HD) f32 (or bf16), rows a multiple of 64: the projection of tokens
  ``[row0 - shift, row0 - shift + rows)`` of batch row ``batch_index``. The kernel
  writes tokens ``[row0, row0 + rows)`` below T (row0 a multiple of 64; the y rows of
  token ``row0 + i`` is ``shift + i``). row0, shift, batch_index: int32 scalars,
  static or traced. buffers: a dict with every name of ``buffer_names(meta)``: Q
  (B, T, H, D) bf16 and the PackedKV arrays. Joint attention: tokens from ``added_from``
  (static) on take ``added_bias`` and ``consts``' added norm weights.
  """
  rows, width = y.shape
  h, d = meta.heads, meta.head_dim
  if rows % BLOCK or width != 3 * h * d:
    raise ValueError(f"y must be (rows, 3HD) with rows a multiple of {BLOCK}, got {y.shape}")
  shapes = _buffer_shapes(meta)
  cfg = _Config(t=meta.num_tokens, layout=consts.layout, k_scheme=meta.k_scheme,
                v_scheme=meta.v_scheme, quadrants=consts.quadrants, k_widths=meta.widths("k"),
                v_widths=meta.widths("v"), added_from=added_from)
  if added_from is not None and (bias is None) != (added_bias is None):   # one part without a bias: zeros
    bias, added_bias = (jnp.zeros((width,), jnp.float32) if b is None else b for b in (bias, added_bias))

  inputs = NamedInputs()
  inputs.add_whole("pos", jnp.stack([jnp.asarray(v, jnp.int32) for v in (row0, shift, batch_index)]))
  for role in ("k", "v"):
    inputs.add_whole(role + "_widths", jnp.asarray(meta.block_widths(role)))
    inputs.add_whole(role + "_slots", jnp.asarray(meta.block_slots(role)))
  inputs.add_whole("y", y)
  if consts.layout.norm == "across":
    ms = across_head_mean_squares(y, bias, consts.layout)
    if added_from is not None and added_bias is not None:
      tokens = jnp.asarray(row0, jnp.int32) - jnp.asarray(shift, jnp.int32) + jnp.arange(rows)
      ms = jnp.where(tokens >= added_from, across_head_mean_squares(y, added_bias, consts.layout), ms)
    inputs.add_whole("ms_q", ms[0])
    inputs.add_whole("ms_k", ms[1])
  for prefix, b in (("", bias), ("added_", added_bias if added_from is not None else None)):
    if b is not None:
      for i, role in enumerate("qkv"):
        inputs.add(prefix + "bias_" + role, b, (d,), lambda hh, j, i=i: (i * h + hh,))
  for name, x in (("q_norm", consts.q_norm), ("k_norm", consts.k_norm), ("cos", cos), ("sin", sin),
                  ("p_mat", consts.p_mat), ("h_half", consts.h_half), ("signs_k", consts.signs_k),
                  ("signs_v", consts.signs_v)):
    inputs.add_whole(name, x)
  if added_from is not None and consts.added_q_norm is not None:
    inputs.add_whole("added_q_norm", consts.added_q_norm)
    inputs.add_whole("added_k_norm", consts.added_k_norm)
  out_names = buffer_names(meta)
  aliases = {}
  for k, name in enumerate(out_names):
    aliases[len(inputs.args)] = k
    inputs.add_spec(name + "_in", buffers[name], _head_spec(name, shapes[name][0]))
  outs = pl.pallas_call(
      functools.partial(_kernel, names=inputs.ref_names(*(n + "_out" for n in out_names)), cfg=cfg),
      grid=(h, rows // BLOCK),
      in_specs=inputs.specs,
      out_specs=[_head_spec(n, shapes[n][0]) for n in out_names],
      out_shape=[jax.ShapeDtypeStruct(*shapes[n]) for n in out_names],
      input_output_aliases=aliases,
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name="qkv_epilogue",
  )(*inputs.args)
  return dict(zip(out_names, outs))
