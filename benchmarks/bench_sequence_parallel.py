"""Ulysses sequence parallelism: ours (packed K/V on the wire) against BF16 Ulysses and one GPU.

  python -m benchmarks.bench_sequence_parallel                 # multi-GPU machine: P in {2, 4, 8}
  python -m benchmarks.bench_sequence_parallel --cpu-smoke     # 4 host CPU devices, tiny layer

Variants, each (variant, P, T) in a fresh process (``--child``):

* ``ours``: ``pallas_kernels.sequence_parallel.ulysses_attention_layer`` (streamed
  projection per token shard, Q + packed K/V all-to-all, dense attention per head group);
* ``bf16``: the Ulysses layer users run today (xDiT/USP): per shard ``x @ W`` in bf16,
  QK-norm and RoPE, Q/K/V all-to-all in bf16, cuDNN attention, O all-to-all back;
* ``ring``: ``sequence_parallel.ring_attention_layer`` (packed K/V shards around the
  ring, the fused kernel per shard, log-sum-exp merge): any P;
* ``one``: ``layer.attention_layer`` on one device (P = 1).

Per row: median time, each device's peak (device level: the lowest ``cudaMemGetInfo``
free of every card during a call, against its free memory before), and the bytes each
variant puts on the wire (``sequence_parallel.wire_bytes``: computed from the arrays
exchanged, padding included). ``--max-tokens`` then searches the largest T that
completes with ``--budget-gib`` free per card (default the user's 11.94), on one GPU and
with Ulysses at the largest P. Writes ``benchmarks/results/sequence_parallel_<card>_<date>.json``
and the scorecard: ``sp.wire_bytes_vs_bf16`` (always, from buffer sizes at H3 shape,
P = 8), ``sp.ulysses8_speedup_152k`` when P = 8 ran at T = 152,263,
``sp.max_tokens_ratio_p8`` when the search ran at P = 8.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from benchmarks import common  # noqa: E402
from pallas_kernels.qkv_layout import QKVLayout  # noqa: E402

H3 = dict(hidden=5376, heads=56, head_dim=128, rot_dim=96)
SMALL = dict(hidden=128, heads=8, head_dim=64, rot_dim=48)
USER_TOKENS = 152_263


def bf16_ulysses_fn(mesh, axis, shape):
  """The BF16 Ulysses layer (the baseline): inputs dict -> (B, T, H, D) bf16, tokens sharded."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import PartitionSpec as P
  from pallas_kernels.rope import apply_rope_reference

  h, d, rot = shape["heads"], shape["head_dim"], shape["rot_dim"]

  def norm(x, w):
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + 1e-5) * w

  def body(x, cos, sin, w, qn, kn):
    b, s, _ = x.shape
    qkv = jnp.dot(x, w, preferred_element_type=jnp.bfloat16)           # bf16 out, as torch's qkv_proj
    q, k, v = (qkv[..., i * h * d:(i + 1) * h * d].reshape(b, s, h, d) for i in range(3))
    q = apply_rope_reference(norm(q, qn), cos, sin, rot).astype(jnp.bfloat16)
    k = apply_rope_reference(norm(k, kn), cos, sin, rot).astype(jnp.bfloat16)
    a2a = lambda a, sa, ca: jax.lax.all_to_all(a, axis, sa, ca, tiled=True)
    q, k, v = (a2a(a, 2, 1) for a in (q, k, v))                           # (B, T, H/P, D)
    impl = "cudnn" if jax.default_backend() == "gpu" else None
    o = jax.nn.dot_product_attention(q, k, v, implementation=impl)
    return a2a(o, 1, 2)

  rep = P()
  fn = jax.shard_map(body, mesh=mesh, check_vma=False, out_specs=P(None, axis),
                     in_specs=(P(None, axis), P(axis), P(axis), rep, rep, rep))
  return jax.jit(lambda inp: fn(inp["x"], inp["rope_cos"], inp["rope_sin"], inp["w"], inp["q_norm_weight"],
                                inp["k_norm_weight"]))


def child(cfg: dict) -> dict:
  import jax
  import jax.numpy as jnp
  from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

  from pallas_kernels import QKVWeights, layer
  from pallas_kernels import sequence_parallel as sp
  from pallas_kernels import rope

  shape, t, p, variant = cfg["shape"], cfg["tokens"], cfg["devices"], cfg["variant"]
  on_gpu = jax.default_backend() == "gpu"
  rec = dict(cfg)
  hogs = []
  if cfg.get("budget_gib") and on_gpu:  # leave exactly budget_gib free on each card of the mesh
    import torch
    for i in range(p):
      free = torch.cuda.mem_get_info(i)[0]
      extra = free - int(cfg["budget_gib"] * common.GIB)
      if extra > 0:
        hogs.append(torch.empty(extra, dtype=torch.uint8, device=f"cuda:{i}"))
  rng = np.random.default_rng(0)
  hid, h, d, rot = shape["hidden"], shape["heads"], shape["head_dim"], shape["rot_dim"]
  mesh = Mesh(np.array(jax.devices()[:p]), ("sp",))
  by_tokens = NamedSharding(mesh, P(None, "sp")) if variant != "one" else None
  # The baseline's shard_map needs T divisible by P: pad x there (ours pads inside).
  rows = -(-t // p) * p if variant == "bf16" else t
  x = np.zeros((1, rows, hid), np.float32)
  x[:, :t] = rng.normal(size=(1, t, hid)).astype(np.float32)
  ang = np.arange(rows)[:, None] * 1e4 ** (-np.arange(rot // 2) / (rot // 2))
  cos, sin = rope.rope_tables(ang, d)
  by_rows = NamedSharding(mesh, P("sp")) if variant != "one" else None    # RoPE tables (T, D)
  put = jax.device_put                                                     # sharding None: one device
  inp = dict(x=put(jnp.asarray(x, jnp.bfloat16), by_tokens),
             w=put(jnp.asarray(rng.normal(size=(hid, 3 * h * d)) / np.sqrt(hid), jnp.bfloat16)),
             q_norm_weight=put(jnp.ones((d,), jnp.float32)), k_norm_weight=put(jnp.ones((d,), jnp.float32)),
             rope_cos=put(jnp.asarray(cos), by_rows), rope_sin=put(jnp.asarray(sin), by_rows))
  del x
  kw = dict(layout=QKVLayout.h3(h, d, rot), interpret=None if on_gpu else True)
  weights = lambda i: QKVWeights(i["w"], q_norm_weight=i["q_norm_weight"], k_norm_weight=i["k_norm_weight"])
  common_args = lambda i: dict(rope_cos=i["rope_cos"], rope_sin=i["rope_sin"])
  if variant == "ours":
    fn = lambda i: sp.ulysses_attention_layer(i["x"], weights(i), mesh=mesh, axis_name="sp", **common_args(i), **kw)
    rec["wire"] = sp.wire_bytes(t, h, d, p)
  elif variant == "ring":
    fn = lambda i: sp.ring_attention_layer(i["x"], weights(i), mesh=mesh, axis_name="sp", **common_args(i), **kw)
    rec["wire"] = {k: v for k, v in sp.wire_bytes(t, h, d, p).items() if k.startswith("ring")}
  elif variant == "bf16":
    fn = bf16_ulysses_fn(mesh, "sp", shape)
    rec["wire"] = sp.wire_bytes(t, h, d, p)["bf16"]
  else:
    fn = lambda i: layer.attention_layer(i["x"], weights(i), **common_args(i), **kw)
  try:
    out = jax.block_until_ready(fn(inp))            # compile + first call
    del out
    times = []
    for _ in range(cfg["runs"]):
      t0 = time.perf_counter()
      out = jax.block_until_ready(fn(inp))
      times.append(time.perf_counter() - t0)
      del out
    rec["time_s"] = float(np.median(times))
    if on_gpu:  # one low-water sampler per card of the mesh
      before = [common.device_free_bytes(i) for i in range(p)]
      with contextlib.ExitStack() as stack:
        lows = [stack.enter_context(common.LowWater(period_s=0.001, device=i)) for i in range(p)]
        jax.block_until_ready(fn(inp))
      rec["device_peak_bytes"] = [b - lw.low for b, lw in zip(before, lows)]
    rec["ok"] = True
  except Exception as e:  # noqa: BLE001 - an OOM is a result
    msg = str(e)
    rec["ok"] = False
    rec["oom"] = "RESOURCE_EXHAUSTED" in msg or "out of memory" in msg.lower()
    rec["error"] = (msg.splitlines() or [repr(e)])[0][:300]
  return rec


def run_child(cfg, timeout, env_extra=None) -> dict:
  env = dict(os.environ, **(env_extra or {}))
  env.setdefault("XLA_PYTHON_CLIENT_ALLOCATOR", "platform")   # device-level peaks, no pooled memory
  env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
  try:
    proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_sequence_parallel", "--child", json.dumps(cfg)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
  except subprocess.TimeoutExpired:
    return dict(cfg, ok=False, error=f"timeout after {timeout} s")
  lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
  if not lines:
    return dict(cfg, ok=False, error=(proc.stderr.strip().splitlines() or ["no output"])[-1][:300])
  return json.loads(lines[-1][len("RESULT "):])


def largest_tokens(variant, devices, args, env_extra, step=16_384) -> dict:
  """The largest T (a multiple of ``step``) whose layer completes with ``--budget-gib``
  free per card: doubling from T = 152,263's step, then bisection; at most
  ``--search-runs`` children."""
  ok_t, bad_t, tried = 0, None, []
  t = -(-USER_TOKENS // step) * step
  for _ in range(args.search_runs):
    rec = run_child(dict(shape=H3, tokens=t, devices=devices, variant=variant, runs=1, budget_gib=args.budget_gib),
                    args.timeout, env_extra)
    tried.append({"tokens": t, "ok": bool(rec.get("ok")), "error": rec.get("error")})
    print(f"  search {variant} P={devices} T={t}: {'ok' if rec.get('ok') else rec.get('error', 'failed')}", flush=True)
    if rec.get("ok"):
      ok_t = t
    else:
      bad_t = t
    t = 2 * ok_t if bad_t is None else (ok_t + bad_t) // 2 // step * step
    if bad_t is not None and bad_t - ok_t <= step:
      break
  return {"variant": variant, "devices": devices, "budget_gib": args.budget_gib, "max_tokens": ok_t, "tried": tried}


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--tokens", default=str(USER_TOKENS), help="comma-separated T")
  ap.add_argument("--devices", default="2,4,8", help="comma-separated P (those above the card count are skipped)")
  ap.add_argument("--variants", default="one,bf16,ours,ring")
  ap.add_argument("--runs", type=int, default=3)
  ap.add_argument("--timeout", type=int, default=300, help="seconds per child")
  ap.add_argument("--cpu-smoke", action="store_true", help="4 host CPU devices, a tiny layer, interpret mode")
  ap.add_argument("--max-tokens", action="store_true",
                  help="also search the largest T per card budget: one GPU and Ulysses at the largest P")
  ap.add_argument("--budget-gib", type=float, default=11.94, help="free memory per card in the search")
  ap.add_argument("--search-runs", type=int, default=5)
  ap.add_argument("--out", default=None)
  ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
  args = ap.parse_args(argv)
  if args.child:
    print("RESULT " + json.dumps(child(json.loads(args.child))), flush=True)
    return

  from pallas_kernels import sequence_parallel as sp
  env_extra = None
  if args.cpu_smoke:
    shape, tokens, devices, cards = SMALL, [300], [2, 4], 4
    env_extra = {"XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu"}
    card = "cpu"
  else:
    import jax
    shape, tokens = H3, [int(v) for v in args.tokens.split(",")]
    cards = len(jax.devices())
    devices = [int(v) for v in args.devices.split(",") if int(v) <= cards]
    card = common.device_name() if jax.default_backend() == "gpu" else "cpu"
    if not devices:
      print(f"only {cards} device(s): no P in {args.devices} fits; the wire-byte table alone follows")
  rows = []
  for t in (tokens if devices else []):
    plan = [("one", 1)] if "one" in args.variants else []
    plan += [(v, p) for p in devices for v in ("bf16", "ours", "ring") if v in args.variants]
    for variant, p in plan:
      if p > cards:
        continue
      rec = run_child(dict(shape=shape, tokens=t, devices=p, variant=variant, runs=args.runs), args.timeout,
                      env_extra)
      rows.append(rec)
      peak = max(rec.get("device_peak_bytes") or [0]) / common.GIB
      print(f"T={t:>7} P={p} {variant:5s} ok={rec.get('ok')} time={rec.get('time_s', float('nan')):.4f} s "
            f"max device peak={peak:.2f} GiB {rec.get('error', '')}", flush=True)
  search = []
  if args.max_tokens and devices and not args.cpu_smoke:
    search = [largest_tokens("one", 1, args, env_extra), largest_tokens("ours", max(devices), args, env_extra)]
  # Wire bytes at H3's shape (buffer sizes; no device needed).
  wire = {p: sp.wire_bytes(USER_TOKENS, H3["heads"], H3["head_dim"], p) for p in (2, 4, 8)}
  print(common.table([dict(P=p, ours=w["ours"] / common.GIB, bf16=w["bf16"] / common.GIB, ratio=w["ratio"],
                           kv=w["kv_ratio"]) for p, w in wire.items()],
                     [("P", "P", "{}"), ("ours GiB", "ours", "{:.3f}"), ("bf16 GiB", "bf16", "{:.3f}"),
                      ("layer ratio", "ratio", "{:.3f}"), ("K/V ratio", "kv", "{:.3f}")]))
  out = args.out or common.result_path("sequence_parallel", card)
  common.write_json(out, common.run_record() | {"card": card, "rows": rows, "max_tokens": search,
                                                "wire_bytes_h3_152k": {str(p): w for p, w in wire.items()}})
  entries = {"sp.wire_bytes_vs_bf16": round(wire[8]["ratio"], 4)}
  one = {r["tokens"]: r for r in rows if r["variant"] == "one" and r.get("ok")}
  p8 = [r for r in rows if r["variant"] == "ours" and r["devices"] == 8 and r["tokens"] == USER_TOKENS and r.get("ok")]
  if p8 and USER_TOKENS in one:
    entries["sp.ulysses8_speedup_152k"] = round(one[USER_TOKENS]["time_s"] / p8[0]["time_s"], 3)
  if len(search) == 2 and search[0]["max_tokens"] and search[1]["devices"] == 8:
    entries["sp.max_tokens_ratio_p8"] = round(search[1]["max_tokens"] / search[0]["max_tokens"], 3)
  if not args.cpu_smoke:
    common.update_scorecard(entries, card=card if len(entries) > 1 else "buffer sizes (any card)", source=out,
                            command=common.run_record()["command"])


if __name__ == "__main__":
  main()
