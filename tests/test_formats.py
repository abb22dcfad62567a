"""The packed K/V format: rotation, packing, quantization bounds, policy, metadata."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from formats import packed_kv as fmt


def _kv(rng, b=2, t=200, h=3, d=64, offset=3.0):
  k = rng.normal(size=(b, t, h, d)).astype(np.float32) + offset * rng.normal(size=(d,)).astype(np.float32)
  v = rng.normal(size=(b, t, h, d)).astype(np.float32)
  return k, v


@pytest.mark.parametrize("d", [64, 128])
def test_rotation_is_orthogonal_and_seeded(d):
  r = fmt.hadamard_rotation(d, 7)
  np.testing.assert_allclose(r @ r.T, np.eye(d), atol=1e-6)
  np.testing.assert_array_equal(r, fmt.hadamard_rotation(d, 7))
  assert not np.array_equal(r, fmt.hadamard_rotation(d, 8))
  assert set(np.unique(fmt.hadamard_signs(d, 7))) == {-1.0, 1.0}


def test_rotation_rejects_unsupported_head_dim():
  with pytest.raises(ValueError, match="head_dim=96"):
    fmt.hadamard_rotation(96, 0)


def test_pack_unpack_split_half_layout():
  rng = np.random.default_rng(0)
  codes = rng.integers(0, 16, size=(5, 64)).astype(np.uint8)
  packed = np.asarray(fmt.pack_nibbles(jnp.asarray(codes)))
  assert packed.shape == (5, 32) and packed.dtype == np.uint8
  np.testing.assert_array_equal(packed & 0xF, codes[:, :32])
  np.testing.assert_array_equal(packed >> 4, codes[:, 32:])
  np.testing.assert_array_equal(np.asarray(fmt.unpack_nibbles(jnp.asarray(packed))), codes)


@pytest.mark.parametrize("k_scheme", fmt.K_SCHEMES)
@pytest.mark.parametrize("v_scheme", fmt.V_SCHEMES)
@pytest.mark.parametrize("cls", ["int4", "int8", "bf16", "k5v4", "k5v5"])
def test_roundtrip_error_is_within_half_a_step(k_scheme, v_scheme, cls):
  rng = np.random.default_rng(1)
  k, v = _kv(rng)
  t = k.shape[1]
  classes = (fmt.CLASS_ID[cls],) * (-(-t // fmt.BLOCK))
  meta = fmt.PackedKVMeta(2, 3, 64, t, classes, k_scheme, v_scheme)
  packed = fmt.quantize_reference(jnp.asarray(k), jnp.asarray(v), meta)
  fmt.check_packed(packed)
  kd, vd = fmt.dequantize_reference(packed)
  for x, xd, role in ((k, kd, "k"), (v, vd, "v")):
    err = np.abs(np.asarray(xd) - x)
    width = fmt.CLASS_WIDTHS[cls]["kv".index(role)]
    if width == 16:
      assert err.max() <= np.abs(x).max() * 2 ** -8
      continue
    scale = np.asarray(packed.arrays[f"{role}_scale{width}"])
    # Each element is within half a step (plus f32 rounding) of its original value.
    assert err.max() <= 0.5 * scale.max() * (1 + 1e-5) + 1e-6
    rel = np.linalg.norm(np.asarray(xd) - x) / np.linalg.norm(x)
    assert rel < {4: 0.12, 5: 0.06, 8: 0.01}[width], rel


def test_five_bit_store_layout():
  """A 5-bit code is its nibble (split-half, the int4 layout) plus 16 x its bit in the
  fifth-bit plane, channel c at bit c % 8 of byte c // 8; K and V of a k5v4 block land
  in different stores (K's 5-bit, V's 4-bit beside the int4 blocks')."""
  bits = np.random.default_rng(3).integers(0, 2, size=(3, 128))
  plane = np.asarray(fmt.pack_bits(jnp.asarray(bits)))
  np.testing.assert_array_equal(plane, np.packbits(bits.astype(np.uint8), axis=-1, bitorder="little"))
  np.testing.assert_array_equal(np.asarray(fmt.unpack_bits(jnp.asarray(plane))), bits)
  classes = fmt.resolve_block_classes(300, [(0, 64, "k5v4"), (130, 200, "k5v5")])
  assert classes == (3, 0, 4, 4, 0)
  meta = fmt.PackedKVMeta(1, 2, 64, 300, classes)
  assert meta.store_blocks("k", 5) == (0, 2, 3) and meta.store_blocks("v", 5) == (2, 3)
  assert meta.store_blocks("v", 4) == (0, 1, 4) and meta.widths("v") == (4, 5)
  np.testing.assert_array_equal(meta.block_slots("k"), [0, 0, 1, 2, 1])
  np.testing.assert_array_equal(meta.block_slots("v"), [0, 1, 0, 1, 2])
  specs = fmt.buffer_specs(meta)
  assert specs["k_codes5"] == ((1, 2, 192, 32), "uint8") and specs["k_bits5"] == ((1, 2, 192, 8), "uint8")
  assert specs["v_codes4"][0] == (1, 2, 192, 32) and specs["v_bits5"][0] == (1, 2, 128, 8)
  rng = np.random.default_rng(5)
  k, v = (rng.normal(size=(1, 300, 2, 64)).astype(np.float32) for _ in range(2))
  packed = fmt.quantize_reference(jnp.asarray(k), jnp.asarray(v), meta)
  codes = np.asarray(fmt.unpack_nibbles(packed.k_codes5)).astype(np.int32) | (
      np.asarray(fmt.unpack_bits(packed.k_bits5)) << 4)
  assert codes.max() == 31 and codes.min() == 0
  scale, zero = (np.asarray(packed.arrays[n], np.float32) for n in ("k_scale5", "k_zero5"))
  want = codes.reshape(1, 2, 3, 64, 64) * scale[:, :, :, None] + zero[:, :, :, None]
  kd = np.asarray(fmt.dequantize_reference(packed)[0])
  np.testing.assert_allclose(kd[0, :64].transpose(1, 0, 2), want[0, :, 0], rtol=1e-6, atol=1e-6)


def test_precision_order_and_bits():
  """The higher class wins where policies meet (PRECISION_ORDER, not id order);
  bits per value count every array."""
  assert fmt.resolve_block_classes(128, [(0, 64, "k5v5"), (0, 10, "k5v4")], default="int4") == (4, 0)
  assert fmt.resolve_block_classes(128, [(0, 64, "k5v5")], default="int8") == (1, 1)
  assert fmt.resolve_block_classes(128, (), default="k5v4", layer=2, layer_classes={2: "int4"}) == (3, 3)
  bits = {c: fmt.bits_per_value(fmt.PackedKVMeta(1, 1, 128, 64, (fmt.CLASS_ID[c],))) for c in fmt.CLASSES}
  assert bits == {"int4": 4.625, "k5v4": 5.125, "k5v5": 5.625, "int8": 8.625, "bf16": 16.25}


def test_constant_group_is_exact():
  k = np.full((1, 64, 1, 64), 2.5, np.float32)
  meta = fmt.PackedKVMeta(1, 1, 64, 64, (0,), "channel", "token")
  kd, vd = fmt.dequantize_reference(fmt.quantize_reference(jnp.asarray(k), jnp.asarray(k), meta))
  np.testing.assert_array_equal(np.asarray(kd), k)
  np.testing.assert_array_equal(np.asarray(vd), k)


def test_mixed_classes_store_each_block_once():
  rng = np.random.default_rng(2)
  t = 300  # 5 blocks, last one partial
  k, v = _kv(rng, b=1, t=t, h=2)
  classes = fmt.resolve_block_classes(t, [(0, 70, "int8"), (200, 210, "bf16")])
  assert classes == (1, 1, 0, 2, 0)
  meta = fmt.PackedKVMeta(1, 2, 64, t, classes)
  packed = fmt.quantize_reference(jnp.asarray(k), jnp.asarray(v), meta)
  assert packed.k_codes4.shape == (1, 2, 2 * 64, 32)
  assert packed.k_codes8.shape == (1, 2, 2 * 64, 64)
  assert packed.k_bf16.shape == (1, 2, 64, 64)
  kd, _ = fmt.dequantize_reference(packed)
  err = np.abs(np.asarray(kd) - k).max(axis=(0, 2, 3))
  assert err[192:256].max() <= np.abs(k).max() * 2 ** -8      # bf16 block
  assert err[:128].max() < err[128:192].max() / 4              # int8 blocks beat int4


def test_block_stats_over_live_tokens():
  rng = np.random.default_rng(3)
  t = 150
  k, v = _kv(rng, b=1, t=t, h=2)
  meta = fmt.PackedKVMeta(1, 2, 64, t, (0, 0, 0))
  packed = fmt.quantize_reference(jnp.asarray(k), jnp.asarray(v), meta)
  for blk, (a, b) in enumerate([(0, 64), (64, 128), (128, 150)]):
    # bfloat16 storage (format v2): within half a bf16 ulp of the f32 statistic
    for got, want in ((packed.k_mean[0, :, blk], k[0, a:b].mean(0)), (packed.v_sum[0, :, blk], v[0, a:b].sum(0))):
      got = np.asarray(got.astype(jnp.float32))
      np.testing.assert_allclose(got, want, rtol=2 ** -8, atol=1e-6)


def test_policy_layers_and_timesteps():
  assert fmt.resolve_block_classes(130) == (0, 0, 0)
  assert fmt.resolve_block_classes(130, layer=3, layer_classes={3: "bf16"}) == (2, 2, 2)
  assert fmt.resolve_block_classes(130, layer=2, layer_classes={3: "bf16"}) == (0, 0, 0)
  steps = [(0.9, 1.0, "int8")]
  assert fmt.resolve_block_classes(130, timestep=0.95, timestep_classes=steps) == (1, 1, 1)
  assert fmt.resolve_block_classes(130, [(0, 10, "bf16")], timestep=0.95, timestep_classes=steps) == (2, 1, 1)
  with pytest.raises(ValueError, match="unknown precision class 'fp8'"):
    fmt.resolve_block_classes(130, [(0, 10, "fp8")])
  with pytest.raises(ValueError, match="outside"):
    fmt.resolve_block_classes(130, [(100, 140, "int8")])


def test_meta_validation_and_json_roundtrip():
  meta = fmt.PackedKVMeta(1, 2, 128, 100, (0, 1))
  again = fmt.PackedKVMeta.from_dict(json.loads(json.dumps(meta.to_dict())))
  assert again == meta and hash(again) == hash(meta)
  with pytest.raises(ValueError, match="version 1 is not readable by version 3"):
    dataclasses.replace(meta, version=1)
  # A version-2 record (classes 0-2) stays readable; it cannot name a newer class.
  assert fmt.PackedKVMeta.from_dict(meta.to_dict() | {"version": 2}).version == 2
  with pytest.raises(ValueError, match="2 \\(bf16\\)$"):
    fmt.PackedKVMeta(1, 2, 128, 100, (0, 3), version=2)
  with pytest.raises(ValueError, match="head_dim=96"):
    fmt.PackedKVMeta(1, 2, 96, 100, (0, 1))
  with pytest.raises(ValueError, match="need 2"):
    fmt.PackedKVMeta(1, 2, 128, 100, (0,))
  with pytest.raises(ValueError, match="k_scheme"):
    fmt.PackedKVMeta(1, 2, 128, 100, (0, 0), k_scheme="tensor")


def test_packed_is_a_pytree_and_check_names_the_bad_buffer():
  rng = np.random.default_rng(4)
  k, v = _kv(rng, b=1, t=64, h=1)
  packed = fmt.quantize_reference(jnp.asarray(k), jnp.asarray(v), fmt.PackedKVMeta(1, 1, 64, 64, (0,)))
  out = jax.jit(lambda p: p)(packed)
  assert out.meta == packed.meta
  np.testing.assert_array_equal(out.k_codes4, packed.k_codes4)
  bad = fmt.PackedKV(packed.meta, packed.arrays | {"v_codes4": packed.v_codes4.astype(jnp.int8)})
  with pytest.raises(ValueError, match="v_codes4 must be uint8"):
    fmt.check_packed(bad)


def test_h3_sizes_match_format_doc():
  t = 152_263
  meta = fmt.PackedKVMeta(1, 56, 128, t, (0,) * (-(-t // 64)))
  specs = fmt.buffer_specs(meta)
  nbytes = {n: int(np.prod(s)) * np.dtype(jnp.dtype(d)).itemsize for n, (s, d) in specs.items()}
  codes = nbytes["k_codes4"] + nbytes["v_codes4"]
  assert abs(codes / 2 ** 30 - 1.02) < 0.01
  assert nbytes["k_scale4"] + nbytes["k_zero4"] == 2 * 2380 * 56 * 128 * 2
  # v2 all int4: 4 code bits + K channel params 0.5 + V token params 0.25 + stats 0.25 each
  assert abs(fmt.bits_per_value(meta) - 4.625) < 0.005  # the last block pads 57 tokens
  assert abs(fmt.bits_per_value(fmt.PackedKVMeta(1, 56, 128, t, (1,) * (-(-t // 64)))) - 8.625) < 0.005


def test_v2_parameters_are_16_bit_and_codes_use_the_stored_values():
  """Format v2: float16 scales and zeros, bfloat16 stats; the codes are chosen against
  the rounded parameters, so decoding a code reproduces the quantizer's grid point."""
  rng = np.random.default_rng(3)
  b, t, h, d = 1, 150, 2, 64
  k = jnp.asarray(rng.normal(size=(b, t, h, d)) * 3 + 0.7, jnp.float32)
  v = jnp.asarray(rng.normal(size=(b, t, h, d)), jnp.float32)
  meta = fmt.PackedKVMeta(b, h, d, t, (0, 1, 0))
  packed = fmt.quantize_reference(k, v, meta)
  fmt.check_packed(packed)
  for name, a in packed.arrays.items():
    if "scale" in name or "zero" in name:
      assert a.dtype == jnp.float16, name
    if name in ("k_mean", "v_sum"):
      assert a.dtype == jnp.bfloat16, name
  # Every decoded value lies on its group's grid: (x - zero) / scale is an integer code.
  s = packed.arrays["v_scale8"].astype(jnp.float32)[0, 0, 0]
  z = packed.arrays["v_zero8"].astype(jnp.float32)[0, 0, 0]
  codes = packed.arrays["v_codes8"][0, 0].astype(jnp.float32)
  _, vd = fmt.dequantize_reference(packed)
  np.testing.assert_allclose(np.asarray(vd[0, 64:128, 0]), np.asarray(codes * s[:, None] + z[:, None]),
                             rtol=1e-6, atol=1e-6)
  # int8 round trip stays within half a step plus the fp16 rounding of the parameters.
  err = np.abs(np.asarray(vd[0, 64:128, 0]) - np.asarray(v[0, 64:128, 0]))
  assert (err <= 0.5 * np.asarray(s)[:, None] * 1.01 + 1e-6).all()


def test_v2_parameters_saturate_instead_of_overflowing():
  lo = jnp.asarray([-1e6, 0.0, 5.0], jnp.float32)
  hi = jnp.asarray([1e6, 1e-9, 5.0], jnp.float32)
  scale, zero = fmt.asymmetric_params(lo, hi, 15)
  assert np.isfinite(np.asarray(scale)).all() and np.isfinite(np.asarray(zero)).all()
  assert float(zero[0]) == -fmt.FP16_MAX
  assert float(scale[1]) == 1.0  # 1e-9 / 15 underflows float16: the group decodes to its zero
  assert float(scale[2]) == 1.0 and float(zero[2]) == 5.0
