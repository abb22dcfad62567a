"""Drop-in packed attention for diffusers video transformers (``torch_bridge.diffusers``):
whole tiny models built from diffusers' own classes, our processor against the stock
one, on the CPU (interpret mode). bf16 and int8 K/V must agree within bf16 noise, int4
within the cosine stated below."""
import numpy as np
import pytest
import torch

import torch_bridge as tb  # first: the allocator policy
from formats import KVStorage
from pallas_kernels.testing import quality

diffusers = pytest.importorskip("diffusers", reason="diffusers is a test dependency (scripts/setup.sh installs it)")
from benchmarks.tiny_dits import parity, tiny_transformer  # noqa: E402
from torch_bridge.diffusers import PackedWanAttnProcessor, use_packed_attention  # noqa: E402

# cos against the stock processor per K/V class (T = 128 video tokens): of the whole
# model's output, and of the first self-attention's own output, where nothing dilutes
# the attention's error. Measured (Dec 7, CPU), bf16 / int8 / int4: whole model 0.999997 /
# 0.999997 / 0.999993 (Wan), 0.999996 / 0.999996 / 0.999992 (LTX-Video); first attention
# 0.999993 / 0.999991 / 0.999406 (Wan), 0.999995 / 0.999993 / 0.999659 (LTX-Video).
MIN_COS = {"bf16": 0.99999, "int8": 0.99999, "int4": 0.9999}
MIN_COS_ATTENTION = {"bf16": 0.9999, "int8": 0.9999, "int4": 0.999}


@pytest.mark.parametrize("name", ["wan", "ltx"])
def test_whole_model_matches_stock_processor(name):
  results = parity(name)
  for cls, q in results.items():
    assert np.isfinite(q["model"]["cos"]), (cls, q)
    assert q["model"]["cos"] > MIN_COS[cls], (cls, results)
    assert q["attention"]["cos"] > MIN_COS_ATTENTION[cls], (cls, results)
  # bf16 K/V: only bf16 rounding (of Q, K and V in the rotated basis) separates the two.
  assert results["bf16"]["model"]["rel_l2"] < 0.02, results
  model, _ = tiny_transformer(name)
  names = use_packed_attention(model)
  assert len(names) == 2 and all(n.endswith("attn1") for n in names), names


def test_weights_are_shared_not_copied_and_stock_still_works():
  """The fused (hidden, 3HD) weight is the storage of to_q/to_k/to_v: installing adds
  no copy of the projection, and the stock processor gives the same output after."""
  model, inputs = tiny_transformer("wan")
  attn = model.blocks[0].attn1
  stock = attn.processor
  with torch.no_grad():
    want = model(**inputs, return_dict=False)[0]
    before = sum(p.numel() for p in model.parameters())
    use_packed_attention(model)
    proc = attn.processor
    assert isinstance(proc, PackedWanAttnProcessor)
    assert sum(p.numel() for p in model.parameters()) == before
    assert attn.to_q.weight.data_ptr() == proc.w_qkv.data_ptr()
    assert attn.to_k.weight.data_ptr() == proc.w_qkv.data_ptr() + attn.to_q.out_features * 2
    for blk in model.blocks:
      blk.attn1.set_processor(type(stock)())
    assert torch.equal(model(**inputs, return_dict=False)[0], want)


def test_errors_name_the_fix():
  model, inputs = tiny_transformer("wan")
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
  with pytest.raises(ValueError, match="supports WanTransformer3DModel and LTXVideoTransformer3DModel"):
    use_packed_attention(torch.nn.Linear(4, 4))
  # Settings are values, checked before anything is installed: a name is not a config.
  with pytest.raises(ValueError, match=r"attention must be Dense\(\.\.\.\) or Sol\(\.\.\.\)"):
    use_packed_attention(model, attention="flash")
  with pytest.raises(ValueError, match=r"storage must be a formats.KVStorage"):
    use_packed_attention(model, storage="int8")
  with pytest.raises(ValueError, match=r"use_packed_attention expects a diffusers transformer"):
    use_packed_attention(object())


def test_wan_block_benchmark_smoke(tmp_path):
  """benchmarks/bench_dit.py's rows run (tiny WanAttention, stock and packed, CPU)."""
  import json
  import os
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = tmp_path / "dit.json"
  proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_dit", "--cpu-smoke", "--out", str(out)], cwd=root,
                        capture_output=True, text=True, timeout=600)
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
      use_packed_attention(attn, storage=KVStorage(default=cls))
      got = attn(x, None, None, rotary).float().cpu().numpy()
      assert quality(got, want)["cos"] > min_cos, (cls, quality(got, want))
