"""Zero-copy tensor exchange between PyTorch and JAX, with the checks that keep it so.

Why the checks: ``jax.dlpack.from_dlpack`` silently copies a buffer it cannot use in
place (a view whose data pointer is not aligned, some strided layouts), and a copy of
the packed K/V or of Q is exactly what the bridge exists to avoid. So every tensor is
validated on the torch side first (device, dtype, C-contiguity, alignment: 32 bytes
on CUDA, 64 on CPU where JAX copies anything less),
and after the hand-off the pointers are compared; any mismatch raises instead of
silently costing memory.

Stream ordering (CUDA). Both directions go through the DLPack stream protocol:

* torch -> JAX: JAX calls ``tensor.__dlpack__(stream=<JAX's external-ready stream>)``;
  torch records an event on its *current* stream and makes that stream wait on it, so
  JAX reads the tensor only after all torch work queued before the call.
* JAX -> torch: ``torch.from_dlpack`` passes torch's current stream; JAX makes that
  stream wait for the buffer's definition event, so torch work queued after the call
  sees the finished result.

No host synchronization happens. Buffer lifetimes are safe under one rule: use the
bridge's outputs, and free its inputs, on the torch stream that was current when the
op was called (or synchronize yourself). The reasoning: the op converts its outputs
to torch (queuing the wait on JAX's work) before it drops its references to the
inputs, so any later reuse of an input's memory by torch's caching allocator is
queued after JAX finished reading it; and every kernel the bridge launches reads at
least one imported torch tensor, so it starts after earlier torch work that may still
read a JAX-owned output that torch has since freed (JAX recycles that memory as soon
as torch drops the tensor). The one residual gap: a JAX allocation that depends on no
torch input and is written before such a kernel (an eager host-to-device constant,
e.g. Sol's ``block_len`` clamp table) is not ordered after torch's pending reads. The
default paths launch none; set ``TORCH_BRIDGE_SYNC=1`` to block on every JAX result
if in doubt (debugging only).

Mutability: JAX arrays are immutable and XLA assumes nobody writes their memory. A
torch tensor handed to JAX must not be written by torch while a JAX computation may
still read it, and tensors returned by the bridge alias JAX buffers: writing them in
place is allowed only once no JAX array view of them is still in use (the bridge
keeps none after an op returns).
"""
from __future__ import annotations

import os

import jax
import torch

from pallas_kernels import backend

# Minimum start alignment per device type. CUDA: 32 bytes, because Pallas-Triton marks
# every pointer argument of a kernel as 32-byte aligned (tt.divisibility = 32), so a
# less aligned view would be read wrongly, not slowly. CPU: 64 bytes, because JAX's CPU client copies any
# imported buffer that is not 64-byte aligned (measured: jax 0.10.2); torch's CPU
# allocator returns 64-byte aligned memory, numpy's often only 16.
ALIGN = {"cuda": 32, "cpu": 64}
SYNC = os.environ.get("TORCH_BRIDGE_SYNC", "0") not in ("", "0", "false")


class BridgeError(ValueError):
  """A tensor cannot cross the bridge without a copy or a wrong result."""


def _where(name: str, t: torch.Tensor) -> str:
  return f"{name} ({t.dtype}{list(t.shape)} on {t.device})"


def check_tensor(t, name: str, *, dtype: torch.dtype | tuple[torch.dtype, ...] | None = None,
                 shape: tuple[int, ...] | None = None, ndim: int | None = None,
                 device: torch.device | None = None) -> torch.Tensor:
  """Validate one tensor for a zero-copy hand-off to a kernel and return it.

  Checks type, dtype, shape, device, C-contiguity and alignment (``ALIGN``) of the data
  pointer (empty tensors skip the last two: they own no memory).
  """
  if not isinstance(t, torch.Tensor):
    raise BridgeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
  if dtype is not None:
    allowed = dtype if isinstance(dtype, tuple) else (dtype,)
    if t.dtype not in allowed:
      want = " or ".join(str(d) for d in allowed)
      raise BridgeError(f"{_where(name, t)} must be {want}; convert it with .to({allowed[0]}) "
                        "(the kernels never convert dtypes implicitly)")
  if ndim is not None and t.dim() != ndim:
    raise BridgeError(f"{_where(name, t)} must have {ndim} dimensions")
  if shape is not None and tuple(t.shape) != tuple(shape):
    raise BridgeError(f"{_where(name, t)} must have shape {list(shape)}")
  if device is not None and t.device != device:
    raise BridgeError(f"{_where(name, t)} is on {t.device} but the other inputs are on {device}; "
                      f"move it with .to({str(device)!r})")
  if t.layout != torch.strided:
    raise BridgeError(f"{_where(name, t)} has layout {t.layout}; pass a dense (strided) tensor")
  if t.numel() and not t.is_contiguous():
    raise BridgeError(f"{_where(name, t)} is not C-contiguous (strides {list(t.stride())}); the "
                      "bridge never copies, so call .contiguous() yourself if the copy is intended")
  align = ALIGN.get(t.device.type, 16)
  if t.numel() and t.data_ptr() % align:
    raise BridgeError(f"{_where(name, t)} starts at address {t.data_ptr():#x}, not {align}-byte "
                      f"aligned as {t.device.type} kernels need (a view at an odd offset, or a "
                      "numpy-backed tensor?); pass a tensor that starts at its own torch "
                      "allocation, e.g. .clone()")
  return t


def check_device(tensors: dict[str, torch.Tensor | None], interpret: bool | None) -> torch.device:
  """The one device of all given tensors, checked against where the kernels run."""
  device = None
  for name, t in tensors.items():
    if t is None:
      continue
    if device is None:
      device, first = t.device, name
    elif t.device != device:
      raise BridgeError(f"{_where(name, t)} is on {t.device} but {first} is on {device}; put all "
                        "inputs on one device")
  if device is None:
    raise BridgeError("no tensor inputs given")
  if device.type == "cuda":
    if not backend.on_gpu():
      raise BridgeError(f"inputs are on {device} but JAX has no GPU backend "
                        f"(default backend {jax.default_backend()!r}); install a CUDA jaxlib "
                        "(pip install 'jax[cuda13]') or pass CPU tensors with interpret=True")
    if interpret:
      raise BridgeError("interpret=True runs on the CPU; pass CPU tensors or interpret=None/False")
    from torch_bridge import allocator
    allocator.check_once()
  elif device.type == "cpu":
    if backend.on_gpu() and not interpret:
      raise BridgeError("inputs are on the CPU but the kernels run on JAX's GPU backend; move them "
                        "with .cuda(), or pass interpret=True to run the slow CPU interpreter")
  else:
    raise BridgeError(f"inputs are on {device}; the bridge supports cpu and cuda tensors only")
  return device


def _device_guard(t: torch.Tensor):
  """torch refuses to export a CUDA tensor of a non-current device: make it current."""
  if t.device.type == "cuda":
    return torch.cuda.device(t.device)
  import contextlib
  return contextlib.nullcontext()


def to_jax(t: torch.Tensor | None, name: str) -> jax.Array | None:
  """A JAX view of a validated torch tensor; raises if JAX made a copy."""
  if t is None:
    return None
  check_tensor(t, name)
  with _device_guard(t):
    a = jax.dlpack.from_dlpack(t.detach())
  if t.numel() and a.unsafe_buffer_pointer() != t.data_ptr():
    raise BridgeError(f"JAX copied {_where(name, t)} instead of sharing it; this is a bridge bug "
                      "or an unsupported layout, please report it with the tensor's strides "
                      f"{list(t.stride())}")
  return a


def to_torch(a: jax.Array, name: str) -> torch.Tensor:
  """A torch view of a JAX array (queued after the array is ready on torch's stream)."""
  if SYNC:
    a.block_until_ready()
  t = torch.from_dlpack(a)
  if t.numel() and t.data_ptr() != a.unsafe_buffer_pointer():
    raise BridgeError(f"torch copied JAX output {name} instead of sharing it; this is a bridge bug")
  return t


def share_memory(t: torch.Tensor, a: jax.Array) -> bool:
  """Whether a torch tensor and a JAX array start at the same device address."""
  return t.data_ptr() == a.unsafe_buffer_pointer()
