"""Where the chunked projection's time goes (issue 41): the cuBLAS chunk GEMMs alone,
the epilogue kernel alone, and the whole method, next to one cuBLAS GEMM of the full
projection, in one process.

  python -m benchmarks.profile_projection                 # GPU: T = 38,247 and 152,263
  python -m benchmarks.profile_projection --cpu-smoke     # tiny, interpret mode

Per T and scratch budget: ``gemm_loop`` is the method's ``fori_loop`` over chunks with
the GEMM and nothing else; ``epilogue_loop`` is the same loop with the epilogue kernel
over one fixed chunk of GEMM output (no GEMM); ``chunked`` is ``streamed_qkv`` itself.
The epilogue's bytes are what it must move at least (read the chunk's GEMM output,
write Q, the codes, scales, zeros and stats); ``epilogue_gbps`` is those bytes over
its time, against the card's memory bandwidth. Writes
``results/profile_projection_<card>_<date>.json``.
"""
from __future__ import annotations

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import sys  # noqa: E402
from types import SimpleNamespace  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
  sys.path.insert(0, ROOT)

from benchmarks import common  # noqa: E402

# HBM bandwidth by card (vendor figures, bytes/s): the yardstick for the epilogue.
CARD_BANDWIDTH = {"h100": 3.35e12, "h200": 4.8e12}


def epilogue_bytes(meta, rows: int, gemm_itemsize: int) -> int:
  """Least bytes one chunk's epilogue moves: the GEMM output in, Q and the packed
  arrays of ``rows`` tokens out (all-int4 storage)."""
  import numpy as np

  from formats import packed_kv as fmt
  h, d = meta.heads, meta.head_dim
  packed = sum(int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype in fmt.buffer_specs(meta).values())
  out_per_row = h * d * 2 + packed / (meta.num_blocks * fmt.BLOCK)  # Q bf16, then the PackedKV
  return int(rows * (3 * h * d * gemm_itemsize + out_per_row))


def run_tokens(args, tokens, rows_out):
  import jax
  import jax.numpy as jnp
  from jax import lax

  from benchmarks.bench_streamed_qkv import make_inputs
  from formats import packed_kv as fmt
  from pallas_kernels.qkv_projection import ProjectionTuning, check_inputs, chunk_rows, streamed_qkv
  from pallas_kernels.qkv_ops import epilogue_constants
  from pallas_kernels.qkv_epilogue import empty_buffers, epilogue_call

  shape = SimpleNamespace(batch=1, tokens=tokens, hidden=args.hidden, heads=args.heads, head_dim=args.head_dim,
                          rot_dim=args.rot_dim)
  x, weights, kw = make_inputs(shape)
  w = weights.w_qkv
  layout = kw["layout"]
  meta = check_inputs(x, weights, layout, kw["rope_cos"], kw["rope_sin"], None)  # the default KVStorage()
  interpret = jax.default_backend() != "gpu"
  consts = epilogue_constants(layout, meta.rotation_seed_k, meta.rotation_seed_v, weights.q_norm_weight,
                              weights.k_norm_weight)
  cos, sin = kw["rope_cos"], kw["rope_sin"]
  nb = meta.num_blocks
  hidden, width = x.shape[2], layout.width

  full = jax.jit(lambda x, w: jnp.dot(x, w, preferred_element_type=jnp.bfloat16))
  t_full, _ = common.time_fn(lambda: full(x, w), args.warmup, args.iters)
  rows_out.append({"tokens": tokens, "part": "cublas_full_gemm_bf16", "time_s": t_full})

  for scratch in args.scratch_mib:
    rows = chunk_rows(tokens, hidden, width, scratch << 20)
    n = -(-nb // (rows // fmt.BLOCK))
    for gemm_dtype in args.gemm_dtypes:
      gd = jnp.dtype(gemm_dtype)

      @jax.jit
      def gemm_loop(x, w):
        def body(i, acc):
          a = jnp.minimum(i * rows, max(tokens - rows, 0))
          xs = lax.dynamic_slice(x, (0, a, 0), (1, rows, hidden))[0]
          y = jnp.dot(xs, w, preferred_element_type=gd)
          return acc + y[::rows // 2, ::width // 4].astype(jnp.float32).sum()
        return lax.fori_loop(0, n, body, jnp.float32(0))

      y_fixed = jax.random.normal(jax.random.key(1), (rows, width), jnp.float32).astype(gd)
      t_gemm, _ = common.time_fn(lambda: gemm_loop(x, w), args.warmup, args.iters)
      base = {"tokens": tokens, "scratch_mib": scratch, "chunk_rows": rows, "chunks": n, "gemm_dtype": gemm_dtype}
      rows_out.append(base | {"part": "gemm_loop", "time_s": t_gemm, "vs_full_gemm": t_gemm / t_full})
      for warps in args.warps:

        @jax.jit
        def epi_loop(y):
          def body(i, bufs):
            a = jnp.minimum(i * rows, nb * fmt.BLOCK - rows)
            return epilogue_call(y, None, a, jnp.int32(0), jnp.int32(0), bufs, cos, sin, consts, meta,
                                 interpret=interpret, num_warps=warps)
          return lax.fori_loop(0, n, body, empty_buffers(meta, interpret=interpret))

        t_epi, _ = common.time_fn(lambda: epi_loop(y_fixed), args.warmup, args.iters)
        moved = epilogue_bytes(meta, rows, gd.itemsize) * n
        bw = CARD_BANDWIDTH.get(common.short_card(common.device_name()))
        rows_out.append(base | {"part": "epilogue_loop", "num_warps": warps, "time_s": t_epi,
                                "bytes": moved, "epilogue_gbps": moved / t_epi / 1e9,
                                "fraction_of_bandwidth": (moved / t_epi / bw) if bw else None})
        tuning = ProjectionTuning(epilogue_num_warps=warps, gemm_dtype=gemm_dtype)
        fn = lambda: streamed_qkv(x, weights, **kw, method="chunked", scratch_bytes=scratch << 20, tuning=tuning)
        t_all, _ = common.time_fn(fn, args.warmup, args.iters)
        rows_out.append(base | {"part": "chunked", "num_warps": warps, "time_s": t_all,
                                "vs_full_gemm": t_all / t_full,
                                "gemm_plus_epilogue_s": t_gemm + t_epi})


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--tokens", type=int, nargs="+", default=[38247, 152263])
  ap.add_argument("--hidden", type=int, default=5376)
  ap.add_argument("--heads", type=int, default=56)
  ap.add_argument("--head-dim", type=int, default=128)
  ap.add_argument("--rot-dim", type=int, default=96)
  ap.add_argument("--scratch-mib", type=int, nargs="+", default=[512, 128])
  ap.add_argument("--gemm-dtypes", nargs="+", default=["float32", "bfloat16"])
  ap.add_argument("--warps", type=int, nargs="+", default=[4, 8])
  ap.add_argument("--iters", type=int, default=5)
  ap.add_argument("--warmup", type=int, default=1)
  ap.add_argument("--cpu-smoke", action="store_true")
  ap.add_argument("--out", default=None)
  args = ap.parse_args(argv)
  import jax
  if args.cpu_smoke:
    args.tokens, args.hidden, args.heads, args.rot_dim = [300], 256, 2, 96
    args.scratch_mib, args.gemm_dtypes, args.warps, args.iters = [33], ["float32"], [4], 1
  elif jax.default_backend() != "gpu":
    sys.exit("no GPU visible to JAX: pass --cpu-smoke for a tiny interpret-mode run")
  card = common.device_name()
  rows = []
  for t in args.tokens:
    run_tokens(args, t, rows)
  print(f"card: {card}")
  print(common.table(rows, [("T", "tokens", "{}"), ("MiB", "scratch_mib", "{}"), ("gemm", "gemm_dtype", "{}"),
                            ("part", "part", "{}"), ("warps", "num_warps", "{}"), ("s", "time_s", "{:.4f}"),
                            ("vs full GEMM", "vs_full_gemm", "{:.3f}"), ("GB/s", "epilogue_gbps", "{:.0f}"),
                            ("of BW", "fraction_of_bandwidth", "{:.2f}")]))
  out = args.out or common.result_path("profile_projection" + ("_cpu_smoke" if args.cpu_smoke else ""), card)
  common.write_json(out, common.run_record() | {"card": card, "args": vars(args), "rows": rows})


if __name__ == "__main__":
  main()
