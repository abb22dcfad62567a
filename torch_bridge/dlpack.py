"""Zero-copy tensor exchange between PyTorch and JAX, with the checks that keep it so.

Why the checks: ``jax.dlpack.from_dlpack`` silently copies a buffer it cannot use in
place (a view whose data pointer is not aligned, some strided layouts), and a copy of
the packed K/V or of Q is exactly what the bridge exists to avoid. So every tensor is
validated on the torch side first (device, dtype, C-contiguity, alignment: 32 bytes
on CUDA, 64 on CPU where JAX copies anything less),
and after the hand-off the pointers are compared; any mismatch raises instead of
silently costing memory.

Torch -> JAX goes through DLPack. JAX calls ``tensor.__dlpack__(stream=<JAX's stream>)``;
torch records an event on its *current* stream and makes JAX's stream wait on it, so JAX
reads the tensor only after all torch work queued before the call. The JAX array holds
torch's tensor until the array dies, then torch's deleter runs at once (it needs no GIL).

JAX -> torch does NOT use DLPack, and this is about memory, not speed. jaxlib's DLPack
export holds the JAX array from a C++ object whose destructor may run without the GIL, so
it hands the array to a queue of deferred releases that only ``collect_garbage()`` drains
(JAX runs it from a ``gc.callbacks`` hook). A tensor from ``torch.from_dlpack(jax_array)``
therefore keeps its device memory after torch drops it, until Python's garbage collector
next runs: with gc disabled (or simply between collections) a model loop holds one
dead Q-sized buffer per call and runs out of memory (issue 36, measured on an H100).
Instead ``to_torch`` hands torch a small owner object that exposes the buffer through
``__cuda_array_interface__`` (``__array_interface__`` plus ``torch.from_numpy`` on the
CPU). torch keeps a plain Python reference to the owner and drops it under the GIL when
the tensor's storage dies, so the JAX array, and its device memory, go the moment torch
releases its last view. No private JAX entry point is involved.

The array interface carries no stream, so ``to_torch`` waits for the JAX array on the
host (``block_until_ready``) before torch may queue work on it. The bridge's ops are
large (milliseconds to seconds), so the wait costs the gap of one kernel launch, and it
also settles the ordering of inputs: when an op returns, JAX has finished reading them.

Freed JAX memory goes straight back to the driver (the bridge's ``platform`` allocator,
``torch_bridge.allocator``), whose free waits for work still queued on the device, so
torch work queued before the drop that still reads the buffer is safe. Use the outputs
on the torch stream that was current when the op was called, or synchronize yourself.

Mutability: JAX arrays are immutable and XLA assumes nobody writes their memory. A
torch tensor handed to JAX must not be written by torch while a JAX computation may
still read it. Tensors returned by the bridge are the only reference to their JAX
buffers (the bridge keeps none after an op returns), so writing them in place is safe.
"""
from __future__ import annotations

import jax
import numpy as np
import torch

from pallas_kernels import backend

# Minimum start alignment per device type. CUDA: 32 bytes, because Pallas-Triton marks
# every pointer argument of a kernel as 32-byte aligned (tt.divisibility = 32), so a
# less aligned view would be read wrongly, not slowly. CPU: 64 bytes, because JAX's CPU client copies any
# imported buffer that is not 64-byte aligned (measured: jax 0.10.2); torch's CPU
# allocator returns 64-byte aligned memory, numpy's often only 16.
ALIGN = {"cuda": 32, "cpu": 64}
# dtypes numpy's array interface cannot name (ml_dtypes): exported as a signed integer
# of the same width, then viewed as the torch dtype.
_TORCH_VIEW_DTYPES = {"bfloat16": torch.bfloat16, "float8_e4m3fn": torch.float8_e4m3fn,
                      "float8_e5m2": torch.float8_e5m2}
_SAME_WIDTH_INT = {1: "|i1", 2: "<i2"}


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


class _JaxBufferOwner:
  """Keeps one JAX array alive for as long as torch views its buffer.

  torch takes a reference to this object when it builds a tensor from its
  ``__cuda_array_interface__`` (CUDA) or, through numpy, its ``__array_interface__``
  (CPU), and drops that reference under the GIL when the tensor's storage is freed:
  the array dies then, not at the next garbage collection (see the module docstring).
  """

  def __init__(self, a: jax.Array, typestr: str):
    self.array = a
    interface = {"shape": tuple(a.shape), "typestr": typestr, "strides": None,
                 "data": (a.unsafe_buffer_pointer(), False), "version": 2}
    if a.devices().pop().platform == "cpu":
      self.__array_interface__ = dict(interface, version=3)
    else:
      self.__cuda_array_interface__ = interface


def _torch_device(a: jax.Array) -> torch.device:
  dev = a.devices().pop()
  if dev.platform == "cpu":
    return torch.device("cpu")
  index = getattr(dev, "local_hardware_id", None)
  return torch.device("cuda", dev.id if index is None else index)


def _torch_dtype(a: jax.Array) -> tuple[torch.dtype, str]:
  """The torch dtype of ``a`` and the array-interface typestr its buffer crosses as."""
  name = np.dtype(a.dtype).name
  if name in _TORCH_VIEW_DTYPES:
    return _TORCH_VIEW_DTYPES[name], _SAME_WIDTH_INT[np.dtype(a.dtype).itemsize]
  return torch.from_numpy(np.empty(0, a.dtype)).dtype, np.dtype(a.dtype).str


def to_torch(a: jax.Array, name: str) -> torch.Tensor:
  """A torch view of a JAX array, ready to use (waits for JAX on the host), whose buffer
  is freed the moment torch drops its last reference (see the module docstring)."""
  if len(a.devices()) != 1:
    raise BridgeError(f"output {name} is sharded over {len(a.devices())} devices; the bridge "
                      "hands torch single-device arrays only")
  dtype, typestr = _torch_dtype(a)
  device = _torch_device(a)
  if a.size == 0:
    return torch.empty(a.shape, dtype=dtype, device=device)
  a.block_until_ready()
  owner = _JaxBufferOwner(a, typestr)
  if device.type == "cpu":
    t = torch.from_numpy(np.asarray(owner))
  else:
    with torch.cuda.device(device):
      t = torch.as_tensor(owner, device=device)
  if t.dtype != dtype:
    t = t.view(dtype)
  if t.data_ptr() != a.unsafe_buffer_pointer():
    raise BridgeError(f"torch copied JAX output {name} instead of sharing it; this is a bridge bug")
  return t
