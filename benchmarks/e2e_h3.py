"""End-to-end H3 attention layer in JAX: peak device memory, time and quality of four variants.

  python -m benchmarks.e2e_h3                       # GPU: T in {38247, 73923, 109599, 152263}
  python -m benchmarks.e2e_h3 --small               # CPU: a tiny layer in interpret mode

Every (variant, T) runs in a fresh process (``--child``), so each peak is that
configuration's alone. Peak memory is device-level on a GPU: the lowest
``cudaMemGetInfo`` free seen during the first call, against the free memory before it,
with JAX's platform allocator (memory returned as soon as it is freed), so it is the
layer's own, above its inputs. On a CPU there is no device-level figure and the
column is left out. The user's own failure (torch holding 6.09 GiB of a 12 GiB card)
is ``benchmarks/card_budget.py``. Quality compares a fixed subset of query rows with
a float32 reference of the same layer, computed in its own process.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from benchmarks import common

H3_TOKENS = (38_247, 73_923, 109_599, 152_263)


def _child(args):
  import jax
  from benchmarks import h3_layer

  shape = _shape(args)
  inp = h3_layer.make_inputs(shape)
  jax.block_until_ready(inp)
  dev = jax.devices()[0]
  input_bytes = sum(int(a.nbytes) for a in inp.values())
  fn = jax.jit(h3_layer.layer_fn(args.variant, shape, json.loads(args.sol_kwargs)))
  rec = {"variant": args.variant, "tokens": shape.tokens, "input_bytes": input_bytes}
  on_gpu = jax.default_backend() == "gpu"
  try:
    free0 = common.device_free_bytes() if on_gpu else None
    t0 = time.perf_counter()
    if on_gpu:
      with common.LowWater() as lw:
        out = jax.block_until_ready(fn(inp))
      rec["device_peak_bytes"] = free0 - lw.low
    else:
      out = jax.block_until_ready(fn(inp))
    rec["first_call_s"] = time.perf_counter() - t0
    rows = h3_layer.quality_rows(shape.tokens, args.quality_rows)
    out_rows = np.asarray(out[0, rows], np.float32)
    times = []
    for _ in range(args.runs):
      # Drop the last output first: holding it while the next call runs would add one
      # output's bytes to the peak that no single layer call needs.
      del out
      t0 = time.perf_counter()
      out = jax.block_until_ready(fn(inp))
      times.append(time.perf_counter() - t0)
    del out
    rec["times_s"] = times
    rec["time_s"] = float(np.median(times))
    if on_gpu:  # the steady-state call's peak (the first one also compiles)
      free0 = common.device_free_bytes()
      with common.LowWater() as lw:
        jax.block_until_ready(fn(inp))
      rec["device_peak_bytes"] = free0 - lw.low
    np.save(args.rows_file, out_rows)
    rec["ok"] = True
  except Exception as e:  # noqa: BLE001 - an OOM is a result, not a crash
    msg = str(e)
    rec["ok"] = False
    rec["oom"] = "RESOURCE_EXHAUSTED" in msg or "out of memory" in msg.lower()
    rec["error"] = msg.splitlines()[0][:400] if msg else repr(e)
  rec["card"] = getattr(dev, "device_kind", dev.platform)
  print("RESULT " + json.dumps(rec), flush=True)


def _quality(args):
  import jax
  from benchmarks import h3_layer
  from pallas_kernels.testing import quality

  shape = _shape(args)
  inp = h3_layer.make_inputs(shape)
  rows = h3_layer.quality_rows(shape.tokens, args.quality_rows)
  ref = np.asarray(jax.jit(lambda i: h3_layer.reference_rows(i, shape, rows))(inp))[0]
  res = {}
  for variant, path in json.loads(args.rows_files).items():
    if os.path.exists(path):
      res[variant] = quality(np.load(path), ref)
  print("RESULT " + json.dumps(res), flush=True)


def _shape(args):
  from benchmarks import h3_layer
  if args.small:
    return h3_layer.LayerShape(tokens=args.tokens[0], hidden=256, heads=2, head_dim=128, rot_dim=96,
                               prefix_tokens=args.tokens[0] // 8)
  return h3_layer.LayerShape(tokens=args.tokens[0], prefix_tokens=args.prefix_tokens)


def _run_child(argv, env_extra):
  env = dict(os.environ, PYTHONUNBUFFERED="1", **env_extra)
  proc = subprocess.run([sys.executable, "-m", "benchmarks.e2e_h3", *argv], env=env,
                        capture_output=True, text=True)
  for line in proc.stdout.splitlines():
    if line.startswith("RESULT "):
      return json.loads(line[len("RESULT "):])
  return {"ok": False, "error": (proc.stderr or proc.stdout)[-800:], "returncode": proc.returncode}


LEGEND = ("bf16 = the plain BF16 pipeline (x @ W, RMSNorm, RoPE, cuDNN attention); bf16_quant = BF16 "
          "projection then quantize (the anti-pattern: the full QKV exists); dense = ours, streamed "
          "projection + dense attention over packed K/V; sol = ours with Sol sparse attention.\n"
          "Quality (cos, rel L1) compares each variant's output with the layer in float32 on the same "
          "inputs (a subset of query rows; 1 = identical). 'vs bf16' is time / the BF16 pipeline's time "
          "(below 1 = faster); 'bf16 peak / peak' is the BF16 pipeline's device peak / this variant's "
          "(above 1 = less memory).")


def _plot(records, path):
  """Peak memory (device level, when measured) and time per variant: lines over T, or
  bars when there is only one T."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  ok = [r for r in records if r.get("ok")]
  variants = sorted({r["variant"] for r in ok})
  has_mem = any(r.get("device_peak_bytes") for r in ok)
  fig, axes = plt.subplots(1, 2 if has_mem else 1, figsize=(11 if has_mem else 6, 4))
  axes = list(axes) if has_mem else [axes]
  panels = [("time per layer (ms)", lambda r: r["time_s"] * 1e3)]
  if has_mem:
    panels.insert(0, ("device peak above inputs (GiB)", lambda r: r["device_peak_bytes"] / common.GIB))
  tokens = sorted({r["tokens"] for r in ok})
  for ax, (label, value) in zip(axes, panels):
    if len(tokens) == 1:
      vals = [next(value(r) for r in ok if r["variant"] == v) for v in variants]
      ax.bar(variants, vals)
      ax.set(ylabel=label, title=f"T = {tokens[0]}")
    else:
      for v in variants:
        rs = sorted((r for r in ok if r["variant"] == v), key=lambda r: r["tokens"])
        ax.plot([r["tokens"] for r in rs], [value(r) for r in rs], "o-", label=v)
      ax.set(xlabel="tokens T", ylabel=label)
      ax.legend()
    ax.grid(alpha=0.3)
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--tokens", type=int, nargs="+", default=None)
  ap.add_argument("--variants", nargs="+", default=["bf16", "bf16_quant", "dense", "sol"])
  ap.add_argument("--prefix-tokens", type=int, default=4096, help="conditioning prefix kept at int8")
  ap.add_argument("--runs", type=int, default=3)
  ap.add_argument("--quality-rows", type=int, default=512)
  ap.add_argument("--sol-kwargs", default="{}")
  ap.add_argument("--small", action="store_true", help="tiny layer for the CPU")
  ap.add_argument("--out", default=None)
  ap.add_argument("--child", default=None, choices=["run", "quality"])
  ap.add_argument("--variant", default=None)
  ap.add_argument("--rows-file", default=None)
  ap.add_argument("--rows-files", default=None)
  args = ap.parse_args(argv)
  if args.child == "run":
    return _child(args)
  if args.child == "quality":
    return _quality(args)

  tokens = args.tokens or ([300] if args.small else list(H3_TOKENS))
  out_path = args.out or ("benchmarks/results/e2e_h3_cpu_small.json" if args.small else None)
  base = ["--prefix-tokens", str(args.prefix_tokens), "--runs", str(args.runs),
          "--quality-rows", str(args.quality_rows), "--sol-kwargs", args.sol_kwargs] + (["--small"] if args.small else [])
  env = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "XLA_PYTHON_CLIENT_ALLOCATOR": "platform"}
  records, qualities = [], {}
  tmp = tempfile.mkdtemp(prefix="e2e_h3_")
  run = common.run_record([sys.executable, "-m", "benchmarks.e2e_h3", *(argv if argv is not None else sys.argv[1:])])
  card = None
  print(LEGEND, flush=True)

  def save():
    nonlocal out_path
    out_path = out_path or common.result_path("e2e_h3", card or "unknown")
    common.write_json(out_path, run | {"card": card, "legend": LEGEND, "env": env, "records": records,
                                       "quality": {str(k): v for k, v in qualities.items()}})
  for t in tokens:
    files = {}
    for variant in args.variants:
      files[variant] = os.path.join(tmp, f"{variant}_{t}.npy")
      rec = _run_child(["--child", "run", "--variant", variant, "--tokens", str(t), "--rows-file", files[variant],
                        *base], env)
      rec.setdefault("variant", variant)
      rec.setdefault("tokens", t)
      card = rec.get("card", card)
      records.append(rec)
      peak = rec.get("device_peak_bytes")
      print(f"[{variant:10s} T={t:7d}] ok={rec.get('ok')} time={rec.get('time_s', float('nan')) * 1e3:9.1f} ms"
            + (f" device peak {peak / common.GIB:.2f} GiB" if peak else "") + f" {rec.get('error', '')[:120]}",
            flush=True)
    qualities[t] = _run_child(["--child", "quality", "--tokens", str(t), "--rows-files", json.dumps(files), *base], env)
    for variant, q in qualities[t].items():
      print(f"[quality {variant:10s} T={t:7d}] " + json.dumps(q), flush=True)
  rows = []
  for t in tokens:
    base_rec = next((r for r in records if r["variant"] == "bf16" and r["tokens"] == t and r.get("ok")), None)
    for r in (r for r in records if r["tokens"] == t):
      row = {"T": t, "variant": r["variant"], "ok": r.get("ok"), "time_ms": r.get("time_s", 0) * 1e3 or None,
             **{k: v for k, v in qualities.get(t, {}).get(r["variant"], {}).items() if k in ("cos", "rel_l1")}}
      if r.get("device_peak_bytes"):
        row["peak_gib"] = r["device_peak_bytes"] / common.GIB
      if base_rec and r.get("ok"):
        row["time_vs_bf16"] = r["time_s"] / base_rec["time_s"]
        if r.get("device_peak_bytes") and base_rec.get("device_peak_bytes"):
          row["bf16_peak_over_peak"] = base_rec["device_peak_bytes"] / r["device_peak_bytes"]
      r["summary"] = row
      rows.append(row)
  interpreted = card in (None, "cpu")
  columns = [("T", "T", "{}"), ("variant", "variant", "{}"), ("ms", "time_ms", "{:.1f}"),
             ("vs bf16", "time_vs_bf16", "{:.3f}"), ("cos", "cos", "{:.6f}"), ("rel L1", "rel_l1", "{:.4f}")]
  if interpreted:
    # Our kernels run in the Pallas interpreter here, the BF16 rows as compiled XLA:
    # a time ratio would compare an interpreter with a compiler, so none is shown.
    columns[2:4] = [("ms (interpreter)", "time_ms", "{:.1f}")]
  if any("peak_gib" in r for r in rows):
    columns[3:3] = [("peak GiB", "peak_gib", "{:.2f}"), ("bf16 peak / peak", "bf16_peak_over_peak", "{:.2f}")]
  print(f"card: {card}")
  print(common.table(rows, columns))
  save()
  png = out_path.replace(".json", ".png")
  if interpreted:
    print("plot skipped: on a CPU the times are the interpreter's and no device memory is measured")
    return
  try:
    _plot(records, png)
    print(f"wrote {png}")
  except Exception as e:  # noqa: BLE001
    print(f"plot skipped: {e}")
  dense = next((r["summary"] for r in records if r["variant"] == "dense" and r["tokens"] == 152263), None)
  if dense and card and not args.small:
    common.update_scorecard({"e2e.dense_time_vs_bf16_152k": dense.get("time_vs_bf16"),
                             "e2e.dense_peak_ratio_152k": dense.get("bf16_peak_over_peak")},
                            card=card, source=out_path, command=run["command"])


if __name__ == "__main__":
  main()
