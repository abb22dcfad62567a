"""GPU memory policy for JAX and PyTorch sharing one card.

The problem, measured (``benchmarks/card_budget.py``, ``benchmarks/NOTES.md``): each
framework keeps the memory it frees in its own pool, which the other cannot use. JAX
preallocates 75% of the card by default; with preallocation off its BFC allocator
still grows on demand and never gives memory back (on a 12 GiB budget its pool grew
to 8 GiB and kept it); torch's caching allocator keeps freed blocks the same way.
A block that needs 4 GiB for a moment then leaves the other framework short for good.

The policy ``import torch_bridge`` sets, before JAX starts its GPU backend, unless the
user already set the variable:

* ``XLA_PYTHON_CLIENT_ALLOCATOR=platform``: JAX allocates each buffer with cudaMalloc
  and frees it as soon as it dies, so memory JAX no longer uses is free on the device
  for torch's next allocation. JAX's calls here allocate a few large buffers each,
  so the per-buffer cudaMalloc costs nothing measurable (``card_budget``'s timings).
* ``XLA_PYTHON_CLIENT_PREALLOCATE=false``: no preallocated pool.
* Before each op that enters JAX on a CUDA device, the bridge releases torch's cached
  free blocks (``torch.cuda.empty_cache()``) when they exceed ``RELEASE_THRESHOLD``,
  so JAX can allocate what torch has freed.

JAX reads the variables when it creates its GPU client (the first ``jax.devices()``,
array or jit call), not at ``import jax``: import torch_bridge before JAX touches the
GPU. If the backend already started under another policy, ``check_allocator`` warns
(or raises with ``strict=True``) and names the fix; every op checks once, on its
first GPU call.
"""
from __future__ import annotations

import os
import warnings

PREALLOCATE_VAR = "XLA_PYTHON_CLIENT_PREALLOCATE"
ALLOCATOR_VAR = "XLA_PYTHON_CLIENT_ALLOCATOR"
RELEASE_THRESHOLD = 64 << 20   # torch cache (reserved - allocated) bytes worth a release
_FIX = (f"set {PREALLOCATE_VAR}=false and {ALLOCATOR_VAR}=platform in the environment, or import "
        "torch_bridge before anything calls jax.devices(), creates a jax array or runs a jitted function")


class AllocatorWarning(UserWarning):
  """JAX holds a pool of GPU memory that torch cannot use."""


def _backends_initialized() -> bool:
  """Whether JAX has created its backends (private API, guarded for other versions)."""
  try:
    from jax._src import xla_bridge
    return bool(xla_bridge.backends_are_initialized())
  except Exception:  # pragma: no cover - jax moved the helper; assume the worst
    return True


def configure() -> None:
  """Set the policy's variables if JAX has not started its backends yet.

  Called by ``import torch_bridge``. An explicit user setting wins.
  """
  if not _backends_initialized():
    os.environ.setdefault(PREALLOCATE_VAR, "false")
    os.environ.setdefault(ALLOCATOR_VAR, "platform")


ALLOW_CPU_JAX_VAR = "TORCH_BRIDGE_ALLOW_CPU_JAX"


def jax_cuda_plugin() -> str | None:
  """The JAX CUDA plugin installed (its ``jax_plugins`` module, e.g. 'xla_cuda13', or its
  distribution, e.g. 'jax-cuda13-plugin'), or None; found without starting JAX."""
  import pkgutil
  from importlib import metadata
  try:
    import jax_plugins
    found = next((m.name for m in pkgutil.iter_modules(jax_plugins.__path__) if "cuda" in m.name), None)
    if found:
      return found
  except ImportError:
    pass
  for name in ("jax-cuda13-plugin", "jax-cuda12-plugin", "jax-cuda13-pjrt", "jax-cuda12-pjrt"):
    try:
      metadata.version(name)
      return name
    except metadata.PackageNotFoundError:
      continue
  return None


def check_jax_sees_the_gpu(torch_cuda: bool, plugin: str | None, torch_cuda_version: str | None) -> None:
  """Raise ImportError when torch has a CUDA GPU but JAX has no CUDA plugin: every op
  would refuse CUDA tensors later, so say it once, at import, with the pip command.
  ``TORCH_BRIDGE_ALLOW_CPU_JAX=1`` allows it (the kernels then run on CPU tensors in
  JAX's interpreter)."""
  if not torch_cuda or plugin is not None:
    return
  if os.environ.get(ALLOW_CPU_JAX_VAR, "").strip() not in ("", "0", "false"):
    return
  major = (torch_cuda_version or "13").split(".")[0]
  extra = "cuda12" if major == "12" else "cuda13"
  raise ImportError(f"torch sees a CUDA GPU but JAX has no CUDA plugin, so the kernels cannot run on it. Install "
                    f"one next to your torch (CUDA {torch_cuda_version}): pip install 'jax[{extra}]' (or "
                    f"pip install 'packed-kv-attention[cuda]'); set {ALLOW_CPU_JAX_VAR}=1 to import anyway and run "
                    "the kernels on CPU tensors in JAX's interpreter")


def _env_preallocates() -> bool:
  return os.environ.get(PREALLOCATE_VAR, "true").strip().lower() not in ("false", "0", "no")


def _env_pools() -> bool:
  """Whether JAX's allocator keeps freed memory in a pool (anything but 'platform')."""
  return os.environ.get(ALLOCATOR_VAR, "bfc").strip().lower() != "platform"


def allocator_status() -> dict:
  """What the bridge can tell about JAX's GPU memory policy, without starting JAX.

  ``preallocated``: True when JAX's GPU backend runs with a preallocated pool, False
  when it does not, None when no GPU backend runs yet. ``pools``: whether JAX keeps
  freed memory in its own pool (every allocator but ``platform``).
  """
  status = {"env": os.environ.get(PREALLOCATE_VAR), "allocator": os.environ.get(ALLOCATOR_VAR),
            "backends_initialized": _backends_initialized(), "preallocated": None, "pools": None,
            "pool_bytes": None, "bytes_limit": None}
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
  status["pools"] = _env_pools()
  if status["pool_bytes"] is not None and status["bytes_limit"]:
    # A preallocated pool equals the limit from the start; an on-demand one holds
    # only what was used. Half the limit separates them with a wide margin.
    status["preallocated"] = (status["pool_bytes"] >= 0.5 * status["bytes_limit"]
                              and _env_preallocates())
  else:
    status["preallocated"] = _env_preallocates() and status["pools"]
  return status


def check_allocator(strict: bool = False) -> dict:
  """Warn (or raise RuntimeError with ``strict``) if JAX keeps GPU memory from torch."""
  status = allocator_status()
  problem = None
  if status["preallocated"]:
    problem = (f"JAX started its GPU backend with memory preallocation on ({PREALLOCATE_VAR}="
               f"{status['env']!r}, pool {status['pool_bytes']} bytes), so it holds most of the card")
  elif status["pools"]:
    problem = (f"JAX started its GPU backend with a pooling allocator ({ALLOCATOR_VAR}="
               f"{status['allocator']!r}), so memory it frees stays in its pool")
  if problem:
    msg = f"{problem} and torch may run out of memory. Fix: {_FIX}."
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


def release_torch_cache(device) -> int:
  """Before JAX allocates on ``device``: give torch's cached free blocks back to the
  device when they exceed ``RELEASE_THRESHOLD``. Returns the bytes torch held free."""
  import torch
  if device.type != "cuda":
    return 0
  idle = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
  if idle > RELEASE_THRESHOLD:
    with torch.cuda.device(device):
      torch.cuda.empty_cache()
  return idle
