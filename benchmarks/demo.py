"""The main job, end to end: an H3-style attention layer through the streamed QKV
projection, the packed K/V format, and dense + Sol attention over packed K/V, next to
the plain BF16 pipeline and the BF16-then-quantize anti-pattern.

It starts with the user's case in bytes (T = 152,263, computed by ``required_bytes``).
On a GPU it then runs at MiniMax-H3 width (hidden 5376, 56 x 128 heads) with T = 38,247
tokens; on a CPU it runs a tiny layer in interpret mode. Results go to demo_out/.
Each variant runs in its own process so its peak memory is its own.
"""
from __future__ import annotations

import subprocess
import sys

from benchmarks import e2e_h3

H3_TOKENS, H3_HIDDEN, H3_HEADS, H3_HEAD_DIM = 152_263, 5376, 56, 128
GIB = 2 ** 30


def memory_story() -> str:
  """The user's case in bytes, computed (no GPU needed): what one H3 attention block
  needs above what the caller holds, ours against the BF16 pipeline's QKV alone."""
  from pallas_kernels import QKVLayout, Sol, required_bytes
  layout = QKVLayout.h3(H3_HEADS, H3_HEAD_DIM)
  dense = required_bytes(H3_TOKENS, layout, H3_HIDDEN)
  sol = required_bytes(H3_TOKENS, layout, H3_HIDDEN, attention=Sol())
  qkv = H3_TOKENS * layout.width * 2
  return "\n".join([
      f"The user's case, computed by pallas_kernels.required_bytes (MiniMax-H3: T = {H3_TOKENS:,}, hidden "
      f"{H3_HIDDEN}, {H3_HEADS} x {H3_HEAD_DIM} heads; a 12 GiB card with 6.09 GiB already held):",
      f"  BF16 pipeline: qkv = qkv_proj(x) alone is {qkv / GIB:.2f} GiB -> out of memory on that card",
      f"  ours, dense attention: {dense['peak'] / GIB:.2f} GiB at the block's peak (Q {dense['q'] / GIB:.2f} + packed "
      f"K/V {dense['packed_kv'] / GIB:.2f} + scratch {dense['attention_scratch'] / GIB:.2f})",
      f"  ours, Sol attention:   {sol['peak'] / GIB:.2f} GiB",
      "  measured on an H100 (benchmarks/results/e2e_h3_h100_2026-12-07.json): the whole layer's device peak "
      "3.73 GiB against the BF16 pipeline's 24.40 GiB",
  ])


def _has_gpu() -> bool:
  probe = "import jax, sys; sys.exit(0 if jax.default_backend() == 'gpu' else 1)"
  return subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0


def main(argv=None):
  argv = list(sys.argv[1:] if argv is None else argv)
  print(memory_story(), flush=True)
  if _has_gpu():
    args = ["--tokens", "38247", "--runs", "3", "--out", "demo_out/e2e_h3_demo.json"]
  else:
    print("\nNo GPU visible to JAX, so what runs below is a tiny layer (T = 300, hidden 256, 2 heads) on the CPU in "
          "interpret mode, to show the pieces work and agree with the float32 reference. Its times are the Pallas "
          "interpreter's, not the kernels': do not compare them with the BF16 rows. Sol is sparse attention (most "
          "key blocks enter as one pooled term), so its cos against dense float32 attention is expected well below "
          "1; comfy-kitchen's own Sol scores the same on the same data (benchmarks/NOTES.md).\n", flush=True)
    args = ["--small", "--tokens", "300", "--runs", "3", "--quality-rows", "128",
            "--out", "demo_out/e2e_h3_demo_cpu.json"]
  e2e_h3.main(args + argv)


if __name__ == "__main__":
  main()
