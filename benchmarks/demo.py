"""The main job, end to end: an H3-style attention layer through the streamed QKV
projection, the packed K/V format, and dense + Sol attention over packed K/V, next to
the plain BF16 pipeline and the BF16-then-quantize anti-pattern.

On a GPU it runs at MiniMax-H3 width (hidden 5376, 56 x 128 heads) with T = 38,247
tokens; on a CPU it runs a tiny layer in interpret mode. Results go to demo_out/.
Each variant runs in its own process so its peak memory is its own.
"""
from __future__ import annotations

import subprocess
import sys

from benchmarks import e2e_h3


def _has_gpu() -> bool:
  probe = "import jax, sys; sys.exit(0 if jax.default_backend() == 'gpu' else 1)"
  return subprocess.run([sys.executable, "-c", probe], capture_output=True).returncode == 0


def main(argv=None):
  argv = list(sys.argv[1:] if argv is None else argv)
  if _has_gpu():
    args = ["--tokens", "38247", "--runs", "3", "--out", "demo_out/e2e_h3_demo.json"]
  else:
    print("no GPU visible to JAX: running a tiny layer (T = 300, hidden 256, 2 heads) on the CPU in "
          "interpret mode; times are the interpreter's, memory is not measured on a CPU", flush=True)
    args = ["--small", "--tokens", "300", "--runs", "3", "--quality-rows", "128",
            "--out", "demo_out/e2e_h3_demo_cpu.json"]
  e2e_h3.main(args + argv)


if __name__ == "__main__":
  main()
