"""Tiny random diffusers video transformers, one per family ``torch_bridge.diffusers``
serves, and our processors' parity against the stock ones on them: what the tests and
``bench_dit --parity`` check an install with. Real models come from ``from_pretrained``.

Parity is judged per attention module (``module_parity``): every module we install on
is hooked in a stock run of the model, its inputs are kept, and stock attention is
replayed on them in float32 (a float32 copy of the module with its stock processor) as
the reference. Our processor then runs on the same inputs, so each module's error is
its own: errors do not compound across layers, and a module whose attention is wrong
cannot hide behind the residual stream (zeroing every self-attention of the tiny Wan
left the whole model's output at cos 0.99946). The compared quantity is the module's
output minus its output projection's bias (a constant both sides share, which would
otherwise dilute the attention's error). The whole model's output against the stock
bf16 model is reported too.
"""
from __future__ import annotations

import copy

import numpy as np
import torch

from formats import KVStorage
from torch_bridge.diffusers import attention_report, restore_stock_attention, use_packed_attention

FAMILIES = ("wan", "wan_vace", "chronoedit", "skyreels_v2", "helios", "ltx", "ltx2", "cosmos", "minimax_h3",
            "kandinsky5", "hunyuan_video", "cogvideox")
"""Every family served, by the name ``tiny_transformer`` takes."""

TARGET_MODULE_COS = {"bf16": 0.999, "int8": 0.999, "int4": 0.998}
"""Per-module cos against float32 stock attention that every served module must reach,
per K/V class (issue 47's targets)."""


def _bf16(inputs: dict) -> dict:
  return {k: (v.to(torch.bfloat16) if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in inputs.items()}


def tiny_transformer(name: str, *, layers: int = 2, seed: int | None = None, text_tokens: int = 128, **config):
  """(model, forward kwargs): a tiny random bf16 model of a served family (``FAMILIES``;
  2 heads of 64, 128 video tokens) with example inputs, on the CPU. ``config``
  overrides the model's constructor arguments. For tests, demos and checking an
  install; real models come from ``from_pretrained``."""
  import diffusers
  torch.manual_seed(FAMILIES.index(name) if seed is None and name in FAMILIES else (seed or 0))
  if name in ("wan", "wan_vace", "chronoedit", "skyreels_v2"):
    cls = {"wan": diffusers.WanTransformer3DModel, "wan_vace": diffusers.WanVACETransformer3DModel,
           "chronoedit": diffusers.ChronoEditTransformer3DModel,
           "skyreels_v2": diffusers.SkyReelsV2Transformer3DModel}[name]
    extra = dict(vace_layers=[0], vace_in_channels=4) if name == "wan_vace" else {}
    model = cls(**dict(dict(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=64, in_channels=4, out_channels=4,
        text_dim=16, freq_dim=256, ffn_dim=64, num_layers=layers, cross_attn_norm=True,
        qk_norm="rms_norm_across_heads", rope_max_seq_len=32, **extra), **config))
    inputs = dict(hidden_states=torch.randn(1, 4, 2, 16, 16), timestep=torch.tensor([500]),
                  encoder_hidden_states=torch.randn(1, 12, 16))
    if name == "wan_vace":
      inputs["control_hidden_states"] = torch.randn(1, 4, 2, 16, 16)
  elif name == "helios":
    model = diffusers.HeliosTransformer3DModel(**dict(dict(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=64, in_channels=4, out_channels=4,
        text_dim=16, freq_dim=256, ffn_dim=64, num_layers=layers, rope_dim=(24, 20, 20)), **config))
    inputs = dict(hidden_states=torch.randn(1, 4, 2, 16, 16), timestep=torch.tensor([500]),
                  encoder_hidden_states=torch.randn(1, 12, 16))
  elif name == "ltx":
    model = diffusers.LTXVideoTransformer3DModel(**dict(dict(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=64, cross_attention_dim=128,
        num_layers=layers, qk_norm="rms_norm_across_heads", caption_channels=16), **config))
    inputs = dict(hidden_states=torch.randn(1, 2 * 8 * 8, 4), encoder_hidden_states=torch.randn(1, 12, 16),
                  timestep=torch.tensor([500]), encoder_attention_mask=torch.ones(1, 12, dtype=torch.bool),
                  num_frames=2, height=8, width=8, rope_interpolation_scale=(8 / 25, 32, 32))
  elif name == "ltx2":
    model = diffusers.LTX2VideoTransformer3DModel(**dict(dict(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=64, cross_attention_dim=128,
        audio_in_channels=4, audio_out_channels=4, audio_num_attention_heads=2, audio_attention_head_dim=64,
        audio_cross_attention_dim=128, num_layers=layers, caption_channels=16, gated_attn=True,
        audio_gated_attn=True), **config))
    n_audio = 128
    inputs = dict(hidden_states=torch.randn(1, 2 * 8 * 8, 4), audio_hidden_states=torch.randn(1, n_audio, 4),
                  encoder_hidden_states=torch.randn(1, 12, 16), audio_encoder_hidden_states=torch.randn(1, 12, 16),
                  timestep=torch.tensor([500]), num_frames=2, height=8, width=8, audio_num_frames=n_audio)
  elif name == "cosmos":
    model = diffusers.CosmosTransformer3DModel(**dict(dict(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=64, num_layers=layers,
        mlp_ratio=1.0, text_embed_dim=16, adaln_lora_dim=32, max_size=(8, 32, 32), patch_size=(1, 2, 2),
        concat_padding_mask=False), **config))
    inputs = dict(hidden_states=torch.randn(1, 4, 2, 16, 16), timestep=torch.tensor([500.0]),
                  encoder_hidden_states=torch.randn(1, 12, 16), fps=24)
  elif name == "minimax_h3":
    model = diffusers.MiniMaxH3Transformer3DModel(**dict(dict(
        num_attention_heads=2, attention_head_dim=64, hidden_size=128, num_layers=layers, num_refiner_layers=1,
        ffn_dim=64, in_channels=4, audio_in_channels=4, patch_size=(1, 2, 2), text_dim=16, freq_dim=64,
        time_embed_hidden_dim=64, time_embed_dim=32, rope_freq_dim=8), **config))
    # One packed sequence: text, video (frames x h x w patches), audio rows.
    n_text, n_audio, (f, h, w) = text_tokens, 16, (2, 6, 8)
    n_video = f * h * w
    seq = n_text + n_video + n_audio
    grid = torch.stack(torch.meshgrid(torch.arange(f), torch.arange(h), torch.arange(w), indexing="ij"), -1)
    text_pos = torch.stack([torch.arange(n_text), torch.zeros(n_text, dtype=torch.long),
                            torch.zeros(n_text, dtype=torch.long)], 1)
    audio_pos = torch.stack([torch.arange(n_audio), torch.zeros(n_audio, dtype=torch.long),
                             torch.zeros(n_audio, dtype=torch.long)], 1)
    position_ids = torch.cat([text_pos, grid.reshape(-1, 3) + torch.tensor([n_text, 0, 0]), audio_pos], 0)
    token_tags = torch.cat([torch.ones(n_text), torch.zeros(n_video), torch.full((n_audio,), 2)]).long()
    inputs = dict(hidden_states=torch.randn(1, n_video, 4 * 4), audio_hidden_states=torch.randn(1, n_audio, 4),
                  encoder_hidden_states=torch.randn(1, n_text, 16), timestep=torch.tensor([0.5]),
                  timestep_indices=torch.zeros(seq, dtype=torch.long), token_tags=token_tags,
                  position_ids=position_ids, video_indices=torch.arange(n_text, n_text + n_video),
                  audio_indices=torch.arange(n_text + n_video, seq), text_indices=torch.arange(n_text))
  elif name == "kandinsky5":
    model = diffusers.Kandinsky5Transformer3DModel(**dict(dict(
        in_visual_dim=4, in_text_dim=16, in_text_dim2=16, time_dim=32, out_visual_dim=4, patch_size=(1, 2, 2),
        model_dim=128, ff_dim=64, num_text_blocks=1, num_visual_blocks=layers, axes_dims=(16, 24, 24)), **config))
    n_text = text_tokens
    inputs = dict(hidden_states=torch.randn(1, 2, 16, 16, 4), encoder_hidden_states=torch.randn(1, n_text, 16),
                  timestep=torch.tensor([500.0]), pooled_projections=torch.randn(1, 16),
                  visual_rope_pos=(torch.arange(2), torch.arange(8), torch.arange(8)),
                  text_rope_pos=torch.arange(n_text))
    with torch.no_grad():   # its modulations start at zero (gates 0: attention would not reach the output)
      for module in model.modules():
        if type(module).__name__ == "Kandinsky5Modulation":
          module.out_layer.weight.normal_(std=0.02)
  elif name == "hunyuan_video":
    model = diffusers.HunyuanVideoTransformer3DModel(**dict(dict(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=64, num_layers=layers,
        num_single_layers=layers, num_refiner_layers=1, mlp_ratio=1.0, patch_size=2, patch_size_t=1,
        guidance_embeds=False, text_embed_dim=16, pooled_projection_dim=16, rope_axes_dim=(16, 24, 24)), **config))
    # Text padded to text_tokens with its last 16 masked: the joint attention's key padding.
    n_text = text_tokens
    inputs = dict(hidden_states=torch.randn(1, 4, 2, 16, 16), timestep=torch.tensor([500]),
                  encoder_hidden_states=torch.randn(1, n_text, 16), pooled_projections=torch.randn(1, 16),
                  encoder_attention_mask=(torch.arange(n_text) < n_text - 16)[None].long())
  elif name == "cogvideox":
    from diffusers.models.embeddings import get_3d_rotary_pos_embed
    model = diffusers.CogVideoXTransformer3DModel(**dict(dict(
        num_attention_heads=2, attention_head_dim=64, in_channels=4, out_channels=4, num_layers=layers,
        text_embed_dim=16, time_embed_dim=32, sample_width=16, sample_height=16, sample_frames=9,
        use_rotary_positional_embeddings=True), **config))
    with torch.no_grad():   # LayerNorm QK norms start at weight 1, bias 0: give them values to get right
      for module in model.modules():
        if isinstance(module, torch.nn.LayerNorm) and module.normalized_shape == (64,):
          module.weight.normal_(1.0, 0.3)
          module.bias.normal_(0.0, 0.3)
    frames, h, w = 3, 8, 8   # latent frames, 2x2 patches of a 16 x 16 latent
    cos, sin = get_3d_rotary_pos_embed(64, ((0, 0), (h, w)), (h, w), frames, device="cpu")
    inputs = dict(hidden_states=torch.randn(1, frames, 4, 16, 16),
                  encoder_hidden_states=torch.randn(1, text_tokens, 16), timestep=torch.tensor([500]), image_rotary_emb=(cos.float(), sin.float()))
  else:
    raise ValueError(f"name must be one of {FAMILIES}, got {name!r}")
  return _as_loaded_in_bf16(model).eval(), _bf16(inputs)


def _as_loaded_in_bf16(model):
  """bf16 as ``from_pretrained(..., torch_dtype=torch.bfloat16)`` loads it: the modules
  the class lists in ``_keep_in_fp32_modules`` stay float32."""
  keep = tuple(getattr(model, "_keep_in_fp32_modules", None) or ())
  with torch.no_grad():
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
      if t.is_floating_point():
        t.data = t.data.to(torch.float32 if any(m in name.split(".") for m in keep) else torch.bfloat16)
  return model


# --------------------------------------------------------------------------------------
# Per-module parity
# --------------------------------------------------------------------------------------
def _tree(x, fn):
  if torch.is_tensor(x):
    return fn(x)
  if isinstance(x, (tuple, list)):
    return type(x)(_tree(v, fn) for v in x)
  if isinstance(x, dict):
    return {k: _tree(v, fn) for k, v in x.items()}
  return x


def _f32(x):
  return _tree(x, lambda t: t.float() if t.is_floating_point() else t)


def _out_bias(module, which: int = 0) -> torch.Tensor | float:
  """The bias of the module's output projection (0 without one); ``which=1``: the added
  (text) tokens' output projection of joint attention."""
  if which == 1:
    lin = getattr(module, "to_add_out", None)
  else:
    to_out = getattr(module, "to_out", None)
    lin = to_out[0] if to_out is not None else getattr(module, "out_layer", None)
  bias = getattr(lin, "bias", None)
  return 0.0 if bias is None else bias.detach().float()


def _attention_part(module, out) -> np.ndarray:
  """The module's output less its output biases, as one array (joint attention's
  (video, text) pair joined along the tokens)."""
  if isinstance(out, tuple):
    return np.concatenate([(o.float() - _out_bias(module, i)).numpy() for i, o in enumerate(out)], axis=1)
  return (out.float() - _out_bias(module)).numpy()


class ZeroAttnProcessor:
  """A negative control: runs the stock processor and returns zeros of its output's
  shape. ``module_parity`` must reject it (``module_failures``)."""

  def __init__(self, stock):
    self.stock_processor = stock

  def __call__(self, attn, *args, **kwargs):
    return _tree(self.stock_processor(attn, *args, **kwargs), torch.zeros_like)


def install_zero_attention(model, storage=None) -> None:
  """Install ``ZeroAttnProcessor`` wherever ``use_packed_attention`` would install ours."""
  modules = dict(model.named_modules())
  for name in attention_report(model).installed:
    module = modules[name]
    stock = module.processor
    stock = getattr(stock, "stock_processor", stock)
    module.set_processor(ZeroAttnProcessor(stock))


def _restore(model) -> None:
  restore_stock_attention(model)
  for module in model.modules():
    if isinstance(getattr(module, "processor", None), ZeroAttnProcessor):
      module.set_processor(module.processor.stock_processor)


def module_parity(name: str, classes=("int8", "int4"), *, install=None, model=None, inputs=None, **tiny) -> dict:
  """Our processors against float32 stock attention, per attention module, on
  ``tiny_transformer(name, **tiny)`` (or ``model``, ``inputs``).

  Returns ``{"report": InstallReport, "stock_bf16": {module: quality}, "modules": {cls:
  {module: quality}}, "model": {cls: quality}}``: ``quality`` is
  ``pallas_kernels.testing.quality`` (cos, rel_l1, rel_l2) of the module's output minus
  its output bias, against stock attention replayed in float32 on the inputs the module
  saw in the stock run; ``stock_bf16`` is the stock bf16 module's own quality (bf16
  noise); ``model`` compares the whole model's output with the stock bf16 model's.
  ``install(model, storage)`` replaces ``use_packed_attention`` (a negative control
  installs ``install_zero_attention``).
  """
  from pallas_kernels.testing import quality
  if model is None:
    model, inputs = tiny_transformer(name, **tiny)
  _restore(model)
  install = install or (lambda m, storage: use_packed_attention(m, storage=storage))
  report = attention_report(model)
  modules = dict(model.named_modules())
  seen: dict[str, tuple] = {}

  def keep(mod_name):
    def hook(module, args, kwargs, output):
      if mod_name not in seen:   # the first call (a module may run more than once)
        clone = lambda t: t.detach().clone()
        seen[mod_name] = (_tree(args, clone), _tree(kwargs, clone), _tree(output, clone))
    return hook

  hooks = [modules[n].register_forward_hook(keep(n), with_kwargs=True) for n in report.installed]
  try:
    with torch.no_grad():
      want = model(**inputs, return_dict=False)[0].float().numpy()
  finally:
    for h in hooks:
      h.remove()
  if set(seen) != set(report.installed):
    raise RuntimeError(f"modules not called by the model: {sorted(set(report.installed) - set(seen))}")

  ref, stock_q = {}, {}
  with torch.no_grad():
    for n, (args, kwargs, out) in seen.items():
      f32 = copy.deepcopy(modules[n]).float()
      ref[n] = _attention_part(f32, f32(*_f32(args), **_f32(kwargs)))
      stock_q[n] = quality(_attention_part(modules[n], out), ref[n])

  result = {"report": report, "stock_bf16": stock_q, "modules": {}, "model": {}}
  try:
    for cls in classes:
      install(model, KVStorage(default=cls))
      with torch.no_grad():
        got = model(**inputs, return_dict=False)[0].float().numpy()
        result["model"][cls] = quality(got, want)
        result["modules"][cls] = {n: quality(_attention_part(modules[n], modules[n](*args, **kwargs)), ref[n])
                                  for n, (args, kwargs, _) in seen.items()}
  finally:
    _restore(model)
  return result


def module_failures(per_module: dict, min_cos: float) -> dict:
  """{module: cos} of the modules below ``min_cos`` (NaN, from an all-zero output,
  fails); a result with no module at all fails as ``{"<no module>": nan}``."""
  if not per_module:
    return {"<no module>": float("nan")}
  return {n: q["cos"] for n, q in per_module.items() if not q["cos"] >= min_cos}


def min_module_cos(per_module: dict) -> float:
  return float(min(q["cos"] for q in per_module.values())) if per_module else float("nan")
