"""What every results file records about the software it ran on."""
from __future__ import annotations

import platform
from importlib import metadata

PACKAGES = ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda13-plugin", "triton", "torch", "numpy")


def package_versions() -> dict:
  """Installed versions, read from package metadata: nothing is imported, so a parent
  process can call this without starting JAX's GPU backend."""
  v = {"python": platform.python_version()}
  for name in PACKAGES:
    try:
      v[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
      pass
  return v
