"""Dense attention over packed K/V against its peers, in one process, with quality per row.

  python -m benchmarks.bench_attention                    # GPU: T = 38,247 and 152,263
  python -m benchmarks.bench_attention --tokens 256 --heads 2 --cpu-smoke

Data: one H3-style layer's q, k, v on DiT-like inputs (``benchmarks.h3_layer``),
projected in float32; the packed K/V quantizes the rotated k, v (format v1), all int4
or with an int8 conditioning prefix (``--default-class k5v4``: the other blocks in that
class; the fused row then reports the kernel's refusal). Rows, timed in the same process (median of
``--repeats`` after ``--warmup``):

* jax cuDNN and torch SDPA cuDNN on bf16 q, k, v (the speed bar);
* ``packed_attention(q, packed, Dense(method="streamed", scratch_bytes=...))`` at 128 MiB,
  512 MiB and 2 GiB of scratch;
* ``packed_attention(q, packed, Dense(method="fused"))`` (the Triton kernel, no scratch);
* ``packed_attention(q, packed, Dense(qk="int8", num_warps=..., num_stages=...))``: int8
  Q.K in Sol's loop over decoded head groups, four launches;
* comfy-kitchen ``int8_attention`` on bf16 q, k, v (the peer users run today; its row
  is skipped, saying why, when comfy_kitchen does not import).

Quality: cos, rel L1 and rel L2 of each row's output against float32 attention of
the unquantized layer on ``--check-rows`` query rows. Writes
``benchmarks/results/attention_<card>_<date>.json`` and the scorecard's dense entries.
"""
from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # share the GPU with torch

import argparse  # noqa: E402
import functools  # noqa: E402
import sys  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import formats as fmt  # noqa: E402
from benchmarks import common, h3_layer  # noqa: E402
from pallas_kernels.testing import quality  # noqa: E402
from pallas_kernels import Dense  # noqa: E402
from pallas_kernels.attention import packed_attention  # noqa: E402

STREAMED = (("streamed_128mib", 128 << 20), ("streamed_512mib", 512 << 20), ("streamed_2gib", 2 << 30))
INT8_QK_LAUNCH = ((4, 2), (4, 3), (8, 2), (8, 3))   # Dense(qk="int8") launches swept (num_warps, num_stages)


def build(tokens, heads, head_dim, prefix, seed=0, default_class="int4"):
  """bf16 q, k, v (unrotated, for the peers), rotated bf16 q and the PackedKV, and the
  float32 reference output on the check rows."""
  shape = h3_layer.LayerShape(tokens=tokens, hidden=min(5376, 64 * heads), heads=heads, head_dim=head_dim,
                              rot_dim=3 * head_dim // 4, prefix_tokens=prefix, prefix_class="int8",
                              default_class=default_class)
  inp = h3_layer.make_inputs(shape, seed=seed)
  # One jitted program: its float32 temporaries (the 13 GB QKV at T = 152k) live inside
  # XLA and are freed at once, instead of eager buffers fragmenting the BFC pool.
  q32, k32, v32 = jax.jit(lambda i: h3_layer.project_reference(i, shape, jnp.float32))(inp)
  del inp
  meta = shape.storage.meta(1, heads, head_dim, tokens)
  r_k = jnp.asarray(fmt.hadamard_rotation(head_dim, meta.rotation_seed_k))
  r_v = jnp.asarray(fmt.hadamard_rotation(head_dim, meta.rotation_seed_v))
  packed = jax.jit(lambda k, v: fmt.quantize_reference(k @ r_k, v @ r_v, meta))(k32, v32)
  q_rot = jax.jit(lambda q: (q @ r_k).astype(jnp.bfloat16))(q32)
  return shape, q32, k32, v32, q_rot, packed


def reference_rows(q32, k32, v32, rows, chunk=32):
  """float32 softmax attention for ``rows`` of q against all keys, one head at a time."""
  d = q32.shape[-1]

  @jax.jit
  def one(qr, k, v):  # k, v are arguments: a closure would bake them into the program
    def head(h):  # one head's K/V slice at a time: no transposed copy of all of K and V
      kh = jax.lax.dynamic_index_in_dim(k[0], h, 1, keepdims=False)
      vh = jax.lax.dynamic_index_in_dim(v[0], h, 1, keepdims=False)
      qh = jax.lax.dynamic_index_in_dim(qr, h, 1, keepdims=False)
      return jax.nn.softmax(qh @ kh.T / np.sqrt(d), -1) @ vh
    return jax.lax.map(head, jnp.arange(qr.shape[1]))

  # On the host CPU: at T = 152k the f32 K and V already fill the card next to the
  # benchmark's own buffers, and a few query rows are cheap there.
  cpu = jax.devices("cpu")[0]
  k32, v32 = jax.device_put(k32, cpu), jax.device_put(v32, cpu)
  outs = [np.asarray(one(jax.device_put(q32[0, rows[i:i + chunk]], cpu), k32, v32)).transpose(1, 0, 2)
          for i in range(0, len(rows), chunk)]
  return np.concatenate(outs, 0)


def torch_peers():
  """(name, fn(tq, tk, tv) on BHSD bf16 torch tensors) of the torch peers that import."""
  import torch
  from torch.nn.attention import SDPBackend, sdpa_kernel
  peers = []

  def sdpa(q, k, v):
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
      return torch.nn.functional.scaled_dot_product_attention(q, k, v)
  peers.append(("torch_sdpa_cudnn", sdpa, None))
  try:
    from comfy_kitchen.sage_attention import int8_attention
    peers.append(("comfy_int8_attention", int8_attention, None))
  except Exception as e:  # noqa: BLE001 - the row says why it is missing
    peers.append(("comfy_int8_attention", None, f"comfy_kitchen did not import: {str(e)[:200]}"))
  return peers


def run(args, tokens, prefix):
  on_gpu = jax.default_backend() == "gpu"
  shape, q32, k32, v32, q_rot, packed = build(tokens, args.heads, args.head_dim, prefix,
                                              default_class=args.default_class)
  rng = np.random.default_rng(0)
  rows = np.sort(rng.choice(tokens, size=min(args.check_rows, tokens), replace=False))
  ref = reference_rows(q32, k32, v32, rows)
  q, k, v = (x.astype(jnp.bfloat16) for x in (q32, k32, v32))
  del q32, k32, v32
  out_rows = []

  def add(name, fn, sync=None, to_rows=None, note=None):
    rec = {"tokens": tokens, "prefix_int8": prefix, "default_class": args.default_class, "variant": name}
    if fn is None:
      rec.update(ok=False, skipped=note)
      out_rows.append(rec)
      print(f"  {name}: skipped ({note})", flush=True)
      return rec
    try:
      rec["time_s"], rec["times_s"] = common.time_fn(fn, args.warmup, args.repeats, sync)
      o = fn()
      got = to_rows(o) if to_rows else np.asarray(o[0, rows], np.float32)
      rec.update(quality(got, ref), ok=True)
      del o
    except Exception as e:  # noqa: BLE001 - a failed row is a result
      rec.update(ok=False, error=str(e).splitlines()[0][:300])
    out_rows.append(rec)
    print(f"  {name}: {rec.get('time_s', float('nan')):.4f} s  cos {rec.get('cos', float('nan')):.7f}",
          flush=True)
    return rec

  cudnn = jax.jit(functools.partial(jax.nn.dot_product_attention, implementation="cudnn" if on_gpu else None))
  base = add("jax_cudnn_bf16", lambda: cudnn(q, k, v))
  for name, budget in STREAMED:
    add(name, lambda budget=budget: packed_attention(q_rot, packed, Dense(method="streamed", scratch_bytes=budget)))
  add("fused", lambda: packed_attention(q_rot, packed, Dense(method="fused")))
  for warps, stages in INT8_QK_LAUNCH:   # int8 Q.K in Sol's loop over decoded groups (512 MiB)
    add(f"int8_qk_w{warps}s{stages}",
        lambda w=warps, st=stages: packed_attention(q_rot, packed, Dense(qk="int8", num_warps=w, num_stages=st)))
  if on_gpu:
    import torch
    tq, tk, tv = (torch.from_dlpack(x).permute(0, 2, 1, 3) for x in (q, k, v))
    tq, tk, tv = (x.contiguous() for x in (tq, tk, tv))
    sync = lambda _: torch.cuda.synchronize()
    to_rows = lambda o: o[0].permute(1, 0, 2)[torch.as_tensor(rows, device=o.device)].float().cpu().numpy()
    for name, fn, note in torch_peers():
      add(name, None if fn is None else (lambda fn=fn: fn(tq, tk, tv)), sync, to_rows, note)
    del tq, tk, tv
  for r in out_rows:
    if r.get("time_s") and base.get("time_s"):
      r["vs_jax_cudnn"] = r["time_s"] / base["time_s"]
  return out_rows


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--tokens", default="38247,152263", help="comma-separated T values")
  ap.add_argument("--heads", type=int, default=56)
  ap.add_argument("--head-dim", type=int, default=128)
  ap.add_argument("--prefixes", default="0,4096", help="int8 prefix lengths to run (0: all int4)")
  ap.add_argument("--default-class", default="int4", help="every other block's class (formats.CLASSES)")
  ap.add_argument("--warmup", type=int, default=1)
  ap.add_argument("--repeats", type=int, default=3)
  ap.add_argument("--check-rows", type=int, default=128)
  ap.add_argument("--cpu-smoke", action="store_true", help="tiny interpret-mode run on a CPU")
  ap.add_argument("--out", default=None, help="default benchmarks/results/attention_<card>_<date>.json")
  args = ap.parse_args(argv)
  if jax.default_backend() != "gpu" and not args.cpu_smoke:
    sys.exit("no GPU visible to JAX: pass --cpu-smoke for a tiny interpret-mode run")
  card = common.device_name()
  rows = []
  for t in (int(x) for x in args.tokens.split(",")):
    for p in (int(x) for x in args.prefixes.split(",")):
      print(f"T={t} int8 prefix={p}", flush=True)
      rows += run(args, t, min(p, t // 2))
  print(f"card: {card}")
  print(common.table(rows, [("T", "tokens", "{}"), ("prefix", "prefix_int8", "{}"), ("variant", "variant", "{}"),
                            ("s", "time_s", "{:.4f}"), ("vs cuDNN", "vs_jax_cudnn", "{:.3f}"),
                            ("cos", "cos", "{:.7f}"), ("rel L1", "rel_l1", "{:.2e}")]))
  out = args.out or common.result_path("attention" + ("_cpu_smoke" if args.cpu_smoke else ""), card)
  rec = common.run_record() | {"card": card, "args": vars(args), "rows": rows}
  common.write_json(out, rec)
  if not args.cpu_smoke and args.default_class == "int4":   # the scorecard's entries are all-int4 figures
    pick = {(r["tokens"], r["prefix_int8"], r["variant"]): r for r in rows}
    s512 = pick.get((152263, 0, "streamed_512mib"), {})
    s128 = pick.get((152263, 0, "streamed_128mib"), {})
    fused = pick.get((152263, 0, "fused"), {})
    delta = abs(s512["cos"] - fused["cos"]) if "cos" in s512 and "cos" in fused else None
    # The 8-bit entries (issue 49's keys, named fp8 there): the fastest int8 Q.K launch.
    best8 = lambda t: min((r["vs_jax_cudnn"] for (tt, p, name), r in pick.items()
                           if tt == t and p == 0 and name.startswith("int8_qk") and r.get("vs_jax_cudnn")),
                          default=None)
    common.update_scorecard({"dense.streamed_vs_cudnn_152k": s512.get("vs_jax_cudnn"),
                             "dense.streamed_128mib_vs_cudnn_152k": s128.get("vs_jax_cudnn"),
                             "dense.cos_delta_vs_fused": delta,
                             "dense.fp8_vs_cudnn_152k": best8(152263), "dense.fp8_vs_cudnn_38k": best8(38247)},
                            card=card, source=out, command=rec["command"])


if __name__ == "__main__":
  main()
