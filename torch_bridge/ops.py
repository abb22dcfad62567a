"""PyTorch custom ops over the JAX kernels: ``torch.ops.packed_kv.*``.

Why custom ops: ``torch.library.custom_op`` makes each kernel one opaque node that
``torch.compile(fullgraph=True)`` can trace. Each op has a ``register_fake`` that
computes output shapes from ``formats.buffer_specs``, so tracing never runs JAX.

Calling convention. Custom ops take and return tensors (plus ints, floats, bools,
strings and lists of them), so the packed K/V crosses as a fixed tuple of tensors in
``formats.ARRAY_NAMES`` order, and every setting as the JSON text of its value: the
``QKVLayout``, the ``formats.KVStorage`` and the attention config (``Dense`` / ``Sol``),
each checked by its own class, so the JAX API and the torch ops share one rule for each.
``streamed_qkv`` / ``packed_attention`` / ``sol_attention`` / ``attention_layer``
below wrap the ops for torch callers (``TorchPackedKV`` for the packed K/V);
``attention_module.PackedAttention`` and the diffusers processors call
``attention_layer``.

Ops (schemas are printed by ``print(torch.ops.packed_kv.<name>.default._schema)``):

* ``packed_kv::streamed_qkv(x, w_qkv, bias?, q_norm_weight?, k_norm_weight?, rope_cos,
  rope_sin, layout, storage, method, scratch_bytes, added_x?, added_w_qkv?, added_bias?,
  added_q_norm_weight?, added_k_norm_weight?, interpret?) -> (q, *packed)``.
* ``packed_kv::packed_attention(q, packed[16], num_tokens, storage, attention,
  q_segment_ids?, kv_segment_ids?, kv_mask?, kv_lengths?, keep_rotated, interpret?) -> o``.
* ``packed_kv::sol_attention(q, packed[16], num_tokens, storage, attention, key_bias?,
  block_len?, keep_rotated, interpret?) -> o``.
* ``packed_kv::attention_layer(x, w_qkv, bias?, q_norm_weight?, k_norm_weight?, rope_cos,
  rope_sin, layout, storage, attention, segment_ids?, kv_mask?, kv_lengths?, added_x?,
  added_w_qkv?, added_bias?, added_q_norm_weight?, added_k_norm_weight?, interpret?)
  -> o``: projection and attention in one JAX call, the output over Q
  (``pallas_kernels.layer``); the ``added_*`` tensors are joint attention's added tokens
  and their projection (``AddedTokens``).

Every tensor crosses through ``torch_bridge.dlpack`` (zero copy, pointer-checked,
stream-ordered; outputs are freed the moment torch drops them; read that module's
docstring for the stream and lifetime rules). The ops are inference-only: no autograd
formula is registered, so a backward through them raises.

The ops call the public JAX functions (``pallas_kernels.streamed_qkv``,
``packed_attention``, ``sol_attention``, ``attention_layer``), which jit their kernels:
torch and JAX callers share one compilation cache, and a bridge call costs the JAX
call plus validation and the zero-copy hand-offs. ``benchmarks/bench_bridge.py`` measures
that overhead against calling the same function from JAX. Before each call on a CUDA
device the bridge gives torch's cached free blocks back to the device
(``allocator.release_torch_cache``), so JAX can use memory torch no longer does.
"""
from __future__ import annotations

import functools
from typing import Optional, Sequence

import torch

import formats
from formats import ARRAY_NAMES, KVStorage, PackedKVMeta
from formats.storage import as_storage
from pallas_kernels import attention as jattention
from pallas_kernels import layer as jlayer
from pallas_kernels import sol as jsol
from pallas_kernels import qkv_projection as jqkv
from pallas_kernels.attention_config import DEFAULT_SCRATCH_BYTES, Dense, Sol, as_attention, attention_from_json
from pallas_kernels.qkv_layout import AddedTokens, QKVLayout, QKVWeights
from torch_bridge import allocator, dlpack
from torch_bridge.packed_kv import TorchPackedKV, torch_buffer_specs

NAMESPACE = "packed_kv"
NUM_ARRAYS = len(ARRAY_NAMES)
_QKV_RESULT = tuple[(torch.Tensor,) * (1 + NUM_ARRAYS)]


def _enter_jax(tensors: dict, interpret) -> torch.device:
  """Check the inputs' device against where the kernels run, then free torch's idle
  cache on it so that JAX can allocate what torch has freed."""
  device = dlpack.check_device(tensors, interpret)
  allocator.release_torch_cache(device)
  return device


def _check(t, name, *, real: bool, **kw):
  """Shape/dtype/contiguity checks always; pointer checks only on real tensors
  (fake tensors under torch.compile have no memory)."""
  if t is None:
    return None
  return dlpack.check_tensor(t, name, **kw) if real else _check_fake(t, name, **kw)


def _check_fake(t, name, *, dtype=None, shape=None, ndim=None, device=None):
  """The checks of ``dlpack.check_tensor`` that need no memory, same messages."""
  where = dlpack._where(name, t)
  if dtype is not None:
    allowed = dtype if isinstance(dtype, tuple) else (dtype,)
    if t.dtype not in allowed:
      raise dlpack.BridgeError(f"{where} must be {' or '.join(str(d) for d in allowed)}; convert "
                               f"it with .to({allowed[0]})")
  if ndim is not None and t.dim() != ndim:
    raise dlpack.BridgeError(f"{where} must have {ndim} dimensions")
  if shape is not None and tuple(t.shape) != tuple(shape):
    raise dlpack.BridgeError(f"{where} must have shape {list(shape)}")
  if device is not None and t.device != device:
    raise dlpack.BridgeError(f"{where} is on {t.device} but the other inputs are on {device}; move "
                             f"it with .to({str(device)!r})")
  if t.numel() and not t.is_contiguous():
    raise dlpack.BridgeError(f"{where} is not C-contiguous (strides {list(t.stride())}); call "
                             ".contiguous() yourself if the copy is intended")
  return t


@functools.lru_cache(maxsize=256)
def _storage(text: str) -> KVStorage:
  """The op's storage argument (``KVStorage.to_json()`` text) as a KVStorage."""
  try:
    return KVStorage.from_json(text)
  except (TypeError, ValueError, KeyError) as e:
    raise dlpack.BridgeError(f"storage rejected: {e}") from None


@functools.lru_cache(maxsize=256)
def _attention_config(text: str):
  return attention_from_json(text)


def _attention(text: str, kind=None):
  """The op's attention argument (``Dense(...).to_json()`` / ``Sol(...).to_json()``),
  parsed once per distinct text."""
  try:
    cfg = _attention_config(text)
  except (TypeError, ValueError) as e:
    raise dlpack.BridgeError(f"attention rejected: {e}") from None
  if kind is not None and not isinstance(cfg, kind):
    raise dlpack.BridgeError(f"this op takes a {kind.__name__}(...) config, got {cfg!r}")
  return cfg


# --------------------------------------------------------------------------------------
# Streamed projection
# --------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=256)
def _layout(layout) -> QKVLayout:
  """The op's layout argument (``QKVLayout.to_json()`` text) as a QKVLayout."""
  try:
    return QKVLayout.from_json(layout)
  except (TypeError, ValueError) as e:
    raise dlpack.BridgeError(f"layout rejected: {e}") from None


def _weights(w_qkv, bias, q_norm_weight, k_norm_weight) -> QKVWeights:
  return QKVWeights(w_qkv, bias, q_norm_weight, k_norm_weight)


def _qkv_meta(x, weights: QKVWeights, rope_cos, rope_sin, layout: QKVLayout, storage: KVStorage, *,
              real: bool, extra_rows: int = 0) -> PackedKVMeta:
  """Validate the projection's inputs; return the metadata of its packed K/V (over x's
  tokens and ``extra_rows`` added ones)."""
  _check(x, "x", real=real, dtype=torch.bfloat16, ndim=3)
  b, t, hidden = x.shape
  t += extra_rows
  dev = x.device
  _check_weights(weights, hidden, layout, dev, real=real)
  _check(rope_cos, "rope_cos", real=real, dtype=torch.float32, device=dev)
  _check(rope_sin, "rope_sin", real=real, dtype=torch.float32, device=dev)
  try:
    layout.check_norm_weights(weights.q_norm_weight, weights.k_norm_weight)
    layout.check_tables(rope_cos, rope_sin, t)
    return storage.meta(b, layout.heads, layout.head_dim, t)
  except ValueError as e:
    raise dlpack.BridgeError(f"projection inputs rejected: {e}") from None


def _check_weights(weights: QKVWeights, hidden: int, layout: QKVLayout, device, *, real: bool, prefix: str = ""):
  """One projection's tensors against its input width and the layout (names prefixed,
  e.g. ``added_w_qkv``); the norm weights' shapes are ``layout.check_norm_weights``'s."""
  _check(weights.w_qkv, prefix + "w_qkv", real=real, dtype=torch.bfloat16, shape=(hidden, layout.width),
         device=device)
  _check(weights.bias, prefix + "bias", real=real, dtype=(torch.bfloat16, torch.float32), shape=(layout.width,),
         device=device)
  for name in ("q_norm_weight", "k_norm_weight"):
    _check(getattr(weights, name), prefix + name, real=real, dtype=torch.float32, device=device)


def _added_rows(x, added_x, added_weights: QKVWeights, layout: QKVLayout, *, real: bool) -> int:
  """Joint attention's added tokens checked against x and the layout; their count (0
  without them)."""
  if added_x is None:
    if added_weights is not None and added_weights.w_qkv is not None:
      raise dlpack.BridgeError("added_w_qkv given without added_x: joint attention needs both "
                               "(AddedTokens(x, weights))")
    return 0
  _check(added_x, "added_x", real=real, dtype=torch.bfloat16, ndim=3, device=x.device)
  b_added, added_rows, added_hidden = added_x.shape
  if b_added != x.shape[0]:
    raise dlpack.BridgeError(f"added_x has {b_added} batch rows, x has {x.shape[0]}: they must match")
  _check_weights(added_weights, added_hidden, layout, x.device, real=real, prefix="added_")
  try:
    layout.check_norm_weights(added_weights.q_norm_weight, added_weights.k_norm_weight)
  except ValueError as e:
    raise dlpack.BridgeError(f"added tokens' weights rejected: {e}") from None
  return added_rows


def _added_inputs(added_x, added_w_qkv, added_bias, added_q_norm_weight, added_k_norm_weight) -> dict:
  return {"added_x": added_x, "added_w_qkv": added_w_qkv, "added_bias": added_bias,
          "added_q_norm_weight": added_q_norm_weight, "added_k_norm_weight": added_k_norm_weight}


def _jax_added(j: dict) -> AddedTokens | None:
  if j["added_x"] is None:
    return None
  return AddedTokens(j["added_x"], QKVWeights(j["added_w_qkv"], j["added_bias"], j["added_q_norm_weight"],
                                              j["added_k_norm_weight"]))


def _added_args(added: AddedTokens | None) -> tuple:
  """The op's five added_* arguments of an ``AddedTokens`` of torch tensors (or Nones)."""
  if added is None:
    return (None,) * 5
  w = added.weights
  return (added.x, w.w_qkv, w.bias, w.q_norm_weight, w.k_norm_weight)


def _projection_inputs(x, w_qkv, bias, q_norm_weight, k_norm_weight, rope_cos, rope_sin) -> dict:
  return {"x": x, "w_qkv": w_qkv, "bias": bias, "q_norm_weight": q_norm_weight, "k_norm_weight": k_norm_weight,
          "rope_cos": rope_cos, "rope_sin": rope_sin}


def _jax_weights(j: dict) -> QKVWeights:
  return QKVWeights(j["w_qkv"], j["bias"], j["q_norm_weight"], j["k_norm_weight"])


@torch.library.custom_op(f"{NAMESPACE}::streamed_qkv", mutates_args=())
def _streamed_qkv_op(
    x: torch.Tensor, w_qkv: torch.Tensor, bias: Optional[torch.Tensor], q_norm_weight: Optional[torch.Tensor],
    k_norm_weight: Optional[torch.Tensor], rope_cos: torch.Tensor, rope_sin: torch.Tensor, layout: str,
    storage: str, method: str, scratch_bytes: int, added_x: Optional[torch.Tensor],
    added_w_qkv: Optional[torch.Tensor], added_bias: Optional[torch.Tensor],
    added_q_norm_weight: Optional[torch.Tensor], added_k_norm_weight: Optional[torch.Tensor],
    interpret: Optional[bool],
) -> _QKV_RESULT:
  lay, st = _layout(layout), _storage(storage)
  added = _weights(added_w_qkv, added_bias, added_q_norm_weight, added_k_norm_weight)
  meta = _qkv_meta(x, _weights(w_qkv, bias, q_norm_weight, k_norm_weight), rope_cos, rope_sin, lay, st, real=True,
                   extra_rows=_added_rows(x, added_x, added, lay, real=True))
  inputs = _projection_inputs(x, w_qkv, bias, q_norm_weight, k_norm_weight, rope_cos, rope_sin)
  inputs |= _added_inputs(added_x, added_w_qkv, added_bias, added_q_norm_weight, added_k_norm_weight)
  _enter_jax(inputs, interpret)
  j = {name: dlpack.to_jax(t, name) for name, t in inputs.items()}
  q, packed = jqkv.streamed_qkv(j["x"], _jax_weights(j), layout=lay, rope_cos=j["rope_cos"], rope_sin=j["rope_sin"],
                                storage=st, added=_jax_added(j), method=method, scratch_bytes=int(scratch_bytes),
                                interpret=interpret)
  if packed.meta != meta:
    raise dlpack.BridgeError(f"kernel returned packed K/V metadata {packed.meta}, expected {meta}")
  # Outputs are imported (queuing torch's wait on JAX) before the JAX views of the
  # inputs go out of scope: see torch_bridge.dlpack on lifetimes.
  return (dlpack.to_torch(q, "q"), *(dlpack.to_torch(packed.arrays[n], n) for n in ARRAY_NAMES))


@_streamed_qkv_op.register_fake
def _streamed_qkv_fake(x, w_qkv, bias, q_norm_weight, k_norm_weight, rope_cos, rope_sin, layout, storage, method,
                       scratch_bytes, added_x, added_w_qkv, added_bias, added_q_norm_weight, added_k_norm_weight,
                       interpret):
  lay = _layout(layout)
  added = _weights(added_w_qkv, added_bias, added_q_norm_weight, added_k_norm_weight)
  meta = _qkv_meta(x, _weights(w_qkv, bias, q_norm_weight, k_norm_weight), rope_cos, rope_sin, lay,
                   _storage(storage), real=False, extra_rows=_added_rows(x, added_x, added, lay, real=False))
  q = x.new_empty((meta.batch, meta.num_tokens, lay.heads, lay.head_dim), dtype=torch.bfloat16)
  specs = torch_buffer_specs(meta)
  return (q, *(x.new_empty(specs[n][0], dtype=specs[n][1]) for n in ARRAY_NAMES))


def streamed_qkv(x: torch.Tensor, weights: QKVWeights, *, layout: QKVLayout, rope_cos: torch.Tensor,
                 rope_sin: torch.Tensor, storage: KVStorage | None = None, added: AddedTokens | None = None,
                 method: str = "auto", scratch_bytes: int = DEFAULT_SCRATCH_BYTES,
                 interpret: bool | None = None) -> tuple[torch.Tensor, TorchPackedKV]:
  """Torch front end of ``pallas_kernels.streamed_qkv``.

  Same arguments (``weights``: a ``QKVWeights`` of torch tensors; ``layout``: a
  ``QKVLayout``; ``storage``: a ``formats.KVStorage``, None for every block int4),
  torch tensors in and out: returns Q (B, T, H, D) bf16 in the rotated basis and the
  packed K/V as a ``TorchPackedKV`` whose tensors are the kernel's own output buffers.
  ``added``: an ``AddedTokens`` of torch tensors (joint attention; T + T_added rows out).
  """
  storage = as_storage(storage)
  if not isinstance(weights, QKVWeights):
    raise dlpack.BridgeError(f"weights must be a QKVWeights(w_qkv, bias, q_norm_weight, k_norm_weight) of "
                             f"torch tensors, got {type(weights).__name__}")
  out = torch.ops.packed_kv.streamed_qkv(x, weights.w_qkv, weights.bias, weights.q_norm_weight,
                                         weights.k_norm_weight, rope_cos, rope_sin, layout.to_json(),
                                         storage.to_json(), method, int(scratch_bytes), *_added_args(added),
                                         interpret)
  meta = storage.meta(x.shape[0], layout.heads, layout.head_dim, out[0].shape[1])
  return out[0], TorchPackedKV.from_tuple(meta, out[1:])


# --------------------------------------------------------------------------------------
# Dense packed attention
# --------------------------------------------------------------------------------------
def _attention_meta(q, packed, num_tokens, storage: KVStorage, q_segment_ids, kv_segment_ids, kv_mask,
                    kv_lengths=None, *, real: bool):
  """Validate attention inputs against the format; return the packed K/V metadata."""
  _check(q, "q", real=real, dtype=torch.bfloat16, ndim=4)
  b, tq, h, d = q.shape
  if len(packed) != NUM_ARRAYS:
    raise dlpack.BridgeError(f"packed must hold {NUM_ARRAYS} tensors in formats.ARRAY_NAMES order, "
                             f"got {len(packed)}")
  try:
    meta = storage.meta(b, h, d, int(num_tokens))
  except ValueError as e:
    raise dlpack.BridgeError(f"packed K/V metadata rejected by the format (q is {list(q.shape)}): "
                             f"{e}") from None
  device, specs = q.device, torch_buffer_specs(meta)
  for name, t in zip(ARRAY_NAMES, packed):
    shape, dtype = specs[name]
    _check(t, f"packed.{name}", real=real, dtype=dtype, shape=shape, device=device)
  if (q_segment_ids is None) != (kv_segment_ids is None):
    raise dlpack.BridgeError("pass both q_segment_ids and kv_segment_ids, or neither")
  for name, ids, length in (("q_segment_ids", q_segment_ids, tq),
                            ("kv_segment_ids", kv_segment_ids, meta.num_tokens)):
    if ids is not None and tuple(ids.shape) not in ((length,), (b, length)):
      raise dlpack.BridgeError(f"{name} must be (T,) = ({length},) or (B, T) = {(b, length)}, got "
                               f"{list(ids.shape)}")
    _check(ids, name, real=real, dtype=torch.int32, device=device)
  _check(kv_mask, "kv_mask", real=real, dtype=torch.bool, shape=(b, meta.num_tokens), device=device)
  _check(kv_lengths, "kv_lengths", real=real, dtype=torch.int32, shape=(b,), device=device)
  return meta


def _jax_packed(meta, packed):
  return formats.PackedKV(meta, {n: dlpack.to_jax(t, f"packed.{n}") for n, t in zip(ARRAY_NAMES, packed)})


@torch.library.custom_op(f"{NAMESPACE}::packed_attention", mutates_args=())
def _packed_attention_op(
    q: torch.Tensor, packed: Sequence[torch.Tensor], num_tokens: int, storage: str, attention: str,
    q_segment_ids: Optional[torch.Tensor], kv_segment_ids: Optional[torch.Tensor], kv_mask: Optional[torch.Tensor],
    kv_lengths: Optional[torch.Tensor], keep_rotated: bool, interpret: Optional[bool],
) -> torch.Tensor:
  cfg = _attention(attention, Dense)
  meta = _attention_meta(q, packed, num_tokens, _storage(storage), q_segment_ids, kv_segment_ids, kv_mask,
                         kv_lengths, real=True)
  _enter_jax({"q": q, "packed.k_mean": packed[ARRAY_NAMES.index("k_mean")],
              "q_segment_ids": q_segment_ids, "kv_segment_ids": kv_segment_ids, "kv_mask": kv_mask,
              "kv_lengths": kv_lengths}, interpret)
  j = dlpack.to_jax
  o = jattention.packed_attention(
      j(q, "q"), _jax_packed(meta, packed), cfg, q_segment_ids=j(q_segment_ids, "q_segment_ids"),
      kv_segment_ids=j(kv_segment_ids, "kv_segment_ids"), kv_mask=j(kv_mask, "kv_mask"),
      kv_lengths=j(kv_lengths, "kv_lengths"), keep_rotated=bool(keep_rotated), interpret=interpret)
  return dlpack.to_torch(o, "o")


@_packed_attention_op.register_fake
def _packed_attention_fake(q, packed, num_tokens, storage, attention, q_segment_ids, kv_segment_ids, kv_mask,
                           kv_lengths, keep_rotated, interpret):
  _attention(attention, Dense)
  _attention_meta(q, packed, num_tokens, _storage(storage), q_segment_ids, kv_segment_ids, kv_mask, kv_lengths,
                  real=False)
  return q.new_empty(q.shape, dtype=torch.bfloat16)


def _packed_args(packed) -> tuple:
  if not isinstance(packed, TorchPackedKV):
    raise dlpack.BridgeError(f"packed must be a TorchPackedKV, got {type(packed).__name__}; wrap "
                             "raw tensors with TorchPackedKV.from_tuple(meta, tensors)")
  return list(packed.as_tuple()), packed.meta.num_tokens, KVStorage.of(packed.meta).to_json()


def packed_attention(q: torch.Tensor, packed: TorchPackedKV, attention: Dense | None = None, *,
                     q_segment_ids: torch.Tensor | None = None, kv_segment_ids: torch.Tensor | None = None,
                     kv_mask: torch.Tensor | None = None, kv_lengths: torch.Tensor | None = None,
                     keep_rotated: bool = False, interpret: bool | None = None) -> torch.Tensor:
  """Torch front end of ``pallas_kernels.packed_attention``.

  q (B, Tq, H, D) bf16 in the rotated basis (as ``streamed_qkv`` returns it); returns
  O (B, Tq, H, D) bf16, un-rotated unless ``keep_rotated``. ``attention``: a ``Dense``
  config (None: ``Dense()``). Segment ids are int32, (T,) shared by the batch
  (``segment_ids_from_cu_seqlens``) or (B, T); ``kv_mask`` is (B, Tk) bool with True =
  attend; ``kv_lengths`` (B,) int32 valid keys per batch row. A query that sees no key
  outputs 0.
  """
  attention = Dense() if attention is None else attention
  if not isinstance(attention, Dense):
    raise dlpack.BridgeError(f"packed_attention takes a Dense(...) config, got {attention!r}; Sol runs through "
                             "sol_attention")
  return torch.ops.packed_kv.packed_attention(q, *_packed_args(packed), attention.to_json(), q_segment_ids,
                                              kv_segment_ids, kv_mask, kv_lengths, bool(keep_rotated), interpret)


def segment_ids_from_cu_seqlens(cu_seqlens: torch.Tensor, num_tokens: int) -> torch.Tensor:
  """(S+1,) cumulative sequence lengths ``[0, l0, l0+l1, ...]`` -> (T,) int32 segment ids.

  Torch twin of ``pallas_kernels.attention.segment_ids_from_cu_seqlens`` (pure torch,
  so it traces under torch.compile): token t gets the index of its sequence, and
  tokens at or past ``cu_seqlens[-1]`` get -1 (mask them with ``kv_mask``).
  """
  cu = cu_seqlens.to(torch.int64)
  pos = torch.arange(num_tokens, device=cu.device, dtype=torch.int64)
  ids = torch.searchsorted(cu[1:].contiguous(), pos, right=True)
  return torch.where(pos >= cu[-1], -1, ids).to(torch.int32)


# --------------------------------------------------------------------------------------
# Sol attention (sparse)
# --------------------------------------------------------------------------------------
_SOL_KEY_BIAS_DTYPES = (torch.bool, torch.float32, torch.bfloat16, torch.float16)


def _sol_meta(q, packed, num_tokens, storage, key_bias, block_len, *, real: bool):
  """Validate Sol's inputs (the dense checks plus Sol's own); return the metadata."""
  meta = _attention_meta(q, packed, num_tokens, storage, None, None, None, real=real)
  if q.shape[1] != meta.num_tokens:
    raise dlpack.BridgeError(f"Sol attention is self-attention: q has {q.shape[1]} tokens but the "
                             f"packed K/V has {meta.num_tokens}; use packed_attention for Tq != Tkv")
  if key_bias is not None:
    _check(key_bias, "key_bias", real=real, dtype=_SOL_KEY_BIAS_DTYPES, device=q.device)
    if key_bias.dim() not in (1, 2, 4) or key_bias.shape[-1] != meta.num_tokens:
      raise dlpack.BridgeError(f"key_bias {list(key_bias.shape)} must be (T,), (B, T) or "
                               f"(B, 1, 1, T) with T = {meta.num_tokens}")
  _check(block_len, "block_len", real=real, dtype=torch.int32, shape=(meta.num_blocks,),
         device=q.device)
  return meta


@torch.library.custom_op(f"{NAMESPACE}::sol_attention", mutates_args=())
def _sol_attention_op(
    q: torch.Tensor, packed: Sequence[torch.Tensor], num_tokens: int, storage: str, attention: str,
    key_bias: Optional[torch.Tensor], block_len: Optional[torch.Tensor], keep_rotated: bool,
    interpret: Optional[bool],
) -> torch.Tensor:
  cfg = _attention(attention, Sol)
  meta = _sol_meta(q, packed, num_tokens, _storage(storage), key_bias, block_len, real=True)
  _enter_jax({"q": q, "packed.k_mean": packed[ARRAY_NAMES.index("k_mean")], "key_bias": key_bias,
              "block_len": block_len}, interpret)
  j = dlpack.to_jax
  o = jsol.sol_attention(j(q, "q"), _jax_packed(meta, packed), cfg, key_bias=j(key_bias, "key_bias"),
                         block_len=j(block_len, "block_len"), keep_rotated=bool(keep_rotated), interpret=interpret)
  return dlpack.to_torch(o, "o")


@_sol_attention_op.register_fake
def _sol_attention_fake(q, packed, num_tokens, storage, attention, key_bias, block_len, keep_rotated, interpret):
  _attention(attention, Sol)
  _sol_meta(q, packed, num_tokens, _storage(storage), key_bias, block_len, real=False)
  return q.new_empty(q.shape, dtype=torch.bfloat16)


def sol_attention(q: torch.Tensor, packed: TorchPackedKV, attention: Sol | None = None, *,
                  key_bias: torch.Tensor | None = None, block_len: torch.Tensor | None = None,
                  keep_rotated: bool = False, interpret: bool | None = None) -> torch.Tensor:
  """Torch front end of ``pallas_kernels.sol_attention``.

  Self-attention only (q has the packed K/V's T tokens). ``attention``: a ``Sol``
  config (comfy-kitchen's ``sol_attn`` settings; None: ``Sol()``); ``key_bias`` is
  (T,), (B, T) or (B, 1, 1, T), bool (True = attend) or float (natural-log bias);
  ``block_len`` is (NB,) int32. Routing is computed inside the same call.
  """
  attention = Sol() if attention is None else attention
  if not isinstance(attention, Sol):
    raise dlpack.BridgeError(f"sol_attention takes a Sol(...) config, got {attention!r}")
  return torch.ops.packed_kv.sol_attention(q, *_packed_args(packed), attention.to_json(), key_bias, block_len,
                                           bool(keep_rotated), interpret)


# --------------------------------------------------------------------------------------
# The attention core of a block: projection + attention in one JAX call
# --------------------------------------------------------------------------------------
def _layer_meta(x, weights, rope_cos, rope_sin, layout, storage, attention, segment_ids, kv_mask, kv_lengths, *,
                real: bool, added_x=None, added_weights=None) -> PackedKVMeta:
  meta = _qkv_meta(x, weights, rope_cos, rope_sin, layout, storage, real=real,
                   extra_rows=_added_rows(x, added_x, added_weights, layout, real=real))
  try:
    jlayer.check_attention(attention, (segment_ids, kv_mask, kv_lengths))
  except ValueError as e:
    raise dlpack.BridgeError(str(e)) from None
  b, t = meta.batch, meta.num_tokens
  if segment_ids is not None and tuple(segment_ids.shape) not in ((t,), (b, t)):
    raise dlpack.BridgeError(f"segment_ids must be (T,) = ({t},) or (B, T) = {(b, t)}, got "
                             f"{list(segment_ids.shape)}")
  _check(segment_ids, "segment_ids", real=real, dtype=torch.int32, device=x.device)
  _check(kv_mask, "kv_mask", real=real, dtype=torch.bool, shape=(b, t), device=x.device)
  _check(kv_lengths, "kv_lengths", real=real, dtype=torch.int32, shape=(b,), device=x.device)
  return meta


@torch.library.custom_op(f"{NAMESPACE}::attention_layer", mutates_args=())
def _attention_layer_op(
    x: torch.Tensor, w_qkv: torch.Tensor, bias: Optional[torch.Tensor], q_norm_weight: Optional[torch.Tensor],
    k_norm_weight: Optional[torch.Tensor], rope_cos: torch.Tensor, rope_sin: torch.Tensor, layout: str,
    storage: str, attention: str, segment_ids: Optional[torch.Tensor], kv_mask: Optional[torch.Tensor],
    kv_lengths: Optional[torch.Tensor], added_x: Optional[torch.Tensor], added_w_qkv: Optional[torch.Tensor],
    added_bias: Optional[torch.Tensor], added_q_norm_weight: Optional[torch.Tensor],
    added_k_norm_weight: Optional[torch.Tensor], interpret: Optional[bool],
) -> torch.Tensor:
  lay, st, cfg = _layout(layout), _storage(storage), _attention(attention)
  added = _weights(added_w_qkv, added_bias, added_q_norm_weight, added_k_norm_weight)
  _layer_meta(x, _weights(w_qkv, bias, q_norm_weight, k_norm_weight), rope_cos, rope_sin, lay, st, cfg,
              segment_ids, kv_mask, kv_lengths, real=True, added_x=added_x, added_weights=added)
  inputs = _projection_inputs(x, w_qkv, bias, q_norm_weight, k_norm_weight, rope_cos, rope_sin)
  inputs |= {"segment_ids": segment_ids, "kv_mask": kv_mask, "kv_lengths": kv_lengths}
  inputs |= _added_inputs(added_x, added_w_qkv, added_bias, added_q_norm_weight, added_k_norm_weight)
  _enter_jax(inputs, interpret)
  j = {name: dlpack.to_jax(t, name) for name, t in inputs.items()}
  o = jlayer.attention_layer(j["x"], _jax_weights(j), layout=lay, rope_cos=j["rope_cos"], rope_sin=j["rope_sin"],
                             storage=st, attention=cfg, segment_ids=j["segment_ids"], kv_mask=j["kv_mask"],
                             kv_lengths=j["kv_lengths"], added=_jax_added(j), interpret=interpret)
  return dlpack.to_torch(o, "o")


@_attention_layer_op.register_fake
def _attention_layer_fake(x, w_qkv, bias, q_norm_weight, k_norm_weight, rope_cos, rope_sin, layout, storage,
                          attention, segment_ids, kv_mask, kv_lengths, added_x, added_w_qkv, added_bias,
                          added_q_norm_weight, added_k_norm_weight, interpret):
  lay = _layout(layout)
  meta = _layer_meta(x, _weights(w_qkv, bias, q_norm_weight, k_norm_weight), rope_cos, rope_sin, lay,
                     _storage(storage), _attention(attention), segment_ids, kv_mask, kv_lengths, real=False,
                     added_x=added_x,
                     added_weights=_weights(added_w_qkv, added_bias, added_q_norm_weight, added_k_norm_weight))
  return x.new_empty((meta.batch, meta.num_tokens, lay.heads, lay.head_dim), dtype=torch.bfloat16)


def attention_layer(x: torch.Tensor, weights: QKVWeights, *, layout: QKVLayout, rope_cos: torch.Tensor,
                    rope_sin: torch.Tensor, storage: KVStorage | None = None, attention: Dense | Sol | None = None,
                    segment_ids: torch.Tensor | None = None, kv_mask: torch.Tensor | None = None,
                    kv_lengths: torch.Tensor | None = None, added: AddedTokens | None = None,
                    interpret: bool | None = None) -> torch.Tensor:
  """Torch front end of ``pallas_kernels.attention_layer`` (same arguments, torch
  tensors; ``weights`` a ``QKVWeights`` of torch tensors): x (B, T, hidden) bf16 ->
  (B, T, H, D) bf16 un-rotated attention output, the projection and attention in one
  JAX call. The one way the torch module and the diffusers processors call the op.
  ``added``: an ``AddedTokens`` of torch tensors (joint attention; the output then has
  T + T_added rows, the added ones last).

  ``layout`` / ``storage`` / ``attention`` may also be given as their ``to_json()``
  text, which is what a module caches so that ``torch.compile`` sees constants.
  """
  return torch.ops.packed_kv.attention_layer(x, weights.w_qkv, weights.bias, weights.q_norm_weight,
                                             weights.k_norm_weight, rope_cos, rope_sin, settings_json(layout),
                                             settings_json(as_storage(storage) if not isinstance(storage, str)
                                                           else storage),
                                             settings_json(as_attention(attention) if not isinstance(attention, str)
                                                           else attention),
                                             segment_ids, kv_mask, kv_lengths, *_added_args(added), interpret)


def settings_json(value) -> str:
  """A ``QKVLayout``, ``KVStorage``, ``Dense`` or ``Sol`` as the JSON text the ops take
  (text passes through)."""
  return value if isinstance(value, str) else value.to_json()


def required_bytes(tokens: int, layout: QKVLayout, hidden: int, **kw) -> dict:
  """Device bytes an attention block needs above what the caller holds, phase by
  phase (``pallas_kernels.layer.required_bytes``: same arguments)."""
  return jlayer.required_bytes(tokens, layout, hidden, **kw)
