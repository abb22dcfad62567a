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
``qkv_epilogue.rotated_qkv_reference`` and the format's ``quantize_reference``.

Joint attention (``added``: an ``AddedTokens``): tokens joined after x's, projected with
their own weights, land in the same Q and packed K/V. Chunked only: a chunk's GEMM
takes its rows from whichever part they belong to (both, through two GEMMs, in the one
chunk that straddles the boundary), and the epilogue picks each row's bias and norm
weights by the part it belongs to.
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
from pallas_kernels.qkv_epilogue import empty_buffers, epilogue_call, rotated_qkv_reference
from pallas_kernels.qkv_layout import AddedTokens, QKVLayout, QKVWeights

__all__ = ["AddedTokens", "GEMM_WORKSPACE_BYTES", "METHODS", "ProjectionTuning", "QKVLayout", "QKVWeights",
           "check_inputs", "chunk_rows", "chunk_scratch_bytes", "projected_qkv_f32", "streamed_qkv",
           "streamed_qkv_reference"]

BLOCK = fmt.BLOCK
METHODS = ("auto", "chunked", "fused")


# --------------------------------------------------------------------------------------
# Validation, metadata, tuning
# --------------------------------------------------------------------------------------
def check_inputs(x, weights: QKVWeights, layout: QKVLayout, rope_cos, rope_sin, storage: KVStorage | None,
                 added: AddedTokens | None = None) -> fmt.PackedKVMeta:
  """Raise ValueError on malformed inputs; return the PackedKVMeta of the output (over
  T + T_added tokens with ``added``). The one place these rules live: the JAX API and
  the torch ops both call it."""
  if not isinstance(layout, QKVLayout):
    raise ValueError(f"layout must be a QKVLayout (e.g. QKVLayout.h3(heads, head_dim)), got "
                     f"{type(layout).__name__}")
  storage = as_storage(storage)
  b, t = _check_projection(x, weights, layout, "x", "")
  if added is not None:
    if not isinstance(added, AddedTokens):
      raise ValueError(f"added must be an AddedTokens(x, weights) or None, got {type(added).__name__}")
    b_added, t_added = _check_projection(added.x, added.weights, layout, "added.x", "added.weights.")
    if b_added != b:
      raise ValueError(f"added.x has {b_added} batch rows, x has {b}: they must match")
    t += t_added
  layout.check_tables(rope_cos, rope_sin, t)
  return storage.meta(b, layout.heads, layout.head_dim, t)


def _check_projection(x, weights, layout: QKVLayout, x_name: str, w_prefix: str) -> tuple[int, int]:
  """One projection's input and weights; (B, T) of its x."""
  if not isinstance(weights, QKVWeights):
    raise ValueError(f"{w_prefix or 'weights'} must be a QKVWeights(w_qkv, bias, q_norm_weight, k_norm_weight), "
                     f"got {type(weights).__name__}")
  w_qkv, bias = weights.w_qkv, weights.bias
  if x.ndim != 3:
    raise ValueError(f"{x_name} must be (B, T, hidden), got shape {tuple(x.shape)}")
  if jnp.dtype(x.dtype) != jnp.bfloat16:
    raise ValueError(f"{x_name} must be bfloat16, got {x.dtype}")
  if w_qkv.ndim != 2 or jnp.dtype(w_qkv.dtype) != jnp.bfloat16:
    raise ValueError(f"{w_prefix}w_qkv must be a 2-D bfloat16 array, got {w_qkv.dtype}{list(w_qkv.shape)}")
  b, t, hidden = x.shape
  if b == 0 or t == 0 or hidden == 0:
    raise ValueError(f"{x_name} has an empty axis: (B, T, hidden) = {(b, t, hidden)}; pass at least one "
                     "batch row, one token and one hidden channel")
  width = layout.width
  if tuple(w_qkv.shape) != (hidden, width):
    raise ValueError(f"{w_prefix}w_qkv must be (hidden, 3*H*D) = {(hidden, width)}, got {tuple(w_qkv.shape)}")
  if bias is not None:
    if tuple(bias.shape) != (width,):
      raise ValueError(f"{w_prefix}bias must be (3*H*D,) = ({width},), got {tuple(bias.shape)}")
    if jnp.dtype(bias.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32)):
      raise ValueError(f"{w_prefix}bias must be bfloat16 or float32, got {bias.dtype}")
  layout.check_norm_weights(weights.q_norm_weight, weights.k_norm_weight)
  return b, t


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
                      storage: KVStorage | None = None, added: AddedTokens | None = None):
  """Full float32 (B, T, H, D) q, k, v in the rotated basis, before any rounding (over
  T + T_added tokens with ``added``, each part through its own weights).

  Tests and references only: this is exactly the tensor the kernels never build.
  """
  meta = check_inputs(x, weights, layout, rope_cos, rope_sin, storage, added)
  return _projected_f32(x, weights, rope_cos, rope_sin, added, layout=layout,
                        seeds=(meta.rotation_seed_k, meta.rotation_seed_v))


@functools.partial(jax.jit, static_argnames=("layout", "seeds"))
def _projected_f32(x, weights, rope_cos, rope_sin, added, *, layout, seeds):
  parts = [(x, weights)] + ([] if added is None else [(added.x, added.weights)])
  out, row = [], 0
  for xp, wp in parts:
    t = xp.shape[1]
    out.append(rotated_qkv_reference(
        _projection_f32(xp, wp.w_qkv), wp.bias, layout=layout, q_norm_weight=wp.q_norm_weight,
        k_norm_weight=wp.k_norm_weight, rope_cos=rope_cos[row:row + t], rope_sin=rope_sin[row:row + t],
        rotation_seed_k=seeds[0], rotation_seed_v=seeds[1]))
    row += t
  return tuple(jnp.concatenate(z, axis=1) for z in zip(*out))


def streamed_qkv_reference(x, weights: QKVWeights, *, layout: QKVLayout, rope_cos, rope_sin,
                           storage: KVStorage | None = None, added: AddedTokens | None = None):
  """Plain float32 jnp definition of ``streamed_qkv``. It materializes everything."""
  meta = check_inputs(x, weights, layout, rope_cos, rope_sin, storage, added)
  q, k, v = _projected_f32(x, weights, rope_cos, rope_sin, added, layout=layout,
                           seeds=(meta.rotation_seed_k, meta.rotation_seed_v))
  return q.astype(jnp.bfloat16), _quantize(k, v, meta=meta)


_quantize = jax.jit(fmt.quantize_reference, static_argnames=("meta",))


# --------------------------------------------------------------------------------------
# The chunked method
# --------------------------------------------------------------------------------------
# cuBLAS(Lt)'s workspace, which XLA allocates beside each GEMM's output: part of the
# chunk's scratch. 32 MiB is what XLA reserves on Hopper.
GEMM_WORKSPACE_BYTES = 32 << 20


def _row_bytes(hidden: int, width: int, added_hidden: int | None) -> int:
  """Scratch per chunk row: the f32 GEMM output and the bf16 rows of x; with added
  tokens (width ``added_hidden``), the boundary chunk's two GEMM outputs, their merge
  and both parts' rows."""
  if added_hidden is None:
    return width * 4 + hidden * 2
  return 3 * width * 4 + (hidden + added_hidden) * 2


def chunk_rows(num_tokens: int, hidden: int, width: int, scratch_bytes: int, added_hidden: int | None = None) -> int:
  """Rows per chunk of the chunked method (a multiple of 64; 0 when no 64-row chunk
  fits ``scratch_bytes``). A chunk holds the f32 GEMM output (``width`` = 3HD columns),
  the bf16 slice of x and the GEMM workspace (``_row_bytes``; ``added_hidden``: joint
  attention). Chunks are balanced: T is cut into the fewest chunks that fit, of equal
  size, so the last one repeats fewer blocks than there are chunks."""
  max_blocks = max(0, int(scratch_bytes) - GEMM_WORKSPACE_BYTES) // _row_bytes(hidden, width, added_hidden) // BLOCK
  if max_blocks == 0:
    return 0
  nb = -(-num_tokens // BLOCK)
  n = -(-nb // max_blocks)
  return -(-nb // n) * BLOCK


def chunk_scratch_bytes(rows: int, hidden: int, width: int, added_hidden: int | None = None) -> int:
  """Scratch that one chunk of ``rows`` rows holds (see ``chunk_rows``)."""
  return rows * _row_bytes(hidden, width, added_hidden) + GEMM_WORKSPACE_BYTES


def _chunked(x, w_qkv, bias, cos, sin, consts, meta, *, rows, interpret, num_warps=4, init=None,
             gemm_dtype=jnp.float32, added: AddedTokens | None = None):
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

  ``added`` (joint attention): the sequence is x's tokens then the added ones. A chunk
  inside one part is one GEMM with that part's weights; the chunk across the boundary
  runs both GEMMs and takes each row from its own (``lax.switch``, so the other chunks
  pay nothing). Rows are gathered with their indices clamped, which also covers a
  chunk longer than the sequence (the rows past T are never written).
  """
  b, t_own, hidden = x.shape
  t = meta.num_tokens
  nb = meta.num_blocks
  n = -(-nb // (rows // BLOCK))
  bufs = init if init is not None else empty_buffers(meta, interpret=interpret)

  def own_rows(bi, start):
    if t >= rows:
      return lax.dynamic_slice(x, (bi, start, 0), (1, rows, hidden))[0]
    # one chunk longer than the sequence
    return jnp.pad(lax.dynamic_slice(x, (bi, 0, 0), (1, t, hidden))[0], ((0, rows - t), (0, 0)))

  def joint_rows(bi, start):
    tok = start + jnp.arange(rows)
    gemm = lambda xp, w, i: jnp.dot(xp[bi, jnp.clip(i, 0, xp.shape[1] - 1)], w, preferred_element_type=gemm_dtype)
    own = lambda: gemm(x, w_qkv, tok)
    extra = lambda: gemm(added.x, added.weights.w_qkv, tok - t_own)
    both = lambda: jnp.where((tok < t_own)[:, None], own(), extra())
    branch = jnp.where(start + rows <= t_own, 0, jnp.where(start >= t_own, 1, 2))
    return lax.switch(branch, (own, extra, both))

  def chunk(i, bufs):
    bi, ci = i // n, i % n
    a = jnp.minimum(ci * rows, nb * BLOCK - rows)
    start = jnp.minimum(a, t - rows) if t >= rows else 0
    if added is None:
      y = jnp.dot(own_rows(bi, start), w_qkv, preferred_element_type=gemm_dtype)
    else:
      y = joint_rows(bi, start)
    return epilogue_call(y, bias, a, a - start, bi, bufs, cos, sin, consts, meta, interpret=interpret,
                         num_warps=num_warps, added_from=None if added is None else t_own,
                         added_bias=None if added is None else added.weights.bias)

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
def resolve_method(method: str, num_tokens: int, hidden: int, layout: QKVLayout, scratch_bytes: int,
                   added_hidden: int | None = None, block_classes: tuple = ()) -> str:
  """``auto`` -> ``chunked`` when one 64-row chunk fits ``scratch_bytes``, else
  ``fused`` (where it runs the layout); an explicit method is checked. Added tokens
  (``added_hidden``, their width) and classes beyond ``backend.FUSED_CLASSES``
  (``block_classes``): chunked only."""
  if method not in METHODS:
    raise ValueError(f"method must be one of {METHODS}, got {method!r}")
  if int(scratch_bytes) < 0:
    raise ValueError(f"scratch_bytes must be >= 0, got {scratch_bytes}")
  fits = chunk_rows(num_tokens, hidden, layout.width, scratch_bytes, added_hidden) >= BLOCK
  fused_reason = qkv_fused.unsupported_layout_reason(layout)
  if added_hidden is not None:
    fused_reason = "joint attention (added tokens) is projected by the chunked method only"
  split = backend.classes_outside_fused(block_classes)
  if split:
    fused_reason = f"classes {split} are written by the chunked method only"
  need = chunk_scratch_bytes(BLOCK, hidden, layout.width, added_hidden)
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
                 added: AddedTokens | None = None, method="auto", scratch_bytes=DEFAULT_SCRATCH_BYTES,
                 tuning: "ProjectionTuning | None" = None, interpret=None):
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

  ``added``: an ``AddedTokens`` (joint text+video attention): its tokens follow x's in
  Q and the packed K/V (T + T_added rows, tables over all of them), each projected
  with its own weights; chunked method only.
  """
  meta = check_inputs(x, weights, layout, rope_cos, rope_sin, storage, added)
  tuning = ProjectionTuning() if tuning is None else tuning
  if not isinstance(tuning, ProjectionTuning):
    raise ValueError(f"tuning must be a ProjectionTuning or None, got {type(tuning).__name__}")
  if layout.heads % tuning.q_heads_per_program:
    raise ValueError(f"tuning.q_heads_per_program={tuning.q_heads_per_program} must divide heads={layout.heads}")
  hidden = x.shape[2]
  added_hidden = None if added is None else added.x.shape[2]
  method = resolve_method(method, meta.num_tokens, hidden, layout, scratch_bytes, added_hidden, meta.block_classes)
  return _streamed_qkv(x, weights, rope_cos, rope_sin, added, layout=layout, meta=meta, method=method,
                       scratch_bytes=int(scratch_bytes), tuning=tuning,
                       interpret=backend.resolve_interpret(interpret))


@functools.partial(jax.jit, static_argnames=("layout", "meta", "method", "scratch_bytes", "tuning", "interpret"))
def _streamed_qkv(x, weights, rope_cos, rope_sin, added=None, *, layout, meta, method, scratch_bytes, tuning,
                  interpret):
  t, hidden = meta.num_tokens, x.shape[2]
  w_qkv, bias = weights.w_qkv, weights.bias
  consts = epilogue_constants(layout, meta.rotation_seed_k, meta.rotation_seed_v, weights.q_norm_weight,
                              weights.k_norm_weight, None if added is None else added.weights)
  cos = jnp.asarray(rope_cos, jnp.float32)
  sin = jnp.asarray(rope_sin, jnp.float32)
  if method == "fused":
    return qkv_fused.fused_qkv(x, w_qkv, bias, cos, sin, consts, meta, interpret=interpret,
                               block_q=tuning.block_q, block_h=tuning.block_h, num_warps=tuning.num_warps,
                               num_stages=tuning.num_stages, full_width_gemm=tuning.full_width_gemm,
                               q_heads_per_program=tuning.q_heads_per_program,
                               kv_blocks_per_program=tuning.kv_blocks_per_program)
  rows = chunk_rows(t, hidden, layout.width, scratch_bytes, None if added is None else added.x.shape[2])
  return _chunked(x, w_qkv, bias, cos, sin, consts, meta, rows=rows, interpret=interpret,
                  num_warps=int(tuning.epilogue_num_warps), gemm_dtype=jnp.dtype(tuning.gemm_dtype), added=added)
