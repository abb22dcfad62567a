"""Ulysses sequence parallelism on four host CPU devices (interpret mode, small shapes).

JAX fixes its device count when it starts, so each case runs in a fresh process with
``--xla_force_host_platform_device_count=4`` (``_worker``) and reports JSON; the
assertions are here. Ragged T (a short shard and an empty one), a mixed class map
(int8 prefix on device 0, a bf16 block on the ragged tail), and both attentions.
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _worker(case: dict) -> dict:
  """Runs in the child: the sharded layer and exchange against the single-device ones."""
  import jax
  from jax.sharding import Mesh
  return _worker_on(case, Mesh(np.array(jax.devices()[:case["devices"]]), ("sp",)))


def _worker_on(case: dict, mesh) -> dict:
  import jax.numpy as jnp

  from formats import KVStorage
  from formats import packed_kv as fmt
  from pallas_kernels import Dense, QKVLayout, QKVWeights, Sol, layer, rope
  from pallas_kernels import qkv_projection as sq
  from pallas_kernels import sequence_parallel as sp

  t, h, d, hidden, rot, devices = (case[k] for k in ("tokens", "heads", "head_dim", "hidden", "rot_dim", "devices"))
  rng = np.random.default_rng(case["seed"])
  x = jnp.asarray(rng.normal(size=(case["batch"], t, hidden)), jnp.bfloat16)
  w = jnp.asarray(rng.normal(size=(hidden, 3 * h * d)) / np.sqrt(hidden), jnp.bfloat16)
  bias = jnp.asarray(0.1 * rng.normal(size=3 * h * d), jnp.bfloat16) if case["bias"] else None
  cos, sin = rope.rope_tables(np.arange(t)[:, None] * 1e4 ** (-np.arange(rot // 2) / (rot // 2)), d)
  storage = KVStorage(token_ranges=[tuple(r) for r in case["ranges"]]) if case["ranges"] else None
  weights = QKVWeights(w, bias, q_norm_weight=jnp.asarray(1 + 0.1 * rng.normal(size=d), jnp.float32),
                       k_norm_weight=jnp.asarray(1 + 0.1 * rng.normal(size=d), jnp.float32))
  kw = dict(rope_cos=cos, rope_sin=sin, layout=QKVLayout.h3(h, d, rot), storage=storage,
            interpret=case.get("interpret", True))
  rec = {"plan": sp.ulysses_plan(t, devices, None if storage is None else storage.classes_for(t)).local_tokens}
  if case.get("ring"):
    ref = layer.attention_layer(x, weights, **kw)
    out = sp.ring_attention_layer(x, weights, mesh=mesh, axis_name="sp", **kw)
    a, b = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    rec.update(out_shape=list(out.shape), out_spec=list(out.sharding.spec), out_finite=bool(np.isfinite(a).all()),
               out_rel_l2=float(np.linalg.norm(a - b) / np.linalg.norm(b)))
    return rec
  if case.get("expect_error"):
    try:
      sp.ulysses_attention_layer(x, weights, mesh=mesh, axis_name="sp", **kw)
      rec["error"] = None
    except ValueError as e:
      rec["error"] = str(e)
    return rec
  q1, p1 = sq.streamed_qkv(x, weights, **kw)
  q2, p2 = sp.ulysses_qkv(x, weights, mesh=mesh, axis_name="sp", **kw)
  rec["q_equal"] = bool((np.asarray(q1, np.float32) == np.asarray(q2, np.float32)).all())
  rec["q_spec"] = list(q2.sharding.spec)
  rec["arrays"] = {}
  for n in fmt.ARRAY_NAMES:
    a, b = np.asarray(p1.arrays[n], np.float32), np.asarray(p2.arrays[n], np.float32)
    rec["arrays"][n] = {"shape_equal": a.shape == b.shape,
                        "max_rel": float(np.abs(a - b).max() / max(np.abs(a).max(), 1e-30)) if a.size else 0.0}
  attention = Sol(tau=0.5) if case["attention"] == "sol" else Dense()
  ref = layer.attention_layer(x, weights, attention=attention, **kw)
  # NaN-poisoned padding would show here: every row of the output must be finite.
  out = sp.ulysses_attention_layer(x, weights, mesh=mesh, axis_name="sp", attention=attention, **kw)
  a, b = np.asarray(out, np.float32), np.asarray(ref, np.float32)
  rec["out_shape"] = list(out.shape)
  rec["out_spec"] = list(out.sharding.spec)
  rec["out_finite"] = bool(np.isfinite(a).all())
  rec["out_rel_l2"] = float(np.linalg.norm(a - b) / np.linalg.norm(b))
  return rec


def _run(case: dict) -> dict:
  env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=4", JAX_PLATFORMS="cpu")
  code = ("import json, sys; sys.path.insert(0, %r); from tests.test_sequence_parallel import _worker; "
          "print('RESULT ' + json.dumps(_worker(json.loads(sys.argv[1]))))" % ROOT)
  proc = subprocess.run([sys.executable, "-c", code, json.dumps(case)], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")][-1]
  return json.loads(line[len("RESULT "):])


BASE = dict(heads=8, head_dim=64, hidden=96, rot_dim=48, batch=1, seed=0, bias=False, ranges=None, attention="dense")


@pytest.mark.parametrize("case", [
    # T = 300 on 4 devices: shards of 128, 128, 44 and 0 rows; int8 first block, bf16 tail.
    dict(BASE, tokens=300, devices=4, ranges=[[0, 300, "int4"], [0, 64, "int8"], [260, 300, "bf16"]], bias=True),
    # Two devices, batch 2, all int4, Sol attention.
    dict(BASE, tokens=200, devices=2, batch=2, seed=1, attention="sol"),
], ids=["dense_p4_ragged_mixed", "sol_p2_batch2"])
def test_ulysses_equals_one_device(case):
  rec = _run(case)
  assert rec["q_equal"], "Q after the exchange differs from the single-device projection"
  assert rec["q_spec"] == [None, None, "sp"]
  for name, m in rec["arrays"].items():
    assert m["shape_equal"], name
    # Codes, scales, zeros and bf16 stores are the same values; the block stats of a
    # ragged block may differ by float32 summation order.
    limit = 1e-6 if name in ("k_mean", "v_sum") else 0.0
    assert m["max_rel"] <= limit, (name, m)
  assert rec["out_shape"][1] == case["tokens"]
  assert rec["out_spec"][:2] == [None, "sp"]
  assert rec["out_finite"]
  assert rec["out_rel_l2"] < 1e-3, rec["out_rel_l2"]


def test_ring_takes_any_device_count():
  """Ring on 4 devices with 6 heads (Ulysses cannot split them), ragged shards (128,
  128, 44, 0 rows), mixed classes, batch 2: equal to the one-device layer up to the
  merge of bf16 partial outputs."""
  rec = _run(dict(BASE, heads=6, tokens=300, devices=4, batch=2, bias=True, ring=True,
                  ranges=[[0, 300, "int4"], [0, 64, "int8"], [260, 300, "bf16"]]))
  assert rec["plan"] == [128, 128, 44, 0]
  assert rec["out_shape"] == [2, 300, 6, 64] and rec["out_spec"][:2] == [None, "sp"]
  assert rec["out_finite"]
  assert rec["out_rel_l2"] < 1e-2, rec["out_rel_l2"]


def test_heads_not_divisible_names_the_sizes_that_work():
  rec = _run(dict(BASE, tokens=128, devices=3, expect_error=True))
  assert rec["error"] and "not divisible by P=3" in rec["error"] and "[1, 2, 4, 8]" in rec["error"]


def test_plan_and_wire_bytes():
  from pallas_kernels import sequence_parallel as sp
  from formats import KVStorage
  plan = sp.ulysses_plan(300, 4, KVStorage(token_ranges=[(0, 300, "int4"), (0, 64, "int8")]).classes_for(300))
  assert plan.shard_tokens == 128 and plan.local_tokens == (128, 128, 44, 0)
  assert plan.capacity == (2, 1, 0) and plan.block_classes == (1, 0, 0, 0, 0)
  assert len(plan.branches()) == 4
  with pytest.raises(NotImplementedError, match=r"sequence parallelism reads classes .* not \['k5v4'\]"):
    sp.ulysses_plan(300, 4, (0, 3, 0, 0, 0))
  # H3 at T = 152,263 on 8 devices, all int4: K/V at 4.625 bits a value (format v2:
  # codes, f16 scales and zeros, bf16 block stats) against 16, to within padding.
  wb = sp.wire_bytes(152_263, 56, 128, 8)
  assert abs(wb["kv_ratio"] - 4.625 / 16) < 0.01, wb
  s = -(-152_263 // (8 * 64)) * 64
  assert wb["bf16"] == 7 * s * 56 * 128 * 2 * 4      # Q, K, V out and O back, 7/8 of 8 shards
  assert wb["ratio"] < 0.7
  assert abs(wb["ring_ours"] / wb["ring_bf16"] - wb["kv_ratio"]) < 1e-9
  with pytest.raises(ValueError, match="positive"):
    sp.ulysses_plan(0, 4)
  # The storage decides the K/V bytes: an int8 prefix sends more than all int4.
  mixed = sp.wire_bytes(152_263, 56, 128, 8, storage=KVStorage(token_ranges=[(0, 8192, "int8")]))
  assert mixed["kv_ours"] > wb["kv_ours"] and mixed["bf16"] == wb["bf16"]
  assert sp.wire_bytes(152_263, 56, 128, 8, storage=KVStorage()) == wb
  with pytest.raises(ValueError, match="storage must be a formats.KVStorage"):
    sp.wire_bytes(300, 8, 64, 4, storage=(1, 0, 0, 0, 0))


def test_config_errors_before_any_work():
  """Settings are values: a bad one raises at the call, before the shard_map program
  (a one-device mesh is enough)."""
  import jax
  import jax.numpy as jnp
  from jax.sharding import Mesh
  from formats import KVStorage
  from pallas_kernels import Dense, QKVLayout, QKVWeights, Sol, rope
  from pallas_kernels import sequence_parallel as sp

  mesh = Mesh(np.array(jax.devices()[:1]), ("sp",))
  t, h, d = 128, 2, 64
  cos, sin = rope.rope_tables(np.arange(t)[:, None] * 1e4 ** (-np.arange(24) / 24), d)
  x = jnp.zeros((1, t, 32), jnp.bfloat16)
  weights = QKVWeights(jnp.zeros((32, 3 * h * d), jnp.bfloat16), None, jnp.ones((d,)), jnp.ones((d,)))
  kw = dict(mesh=mesh, axis_name="sp", layout=QKVLayout.h3(h, d, 48), rope_cos=cos, rope_sin=sin)
  with pytest.raises(ValueError, match="ulysses_attention_layer"):
    sp.ring_attention_layer(x, weights, attention=Sol(), **kw)
  with pytest.raises(ValueError, match="fused"):
    sp.ring_attention_layer(x, weights, attention=Dense(method="streamed"), **kw)
  with pytest.raises(ValueError, match="Dense"):
    sp.ulysses_attention_layer(x, weights, attention="sol", **kw)
  with pytest.raises(ValueError, match="QKVWeights"):
    sp.ulysses_qkv(x, jnp.zeros((32, 3 * h * d), jnp.bfloat16), **kw)
  with pytest.raises(ValueError, match="block_classes has 1 entries"):
    sp.ulysses_attention_layer(x, weights, storage=KVStorage(block_classes=(0,)), **kw)
  with pytest.raises(ValueError, match="not an axis"):
    sp.ulysses_qkv(x, weights, **dict(kw, axis_name="tp"))


def test_benchmark_cpu_smoke(tmp_path):
  """The multi-GPU benchmark's code path on 4 host devices: every variant runs."""
  out = tmp_path / "sp.json"
  proc = subprocess.run([sys.executable, "-m", "benchmarks.bench_sequence_parallel", "--cpu-smoke", "--runs", "1",
                         "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rec = json.loads(out.read_text())
  assert {(r["variant"], r["devices"]) for r in rec["rows"]} == {("one", 1)} | {
      (v, p) for v in ("bf16", "ours", "ring") for p in (2, 4)}
  assert all(r["ok"] for r in rec["rows"]), [r.get("error") for r in rec["rows"]]
  assert rec["wire_bytes_h3_152k"]["8"]["ratio"] < 0.7


@pytest.mark.gpu
def test_one_gpu_mesh_lowers_and_matches():
  """On the GPU (one card: P = 1): the shard_map program with the Triton/cuDNN paths
  inside lowers, runs and equals the one-device layer (the exchange is the identity)."""
  import jax
  from jax.sharding import Mesh
  rec_case = dict(BASE, tokens=1000, devices=1, head_dim=128, rot_dim=96, hidden=256,
                  ranges=[[0, 1000, "int4"], [0, 128, "int8"]], interpret=None)
  assert jax.default_backend() == "gpu"
  mesh = Mesh(np.array(jax.devices()[:1]), ("sp",))
  rec = _worker_on(rec_case, mesh)
  assert rec["q_equal"] and rec["out_finite"] and rec["out_rel_l2"] < 1e-3, rec
  rec = _worker_on(dict(rec_case, ring=True), mesh)   # the ring's one hop: fused kernel with its LSE
  assert rec["out_finite"] and rec["out_rel_l2"] < 1e-2, rec
