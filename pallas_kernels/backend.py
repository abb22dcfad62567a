"""Where kernels run: the Triton backend on a GPU, interpret mode anywhere else."""
from __future__ import annotations

import jax


def on_gpu() -> bool:
  return jax.default_backend() == "gpu"


def resolve_interpret(interpret: bool | None) -> bool:
  """``None`` picks interpret mode unless JAX's default backend is a GPU."""
  return (not on_gpu()) if interpret is None else bool(interpret)
