"""Dense attention of BF16 Q over a packed low-bit K/V (formats/): the public entry point.

Two methods compute ``packed_attention``:

* ``"streamed"`` (the default on CUDA GPUs with cuDNN flash attention): for each group
  of g heads, ``kv_dequant`` decodes that group's K and V into a bounded bf16 scratch
  (g from ``scratch_bytes`` and T), cuDNN flash attention runs on it, and the group's
  output lands in the output buffer, or over Q (``overwrite_q``). The groups run in a
  ``lax.fori_loop``, so XLA holds one group's scratch at a time; no buffer holds all
  of K or V in bf16. V is decoded already un-rotated (``P (V R_v^T) = (P V) R_v^T``),
  so the output needs no extra pass. When one head's K and V alone exceed the budget,
  the queries are cut into row chunks as well.
* ``"fused"`` (``attention_fused``): one Pallas kernel that decodes K/V tile by tile in
  registers. No scratch; the path for segment ids and general key masks (cuDNN takes
  only per-row key lengths), GPUs without cuDNN flash attention, CPU interpret mode.

Which inputs take which path (``method="auto"``):

| inputs | path |
|---|---|
| no mask, or ``kv_lengths`` (trailing key padding per batch row) | streamed: cuDNN's own padding mask |
| ``q_segment_ids`` / ``kv_segment_ids`` (packed varlen) or ``kv_mask`` | fused (block skipping over segments) |
| CPU, interpret mode, no cuDNN (compute capability < 8.0) | fused |
| ``scratch_bytes`` below one head's bf16 K and V plus 64 query rows | fused |
| any k5v4 / k5v5 block (the fused kernel reads int4, int8, bf16 only) | streamed, on the CPU too (XLA attention); with segment ids or ``kv_mask``, an error |

``method="streamed"`` also runs on the CPU, with XLA's attention in place of cuDNN
(it materializes each group's logits: for tests and small shapes).

``packed_attention_reference`` defines both.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import logging

from formats import packed_kv as fmt
from formats.reference import attention_lse_f32
from pallas_kernels.attention_config import DENSE_METHODS as METHODS
from pallas_kernels.attention_config import Dense
from pallas_kernels import sol, sol_decoded
from pallas_kernels.attention_fused import fused_attention
from pallas_kernels.backend import (LOG2E, classes_outside_fused, on_gpu, over_chunks, resolve_interpret,
                                    resolve_sm_scale)
from pallas_kernels.kv_dequant import dequantize_group

__all__ = ["Dense", "METHODS", "StreamedPlan", "packed_attention", "packed_attention_lse",
           "packed_attention_reference", "packed_attention_lse_reference", "resolve_method",
           "segment_ids_from_cu_seqlens", "streamed_plan"]

BLOCK = fmt.BLOCK
log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------
# Inputs
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


def _validate(q, packed, sm_scale, q_segment_ids, kv_segment_ids, kv_mask, kv_lengths=None):
  """Check every input; return (sm_scale, q_seg, kv_seg, kv_mask, kv_lengths) normalized."""
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
  if kv_lengths is not None:
    kv_lengths = jnp.asarray(kv_lengths)
    if kv_lengths.shape != (b,) or not jnp.issubdtype(kv_lengths.dtype, jnp.integer):
      raise ValueError(f"kv_lengths must be an integer (B,) = ({b},) array of valid keys per batch row, "
                       f"got {kv_lengths.dtype}{list(kv_lengths.shape)}")
    kv_lengths = kv_lengths.astype(jnp.int32)
  sm_scale = resolve_sm_scale(sm_scale, d)
  return sm_scale, q_segment_ids, kv_segment_ids, kv_mask, kv_lengths


def _lengths_mask(kv_lengths, kv_mask, num_tokens):
  """kv_lengths (B,) as a (B, T) key mask, combined with ``kv_mask``."""
  if kv_lengths is None:
    return kv_mask
  by_length = jnp.arange(num_tokens, dtype=jnp.int32)[None, :] < kv_lengths[:, None]
  return by_length if kv_mask is None else kv_mask & by_length


# --------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------
def packed_attention_lse_reference(q, packed, attention: Dense | None = None, *, q_segment_ids=None,
                                   kv_segment_ids=None, kv_mask=None, kv_lengths=None, keep_rotated=False):
  """Float32 jnp reference of ``packed_attention_lse``: (o f32, lse (B, H, Tq) f32).

  Dequantizes all of K and V (``formats.dequantize_reference``): tests and
  benchmarks only. The method and tiles of ``attention`` are ignored.
  """
  attention = Dense() if attention is None else attention
  sm_scale, qs, ks, km, kl = _validate(q, packed, attention.sm_scale, q_segment_ids, kv_segment_ids, kv_mask,
                                       kv_lengths)
  km = _lengths_mask(kl, km, packed.meta.num_tokens)
  k, v = fmt.dequantize_reference(packed)
  o, lse = attention_lse_f32(q, k, v, sm_scale=sm_scale, q_segment_ids=qs, kv_segment_ids=ks, kv_mask=km,
                             chunk=None)
  if not keep_rotated:
    r_v = jnp.asarray(fmt.hadamard_rotation(packed.meta.head_dim, packed.meta.rotation_seed_v))
    o = jnp.einsum("bqhd,ed->bqhe", o, r_v, precision=lax.Precision.HIGHEST)
  return o, lse


def packed_attention_reference(q, packed, attention: Dense | None = None, **masks):
  """Float32 jnp reference of ``packed_attention`` (same arguments, f32 output)."""
  return packed_attention_lse_reference(q, packed, attention, **masks)[0]


# --------------------------------------------------------------------------------------
# The streamed method
# --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class StreamedPlan:
  """How the streamed method cuts the work: ``group`` heads per cuDNN call, queries in
  chunks of ``q_rows`` rows, ``scratch`` bytes held at once (bf16 K and V of the
  group, the group's q slice and cuDNN's output for one query chunk)."""
  group: int
  q_rows: int
  scratch: int


def streamed_plan(batch: int, tq: int, tkv: int, heads: int, head_dim: int, scratch_bytes: int):
  """The largest head group (then query chunk) whose scratch fits ``scratch_bytes``;
  None when not even one head's K and V plus 64 query rows fit."""
  kv = 2 * batch * tkv * head_dim * 2        # one head's bf16 K and V
  per_row = 2 * batch * head_dim * 2         # one query row of one head: q slice + output
  budget = int(scratch_bytes)
  group = min(heads, budget // (kv + tq * per_row))
  if group >= 1:
    return StreamedPlan(group, tq, group * (kv + tq * per_row))
  rows = min(tq, (budget - kv) // per_row // BLOCK * BLOCK) if budget > kv else 0
  if rows < min(tq, BLOCK):
    return None
  return StreamedPlan(1, rows, kv + rows * per_row)


def cudnn_unsupported_reason() -> str | None:
  """None where cuDNN flash attention runs (a CUDA GPU of compute capability 8.0+)."""
  if not on_gpu():
    return "there is no CUDA GPU (the CPU has no cuDNN)"
  cc = str(getattr(jax.devices()[0], "compute_capability", "") or "")
  try:
    major = int(cc.split(".")[0])
  except ValueError:
    return f"the GPU's compute capability is unknown ({cc!r})"
  if major < 8:
    return f"cuDNN flash attention needs compute capability 8.0 or newer, found {cc}"
  return None


def resolve_method(method, q, packed, *, masked: bool, interpret: bool, scratch_bytes: int):
  """(method, plan): ``auto`` -> ``streamed`` where it runs (see the module table),
  else ``fused``; an explicit ``streamed`` that cannot run raises, naming why."""
  if method == "fused":
    return "fused", None
  b, tq, h, d = q.shape
  plan = streamed_plan(b, tq, packed.meta.num_tokens, h, d, scratch_bytes)
  outside = classes_outside_fused(packed.meta.block_classes)   # the fused kernel cannot read them
  reason = None
  if masked:
    reason = ("segment ids and kv_mask run on the fused kernel (cuDNN takes only per-row key lengths: "
              "pass kv_lengths for trailing padding)")
  elif plan is None:
    need = streamed_plan(b, tq, packed.meta.num_tokens, h, d, 1 << 62).scratch // h
    reason = (f"scratch_bytes={scratch_bytes} holds less than one head's bf16 K and V plus 64 query rows "
              f"(one head needs about {need} bytes at Tkv={packed.meta.num_tokens})")
  if method == "streamed" or outside:
    if reason is not None:
      fix = (f"classes {outside} are read by the streamed method only: store the blocks as int4, int8 or bf16"
             if outside else "use method='fused'")
      raise NotImplementedError(f"method='streamed' cannot run: {reason}; {fix}")
    if method == "auto":
      log.info("packed_attention auto: streamed (classes %s: the fused kernel does not read them)", outside)
    return "streamed", plan
  if reason is None:
    reason = "interpret mode runs the fused kernel" if interpret else cudnn_unsupported_reason()
  if reason is not None:
    log.info("packed_attention auto: fused (streamed rejected: %s)", reason)
    return "fused", None
  log.info("packed_attention auto: streamed (%d heads a group, %d query rows a chunk, %d scratch bytes)",
           plan.group, plan.q_rows, plan.scratch)
  return "streamed", plan


def _streamed(q, packed, out, kv_lengths, *, sm_scale, keep_rotated, overwrite_q, plan: StreamedPlan, interpret,
              implementation):
  """Per head group: decode K/V to bf16, attend with ``implementation``, write the
  group's output into the target (q's own buffer with ``overwrite_q``)."""
  b, tq, h, d = q.shape
  if overwrite_q:
    target = q
  elif out is not None:
    target = out
  else:
    target = jnp.zeros_like(q)

  def attend_group(h0, ng, target):
    k, v = dequantize_group(packed, h0, ng, unrotate_v=not keep_rotated, interpret=interpret)

    def attend_rows(r0, nr, target):
      # With overwrite_q the target is q itself: these q rows of these heads are read
      # here, before the same rows and heads are overwritten below.
      qg = lax.dynamic_slice(target if overwrite_q else q, (0, r0, h0, 0), (b, nr, ng, d))
      og = jax.nn.dot_product_attention(qg, k, v, scale=sm_scale, key_value_seq_lengths=kv_lengths,
                                        implementation=implementation)
      if kv_lengths is not None:  # a row with no key outputs 0, as the fused kernel does
        og = jnp.where((kv_lengths > 0)[:, None, None, None], og, 0)
      return lax.dynamic_update_slice(target, og.astype(jnp.bfloat16), (0, r0, h0, 0))

    return over_chunks(tq, plan.q_rows, attend_rows, target)

  return over_chunks(h, plan.group, attend_group, target)


_STREAMED_STATIC = ("sm_scale", "keep_rotated", "overwrite_q", "plan", "interpret", "implementation")
_streamed_jit = jax.jit(_streamed, static_argnames=_STREAMED_STATIC)
# q donated: at top level its buffer becomes the output instead of being copied.
_streamed_jit_donate_q = jax.jit(_streamed, static_argnames=_STREAMED_STATIC, donate_argnums=(0,))


def key_center(packed) -> jax.Array:
  """(B, H, D) f32: the mean of the rotated K over the live tokens, from the block
  means the format stores. Subtracting it from every key shifts each logit of a row by
  one constant (softmax unchanged) and takes K's shared offset out of the int8 range."""
  meta = packed.meta
  live = jnp.minimum(meta.num_tokens - jnp.arange(meta.num_blocks) * BLOCK, BLOCK).astype(jnp.float32)
  return jnp.einsum("bhnd,n->bhd", packed.k_mean.astype(jnp.float32), live / meta.num_tokens)


def _streamed_int8(q, packed, *, sm_scale, keep_rotated, overwrite_q, group, interpret, num_warps, num_stages):
  """``Dense(qk="int8")``: per head group, the one decoder writes K - its mean as int8
  per token and V in bf16 (``store="int8_k"``), and Sol's loop over decoded stores
  runs with every query block walking every key block (``sink_q`` over all of them,
  no pooled tail): int8 Q.K, bf16 P.V, one online softmax."""
  b, t, h, d = q.shape
  nb = packed.meta.num_blocks
  cfg = sol_decoded.LoopConfig(head_dim=d, num_tokens=t, num_blocks=nb, qk_scale=sm_scale * LOG2E,
                               sink_blocks=(0, 0), sink_q=(0, nb), tail=False, qk="int8", has_key_bias=False,
                               has_block_len=False)
  center = key_center(packed)
  out = q if overwrite_q else jnp.zeros_like(q)
  no_list = jnp.zeros((b, group, nb, 16), jnp.int16)   # every row walks every block: no routed lists
  no_count = jnp.zeros((b, group, nb), jnp.int32)

  def attend(h0, g, out):
    k, k_scale, v = dequantize_group(packed, h0, g, unrotate_v=not keep_rotated, interpret=interpret,
                                     layout="bhtd", store="int8_k", center=center)
    # With overwrite_q these q heads are read here, before the same heads are overwritten.
    qg = lax.dynamic_slice(out if overwrite_q else q, (0, 0, h0, 0), (b, t, g, d))
    og = sol_decoded.sol_over_stores(qg, k, k_scale, v, None, lax.dynamic_slice_in_dim(center, h0, g, axis=1),
                                     no_list[:, :g], no_count[:, :g], None, None, None, None, cfg,
                                     interpret=interpret, num_warps=num_warps, num_stages=num_stages)
    return lax.dynamic_update_slice(out, og, (0, 0, h0, 0))

  return over_chunks(h, group, attend, out)


_INT8_STATIC = ("sm_scale", "keep_rotated", "overwrite_q", "group", "interpret", "num_warps", "num_stages")
_streamed_int8_jit = jax.jit(_streamed_int8, static_argnames=_INT8_STATIC)
_streamed_int8_jit_donate_q = jax.jit(_streamed_int8, static_argnames=_INT8_STATIC, donate_argnums=(0,))


def int8_group(q_shape, scratch_bytes: int) -> int:
  """Heads per group of ``Dense(qk="int8")`` within ``scratch_bytes`` (0: not one head):
  each head's int8 K and scales, bf16 V, its q slice and output."""
  b, t, h, d = q_shape
  return sol.streamed_group(b, t, h, d, scratch_bytes, "int8")


def _check_int8(q, packed, attention, masked, kv_lengths, return_lse, out):
  """Raise naming the fix where ``Dense(qk="int8")`` cannot run; return its group."""
  why = None
  if q.shape[1] != packed.meta.num_tokens:
    why = f"it is self-attention only (Tq = {q.shape[1]}, Tkv = {packed.meta.num_tokens})"
  elif masked or kv_lengths is not None:
    why = "it takes no segment ids, kv_mask or kv_lengths"
  elif return_lse:
    why = "it returns no log-sum-exp"
  elif out is not None:
    why = "it writes a fresh output or q's buffer (overwrite_q), not a given out"
  if why:
    raise NotImplementedError(f"Dense(qk='int8') cannot run here: {why}; use Dense(qk='bf16')")
  group = int8_group(q.shape, attention.scratch_bytes)
  if group < 1:
    b, t, h, d = q.shape
    raise ValueError(f"Dense(qk='int8', scratch_bytes={attention.scratch_bytes}) holds less than one head's "
                     f"decoded stores, q slice and output ({sol.streamed_head_bytes(b, t, d, 'int8')} bytes at "
                     f"T={t}); raise scratch_bytes")
  return group


_FUSED_STATIC = ("sm_scale", "keep_rotated", "interpret", "block_q", "num_warps", "num_stages", "overwrite_q",
                 "return_lse")


def _fused(q, packed, q_seg, kv_seg, kv_mask, out, **kw):
  return fused_attention(q, packed, q_seg=q_seg, kv_seg=kv_seg, kv_mask=kv_mask, out=out, **kw)


_fused_jit = jax.jit(_fused, static_argnames=_FUSED_STATIC)
_fused_jit_donate_q = jax.jit(_fused, static_argnames=_FUSED_STATIC, donate_argnums=(0,))


# --------------------------------------------------------------------------------------
# Public entry point
# --------------------------------------------------------------------------------------
def packed_attention(q, packed, attention: Dense | None = None, *, q_segment_ids=None, kv_segment_ids=None,
                     kv_mask=None, kv_lengths=None, keep_rotated=False, overwrite_q=False, interpret=None):
  """Dense attention of BF16 ``q`` over a ``formats.PackedKV``; returns (B, Tq, H, D) bf16.

  q: (B, Tq, H, D) bf16, already rotated by ``R_k`` (as ``streamed_qkv`` returns it);
  Tq may differ from the packed ``num_tokens``. ``attention``: a ``Dense`` config
  (softmax scale, method, scratch budget, fused tiles; None: ``Dense()``).
  q_segment_ids (B, Tq) / kv_segment_ids (B, Tkv) int32 (or (T,), shared by the
  batch): a query sees only keys of its own segment. kv_mask (B, Tkv) bool: True =
  valid key. kv_lengths (B,) int32: only the first kv_lengths[b] keys of batch row b
  are valid (cuDNN's own padding mask on the streamed path). A query row with no
  visible key outputs exactly 0. The output is un-rotated by ``R_v^T`` unless
  ``keep_rotated`` (then fold ``R_v^T`` into W_o).
  overwrite_q: write the output into q's buffer (q is donated and must not be used
  afterwards). It saves one (B, Tq, H, D) bf16 buffer of peak memory, the point of the
  library at the user's sizes; a jitted caller gets the same from XLA when q dies
  here, and the flag exists for eager callers (the torch op), whose q buffer only a
  donation can reuse.
  """
  return _packed_attention(q, packed, attention, q_segment_ids, kv_segment_ids, kv_mask, kv_lengths,
                           keep_rotated=keep_rotated, overwrite_q=overwrite_q, interpret=interpret)


def packed_attention_lse(q, packed, attention: Dense | None = None, *, q_segment_ids=None, kv_segment_ids=None,
                         kv_mask=None, kv_lengths=None, keep_rotated=False, interpret=None):
  """``packed_attention`` and each row's log-sum-exp of its scaled logits: (o (B, Tq, H,
  D) bf16, lse (B, H, Tq) f32, -inf for a row with no visible key), to merge attentions
  over key shards (ring attention). Runs the fused method (jax's public cuDNN call
  returns no log-sum-exp); a ``Dense(method="streamed")`` is refused."""
  attention = Dense() if attention is None else attention
  if attention.method == "streamed":
    raise ValueError("packed_attention_lse needs Dense(method='fused') or 'auto': the streamed path's cuDNN "
                     "call returns no log-sum-exp")
  return _packed_attention(q, packed, attention, q_segment_ids, kv_segment_ids, kv_mask, kv_lengths,
                           keep_rotated=keep_rotated, overwrite_q=False, interpret=interpret, return_lse=True)


def _packed_attention(q, packed, attention, q_segment_ids, kv_segment_ids, kv_mask, kv_lengths, *, keep_rotated,
                      overwrite_q, interpret, return_lse=False, out=None):
  """Both entry points; ``out`` (a bf16 buffer aliased as the output) lets the tests
  poison the output with NaN and see every element written."""
  attention = Dense() if attention is None else attention
  if not isinstance(attention, Dense):
    raise ValueError(f"attention must be a Dense(...) config, got {attention!r}; Sol runs through sol_attention")
  sm_scale, q_seg, kv_seg, kv_mask, kv_lengths = _validate(q, packed, attention.sm_scale, q_segment_ids,
                                                           kv_segment_ids, kv_mask, kv_lengths)
  if out is not None and (out.shape != q.shape or out.dtype != jnp.bfloat16):
    raise ValueError(f"out must be bfloat16{list(q.shape)}, got {out.dtype}{list(out.shape)}")
  if overwrite_q and out is not None:
    raise ValueError("overwrite_q and out both name the output buffer; pass one")
  interpret = resolve_interpret(interpret)
  if not interpret and not on_gpu():
    raise ValueError("interpret=False needs a CUDA GPU, and JAX has none here "
                     f"(default backend {jax.default_backend()!r}); pass interpret=None or True on a CPU")
  masked = q_seg is not None or kv_mask is not None
  if attention.qk == "int8":
    group = _check_int8(q, packed, attention, masked, kv_lengths, return_lse, out)
    call = _streamed_int8_jit_donate_q if overwrite_q else _streamed_int8_jit
    return call(q, packed, sm_scale=sm_scale, keep_rotated=bool(keep_rotated), overwrite_q=bool(overwrite_q),
                group=group, interpret=interpret, num_warps=attention.num_warps or 4,
                num_stages=attention.num_stages or 2)
  method = "fused" if return_lse else attention.method
  method, plan = resolve_method(method, q, packed, masked=masked, interpret=interpret,
                                scratch_bytes=attention.scratch_bytes)
  if method == "streamed":
    call = _streamed_jit_donate_q if overwrite_q else _streamed_jit
    return call(q, packed, out, kv_lengths, sm_scale=sm_scale, keep_rotated=bool(keep_rotated),
                overwrite_q=bool(overwrite_q), plan=plan, interpret=interpret,
                implementation="cudnn" if cudnn_unsupported_reason() is None and not interpret else None)
  kv_mask = _lengths_mask(kv_lengths, kv_mask, packed.meta.num_tokens)
  # Donation is a property of the jitted function, hence a twin that donates q.
  call = _fused_jit_donate_q if overwrite_q else _fused_jit
  return call(q, packed, q_seg, kv_seg, kv_mask, out, sm_scale=sm_scale,
              keep_rotated=bool(keep_rotated), interpret=interpret, block_q=int(attention.block_q),
              num_warps=attention.num_warps, num_stages=attention.num_stages, overwrite_q=bool(overwrite_q),
              return_lse=bool(return_lse))
