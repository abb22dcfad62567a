"""Summarize an Nsight Compute SASS export (stall samples per loop, spills), on any machine.

  ncu --import rep.ncu-rep --page source --print-source sass --csv | gzip > sass.csv.gz
  python3 -m benchmarks.probes.ncu_sass_summary sass.csv.gz [name,name,...]

For each profiled kernel (in launch order; names label them): the stall samples, the
local-memory (spill) instructions executed, and every run of consecutive SASS lines
with the same execution count that holds at least 1% of the samples. Such a run is a
loop body or a straight-line stretch, e.g. the compute warpgroups' key loop, with
its length in instructions and its top stall reasons.
"""
import collections
import csv
import gzip
import io
import sys


def load(path):
  kernels, cur = [], None
  for row in csv.reader(io.TextIOWrapper(gzip.open(path), "utf-8")):
    if row and row[0] == "Kernel Name":
      cur = {"rows": []}
      kernels.append(cur)
    elif row and row[0] == "Address":
      cur["hdr"] = {n: i for i, n in enumerate(row)}
    elif cur is not None and row:
      cur["rows"].append(row)
  return kernels


def summarize(k, name):
  ix = k["hdr"]
  col = lambda r, n: int(r[ix[n]] or 0)
  samples = lambda r: col(r, "Warp Stall Sampling (All Samples)")
  execs = lambda r: col(r, "Instructions Executed")
  stall_names = [n for n in ix if n.startswith("stall_") and "Not Issued" not in n]
  rows = k["rows"]
  total = sum(map(samples, rows)) or 1
  spills = [r for r in rows if "LDL" in r[1] or "STL" in r[1]]
  print(f"== {name}: {len(rows)} SASS lines, {total} samples, {sum(map(execs, rows))} warp instructions, "
        f"{len(spills)} spill lines executed {sum(map(execs, spills))} times ({sum(map(samples, spills))} samples)")
  runs = []
  for i, r in enumerate(rows):
    if runs and runs[-1]["exec"] == execs(r):
      runs[-1]["lines"].append(i)
    else:
      runs.append({"exec": execs(r), "lines": [i]})
  for run in runs:
    s = sum(samples(rows[i]) for i in run["lines"])
    if s < 0.01 * total:
      continue
    stalls = collections.Counter()
    for i in run["lines"]:
      for n in stall_names:
        stalls[n[6:]] += col(rows[i], n)
    nspill = sum(1 for i in run["lines"] if "LDL" in rows[i][1] or "STL" in rows[i][1])
    top = ", ".join(f"{n} {v / s:.0%}" for n, v in stalls.most_common(4))
    print(f"  lines {run['lines'][0]:5d}-{run['lines'][-1]:5d}: {len(run['lines']):4d} instructions x {run['exec']:9d}, "
          f"{s / total:6.1%} of samples, {nspill} spill instructions; {top}")


if __name__ == "__main__":
  ks = load(sys.argv[1])
  labels = sys.argv[2].split(",") if len(sys.argv) > 2 else [f"kernel {i}" for i in range(len(ks))]
  for k, label in zip(ks, labels):
    summarize(k, label)
