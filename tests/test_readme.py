"""The README's quick start runs as written (tiny shapes, interpret mode on the CPU)."""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_quick_start_blocks_run_as_written():
  text = open(os.path.join(ROOT, "README.md")).read()
  blocks = re.findall(r"```python\n(.*?)```", text, re.S)
  assert len(blocks) == 2, "the README's quick start has a JAX and a torch block"
  for code in blocks:
    scope = {}
    exec(compile(code, "README.md", "exec"), scope)  # noqa: S102 - the README's own code
  assert tuple(scope["y"].shape) == (1, 256, 128)
