"""The fake quantization the quality benchmarks report numbers with
(``pallas_kernels.testing.fake_quant``): ``benchmarks/attention_quality.py`` simulates
formats the packed format does not store, and this ties that simulation to the
format's own reference where they overlap."""
import jax.numpy as jnp
import numpy as np
import pytest

from pallas_kernels.testing import fake_quant
from formats import packed_kv as fmt


def _x(rng, t=192, h=2, d=64):
  return (rng.normal(size=(1, t, h, d)) + 2.0 * rng.normal(size=(d,))).astype(np.float32)


@pytest.mark.parametrize("cls", ["int4", "int8", "k5v4", "k5v5"])
def test_fake_quant_matches_the_format_reference(cls):
  rng = np.random.default_rng(0)
  k, v = _x(rng), _x(rng)
  t = k.shape[1]
  meta = fmt.PackedKVMeta(1, k.shape[2], k.shape[3], t, (fmt.CLASS_ID[cls],) * (t // fmt.BLOCK))
  kd, vd = fmt.dequantize_reference(fmt.quantize_reference(jnp.asarray(k), jnp.asarray(v), meta))
  k_levels, v_levels = (fmt.CODE_LEVELS[w] for w in fmt.CLASS_WIDTHS[cls])
  # K "channel": one group per channel per 64-token block; V "token": one per token.
  np.testing.assert_allclose(fake_quant(k, 64, 1, k_levels), np.asarray(kd), rtol=0, atol=1e-5)
  np.testing.assert_allclose(fake_quant(v, 1, k.shape[3], v_levels), np.asarray(vd), rtol=0, atol=1e-5)
