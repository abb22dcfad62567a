"""Sequence-parallel H3 attention (Ulysses, ring) with the packed K/V on the wire.

x (B, T, hidden) is split by tokens over one axis of a ``jax.sharding.Mesh`` of P
devices. Inside one ``jax.shard_map`` program each device:

1. projects its own rows with ``streamed_qkv``: Q bf16 and a PackedKV of its tokens
   (every class, ragged tail and block stats exactly as one device would make them);
2. sends every array through one ``lax.all_to_all`` (XLA lowers it to NCCL on GPUs):
   heads split into P groups, tokens gathered. Afterwards it holds Q and the packed
   K/V of all T tokens for H/P heads. This is the step where BF16 Ulysses (xDiT/USP,
   the layer users run today) sends K and V at 2 bytes a value; the packed K/V moves
   about 4.625 bits a value, format v2 (``wire_bytes``);
3. runs the single-device dense or Sol attention on its heads, unchanged (the
   ``attention`` config, ``Dense(...)`` or ``Sol(...)``, as ``layer.attention_layer``);
4. sends O back to token shards with a second ``all_to_all``.

Shapes under shard_map are the same on every device, and the format's stores are not:
each device's token range has its own block classes (an int8 prefix sits on device 0
only) and the last shard may be short or empty. So each device pads every store to the
largest any device has (``UlyssesPlan``: the capacities are static, from the class
map), the receiver cuts the padding out with static slices, and devices whose class
maps differ project through a ``lax.switch`` on the axis index, one branch per distinct
local map. The padded x has P x S rows, S = ceil(T / P) rounded up to a 64-token block,
so every device's blocks are whole global blocks.

Heads must divide by P (H3's 56 heads: P in 1, 2, 4, 7, 8, 14, 28, 56); otherwise a
ValueError says which P would work, and ``ring_attention_layer`` takes any P: each
device keeps its Q and its token rows, the packed K/V shards travel the ring with
``ppermute`` (P - 1 hops), each is attended by ``packed_attention_lse`` (the fused
kernel, which also returns each row's log-sum-exp), and the partial outputs merge
through their log-sum-exp. Ring is dense only (Sol routes over the whole sequence: a
``Sol`` config raises) and runs the fused kernel, not cuDNN (jax's public cuDNN call
returns no log-sum-exp); it is not combined with Ulysses.

Inputs are ``layer.attention_layer``'s: ``weights`` a ``QKVWeights``, ``layout`` a
``QKVLayout``, ``storage`` a ``formats.KVStorage`` (resolved once to the global block
classes for T, then cut per device), ``attention`` a ``Dense`` / ``Sol`` whose
``scratch_bytes`` bounds each device's projection and attention scratch.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from formats import packed_kv as fmt
from formats.storage import KVStorage, as_storage, class_id
from pallas_kernels import attention as dense
from pallas_kernels import backend
from pallas_kernels import qkv_projection as sq
from pallas_kernels import sol
from pallas_kernels.attention_config import DEFAULT_SCRATCH_BYTES, Dense, Sol, as_attention
from pallas_kernels.layer import check_attention
from pallas_kernels.qkv_layout import QKVLayout, QKVWeights

__all__ = ["UlyssesPlan", "ring_attention_layer", "ulysses_attention_layer", "ulysses_plan", "ulysses_qkv",
           "wire_bytes"]

BLOCK = fmt.BLOCK


@dataclasses.dataclass(frozen=True)
class UlyssesPlan:
  """Static layout of one Ulysses layer: who owns which tokens and how the stores pad."""
  devices: int
  num_tokens: int
  shard_tokens: int                     # S: rows per device (a multiple of 64)
  local_tokens: tuple[int, ...]         # real rows of each device (the last ones may be short or 0)
  local_classes: tuple[tuple[int, ...], ...]  # each device's block classes
  capacity: tuple[int, int, int]        # slots per class (int4, int8, bf16) every device sends

  @property
  def block_classes(self) -> tuple[int, ...]:
    return sum(self.local_classes, ())

  def slots(self, device: int, cls: str) -> int:
    return sum(1 for c in self.local_classes[device] if c == fmt.CLASS_ID[cls])

  def branches(self) -> tuple[tuple[int, tuple[int, ...]], ...]:
    """The distinct (local tokens, local classes) pairs, in first-device order."""
    out = []
    for pair in zip(self.local_tokens, self.local_classes):
      if pair not in out:
        out.append(pair)
    return tuple(out)

  def branch_index(self) -> tuple[int, ...]:
    br = self.branches()
    return tuple(br.index(p) for p in zip(self.local_tokens, self.local_classes))


def _refuse_split_classes(block_classes) -> None:
  """The sharded stores (padded per class, all-to-all per array) and the ring's
  log-sum-exp merge (the fused kernel) know the fused kernels' classes only."""
  backend.refuse_outside_fused(block_classes, "sequence parallelism",
                               "store those blocks as int4, int8 or bf16 (or run attention_layer on one device)")


def ulysses_plan(num_tokens: int, devices: int, block_classes=None) -> UlyssesPlan:
  """The plan for T tokens on ``devices`` devices; ``block_classes`` one class (name or
  id) per 64-token block of the whole sequence, e.g. ``KVStorage.classes_for(T)``
  (None: every block int4)."""
  if num_tokens <= 0 or devices <= 0:
    raise ValueError(f"num_tokens and devices must be positive, got {num_tokens}, {devices}")
  nb = -(-num_tokens // BLOCK)
  classes = (0,) * nb if block_classes is None else tuple(class_id(c) for c in block_classes)
  _refuse_split_classes(classes)
  if len(classes) != nb:
    raise ValueError(f"block_classes has {len(classes)} entries, need {nb} for T = {num_tokens}")
  per = -(-nb // devices)
  s = per * BLOCK
  local_tokens = tuple(int(np.clip(num_tokens - p * s, 0, s)) for p in range(devices))
  local_classes = tuple(classes[p * per:(p + 1) * per] for p in range(devices))
  cap = tuple(max(sum(1 for c in lc if c == cid) for lc in local_classes) for cid in range(3))
  return UlyssesPlan(devices, num_tokens, s, local_tokens, local_classes, cap)


def _slot_axis(name: str, meta: fmt.PackedKVMeta) -> tuple[int, int]:
  """(axis, values per slot) of the token/slot axis of a PackedKV array."""
  if name.endswith(("scale4", "scale5", "scale8", "zero4", "zero5", "zero8")):
    scheme = meta.k_scheme if name.startswith("k") else meta.v_scheme
    return (2, 1) if scheme == "channel" else (3, BLOCK)
  if name in ("k_mean", "v_sum"):
    return 2, 1
  return 2, BLOCK                                       # codes and bf16 stores


def _class_of(name: str) -> str | None:
  """The class whose blocks array ``name`` holds; None for the stats (every block).
  The 5-bit stores are always empty here (``_refuse_split_classes``)."""
  if name in ("k_mean", "v_sum"):
    return None
  return {"4": "int4", "5": "k5v5", "8": "int8", "6": "bf16"}[name[-1]]


def _extent(plan: UlyssesPlan, name: str, meta: fmt.PackedKVMeta, device: int | None = None) -> tuple[int, int]:
  """(slot axis, its length) of array ``name``: the padded capacity every device sends
  (stats: one per block of the shard), or with ``device`` that device's own slots."""
  axis, per_slot = _slot_axis(name, meta)
  cls = _class_of(name)
  if cls == "k5v5":
    slots = 0
  elif device is None:
    slots = plan.shard_tokens // BLOCK if cls is None else plan.capacity[fmt.CLASSES.index(cls)]
  else:
    slots = -(-plan.local_tokens[device] // BLOCK) if cls is None else plan.slots(device, cls)
  return axis, slots * per_slot


def _pad_axis(a, axis, size):
  pad = [(0, 0)] * a.ndim
  pad[axis] = (0, size - a.shape[axis])
  return jnp.pad(a, pad)


def _local_projection(x, cos, sin, weights: QKVWeights, *, plan, proj, axis_name):
  """This device's rows -> (Q (B, S, H, D), {name: padded store}), via one switch branch
  per distinct local class map."""
  b, s, _ = x.shape

  def branch(tokens, classes):
    def run(x, cos, sin):
      if tokens == 0:  # an empty shard sends padding only
        meta = proj.meta(b, proj.heads, 1, (0,))   # any meta: only the padded shapes are read
        q = jnp.zeros((b, s, proj.heads, proj.head_dim), jnp.bfloat16)
        arrays = {n: jnp.zeros(_padded_shape(shape, n, meta, plan), dt)
                  for n, (shape, dt) in fmt.buffer_specs(meta).items()}
        return q, arrays
      q, packed = sq.streamed_qkv(x[:, :tokens], weights, layout=proj.layout, rope_cos=cos[:tokens],
                                  rope_sin=sin[:tokens], storage=proj.storage(classes),
                                  scratch_bytes=proj.scratch_bytes, interpret=proj.interpret)
      arrays = {n: _pad_axis(a, *_extent(plan, n, packed.meta)) for n, a in packed.arrays.items()}
      return _pad_axis(q, 1, s), arrays
    return run

  branches = [branch(t, c) for t, c in plan.branches()]
  if len(branches) == 1:
    return branches[0](x, cos, sin)
  which = jnp.asarray(plan.branch_index(), jnp.int32)[jax.lax.axis_index(axis_name)]
  return jax.lax.switch(which, branches, x, cos, sin)


def _padded_shape(shape, name, meta, plan):
  axis, size = _extent(plan, name, meta)
  return tuple(size if i == axis else n for i, n in enumerate(shape))


def _gather_tokens(arrays: dict, plan: UlyssesPlan, meta: fmt.PackedKVMeta) -> dict:
  """Received stores (P segments of padded capacity on the slot axis) -> the global
  stores: static slices of each device's real slots, in device order."""
  out = {}
  for n, a in arrays.items():
    axis, cap = _extent(plan, n, meta)
    parts = []
    for p in range(plan.devices):
      used = _extent(plan, n, meta, p)[1]
      if used:
        parts.append(jax.lax.slice_in_dim(a, p * cap, p * cap + used, axis=axis))
    if not parts:  # no device has a block of this class: the store is empty
      parts = [jax.lax.slice_in_dim(a, 0, 0, axis=axis)]
    out[n] = jnp.concatenate(parts, axis) if len(parts) > 1 else parts[0]
  return out


@dataclasses.dataclass(frozen=True)
class _Proj:
  """The static settings of the local projection (``streamed_qkv``'s keywords), the
  storage resolved to plain hashable values: its block classes travel separately (the
  global map, cut per device), its schemes and seeds here."""
  layout: QKVLayout
  k_scheme: str
  v_scheme: str
  rotation_seed_k: int
  rotation_seed_v: int
  interpret: bool
  scratch_bytes: int

  @property
  def heads(self) -> int:
    return self.layout.heads

  @property
  def head_dim(self) -> int:
    return self.layout.head_dim

  def storage(self, classes) -> KVStorage:
    """The ``KVStorage`` of a token range whose blocks have ``classes``."""
    return KVStorage(block_classes=classes, k_scheme=self.k_scheme, v_scheme=self.v_scheme,
                     rotation_seed_k=self.rotation_seed_k, rotation_seed_v=self.rotation_seed_v)

  def meta(self, batch, heads, tokens, classes) -> fmt.PackedKVMeta:
    return fmt.PackedKVMeta(batch, heads, self.head_dim, tokens, classes, self.k_scheme, self.v_scheme,
                            self.rotation_seed_k, self.rotation_seed_v)


def _token_shards(x, rope_cos, rope_sin, devices, block_classes):
  """(plan, padded rows, x, cos, sin padded to P x S rows)."""
  plan = ulysses_plan(x.shape[1], devices, block_classes)
  rows = devices * plan.shard_tokens
  pad = lambda a, axis: _pad_axis(a, axis, rows)
  return plan, rows, pad(x, 1), pad(rope_cos.astype(jnp.float32), 0), pad(rope_sin.astype(jnp.float32), 0)


def _shard_call(body, mesh, axis_name, out_specs, x, cos, sin, weights: QKVWeights):
  """``body(x, cos, sin, weights)`` per device under shard_map: x, cos and sin split by
  tokens, the weights replicated. An optional weight that is None crosses as an empty
  array and reaches ``body`` as None again."""
  leaves = (weights.w_qkv, weights.bias, weights.q_norm_weight, weights.k_norm_weight)
  given = [a is not None for a in leaves]
  rep = P()

  def local(x, c, s, *arrays):
    return body(x, c, s, QKVWeights(*(a if g else None for a, g in zip(arrays, given))))
  shard = jax.shard_map(local, mesh=mesh, check_vma=False, out_specs=out_specs,
                        in_specs=(P(None, axis_name), P(axis_name), P(axis_name), rep, rep, rep, rep))
  empty = jnp.zeros((0,), jnp.float32)
  return shard(x, cos, sin, *(a if g else empty for a, g in zip(leaves, given)))


_STATIC = ("mesh", "axis_name", "block_classes", "proj", "attention")


def _sharded(x, weights, rope_cos, rope_sin, *, mesh, axis_name, block_classes, proj: _Proj, attention):
  """The shard_map program. attention None: stop after the exchange and return
  (Q (B, T, H, D) and the packed arrays, sharded by heads); else (a ``Dense`` or
  ``Sol``) the layer's output (B, T, H, D) sharded by tokens."""
  devices = mesh.shape[axis_name]
  b, t, _ = x.shape
  heads, interpret = proj.heads, proj.interpret
  plan, rows, x, cos, sin = _token_shards(x, rope_cos, rope_sin, devices, block_classes)
  local_meta = proj.meta(b, heads // devices, t, plan.block_classes)

  def body(x, cos, sin, weights):
    q, arrays = _local_projection(x, cos, sin, weights, plan=plan, proj=proj, axis_name=axis_name)
    # Tokens -> heads. Every packed array is (B, H, ...): heads split, slot axis gathered.
    a2a = functools.partial(jax.lax.all_to_all, axis_name=axis_name, tiled=True)
    q = a2a(q, split_axis=2, concat_axis=1)[:, :t]                       # (B, T, H/P, D)
    arrays = {n: a2a(a, split_axis=1, concat_axis=_slot_axis(n, local_meta)[0]) for n, a in arrays.items()}
    packed = fmt.PackedKV(local_meta, _gather_tokens(arrays, plan, local_meta))
    if attention is None:
      return q, packed.arrays
    if isinstance(attention, Sol):
      o = sol.sol_attention(q, packed, attention, overwrite_q=True, interpret=interpret)
    else:
      o = dense.packed_attention(q, packed, attention, overwrite_q=True, interpret=interpret)
    # Heads -> tokens.
    return a2a(_pad_axis(o, 1, rows), split_axis=1, concat_axis=2)       # (B, S, H, D)

  by_heads = P(None, axis_name)                                          # packed arrays: (B, H, ...)
  out_specs = ((P(None, None, axis_name), {n: by_heads for n in fmt.ARRAY_NAMES}) if attention is None
               else P(None, axis_name))
  out = _shard_call(body, mesh, axis_name, out_specs, x, cos, sin, weights)
  if attention is None:
    q, arrays = out
    return q, fmt.PackedKV(proj.meta(b, heads, t, plan.block_classes), arrays)
  return out[:, :t]


_sharded_jit = jax.jit(_sharded, static_argnames=_STATIC)


def _resolve(x, weights, layout, rope_cos, rope_sin, storage, mesh, axis_name, *, interpret, scratch_bytes):
  """The one-device checks (``streamed_qkv``'s, on the whole sequence) and the mesh's;
  returns (the global block classes, the projection's static settings). The storage is
  resolved here, before jit: a ``KVStorage`` holding a ``PrecisionPolicy`` is no
  reliable static argument, its block classes, schemes and seeds are."""
  if axis_name not in mesh.shape:
    raise ValueError(f"axis_name {axis_name!r} is not an axis of the mesh {dict(mesh.shape)}")
  if getattr(x, "ndim", None) != 3 or x.shape[0] == 0 or x.shape[1] == 0:
    raise ValueError(f"x must be (B, T, hidden) with B, T >= 1, got shape {tuple(getattr(x, 'shape', ()))}")
  meta = sq.check_inputs(x, weights, layout, rope_cos, rope_sin, storage)
  _refuse_split_classes(meta.block_classes)
  proj = _Proj(layout, meta.k_scheme, meta.v_scheme, meta.rotation_seed_k, meta.rotation_seed_v,
               backend.resolve_interpret(interpret), int(scratch_bytes))
  return tuple(int(c) for c in meta.block_classes), proj


def _check_heads(heads, devices):
  if heads % devices:
    good = [p for p in range(1, heads + 1) if heads % p == 0]
    raise ValueError(f"Ulysses splits heads over the devices: heads={heads} is not divisible by "
                     f"P={devices}; use a mesh axis of size in {good} (or ring_attention_layer)")


def ulysses_attention_layer(x, weights: QKVWeights, *, mesh: Mesh, axis_name: str, layout: QKVLayout, rope_cos,
                            rope_sin, storage: KVStorage | None = None, attention: Dense | Sol | None = None,
                            interpret=None):
  """``layer.attention_layer`` over the ``axis_name`` axis of ``mesh``, tokens sharded.

  x (B, T, hidden) bf16 (any T >= 1; the layer pads to whole blocks per device),
  rope tables with T rows, ``weights`` / ``layout`` / ``storage`` / ``attention`` as
  ``attention_layer`` (no masks: one sequence per batch row; ``storage`` describes the
  whole sequence of T tokens). Returns (B, T, H, D) bf16, un-rotated, sharded by tokens
  over ``axis_name``; equal to the single-device layer (same codes, the same attention
  per head). ``attention.scratch_bytes`` bounds each device's projection and attention
  scratch.
  """
  attention = check_attention(attention, ())
  classes, proj = _resolve(x, weights, layout, rope_cos, rope_sin, storage, mesh, axis_name, interpret=interpret,
                           scratch_bytes=attention.scratch_bytes)
  _check_heads(layout.heads, mesh.shape[axis_name])
  return _sharded_jit(x, weights, rope_cos, rope_sin, mesh=mesh, axis_name=axis_name, block_classes=classes,
                      proj=proj, attention=attention)


def ulysses_qkv(x, weights: QKVWeights, *, mesh: Mesh, axis_name: str, layout: QKVLayout, rope_cos, rope_sin,
                storage: KVStorage | None = None, scratch_bytes=DEFAULT_SCRATCH_BYTES, interpret=None):
  """The layer's first half, for callers with their own attention: ``streamed_qkv`` on
  token shards, then the exchange. Returns (Q (B, T, H, D) bf16, PackedKV of all T
  tokens and H heads), both sharded by heads over ``axis_name``: the same values
  ``streamed_qkv`` gives on one device (arguments as there, plus the mesh)."""
  if not isinstance(scratch_bytes, (int, np.integer)) or isinstance(scratch_bytes, bool) or scratch_bytes < 0:
    raise ValueError(f"scratch_bytes must be a non-negative int (bytes), got {scratch_bytes!r}")
  classes, proj = _resolve(x, weights, layout, rope_cos, rope_sin, storage, mesh, axis_name, interpret=interpret,
                           scratch_bytes=scratch_bytes)
  _check_heads(layout.heads, mesh.shape[axis_name])
  return _sharded_jit(x, weights, rope_cos, rope_sin, mesh=mesh, axis_name=axis_name, block_classes=classes,
                      proj=proj, attention=None)


def _cut_local(arrays: dict, plan: UlyssesPlan, device: int, meta: fmt.PackedKVMeta) -> dict:
  """A device's padded stores (capacity slots) -> its own PackedKV arrays."""
  out = {}
  for n, a in arrays.items():
    axis, used = _extent(plan, n, meta, device)
    out[n] = jax.lax.slice_in_dim(a, 0, used, axis=axis)
  return out


_RING_STATIC = ("mesh", "axis_name", "block_classes", "proj", "attention")


def _ring(x, weights, rope_cos, rope_sin, *, mesh, axis_name, block_classes, proj: _Proj, attention: Dense):
  devices = mesh.shape[axis_name]
  b, t, _ = x.shape
  heads, interpret = proj.heads, proj.interpret
  plan, _, x, cos, sin = _token_shards(x, rope_cos, rope_sin, devices, block_classes)
  any_meta = proj.meta(b, heads, 1, (0,))
  # One branch per distinct source shard: its (static) class map decides the PackedKV.
  branch_of = plan.branch_index()
  sources = [branch_of.index(k) for k in range(len(plan.branches()))]

  def attend_from(device):
    tokens, classes = plan.local_tokens[device], plan.local_classes[device]

    def run(q, arrays):
      if tokens == 0:  # an empty shard: nothing to attend
        return jnp.zeros(q.shape, jnp.bfloat16), jnp.full((b, heads, q.shape[1]), -jnp.inf, jnp.float32)
      packed = fmt.PackedKV(proj.meta(b, heads, tokens, classes), _cut_local(arrays, plan, device, any_meta))
      return dense.packed_attention_lse(q, packed, attention, interpret=interpret)
    return run

  branches = [attend_from(dev) for dev in sources]

  def body(x, cos, sin, weights):
    q, arrays = _local_projection(x, cos, sin, weights, plan=plan, proj=proj, axis_name=axis_name)
    me = jax.lax.axis_index(axis_name)
    which = jnp.asarray(branch_of, jnp.int32)
    shift = [(j, (j + 1) % devices) for j in range(devices)]

    def attend(step, o_acc, lse_acc, arrays):
      src = (me - step) % devices               # whose K/V shard this device holds now
      o, lse = jax.lax.switch(which[src], branches, q, arrays)
      new = jnp.logaddexp(lse_acc, lse)         # (B, H, S); -inf while no key was seen
      safe = jnp.where(jnp.isfinite(new), new, 0.0)
      w_acc = jnp.where(jnp.isfinite(lse_acc), jnp.exp(lse_acc - safe), 0.0)
      w_new = jnp.where(jnp.isfinite(lse), jnp.exp(lse - safe), 0.0)
      to_rows = lambda w: jnp.transpose(w, (0, 2, 1))[..., None]
      return o_acc * to_rows(w_acc) + o.astype(jnp.float32) * to_rows(w_new), new

    def step(i, carry):
      o_acc, lse_acc, arrays = carry
      o_acc, lse_acc = attend(i, o_acc, lse_acc, arrays)
      arrays = {n: jax.lax.ppermute(a, axis_name, shift) for n, a in arrays.items()}
      return o_acc, lse_acc, arrays

    o_acc = jnp.zeros(q.shape, jnp.float32)
    lse_acc = jnp.full((b, heads, q.shape[1]), -jnp.inf, jnp.float32)
    o_acc, lse_acc, arrays = jax.lax.fori_loop(0, devices - 1, step, (o_acc, lse_acc, arrays))
    o_acc, _ = attend(devices - 1, o_acc, lse_acc, arrays)
    return o_acc.astype(jnp.bfloat16)

  return _shard_call(body, mesh, axis_name, P(None, axis_name), x, cos, sin, weights)[:, :t]


_ring_jit = jax.jit(_ring, static_argnames=_RING_STATIC)


def ring_attention_layer(x, weights: QKVWeights, *, mesh: Mesh, axis_name: str, layout: QKVLayout, rope_cos,
                         rope_sin, storage: KVStorage | None = None, attention: Dense | None = None, interpret=None):
  """The dense layer with ring attention over ``axis_name``: any number of devices P
  (heads need not divide). Each device projects its token shard, keeps its Q and
  passes its packed K/V shard around the ring with ``ppermute`` (P - 1 hops), attending
  each shard with ``packed_attention_lse`` (the fused kernel), whose log-sum-exp merges
  the partial outputs. Arguments and output as ``ulysses_attention_layer``, dense only:
  ``attention`` a ``Dense`` (None: ``Dense()``; its ``sm_scale``, fused tiles and
  ``scratch_bytes``, which bounds the projection's scratch), not
  ``Dense(method="streamed")``; Sol routes over the whole sequence at once and raises
  (use ``ulysses_attention_layer``)."""
  attention = as_attention(attention)
  if isinstance(attention, Sol):
    raise ValueError("ring_attention_layer is dense only (Sol routes over the whole sequence at once); "
                     "use ulysses_attention_layer for Sol(...)")
  if attention.method == "streamed":
    raise ValueError("ring_attention_layer merges shards by their log-sum-exp, which only the fused kernel "
                     "returns; use Dense(method='fused') or 'auto'")
  classes, proj = _resolve(x, weights, layout, rope_cos, rope_sin, storage, mesh, axis_name, interpret=interpret,
                           scratch_bytes=attention.scratch_bytes)
  return _ring_jit(x, weights, rope_cos, rope_sin, mesh=mesh, axis_name=axis_name, block_classes=classes, proj=proj,
                   attention=attention)


def wire_bytes(num_tokens: int, heads: int, head_dim: int, devices: int, *, batch: int = 1,
               storage: KVStorage | None = None) -> dict:
  """Bytes one layer puts on the wire, all devices together, the padding each device
  sends included, for a K/V stored as ``storage`` (None: every block int4). Ulysses:
  ours (Q bf16 + packed K/V out, O bf16 back) against BF16 Ulysses (Q, K, V bf16 out,
  O back); a device keeps 1/P of what it sends. Ring (``ring_*``): the K/V shards'
  P - 1 hops, packed against bf16."""
  storage = as_storage(storage)
  plan = ulysses_plan(num_tokens, devices, storage.classes_for(num_tokens) if num_tokens > 0 else None)
  k_scheme, v_scheme = storage.k_scheme, storage.v_scheme
  keep = (devices - 1) / devices
  s = plan.shard_tokens
  bf16_one = batch * s * heads * head_dim * 2                            # one (B, S, H, D) bf16 shard
  meta = fmt.PackedKVMeta(batch, heads, head_dim, s, (0,) * (s // BLOCK), k_scheme, v_scheme)
  packed = 0
  for n, (shape, dt) in fmt.buffer_specs(meta).items():
    packed += int(np.prod(_padded_shape(shape, n, meta, plan))) * np.dtype(dt).itemsize
  ours = {"q": bf16_one, "kv": packed, "o": bf16_one}
  base = {"q": bf16_one, "kv": 2 * bf16_one, "o": bf16_one}
  tot = lambda d: int(sum(d.values()) * devices * keep)
  # Ring: every device's K/V shard makes P - 1 hops; Q and O stay home.
  ring = {"ours": packed * devices * (devices - 1), "bf16": 2 * bf16_one * devices * (devices - 1)}
  return {"devices": devices, "ours": tot(ours), "bf16": tot(base), "kv_ours": int(packed * devices * keep),
          "kv_bf16": int(2 * bf16_one * devices * keep), "ratio": tot(ours) / tot(base),
          "kv_ratio": packed / (2 * bf16_one), "ring_ours": ring["ours"], "ring_bf16": ring["bf16"]}
