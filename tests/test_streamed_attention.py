"""The streamed dense path's pieces: the head-group decode kernel against its reference,
the byte budget, and the bound on what the program holds.

``tests/test_attention.py`` runs the whole streamed path against the attention
reference (with XLA's attention in place of cuDNN on the CPU); the GPU tests here run
cuDNN and check the compiled program's memory at H3 shapes.
"""
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import formats as fmt
from pallas_kernels import attention as attn
from pallas_kernels.kv_dequant import dequantize_group, dequantize_group_reference


@pytest.fixture
def seed():
  """Fixed by default so a failure reproduces; PACKED_KV_TEST_SEED=<int> picks another, =random a fresh one."""
  value = os.environ.get("PACKED_KV_TEST_SEED", "0")
  seed = int.from_bytes(os.urandom(4), "little") if value.strip().lower() == "random" else int(value)
  print(f"seed={seed} (rerun with PACKED_KV_TEST_SEED={seed})")
  return seed


def _packed(seed, *, batch=2, t=300, heads=4, head_dim=128, k_scheme="channel", v_scheme="token", ranges=()):
  rng = np.random.default_rng(seed)
  k = rng.normal(size=(batch, t, heads, head_dim)) + rng.normal(size=head_dim)
  v = rng.normal(size=(batch, t, heads, head_dim))
  meta = fmt.PackedKVMeta(batch, heads, head_dim, t, fmt.resolve_block_classes(t, ranges), k_scheme, v_scheme,
                          rotation_seed_v=seed % 89 + 1)
  return fmt.quantize_reference(jnp.asarray(k, jnp.float32), jnp.asarray(v, jnp.float32), meta)


_decode = jax.jit(dequantize_group, static_argnames=("heads", "unrotate_v", "interpret"))


@pytest.mark.parametrize("head_dim,k_scheme,v_scheme,t,ranges", [
    (128, "channel", "token", 300, ((0, 64, "int8"), (100, 130, "bf16"))),   # every class, ragged T
    (64, "token", "token_g64", 200, ((64, 150, "int8"),)),
    (128, "channel", "token", 256, ()),                                     # int4 only, whole blocks
    (128, "channel", "token", 300, ((0, 64, "k5v5"), (64, 190, "k5v4"), (250, 260, "int8"))),  # 5-bit stores
    (64, "token", "token_g64", 200, ((0, 10, "bf16"), (64, 150, "k5v5"))),
])
@pytest.mark.parametrize("unrotate_v", [True, False])
def test_decode_matches_reference(seed, head_dim, k_scheme, v_scheme, t, ranges, unrotate_v):
  """Equal up to one bf16 step: the kernel decodes in f32 and rounds once, as the
  reference does; the V un-rotation is a 16-bit split product (ties move one bf16 step).
  Values that cancel to ~0 may differ by a few ulps of the operands, hence an absolute
  term: f32 ulps for code * scale + zero (fused or separate multiply-add), and 2^-15 of
  the largest value for the un-rotation's 16-bit split."""
  packed = _packed(seed, t=t, head_dim=head_dim, k_scheme=k_scheme, v_scheme=v_scheme, ranges=ranges)
  for head0, heads in ((0, 4), (1, 2), (3, 1)):
    got = _decode(packed, jnp.int32(head0), heads=heads, unrotate_v=unrotate_v, interpret=True)
    want = dequantize_group_reference(packed, head0, heads, unrotate_v=unrotate_v)
    for name, g, w in zip("kv", got, want):
      g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
      assert g.shape == (2, t, heads, head_dim) and np.isfinite(g).all(), f"seed={seed}: {name} unwritten"
      split = name == "v" and unrotate_v
      step = np.abs(w) * 2.0 ** -7 + (2.0 ** -15 if split else 1e-6) * np.abs(w).max()   # one bf16 step
      off = np.abs(g - w)
      assert (off <= step).all(), f"seed={seed} {name}: off by {off.max()} (> one bf16 step)"
      assert (off > 0).mean() < (0.05 if split else 1e-3), f"seed={seed} {name}: {(off > 0).mean():.2%} differ"


def test_decode_lowers_to_triton():
  packed = _packed(0, t=300, ranges=((0, 64, "int8"), (100, 130, "bf16"), (150, 200, "k5v4"), (200, 260, "k5v5")))
  for unrotate in (True, False):
    text = jax.jit(lambda p, h0: dequantize_group(p, h0, 2, unrotate_v=unrotate, interpret=False)).trace(
        packed, jnp.int32(1)).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.triton" in text


def test_plan_fits_the_budget_and_falls_back_to_row_chunks():
  b, t, h, d = 1, 152263, 56, 128
  kv_head = 2 * b * t * d * 2
  for budget in (128 << 20, 512 << 20, 2 << 30):
    plan = attn.streamed_plan(b, t, t, h, d, budget)
    assert plan.scratch <= budget
    if plan.q_rows == t:   # whole queries: the largest group that fits
      assert attn.streamed_plan(b, t, t, h, d, budget).group == budget // (kv_head + t * 2 * b * d * 2)
  small = attn.streamed_plan(b, t, t, h, d, 128 << 20)   # one head's K/V is 78 MB here
  assert small.group == 1 and small.q_rows < t and small.q_rows % 64 == 0
  assert attn.streamed_plan(b, t, t, h, d, kv_head) is None
  assert attn.streamed_plan(1, 100, 100, 2, 64, 1 << 30).group == 2   # never more than H


def _tensor_bytes(text):
  sizes = {"bf16": 2, "f32": 4, "ui8": 1, "i8": 1, "i32": 4, "i16": 2, "i1": 1, "f16": 2}
  out = []
  for dims, dtype in re.findall(r"tensor<((?:\d+x)*)(\w+)>", text):
    n = int(np.prod([int(x) for x in dims.split("x") if x])) if dims else 1
    out.append((n * sizes.get(dtype, 4), dims + dtype))
  return out


def test_streamed_program_holds_no_full_bf16_kv(monkeypatch):
  """The program XLA gets on the GPU (lowered for CUDA here): apart from q and the
  output, no tensor reaches one full bf16 K (B*T*H*D*2 bytes), and the decoded K/V
  tensors are one head group's. cuDNN cannot lower on a CPU, so a stand-in with
  flash attention's memory signature (output shaped like q, nothing T x T) takes its
  place; the GPU test below checks the compiled program with cuDNN itself."""
  monkeypatch.setattr(jax.nn, "dot_product_attention", lambda q, k, v, **kw: q * k[:, :1] + v[:, -1:])
  b, t, h, d = 1, 2048, 16, 128
  meta = fmt.PackedKVMeta(b, h, d, t, fmt.resolve_block_classes(t, [(0, 128, "int8")]))
  packed = fmt.PackedKV(meta, {n: jax.ShapeDtypeStruct(s, jnp.dtype(dt)) for n, (s, dt) in
                               fmt.buffer_specs(meta).items()})
  q = jax.ShapeDtypeStruct((b, t, h, d), jnp.bfloat16)
  full_k = b * t * h * d * 2
  plan = attn.streamed_plan(b, t, t, h, d, full_k // 2)
  assert 1 < plan.group < h and plan.q_rows == t
  text = attn._streamed_jit.trace(q, packed, None, None, sm_scale=0.1, keep_rotated=False, overwrite_q=True,
                                  plan=plan, interpret=False, implementation="cudnn").lower(
                                      lowering_platforms=("cuda",)).as_text()
  big = lambda text: {ty for size, ty in _tensor_bytes(text) if size >= full_k and ty != f"{b}x{t}x{h}x{d}xbf16"}
  assert big(text) == set(), big(text)
  assert f"{b}x{t}x{plan.group}x{d}xbf16" in text   # the group's decoded K/V (and q slice)

  def expand_all(q, packed):  # negative control: decode all of K and V, then attend
    k, v = fmt.dequantize_reference(packed)
    return jax.nn.dot_product_attention(q, k.astype(jnp.bfloat16), v.astype(jnp.bfloat16))
  bad = jax.jit(expand_all).trace(q, packed).lower(lowering_platforms=("cuda",)).as_text()
  assert big(bad) != set()


# --------------------------------------------------------------------------------------
# GPU: cuDNN itself
# --------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.parametrize("budget_mib", [128, 512])
def test_gpu_compiled_program_stays_within_the_budget_at_h3_shapes(budget_mib):
  """Compile (no run) the streamed path at T = 152,263, H = 56, D = 128: XLA's temp
  memory, cuDNN's workspace included, stays within the declared scratch budget."""
  b, t, h, d = 1, 152263, 56, 128
  meta = fmt.PackedKVMeta(b, h, d, t, fmt.resolve_block_classes(t, [(0, 4096, "int8")]))
  packed = fmt.PackedKV(meta, {n: jax.ShapeDtypeStruct(s, jnp.dtype(dt)) for n, (s, dt) in
                               fmt.buffer_specs(meta).items()})
  q = jax.ShapeDtypeStruct((b, t, h, d), jnp.bfloat16)
  budget = budget_mib << 20
  plan = attn.streamed_plan(b, t, t, h, d, budget)
  compiled = attn._streamed_jit_donate_q.trace(
      q, packed, None, None, sm_scale=d ** -0.5, keep_rotated=False, overwrite_q=True, plan=plan,
      interpret=False, implementation="cudnn").lower().compile()
  temp = compiled.memory_analysis().temp_size_in_bytes
  assert temp <= budget, f"temp {temp / 2**20:.1f} MiB > budget {budget_mib} MiB (plan {plan})"


@pytest.mark.gpu
def test_gpu_decode_matches_reference(seed):
  packed = _packed(seed, t=1000, heads=4, ranges=((0, 100, "int8"), (300, 340, "bf16"), (400, 600, "k5v4"),
                                                  (700, 800, "k5v5")))
  got = dequantize_group(packed, jnp.int32(1), 3, unrotate_v=True, interpret=False)
  want = dequantize_group_reference(packed, 1, 3, unrotate_v=True)
  for g, w in zip(got, want):
    g, w = np.asarray(g, np.float32), np.asarray(w, np.float32)
    assert (np.abs(g - w) <= np.abs(w) * 2.0 ** -7 + 2.0 ** -15 * np.abs(w).max()).all()


def test_int8_k_store_matches_reference(seed):
  """Sol's 8-bit K store (``store="int8_k"``) against its definition: codes equal except
  where the f32 decode lands a hair either side of a rounding boundary (then one code
  apart), scales to f32 rounding, rows past T zero; V as the bf16 decode."""
  from pallas_kernels.kv_dequant import dequantize_group_int8_k_reference
  t, heads, d = 300, 4, 128
  packed = _packed(seed, t=t, head_dim=d, ranges=((0, 64, "int8"), (100, 130, "bf16")))
  center = jnp.asarray(np.random.default_rng(seed).normal(size=(2, heads, d)), jnp.float32)
  for head0, g in ((0, 4), (1, 2)):
    k_codes, k_scale, v = dequantize_group(packed, jnp.int32(head0), g, unrotate_v=True, interpret=True,
                                           layout="bhtd", store="int8_k", center=center)
    want = dequantize_group_int8_k_reference(packed, head0, g, center, unrotate_v=True)
    w_v = np.asarray(want[2], np.float32)
    np.testing.assert_allclose(np.asarray(v, np.float32), w_v, rtol=2 ** -7, atol=2 ** -15 * float(np.abs(w_v).max()))
    diff = np.abs(np.asarray(k_codes, np.int32) - np.asarray(want[0], np.int32))
    assert diff.max() <= 1 and (diff > 0).mean() < 0.01, (diff.max(), (diff > 0).mean())
    np.testing.assert_allclose(np.asarray(k_scale), np.asarray(want[1]), rtol=1e-5, atol=1e-7)
    assert not np.asarray(k_codes)[:, :, t:].any() and not np.asarray(k_scale)[:, :, t:].any()
