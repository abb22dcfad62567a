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
  assert amg.make_config().block_q == amg.VARIANTS[amg.DEFAULT_VARIANT]["block_q"] == 128
  assert amg.make_config(block_q=64).block_q == 64
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
  with pytest.raises(ValueError, match="deq_slots"):
    amg.MgpuConfig(deq_slots=1)
  with pytest.raises(ValueError, match="multiple of 8"):
    amg.MgpuConfig(compute_regs=230)
  # 2 x 232 + 48 = 512 fits the SM's register file but not the pool allocated at launch
  # (3 x 168): on the GPU the compute warpgroups' setmaxnreg would wait forever.
  with pytest.raises(ValueError, match="exceeds 504"):
    amg.MgpuConfig(compute_regs=232, memory_regs=48)
  amg.MgpuConfig(compute_regs=232, memory_regs=40)  # jax's FA3 example split: 504


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
