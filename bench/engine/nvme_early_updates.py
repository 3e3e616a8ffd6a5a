#!/usr/bin/env python3
"""Early, exact updates with the optimizer state on NVMe (issue 24 §1 and §2's
NVMe step targets; docs/engine.md "Early, exact updates").

One ABBA round of `strata train` runs (medians of steps 2..8 each): the
in-memory baseline (stage 2, optimizer on the device) and stages 1-3 with the
optimizer state on NVMe, early updates off ("late": under the next forward
only) and on ("early": under the backward too). Prints each row's median step
and its ratio to the baseline (the issue's targets: stages 1-2 <= 1.05x,
stage 3 <= 1.10x), with the per-run samples in order.

With --params-nvme the rows are stage 3 with the parameter shards on NVMe
too (offload_param nvme), the optimizer state on cpu and on NVMe, early
updates off and on (each early update writes its shard back at once).

Usage: nvme_early_updates.py [--params-nvme] STRATA NVME_DIR [fp32|int8] [CLIP] [JSON]
"""
import json, os, sys, statistics, tempfile, time
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_medians import train_medians
params_nvme = "--params-nvme" in sys.argv
if params_nvme:
  sys.argv.remove("--params-nvme")
if len(sys.argv) < 3:
  sys.exit(__doc__)
S, nvme_dir = sys.argv[1], sys.argv[2]
if not os.path.isdir(nvme_dir):
  sys.exit(f"nvme_early_updates.py: NVME_DIR '{nvme_dir}' is not a directory")
base = ["--preset", "small", "--batch", "4", "--seq", "64", "--device-threads", "1", "--optimizer-threads", "1"]
nv = ["--offload-optimizer", "nvme", "--nvme-path", nvme_dir]
moments = sys.argv[3] if len(sys.argv) > 3 else "fp32"
clip = sys.argv[4] if len(sys.argv) > 4 else "0"
out_json = sys.argv[5] if len(sys.argv) > 5 else None
if moments not in ("fp32", "int8"):
  sys.exit(f"nvme_early_updates.py: moments '{moments}' is not fp32 or int8")
int8_config = os.path.join(tempfile.mkdtemp(), "int8.json")
with open(int8_config, "w") as f:
  json.dump({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": nvme_dir}},
             "train_micro_batch_size_per_gpu": 4, "strata": {"optimizer_state_dtype": "int8"}}, f)
common = base + ["--clip", clip]
V = {
  "s2 memory": ["--stage", "2", "--offload-optimizer", "none"],
  "s1 nvme late": ["--stage", "1", *nv, "--speculative-optimizer", "off"],
  "s1 nvme early": ["--stage", "1", *nv, "--speculative-optimizer", "on"],
  "s2 nvme late": ["--stage", "2", *nv, "--speculative-optimizer", "off"],
  "s2 nvme early": ["--stage", "2", *nv, "--speculative-optimizer", "on"],
  "s3 nvme late": ["--stage", "3", *nv, "--speculative-optimizer", "off"],
  "s3 nvme early": ["--stage", "3", *nv, "--speculative-optimizer", "on"],
}
if params_nvme:
  pn = ["--stage", "3", "--offload-param", "nvme", "--nvme-path", nvme_dir]
  V = {
    "s2 memory": ["--stage", "2", "--offload-optimizer", "none"],
    "s3 p+o cpu late": [*pn, "--offload-optimizer", "cpu", "--speculative-optimizer", "off"],
    "s3 p+o cpu early": [*pn, "--offload-optimizer", "cpu", "--speculative-optimizer", "on"],
    "s3 p+o nvme late": [*pn, "--offload-optimizer", "nvme", "--speculative-optimizer", "off"],
    "s3 p+o nvme early": [*pn, "--offload-optimizer", "nvme", "--speculative-optimizer", "on"],
  }
if moments != "fp32":
  for k in V:
    if "nvme" in k: V[k] = ["--config", int8_config] + V[k]
F = {"step_ms": lambda r: r["step_ms"], "exposed": lambda r: r["exposed_ms"]["optimizer"],
     "early": lambda r: r.get("early_updates", {}).get("layers", 0), "redone": lambda r: r.get("early_updates", {}).get("redone", 0),
     "nvme_mb": lambda r: (r["bytes"]["nvme_read"] + r["bytes"]["nvme_write"]) / 1e6}
names = list(V)
order = names + names[::-1]
res = {n: [] for n in names}
for n in order:
  m = train_medians(S, common + V[n], [], 8, F)
  res[n].append(m)
  print(f"{time.strftime('%H:%M:%S')} {n:17s} step {m['step_ms']:7.1f} exposed {m['exposed']:6.1f} early {m['early']:.0f} redone {m['redone']:.0f}", flush=True)
base_ms = statistics.median([r["step_ms"] for r in res["s2 memory"]])
print(f"moments {moments} clip {clip}; baseline s2 memory {base_ms:.1f} ms")
for n in names:
  ms = statistics.median([r["step_ms"] for r in res[n]])
  print(f"{n:17s} median {ms:7.1f} ms  ratio {ms/base_ms:.3f}  pairs {[round(r['step_ms'],1) for r in res[n]]}")
if out_json:
  json.dump(res, open(out_json, "w"))
