"""Per-call overhead of the PyTorch bridge over calling the JAX kernels directly.

Why: the bridge promises no copies, but every call still pays validation, DLPack
hand-offs (one per input and output tensor: 7 in / 17 out for the projection, 17-20
in / 1 out for attention), torch's custom-op dispatch and a cross-stream event per
hand-off. This measures that cost, in one process, against calling the very JAX
function the bridge calls (``qkv_projection.streamed_qkv``,
``attention.packed_attention``) on JAX views of the same buffers, with the same
settings (the bridge's ops take them as JSON text and parse them on every call, which
is part of the overhead measured).

Method: for each op and shape, warm both paths up, then alternate them for ``--iters``
iterations and take medians of
* ``sync``: call + device synchronize (``torch.cuda.synchronize``, which also waits
  for JAX's streams), i.e. the latency a caller sees;
* ``host``: time until the call returns (asynchronous dispatch), i.e. the host time
  the bridge adds to a pipelined model.
Overhead = bridge median - direct median. The DLPack hand-off alone is timed too.

Usage (device machine):  python benchmarks/bench_bridge.py
CPU smoke (tiny, interpret mode):  python benchmarks/bench_bridge.py --cpu-smoke
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch_bridge as tb  # noqa: E402  (first: allocator policy before JAX starts)
import jax  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402

import formats  # noqa: E402
from formats import KVStorage  # noqa: E402
from pallas_kernels import attention as jax_attn  # noqa: E402
from pallas_kernels import backend  # noqa: E402
from pallas_kernels import qkv_projection as jax_qkv  # noqa: E402
from pallas_kernels.attention_config import DEFAULT_SCRATCH_BYTES, Dense  # noqa: E402
from pallas_kernels.qkv_layout import QKVLayout, QKVWeights  # noqa: E402
from benchmarks.common import package_versions  # noqa: E402
from pallas_kernels.rope import rope_3d_angles, rope_tables  # noqa: E402
from torch_bridge import dlpack  # noqa: E402

GPU_SHAPES = [
    dict(name="small", b=1, t=1024, hidden=1024, h=8, d=128),
    dict(name="medium", b=1, t=8192, hidden=2048, h=16, d=128),
    dict(name="h3_t16k", b=1, t=16384, hidden=5376, h=56, d=128),
]
CPU_SHAPES = [dict(name="cpu_tiny", b=1, t=150, hidden=128, h=2, d=64)]


def _sync(device):
  if device.type == "cuda":
    torch.cuda.synchronize(device)


def _time(fn, device, sync: bool) -> float:
  t0 = time.perf_counter()
  out = fn()
  if sync:
    _sync(device)
    # CPU: JAX dispatches asynchronously; torch outputs from DLPack are already ready.
    for leaf in jax.tree_util.tree_leaves(out):
      if isinstance(leaf, jax.Array):
        leaf.block_until_ready()
  dt = time.perf_counter() - t0
  del out
  return dt


def _compare(direct, bridge, device, warmup, iters) -> dict:
  """Medians (ms) of both paths, interleaved so drift hits both alike."""
  for _ in range(warmup):
    _time(direct, device, True)
    _time(bridge, device, True)
  res = {}
  for mode in ("sync", "host"):
    d, b = [], []
    for _ in range(iters):
      d.append(_time(direct, device, mode == "sync"))
      _sync(device)
      b.append(_time(bridge, device, mode == "sync"))
      _sync(device)
    md, mb = statistics.median(d) * 1e3, statistics.median(b) * 1e3
    res[mode] = {"direct_ms": md, "bridge_ms": mb, "overhead_ms": mb - md,
                 "overhead_pct": 100.0 * (mb - md) / md if md else None,
                 "direct_p10_p90_ms": [float(np.percentile(d, 10) * 1e3), float(np.percentile(d, 90) * 1e3)],
                 "bridge_p10_p90_ms": [float(np.percentile(b, 10) * 1e3), float(np.percentile(b, 90) * 1e3)]}
  return res


def bench_shape(shape, device, interpret, warmup, iters) -> dict:
  b, t, hidden, h, d = (shape[k] for k in ("b", "t", "hidden", "h", "d"))
  rot = (3 * d) // 4
  g = torch.Generator(device="cpu").manual_seed(0)
  x = (torch.randn(b, t, hidden, generator=g) * 0.5).to(torch.bfloat16).to(device)
  w = (torch.randn(hidden, 3 * h * d, generator=g) * hidden ** -0.5).to(torch.bfloat16).to(device)
  qn = torch.ones(d, device=device)
  kn = torch.ones(d, device=device)
  pos = np.stack([np.arange(t), np.zeros(t), np.zeros(t)], 1)
  cos, sin = rope_tables(rope_3d_angles(pos, freqs_per_axis=rot // 6), d)
  cos, sin = torch.tensor(cos, device=device), torch.tensor(sin, device=device)
  storage = KVStorage(block_classes=[0] * (-(-t // formats.BLOCK)))  # every block int4, K channel, V token

  scratch = DEFAULT_SCRATCH_BYTES
  layout = QKVLayout.h3(h, d, rot)
  qkv_args = (x, w, None, qn, kn, cos, sin, layout.to_json(), storage.to_json(), "auto", scratch,
              None, None, None, None, None, interpret)   # no added tokens
  jx = dlpack.to_jax(x, "x")
  jweights = QKVWeights(dlpack.to_jax(w, "w"), None, dlpack.to_jax(qn, "qn"), dlpack.to_jax(kn, "kn"))
  jkw = dict(rope_cos=dlpack.to_jax(cos, "cos"), rope_sin=dlpack.to_jax(sin, "sin"), layout=layout,
             storage=storage, method="auto", scratch_bytes=scratch, interpret=interpret)
  out = {"shape": shape}
  out["streamed_qkv"] = _compare(lambda: jax_qkv.streamed_qkv(jx, jweights, **jkw),
                                 lambda: torch.ops.packed_kv.streamed_qkv(*qkv_args),
                                 device, warmup, iters)

  res = torch.ops.packed_kv.streamed_qkv(*qkv_args)
  q, packed = res[0], list(res[1:])
  meta = storage.meta(b, h, d, t)
  jq = dlpack.to_jax(q, "q")
  jpacked = formats.PackedKV(meta, {n: dlpack.to_jax(a, n) for n, a in zip(formats.ARRAY_NAMES, packed)})
  attention = Dense(method="auto", scratch_bytes=scratch)
  attn_args = (q, packed, t, storage.to_json(), attention.to_json(), None, None, None, None, False, interpret)
  out["packed_attention"] = _compare(
      lambda: jax_attn.packed_attention(jq, jpacked, attention, interpret=interpret),
      lambda: torch.ops.packed_kv.packed_attention(*attn_args), device, warmup, iters)

  # The hand-offs alone (host time; no device work is queued by them).
  ho = {}
  for name, fn in (("to_jax_x", lambda: dlpack.to_jax(x, "x")),
                   ("to_torch_q", lambda: dlpack.to_torch(jq, "q")),
                   ("check_tensor_x", lambda: dlpack.check_tensor(x, "x"))):
    ts = []
    for _ in range(max(iters, 50)):
      t0 = time.perf_counter()
      fn()
      ts.append(time.perf_counter() - t0)
    ho[name + "_us"] = statistics.median(ts) * 1e6
  out["handoff"] = ho
  return out


def _git_rev():
  try:
    return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                          cwd=os.path.dirname(os.path.abspath(__file__)), timeout=10).stdout.strip() or None
  except Exception:
    return None


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
  p.add_argument("--cpu-smoke", action="store_true", help="tiny shapes, interpret mode, CPU")
  p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/"
                 "bridge_overhead_h200.json; with --cpu-smoke a file in the temp folder: a smoke run "
                 "measures nothing worth keeping)")
  p.add_argument("--iters", type=int, default=None)
  p.add_argument("--warmup", type=int, default=None)
  p.add_argument("--shapes", default=None, help="comma-separated shape names to run")
  args = p.parse_args(argv)
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  if args.cpu_smoke:
    device, interpret, shapes = torch.device("cpu"), True, CPU_SHAPES
    iters, warmup = args.iters or 5, args.warmup or 1
    default_out = "bridge_overhead_cpu_smoke.json"
  else:
    if not torch.cuda.is_available() or not backend.on_gpu():
      sys.exit("no CUDA device visible to both torch and JAX; use --cpu-smoke on a CPU machine")
    device, interpret, shapes = torch.device("cuda"), None, GPU_SHAPES
    iters, warmup = args.iters or 30, args.warmup or 3
    default_out = "bridge_overhead_h200.json"
  if args.shapes:
    keep = set(args.shapes.split(","))
    shapes = [s for s in shapes if s["name"] in keep]
  out_dir = tempfile.gettempdir() if args.cpu_smoke else os.path.join(root, "benchmarks", "results")
  out_path = args.out or os.path.join(out_dir, default_out)

  results = []
  for shape in shapes:
    r = bench_shape(shape, device, interpret, warmup, iters)
    results.append(r)
    for op in ("streamed_qkv", "packed_attention"):
      s = r[op]["sync"]
      print(f"{shape['name']:>10} {op:>16}: direct {s['direct_ms']:.3f} ms, bridge "
            f"{s['bridge_ms']:.3f} ms, overhead {s['overhead_ms']:+.3f} ms "
            f"(host {r[op]['host']['overhead_ms']:+.3f} ms)", flush=True)

  dev = jax.devices()[0]
  record = {
      "benchmark": "bridge_overhead",
      "command": " ".join([os.path.basename(sys.executable)] + sys.argv),
      "device": (torch.cuda.get_device_name(device) if device.type == "cuda"
                 else platform.processor() or "cpu"),
      "jax_device": str(dev),
      "versions": package_versions() | {"cuda_torch": torch.version.cuda},
      "git_rev": _git_rev(),
      "allocator": {k: v for k, v in tb.allocator_status().items()},
      "iters": iters, "warmup": warmup, "interpret": bool(interpret),
      "method": "medians of interleaved direct/bridge calls; sync = call + device synchronize, "
                "host = until the call returns; overhead = bridge - direct",
      "results": results,
  }
  os.makedirs(os.path.dirname(out_path), exist_ok=True)
  with open(out_path, "w") as f:
    json.dump(record, f, indent=2)
  print(f"wrote {out_path}")


if __name__ == "__main__":
  main()
