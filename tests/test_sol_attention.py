"""Sol attention: routing, the jnp reference's semantics, and the Pallas kernel against it.

DiT-like data throughout (random Gaussian data makes routing meaningless). Shapes are
small and ragged so interpret mode stays fast; the ``gpu`` test reruns the kernel
cases on the device, where the Triton lowering rules apply.
"""
import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.testing import dit_qkv, quality
from formats import packed_kv as fmt
from pallas_kernels import attention as dense
from pallas_kernels import sol as sol
from pallas_kernels import sol_decoded
from pallas_kernels.attention_config import DEFAULT_MAX_EXACT_TAU, Sol
from pallas_kernels.sol_routing import make_plan
from pallas_kernels.kv_dequant import dequantize_group_int8_k_reference, dequantize_group_reference

H = 2
_quantize = jax.jit(fmt.quantize_reference, static_argnums=2)
MIXED = (2, 2, 1, 0, 0, 1, 0, 0, 0, 2, 0)  # 11 blocks: bf16 prefix, int8 and int4 elsewhere


@functools.lru_cache(maxsize=None)
def _data(t, d, classes=None, k_scheme="channel", v_scheme="token", seed=0, block_len_seed=None):
  """(q bf16, packed, block_len or None, live rows (T,) bool) for a DiT-like head set.

  With ``block_len_seed`` the dead rows of K and V are zeroed before packing: what a
  zero-padded tile looks like after the projection.
  """
  q, k, v, _, _ = dit_qkv(t, H, d, prefix_tokens=t // 8, seed=seed)
  rk, rv = fmt.hadamard_rotation(d, 0), fmt.hadamard_rotation(d, 1)
  kr, vr = k @ rk, v @ rv
  nb = -(-t // fmt.BLOCK)
  block_len, live = None, np.ones((t,), bool)
  if block_len_seed is not None:
    block_len = np.random.default_rng(block_len_seed).integers(8, 65, nb).astype(np.int32)
    live = (np.arange(t) % fmt.BLOCK) < block_len[np.arange(t) // fmt.BLOCK]
    kr, vr = kr * live[None, :, None, None], vr * live[None, :, None, None]
    block_len = jnp.asarray(block_len)
  meta = fmt.PackedKVMeta(1, H, d, t, classes or (0,) * nb, k_scheme, v_scheme)
  packed = _quantize(jnp.asarray(kr), jnp.asarray(vr), meta)
  return jnp.asarray(q @ rk, jnp.bfloat16), packed, block_len, live


def _key_bias(t, seed=0):
  rng = np.random.default_rng(seed)
  kb = rng.normal(size=t).astype(np.float32)
  kb[rng.uniform(size=t) < 0.2] = -np.inf
  return jnp.asarray(kb)


# Keywords of the calls themselves; everything else in a settings dict is a Sol setting.
CALL_KEYS = ("key_bias", "block_len", "routing", "keep_rotated", "overwrite_q", "interpret")
# The kernel these tests check unless they name a method (Sol's own default is "auto").
FUSED = Sol(method="fused")


def _split(kw, **extra):
  """A dict of Sol settings mixed with call keywords (key_bias, block_len...) ->
  (``Sol(**settings)``, the call's keywords). The method is ``"fused"`` unless given."""
  kw = {"method": "fused", **kw, **extra}
  call = {k: kw.pop(k) for k in CALL_KEYS if k in kw}
  return Sol(**kw), call


def _attend(q, packed, kw=None, **extra):
  """``sol_attention`` with the settings and call keywords of ``kw`` (and ``extra``)."""
  cfg, call = _split(kw or {}, **extra)
  return sol.sol_attention(q, packed, cfg, **call)


def _reference(q, packed, kw=None, **extra):
  cfg, call = _split(kw or {}, **extra)
  return sol.sol_attention_reference(q, packed, cfg, **call)


def _exact(q, packed, kw=None, **extra):
  """The reference's exact-block matrix (``sol_exact_blocks_reference``)."""
  cfg, call = _split(kw or {}, **extra)
  return sol.sol_exact_blocks_reference(q, packed, cfg, **call)


def _routing(q, packed, kw=None, **extra):
  cfg, call = _split(kw or {}, **extra)
  return sol.sol_routing(q, packed, cfg, **call)


def _check(out, ref, live=None, cos=0.998):
  o, r = np.asarray(out, np.float32), np.asarray(ref, np.float32)
  if live is not None:
    o, r = o[:, live], r[:, live]
  assert np.isfinite(o).all()
  qual = quality(o, r)
  assert qual["cos"] >= cos, qual
  return qual


# name: (T, D, classes, k_scheme, v_scheme, block_len_seed, sol kwargs)
CASES = {
    "int4_d64_tau1": (700, 64, None, "channel", "token", None, {}),
    "mixed_d128_g64_tau05": (700, 128, MIXED, "channel", "token_g64", None, {"tau": 0.5}),
    "mixed_ktoken_topk_sinks": (700, 128, MIXED, "token", "token", None,
                                {"topk_ratio": 0.3, "sink_blocks": [0, 2]}),
    "no_tail_sink_q": (700, 128, None, "channel", "token", None,
                       {"tail": False, "sink_q": [3, 5], "sink_blocks": [0, 1]}),
    "key_bias_d64": (700, 64, MIXED, "channel", "token", None, {"key_bias": "kb", "sink_blocks": [0, 2]}),
    "block_len": (700, 128, None, "channel", "token", 3, {}),
    "whole_blocks_t640": (640, 64, None, "token", "token_g64", None, {"tau": 0.0}),
    "tiny_tail_t65": (65, 64, None, "channel", "token", None, {}),
}


def _case_inputs(name):
  t, d, classes, ks, vs, bl_seed, kw = CASES[name]
  q, packed, block_len, live = _data(t, d, classes, ks, vs, block_len_seed=bl_seed)
  kw = dict(kw)
  if kw.get("key_bias") == "kb":
    kw["key_bias"] = _key_bias(t)
  if block_len is not None:
    kw["block_len"] = block_len
  return q, packed, kw, live


def _run_case(name):
  q, packed, kw, live = _case_inputs(name)
  return _attend(q, packed, kw), _reference(q, packed, kw), live


@pytest.mark.parametrize("name", list(CASES))
def test_kernel_matches_reference(name):
  out, ref, live = _run_case(name)
  assert out.shape == ref.shape and out.dtype == jnp.bfloat16
  _check(out, ref, live)


STREAMED = ("streamed", "streamed_int8")


@pytest.mark.parametrize("method", STREAMED)
def test_streamed_methods_read_the_five_bit_classes(method):
  """k5v4 / k5v5 blocks among int4, int8 and bf16 ones: the streamed methods (the one
  decoder) match the reference; the fused kernel refuses them, naming the fix."""
  classes = (4, 3, 1, 0, 3, 4, 2, 3, 0, 4, 3)
  q, packed, _, _ = _data(700, 128, classes, "channel", "token")
  kw = {"tau": 0.5, "sink_blocks": [0, 2]}
  _check(_attend(q, packed, kw, method=method), _reference(q, packed, kw), cos=0.9995)
  with pytest.raises(NotImplementedError, match=r"Sol method='fused' reads classes .* not \['k5v4', 'k5v5'\]"):
    _attend(q, packed, kw)


@pytest.mark.parametrize("method", STREAMED)
@pytest.mark.parametrize("name", ["mixed_d128_g64_tau05", "key_bias_d64", "no_tail_sink_q", "block_len"])
def test_streamed_methods_match_fused_and_reference(name, method):
  """method='streamed*': head groups decoded to stores first, then the kernel over them
  (bf16 or int8 Q.K). One head per group here (a budget of one head's scratch): the
  group loop and the per-group slices of q, the stats and the routing all run."""
  q, packed, kw, live = _case_inputs(name)
  b, t, h, d = q.shape
  qk = "int8" if method == "streamed_int8" else "bf16"
  one_head = sol.streamed_head_bytes(b, t, d, qk)
  assert sol.streamed_group(b, t, h, d, one_head, qk) == 1
  fused = _attend(q, packed, kw)
  streamed = _attend(q, packed, kw, method=method, scratch_bytes=one_head)
  assert streamed.shape == fused.shape and streamed.dtype == jnp.bfloat16
  _check(streamed, _reference(q, packed, kw), live)
  # int8 Q.K adds its own rounding (measured ~1e-2 rel_l2 against the fused kernel here).
  qual = _check(streamed, fused, live, cos=0.9999 if qk == "bf16" else 0.9997)
  assert qual["rel_l2"] < (1e-2 if qk == "bf16" else 2.5e-2), qual
  # Every head in one group, and the output over q: the same values, up to one bf16 ulp
  # (XLA fuses the f32 routing sums over the bf16 block stats differently per group shape).
  q_copy = jnp.array(q, copy=True)
  whole = _attend(q_copy, packed, kw, method=method, overwrite_q=True)
  np.testing.assert_allclose(np.asarray(whole, np.float32), np.asarray(streamed, np.float32), rtol=2 ** -7, atol=0)
  # A scratch too small for one head raises at the call (it depends on the shapes) ...
  with pytest.raises(ValueError, match=r"use Sol\(method='fused'\)"):
    _attend(q, packed, kw, method=method, scratch_bytes=one_head - 1)
  # ... an unknown method at Sol(...) construction.
  with pytest.raises(ValueError, match="method must be one of"):
    _split(kw, method="cudnn")


def _group_stores(q, packed, kw, qk, head0=0, heads=H):
  """The kernel-over-stores inputs of one head group, built with the decoder's references."""
  cfg, call = _split(kw)
  plan = make_plan(q, packed, cfg)
  routing = sol.sol_routing(q, packed, cfg, block_len=call.get("block_len"))
  d = q.shape[-1]
  pad = plan.num_blocks * fmt.BLOCK - plan.num_tokens
  if qk == "int8":
    k, k_scale, v = dequantize_group_int8_k_reference(packed, head0, heads, routing.k_global, unrotate_v=True)
  else:
    k, v = dequantize_group_reference(packed, head0, heads, unrotate_v=True)
    k, v = (jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))).transpose(0, 2, 1, 3) for x in (k, v))
    k_scale = None
  sl = lambda a: a[:, head0:head0 + heads]
  r_v = jnp.asarray(fmt.hadamard_rotation(d, packed.meta.rotation_seed_v))
  v_sum = jnp.einsum("bhnd,ed->bhne", sl(packed.v_sum).astype(jnp.float32), r_v)
  kb = kw.get("key_bias")
  kb = None if kb is None else sol.normalize_key_bias(kb, q.shape[0], q.shape[1]) * sol.LOG2E
  lengths = kw.get("block_len")
  cfg = sol_decoded.LoopConfig.from_plan(plan, d, qk, has_key_bias=kb is not None, has_block_len=lengths is not None)
  lengths = None if lengths is None else sol.block_lengths(plan.num_tokens, lengths)
  args = (q[:, :, head0:head0 + heads], k, k_scale, v, v_sum, sl(routing.k_global), sl(routing.blocks),
          sl(routing.counts), sl(routing.centroid), sl(routing.k_mean), kb, lengths, cfg)
  return args


@pytest.mark.parametrize("qk", sol_decoded.QK_PRECISIONS)
@pytest.mark.parametrize("name", ["int4_d64_tau1", "mixed_ktoken_topk_sinks", "no_tail_sink_q", "key_bias_d64",
                                  "block_len", "whole_blocks_t640", "tiny_tail_t65"])
def test_kernel_over_stores_matches_its_reference(name, qk):
  """``sol_decoded``'s kernel against ``exact_loop_reference`` on the same stores: only
  the kernel's own roundings differ (P in bf16, the V sums as two bf16 terms)."""
  q, packed, kw, live = _case_inputs(name)
  args = _group_stores(q, packed, kw, qk)
  out = sol_decoded.sol_over_stores(*args, interpret=True)
  ref = sol_decoded.exact_loop_reference(*args)
  assert out.shape == q.shape and out.dtype == jnp.bfloat16
  qual = _check(out, ref, live, cos=0.99998)
  assert qual["rel_l2"] < 5e-3, qual


def test_int8_qk_is_close_to_bf16_qk_and_not_equal():
  """Int8 Q.K is a real change of the dots (not the bf16 path renamed) and stays close."""
  q, packed, kw, live = _case_inputs("mixed_d128_g64_tau05")
  outs = {qk: np.asarray(sol_decoded.sol_over_stores(*_group_stores(q, packed, kw, qk), interpret=True),
                         np.float32)[:, live] for qk in sol_decoded.QK_PRECISIONS}
  qual = quality(outs["int8"], outs["bf16"])
  assert 0.9995 < qual["cos"] < 1.0 and qual["rel_l2"] > 1e-4, qual


def test_overwrite_q_writes_the_output_into_q():
  # Same values as the out-of-place call (routing included, which also reads q), and
  # q is donated; inside a jit with q an intermediate as in a layer.
  q, packed, kw, _ = _case_inputs("mixed_ktoken_topk_sinks")
  expected = np.asarray(_attend(q, packed, kw), np.float32)
  q_copy = jnp.array(q, copy=True)
  out = _attend(q_copy, packed, kw, overwrite_q=True)
  np.testing.assert_array_equal(np.asarray(out, np.float32), expected)
  assert q_copy.is_deleted(), "overwrite_q must donate q"
  layer = jax.jit(lambda a, p: _attend(a * 1.0, p, kw, overwrite_q=True))
  np.testing.assert_array_equal(np.asarray(layer(q, packed), np.float32), expected)


@pytest.mark.parametrize("name, keep_rotated, method", [
    ("mixed_ktoken_topk_sinks", False, "fused"), ("no_tail_sink_q", True, "fused"), ("key_bias_d64", False, "fused"),
    ("block_len", False, "fused"), ("mixed_d128_g64_tau05", False, "streamed"), ("block_len", True, "streamed"),
    ("key_bias_d64", False, "streamed_int8"), ("no_tail_sink_q", False, "streamed_int8")])
def test_kernel_lowers_to_triton(name, keep_rotated, method):
  """Lower for CUDA on this CPU machine: catches what Pallas-Triton rejects (slices of
  values, non power-of-two shapes, unsupported ops) that interpret mode lets through."""
  q, packed, kw, _ = _case_inputs(name)
  cfg, arrays = _split(kw, method=method)
  assert all(hasattr(v, "shape") for v in arrays.values())
  fn = jax.jit(lambda q, packed, arrays: sol.sol_attention(q, packed, cfg, interpret=False, keep_rotated=keep_rotated,
                                                           **arrays))
  text = fn.trace(q, packed, arrays).lower(lowering_platforms=("cuda",)).as_text()
  kernel = "sol_attention" if method == "fused" else "sol_over_stores"
  assert kernel in text and "triton" in text.lower()


@pytest.mark.parametrize("kw", [{}, {"tau": -0.5, "sm_scale": 0.2}, {"topk_ratio": 0.3, "sink_blocks": [0, 2]},
                                {"tail": False, "sink_q": [5, 7]}, {"block_len": "bl"},
                                {"key_bias": "kb", "sink_blocks": [0, 4]}])
def test_reference_matches_comfy_kitchen_eager(kw):
  """Our jnp reference against comfy-kitchen's eager sol_attn, where it is installed.

  Same numbers in: a bf16 store (exact), stats from the same bf16-rounded K/V, and
  comfy called on those tensors un-rotated (float32), the basis the caller holds:
  our tau threshold is computed there (the module docstring). Not installed: skipped.
  """
  eager = pytest.importorskip("comfy_kitchen.backends.eager.sol_attn")
  torch = pytest.importorskip("torch")
  t, d = 700, 64
  q, k, v, _, _ = dit_qkv(t, H, d, prefix_tokens=100, seed=3)
  rk, rv = fmt.hadamard_rotation(d, 0), fmt.hadamard_rotation(d, 1)
  bf = lambda x: np.asarray(jnp.asarray(x, jnp.bfloat16).astype(jnp.float32))
  qr, kr, vr = bf(q @ rk), bf(k @ rk), bf(v @ rv)
  nb = -(-t // fmt.BLOCK)
  ours, theirs, live = dict(kw), dict(kw), np.ones((t,), bool)
  if kw.get("block_len") == "bl":
    bl = np.random.default_rng(0).integers(20, 65, nb).astype(np.int32)
    live = (np.arange(t) % fmt.BLOCK) < bl[np.arange(t) // fmt.BLOCK]
    kr, vr = kr * live[None, :, None, None], vr * live[None, :, None, None]
    ours["block_len"], theirs["block_len"] = jnp.asarray(bl), torch.from_numpy(bl)
  if kw.get("key_bias") == "kb":
    kb = np.asarray(_key_bias(t))
    ours["key_bias"], theirs["key_bias"] = jnp.asarray(kb), torch.from_numpy(kb.copy())
  if "sm_scale" in theirs:
    theirs["scale"] = theirs.pop("sm_scale")
  packed = _quantize(jnp.asarray(kr), jnp.asarray(vr), fmt.PackedKVMeta(1, H, d, t, (2,) * nb))
  out = np.asarray(_reference(jnp.asarray(qr, jnp.bfloat16), packed, ours))
  caller = (qr @ rk.T, kr @ rk.T, vr @ rv.T)   # exact in float32 up to rounding: R is orthogonal
  want = eager.sol_attn(*(torch.from_numpy(np.ascontiguousarray(x, np.float32)) for x in caller), **theirs).numpy()
  # Format v2 stores the block stats (K means, V sums) in bf16 where comfy-kitchen keeps
  # float32: most settings agree to ~1e-4, and a near-tie top-k choice can move one
  # block between exact and pooled (rel L1 3e-3 with topk_ratio 0.3). With float32
  # stats (format v1) all six agreed to 1e-5.
  got = quality(out[:, live], want[:, live])
  assert got["rel_l1"] < 5e-3 and got["cos"] > 0.9998, got


def test_tau_moves_monotonically_toward_dense():
  q, packed, _, _ = _data(700, 128)
  dense_ref = dense.packed_attention_reference(q, packed)
  prev_exact, prev_err = None, np.inf
  for tau in (3.0, 1.5, 1.0, 0.0, -1.0, -2.0, -1e9):
    out, exact = _reference(q, packed, tau=tau), np.asarray(_exact(q, packed, tau=tau))
    if prev_exact is not None:
      assert (exact >= prev_exact).all(), f"tau={tau} dropped a block a higher tau kept"
    err = quality(out, dense_ref)["rel_l1"]
    assert err <= prev_err + 1e-6, (tau, err, prev_err)
    prev_exact, prev_err = exact, err
  assert exact.all() and prev_err < 1e-5
  # The kernel follows the reference at both ends of the sweep.
  _check(_attend(q, packed, tau=-1e9), dense_ref, cos=0.9999)


def test_sink_q_rows_equal_dense_attention():
  q, packed, _, _ = _data(700, 128, MIXED)
  dense_ref = np.asarray(dense.packed_attention_reference(q, packed))
  out = np.asarray(_attend(q, packed, tau=2.0, sink_q=[4, 6]), np.float32)
  rows = slice(4 * fmt.BLOCK, 6 * fmt.BLOCK)
  assert quality(out[:, rows], dense_ref[:, rows])["cos"] >= 0.9999
  # ... while the other rows are sparse and differ from dense.
  assert quality(out[:, :4 * fmt.BLOCK], dense_ref[:, :4 * fmt.BLOCK])["cos"] < 0.999
  everything = _attend(q, packed, tau=2.0, sink_q=[0, 100])
  _check(everything, dense_ref, cos=0.9999)


def test_sinks_and_diagonal_are_always_exact():
  q, packed, _, _ = _data(700, 128)
  nb = packed.meta.num_blocks
  exact = _exact(q, packed, tau=50.0, sink_blocks=[1, 3], sink_q=[7, 8])
  i, j = np.meshgrid(np.arange(nb), np.arange(nb), indexing="ij")
  forced = (np.abs(i - j) <= 1) | ((j >= 1) & (j < 3)) | (i == 7)
  np.testing.assert_array_equal(np.asarray(exact), np.broadcast_to(forced, exact.shape))


def test_topk_keeps_its_budget_outside_the_sinks():
  q, packed, _, _ = _data(700, 128)
  nb = packed.meta.num_blocks
  ratio, sinks = 0.3, (0, 2)
  kk = sol.topk_count(nb - 2, ratio)
  assert kk == round(0.3 * 9)
  exact = _exact(q, packed, topk_ratio=ratio, sink_blocks=list(sinks), tau=1e9)
  exact = np.asarray(exact)[..., 2:]              # non-sink columns
  diag = np.abs(np.arange(nb)[:, None] - np.arange(2, nb)[None, :]) <= 1
  per_row = exact.sum(-1)
  assert (per_row >= kk).all() and (per_row <= kk + 3).all()
  assert ((exact & ~diag).sum(-1) <= kk).all()
  assert sol.topk_count(1, 0.5) == 0 and sol.topk_count(10, 0.01) == 1 and sol.topk_count(10, 0.99) == 9


def test_routing_lists_match_reference_chunked_and_bounded():
  q, packed, _, _ = _data(700, 128, MIXED)
  nb = packed.meta.num_blocks
  kw = dict(tau=0.5, sink_blocks=[1, 2], sink_q=[9, 10])
  exact = _exact(q, packed, kw)
  # A tiny chunk budget forces one query block per chunk: same lists as one chunk.
  r = _routing(q, packed, kw, route_chunk_bytes=1)
  r1 = _routing(q, packed, kw)
  np.testing.assert_array_equal(np.asarray(r.blocks), np.asarray(r1.blocks))
  assert r.blocks.dtype == jnp.int16 and r.blocks.shape == (1, H, nb, nb)  # capacity clipped to NB
  blocks, counts = np.asarray(r.blocks), np.asarray(r.counts)
  want = np.asarray(exact).copy()
  want[..., 1:2] = False          # the sink range is walked directly, not listed
  want[..., 9, :] = False         # sink_q rows are dense, no list
  for b in range(1):
    for h in range(H):
      for i in range(nb):
        row = blocks[b, h, i]
        listed = row[:counts[b, h, i]]
        assert (np.diff(listed) > 0).all() and (row[counts[b, h, i]:] == -1).all()
        np.testing.assert_array_equal(listed, np.flatnonzero(want[b, h, i]))
  assert not np.asarray(r.dropped).any()
  expect = sol.routing_nbytes(1, H, 700, 128, nb)["total"]
  assert r.nbytes() == expect


def test_max_exact_cut_keeps_the_best_blocks_and_reports_drops():
  q, packed, _, _ = _data(700, 128)
  kw = dict(tau=-0.5, max_exact=4)
  r = _routing(q, packed, kw)
  dropped, counts = np.asarray(r.dropped), np.asarray(r.counts)
  assert dropped.sum() > 0 and counts.max() == 4
  full = _exact(q, packed, tau=-0.5)
  cut = _exact(q, packed, kw)
  np.testing.assert_array_equal(np.asarray(full).sum(-1) - np.asarray(cut).sum(-1), dropped)
  _check(_attend(q, packed, kw, routing=r), _reference(q, packed, kw))
  # The routing metadata does not grow with the square of T: capacity is fixed.
  assert r.blocks.shape[-1] == 4
  big = sol.routing_nbytes(1, 56, 152_263, 128, DEFAULT_MAX_EXACT_TAU)
  assert big["blocks"] == 56 * 2380 * 1024 * 2


def test_key_bias_forms_agree():
  q, packed, _, _ = _data(700, 64, MIXED)
  t = 700
  kb = _key_bias(t)
  base = _reference(q, packed, key_bias=kb, sink_blocks=[0, 2])
  for form in (kb[None], kb[None, None, None]):
    np.testing.assert_array_equal(np.asarray(_reference(q, packed, key_bias=form, sink_blocks=[0, 2])),
                                  np.asarray(base))
  mask = np.asarray(jnp.isfinite(kb))
  as_bool = _reference(q, packed, key_bias=jnp.asarray(mask), sink_blocks=[0, 2])
  as_float = _reference(q, packed, key_bias=jnp.where(mask, 0.0, -jnp.inf), sink_blocks=[0, 2])
  np.testing.assert_array_equal(np.asarray(as_bool), np.asarray(as_float))


def test_keep_rotated_is_the_rotated_output():
  q, packed, _, _ = _data(300, 64)
  rot = np.asarray(sol.sol_attention(q, packed, FUSED, keep_rotated=True), np.float32)
  out = np.asarray(sol.sol_attention(q, packed, FUSED), np.float32)
  rv = fmt.hadamard_rotation(64, packed.meta.rotation_seed_v)
  assert quality(rot @ rv.T, out)["cos"] >= 0.9999


def _poison_rows(packed, rows_by_block):
  """NaN into the per-row scales/zeros (token schemes) and bf16 rows of given rows."""
  meta = packed.meta
  arrays = dict(packed.arrays)
  for cls in fmt.CLASSES:
    for slot, blk in enumerate(meta.slots(cls)):
      rows = [slot * fmt.BLOCK + r for r in rows_by_block.get(blk, ())]
      if not rows:
        continue
      for role in ("k", "v"):
        scheme = meta.k_scheme if role == "k" else meta.v_scheme
        if cls == "bf16":
          arrays[f"{role}_bf16"] = arrays[f"{role}_bf16"].at[:, :, rows].set(jnp.nan)
        elif scheme != "channel":
          sfx = "4" if cls == "int4" else "8"
          for part in ("scale", "zero"):
            arrays[f"{role}_{part}{sfx}"] = arrays[f"{role}_{part}{sfx}"].at[..., rows].set(jnp.nan)
  return fmt.PackedKV(meta, arrays)


@pytest.mark.parametrize("method", ["fused", "streamed", "streamed_int8"])
def test_nan_poisoning_of_padding_dead_rows_and_unused_list_entries(method):
  t = 700
  q, packed, block_len, live = _data(t, 128, MIXED, "token", "token", block_len_seed=5)
  nb = packed.meta.num_blocks
  kw = dict(block_len=block_len, tau=0.5, method=method)
  clean = np.asarray(_attend(q, packed, kw), np.float32)[:, live]
  # Dead rows of every block and the padding rows past T.
  dead = {b: [r for r in range(fmt.BLOCK) if b * fmt.BLOCK + r >= t or not live[b * fmt.BLOCK + r]]
          for b in range(nb)}
  poisoned = _poison_rows(packed, dead)
  q_bad = jnp.where(jnp.asarray(live)[None, :, None, None], q, jnp.nan).astype(jnp.bfloat16)
  r = _routing(q_bad, poisoned, kw)
  # List entries past each count are never read: fill them with a real block.
  r = dataclasses.replace(r, blocks=jnp.where(r.blocks < 0, jnp.int16(0), r.blocks))
  out = np.asarray(_attend(q_bad, poisoned, kw, routing=r), np.float32)[:, live]
  assert np.isfinite(out).all()
  np.testing.assert_array_equal(out, clean)


def test_fully_masked_rows_output_zero():
  q, packed, _, _ = _data(300, 64)
  out = sol.sol_attention(q, packed, Sol(tail=False, method="fused"), key_bias=jnp.full((300,), -jnp.inf))
  ref = sol.sol_attention_reference(q, packed, Sol(tail=False), key_bias=jnp.full((300,), -jnp.inf))
  assert not np.asarray(out, np.float32).any() and not np.asarray(ref).any()


@pytest.mark.parametrize("kwargs, match", [
    ({"tau": float("nan")}, "tau"),
    ({"topk_ratio": 1.5}, "topk_ratio"),
    ({"sink_blocks": [3, 1]}, "sink_blocks"),
    ({"sink_q": [0, 1, 2]}, "sink_q"),
    ({"sink_blocks": [-1, 2]}, "non-negative"),
    ({"block_len": np.full((5,), 64, np.int64)}, "block_len"),
    ({"block_len": np.full((4,), 64, np.int32)}, "block_len"),
    ({"key_bias": np.zeros((1, 2, 1, 300), np.float32)}, "key-only"),
    ({"key_bias": np.zeros((299,), np.float32)}, "key_bias"),
    ({"max_exact": 2}, "max_exact"),
    ({"sm_scale": -1.0}, "sm_scale"),
])
def test_bad_arguments_raise(kwargs, match):
  """A bad Sol setting raises at ``Sol(...)`` construction; a bad key bias or block
  length (which depend on the shapes) at the call, in the kernel and the reference."""
  q, packed, _, _ = _data(300, 64)
  settings = {k: v for k, v in kwargs.items() if k not in CALL_KEYS}
  call = {k: v for k, v in kwargs.items() if k in CALL_KEYS}
  assert bool(settings) != bool(call)
  if settings:
    with pytest.raises(ValueError, match=match):
      Sol(**settings)
    return
  for fn in (sol.sol_attention, sol.sol_attention_reference):
    with pytest.raises(ValueError, match=match):
      fn(q, packed, Sol(), **call)


def test_bad_inputs_raise():
  q, packed, _, _ = _data(300, 64)
  with pytest.raises(ValueError, match="self-attention"):
    sol.sol_attention(q[:, :200], packed)
  with pytest.raises(ValueError, match="bfloat16"):
    sol.sol_attention(q.astype(jnp.float32), packed)
  with pytest.raises(ValueError, match="PackedKV"):
    sol.sol_attention(q, {"k": 1})
  other = sol.sol_routing(*_data(700, 64)[:2])
  with pytest.raises(ValueError, match="routing"):
    sol.sol_attention(q, packed, routing=other)
  # The config must be a Sol: a Dense (or a loose dict of settings) names the fix.
  from pallas_kernels.attention_config import Dense
  for bad in (Dense(), {"tau": 0.5}):
    with pytest.raises(ValueError, match=r"attention must be a Sol\(\.\.\.\) config"):
      sol.sol_attention(q, packed, bad)


@pytest.mark.gpu
def test_gpu_kernel_matches_reference():
  """Every kernel case on the device (Triton lowering), plus a longer sequence."""
  for name in CASES:
    out, ref, live = _run_case(name)
    _check(out, ref, live)
  q, packed, _, _ = _data(4000, 128, None, "channel", "token", seed=1)
  for kw in ({}, {"topk_ratio": 0.1, "sink_blocks": [0, 8]}, {"tau": 1.5, "sink_q": [10, 12]}):
    _check(_attend(q, packed, kw), _reference(q, packed, kw))
    for method in STREAMED:
      _check(_attend(q, packed, kw, method=method), _reference(q, packed, kw))
  _check(sol.sol_attention(jnp.array(q, copy=True), packed, FUSED, overwrite_q=True),
         sol.sol_attention_reference(q, packed))
