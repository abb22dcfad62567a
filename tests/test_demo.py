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
  # On a CPU the times are the interpreter's: no time ratio to BF16 and no plot that would
  # read as one.
  assert "ms (interpreter)" in proc.stdout and "vs bf16" not in proc.stdout.split("card:")[-1]
  assert not (tmp_path / "e2e.png").exists()


def test_demo_leads_with_the_memory_story_at_the_users_size():
  """Computed bytes at T = 152,263 beside the BF16 QKV, from required_bytes itself."""
  from benchmarks.demo import memory_story
  from pallas_kernels import QKVLayout, required_bytes
  text = memory_story()
  need = required_bytes(152_263, QKVLayout.h3(56, 128), 5376)["peak"] / 2 ** 30
  assert "152,263" in text and "6.10 GiB" in text and f"{need:.2f} GiB" in text, text
