"""The README's main job, tiny: every variant of the e2e H3 layer runs in its own
process and the packed paths keep near-BF16 quality against the float32 layer."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_e2e_layer_small_runs_every_variant(tmp_path):
  out = tmp_path / "e2e.json"
  proc = subprocess.run([sys.executable, "-m", "benchmarks.e2e_h3", "--small", "--tokens", "200", "--runs", "1",
                         "--quality-rows", "48", "--out", str(out)], cwd=ROOT, capture_output=True, text=True,
                        timeout=600)
  assert proc.returncode == 0, proc.stderr[-2000:]
  assert "bf16 = the plain BF16 pipeline" in proc.stdout  # the legend
  result = json.loads(out.read_text())
  records = {r["variant"]: r for r in result["records"]}
  assert set(records) == {"bf16", "bf16_quant", "dense", "sol"}
  assert all(r["ok"] for r in records.values()), [r.get("error") for r in records.values()]
  assert all("device_peak_bytes" not in r for r in records.values())  # no device-level memory on a CPU
  quality = result["quality"]["200"]
  assert quality["bf16"]["cos"] > 0.9999
  for variant in ("bf16_quant", "dense"):
    assert quality[variant]["cos"] > 0.998 and quality[variant]["rel_l1"] < 0.06, quality[variant]
  assert quality["sol"]["cos"] > 0.9, quality["sol"]   # sparse: coarser by design on this data
  assert (tmp_path / "e2e.png").exists()
