"""H3-style attention blocks: a plain BF16 torch reference and a drop-in on our ops.

Why two modules: ``ReferenceH3Attention`` is the block as a model would ship it
(fused ``qkv_proj`` Linear, per-head RMSNorm on q and k, partial split-half RoPE,
``F.scaled_dot_product_attention``, ``o_proj``). ``PackedH3Attention`` computes the
same function through ``torch.ops.packed_kv`` (streamed projection -> packed K/V ->
packed attention) and loads the reference's ``state_dict`` unchanged, so a model can
swap one for the other without converting checkpoints.

Shared conventions (MiniMax-H3: hidden 5376, 56 heads x 128, rot_dim 96, eps 1e-5):

* ``qkv_proj``: Linear(hidden, 3*H*D), output columns ``[q heads | k heads | v heads]``,
  no bias by default.
* ``q_norm`` / ``k_norm``: RMSNorm over the head dim (weight (D,)), applied before RoPE.
* RoPE: full-width tables ``rope_cos, rope_sin`` (T, D) float32 from
  ``pallas_kernels.rope.rope_tables``; channels [0, rot_dim) rotate split-half, the rest
  pass through.
* Attention is full (non-causal); optional ``segment_ids`` (T,) int32 restrict it to a
  packed sequence's own segment (``ops.segment_ids_from_cu_seqlens``), ``kv_mask``
  (B, T) bool drops padding keys, and ``kv_lengths`` (B,) int32 keeps the first
  kv_lengths[b] keys of batch row b.
* ``o_proj``: Linear(H*D, hidden). Our attention output is un-rotated, so ``o_proj``
  applies to it as is.

``PackedH3Attention(attention="sol")`` uses Sol sparse attention instead of dense.
Both modules are inference modules for the packed path: its ops have no backward.
"""
from __future__ import annotations

from typing import Sequence

import json

import torch
import torch.nn.functional as F
from torch import nn

import formats
from pallas_kernels.layer import check_attention, required_bytes
from pallas_kernels.projection import DEFAULT_SCRATCH_BYTES
from pallas_kernels.qkv_layout import QKVLayout


class RMSNorm(nn.Module):
  """RMSNorm over the last dim, computed in float32 (weight key: ``weight``)."""

  def __init__(self, dim: int, eps: float = 1e-5, *, dtype=None, device=None):
    super().__init__()
    self.eps = eps
    self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device))

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    xf = x.float()
    return xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight.float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rot_dim: int) -> torch.Tensor:
  """x (B, T, H, D) float32 with (T, D) tables: ``x * cos + partner(x) * sin``.

  partner = [-x2, x1, 0] with x1 = x[..., :rot_dim/2], x2 = x[..., rot_dim/2:rot_dim],
  the torch twin of ``pallas_kernels.rope.apply_rope_reference``.
  """
  half = rot_dim // 2
  x1, x2, rest = x[..., :half], x[..., half:rot_dim], x[..., rot_dim:]
  partner = torch.cat([-x2, x1, torch.zeros_like(rest)], dim=-1)
  return x * cos[:, None, :] + partner * sin[:, None, :]


def sol_options_json(sol_options: dict | None) -> str:
  """Sol's settings for the layer op (JSON text), checked by the layer's own rule."""
  opts = check_attention("sol", sol_options, ())
  return json.dumps({k: (list(v) if isinstance(v, tuple) else v) for k, v in opts.items() if v is not None},
                    sort_keys=True)


class ReferenceH3Attention(nn.Module):
  """Plain BF16 torch H3 attention block (the parity reference and checkpoint source)."""

  def __init__(self, hidden: int, heads: int, head_dim: int, *, rot_dim: int | None = None,
               eps: float = 1e-5, qkv_bias: bool = False, o_bias: bool = False,
               dtype: torch.dtype = torch.bfloat16, device=None):
    super().__init__()
    self.hidden, self.heads, self.head_dim = hidden, heads, head_dim
    self.rot_dim = QKVLayout.h3(heads, head_dim, rot_dim, eps).rot_dim
    self.qkv_proj = nn.Linear(hidden, 3 * heads * head_dim, bias=qkv_bias, dtype=dtype, device=device)
    self.q_norm = RMSNorm(head_dim, eps, dtype=dtype, device=device)
    self.k_norm = RMSNorm(head_dim, eps, dtype=dtype, device=device)
    self.o_proj = nn.Linear(heads * head_dim, hidden, bias=o_bias, dtype=dtype, device=device)

  def forward(self, x: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor, *,
              segment_ids: torch.Tensor | None = None, kv_mask: torch.Tensor | None = None,
              kv_lengths: torch.Tensor | None = None):
    b, t, _ = x.shape
    if kv_lengths is not None:
      by_length = torch.arange(t, device=x.device)[None, :] < kv_lengths[:, None]
      kv_mask = by_length if kv_mask is None else kv_mask & by_length
    h, d = self.heads, self.head_dim
    q, k, v = self.qkv_proj(x).view(b, t, 3, h, d).unbind(2)
    q = apply_rope(self.q_norm(q), rope_cos, rope_sin, self.rot_dim).to(x.dtype)
    k = apply_rope(self.k_norm(k), rope_cos, rope_sin, self.rot_dim).to(x.dtype)
    mask = None
    if segment_ids is not None:
      mask = (segment_ids[:, None] == segment_ids[None, :])[None, None]
    if kv_mask is not None:
      km = kv_mask[:, None, None, :]
      mask = km if mask is None else mask & km
    o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                       attn_mask=mask)
    return self.o_proj(o.transpose(1, 2).reshape(b, t, h * d))


class KernelLayoutLinear(nn.Module):
  """A Linear whose weight is stored (in, out) row-major, the projection kernel's layout.

  Why: the kernel reads ``w_qkv`` as a contiguous (hidden, 3*H*D) matrix, while
  ``nn.Linear`` stores (out, in). Passing ``linear.weight.t()`` would be a strided
  view, which the bridge refuses rather than copy on every call. So the weight is
  kept transposed once, and ``state_dict`` / ``load_state_dict`` translate to and from
  the ``nn.Linear`` key ``weight`` with shape (out, in); checkpoints stay compatible.
  """

  def __init__(self, in_features: int, out_features: int, bias: bool = False, *, dtype=None,
               device=None):
    super().__init__()
    self.in_features, self.out_features = in_features, out_features
    self.weight_t = nn.Parameter(torch.empty(in_features, out_features, dtype=dtype, device=device))
    self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None
    nn.init.normal_(self.weight_t, std=in_features ** -0.5)
    self.register_state_dict_post_hook(KernelLayoutLinear._to_linear_keys)
    self.register_load_state_dict_pre_hook(KernelLayoutLinear._from_linear_keys)

  @property
  def weight(self) -> torch.Tensor:
    """(out, in) view, as ``nn.Linear.weight``."""
    return self.weight_t.t()

  @staticmethod
  def _to_linear_keys(module, state_dict, prefix, local_metadata):
    w = state_dict.pop(prefix + "weight_t")
    state_dict[prefix + "weight"] = w.t()

  @staticmethod
  def _from_linear_keys(module, state_dict, prefix, local_metadata, strict, missing_keys,
                        unexpected_keys, error_msgs):
    if prefix + "weight" in state_dict:
      state_dict[prefix + "weight_t"] = state_dict.pop(prefix + "weight").t()

  def forward(self, x: torch.Tensor) -> torch.Tensor:
    out = x @ self.weight_t
    return out if self.bias is None else out + self.bias


class PackedH3Attention(nn.Module):
  """The H3 attention block on ``torch.ops.packed_kv``: streamed QKV + packed attention.

  One custom op (``packed_kv::attention_layer``) runs the projection and attention in
  one JAX call: Q and the packed K/V come from the streamed projection, attention
  reads the packed K/V and writes its output over Q, and the packed K/V is freed when
  the call returns, so the block never holds two Q-sized buffers, nor any BF16 copy of
  K or V. ``o_proj`` then runs in torch. Loads the ``state_dict`` of a
  ``ReferenceH3Attention`` of the same shape. ``required_bytes(tokens)`` tells the
  device memory a forward needs above what the caller holds.

  ``forward(x, rope_cos, rope_sin, *, segment_ids=None, kv_mask=None, kv_lengths=None,
  block_classes=None)``: ``block_classes`` (one class id per 64-token block, e.g. from
  ``formats.resolve_block_classes``) overrides the module's ``default_class`` for
  every block. Under ``torch.compile`` pass it as a tuple of Python ints.
  ``kv_lengths`` (B,) int32: valid keys per batch row (trailing padding; cuDNN's own
  mask on the streamed path).

  ``attention="sol"`` swaps dense attention for Sol sparse attention with
  ``sol_options`` (tau, sink_blocks, sink_q, topk_ratio, tail, max_exact; see
  ``ops.sol_attention``); Sol takes no segment ids or masks here.
  ``scratch_bytes`` bounds the projection's and the dense attention's scratch.
  """

  def __init__(self, hidden: int, heads: int, head_dim: int, *, rot_dim: int | None = None,
               eps: float = 1e-5, qkv_bias: bool = False, o_bias: bool = False,
               k_scheme: str = formats.DEFAULT_K_SCHEME, v_scheme: str = formats.DEFAULT_V_SCHEME,
               rotation_seed_k: int = 0, rotation_seed_v: int = 1, default_class: str = "int4",
               sm_scale: float | None = None, attention: str = "dense",
               sol_options: dict | None = None, scratch_bytes: int = DEFAULT_SCRATCH_BYTES,
               interpret: bool | None = None, dtype: torch.dtype = torch.bfloat16, device=None):
    super().__init__()
    if default_class not in formats.CLASS_ID:
      raise ValueError(f"default_class {default_class!r} unknown; use one of {formats.CLASSES}")
    if attention not in ("dense", "sol"):
      raise ValueError(f"attention must be 'dense' or 'sol', got {attention!r}")
    self.attention, self.sol_options = attention, dict(sol_options or {})
    self._sol_json = sol_options_json(sol_options) if attention == "sol" else ""
    self.hidden, self.heads, self.head_dim = hidden, heads, head_dim
    self.layout = QKVLayout.h3(heads, head_dim, rot_dim, eps)
    self._layout_json = self.layout.to_json()
    self.rot_dim, self.eps = self.layout.rot_dim, eps
    self.k_scheme, self.v_scheme = k_scheme, v_scheme
    self.rotation_seed_k, self.rotation_seed_v = rotation_seed_k, rotation_seed_v
    self.default_class = formats.CLASS_ID[default_class]
    self.sm_scale, self.interpret = sm_scale, interpret
    self.scratch_bytes = int(scratch_bytes)
    self.qkv_proj = KernelLayoutLinear(hidden, 3 * heads * head_dim, bias=qkv_bias, dtype=dtype,
                                       device=device)
    # Norm weights stay float32: the kernel's epilogue takes them in f32, and loading a
    # bf16 checkpoint into them is exact.
    self.q_norm = RMSNorm(head_dim, eps, dtype=torch.float32, device=device)
    self.k_norm = RMSNorm(head_dim, eps, dtype=torch.float32, device=device)
    self.o_proj = nn.Linear(heads * head_dim, hidden, bias=o_bias, dtype=dtype, device=device)

  def required_bytes(self, tokens: int, batch: int = 1, block_classes: Sequence[int] | None = None) -> dict:
    """Device bytes a forward over ``tokens`` tokens needs above what the caller holds
    (x, the weights, the RoPE tables), phase by phase (``pallas_kernels.layer.required_bytes``)."""
    return required_bytes(tokens, self.heads, self.head_dim, self.hidden, batch=batch,
                          block_classes=block_classes, k_scheme=self.k_scheme, v_scheme=self.v_scheme,
                          attention=self.attention, scratch_bytes=self.scratch_bytes,
                          sol_options=self.sol_options if self.attention == "sol" else None)

  def forward(self, x: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor, *,
              segment_ids: torch.Tensor | None = None, kv_mask: torch.Tensor | None = None,
              kv_lengths: torch.Tensor | None = None, block_classes: Sequence[int] | None = None):
    b, t, _ = x.shape
    h, d = self.heads, self.head_dim
    if block_classes is None:
      classes = [self.default_class] * (-(-t // formats.BLOCK))
    else:
      classes = [int(c) for c in block_classes]
    o = torch.ops.packed_kv.attention_layer(
        x, self.qkv_proj.weight_t, self.qkv_proj.bias, self.q_norm.weight.float(), self.k_norm.weight.float(),
        rope_cos, rope_sin, self._layout_json, classes, self.k_scheme, self.v_scheme, self.rotation_seed_k,
        self.rotation_seed_v, self.attention, self.sm_scale, segment_ids, kv_mask, kv_lengths, self._sol_json,
        self.scratch_bytes, self.interpret)
    return self.o_proj(o.reshape(b, t, h * d))
