"""Where the time of ``packed_attention``'s Hopper fast path goes, at H3 scale.

  XLA_PYTHON_CLIENT_PREALLOCATE=false python3 -m benchmarks.probe_fast_path --out $OUT/fast_path_probe.json

One process on an H200, B=1 H=56 D=128 T=152,263 (all int4, ragged last block), the
same random inputs as ``bench_attention``. Times (median of --repeats after --warmup):
jax cuDNN BF16 attention (the peer), the whole fast path (``backend="auto"``), and its
pieces alone: the Mosaic-GPU first pass (full int4 blocks x whole 256-row q tiles,
saving lse) at Tq = T (q through registers: T % 8 != 0) and at Tq = T rounded down to
a multiple of 8 (q by TMA; same tiles, same work), the Triton continuation over the
rest (ragged int4 block, un-rotation), and the Triton pass over the ragged q rows.
Writes JSON with the command, device and versions.
"""
from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import functools  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.bench_attention import _make_inputs, _time  # noqa: E402
from benchmarks.run_info import package_versions  # noqa: E402
from pallas_kernels import attention as attn  # noqa: E402
from pallas_kernels import attention_mgpu as amg  # noqa: E402


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--tokens", type=int, default=152263)
  ap.add_argument("--heads", type=int, default=56)
  ap.add_argument("--warmup", type=int, default=1)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--out", default="benchmarks/results/fast_path_probe.json")
  args = ap.parse_args(argv)
  b, t, h, d = 1, args.tokens, args.heads, 128
  q, k, v, packed = _make_inputs(b, t, h, d, seed=0)
  sync = jax.block_until_ready
  sm_scale = d ** -0.5
  plan = attn._fast_path_plan(packed.meta, t, 256, amg.DEFAULT_VARIANT)  # packed_attention's default block_q
  ops = amg.int4_store_operands(packed)
  first = jax.jit(functools.partial(amg._attention_call, cfg=plan.cfg, sm_scale=sm_scale,
                                    num_q_tiles=plan.n_tiles, kv_steps=plan.kv_steps, save_lse=True))
  tri = functools.partial(attn._packed_attention_impl, sm_scale=sm_scale, q_seg=None, kv_seg=None, kv_mask=None,
                          keep_rotated=False, interpret=False, block_q=plan.block_q, num_warps=None,
                          num_stages=None)
  cont = jax.jit(lambda q, packed, o, lse: tri(q, packed, init=(o, lse), out=o, q_tiles=plan.cont_tiles,
                                               class_first={"int4": plan.int4_done}))
  tail = jax.jit(lambda q, packed: tri(q, packed, q_tiles=plan.tail_tiles))
  cudnn = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, implementation="cudnn"))
  t8 = t // 8 * 8
  q8 = q[:, :t8]
  o, lse = first(q, *ops)
  sync((o, lse))
  cases = [
      ("jax cuDNN bf16", lambda: cudnn(q, k, v)),
      ("fast path (packed_attention auto)", lambda: attn.packed_attention(q, packed)),
      (f"first pass, Tq={t} (q via registers)", lambda: first(q, *ops)),
      (f"first pass, Tq={t8} (q via TMA)", lambda: first(q8, *ops)),
      ("continuation (Triton, init from first pass)", lambda: cont(q, packed, o, lse)),
      (f"ragged q rows {plan.cont_tiles[1] * plan.block_q}..{t} (Triton)", lambda: tail(q, packed)),
  ]
  results = []
  for name, fn in cases:
    entry = {"name": name}
    try:
      med, all_t = _time(fn, args.warmup, args.repeats, sync)
      entry |= {"seconds": med, "all_seconds": all_t}
    except Exception as e:  # noqa: BLE001
      entry["error"] = f"{type(e).__name__}: {e}"[:2000]
      traceback.print_exc()
    results.append(entry)
    print(f"{name:55s} {entry.get('seconds', float('nan')):9.4f} s", flush=True)
  base = results[0].get("seconds")
  for e in results:
    e["ratio_to_jax_cudnn"] = e.get("seconds") / base if (base and e.get("seconds")) else None
  record = {"command": " ".join(["python3 -m benchmarks.probe_fast_path", *(argv or sys.argv[1:])]),
            "device": str(jax.devices()[0].device_kind), "shape": {"B": b, "T": t, "H": h, "D": d},
            "variant": amg.DEFAULT_VARIANT, "versions": package_versions(), "results": results}
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(record, f, indent=1)
  print(f"wrote {args.out}")


if __name__ == "__main__":
  main()
