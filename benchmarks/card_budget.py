"""The user's own failure as a benchmark: one H3 attention block from torch, on a card
with ``--budget-gib`` free and ``--held-gib`` of it already held by torch.

  python -m benchmarks.card_budget                        # the user's case, then the largest T
  python -m benchmarks.card_budget --blocks dense --no-search

The user (``../shared/feature-request.md``): a torch app on a 12 GiB card, 6.09 GiB
allocated, asks 6.11 GiB for ``qkv = qkv_proj(x)`` at T = 152,263; device limit 11.94
GiB. Every row runs in a fresh process (``--child``):

1. a hog allocation leaves exactly ``--budget-gib`` free on the device;
2. torch allocations bring torch's holding to ``--held-gib``: x (1, T, 5376) bf16, the
   block's weights, its RoPE tables, and filler standing for the rest of the model,
   all built without transient float32 buffers; torch's cache is emptied;
3. the block's forward, twice (the first output is dropped before the second call);
4. one torch allocation as large as what the app expects back: the free memory before
   the first forward, less the block's output (which the app still holds).

Measured per row: device free memory (``cudaMemGetInfo``, sampled through each call:
the low-water mark), torch's and JAX's own peaks and pools, ok/OOM per phase, time.
Blocks: ``reference`` (the plain BF16 torch block: the control), ``dense`` and ``sol``
(``torch_bridge.PackedH3Attention``), ``jax_dense`` (the same layer and ``o_proj`` in
one JAX call, inputs shared with torch by DLPack). ``--allocators`` adds rows with
JAX's default pooling allocator (``bfc``) next to the bridge's policy (``platform``).
Then, per block, the largest T (steps of 4,096) that completes under the same budget,
searched from ``required_bytes`` plus the overhead the user-case row measured.
Writes ``benchmarks/results/card_budget_<card>_<date>.json`` and the scorecard.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from benchmarks import common  # noqa: E402

USER_TOKENS = 152_263
HIDDEN, HEADS, HEAD_DIM, ROT_DIM = 5376, 56, 128, 96
STEP = 4096
BLOCKS = ("dense", "reference", "sol", "jax_dense")  # user-case rows, in running order


# --------------------------------------------------------------------------------------
# Child: one configuration in a fresh process
# --------------------------------------------------------------------------------------
def _oom(e: Exception) -> bool:
  msg = str(e)
  return "out of memory" in msg.lower() or "RESOURCE_EXHAUSTED" in msg


def child(cfg: dict) -> dict:
  if cfg["jax_allocator"] != "platform":  # the bridge's policy is set by its import
    os.environ["XLA_PYTHON_CLIENT_ALLOCATOR"] = cfg["jax_allocator"]
  import numpy as np
  import torch

  import torch_bridge as tb
  from pallas_kernels.testing import dit_grid
  from pallas_kernels import rope

  gib, t = common.GIB, cfg["tokens"]
  rec = dict(cfg)
  dev = torch.device("cuda")
  torch.cuda.init()
  # 1. The hog: the card now has budget_gib free.
  free, total = torch.cuda.mem_get_info()
  budget = int(cfg["budget_gib"] * gib)
  hog = [torch.empty(free - budget, dtype=torch.uint8, device=dev)] if free > budget else []
  rec["card_total_gib"] = total / gib
  # 2. Torch's holding: the block, x, RoPE tables, filler.
  torch.manual_seed(0)
  with torch.no_grad():
    if cfg["block"] == "reference":
      block = tb.ReferenceH3Attention(HIDDEN, HEADS, HEAD_DIM, device=dev)
    else:
      block = tb.PackedH3Attention(HIDDEN, HEADS, HEAD_DIM, device=dev,
                                   attention="sol" if cfg["block"] == "sol" else "dense",
                                   scratch_bytes=int(cfg["scratch_mib"]) << 20)
    block = block.eval().requires_grad_(False)
    x = torch.randn(1, t, HIDDEN, dtype=torch.bfloat16, device=dev)
    cos, sin = rope.rope_tables(rope.rope_3d_angles(dit_grid(t, 4096), freqs_per_axis=ROT_DIM // 6), HEAD_DIM)
    cos, sin = torch.tensor(cos, device=dev), torch.tensor(sin, device=dev)
  held = torch.cuda.memory_allocated() - sum(h.numel() for h in hog)
  filler_bytes = int(cfg["held_gib"] * gib) - held
  filler = torch.empty(max(filler_bytes, 0), dtype=torch.uint8, device=dev)
  rec["held_gib"] = (held + filler.numel()) / gib
  rec["x_gib"] = x.numel() * 2 / gib
  torch.cuda.empty_cache()
  torch.cuda.reset_peak_memory_stats()
  torch.cuda.synchronize()
  free0 = torch.cuda.mem_get_info()[0]
  rec["free_before_gib"] = free0 / gib

  if cfg["block"] == "jax_dense":
    import jax
    import jax.numpy as jnp
    from pallas_kernels.layer import attention_layer
    j = lambda a: tb.to_jax(a, "input")
    jin = dict(x=j(x), w=j(block.qkv_proj.weight_t), wo=j(block.o_proj.weight), qn=j(block.q_norm.weight),
               kn=j(block.k_norm.weight), cos=j(cos), sin=j(sin))

    @jax.jit
    def layer(i):
      o = attention_layer(i["x"], i["w"], q_norm_weight=i["qn"], k_norm_weight=i["kn"], rope_cos=i["cos"],
                          rope_sin=i["sin"], rot_dim=ROT_DIM, heads=HEADS, head_dim=HEAD_DIM,
                          scratch_bytes=int(cfg["scratch_mib"]) << 20)
      return jnp.dot(o.reshape(1, t, HEADS * HEAD_DIM), i["wo"].T, preferred_element_type=jnp.bfloat16)
    forward = lambda: layer(jin)
    sync = jax.block_until_ready
  else:
    def forward():
      with torch.inference_mode():
        return block(x, cos, sin)
    sync = lambda y: torch.cuda.synchronize()

  out = None
  for phase in ("forward_1", "forward_2"):
    out = None  # the app drops the last output before the next call
    t0 = time.perf_counter()
    try:
      with common.LowWater() as lw:
        out = forward()
        sync(out)
      rec[phase] = {"ok": True, "time_s": time.perf_counter() - t0, "low_free_gib": lw.low / gib,
                    "peak_above_held_gib": (free0 - lw.low) / gib}
    except Exception as e:  # noqa: BLE001 - an OOM is the result
      rec[phase] = {"ok": False, "oom": _oom(e), "error": str(e).splitlines()[0][:400],
                    "low_free_gib": lw.low / gib, "peak_above_held_gib": (free0 - lw.low) / gib}
      out = None
      break
  rec["ok"] = bool(rec.get("forward_2", {}).get("ok"))
  rec["torch_peak_allocated_above_held_gib"] = (torch.cuda.max_memory_allocated() - held - filler.numel()
                                                - sum(h.numel() for h in hog)) / gib
  rec["torch_peak_reserved_gib"] = torch.cuda.max_memory_reserved() / gib
  if cfg["block"] != "reference":
    import jax
    stats = jax.devices()[0].memory_stats() or {}
    rec["jax_stats_gib"] = {k: stats[k] / gib for k in ("peak_bytes_in_use", "bytes_in_use", "pool_bytes")
                            if k in stats}
  # 4. What the app expects back: free before the block, less the output it holds.
  out_bytes = 0 if out is None else int(np.prod(out.shape)) * 2
  rec["output_gib"] = out_bytes / gib
  torch.cuda.synchronize()
  free_now = torch.cuda.mem_get_info()[0]
  idle = torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
  expected = free0 - out_bytes
  rec["after"] = {"free_gib": free_now / gib, "torch_idle_cache_gib": idle / gib,
                  "expected_back_gib": expected / gib,
                  "shortfall_gib": (expected - free_now - idle) / gib}
  for name, size in (("alloc_expected", expected), ("alloc_expected_minus_0.25gib", expected - int(0.25 * gib))):
    try:
      probe = torch.empty(size, dtype=torch.uint8, device=dev)
      del probe
      rec["after"][name] = True
    except Exception as e:  # noqa: BLE001
      rec["after"][name] = False if _oom(e) else str(e)[:200]
  rec["required_bytes_gib"] = ({k: v / gib for k, v in block.required_bytes(t).items()}
                               if hasattr(block, "required_bytes") else None)
  rec["card"] = torch.cuda.get_device_name()
  return rec


# --------------------------------------------------------------------------------------
# Parent
# --------------------------------------------------------------------------------------
_DEADLINE = [None]  # monotonic time after which no new child starts (--deadline-s)


def spawn(cfg: dict, timeout: int) -> dict:
  if _DEADLINE[0] is not None and time.monotonic() + 30 > _DEADLINE[0]:
    return dict(cfg, ok=False, skipped="the run's --deadline-s left no time for this row")
  timeout = timeout if _DEADLINE[0] is None else max(30, min(timeout, int(_DEADLINE[0] - time.monotonic())))
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  try:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.card_budget", "--child", json.dumps(cfg)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
  except subprocess.TimeoutExpired:
    return dict(cfg, ok=False, error=f"timed out after {timeout} s")
  for line in proc.stdout.splitlines():
    if line.startswith("RESULT "):
      return json.loads(line[len("RESULT "):])
  return dict(cfg, ok=False, error=(proc.stderr or proc.stdout)[-1500:])


def summary(r: dict) -> str:
  if r.get("skipped"):
    return f"skipped: {r['skipped']}"
  if "forward_1" not in r:
    return f"failed: {r.get('error', '')[-300:]}"
  f1, f2, after = r["forward_1"], r.get("forward_2", {}), r.get("after", {})
  out = (f"f1 {'ok' if f1['ok'] else 'OOM' if f1.get('oom') else 'FAIL'} {f1.get('time_s', 0):.2f}s "
         f"low {f1['low_free_gib']:.2f}; f2 {'ok' if f2.get('ok') else '-'} {f2.get('time_s', 0):.2f}s "
         f"peak {f2.get('peak_above_held_gib', f1['peak_above_held_gib']):.2f} GiB; "
         f"shortfall {after.get('shortfall_gib', float('nan')):.2f} GiB, alloc {after.get('alloc_expected')}")
  if not f1["ok"]:
    out += f" [{f1.get('error', '')[:160]}]"
  return out


class _OutOfTime(Exception):
  pass


def search_max_tokens(base: dict, start: int, timeout: int, records: list, max_runs: int) -> int | None:
  """The largest multiple of STEP that completes: bracket the edge from ``start``
  (doubling steps up or down), then bisect. None when ``max_runs`` children or the
  deadline ran out before the edge was pinned to one STEP."""
  runs = []

  def run(t):
    if len(runs) >= max_runs:
      raise _OutOfTime
    r = spawn(dict(base, tokens=t, search=True), timeout)
    records.append(r)
    print(f"  [{base['block']:9s} T={t:7d}] {summary(r)}", flush=True)
    if r.get("skipped"):
      raise _OutOfTime
    runs.append(t)
    return bool(r.get("ok"))

  try:
    t = max(STEP, start // STEP * STEP)
    step = STEP
    if run(t):
      lo, hi = t, None
      while hi is None:
        if run(lo + step):
          lo, step = lo + step, 2 * step
        else:
          hi = lo + step
    else:
      lo, hi = None, t
      while lo is None:
        if hi - step < STEP:
          return None
        if run(hi - step):
          lo = hi - step
        else:
          hi, step = hi - step, 2 * step
    while hi - lo > STEP:
      mid = (lo + hi) // 2 // STEP * STEP
      if run(mid):
        lo = mid
      else:
        hi = mid
    return lo
  except _OutOfTime:
    return None


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--budget-gib", type=float, default=11.94)
  ap.add_argument("--held-gib", type=float, default=6.09)
  ap.add_argument("--tokens", type=int, default=USER_TOKENS)
  ap.add_argument("--scratch-mib", type=int, default=512)
  ap.add_argument("--blocks", default=",".join(BLOCKS), help="user-case rows, in this order")
  ap.add_argument("--allocators", default="platform,bfc",
                  help="JAX allocators for the packed blocks' user-case rows (bfc: dense only, for before/after)")
  ap.add_argument("--no-search", action="store_true", help="skip the largest-T search")
  ap.add_argument("--search-blocks", default="dense,reference,sol")
  ap.add_argument("--search-runs", type=int, default=6, help="children per block in the largest-T search")
  ap.add_argument("--timeout", type=int, default=400, help="seconds per child process")
  ap.add_argument("--deadline-s", type=int, default=None,
                  help="start no child after this many seconds (rows not run say so)")
  ap.add_argument("--out", default=None)
  ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.child:
    print("RESULT " + json.dumps(child(json.loads(args.child)), default=float), flush=True)
    return
  base = dict(budget_gib=args.budget_gib, held_gib=args.held_gib, scratch_mib=args.scratch_mib)
  if args.deadline_s:
    _DEADLINE[0] = time.monotonic() + args.deadline_s
  records = []
  print(f"budget {args.budget_gib} GiB free, torch holds {args.held_gib} GiB, T = {args.tokens}", flush=True)
  rows = [(b, "platform") for b in args.blocks.split(",")]
  if "dense" in args.blocks.split(","):  # the pooling allocator last: the before/after comparison
    rows += [("dense", a) for a in args.allocators.split(",") if a != "platform"]
  for block, alloc in rows:
    r = spawn(dict(base, block=block, tokens=args.tokens, jax_allocator=alloc), args.timeout)
    records.append(r)
    print(f"[{block:9s} {alloc:8s} T={args.tokens}] {summary(r)}", flush=True)
  card = next((r["card"] for r in records if r.get("card")), "unknown")
  max_tokens = {}
  if not args.no_search:
    from pallas_kernels.layer import required_bytes
    free_budget = (args.budget_gib - args.held_gib) * common.GIB
    for block in args.search_blocks.split(","):
      user = next((r for r in records if r.get("block") == block and r.get("jax_allocator") == "platform"), None)
      if block == "reference":
        start = args.tokens // 4  # the BF16 block's per-token footprint is about 4x ours
      else:
        att = "sol" if block == "sol" else "dense"
        overhead = 0.0
        if user and user.get("ok") and user.get("required_bytes_gib"):
          overhead = max(0.0, user["forward_2"]["peak_above_held_gib"] - user["required_bytes_gib"]["peak"])
        start = STEP
        while required_bytes(start + STEP, HEADS, HEAD_DIM, HIDDEN, attention=att,
                             scratch_bytes=args.scratch_mib << 20)["peak"] + overhead * common.GIB < free_budget:
          start += STEP
      max_tokens[block] = search_max_tokens(dict(base, block=block, jax_allocator="platform"), start,
                                            args.timeout, records, args.search_runs)
      print(f"largest T for {block}: {max_tokens[block]}", flush=True)
  out = args.out or common.result_path("card_budget", card)
  rec = common.run_record() | {"card": card, "args": vars(args), "records": records, "max_tokens": max_tokens}
  common.write_json(out, rec)
  user = {r["block"]: r for r in records if not r.get("search") and r.get("jax_allocator") == "platform"}
  dense = user.get("dense", {})
  floor = None
  if dense.get("ok") and dense.get("required_bytes_gib"):
    rb = dense["required_bytes_gib"]
    floor = dense["forward_2"]["peak_above_held_gib"] - (rb["q"] + rb["packed_kv"] + rb["o_proj_output"]
                                                         + args.scratch_mib / 1024)
  entries = {"card_budget.dense_ok_user_case": bool(dense.get("ok")) if dense else None,
             "card_budget.sol_ok_user_case": bool(user["sol"].get("ok")) if "sol" in user else None,
             "card_budget.reference_ok_user_case": bool(user["reference"].get("ok")) if "reference" in user else None,
             "card_budget.torch_shortfall_gib": dense.get("after", {}).get("shortfall_gib"),
             "card_budget.block_peak_over_floor_gib": floor}
  for block in ("dense", "sol", "reference"):
    if block in max_tokens and max_tokens[block] is not None:
      entries[f"card_budget.{block}_max_tokens"] = max_tokens[block]
  if args.tokens == USER_TOKENS and abs(args.budget_gib - 11.94) < 1e-9 and abs(args.held_gib - 6.09) < 1e-9:
    common.update_scorecard(entries, card=card, source=out, command=rec["command"])


if __name__ == "__main__":
  main()
