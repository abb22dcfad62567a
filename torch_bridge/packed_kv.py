"""Torch mirror of the packed K/V format (formats/FORMAT.md, version 3).

Why a mirror and not a conversion: the torch side must see the very buffers the
projection kernel wrote, with no copy and no BF16 expansion. ``TorchPackedKV`` holds
the same named tensors as ``formats.PackedKV`` (one per ``formats.ARRAY_NAMES``) and
the same ``formats.PackedKVMeta``; ``from_jax`` / ``to_jax`` move between the two
pointer for pointer (DLPack one way, the array interface the other: see ``dlpack``).

The metadata crosses as ``PackedKVMeta.to_dict()``: JSON text, or a small uint8
tensor of that UTF-8 JSON (``meta_to_tensor``) when it must travel with tensors (a
checkpoint, a torch collective). ``meta_from_tensor`` reads it from a torch tensor, a
numpy array or a jax array alike, so both frameworks read one record.
"""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import torch

import formats
from formats import ARRAY_NAMES, PackedKV, PackedKVMeta
from torch_bridge import dlpack

TORCH_DTYPES = {"uint8": torch.uint8, "float32": torch.float32, "float16": torch.float16,
                "bfloat16": torch.bfloat16}


def torch_buffer_specs(meta: PackedKVMeta) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
  """``formats.buffer_specs`` with torch dtypes."""
  return {n: (shape, TORCH_DTYPES[dt]) for n, (shape, dt) in formats.buffer_specs(meta).items()}


def meta_to_json(meta: PackedKVMeta) -> str:
  return json.dumps(meta.to_dict(), sort_keys=True, separators=(",", ":"))


def meta_from_json(text: str) -> PackedKVMeta:
  return PackedKVMeta.from_dict(json.loads(text))


def meta_to_tensor(meta: PackedKVMeta, device: torch.device | str = "cpu") -> torch.Tensor:
  """The metadata as a 1-D uint8 tensor of UTF-8 JSON (a few hundred bytes)."""
  raw = np.frombuffer(meta_to_json(meta).encode("utf-8"), np.uint8).copy()
  return torch.from_numpy(raw).to(device)


def meta_from_tensor(t) -> PackedKVMeta:
  """Read ``meta_to_tensor`` output from a torch tensor, numpy array or jax array."""
  if isinstance(t, torch.Tensor):
    raw = t.detach().cpu().numpy()
  else:
    raw = np.asarray(t)
  if raw.dtype != np.uint8 or raw.ndim != 1:
    raise ValueError("packed K/V metadata must be a 1-D uint8 array of JSON (meta_to_tensor), got "
                     f"{raw.dtype}{list(raw.shape)}")
  return meta_from_json(raw.tobytes().decode("utf-8"))


@dataclasses.dataclass(frozen=True)
class TorchPackedKV:
  """The tensors of one packed K/V plus its metadata, torch side.

  ``tensors`` maps each name of ``formats.ARRAY_NAMES`` to a torch tensor of the shape
  and dtype ``formats.buffer_specs(meta)`` gives. It is inference data: never written
  in place while a kernel may read it.
  """
  meta: PackedKVMeta
  tensors: dict

  def __getattr__(self, name):  # packed.k_codes4 etc.
    if name in ARRAY_NAMES:
      return self.tensors[name]
    raise AttributeError(name)

  @property
  def device(self) -> torch.device:
    return self.tensors[ARRAY_NAMES[0]].device

  def as_tuple(self) -> tuple[torch.Tensor, ...]:
    """The tensors in ``formats.ARRAY_NAMES`` order (the custom ops' calling convention)."""
    return tuple(self.tensors[n] for n in ARRAY_NAMES)

  @classmethod
  def from_tuple(cls, meta: PackedKVMeta, tensors) -> "TorchPackedKV":
    tensors = tuple(tensors)
    if len(tensors) != len(ARRAY_NAMES):
      raise ValueError(f"need {len(ARRAY_NAMES)} tensors in formats.ARRAY_NAMES order, got {len(tensors)}")
    return cls(meta, dict(zip(ARRAY_NAMES, tensors)))

  def check(self) -> None:
    """Raise ``BridgeError`` naming the first tensor that breaks the format or the
    zero-copy rules (shape, dtype, device, contiguity, alignment)."""
    device = self.device
    for name, (shape, dtype) in torch_buffer_specs(self.meta).items():
      t = self.tensors.get(name)
      if t is None:
        raise dlpack.BridgeError(f"TorchPackedKV is missing tensor {name!r}")
      dlpack.check_tensor(t, f"packed.{name}", dtype=dtype, shape=shape, device=device)

  def nbytes(self) -> int:
    return sum(t.numel() * t.element_size() for t in self.tensors.values())

  def meta_tensor(self, device: torch.device | str = "cpu") -> torch.Tensor:
    return meta_to_tensor(self.meta, device)

  @classmethod
  def from_jax(cls, packed: PackedKV) -> "TorchPackedKV":
    """Zero-copy torch views of a ``formats.PackedKV``."""
    formats.check_packed(packed)
    return cls(packed.meta, {n: dlpack.to_torch(packed.arrays[n], n) for n in ARRAY_NAMES})

  def to_jax(self) -> PackedKV:
    """Zero-copy JAX views (a ``formats.PackedKV``). Do not write these tensors from
    torch while the JAX arrays are in use: JAX assumes its arrays are immutable."""
    self.check()
    return PackedKV(self.meta, {n: dlpack.to_jax(self.tensors[n], f"packed.{n}") for n in ARRAY_NAMES})

  def state_dict(self) -> dict:
    """Tensors plus the metadata tensor, e.g. for ``torch.save``."""
    return dict(self.tensors) | {"meta": self.meta_tensor()}

  @classmethod
  def from_state_dict(cls, state: dict) -> "TorchPackedKV":
    return cls(meta_from_tensor(state["meta"]), {n: state[n] for n in ARRAY_NAMES})
