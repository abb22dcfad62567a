"""The fake quantization and attention the quality benchmarks report numbers with.

``benchmarks/attention_quality.py`` and ``benchmarks/factored_scales_quality.py``
simulate formats the packed format does not store; these tests tie that simulation
to the format's own reference where they overlap, and check the pieces that only the
simulation has (ragged super-blocks, the bf16 Q rescale).
"""
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import factored_scales_quality as fsq
from benchmarks.quality import fake_quant
from formats import packed_kv as fmt


def _x(rng, t=192, h=2, d=64):
  return (rng.normal(size=(1, t, h, d)) + 2.0 * rng.normal(size=(d,))).astype(np.float32)


@pytest.mark.parametrize("cls", ["int4", "int8"])
def test_fake_quant_matches_the_format_reference(cls):
  rng = np.random.default_rng(0)
  k, v = _x(rng), _x(rng)
  t = k.shape[1]
  meta = fmt.PackedKVMeta(1, k.shape[2], k.shape[3], t, (fmt.CLASS_ID[cls],) * (t // fmt.BLOCK))
  kd, vd = fmt.dequantize_reference(fmt.quantize_reference(jnp.asarray(k), jnp.asarray(v), meta))
  levels = fmt.LEVELS[cls]
  # K "channel": one group per channel per 64-token block; V "token": one per token.
  np.testing.assert_allclose(fake_quant(k, 64, 1, levels), np.asarray(kd), rtol=0, atol=1e-5)
  np.testing.assert_allclose(fake_quant(v, 1, k.shape[3], levels), np.asarray(vd), rtol=0, atol=1e-5)


def test_ragged_super_block_is_quantized_on_its_own():
  rng = np.random.default_rng(1)
  x = _x(rng, t=300)
  got, scale = fsq.quantize_case(x, "ch256")
  np.testing.assert_array_equal(got[:, :256], fake_quant(x[:, :256], 256, 1))
  np.testing.assert_array_equal(got[:, 256:], fake_quant(x[:, 256:], 44, 1))
  span = x[:, 256:].max(1) - x[:, 256:].min(1)
  np.testing.assert_allclose(scale[:, 299], span / 15, rtol=1e-6)
  assert np.all(scale[:, 256:] == scale[:, 256:257])  # constant over the group


def test_quantize_case_rejects_unknown_spec():
  with pytest.raises(ValueError, match="unknown spec"):
    fsq.quantize_case(np.zeros((1, 64, 1, 64), np.float32), "row7")


def test_bf16_q_rescale_changes_only_the_rescaled_groups():
  rng = np.random.default_rng(2)
  q = np.asarray(jnp.asarray(_x(rng, t=32), jnp.bfloat16), np.float32)
  k, v = _x(rng, t=320), _x(rng, t=320)
  plain = fsq.attention(q, k, v, 0.125)
  # Power-of-two scales: bf16(q * s) / s is exact, so the result is the plain attention's.
  pow2 = np.broadcast_to(2.0 ** rng.integers(-3, 4, size=(1, 1, 2, 64)), k.shape).astype(np.float32)
  np.testing.assert_allclose(fsq.attention(q, k, v, 0.125, k_scale=pow2[:, 64:], k_group=128, split=64),
                             plain, rtol=1e-5, atol=1e-6)
  # Other scales round q differently per group: a small, nonzero change.
  odd = np.broadcast_to(rng.uniform(0.3, 3.0, size=(1, 1, 2, 64)), k.shape).astype(np.float32)
  got = fsq.attention(q, k, v, 0.125, k_scale=odd[:, 64:], k_group=128, split=64)
  rel = np.linalg.norm(got - plain) / np.linalg.norm(plain)
  assert 0 < rel < 2e-2
