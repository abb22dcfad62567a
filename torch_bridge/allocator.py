"""GPU memory policy for JAX and PyTorch sharing one device.

Why this exists: by default JAX's GPU client grabs 75% of device memory when its
backend starts (``XLA_PYTHON_CLIENT_PREALLOCATE``), which leaves PyTorch a quarter of
the card. The DESIGN budget (Q bf16 + packed K/V on one card next to torch
activations) only fits if both frameworks allocate on demand.

The policy:

* ``torch_bridge`` sets ``XLA_PYTHON_CLIENT_PREALLOCATE=false`` at import unless the
  user already set it. JAX reads the variable when it creates its GPU client (the
  first ``jax.devices()``, array or jit call), not at ``import jax``, so this works as
  long as torch_bridge is imported before JAX touches the GPU.
* With preallocation off, JAX's BFC allocator grows on demand, capped at
  ``XLA_PYTHON_CLIENT_MEM_FRACTION`` (default 0.75) of the card, and keeps freed
  blocks in its own pool (as torch's caching allocator does). Neither framework
  returns memory to the other; ``torch.cuda.empty_cache()`` releases torch's cache.
  ``XLA_PYTHON_CLIENT_ALLOCATOR=platform`` would return memory eagerly but costs a
  cudaMalloc per buffer, so it is not the default.
* If JAX's GPU backend was already started with preallocation on, the bridge cannot
  undo it: ``check_allocator`` warns (or raises with ``strict=True``) and names the
  fix. Every op checks once, on its first GPU call.
"""
from __future__ import annotations

import os
import warnings

PREALLOCATE_VAR = "XLA_PYTHON_CLIENT_PREALLOCATE"
_FIX = (f"set {PREALLOCATE_VAR}=false in the environment, or import torch_bridge before "
        "anything calls jax.devices(), creates a jax array or runs a jitted function")


class AllocatorWarning(UserWarning):
  """JAX holds a preallocated GPU pool, so torch may run out of memory."""


def _backends_initialized() -> bool:
  """Whether JAX has created its backends (private API, guarded for other versions)."""
  try:
    from jax._src import xla_bridge
    return bool(xla_bridge.backends_are_initialized())
  except Exception:  # pragma: no cover - jax moved the helper; assume the worst
    return True


def configure() -> None:
  """Turn JAX's GPU preallocation off if JAX has not started its backends yet.

  Called by ``import torch_bridge``. An explicit user setting wins.
  """
  if not _backends_initialized():
    os.environ.setdefault(PREALLOCATE_VAR, "false")


def _env_preallocates() -> bool:
  return os.environ.get(PREALLOCATE_VAR, "true").strip().lower() not in ("false", "0", "no")


def allocator_status() -> dict:
  """What the bridge can tell about JAX's GPU memory pool, without starting JAX.

  ``preallocated`` is True when JAX's GPU backend is running and its pool was
  preallocated (read from the pool statistics when the client reports them, else from
  the environment), False when it grows on demand, None when no GPU backend runs yet.
  """
  status = {"env": os.environ.get(PREALLOCATE_VAR), "backends_initialized": _backends_initialized(),
            "preallocated": None, "pool_bytes": None, "bytes_limit": None}
  if not status["backends_initialized"]:
    return status
  import jax
  try:
    gpus = jax.devices("gpu")
  except RuntimeError:
    return status
  if not gpus:
    return status
  stats = {}
  try:
    stats = gpus[0].memory_stats() or {}
  except Exception:  # memory_stats is optional in PJRT clients
    pass
  status["pool_bytes"] = stats.get("pool_bytes")
  status["bytes_limit"] = stats.get("bytes_limit")
  if status["pool_bytes"] is not None and status["bytes_limit"]:
    # A preallocated pool equals the limit from the start; an on-demand one holds
    # only what was used. Half the limit separates them with a wide margin.
    status["preallocated"] = (status["pool_bytes"] >= 0.5 * status["bytes_limit"]
                              and _env_preallocates())
  else:
    status["preallocated"] = _env_preallocates()
  return status


def check_allocator(strict: bool = False) -> dict:
  """Warn (or raise RuntimeError with ``strict``) if JAX preallocated the GPU."""
  status = allocator_status()
  if status["preallocated"]:
    msg = ("JAX started its GPU backend with memory preallocation on "
           f"({PREALLOCATE_VAR}={status['env']!r}, pool {status['pool_bytes']} bytes), so it "
           f"holds most of the card and torch may run out of memory. Fix: {_FIX}.")
    if strict:
      raise RuntimeError(msg)
    warnings.warn(msg, AllocatorWarning, stacklevel=3)
  return status


_checked = False


def check_once() -> None:
  """``check_allocator`` on the first GPU op call of the process only (cheap after)."""
  global _checked
  if not _checked:
    _checked = True
    check_allocator()
