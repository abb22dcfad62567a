"""The K/V quality benchmark's quick version on the committed real-activation sample
(two SmolLM2 layers, 1,024 tokens): the fake quantizer that the lever study builds on
reproduces the format's own round trip (v2: 16-bit parameters), and the rows order as they must."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_sample_run_matches_the_format_and_orders_the_policies(tmp_path):
  out = tmp_path / "kvq.json"
  proc = subprocess.run([sys.executable, "-m", "benchmarks.kv_quality", "--sample", "--out", str(out)], cwd=ROOT,
                        capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stderr[-2000:]
  rows = {r["row"]: r for r in json.loads(out.read_text())["real_sample"]["rows"]}
  v1, fake = rows["format: all int4"], rows["lever: format v2 (fake quant, check)"]
  for layer, m in v1["layers"].items():   # same codes, same dequantized values, same attention
    assert abs(m["cos"] - fake["layers"][layer]["cos"]) < 1e-6, layer
  assert rows["format: all int8"]["worst_cos"] > 0.9999
  assert rows["format: all int8"]["median_cos"] > rows["format: int8 K, int4 V"]["median_cos"] > v1["median_cos"]
  assert rows["format: K per token, all int4"]["median_cos"] < v1["median_cos"]  # why K is per channel
