import os
import sys
import warnings

# JAX must not preallocate GPU memory that torch (bridge tests) needs; set before jax starts.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import pytest  # noqa: E402


_SLOW = {line.strip() for line in open(os.path.join(os.path.dirname(__file__), "slow_tests.txt"))
         if line.strip() and not line.startswith("#")}


def pytest_collection_modifyitems(config, items):
  for item in items:
    if item.nodeid in _SLOW:
      item.add_marker(pytest.mark.slow)
  if not any("::" in arg for arg in config.args):   # whole files collected: an id missing from them is stale
    ids = {item.nodeid for item in items}
    files = {nodeid.split("::")[0] for nodeid in ids}
    stale = sorted(i for i in _SLOW if i.split("::")[0] in files and i not in ids)
    if stale:
      warnings.warn(pytest.PytestWarning("tests/slow_tests.txt names tests that do not exist (renamed?), "
                                         "so they are not marked slow: " + ", ".join(stale)))
  if jax.default_backend() == "gpu":
    return
  skip = pytest.mark.skip(reason="gpu marker: no CUDA GPU visible to JAX on this machine; "
                                 "run `pytest -m gpu` on the device machine")
  for item in items:
    if "gpu" in item.keywords:
      item.add_marker(skip)

