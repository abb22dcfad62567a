"""What every benchmark shares: timing, device-level memory, run info, results files and
the scorecard (``../shared/SCORECARD.md``: ``benchmarks/results/scorecard.json``).

Device-level memory is ``cudaMemGetInfo`` (through torch), sampled by a thread while
the measured code runs: what the card sees, whichever framework allocated it.
"""
from __future__ import annotations

import datetime
import json
import os
import platform
import re
import shlex
import statistics
import sys
import threading
import time
from importlib import metadata

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
SCORECARD = os.path.join(RESULTS, "scorecard.json")
GIB = float(1 << 30)
MIB = float(1 << 20)
PACKAGES = ("jax", "jaxlib", "jax-cuda12-plugin", "jax-cuda13-plugin", "triton", "torch", "numpy",
            "comfy-kitchen")


def package_versions() -> dict:
  """Installed versions, read from package metadata: nothing is imported, so a parent
  process can call this without starting JAX's GPU backend."""
  v = {"python": platform.python_version()}
  for name in PACKAGES:
    try:
      v[name] = metadata.version(name)
    except metadata.PackageNotFoundError:
      pass
  return v


def device_name() -> str:
  """The accelerator JAX sees (e.g. 'NVIDIA H100 80GB HBM3'), or 'cpu'."""
  import jax
  dev = jax.devices()[0]
  return getattr(dev, "device_kind", None) or dev.platform


def time_fn(fn, warmup: int = 1, repeats: int = 3, sync=None):
  """Median wall seconds of ``fn()`` over ``repeats`` calls after ``warmup`` calls;
  ``sync`` (default ``jax.block_until_ready``) waits for each result."""
  if sync is None:
    import jax
    sync = jax.block_until_ready
  for _ in range(warmup):
    sync(fn())
  times = []
  for _ in range(repeats):
    t0 = time.perf_counter()
    sync(fn())
    times.append(time.perf_counter() - t0)
  return statistics.median(times), times


def device_free_bytes(device=None) -> int:
  """cudaMemGetInfo's free bytes on CUDA device ``device`` (default: the current one)."""
  import torch
  return torch.cuda.mem_get_info(device)[0]


class LowWater:
  """Samples device free memory in a thread while the block runs; ``low`` is the least
  seen (bytes). Peaks shorter than the sampling period can slip past; the benchmarks'
  buffers live for milliseconds to seconds."""

  def __init__(self, period_s: float = 0.0005, device=None):
    self.period_s = period_s
    self.device = device
    self.low = None
    self._stop = threading.Event()
    self._thread = None

  def _run(self):
    while not self._stop.is_set():
      free = device_free_bytes(self.device)
      self.low = free if self.low is None else min(self.low, free)
      time.sleep(self.period_s)

  def __enter__(self):
    self.low = device_free_bytes(self.device)
    self._stop.clear()
    self._thread = threading.Thread(target=self._run, daemon=True)
    self._thread.start()
    return self

  def __exit__(self, *exc):
    self._stop.set()
    self._thread.join()
    self.low = min(self.low, device_free_bytes(self.device))
    return False


def run_record(argv=None) -> dict:
  """The command, date and versions every results file carries."""
  argv = list(sys.argv if argv is None else argv)
  if argv and argv[0].endswith(".py"):  # run as ``python3 -m benchmarks.x``: say so
    rel = os.path.relpath(os.path.abspath(argv[0]), ROOT)
    if not rel.startswith(".."):
      argv = ["python3", "-m", rel[:-3].replace(os.sep, ".")] + argv[1:]
  return {"command": " ".join(shlex.quote(a) for a in argv), "date": datetime.date.today().isoformat(),
          "versions": package_versions()}


def short_card(card: str) -> str:
  """'NVIDIA H100 80GB HBM3' -> 'h100', 'NVIDIA H200' -> 'h200', 'cpu' -> 'cpu'."""
  m = re.search(r"\b([A-Z]\d{2,4}[A-Z]?)\b", card)
  return m.group(1).lower() if m else card.split()[0].lower()


def result_path(prefix: str, card: str) -> str:
  """``benchmarks/results/<prefix>_<card>_<date>.json``: one file per benchmark, card
  and day, so a later run never overwrites a file that documents cite."""
  return os.path.join(RESULTS, f"{prefix}_{short_card(card)}_{datetime.date.today().isoformat()}.json")


def write_json(path: str, record: dict) -> None:
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  with open(path, "w") as f:
    json.dump(record, f, indent=1, default=float)
    f.write("\n")
  print(f"wrote {path}", flush=True)


def update_scorecard(entries: dict, *, card: str, source: str, command: str, path: str = SCORECARD) -> None:
  """Read, update and write back ``scorecard.json``: each key gets exactly the five
  fields of SCORECARD.md. Other entries are kept."""
  card_json = {}
  if os.path.exists(path):
    with open(path) as f:
      card_json = json.load(f)
  rel = os.path.relpath(os.path.abspath(source), ROOT)
  for key, value in entries.items():
    if value is None:
      continue
    card_json[key] = {"value": value, "card": card, "source": rel, "command": command,
                      "date": datetime.date.today().isoformat()}
  write_json(path, dict(sorted(card_json.items())))


def answer_as_child(child_arg: str | None, child) -> bool:
  """In the fresh process ``run_child`` starts (``--child <JSON>``): run ``child(cfg)`` and
  print its ``RESULT`` line. False (nothing done) in the parent."""
  if not child_arg:
    return False
  print("RESULT " + json.dumps(child(json.loads(child_arg)), default=float), flush=True)
  return True


def run_child(module: str, cfg: dict, timeout: int) -> dict:
  """Run ``python -m <module> --child <cfg as JSON>`` in a fresh process (each
  configuration's memory its own) and return the dict it prints after ``RESULT ``; on a
  crash or timeout, ``cfg`` with ok=False and the error."""
  import subprocess
  env = dict(os.environ, PYTHONUNBUFFERED="1")
  try:
    proc = subprocess.run([sys.executable, "-m", module, "--child", json.dumps(cfg)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
  except subprocess.TimeoutExpired:
    return dict(cfg, ok=False, error=f"timed out after {timeout} s")
  for line in proc.stdout.splitlines():
    if line.startswith("RESULT "):
      return json.loads(line[len("RESULT "):])
  return dict(cfg, ok=False, error=(proc.stderr or proc.stdout)[-1500:])


def largest_passing(run, start: int, step: int, max_runs: int) -> dict:
  """The largest multiple of ``step`` for which ``run(t)`` is True: bracket the edge from
  ``start`` (doubling steps up or down), then bisect. ``run`` returns True, False, or None
  to stop (out of time). Returns the largest T that passed and the smallest that failed;
  ``pinned`` says whether they are one step apart (else ``max_runs`` or ``run`` stopped
  the search first)."""
  passed, failed = [], []

  class _Stop(Exception):
    pass

  def probe(t):
    if len(passed) + len(failed) >= max_runs:
      raise _Stop
    ok = run(t)
    if ok is None:
      raise _Stop
    (passed if ok else failed).append(t)
    return ok

  try:
    t = max(step, start // step * step)
    grow = step
    if probe(t):
      lo, hi = t, None
      while hi is None:
        if probe(lo + grow):
          lo, grow = lo + grow, 2 * grow
        else:
          hi = lo + grow
    else:
      lo, hi = None, t
      while lo is None and hi - grow >= step:
        if probe(hi - grow):
          lo = hi - grow
        else:
          hi, grow = hi - grow, 2 * grow
    while lo is not None and hi - lo > step:
      mid = (lo + hi) // 2 // step * step
      if probe(mid):
        lo = mid
      else:
        hi = mid
  except _Stop:
    pass
  best, worst = max(passed, default=None), min(failed, default=None)
  return {"largest_passed": best, "smallest_failed": worst,
          "pinned": best is not None and worst is not None and worst - best == step}


def table(rows, columns) -> str:
  """A small fixed-width text table: ``columns`` is a list of (header, key, format)."""
  head = [h for h, _, _ in columns]
  body = [[("-" if r.get(k) is None else fmt.format(r[k])) for _, k, fmt in columns] for r in rows]
  widths = [max(len(x) for x in col) for col in zip(head, *body)]
  line = lambda cells: "  ".join(c.rjust(w) for c, w in zip(cells, widths))
  return "\n".join([line(head), line(["-" * w for w in widths])] + [line(b) for b in body])
