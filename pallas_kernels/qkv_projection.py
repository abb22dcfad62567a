"""Streamed QKV projection: x @ W_qkv -> Q (BF16, rotated) and a PackedKV, never the
full BF16 QKV.

``streamed_qkv`` is the public entry point; two methods compute it:

* ``"chunked"`` (the default): for each row chunk of ``x`` (a multiple of 64 rows,
  sized from ``scratch_bytes``), XLA's dot (cuBLAS on a GPU) computes
  ``x[chunk] @ W`` in float32 into a bounded scratch, then one Pallas kernel
  (``qkv_epilogue``) runs the whole epilogue and writes straight into the final Q and
  PackedKV buffers. Every chunk has the same shape and all run in one
  ``lax.fori_loop``, so XLA holds one chunk's scratch at a time.
* ``"fused"`` (``qkv_fused``): one Pallas kernel runs GEMM and epilogue together, with
  no scratch at all: the zero-scratch choice, and the one that needs no vendor GEMM.

Why f32 from the GEMM: the reference is float32, and a bf16 GEMM output moves about 1%
of the int4 codes by a step (``benchmarks/NOTES.md``); f32 keeps the kernel within
rounding ties of the reference.

``streamed_qkv_reference`` defines both: the f32 projection, then
``qkv_epilogue.epilogue_reference``.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax

from formats import packed_kv as fmt
from formats.storage import KVStorage, as_storage
from pallas_kernels import backend, qkv_fused
from pallas_kernels.attention_config import DEFAULT_SCRATCH_BYTES
from pallas_kernels.qkv_ops import epilogue_constants
from pallas_kernels.qkv_epilogue import empty_buffers, epilogue_call, epilogue_reference, rotated_qkv_reference
from pallas_kernels.qkv_layout import QKVLayout, QKVWeights

__all__ = ["GEMM_WORKSPACE_BYTES", "METHODS", "ProjectionTuning", "QKVLayout", "QKVWeights", "check_inputs",
           "chunk_rows", "chunk_scratch_bytes", "projected_qkv_f32", "streamed_qkv", "streamed_qkv_reference"]

BLOCK = fmt.BLOCK
METHODS = ("auto", "chunked", "fused")


# --------------------------------------------------------------------------------------
# Validation, metadata, tuning
# --------------------------------------------------------------------------------------
def check_inputs(x, weights: QKVWeights, layout: QKVLayout, rope_cos, rope_sin, storage: KVStorage | None
                 ) -> fmt.PackedKVMeta:
  """Raise ValueError on malformed inputs; return the PackedKVMeta of the output. The
  one place these rules live: the JAX API and the torch ops both call it."""
  if not isinstance(layout, QKVLayout):
    raise ValueError(f"layout must be a QKVLayout (e.g. QKVLayout.h3(heads, head_dim)), got "
                     f"{type(layout).__name__}")
  if not isinstance(weights, QKVWeights):
    raise ValueError(f"weights must be a QKVWeights(w_qkv, bias, q_norm_weight, k_norm_weight), got "
                     f"{type(weights).__name__}")
  storage = as_storage(storage)
  w_qkv, bias = weights.w_qkv, weights.bias
  if x.ndim != 3:
    raise ValueError(f"x must be (B, T, hidden), got shape {tuple(x.shape)}")
  if jnp.dtype(x.dtype) != jnp.bfloat16:
    raise ValueError(f"x must be bfloat16, got {x.dtype}")
  if w_qkv.ndim != 2 or jnp.dtype(w_qkv.dtype) != jnp.bfloat16:
    raise ValueError(f"w_qkv must be a 2-D bfloat16 array, got {w_qkv.dtype}{list(w_qkv.shape)}")
  b, t, hidden = x.shape
  if b == 0 or t == 0 or hidden == 0:
    raise ValueError(f"x has an empty axis: (B, T, hidden) = {(b, t, hidden)}; pass at least one "
                     "batch row, one token and one hidden channel")
  width = layout.width
  if tuple(w_qkv.shape) != (hidden, width):
    raise ValueError(f"w_qkv must be (hidden, 3*H*D) = {(hidden, width)}, got {tuple(w_qkv.shape)}")
  if bias is not None:
    if tuple(bias.shape) != (width,):
      raise ValueError(f"bias must be (3*H*D,) = ({width},), got {tuple(bias.shape)}")
    if jnp.dtype(bias.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
      raise ValueError(f"bias must be bfloat16 or float32, got {bias.dtype}")
  layout.check_norm_weights(weights.q_norm_weight, weights.k_norm_weight)
  layout.check_tables(rope_cos, rope_sin, t)
  return storage.meta(b, layout.heads, layout.head_dim, t)


@dataclasses.dataclass(frozen=True)
class ProjectionTuning:
  """Launch settings of the projection's kernels, kept out of the public signature.

  Chunked method: ``epilogue_num_warps`` (the epilogue kernel) and ``gemm_dtype``
  ("float32" or "bfloat16", the cuBLAS chunk's output: bfloat16 halves the chunk's
  traffic but rounds the projection before the norm, as a BF16 model's own qkv_proj
  does; outside the reference's 1e-4 code agreement, ``benchmarks/NOTES.md``).
  Fused method (``qkv_fused.fused_qkv``, which documents each): ``block_q``,
  ``block_h``, ``num_warps``, ``num_stages``, ``full_width_gemm``,
  ``q_heads_per_program``, ``kv_blocks_per_program``.
  """
  epilogue_num_warps: int = 4
  gemm_dtype: str = "float32"
  block_q: int = 128
  block_h: int = 64
  num_warps: object = None
  num_stages: object = None
  full_width_gemm: bool = qkv_fused.DEFAULT_FULL_WIDTH_GEMM
  q_heads_per_program: int = 1
  kv_blocks_per_program: int = 1

  def __post_init__(self):
    if str(self.gemm_dtype) not in ("float32", "bfloat16"):
      raise ValueError(f"gemm_dtype must be 'float32' or 'bfloat16', got {self.gemm_dtype!r}")
    if self.epilogue_num_warps not in (1, 2, 4, 8, 16):
      raise ValueError(f"epilogue_num_warps must be a power of two up to 16, got {self.epilogue_num_warps!r}")
    if not isinstance(self.full_width_gemm, bool):
      raise ValueError(f"full_width_gemm must be a bool, got {self.full_width_gemm!r}")
    qkv_fused.check_tiles(self.block_q, self.block_h, self.q_heads_per_program, self.kv_blocks_per_program,
                          self.num_warps, self.num_stages)


# --------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------
def _projection_f32(x, w_qkv):
  return jnp.dot(x.astype(jnp.float32), w_qkv.astype(jnp.float32), precision=lax.Precision.HIGHEST)


def projected_qkv_f32(x, weights: QKVWeights, *, layout: QKVLayout, rope_cos, rope_sin,
                      storage: KVStorage | None = None):
  """Full float32 (B, T, H, D) q, k, v in the rotated basis, before any rounding.

  Tests and references only: this is exactly the tensor the kernels never build.
  """
  meta = check_inputs(x, weights, layout, rope_cos, rope_sin, storage)
  return _projected_f32(x, weights, rope_cos, rope_sin, layout=layout, seeds=(meta.rotation_seed_k,
                                                                               meta.rotation_seed_v))


@functools.partial(jax.jit, static_argnames=("layout", "seeds"))
def _projected_f32(x, weights, rope_cos, rope_sin, *, layout, seeds):
  return rotated_qkv_reference(
      _projection_f32(x, weights.w_qkv), weights.bias, layout=layout, q_norm_weight=weights.q_norm_weight,
      k_norm_weight=weights.k_norm_weight, rope_cos=rope_cos, rope_sin=rope_sin, rotation_seed_k=seeds[0],
      rotation_seed_v=seeds[1])


def streamed_qkv_reference(x, weights: QKVWeights, *, layout: QKVLayout, rope_cos, rope_sin,
                           storage: KVStorage | None = None):
  """Plain float32 jnp definition of ``streamed_qkv``. It materializes everything."""
  meta = check_inputs(x, weights, layout, rope_cos, rope_sin, storage)
  return _reference(x, weights, rope_cos, rope_sin, layout=layout, meta=meta)


@functools.partial(jax.jit, static_argnames=("layout", "meta"))
def _reference(x, weights, rope_cos, rope_sin, *, layout, meta):
  return epilogue_reference(_projection_f32(x, weights.w_qkv), weights.bias, meta, layout=layout,
                            q_norm_weight=weights.q_norm_weight, k_norm_weight=weights.k_norm_weight,
                            rope_cos=rope_cos, rope_sin=rope_sin)


# --------------------------------------------------------------------------------------
# The chunked method
# --------------------------------------------------------------------------------------
# cuBLAS(Lt)'s workspace, which XLA allocates beside each GEMM's output: part of the
# chunk's scratch. 32 MiB is what XLA reserves on Hopper.
GEMM_WORKSPACE_BYTES = 32 << 20


def chunk_rows(num_tokens: int, hidden: int, width: int, scratch_bytes: int) -> int:
  """Rows per chunk of the chunked method (a multiple of 64; 0 when no 64-row chunk
  fits ``scratch_bytes``). A chunk holds the f32 GEMM output (``width`` = 3HD columns),
  the bf16 slice of x and the GEMM workspace. Chunks are balanced: T is cut into the
  fewest chunks that fit, of equal size, so the last one repeats fewer blocks than
  there are chunks."""
  per_row = width * 4 + hidden * 2
  max_blocks = max(0, int(scratch_bytes) - GEMM_WORKSPACE_BYTES) // per_row // BLOCK
  if max_blocks == 0:
    return 0
  nb = -(-num_tokens // BLOCK)
  n = -(-nb // max_blocks)
  return -(-nb // n) * BLOCK


def chunk_scratch_bytes(rows: int, hidden: int, width: int) -> int:
  """Scratch that one chunk of ``rows`` rows holds (see ``chunk_rows``)."""
  return rows * (width * 4 + hidden * 2) + GEMM_WORKSPACE_BYTES


def _chunked(x, w_qkv, bias, cos, sin, consts, meta, *, rows, interpret, num_warps=4, init=None,
             gemm_dtype=jnp.float32):
  """The chunked method: one ``fori_loop`` over (batch row, chunk), every chunk of the
  same shape, so XLA holds one chunk's scratch at a time.

  Chunk i of a batch row covers the 64-aligned tokens ``[a, a + rows)`` with
  ``a = min(i * rows, NB * 64 - rows)``: the last chunk may repeat a few blocks of the
  one before (same values, written twice). Its x rows start at ``min(a, T - rows)``,
  ``shift`` rows before ``a`` when T is not a multiple of 64, and the epilogue reads
  ``y`` from that offset. A sequence shorter than one chunk is zero-padded instead.
  ``init``: the buffers to write (tests poison them); by default they are created
  uninitialized, since the chunks write every element (the repeated blocks twice, with
  the same values: a row's GEMM result does not depend on its neighbours).
  """
  b, t, hidden = x.shape
  nb = meta.num_blocks
  n = -(-nb // (rows // BLOCK))
  bufs = init if init is not None else empty_buffers(meta, interpret=interpret)

  def chunk(i, bufs):
    bi, ci = i // n, i % n
    a = jnp.minimum(ci * rows, nb * BLOCK - rows)
    if t >= rows:
      start = jnp.minimum(a, t - rows)
      xs = lax.dynamic_slice(x, (bi, start, 0), (1, rows, hidden))[0]
    else:  # one chunk longer than the sequence
      start = 0
      xs = jnp.pad(lax.dynamic_slice(x, (bi, 0, 0), (1, t, hidden))[0], ((0, rows - t), (0, 0)))
    y = jnp.dot(xs, w_qkv, preferred_element_type=gemm_dtype)
    return epilogue_call(y, bias, a, a - start, bi, bufs, cos, sin, consts, meta, interpret=interpret,
                         num_warps=num_warps)

  bufs = lax.fori_loop(0, b * n, chunk, bufs)
  q = bufs.pop("q")
  specs = fmt.buffer_specs(meta)
  for name in fmt.ARRAY_NAMES:  # classes without blocks: zero-length arrays
    if name not in bufs:
      bufs[name] = jnp.zeros(*specs[name])
  return q, fmt.PackedKV(meta, {name: bufs[name] for name in fmt.ARRAY_NAMES})


# --------------------------------------------------------------------------------------
# Public entry point
# --------------------------------------------------------------------------------------
def resolve_method(method: str, num_tokens: int, hidden: int, layout: QKVLayout, scratch_bytes: int) -> str:
  """``auto`` -> ``chunked`` when one 64-row chunk fits ``scratch_bytes``, else
  ``fused`` (where it runs the layout); an explicit method is checked."""
  if method not in METHODS:
    raise ValueError(f"method must be one of {METHODS}, got {method!r}")
  if int(scratch_bytes) < 0:
    raise ValueError(f"scratch_bytes must be >= 0, got {scratch_bytes}")
  fits = chunk_rows(num_tokens, hidden, layout.width, scratch_bytes) >= BLOCK
  fused_reason = qkv_fused.unsupported_layout_reason(layout)
  need = chunk_scratch_bytes(BLOCK, hidden, layout.width)
  if method == "auto":
    if fits:
      return "chunked"
    if fused_reason is None:
      return "fused"
    raise ValueError(f"scratch_bytes={scratch_bytes} holds no 64-row chunk (needs {need} bytes) and the "
                     f"fused method cannot run this layout ({fused_reason}); raise scratch_bytes")
  if method == "chunked" and not fits:
    raise ValueError(f"scratch_bytes={scratch_bytes} holds no 64-row chunk (needs {need} bytes); "
                     "raise it or use method='fused' (no scratch)")
  if method == "fused" and fused_reason is not None:
    raise NotImplementedError(f"method='fused' cannot run this layout: {fused_reason}; use method='chunked'")
  return method


def streamed_qkv(x, weights: QKVWeights, *, layout: QKVLayout, rope_cos, rope_sin, storage: KVStorage | None = None,
                 method="auto", scratch_bytes=DEFAULT_SCRATCH_BYTES, tuning: "ProjectionTuning | None" = None,
                 interpret=None):
  """x (B, T, hidden) bf16 @ w_qkv (hidden, 3HD) bf16 (+ bias) -> (Q, PackedKV).

  ``weights``: a ``QKVWeights`` (w_qkv, bias (3HD,) bf16/f32 or None, the QK-norm
  weights f32: (D,) per head, (H*D,) across heads, None without a norm). ``layout``
  (``QKVLayout``) says how q and k are made: heads x head_dim, the QK norm, the RoPE
  style over the first ``rot_dim`` channels with tables ``rope_cos`` / ``rope_sin``
  (T, D) f32, or (T, H*D) with ``rope_per_head``. Q is (B, T, H, D) bf16 after the
  norm, RoPE and the rotation ``R_k``; the PackedKV holds K (same epilogue) and V
  (rotated by ``R_v``) in the format of ``formats/``, stored as ``storage`` (a
  ``formats.KVStorage``; None: every block int4) says. ``streamed_qkv_reference`` is
  the exact definition.

  method: ``"auto"`` (``"chunked"`` unless ``scratch_bytes`` holds no 64-row chunk),
  ``"chunked"`` (cuBLAS row chunks + the epilogue kernel; scratch at most
  ``scratch_bytes``) or ``"fused"`` (one Pallas kernel, no scratch; norms per head and
  shared tables only). ``tuning``: a ``ProjectionTuning`` (launch settings).
  """
  meta = check_inputs(x, weights, layout, rope_cos, rope_sin, storage)
  tuning = ProjectionTuning() if tuning is None else tuning
  if not isinstance(tuning, ProjectionTuning):
    raise ValueError(f"tuning must be a ProjectionTuning or None, got {type(tuning).__name__}")
  if layout.heads % tuning.q_heads_per_program:
    raise ValueError(f"tuning.q_heads_per_program={tuning.q_heads_per_program} must divide heads={layout.heads}")
  b, t, hidden = x.shape
  method = resolve_method(method, t, hidden, layout, scratch_bytes)
  return _streamed_qkv(x, weights, rope_cos, rope_sin, layout=layout, meta=meta, method=method,
                       scratch_bytes=int(scratch_bytes), tuning=tuning,
                       interpret=backend.resolve_interpret(interpret))


@functools.partial(jax.jit, static_argnames=("layout", "meta", "method", "scratch_bytes", "tuning", "interpret"))
def _streamed_qkv(x, weights, rope_cos, rope_sin, *, layout, meta, method, scratch_bytes, tuning, interpret):
  b, t, hidden = x.shape
  w_qkv, bias = weights.w_qkv, weights.bias
  consts = epilogue_constants(layout, meta.rotation_seed_k, meta.rotation_seed_v, weights.q_norm_weight,
                              weights.k_norm_weight)
  cos = jnp.asarray(rope_cos, jnp.float32)
  sin = jnp.asarray(rope_sin, jnp.float32)
  if method == "fused":
    return qkv_fused.fused_qkv(x, w_qkv, bias, cos, sin, consts, meta, interpret=interpret,
                               block_q=tuning.block_q, block_h=tuning.block_h, num_warps=tuning.num_warps,
                               num_stages=tuning.num_stages, full_width_gemm=tuning.full_width_gemm,
                               q_heads_per_program=tuning.q_heads_per_program,
                               kv_blocks_per_program=tuning.kv_blocks_per_program)
  rows = chunk_rows(t, hidden, layout.width, scratch_bytes)
  return _chunked(x, w_qkv, bias, cos, sin, consts, meta, rows=rows, interpret=interpret,
                  num_warps=int(tuning.epilogue_num_warps), gemm_dtype=jnp.dtype(tuning.gemm_dtype))
