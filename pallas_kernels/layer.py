"""The attention core of an H3-style block in one jitted call: streamed projection, then
dense or Sol attention over the packed K/V, the output written over Q.

Why one call: inside one XLA program Q is dead once attention has read it, so the
output takes Q's buffer, and the packed K/V is a temporary that XLA frees when the
call returns. The block then holds at most Q + the packed K/V + one bounded scratch
at a time, never two Q-sized buffers (``required_bytes`` gives the figure). The torch
module ``torch_bridge.PackedH3Attention`` calls this through one custom op and runs
``o_proj`` on the result.
"""
from __future__ import annotations

import functools

import jax
import numpy as np

from formats import packed_kv as fmt
from pallas_kernels import attention as dense
from pallas_kernels import sol
from pallas_kernels import projection as sq

__all__ = ["ATTENTIONS", "SOL_OPTIONS", "attention_layer", "required_bytes", "check_attention"]

ATTENTIONS = ("dense", "sol")
SOL_OPTIONS = ("tau", "sink_blocks", "sink_q", "topk_ratio", "tail", "max_exact", "method")


def _sol_kwargs(sol_options) -> dict:
  opts = dict(sol_options or {})
  unknown = set(opts) - set(SOL_OPTIONS)
  if unknown:
    raise ValueError(f"unknown sol_options {sorted(unknown)}; use {list(SOL_OPTIONS)}")
  return opts


_STATIC = ("layout", "block_classes", "k_scheme", "v_scheme", "rotation_seed_k", "rotation_seed_v", "attention",
           "sm_scale", "sol_items", "scratch_bytes", "interpret")


@functools.partial(jax.jit, static_argnames=_STATIC)
def _layer(x, w_qkv, bias, q_norm_weight, k_norm_weight, rope_cos, rope_sin, q_segment_ids, kv_segment_ids,
           kv_mask, kv_lengths, *, layout, block_classes, k_scheme, v_scheme, rotation_seed_k, rotation_seed_v,
           attention, sm_scale, sol_items, scratch_bytes, interpret):
  q, packed = sq.streamed_qkv(
      x, w_qkv, bias, layout=layout, q_norm_weight=q_norm_weight, k_norm_weight=k_norm_weight, rope_cos=rope_cos,
      rope_sin=rope_sin, block_classes=block_classes, k_scheme=k_scheme, v_scheme=v_scheme,
      rotation_seed_k=rotation_seed_k, rotation_seed_v=rotation_seed_v, interpret=interpret,
      scratch_bytes=scratch_bytes)
  if attention == "sol":
    return sol.sol_attention(q, packed, sm_scale=sm_scale, overwrite_q=True, interpret=interpret,
                             scratch_bytes=scratch_bytes, **dict(sol_items))
  return dense.packed_attention(q, packed, sm_scale=sm_scale, q_segment_ids=q_segment_ids,
                                kv_segment_ids=kv_segment_ids, kv_mask=kv_mask, kv_lengths=kv_lengths,
                                overwrite_q=True, interpret=interpret, scratch_bytes=scratch_bytes)


def check_attention(attention, sol_options, masks) -> dict:
  """The layer's attention choice checked once (the JAX API and the torch op both call
  this); returns Sol's options."""
  if attention not in ATTENTIONS:
    raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
  opts = _sol_kwargs(sol_options)
  if attention == "sol" and any(a is not None for a in masks):
    raise ValueError("Sol attention takes no segment ids or key masks here (its diagonal assumes one "
                     "sequence); use attention='dense'")
  return opts


def attention_layer(x, w_qkv, bias=None, *, layout: sq.QKVLayout, q_norm_weight=None, k_norm_weight=None,
                    rope_cos, rope_sin, block_classes=None, k_scheme=fmt.DEFAULT_K_SCHEME,
                    v_scheme=fmt.DEFAULT_V_SCHEME, rotation_seed_k=0, rotation_seed_v=1, attention="dense",
                    sm_scale=None, q_segment_ids=None, kv_segment_ids=None, kv_mask=None, kv_lengths=None,
                    sol_options=None, scratch_bytes=sq.DEFAULT_SCRATCH_BYTES, interpret=None):
  """x (B, T, hidden) bf16 -> attention output (B, T, H, D) bf16, un-rotated.

  The projection arguments are ``streamed_qkv``'s (``layout``: a ``QKVLayout``), the
  masks ``packed_attention``'s (dense only), ``sol_options`` a dict of
  ``sol_attention`` settings (``SOL_OPTIONS``). ``scratch_bytes`` bounds both the
  projection's and the dense attention's scratch (they never run at the same time).
  The caller's ``o_proj`` applies to the result reshaped to (B, T, H*D).
  """
  opts = check_attention(attention, sol_options, (q_segment_ids, kv_segment_ids, kv_mask, kv_lengths))
  sol_items = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in opts.items()))
  classes = None if block_classes is None else tuple(int(c) for c in block_classes)
  return _layer(x, w_qkv, bias, q_norm_weight, k_norm_weight, rope_cos, rope_sin, q_segment_ids, kv_segment_ids,
                kv_mask, kv_lengths, layout=layout, block_classes=classes, k_scheme=k_scheme, v_scheme=v_scheme,
                rotation_seed_k=rotation_seed_k, rotation_seed_v=rotation_seed_v, attention=attention,
                sm_scale=sm_scale, sol_items=sol_items, scratch_bytes=int(scratch_bytes), interpret=interpret)


def required_bytes(tokens: int, heads: int, head_dim: int, hidden: int, *, batch: int = 1, block_classes=None,
                   k_scheme: str = fmt.DEFAULT_K_SCHEME, v_scheme: str = fmt.DEFAULT_V_SCHEME,
                   attention: str = "dense", scratch_bytes: int = sq.DEFAULT_SCRATCH_BYTES,
                   sol_options=None) -> dict:
  """Device bytes the attention block needs above what the caller already holds (x,
  weights, RoPE tables), phase by phase, as the GPU path allocates them:

  * ``projection``: Q + packed K/V + one chunk of the chunked projection;
  * ``attention``: Q + packed K/V + the streamed path's head-group scratch (dense, a
    cuDNN GPU) or Sol's routing metadata;
  * ``o_proj``: the attention output (in Q's buffer) + ``o_proj``'s output
    (B, T, hidden) bf16, allocated by torch once the packed K/V is freed.

  Returns every term and ``peak`` = the largest phase. Library workspaces (cuBLAS,
  cuDNN) and the CUDA context are not in it; ``benchmarks/card_budget.py`` measures
  how far the device-level peak sits from it.
  """
  if attention not in ATTENTIONS:
    raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
  if min(tokens, heads, head_dim, hidden, batch) <= 0:
    raise ValueError(f"tokens, heads, head_dim, hidden and batch must be positive, got "
                     f"{(tokens, heads, head_dim, hidden, batch)}")
  classes = tuple(block_classes) if block_classes is not None else fmt.resolve_block_classes(tokens)
  meta = fmt.PackedKVMeta(batch, heads, head_dim, tokens, classes, k_scheme, v_scheme)
  q = batch * tokens * heads * head_dim * 2
  packed = sum(int(np.prod(shape)) * np.dtype(dt).itemsize for shape, dt in fmt.buffer_specs(meta).values())
  width = 3 * heads * head_dim
  rows = sq.chunk_rows(tokens, hidden, width, scratch_bytes)
  projection = sq.chunk_scratch_bytes(rows, hidden, width) if rows >= fmt.BLOCK else 0
  if attention == "dense":
    plan = dense.streamed_plan(batch, tokens, tokens, heads, head_dim, scratch_bytes)
    attn = 0 if plan is None else plan.scratch
  else:
    opts = _sol_kwargs(sol_options)
    nb = meta.num_blocks
    topk = float(opts.get("topk_ratio") or 0.0)
    cap = opts.get("max_exact") or (sol.topk_count(nb, topk) + 3 if topk > 0 else sol.DEFAULT_MAX_EXACT_TAU)
    attn = sol.routing_nbytes(batch, heads, tokens, head_dim, cap)["total"] + sol.DEFAULT_ROUTE_CHUNK_BYTES
    qk = sol.STREAMED_QK.get(opts.get("method", "fused"))
    if qk is not None:  # one head group's decoded K/V stores, q slice and output
      group = sol.streamed_group(batch, tokens, heads, head_dim, scratch_bytes, qk)
      attn += group * sol.streamed_head_bytes(batch, tokens, head_dim, qk)
  out = batch * tokens * hidden * 2
  phases = {"projection": q + packed + projection, "attention": q + packed + attn, "o_proj": q + out}
  return {"q": q, "packed_kv": packed, "projection_scratch": projection, "attention_scratch": attn,
          "o_proj_output": out, **phases, "peak": max(phases.values())}
