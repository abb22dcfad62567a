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

Where it lives
--------------
``sol.py`` (this file): the entry point, ``sol_attention``, its checks and the choice of
method. ``sol_routing``: the plan and the routing (``sol_routing``, ``SolRouting``).
``sol_fused``: the kernel that decodes packed tiles in its loop. ``sol_decoded``: the
kernel over one head group's decoded stores (bf16 or int8 K), fed by ``kv_dequant``.
``sol_reference``: the float32 definition.
"""
from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
from jax import lax

from formats import packed_kv as fmt
from pallas_kernels import sol_decoded
from pallas_kernels.attention_config import Sol
from pallas_kernels.backend import LOG2E, over_chunks, resolve_interpret
from pallas_kernels.kv_dequant import dequantize_group
from pallas_kernels.sol_fused import fused_sol
from pallas_kernels.sol_reference import sol_attention_reference, sol_exact_blocks_reference
from pallas_kernels.sol_routing import (BLOCK, SolPlan, SolRouting, _routing_impl, block_lengths, default_max_exact,
                                        make_plan, normalize_key_bias, routing_nbytes, routing_workspace_bytes,
                                        sol_routing, topk_count)

__all__ = ["Sol", "SolRouting", "auto_order", "default_max_exact", "resolve_method", "routing_nbytes",
           "routing_workspace_bytes", "sol_attention", "sol_attention_reference", "sol_exact_blocks_reference",
           "sol_routing", "streamed_group", "streamed_head_bytes", "topk_count"]

log = logging.getLogger(__name__)
# The streamed methods and the Q.K precision of their kernel.
STREAMED_QK = {"streamed": "bf16", "streamed_int8": "int8"}
# What method="auto" tries, fastest first, as measured on an H100 against comfy-kitchen
# (benchmarks/NOTES.md, "Sol over decoded stores"; results/sol_h100_2026-12-07_{38k,75k,152k}.json):
# int8 Q.K beats bf16 by 14-17% at T = 152,263 and loses by 3-5% at 75,600 (4-9% at 38,247).
# Its advantage, interpolated linearly in log T between the two nearest points, crosses
# zero near 87,000 tokens. Fused (no scratch) is last: 1.8-2.2x slower, the choice when
# one head's stores do not fit scratch_bytes.
INT8_QK_FROM_TOKENS = 87_296
AUTO_ORDER_SHORT = ("streamed", "streamed_int8", "fused")
AUTO_ORDER_LONG = ("streamed_int8", "streamed", "fused")


def auto_order(tokens: int) -> tuple:
  """The methods ``auto`` tries at ``tokens`` tokens, fastest first."""
  return AUTO_ORDER_LONG if tokens >= INT8_QK_FROM_TOKENS else AUTO_ORDER_SHORT


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


def _sol_streamed(q, packed, routing, key_bias, block_len, plan: SolPlan, *, keep_rotated, interpret, num_warps,
                  num_stages, group, overwrite_q, qk):
  """Per head group: decode its K/V into stores (``kv_dequant``: bf16 K, or int8 K - kg
  for ``qk="int8"``; V un-rotated unless ``keep_rotated``), run ``sol_decoded``'s kernel
  over them (no decode in its loops), write the group's output."""
  meta = packed.meta
  b, t, h, d = q.shape
  out = q if overwrite_q else jnp.zeros_like(q)
  cfg = sol_decoded.LoopConfig.from_plan(plan, d, qk, has_key_bias=key_bias is not None,
                                         has_block_len=block_len is not None)
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

  return over_chunks(h, group, attend, out)


def _sol_call(q, packed, routing, key_bias, block_len, *, plan, keep_rotated, interpret, num_warps, num_stages,
              chunk_bytes, overwrite_q, group, qk):
  if routing is None:  # XLA orders this read of q before the kernel that may overwrite it
    routing = _routing_impl(q, packed, block_len, plan, chunk_bytes)
  if group:
    return _sol_streamed(q, packed, routing, key_bias, block_len, plan, keep_rotated=keep_rotated,
                         interpret=interpret, num_warps=num_warps, num_stages=num_stages, group=group,
                         overwrite_q=overwrite_q, qk=qk)
  return fused_sol(q, packed, routing, key_bias, block_len, plan, keep_rotated=keep_rotated,
                   interpret=interpret, num_warps=num_warps, num_stages=num_stages, overwrite_q=overwrite_q)


_SOL_STATIC = ("plan", "keep_rotated", "interpret", "num_warps", "num_stages", "chunk_bytes", "overwrite_q",
               "group", "qk")
_sol_jit = jax.jit(_sol_call, static_argnames=_SOL_STATIC)
# q donated: at top level its buffer becomes the output instead of being copied.
_sol_jit_donate_q = jax.jit(_sol_call, static_argnames=_SOL_STATIC, donate_argnums=(0,))


def resolve_method(attention: Sol, batch: int, tokens: int, heads: int, head_dim: int) -> tuple[str, int]:
  """(method, heads per group; 0 for fused). ``auto`` takes the first of
  ``auto_order(tokens)`` that runs and logs why it passed over the others; an explicit streamed method whose
  one head does not fit ``scratch_bytes`` raises, naming the fix."""
  def group_of(method):
    return streamed_group(batch, tokens, heads, head_dim, attention.scratch_bytes, STREAMED_QK[method])

  if attention.method != "auto":
    if attention.method not in STREAMED_QK:
      return attention.method, 0
    group = group_of(attention.method)
    if group < 1:
      need = streamed_head_bytes(batch, tokens, head_dim, STREAMED_QK[attention.method])
      raise ValueError(f"Sol(scratch_bytes={attention.scratch_bytes}) holds less than one head's decoded K/V "
                       f"stores, q slice and output ({need} bytes at T={tokens}); raise scratch_bytes or use "
                       f"Sol(method='fused') (no scratch)")
    return attention.method, group
  rejected = []
  for method in auto_order(tokens):
    if method not in STREAMED_QK:
      break
    group = group_of(method)
    if group >= 1:
      log.info("sol_attention auto: %s (%d heads a group)%s", method, group,
               "".join(f"; {r}" for r in rejected))
      return method, group
    rejected.append(f"{method} rejected: one head needs "
                    f"{streamed_head_bytes(batch, tokens, head_dim, STREAMED_QK[method])} bytes of scratch, "
                    f"scratch_bytes is {attention.scratch_bytes}")
  log.info("sol_attention auto: fused%s", "".join(f"; {r}" for r in rejected))
  return "fused", 0


def sol_attention(q, packed, attention: Sol | None = None, *, key_bias=None, block_len=None, routing=None,
                  keep_rotated=False, overwrite_q=False, interpret=None):
  """Sol sparse attention of BF16 ``q`` over a ``formats.PackedKV``; (B, T, H, D) bf16.

  q: (B, T, H, D) bf16 rotated by ``R_k``, the same T as the packed K/V (self-
  attention). ``attention``: a ``Sol`` config (tau, top-k, sinks, tail, list capacity,
  scale, method, scratch; None: ``Sol()``). key_bias: (T,), (B, T) or (B, 1, 1, T),
  bool (True = attend) or float (natural-log bias), exact branch only. block_len:
  (NB,) int32 live rows per block. routing: a ``SolRouting`` from ``sol_routing`` with
  the same config, to skip the routing step. The output is un-rotated by ``R_v^T``
  unless ``keep_rotated``. overwrite_q: write the output into q's buffer (q is donated
  and must not be used afterwards), saving one (B, T, H, D) bf16 buffer of peak memory:
  what lets the user's case fit, and what an eager (torch) caller can get no other way.

  Methods (``Sol.method``): ``"fused"`` (``sol_fused``: the kernel decodes int4/int8
  tiles in its exact loop; no scratch), ``"streamed"`` or ``"streamed_int8"``: head
  groups decoded first by ``kv_dequant`` into stores of at most ``scratch_bytes`` (K
  bf16, or K - kg int8 per token for ``streamed_int8``; V bf16, un-rotated), then
  ``sol_decoded``'s kernel, which only loads whole 64 x D tiles and multiplies them
  (bf16 Q.K dots, or int8 Q.K with Q quantized per row; P.V in bf16). ``"auto"``: the
  fastest that runs, as measured (``auto_order``). All agree up to the roundings each
  adds: ``benchmarks/NOTES.md`` has their times and cosines next to comfy-kitchen's.
  """
  attention = Sol() if attention is None else attention
  plan = make_plan(q, packed, attention)
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
  b, t, h, d = q.shape
  method, group = resolve_method(attention, b, t, h, d)
  # Donation is a property of the jitted function, hence a twin that donates q.
  call = _sol_jit_donate_q if overwrite_q else _sol_jit
  return call(q, packed, routing, key_bias, block_len, plan=plan, keep_rotated=bool(keep_rotated),
              interpret=resolve_interpret(interpret), num_warps=attention.num_warps,
              num_stages=attention.num_stages, chunk_bytes=attention.route_chunk_bytes,
              overwrite_q=bool(overwrite_q), group=group, qk=STREAMED_QK.get(method, "bf16"))
