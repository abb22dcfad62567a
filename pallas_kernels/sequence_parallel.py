"""Sequence-parallel H3 attention (Ulysses) with the packed K/V on the wire.

x (B, T, hidden) is split by tokens over one axis of a ``jax.sharding.Mesh`` of P
devices. Inside one ``jax.shard_map`` program each device:

1. projects its own rows with ``streamed_qkv``: Q bf16 and a PackedKV of its tokens
   (every class, ragged tail and block stats exactly as one device would make them);
2. sends every array through one ``lax.all_to_all`` (XLA lowers it to NCCL on GPUs):
   heads split into P groups, tokens gathered. Afterwards it holds Q and the packed
   K/V of all T tokens for H/P heads. This is the step where BF16 Ulysses (xDiT/USP,
   the layer users run today) sends K and V at 2 bytes a value; the packed K/V moves
   about 5.25 bits a value (``wire_bytes``);
3. runs the single-device dense or Sol attention on its heads, unchanged;
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
ValueError says which P would work. Ring attention (K/V shards passed around with
``ppermute``) is not built: it needs the attention's log-sum-exp, which neither the
cuDNN path nor the fused kernel returns today (``benchmarks/NOTES.md``).
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from formats import packed_kv as fmt
from pallas_kernels import attention as dense
from pallas_kernels import backend
from pallas_kernels import projection as sq
from pallas_kernels import sol
from pallas_kernels.layer import ATTENTIONS, _sol_kwargs

__all__ = ["UlyssesPlan", "ulysses_attention_layer", "ulysses_plan", "ulysses_qkv", "wire_bytes"]

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


def ulysses_plan(num_tokens: int, devices: int, block_classes=None) -> UlyssesPlan:
  """The plan for T tokens on ``devices`` devices; ``block_classes`` as ``streamed_qkv``."""
  if num_tokens <= 0 or devices <= 0:
    raise ValueError(f"num_tokens and devices must be positive, got {num_tokens}, {devices}")
  nb = -(-num_tokens // BLOCK)
  classes = (0,) * nb if block_classes is None else tuple(int(c) for c in block_classes)
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
  if name.endswith(("scale4", "scale8", "zero4", "zero8")):
    scheme = meta.k_scheme if name.startswith("k") else meta.v_scheme
    return (2, 1) if scheme == "channel" else (3, BLOCK)
  if name in ("k_mean", "v_sum"):
    return 2, 1
  return 2, BLOCK                                       # codes and bf16 stores


def _class_of(name: str) -> str | None:
  if name in ("k_mean", "v_sum"):
    return None
  return {"4": "int4", "8": "int8", "6": "bf16"}[name[-1]]


def _capacity(plan: UlyssesPlan, name: str) -> int:
  """Slots of ``name`` every device sends (stats: one per block of the shard)."""
  cls = _class_of(name)
  return plan.shard_tokens // BLOCK if cls is None else plan.capacity[fmt.CLASSES.index(cls)]


def _pad_axis(a, axis, size):
  pad = [(0, 0)] * a.ndim
  pad[axis] = (0, size - a.shape[axis])
  return jnp.pad(a, pad)


def _local_projection(x, cos, sin, w_qkv, bias, q_norm_weight, k_norm_weight, *, plan, device_meta_kw, proj_kw):
  """This device's rows -> (Q (B, S, H, D), {name: padded store}), via one switch branch
  per distinct local class map."""
  b, s, _ = x.shape
  heads, head_dim = device_meta_kw["heads"], device_meta_kw["head_dim"]

  def branch(tokens, classes):
    def run(x, cos, sin):
      meta = fmt.PackedKVMeta(b, heads, head_dim, max(tokens, 1), classes or (0,), device_meta_kw["k_scheme"],
                              device_meta_kw["v_scheme"])
      if tokens == 0:  # an empty shard sends padding only
        q = jnp.zeros((b, s, heads, head_dim), jnp.bfloat16)
        arrays = {n: jnp.zeros(_padded_shape(shape, n, meta, plan), dt)
                  for n, (shape, dt) in fmt.buffer_specs(meta).items()}
        return q, arrays
      q, packed = sq.streamed_qkv(x[:, :tokens], w_qkv, bias, q_norm_weight=q_norm_weight,
                                  k_norm_weight=k_norm_weight, rope_cos=cos[:tokens], rope_sin=sin[:tokens],
                                  block_classes=classes, **proj_kw)
      q = _pad_axis(q, 1, s)
      arrays = {}
      for n, a in packed.arrays.items():
        axis, per_slot = _slot_axis(n, packed.meta)
        arrays[n] = _pad_axis(a, axis, _capacity(plan, n) * per_slot)
      return q, arrays
    return run

  branches = [branch(t, c) for t, c in plan.branches()]
  if len(branches) == 1:
    return branches[0](x, cos, sin)
  which = jnp.asarray(plan.branch_index(), jnp.int32)[jax.lax.axis_index(device_meta_kw["axis_name"])]
  return jax.lax.switch(which, branches, x, cos, sin)


def _padded_shape(shape, name, meta, plan):
  axis, per_slot = _slot_axis(name, meta)
  out = list(shape)
  out[axis] = _capacity(plan, name) * per_slot
  return tuple(out)


def _gather_tokens(arrays: dict, plan: UlyssesPlan, meta: fmt.PackedKVMeta) -> dict:
  """Received stores (P segments of padded capacity on the slot axis) -> the global
  stores: static slices of each device's real slots, in device order."""
  out = {}
  for n, a in arrays.items():
    axis, per_slot = _slot_axis(n, meta)
    cap = _capacity(plan, n) * per_slot
    cls = _class_of(n)
    parts = []
    for p in range(plan.devices):
      used = (-(-plan.local_tokens[p] // BLOCK) if cls is None else plan.slots(p, cls)) * per_slot
      if used:
        parts.append(jax.lax.slice_in_dim(a, p * cap, p * cap + used, axis=axis))
    if not parts:  # no device has a block of this class: the store is empty
      parts = [jax.lax.slice_in_dim(a, 0, 0, axis=axis)]
    out[n] = jnp.concatenate(parts, axis) if len(parts) > 1 else parts[0]
  return out


_STATIC = ("mesh", "axis_name", "rot_dim", "heads", "head_dim", "block_classes", "k_scheme", "v_scheme",
           "rotation_seed_k", "rotation_seed_v", "eps", "attention", "sm_scale", "sol_items", "scratch_bytes",
           "interpret")


def _sharded(x, w_qkv, bias, q_norm_weight, k_norm_weight, rope_cos, rope_sin, *, mesh, axis_name, rot_dim, heads,
             head_dim, block_classes, k_scheme, v_scheme, rotation_seed_k, rotation_seed_v, eps, attention,
             sm_scale, sol_items, scratch_bytes, interpret):
  """The shard_map program. attention None: stop after the exchange and return
  (Q (B, T, H, D) and the packed arrays, sharded by heads); else the layer's output
  (B, T, H, D) sharded by tokens."""
  devices = mesh.shape[axis_name]
  b, t, hidden = x.shape
  plan = ulysses_plan(t, devices, block_classes)
  rows = devices * plan.shard_tokens
  x = _pad_axis(x, 1, rows)
  cos, sin = _pad_axis(rope_cos.astype(jnp.float32), 0, rows), _pad_axis(rope_sin.astype(jnp.float32), 0, rows)
  local_meta = fmt.PackedKVMeta(b, heads // devices, head_dim, t, plan.block_classes, k_scheme, v_scheme,
                                rotation_seed_k, rotation_seed_v)
  proj_kw = dict(rot_dim=rot_dim, heads=heads, head_dim=head_dim, k_scheme=k_scheme, v_scheme=v_scheme,
                 rotation_seed_k=rotation_seed_k, rotation_seed_v=rotation_seed_v, eps=eps, interpret=interpret,
                 scratch_bytes=scratch_bytes)
  meta_kw = dict(heads=heads, head_dim=head_dim, k_scheme=k_scheme, v_scheme=v_scheme, axis_name=axis_name)
  with_bias = bias is not None

  def body(x, cos, sin, w_qkv, bias, q_norm_weight, k_norm_weight):
    q, arrays = _local_projection(x, cos, sin, w_qkv, bias if with_bias else None, q_norm_weight, k_norm_weight,
                                  plan=plan, device_meta_kw=meta_kw, proj_kw=proj_kw)
    # Tokens -> heads. Every packed array is (B, H, ...): heads split, slot axis gathered.
    a2a = functools.partial(jax.lax.all_to_all, axis_name=axis_name, tiled=True)
    q = a2a(q, split_axis=2, concat_axis=1)[:, :t]                       # (B, T, H/P, D)
    arrays = {n: a2a(a, split_axis=1, concat_axis=_slot_axis(n, local_meta)[0]) for n, a in arrays.items()}
    packed = fmt.PackedKV(local_meta, _gather_tokens(arrays, plan, local_meta))
    if attention is None:
      return q, packed.arrays
    if attention == "sol":
      o = sol.sol_attention(q, packed, sm_scale=sm_scale, overwrite_q=True, interpret=interpret, **dict(sol_items))
    else:
      o = dense.packed_attention(q, packed, sm_scale=sm_scale, overwrite_q=True, interpret=interpret,
                                 scratch_bytes=scratch_bytes)
    # Heads -> tokens.
    return a2a(_pad_axis(o, 1, rows), split_axis=1, concat_axis=2)       # (B, S, H, D)

  rep = P()
  by_heads = P(None, axis_name)                                          # packed arrays: (B, H, ...)
  out_specs = ((P(None, None, axis_name), {n: by_heads for n in fmt.ARRAY_NAMES}) if attention is None
               else P(None, axis_name))
  shard = jax.shard_map(body, mesh=mesh, check_vma=False, out_specs=out_specs,
                        in_specs=(P(None, axis_name), P(axis_name), P(axis_name), rep, rep, rep, rep))
  bias_arg = bias if with_bias else jnp.zeros((0,), jnp.bfloat16)
  out = shard(x, cos, sin, w_qkv, bias_arg, q_norm_weight, k_norm_weight)
  if attention is None:
    q, arrays = out
    meta = fmt.PackedKVMeta(b, heads, head_dim, t, plan.block_classes, k_scheme, v_scheme, rotation_seed_k,
                            rotation_seed_v)
    return q, fmt.PackedKV(meta, arrays)
  return out[:, :t]


_sharded_jit = jax.jit(_sharded, static_argnames=_STATIC)


def _checked_call(x, w_qkv, bias, *, mesh, axis_name, heads, block_classes, attention, sol_options, scratch_bytes,
                  interpret, **kw):
  if attention not in ATTENTIONS + (None,):
    raise ValueError(f"attention must be one of {ATTENTIONS}, got {attention!r}")
  if axis_name not in mesh.shape:
    raise ValueError(f"axis_name {axis_name!r} is not an axis of the mesh {dict(mesh.shape)}")
  devices = mesh.shape[axis_name]
  if not isinstance(heads, (int, np.integer)) or heads <= 0:
    raise ValueError(f"heads must be a positive int, got {heads!r}")
  if heads % devices:
    good = [p for p in range(1, heads + 1) if heads % p == 0]
    raise ValueError(f"Ulysses splits heads over the devices: heads={heads} is not divisible by "
                     f"P={devices}; use a mesh axis of size in {good}")
  if x.ndim != 3 or x.shape[0] == 0 or x.shape[1] == 0:
    raise ValueError(f"x must be (B, T, hidden) with B, T >= 1, got shape {tuple(x.shape)}")
  opts = _sol_kwargs(sol_options)
  sol_items = tuple(sorted((k, tuple(v) if isinstance(v, list) else v) for k, v in opts.items()))
  classes = None if block_classes is None else tuple(int(c) for c in block_classes)
  return _sharded_jit(x, w_qkv, bias, kw.pop("q_norm_weight"), kw.pop("k_norm_weight"), kw.pop("rope_cos"),
                      kw.pop("rope_sin"), mesh=mesh, axis_name=axis_name, heads=heads, block_classes=classes,
                      attention=attention, sol_items=sol_items, scratch_bytes=int(scratch_bytes),
                      interpret=backend.resolve_interpret(interpret), **kw)


def ulysses_attention_layer(x, w_qkv, bias=None, *, mesh: Mesh, axis_name: str, q_norm_weight, k_norm_weight,
                            rope_cos, rope_sin, rot_dim, heads, head_dim, block_classes=None,
                            k_scheme=fmt.DEFAULT_K_SCHEME, v_scheme=fmt.DEFAULT_V_SCHEME, rotation_seed_k=0,
                            rotation_seed_v=1, eps=1e-5, attention="dense", sm_scale=None, sol_options=None,
                            scratch_bytes=sq.DEFAULT_SCRATCH_BYTES, interpret=None):
  """``layer.attention_layer`` over the ``axis_name`` axis of ``mesh``, tokens sharded.

  x (B, T, hidden) bf16 (any T >= 1; the layer pads to whole blocks per device),
  rope_cos/rope_sin (T, D) f32, the rest as ``attention_layer`` (no masks: one sequence
  per batch row). Returns (B, T, H, D) bf16, un-rotated, sharded by tokens over
  ``axis_name``; equal to the single-device layer (same codes, the same attention per
  head). ``scratch_bytes`` bounds each device's projection and attention scratch.
  """
  return _checked_call(x, w_qkv, bias, mesh=mesh, axis_name=axis_name, q_norm_weight=q_norm_weight,
                       k_norm_weight=k_norm_weight, rope_cos=rope_cos, rope_sin=rope_sin, rot_dim=rot_dim,
                       heads=heads, head_dim=head_dim, block_classes=block_classes, k_scheme=k_scheme,
                       v_scheme=v_scheme, rotation_seed_k=rotation_seed_k, rotation_seed_v=rotation_seed_v,
                       eps=eps, attention=attention, sm_scale=sm_scale, sol_options=sol_options,
                       scratch_bytes=scratch_bytes, interpret=interpret)


def ulysses_qkv(x, w_qkv, bias=None, *, mesh: Mesh, axis_name: str, q_norm_weight, k_norm_weight, rope_cos,
                rope_sin, rot_dim, heads, head_dim, block_classes=None, k_scheme=fmt.DEFAULT_K_SCHEME,
                v_scheme=fmt.DEFAULT_V_SCHEME, rotation_seed_k=0, rotation_seed_v=1, eps=1e-5,
                scratch_bytes=sq.DEFAULT_SCRATCH_BYTES, interpret=None):
  """The layer's first half, for callers with their own attention: ``streamed_qkv`` on
  token shards, then the exchange. Returns (Q (B, T, H, D) bf16, PackedKV of all T
  tokens and H heads), both sharded by heads over ``axis_name``: the same values
  ``streamed_qkv`` gives on one device."""
  return _checked_call(x, w_qkv, bias, mesh=mesh, axis_name=axis_name, q_norm_weight=q_norm_weight,
                       k_norm_weight=k_norm_weight, rope_cos=rope_cos, rope_sin=rope_sin, rot_dim=rot_dim,
                       heads=heads, head_dim=head_dim, block_classes=block_classes, k_scheme=k_scheme,
                       v_scheme=v_scheme, rotation_seed_k=rotation_seed_k, rotation_seed_v=rotation_seed_v,
                       eps=eps, attention=None, sm_scale=None, sol_options=None, scratch_bytes=scratch_bytes,
                       interpret=interpret)


def wire_bytes(num_tokens: int, heads: int, head_dim: int, devices: int, *, batch: int = 1, block_classes=None,
               k_scheme=fmt.DEFAULT_K_SCHEME, v_scheme=fmt.DEFAULT_V_SCHEME) -> dict:
  """Bytes one Ulysses layer puts on the wire, all devices together, the padding each
  device sends included: ours (Q bf16 + packed K/V out, O bf16 back) against BF16
  Ulysses (Q, K, V bf16 out, O back). A device keeps 1/P of what it sends."""
  plan = ulysses_plan(num_tokens, devices, block_classes)
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
  return {"devices": devices, "ours": tot(ours), "bf16": tot(base), "kv_ours": int(packed * devices * keep),
          "kv_bf16": int(2 * bf16_one * devices * keep), "ratio": tot(ours) / tot(base),
          "kv_ratio": packed / (2 * bf16_one)}
