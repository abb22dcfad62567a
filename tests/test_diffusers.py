"""Drop-in packed attention for diffusers video transformers (``torch_bridge.diffusers``):
tiny models built from diffusers' own classes, one per family served, on the CPU
(interpret mode).

Parity is judged per attention module (``benchmarks.tiny_dits.module_parity``): each
module we install on runs on the inputs it saw in the stock run and is compared with
stock attention replayed in float32 on those inputs. The whole model's output alone
cannot see attention: zeroing every self-attention of the tiny Wan leaves it at cos
0.99946 and ignoring Wan's RoPE at 0.99997; the negative controls below show that the
per-module check rejects both.
"""
import logging

import pytest
import torch

import torch_bridge as tb  # first: the allocator policy
from formats import KVStorage
from pallas_kernels import Sol
from pallas_kernels.testing import quality

diffusers = pytest.importorskip("diffusers", reason="diffusers is a test dependency (scripts/setup.sh installs it)")
from benchmarks.tiny_dits import (FAMILIES, TARGET_MODULE_COS, install_zero_attention, module_failures,  # noqa: E402
                                  module_parity, tiny_transformer)
from torch_bridge.diffusers import (InstallReport, PackedWanAttnProcessor, attention_report,  # noqa: E402
                                    restore_stock_attention, use_packed_attention)

# Per-module cos against float32 stock attention. int4: the target. int8: ten
# times tighter than the 0.999, so that a convention slip fails it (a wrong RoPE
# style, sign or rot_dim, missing LTX-2 gates: 0.90-0.96). Measured (CPU, 2 heads x 64,
# 128 video and 128 text tokens, min over each family's modules): int8 0.999991-0.999995,
# int4 0.99871 (Wan VACE's control block) to 0.99961 (LTX-Video); stock bf16 itself
# 0.999993-0.999996.
MIN_MODULE_COS = {"int8": 0.9999, "int4": TARGET_MODULE_COS["int4"]}
# The whole model's output against the stock bf16 model: measured 0.99998-0.999999 (int8),
# 0.99997-0.999996 (int4).
MIN_MODEL_COS = {"int8": 0.99995, "int4": 0.9999}

_WAN = (["blocks.0.attn1", "blocks.1.attn1"], ("blocks.0.attn2", "cross-attention"))
SERVED = {  # family -> (modules installed, a refused module and the start of its reason)
    "wan": _WAN, "chronoedit": _WAN, "skyreels_v2": _WAN, "helios": _WAN,
    "wan_vace": (["blocks.0.attn1", "blocks.1.attn1", "vace_blocks.0.attn1"], ("vace_blocks.0.attn2", "cross-att")),
    "ltx": (["transformer_blocks.0.attn1", "transformer_blocks.1.attn1"],
            ("transformer_blocks.0.attn2", "not the self-attention")),
    "ltx2": (["transformer_blocks.0.attn1", "transformer_blocks.0.audio_attn1", "transformer_blocks.1.attn1",
              "transformer_blocks.1.audio_attn1"], ("transformer_blocks.0.audio_to_video_attn", "not the self-att")),
    "cosmos": (["transformer_blocks.0.attn1", "transformer_blocks.1.attn1"],
               ("transformer_blocks.1.attn2", "cross-attention")),
    "minimax_h3": (["token_refiner.refiner_blocks.0.attn", "transformer_blocks.0.attn", "transformer_blocks.1.attn"],
                   None),
    "kandinsky5": (["text_transformer_blocks.0.self_attention", "visual_transformer_blocks.0.self_attention",
                    "visual_transformer_blocks.1.self_attention"],
                   ("visual_transformer_blocks.0.cross_attention", "not the self-attention")),
    # Joint text+video attention: dual-stream (add_q_proj) and single-stream blocks.
    "hunyuan_video": (["transformer_blocks.0.attn", "transformer_blocks.1.attn", "single_transformer_blocks.0.attn",
                       "single_transformer_blocks.1.attn"],
                      ("context_embedder.token_refiner.refiner_blocks.0.attn", "generic AttnProcessor2_0")),
    # Joint through one projection, text first, LayerNorm QK norm per head.
    "cogvideox": (["transformer_blocks.0.attn1", "transformer_blocks.1.attn1"], None),
}
# Every family as built by tiny_transformer, and the variants that take another code path.
VARIANTS = [pytest.param(name, {}, id=name) for name in FAMILIES] + [
    pytest.param("ltx2", {"rope_type": "split"}, id="ltx2-split-rope")]


def test_every_family_has_a_parity_test():
  assert sorted(SERVED) == sorted(FAMILIES)


@pytest.mark.parametrize("name, config", VARIANTS)
def test_each_attention_module_matches_float32_stock(name, config):
  r = module_parity(name, ("int8", "int4"), **config)
  installed, refused = SERVED[name]
  assert r["report"].installed == installed, r["report"]
  if refused is not None:
    assert r["report"][refused[0]].startswith(refused[1]), r["report"]
  # The reference is right: the stock bf16 module sits within bf16 noise of it.
  assert not module_failures(r["stock_bf16"], 0.9999), r["stock_bf16"]
  for cls in ("int8", "int4"):
    assert sorted(r["modules"][cls]) == sorted(installed)
    assert not module_failures(r["modules"][cls], MIN_MODULE_COS[cls]), (cls, r["modules"][cls])
    assert r["model"][cls]["cos"] > MIN_MODEL_COS[cls], (cls, r["model"])


def test_module_check_rejects_zeroed_attention():
  """Negative control: stock attention with its output zeroed. The whole model barely
  moves; every module fails the per-module check."""
  r = module_parity("wan", ("int8",), install=install_zero_attention)
  assert r["model"]["int8"]["cos"] > 0.999, r["model"]          # what the whole model sees
  failed = module_failures(r["modules"]["int8"], TARGET_MODULE_COS["int8"])
  assert sorted(failed) == sorted(r["report"].installed), failed
  assert module_failures({}, 0.0), "a result with no module must fail"


def test_module_check_rejects_ignored_rope(monkeypatch):
  """Negative control: our processor with the model's RoPE dropped (identity tables).
  Measured: modules 0.97-0.98, the whole model 0.99997."""
  monkeypatch.setattr(PackedWanAttnProcessor, "tables", lambda self, rope, t: self._identity_tables(t, "cpu"))
  r = module_parity("wan", ("int8",))
  assert r["model"]["int8"]["cos"] > 0.9999, r["model"]
  failed = module_failures(r["modules"]["int8"], TARGET_MODULE_COS["int8"])
  assert sorted(failed) == sorted(r["report"].installed), r["modules"]


def test_joint_attention_honours_the_text_padding(monkeypatch):
  """Negative control for joint attention: HunyuanVideo's text key padding dropped (every
  text token attended). Measured: modules 0.995-0.997 against stock's masked attention."""
  import torch_bridge.diffusers as td
  monkeypatch.setattr(td, "_trailing_key_lengths", lambda mask, n: None)
  r = module_parity("hunyuan_video", ("int8",), layers=1)
  failed = module_failures(r["modules"]["int8"], MIN_MODULE_COS["int8"])
  assert sorted(failed) == sorted(r["report"].installed), r["modules"]


def test_joint_attention_rotates_the_video_tokens_only(monkeypatch):
  """Negative control for CogVideoX: its RoPE dropped (identity tables for every token)
  fails every module; the text rows it skips are what the tables' identity rows say."""
  from torch_bridge.diffusers import PackedCogVideoXAttnProcessor
  monkeypatch.setattr(PackedCogVideoXAttnProcessor, "joint_tables",
                      lambda self, rope, tv, tt, device, text_first: self._identity_tables(tv + tt, device))
  r = module_parity("cogvideox", ("int8",), layers=1)
  failed = module_failures(r["modules"]["int8"], MIN_MODULE_COS["int8"])
  assert sorted(failed) == sorted(r["report"].installed), r["modules"]


def test_joint_module_called_without_text_returns_as_stock():
  """HunyuanVideo's processor without encoder_hidden_states returns (attention, None)
  with no output projection, as stock does; int8 K/V within 1e-4 of it."""
  import benchmarks.bench_dit as bench_dit
  from diffusers.models.transformers.transformer_hunyuan_video import HunyuanVideoRotaryPosEmbed
  attn, _ = bench_dit._hunyuan_block(bench_dit.SMOKE, 256, 32, (1, 8, 32), torch.device("cpu"))
  x = torch.randn(1, 256, 128, dtype=torch.bfloat16)
  rope = HunyuanVideoRotaryPosEmbed(2, 1, [16, 24, 24])(torch.empty(1, 1, 1, 16, 64))
  with torch.no_grad():
    want = attn(x, image_rotary_emb=rope)
    use_packed_attention(attn, storage=KVStorage(default="int8"))
    got = attn(x, image_rotary_emb=rope)
  assert want[1] is None and got[1] is None and got[0].shape == want[0].shape == (1, 256, 128)
  assert quality(got[0].float().numpy(), want[0].float().numpy())["cos"] > 0.9999


def test_joint_attention_key_padding_rules():
  from torch_bridge.diffusers import _trailing_key_lengths
  n = 10
  keep = torch.arange(n)[None] < torch.tensor([[7], [10]])
  assert torch.equal(_trailing_key_lengths(keep[:, None, None], n), torch.tensor([7, 10], dtype=torch.int32))
  assert _trailing_key_lengths(torch.ones(2, 1, 1, n, dtype=torch.bool), n) is None   # nothing masked
  holes = keep.clone()
  holes[0, 2] = False
  with pytest.raises(NotImplementedError, match="not trailing padding.*restore_stock_attention"):
    _trailing_key_lengths(holes, n)
  with pytest.raises(NotImplementedError, match="not a boolean key-padding mask"):
    _trailing_key_lengths(torch.zeros(2, 1, 1, n), n)
  with pytest.raises(NotImplementedError, match="not a boolean key-padding mask"):
    _trailing_key_lengths(keep[:, None, None].expand(2, 1, n, n), n)
  # Sol takes no key mask: the joint module with padded text names Dense.
  model, inputs = tiny_transformer("hunyuan_video", layers=1)
  use_packed_attention(model, attention=Sol())
  with pytest.raises(Exception, match=r"use attention=Dense"):
    with torch.no_grad():
      model(**inputs)
  inputs["encoder_attention_mask"] = torch.ones_like(inputs["encoder_attention_mask"])   # no padding: Sol runs
  with torch.no_grad():
    out = model(**inputs, return_dict=False)[0]
  assert torch.isfinite(out.float()).all()


def test_install_report_is_returned_and_logged(caplog):
  model, _ = tiny_transformer("wan", layers=1)
  with caplog.at_level(logging.INFO, logger="torch_bridge.diffusers"):
    report = use_packed_attention(model)
  assert isinstance(report, InstallReport) and isinstance(report, dict)
  assert report == {"blocks.0.attn1": "installed",
                    "blocks.0.attn2": "cross-attention (keys from encoder_hidden_states): stays stock"}
  assert report.installed == ["blocks.0.attn1"] and list(report.refused) == ["blocks.0.attn2"]
  assert report.kinds == {"blocks.0.attn1": "WanAttention", "blocks.0.attn2": "WanAttention"}
  assert "packed attention on 1 of 2 attention modules" in str(report)
  logged = [r.getMessage() for r in caplog.records if r.name == "torch_bridge.diffusers"]
  assert any("blocks.0.attn1 (WanAttention): installed PackedWanAttnProcessor" in m for m in logged), logged
  assert any("blocks.0.attn2 (WanAttention): cross-attention" in m for m in logged), logged
  assert attention_report(model) == report               # the dry run says the same
  assert restore_stock_attention(model) == ["blocks.0.attn1"]
  assert type(model.blocks[0].attn1.processor).__name__ == "WanAttnProcessor"


def _refused_models():
  """Tiny models of families packed attention does not serve (built, never run)."""
  torch.manual_seed(0)
  return {
      "Mochi": diffusers.MochiTransformer3DModel(
          num_attention_heads=2, attention_head_dim=64, num_layers=2, pooled_projection_dim=16, in_channels=4,
          text_embed_dim=16, time_embed_dim=32),
      "Allegro": diffusers.AllegroTransformer3DModel(
          num_attention_heads=2, attention_head_dim=64, in_channels=4, out_channels=4, num_layers=1,
          cross_attention_dim=128, caption_channels=16),
  }


def test_refused_families_say_why():
  reasons = {family: attention_report(m) for family, m in _refused_models().items()}
  assert set(reasons["Mochi"].values()) == {
      "joint text+video attention (add_q_proj) under MochiAttnProcessor2_0: not supported yet"}
  assert reasons["Allegro"]["transformer_blocks.0.attn1"].startswith("RoPE rotate-half within each t/h/w third")
  assert reasons["Allegro"]["transformer_blocks.0.attn2"].startswith("cross-attention")
  for family, model in _refused_models().items():
    with pytest.raises(ValueError, match="has no attention module packed attention can serve") as e:
      use_packed_attention(model)
    assert all(r in str(e.value) for r in set(reasons[family].values())), (family, str(e.value))


def test_module_attributes_decide():
  """One processor class (Cosmos's), different modules: what each can serve is read
  from the module, and every refusal says which attribute."""
  from diffusers.models.attention_processor import Attention
  from diffusers.models.transformers.transformer_cosmos import CosmosAttnProcessor2_0

  def report(**kw):
    args = dict(query_dim=128, heads=2, dim_head=64, qk_norm="rms_norm", processor=CosmosAttnProcessor2_0()) | kw
    return attention_report(Attention(**args))[""]

  assert report() == "installed"
  assert report(qk_norm=None) == "installed"
  assert report(qk_norm="rms_norm_across_heads", kv_heads=2) == "installed"
  assert report(dim_head=96, query_dim=192) == "head_dim 96 not supported (64 or 128)"
  assert report(qk_norm="layer_norm") == "installed"   # LayerNorm per head (CogVideoX's)
  assert report(qk_norm="layer_norm_across_heads", kv_heads=2) == (
      "LayerNorm over [128]: only per head (head_dim 64) is supported")
  assert report(qk_norm="l2") == "L2 QK norm (LpNorm): not supported (RMSNorm, LayerNorm or none)"
  assert report(kv_heads=1, qk_norm=None).startswith("grouped-query attention (K/V width 64/64 for Q width 128)")
  assert report(cross_attention_dim=16).startswith("cross-attention")
  assert report(added_kv_proj_dim=16).startswith("joint text+video attention (add_k_proj)")
  assert report(processor=None).startswith("generic AttnProcessor2_0")


def test_fused_projections_are_unfused():
  model, inputs = tiny_transformer("wan", layers=1)
  with torch.no_grad():
    use_packed_attention(model)
    want = model(**inputs, return_dict=False)[0]
    restore_stock_attention(model)
    model.fuse_qkv_projections()
    assert model.blocks[0].attn1.fused_projections
    use_packed_attention(model)
    assert not model.blocks[0].attn1.fused_projections and not hasattr(model.blocks[0].attn1, "to_qkv")
    assert torch.equal(model(**inputs, return_dict=False)[0], want)


def test_weights_are_shared_not_copied_and_stock_still_works():
  """The fused (hidden, 3HD) weight is the storage of to_q/to_k/to_v: installing adds
  no copy of the projection, and the stock processor gives the same output after."""
  model, inputs = tiny_transformer("wan")
  attn = model.blocks[0].attn1
  with torch.no_grad():
    want = model(**inputs, return_dict=False)[0]
    before = sum(p.numel() for p in model.parameters())
    use_packed_attention(model)
    proc = attn.processor
    assert isinstance(proc, PackedWanAttnProcessor)
    assert sum(p.numel() for p in model.parameters()) == before
    assert attn.to_q.weight.data_ptr() == proc.w_qkv.data_ptr()
    assert attn.to_k.weight.data_ptr() == proc.w_qkv.data_ptr() + attn.to_q.out_features * 2
    assert restore_stock_attention(model) == ["blocks.0.attn1", "blocks.1.attn1"]
    assert torch.equal(model(**inputs, return_dict=False)[0], want)


def test_errors_name_the_fix():
  model, inputs = tiny_transformer("wan", layers=1)
  model = model.float()
  with pytest.raises(tb.BridgeError, match=r"cast the transformer with \.to\(torch\.bfloat16\)"):
    use_packed_attention(model)
    with torch.no_grad():
      model(**{k: (v.float() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in inputs.items()})
  model = model.to(torch.bfloat16)
  use_packed_attention(model)
  model = model.to(torch.float32).to(torch.bfloat16)  # moved after install: the fused weights are stale
  with pytest.raises(tb.BridgeError, match="call use_packed_attention again"):
    with torch.no_grad():
      model(**inputs)
  with pytest.raises(ValueError, match="Linear has no diffusers attention module.*serves the self- and joint "
                                       "text\\+video attention of: CogVideoX, Cosmos, .*HunyuanVideo, .*Wan 2.x"):
    use_packed_attention(torch.nn.Linear(4, 4))
  # Settings are values, checked before anything is installed: a name is not a config.
  with pytest.raises(ValueError, match=r"attention must be Dense\(\.\.\.\) or Sol\(\.\.\.\)"):
    use_packed_attention(model, attention="flash")
  with pytest.raises(ValueError, match=r"storage must be a formats.KVStorage"):
    use_packed_attention(model, storage="int8")
  with pytest.raises(ValueError, match=r"use_packed_attention expects a diffusers transformer"):
    use_packed_attention(object())


def test_calls_a_served_module_cannot_take_name_the_fix():
  """What only the call shows: a mask (SkyReels-V2's diffusion forcing passes a
  block-causal one), or text handed to a module served as self-attention."""
  model, inputs = tiny_transformer("skyreels_v2", layers=1, num_frame_per_block=2)
  use_packed_attention(model)
  with pytest.raises(NotImplementedError, match="attention_mask .*num_frame_per_block > 1.*restore_stock_attention"):
    with torch.no_grad():
      model(**inputs)
  model, _ = tiny_transformer("kandinsky5", layers=1)
  use_packed_attention(model)
  x = torch.randn(1, 8, 128, dtype=torch.bfloat16)
  with pytest.raises(NotImplementedError, match="called with encoder_hidden_states.*restore_stock_attention"):
    model.visual_transformer_blocks[0].self_attention(x, encoder_hidden_states=x)


@pytest.mark.parametrize("block", ["wan", "hunyuan"])
def test_block_benchmark_smoke(tmp_path, block):
  """benchmarks/bench_dit.py's rows run (a tiny WanAttention or HunyuanVideo joint
  block, stock and packed, CPU)."""
  import json
  import os
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = tmp_path / "dit.json"
  proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_dit", "--cpu-smoke", "--block", block, "--out",
                         str(out)], cwd=root, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-2000:]
  rows = json.loads(out.read_text())["rows"]
  assert [(r["variant"], r["ok"]) for r in rows] == [("stock", True), ("packed", True)], rows


@pytest.mark.gpu
def test_gpu_wan14b_width_block_matches_stock():
  """One self-attention block at Wan 14B's width (hidden 5120, 40 x 128) on CUDA,
  T = 8,192: ours (int8 and int4 K/V) against diffusers' own processor."""
  from diffusers.models.transformers.transformer_wan import WanAttention, WanAttnProcessor, WanRotaryPosEmbed
  torch.manual_seed(0)
  attn = WanAttention(5120, heads=40, dim_head=128, eps=1e-6, processor=WanAttnProcessor())
  attn = attn.to("cuda", torch.bfloat16).eval()
  rope = WanRotaryPosEmbed(128, (1, 2, 2), max_seq_len=1024)
  cos, sin = rope(torch.empty(1, 1, 4, 2 * 32, 2 * 64, device="meta"))   # 4 x 32 x 64 = 8,192 tokens
  rotary = (cos.cuda(), sin.cuda())
  x = torch.randn(1, 8192, 5120, dtype=torch.bfloat16, device="cuda")
  with torch.no_grad():
    want = attn(x, None, None, rotary).float().cpu().numpy()
    for cls, min_cos in (("int8", 0.9999), ("int4", 0.999)):
      assert use_packed_attention(attn, storage=KVStorage(default=cls)).installed == [""]
      got = attn(x, None, None, rotary).float().cpu().numpy()
      assert quality(got, want)["cos"] > min_cos, (cls, quality(got, want))


@pytest.mark.gpu
def test_gpu_hunyuan_joint_block_matches_stock():
  """A HunyuanVideo dual-stream block at its real width (hidden 3072, 24 x 128) on CUDA:
  4,096 video tokens and 256 text tokens, the last 64 masked as padding, ours (int8 and
  int4 K/V, text at int8) against diffusers' own processor, video and text outputs."""
  import benchmarks.bench_dit as bench_dit
  attn, call = bench_dit._hunyuan_block(bench_dit.HUNYUAN, 4096, 256, (8, 16, 32), torch.device("cuda"))
  with torch.no_grad():
    want = [o.float().cpu().numpy() for o in call()]
    for cls, min_cos in (("int8", 0.9999), ("int4", 0.998)):
      assert use_packed_attention(attn, storage=KVStorage(default=cls)).installed == [""]
      got = [o.float().cpu().numpy() for o in call()]
      for part, g, w in zip(("video", "text"), got, want):
        assert quality(g, w)["cos"] > min_cos, (cls, part, quality(g, w))
