"""Drop-in attention processors for diffusers video transformers: the streamed projection
and packed K/V instead of ``to_q`` / ``to_k`` / ``to_v`` and SDPA.

    from torch_bridge.diffusers import use_packed_attention
    transformer = WanTransformer3DModel.from_pretrained(..., torch_dtype=torch.bfloat16)
    use_packed_attention(transformer)                  # or attention=Sol(tau=1.0)

diffusers lets a model swap the processor of each attention module without touching the
model's code (``attn.set_processor``). ``use_packed_attention`` installs ours on every
*self-attention over video tokens* of a supported transformer and leaves cross-attention
to the text alone (its keys are a few hundred text tokens, nothing to save). Our
processor calls one op, ``torch.ops.packed_kv.attention_layer``: x (B, S, hidden) ->
streamed QKV projection (Q bf16, K/V packed, never the BF16 QKV) -> dense or Sol
attention over the packed K/V, the output written over Q; then the module's own
``to_out``.

Each model's attention differs in its QK norm and RoPE; a ``QKVLayout`` says which, and
the processor hands the model's own RoPE tables to the kernel:

| model (diffusers class) | self-attention modules | QK norm | RoPE (tables the model builds) |
|---|---|---|---|
| Wan 2.x (``WanTransformer3DModel``) | ``blocks.N.attn1`` | RMSNorm over all H*D channels | adjacent pairs on every channel of a head, (1, S, 1, D) f32 |
| LTX-Video (``LTXVideoTransformer3DModel``) | ``transformer_blocks.N.attn1`` | RMSNorm over all H*D channels | adjacent pairs over the flat H*D channels, each head its own frequencies, (B, S, H*D) f32 |

Weights: the kernel reads q, k and v's weights as one contiguous (hidden, 3*H*D)
matrix. ``use_packed_attention`` builds it once per module and re-points ``to_q``,
``to_k`` and ``to_v`` (or a fused ``to_qkv``) at views of it, so the model holds its
projection weights once, as before, and the stock processor still works on them.

Requirements, checked with errors that name the fix: the transformer in bfloat16, head
dim 64 or 128, no attention mask on self-attention (neither model passes one), the same
RoPE table for every batch row (LTX-Video builds one per row from shared coordinates).
"""
from __future__ import annotations

import logging
from typing import Sequence

import torch
from torch import nn

from formats.storage import KVStorage, as_storage
from pallas_kernels.attention_config import Dense, Sol, as_attention
from pallas_kernels.qkv_layout import QKVLayout, QKVWeights
from torch_bridge import dlpack
from torch_bridge.ops import attention_layer, settings_json

log = logging.getLogger(__name__)


def _fuse_projection(linears: Sequence[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
  """One contiguous (hidden, 3*H*D) weight and (3*H*D,) bias from q, k, v Linears, and
  re-point each Linear's weight (and bias) at a view of them: memory is not doubled."""
  with torch.no_grad():
    weight = torch.cat([lin.weight for lin in linears], 0).t().contiguous()
    bias = None
    if all(lin.bias is not None for lin in linears):
      bias = torch.cat([lin.bias for lin in linears], 0).contiguous()
    col = 0
    for lin in linears:
      n = lin.out_features
      lin.weight = nn.Parameter(weight[:, col:col + n].t(), requires_grad=lin.weight.requires_grad)
      if bias is not None:
        lin.bias = nn.Parameter(bias[col:col + n], requires_grad=lin.bias.requires_grad)
      col += n
  return weight, bias


class _PackedSelfAttnProcessor:
  """The shared body of our processors: one layer op, then the module's ``to_out``.

  Subclasses give the layout and turn the model's rotary embedding into (T, width)
  float32 tables. The weights are fused once, on the first call (or at install).
  """

  _attention_backend = None   # read by diffusers' set_attention_backend / context parallelism
  _parallel_config = None

  def __init__(self, attn, *, attention: Dense | Sol | None = None, storage: KVStorage | None = None,
               interpret: bool | None = None):
    self.attention, self.storage = as_attention(attention), as_storage(storage)
    self.interpret = interpret
    self.layout = self.layout_of(attn, _eps(attn.norm_q))
    # The op's settings as JSON text, computed once (constants under torch.compile).
    self.settings = tuple(settings_json(v) for v in (self.layout, self.storage, self.attention))
    if getattr(attn, "fused_projections", False) and getattr(attn, "to_qkv", None) is not None:
      raise NotImplementedError("this module's projections are fused (fuse_qkv_projections); call "
                                "unfuse_qkv_projections() before use_packed_attention")
    self.w_qkv, self.bias = _fuse_projection([attn.to_q, attn.to_k, attn.to_v])
    self.q_norm = attn.norm_q.weight.detach().float().contiguous()
    self.k_norm = attn.norm_k.weight.detach().float().contiguous()

  # -- per model ---------------------------------------------------------------------
  @staticmethod
  def layout_of(attn, eps: float) -> QKVLayout:
    raise NotImplementedError

  def tables(self, rotary_emb, b: int, t: int):
    raise NotImplementedError

  # -- the call ------------------------------------------------------------------------
  def check_self_attention(self, encoder_hidden_states, attention_mask):
    if encoder_hidden_states is not None or attention_mask is not None:
      raise NotImplementedError(f"{type(self).__name__} is for self-attention without a mask (attn1); install it "
                                "with use_packed_attention, which leaves cross-attention stock")

  def attend(self, attn, hidden_states, rotary_emb):
    if hidden_states.dtype != torch.bfloat16 or self.w_qkv.dtype != torch.bfloat16:
      raise dlpack.BridgeError(f"packed attention runs on bfloat16 (hidden states are {hidden_states.dtype}, "
                               f"weights {self.w_qkv.dtype}); cast the transformer with .to(torch.bfloat16) "
                               "before use_packed_attention")
    if self.w_qkv.device != hidden_states.device or attn.to_q.weight.data_ptr() != self.w_qkv.data_ptr():
      raise dlpack.BridgeError("the transformer was moved or cast after use_packed_attention, so this processor's "
                               "fused weights are stale; call use_packed_attention again after .to(...)")
    b, t, _ = hidden_states.shape
    cos, sin = self.tables(rotary_emb, b, t)
    layout, storage, attention = self.settings
    o = attention_layer(hidden_states.contiguous(), QKVWeights(self.w_qkv, self.bias, self.q_norm, self.k_norm),
                        layout=layout, rope_cos=cos, rope_sin=sin, storage=storage, attention=attention,
                        interpret=self.interpret)
    out = attn.to_out[0](o.flatten(2, 3))
    return attn.to_out[1](out)


def _eps(norm: nn.Module) -> float:
  """The eps torch's RMSNorm uses: its own, or (None) the machine epsilon of its dtype."""
  return float(norm.eps) if norm.eps is not None else float(torch.finfo(norm.weight.dtype).eps)


def _same_rows(table: torch.Tensor, name: str) -> torch.Tensor:
  """(B, S, W) -> (S, W), refusing tables that differ between batch rows."""
  if table.shape[0] > 1 and not torch.equal(table[1:], table[:1].expand_as(table[1:])):
    raise NotImplementedError(f"{name} differs between batch rows; packed attention takes one RoPE table for "
                              "the batch: run the rows one at a time")
  return table[0]


class PackedWanAttnProcessor(_PackedSelfAttnProcessor):
  """Wan 2.x self-attention (``WanAttention``, ``attn1``) on packed K/V."""

  @staticmethod
  def layout_of(attn, eps: float) -> QKVLayout:
    return QKVLayout(attn.heads, attn.inner_dim // attn.heads, norm="across", rope="pairs", eps=eps)

  def tables(self, rotary_emb, b, t):
    if rotary_emb is None:
      raise dlpack.BridgeError("Wan self-attention needs rotary_emb (freqs_cos, freqs_sin); call the model, "
                               "not the attention module, or pass WanRotaryPosEmbed's output")
    cos, sin = rotary_emb  # (1, S, 1, D): one table for every head and batch row
    return (cos.reshape(t, -1).float().contiguous(), sin.reshape(t, -1).float().contiguous())

  def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
    self.check_self_attention(encoder_hidden_states, attention_mask)
    return self.attend(attn, hidden_states, rotary_emb)


class PackedLTXAttnProcessor(_PackedSelfAttnProcessor):
  """LTX-Video self-attention (``LTXAttention``, ``attn1``) on packed K/V."""

  @staticmethod
  def layout_of(attn, eps: float) -> QKVLayout:
    return QKVLayout(attn.heads, attn.inner_dim // attn.heads, norm="across", rope="pairs", eps=eps,
                     rope_per_head=True)

  def tables(self, rotary_emb, b, t):
    if rotary_emb is None:
      raise dlpack.BridgeError("LTX-Video self-attention needs image_rotary_emb (cos, sin); call the model, "
                               "not the attention module")
    cos, sin = rotary_emb  # (B, S, H*D): each head its own frequencies
    return (_same_rows(cos, "image_rotary_emb cos").float().contiguous(),
            _same_rows(sin, "image_rotary_emb sin").float().contiguous())

  def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
    self.check_self_attention(encoder_hidden_states, attention_mask)
    return self.attend(attn, hidden_states, image_rotary_emb)


def _self_attention_modules(transformer):
  """(name, module, processor class) of each self-attention over video tokens."""
  found = []
  try:
    from diffusers.models.transformers.transformer_wan import WanAttention
  except ImportError:  # pragma: no cover - an older diffusers
    WanAttention = None
  try:
    from diffusers.models.transformers.transformer_ltx import LTXAttention
  except ImportError:  # pragma: no cover
    LTXAttention = None
  for name, module in transformer.named_modules():
    if WanAttention is not None and isinstance(module, WanAttention):
      if not module.is_cross_attention and getattr(module, "add_k_proj", None) is None:
        found.append((name, module, PackedWanAttnProcessor))
    elif LTXAttention is not None and isinstance(module, LTXAttention) and name.endswith("attn1"):
      found.append((name, module, PackedLTXAttnProcessor))
  return found


def use_packed_attention(transformer, *, attention: Dense | Sol | None = None, storage: KVStorage | None = None,
                         interpret: bool | None = None) -> list[str]:
  """Install packed attention on every video self-attention of a diffusers transformer.

  attention: ``Dense(...)`` (default) or ``Sol(...)`` (``pallas_kernels``).
  storage: a ``formats.KVStorage`` (None: every block int4), e.g.
  ``KVStorage(token_ranges=[(0, 4096, "int8")])`` for an int8 prefix; its token ranges
  fit any sequence length. The settings are checked here, before anything is installed.
  Returns the names of the modules now on packed attention (also logged); raises
  ValueError for a transformer with none (the supported classes are listed in this
  module's docstring).
  """
  if not isinstance(transformer, nn.Module):
    raise ValueError(f"use_packed_attention expects a diffusers transformer (a torch nn.Module such as "
                     f"WanTransformer3DModel), got {type(transformer).__name__}")
  attention, storage = as_attention(attention), as_storage(storage)
  found = _self_attention_modules(transformer)
  if not found:
    raise ValueError(f"{type(transformer).__name__} has no attention module packed attention supports; it "
                     "supports WanTransformer3DModel and LTXVideoTransformer3DModel (self-attention attn1)")
  for name, module, cls in found:
    module.set_processor(cls(module, attention=attention, storage=storage, interpret=interpret))
    log.info("use_packed_attention: %s on %s", name, cls.__name__)
  return [name for name, _, _ in found]
