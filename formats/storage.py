"""How a packed K/V is stored, as one value: ``KVStorage``.

Every producer (the projection, the torch ops, the layer) and every consumer that
builds a packed K/V takes one ``KVStorage`` instead of the five loose settings it
replaces (block classes, K scheme, V scheme and the two rotation seeds). It is frozen,
hashable (a jit static argument), checked once at construction, and crosses the torch
custom-op boundary as JSON text.

Precision per 64-token block comes from exactly one of:

* ``token_ranges``: ``(start, end, class)`` half-open token ranges above ``default``
  (a text prefix, reference frames...); resolved for each sequence length.
* ``block_classes``: one class per block, for one sequence length.
* ``policy`` + ``policy_key``: a calibrated ``PrecisionPolicy`` and the key (layer,
  or (layer, timestep)) whose classes to use.

Class names (``"int4"``) and ids (``0``) are both accepted and normalized to ids here,
once. ``KVStorage()`` is the library's one default: every block int4, K per channel,
V per token, rotation seeds 0 and 1.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from typing import Hashable

import numpy as np

from formats import packed_kv as fmt
from formats.calibration import PrecisionPolicy


def json_fields(text: str, cls, extra=()) -> dict:
  """The fields of a settings value (a frozen dataclass: ``KVStorage``, ``QKVLayout``,
  ``Dense``, ``Sol``) from its ``to_json()`` text; anything else raises ValueError naming
  the class and, for unknown keys, its settings. ``extra``: keys allowed beside the
  fields (a kind tag)."""
  name = cls.__name__
  try:
    d = json.loads(text)
  except (TypeError, ValueError) as e:
    raise ValueError(f"expected {name}.to_json() text, got {text!r}") from e
  if not isinstance(d, dict):
    raise ValueError(f"expected {name}.to_json() text, got {text!r}")
  known = [f.name for f in dataclasses.fields(cls)]
  unknown = set(d) - set(known) - set(extra)
  if unknown:
    raise ValueError(f"{name} has no setting {sorted(unknown)}; its settings are {known}")
  return d


def class_id(c) -> int:
  """A class given by name (``"int8"``) or id (``1``) -> its id; anything else raises
  naming the classes there are."""
  if isinstance(c, str):
    if c in fmt.CLASS_ID:
      return fmt.CLASS_ID[c]
  elif isinstance(c, (int, np.integer)) and not isinstance(c, bool) and 0 <= int(c) < len(fmt.CLASSES):
    return int(c)
  raise ValueError(f"unknown precision class {c!r}; use a name in {fmt.CLASSES} or its index "
                   f"0..{len(fmt.CLASSES) - 1}")


@dataclasses.dataclass(frozen=True)
class KVStorage:
  """Precision classes, quantization schemes and rotation seeds of a packed K/V.

  default: the class of every block nothing else raises (name or id).
  token_ranges: ``((start, end, class), ...)`` token ranges stored at least at ``class``.
  block_classes: one class per 64-token block (fixes the sequence length).
  policy / policy_key: a ``PrecisionPolicy`` and the key to read from it.
  k_scheme / v_scheme: ``formats.K_SCHEMES`` / ``formats.V_SCHEMES``.
  rotation_seed_k / rotation_seed_v: seeds of the Hadamard rotations R_k and R_v.
  """
  default: str | int = "int4"
  token_ranges: tuple = ()
  block_classes: tuple | None = None
  policy: PrecisionPolicy | None = None
  policy_key: Hashable = None
  k_scheme: str = fmt.DEFAULT_K_SCHEME
  v_scheme: str = fmt.DEFAULT_V_SCHEME
  rotation_seed_k: int = 0
  rotation_seed_v: int = 1

  def __post_init__(self):
    put = lambda name, value: object.__setattr__(self, name, value)
    try:
      put("default", fmt.CLASSES[class_id(self.default)])
    except ValueError as e:
      raise ValueError(f"default: {e}") from None
    ranges = []
    for r in self.token_ranges or ():
      if len(r) != 3:
        raise ValueError(f"token_ranges entries must be (start, end, class), got {r!r}")
      start, end, cls = r
      if not (isinstance(start, (int, np.integer)) and isinstance(end, (int, np.integer)) and 0 <= start < end):
        raise ValueError(f"token range ({start}, {end}) must be integers with 0 <= start < end")
      try:
        ranges.append((int(start), int(end), fmt.CLASSES[class_id(cls)]))
      except ValueError as e:
        raise ValueError(f"token_ranges: {e}") from None
    put("token_ranges", tuple(ranges))
    if self.block_classes is not None:
      try:
        put("block_classes", tuple(class_id(c) for c in self.block_classes))
      except ValueError as e:
        raise ValueError(f"block_classes: {e}") from None
      if not self.block_classes:
        raise ValueError("block_classes is empty; give one class per 64-token block or leave it None")
    sources = [name for name, on in (("token_ranges", bool(self.token_ranges)),
                                     ("block_classes", self.block_classes is not None),
                                     ("policy", self.policy is not None)) if on]
    if len(sources) > 1:
      raise ValueError(f"give one source of block classes, got {' and '.join(sources)}")
    if self.policy is not None:
      if not isinstance(self.policy, PrecisionPolicy):
        raise ValueError(f"policy must be a formats.PrecisionPolicy, got {type(self.policy).__name__}")
      if self.policy_key not in self.policy.ranges:
        raise ValueError(f"policy_key {self.policy_key!r} is not in the policy; it knows "
                         f"{sorted(map(str, self.policy.ranges))}")
    elif self.policy_key is not None:
      raise ValueError("policy_key given without a policy")
    if self.k_scheme not in fmt.K_SCHEMES:
      raise ValueError(f"k_scheme {self.k_scheme!r} unknown; use one of {fmt.K_SCHEMES}")
    if self.v_scheme not in fmt.V_SCHEMES:
      raise ValueError(f"v_scheme {self.v_scheme!r} unknown; use one of {fmt.V_SCHEMES}")
    for name in ("rotation_seed_k", "rotation_seed_v"):
      seed = getattr(self, name)
      if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"{name} must be a non-negative int, got {seed!r}")
      put(name, int(seed))
    # The JSON text is made once here: torch.compile can read an attribute of a constant
    # but cannot trace json.dumps, and the ops take the text on every call.
    put("_json", self._make_json())

  def __hash__(self):
    # A PrecisionPolicy holds dicts (and a report equality ignores): hash what equality
    # compares, in a canonical order.
    policy = None
    if self.policy is not None:
      policy = (self.policy.num_tokens, tuple(sorted((json.dumps(k if not isinstance(k, tuple) else list(k)),
                                                      tuple(map(tuple, v))) for k, v in self.policy.ranges.items())))
    return hash((self.default, self.token_ranges, self.block_classes, policy, self.policy_key, self.k_scheme,
                 self.v_scheme, self.rotation_seed_k, self.rotation_seed_v))

  # ------------------------------------------------------------------------------------
  def classes_for(self, num_tokens: int) -> tuple[int, ...]:
    """The class id of each 64-token block of a sequence of ``num_tokens`` tokens."""
    num_blocks = -(-int(num_tokens) // fmt.BLOCK)
    if self.block_classes is not None:
      if len(self.block_classes) != num_blocks:
        raise ValueError(f"block_classes has {len(self.block_classes)} entries but T = {num_tokens} has "
                         f"{num_blocks} blocks of {fmt.BLOCK}; give one class per block, or use token_ranges "
                         f"(which fit any T)")
      return self.block_classes
    if self.policy is not None:
      return self.policy.block_classes(self.policy_key, num_tokens)
    return fmt.resolve_block_classes(int(num_tokens), self.token_ranges, self.default)

  def meta(self, batch: int, heads: int, head_dim: int, num_tokens: int) -> fmt.PackedKVMeta:
    """The ``PackedKVMeta`` of a (batch, num_tokens, heads, head_dim) K/V stored this way."""
    return fmt.PackedKVMeta(int(batch), int(heads), int(head_dim), int(num_tokens), self.classes_for(num_tokens),
                            self.k_scheme, self.v_scheme, self.rotation_seed_k, self.rotation_seed_v)

  @classmethod
  def of(cls, meta: fmt.PackedKVMeta) -> "KVStorage":
    """The storage an existing packed K/V was written with."""
    return _storage_of(meta)

  @classmethod
  def _of(cls, meta: fmt.PackedKVMeta) -> "KVStorage":
    return cls(block_classes=meta.block_classes, k_scheme=meta.k_scheme, v_scheme=meta.v_scheme,
               rotation_seed_k=meta.rotation_seed_k, rotation_seed_v=meta.rotation_seed_v)

  # ------------------------------------------------------------------------------------
  def to_json(self) -> str:
    """JSON text (how it crosses a torch custom op's schema); ``from_json`` inverts it."""
    return self._json

  def _make_json(self) -> str:
    d = {"default": self.default, "token_ranges": [list(r) for r in self.token_ranges],
         "block_classes": None if self.block_classes is None else list(self.block_classes),
         "policy": None if self.policy is None else self.policy.to_json(),
         "policy_key": self.policy_key if not isinstance(self.policy_key, tuple) else list(self.policy_key),
         "k_scheme": self.k_scheme, "v_scheme": self.v_scheme,
         "rotation_seed_k": self.rotation_seed_k, "rotation_seed_v": self.rotation_seed_v}
    return json.dumps(d, sort_keys=True, separators=(",", ":"))

  @classmethod
  def from_json(cls, text: str) -> "KVStorage":
    d = json_fields(text, cls)
    if d.get("policy") is not None:
      d["policy"] = PrecisionPolicy.from_json(d["policy"])
    if isinstance(d.get("policy_key"), list):
      d["policy_key"] = tuple(d["policy_key"])
    d["token_ranges"] = tuple(tuple(r) for r in d.get("token_ranges") or ())
    return cls(**d)


@functools.lru_cache(maxsize=256)
def _storage_of(meta: fmt.PackedKVMeta) -> KVStorage:
  return KVStorage._of(meta)


def as_storage(storage) -> KVStorage:
  """``None`` -> the default ``KVStorage()``; a ``KVStorage`` as is; anything else raises."""
  if storage is None:
    return KVStorage()
  if not isinstance(storage, KVStorage):
    raise ValueError(f"storage must be a formats.KVStorage, got {type(storage).__name__}; e.g. "
                     "KVStorage(token_ranges=[(0, 4096, 'int8')])")
  return storage
