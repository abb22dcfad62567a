"""The settings values of the public API (issue 46): ``formats.KVStorage``, ``Dense`` /
``Sol``, ``QKVWeights`` and ``ProjectionTuning``. Each checks itself at construction,
is hashable and (KVStorage, Dense, Sol) crosses the torch boundary as JSON text. No
kernel runs here except where a call must refuse a combination."""
import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from formats import KVStorage, PrecisionPolicy
from formats import packed_kv as fmt
from formats.storage import as_storage
import pallas_kernels
from pallas_kernels import Dense, ProjectionTuning, QKVLayout, QKVWeights, Sol
from pallas_kernels.attention_config import DEFAULT_SCRATCH_BYTES, as_attention, attention_from_json


# ---------------------------------------------------------------------------------------
# KVStorage
# ---------------------------------------------------------------------------------------
def test_storage_default_is_all_int4_channel_token_seeds_0_1():
  s = KVStorage()
  assert s.classes_for(130) == (0, 0, 0)
  assert s.meta(1, 2, 64, 130) == fmt.PackedKVMeta(1, 2, 64, 130, (0, 0, 0), "channel", "token", 0, 1)
  assert as_storage(None) == s
  with pytest.raises(ValueError, match=r"storage must be a formats.KVStorage, got dict.*KVStorage\(token_ranges"):
    as_storage({"block_classes": (0,)})


def test_storage_class_names_and_ids_are_both_accepted_and_normalized():
  # default and token ranges keep names, block classes keep ids: either spelling in.
  assert KVStorage(default=1) == KVStorage(default="int8") and KVStorage(default=np.int64(2)).default == "bf16"
  by_id = KVStorage(token_ranges=[(0, 10, 2), (64, 70, np.int32(1))])
  by_name = KVStorage(token_ranges=((0, 10, "bf16"), (64, 70, "int8")))
  assert by_id.token_ranges == by_name.token_ranges == ((0, 10, "bf16"), (64, 70, "int8"))
  assert by_id == by_name and hash(by_id) == hash(by_name)
  blocks = KVStorage(block_classes=["int8", 0, "bf16", np.int8(1)])
  assert blocks.block_classes == (1, 0, 2, 1) and all(type(c) is int for c in blocks.block_classes)
  assert blocks == KVStorage(block_classes=(1, 0, 2, 1)) and hash(blocks) == hash(KVStorage(block_classes=(1, 0, 2, 1)))
  assert by_name.classes_for(200) == (2, 1, 0, 0)


_POLICY = PrecisionPolicy(256, {1: ((64, 128),), (3, 0.5): ((0, 64),)})


@pytest.mark.parametrize("kwargs, match", [
    (dict(default="fp8"), r"unknown precision class 'fp8'; use a name in \('int4', 'int8', 'bf16', 'k5v4', 'k5v5'\) "
                          r"or its index"),
    (dict(default=5), "unknown precision class 5"),
    (dict(default=True), "unknown precision class True"),      # a bool is not a class id
    (dict(block_classes=(0, 5)), "unknown precision class 5"),
    (dict(block_classes=("int4", "int2")), "unknown precision class 'int2'"),
    (dict(block_classes=()), "block_classes is empty; give one class per 64-token block or leave it None"),
    (dict(token_ranges=[(0, 10, "fp8")]), "unknown precision class 'fp8'"),
    (dict(token_ranges=[(0, 10)]), r"token_ranges entries must be \(start, end, class\)"),
    (dict(token_ranges=[(10, 10, "int8")]), "0 <= start < end"),
    (dict(token_ranges=[(-5, 10, "int8")]), "0 <= start < end"),
    (dict(token_ranges=[(0.5, 10, "int8")]), "must be integers"),
    (dict(k_scheme="tensor"), r"k_scheme 'tensor' unknown; use one of \('channel', 'token'\)"),
    (dict(v_scheme="channel"), r"v_scheme 'channel' unknown; use one of \('token', 'token_g64'\)"),
    (dict(rotation_seed_k=-1), "rotation_seed_k must be a non-negative int"),
    (dict(rotation_seed_v=1.5), "rotation_seed_v must be a non-negative int"),
    (dict(rotation_seed_k=True), "rotation_seed_k must be a non-negative int"),
    (dict(token_ranges=[(0, 10, "int8")], block_classes=(1,)),
     "give one source of block classes, got token_ranges and block_classes"),
    (dict(token_ranges=[(0, 10, "int8")], policy=_POLICY, policy_key=1),
     "give one source of block classes, got token_ranges and policy"),
    (dict(block_classes=(1,), policy=_POLICY, policy_key=1),
     "give one source of block classes, got block_classes and policy"),
    (dict(policy_key=1), "policy_key given without a policy"),
    (dict(policy=_POLICY, policy_key=7), r"policy_key 7 is not in the policy; it knows \['\(3, 0.5\)', '1'\]"),
    (dict(policy=_POLICY), "policy_key None is not in the policy"),
    (dict(policy={1: ((0, 64),)}, policy_key=1), "policy must be a formats.PrecisionPolicy, got dict"),
])
def test_storage_bad_settings_raise_at_construction_naming_the_fix(kwargs, match):
  with pytest.raises(ValueError, match=match):
    KVStorage(**kwargs)


def test_storage_classes_for_each_source():
  # token ranges fit any T (a block holding any token of a class takes it) ...
  ranges = KVStorage(token_ranges=[(0, 70, "int8"), (200, 210, "bf16")])
  assert ranges.classes_for(300) == (1, 1, 0, 2, 0) == fmt.resolve_block_classes(300, [(0, 70, "int8"),
                                                                                        (200, 210, "bf16")])
  assert ranges.classes_for(640) == (1, 1, 0, 2) + (0,) * 6
  assert KVStorage(default="int8", token_ranges=[(0, 1, "bf16")]).classes_for(130) == (2, 1, 1)
  with pytest.raises(ValueError, match=r"token range \(200, 210\) is outside \[0, 150\)"):
    ranges.classes_for(150)
  # ... block classes fix T (ragged last block included) ...
  blocks = KVStorage(block_classes=("int8", "int4", "bf16"))
  assert blocks.classes_for(129) == blocks.classes_for(192) == (1, 0, 2)
  for t in (128, 193, 64):
    with pytest.raises(ValueError, match=rf"block_classes has 3 entries but T = {t} has {-(-t // 64)} blocks of 64; "
                                         r"give one class per block, or use token_ranges"):
      blocks.classes_for(t)
  # ... a policy reads its key's int8 ranges, at its calibrated T only.
  pol = PrecisionPolicy(256, {1: ((64, 128),), (3, 0.5): ((0, 64),)})
  assert KVStorage(policy=pol, policy_key=1).classes_for(256) == (0, 1, 0, 0)
  assert KVStorage(policy=pol, policy_key=(3, 0.5)).classes_for(256) == (1, 0, 0, 0)
  with pytest.raises(ValueError, match="calibrated for T = 256, not T = 320.*calibrate again"):
    KVStorage(policy=pol, policy_key=1).classes_for(320)


def test_storage_meta_and_of_round_trip():
  s = KVStorage(token_ranges=[(0, 64, "bf16")], k_scheme="token", v_scheme="token_g64", rotation_seed_k=5,
                rotation_seed_v=9)
  meta = s.meta(2, 3, 128, 100)
  assert meta == fmt.PackedKVMeta(2, 3, 128, 100, (2, 0), "token", "token_g64", 5, 9)
  again = KVStorage.of(meta)
  assert again.block_classes == (2, 0) and again.k_scheme == "token" and again.v_scheme == "token_g64"
  assert (again.rotation_seed_k, again.rotation_seed_v) == (5, 9)
  assert again.meta(2, 3, 128, 100) == meta
  assert KVStorage.of(KVStorage(block_classes=(1, 2), rotation_seed_v=4).meta(1, 1, 64, 100)) == KVStorage(
      block_classes=(1, 2), rotation_seed_v=4)


@pytest.mark.parametrize("storage", [
    KVStorage(),
    KVStorage(default="int8", token_ranges=[(0, 100, "bf16")], k_scheme="token", rotation_seed_k=3),
    KVStorage(block_classes=("int8", 0, 2, 0), v_scheme="token_g64", rotation_seed_v=7),
    KVStorage(policy=PrecisionPolicy(256, {(3, 0.5): ((0, 64),), (3, 1.0): (), 2: ((128, 192),)},
                                     {"note": "measured"}), policy_key=(3, 0.5)),
    KVStorage(policy=PrecisionPolicy(256, {2: ((128, 192),)}), policy_key=2),
], ids=["default", "token_ranges", "block_classes", "policy_tuple_key", "policy_int_key"])
def test_storage_json_round_trip(storage):
  text = storage.to_json()
  assert isinstance(json.loads(text), dict)
  again = KVStorage.from_json(text)
  assert again == storage and hash(again) == hash(storage) and again.to_json() == text
  assert again.classes_for(256) == storage.classes_for(256)
  if storage.policy is not None:
    assert again.policy_key == storage.policy_key and type(again.policy_key) is type(storage.policy_key)
    assert set(again.policy.ranges) == set(storage.policy.ranges)   # tuple keys come back as tuples
    assert again.policy.report == storage.policy.report


@pytest.mark.parametrize("text", ["{bad", "[1, 2]", json.dumps({"block_clases": [0]}), None])
def test_storage_from_json_refuses_other_text(text):
  with pytest.raises(ValueError, match=r"KVStorage(\.to_json\(\) text| has no setting)"):
    KVStorage.from_json(text)


def test_storage_is_frozen():
  with pytest.raises(dataclasses.FrozenInstanceError):
    KVStorage().k_scheme = "token"


# ---------------------------------------------------------------------------------------
# Dense and Sol
# ---------------------------------------------------------------------------------------
def test_attention_defaults_are_valid_and_as_documented():
  d, s = Dense(), Sol()
  assert (d.sm_scale, d.method, d.scratch_bytes, d.block_q) == (None, "auto", DEFAULT_SCRATCH_BYTES, 256)
  assert (s.tau, s.topk_ratio, s.sink_blocks, s.sink_q, s.tail, s.max_exact, s.method) == (
      1.0, 0.0, None, None, True, None, "auto")
  assert s.scratch_bytes == DEFAULT_SCRATCH_BYTES
  assert as_attention(None) == Dense() and as_attention(s) is s
  with pytest.raises(ValueError, match=r"attention must be Dense\(...\) or Sol\(...\)"):
    as_attention({"method": "fused"})


@pytest.mark.parametrize("kwargs, match", [
    (dict(sm_scale=0.0), "sm_scale must be a positive finite number"),
    (dict(sm_scale=-1.0), "sm_scale must be a positive finite number"),
    (dict(sm_scale=float("nan")), "sm_scale must be a positive finite number"),
    (dict(sm_scale=float("inf")), "sm_scale must be a positive finite number"),
    (dict(method="cudnn"), r"Dense method must be one of \('auto', 'streamed', 'fused'\), got 'cudnn'"),
    (dict(scratch_bytes=-1), "scratch_bytes must be a non-negative int"),
    (dict(scratch_bytes=1.5), "scratch_bytes must be a non-negative int"),
    (dict(scratch_bytes=True), "scratch_bytes must be a non-negative int"),
    (dict(block_q=96), "block_q must be a power of two >= 16"),
    (dict(block_q=8), "block_q must be a power of two >= 16"),
    (dict(block_q=64.0), "block_q must be a power of two >= 16"),
    (dict(num_warps=3), "num_warps must be one of"),
    (dict(num_stages=0), "num_stages must be one of"),
    (dict(num_stages=9), "num_stages must be one of"),
])
def test_dense_bad_settings_raise_at_construction(kwargs, match):
  with pytest.raises(ValueError, match=match):
    Dense(**kwargs)


@pytest.mark.parametrize("kwargs, match", [
    (dict(tau=float("nan")), "tau must not be NaN"),
    (dict(tau="high"), "tau must be a number"),
    (dict(tau=None), "tau must be a number"),
    (dict(topk_ratio=1.5), r"topk_ratio must be 0 or in \(0, 1\)"),
    (dict(topk_ratio=1.0), r"topk_ratio must be 0 or in \(0, 1\)"),
    (dict(topk_ratio=-0.1), r"topk_ratio must be 0 or in \(0, 1\)"),
    (dict(topk_ratio=float("nan")), r"topk_ratio must be 0 or in \(0, 1\)"),
    (dict(topk_ratio="most"), "topk_ratio must be a number"),
    (dict(sink_blocks=(3, 1)), r"sink_blocks must be \[start, end\) with end >= start"),
    (dict(sink_blocks=[0, 1, 2]), "sink_blocks must have 2 elements"),
    (dict(sink_blocks=(-1, 2)), "sink_blocks entries must be non-negative"),
    (dict(sink_blocks=(0.5, 2)), "sink_blocks entries must be ints"),
    (dict(sink_q=[0, 1, 2]), "sink_q must have 2 elements"),
    (dict(sink_q=(5, 4)), r"sink_q must be \[start, end\) with end >= start"),
    (dict(max_exact=2), "max_exact must be an int >= 3"),
    (dict(max_exact=3.5), "max_exact must be an int >= 3"),
    (dict(sm_scale=0), "sm_scale must be a positive finite number"),
    (dict(sm_scale=-1.0), "sm_scale must be a positive finite number"),
    (dict(method="dense"), r"Sol method must be one of \('auto', 'fused', 'streamed', 'streamed_int8'\)"),
    (dict(scratch_bytes=-5), "scratch_bytes must be a non-negative int"),
    (dict(num_warps=3), "num_warps must be one of"),
    (dict(num_stages=0), "num_stages must be one of"),
    (dict(route_chunk_bytes=0), "route_chunk_bytes must be a positive int"),
    (dict(route_chunk_bytes=1.5), "route_chunk_bytes must be a positive int"),
])
def test_sol_bad_settings_raise_at_construction(kwargs, match):
  with pytest.raises(ValueError, match=match):
    Sol(**kwargs)


def test_configs_normalize_and_are_hashable():
  s = Sol(tau=1, sink_blocks=[0, np.int64(2)], sink_q=np.array([3, 5]), max_exact=np.int32(8), tail=0)
  assert s.tau == 1.0 and type(s.tau) is float
  assert s.sink_blocks == (0, 2) and s.sink_q == (3, 5) and s.max_exact == 8 and s.tail is False
  same = Sol(tau=1.0, sink_blocks=(0, 2), sink_q=(3, 5), max_exact=8, tail=False)
  assert s == same and hash(s) == hash(same)
  assert Sol(tau=0.5) != Sol(tau=1.0)
  assert Dense(sm_scale=1) == Dense(sm_scale=1.0) and hash(Dense(sm_scale=1)) == hash(Dense(sm_scale=1.0))
  assert len({Dense(), Dense(), Sol(), Sol(), Dense(method="fused")}) == 3
  # A jit static argument: the same config hits the cache.
  calls = []
  f = jax.jit(lambda x, cfg: (calls.append(cfg), x)[1], static_argnums=1)
  f(1.0, Sol(sink_blocks=[0, 2]))
  f(1.0, Sol(sink_blocks=(0, 2)))
  assert len(calls) == 1
  with pytest.raises(dataclasses.FrozenInstanceError):
    Sol().tau = 0.5


@pytest.mark.parametrize("config", [
    Dense(), Dense(sm_scale=0.125, method="fused", scratch_bytes=0, block_q=64, num_warps=8, num_stages=3),
    Sol(), Sol(tau=-0.5, topk_ratio=0.3, sink_blocks=(0, 2), sink_q=(4, 6), tail=False, max_exact=16, sm_scale=0.1,
               method="streamed_int8", scratch_bytes=1 << 20, num_warps=8, num_stages=3, route_chunk_bytes=1 << 10),
], ids=["dense_default", "dense_all", "sol_default", "sol_all"])
def test_attention_json_round_trip(config):
  text = config.to_json()
  assert json.loads(text)["kind"] == config.kind
  again = attention_from_json(text)
  assert type(again) is type(config) and again == config and hash(again) == hash(config)
  assert again.to_json() == text


@pytest.mark.parametrize("text, match", [
    ("{bad", r"attention must be Dense\(...\).to_json\(\) or Sol\(...\).to_json\(\) text"),
    (None, r"attention must be Dense\(...\).to_json\(\) or Sol\(...\).to_json\(\) text"),
    ("[1]", "attention JSON must carry kind 'dense' or 'sol'"),
    ('{"tau": 0.5}', "attention JSON must carry kind 'dense' or 'sol'"),
    ('{"kind": "flash"}', "attention JSON must carry kind 'dense' or 'sol'"),
    ('{"kind": "sol", "tau": NaN}', "tau must not be NaN"),              # the config still checks itself
    ('{"kind": "dense", "method": "cudnn"}', "Dense method must be one of"),
])
def test_attention_from_json_refuses_bad_text(text, match):
  with pytest.raises(ValueError, match=match):
    attention_from_json(text)


def test_attention_from_json_refuses_unknown_fields_with_value_error():
  with pytest.raises(ValueError, match="blockq"):
    attention_from_json('{"kind": "dense", "blockq": 64}')


def test_equal_storages_hash_equal_and_bad_settings_name_their_field():
  from formats import PrecisionPolicy
  a = KVStorage(policy=PrecisionPolicy(256, {1: ((0, 64),), 2: ()}, {"cos": 0.99}), policy_key=1)
  b = KVStorage(policy=PrecisionPolicy(256, {2: (), 1: ((0, 64),)}), policy_key=1)
  assert a == b and hash(a) == hash(b)
  with pytest.raises(ValueError, match="block_classes"):
    KVStorage(block_classes=(0, 5))
  with pytest.raises(ValueError, match="sink_blocks"):
    Sol(sink_blocks=5)
  with pytest.raises(ValueError, match="tail"):
    Sol(tail="no")
  with pytest.raises(ValueError, match="block_q"):
    ProjectionTuning(block_q=64.0)


# ---------------------------------------------------------------------------------------
# QKVWeights and ProjectionTuning
# ---------------------------------------------------------------------------------------
def test_qkv_weights_is_a_pytree_with_none_leaves():
  w = jnp.ones((4, 6), jnp.bfloat16)
  full = QKVWeights(w, jnp.zeros((6,), jnp.float32), jnp.ones((2,)), jnp.full((2,), 2.0))
  bare = QKVWeights(w)
  assert (bare.bias, bare.q_norm_weight, bare.k_norm_weight) == (None, None, None)
  leaves, tree = jax.tree_util.tree_flatten(bare)
  assert len(leaves) == 1 and leaves[0] is w
  again = jax.tree_util.tree_unflatten(tree, leaves)
  assert isinstance(again, QKVWeights) and again.w_qkv is w and again.bias is None and again.k_norm_weight is None
  leaves, tree = jax.tree_util.tree_flatten(full)
  assert len(leaves) == 4
  doubled = jax.tree_util.tree_map(lambda a: a * 2, full)
  assert isinstance(doubled, QKVWeights)
  np.testing.assert_array_equal(np.asarray(doubled.k_norm_weight), [4.0, 4.0])
  # Through jit: None fields stay None, arrays come back as arrays.
  out = jax.jit(lambda p: p)(bare)
  assert isinstance(out, QKVWeights) and out.bias is None and out.q_norm_weight is None
  np.testing.assert_array_equal(np.asarray(out.w_qkv, np.float32), np.ones((4, 6)))
  assert jax.tree_util.tree_structure(bare) != jax.tree_util.tree_structure(full)


@pytest.mark.parametrize("kwargs, match", [
    (dict(block_q=96), "block_q must be a power of two >= 16"),
    (dict(block_q=8), "block_q must be a power of two >= 16"),
    (dict(block_h=48), "block_h must be a power of two >= 16"),
    (dict(q_heads_per_program=3), "q_heads_per_program must be 1, 2 or 4"),
    (dict(kv_blocks_per_program=4), "kv_blocks_per_program must be 1 or 2"),
    (dict(num_warps=3), "num_warps must be a power of two up to 16"),
    (dict(num_warps=(4, 3)), "num_warps must be a power of two up to 16"),
    (dict(num_warps=[4, 8]), r"num_warps must be None, an int or a \(q, kv\) pair"),
    (dict(num_stages=0), r"num_stages must be in 1..8"),
    (dict(num_stages=(2, 9)), r"num_stages must be in 1..8"),
    (dict(gemm_dtype="float16"), "gemm_dtype must be 'float32' or 'bfloat16'"),
    (dict(epilogue_num_warps=3), "epilogue_num_warps must be a power of two up to 16"),
    (dict(full_width_gemm="yes"), "full_width_gemm must be a bool"),
])
def test_projection_tuning_validates_every_field(kwargs, match):
  with pytest.raises(ValueError, match=match):
    ProjectionTuning(**kwargs)


def test_projection_tuning_valid_settings_construct_and_hash():
  t = ProjectionTuning(block_q=64, block_h=128, q_heads_per_program=4, kv_blocks_per_program=2, num_warps=(4, 8),
                       num_stages=2, gemm_dtype="bfloat16", epilogue_num_warps=8, full_width_gemm=False)
  assert hash(t) == hash(dataclasses.replace(t)) and t == dataclasses.replace(t)


# ---------------------------------------------------------------------------------------
# The layer: masks belong to Dense
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("mask", ["kv_mask", "segment_ids", "kv_lengths"])
def test_attention_layer_refuses_masks_with_sol(mask):
  """Valid inputs throughout: the only thing wrong is a mask given with Sol."""
  b, t, hidden, heads, d = 1, 64, 64, 1, 64
  layout = QKVLayout.h3(heads, d, 48)
  x = jnp.zeros((b, t, hidden), jnp.bfloat16)
  weights = QKVWeights(jnp.zeros((hidden, layout.width), jnp.bfloat16), None, jnp.ones((d,)), jnp.ones((d,)))
  tab = jnp.zeros((t, d), jnp.float32)
  value = {"kv_mask": jnp.ones((b, t), bool), "segment_ids": jnp.zeros((b, t), jnp.int32),
           "kv_lengths": jnp.full((b,), t, jnp.int32)}[mask]
  with pytest.raises(ValueError, match=r"Sol attention takes no segment ids or key masks.*attention=Dense"):
    pallas_kernels.attention_layer(x, weights, layout=layout, rope_cos=tab, rope_sin=tab, attention=Sol(),
                                   **{mask: value})
  with pytest.raises(ValueError, match=r"attention must be Dense\(...\) or Sol\(...\)"):
    pallas_kernels.attention_layer(x, weights, layout=layout, rope_cos=tab, rope_sin=tab, attention="sol")
