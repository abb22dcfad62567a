"""Where kernels run (the Triton backend on a GPU, interpret mode anywhere else), and
the few in-kernel helpers every kernel shares: matrix products, the bf16 split,
multiplication by the Hadamard rotation, code -> bf16 conversion, softmax constants."""
from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from formats.packed_kv import CLASSES

LOG2E = math.log2(math.e)  # softmax in base 2: sm_scale * log2(e) rides in the exp2 argument
LN2 = math.log(2.0)        # base-2 log-sum-exp back to natural log
M_INIT = -1e30             # running max start: finite, so exp2(m_prev - m_new) never sees inf - inf
INT4_OFFSET = 128.0        # int4_halves returns code + INT4_OFFSET
# The classes the fused kernels (fused attention, fused Sol, fused projection) read or
# write in their loops; every other class goes through the one decoder (kv_dequant) and
# the chunked epilogue.
FUSED_CLASSES = ("int4", "int8", "bf16")


def classes_outside_fused(block_classes) -> list[str]:
  """The names of the classes among ``block_classes`` (ids) that the fused kernels do
  not read, sorted."""
  return sorted({CLASSES[c] for c in block_classes} - set(FUSED_CLASSES))


def refuse_outside_fused(block_classes, reader: str, fix: str) -> None:
  """Raise NotImplementedError naming the classes among ``block_classes`` (ids) that
  ``reader`` (a fused kernel, or a path built on one) does not read, and ``fix``."""
  outside = classes_outside_fused(block_classes)
  if outside:
    raise NotImplementedError(f"{reader} reads classes {list(FUSED_CLASSES)} only, not {outside}; {fix}")


def on_gpu() -> bool:
  return jax.default_backend() == "gpu"


def resolve_interpret(interpret: bool | None) -> bool:
  """``None`` picks interpret mode unless JAX's default backend is a GPU."""
  return (not on_gpu()) if interpret is None else bool(interpret)


class NamedInputs:
  """The inputs of one pallas_call: arrays, their BlockSpecs, and the names the kernel
  body looks its refs up by (``dict(zip(names, refs))``), outputs named after inputs."""

  def __init__(self):
    self.names, self.args, self.specs = [], [], []

  def add(self, name, x, block, index_map):
    self.add_spec(name, x, pl.BlockSpec(block, index_map))

  def add_spec(self, name, x, spec):
    self.names.append(name)
    self.args.append(x)
    self.specs.append(spec)

  def add_whole(self, name, x):
    """``x`` as one block, the same for every program (tables, constants, and arrays
    the kernel addresses itself)."""
    self.add_spec(name, x, pl.BlockSpec(x.shape, lambda *_: (0,) * x.ndim))

  def ref_names(self, *outputs) -> tuple:
    return (*self.names, *outputs)


def resolve_sm_scale(sm_scale, head_dim: int) -> float:
  """``None`` -> 1/sqrt(D); anything else must be a positive finite number."""
  sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
  if not (math.isfinite(sm_scale) and sm_scale > 0):
    raise ValueError(f"sm_scale must be a positive finite number, got {sm_scale}")
  return sm_scale


def dot(a, b, trans_b: bool = False):
  """2D matrix product with float32 accumulation, inside any Pallas kernel.

  ``pl.dot``/``plgpu.dot`` were removed in jax 0.12 (deprecated in 0.11, which the GPU
  machine runs), so kernels call this instead.
  """
  return jax.lax.dot_general(a, b, (((1,), (1 if trans_b else 0,)), ((), ())),
                             preferred_element_type=jax.numpy.float32)


def split_bf16(x):
  """f32 -> (a, b) bf16 terms with a + b == x to about 16 significant bits.

  Two bf16 dots against an exact +-1 matrix then give an f32-accurate product with no
  f32 dot (Triton would run that on TF32 or, with full precision, off the tensor cores).
  """
  a = x.astype(jnp.bfloat16)
  return a, (x - a.astype(jnp.float32)).astype(jnp.bfloat16)


def sign_dot(parts, m):
  """sum(parts) @ m for a {-1, 0, 1} bf16 matrix m, in f32."""
  return dot(parts[0], m) + dot(parts[1], m)


def unrotate_halves(o_lo, o_hi, ht_ref, lo, hi, head_dim):
  """(o_lo | o_hi) @ ht / sqrt(D) for the +-1 matrix ``ht_ref`` (D, D) in bf16.

  Works on the two channel halves because Triton cannot slice a loaded value; ``lo``
  and ``hi`` index the halves of ``ht_ref``.
  """
  parts_lo, parts_hi = split_bf16(o_lo), split_bf16(o_hi)

  def out_half(cols):
    return (sign_dot(parts_lo, ht_ref[lo, cols]) + sign_dot(parts_hi, ht_ref[hi, cols])) * (1.0 / math.sqrt(head_dim))
  return out_half(lo), out_half(hi)


def int4_halves(codes):
  """(rows, D/2) uint8 split-half bytes -> (lo, hi) bf16 tiles equal to code + 128, exactly.

  A bit trick instead of a conversion: bf16 bits ``0x4300 | c`` are the number 128 + c
  (c < 128). Widened once to 16-bit lanes, each mask/shift/or handles two codes per
  instruction; callers remove the offset in their (exact) bf16 or f32 arithmetic.
  """
  w = codes.astype(jnp.uint16)
  lo = lax.bitcast_convert_type((w & jnp.uint16(0xF)) | jnp.uint16(0x4300), jnp.bfloat16)
  hi = lax.bitcast_convert_type((w >> jnp.uint16(4)) | jnp.uint16(0x4300), jnp.bfloat16)
  return lo, hi


def int8_to_bf16(codes):
  """uint8 codes -> bf16 (exact below 256), through the f32 twin of the int4 trick:
  ``0x4B000000 | c`` is the f32 number 2^23 + c."""
  word = codes.astype(jnp.uint32) | jnp.uint32(0x4B000000)
  return (lax.bitcast_convert_type(word, jnp.float32) - 8388608.0).astype(jnp.bfloat16)


def int8_codes(x, amax):
  """int8 codes of ``x`` against a per-row ``amax`` (its absmax, (rows,)), rounded half
  away from zero; an all-zero row gets codes 0. Kernels that see a row in pieces (the
  decoder's channel halves) take the absmax over the pieces and call this per piece."""
  inv = jnp.where(amax > 0, 127.0 / jnp.where(amax > 0, amax, 1.0), 0.0)
  c = x * inv[..., None]
  return jnp.where(c >= 0, c + 0.5, c - 0.5).astype(jnp.int32).astype(jnp.int8)


def quantize_rows_int8(x):
  """(rows, D) f32 -> (int8 codes, (rows,) f32 scales = absmax / 127), codes rounded half
  away from zero; an all-zero row gets scale 0. The one rule for 8-bit Q and K: Sol's
  kernel applies it to its Q tile, ``kv_dequant`` (``store="int8_k"``) to K."""
  amax = jnp.abs(x).max(-1)
  return int8_codes(x, amax), amax * (1.0 / 127.0)


def over_chunks(total: int, size: int, fn, carry):
  """``fn(start, n, carry)`` over [0, total) in chunks of ``size``: the whole chunks in
  one ``lax.fori_loop`` (one compiled body, so XLA holds one chunk's scratch at a time),
  then the remainder once. The streamed methods' loop over head groups and row chunks."""
  n, rem = divmod(total, size)
  if n:
    carry = lax.fori_loop(0, n, lambda i, c: fn(i * size, size, c), carry)
  if rem:
    carry = fn(n * size, rem, carry)
  return carry
