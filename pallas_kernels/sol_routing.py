"""Sol's routing: which key blocks each 64-token query block attends exactly.

Plain jnp (``sol.py``'s docstring states the rules). Centroids and proxy scores are
computed in chunks of query blocks, so only ``B * H * chunk * NB`` scores exist at a
time (the full NB x NB matrix at T = 152k and 56 heads would be 1.3 GB in f32), and
each query block's exact set is written as one sorted list of at most ``max_exact``
key blocks, ``SolRouting``: metadata that grows with T, never T**2.
"""
from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from formats import packed_kv as fmt
from pallas_kernels.attention_config import DEFAULT_MAX_EXACT_TAU, Sol
from pallas_kernels.backend import LOG2E, resolve_sm_scale

BLOCK = fmt.BLOCK

@dataclasses.dataclass(frozen=True)
class SolPlan:
  """Static description of one Sol call (hashable: jit static argument): the ``Sol``
  config resolved against the shapes (sinks clipped to [0, NB], the top-k count, the
  list capacity)."""
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


def topk_count(n: int, ratio: float) -> int:
  """Key blocks kept per query block under top-k: round(ratio * n) clamped to
  [1, n - 1], 0 when n <= 1 (nothing beyond the forced blocks)."""
  return max(0, min(n - 1, max(1, round(ratio * n))))


def default_max_exact(num_blocks: int, config: Sol) -> int:
  """The routed-list capacity a call uses: the config's, else top-k's count + 3, else
  ``DEFAULT_MAX_EXACT_TAU``; never more than NB."""
  sinks = config.sink_blocks or (0, 0)
  n = num_blocks - (min(sinks[1], num_blocks) - min(sinks[0], num_blocks))
  cap = config.max_exact
  if cap is None:
    cap = topk_count(n, config.topk_ratio) + 3 if config.topk_ratio else DEFAULT_MAX_EXACT_TAU
  return min(int(cap), num_blocks)


def make_plan(q, packed, config: Sol, *, uncapped: bool = False) -> SolPlan:
  """Check q against the packed K/V and resolve ``config`` for this shape.
  ``uncapped``: no list capacity (the algorithm as published: the reference's default)."""
  if not isinstance(config, Sol):
    raise ValueError(f"attention must be a Sol(...) config, got {config!r}")
  meta = fmt.check_query(q, packed)
  if q.shape[1] != meta.num_tokens:
    raise ValueError(f"Sol attention is self-attention: q has {q.shape[1]} tokens, packed K/V "
                     f"{meta.num_tokens}")
  nb = meta.num_blocks
  s0, s1 = config.sink_blocks or (0, 0)
  q0, q1 = config.sink_q or (0, 0)
  sinks = (min(s0, nb), min(s1, nb))
  kk = topk_count(nb - (sinks[1] - sinks[0]), config.topk_ratio) if config.topk_ratio else 0
  cap = max(nb, 3) if uncapped and config.max_exact is None else default_max_exact(nb, config)
  return SolPlan(num_tokens=meta.num_tokens, num_blocks=nb, sm_scale=resolve_sm_scale(config.sm_scale, meta.head_dim),
                 tau=config.tau, topk_ratio=config.topk_ratio, topk_kk=kk, sink_blocks=sinks,
                 sink_q=(min(q0, nb), min(q1, nb)), tail=config.tail, max_exact=min(cap, nb))


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
def _route_rows(cen, kcc, kvar, qb, plan: SolPlan, unrotation):
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


def routing_workspace_bytes(batch: int, heads: int, num_tokens: int, head_dim: int, chunk_bytes: int) -> int:
  """Temporaries routing holds while it runs, beyond its metadata (``routing_nbytes``):
  three f32 (B, H, NB, D) arrays (the block means in f32, centred, and in the caller's
  basis), the padded copy of the centroids, and about four chunk-sized arrays per chunk
  of proxy scores (the scores, the capacity cut's keys, the running count, the slots).
  At T = 152,263 and 56 heads that is 0.38 GiB, close to the 0.4 GiB by which the card
  budget found ``required_bytes`` short for Sol before it was counted (issue 45). A
  count from the code, not yet checked on the card."""
  nb = -(-num_tokens // BLOCK)
  per_block_stats = batch * heads * nb * head_dim * 4
  return 4 * per_block_stats + 4 * int(chunk_bytes)


def _route_chunk_blocks(plan: SolPlan, batch: int, heads: int, chunk_bytes: int) -> int:
  return int(max(1, min(plan.num_blocks, chunk_bytes // (batch * heads * plan.num_blocks * 4))))


def _routing_impl(q, packed, block_len, plan: SolPlan, chunk_bytes: int) -> SolRouting:
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


def sol_routing(q, packed, attention: Sol | None = None, *, block_len=None) -> SolRouting:
  """Routing only (``sol_attention``'s arguments); pass the result back as
  ``sol_attention(..., routing=r)`` to time or inspect the two stages apart."""
  attention = Sol() if attention is None else attention
  plan = make_plan(q, packed, attention)
  if block_len is not None:
    block_lengths(plan.num_tokens, block_len)  # validates
  return _routing_jit(q, packed, block_len, plan=plan, chunk_bytes=int(attention.route_chunk_bytes))


def pooled_step(s, m, l, blocks_ref, lens_ref, qb, t, ptr, count, *, num_blocks, num_tokens, sink_blocks):
  """Inside a Sol kernel: one online-softmax step over pooled tile ``t`` (64 key
  blocks) for query block ``qb``. ``s`` (64,) holds the tile's pooled logits; blocks
  attended exactly (listed, or in the sink range) and past NB are dropped, and each
  term weighs its block's live rows. Returns (m_new, alpha, p bf16 (64 rows, 64
  blocks), l, the list pointer for tile t + 1); the caller adds ``p @ v_sum``.

  The list is ascending, so the entries of this tile sit in the 64-wide window of
  ``blocks_ref[qb]`` starting at ``ptr``: one load and a 64 x 64 compare, no search.
  ``lens_ref``: the block_len table, or None (live rows from ``num_tokens``).
  """
  ar = jnp.arange(BLOCK, dtype=jnp.int32)
  bids = t * BLOCK + ar
  in_range = bids < num_blocks
  lst = plgpu.load(blocks_ref.at[qb, pl.ds(ptr, BLOCK)], mask=ptr + ar < count, other=-1).astype(jnp.int32)
  hit = (lst[:, None] == bids[None, :]).astype(jnp.int32).max(axis=0) > 0
  s0, s1 = sink_blocks
  hit = hit | ((bids >= s0) & (bids < s1))
  ptr = ptr + ((lst >= 0) & (lst < (t + 1) * BLOCK)).astype(jnp.int32).sum()
  if lens_ref is not None:
    weight = plgpu.load(lens_ref.at[pl.ds(t * BLOCK, BLOCK)], mask=in_range, other=0).astype(jnp.float32)
  else:
    weight = jnp.clip(num_tokens - bids * BLOCK, 0, BLOCK).astype(jnp.float32)
  s = jnp.where(in_range & ~hit, s, -jnp.inf)
  m_new = jnp.maximum(m, s.max())
  alpha = jnp.exp2(m - m_new)
  p = jnp.exp2(s[None, :] - m_new[:, None])
  l = l * alpha + (p * weight[None, :]).sum(axis=-1)
  return m_new, alpha, p.astype(jnp.bfloat16), l, ptr


def walk_exact_blocks(exact_block, carry, blocks_ref, counts_ref, qb, *, num_blocks, sink_blocks, sink_q):
  """Inside a Sol kernel: run ``exact_block(blk, carry)`` over every key block query
  block ``qb`` attends exactly: all of them on a ``sink_q`` row, else the sink range
  then the routed list. Returns (carry, the list's live entries (0 on a ``sink_q`` row), the number of
  pooled tiles to walk).

  The next list entry is read before the current block's dots, so its latency (the
  loop's only dependent load) hides behind them. Bounds stay Python ints when no
  ``sink_q`` is given, so those loops are static.
  """
  s0, s1 = sink_blocks
  q0, q1 = sink_q
  count = counts_ref[qb]
  n_pool_tiles = pl.cdiv(num_blocks, BLOCK)
  if q1 > q0:
    dense_row = (qb >= q0) & (qb < q1)
    first = jnp.where(dense_row, jnp.int32(0), jnp.int32(s0))
    last = jnp.where(dense_row, jnp.int32(num_blocks), jnp.int32(s1))
    carry = lax.fori_loop(first, last, exact_block, carry)
    count = jnp.where(dense_row, jnp.int32(0), count)
    n_pool_tiles = jnp.where(dense_row, jnp.int32(0), jnp.int32(n_pool_tiles))
  elif s1 > s0:
    carry = lax.fori_loop(s0, s1, exact_block, carry)
  cap = blocks_ref.shape[-1]

  def listed(e, state):
    carry, blk = state
    nxt = blocks_ref[qb, jnp.minimum(e + 1, cap - 1)].astype(jnp.int32)
    return exact_block(blk, carry), nxt

  carry, _ = lax.fori_loop(0, count, listed, (carry, blocks_ref[qb, 0].astype(jnp.int32)))
  return carry, count, n_pool_tiles
