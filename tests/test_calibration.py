"""formats.calibrate: int8 token ranges chosen by measured attention error, within a
bit budget, worst layer first; the policy as data (JSON, block classes)."""
import numpy as np
import pytest

from formats import packed_kv as fmt
from formats import KVStorage
from formats.calibration import PrecisionPolicy, attention_cos, calibrate, storage_roundtrip
from formats.reference import attention_f32

T, H, D = 512, 2, 64


def _layer(seed, hard_tokens=None):
  """DiT-like-enough q, k, v; ``hard_tokens`` (a, b): keys there get large per-channel
  offsets and the queries attend to them, so int4 hurts that range most."""
  rng = np.random.default_rng(seed)
  q = rng.normal(size=(T, H, D)).astype(np.float32)
  k = rng.normal(size=(T, H, D)).astype(np.float32)
  v = rng.normal(size=(T, H, D)).astype(np.float32)
  if hard_tokens:
    a, b = hard_tokens
    k[a:b] += 6.0 * rng.normal(size=(1, H, D)).astype(np.float32) * rng.uniform(0.5, 1.5, size=(b - a, 1, 1))
    k[a:b] += 3.0 * rng.normal(size=(b - a, H, D)).astype(np.float32)
    v[a:b] *= 4.0
    q += 0.3 * k[a:b].mean(0, keepdims=True)
  return q, k, v


@pytest.fixture(scope="module")
def samples():
  return {0: _layer(0), 1: _layer(1, (128, 256))}


def test_budget_worst_layer_first_and_measured(samples):
  pol = calibrate(samples, max_bits=5.25)
  rep = pol.report
  assert rep["bits_per_value"] <= 5.25 + 1e-6 and abs(pol.bits_per_value(1, D) - rep["bits_per_value"]) < 1e-9
  c4, cp = rep["cos_all_base"], rep["cos_policy"]
  assert c4["1"] < c4["0"]                        # the hard layer is the worst under int4
  assert min(cp.values()) > min(c4.values())      # and the policy lifts it (measured, not estimated)
  assert pol.ranges[1], "the worst layer got no int8 range"
  # The measured gains peak on the hard tokens, and the first ranges go there.
  assert 128 <= int(np.argmax(rep["gains"]["1"])) * 128 < 256
  assert any(a < 256 and b > 128 for a, b in pol.ranges[1])
  # Measured again independently: the report's cos is the policy's.
  q, k, v = samples[1]
  kd, vd = storage_roundtrip(k, v, pol.block_classes(1))
  assert abs(attention_cos(attention_f32(q, kd, vd), attention_f32(q, k, v)) - cp["1"]) < 1e-9


def test_no_budget_no_upgrade_and_target_stops_early(samples):
  pol = calibrate(samples, max_bits=fmt.bits_per_value(fmt.PackedKVMeta(1, 1, D, 64, (0,))))
  assert all(r == () for r in pol.ranges.values())
  rich = calibrate(samples, max_bits=8.0)
  c4 = rich.report["cos_all_base"]
  target = (min(c4.values()) + max(c4.values())) / 2   # between the two layers
  met = calibrate(samples, max_bits=8.0, target_cos=target)
  assert met.report["bits_per_value"] < rich.report["bits_per_value"]
  assert met.ranges[0] == ()                          # the easy layer already met it


def test_policy_is_data(samples):
  pol = calibrate(samples, max_bits=5.25)
  again = PrecisionPolicy.from_json(pol.to_json())
  assert again == pol and again.block_classes(1) == pol.block_classes(1)
  # What the kernels take: a KVStorage reading the policy's key.
  assert KVStorage(policy=again, policy_key=1).classes_for(T) == pol.block_classes(1)
  keyed = PrecisionPolicy(T, {(3, 0.5): ((0, 64),)})
  assert PrecisionPolicy.from_json(keyed.to_json()).block_classes((3, 0.5))[0] == fmt.CLASS_ID["int8"]
  with pytest.raises(ValueError, match="calibrated for T = 512, not T = 640.*calibrate again"):
    pol.block_classes(1, 640)
  with pytest.raises(KeyError, match="no calibrated classes for key 7"):
    pol.block_classes(7)


def test_other_classes_calibrate_the_same_way(samples):
  """A k5v4 base with k5v5 upgrades: the policy's blocks are those classes, within the
  budget, the hard layer lifted, and the pair survives JSON; a pair that is not an
  upgrade is refused."""
  pol = calibrate(samples, max_bits=5.4, base="k5v4", upgrade="k5v5")
  assert set(pol.block_classes(1)) == {fmt.CLASS_ID["k5v4"], fmt.CLASS_ID["k5v5"]}
  assert pol.report["bits_per_value"] <= 5.4 + 1e-6 and pol.ranges[1]
  assert min(pol.report["cos_policy"].values()) > min(pol.report["cos_all_base"].values())
  # 5-bit K on the base already beats int4 on the hard layer.
  assert pol.report["cos_all_base"]["1"] > calibrate(samples, max_bits=8.0).report["cos_all_base"]["1"]
  again = PrecisionPolicy.from_json(pol.to_json())
  assert (again.base, again.upgrade) == ("k5v4", "k5v5") and again.block_classes(1) == pol.block_classes(1)
  with pytest.raises(ValueError, match="must be a higher class than base 'k5v5'"):
    calibrate(samples, base="k5v5", upgrade="k5v4")
  with pytest.raises(ValueError, match="below the k5v4 class"):
    calibrate(samples, max_bits=5.0, base="k5v4")


def test_bad_input_names_the_fix(samples):
  with pytest.raises(ValueError, match="at least one"):
    calibrate({})
  with pytest.raises(ValueError, match="below the int4 class"):
    calibrate(samples, max_bits=4.0)
  q, k, v = samples[0]
  with pytest.raises(ValueError, match="same T"):
    calibrate({0: (q, k, v), 1: (q[:256], k[:256], v[:256])})
  with pytest.raises(ValueError, match="not a multiple of K/V heads"):
    calibrate({0: (np.zeros((T, 3, D), np.float32), k, v)})
  with pytest.raises(ValueError, match="head_dim 32"):
    calibrate({0: (q[..., :32], k[..., :32], v[..., :32])})


def test_benchmark_sample_run(tmp_path):
  """benchmarks.kv_calibration --sample: every policy row on both halves of the real
  sample, each within its bits, and the calibrated policy never below all-int4."""
  import json
  import os
  import subprocess
  import sys
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  out = tmp_path / "kvc.json"
  proc = subprocess.run([sys.executable, "-m", "benchmarks.kv_calibration", "--sample", "--out", str(out)], cwd=root,
                        capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stderr[-2000:]
  rows = {(r["policy"].split(" (")[0].split(",")[0], r["data"]): r for r in json.loads(out.read_text())["rows"]}
  assert len(rows) == 8
  for (policy, data), r in rows.items():
    limit = {"all int4": 4.625, "calibrated": 5.25, "uniform": 5.25, "all int8": 8.625}[policy]
    assert r["bits_per_value"] <= limit + 1e-6, (policy, r["bits_per_value"])
  cal = rows[("calibrated", "calibration tokens")]
  assert cal["worst_cos"] > rows[("all int4", "calibration tokens")]["worst_cos"]
  assert rows[("all int8", "held-out tokens")]["worst_cos"] > 0.9999
