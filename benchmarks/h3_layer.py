"""One MiniMax-H3-style attention layer (projection, QK-norm, partial 3D RoPE, attention)
in four variants, shared by the demo and the end-to-end benchmark.

  bf16        the plain BF16 pipeline: qkv = x @ W, RMSNorm, RoPE, cuDNN SDPA
  bf16_quant  BF16 projection, then rotate + quantize (the anti-pattern: full QKV exists)
  dense       ours: pallas_kernels.layer.attention_layer (streamed_qkv -> packed_attention)
  sol         ours: the same with sol_attention

Inputs are DiT-like: hidden states are smooth fields over a (t, h, w) grid plus noise,
behind a conditioning prefix, so attention is structured as in a video DiT.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels.testing import dit_grid
from formats import KVStorage
from formats import packed_kv as fmt
from pallas_kernels import rope as rope_lib
from pallas_kernels.qkv_layout import QKVLayout, QKVWeights

VARIANTS = ("bf16", "bf16_quant", "dense", "sol")

@dataclasses.dataclass(frozen=True)
class LayerShape:
  tokens: int
  hidden: int = 5376
  heads: int = 56
  head_dim: int = 128
  rot_dim: int = 96
  prefix_tokens: int = 0        # conditioning prefix (text, references, audio)
  prefix_class: str = "int8"    # its K/V precision in our variants
  default_class: str = "int4"   # every other block's

  @property
  def storage(self) -> KVStorage:
    """Our variants' K/V storage: ``default_class`` (int4), the prefix in ``prefix_class``."""
    ranges = ((0, self.prefix_tokens, self.prefix_class),) if self.prefix_tokens else ()
    return KVStorage(default=self.default_class, token_ranges=ranges)

  @property
  def layout(self) -> QKVLayout:
    return QKVLayout.h3(self.heads, self.head_dim, self.rot_dim)


H3_SMALL = LayerShape(tokens=300, hidden=256, heads=2, head_dim=128, rot_dim=96, prefix_tokens=40)


def make_inputs(shape: LayerShape, seed: int = 0, chunk: int = 8192):
  """x (1, T, hidden) bf16, W (hidden, 3HD) bf16, norm weights, RoPE tables, on device.

  x is generated on the device in row chunks and assembled on the host, so that making
  the inputs never allocates more device memory than the inputs themselves (the
  benchmark reads the process's peak).
  """
  t, hid = shape.tokens, shape.hidden
  pos = dit_grid(t, shape.prefix_tokens)
  cos, sin = rope_lib.rope_tables(rope_lib.rope_3d_angles(pos, freqs_per_axis=shape.rot_dim // 6),
                                  shape.head_dim)
  keys = jax.random.split(jax.random.key(seed), 6)
  span = np.maximum(pos.max(0), 1).astype(np.float32)
  waves = 24
  freq = jax.random.normal(keys[0], (3, waves)) * 2.5
  phase = jax.random.uniform(keys[1], (waves,)) * 2 * np.pi
  mix = jax.random.normal(keys[2], (waves, hid)) / np.sqrt(waves)

  @jax.jit
  def x_rows(p, key, boost):
    basis = jnp.sin(p @ freq * np.pi + phase)                               # (rows, waves)
    x = basis @ mix + 0.5 * jax.random.normal(key, (p.shape[0], hid))
    return (x * boost[:, None]).astype(jnp.bfloat16)

  x = np.empty((t, hid), jnp.bfloat16)
  for i, r0 in enumerate(range(0, t, chunk)):
    r1 = min(r0 + chunk, t)
    boost = np.where(np.arange(r0, r1) < shape.prefix_tokens, 1.5, 1.0).astype(np.float32)
    x[r0:r1] = np.asarray(x_rows(jnp.asarray(pos[r0:r1] / span, jnp.float32),
                                 jax.random.fold_in(keys[3], i), jnp.asarray(boost)))
  w = (jax.random.normal(keys[4], (hid, 3 * shape.heads * shape.head_dim)) / np.sqrt(hid)).astype(jnp.bfloat16)
  nw = 1.0 + 0.2 * jax.random.normal(keys[5], (2, shape.head_dim))
  return dict(x=jax.device_put(x[None]), w=w, q_norm_weight=nw[0].astype(jnp.float32),
              k_norm_weight=nw[1].astype(jnp.float32), rope_cos=jnp.asarray(cos), rope_sin=jnp.asarray(sin))


def _rms_norm(x, w, eps=1e-5):
  x = x.astype(jnp.float32)
  return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * w


def project_reference(inp, shape: LayerShape, dtype=jnp.float32):
  """q, k, v (1, T, H, D) after norm and RoPE (unrotated), computed in ``dtype``."""
  h, d = shape.heads, shape.head_dim
  # The BF16 pipeline's GEMM writes bf16 directly, as torch's qkv_proj does: an f32
  # output would add a 12 GiB buffer at T = 152k that no real BF16 model allocates.
  qkv = jnp.dot(inp["x"].astype(dtype), inp["w"].astype(dtype), preferred_element_type=dtype)
  t = qkv.shape[1]
  q, k, v = (qkv[..., i * h * d:(i + 1) * h * d].reshape(1, t, h, d) for i in range(3))
  q = rope_lib.apply_rope_reference(_rms_norm(q, inp["q_norm_weight"]), inp["rope_cos"], inp["rope_sin"],
                                    shape.rot_dim).astype(dtype)
  k = rope_lib.apply_rope_reference(_rms_norm(k, inp["k_norm_weight"]), inp["rope_cos"], inp["rope_sin"],
                                    shape.rot_dim).astype(dtype)
  return q, k, v


def _sdpa(q, k, v):
  impl = "cudnn" if jax.default_backend() == "gpu" else None
  return jax.nn.dot_product_attention(q, k, v, implementation=impl)


def layer_fn(variant: str, shape: LayerShape, sol_kwargs: dict | None = None):
  """A jittable function inputs -> attention output (1, T, H, D) bf16 for ``variant``.
  ``sol_kwargs``: ``pallas_kernels.Sol`` settings of the ``sol`` variant."""
  if variant == "bf16":
    def run(inp):
      q, k, v = project_reference(inp, shape, jnp.bfloat16)
      return _sdpa(q, k, v)
    return run

  if variant == "bf16_quant":
    def run(inp):
      from pallas_kernels.attention import packed_attention
      q, k, v = project_reference(inp, shape, jnp.bfloat16)
      rk = jnp.asarray(fmt.hadamard_rotation(shape.head_dim, 0))
      rv = jnp.asarray(fmt.hadamard_rotation(shape.head_dim, 1))
      meta = shape.storage.meta(1, shape.heads, shape.head_dim, shape.tokens)
      packed = fmt.quantize_reference(k @ rk, v @ rv, meta)
      return packed_attention((q @ rk).astype(jnp.bfloat16), packed)
    return run
  if variant in ("dense", "sol"):
    def run(inp):
      # Projection and attention in one call: the output takes Q's buffer.
      from pallas_kernels import Dense, Sol
      from pallas_kernels.layer import attention_layer
      weights = QKVWeights(inp["w"], q_norm_weight=inp["q_norm_weight"], k_norm_weight=inp["k_norm_weight"])
      return attention_layer(inp["x"], weights, layout=shape.layout, rope_cos=inp["rope_cos"],
                             rope_sin=inp["rope_sin"], storage=shape.storage,
                             attention=Sol(**(sol_kwargs or {})) if variant == "sol" else Dense())
    return run
  raise ValueError(f"unknown variant {variant!r}; use one of {VARIANTS}")


def reference_rows(inp, shape: LayerShape, rows: np.ndarray):
  """float32 attention output for the query rows ``rows`` against all keys, (1, R, H, D).

  One head at a time, so the (R, T) score matrix stays small at T = 152k.
  """
  q, k, v = project_reference(inp, shape, jnp.float32)
  q = q[0, rows]                                                      # (R, H, D)

  def one_head(args):
    qh, kh, vh = args
    s = qh @ kh.T / np.sqrt(shape.head_dim)
    return jax.nn.softmax(s, -1) @ vh
  out = jax.lax.map(one_head, (q.transpose(1, 0, 2), k[0].transpose(1, 0, 2), v[0].transpose(1, 0, 2)))
  return out.transpose(1, 0, 2)[None]


@functools.lru_cache(maxsize=None)
def quality_rows(tokens: int, count: int = 512, seed: int = 0) -> np.ndarray:
  """A fixed spread of query rows: some of the prefix, the rest across the video."""
  rng = np.random.default_rng(seed)
  return np.sort(rng.choice(tokens, size=min(count, tokens), replace=False)).astype(np.int32)
