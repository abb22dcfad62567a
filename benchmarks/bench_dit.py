"""One Wan 14B self-attention block (or a HunyuanVideo joint block) at real size: stock
diffusers (SDPA) against our processor (``torch_bridge.diffusers``), in the user's 12 GiB
budget.

  python -m benchmarks.bench_dit                       # T = 75,600 and 151,200, then the largest T each
  python -m benchmarks.bench_dit --block hunyuan --tokens 75600
  python -m benchmarks.bench_dit --cpu-smoke           # a tiny WanAttention in interpret mode
  python -m benchmarks.bench_dit --block hunyuan --cpu-smoke
  python -m benchmarks.bench_dit --parity              # every served family, per attention module (CPU)
  python -m benchmarks.bench_dit --parity --families wan ltx2

The block is diffusers' own ``WanAttention`` (hidden 5120, 40 heads x 128, q/k/v bias,
RMSNorm across heads, eps 1e-6) with random bf16 weights, fed by ``WanRotaryPosEmbed``
on a latent grid of 21 frames x 45 x 80 patches per 75,600 tokens (81 frames at 720p;
2x is 42 frames). Every row runs in a fresh process (``--child``): a hog allocation
leaves ``--budget-gib`` free, torch holds ``--held-gib`` (the block, x, the RoPE
tables, filler), then the block runs three times; the device-level low-water mark
(``cudaMemGetInfo``) gives the peak above what was free, the median of the last two
calls the time. ``stock`` is the module with diffusers' processor (SDPA), ``packed`` the
same module after ``use_packed_attention`` (dense, int4 K/V). Then the largest T (steps
of 4,096, on the same grid's aspect) each completes. On the GPU machine diffusers
travels as a wheel (benchmarks/README.md). Writes ``results/dit_<card>_<date>.json`` and
the scorecard ``dit.wan14b_*``.

``--block hunyuan``: diffusers' HunyuanVideo dual-stream ``Attention`` (hidden 3072, 24
heads x 128, text through ``add_q_proj``..., per-head RMSNorm, eps 1e-6) with
``HunyuanVideoAttnProcessor2_0``: T video tokens (RoPE from ``HunyuanVideoRotaryPosEmbed``
on the same grid) joined by ``--text-tokens`` text tokens (256), the last quarter masked
as padding, as the model passes it (``attention_mask`` (1, 1, 1, N) bool). Scorecard
``dit.hunyuan_*``.

``--parity`` (CPU, interpret mode) runs ``benchmarks.tiny_dits.module_parity`` on a tiny
random model of every family ``torch_bridge.diffusers`` serves: each attention module we
install on runs on the inputs it saw in a stock run, against stock attention replayed in
float32 on them; it prints, per family, module class and K/V class, the worst module's
cos (and the stock bf16 module's own, for scale) and the whole model's output cos
against the stock bf16 model. Writes ``results/dit_parity_cpu_<date>.json`` and the
scorecard ``dit.parity_models``: the families whose every module reaches the per-module
targets (``tiny_dits.TARGET_MODULE_COS``: 0.999 at int8, 0.998 at int4).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from benchmarks import common  # noqa: E402

WAN14B = dict(hidden=5120, heads=40, head_dim=128, eps=1e-6)
HUNYUAN = dict(hidden=3072, heads=24, head_dim=128, eps=1e-6, rope_axes=(16, 56, 56))
SMOKE = dict(hidden=128, heads=2, head_dim=64, eps=1e-6, rope_axes=(16, 24, 24))
SCORE_PREFIX = {"wan": "dit.wan14b", "hunyuan": "dit.hunyuan"}
TOKENS = (75_600, 151_200)
STEP = 4096
FRAME_TOKENS = 45 * 80  # one latent frame of 720p video, in 2x2 patches


def _grid(tokens: int, smoke: bool) -> tuple[int, int, int]:
  """A (frames, height, width) patch grid with exactly ``tokens`` tokens: whole 720p
  latent frames where they divide, else one row of ``tokens`` patches per frame."""
  if not smoke and tokens % FRAME_TOKENS == 0:
    return tokens // FRAME_TOKENS, 45, 80
  return 1, 1, tokens


def child(cfg: dict) -> dict:
  import torch

  import torch_bridge as tb  # noqa: F401  (allocator policy)
  from diffusers.models.transformers.transformer_wan import WanAttention, WanAttnProcessor, WanRotaryPosEmbed
  from torch_bridge.diffusers import use_packed_attention

  smoke = cfg.get("cpu_smoke", False)
  block = cfg.get("block", "wan")
  shape = SMOKE if smoke else {"wan": WAN14B, "hunyuan": HUNYUAN}[block]
  cuda = not smoke
  dev = torch.device("cuda" if cuda else "cpu")
  gib, t = common.GIB, cfg["tokens"]
  rec = dict(cfg)
  hog = []
  if cuda:
    free, _ = torch.cuda.mem_get_info()
    budget = int(cfg["budget_gib"] * gib)
    hog = [torch.empty(free - budget, dtype=torch.uint8, device=dev)] if free > budget else []
  torch.manual_seed(0)
  d = shape["head_dim"]
  frames, height, width = _grid(t, smoke)
  if block == "hunyuan":
    attn, call = _hunyuan_block(shape, t, cfg["text_tokens"], (frames, height, width), dev)
  else:
    attn = WanAttention(shape["hidden"], heads=shape["heads"], dim_head=d, eps=shape["eps"],
                        processor=WanAttnProcessor()).to(dev, torch.bfloat16)
    attn = attn.eval().requires_grad_(False)
    rope = WanRotaryPosEmbed(d, (1, 2, 2), max_seq_len=max(1024, frames, height, width))
    latent = torch.empty(1, 1, frames, 2 * height, 2 * width, device="meta")
    with torch.no_grad():
      cos, sin = rope(latent)  # (1, T, 1, D) f32, computed from the grid's shape alone
      rotary = (cos.to(dev), sin.to(dev))
      x = torch.randn(1, t, shape["hidden"], dtype=torch.bfloat16, device=dev)
    call = lambda: attn(x, None, None, rotary)
  if cfg["variant"] == "packed":
    use_packed_attention(attn, interpret=True if smoke else None)
  filler = None
  if cuda:
    held = torch.cuda.memory_allocated() - sum(h.numel() for h in hog)
    filler = torch.empty(max(int(cfg["held_gib"] * gib) - held, 0), dtype=torch.uint8, device=dev)
    torch.cuda.empty_cache()
    torch.cuda.synchronize()
  free0 = common.device_free_bytes() if cuda else None
  times, rec["ok"] = [], True
  import contextlib
  for _ in range(cfg["calls"]):
    t0 = time.perf_counter()
    try:
      with torch.no_grad(), (common.LowWater() if cuda else contextlib.nullcontext()) as lw:
        y = call()
        if cuda:
          torch.cuda.synchronize()
      times.append(time.perf_counter() - t0)
      del y
      if lw is not None:
        rec["peak_above_free_gib"] = max(rec.get("peak_above_free_gib", 0.0), (free0 - lw.low) / gib)
    except Exception as e:  # noqa: BLE001 - an OOM is the result
      msg = str(e)
      rec.update(ok=False, oom="out of memory" in msg.lower() or "RESOURCE_EXHAUSTED" in msg,
                 error=msg.splitlines()[0][:300])
      break
  rec["time_s"] = statistics.median(times[1:]) if len(times) > 1 else None
  rec["card"] = torch.cuda.get_device_name() if cuda else "cpu"
  return rec


def _hunyuan_block(shape: dict, t: int, text_tokens: int, grid: tuple, dev):
  """A HunyuanVideo dual-stream attention module and a call of it as the model makes
  one: video tokens, text tokens (the last quarter masked as padding), RoPE on the video."""
  import torch
  from diffusers.models.attention_processor import Attention
  from diffusers.models.transformers.transformer_hunyuan_video import (HunyuanVideoAttnProcessor2_0,
                                                                        HunyuanVideoRotaryPosEmbed)
  hidden = shape["hidden"]
  attn = Attention(query_dim=hidden, cross_attention_dim=None, added_kv_proj_dim=hidden, dim_head=shape["head_dim"],
                   heads=shape["heads"], out_dim=hidden, context_pre_only=False, bias=True,
                   processor=HunyuanVideoAttnProcessor2_0(), qk_norm="rms_norm", eps=shape["eps"])
  attn = attn.to(dev, torch.bfloat16).eval().requires_grad_(False)
  frames, height, width = grid
  rope = HunyuanVideoRotaryPosEmbed(2, 1, list(shape["rope_axes"]))
  with torch.no_grad():
    latent = torch.empty(1, 1, frames, 2 * height, 2 * width, device=dev, dtype=torch.bfloat16)
    rotary = rope(latent)   # (T, D) cos and sin, f32
    del latent
    x = torch.randn(1, t, hidden, dtype=torch.bfloat16, device=dev)
    text = torch.randn(1, text_tokens, hidden, dtype=torch.bfloat16, device=dev)
    keep = torch.arange(t + text_tokens, device=dev) < t + text_tokens - text_tokens // 4
    mask = keep.view(1, 1, 1, -1)
  return attn, lambda: attn(x, encoder_hidden_states=text, attention_mask=mask, image_rotary_emb=rotary)


def spawn(cfg: dict, timeout: int) -> dict:
  return common.run_child("benchmarks.bench_dit", cfg, timeout)


def _role(name: str) -> str:
  """A module's place in the model, block indices dropped: 'transformer_blocks.N.attn1'."""
  import re
  return re.sub(r"(^|\.)\d+(\.|$)", r"\1N\2", name) or "<root>"


def parity_run(out=None, families=None, classes=("bf16", "int8", "int4")) -> dict:
  """``benchmarks.tiny_dits.module_parity`` for every served family (or ``families``):
  per family, module (class and place, block index dropped) and K/V class, the worst
  module's cos against float32 stock attention; the scorecard's ``dit.parity_models``
  counts the families whose every module reaches ``TARGET_MODULE_COS`` at int8 and
  int4."""
  import torch_bridge  # noqa: F401  (allocator policy)
  from benchmarks.tiny_dits import FAMILIES, TARGET_MODULE_COS, min_module_cos, module_failures, module_parity
  models, passing = {}, []
  print(f"{'family':11s} {'module':56s} {'K/V':4s} {'n':>2s} {'min module cos':>14s} {'stock bf16':>10s} "
        f"{'model cos':>9s}")
  for name in families or FAMILIES:
    r = module_parity(name, classes)
    report = r["report"]
    groups = {}
    for mod in report.installed:
      groups.setdefault(f"{report.kinds[mod]} {_role(mod)}", []).append(mod)
    rec = {"installed": report.installed, "refused": report.refused, "kinds": report.kinds,
           "stock_bf16": r["stock_bf16"], "classes": {}}
    for cls in classes:
      mods = r["modules"][cls]
      by = {g: min_module_cos({m: mods[m] for m in v}) for g, v in groups.items()}
      rec["classes"][cls] = {"model": r["model"][cls], "modules": mods, "min_module_cos": min_module_cos(mods),
                             "min_module_cos_by_module": by}
      for g, names in groups.items():
        print(f"{name:11s} {g:56s} {cls:4s} {len(names):2d} {by[g]:14.6f} "
              f"{min_module_cos({m: r['stock_bf16'][m] for m in names}):10.6f} {r['model'][cls]['cos']:9.6f}")
    if not any(module_failures(r["modules"][c], TARGET_MODULE_COS[c]) for c in ("int8", "int4") if c in classes):
      passing.append(name)
    models[name] = rec
  out = out or common.result_path("dit_parity", "cpu")
  rec = common.run_record() | {"card": "cpu", "target_module_cos": TARGET_MODULE_COS, "models": models,
                               "passing": passing}
  common.write_json(out, rec)
  print(f"families at the per-module targets {TARGET_MODULE_COS}: {len(passing)} of {len(models)}")
  if families is None:   # the scorecard counts the full set only
    common.update_scorecard({"dit.parity_models": len(passing)}, card="cpu", source=out, command=rec["command"])
  return rec


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--block", default="wan", choices=("wan", "hunyuan"),
                  help="Wan 14B self-attention, or a HunyuanVideo-size joint text+video block")
  ap.add_argument("--text-tokens", type=int, default=256, help="--block hunyuan: text tokens (a quarter masked)")
  ap.add_argument("--tokens", type=int, nargs="+", default=list(TOKENS))
  ap.add_argument("--budget-gib", type=float, default=11.94)
  ap.add_argument("--held-gib", type=float, default=6.09)
  ap.add_argument("--calls", type=int, default=3)
  ap.add_argument("--no-search", action="store_true")
  ap.add_argument("--search-runs", type=int, default=5)
  ap.add_argument("--timeout", type=int, default=400)
  ap.add_argument("--cpu-smoke", action="store_true")
  ap.add_argument("--parity", action="store_true", help="every served family, per attention module (CPU)")
  ap.add_argument("--families", nargs="+", default=None, help="with --parity: these tiny_dits.FAMILIES only")
  ap.add_argument("--out", default=None)
  ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if common.answer_as_child(args.child, child):
    return
  if args.parity:
    return parity_run(args.out, args.families)
  if args.cpu_smoke:
    args.tokens, args.calls, args.no_search, args.text_tokens = [200], 2, True, min(args.text_tokens, 24)
  base = dict(budget_gib=args.budget_gib, held_gib=args.held_gib, calls=args.calls, cpu_smoke=args.cpu_smoke,
              block=args.block, text_tokens=args.text_tokens)
  rows = []
  for t in args.tokens:
    for variant in ("stock", "packed"):
      r = spawn(dict(base, variant=variant, tokens=t), args.timeout)
      rows.append(r)
      print(f"[{variant:6s} T={t:7d}] ok={r.get('ok')} time={r.get('time_s')} peak={r.get('peak_above_free_gib')} "
            f"{r.get('error', '')[:160]}", flush=True)
  card = next((r["card"] for r in rows if r.get("card")), "unknown")
  max_tokens = {}
  if not args.no_search:
    for variant in ("stock", "packed"):
      def run(t, variant=variant):
        r = spawn(dict(base, variant=variant, tokens=t, search=True), args.timeout)
        rows.append(r)
        print(f"  [{variant:6s} T={t:7d}] ok={r.get('ok')}", flush=True)
        return bool(r.get("ok"))
      start = args.tokens[0] if variant == "packed" else args.tokens[0] // 2
      max_tokens[variant] = common.largest_passing(run, start, STEP, args.search_runs)
      print(f"largest T, {variant}: {max_tokens[variant]}", flush=True)
  out = args.out or (os.path.join("/tmp", "dit_cpu_smoke.json") if args.cpu_smoke
                     else common.result_path("dit" if args.block == "wan" else f"dit_{args.block}", card))
  rec = common.run_record() | {"card": card, "args": vars(args), "rows": rows, "max_tokens": max_tokens}
  common.write_json(out, rec)
  by = {(r["variant"], r["tokens"]): r for r in rows if not r.get("search")}
  stock, ours = by.get(("stock", TOKENS[0]), {}), by.get(("packed", TOKENS[0]), {})
  if args.cpu_smoke or not ours.get("ok"):
    return rec
  entries, prefix = {}, SCORE_PREFIX[args.block]
  if stock.get("ok"):  # in the user's budget the stock block may not run at all
    entries[f"{prefix}_peak_ratio_75k"] = stock["peak_above_free_gib"] / ours["peak_above_free_gib"]
    entries[f"{prefix}_time_vs_stock_75k"] = ours["time_s"] / stock["time_s"]
  mt = {v: (max_tokens.get(v) or {}).get("largest_passed") for v in ("stock", "packed")}
  if mt["stock"] and mt["packed"] and args.block == "wan":
    entries["dit.wan14b_max_tokens_ratio"] = mt["packed"] / mt["stock"]
  common.update_scorecard(entries, card=card, source=out, command=rec["command"])
  return rec


if __name__ == "__main__":
  main()
