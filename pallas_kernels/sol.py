"""Sol attention (arXiv 2607.24027) over packed low-bit K/V: routing, jnp reference, Pallas kernel.

Sol is training-free sparse attention for video diffusion. Each 64-token query
block attends a routed subset of key blocks exactly; every other key block still
enters the same softmax as one pooled term, so the denominator always covers the
whole sequence. The semantics follow comfy-kitchen's eager ``sol_attn``
(PyPI ``comfy-kitchen``, ``backends/eager/sol_attn.py``); this is an independent
implementation of that algorithm, reading ``formats.PackedKV`` tile by tile.

Semantics implemented (all logits in log2 units, ``s = sm_scale * log2(e)``)
------------------------------------------------------------------------------
Blocks are the format's 64-token blocks; NB = ceil(T / 64) query and key blocks.

* Live rows. ``len_b`` = 64, except the ragged last block (T - 64 (NB-1)), or
  ``block_len[b]`` clamped to ``[1, rows of block b]`` when given. Row r of block b
  is live iff ``r < len_b``. Dead rows are never keys; their outputs are computed
  like any other row but are unspecified by contract (comfy's wording).
* Block stats. ``kc_b`` = mean of K over the live rows of block b and ``vc_b`` = sum
  of V over them: the projection epilogue's ``PackedKV.k_mean`` / ``v_sum``, taken
  from full-precision K/V (see deviations for ``block_len``).
* Centring. ``kg = mean_b kc_b`` (unweighted over blocks), ``kcc_b = kc_b - kg``,
  ``kvar = mean_b kcc_b**2`` (per channel). Every exact logit uses the centred key
  ``k - kg`` too: that shifts a row by a constant, but the pooled logits below are
  not shifted the same way, so centring is part of the semantics.
* Centroid. ``c_i`` = mean of Q over the live rows of query block i.
* Proxy score. ``P[i, j] = s * c_i . kcc_j`` (the pooled logit, equal to the mean
  over the query block's rows of the exact block-mean logits).
* Routing (``topk_ratio == 0``): key block j is exact for query block i iff
  ``P[i, j] > tau * sqrt(s**2 * sum_d c_id**2 kvar_d + 1e-6)``, i.e. it clears tau
  sigmas of the proxy row. Lower tau routes more blocks; tau -> -inf is dense.
* Routing (``0 < topk_ratio < 1``, tau ignored): with the sink key blocks excluded,
  ``kk = clamp(round(topk_ratio * n), 1, n - 1)`` (0 when n <= 1; n = NB minus the
  sink blocks, Python's round) and block j is exact iff ``P[i, j]`` is >= the kk-th
  largest non-sink score of the row.
* Always exact: the diagonal ``|i - j| <= 1``, the key blocks in
  ``sink_blocks = [start, end)`` for every query, and every key block for the
  query blocks in ``sink_q = [start, end)`` (those rows are dense attention).
* Exact branch: logit ``s * q_t . (k_u - kg)`` for every live key u of an exact
  block, plus ``key_bias[u] * log2(e)`` (natural-log bias; bool masks map to 0 /
  -inf; exact branch only: comfy documents that biased blocks must be sink-covered).
* Pooled branch (``tail=True``): every non-exact block j adds one term with logit
  ``P[i, j]`` (shared by all rows of query block i), value ``vc_j`` and
  denominator weight ``len_j``. ``tail=False`` drops it (softmax over routed blocks
  only).
* One softmax: ``o_t = (sum_exact p v + sum_pooled p vc) / (sum_exact p +
  sum_pooled p len)``. A row with nothing to attend (possible with key_bias -inf
  and tail=False) outputs exactly 0.
* Output is un-rotated by ``R_v^T`` unless ``keep_rotated``.

Deviations from the eager reference, and why
---------------------------------------------
* None in routing's basis. The format stores Q/K rotated by the Hadamard ``R_k``
  and V by ``R_v``. The dot products are rotation invariant but the per-channel
  ``kvar`` and ``c_id**2`` of the tau threshold are not, so the threshold's variance
  term is computed in the caller's basis: ``kcc`` and ``c`` are un-rotated by
  ``R_k^T`` first (NB x D x D flops, nothing next to attention). Tau then selects
  what comfy's ``sol_attn(q, k, v)`` selects on the model's own tensors; routing in
  the rotated basis lost 0.012 cos at tau = 1 on DiT-like data
  (``benchmarks/sol_quality.py``, ``benchmarks/NOTES.md``).
* Stats come from the epilogue's full-precision K/V while the exact branch reads
  the quantized tiles (comfy derives both from one tensor). The pooled term is
  therefore more accurate than a block mean of dequantized K would be.
* ``block_len``: the epilogue cannot know the caller's live rows, so its stats
  cover every row below T. With ``block_len`` the key mean is rescaled by
  ``rows / len`` and the V sum is used as is; this equals comfy's masked pool
  exactly when dead rows of K and V are zero, which is what ``block_len`` is for
  (zero-padded tiles: a zero input row projects to zero K after RMSNorm, RoPE and
  rotation, and to zero V without a bias). Non-zero dead rows would leak into
  the pooled stats.
* Bounded routing metadata. The exact set is stored as one sorted list of key
  blocks per query block, ``(B, H, NB, max_exact)``, holding the routed and
  diagonal blocks (the sink range and ``sink_q`` rows need no list). If more than
  ``max_exact`` blocks are routed for one query block, the diagonal and then the
  highest proxy scores are kept and the rest fall back to pooled terms (exact ties
  at the cut keep the lowest block indices); ``SolRouting.dropped`` counts them,
  and ``sol_attention_reference(max_exact=...)`` models the same cut. Under top-k
  the default capacity is kk + 3, so only exact ties can overflow (comfy keeps
  every tie). Under tau the default capacity is ``DEFAULT_MAX_EXACT_TAU``
  blocks. Capacity never depends on T**2, so neither does the metadata.
* Parameter names follow comfy (tau, sink_blocks, sink_q, topk_ratio, tail,
  block_len, key_bias) except ``sm_scale`` (comfy's ``scale``), which matches
  ``packed_attention``. Not implemented: ``coarse_gate`` and ``token_aug`` (comfy's
  own eager path ignores token_aug), segment ids and Tq != Tkv (Sol's diagonal
  assumes self-attention).

Kernel layout
-------------
``sol_routing`` (plain jnp) computes centroids and the proxy scores in chunks of
query blocks, so only ``B * H * chunk * NB`` scores exist at a time (the full
NB x NB matrix at T = 152k and 56 heads would be 1.3 GB in f32), and writes the
sorted lists. ``sol_attention`` then runs one Pallas kernel (Triton on a GPU,
interpret mode elsewhere) on grid ``(query blocks, H, B)``:

* Q tile (64 x D) in two channel halves (Triton cannot slice loaded values; the
  int4 byte holds channel j and j + D/2), kept in bf16.
* Exact loop: the sink range, then the list (a ``sink_q`` block walks all blocks).
  With one class the store holds every block in order, so the list entry is the
  only dependent scalar load per block; with several, an int32 table gives
  ``slot * 4 + class branch`` and a ``lax.switch`` picks the store. Live rows come
  from T arithmetically, or from a ``block_len`` table. Tiles are dequantized in
  registers as in ``packed_attention`` (codes enter the bf16 dots through the
  0x4300 bit trick), with ``kg`` folded into the K zero point so the centred key
  enters the dot. Dead key rows get -inf logits and zero V scales (NaN-safe).
* Pooled loop: 64 key blocks per step from ``k_mean`` / ``v_sum``; membership in
  the exact set comes from the sorted list (a 64 x 64 compare against a window that
  advances with a pointer) and the sink range. The pooled value dot runs on a
  two-term bf16 split of ``v_sum``.
* One online softmax (base 2, m starts at a finite -1e30, masked logits -inf), then
  ``R_v^T`` as in the dense kernel.
"""
from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from formats import packed_kv as fmt
from pallas_kernels import sol_decoded
from pallas_kernels.kv_dequant import dequantize_group
from pallas_kernels.backend import dot as _dot
from pallas_kernels.backend import (INT4_OFFSET, LOG2E, M_INIT, NamedInputs, int4_halves, int8_to_bf16, resolve_interpret,
                                    resolve_sm_scale, split_bf16, unrotate_halves)

BLOCK = fmt.BLOCK
# Routed-list capacity under tau when the caller gives none: 1024 blocks = 64k
# exact keys per query block. Fixed, so the metadata grows with T, not T**2.
DEFAULT_MAX_EXACT_TAU = 1024
# Budget for one chunk of the (B, H, chunk, NB) proxy-score matrix in routing.
DEFAULT_ROUTE_CHUNK_BYTES = 32 << 20
# fused: the kernel below decodes packed tiles in its loop. streamed / streamed_int8:
# head groups decoded first, then sol_decoded's kernel (bf16 / int8 Q.K dots).
METHODS = ("fused", "streamed", "streamed_int8")
STREAMED_QK = {"streamed": "bf16", "streamed_int8": "int8"}
# The streamed method's bound on one head group's bf16 K/V stores, q slice and output.
DEFAULT_SCRATCH_BYTES = 512 << 20


# --------------------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------------------
def topk_count(n: int, ratio: float) -> int:
  """Key blocks kept per query block under top-k: round(ratio * n) clamped to
  [1, n - 1], 0 when n <= 1 (nothing beyond the forced blocks)."""
  return max(0, min(n - 1, max(1, round(ratio * n))))


def _sink_pair(value, name: str) -> tuple[int, int]:
  if value is None:
    return 0, 0
  value = list(value)
  if len(value) != 2:
    raise ValueError(f"{name} must have 2 elements [start, end), got {len(value)}")
  start, end = (int(x) for x in value)
  if start < 0 or end < 0:
    raise ValueError(f"{name} entries must be non-negative, got {value}")
  if end < start:
    raise ValueError(f"{name} must be [start, end) with end >= start, got {value}")
  return start, end


@dataclasses.dataclass(frozen=True)
class _Plan:
  """Static description of one Sol call (hashable: jit static argument)."""
  num_tokens: int
  num_blocks: int
  sm_scale: float
  tau: float
  topk_ratio: float
  topk_kk: int
  sink_blocks: tuple   # clipped to [0, NB]
  sink_q: tuple        # clipped to [0, NB]
  tail: bool
  max_exact: int

  @property
  def log2_scale(self) -> float:
    return self.sm_scale * LOG2E


def _plan(q, packed, *, tau, sm_scale, sink_blocks, sink_q, topk_ratio, tail, max_exact) -> _Plan:
  """Validate everything static and resolve the defaults."""
  meta = fmt.check_query(q, packed)
  sm_scale = resolve_sm_scale(sm_scale, meta.head_dim)
  if q.shape[1] != meta.num_tokens:
    raise ValueError(f"Sol attention is self-attention: q has {q.shape[1]} tokens, packed K/V "
                     f"{meta.num_tokens}")
  tau = float(tau)
  if math.isnan(tau):
    raise ValueError("tau must not be NaN")
  topk_ratio = float(topk_ratio or 0.0)
  if topk_ratio and not 0.0 < topk_ratio < 1.0:
    raise ValueError(f"topk_ratio must be 0 or in (0, 1), got {topk_ratio}")
  nb = meta.num_blocks
  s0, s1 = _sink_pair(sink_blocks, "sink_blocks")
  q0, q1 = _sink_pair(sink_q, "sink_q")
  sinks = (min(s0, nb), min(s1, nb))
  sq = (min(q0, nb), min(q1, nb))
  kk = topk_count(nb - (sinks[1] - sinks[0]), topk_ratio) if topk_ratio else 0
  if max_exact is None:
    max_exact = kk + 3 if topk_ratio else DEFAULT_MAX_EXACT_TAU
  max_exact = int(max_exact)
  if max_exact < 3:
    raise ValueError(f"max_exact must be >= 3 (the diagonal +-1 is always exact), got {max_exact}")
  return _Plan(num_tokens=meta.num_tokens, num_blocks=nb, sm_scale=sm_scale, tau=tau,
               topk_ratio=topk_ratio, topk_kk=kk, sink_blocks=sinks, sink_q=sq, tail=bool(tail),
               max_exact=min(max_exact, nb))


def block_lengths(num_tokens: int, block_len=None) -> jax.Array:
  """(NB,) int32 live rows per block: 64 but a ragged last block, or the caller's
  ``block_len`` clamped to [1, rows of the block]."""
  nb = -(-num_tokens // BLOCK)
  rows = np.minimum(num_tokens - np.arange(nb) * BLOCK, BLOCK).astype(np.int32)
  if block_len is None:
    return jnp.asarray(rows)
  # Check the caller's dtype before jnp.asarray, which would quietly narrow int64.
  dtype, shape = np.dtype(getattr(block_len, "dtype", None)), tuple(np.shape(block_len))
  if dtype != np.int32 or shape != (nb,):
    raise ValueError(f"block_len must be int32 of shape ({nb},), got {dtype}{list(shape)}")
  return jnp.clip(jnp.asarray(block_len), 1, jnp.asarray(rows))


def normalize_key_bias(key_bias, batch: int, num_tokens: int) -> jax.Array:
  """(T,), (B, T) or (B|1, 1, 1, T), bool or float -> (B, T) float32 natural-log bias.

  Head- or query-varying masks cannot be expressed by Sol's exact branch.
  """
  kb = jnp.asarray(key_bias)
  if kb.ndim == 4:
    if kb.shape[1] != 1 or kb.shape[2] != 1:
      raise ValueError(f"key_bias must be key-only; a mask varying over heads or queries "
                       f"{tuple(kb.shape)} cannot be expressed by Sol attention")
    kb = kb[:, 0, 0, :]
  if kb.ndim == 1:
    kb = kb[None]
  if kb.ndim != 2 or kb.shape[-1] != num_tokens or kb.shape[0] not in (1, batch):
    raise ValueError(f"key_bias must be (T,), (B, T) or (B, 1, 1, T), got {tuple(jnp.shape(key_bias))} "
                     f"for T={num_tokens}, B={batch}")
  if kb.dtype == jnp.bool_:
    kb = jnp.where(kb, 0.0, -jnp.inf)
  elif not jnp.issubdtype(kb.dtype, jnp.floating):
    raise ValueError(f"key_bias must be bool or floating, got {kb.dtype}")
  return jnp.broadcast_to(kb.astype(jnp.float32), (batch, num_tokens))


def _unrotation(meta) -> jax.Array:
  """R_k^T (D, D) f32: takes rotated Q/K rows back to the caller's basis."""
  return jnp.asarray(fmt.hadamard_rotation(meta.head_dim, meta.rotation_seed_k).T, jnp.float32)


def _pooled_keys(packed, lengths, unrotation):
  """(k_mean over live rows, kg, kvar): (B,H,NB,D) (the stored bf16, or f32 when
  rescaled by ``lengths``), (B,H,D), (B,H,D) f32; kvar per
  channel of the caller's basis (``unrotation`` = ``_unrotation(meta)``)."""
  meta = packed.meta
  rows = np.minimum(meta.num_tokens - np.arange(meta.num_blocks) * BLOCK, BLOCK).astype(np.float32)
  km = packed.k_mean  # stored bf16; the kernel reads it as is, the sums below in f32
  if lengths is not None:
    km = km.astype(jnp.float32) * (jnp.asarray(rows) / lengths.astype(jnp.float32))[None, None, :, None]
  km32 = km.astype(jnp.float32)
  kg = km32.mean(axis=2)
  kcc_caller = jnp.einsum("bhnd,de->bhne", km32 - kg[:, :, None], unrotation, precision=lax.Precision.HIGHEST)
  kvar = jnp.square(kcc_caller).mean(axis=2)
  return km, kg, kvar


def _centroids(q, lengths) -> jax.Array:
  """(B, H, NB, D) f32 mean of Q over the live rows of each block.

  Full blocks reduce straight from q (no padded copy of Q), the ragged tail apart.
  """
  b, t, h, d = q.shape
  nb = -(-t // BLOCK)
  full = t // BLOCK
  r = jnp.arange(BLOCK)
  parts = []
  if full:
    x = q[:, :full * BLOCK].reshape(b, full, BLOCK, h, d).astype(jnp.float32)
    live = (r[None, :] < lengths[:full, None])[None, :, :, None, None]
    parts.append(jnp.where(live, x, 0.0).sum(axis=2))
  if full < nb:
    x = q[:, full * BLOCK:].astype(jnp.float32)
    live = (r[: t - full * BLOCK] < lengths[full])[None, :, None, None]
    parts.append(jnp.where(live, x, 0.0).sum(axis=1, keepdims=True))
  sums = jnp.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]
  cen = sums / lengths.astype(jnp.float32)[None, :, None, None]
  return cen.transpose(0, 2, 1, 3)


# --------------------------------------------------------------------------------------
# Routing
# --------------------------------------------------------------------------------------
def _route_rows(cen, kcc, kvar, qb, plan: _Plan, unrotation):
  """Routed key blocks of the query blocks ``qb``.

  cen (B, H, C, D) centroids of query blocks ``qb`` (C,), kcc (B, H, NB, D) centred
  block means, both rotated; kvar (B, H, D) in the caller's basis, where
  ``unrotation`` (D, D) takes the centroids for the threshold. Returns (routed
  (B, H, C, NB) bool, scores, wanted (B, H, C) int32): routed holds the diagonal and the routed blocks minus the sink
  range, after the ``max_exact`` cut; ``sink_q`` rows route nothing (they are dense);
  ``wanted`` counts the blocks before the cut.
  """
  nb = plan.num_blocks
  s = plan.log2_scale
  score = jnp.einsum("bhcd,bhnd->bhcn", cen, kcc, precision=lax.Precision.HIGHEST) * s
  j = jnp.arange(nb, dtype=jnp.int32)
  s0, s1 = plan.sink_blocks
  sink = (j >= s0) & (j < s1)
  if plan.topk_ratio:
    if plan.topk_kk:
      ranked = jnp.where(sink, -jnp.inf, score)
      kth = lax.top_k(ranked, plan.topk_kk)[0][..., -1:]
      routed = ranked >= kth
    else:
      routed = jnp.zeros(score.shape, bool)
  else:
    cen_caller = jnp.einsum("bhcd,de->bhce", cen, unrotation, precision=lax.Precision.HIGHEST)
    var = jnp.sum(jnp.square(cen_caller) * kvar[:, :, None, :], axis=-1)
    thr = plan.tau * jnp.sqrt(var * (s * s) + 1e-6)
    routed = score > thr[..., None]
  diag = jnp.abs(j[None, :] - qb[:, None]) <= 1
  q0, q1 = plan.sink_q
  dense_row = (qb >= q0) & (qb < q1)
  routed = (routed | diag[None, None]) & ~sink & ~dense_row[None, None, :, None]
  wanted = routed.sum(-1, dtype=jnp.int32)
  cap = plan.max_exact
  if cap < nb:
    key = jnp.where(routed, jnp.where(diag[None, None], jnp.inf, score), -jnp.inf)

    def cut(routed):
      kth = lax.top_k(key, cap)[0][..., -1:]
      return routed & (key >= kth)
    # top_k is the costly part of routing; most chunks never overflow.
    routed = lax.cond(jnp.any(wanted > cap), cut, lambda r: r, routed)
    routed = routed & (jnp.cumsum(routed, axis=-1, dtype=jnp.int32) <= cap)
  return routed, score, wanted


@jax.tree_util.register_pytree_node_class
@dataclasses.dataclass(frozen=True)
class SolRouting:
  """Per-query-block routing of one Sol call.

  blocks: (B, H, NB, max_exact) int16 (int32 past 32767 blocks): the routed and
    diagonal key blocks of each query block, ascending, minus the sink range;
    entries past ``counts`` are -1.
  counts: (B, H, NB) int32 live entries of ``blocks`` (0 on sink_q rows).
  dropped: (B, H, NB) int32 routed blocks beyond ``max_exact``, pooled instead.
  centroid: (B, H, NB, D) f32 query-block centroids; k_global: (B, H, D) f32 kg.
  k_mean: (B, H, NB, D) block K means over the live rows: ``PackedKV.k_mean`` itself
    (bf16, format v2) unless ``block_len`` rescaled it (then a new f32 array).
  """
  blocks: jax.Array
  counts: jax.Array
  dropped: jax.Array
  centroid: jax.Array
  k_global: jax.Array
  k_mean: jax.Array
  k_mean_is_new: bool = False

  def tree_flatten(self):
    return (self.blocks, self.counts, self.dropped, self.centroid, self.k_global, self.k_mean), \
        self.k_mean_is_new

  @classmethod
  def tree_unflatten(cls, aux, leaves):
    return cls(*leaves, k_mean_is_new=aux)

  def nbytes(self) -> int:
    """Bytes of routing metadata this call allocates (k_mean only if it is new)."""
    arrays = [self.blocks, self.counts, self.dropped, self.centroid, self.k_global]
    if self.k_mean_is_new:
      arrays.append(self.k_mean)
    return sum(int(np.prod(a.shape)) * jnp.dtype(a.dtype).itemsize for a in arrays)


def routing_nbytes(batch: int, heads: int, num_tokens: int, head_dim: int, max_exact: int,
                   block_len: bool = False) -> dict:
  """Routing metadata bytes of one call, without running it (for reports)."""
  nb = -(-num_tokens // BLOCK)
  cap = min(max_exact, nb)
  idx = 2 if nb <= 32767 else 4
  out = {"blocks": batch * heads * nb * cap * idx, "counts": batch * heads * nb * 4,
         "dropped": batch * heads * nb * 4, "centroid": batch * heads * nb * head_dim * 4,
         "k_global": batch * heads * head_dim * 4,
         "k_mean_rescaled": batch * heads * nb * head_dim * 4 if block_len else 0}
  out["total"] = sum(out.values())
  return out


def _route_chunk_blocks(plan: _Plan, batch: int, heads: int, chunk_bytes: int) -> int:
  return int(max(1, min(plan.num_blocks, chunk_bytes // (batch * heads * plan.num_blocks * 4))))


def _routing_impl(q, packed, block_len, plan: _Plan, chunk_bytes: int) -> SolRouting:
  meta = packed.meta
  b, h, nb = meta.batch, meta.heads, meta.num_blocks
  lengths = block_lengths(meta.num_tokens, block_len)
  unrotation = _unrotation(meta)
  km, kg, kvar = _pooled_keys(packed, lengths if block_len is not None else None, unrotation)
  kcc = km - kg[:, :, None]
  cen = _centroids(q, lengths)
  cap = plan.max_exact
  idx_dtype = jnp.int16 if nb <= 32767 else jnp.int32
  c = _route_chunk_blocks(plan, b, h, chunk_bytes)
  nc = -(-nb // c)
  cen_p = jnp.pad(cen, ((0, 0), (0, 0), (0, nc * c - nb), (0, 0)))
  cen_p = cen_p.reshape(b, h, nc, c, -1).transpose(2, 0, 1, 3, 4)
  qb = jnp.arange(nc * c, dtype=jnp.int32).reshape(nc, c)
  j = jnp.arange(nb, dtype=idx_dtype)

  def chunk(args):
    cen_c, qb_c = args
    routed, _, wanted = _route_rows(cen_c, kcc, kvar, qb_c, plan, unrotation)
    # Unrouted blocks get distinct out-of-range slots, so every index is unique and
    # the scatter is plain stores (no collision handling) that drop the unrouted.
    pos = jnp.where(routed, jnp.cumsum(routed, axis=-1, dtype=jnp.int32) - 1, cap + j.astype(jnp.int32))
    fill = jnp.full((cap,), -1, idx_dtype)
    scatter = lambda p: fill.at[p].set(j, mode="drop", unique_indices=True)
    lists = jax.vmap(scatter)(pos.reshape(-1, nb)).reshape(b, h, c, cap)
    counts = routed.sum(-1, dtype=jnp.int32)
    return lists, counts, wanted - counts

  lists, counts, dropped = lax.map(chunk, (cen_p, qb))
  unchunk = lambda x: jnp.moveaxis(x, 0, 2).reshape(b, h, nc * c, *x.shape[4:])[:, :, :nb]
  return SolRouting(blocks=unchunk(lists), counts=unchunk(counts), dropped=unchunk(dropped), centroid=cen,
                    k_global=kg, k_mean=km, k_mean_is_new=block_len is not None)


@functools.partial(jax.jit, static_argnames=("plan", "chunk_bytes"))
def _routing_jit(q, packed, block_len, *, plan, chunk_bytes):
  return _routing_impl(q, packed, block_len, plan, chunk_bytes)


def sol_routing(q, packed, *, tau=1.0, sm_scale=None, sink_blocks=None, sink_q=None, topk_ratio=0.0,
                block_len=None, max_exact=None, route_chunk_bytes=DEFAULT_ROUTE_CHUNK_BYTES) -> SolRouting:
  """Routing only (same arguments as ``sol_attention``); pass the result back as
  ``sol_attention(..., routing=r)`` to time or inspect the two stages apart."""
  plan = _plan(q, packed, tau=tau, sm_scale=sm_scale, sink_blocks=sink_blocks, sink_q=sink_q,
               topk_ratio=topk_ratio, tail=True, max_exact=max_exact)
  if block_len is not None:
    block_lengths(plan.num_tokens, block_len)  # validates
  return _routing_jit(q, packed, block_len, plan=plan, chunk_bytes=int(route_chunk_bytes))


# --------------------------------------------------------------------------------------
# Reference
# --------------------------------------------------------------------------------------
def sol_attention_reference(q, packed, *, tau=1.0, sm_scale=None, sink_blocks=None, sink_q=None, key_bias=None,
                            topk_ratio=0.0, tail=True, block_len=None, max_exact=None, keep_rotated=False,
                            return_exact=False, **_unused):
  """Float32 jnp reference of ``sol_attention`` (same arguments, f32 output).

  Dense O(T**2) scores over ``formats.dequantize_reference`` K/V: tests only.
  ``max_exact=None`` here means no cap (the algorithm as published); pass the
  kernel's capacity to model its cut. ``return_exact`` also returns the
  (B, H, NB, NB) bool exact-block matrix.
  """
  if max_exact is None:
    max_exact = max(packed.meta.num_blocks, 3)
  plan = _plan(q, packed, tau=tau, sm_scale=sm_scale, sink_blocks=sink_blocks, sink_q=sink_q,
               topk_ratio=topk_ratio, tail=tail, max_exact=max_exact)
  if block_len is not None:
    block_lengths(plan.num_tokens, block_len)
  if key_bias is not None:
    key_bias = normalize_key_bias(key_bias, q.shape[0], q.shape[1])
  o, exact = _reference_jit(q, packed, key_bias, block_len, plan=plan, keep_rotated=bool(keep_rotated))
  return (o, exact) if return_exact else o


@functools.partial(jax.jit, static_argnames=("plan", "keep_rotated"))
def _reference_jit(q, packed, key_bias, block_len, *, plan, keep_rotated):
  meta = packed.meta
  b, t, h, d = q.shape
  nb = plan.num_blocks
  lengths = block_lengths(t, block_len)
  unrotation = _unrotation(meta)
  km, kg, kvar = _pooled_keys(packed, lengths if block_len is not None else None, unrotation)
  kcc = km - kg[:, :, None]
  cen = _centroids(q, lengths)
  j = jnp.arange(nb)
  routed, proxy, _ = _route_rows(cen, kcc, kvar, j.astype(jnp.int32), plan, unrotation)
  s0, s1 = plan.sink_blocks
  q0, q1 = plan.sink_q
  exact = routed | ((j >= s0) & (j < s1))[None, None, None, :] | ((j >= q0) & (j < q1))[None, None, :, None]

  k, v = fmt.dequantize_reference(packed)
  pos = jnp.arange(t)
  blk = pos // BLOCK
  live = (pos % BLOCK) < lengths[blk]
  ls = plan.log2_scale
  s_tok = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k - kg[:, None],
                     precision=lax.Precision.HIGHEST) * ls
  if key_bias is not None:
    s_tok = s_tok + (key_bias * LOG2E)[:, None, None, :]
  ex_tok = exact[:, :, blk][..., blk]                                # (B, H, T, T)
  s_tok = jnp.where(ex_tok & live[None, None, None, :], s_tok, -jnp.inf)
  s_blk = jnp.where(exact[:, :, blk], -jnp.inf, proxy[:, :, blk])    # (B, H, T, NB)
  if not plan.tail:
    s_blk = jnp.full_like(s_blk, -jnp.inf)
  m = jnp.maximum(s_tok.max(-1), s_blk.max(-1))[..., None]
  m = jnp.where(jnp.isfinite(m), m, 0.0)
  p_tok = jnp.exp2(s_tok - m)
  p_blk = jnp.exp2(s_blk - m)
  v_live = jnp.where(live[None, :, None, None], v, 0.0)
  num = (jnp.einsum("bhqk,bkhd->bhqd", p_tok, v_live, precision=lax.Precision.HIGHEST)
         + jnp.einsum("bhqn,bhnd->bhqd", p_blk, packed.v_sum.astype(jnp.float32), precision=lax.Precision.HIGHEST))
  den = p_tok.sum(-1) + (p_blk * lengths.astype(jnp.float32)).sum(-1)
  o = (num / jnp.where(den > 0, den, 1.0)[..., None]).transpose(0, 2, 1, 3)
  if not keep_rotated:
    r_v = jnp.asarray(fmt.hadamard_rotation(d, meta.rotation_seed_v))
    o = jnp.einsum("bqhd,ed->bqhe", o, r_v, precision=lax.Precision.HIGHEST)
  return o, exact


# --------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class _KConfig:
  """Everything static the kernel body needs."""
  head_dim: int
  num_tokens: int
  num_blocks: int
  qk_scale: float          # sm_scale * log2(e)
  k_scheme: str
  v_scheme: str
  branches: tuple          # class names present, in table branch order
  sink_blocks: tuple
  sink_q: tuple
  tail: bool
  has_key_bias: bool
  has_block_len: bool
  keep_rotated: bool


def _kernel(*refs, names, cfg: _KConfig):
  r = dict(zip(names, refs))
  o_ref = r["out"]
  d = cfg.head_dim
  half = d // 2
  lo, hi = pl.ds(0, half), pl.ds(half, half)
  qb = pl.program_id(0)
  ar = jnp.arange(BLOCK, dtype=jnp.int32)
  q_rows = qb * BLOCK + ar
  row_mask = jnp.broadcast_to((q_rows < cfg.num_tokens)[:, None], (BLOCK, half))
  q_tile = pl.ds(qb * BLOCK, BLOCK)
  q_lo = plgpu.load(r["q"].at[q_tile, lo], mask=row_mask, other=0.0)
  q_hi = plgpu.load(r["q"].at[q_tile, hi], mask=row_mask, other=0.0)
  kg_lo, kg_hi = r["kg"][lo], r["kg"][hi]
  qks = cfg.qk_scale
  q_kg = None
  if cfg.k_scheme == "token":
    # Token scales apply outside the dot, so the centring term is a row constant.
    q_sum = q_lo.astype(jnp.float32).sum(-1) + q_hi.astype(jnp.float32).sum(-1)
    q_kg = ((q_lo.astype(jnp.float32) * kg_lo[None, :]).sum(-1)
            + (q_hi.astype(jnp.float32) * kg_hi[None, :]).sum(-1)) * qks

  def codes(cls, role, rows):
    """(lo, hi) bf16 code operands of one tile, equal to code + offset; and offset."""
    if cls == "int4":
      return (*int4_halves(r[f"{role}_codes4"][rows, :]), INT4_OFFSET)
    return int8_to_bf16(r[f"{role}_codes8"][rows, lo]), int8_to_bf16(r[f"{role}_codes8"][rows, hi]), 0.0

  def logits(cls, slot, rows):
    """(64, 64) centred logits, log2 units, of one exact tile (before masking)."""
    if cls == "bf16":
      k_lo = (r["k_bf16"][rows, lo].astype(jnp.float32) - kg_lo[None, :]).astype(jnp.bfloat16)
      k_hi = (r["k_bf16"][rows, hi].astype(jnp.float32) - kg_hi[None, :]).astype(jnp.bfloat16)
      return (_dot(q_lo, k_lo, trans_b=True) + _dot(q_hi, k_hi, trans_b=True)) * qks
    c_lo, c_hi, off = codes(cls, "k", rows)
    sfx = "4" if cls == "int4" else "8"
    if cfg.k_scheme == "channel":
      sc_ref, z_ref = r["k_scale" + sfx], r["k_zero" + sfx]

      def deq(c, chans, kg):
        scale = sc_ref[slot, chans].astype(jnp.float32) * qks
        zero = (z_ref[slot, chans].astype(jnp.float32) - kg) * qks - off * scale
        return (c.astype(jnp.float32) * scale[None, :] + zero[None, :]).astype(jnp.bfloat16)
      return _dot(q_lo, deq(c_lo, lo, kg_lo), trans_b=True) + _dot(q_hi, deq(c_hi, hi, kg_hi), trans_b=True)
    raw = _dot(q_lo, c_lo, trans_b=True) + _dot(q_hi, c_hi, trans_b=True)
    scale = r["k_scale" + sfx + "_g0"][rows].astype(jnp.float32) * qks
    zero = r["k_zero" + sfx + "_g0"][rows].astype(jnp.float32) * qks - off * scale
    return raw * scale[None, :] + q_sum[:, None] * zero[None, :] - q_kg[:, None]

  def pv(cls, p, rows, live):
    """(lo, hi) halves of p @ V of one tile; dead rows read as zero (NaN-safe)."""
    if cls == "bf16":
      pb = p.astype(jnp.bfloat16)
      vm = jnp.broadcast_to(live[:, None], (BLOCK, half))
      v_lo = plgpu.load(r["v_bf16"].at[rows, lo], mask=vm, other=0.0)
      v_hi = plgpu.load(r["v_bf16"].at[rows, hi], mask=vm, other=0.0)
      return _dot(pb, v_lo), _dot(pb, v_hi)
    c_lo, c_hi, off = codes(cls, "v", rows)
    sfx = "4" if cls == "int4" else "8"

    def group(g):
      scale = plgpu.load(r[f"v_scale{sfx}_g{g}"].at[rows], mask=live, other=0.0).astype(jnp.float32)
      zero = plgpu.load(r[f"v_zero{sfx}_g{g}"].at[rows], mask=live, other=0.0).astype(jnp.float32)
      ps = (p * scale[None, :]).astype(jnp.bfloat16)
      corr = (p * zero[None, :]).sum(-1) - off * ps.astype(jnp.float32).sum(-1)
      return ps, corr[:, None]

    if cfg.v_scheme == "token":
      ps, corr = group(0)
      return _dot(ps, c_lo) + corr, _dot(ps, c_hi) + corr
    ps_lo, corr_lo = group(0)
    ps_hi, corr_hi = group(1)
    return _dot(ps_lo, c_lo) + corr_lo, _dot(ps_hi, c_hi) + corr_hi

  def live_rows(blk):
    """Live rows of key block ``blk``: arithmetic unless the caller gave block_len,
    so the exact loop's only dependent scalar load is the list entry itself."""
    if cfg.has_block_len:
      return r["lens"][blk]
    return jnp.minimum(cfg.num_tokens - blk * BLOCK, BLOCK)

  def exact_tile(cls, slot, blk, carry):
    m, l, o_lo, o_hi = carry
    rows = pl.ds(slot * BLOCK, BLOCK)
    live = ar < live_rows(blk)
    sc = logits(cls, slot, rows)
    if cfg.has_key_bias:
      keys = blk * BLOCK + ar
      sc = sc + plgpu.load(r["kb"].at[pl.ds(blk * BLOCK, BLOCK)], mask=keys < cfg.num_tokens, other=0.0)[None, :]
    sc = jnp.where(jnp.broadcast_to(live[None, :], (BLOCK, BLOCK)), sc, -jnp.inf)
    m_new = jnp.maximum(m, sc.max(axis=-1))
    alpha = jnp.exp2(m - m_new)
    p = jnp.exp2(sc - m_new[:, None])
    l = l * alpha + p.sum(axis=-1)
    pv_lo, pv_hi = pv(cls, p, rows, live)
    return m_new, l, o_lo * alpha[:, None] + pv_lo, o_hi * alpha[:, None] + pv_hi

  def exact_block(blk, carry):
    if len(cfg.branches) == 1:  # one class: its store holds every block in order
      return exact_tile(cfg.branches[0], blk, blk, carry)
    code = r["table"][blk]
    slot = code >> 2
    fns = [functools.partial(exact_tile, cls) for cls in cfg.branches]
    return lax.switch(code & 3, fns, slot, blk, carry)

  carry = (jnp.full((BLOCK,), M_INIT, jnp.float32), jnp.zeros((BLOCK,), jnp.float32),
           jnp.zeros((BLOCK, half), jnp.float32), jnp.zeros((BLOCK, half), jnp.float32))
  nb = cfg.num_blocks
  s0, s1 = cfg.sink_blocks
  q0, q1 = cfg.sink_q
  # A sink_q block walks every key block; any other the sink range then its list.
  # Bounds stay Python ints when no sink_q is given, so the loops are static.
  count = r["counts"][qb]
  n_tiles = pl.cdiv(nb, BLOCK)
  if q1 > q0:
    dense_row = (qb >= q0) & (qb < q1)
    first = jnp.where(dense_row, jnp.int32(0), jnp.int32(s0))
    last = jnp.where(dense_row, jnp.int32(nb), jnp.int32(s1))
    carry = lax.fori_loop(first, last, exact_block, carry)
    count = jnp.where(dense_row, jnp.int32(0), count)
    n_tiles = jnp.where(dense_row, jnp.int32(0), jnp.int32(n_tiles))
  elif s1 > s0:
    carry = lax.fori_loop(s0, s1, exact_block, carry)
  blocks_ref = r["blocks"]
  carry = lax.fori_loop(0, count, lambda e, c: exact_block(blocks_ref[qb, e].astype(jnp.int32), c), carry)

  if cfg.tail:
    cen_lo, cen_hi = r["cen"][qb, lo], r["cen"][qb, hi]
    c_kg = (cen_lo * kg_lo).sum() + (cen_hi * kg_hi).sum()

    def pooled(t, state):
      carry, ptr = state
      m, l, o_lo, o_hi = carry
      bids = t * BLOCK + ar
      in_range = bids < nb
      tiles = pl.ds(t * BLOCK, BLOCK)
      tmask = jnp.broadcast_to(in_range[:, None], (BLOCK, half))
      km_lo = plgpu.load(r["km"].at[tiles, lo], mask=tmask, other=0.0).astype(jnp.float32)
      km_hi = plgpu.load(r["km"].at[tiles, hi], mask=tmask, other=0.0).astype(jnp.float32)
      s = ((km_lo * cen_lo[None, :]).sum(-1) + (km_hi * cen_hi[None, :]).sum(-1) - c_kg) * qks
      # Exact membership: the list is ascending, so the entries of this tile
      # sit in the 64-wide window starting at ptr.
      window = ptr + ar
      lst = plgpu.load(blocks_ref.at[qb, pl.ds(ptr, BLOCK)], mask=window < count, other=-1).astype(jnp.int32)
      hit = (lst[:, None] == bids[None, :]).astype(jnp.int32).max(axis=0) > 0
      hit = hit | ((bids >= s0) & (bids < s1))
      s = jnp.where(in_range & ~hit, s, -jnp.inf)
      ptr = ptr + ((lst >= 0) & (lst < (t + 1) * BLOCK)).astype(jnp.int32).sum()
      if cfg.has_block_len:
        weight = plgpu.load(r["lens"].at[tiles], mask=in_range, other=0).astype(jnp.float32)
      else:
        weight = jnp.clip(cfg.num_tokens - bids * BLOCK, 0, BLOCK).astype(jnp.float32)
      m_new = jnp.maximum(m, s.max())
      alpha = jnp.exp2(m - m_new)
      p = jnp.exp2(s[None, :] - m_new[:, None])
      l = l * alpha + (p * weight[None, :]).sum(axis=-1)
      pb = p.astype(jnp.bfloat16)

      def pv_half(chans):
        vs = plgpu.load(r["vs"].at[tiles, chans], mask=tmask, other=0.0).astype(jnp.float32)
        a, b = split_bf16(vs)  # one more dot, no f32 dot
        return _dot(pb, a) + _dot(pb, b)
      o_lo = o_lo * alpha[:, None] + pv_half(lo)
      o_hi = o_hi * alpha[:, None] + pv_half(hi)
      return (m_new, l, o_lo, o_hi), ptr

    carry, _ = lax.fori_loop(0, n_tiles, pooled, (carry, jnp.int32(0)))

  _, l, o_lo, o_hi = carry
  inv = 1.0 / jnp.where(l > 0.0, l, 1.0)  # l == 0: nothing to attend, o is 0
  o_lo = o_lo * inv[:, None]
  o_hi = o_hi * inv[:, None]
  if not cfg.keep_rotated:
    o_lo, o_hi = unrotate_halves(o_lo, o_hi, r["ht"], lo, hi, d)
  plgpu.store(o_ref.at[q_tile, lo], o_lo.astype(o_ref.dtype), mask=row_mask)
  plgpu.store(o_ref.at[q_tile, hi], o_hi.astype(o_ref.dtype), mask=row_mask)


def _block_table(meta) -> np.ndarray:
  """(NB,) int32 ``slot * 4 + branch``; branches are the present classes in order."""
  present = [fmt.CLASS_ID[c] for c in fmt.CLASSES if meta.slots(c)]
  branch = np.asarray([present.index(c) for c in meta.block_classes], np.int32)
  return meta.block_slots() * 4 + branch


def _sol_impl(q, packed, routing: SolRouting, key_bias, block_len, plan: _Plan, *, keep_rotated, interpret,
              num_warps, num_stages, overwrite_q=False):
  meta = packed.meta
  b, t, h, d = q.shape
  nb = plan.num_blocks
  branches = tuple(c for c in fmt.CLASSES if meta.slots(c))
  cfg = _KConfig(head_dim=d, num_tokens=t, num_blocks=nb, qk_scale=plan.log2_scale, k_scheme=meta.k_scheme,
                 v_scheme=meta.v_scheme, branches=branches, sink_blocks=plan.sink_blocks, sink_q=plan.sink_q,
                 tail=plan.tail, has_key_bias=key_bias is not None, has_block_len=block_len is not None,
                 keep_rotated=keep_rotated)
  inputs = NamedInputs()
  add = inputs.add

  per_bh = lambda i, j, k: (k, j, 0, 0)
  shared = lambda n: (lambda i, j, k: (0,) * n)
  add("q", q, (None, t, None, d), lambda i, j, k: (k, 0, j, 0))
  if len(branches) > 1:
    add("table", jnp.asarray(_block_table(meta)), (nb,), shared(1))
  if block_len is not None:
    add("lens", block_lengths(t, block_len), (nb,), shared(1))
  add("kg", routing.k_global, (None, None, d), lambda i, j, k: (k, j, 0))
  add("blocks", routing.blocks, (None, None) + routing.blocks.shape[2:], per_bh)
  add("counts", routing.counts, (None, None, nb), lambda i, j, k: (k, j, 0))
  if plan.tail:
    add("cen", routing.centroid, (None, None, nb, d), per_bh)
    add("km", routing.k_mean, (None, None, nb, d), per_bh)
    add("vs", packed.v_sum, (None, None, nb, d), per_bh)
  if key_bias is not None:
    kb = normalize_key_bias(key_bias, b, t) * LOG2E
    add("kb", kb, (None, t), lambda i, j, k: (k, 0))
  if not keep_rotated:
    ht = fmt.hadamard_signs(d, meta.rotation_seed_v).T
    add("ht", jnp.asarray(ht, jnp.bfloat16), (d, d), shared(2))
  for cls in branches:
    for role in ("k", "v"):
      if cls == "bf16":
        a = packed.arrays[f"{role}_bf16"]
        add(f"{role}_bf16", a, (None, None) + a.shape[2:], per_bh)
        continue
      sfx = "4" if cls == "int4" else "8"
      codes = packed.arrays[f"{role}_codes{sfx}"]
      add(f"{role}_codes{sfx}", codes, (None, None) + codes.shape[2:], per_bh)
      scheme = meta.k_scheme if role == "k" else meta.v_scheme
      for part in ("scale", "zero"):
        a = packed.arrays[f"{role}_{part}{sfx}"]
        if scheme == "channel":
          add(f"{role}_{part}{sfx}", a, (None, None) + a.shape[2:], per_bh)
          continue
        for g in range(a.shape[2]):  # one 1-D ref per channel group
          add(f"{role}_{part}{sfx}_g{g}", a, (None, None, None, a.shape[3]), lambda i, j, k, g=g: (k, j, g, 0))
  kernel = functools.partial(_kernel, names=inputs.ref_names("out"), cfg=cfg)
  return pl.pallas_call(
      kernel,
      grid=(nb, h, b),
      in_specs=inputs.specs,
      out_specs=pl.BlockSpec((None, t, None, d), lambda i, j, k: (k, 0, j, 0)),
      out_shape=jax.ShapeDtypeStruct(q.shape, jnp.bfloat16),
      # Each program reads its own q tile before it writes the same output tile, and
      # no other program touches it, so the output may take q's buffer.
      input_output_aliases={0: 0} if overwrite_q else {},
      compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=num_stages),
      interpret=interpret,
      name="sol_attention",
  )(*inputs.args)


def streamed_head_bytes(batch: int, tokens: int, head_dim: int, qk: str = "bf16") -> int:
  """Scratch of one head in the streamed methods: its decoded K store (bf16, or int8
  codes and an f32 scale per row under ``qk="int8"``) and bf16 V store (64-token slots),
  its f32 V sums, its q slice and its output."""
  rows = -(-tokens // BLOCK) * BLOCK
  k_row = head_dim + 4 if qk == "int8" else 2 * head_dim
  return batch * (rows * (k_row + 2 * head_dim) + (rows // BLOCK) * head_dim * 4 + 2 * tokens * head_dim * 2)


def streamed_group(batch: int, tokens: int, heads: int, head_dim: int, scratch_bytes: int, qk: str = "bf16") -> int:
  """Heads per group of the streamed methods within ``scratch_bytes`` (0: not one head)."""
  return int(min(heads, int(scratch_bytes) // streamed_head_bytes(batch, tokens, head_dim, qk)))


def _sol_streamed(q, packed, routing, key_bias, block_len, plan: _Plan, *, keep_rotated, interpret, num_warps,
                  num_stages, group, overwrite_q, qk):
  """Per head group: decode its K/V into stores (``kv_dequant``: bf16 K, or int8 K - kg
  for ``qk="int8"``; V un-rotated unless ``keep_rotated``), run ``sol_decoded``'s kernel
  over them (no decode in its loops), write the group's output."""
  meta = packed.meta
  b, t, h, d = q.shape
  out = q if overwrite_q else jnp.zeros_like(q)
  cfg = sol_decoded.LoopConfig(head_dim=d, num_tokens=t, num_blocks=plan.num_blocks, qk_scale=plan.log2_scale,
                               sink_blocks=plan.sink_blocks, sink_q=plan.sink_q, tail=plan.tail, qk=qk,
                               has_key_bias=key_bias is not None, has_block_len=block_len is not None)
  kb = normalize_key_bias(key_bias, b, t) * LOG2E if key_bias is not None else None
  lengths = block_lengths(t, block_len) if block_len is not None else None
  r_v = None if keep_rotated else jnp.asarray(fmt.hadamard_rotation(d, meta.rotation_seed_v))

  def attend(h0, g, out):
    take = lambda a: lax.dynamic_slice_in_dim(a, h0, g, axis=1)
    if qk == "int8":
      k, k_scale, v = dequantize_group(packed, h0, g, unrotate_v=not keep_rotated, interpret=interpret,
                                       layout="bhtd", store="int8_k", center=routing.k_global)
    else:
      (k, v), k_scale = dequantize_group(packed, h0, g, unrotate_v=not keep_rotated, interpret=interpret,
                                         layout="bhtd"), None
    v_sum = take(packed.v_sum).astype(jnp.float32)
    if r_v is not None:  # the pooled values in the basis the decoded V has
      v_sum = jnp.einsum("bhnd,ed->bhne", v_sum, r_v, precision=lax.Precision.HIGHEST)
    # With overwrite_q these q heads are read here, before the same heads are overwritten.
    qg = lax.dynamic_slice(out if overwrite_q else q, (0, 0, h0, 0), (b, t, g, d))
    og = sol_decoded.sol_over_stores(qg, k, k_scale, v, v_sum, take(routing.k_global), take(routing.blocks),
                                     take(routing.counts), take(routing.centroid), take(routing.k_mean), kb,
                                     lengths, cfg, interpret=interpret, num_warps=num_warps, num_stages=num_stages)
    return lax.dynamic_update_slice(out, og, (0, 0, h0, 0))

  n, rem = divmod(h, group)
  out = lax.fori_loop(0, n, lambda i, o: attend(i * group, group, o), out)
  if rem:
    out = attend(n * group, rem, out)
  return out


def _sol_call(q, packed, routing, key_bias, block_len, *, plan, keep_rotated, interpret, num_warps, num_stages,
              chunk_bytes, overwrite_q, group, qk):
  if routing is None:  # XLA orders this read of q before the kernel that may overwrite it
    routing = _routing_impl(q, packed, block_len, plan, chunk_bytes)
  if group:
    return _sol_streamed(q, packed, routing, key_bias, block_len, plan, keep_rotated=keep_rotated,
                         interpret=interpret, num_warps=num_warps, num_stages=num_stages, group=group,
                         overwrite_q=overwrite_q, qk=qk)
  return _sol_impl(q, packed, routing, key_bias, block_len, plan, keep_rotated=keep_rotated,
                   interpret=interpret, num_warps=num_warps, num_stages=num_stages, overwrite_q=overwrite_q)


_SOL_STATIC = ("plan", "keep_rotated", "interpret", "num_warps", "num_stages", "chunk_bytes", "overwrite_q",
               "group", "qk")
_sol_jit = jax.jit(_sol_call, static_argnames=_SOL_STATIC)
# q donated: at top level its buffer becomes the output instead of being copied.
_sol_jit_donate_q = jax.jit(_sol_call, static_argnames=_SOL_STATIC, donate_argnums=(0,))


def sol_attention(q, packed, *, tau=1.0, sm_scale=None, sink_blocks=None, sink_q=None, key_bias=None,
                  topk_ratio=0.0, tail=True, block_len=None, max_exact=None, keep_rotated=False, routing=None,
                  overwrite_q=False, method="fused", scratch_bytes=DEFAULT_SCRATCH_BYTES, interpret=None,
                  num_warps=4, num_stages=2, route_chunk_bytes=DEFAULT_ROUTE_CHUNK_BYTES):
  """Sol sparse attention of BF16 ``q`` over a ``formats.PackedKV``; (B, T, H, D) bf16.

  q: (B, T, H, D) bf16 rotated by ``R_k``, the same T as the packed K/V (self-
  attention). tau / topk_ratio / sink_blocks / sink_q / key_bias / tail /
  block_len: see the module docstring (comfy-kitchen's ``sol_attn`` parameters;
  sm_scale is its ``scale``, default 1/sqrt(D)). max_exact: routed-list capacity
  per query block (default kk + 3 under top-k, ``DEFAULT_MAX_EXACT_TAU`` under
  tau). routing: a ``SolRouting`` from ``sol_routing`` with the same arguments,
  to skip the routing step. The output is un-rotated by ``R_v^T`` unless
  ``keep_rotated``. overwrite_q: write the output into q's buffer (q is donated and
  must not be used afterwards), saving one (B, T, H, D) bf16 buffer of peak memory.
  method: ``"fused"`` (the kernel below decodes int4/int8 tiles in its exact loop; no
  scratch), ``"streamed"`` or ``"streamed_int8"``: head groups decoded first by
  ``kv_dequant`` into stores of at most ``scratch_bytes`` (K bf16, or K - kg int8 per
  token for ``streamed_int8``; V bf16, un-rotated), then ``sol_decoded``'s kernel, which
  only loads whole 64 x D tiles and multiplies them (bf16 Q.K dots, or int8 Q.K with Q
  quantized per row; P.V in bf16). The three agree up to the roundings each adds:
  ``benchmarks/NOTES.md`` has their times and cosines next to comfy-kitchen's.
  """
  plan = _plan(q, packed, tau=tau, sm_scale=sm_scale, sink_blocks=sink_blocks, sink_q=sink_q,
               topk_ratio=topk_ratio, tail=tail, max_exact=max_exact)
  if block_len is not None:
    block_lengths(plan.num_tokens, block_len)
  if key_bias is not None:
    normalize_key_bias(key_bias, q.shape[0], q.shape[1])
  if routing is not None:
    if not isinstance(routing, SolRouting):
      raise ValueError(f"routing must be a SolRouting, got {type(routing).__name__}")
    want = (q.shape[0], q.shape[2], plan.num_blocks)
    if tuple(routing.counts.shape) != want or routing.blocks.shape[:3] != want:
      raise ValueError(f"routing is for (B, H, NB) = {tuple(routing.counts.shape)}, this call needs {want}")
  if method not in METHODS:
    raise ValueError(f"method must be one of {METHODS}, got {method!r}")
  group, qk = 0, STREAMED_QK.get(method, "bf16")
  if method in STREAMED_QK:
    b, t, h, d = q.shape
    group = streamed_group(b, t, h, d, scratch_bytes, qk)
    if group < 1:
      need = streamed_head_bytes(b, t, d, qk)
      raise ValueError(f"scratch_bytes={scratch_bytes} holds less than one head's bf16 K/V stores, q slice and "
                       f"output ({need} bytes at T={t}); raise it or use method='fused' (no scratch)")
  call = _sol_jit_donate_q if overwrite_q else _sol_jit
  return call(q, packed, routing, key_bias, block_len, plan=plan, keep_rotated=bool(keep_rotated),
              interpret=resolve_interpret(interpret), num_warps=int(num_warps), num_stages=int(num_stages),
              chunk_bytes=int(route_chunk_bytes), overwrite_q=bool(overwrite_q), group=group, qk=qk)
