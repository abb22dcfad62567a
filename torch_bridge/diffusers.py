"""Drop-in attention processors for diffusers video transformers: the streamed projection
and packed K/V instead of the q / k / v projections and SDPA.

    from torch_bridge.diffusers import use_packed_attention
    transformer = WanTransformer3DModel.from_pretrained(..., torch_dtype=torch.bfloat16)
    report = use_packed_attention(transformer)         # or attention=Sol(tau=1.0)
    print(report)                                      # each attention module: installed, or why not

diffusers lets a model swap the processor of each attention module without touching the
model's code (``attn.set_processor``). ``use_packed_attention`` walks
``transformer.named_modules()`` and installs ours on every *self-attention* it can serve,
whatever the model class, and leaves every other attention module on its stock processor.
Our processor calls one op, ``torch.ops.packed_kv.attention_layer``: x (B, S, hidden) ->
streamed QKV projection (Q bf16, K/V packed, never the BF16 QKV) -> dense or Sol
attention over the packed K/V, the output written over Q; then the module's own output
projection.

How a module is recognised. Two things decide, and both are read, not assumed from the
model class:

* The module's own attributes: q / k / v ``nn.Linear`` projections (``to_q`` ... or a
  fused ``to_qkv``, which is unfused first) of one width (no grouped-query attention),
  bias on all three or none, head dim 64 or 128, and its QK norms: ``RMSNorm`` over
  head_dim (layout norm ``"head"``), over heads*head_dim (``"across"``), torch's
  ``LayerNorm`` over head_dim (``"head_layer"``) or none.
  Cross-attention (``is_cross_attention``) stays stock; added text projections
  (``add_q_proj`` / ``add_k_proj``) mean joint text+video attention, served where the
  convention knows how the model joins the text (HunyuanVideo), else left stock.
* How the model calls it, which is what its stock processor class says: the keyword
  the rotary embedding arrives under, the format of that embedding, and where the
  RoPE goes. Each served convention maps the model's own tables onto the layout's RoPE
  (``"pairs"`` or ``"half"``, one table for all heads or one per head); the table
  below lists them. A processor outside the table is left stock (its RoPE format, or
  whether it joins text tokens into the attention, is not known), with the reason in
  the report.

| family (diffusers classes) | stock processor -> ours | self-attention served | QK norm | RoPE the model passes -> layout |
|---|---|---|---|---|
| Wan 2.x, Wan VACE, ChronoEdit (``WanAttention``); SkyReels-V2 (``SkyReelsV2Attention``) | ``WanAttnProcessor`` / ``SkyReelsV2AttnProcessor`` -> ``PackedWanAttnProcessor`` | ``attn1`` (``is_cross_attention`` False; VACE's ``vace_blocks.N.attn1`` too) | RMSNorm over H*D | ``rotary_emb`` (cos, sin), each (1, S, 1, D) f32 -> ``pairs`` |
| Helios (``HeliosAttention``) | ``HeliosAttnProcessor`` -> ``PackedHeliosAttnProcessor`` | ``attn1``, unless ``is_amplify_history`` | RMSNorm over H*D | ``rotary_emb`` (B, S, 2*D), cos then sin -> ``pairs`` |
| LTX-Video (``LTXAttention``) | ``LTXVideoAttnProcessor`` -> ``PackedLTXAttnProcessor`` | the module named ``attn1`` | RMSNorm over H*D | ``image_rotary_emb`` (cos, sin), each (B, S, H*D) -> ``pairs``, one table per head |
| LTX-2 (``LTX2Attention``) | ``LTX2AudioVideoAttnProcessor`` -> ``PackedLTX2AttnProcessor`` | the modules named ``attn1`` (video) and ``audio_attn1`` (audio); per-head output gates applied | RMSNorm over H*D | ``query_rotary_emb`` (cos, sin): ``rope_type`` "interleaved" (B, S, H*D) -> ``pairs``, "split" (B, H, S, D/2) -> ``half``, one table per head |
| Cosmos Predict-1 (``Attention``) | ``CosmosAttnProcessor2_0`` -> ``PackedCosmosAttnProcessor`` | ``attn1`` (``is_cross_attention`` False) | RMSNorm over D | ``image_rotary_emb`` (cos, sin), each (S, D) -> ``half`` |
| MiniMax-H3 (``MiniMaxH3Attention``) | ``MiniMaxH3AttnProcessor`` -> ``PackedH3AttnProcessor`` | every one (H3 has no cross-attention; the text refiner's run without RoPE) | RMSNorm over D | ``rotary_emb`` (cos, sin), each (S, rot_dim) -> ``half`` on the first rot_dim channels |
| Kandinsky 5 (``Kandinsky5Attention``) | ``Kandinsky5AttnProcessor`` -> ``PackedKandinsky5AttnProcessor`` | the modules named ``self_attention`` (visual and text blocks) | RMSNorm over D (of float32 q / k) | ``rotary_emb`` 2x2 rotations (B, S, 1, D/2, 2, 2) -> ``pairs`` |
| CogVideoX, ConsisID (``Attention``) | ``CogVideoXAttnProcessor2_0`` -> ``PackedCogVideoXAttnProcessor`` | joint text+video: text first, then video, through the one projection; no mask | LayerNorm over D | ``image_rotary_emb`` (cos, sin), each (S_video, D), video tokens only -> ``pairs``; none on CogVideoX-2b |
| HunyuanVideo (``Attention``) | ``HunyuanVideoAttnProcessor2_0`` -> ``PackedHunyuanVideoAttnProcessor`` | joint text+video: dual-stream blocks (text through ``add_q_proj``... into the same packed K/V, ``AddedTokens``) and single-stream blocks (text joined before the one projection); text key padding -> key lengths | RMSNorm over D (text: ``norm_added_q/k``) | ``image_rotary_emb`` (cos, sin), each (S_video, D), video tokens only -> ``pairs`` |

Left stock, with the reason in the report (``KNOWN_REFUSALS`` names the processors):
joint text+video attention other than HunyuanVideo's and CogVideoX's (HunyuanVideo 1.5,
whose mask also masks the padded text's queries; the fused-projection CogVideoX
processor; Mochi, EasyAnimate, Motif-Video), Allegro's RoPE
(rotate-half inside each t/h/w third of a head), linear attention (Sana-Video), the
generic ``AttnProcessor2_0`` (text refiners, Latte: no RoPE, masks), LTX-2's perturbed
processor, and any processor not listed above. Wan-Animate runs Wan's processor code
under its own class, which is not listed until a tiny model of it is tested.

Where an attention module's class cannot say whether it is self- or cross-attention
(``LTXAttention``, ``LTX2Attention``, ``Kandinsky5Attention``), the convention names the
self-attention modules (``attn1``, ``self_attention``); if such a module is nevertheless
called with ``encoder_hidden_states``, ours raises instead of computing something else.

Weights: the kernel reads q, k and v's weights as one contiguous (hidden, 3*H*D)
matrix. Installing builds it once per module and re-points the q, k and v Linears at
views of it, so the model holds its projection weights once, as before, and the stock
processor still works on them (``restore_stock_attention`` puts it back).

Requirements, checked with errors that name the fix: the transformer in bfloat16, no
attention mask and no ``encoder_hidden_states`` on a served self-attention module
(joint attention takes trailing key padding only; SkyReels-V2 with
``num_frame_per_block > 1`` passes a block-causal mask; Kandinsky 5's NABLA passes
``sparse_params``), the RoPE format the convention expects, the same RoPE table for
every batch row (LTX-Video builds one per row from shared coordinates).

Parity: ``benchmarks/tiny_dits.py`` (``module_parity``) checks each served module of a
tiny model of every family against stock attention replayed in float32 on the same
inputs; ``python -m benchmarks.bench_dit --parity`` prints it.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Sequence

import torch
from torch import nn

from formats.packed_kv import CLASSES, check_head_dim
from formats.storage import KVStorage, as_storage
from pallas_kernels.attention_config import Dense, Sol, as_attention
from pallas_kernels.qkv_layout import AddedTokens, QKVLayout, QKVWeights
from torch_bridge import dlpack
from torch_bridge.ops import attention_layer, settings_json

log = logging.getLogger(__name__)

INSTALLED = "installed"


class InstallReport(dict):
  """What ``use_packed_attention`` did to each attention module of a transformer.

  A dict: module name (as ``named_modules()`` gives it; ``""`` for the transformer
  itself) -> ``"installed"`` or the reason the module stays on its stock processor.
  ``.installed`` lists the names now on packed attention, ``.refused`` maps the others
  to their reasons, ``.kinds`` maps every name to its module class name, and
  ``str(report)`` is a summary grouped by class and reason.
  """

  def __init__(self):
    super().__init__()
    self.kinds: dict[str, str] = {}

  def add(self, name: str, module: nn.Module, outcome: str) -> None:
    self[name] = outcome
    self.kinds[name] = type(module).__name__

  @property
  def installed(self) -> list[str]:
    return [name for name, outcome in self.items() if outcome == INSTALLED]

  @property
  def refused(self) -> dict[str, str]:
    return {name: outcome for name, outcome in self.items() if outcome != INSTALLED}

  def grouped(self) -> dict[tuple[str, str], list[str]]:
    """(module class, outcome) -> names, in the order the modules were seen."""
    groups = collections.defaultdict(list)
    for name, outcome in self.items():
      groups[(self.kinds.get(name, "?"), outcome)].append(name)
    return dict(groups)

  def summary(self) -> str:
    lines = [f"packed attention on {len(self.installed)} of {len(self)} attention modules"]
    for (kind, outcome), names in self.grouped().items():
      shown = ", ".join(n or "<root>" for n in names[:3]) + (", ..." if len(names) > 3 else "")
      lines.append(f"  {kind} x{len(names)} ({shown}): {outcome}")
    return "\n".join(lines)

  __str__ = summary


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


# --------------------------------------------------------------------------------------
# What a module is: its projections and QK norms, read from its attributes
# --------------------------------------------------------------------------------------
class _Refused(Exception):
  """A module that packed attention does not serve; the message is the reason."""


class _Spec:
  """The projection and QK-norm facts of one servable module."""

  def __init__(self, q, k, v, heads, head_dim, norm, eps, q_norm, k_norm):
    self.q, self.k, self.v = q, k, v
    self.heads, self.head_dim, self.norm, self.eps = heads, head_dim, norm, eps
    self.q_norm, self.k_norm = q_norm, k_norm


def _norm_facts(norm: nn.Module, what: str, input_dtype: torch.dtype):
  """(normalized width, eps, parameters or None, is_layer_norm) of a QK norm: an RMSNorm
  (its weight) or a LayerNorm (weight then bias, ones and zeros without them), or
  _Refused naming the norm."""
  from diffusers.models import normalization as dn
  if isinstance(norm, nn.RMSNorm):
    shape, eps = tuple(norm.normalized_shape), norm.eps
    # torch's RMSNorm without eps uses the machine epsilon of its input's dtype
    eps = float(torch.finfo(input_dtype).eps) if eps is None else float(eps)
    return shape, eps, norm.weight, False
  if isinstance(norm, dn.RMSNorm):
    if getattr(norm, "bias", None) is not None:
      raise _Refused(f"{what} is an RMSNorm with a bias: not supported")
    return tuple(norm.dim), float(norm.eps), norm.weight, False
  if type(norm) is nn.LayerNorm:
    shape = tuple(norm.normalized_shape)
    ref = norm.weight if norm.weight is not None else norm.bias
    dev = ref.device if ref is not None else None
    w = norm.weight.detach().float() if norm.weight is not None else torch.ones(shape, device=dev)
    b = norm.bias.detach().float() if norm.bias is not None else torch.zeros(shape, device=dev)
    return shape, float(norm.eps), torch.cat([w, b]), True
  if isinstance(norm, nn.LayerNorm) or "LayerNorm" in type(norm).__name__:
    raise _Refused(f"layer norm QK norm {type(norm).__name__}: not supported (RMSNorm, torch's LayerNorm or none)")
  if type(norm).__name__ == "LpNorm":
    raise _Refused("L2 QK norm (LpNorm): not supported (RMSNorm, LayerNorm or none)")
  raise _Refused(f"QK norm {type(norm).__name__}: not supported (RMSNorm, LayerNorm or none)")


def _module_spec(module: nn.Module, attrs: dict, input_dtype: torch.dtype) -> _Spec:
  q, k, v = (getattr(module, attrs[n], None) for n in ("q", "k", "v"))
  if not all(isinstance(lin, nn.Linear) for lin in (q, k, v)):
    if getattr(module, "to_qkv", None) is not None:
      raise _Refused("fused to_qkv without separate q/k/v projections: not supported")
    raise _Refused(f"no q/k/v nn.Linear projections ({attrs['q']}, {attrs['k']}, {attrs['v']})")
  heads = getattr(module, attrs["heads"], None)
  if not isinstance(heads, int) or heads <= 0 or q.out_features % heads:
    raise _Refused(f"head count {heads!r} does not divide the q width {q.out_features}")
  if k.out_features != q.out_features or v.out_features != q.out_features:
    raise _Refused(f"grouped-query attention (K/V width {k.out_features}/{v.out_features} for Q width "
                   f"{q.out_features}): not supported")
  if not q.in_features == k.in_features == v.in_features:
    raise _Refused(f"q/k/v read different widths ({q.in_features}, {k.in_features}, {v.in_features})")
  head_dim = q.out_features // heads
  try:
    check_head_dim(head_dim)
  except ValueError:
    raise _Refused(f"head_dim {head_dim} not supported (64 or 128)") from None
  if len({lin.bias is None for lin in (q, k, v)}) > 1:
    raise _Refused("bias on some of q/k/v only: not supported")
  norm_q, norm_k = getattr(module, attrs["norm_q"], None), getattr(module, attrs["norm_k"], None)
  if norm_q is None and norm_k is None:
    return _Spec(q, k, v, heads, head_dim, "none", 1e-5, None, None)
  if norm_q is None or norm_k is None:
    raise _Refused("a QK norm on only one of q and k: not supported")
  facts = [_norm_facts(n, w, input_dtype) for n, w in ((norm_q, "norm_q"), (norm_k, "norm_k"))]
  (shape, eps, wq, layer), (shape_k, eps_k, wk, layer_k) = facts
  if shape != shape_k or eps != eps_k or layer != layer_k:
    raise _Refused(f"norm_q and norm_k differ (over {shape} eps {eps} vs {shape_k} eps {eps_k})")
  if layer:
    if shape != (head_dim,):
      raise _Refused(f"LayerNorm over {list(shape)}: only per head (head_dim {head_dim}) is supported")
    return _Spec(q, k, v, heads, head_dim, "head_layer", eps, wq.contiguous(), wk.contiguous())
  kinds = {(head_dim,): "head", (heads * head_dim,): "across"}
  if shape not in kinds:
    raise _Refused(f"RMSNorm over {list(shape)}: neither head_dim ({head_dim}) nor heads*head_dim "
                   f"({heads * head_dim})")
  width = shape[0]
  as_f32 = lambda w: (torch.ones(width, device=q.weight.device) if w is None else w.detach().float()).contiguous()
  return _Spec(q, k, v, heads, head_dim, kinds[shape], eps, as_f32(wq), as_f32(wk))


# --------------------------------------------------------------------------------------
# Our processors: one per calling convention
# --------------------------------------------------------------------------------------
class _PackedSelfAttnProcessor:
  """The shared body of our processors: one layer op, then the module's output projection.

  Subclasses state the convention of the stock processor they replace: the attribute
  names of the projections and norms, which modules are self-attention, the RoPE style,
  how to turn the model's rotary embedding into (T, width) float32 tables, and the
  ``__call__`` signature (diffusers passes keywords by the processor's parameter names).
  The weights are fused once, at construction.
  """

  family = ""
  attrs = dict(q="to_q", k="to_k", v="to_v", norm_q="norm_q", norm_k="norm_k", heads="heads")
  rope_style = "pairs"
  rope_per_head = False
  norm_input_dtype = torch.bfloat16   # the dtype the stock processor feeds its QK norms
  self_attention_names: tuple[str, ...] = ()   # set where the module's class cannot tell

  _attention_backend = None   # read by diffusers' set_attention_backend / context parallelism
  _parallel_config = None

  def __init__(self, attn, *, attention: Dense | Sol | None = None, storage: KVStorage | None = None,
               interpret: bool | None = None, stock=None):
    self.attention, self.storage = as_attention(attention), as_storage(storage)
    self.interpret = interpret
    self.stock_processor = stock if stock is not None else _stock_processor(attn)
    try:
      spec = self.check_module(attn)
    except _Refused as e:
      raise ValueError(f"{type(self).__name__} cannot serve this {type(attn).__name__}: {e}") from None
    if getattr(attn, "fused_projections", False):   # fuse_qkv_projections() kept to_q/to_k/to_v: drop the copy
      if hasattr(attn, "unfuse_projections"):
        attn.unfuse_projections()
      elif hasattr(attn, "to_qkv"):
        del attn.to_qkv
      attn.fused_projections = False
    self.heads, self.head_dim, self.norm, self.eps = spec.heads, spec.head_dim, spec.norm, spec.eps
    self.rope_style = self.rope_style_of(attn)
    self.w_qkv, self.bias = _fuse_projection([spec.q, spec.k, spec.v])
    self.q_norm, self.k_norm = spec.q_norm, spec.k_norm
    self._settings: dict[tuple, tuple[str, str, str]] = {}
    self.settings(self.head_dim)   # check the layout now, not at the first call

  # -- per convention --------------------------------------------------------------------
  @classmethod
  def check_module(cls, attn, name: str | None = None) -> _Spec:
    """The module's spec, or _Refused with the reason it is not served."""
    if name is not None and cls.self_attention_names:
      if name.rpartition(".")[2] not in cls.self_attention_names:
        raise _Refused(f"not the self-attention of this model ({type(attn).__name__}'s self-attention is the "
                       f"module named {' / '.join(cls.self_attention_names)}): cross-attention stays stock")
    elif getattr(attn, "is_cross_attention", False):
      raise _Refused("cross-attention (keys from encoder_hidden_states): stays stock")
    return _module_spec(attn, cls.attrs, cls.norm_input_dtype)

  @classmethod
  def rope_style_of(cls, attn) -> str:
    """The layout's RoPE style for this module (most conventions have one)."""
    return cls.rope_style

  def tables(self, rotary_emb, t: int):
    """(cos, sin, rot_dim): (T, D) or (T, H*D) float32 tables in the layout's style."""
    raise NotImplementedError

  def output(self, attn, o: torch.Tensor, hidden_states: torch.Tensor) -> torch.Tensor:
    """o (B, T, H*D) bf16 -> the module's output, as the stock processor finishes."""
    return attn.to_out[1](attn.to_out[0](o))

  # -- the call ------------------------------------------------------------------------
  def layout(self, rot_dim: int) -> QKVLayout:
    return QKVLayout(self.heads, self.head_dim, norm=self.norm, rope=self.rope_style, rot_dim=rot_dim,
                     eps=self.eps, rope_per_head=self.rope_per_head)

  def settings(self, rot_dim: int, storage: KVStorage | None = None) -> tuple[str, str, str]:
    """The op's settings as JSON text, computed once per rot_dim and storage (constants
    under torch.compile); ``storage`` None: the processor's own."""
    storage = self.storage if storage is None else storage
    key = (rot_dim, storage)
    if key not in self._settings:
      self._settings[key] = tuple(settings_json(v) for v in (self.layout(rot_dim), storage, self.attention))
    return self._settings[key]

  def check_self_attention(self, encoder_hidden_states, attention_mask):
    if encoder_hidden_states is not None:
      raise NotImplementedError(f"{type(self).__name__} serves self-attention, but this module was called with "
                                "encoder_hidden_states; call restore_stock_attention(transformer) (or set the "
                                "stock processor on this module) to run it")
    if attention_mask is not None:
      raise NotImplementedError(f"{type(self).__name__} runs self-attention without a mask, but the model passed "
                                "attention_mask (e.g. SkyReels-V2 with num_frame_per_block > 1); run the model "
                                "without a mask or call restore_stock_attention(transformer)")

  def _identity_tables(self, t: int, device):
    width = self.heads * self.head_dim if self.rope_per_head else self.head_dim
    return (torch.ones(t, width, device=device), torch.zeros(t, width, device=device), self.head_dim)

  def check_weights(self, attn, hidden_states, q_attr: str, w_qkv):
    """Our fused weights are still the module's (not moved or cast since install)."""
    if hidden_states.dtype != torch.bfloat16 or w_qkv.dtype != torch.bfloat16:
      raise dlpack.BridgeError(f"packed attention runs on bfloat16 (hidden states are {hidden_states.dtype}, "
                               f"weights {w_qkv.dtype}); cast the transformer with .to(torch.bfloat16) "
                               "before use_packed_attention")
    q_lin = getattr(attn, q_attr)
    if w_qkv.device != hidden_states.device or q_lin.weight.data_ptr() != w_qkv.data_ptr():
      raise dlpack.BridgeError("the transformer was moved or cast after use_packed_attention, so this processor's "
                               "fused weights are stale; call use_packed_attention again after .to(...)")

  def run_layer(self, x, cos, sin, rot_dim, *, added: AddedTokens | None = None, kv_lengths=None, storage=None):
    """The one op call: (B, T [+ T_added], H*D) bf16 attention output."""
    layout, storage, attention = self.settings(rot_dim, storage)
    o = attention_layer(x.contiguous(), QKVWeights(self.w_qkv, self.bias, self.q_norm, self.k_norm),
                        layout=layout, rope_cos=cos.contiguous(), rope_sin=sin.contiguous(), storage=storage,
                        attention=attention, kv_lengths=kv_lengths, added=added, interpret=self.interpret)
    return o.flatten(2, 3)

  def attend(self, attn, hidden_states, rotary_emb):
    self.check_weights(attn, hidden_states, self.attrs["q"], self.w_qkv)
    b, t, _ = hidden_states.shape
    if rotary_emb is None:   # the stock processor then applies no RoPE
      cos, sin, rot_dim = self._identity_tables(t, hidden_states.device)
    else:
      cos, sin, rot_dim = self.tables(rotary_emb, t)
    return self.output(attn, self.run_layer(hidden_states, cos, sin, rot_dim), hidden_states)


def _same_rows(table: torch.Tensor, name: str) -> torch.Tensor:
  """(B, S, ...) -> (S, ...), refusing tables that differ between batch rows."""
  if table.shape[0] > 1 and not torch.equal(table[1:], table[:1].expand_as(table[1:])):
    raise NotImplementedError(f"{name} differs between batch rows; packed attention takes one RoPE table for "
                              "the batch: run the rows one at a time")
  return table[0]


def _whole_head_tables(rotary_emb, t: int, d: int):
  """``image_rotary_emb`` given as (cos, sin), each (S, D) over the whole head, already in
  the layout's style: checked and passed through as float32."""
  cos, sin = rotary_emb
  for name, tab in (("image_rotary_emb cos", cos), ("image_rotary_emb sin", sin)):
    if tuple(tab.shape) != (t, d):
      raise _table_shape_error(name, tab.shape, f"({t}, {d})")
  return cos.float(), sin.float(), d


def _table_shape_error(name, got, want):
  return dlpack.BridgeError(f"{name} has shape {list(got)}, expected {want}; packed attention reads the RoPE "
                            "format of this model's own rotary embedding module")


class PackedWanAttnProcessor(_PackedSelfAttnProcessor):
  """Wan 2.x self-attention (``WanAttention``, ``attn1``; the same processor code serves
  Wan VACE, ChronoEdit and SkyReels-V2) on packed K/V."""

  family = "Wan 2.x"

  def tables(self, rotary_emb, t):
    cos, sin = rotary_emb   # (1, S, 1, D): one table for every head and batch row
    d = self.head_dim
    for name, tab in (("rotary_emb cos", cos), ("rotary_emb sin", sin)):
      if tab.shape[-1] != d or tab.numel() % (t * d):
        raise _table_shape_error(name, tab.shape, f"(1, {t}, 1, {d})")
    cos = _same_rows(cos.reshape(-1, t, d), "rotary_emb cos")
    sin = _same_rows(sin.reshape(-1, t, d), "rotary_emb sin")
    # The stock processor reads cos at even and sin at odd channels for each pair.
    return (cos[:, 0::2].float().repeat_interleave(2, -1), sin[:, 1::2].float().repeat_interleave(2, -1), d)

  def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None):
    self.check_self_attention(encoder_hidden_states, attention_mask)
    return self.attend(attn, hidden_states, rotary_emb)


class PackedHeliosAttnProcessor(PackedWanAttnProcessor):
  """Helios self-attention (``HeliosAttention``, ``attn1``: Wan's attention with the
  RoPE tables in one (B, S, 2*D) tensor, cos then sin) on packed K/V. Modules that
  amplify the history's keys (``is_amplify_history``) stay stock."""

  family = "Helios"

  @classmethod
  def check_module(cls, attn, name=None):
    spec = super().check_module(attn, name)
    if getattr(attn, "is_amplify_history", False):
      raise _Refused("history key amplification (is_amplify_history): not served")
    return spec

  def tables(self, rotary_emb, t):
    d = self.head_dim
    if rotary_emb.shape[-1] != 2 * d:
      raise _table_shape_error("rotary_emb", rotary_emb.shape, f"(B, {t}, {2 * d}): cos then sin")
    return super().tables(rotary_emb.chunk(2, dim=-1), t)

  def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, rotary_emb=None,
               original_context_length=None):
    self.check_self_attention(encoder_hidden_states, attention_mask)
    return self.attend(attn, hidden_states, rotary_emb)


class PackedLTXAttnProcessor(_PackedSelfAttnProcessor):
  """LTX-Video self-attention (``LTXAttention``, ``attn1``) on packed K/V."""

  family = "LTX-Video"
  rope_per_head = True
  self_attention_names = ("attn1",)

  def tables(self, rotary_emb, t):
    cos, sin = rotary_emb   # (B, S, H*D): each head its own frequencies
    hd = self.heads * self.head_dim
    for name, tab in (("image_rotary_emb cos", cos), ("image_rotary_emb sin", sin)):
      if tab.dim() != 3 or tuple(tab.shape[1:]) != (t, hd):
        raise _table_shape_error(name, tab.shape, f"(B, {t}, {hd})")
    return (_same_rows(cos, "image_rotary_emb cos").float(), _same_rows(sin, "image_rotary_emb sin").float(),
            self.head_dim)

  def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
    self.check_self_attention(encoder_hidden_states, attention_mask)
    return self.attend(attn, hidden_states, image_rotary_emb)


class PackedCosmosAttnProcessor(_PackedSelfAttnProcessor):
  """Cosmos Predict-1 self-attention (``Attention`` with ``CosmosAttnProcessor2_0``,
  ``attn1``) on packed K/V: per-head RMSNorm, rotate-half RoPE
  (``apply_rotary_emb(use_real_unbind_dim=-2)``)."""

  family = "Cosmos"
  rope_style = "half"

  def tables(self, rotary_emb, t):
    return _whole_head_tables(rotary_emb, t, self.head_dim)   # (S, D)

  def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
    self.check_self_attention(encoder_hidden_states, attention_mask)
    return self.attend(attn, hidden_states, image_rotary_emb)


class PackedH3AttnProcessor(_PackedSelfAttnProcessor):
  """MiniMax-H3 attention (``MiniMaxH3Attention``: the blocks and the text refiner) on
  packed K/V: per-head RMSNorm, rotate-half RoPE on the first rot_dim channels."""

  family = "MiniMax-H3"
  rope_style = "half"

  def tables(self, rotary_emb, t):
    cos, sin = rotary_emb   # (S, rot_dim); the other channels pass through
    d = self.head_dim
    rot = cos.shape[-1]
    for name, tab in (("rotary_emb cos", cos), ("rotary_emb sin", sin)):
      if tab.dim() != 2 or tuple(tab.shape) != (t, rot) or rot % 2 or rot > d:
        raise _table_shape_error(name, tab.shape, f"({t}, rot_dim), rot_dim even and <= {d}")
    pad = d - rot
    cos = torch.cat([cos.float(), cos.new_ones(t, pad, dtype=torch.float32)], 1)
    sin = torch.cat([sin.float(), sin.new_zeros(t, pad, dtype=torch.float32)], 1)
    return cos, sin, rot

  def __call__(self, attn, hidden_states, rotary_emb=None, attention_mask=None):
    self.check_self_attention(None, attention_mask)
    return self.attend(attn, hidden_states, rotary_emb)


class PackedKandinsky5AttnProcessor(_PackedSelfAttnProcessor):
  """Kandinsky 5 self-attention (``Kandinsky5Attention`` named ``self_attention``, in the
  visual and the text blocks) on packed K/V: per-head RMSNorm of float32 q / k, RoPE as
  2x2 rotation matrices on adjacent pairs."""

  family = "Kandinsky 5"
  attrs = dict(q="to_query", k="to_key", v="to_value", norm_q="query_norm", norm_k="key_norm", heads="num_heads")
  norm_input_dtype = torch.float32
  self_attention_names = ("self_attention",)

  def tables(self, rotary_emb, t):
    d = self.head_dim
    if tuple(rotary_emb.shape[-5:]) != (t, 1, d // 2, 2, 2):
      raise _table_shape_error("rotary_emb", rotary_emb.shape, f"(B, {t}, 1, {d // 2}, 2, 2)")
    rot = _same_rows(rotary_emb.reshape(-1, t, d // 2, 2, 2), "rotary_emb")
    cos, sin = rot[..., 0, 0], rot[..., 1, 0]
    if not (torch.equal(rot[..., 0, 1], -sin) and torch.equal(rot[..., 1, 1], cos)):
      raise dlpack.BridgeError("rotary_emb is not a rotation [[cos, -sin], [sin, cos]] per channel pair; packed "
                               "attention serves Kandinsky5RoPE1D / Kandinsky5RoPE3D tables")
    return cos.float().repeat_interleave(2, -1), sin.float().repeat_interleave(2, -1), d

  def output(self, attn, o, hidden_states):
    return attn.out_layer(o)

  def __call__(self, attn, hidden_states, encoder_hidden_states=None, rotary_emb=None, sparse_params=None):
    self.check_self_attention(encoder_hidden_states, None)
    if sparse_params is not None:
      raise NotImplementedError("Kandinsky 5's NABLA sparse attention (sparse_params) is not served; use "
                                "attention_type='regular', or attention=Sol(...) for sparse attention")
    return self.attend(attn, hidden_states, rotary_emb)


class PackedLTX2AttnProcessor(_PackedSelfAttnProcessor):
  """LTX-2 self-attention (``LTX2Attention`` named ``attn1``, video, and ``audio_attn1``,
  audio) on packed K/V: RMSNorm over H*D, RoPE per head, ``rope_type`` "interleaved"
  (adjacent pairs, (B, S, H*D) tables) or "split" (rotate-half per head, (B, H, S, D/2)
  tables); the per-head output gates of ``apply_gated_attention`` are applied as stock
  does."""

  family = "LTX-2"
  rope_per_head = True
  self_attention_names = ("attn1", "audio_attn1")

  @classmethod
  def check_module(cls, attn, name=None):
    spec = super().check_module(attn, name)
    if getattr(attn, "rope_type", None) not in ("interleaved", "split"):
      raise _Refused(f"LTX-2 rope_type {getattr(attn, 'rope_type', None)!r}: not served (interleaved or split)")
    return spec

  @classmethod
  def rope_style_of(cls, attn):
    return "pairs" if attn.rope_type == "interleaved" else "half"

  def tables(self, rotary_emb, t):
    cos, sin = rotary_emb
    h, d = self.heads, self.head_dim
    if self.rope_style == "pairs":   # (B, S, H*D), adjacent pairs
      for name, tab in (("query_rotary_emb cos", cos), ("query_rotary_emb sin", sin)):
        if tab.dim() != 3 or tuple(tab.shape[1:]) != (t, h * d):
          raise _table_shape_error(name, tab.shape, f"(B, {t}, {h * d})")
      return (_same_rows(cos, "query_rotary_emb cos").float(), _same_rows(sin, "query_rotary_emb sin").float(), d)
    out = []   # split: (B, H, S, D/2) -> channel c and c + D/2 of each head share angle c
    for name, tab in (("query_rotary_emb cos", cos), ("query_rotary_emb sin", sin)):
      if tab.dim() != 4 or tuple(tab.shape[1:]) != (h, t, d // 2):
        raise _table_shape_error(name, tab.shape, f"(B, {h}, {t}, {d // 2})")
      tab = _same_rows(tab, name).float().transpose(0, 1)   # (S, H, D/2)
      out.append(torch.cat([tab, tab], -1).reshape(t, h * d))
    return out[0], out[1], d

  def output(self, attn, o, hidden_states):
    if attn.to_gate_logits is not None:   # per-head gates from the module's input, as stock
      gates = 2.0 * torch.sigmoid(attn.to_gate_logits(hidden_states))   # (B, T, H)
      o = (o.unflatten(2, (self.heads, -1)) * gates.unsqueeze(-1)).flatten(2, 3)
    return attn.to_out[1](attn.to_out[0](o))

  def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, query_rotary_emb=None,
               key_rotary_emb=None):
    self.check_self_attention(encoder_hidden_states, attention_mask)
    if key_rotary_emb is not None and key_rotary_emb is not query_rotary_emb:
      raise NotImplementedError("LTX-2 self-attention with a separate key_rotary_emb is not served (one RoPE for "
                                "q and k); call restore_stock_attention(transformer)")
    return self.attend(attn, hidden_states, query_rotary_emb)


def _trailing_key_lengths(mask: torch.Tensor, n: int) -> torch.Tensor | None:
  """A key-padding mask (B, 1, 1, N) or (B, N) bool, True = attend, as (B,) int32 key
  counts, or None when every key is kept. Only trailing padding has this form (what
  HunyuanVideo's text padding is); anything else raises, naming the fix."""
  if mask.dtype != torch.bool or mask.dim() not in (2, 4) or mask.shape[-1] != n or (
      mask.dim() == 4 and tuple(mask.shape[1:3]) != (1, 1)):
    raise NotImplementedError(f"attention_mask {mask.dtype}{list(mask.shape)} is not a boolean key-padding mask "
                              f"(B, 1, 1, {n}); packed attention takes trailing key padding only: call "
                              "restore_stock_attention(transformer) to run this model")
  keep = mask.reshape(mask.shape[0], n)
  lengths = keep.sum(1, dtype=torch.int32)
  if bool((lengths == n).all()):
    return None
  if not torch.equal(keep, torch.arange(n, device=mask.device)[None, :] < lengths[:, None]):
    raise NotImplementedError("attention_mask masks keys that are not trailing padding; packed attention takes "
                              "trailing key padding only: call restore_stock_attention(transformer) to run this "
                              "model")
  return lengths


class _PackedJointAttnProcessor(_PackedSelfAttnProcessor):
  """The shared part of joint text+video attention: the text tokens' storage class and
  the RoPE tables over both parts (the model's tables on the video tokens, cos 1 and
  sin 0 on the text)."""

  joint = True   # the text joins this attention (through its own projection or the module's)

  def __init__(self, attn, *, text_class: str | None = "int8", **kw):
    super().__init__(attn, **kw)
    if text_class is not None and text_class not in CLASSES:
      raise ValueError(f"text_class must be one of {CLASSES} or None, got {text_class!r}")
    self.text_class = text_class
    self._text_storages: dict[tuple[int, int], KVStorage] = {}

  def text_storage(self, start: int, end: int) -> KVStorage | None:
    """The storage with the text tokens [start, end) at ``text_class`` (None: as is; a
    storage with fixed block classes is taken as the caller wrote it). Built once per
    range, not per call."""
    if self.text_class is None or self.storage.block_classes is not None:
      return None
    key = (start, end)
    if key not in self._text_storages:
      self._text_storages[key] = dataclasses.replace(
          self.storage, token_ranges=self.storage.token_ranges + ((start, end, self.text_class),))
    return self._text_storages[key]

  def tables(self, rotary_emb, t):
    return _whole_head_tables(rotary_emb, t, self.head_dim)   # (S, D), repeat-interleaved pairs

  def joint_tables(self, rotary_emb, t_video: int, t_text: int, device, *, text_first: bool):
    """(cos, sin, rot_dim) over both parts, in the order they are joined."""
    if rotary_emb is None:
      return self._identity_tables(t_video + t_text, device)
    cos, sin, rot_dim = self.tables(rotary_emb, t_video)
    ident_cos, ident_sin, _ = self._identity_tables(t_text, device)
    join = (lambda v, txt: torch.cat([txt, v], 0)) if text_first else (lambda v, txt: torch.cat([v, txt], 0))
    return join(cos, ident_cos), join(sin, ident_sin), rot_dim


class PackedHunyuanVideoAttnProcessor(_PackedJointAttnProcessor):
  """HunyuanVideo's joint text+video attention (``Attention`` with
  ``HunyuanVideoAttnProcessor2_0``) on packed K/V: one attention over the video tokens
  and the text tokens after them.

  * Dual-stream blocks (``add_q_proj``): the video tokens through ``to_q/to_k/to_v`` and
    ``norm_q/norm_k``, the text tokens through ``add_q_proj``... and
    ``norm_added_q/norm_added_k``, into one packed K/V (``AddedTokens``); outputs
    through ``to_out`` and ``to_add_out``.
  * Single-stream blocks (no ``add_q_proj``): video and text joined and projected by
    the one ``to_q/to_k/to_v``; the output is split back, as stock, with no projection.

  RoPE on the video tokens only (pairs, ``image_rotary_emb`` (S, D) cos and sin); the
  text's key padding (``attention_mask`` (B, 1, 1, N), True = attend) becomes key
  lengths per batch row (dense attention only; Sol takes no mask). The text tokens are
  stored at ``text_class`` (default int8: short text loses more at int4), a token range
  added to the storage for each call's lengths; None leaves them to the storage.
  """

  family = "HunyuanVideo"
  added_attrs = dict(q="add_q_proj", k="add_k_proj", v="add_v_proj", norm_q="norm_added_q",
                     norm_k="norm_added_k", heads="heads")

  def __init__(self, attn, **kw):
    super().__init__(attn, **kw)
    self.added = None
    if getattr(attn, "add_q_proj", None) is not None:
      spec = _module_spec(attn, self.added_attrs, self.norm_input_dtype)
      w, b = _fuse_projection([spec.q, spec.k, spec.v])
      self.added = QKVWeights(w, b, spec.q_norm, spec.k_norm)

  @classmethod
  def check_module(cls, attn, name=None):
    spec = super().check_module(attn, name)
    if getattr(attn, "add_q_proj", None) is not None:
      added = _module_spec(attn, cls.added_attrs, cls.norm_input_dtype)
      if (added.heads, added.head_dim, added.norm, added.eps) != (spec.heads, spec.head_dim, spec.norm, spec.eps):
        raise _Refused(f"the added (text) projections differ from the video ones in heads, head_dim or QK norm "
                       f"({added.heads}x{added.head_dim} {added.norm} eps {added.eps} vs {spec.heads}x"
                       f"{spec.head_dim} {spec.norm} eps {spec.eps}): not supported")
    return spec

  def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None):
    self.check_weights(attn, hidden_states, self.attrs["q"], self.w_qkv)
    if encoder_hidden_states is None:   # as stock: attention of the video alone, no output projection
      self.check_self_attention(None, attention_mask)
      t = hidden_states.shape[1]
      cos, sin, rot_dim = (self._identity_tables(t, hidden_states.device) if image_rotary_emb is None
                           else self.tables(image_rotary_emb, t))
      return self.run_layer(hidden_states, cos, sin, rot_dim), None
    t_video, t_text = hidden_states.shape[1], encoder_hidden_states.shape[1]
    n = t_video + t_text
    kv_lengths = None if attention_mask is None else _trailing_key_lengths(attention_mask, n)
    cos, sin, rot_dim = self.joint_tables(image_rotary_emb, t_video, t_text, hidden_states.device, text_first=False)
    storage = self.text_storage(t_video, n)
    if self.added is not None:
      self.check_weights(attn, encoder_hidden_states, self.added_attrs["q"], self.added.w_qkv)
      o = self.run_layer(hidden_states, cos, sin, rot_dim, kv_lengths=kv_lengths, storage=storage,
                         added=AddedTokens(encoder_hidden_states.contiguous(), self.added))
    else:
      o = self.run_layer(torch.cat([hidden_states, encoder_hidden_states], 1), cos, sin, rot_dim,
                         kv_lengths=kv_lengths, storage=storage)
    video, text = o[:, :t_video], o[:, t_video:]
    if getattr(attn, "to_out", None) is not None:
      video = attn.to_out[1](attn.to_out[0](video))
    if getattr(attn, "to_add_out", None) is not None:
      text = attn.to_add_out(text)
    return video, text


class PackedCogVideoXAttnProcessor(_PackedJointAttnProcessor):
  """CogVideoX's joint text+video attention (``Attention`` with
  ``CogVideoXAttnProcessor2_0``; ConsisID runs the same processor) on packed K/V: the
  text tokens first, then the video tokens, through the one ``to_q/to_k/to_v`` and its
  LayerNorm QK norm per head; RoPE (pairs, ``image_rotary_emb`` (S_video, D)) on the
  video tokens only, none without it (CogVideoX-2b); ``to_out`` on both, split back as
  (video, text). No attention mask (the stock models pass none). Text stored at
  ``text_class`` (default int8)."""

  family = "CogVideoX"

  def __call__(self, attn, hidden_states, encoder_hidden_states, attention_mask=None, image_rotary_emb=None):
    self.check_weights(attn, hidden_states, self.attrs["q"], self.w_qkv)
    if attention_mask is not None:
      raise NotImplementedError(f"{type(self).__name__} runs CogVideoX attention without a mask, but the model "
                                "passed attention_mask; call restore_stock_attention(transformer) to run it")
    t_video, t_text = hidden_states.shape[1], encoder_hidden_states.shape[1]
    cos, sin, rot_dim = self.joint_tables(image_rotary_emb, t_video, t_text, hidden_states.device, text_first=True)
    o = self.run_layer(torch.cat([encoder_hidden_states, hidden_states], 1), cos, sin, rot_dim,
                       storage=self.text_storage(0, t_text))
    o = attn.to_out[1](attn.to_out[0](o))
    return o[:, t_text:], o[:, :t_text]


# --------------------------------------------------------------------------------------
# Which stock processor is which convention
# --------------------------------------------------------------------------------------
_T = "diffusers.models.transformers."
_AP = "diffusers.models.attention_processor."

SERVED = {
    _T + "transformer_wan.WanAttnProcessor": PackedWanAttnProcessor,
    _T + "transformer_chronoedit.WanAttnProcessor": PackedWanAttnProcessor,
    _T + "transformer_skyreels_v2.SkyReelsV2AttnProcessor": PackedWanAttnProcessor,
    _T + "transformer_ltx.LTXVideoAttnProcessor": PackedLTXAttnProcessor,
    _T + "transformer_cosmos.CosmosAttnProcessor2_0": PackedCosmosAttnProcessor,
    _T + "transformer_minimax_h3.MiniMaxH3AttnProcessor": PackedH3AttnProcessor,
    _T + "transformer_kandinsky.Kandinsky5AttnProcessor": PackedKandinsky5AttnProcessor,
    _T + "transformer_ltx2.LTX2AudioVideoAttnProcessor": PackedLTX2AttnProcessor,
    _T + "transformer_helios.HeliosAttnProcessor": PackedHeliosAttnProcessor,
    _T + "transformer_hunyuan_video.HunyuanVideoAttnProcessor2_0": PackedHunyuanVideoAttnProcessor,
    _AP + "CogVideoXAttnProcessor2_0": PackedCogVideoXAttnProcessor,
}
"""Stock processor (module.qualname) -> our processor for that calling convention."""

_JOINT = "joint text+video attention ({}: the text tokens join the video tokens' attention): not supported yet"
KNOWN_REFUSALS = {
    _AP + "FusedCogVideoXAttnProcessor2_0": _JOINT.format("FusedCogVideoXAttnProcessor2_0"),
    _T + "transformer_easyanimate.EasyAnimateAttnProcessor2_0": _JOINT.format("EasyAnimateAttnProcessor2_0"),
    _T + "transformer_motif_video.MotifVideoAttnProcessor2_0": _JOINT.format("MotifVideoAttnProcessor2_0"),
    _AP + "AllegroAttnProcessor2_0": ("RoPE rotate-half within each t/h/w third of a head (AllegroAttnProcessor2_0): "
                                      "no layout RoPE style serves it"),
    _T + "transformer_sana_video.SanaLinearAttnProcessor3_0": "linear attention (SanaLinearAttnProcessor3_0), not "
                                                             "softmax attention",
    _AP + "AttnProcessor2_0": ("generic AttnProcessor2_0 (no RoPE; text refiners and spatial/temporal blocks pass "
                               "masks through it): not served"),
    _AP + "AttnProcessor": "generic AttnProcessor (no RoPE, may be given masks): not served",
    _T + "transformer_ltx2.LTX2PerturbedAttnProcessor": ("LTX-2 perturbed attention (LTX2PerturbedAttnProcessor, "
                                                         "perturbed_attn=True): not served"),
}
"""Stock processors known not to be servable, with the reason the report gives."""


def _key(processor) -> str:
  return f"{type(processor).__module__}.{type(processor).__qualname__}"


def _stock_processor(module):
  p = getattr(module, "processor", None)
  return p.stock_processor if isinstance(p, _PackedSelfAttnProcessor) else p


def _is_attention_module(module) -> bool:
  """A diffusers attention module: one that runs through a processor (Attention,
  AttentionModuleMixin classes, and the few, like MochiAttention, with only the attribute)."""
  if not hasattr(module, "processor"):
    return False
  return callable(getattr(module, "set_processor", None)) or callable(module.processor)


def _plan(name: str, module: nn.Module):
  """(our processor class, None) for a servable module, else (None, reason)."""
  stock = _stock_processor(module)
  if getattr(module, "is_cross_attention", False):
    return None, "cross-attention (keys from encoder_hidden_states): stays stock"
  cls = SERVED.get(_key(stock))
  if not getattr(cls, "joint", False):
    for attr in ("add_q_proj", "add_k_proj"):
      if getattr(module, attr, None) is not None:
        return None, f"joint text+video attention ({attr}) under {type(stock).__name__}: not supported yet"
  if cls is None:
    return None, KNOWN_REFUSALS.get(_key(stock), f"stock processor {type(stock).__name__}: packed attention does not "
                                                 "know how this model calls it (RoPE format, masks, joined tokens)")
  try:
    cls.check_module(module, name)
  except _Refused as e:
    return None, str(e)
  return cls, None


def attention_report(transformer) -> InstallReport:
  """What ``use_packed_attention`` would do to each attention module, without
  installing anything (same ``InstallReport``)."""
  report = InstallReport()
  for name, module in transformer.named_modules():
    if _is_attention_module(module):
      cls, reason = _plan(name, module)
      report.add(name, module, INSTALLED if cls is not None else reason)
  return report


def use_packed_attention(transformer, *, attention: Dense | Sol | None = None, storage: KVStorage | None = None,
                         text_class: str | None = "int8", interpret: bool | None = None) -> InstallReport:
  """Install packed attention on every self-attention of a diffusers transformer that it
  can serve (this module's docstring says which and how they are recognised).

  attention: ``Dense(...)`` (default) or ``Sol(...)`` (``pallas_kernels``).
  storage: a ``formats.KVStorage`` (None: every block int4), e.g.
  ``KVStorage(token_ranges=[(0, 4096, "int8")])`` for an int8 prefix; its token ranges
  fit any sequence length. The settings are checked here, before anything is installed.
  text_class: joint text+video attention's text tokens are stored at least at this
  class (default int8; None: as ``storage`` says).

  Returns an ``InstallReport`` (a dict: module name -> ``"installed"`` or the reason it
  stays stock; ``.installed`` lists the names now on packed attention), also logged at
  INFO on the ``torch_bridge.diffusers`` logger. Raises ValueError when no module can be
  served, naming the reason for each kind of attention module seen. Calling it again
  (after ``.to(...)``, or with other settings) reinstalls.
  """
  if not isinstance(transformer, nn.Module):
    raise ValueError(f"use_packed_attention expects a diffusers transformer (a torch nn.Module such as "
                     f"WanTransformer3DModel), got {type(transformer).__name__}")
  attention, storage = as_attention(attention), as_storage(storage)
  if text_class is not None and text_class not in CLASSES:
    raise ValueError(f"text_class must be one of {CLASSES} or None, got {text_class!r}")
  report = attention_report(transformer)
  if not report.installed:
    if not report:
      raise ValueError(f"{type(transformer).__name__} has no diffusers attention module (one with a processor); "
                       "packed attention serves the self- and joint text+video attention of: "
                       + ", ".join(sorted({c.family for c in SERVED.values()})))
    seen = "; ".join(f"{kind} x{len(names)}: {reason}" for (kind, reason), names in report.grouped().items())
    raise ValueError(f"{type(transformer).__name__} has no attention module packed attention can serve ({seen})")
  modules = dict(transformer.named_modules())
  for name in report.installed:
    module = modules[name]
    cls = SERVED[_key(_stock_processor(module))]
    joint = dict(text_class=text_class) if getattr(cls, "joint", False) else {}
    module.set_processor(cls(module, attention=attention, storage=storage, interpret=interpret,
                             stock=_stock_processor(module), **joint))
  for name, outcome in report.items():
    log.info("use_packed_attention: %s (%s): %s", name or "<root>", report.kinds[name],
             f"installed {type(modules[name].processor).__name__}" if outcome == INSTALLED else outcome)
  return report


def restore_stock_attention(transformer) -> list[str]:
  """Put the stock processor back on every module ``use_packed_attention`` installed
  ours on; returns their names. The q/k/v weights stay views of one fused matrix."""
  restored = []
  for name, module in transformer.named_modules():
    if _is_attention_module(module) and isinstance(module.processor, _PackedSelfAttnProcessor):
      module.set_processor(module.processor.stock_processor)
      restored.append(name)
  return restored
