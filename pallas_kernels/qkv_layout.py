"""How an attention block turns its projection into q and k: one small frozen config.

Video DiTs agree on ``q, k, v = x @ W (+ bias)`` and on attention, and differ in between:

* QK norm: RMSNorm per head (weight (D,): MiniMax-H3, HunyuanVideo), across all heads
  of a token (weight (H*D,): Wan, LTX-Video), LayerNorm per head (weight and bias,
  CogVideoX), or none.
* RoPE: ``rope(x) = x * cos + partner(x) * sin`` on the channels ``[0, rot_dim)`` of each
  head, with the partner of the ``"half"`` style (rotate-half: channel c pairs with
  c + rot_dim/2; H3) or the ``"pairs"`` style (adjacent channels 2i, 2i+1, the complex
  multiply of Wan, HunyuanVideo and LTX-Video). The caller builds the tables: (T, D)
  float32 shared by every head, or (T, H*D) with each head's own frequencies (LTX-Video
  spreads its frequencies over all H*D channels), with cos = 1 and sin = 0 where a
  channel does not rotate.

``QKVLayout`` holds those choices with the head count and size, checks them once, and
is what ``streamed_qkv``, ``attention_layer`` and the torch ops take instead of a row of
loose arguments. ``QKVLayout.h3(...)`` is MiniMax-H3's (the default everywhere).
``rotated_qkv_reference`` in ``qkv_epilogue`` is the layout's float32 definition.
"""
from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np

from formats.packed_kv import check_head_dim
from formats.storage import json_fields

from pallas_kernels.rope import STYLES as ROPE_STYLES

NORMS = ("head", "across", "head_layer", "none")


@dataclasses.dataclass(frozen=True)
class QKVLayout:
  """heads x head_dim; ``norm`` in ``NORMS`` (``"head"``: RMSNorm per head,
  ``"across"``: RMSNorm over a token's H*D channels, ``"head_layer"``: LayerNorm per
  head, ``"none"``); ``rope`` in ``ROPE_STYLES`` over the first ``rot_dim`` channels of
  every head (None: all of them; 0: no RoPE); ``eps`` of the norm;
  ``rope_per_head``: the tables are (T, H*D), one set of frequencies per head."""
  heads: int
  head_dim: int
  norm: str = "head"
  rope: str = "half"
  rot_dim: int | None = None
  eps: float = 1e-5
  rope_per_head: bool = False

  def __post_init__(self):
    if not isinstance(self.heads, (int, np.integer)) or self.heads <= 0:
      raise ValueError(f"heads must be a positive int, got {self.heads!r}")
    check_head_dim(self.head_dim)
    if self.norm not in NORMS:
      raise ValueError(f"norm must be one of {NORMS} (RMSNorm per head, across heads, LayerNorm per head, none), "
                       f"got {self.norm!r}")
    if self.rot_dim is None:
      object.__setattr__(self, "rot_dim", self.head_dim)
    if self.rope not in ROPE_STYLES:
      raise ValueError(f"rope must be one of {ROPE_STYLES} (rotate-half, adjacent pairs), got {self.rope!r}")
    if not isinstance(self.rot_dim, (int, np.integer)) or self.rot_dim % 2 or not 0 <= self.rot_dim <= self.head_dim:
      raise ValueError(f"rot_dim must be even and in [0, head_dim={self.head_dim}], got {self.rot_dim!r}")
    if not float(self.eps) > 0:
      raise ValueError(f"eps must be positive, got {self.eps!r}")
    object.__setattr__(self, "heads", int(self.heads))
    object.__setattr__(self, "rot_dim", int(self.rot_dim))
    object.__setattr__(self, "eps", float(self.eps))
    object.__setattr__(self, "rope_per_head", bool(self.rope_per_head))

  @classmethod
  def h3(cls, heads: int = 56, head_dim: int = 128, rot_dim: int | None = None, eps: float = 1e-5):
    """MiniMax-H3: RMSNorm per head, rotate-half RoPE on 3/4 of each head."""
    return cls(heads, head_dim, "head", "half", (3 * head_dim) // 4 if rot_dim is None else rot_dim, eps)

  def to_json(self) -> str:
    """The layout as a JSON string: how it crosses a torch custom op's schema."""
    return json.dumps(dataclasses.asdict(self), sort_keys=True, separators=(",", ":"))

  @classmethod
  def from_json(cls, text: str) -> "QKVLayout":
    return cls(**json_fields(text, cls))

  @property
  def width(self) -> int:
    """Columns of the fused projection: [q heads | k heads | v heads]."""
    return 3 * self.heads * self.head_dim

  @property
  def norm_width(self) -> int:
    """Length of each norm's parameter vector: D per head, H*D across heads, 2*D for a
    LayerNorm per head (its weight, then its bias), 0 without a norm."""
    return {"head": self.head_dim, "across": self.heads * self.head_dim, "head_layer": 2 * self.head_dim,
            "none": 0}[self.norm]

  @property
  def table_width(self) -> int:
    return self.heads * self.head_dim if self.rope_per_head else self.head_dim

  def check_norm_weights(self, q_norm_weight, k_norm_weight):
    for name, wgt in (("q_norm_weight", q_norm_weight), ("k_norm_weight", k_norm_weight)):
      if self.norm == "none":
        if wgt is not None:
          raise ValueError(f"{name} given, but the layout has norm='none'")
      elif wgt is None or tuple(wgt.shape) != (self.norm_width,):
        got = None if wgt is None else tuple(wgt.shape)
        raise ValueError(f"{name} must be ({self.norm_width},) for norm={self.norm!r}, got {got}")

  def check_tables(self, rope_cos, rope_sin, num_tokens: int):
    want = (num_tokens, self.table_width)
    for name, tab in (("rope_cos", rope_cos), ("rope_sin", rope_sin)):
      if tab is None or tuple(tab.shape) != want:
        got = None if tab is None else tuple(tab.shape)
        per = "(T, H*D): each head its own" if self.rope_per_head else "(T, D): shared by every head"
        raise ValueError(f"{name} must be {per} = {want}, got {got}; build it with rope.rope_tables "
                         f"(cos 1, sin 0 on channels that do not rotate)")


def rms_norm_reference(x, weight, layout: QKVLayout):
  """x (B, T, H, D) float32: the layout's QK norm (RMSNorm per head or across the heads
  of each token, LayerNorm per head), or none."""
  if layout.norm == "none":
    return x
  b, t, h, d = x.shape
  w = jnp.asarray(weight, jnp.float32)
  if layout.norm == "head_layer":
    centred = x - jnp.mean(x, axis=-1, keepdims=True)
    var = jnp.mean(centred * centred, axis=-1, keepdims=True)
    return centred * jax.lax.rsqrt(var + layout.eps) * w[:d] + w[d:]
  if layout.norm == "head":
    ms = jnp.mean(x * x, axis=-1, keepdims=True)
    return x * jax.lax.rsqrt(ms + layout.eps) * w
  ms = jnp.mean(x * x, axis=(-2, -1), keepdims=True)
  return x * jax.lax.rsqrt(ms + layout.eps) * w.reshape(h, d)


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class QKVWeights:
  """The arrays of one attention block's QKV projection, as one value (a pytree).

  w_qkv: (hidden, 3*H*D) bf16, columns [q heads | k heads | v heads].
  bias: (3*H*D,) bf16 or f32, or None.
  q_norm_weight / k_norm_weight: f32 QK-norm parameters, (D,) per head or (H*D,) across
  heads as the ``QKVLayout`` says, (2*D,) = weight then bias for a LayerNorm per head;
  None without a norm.
  """
  w_qkv: object
  bias: object = None
  q_norm_weight: object = None
  k_norm_weight: object = None

  def tree_flatten(self):
    return (self.w_qkv, self.bias, self.q_norm_weight, self.k_norm_weight), None

  @classmethod
  def tree_unflatten(cls, _, leaves):
    return cls(*leaves)


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class AddedTokens:
  """Tokens joined after the block's own, through their own projection: joint text+video
  attention (diffusers' ``add_q_proj`` / ``add_k_proj`` / ``add_v_proj`` with
  ``norm_added_q`` / ``norm_added_k``, as in HunyuanVideo's dual-stream blocks).

  x: (B, T_added, hidden_added) bf16 (its width may differ from the block's x).
  weights: a ``QKVWeights`` for them, in the same ``QKVLayout`` (heads, head_dim, norm
  kind) as the block's own: w_qkv (hidden_added, 3*H*D), its bias or None, its norm
  weights.

  The projection writes one Q and one packed K/V over T + T_added tokens, the added
  ones after the block's own, each token through its own weights (a 64-token block
  may hold both kinds: the epilogue picks bias and norm weights per row); the RoPE
  tables cover all T + T_added rows (cos 1, sin 0 where a token does not rotate).
  """
  x: object
  weights: QKVWeights

  def tree_flatten(self):
    return (self.x, self.weights), None

  @classmethod
  def tree_unflatten(cls, _, leaves):
    return cls(*leaves)
