"""Packed low-bit K/V format, version 3: data, metadata and the plain-jnp reference.

The byte-level specification lives in ``formats/FORMAT.md``; this module is its
executable form. Everything here is plain jnp/numpy and defines what the Pallas
kernels must produce (projection epilogue) and consume (attention).

Vocabulary
----------
* block: 64 consecutive tokens of one sequence. It is the quantization tile, the
  attention K/V tile and the Sol routing block at once.
* class: the storage precision of a block, one of ``CLASSES``: ``int4`` (default),
  ``k5v4``, ``k5v5``, ``int8`` or ``bf16``. A class gives K and V each a code width
  (``CLASS_WIDTHS``: 4, 5, 8 or 16 bits). Every block of every head and batch row
  has the same class, chosen by a token-range / layer / timestep policy
  (``resolve_block_classes``).
* store: the compact arrays of one role (K or V) at one width; slot: a block's
  position inside the store its class gives each role (``PackedKVMeta.block_slots``).
  An int4 block costs 4 bits per value, a k5v4 block 5 for K and 4 for V (its V
  shares the 4-bit V store with the int4 blocks).
* rotation: K and Q are multiplied by an orthogonal matrix ``R_k`` after RoPE, V by
  ``R_v``. Both are signed Walsh-Hadamard matrices built from a seed
  (``hadamard_rotation``). ``(q R)(k R)^T = q k^T``, so attention is unchanged.

Quantization schemes (asymmetric, ``x ~ code * scale + zero``)
----------------------------------------------------------------
* K ``"channel"``: one (scale, zero) per channel per 64-token block (KIVI-style; the
  zero point absorbs the per-channel offsets DiT keys carry).
* K ``"token"``: one (scale, zero) per token over the head dim.
* V ``"token"``: one (scale, zero) per token over the head dim.
* V ``"token_g64"``: one (scale, zero) per token per 64-channel half.
The defaults (K ``channel``, V ``token``) were picked by ``benchmarks/quant_schemes.py``
(``benchmarks/results/quant_schemes.json``, DiT-like data, int4): K ``channel`` beats K
``token`` on every seed (attention cos 0.9981 vs 0.9970 on average, rel L1 0.053 vs
0.066); V ``token_g64`` gains only ~1e-4 in cos over V ``token`` for 0.25 more bits per
value, so V stays per token.
"""
from __future__ import annotations

import dataclasses
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "ARRAY_NAMES",
    "BLOCK",
    "CLASSES",
    "CLASS_ID",
    "CLASS_WIDTHS",
    "CODE_LEVELS",
    "PRECISION_ORDER",
    "WIDTHS",
    "class_rank",
    "pack_bits",
    "store_names",
    "unpack_bits",
    "DEFAULT_K_SCHEME",
    "DEFAULT_V_SCHEME",
    "FORMAT_VERSION",
    "K_SCHEMES",
    "PARAM_DTYPE",
    "STAT_DTYPE",
    "PackedKV",
    "PackedKVMeta",
    "SUPPORTED_HEAD_DIMS",
    "check_head_dim",
    "V_SCHEMES",
    "asymmetric_params",
    "block_stats_reference",
    "bits_per_value",
    "buffer_specs",
    "check_packed",
    "check_query",
    "dequantize_reference",
    "hadamard_rotation",
    "hadamard_signs",
    "pack_nibbles",
    "quantize_codes",
    "quantize_reference",
    "round_params",
    "resolve_block_classes",
    "scale_shape",
    "sylvester",
    "unpack_nibbles",
]

FORMAT_VERSION = 3
READABLE_VERSIONS = (2, 3)
# Version 3 adds the classes k5v4 and k5v5 (K and V with their own code widths, 5-bit
# stores); a version-2 record is a version-3 record that uses classes 0-2 only, so it
# stays readable. Version 2 stores scales and zeros in float16 and the block statistics in bfloat16
# (version 1: float32). The format-v2 study (benchmarks/NOTES.md) measured no quality
# cost: codes are chosen against the rounded parameters, so the decoder sees exactly
# what the quantizer used. Stats are bfloat16 because a V sum over 64 tokens can pass
# float16's 65,504; they only steer Sol's routing and pooled tail.
PARAM_DTYPE = "float16"
STAT_DTYPE = "bfloat16"
FP16_MAX = 65504.0
BLOCK = 64
# Class ids are wire values (block_classes): new classes append, never renumber.
CLASSES = ("int4", "int8", "bf16", "k5v4", "k5v5")
CLASS_ID = {name: i for i, name in enumerate(CLASSES)}
# (K width, V width) in bits of each class; 16 is the bf16 store.
CLASS_WIDTHS = {"int4": (4, 4), "int8": (8, 8), "bf16": (16, 16), "k5v4": (5, 4), "k5v5": (5, 5)}
WIDTHS = (4, 5, 8, 16)
# Largest code of each quantized width (codes are in [0, L]).
CODE_LEVELS = {4: 15, 5: 31, 8: 255}
# Lowest to highest precision: where two policies meet, the higher class wins.
PRECISION_ORDER = ("int4", "k5v4", "k5v5", "int8", "bf16")
K_SCHEMES = ("channel", "token")
V_SCHEMES = ("token", "token_g64")
DEFAULT_K_SCHEME = "channel"
DEFAULT_V_SCHEME = "token"
SUPPORTED_HEAD_DIMS = (64, 128)


# --------------------------------------------------------------------------------------
# Rotation
# --------------------------------------------------------------------------------------
def sylvester(n: int) -> np.ndarray:
  """The unsigned Sylvester Hadamard matrix H_n (entries +-1, n a power of two):
  ``H_1 = [1]``, ``H_2m = [[H_m, H_m], [H_m, -H_m]]``."""
  h = np.ones((1, 1), np.float32)
  while h.shape[0] < n:
    h = np.block([[h, h], [h, -h]])
  return h


def check_head_dim(head_dim) -> int:
  """The one rule for head dims: the Hadamard rotation and the kernels' tiles take 64
  and 128."""
  if head_dim not in SUPPORTED_HEAD_DIMS:
    raise ValueError(f"head_dim={head_dim} is not supported; use one of {SUPPORTED_HEAD_DIMS}")
  return int(head_dim)


def hadamard_signs(head_dim: int, seed: int) -> np.ndarray:
  """Sylvester Hadamard matrix (entries +-1) with rows sign-flipped from ``seed``.

  ``hadamard_signs(d, s) / sqrt(d)`` is the rotation. Kernels multiply by the +-1
  matrix (exact in bf16) and scale by 1/sqrt(d) in f32.
  """
  check_head_dim(head_dim)
  h = sylvester(head_dim)
  signs = np.random.default_rng(seed).choice(np.array([-1.0, 1.0], np.float32), size=head_dim)
  return (signs[:, None] * h).astype(np.float32)


def hadamard_rotation(head_dim: int, seed: int) -> np.ndarray:
  """Orthogonal (head_dim, head_dim) float32 rotation ``diag(signs) H / sqrt(d)``."""
  return hadamard_signs(head_dim, seed) / np.float32(np.sqrt(head_dim))


# --------------------------------------------------------------------------------------
# Precision policy: token ranges / layers / timesteps -> per-block classes
# --------------------------------------------------------------------------------------
def class_rank(cls) -> int:
  """Position of a class (name or id) in ``PRECISION_ORDER``."""
  return PRECISION_ORDER.index(CLASSES[cls] if isinstance(cls, (int, np.integer)) else cls)


def resolve_block_classes(
    num_tokens: int,
    token_ranges: Sequence[tuple[int, int, str]] = (),
    default: str = "int4",
    *,
    layer: int | None = None,
    layer_classes: dict[int, str] | None = None,
    timestep: float | None = None,
    timestep_classes: Sequence[tuple[float, float, str]] = (),
) -> tuple[int, ...]:
  """Class id of each 64-token block.

  ``token_ranges``: ``(start, end, class)`` half-open token ranges (text, references,
  audio...). ``layer_classes`` maps a layer index to a class for the whole layer, and
  ``timestep_classes`` holds ``(t_lo, t_hi, class)`` intervals (inclusive) for the
  whole step. The highest precision that applies wins (``PRECISION_ORDER``), and a
  block holding any token of a higher class takes that class.
  """
  for name in [default, *(r[2] for r in token_ranges), *(layer_classes or {}).values(),
               *(t[2] for t in timestep_classes)]:
    if name not in CLASS_ID:
      raise ValueError(f"unknown precision class {name!r}; use one of {CLASSES}")
  if num_tokens <= 0:
    raise ValueError(f"num_tokens must be positive, got {num_tokens}")
  # Work in ranks (PRECISION_ORDER), return ids.
  floor_rank = class_rank(default)
  if layer is not None and layer_classes and layer in layer_classes:
    floor_rank = max(floor_rank, class_rank(layer_classes[layer]))
  if timestep is not None:
    for lo, hi, name in timestep_classes:
      if lo <= timestep <= hi:
        floor_rank = max(floor_rank, class_rank(name))
  num_blocks = -(-num_tokens // BLOCK)
  ranks = np.full((num_blocks,), floor_rank, np.int32)
  for start, end, name in token_ranges:
    if not (0 <= start < end <= num_tokens):
      raise ValueError(f"token range ({start}, {end}) is outside [0, {num_tokens})")
    b0, b1 = start // BLOCK, -(-end // BLOCK)
    ranks[b0:b1] = np.maximum(ranks[b0:b1], class_rank(name))
  return tuple(CLASS_ID[PRECISION_ORDER[r]] for r in ranks)


# --------------------------------------------------------------------------------------
# Metadata record
# --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class PackedKVMeta:
  """Versioned, hashable description of one packed K/V (static under jit)."""
  batch: int
  heads: int
  head_dim: int
  num_tokens: int
  block_classes: tuple[int, ...]
  k_scheme: str = DEFAULT_K_SCHEME
  v_scheme: str = DEFAULT_V_SCHEME
  rotation_seed_k: int = 0
  rotation_seed_v: int = 1
  version: int = FORMAT_VERSION
  block: int = BLOCK

  def __post_init__(self):
    if self.version not in READABLE_VERSIONS:
      raise ValueError(f"packed K/V version {self.version} is not readable by version {FORMAT_VERSION} "
                       f"(reads {READABLE_VERSIONS})")
    if self.block != BLOCK:
      raise ValueError(f"block must be {BLOCK}, got {self.block}")
    check_head_dim(self.head_dim)
    if self.k_scheme not in K_SCHEMES:
      raise ValueError(f"k_scheme {self.k_scheme!r} unknown; use one of {K_SCHEMES}")
    if self.v_scheme not in V_SCHEMES:
      raise ValueError(f"v_scheme {self.v_scheme!r} unknown; use one of {V_SCHEMES}")
    if len(self.block_classes) != self.num_blocks:
      raise ValueError(f"block_classes has {len(self.block_classes)} entries, need {self.num_blocks}")
    known = range(3 if self.version == 2 else len(CLASSES))
    if any(c not in known for c in self.block_classes):
      raise ValueError("block_classes entries must be class ids: "
                       + ", ".join(f"{i} ({CLASSES[i]})" for i in known))

  @property
  def num_blocks(self) -> int:
    return -(-self.num_tokens // BLOCK)

  def slots(self, cls: str) -> tuple[int, ...]:
    """Global block index of every block of class ``cls``, in order."""
    cid = CLASS_ID[cls]
    return tuple(b for b, c in enumerate(self.block_classes) if c == cid)

  def block_widths(self, role: str) -> np.ndarray:
    """(NB,) int32: the code width of ``role`` ('k' or 'v') in each block."""
    i = ("k", "v").index(role)
    return np.asarray([CLASS_WIDTHS[CLASSES[c]][i] for c in self.block_classes], np.int32)

  def store_blocks(self, role: str, width: int) -> tuple[int, ...]:
    """Global block index of every slot of the ``role`` store of width ``width``, in
    order: the blocks whose class gives ``role`` that width."""
    return tuple(int(b) for b in np.flatnonzero(self.block_widths(role) == width))

  def widths(self, role: str) -> tuple[int, ...]:
    """The widths of ``role`` that have blocks, in ``WIDTHS`` order."""
    present = set(self.block_widths(role).tolist())
    return tuple(w for w in WIDTHS if w in present)

  def block_slots(self, role: str) -> np.ndarray:
    """(NB,) int32: each block's slot inside the ``role`` store of its width (the
    inverse of ``store_blocks``); with ``block_widths`` it locates every block's data."""
    out = np.zeros((self.num_blocks,), np.int32)
    for w in WIDTHS:
      for slot, blk in enumerate(self.store_blocks(role, w)):
        out[blk] = slot
    return out

  def to_dict(self) -> dict:
    return dataclasses.asdict(self) | {"block_classes": list(self.block_classes)}

  @staticmethod
  def from_dict(d: dict) -> "PackedKVMeta":
    return PackedKVMeta(**(d | {"block_classes": tuple(d["block_classes"])}))


def store_names(role: str, width: int) -> tuple[str, ...]:
  """PackedKV array names of the ``role`` store of width ``width``: codes (and the
  5-bit store's fifth-bit plane), scale, zero; or the bf16 store."""
  if width == 16:
    return (f"{role}_bf16",)
  extra = (f"{role}_bits5",) if width == 5 else ()
  return (f"{role}_codes{width}", *extra, f"{role}_scale{width}", f"{role}_zero{width}")


def scale_shape(meta: PackedKVMeta, role: str, width: int) -> tuple[int, ...]:
  """Shape of the scale (and zero) buffer of the ``role`` ('k' or 'v') store of width
  ``width``."""
  b, h, d = meta.batch, meta.heads, meta.head_dim
  n = len(meta.store_blocks(role, width))
  scheme = meta.k_scheme if role == "k" else meta.v_scheme
  if scheme == "channel":
    return (b, h, n, d)
  groups = 2 if scheme == "token_g64" else 1
  return (b, h, groups, n * BLOCK)


def buffer_specs(meta: PackedKVMeta) -> dict[str, tuple[tuple[int, ...], str]]:
  """Name -> (shape, dtype) of every array of a PackedKV. FORMAT.md documents each."""
  b, h, d, nb = meta.batch, meta.heads, meta.head_dim, meta.num_blocks
  specs = {}
  for role in ("k", "v"):
    for w in WIDTHS:
      n = len(meta.store_blocks(role, w)) * BLOCK
      if w == 16:
        specs[f"{role}_bf16"] = ((b, h, n, d), "bfloat16")
        continue
      specs[f"{role}_codes{w}"] = ((b, h, n, d if w == 8 else d // 2), "uint8")
      if w == 5:
        specs[f"{role}_bits5"] = ((b, h, n, d // 8), "uint8")
      specs[f"{role}_scale{w}"] = (scale_shape(meta, role, w), PARAM_DTYPE)
      specs[f"{role}_zero{w}"] = (scale_shape(meta, role, w), PARAM_DTYPE)
  specs["k_mean"] = ((b, h, nb, d), STAT_DTYPE)
  specs["v_sum"] = ((b, h, nb, d), STAT_DTYPE)
  return specs


def bits_per_value(meta: PackedKVMeta) -> float:
  """Stored bits per K or V value: every array of the PackedKV (codes, parameters,
  stats, padding of the last block) over the B*T*H*D values of K and V together."""
  total = sum(int(np.prod(shape)) * np.dtype(jnp.dtype(dtype)).itemsize for shape, dtype in buffer_specs(meta).values())
  return 8.0 * total / (2 * meta.batch * meta.num_tokens * meta.heads * meta.head_dim)


ARRAY_NAMES = tuple(buffer_specs(PackedKVMeta(1, 1, 64, 64, (0,))).keys())


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class PackedKV:
  """The arrays of one packed K/V plus its static metadata.

  ``arrays`` maps each name of ``buffer_specs(meta)`` to an array of that shape and
  dtype. Classes with no blocks have arrays with a zero-length token axis. Under jit
  the arrays are the pytree leaves and ``meta`` is static.
  """
  meta: PackedKVMeta
  arrays: dict

  def tree_flatten(self):
    return tuple(self.arrays[n] for n in ARRAY_NAMES), self.meta

  @classmethod
  def tree_unflatten(cls, meta, leaves):
    return cls(meta, dict(zip(ARRAY_NAMES, leaves)))

  def __getattr__(self, name):  # packed.k_codes4 etc.
    if name in ARRAY_NAMES:
      return self.arrays[name]
    raise AttributeError(name)

  def nbytes(self) -> int:
    return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in self.arrays.values())


def check_packed(packed: PackedKV) -> None:
  """Raise ValueError naming the first array whose shape or dtype breaks the format."""
  for name, (shape, dtype) in buffer_specs(packed.meta).items():
    a = packed.arrays.get(name)
    if a is None:
      raise ValueError(f"PackedKV is missing array {name!r}")
    if tuple(a.shape) != shape or jnp.dtype(a.dtype) != jnp.dtype(dtype):
      raise ValueError(f"PackedKV.{name} must be {dtype}{list(shape)}, got {a.dtype}{list(a.shape)}")


def check_query(q, packed: "PackedKV") -> PackedKVMeta:
  """Check ``packed`` and that ``q`` is a rotated bf16 (B, Tq, H, D) query for it."""
  if not isinstance(packed, PackedKV):
    raise ValueError(f"packed must be a formats.PackedKV, got {type(packed).__name__}")
  check_packed(packed)
  meta = packed.meta
  if not hasattr(q, "shape") or q.ndim != 4:
    raise ValueError(f"q must be (B, Tq, H, D), got shape {getattr(q, 'shape', None)}")
  if q.dtype != jnp.bfloat16:
    raise ValueError(f"q must be bfloat16 (already rotated by R_k), got {q.dtype}")
  b, tq, h, d = q.shape
  if d != meta.head_dim:
    raise ValueError(f"q head_dim {d} does not match packed head_dim {meta.head_dim}")
  if b != meta.batch or h != meta.heads:
    raise ValueError(f"q (B, H) = {(b, h)} does not match packed (B, H) = {(meta.batch, meta.heads)}")
  if tq <= 0:
    raise ValueError("q has no tokens")
  return meta


# --------------------------------------------------------------------------------------
# Shared helpers (used by kernels and references alike)
# --------------------------------------------------------------------------------------
def pack_nibbles(codes: jax.Array) -> jax.Array:
  """(..., D) integer codes in [0, 15] -> (..., D/2) uint8, split-half.

  Byte j holds channel j in its low nibble and channel j + D/2 in its high nibble.
  """
  half = codes.shape[-1] // 2
  lo = codes[..., :half].astype(jnp.uint8)
  hi = codes[..., half:].astype(jnp.uint8)
  return lo | (hi << 4)


def unpack_nibbles(packed: jax.Array) -> jax.Array:
  """(..., D/2) uint8 -> (..., D) uint8 codes; the inverse of ``pack_nibbles``."""
  return jnp.concatenate([packed & 0xF, packed >> 4], axis=-1)


def pack_bits(bits: jax.Array) -> jax.Array:
  """(..., N) values in {0, 1}, N a multiple of 8 -> (..., N/8) uint8: channel c in bit
  c % 8 of byte c // 8 (numpy's ``packbits(bitorder="little")``). The 5-bit store's
  fifth-bit plane; kernels call it on each channel half (D/2 is a multiple of 8)."""
  x = bits.astype(jnp.int32).reshape(*bits.shape[:-1], bits.shape[-1] // 8, 8)
  return jnp.sum(x << jnp.arange(8, dtype=jnp.int32), axis=-1).astype(jnp.uint8)


def unpack_bits(packed: jax.Array) -> jax.Array:
  """(..., N/8) uint8 -> (..., N) int32 in {0, 1}; the inverse of ``pack_bits``."""
  x = (packed.astype(jnp.int32)[..., None] >> jnp.arange(8, dtype=jnp.int32)) & 1
  return x.reshape(*packed.shape[:-1], packed.shape[-1] * 8)


def round_params(scale: jax.Array, zero: jax.Array):
  """(scale, zero) rounded to the stored float16 values, as float32.

  Saturates at float16's largest finite value (a group beyond +-65,504 clips there
  instead of turning into inf/NaN); a scale that rounds to zero becomes 1, so its
  group decodes to ``zero`` (its span is below 1e-6)."""
  f16 = lambda a: jnp.clip(a, -FP16_MAX, FP16_MAX).astype(jnp.float16).astype(jnp.float32)
  scale = f16(scale)
  return jnp.where(scale > 0, scale, 1.0), f16(zero)


def asymmetric_params(lo: jax.Array, hi: jax.Array, levels: int):
  """(scale, zero) for codes in [0, levels], as the float16 values the format stores
  (held in float32); a constant group gets scale 1. Codes are computed against these
  rounded values (``quantize_codes``), so decoding uses exactly the quantizer's grid."""
  span = (hi - lo).astype(jnp.float32)
  scale = jnp.where(span > 0, span / levels, 1.0)
  return round_params(scale, lo.astype(jnp.float32))


def quantize_codes(x: jax.Array, scale: jax.Array, zero: jax.Array, levels: int) -> jax.Array:
  """Round-to-nearest codes in [0, levels] as float32 (floor(x + 0.5): Triton has no round)."""
  return jnp.clip(jnp.floor((x - zero) / scale + 0.5), 0.0, float(levels))


# --------------------------------------------------------------------------------------
# Reference quantize / dequantize
# --------------------------------------------------------------------------------------
def _blocked(x: jax.Array, t_pad: int) -> jax.Array:
  """(B, T, H, D) -> (B, H, NB, 64, D), zero-padded tail."""
  b, t, h, d = x.shape
  x = jnp.pad(x, ((0, 0), (0, t_pad - t), (0, 0), (0, 0)))
  return x.transpose(0, 2, 1, 3).reshape(b, h, t_pad // BLOCK, BLOCK, d)


def _quantize_blocks(xb: jax.Array, valid: jax.Array, scheme: str, levels: int):
  """xb (B, H, n, 64, D) f32, valid (n, 64) -> codes (B,H,n,64,D) f32, scale, zero.

  Scale/zero come back in the buffer layout of ``scale_shape``.
  """
  b, h, n, _, d = xb.shape
  big = jnp.float32(jnp.inf)
  vmask = valid[None, None, :, :, None]
  if scheme == "channel":
    lo = jnp.min(jnp.where(vmask, xb, big), axis=3, keepdims=True)
    hi = jnp.max(jnp.where(vmask, xb, -big), axis=3, keepdims=True)
    lo = jnp.where(jnp.isfinite(lo), lo, 0.0)
    hi = jnp.where(jnp.isfinite(hi), hi, 0.0)
    scale, zero = asymmetric_params(lo, hi, levels)
    codes = quantize_codes(xb, scale, zero, levels)
    return codes, scale[:, :, :, 0, :], zero[:, :, :, 0, :]
  groups = 2 if scheme == "token_g64" else 1
  xg = xb.reshape(b, h, n, BLOCK, groups, d // groups)
  lo = jnp.min(xg, axis=-1, keepdims=True)
  hi = jnp.max(xg, axis=-1, keepdims=True)
  scale, zero = asymmetric_params(lo, hi, levels)
  codes = quantize_codes(xg, scale, zero, levels).reshape(xb.shape)
  to_buf = lambda a: a[..., 0].reshape(b, h, n * BLOCK, groups).transpose(0, 1, 3, 2)
  return codes, to_buf(scale), to_buf(zero)


def _dequantize_blocks(codes, scale, zero, scheme: str):
  """Inverse of ``_quantize_blocks``: codes (B,H,n,64,D) f32 -> values f32."""
  b, h, n, _, d = codes.shape
  scale, zero = scale.astype(jnp.float32), zero.astype(jnp.float32)
  if scheme == "channel":
    return codes * scale[:, :, :, None, :] + zero[:, :, :, None, :]
  groups = scale.shape[2]
  from_buf = lambda a: a.transpose(0, 1, 3, 2).reshape(b, h, n, BLOCK, groups, 1)
  cg = codes.reshape(b, h, n, BLOCK, groups, d // groups)
  return (cg * from_buf(scale) + from_buf(zero)).reshape(codes.shape)


def block_stats_reference(k_rot: jax.Array, v_rot: jax.Array):
  """Per-64-token-block K mean and V sum over live tokens: (B, H, NB, D) f32 each
  (the format stores them in ``STAT_DTYPE``)."""
  b, t, h, d = k_rot.shape
  nb = -(-t // BLOCK)
  kb = _blocked(k_rot.astype(jnp.float32), nb * BLOCK)
  vb = _blocked(v_rot.astype(jnp.float32), nb * BLOCK)
  counts = jnp.minimum(t - jnp.arange(nb) * BLOCK, BLOCK).astype(jnp.float32)
  return kb.sum(axis=3) / counts[None, None, :, None], vb.sum(axis=3)


def quantize_reference(k_rot: jax.Array, v_rot: jax.Array, meta: PackedKVMeta) -> PackedKV:
  """Pack already-rotated K and V, (B, T, H, D), into a PackedKV. Defines the format.

  This reference works on whole tensors; the projection kernel produces the same
  buffers without ever holding all of K or V in high precision.
  """
  b, t, h, d = k_rot.shape
  if v_rot.shape != k_rot.shape:
    raise ValueError(f"k and v shapes differ: {k_rot.shape} vs {v_rot.shape}")
  if (b, t, h, d) != (meta.batch, meta.num_tokens, meta.heads, meta.head_dim):
    raise ValueError(f"k shape {k_rot.shape} does not match meta (B, T, H, D) = "
                     f"{(meta.batch, meta.num_tokens, meta.heads, meta.head_dim)}")
  nb = meta.num_blocks
  valid = (jnp.arange(nb * BLOCK) < t).reshape(nb, BLOCK)
  arrays = {}
  for role, x, scheme in (("k", k_rot, meta.k_scheme), ("v", v_rot, meta.v_scheme)):
    xb = _blocked(x.astype(jnp.float32), nb * BLOCK)
    for w in WIDTHS:
      idx = np.asarray(meta.store_blocks(role, w), np.int32)
      sel, vsel = xb[:, :, idx], valid[idx]
      n = len(idx)
      if w == 16:
        arrays[f"{role}_bf16"] = sel.reshape(b, h, n * BLOCK, d).astype(jnp.bfloat16)
        continue
      codes, scale, zero = _quantize_blocks(sel, vsel, scheme, CODE_LEVELS[w])
      codes = codes.reshape(b, h, n * BLOCK, d).astype(jnp.int32)
      if w == 8:
        arrays[f"{role}_codes8"] = codes.astype(jnp.uint8)
      else:  # the low four bits split-half packed; width 5 adds the fifth-bit plane
        arrays[f"{role}_codes{w}"] = pack_nibbles(codes & 0xF)
        if w == 5:
          arrays[f"{role}_bits5"] = pack_bits(codes >> 4)
      arrays[f"{role}_scale{w}"] = scale.astype(PARAM_DTYPE)
      arrays[f"{role}_zero{w}"] = zero.astype(PARAM_DTYPE)
  arrays["k_mean"], arrays["v_sum"] = (a.astype(STAT_DTYPE) for a in block_stats_reference(k_rot, v_rot))
  return PackedKV(meta, arrays)


def dequantize_reference(packed: PackedKV) -> tuple[jax.Array, jax.Array]:
  """Full (B, T, H, D) float32 K and V in the rotated basis. Reference/tests only:
  it materializes all of K and V, which no production path may do."""
  meta = packed.meta
  b, h, d, nb = meta.batch, meta.heads, meta.head_dim, meta.num_blocks
  out = []
  for role, scheme in (("k", meta.k_scheme), ("v", meta.v_scheme)):
    full = jnp.zeros((b, h, nb, BLOCK, d), jnp.float32)
    for w in WIDTHS:
      idx = np.asarray(meta.store_blocks(role, w), np.int32)
      n = len(idx)
      if n == 0:
        continue
      if w == 16:
        vals = packed.arrays[f"{role}_bf16"].astype(jnp.float32)
      else:
        codes = packed.arrays[f"{role}_codes{w}"]
        codes = codes if w == 8 else unpack_nibbles(codes).astype(jnp.int32)
        if w == 5:
          codes = codes | (unpack_bits(packed.arrays[f"{role}_bits5"]) << 4)
        vals = _dequantize_blocks(codes.astype(jnp.float32).reshape(b, h, n, BLOCK, d),
                                  packed.arrays[f"{role}_scale{w}"],
                                  packed.arrays[f"{role}_zero{w}"], scheme)
      full = full.at[:, :, idx].set(vals.reshape(b, h, n, BLOCK, d))
    full = full.reshape(b, h, nb * BLOCK, d)[:, :, : meta.num_tokens]
    out.append(full.transpose(0, 2, 1, 3))
  return out[0], out[1]
