"""Attention settings as values: ``Dense(...)`` and ``Sol(...)``.

Each config owns its method, its scratch budget and its kernel tiles, is frozen and
hashable (a jit static argument), and checks itself at construction, so a bad setting
fails where it is written, not at the first forward. They cross the torch custom-op
boundary as JSON text (``to_json`` / ``attention_from_json``).

* ``Dense``: ``packed_attention``, which also takes the masks (segment ids, key masks,
  key lengths): masks belong to dense attention only.
* ``Sol``: ``sol_attention`` (comfy-kitchen's ``sol_attn`` settings: tau, top-k, sinks,
  the pooled tail), which takes a key bias and block lengths but no masks.

``scratch_bytes`` is the bound on the streamed methods' scratch; the layer also gives
it to the projection (the two never run at the same time).
"""
from __future__ import annotations

import dataclasses
import json
import math

import numpy as np

from formats.storage import json_fields

# The one default scratch budget of the library (projection chunks, dense head groups,
# Sol head groups).
DEFAULT_SCRATCH_BYTES = 512 << 20

DENSE_METHODS = ("auto", "streamed", "fused")
DENSE_QK = ("bf16", "int8")   # the precision of dense attention's Q.K dot
SOL_METHODS = ("auto", "fused", "streamed", "streamed_int8")
# Routed-list capacity under tau when the caller gives none: 1024 blocks = 64k exact keys
# per query block. Fixed, so Sol's metadata grows with T, not T**2.
DEFAULT_MAX_EXACT_TAU = 1024
# Budget for one chunk of Sol's (B, H, chunk, NB) proxy-score matrix in routing.
DEFAULT_ROUTE_CHUNK_BYTES = 32 << 20


def _check_sm_scale(value):
  if value is None:
    return None
  value = float(value)
  if not (math.isfinite(value) and value > 0):
    raise ValueError(f"sm_scale must be a positive finite number or None (1/sqrt(D)), got {value}")
  return value


def _check_scratch(value) -> int:
  if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
    raise ValueError(f"scratch_bytes must be a non-negative int (bytes), got {value!r}")
  return int(value)


def _check_launch(name, value, allowed):
  if value is not None and value not in allowed:
    raise ValueError(f"{name} must be one of {allowed} or None, got {value!r}")
  return value


def _sink_pair(value, name: str):
  if value is None:
    return None
  if isinstance(value, (str, bytes)) or not hasattr(value, "__len__"):
    raise ValueError(f"{name} must be a pair [start, end) of block indices or None, got {value!r}")
  value = tuple(value)
  if len(value) != 2:
    raise ValueError(f"{name} must have 2 elements [start, end), got {len(value)}")
  if not all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in value):
    raise ValueError(f"{name} entries must be ints, got {value}")
  start, end = (int(x) for x in value)
  if start < 0 or end < 0:
    raise ValueError(f"{name} entries must be non-negative, got {list(value)}")
  if end < start:
    raise ValueError(f"{name} must be [start, end) with end >= start, got {list(value)}")
  return start, end


class _Config:
  """JSON round trip shared by both configs. The text is made once, after the checks
  (``_freeze``): torch.compile reads an attribute of a constant but cannot trace
  json.dumps, and the torch ops take the text on every call."""
  kind: str

  def to_json(self) -> str:
    return self._json

  def _freeze(self):
    d = {"kind": self.kind, **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}}
    object.__setattr__(self, "_json", json.dumps(d, sort_keys=True, separators=(",", ":")))


@dataclasses.dataclass(frozen=True)
class Dense(_Config):
  """Dense attention over a packed K/V (``packed_attention``).

  sm_scale: softmax scale (None: 1/sqrt(D)).
  method: ``"auto"`` (streamed where cuDNN runs and no segment ids / key mask are given,
    else fused), ``"streamed"`` (head groups decoded into bf16 scratch, cuDNN on each)
    or ``"fused"`` (one Pallas kernel decoding tiles in registers, no scratch).
  scratch_bytes: the streamed method's bound on its scratch.
  block_q, num_warps, num_stages: the fused kernel's launch (None: its defaults);
    num_warps and num_stages also launch the ``qk="int8"`` loop (None: 4 and 2).
  qk: ``"bf16"`` (default) or ``"int8"``: Q.K as one int8 dot per tile (Q per row,
    K - its global mean per token, both absmax / 127), P.V in bf16, in Sol's loop over
    decoded head groups with every key block exact (``sol_decoded``). Self-attention
    (Tq = Tkv) without masks; ``scratch_bytes`` bounds the group's stores. Its speed
    against cuDNN is not measured yet (``benchmarks/NOTES.md``): bf16 stays the default.
  """
  sm_scale: float | None = None
  method: str = "auto"
  scratch_bytes: int = DEFAULT_SCRATCH_BYTES
  block_q: int = 256
  num_warps: int | None = None
  num_stages: int | None = None
  qk: str = "bf16"
  kind = "dense"

  def __post_init__(self):
    object.__setattr__(self, "sm_scale", _check_sm_scale(self.sm_scale))
    if self.method not in DENSE_METHODS:
      raise ValueError(f"Dense method must be one of {DENSE_METHODS}, got {self.method!r}")
    if self.qk not in DENSE_QK:
      raise ValueError(f"Dense qk must be one of {DENSE_QK}, got {self.qk!r}")
    if self.qk == "int8" and self.method == "fused":
      raise ValueError("Dense(qk='int8') runs over decoded head groups, not the fused kernel; use method='auto' "
                       "or 'streamed'")
    object.__setattr__(self, "scratch_bytes", _check_scratch(self.scratch_bytes))
    if not isinstance(self.block_q, (int, np.integer)) or self.block_q < 16 or self.block_q & (self.block_q - 1):
      raise ValueError(f"block_q must be a power of two >= 16, got {self.block_q!r}")
    _check_launch("num_warps", self.num_warps, (1, 2, 4, 8, 16))
    _check_launch("num_stages", self.num_stages, (1, 2, 3, 4, 5, 6, 7, 8))
    self._freeze()


@dataclasses.dataclass(frozen=True)
class Sol(_Config):
  """Sol sparse attention over a packed K/V (``sol_attention``); the semantics are
  comfy-kitchen's ``sol_attn`` (``pallas_kernels/sol.py`` states them).

  tau: routing threshold in sigmas of the proxy row (lower routes more blocks).
  topk_ratio: 0, or the fraction of non-sink key blocks each query block keeps (tau
    is then ignored).
  sink_blocks / sink_q: ``(start, end)`` key blocks exact for every query / query blocks
    that see every key block exactly; None for none.
  tail: keep the pooled term of the blocks not attended exactly.
  max_exact: routed-list capacity per query block (None: top-k's count + 3, or
    ``DEFAULT_MAX_EXACT_TAU`` under tau).
  sm_scale: softmax scale (None: 1/sqrt(D)).
  method: ``"auto"``, ``"fused"``, ``"streamed"`` or ``"streamed_int8"``
    (``sol_attention``'s docstring; ``auto`` picks by the measured ranking).
  scratch_bytes: the streamed methods' bound on their scratch.
  num_warps / num_stages: the Sol kernel's launch. route_chunk_bytes: routing's chunk.
  """
  tau: float = 1.0
  topk_ratio: float = 0.0
  sink_blocks: tuple | None = None
  sink_q: tuple | None = None
  tail: bool = True
  max_exact: int | None = None
  sm_scale: float | None = None
  method: str = "auto"
  scratch_bytes: int = DEFAULT_SCRATCH_BYTES
  num_warps: int = 4
  num_stages: int = 2
  route_chunk_bytes: int = DEFAULT_ROUTE_CHUNK_BYTES
  kind = "sol"

  def __post_init__(self):
    put = lambda name, value: object.__setattr__(self, name, value)
    try:
      tau = float(self.tau)
    except (TypeError, ValueError):
      raise ValueError(f"tau must be a number, got {self.tau!r}") from None
    if math.isnan(tau):
      raise ValueError("tau must not be NaN")
    put("tau", tau)
    try:
      topk = float(self.topk_ratio or 0.0)
    except (TypeError, ValueError):
      raise ValueError(f"topk_ratio must be a number, got {self.topk_ratio!r}") from None
    if topk and not 0.0 < topk < 1.0:
      raise ValueError(f"topk_ratio must be 0 or in (0, 1), got {topk}")
    put("topk_ratio", topk)
    put("sink_blocks", _sink_pair(self.sink_blocks, "sink_blocks"))
    put("sink_q", _sink_pair(self.sink_q, "sink_q"))
    if not isinstance(self.tail, (bool, np.bool_, int, np.integer)) or self.tail not in (0, 1):
      raise ValueError(f"tail must be True or False, got {self.tail!r}")
    put("tail", bool(self.tail))
    if self.max_exact is not None:
      if not isinstance(self.max_exact, (int, np.integer)) or self.max_exact < 3:
        raise ValueError(f"max_exact must be an int >= 3 (the diagonal +-1 is always exact), got "
                         f"{self.max_exact!r}")
      put("max_exact", int(self.max_exact))
    put("sm_scale", _check_sm_scale(self.sm_scale))
    if self.method not in SOL_METHODS:
      raise ValueError(f"Sol method must be one of {SOL_METHODS}, got {self.method!r}")
    put("scratch_bytes", _check_scratch(self.scratch_bytes))
    _check_launch("num_warps", self.num_warps, (1, 2, 4, 8, 16))
    _check_launch("num_stages", self.num_stages, (1, 2, 3, 4, 5, 6, 7, 8))
    if not isinstance(self.route_chunk_bytes, (int, np.integer)) or self.route_chunk_bytes <= 0:
      raise ValueError(f"route_chunk_bytes must be a positive int, got {self.route_chunk_bytes!r}")
    self._freeze()


ATTENTIONS = {"dense": Dense, "sol": Sol}


def attention_from_json(text: str):
  """``Dense`` or ``Sol`` from its ``to_json()`` text."""
  try:
    kind = json.loads(text).get("kind")
  except (TypeError, ValueError, AttributeError):
    kind = None
  if kind not in ATTENTIONS:
    raise ValueError(f"attention JSON must carry kind 'dense' or 'sol': attention must be Dense(...).to_json() "
                     f"or Sol(...).to_json() text, got {text!r}")
  cls = ATTENTIONS[kind]
  d = json_fields(text, cls, extra=("kind",))
  d.pop("kind")
  return cls(**d)


def as_attention(attention):
  """``None`` -> ``Dense()``; a ``Dense`` / ``Sol`` as is; anything else raises naming both."""
  if attention is None:
    return Dense()
  if not isinstance(attention, (Dense, Sol)):
    raise ValueError(f"attention must be Dense(...) or Sol(...) from pallas_kernels, got {attention!r}")
  return attention
