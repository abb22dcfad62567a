"""End-to-end H3 attention layer: peak device memory, time and quality of four variants.

  python -m benchmarks.e2e_h3                       # H200: T in {38247, 73923, 109599, 152263}
  python -m benchmarks.e2e_h3 --small               # CPU: a tiny layer in interpret mode

Every (variant, T) runs in a fresh process (``--child``), so each peak is that
configuration's alone. Peak memory is JAX's allocator peak (``peak_bytes_in_use``): every
buffer of these variants lives in that one allocator, inputs included; the table also
gives the peak above the inputs. A second pass reruns chosen variants under a simulated
12 GiB card (``XLA_PYTHON_CLIENT_MEM_FRACTION`` with preallocation), where the BF16
pipeline should run out of memory and ours should not. Quality compares a fixed subset
of query rows with a float32 reference of the same layer, computed in its own process.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

import numpy as np

from benchmarks.run_info import package_versions

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
  rec = {"variant": args.variant, "tokens": shape.tokens, "cap_gib": args.cap_gib, "input_bytes": input_bytes}
  try:
    t0 = time.perf_counter()
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
    np.save(args.rows_file, out_rows)
    rec["ok"] = True
  except Exception as e:  # noqa: BLE001 - the OOM under the cap is a result, not a crash
    msg = str(e)
    rec["ok"] = False
    rec["oom"] = "RESOURCE_EXHAUSTED" in msg or "out of memory" in msg.lower()
    rec["error"] = msg.splitlines()[0][:400] if msg else repr(e)
  stats = dev.memory_stats() or {}
  rec["peak_bytes"] = stats.get("peak_bytes_in_use")
  rec["bytes_limit"] = stats.get("bytes_limit")
  print("RESULT " + json.dumps(rec), flush=True)


def _quality(args):
  import jax
  from benchmarks import h3_layer
  from benchmarks.quality import quality

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


def _gib(nbytes) -> str:
  """Peak as text: the CPU client keeps no allocator statistics."""
  return f"{nbytes / 2 ** 30:6.2f} GiB" if nbytes else "n/a (no device allocator stats)"


def _device_total_bytes():
  try:
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=True).stdout
    return int(out.split()[0]) * 2 ** 20
  except Exception:  # noqa: BLE001
    return None


def _device_name():
  try:
    return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                          capture_output=True, text=True, check=True).stdout.strip()
  except Exception:  # noqa: BLE001
    return f"cpu ({platform.machine()})"


def _plot(records, path):
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
  for variant in sorted({r["variant"] for r in records}):
    rs = sorted((r for r in records if r["variant"] == variant and r.get("ok") and not r.get("cap_gib")),
                key=lambda r: r["tokens"])
    if not rs:
      continue
    t = [r["tokens"] for r in rs]
    ax1.plot(t, [(r["peak_bytes"] or 0) / 2 ** 30 for r in rs], "o-", label=variant)
    ax2.plot(t, [r["time_s"] * 1e3 for r in rs], "o-", label=variant)
  ax1.set(xlabel="tokens T", ylabel="peak device memory (GiB, inputs included)", title="Peak memory")
  ax2.set(xlabel="tokens T", ylabel="time per layer (ms)", title="Time")
  for ax in (ax1, ax2):
    ax.grid(alpha=0.3)
    ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--tokens", type=int, nargs="+", default=None)
  ap.add_argument("--variants", nargs="+", default=["bf16", "bf16_quant", "dense", "sol"])
  ap.add_argument("--cap-gib", type=float, default=12.0, help="simulated card size for the OOM pass (0: skip)")
  ap.add_argument("--cap-variants", nargs="+", default=["bf16", "dense", "sol"])
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
  out_path = args.out or ("benchmarks/results/e2e_h3_cpu_small.json" if args.small
                          else "benchmarks/results/e2e_h3_h200.json")
  total = _device_total_bytes()
  base = ["--prefix-tokens", str(args.prefix_tokens), "--runs", str(args.runs),
          "--quality-rows", str(args.quality_rows), "--sol-kwargs", args.sol_kwargs] + (["--small"] if args.small else [])
  records, qualities = [], {}
  tmp = tempfile.mkdtemp(prefix="e2e_h3_")
  os.makedirs(os.path.dirname(out_path) or ".", exist_ok=True)

  def save():
    result = {"command": " ".join([sys.executable, "-m", "benchmarks.e2e_h3",
                                   *(argv if argv is not None else sys.argv[1:])]),
              "device": _device_name(), "device_total_bytes": total, "versions": package_versions(),
              "records": records, "quality": {str(k): v for k, v in qualities.items()}}
    with open(out_path, "w") as f:
      json.dump(result, f, indent=1)
  for t in tokens:
    files = {}
    for variant in args.variants:
      files[variant] = os.path.join(tmp, f"{variant}_{t}.npy")
      rec = _run_child(["--child", "run", "--variant", variant, "--tokens", str(t), "--rows-file", files[variant],
                        *base, "--cap-gib", "0"], {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
      rec.setdefault("variant", variant)
      rec.setdefault("tokens", t)
      records.append(rec)
      save()
      print(f"[{variant:10s} T={t:7d}] ok={rec.get('ok')} time={rec.get('time_s', float('nan')) * 1e3:9.1f} ms "
            f"peak={_gib(rec.get('peak_bytes'))} {rec.get('error', '')[:120]}", flush=True)
    q = _run_child(["--child", "quality", "--tokens", str(t), "--rows-files", json.dumps(files), *base],
                   {"XLA_PYTHON_CLIENT_PREALLOCATE": "false"})
    qualities[t] = q
    save()
    print(f"[quality    T={t:7d}] " + json.dumps(q)[:400], flush=True)
  if args.cap_gib and total and not args.small:
    t = max(tokens)
    for variant in args.cap_variants:
      env = {"XLA_PYTHON_CLIENT_PREALLOCATE": "true",
             "XLA_PYTHON_CLIENT_MEM_FRACTION": f"{args.cap_gib * 2 ** 30 / total:.5f}"}
      rec = _run_child(["--child", "run", "--variant", variant, "--tokens", str(t),
                        "--rows-file", os.path.join(tmp, f"cap_{variant}.npy"), *base,
                        "--runs", "1", "--cap-gib", str(args.cap_gib)], env)
      rec.update(variant=variant, tokens=t, cap_gib=args.cap_gib)
      records.append(rec)
      save()
      print(f"[cap {args.cap_gib:g} GiB {variant:10s} T={t}] ok={rec.get('ok')} oom={rec.get('oom')} "
            f"{rec.get('error', '')[:160]}", flush=True)

  # Table.
  print("\n| T | variant | peak GiB | above inputs GiB | time ms | vs bf16 time | bf16 peak / peak | cos | rel L1 |")
  print("|---|---|---|---|---|---|---|---|---|")
  for t in tokens:
    base_rec = next((r for r in records if r["variant"] == "bf16" and r["tokens"] == t
                     and not r.get("cap_gib") and r.get("ok")), None)
    for r in (r for r in records if r["tokens"] == t and not r.get("cap_gib")):
      qual = qualities.get(t, {}).get(r["variant"], {})
      if not r.get("ok"):
        print(f"| {t} | {r['variant']} | failed: {r.get('error', '')[:60]} |||||||")
        continue
      nan = float("nan")
      peak = r["peak_bytes"] / 2 ** 30 if r.get("peak_bytes") else nan
      above = (r["peak_bytes"] - r["input_bytes"]) / 2 ** 30 if r.get("peak_bytes") else nan
      tr = r["time_s"] / base_rec["time_s"] if base_rec else nan
      pr = base_rec["peak_bytes"] / r["peak_bytes"] if base_rec and r.get("peak_bytes") else nan
      print(f"| {t} | {r['variant']} | {peak:.2f} | {above:.2f} | {r['time_s'] * 1e3:.1f} | {tr:.2f}x | "
            f"{pr:.2f}x | {qual.get('cos', float('nan')):.5f} | {qual.get('rel_l1', float('nan')):.4f} |")
  for r in (r for r in records if r.get("cap_gib")):
    print(f"cap {r['cap_gib']:g} GiB, T={r['tokens']}, {r['variant']}: "
          + ("completed" if r.get("ok") else ("OOM" if r.get("oom") else f"failed: {r.get('error', '')[:100]}")))
  save()
  try:
    _plot(records, out_path.replace(".json", ".png"))
  except Exception as e:  # noqa: BLE001
    print(f"plot skipped: {e}")
  print(f"wrote {out_path}")


if __name__ == "__main__":
  main()
