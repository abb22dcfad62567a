"""The README's quick start runs as written (tiny shapes, interpret mode on the CPU)."""
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_no_link_leaves_the_repository():
  """Relative links resolve inside the checkout (a link to ../ breaks for every reader)."""
  for doc in ("README.md", "torch_bridge/README.md", "benchmarks/README.md", "formats/FORMAT.md"):
    text = open(os.path.join(ROOT, doc)).read()
    for target in re.findall(r"\]\(([^)#]+)", text):
      if target.startswith(("http://", "https://")):
        continue
      path = os.path.normpath(os.path.join(ROOT, os.path.dirname(doc), target))
      assert path.startswith(ROOT + os.sep) and os.path.exists(path), (doc, target)


def test_quick_start_blocks_run_as_written():
  text = open(os.path.join(ROOT, "README.md")).read()
  blocks = re.findall(r"```python\n(.*?)```", text, re.S)
  assert len(blocks) == 4, "the README has a JAX, a torch, a diffusers and a calibration block"
  scopes = []
  for code in blocks:
    scope = {}
    exec(compile(code, "README.md", "exec"), scope)  # noqa: S102 - the README's own code
    scopes.append(scope)
  assert tuple(scopes[1]["y"].shape) == (1, 256, 128)
  assert tuple(scopes[2]["video"].shape) == (1, 4, 2, 16, 16)
  policy = scopes[3]["policy"]
  assert len(scopes[3]["classes"]) == 4 and policy.report["bits_per_value"] <= 5.25 + 1e-9
