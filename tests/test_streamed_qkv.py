"""Streamed QKV projection, both methods (chunked: cuBLAS row chunks + the epilogue
kernel; fused: one Pallas kernel): kernel vs the f32 reference, the format, the
memory claim.

CPU runs use Pallas interpret mode, which fills every float output with NaN
before the kernel runs (ints with their minimum), so "all finite" means "all
written". Interpret mode does not enforce Triton's rules, so the Triton IR is
also lowered here (on CPU, for platform cuda), and the gpu-marked test runs it.
"""
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.testing import cosine, rel_err
from formats import packed_kv as fmt
from pallas_kernels import rope
from formats import KVStorage
from pallas_kernels.qkv_projection import (ProjectionTuning, chunk_rows, chunk_scratch_bytes, projected_qkv_f32,
                                           streamed_qkv, streamed_qkv_reference)
from pallas_kernels.qkv_layout import AddedTokens, QKVLayout, QKVWeights


def make_inputs(b=2, t=200, hidden=256, heads=2, head_dim=128, rot_dim=96, bias="f32", seed=0, norm="head",
                rope_style="half", rope_per_head=False):
  """Random bf16 x, W and f32 norm weights (one ``QKVWeights``); per-channel K offsets
  via the bias. The RoPE tables have random angles (each head its own with
  ``rope_per_head``). Returns (x, weights, kw) with kw the layout and tables."""
  rng = np.random.default_rng(seed)
  layout = QKVLayout(heads, head_dim, norm, rope_style, rot_dim, rope_per_head=rope_per_head)
  x = jnp.asarray(rng.normal(size=(b, t, hidden)), jnp.bfloat16)
  w = jnp.asarray(rng.normal(size=(hidden, 3 * heads * head_dim)) / np.sqrt(hidden), jnp.bfloat16)
  bias_arr = None
  if bias is not None:
    bias_arr = jnp.asarray(rng.normal(0.0, 0.5, size=(3 * heads * head_dim,)),
                           jnp.float32 if bias == "f32" else jnp.bfloat16)
  tables = [rope.rope_tables(rng.uniform(0.0, 2 * np.pi, size=(t, rot_dim // 2)), head_dim, rope_style)
            for _ in range(heads if rope_per_head else 1)]
  cos, sin = (np.concatenate([tab[i] for tab in tables], axis=1) for i in (0, 1))
  weight = lambda: (None if norm == "none" else
                    jnp.asarray(1 + 0.3 * rng.normal(size=layout.norm_width), jnp.float32))
  weights = QKVWeights(w, bias_arr, weight(), weight())
  kw = dict(layout=layout, rope_cos=jnp.asarray(cos), rope_sin=jnp.asarray(sin))
  return x, weights, kw


_dequantize = jax.jit(fmt.dequantize_reference)  # eager dispatch would dominate test time


def _unpacked_codes(packed, role, width):
  codes = np.asarray(packed.arrays[f"{role}_codes{width}"])
  if width == 8:
    return codes
  codes = np.asarray(fmt.unpack_nibbles(jnp.asarray(codes))).astype(np.int32)
  if width == 5:
    codes = codes | (np.asarray(fmt.unpack_bits(packed.arrays[f"{role}_bits5"])) << 4)
  return codes


def check_against_reference(q, packed, x, weights, kw, storage=None, added=None):
  """Compare kernel outputs with streamed_qkv_reference; return the reference."""
  q_ref, ref = streamed_qkv_reference(x, weights, **kw, storage=storage, added=added)
  assert packed.meta == ref.meta
  fmt.check_packed(packed)
  # Everything written and finite (interpret mode NaN-fills outputs first).
  for name, arr in [("q", q)] + list(packed.arrays.items()):
    a = np.asarray(arr, np.float32)
    assert np.isfinite(a).all(), f"{name} has non-finite entries (unwritten?)"

  qf, qr = np.asarray(q, np.float32), np.asarray(q_ref, np.float32)
  assert rel_err(qf, qr) < 1e-2 and cosine(qf, qr) > 0.9999

  meta = packed.meta
  for role in "kv":
    for sfx in (4, 5, 8):
      if not meta.store_blocks(role, sfx):
        continue
      ck, cr = _unpacked_codes(packed, role, sfx), _unpacked_codes(ref, role, sfx)
      diff = np.abs(ck.astype(np.int32) - cr.astype(np.int32))
      # Only rounding ties may flip, by one step, and rarely.
      assert diff.max() <= 1, f"{role} {sfx}-bit codes differ by {diff.max()}"
      assert diff.mean() < 2e-3, f"{role} {sfx}-bit codes differ in {diff.mean():.2%}"
      for part in ("scale", "zero"):
        a = np.asarray(packed.arrays[f"{role}_{part}{sfx}"])
        r = np.asarray(ref.arrays[f"{role}_{part}{sfx}"])
        # float16 storage (format v2): a value at a rounding tie may land one ulp away.
        np.testing.assert_allclose(a.astype(np.float32), r.astype(np.float32), rtol=2 ** -10,
                                   atol=1e-5 * np.abs(r.astype(np.float32)).max(), err_msg=f"{role}_{part}{sfx}")
    if meta.store_blocks(role, 16):
      a = np.asarray(packed.arrays[f"{role}_bf16"], np.float32)
      r = np.asarray(ref.arrays[f"{role}_bf16"], np.float32)
      np.testing.assert_allclose(a, r, rtol=2 ** -7, atol=1e-5, err_msg=f"{role}_bf16")
  for name in ("k_mean", "v_sum"):
    a, r = np.asarray(packed.arrays[name], np.float32), np.asarray(ref.arrays[name], np.float32)
    # bfloat16 storage (format v2): at most one ulp apart at rounding ties.
    np.testing.assert_allclose(a, r, rtol=2 ** -7, atol=1e-4 * np.abs(r).max(), err_msg=name)

  # Dequantized K/V: as close to the f32 rotated values as the reference's own.
  _, k32, v32 = projected_qkv_f32(x, weights, **kw, storage=storage, added=added)
  kd, vd = _dequantize(packed)
  kr, vr = _dequantize(ref)
  for name, got, want, full in (("k", kd, kr, k32), ("v", vd, vr, v32)):
    e_kernel, e_ref = rel_err(got, full), rel_err(want, full)
    assert e_kernel <= 1.02 * e_ref + 1e-6, f"{name}: kernel {e_kernel:.3g} vs ref {e_ref:.3g}"
    assert rel_err(got, want) < 0.02
  return q_ref, ref


CASES = [
    # (head_dim, rot_dim, k_scheme, v_scheme, bias, block_classes for T=200, full_width_gemm)
    (128, 96, "channel", "token", "f32", (1, 0, 2, 0), False),
    (64, 48, "token", "token_g64", "bf16", (2, 1, 0, 1), False),
    (128, 128, "token", "token_g64", None, None, True),
    (64, 0, "channel", "token", "f32", (0, 0, 0, 2), True),
]


def rows_scratch(rows, x, heads, head_dim):
  """scratch_bytes that makes the chunked method use ``rows``-row chunks."""
  return chunk_scratch_bytes(rows, x.shape[2], 3 * heads * head_dim)


@pytest.mark.parametrize("head_dim,rot_dim,k_scheme,v_scheme,bias,classes,full_width", CASES)
@pytest.mark.parametrize("method", ["chunked", "fused"])
def test_matches_reference(method, head_dim, rot_dim, k_scheme, v_scheme, bias, classes, full_width):
  x, wt, kw = make_inputs(head_dim=head_dim, rot_dim=rot_dim, bias=bias, seed=head_dim + rot_dim)
  storage = KVStorage(block_classes=classes, k_scheme=k_scheme, v_scheme=v_scheme,
                      rotation_seed_k=3, rotation_seed_v=4)
  # chunked: 128-row chunks over T = 200 (a full chunk, then a ragged one) for both
  # batch rows; or the whole sequence in one padded chunk.
  tune = (dict(tuning=ProjectionTuning(full_width_gemm=full_width)) if method == "fused" else
          dict(scratch_bytes=rows_scratch(128 if full_width else 256, x, 2, head_dim)))
  q, packed = streamed_qkv(x, wt, **kw, storage=storage, interpret=True, method=method, **tune)
  assert q.shape == (2, 200, 2, head_dim) and q.dtype == jnp.bfloat16
  assert packed.meta.rotation_seed_k == 3 and packed.meta.rotation_seed_v == 4
  check_against_reference(q, packed, x, wt, kw, storage)


JOINT = [
    # (own tokens, added tokens, norm, own bias, added bias, rows a chunk, added width)
    (150, 40, "head", "f32", "f32", 64, 96),      # boundary inside a block; chunks before, across, after it
    (128, 70, "across", None, "bf16", 128, 64),   # boundary on a block edge; one part without a bias
    (30, 20, "none", "f32", None, 256, 96),       # one chunk longer than the whole sequence
]


@pytest.mark.parametrize("t_own,t_added,norm,bias,bias_added,rows,hidden_added", JOINT)
def test_joint_projection_matches_reference(t_own, t_added, norm, bias, bias_added, rows, hidden_added):
  """Added tokens (joint text+video attention) through their own weights into the same
  Q and packed K/V: each row's bias and norm weights are its own part's, including the
  rows of the 64-token block that holds both parts."""
  t = t_own + t_added
  x, wt, kw = make_inputs(b=2, t=t, hidden=96, heads=2, head_dim=64, rot_dim=48, bias=bias, seed=41, norm=norm,
                          rope_style="pairs")
  xa, wa, _ = make_inputs(b=2, t=t_added, hidden=hidden_added, heads=2, head_dim=64, rot_dim=48, bias=bias_added,
                          seed=42, norm=norm, rope_style="pairs")
  wa = QKVWeights(wa.w_qkv * 2, wa.bias, *(None if w is None else w[::-1] + 0.5 for w in
                                            (wa.q_norm_weight, wa.k_norm_weight)))
  added = AddedTokens(xa, wa)
  nb = -(-t // 64)
  storage = KVStorage(block_classes=tuple((0, 1, 2)[i % 3] for i in range(nb)))
  scratch = chunk_scratch_bytes(rows, 96, 6 * 64, hidden_added)
  assert chunk_rows(t, 96, 6 * 64, scratch, hidden_added) == min(rows, -(-t // 64) * 64)
  q, packed = streamed_qkv(x[:, :t_own], wt, **kw, storage=storage, added=added, interpret=True,
                           method="chunked", scratch_bytes=scratch)
  assert q.shape == (2, t, 2, 64) and packed.meta.num_tokens == t
  check_against_reference(q, packed, x[:, :t_own], wt, kw, storage, added=added)
  # The added rows are not the own weights' projection of anything: both parts matter.
  q_own, _ = streamed_qkv_reference(x[:, :t_own], wt, layout=kw["layout"], rope_cos=kw["rope_cos"][:t_own],
                                    rope_sin=kw["rope_sin"][:t_own])
  np.testing.assert_array_equal(np.asarray(q[:, :t_own]).view(np.uint16) != 0, True)
  assert cosine(np.asarray(q[:, :t_own], np.float32), np.asarray(q_own, np.float32)) > 0.9999
  with pytest.raises(NotImplementedError, match="chunked method only"):
    streamed_qkv(x[:, :t_own], wt, **kw, storage=storage, added=added, interpret=True, method="fused")
  with pytest.raises(ValueError, match=r"rope_cos must be .* = \(%d, 64\)" % t):
    streamed_qkv(x[:, :t_own], wt, **{**kw, "rope_cos": kw["rope_cos"][:t_own], "rope_sin": kw["rope_sin"][:t_own]},
                 added=added, interpret=True)
  with pytest.raises(ValueError, match="added.x has 1 batch rows, x has 2"):
    streamed_qkv(x[:, :t_own], wt, **kw, added=AddedTokens(xa[:1], wa), interpret=True)
  with pytest.raises(ValueError, match=r"added.weights.w_qkv must be \(hidden, 3\*H\*D\)"):
    streamed_qkv(x[:, :t_own], wt, **kw, added=AddedTokens(xa, QKVWeights(wa.w_qkv[:, :64], wa.bias,
                                                                          wa.q_norm_weight, wa.k_norm_weight)),
                 interpret=True)


LAYOUTS = [
    # (norm, rope style, rot_dim, per-head tables): Wan (RMSNorm across heads, pairs over
    # the whole head), LTX-Video (across heads, pairs, each head its own frequencies),
    # HunyuanVideo (per head, pairs), no norm at all.
    ("across", "pairs", 64, False),
    ("across", "pairs", 64, True),
    ("head", "pairs", 48, False),
    ("head_layer", "pairs", 64, False),   # CogVideoX: LayerNorm per head (weight and bias)
    ("none", "half", 32, False),
]


@pytest.mark.parametrize("norm,rope_style,rot_dim,per_head", LAYOUTS)
def test_layouts_match_reference(norm, rope_style, rot_dim, per_head):
  """Every QK-norm and RoPE layout, chunked (every layout) and fused (where it runs;
  elsewhere it names the chunked method), against the float32 reference."""
  x, wt, kw = make_inputs(b=2, t=150, hidden=96, heads=2, head_dim=64, rot_dim=rot_dim, seed=31, norm=norm,
                          rope_style=rope_style, rope_per_head=per_head)
  storage = KVStorage(block_classes=(1, 0, 2))
  q, packed = streamed_qkv(x, wt, **kw, storage=storage, interpret=True, method="chunked",
                           scratch_bytes=rows_scratch(64, x, 2, 64))
  check_against_reference(q, packed, x, wt, kw, storage)
  if norm in ("across", "head_layer") or per_head:
    with pytest.raises(NotImplementedError, match="use method='chunked'"):
      streamed_qkv(x, wt, **kw, storage=storage, interpret=True, method="fused")
  else:
    q, packed = streamed_qkv(x, wt, **kw, storage=storage, interpret=True, method="fused")
    check_against_reference(q, packed, x, wt, kw, storage)


def test_layout_reference_matches_the_models_own_formulas():
  """The layout's reference is the models' math: Wan's RMSNorm over all H*D channels
  and its complex-multiply RoPE on adjacent pairs, written out independently."""
  rng = np.random.default_rng(0)
  b, t, h, d = 1, 5, 3, 64
  z = rng.normal(size=(b, t, h, d)).astype(np.float32)
  wgt = rng.normal(size=(h * d,)).astype(np.float32)
  ang = rng.uniform(0, 6, size=(t, d // 2))
  layout = QKVLayout(h, d, "across", "pairs", d, eps=1e-6)
  from pallas_kernels.qkv_layout import rms_norm_reference
  flat = z.reshape(b, t, h * d)
  want = (flat / np.sqrt(np.mean(flat ** 2, -1, keepdims=True) + 1e-6) * wgt).reshape(b, t, h, d)
  np.testing.assert_allclose(np.asarray(rms_norm_reference(jnp.asarray(z), wgt, layout)), want, rtol=1e-5,
                             atol=1e-6)
  cos, sin = rope.rope_tables(ang, d, "pairs")
  c = z[..., 0::2] + 1j * z[..., 1::2]
  r = c * np.exp(1j * ang)[None, :, None, :]
  want = np.stack([r.real, r.imag], -1).reshape(b, t, h, d)
  got = rope.apply_rope_reference(z, cos, sin, d, "pairs")
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
  # CogVideoX's LayerNorm over each head (torch's own), weight then bias in one vector.
  import torch
  ln = torch.nn.LayerNorm(d, eps=1e-6)
  with torch.no_grad():
    ln.weight.normal_()
    ln.bias.normal_()
    want = ln(torch.from_numpy(z)).numpy()
  params = np.concatenate([ln.weight.detach().numpy(), ln.bias.detach().numpy()])
  got = rms_norm_reference(jnp.asarray(z), params, QKVLayout(h, d, "head_layer", "pairs", d, eps=1e-6))
  np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("tuning", [
    # 2 Q heads per program; int4 has 3 slots (odd: the last program repeats one).
    dict(q_heads_per_program=2, kv_blocks_per_program=2),
    dict(q_heads_per_program=4, kv_blocks_per_program=2, full_width_gemm=False, block_q=64),
])
def test_programs_with_several_heads_or_blocks(tuning):
  """q_heads_per_program / kv_blocks_per_program vs the reference: every class,
  both scale schemes, a bias, a ragged last block and the duplicate-slot case."""
  heads = tuning["q_heads_per_program"]
  x, wt, kw = make_inputs(b=1, t=200, hidden=96, heads=heads, head_dim=64, rot_dim=48, seed=21)
  storage = KVStorage(block_classes=(0, 1, 0, 0) if heads == 2 else (2, 0, 1, 2),
                      k_scheme="channel" if heads == 2 else "token",
                      v_scheme="token" if heads == 2 else "token_g64")
  q, packed = streamed_qkv(x, wt, **kw, storage=storage, interpret=True, method="fused",
                           tuning=ProjectionTuning(**tuning))
  check_against_reference(q, packed, x, wt, kw, storage)


def test_chunks_of_one_block_and_poisoned_buffers():
  """64-row chunks (the fori_loop runs), every class, ragged T; the chunked method
  writes into given buffers (NaN Q and stats, 0xFF codes) and leaves nothing of them."""
  from pallas_kernels import qkv_projection as sq
  from pallas_kernels.qkv_ops import epilogue_constants
  t = 330
  ranges = [(0, 60, "bf16"), (130, 200, "int8")]
  storage = KVStorage(token_ranges=ranges, k_scheme="channel", v_scheme="token_g64")
  assert storage.classes_for(t) == fmt.resolve_block_classes(t, ranges)
  x, wt, kw = make_inputs(b=2, t=t, hidden=96, heads=2, head_dim=64, rot_dim=48, seed=3)
  assert chunk_rows(t, 96, 3 * 2 * 64, rows_scratch(64, x, 2, 64)) == 64
  q, packed = streamed_qkv(x, wt, **kw, storage=storage, interpret=True, method="chunked",
                           scratch_bytes=rows_scratch(64, x, 2, 64))
  check_against_reference(q, packed, x, wt, kw, storage)
  meta = packed.meta
  assert meta.block_classes == storage.classes_for(t)
  poison = {"q": jnp.full(q.shape, jnp.nan, jnp.bfloat16)}
  for name, (shape, dtype) in fmt.buffer_specs(meta).items():
    if np.prod(shape):   # the stores that have blocks
      poison[name] = jnp.full(shape, 255 if dtype == "uint8" else jnp.nan, dtype)
  consts = epilogue_constants(kw["layout"], 0, 1, wt.q_norm_weight, wt.k_norm_weight)
  q2, packed2 = jax.jit(lambda x, w, b, cos, sin, init: sq._chunked(
      x, w, b, cos, sin, consts, meta, rows=64, interpret=True, init=init))(
          x, wt.w_qkv, wt.bias, kw["rope_cos"], kw["rope_sin"], poison)
  np.testing.assert_array_equal(np.asarray(q2, np.float32), np.asarray(q, np.float32))
  for name in fmt.ARRAY_NAMES:
    np.testing.assert_array_equal(np.asarray(packed2.arrays[name]), np.asarray(packed.arrays[name]),
                                  err_msg=name)


def test_mixed_policy_and_padded_tail():
  """int4 + int8 + bf16 blocks from a token-range policy; the ragged tail is zeros."""
  t = 200
  ranges = [(0, 40, "bf16"), (70, 100, "int8"), (195, 200, "bf16")]
  classes = fmt.resolve_block_classes(t, ranges)
  assert set(classes) == {0, 1, 2} and classes[-1] == 2
  storage = KVStorage(token_ranges=ranges)
  assert storage.classes_for(t) == classes
  x, wt, kw = make_inputs(t=t, head_dim=64, rot_dim=48, hidden=96, seed=7)  # ragged hidden
  q, packed = streamed_qkv(x, wt, **kw, storage=storage, interpret=True, method="fused",
                           tuning=ProjectionTuning(block_q=64, block_h=64, full_width_gemm=True))
  assert packed.meta.block_classes == classes
  check_against_reference(q, packed, x, wt, kw, storage)
  q2, packed2 = streamed_qkv(x, wt, **kw, storage=storage, interpret=True, method="chunked",
                             scratch_bytes=rows_scratch(128, x, 2, 64))
  check_against_reference(q2, packed2, x, wt, kw, storage)
  # The tail block (tokens 192..255, 8 live) is bf16: rows past T must be exact zeros
  # although the bias makes the projection of a zero row nonzero.
  last = packed.meta.slots("bf16").index(len(classes) - 1)
  for p in (packed, packed2):
    for role in "kv":
      store = np.asarray(p.arrays[f"{role}_bf16"], np.float32)
      tail = store[:, :, last * 64 + 8:(last + 1) * 64]
      assert tail.size and not tail.any()


@pytest.mark.parametrize("head_dim,k_scheme,v_scheme,classes", [
    (128, "channel", "token", (3, 0, 4, 3)),
    (64, "token", "token_g64", (4, 1, 3, 2)),
])
def test_split_classes_match_reference(head_dim, k_scheme, v_scheme, classes):
  """k5v4 / k5v5 blocks (5-bit stores, K and V at their own widths) beside the other
  classes: the chunked epilogue writes what the reference writes (T = 200, a ragged
  last block), and method='auto' routes them to it."""
  x, wt, kw = make_inputs(head_dim=head_dim, rot_dim=head_dim // 2, seed=head_dim + 5)
  storage = KVStorage(block_classes=classes, k_scheme=k_scheme, v_scheme=v_scheme)
  q, packed = streamed_qkv(x, wt, **kw, storage=storage, interpret=True,
                           scratch_bytes=rows_scratch(128, x, 2, head_dim))
  assert packed.k_bits5.shape == (2, 2, 64 * sum(c in (3, 4) for c in classes), head_dim // 8)
  assert packed.v_bits5.shape[2] == 64 * classes.count(4)
  check_against_reference(q, packed, x, wt, kw, storage)
  with pytest.raises(NotImplementedError, match="chunked method only"):
    streamed_qkv(x, wt, **kw, storage=storage, interpret=True, method="fused")


def test_padded_tokens_token_scheme():
  """Per-token params of padded tokens follow the format: scale 1, zero 0, codes 0."""
  x, wt, kw = make_inputs(b=1, t=40, head_dim=64, rot_dim=32, seed=11)
  storage = KVStorage(k_scheme="token", v_scheme="token_g64")
  for method in ("chunked", "fused"):
    q, packed = streamed_qkv(x, wt, **kw, storage=storage, interpret=True, method=method)
    check_against_reference(q, packed, x, wt, kw, storage)
    for role in "kv":
      assert (np.asarray(packed.arrays[f"{role}_scale4"])[..., 40:] == 1).all()
      assert (np.asarray(packed.arrays[f"{role}_zero4"])[..., 40:] == 0).all()
      assert (np.asarray(packed.arrays[f"{role}_codes4"])[:, :, 40:] == 0).all()


def test_defaults_and_empty_classes():
  x, wt, kw = make_inputs(b=1, t=64, hidden=64, heads=1, head_dim=64, rot_dim=48, bias=None)
  assert wt.bias is None
  q, packed = streamed_qkv(x, wt, **kw, interpret=True)
  assert packed.meta == fmt.PackedKVMeta(1, 1, 64, 64, (0,))
  assert packed.meta == KVStorage().meta(1, 1, 64, 64)
  fmt.check_packed(packed)
  assert packed.k_codes8.shape == (1, 1, 0, 64) and packed.v_bf16.shape == (1, 1, 0, 64)


# ---------------------------------------------------------------------------------------
# Bad inputs
# ---------------------------------------------------------------------------------------
_STORAGE_ARGS = ("block_classes", "k_scheme", "v_scheme", "rotation_seed_k", "rotation_seed_v")


def _bad(**changes):
  x, wt, kw = make_inputs(b=1, t=70, hidden=64, heads=1, head_dim=64, rot_dim=32)
  args = dict(x=x, w_qkv=wt.w_qkv, bias=wt.bias, q_norm_weight=wt.q_norm_weight, k_norm_weight=wt.k_norm_weight,
              **kw)
  args.update(changes)
  return args


def _bad_call(fn, args):
  """Call ``fn`` (streamed_qkv or its reference) with the loose test arguments packed
  into the new values: weights (unless ``weights`` overrides them) and storage (built
  here, so a bad storage setting raises at its construction)."""
  args = dict(args)
  x = args.pop("x")
  weights = QKVWeights(args.pop("w_qkv"), args.pop("bias"), args.pop("q_norm_weight"), args.pop("k_norm_weight"))
  weights = args.pop("weights", weights)
  loose = {k: args.pop(k) for k in _STORAGE_ARGS if k in args}
  if loose:
    args["storage"] = KVStorage(**loose)
  return fn(x, weights, **args)


@pytest.mark.parametrize("changes,match", [
    (lambda a: dict(x=a["x"].astype(jnp.float32)), "x must be bfloat16"),
    (lambda a: dict(x=a["x"][0]), r"x must be \(B, T, hidden\)"),
    (lambda a: dict(w_qkv=a["w_qkv"].astype(jnp.float32)), "w_qkv must be a 2-D bfloat16"),
    (lambda a: dict(w_qkv=a["w_qkv"][:32]), r"w_qkv must be \(hidden, 3\*H\*D\)"),
    (lambda a: dict(w_qkv=a["w_qkv"][:, :100]), r"w_qkv must be \(hidden, 3\*H\*D\)"),
    (lambda a: dict(layout=QKVLayout.h3(2, 64, 32)), r"w_qkv must be \(hidden, 3\*H\*D\)"),
    (lambda a: dict(layout="h3"), "layout must be a QKVLayout"),
    (lambda a: dict(rope_cos=a["rope_cos"][:, :32]), r"rope_cos must be \(T, D\)"),
    (lambda a: dict(rope_sin=a["rope_sin"][:60]), r"rope_sin must be \(T, D\)"),
    (lambda a: dict(layout=QKVLayout(1, 64, "across", "half", 32), q_norm_weight=jnp.ones((32,))),
     r"q_norm_weight must be \(64,\) for norm='across'"),
    (lambda a: dict(layout=QKVLayout(1, 64, "none", "half", 32)), "q_norm_weight given, but the layout has norm='none'"),
    (lambda a: dict(layout=QKVLayout(1, 64, "head", "pairs", 32, rope_per_head=True), rope_cos=a["rope_cos"][:, :32]),
     r"rope_cos must be \(T, H\*D\)"),
    # T = 70 has 2 blocks: a storage of one block fails at the call, naming both counts.
    (lambda a: dict(block_classes=(0,)), "block_classes has 1 entries but T = 70 has 2 blocks"),
    # Bad storage settings fail at KVStorage(...) construction.
    (lambda a: dict(block_classes=(0, 5)), "unknown precision class 5"),
    (lambda a: dict(k_scheme="group"), "k_scheme 'group' unknown"),
    (lambda a: dict(bias=a["bias"][:10]), r"bias must be \(3\*H\*D,\)"),
    (lambda a: dict(q_norm_weight=jnp.ones((32,))), r"q_norm_weight must be \(64,\) for norm='head'"),
    (lambda a: dict(x=a["x"][:, :0], rope_cos=a["rope_cos"][:0], rope_sin=a["rope_sin"][:0]),
     "x has an empty axis"),
    (lambda a: dict(x=a["x"][:0]), "x has an empty axis"),
    (lambda a: dict(weights=a["w_qkv"]), "weights must be a QKVWeights"),
    (lambda a: dict(storage=(0, 0)), "storage must be a formats.KVStorage"),
])
def test_bad_inputs(changes, match):
  args = _bad()
  args.update(changes(args))
  with pytest.raises(ValueError, match=match):
    _bad_call(lambda *a, **k: streamed_qkv(*a, **k, interpret=True), args)
  with pytest.raises(ValueError, match=match):
    _bad_call(streamed_qkv_reference, args)


@pytest.mark.parametrize("make,match", [
    (lambda: QKVLayout(1, 96), "head_dim=96 is not supported"),
    (lambda: QKVLayout(0, 64), "heads must be a positive int"),
    (lambda: QKVLayout.h3(1, 64, 31), "rot_dim must be even"),
    (lambda: QKVLayout.h3(1, 64, 66), "rot_dim must be even"),
    (lambda: QKVLayout(1, 64, norm="layer"), "norm must be one of"),
    (lambda: QKVLayout(1, 64, rope="complex"), "rope must be one of"),
    (lambda: QKVLayout(1, 64, eps=0.0), "eps must be positive"),
    (lambda: QKVLayout.from_json("{bad"), "expected QKVLayout.to_json"),
    (lambda: ProjectionTuning(gemm_dtype="float16"), "gemm_dtype must be"),
    (lambda: ProjectionTuning(epilogue_num_warps=3), "epilogue_num_warps must be"),
])
def test_bad_layout_and_tuning(make, match):
  """Configs validate themselves once, at construction."""
  with pytest.raises(ValueError, match=match):
    make()


def test_bad_tiles():
  x, wt, kw = make_inputs(b=1, t=70, hidden=64, heads=1, head_dim=64, rot_dim=32)
  # Tiles a kernel cannot run fail at ProjectionTuning(...) construction ...
  with pytest.raises(ValueError, match="block_q must be a power of two"):
    ProjectionTuning(block_q=96)
  with pytest.raises(ValueError, match="q_heads_per_program must be 1, 2 or 4"):
    ProjectionTuning(q_heads_per_program=3)
  with pytest.raises(ValueError, match="kv_blocks_per_program must be 1 or 2"):
    ProjectionTuning(kv_blocks_per_program=4)
  # ... what depends on the inputs (the head count, the scratch) at the call.
  with pytest.raises(ValueError, match="q_heads_per_program=2 must divide heads=1"):
    streamed_qkv(x, wt, **kw, interpret=True, tuning=ProjectionTuning(q_heads_per_program=2))
  with pytest.raises(ValueError, match="tuning must be a ProjectionTuning"):
    streamed_qkv(x, wt, **kw, interpret=True, tuning=dict(block_q=64))
  with pytest.raises(ValueError, match="method must be one of"):
    streamed_qkv(x, wt, **kw, interpret=True, method="cublas")
  with pytest.raises(ValueError, match="holds no 64-row chunk"):
    streamed_qkv(x, wt, **kw, interpret=True, method="chunked", scratch_bytes=1000)
  with pytest.raises(ValueError, match="scratch_bytes must be >= 0"):
    streamed_qkv(x, wt, **kw, interpret=True, scratch_bytes=-1)
  # auto falls back to the fused kernel when no chunk fits
  q, packed = streamed_qkv(x, wt, **kw, interpret=True, scratch_bytes=1000)
  check_against_reference(q, packed, x, wt, kw)

# ---------------------------------------------------------------------------------------
# Triton lowering (on CPU) and the no-full-QKV memory claim
# ---------------------------------------------------------------------------------------
def _abstract(b, t, hidden, heads, head_dim, rot_dim, bias=True):
  sd = jax.ShapeDtypeStruct
  nw, tab = sd((head_dim,), jnp.float32), sd((t, head_dim), jnp.float32)
  x, w = sd((b, t, hidden), jnp.bfloat16), sd((hidden, 3 * heads * head_dim), jnp.bfloat16)
  bias = sd((3 * heads * head_dim,), jnp.float32) if bias else None
  layout = QKVLayout.h3(heads, head_dim, rot_dim)
  return x, QKVWeights(w, bias, nw, nw), dict(rope_cos=tab, rope_sin=tab, layout=layout)


def _trace(x, weights, kw, **call_kw):
  """``streamed_qkv`` (settings bound, arrays abstract) under jit, traced."""
  layout = kw["layout"]
  fn = jax.jit(lambda x, weights, cos, sin: streamed_qkv(x, weights, layout=layout, rope_cos=cos, rope_sin=sin,
                                                         **call_kw))
  return fn.trace(x, weights, kw["rope_cos"], kw["rope_sin"])


_MULTI = dict(q_heads_per_program=2, kv_blocks_per_program=2)


@pytest.mark.parametrize("head_dim,rot_dim,k_scheme,v_scheme,hidden,bias,tuning", [
    (128, 96, "channel", "token", 256, True, dict(full_width_gemm=False)),
    (128, 96, "channel", "token", 256, False, dict(full_width_gemm=True)),
    (64, 48, "token", "token_g64", 96, False, dict(full_width_gemm=False)),
    (64, 48, "token", "token_g64", 96, True, dict(full_width_gemm=True)),
    (128, 96, "channel", "token", 256, True, dict(full_width_gemm=True, **_MULTI)),
    (64, 48, "token", "token_g64", 96, True, dict(full_width_gemm=False, **_MULTI)),
])
def test_lowers_to_triton_ir(head_dim, rot_dim, k_scheme, v_scheme, hidden, bias, tuning):
  """The Triton lowering rejects what interpret mode allows (value slices, `other`
  without `mask`...). It runs on CPU when lowering for platform cuda."""
  x, wt, kw = _abstract(1, 200, hidden, 2, head_dim, rot_dim, bias)
  storage = KVStorage(block_classes=(0, 1, 2, 0), k_scheme=k_scheme, v_scheme=v_scheme)
  lowered = _trace(x, wt, kw, storage=storage, interpret=False, method="fused",
                   tuning=ProjectionTuning(**tuning)).lower(lowering_platforms=("cuda",))
  assert lowered.as_text().count("__gpu$xla.gpu.triton") == 4  # Q + three classes


@pytest.mark.parametrize("head_dim,rot_dim,k_scheme,v_scheme,bias", [
    (128, 96, "channel", "token", True), (64, 48, "token", "token_g64", False)])
def test_chunked_epilogue_lowers_to_triton_ir(head_dim, rot_dim, k_scheme, v_scheme, bias):
  """B = 2, 128-row chunks over T = 200 (the last one shifted to end at the last
  block): one loop over every chunk of both batch rows, every class in one kernel,
  and the kernel that creates the uninitialized buffers."""
  x, wt, kw = _abstract(2, 200, 256, 2, head_dim, rot_dim, bias)
  storage = KVStorage(block_classes=(0, 1, 2, 3) if bias else (4, 1, 2, 3), k_scheme=k_scheme, v_scheme=v_scheme)
  text = _trace(x, wt, kw, storage=storage, interpret=False, method="chunked",
                scratch_bytes=chunk_scratch_bytes(128, 256, 6 * head_dim)).lower(
                    lowering_platforms=("cuda",)).as_text()
  assert text.count("__gpu$xla.gpu.triton") == 2 and "qkv_epilogue" in text and "qkv_buffers" in text


@pytest.mark.parametrize("norm", ["head", "across", "head_layer"])
def test_joint_epilogue_lowers_to_triton_ir(norm):
  """Added tokens: the per-row choice of bias and norm weights lowers for CUDA, and the
  chunk loop holds the switch between the parts' GEMMs."""
  sd = jax.ShapeDtypeStruct
  heads, head_dim, t_own, t_added = 2, 64, 150, 40
  layout = QKVLayout(heads, head_dim, norm, "pairs", 48)
  nw = sd((layout.norm_width,), jnp.float32)
  w = lambda hidden: QKVWeights(sd((hidden, 3 * heads * head_dim), jnp.bfloat16),
                                sd((3 * heads * head_dim,), jnp.float32), nw, nw)
  tab = sd((t_own + t_added, head_dim), jnp.float32)
  fn = jax.jit(lambda x, wt, xa, wa, cos, sin: streamed_qkv(
      x, wt, layout=layout, rope_cos=cos, rope_sin=sin, added=AddedTokens(xa, wa), interpret=False,
      method="chunked", scratch_bytes=chunk_scratch_bytes(64, 96, 6 * head_dim, 64)))
  text = fn.trace(sd((1, t_own, 96), jnp.bfloat16), w(96), sd((1, t_added, 64), jnp.bfloat16), w(64), tab,
                  tab).lower(lowering_platforms=("cuda",)).as_text()
  assert "qkv_epilogue" in text and "case" in text


_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "f64": 8, "s32": 4, "u32": 4, "s8": 1, "u8": 1,
          "i32": 4, "ui32": 4, "i8": 1, "ui8": 1, "i1": 1, "pred": 1, "s64": 8, "i64": 8}


def stablehlo_tensors(text):
  """(bytes, type) of every tensor type in a StableHLO module."""
  out = []
  for dims, dtype in re.findall(r"tensor<((?:\d+x)*)(\w+)>", text):
    n = int(np.prod([int(d) for d in dims.split("x") if d])) if dims else 1
    out.append((n * _BYTES.get(dtype, 4), f"{dims}{dtype}"))
  return out


def hlo_buffers(text):
  """(bytes, type) of every instruction result outside fusion bodies: the buffers."""
  fused = set(re.findall(r"calls=(%[\w.\-]+)", text))
  out, comp = [], None
  for line in text.splitlines():
    head = re.match(r"^(?:ENTRY )?(%[\w.\-]+) ", line)
    if head and line.rstrip().endswith("{"):
      comp = head.group(1)
      continue
    if comp is None or comp in fused:
      continue
    inst = re.match(r"^\s*(?:ROOT )?%[\w.\-]+ = (.*?) [\w\-]+\(", line)
    if inst:
      for dtype, dims in re.findall(r"\b(\w+)\[([0-9,]*)\]", inst.group(1)):
        if dtype in _BYTES:
          n = int(np.prod([int(d) for d in dims.split(",") if d])) if dims else 1
          out.append((n * _BYTES[dtype], f"{dtype}[{dims}]"))
  return out


def big_buffers(buffers, threshold, allowed):
  return sorted({ty for size, ty in buffers if size >= threshold and ty not in allowed})


def anti_pattern(x, weights, rope_cos=None, rope_sin=None, *, layout):
  """BF16 QKV, then quantize: the allocation the kernel exists to avoid."""
  heads, head_dim = layout.heads, layout.head_dim
  b, t, _ = x.shape
  y = (x @ weights.w_qkv).reshape(b, t, 3, heads, head_dim)
  meta = fmt.PackedKVMeta(b, heads, head_dim, t, (0,) * (-(-t // 64)))
  return y[:, :, 0], fmt.quantize_reference(y[:, :, 1], y[:, :, 2], meta)


def _trace_anti(x, weights, kw):
  return jax.jit(anti_pattern, static_argnames=("layout",)).trace(x, weights, **kw)


# Sizes chosen so that one head-sized bf16 (T, H, D) tensor, the threshold, is larger
# than x, W, the RoPE tables and the interpreter's padded per-program blocks.
MEM = dict(b=1, t=512, hidden=64, head_dim=64, rot_dim=32)


def _mem_case(heads):
  x, wt, kw = _abstract(MEM["b"], MEM["t"], MEM["hidden"], heads, MEM["head_dim"], MEM["rot_dim"], bias=False)
  q_bytes = MEM["b"] * MEM["t"] * heads * MEM["head_dim"] * 2
  q_types = {"bf16[%d,%d,%d,%d]" % (MEM["b"], MEM["t"], heads, MEM["head_dim"]),
             "%dx%dx%dx%dxbf16" % (MEM["b"], MEM["t"], heads, MEM["head_dim"])}
  return x, wt, kw, q_bytes, q_types


def _method_kw(method, heads):
  """The fused kernel, or the chunked method with 64-row chunks (its f32 scratch is then
  smaller than one head-sized bf16 tensor at these sizes)."""
  if method == "fused":
    return dict(method="fused")
  return dict(method="chunked", scratch_bytes=chunk_scratch_bytes(64, MEM["hidden"], 3 * heads * MEM["head_dim"]))


@pytest.mark.parametrize("method", ["chunked", "fused"])
def test_no_full_qkv_in_gpu_program(method):
  """The program XLA gets on the GPU (lowered for cuda, on CPU): no tensor as large as
  a bf16 K, except Q. The anti-pattern fails the same check."""
  x, wt, kw, q_bytes, q_types = _mem_case(8)
  text = _trace(x, wt, kw, interpret=False, **_method_kw(method, 8)).lower(
      lowering_platforms=("cuda",)).as_text()
  assert big_buffers(stablehlo_tensors(text), q_bytes, q_types) == []
  bad = _trace_anti(x, wt, kw).lower(lowering_platforms=("cuda",)).as_text()
  assert big_buffers(stablehlo_tensors(bad), q_bytes, q_types) != []


def test_no_full_qkv_in_compiled_interpret():
  """Compiled (interpret mode, XLA:CPU), the fused kernel: no buffer as large as a bf16
  K except Q, and temp memory grows per head by about one Q slice (the interpreter's
  NaN-filled Q), not by a full K, V or QKV. The anti-pattern fails both checks.
  (The chunked method's interpreter copies every aliased output through its loop, so
  its CPU temp says nothing about the GPU: ``test_gpu_chunked_program_stays_within
  _the_budget_at_h3_shapes`` checks the compiled GPU program instead.)"""
  method = "fused"
  compiled, temps = {}, {}
  for heads in (8, 16):
    x, wt, kw, q_bytes, q_types = _mem_case(heads)
    for name, trace in (("kernel", lambda: _trace(x, wt, kw, **_method_kw(method, heads))),
                        ("anti", lambda: _trace_anti(x, wt, kw))):
      c = trace().lower().compile()
      compiled[name, heads] = (c, q_bytes, q_types)
      temps[name, heads] = c.memory_analysis().temp_size_in_bytes
  c, q_bytes, q_types = compiled["kernel", 16]
  assert big_buffers(hlo_buffers(c.as_text()), q_bytes, q_types) == []
  c, q_bytes, q_types = compiled["anti", 16]
  assert big_buffers(hlo_buffers(c.as_text()), q_bytes, q_types) != []
  dq = compiled["kernel", 16][1] - compiled["kernel", 8][1]
  assert temps["kernel", 16] - temps["kernel", 8] < 1.5 * dq, temps
  assert temps["anti", 16] - temps["anti", 8] > 3 * dq, temps


# ---------------------------------------------------------------------------------------
# GPU (Triton, not interpreted)
# ---------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("head_dim,rot_dim,k_scheme,v_scheme,tuning", [
    (128, 96, "channel", "token", {}),
    (128, 96, "channel", "token", dict(full_width_gemm=True, num_warps=8, block_h=128,
                                       num_stages=2)),
    (64, 48, "token", "token_g64", {}),
    (64, 48, "token", "token_g64", dict(block_q=64)),
    (128, 96, "channel", "token", dict(q_heads_per_program=2, kv_blocks_per_program=2)),
    (64, 48, "token", "token_g64", dict(q_heads_per_program=4, kv_blocks_per_program=2,
                                        full_width_gemm=False, num_warps=(4, 8))),
])
def test_gpu_matches_reference(head_dim, rot_dim, k_scheme, v_scheme, tuning):
  """Both methods: the fused kernel with each tuning, the chunked method with 320-row
  chunks (a loop chunk, more, and a ragged tail per batch row)."""
  t = 1000
  x, wt, kw = make_inputs(b=2, t=t, hidden=512, heads=4, head_dim=head_dim, rot_dim=rot_dim, seed=5)
  storage = KVStorage(token_ranges=((0, 100, "bf16"), (300, 420, "int8")), k_scheme=k_scheme, v_scheme=v_scheme)
  q, packed = streamed_qkv(x, wt, **kw, storage=storage, interpret=False, method="fused",
                           tuning=ProjectionTuning(**tuning))
  check_against_reference(q, packed, x, wt, kw, storage)
  # On the GPU, the fused kernel's temp memory holds no K/V-sized buffer at all.
  compiled = _trace(x, wt, kw, storage=storage, interpret=False, method="fused",
                    tuning=ProjectionTuning(**tuning)).lower().compile()
  temp = compiled.memory_analysis().temp_size_in_bytes
  assert temp < x.shape[0] * t * 4 * head_dim * 2, temp
  if not tuning:
    scratch = rows_scratch(320, x, 4, head_dim)
    q, packed = streamed_qkv(x, wt, **kw, storage=storage, interpret=False, method="chunked",
                             scratch_bytes=scratch)
    check_against_reference(q, packed, x, wt, kw, storage)


@pytest.mark.gpu
@pytest.mark.parametrize("budget_mib", [128, 512])
def test_gpu_chunked_program_stays_within_the_budget_at_h3_shapes(budget_mib):
  """Compile (no run) the chunked method at T = 152,263, hidden 5376, 56 x 128: XLA's
  temp memory (one chunk's f32 projection and x slice) stays within the budget."""
  x, wt, kw = _abstract(1, 152263, 5376, 56, 128, 96, bias=False)
  budget = budget_mib << 20
  storage = KVStorage(token_ranges=((0, 4096, "int8"),))
  compiled = _trace(x, wt, kw, storage=storage, interpret=False, method="chunked",
                    scratch_bytes=budget).lower().compile()
  temp = compiled.memory_analysis().temp_size_in_bytes
  assert temp <= budget, f"temp {temp / 2**20:.1f} MiB > budget {budget_mib} MiB"


@pytest.mark.gpu
def test_gpu_joint_projection_matches_reference():
  """Added tokens on the GPU: 3,000 video-like and 256 text-like tokens of another width,
  several chunks with one across the boundary, against the float32 reference."""
  t_own, t_added = 3000, 256
  x, wt, kw = make_inputs(b=1, t=t_own + t_added, hidden=256, heads=4, head_dim=128, rot_dim=128, seed=51,
                          rope_style="pairs")
  xa, wa, _ = make_inputs(b=1, t=t_added, hidden=192, heads=4, head_dim=128, rot_dim=128, seed=52,
                          rope_style="pairs")
  added = AddedTokens(xa, wa)
  storage = KVStorage(token_ranges=((t_own, t_own + t_added, "int8"),))
  q, packed = streamed_qkv(x[:, :t_own], wt, **kw, storage=storage, added=added, interpret=False,
                           method="chunked", scratch_bytes=chunk_scratch_bytes(640, 256, 3 * 4 * 128, 192))
  check_against_reference(q, packed, x[:, :t_own], wt, kw, storage, added=added)


@pytest.mark.gpu
def test_gpu_split_classes_match_reference():
  """The 5-bit stores (k5v4, k5v5) written by the compiled epilogue, every other class
  beside them, several chunks and a ragged tail."""
  x, wt, kw = make_inputs(b=1, t=3000, hidden=256, heads=4, head_dim=128, rot_dim=96, seed=53)
  storage = KVStorage(default="k5v4", token_ranges=((0, 700, "k5v5"), (1000, 1100, "int4"), (2000, 2100, "int8"),
                                                    (2900, 3000, "bf16")))
  q, packed = streamed_qkv(x, wt, **kw, storage=storage, interpret=False, method="chunked",
                           scratch_bytes=chunk_scratch_bytes(640, 256, 3 * 4 * 128))
  check_against_reference(q, packed, x, wt, kw, storage)


def test_bf16_gemm_output_rounds_only_the_projection():
  """gemm_dtype='bfloat16': the chunk is rounded to bf16 before the epilogue, as a BF16
  model's qkv_proj output is. Q stays within bf16 rounding of the f32 reference, codes
  within one step; a wrong dtype names the choices."""
  x, wt, kw = make_inputs(seed=11)
  storage = KVStorage(block_classes=(1, 0, 2, 0))
  q_ref, ref = streamed_qkv_reference(x, wt, **kw, storage=storage)
  q, packed = streamed_qkv(x, wt, **kw, storage=storage, method="chunked",
                           tuning=ProjectionTuning(gemm_dtype="bfloat16"),
                           scratch_bytes=rows_scratch(128, x, kw["layout"].heads, kw["layout"].head_dim))
  qf, qr = np.asarray(q, np.float32), np.asarray(q_ref, np.float32)
  assert np.isfinite(qf).all()
  assert rel_err(qf, qr) < 1e-2 and cosine(qf, qr) > 0.9999
  for role in "kv":
    diff = np.abs(_unpacked_codes(packed, role, 4).astype(np.int32) -
                  _unpacked_codes(ref, role, 4).astype(np.int32))
    assert diff.max() <= 1 and diff.mean() < 0.05
  with pytest.raises(ValueError, match="gemm_dtype must be"):
    ProjectionTuning(gemm_dtype="float16")
