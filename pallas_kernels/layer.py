"""The attention core of an attention block in one jitted call: streamed projection,
then dense or Sol attention over the packed K/V, the output written over Q.

Why one call: inside one XLA program Q is dead once attention has read it, so the
output takes Q's buffer, and the packed K/V is a temporary that XLA frees when the
call returns. The block then holds at most Q + the packed K/V + one bounded scratch
at a time, never two Q-sized buffers (``required_bytes`` gives the figure). The torch
module ``torch_bridge.PackedAttention`` calls this through one custom op and runs
``o_proj`` on the result.
"""
from __future__ import annotations

import functools

import jax
import numpy as np

from formats import packed_kv as fmt
from formats.storage import KVStorage, as_storage
from pallas_kernels import attention as dense
from pallas_kernels import qkv_projection as sq
from pallas_kernels import sol
from pallas_kernels.attention_config import Dense, Sol, as_attention
from pallas_kernels.qkv_layout import AddedTokens, QKVLayout, QKVWeights

__all__ = ["attention_layer", "check_attention", "required_bytes"]


def check_attention(attention, masks) -> Dense | Sol:
  """The layer's attention config checked once (the JAX API and the torch op both call
  this): ``Dense`` or ``Sol``; Sol takes no masks."""
  attention = as_attention(attention)
  if isinstance(attention, Sol) and any(a is not None for a in masks):
    raise ValueError("Sol attention takes no segment ids or key masks here (its diagonal assumes one "
                     "sequence); use attention=Dense(...)")
  return attention


@functools.partial(jax.jit, static_argnames=("layout", "meta", "attention", "interpret"))
def _layer(x, weights, rope_cos, rope_sin, segment_ids, kv_mask, kv_lengths, added, *, layout, meta, attention,
           interpret):
  storage = KVStorage.of(meta)
  q, packed = sq.streamed_qkv(x, weights, layout=layout, rope_cos=rope_cos, rope_sin=rope_sin, storage=storage,
                              added=added, scratch_bytes=attention.scratch_bytes, interpret=interpret)
  if isinstance(attention, Sol):
    return sol.sol_attention(q, packed, attention, overwrite_q=True, interpret=interpret)
  return dense.packed_attention(q, packed, attention, q_segment_ids=segment_ids, kv_segment_ids=segment_ids,
                                kv_mask=kv_mask, kv_lengths=kv_lengths, overwrite_q=True, interpret=interpret)


def attention_layer(x, weights: QKVWeights, *, layout: QKVLayout, rope_cos, rope_sin, storage: KVStorage | None = None,
                    attention: Dense | Sol | None = None, segment_ids=None, kv_mask=None, kv_lengths=None,
                    added: AddedTokens | None = None, interpret=None):
  """x (B, T, hidden) bf16 -> attention output (B, T, H, D) bf16, un-rotated.

  The projection arguments are ``streamed_qkv``'s (``weights`` a ``QKVWeights``,
  ``layout`` a ``QKVLayout``, ``storage`` a ``formats.KVStorage``); ``attention`` is a
  ``Dense(...)`` (default) or ``Sol(...)`` config. The masks are dense attention's
  (self-attention: ``segment_ids`` (T,) or (B, T) int32 for queries and keys alike,
  ``kv_mask`` (B, T) bool, ``kv_lengths`` (B,) int32). The config's ``scratch_bytes``
  bounds both the projection's and the attention's scratch (they never run at the
  same time). The caller's ``o_proj`` applies to the result reshaped to (B, T, H*D).

  ``added``: an ``AddedTokens`` for joint text+video attention: its tokens follow x's
  (T + T_added rows in the tables, the masks and the output; each part's output rows
  go to its own output projection).
  """
  attention = check_attention(attention, (segment_ids, kv_mask, kv_lengths))
  meta = sq.check_inputs(x, weights, layout, rope_cos, rope_sin, storage, added)
  return _layer(x, weights, rope_cos, rope_sin, segment_ids, kv_mask, kv_lengths, added, layout=layout, meta=meta,
                attention=attention, interpret=interpret)


def required_bytes(tokens: int, layout: QKVLayout, hidden: int, *, batch: int = 1, storage: KVStorage | None = None,
                   attention: Dense | Sol | None = None, added_hidden: int | None = None) -> dict:
  """Device bytes the attention block needs above what the caller already holds (x,
  weights, RoPE tables), phase by phase, as the GPU path allocates them:

  * ``projection``: Q + packed K/V + one chunk of the chunked projection;
  * ``attention``: Q + packed K/V + the streamed path's head-group scratch (dense, a
    cuDNN GPU; with ``qk="int8"`` one group's int8 K, bf16 V, q slice and output), or
    Sol's routing metadata and workspace and (streamed methods) one head group's
    decoded stores;
  * ``o_proj``: the attention output (in Q's buffer) + ``o_proj``'s output
    (B, T, hidden) bf16, allocated by torch once the packed K/V is freed.

  Joint attention: ``tokens`` counts both parts and ``added_hidden`` is the added
  tokens' width (their rows in the projection's chunk). Returns every term and ``peak``
  = the largest phase. Library workspaces (cuBLAS,
  cuDNN) and the CUDA context are not in it; ``benchmarks/card_budget.py`` measures
  how far the device-level peak sits from it.
  """
  attention = as_attention(attention)
  storage = as_storage(storage)
  if not isinstance(layout, QKVLayout):
    raise ValueError(f"layout must be a QKVLayout, got {type(layout).__name__}")
  if min(tokens, hidden, batch) <= 0:
    raise ValueError(f"tokens, hidden and batch must be positive, got {(tokens, hidden, batch)}")
  heads, head_dim = layout.heads, layout.head_dim
  meta = storage.meta(batch, heads, head_dim, tokens)
  q = batch * tokens * heads * head_dim * 2
  packed = sum(int(np.prod(shape)) * np.dtype(dt).itemsize for shape, dt in fmt.buffer_specs(meta).values())
  width = layout.width
  rows = sq.chunk_rows(tokens, hidden, width, attention.scratch_bytes, added_hidden)
  projection = sq.chunk_scratch_bytes(rows, hidden, width, added_hidden) if rows >= fmt.BLOCK else 0
  if isinstance(attention, Dense) and attention.qk == "int8":
    group = dense.int8_group((batch, tokens, heads, head_dim), attention.scratch_bytes)
    attn = group * sol.streamed_head_bytes(batch, tokens, head_dim, "int8")
  elif isinstance(attention, Dense):
    plan = dense.streamed_plan(batch, tokens, tokens, heads, head_dim, attention.scratch_bytes)
    attn = 0 if plan is None else plan.scratch
  else:
    cap = sol.default_max_exact(meta.num_blocks, attention)
    attn = (sol.routing_nbytes(batch, heads, tokens, head_dim, cap)["total"]
            + sol.routing_workspace_bytes(batch, heads, tokens, head_dim, attention.route_chunk_bytes))
    method, group = sol.resolve_method(attention, batch, tokens, heads, head_dim)
    if group:
      attn += group * sol.streamed_head_bytes(batch, tokens, head_dim, sol.STREAMED_QK[method])
  out = batch * tokens * hidden * 2
  phases = {"projection": q + packed + projection, "attention": q + packed + attn, "o_proj": q + out}
  return {"q": q, "packed_kv": packed, "projection_scratch": projection, "attention_scratch": attn,
          "o_proj_output": out, **phases, "peak": max(phases.values())}
