"""Quality of dense attention over packed K/V against float32 attention (CPU-runnable).

DiT-like data (``pallas_kernels.testing.dit_qkv``) with a conditioning prefix. For every
K/V scheme pair and precision policy, the packed reference (the format dequantized,
version 2 since Dec 7; ``results/attention_quality.json`` was written with v1, bf16 q)
is compared with float32 attention on the unquantized q, k, v; the Pallas kernel
(interpret mode) is run on a query subset to show it reproduces those numbers.
Remedies that format v1 could not store (finer groups, softmax-exact smoothing,
symmetric vs asymmetric) are simulated with fake quantization (v1's float32 parameters).

  python -m benchmarks.attention_quality [--tokens 4096 --heads 4 --seeds 0]
  python -m benchmarks.attention_quality --int8-qk --seeds 0 1 2   # Dense(qk="int8") vs bf16 Q.K

Writes benchmarks/results/attention_quality.json and prints a table.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import formats as fmt  # noqa: E402
from pallas_kernels.testing import dit_qkv, fake_quant, quality  # noqa: E402
from benchmarks.common import package_versions  # noqa: E402
from formats.reference import attention_f32  # noqa: E402
from pallas_kernels import Dense  # noqa: E402
from pallas_kernels.attention import packed_attention, packed_attention_reference  # noqa: E402

GOALS = {"int4": {"cos": 0.999, "rel_l1": 0.05}, "int8": {"cos": 0.9999}}


def _chunked(fn, q, chunk=512):
  """fn(q_chunk) over query chunks, concatenated on the token axis (bounds memory)."""
  return np.concatenate([np.asarray(fn(q[:, i:i + chunk])) for i in range(0, q.shape[1], chunk)], axis=1)


def _policies(t, prefix):
  return {
      "int4": (),
      "int4+prefix_int8": ((0, prefix, "int8"),),
      "int4+prefix_bf16": ((0, prefix, "bf16"),),
      "int8": ((0, t, "int8"),),
      "bf16": ((0, t, "bf16"),),
  }


def _goal(policy, q):
  """'pass'/'miss' against the issue's goals, None where no goal applies."""
  if policy.startswith("int4"):
    g = GOALS["int4"]
    return "pass" if q["cos"] >= g["cos"] and q["rel_l1"] <= g["rel_l1"] else "miss"
  if policy == "int8":
    return "pass" if q["cos"] >= GOALS["int8"]["cos"] else "miss"
  return None


# --------------------------------------------------------------------------------------
# Fake quantization for remedies (format v1 stores none of these; float32 parameters, as v1)
# --------------------------------------------------------------------------------------
def _block_mean(x, block=64):
  b, t, h, d = x.shape
  m = x.reshape(b, t // block, block, h, d).mean(axis=2, keepdims=True)
  return np.broadcast_to(m, (b, t // block, block, h, d)).reshape(x.shape)


def _remedies(q_bf16, k_rot, v_rot, r_v, ref, d, prefix):
  """Simulated int4 variants; each returns its quality vs the float32 reference.

  Smoothing is softmax-exact: a per-channel K offset common to all keys shifts every
  logit of a query row equally; a per-block V mean is added back through the block's
  probability mass, which the format's per-block V sums already provide.
  """
  kq = lambda x: fake_quant(x, 64, 1, param_bits=32)              # format v1: K channel, 64 tokens
  vq = lambda x: fake_quant(x, 1, d, param_bits=32)               # format v1: V token, whole head dim
  mu_k = k_rot.mean(axis=1, keepdims=True)
  mb_v = _block_mean(v_rot)
  p = -(-prefix // 64) * 64  # the boundary block takes the higher class
  cases = {
      "v1 default (K ch64, V tok)": (kq(k_rot), vq(v_rot)),
      "K ch64, V tok symmetric": (kq(k_rot), fake_quant(v_rot, 1, d, symmetric=True, param_bits=32)),
      "K ch64 symmetric, V tok": (fake_quant(k_rot, 64, 1, symmetric=True, param_bits=32), vq(v_rot)),
      "K tok + exact K smoothing, V tok": (fake_quant(k_rot - mu_k, 1, d, param_bits=32) + mu_k, vq(v_rot)),
      "K ch64, V tok - block mean (exact)": (kq(k_rot), vq(v_rot - mb_v) + mb_v),
      "K ch32, V g32": (fake_quant(k_rot, 32, 1, param_bits=32), fake_quant(v_rot, 1, 32, param_bits=32)),
      "K ch16, V tok": (fake_quant(k_rot, 16, 1, param_bits=32), vq(v_rot)),
      "K ch64, V g16": (kq(k_rot), fake_quant(v_rot, 1, 16, param_bits=32)),
      "K ch16, V g16": (fake_quant(k_rot, 16, 1, param_bits=32), fake_quant(v_rot, 1, 16, param_bits=32)),
      "K ch32, V g32, prefix int8": None,
  }
  k32, v32 = fake_quant(k_rot, 32, 1, param_bits=32), fake_quant(v_rot, 1, 32, param_bits=32)
  k8, v8 = fake_quant(k_rot, 64, 1, 255, param_bits=32), fake_quant(v_rot, 1, d, 255, param_bits=32)
  cases["K ch32, V g32, prefix int8"] = (np.concatenate([k8[:, :p], k32[:, p:]], 1),
                                         np.concatenate([v8[:, :p], v32[:, p:]], 1))
  out = {}
  for name, (k, v) in cases.items():
    o = _chunked(lambda qc: attention_f32(qc, k, v, sm_scale=d ** -0.5), q_bf16)
    out[name] = quality(o @ r_v.T, ref)
  return out


def _mean(qs):
  return {k: float(np.mean([q[k] for q in qs])) for k in qs[0]}


def int8_qk_rows(tokens: int, heads: int, head_dim: int, seeds) -> list:
  """``Dense(qk="int8")`` against bf16 Q.K, each against float32 attention on the same
  unquantized q, k, v, with K/V stored bf16 (so the rows show the dot's own error):
  DiT-like data at ``tokens`` per seed, and the committed real sample's two layers
  (SmolLM2-135M, T = 1,024, K/V heads repeated to the query heads). The whole
  sequence runs through the kernel (interpret mode), as a self-attention layer does."""
  from benchmarks.kv_quality import real_layers
  data = []
  for seed in seeds:
    q, k, v, _, _ = dit_qkv(tokens, heads, head_dim, prefix_tokens=tokens // 10, seed=seed)
    data.append((f"dit_like seed {seed}", np.asarray(q), np.asarray(k), np.asarray(v)))
  layers, _, _ = real_layers(0, (), True)
  for name, (q, k, v) in layers.items():
    rep = q.shape[1] // k.shape[1]
    data.append((f"real {name}", q[None], np.repeat(k, rep, 1)[None], np.repeat(v, rep, 1)[None]))
  rows = []
  for name, q, k, v in data:
    q, k, v = (np.asarray(a, np.float32) for a in (q, k, v))
    b, t, h, d = q.shape
    meta = fmt.PackedKVMeta(b, h, d, t, (fmt.CLASS_ID["bf16"],) * (-(-t // fmt.BLOCK)))
    r_k, r_v = fmt.hadamard_rotation(d, 0), fmt.hadamard_rotation(d, 1)
    packed = fmt.quantize_reference(jnp.asarray(k @ r_k), jnp.asarray(v @ r_v), meta)
    ref = _chunked(lambda qc: attention_f32(qc, k, v, sm_scale=d ** -0.5), q)
    for qk in ("bf16", "int8"):
      out = packed_attention(jnp.asarray(q @ r_k, jnp.bfloat16), packed, Dense(qk=qk, method="streamed"))
      rows.append({"data": name, "tokens": t, "heads": h, "qk": qk, **quality(np.asarray(out, np.float32), ref)})
  return rows


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--tokens", type=int, default=4096)
  ap.add_argument("--heads", type=int, default=4)
  ap.add_argument("--head-dim", type=int, default=128)
  ap.add_argument("--prefix-frac", type=float, default=0.1)
  ap.add_argument("--seeds", type=int, nargs="+", default=[0])
  ap.add_argument("--kernel-rows", type=int, default=128, help="query rows run through the interpret-mode kernel")
  ap.add_argument("--int8-qk", action="store_true",
                  help="only Dense(qk='int8') against bf16 Q.K on bf16 K/V (DiT-like and the real sample)")
  ap.add_argument("--out", default=None, help="default results/attention_quality.json "
                                              "(--int8-qk: results/attention_quality_int8qk_<date>.json)")
  args = ap.parse_args(argv)
  if args.int8_qk:
    from benchmarks import common
    rows = int8_qk_rows(args.tokens, args.heads, args.head_dim, args.seeds)
    print(common.table(rows, [("data", "data", "{}"), ("T", "tokens", "{}"), ("Q.K", "qk", "{}"),
                              ("cos", "cos", "{:.6f}"), ("rel L2", "rel_l2", "{:.2e}")]))
    out = args.out or os.path.join(common.RESULTS, f"attention_quality_int8qk_{time.strftime('%Y-%m-%d')}.json")
    common.write_json(out, common.run_record() | {"rows": rows})
    return rows
  args.out = args.out or os.path.join(os.path.dirname(__file__), "results", "attention_quality.json")
  t, h, d = args.tokens, args.heads, args.head_dim
  # Not block-aligned (text lengths are arbitrary): with a mixed policy the
  # boundary block takes the prefix's class.
  prefix = int(round(args.prefix_frac * t))
  t0 = time.time()
  rows = []
  remedies = {}
  for seed in args.seeds:
    q, k, v, _, _ = dit_qkv(t, h, d, prefix_tokens=prefix, seed=seed)
    ref = _chunked(lambda qc: attention_f32(qc, k, v, sm_scale=d ** -0.5), q)
    r_k, r_v = fmt.hadamard_rotation(d, 0), fmt.hadamard_rotation(d, 1)
    q_bf16 = jnp.asarray(q @ r_k, jnp.bfloat16)
    k_rot, v_rot = (k @ r_k).astype(np.float32), (v @ r_v).astype(np.float32)
    sub = np.linspace(0, t - 1, args.kernel_rows).astype(int)  # prefix and video rows
    for k_scheme in fmt.K_SCHEMES:
      for v_scheme in fmt.V_SCHEMES:
        for policy, ranges in _policies(t, prefix).items():
          meta = fmt.PackedKVMeta(1, h, d, t, fmt.resolve_block_classes(t, ranges), k_scheme=k_scheme,
                                  v_scheme=v_scheme)
          packed = fmt.quantize_reference(jnp.asarray(k_rot), jnp.asarray(v_rot), meta)
          out = _chunked(lambda qc: packed_attention_reference(qc, packed), q_bf16)
          row = {"seed": seed, "k_scheme": k_scheme, "v_scheme": v_scheme, "policy": policy,
                 "bits_per_kv_value": 8 * packed.nbytes() / (2 * h * t * d), **quality(out, ref)}
          if args.kernel_rows and policy in ("int4", "int4+prefix_int8", "int8") and \
              (k_scheme, v_scheme) == (fmt.DEFAULT_K_SCHEME, fmt.DEFAULT_V_SCHEME):
            ko = packed_attention(q_bf16[:, sub], packed, Dense(block_q=64), interpret=True)
            kq = quality(np.asarray(ko, np.float32), ref[:, sub])
            row["kernel_rows"] = {"rows": len(sub), **kq,
                                  "reference_same_rows": quality(out[:, sub], ref[:, sub])}
          row["goal"] = _goal(policy, row)
          rows.append(row)
    for name, qv in _remedies(q_bf16, k_rot, v_rot, r_v, ref, d, prefix).items():
      remedies.setdefault(name, []).append(qv)

  result = {
      "command": " ".join([os.path.basename(sys.executable), "-m", "benchmarks.attention_quality",
                           *(argv if argv is not None else sys.argv[1:])]),
      "shape": {"B": 1, "T": t, "H": h, "D": d, "prefix_tokens": prefix},
      "goals": GOALS, "versions": package_versions(),
      "seconds": round(time.time() - t0, 1), "results": rows,
      "remedies_simulated_int4": {n: {"per_seed": v, **_mean(v)} for n, v in remedies.items()},
  }
  os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
  with open(args.out, "w") as f:
    json.dump(result, f, indent=1)

  print(f"T={t} H={h} D={d} prefix={prefix} seeds={args.seeds}  (vs float32 attention on unquantized q/k/v)")
  print(f"{'seed':4s} {'K':8s} {'V':10s} {'policy':18s} {'bits':>5s} {'cos':>9s} {'rel_l1':>7s} {'rel_l2':>7s} goal   kernel rows (cos / rel_l1)")
  for r in rows:
    kr = r.get("kernel_rows")
    ktxt = f"{kr['cos']:.6f} / {kr['rel_l1']:.4f}  (ref same rows {kr['reference_same_rows']['cos']:.6f} / " \
           f"{kr['reference_same_rows']['rel_l1']:.4f})" if kr else ""
    print(f"{r['seed']:<4d} {r['k_scheme']:8s} {r['v_scheme']:10s} {r['policy']:18s} {r['bits_per_kv_value']:5.2f} "
          f"{r['cos']:9.6f} {r['rel_l1']:7.4f} {r['rel_l2']:7.4f} {r['goal'] or '-':6s} {ktxt}")
  print(f"\nINT4 remedies (fake-quantized; mean over seeds {args.seeds}; worst-seed cos in brackets):")
  for name, per_seed in remedies.items():
    qv = _mean(per_seed)
    ok = qv["cos"] >= GOALS["int4"]["cos"] and qv["rel_l1"] <= GOALS["int4"]["rel_l1"]
    worst = min(x["cos"] for x in per_seed)
    print(f"  {name:36s} cos {qv['cos']:.6f} [{worst:.6f}]  rel_l1 {qv['rel_l1']:.4f}  {'pass' if ok else 'miss'}")
  print(f"\nwrote {args.out} in {result['seconds']} s")


if __name__ == "__main__":
  main()
