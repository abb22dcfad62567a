"""Attention blocks on our ops, and the plain BF16 torch block they are checked against.

``PackedAttention(hidden, layout, storage=..., attention=...)`` is one attention block
for any ``QKVLayout`` (QK norm per head, across heads or none; RoPE rotate-half or
pairs): fused ``qkv_proj``, the layout's QK norms, the streamed projection -> packed
K/V -> dense or Sol attention through one custom op, then ``o_proj``.
``PackedH3Attention`` is its MiniMax-H3 preset. ``ReferenceH3Attention`` is the H3 block
as a model would ship it (fused ``qkv_proj`` Linear, per-head RMSNorm on q and k,
partial split-half RoPE, ``F.scaled_dot_product_attention``, ``o_proj``); the packed
module loads its ``state_dict`` unchanged, so a model can swap one for the other
without converting checkpoints.

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

``attention=Sol(...)`` uses Sol sparse attention instead of dense. The packed module
is inference-only: its ops have no backward.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from formats.storage import KVStorage, as_storage
from pallas_kernels.attention_config import Dense, Sol, as_attention
from pallas_kernels.layer import required_bytes
from pallas_kernels.qkv_layout import QKVLayout, QKVWeights
from torch_bridge import dlpack
from torch_bridge.ops import attention_layer, settings_json


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


def _norm_params(norm):
  """The op's norm parameters of a QK norm module: an RMSNorm's weight, a LayerNorm's
  weight then bias (the layout's ``head_layer``), None without one."""
  if norm is None:
    return None
  if isinstance(norm, nn.LayerNorm):
    return torch.cat([norm.weight.float(), norm.bias.float()])
  return norm.weight.float()


class PackedAttention(nn.Module):
  """An attention block on ``torch.ops.packed_kv`` for any ``QKVLayout``.

  One custom op (``packed_kv::attention_layer``) runs the projection and attention in
  one JAX call: Q and the packed K/V come from the streamed projection, attention
  reads the packed K/V and writes its output over Q, and the packed K/V is freed when
  the call returns, so the block never holds two Q-sized buffers, nor any BF16 copy of
  K or V. ``o_proj`` then runs in torch.

  hidden: the model width. layout: a ``QKVLayout`` (heads, head_dim, QK norm, RoPE).
  storage: a ``formats.KVStorage`` (None: every block int4). attention: ``Dense(...)``
  (default) or ``Sol(...)``. qkv_bias / o_bias: the Linears' biases. interpret: kernel
  interpret mode (None: on unless JAX has a GPU).

  Parameters: ``qkv_proj`` (kernel layout, ``state_dict`` keys of an ``nn.Linear``),
  ``q_norm`` / ``k_norm`` (RMSNorm weights, (D,) per head or (H*D,) across heads, or
  ``nn.LayerNorm(D)`` weight and bias with ``norm="head_layer"``; float32; absent with
  ``norm="none"``), ``o_proj``.

  ``forward(x, rope_cos, rope_sin, *, segment_ids=None, kv_mask=None, kv_lengths=None,
  storage=None)``: x (B, T, hidden) bf16; RoPE tables (T, D) float32, or (T, H*D) with
  ``layout.rope_per_head``; masks (dense only) as ``pallas_kernels.attention_layer``;
  ``storage`` overrides the module's for this call (e.g. a per-timestep policy).
  ``required_bytes(tokens)`` tells the device memory a forward needs above what the
  caller holds.
  """

  def __init__(self, hidden: int, layout: QKVLayout, *, storage: KVStorage | None = None,
               attention: Dense | Sol | None = None, qkv_bias: bool = False, o_bias: bool = False,
               interpret: bool | None = None, dtype: torch.dtype = torch.bfloat16, device=None):
    super().__init__()
    if not isinstance(layout, QKVLayout):
      raise ValueError(f"layout must be a QKVLayout (e.g. QKVLayout.h3(heads, head_dim)), got {layout!r}")
    if not isinstance(hidden, int) or hidden <= 0:
      raise ValueError(f"hidden must be a positive int (the model width), got {hidden!r}")
    self.layout, self.storage, self.attention = layout, as_storage(storage), as_attention(attention)
    self.hidden, self.heads, self.head_dim = hidden, layout.heads, layout.head_dim
    self.interpret = interpret
    # The op takes each setting as JSON text; computed once here so that a compiled
    # forward sees constants.
    self._json = (settings_json(self.layout), settings_json(self.storage), settings_json(self.attention))
    width = layout.heads * layout.head_dim
    self.qkv_proj = KernelLayoutLinear(hidden, 3 * width, bias=qkv_bias, dtype=dtype, device=device)
    # Norm weights stay float32: the kernel's epilogue takes them in f32, and loading a
    # bf16 checkpoint into them is exact.
    if layout.norm == "head_layer":
      self.q_norm = nn.LayerNorm(layout.head_dim, layout.eps, dtype=torch.float32, device=device)
      self.k_norm = nn.LayerNorm(layout.head_dim, layout.eps, dtype=torch.float32, device=device)
    elif layout.norm_width:
      self.q_norm = RMSNorm(layout.norm_width, layout.eps, dtype=torch.float32, device=device)
      self.k_norm = RMSNorm(layout.norm_width, layout.eps, dtype=torch.float32, device=device)
    else:
      self.q_norm = self.k_norm = None
    self.o_proj = nn.Linear(width, hidden, bias=o_bias, dtype=dtype, device=device)

  def extra_repr(self) -> str:
    return f"hidden={self.hidden}, layout={self.layout}, storage={self.storage}, attention={self.attention}"

  def required_bytes(self, tokens: int, batch: int = 1, storage: KVStorage | None = None) -> dict:
    """Device bytes a forward over ``tokens`` tokens needs above what the caller holds
    (x, the weights, the RoPE tables), phase by phase (``pallas_kernels.layer.required_bytes``)."""
    return required_bytes(tokens, self.layout, self.hidden, batch=batch,
                          storage=self.storage if storage is None else storage, attention=self.attention)

  def forward(self, x: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor, *,
              segment_ids: torch.Tensor | None = None, kv_mask: torch.Tensor | None = None,
              kv_lengths: torch.Tensor | None = None, storage: KVStorage | None = None):
    if x.dim() != 3 or x.shape[-1] != self.hidden:
      raise dlpack.BridgeError(f"x must be (B, T, hidden={self.hidden}), got {list(x.shape)}; add a batch "
                               f"dimension with x[None] or check the model width this module was built for")
    b, t, _ = x.shape
    weights = QKVWeights(self.qkv_proj.weight_t, self.qkv_proj.bias, _norm_params(self.q_norm),
                         _norm_params(self.k_norm))
    layout_json, storage_json, attention_json = self._json
    if storage is not None:
      storage_json = settings_json(as_storage(storage))
    o = attention_layer(x, weights, layout=layout_json, rope_cos=rope_cos, rope_sin=rope_sin, storage=storage_json,
                        attention=attention_json, segment_ids=segment_ids, kv_mask=kv_mask, kv_lengths=kv_lengths,
                        interpret=self.interpret)
    return self.o_proj(o.reshape(b, t, self.heads * self.head_dim))


class PackedH3Attention(PackedAttention):
  """``PackedAttention`` with MiniMax-H3's layout (RMSNorm per head, rotate-half RoPE on
  ``rot_dim`` = 3/4 of each head by default): loads a ``ReferenceH3Attention``'s
  ``state_dict`` of the same shape. Keywords as ``PackedAttention``."""

  def __init__(self, hidden: int, heads: int, head_dim: int, *, rot_dim: int | None = None, eps: float = 1e-5,
               **kw):
    super().__init__(hidden, QKVLayout.h3(heads, head_dim, rot_dim, eps), **kw)
    self.rot_dim, self.eps = self.layout.rot_dim, eps
