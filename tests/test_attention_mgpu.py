"""The Mosaic-GPU (wgmma) prototype of dense packed attention, pallas_kernels/attention_mgpu.py.

On the CPU: every design variant lowers for CUDA (Mosaic-GPU has no interpret mode
here, so lowering is what the CPU can check), and out-of-scope inputs raise. On the
GPU (``pytest -m gpu``): each variant against ``packed_attention_reference(...,
keep_rotated=True)`` (float32) on fresh random inputs; thresholds rel L2 <= 1e-2 and
cos >= 0.99995, the same as the Triton kernel's.
"""
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import formats as fmt
from benchmarks.quality import cosine, rel_err
from pallas_kernels import attention_mgpu as amg
from pallas_kernels.attention import packed_attention_reference


@pytest.fixture
def seed():
  return int.from_bytes(os.urandom(4), "little")


def _make(seed, *, batch=1, tq=256, tkv=256, heads=2, head_dim=128, classes=None, k_scheme="channel",
          v_scheme="token"):
  rng = np.random.default_rng(seed)
  q = rng.normal(size=(batch, tq, heads, head_dim)).astype(np.float32) * 1.5
  k = rng.normal(size=(batch, tkv, heads, head_dim)).astype(np.float32) + rng.normal(size=head_dim) * 0.5
  v = rng.normal(size=(batch, tkv, heads, head_dim)).astype(np.float32)
  nb = -(-tkv // fmt.BLOCK)
  meta = fmt.PackedKVMeta(batch, heads, head_dim, tkv, classes or (0,) * nb, k_scheme=k_scheme, v_scheme=v_scheme)
  packed = fmt.quantize_reference(jnp.asarray(k), jnp.asarray(v), meta)
  return jnp.asarray(q, jnp.bfloat16), packed


@pytest.mark.parametrize("variant", sorted(amg.VARIANTS))
def test_every_variant_lowers_for_cuda(variant):
  q, packed = _make(0, tq=512, tkv=512)
  fn = jax.jit(lambda q, p: amg.packed_attention_mgpu(q, p, variant=variant))
  text = fn.trace(q, packed).lower(lowering_platforms=("cuda",)).as_text()
  assert "mosaic_gpu" in text


def test_out_of_scope_inputs_raise():
  q, packed = _make(0)
  with pytest.raises(NotImplementedError, match="head_dim"):
    amg.packed_attention_mgpu(*_make(0, head_dim=64))
  with pytest.raises(NotImplementedError, match="all-int4"):
    amg.packed_attention_mgpu(*_make(0, classes=(1, 0, 0, 0)))
  with pytest.raises(NotImplementedError, match="k_scheme"):
    amg.packed_attention_mgpu(*_make(0, k_scheme="token"))
  with pytest.raises(NotImplementedError, match="num_tokens"):
    amg.packed_attention_mgpu(*_make(0, tkv=200))
  with pytest.raises(NotImplementedError, match="Tq"):
    amg.packed_attention_mgpu(*_make(0, tq=192))
  with pytest.raises(ValueError, match="unknown variant"):
    amg.packed_attention_mgpu(q, packed, variant="nope")
  with pytest.raises(ValueError, match="block_kv"):
    amg.packed_attention_mgpu(q, packed, block_kv=96)
  with pytest.raises(ValueError, match="sm_scale"):
    amg.packed_attention_mgpu(q, packed, sm_scale=-1.0)
  with pytest.raises(ValueError):
    amg.packed_attention_mgpu(q.astype(jnp.float32), packed)


@pytest.mark.parametrize("variant", sorted(amg.DIAGNOSTIC_VARIANTS))
def test_diagnostic_variants_lower_for_cuda(variant):
  q, packed = _make(0, tq=512, tkv=512)
  fn = jax.jit(lambda q, p: amg.packed_attention_mgpu(q, p, variant=variant))
  assert "mosaic_gpu" in fn.trace(q, packed).lower(lowering_platforms=("cuda",)).as_text()


def test_config_explicit_blocks_override_the_variant():
  assert amg.make_config().block_q == amg.VARIANTS[amg.DEFAULT_VARIANT]["block_q"]
  assert amg.make_config(variant="deqwg_magic_bf16_pk").block_q == 128
  assert amg.make_config(block_q=64, variant="deqwg_magic_bf16_pk").block_q == 64
  assert amg.make_config(block_kv=128, variant="base").block_kv == 128
  assert amg.make_config(variant="base").block_kv == 64
  assert amg.DEFAULT_VARIANT in amg.VARIANTS


def test_config_rejects_bad_fields():
  with pytest.raises(ValueError, match="v_math"):
    amg.MgpuConfig(v_math="rows")
  with pytest.raises(ValueError, match="needs shared_deq"):
    amg.MgpuConfig(v_math="tile")
  with pytest.raises(ValueError, match="needs overlap"):
    amg.MgpuConfig(shared_deq=True, overlap=False)
  with pytest.raises(ValueError, match="diagnostic"):
    amg.MgpuConfig(diagnostic="fast")
  with pytest.raises(ValueError, match="deq_wg=True needs"):
    amg.MgpuConfig(block_q=128, shared_deq=True, deq_wg=True)  # v_math is still "p_scale"
  with pytest.raises(ValueError, match="bf16_scales"):
    amg.MgpuConfig(bf16_scales=True)  # convert is still "cast"
  with pytest.raises(ValueError, match="deq_slots"):
    amg.MgpuConfig(deq_slots=1)
  with pytest.raises(ValueError, match="multiple of 8"):
    amg.MgpuConfig(compute_regs=230)
  # 2 x 232 + 48 = 512 fits the SM's register file but not the pool allocated at launch
  # (3 x 168): on the GPU the compute warpgroups' setmaxnreg would wait forever.
  with pytest.raises(ValueError, match="exceeds 504"):
    amg.MgpuConfig(compute_regs=232, memory_regs=48)
  amg.MgpuConfig(compute_regs=232, memory_regs=40)  # jax's FA3 example split: 504
  deqwg = dict(block_q=128, shared_deq=True, v_math="tile", deq_wg=True, compute_regs=224, memory_regs=56)
  with pytest.raises(ValueError, match="converter_wgs=3"):
    amg.MgpuConfig(**deqwg, converter_wgs=3)
  with pytest.raises(ValueError, match="converter_wgs=2 needs deq_wg"):
    amg.MgpuConfig(converter_wgs=2, compute_regs=200, memory_regs=56)
  # Four warpgroups get 4 x 128 registers at launch: 2 x 200 + 2 x 64 = 528 would hang.
  with pytest.raises(ValueError, match="2 \\* memory_regs = 528 exceeds 512"):
    amg.MgpuConfig(**{**deqwg, "compute_regs": 200, "memory_regs": 64}, converter_wgs=2)
  amg.MgpuConfig(**{**deqwg, "compute_regs": 200, "memory_regs": 56}, converter_wgs=2)
  with pytest.raises(ValueError, match="auto_barriers=False needs deq_wg"):
    amg.MgpuConfig(auto_barriers=False)
  amg.MgpuConfig(**deqwg, auto_barriers=False)
  # cluster_share splits each 128-key tile between the two CTAs of a pair: 64 keys each.
  two = dict(deqwg, block_q=64, block_kv=128, converter_wgs=2, compute_regs=200, memory_regs=56,
             codes_layout="wgmma_8bit", convert="magic")
  with pytest.raises(ValueError, match="cluster_share=True needs"):
    amg.MgpuConfig(**{**two, "block_kv": 64}, cluster_share=True)
  with pytest.raises(ValueError, match="cluster_share=True needs"):
    amg.MgpuConfig(**{**two, "converter_wgs": 1}, cluster_share=True)
  amg.MgpuConfig(**two, cluster_share=True)


def test_cluster_share_refuses_an_odd_number_of_q_tiles():
  q, packed = _make(0, tq=384, tkv=256)  # 3 tiles of 2 x 64 rows: no CTA pair for the last
  with pytest.raises(NotImplementedError, match="num_q_tiles=3 must be even"):
    jax.jit(lambda q, p: amg.packed_attention_mgpu(q, p, variant="deqwg2_bkv128_pk_cl2")).trace(q, packed)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", sorted(amg.VARIANTS))
def test_gpu_variant_matches_reference(seed, variant):
  for batch, heads, t in ((1, 2, 1024), (2, 3, 2048)):
    q, packed = _make(seed, batch=batch, tq=t, tkv=t, heads=heads)
    out = np.asarray(amg.packed_attention_mgpu(q, packed, variant=variant), np.float32)
    ref = np.asarray(packed_attention_reference(q, packed, keep_rotated=True), np.float32)
    assert np.isfinite(out).all(), f"seed={seed}: non-finite output"
    e, c = rel_err(out, ref), cosine(out, ref)
    assert e <= 1e-2 and c >= 0.99995, f"seed={seed} {variant} B={batch} T={t}: rel_err={e:.3e} cos={c:.7f}"


# --------------------------------------------------------------------------------------
# The inline PTX of convert="magic", run by a small emulator of the instructions it uses
# (no interpreter runs inline asm): the exact text the kernel embeds, on random bytes.
# --------------------------------------------------------------------------------------
def _bf16_bits_to_f32(b):
  return np.array([b << 16], np.uint32).view(np.float32)[0]


def _f32_to_bf16_bits(x):  # round to nearest even, as cvt.rn / fma.rn do
  u = int(np.array([x], np.float32).view(np.uint32)[0])
  return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF


def _run_ptx(asm, operands):
  import re
  regs = {f"${i}": v for i, v in enumerate(operands)}
  val = lambda t: regs[t] if t in regs else int(t, 0)
  f32 = lambda u: np.array([u], np.uint32).view(np.float32)[0]
  u32 = lambda x: int(np.array([x], np.float32).view(np.uint32)[0])
  halves = lambda u: (_bf16_bits_to_f32(u & 0xFFFF), _bf16_bits_to_f32(u >> 16))
  pack = lambda lo, hi: _f32_to_bf16_bits(lo) | _f32_to_bf16_bits(hi) << 16
  for line in asm.splitlines():
    line = line.strip().rstrip(";")
    if not line or line in "{}" or line.startswith(".reg"):
      continue
    op, args = line.split(None, 1)
    a = [x.strip() for x in args.split(",")]
    d, src = a[0], [val(x) for x in a[1:]]
    if op == "mov.b32":
      r = src[0]
    elif op == "shr.u32":
      r = src[0] >> src[1]
    elif op == "shl.b32":
      r = (src[0] << src[1]) & 0xFFFFFFFF
    elif op == "and.b32":
      r = src[0] & src[1]
    elif op == "prmt.b32":
      pool = [(src[0] >> 8 * i) & 0xFF for i in range(4)] + [(src[1] >> 8 * i) & 0xFF for i in range(4)]
      r = sum(pool[(src[2] >> 4 * i) & 0x7] << 8 * i for i in range(4))
    elif op == "lop3.b32":
      assert src[3] == 0xEA  # (a & b) | c
      r = (src[0] & src[1]) | src[2]
    elif op == "sub.bf16x2":
      (a0, a1), (b0, b1) = halves(src[0]), halves(src[1])
      r = pack(np.float32(a0 - b0), np.float32(a1 - b1))
    elif op == "fma.rn.bf16x2":
      (a0, a1), (b0, b1), (c0, c1) = halves(src[0]), halves(src[1]), halves(src[2])
      r = pack(np.float32(np.float64(a0) * b0 + c0), np.float32(np.float64(a1) * b1 + c1))
    elif op == "fma.rn.f32":
      r = u32(np.float32(np.float64(f32(src[0])) * f32(src[1]) + f32(src[2])))
    elif op == "cvt.rn.bf16x2.f32":
      r = pack(f32(src[1]), f32(src[0]))  # a -> upper half, b -> lower half
    else:
      raise AssertionError(f"emulator lacks {op}")
    regs[d] = r
  return [regs[f"${i}"] for i in range(4)]


@pytest.mark.parametrize("math_dtype", ["bf16", "f32"])
def test_magic_ptx_dequantizes_split_half_codes(seed, math_dtype):
  rng = np.random.default_rng(seed)
  asm, cons = amg.dequant_ptx(math_dtype)
  n_in = len(cons.split(",")) - 4
  for _ in range(20):
    b = rng.integers(0, 256, 4)
    word = int(b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24)
    s_lo, s_hi = rng.uniform(0.01, 0.5, 4), rng.uniform(0.01, 0.5, 4)
    z_lo, z_hi = rng.normal(size=4) * 3, rng.normal(size=4) * 3
    bf = lambda x: _bf16_bits_to_f32(_f32_to_bf16_bits(np.float32(x)))
    if math_dtype == "bf16":
      pairs = lambda v: [_f32_to_bf16_bits(np.float32(v[i])) | _f32_to_bf16_bits(np.float32(v[i + 1])) << 16
                         for i in (0, 2)]
      ops = [word] + pairs(s_lo) + pairs(z_lo + 8 * s_lo) + pairs(s_hi) + pairs(z_hi + 8 * s_hi)
      # the kernel's arithmetic: bf16 scale and midpoint, exact centered code, one rounding
      want = lambda c, s, z: bf(np.float32(c - 8) * np.float64(bf(s)) + bf(z + 8 * s))
    else:
      f = lambda v: [int(np.array([x], np.float32).view(np.uint32)[0]) for x in v]
      ops = [word] + f(s_lo) + f(z_lo - 128 * s_lo) + f(s_hi) + f(z_hi - 128 * s_hi)
      want = lambda c, s, z: bf(np.float32(np.float64(128 + c) * np.float32(s) + np.float32(z - 128 * s)))
    assert len(ops) == n_in
    out = _run_ptx(asm, [0, 0, 0, 0] + ops)
    got = [_bf16_bits_to_f32(w >> 16 * i & 0xFFFF) for w in out for i in (0, 1)]
    lo, hi = [int(x) & 15 for x in b], [int(x) >> 4 for x in b]
    expect = [want(lo[j], s_lo[j], z_lo[j]) for j in range(4)] + [want(hi[j], s_hi[j], z_hi[j]) for j in range(4)]
    assert got == expect, (math_dtype, b, got, expect)
    exact = [lo[j] * s_lo[j] + z_lo[j] for j in range(4)] + [hi[j] * s_hi[j] + z_hi[j] for j in range(4)]
    np.testing.assert_allclose(got, exact, rtol=2e-2, atol=2e-2)  # the dequantized values themselves


def test_unpack_diagnostic_ptx_gives_128_plus_code(seed):
  rng = np.random.default_rng(seed)
  asm, cons = amg.dequant_ptx("unpack")
  assert cons.count("r") == 5  # four bf16x2 outputs, the code word, no scale operands
  for _ in range(20):
    b = rng.integers(0, 256, 4)
    word = int(b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24)
    out = _run_ptx(asm, [0, 0, 0, 0, word])
    got = [_bf16_bits_to_f32(w >> 16 * i & 0xFFFF) for w in out for i in (0, 1)]
    assert got == [128.0 + (int(x) & 15) for x in b] + [128.0 + (int(x) >> 4) for x in b]


def test_unpack_diagnostics_need_bf16_scales():
  with pytest.raises(ValueError, match="bf16_scales"):
    amg.MgpuConfig(**{**amg.VARIANTS["deqwg_magic_bf16"], "diagnostic": "unpack_only"})
  with pytest.raises(ValueError, match="diagnostic other than"):
    amg.MgpuConfig(**{**amg.VARIANTS["deqwg_magic_bf16_pk"], "diagnostic": "no_convert"})


def test_head_group_call_rounds_only_its_heads_scales():
  """A call over heads [2, 4) of 4 passes the kernel bf16 scales of those 2 heads only, so
  the fast path's loop over head groups never holds bf16 copies of every head's scales."""
  import re
  q, packed = _make(0, tq=512, tkv=512, heads=4)
  ops = amg.int4_store_operands(packed)
  cfg = amg.make_config()
  assert cfg.bf16_scales
  fn = jax.jit(lambda q, *o: amg._attention_call(q, *o, cfg=cfg, sm_scale=0.09, head_offset=2, num_heads=2))
  text = fn.trace(q, *ops).lower(lowering_platforms=("cuda",)).as_text()
  [call] = [line for line in text.splitlines() if "custom_call" in line and "mosaic_gpu" in line]
  operands = re.findall(r"tensor<([0-9x]+)x(bf16|f32|i8)>", call)[:7]
  # q (all heads), K codes (all heads), K scale / midpoint (2 heads), V codes, V scale / midpoint
  assert operands == [("1x512x4x128", "bf16"), ("1x4x512x64", "i8"), ("1x2x8x128", "bf16"),
                      ("1x2x8x128", "bf16"), ("1x4x512x64", "i8"), ("1x2x512", "bf16"), ("1x2x512", "bf16")]
