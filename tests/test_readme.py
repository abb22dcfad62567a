"""The README's quick start runs as written (tiny shapes, interpret mode on the CPU).

One test per README code block, each run as written in a fresh scope, so a failure names its
block and the slow-test list can keep the expensive blocks out of the quick subset; the full
suite runs all of them."""
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BLOCKS = ("jax", "torch", "diffusers", "calibration")   # the README's python blocks, in order


def test_no_link_leaves_the_repository():
  """Relative links resolve inside the checkout (a link to ../ breaks for every reader)."""
  for doc in ("README.md", "torch_bridge/README.md", "benchmarks/README.md", "formats/FORMAT.md"):
    text = open(os.path.join(ROOT, doc)).read()
    for target in re.findall(r"\]\(([^)#]+)", text):
      if target.startswith(("http://", "https://")):
        continue
      path = os.path.normpath(os.path.join(ROOT, os.path.dirname(doc), target))
      assert path.startswith(ROOT + os.sep) and os.path.exists(path), (doc, target)


def _readme_blocks():
  text = open(os.path.join(ROOT, "README.md")).read()
  blocks = re.findall(r"```python\n(.*?)```", text, re.S)
  assert len(blocks) == len(BLOCKS), "the README has a JAX, a torch, a diffusers and a calibration block"
  return dict(zip(BLOCKS, blocks))


@pytest.mark.parametrize("block", BLOCKS)
def test_quick_start_blocks_run_as_written(block):
  scope = {}
  exec(compile(_readme_blocks()[block], "README.md", "exec"), scope)  # noqa: S102 - the README's own code
  if block == "jax":
    assert tuple(scope["o"].shape) == tuple(scope["q"].shape) == (1, 256, 2, 64)
    assert tuple(scope["o_sparse"].shape) == (1, 256, 2, 64)
  elif block == "torch":
    assert tuple(scope["y"].shape) == (1, 256, 128)
  elif block == "diffusers":
    assert tuple(scope["video"].shape) == (1, 4, 2, 16, 16)
  else:
    policy = scope["policy"]
    assert len(scope["classes"]) == 4 and policy.report["bits_per_value"] <= 5.25 + 1e-9
