"""The acceptance run's model loop (``benchmarks/card_budget.py``), tiny, on the CPU: the
loop runs every block of both passes with the garbage collector off, and the
search reports the largest T that passed even when a later, larger T failed."""
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from benchmarks import card_budget  # noqa: E402


def test_model_loop_smoke_runs_every_block(tmp_path):
  out = tmp_path / "loop.json"
  proc = subprocess.run([sys.executable, "-m", "benchmarks.card_budget", "--cpu-smoke", "--blocks", "dense,reference",
                         "--gc", "off", "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-2000:]
  records = json.loads(out.read_text())["records"]
  assert [(r["block"], r["gc"]) for r in records] == [("dense", "off"), ("reference", "off")]
  for r in records:
    assert r["ok"], r
    assert [(s["pass"], s["block"]) for s in r["steps"]] == [(p, b) for p in range(2) for b in range(2)]


BASE = {"block": "dense", "n_blocks": 2, "passes": 2}


def test_search_reports_the_largest_t_that_passed(monkeypatch):
  """Today's failure mode: a search whose upper runs fail must still report the
  largest T that completed, not None."""
  edge = 225_280
  monkeypatch.setattr(card_budget, "spawn", lambda cfg, timeout: dict(cfg, ok=cfg["tokens"] <= edge, steps=[]))
  found = card_budget.search_max_tokens(BASE, 221_184, 10, [], max_runs=8)
  assert found == {"largest_passed": edge, "smallest_failed": edge + card_budget.STEP, "pinned": True}
  found = card_budget.search_max_tokens(BASE, 262_144, 10, [], max_runs=3)
  assert found["largest_passed"] is None or found["largest_passed"] <= edge
  assert found["smallest_failed"] > edge and not found["pinned"]
  found = card_budget.search_max_tokens(BASE, 200_704, 10, [], max_runs=2)
  assert found["largest_passed"] >= 200_704 and not found["pinned"]
