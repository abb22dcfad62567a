"""Where kernels run: the Triton backend on a GPU, interpret mode anywhere else."""
from __future__ import annotations

import jax


def on_gpu() -> bool:
  return jax.default_backend() == "gpu"


def resolve_interpret(interpret: bool | None) -> bool:
  """``None`` picks interpret mode unless JAX's default backend is a GPU."""
  return (not on_gpu()) if interpret is None else bool(interpret)


def dot(a, b, trans_b: bool = False):
  """2D matrix product with float32 accumulation, inside any Pallas kernel.

  ``pl.dot``/``plgpu.dot`` were removed in jax 0.12 (deprecated in 0.11, which the GPU
  machine runs), so kernels call this instead.
  """
  return jax.lax.dot_general(a, b, (((1,), (1 if trans_b else 0,)), ((), ())),
                             preferred_element_type=jax.numpy.float32)
