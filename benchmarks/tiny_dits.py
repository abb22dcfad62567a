"""Tiny random diffusers video transformers (Wan 2.x, LTX-Video) and our processors'
parity against the stock ones on them: what the tests and ``bench_dit`` check an install
with. Real models come from ``from_pretrained``."""
from __future__ import annotations

import torch

from formats import KVStorage
from torch_bridge.diffusers import use_packed_attention


def tiny_transformer(name: str, *, layers: int = 2, seed: int = 0):
  """(model, forward kwargs): a tiny random bf16 model of a supported class ("wan" or
  "ltx"; 2 heads of 64, 128 video tokens) with example inputs, on the CPU. For tests,
  demos and checking an install; real models come from ``from_pretrained``."""
  import diffusers
  torch.manual_seed(seed)
  if name == "wan":
    model = diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=64, in_channels=4, out_channels=4,
        text_dim=16, freq_dim=256, ffn_dim=64, num_layers=layers, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=32)
    inputs = dict(hidden_states=torch.randn(1, 4, 2, 16, 16), timestep=torch.tensor([500]),
                  encoder_hidden_states=torch.randn(1, 12, 16))
  elif name == "ltx":
    model = diffusers.LTXVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=64, cross_attention_dim=128,
        num_layers=layers, qk_norm="rms_norm_across_heads", caption_channels=16)
    inputs = dict(hidden_states=torch.randn(1, 2 * 8 * 8, 4), encoder_hidden_states=torch.randn(1, 12, 16),
                  timestep=torch.tensor([500]), encoder_attention_mask=torch.ones(1, 12, dtype=torch.bool),
                  num_frames=2, height=8, width=8, rope_interpolation_scale=(8 / 25, 32, 32))
  else:
    raise ValueError(f"name must be 'wan' or 'ltx', got {name!r}")
  inputs = {k: (v.to(torch.bfloat16) if torch.is_tensor(v) and v.is_floating_point() else v)
            for k, v in inputs.items()}
  return model.to(torch.bfloat16).eval(), inputs


def parity(name: str, classes=("bf16", "int8", "int4")) -> dict:
  """Our processors against the stock ones on ``tiny_transformer(name)``: quality of
  the whole model's output and of the first self-attention's, per K/V class."""
  from pallas_kernels.testing import quality
  model, inputs = tiny_transformer(name)
  first = next(m for n, m in model.named_modules() if n.endswith("attn1"))
  seen = []
  first.register_forward_hook(lambda mod, args, out: seen.append(out.float().numpy()))
  out = {}
  with torch.no_grad():
    want = model(**inputs, return_dict=False)[0].float().numpy()
    want_attn = seen.pop()
    for cls in classes:
      use_packed_attention(model, storage=KVStorage(default=cls))
      got = model(**inputs, return_dict=False)[0].float().numpy()
      out[cls] = {"model": quality(got, want), "attention": quality(seen.pop(), want_attn)}
  return out
