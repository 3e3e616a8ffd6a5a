#!/usr/bin/env python3
"""What a checkpoint costs the training loop (issue 13).

Runs `strata train` on the same model and folder three ways, interleaved
(the order rotates every round so disk and CPU drift do not favour one):
  none   no saves
  async  --save-every K (the default: snapshot on the optimizer thread, written in the background; 2 slots)
  asyncN the same with --save-slots N
  sync   --save-every K --save-sync (each save blocks until written and committed)
and reports per mode: the whole run's wall time, the median time a save
blocked the step that asked for it (from the step log), the median step
time of the step after a save (where an asynchronous save's snapshot and
writes overlap training), bytes per save and the save's write rate beside
`strata io-bench --mode write` on the same folder (the drive's ceiling),
measured in the same run. Then host memory: the process's peak RSS with 1
save against 10 saves, and the engine's own host peak after the 1st and
the 10th save (the JSON log), which must be equal.

  bench/engine/checkpoint_bench.py build/apps/strata /tmp/ckbench --rounds 3
"""
import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys

MODEL = ["--preset", "tiny", "--layers", "4", "--embd", "512", "--heads", "8", "--batch", "2", "--seq", "64",
         "--eval-every", "0", "--eval-batches", "1", "--stage", "2", "--offload-optimizer", "cpu"]


def run_train(strata, extra, folder, tag):
    log = os.path.join(folder, f"{tag}.jsonl")
    cmd = ["/usr/bin/time", "-f", "TIME %e %M", strata, "train", *MODEL, *extra, "--json-log", log]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{p.stdout}\n{p.stderr}")
    m = re.search(r"TIME ([0-9.]+) ([0-9]+)", p.stderr)
    wall, rss_kib = float(m.group(1)), int(m.group(2))
    steps = [json.loads(line) for line in open(log)]
    saved = re.search(r"wrote ([0-9.]+ \w+) in ([0-9.]+) s \(([0-9.]+) GB/s\)", p.stdout)
    return {"wall": wall, "rss_mib": rss_kib / 1024, "steps": steps,
            "last_save": (saved.group(1), float(saved.group(2)), float(saved.group(3))) if saved else None}


def io_bench_write(strata, folder):
    p = subprocess.run([strata, "io-bench", "--path", folder, "--size", "512MiB", "--mode", "write", "--json"],
                       capture_output=True, text=True)
    if p.returncode != 0:
        return None
    rows = json.loads(p.stdout)["results"]
    rates = [r["gb_per_s"] for r in rows if r.get("mode") == "write"]
    return max(rates) if rates else None


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("strata")
    ap.add_argument("folder", help="where the checkpoints go (removed and re-created)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--every", type=int, default=2)
    ap.add_argument("--slots", type=int, default=8, help="--save-slots of the second async mode (the first has 2)")
    a = ap.parse_args()
    shutil.rmtree(a.folder, ignore_errors=True)
    os.makedirs(a.folder)
    every = ["--save-every", str(a.every)]
    modes = {"none": [], "async": every, f"async{a.slots}": every + ["--save-slots", str(a.slots)],
             "sync": every + ["--save-sync"]}
    order = list(modes)
    results = {k: [] for k in modes}
    ceilings = []
    for rnd in range(a.rounds):
        ceilings.append(io_bench_write(a.strata, a.folder))
        seq = order[rnd % len(order):] + order[:rnd % len(order)]
        if rnd % 2 == 1:
            seq.reverse()
        for mode in seq:
            d = os.path.join(a.folder, f"{mode}-{rnd}")
            extra = ["--steps", str(a.steps)] + modes[mode] + (["--save-dir", d, "--keep", "2"] if mode != "none" else [])
            results[mode].append(run_train(a.strata, extra, a.folder, f"{mode}-{rnd}"))
            shutil.rmtree(d, ignore_errors=True)
        print(f"round {rnd + 1}: order {' '.join(seq)}; io-bench write {ceilings[-1]} GB/s", flush=True)
    print(f"\nmodel: {' '.join(MODEL)}; {a.steps} steps, a save every {a.every} (async and sync), {a.rounds} rounds")
    print(f"{'mode':<7} {'wall s (per round)':<26} {'blocked ms (median)':>20} {'step after save ms':>20} "
          f"{'other steps ms':>15} {'bytes/save':>11} {'save GB/s':>10}")
    for mode, runs in results.items():
        blocked, after, other = [], [], []
        for r in runs:
            saves = {s["step"] for s in r["steps"] if s.get("save")}
            for s in r["steps"]:
                if s["step"] == 1:
                    continue
                if s.get("save"):
                    blocked.append(s["save"]["blocked_ms"])
                (after if s["step"] - 1 in saves else other).append(s["step_ms"])
        bytes_per = next((s["save"]["bytes"] for r in runs for s in r["steps"] if s.get("save")), 0)
        rate = "-"
        if mode == "sync" and blocked:
            rate = f"{bytes_per / (statistics.median(blocked) / 1e3) / 1e9:.2f}"
        elif mode.startswith("async") and runs[0]["last_save"]:
            rate = f"{statistics.median(r['last_save'][2] for r in runs if r['last_save']):.2f}"
        walls = " ".join("%.2f" % r["wall"] for r in runs)
        print(f"{mode:<7} {walls:<26} "
              f"{statistics.median(blocked) if blocked else 0:>20.2f} "
              f"{statistics.median(after) if after else 0:>20.1f} {statistics.median(other) if other else 0:>15.1f} "
              f"{bytes_per / 2**20:>9.1f}Mi {rate:>10}")
    good = [c for c in ceilings if c]
    print(f"io-bench write ceiling (same folder, per round): {', '.join(f'{c:.2f}' for c in good)} GB/s")

    # Host memory: 1 save against 10 saves.
    one = run_train(a.strata, ["--steps", "10", "--save-every", "10", "--save-dir", os.path.join(a.folder, "m1")],
                    a.folder, "mem1")
    ten = run_train(a.strata, ["--steps", "10", "--save-every", "1", "--keep", "2", "--save-dir",
                               os.path.join(a.folder, "m10")], a.folder, "mem10")
    peaks = [s["peak_bytes"]["host"] for s in ten["steps"]]
    print(f"host memory: peak RSS {one['rss_mib']:.1f} MiB with 1 save, {ten['rss_mib']:.1f} MiB with 10; engine host "
          f"peak after save 1: {peaks[1] / 2**20:.2f} MiB, after save 10: {peaks[-1] / 2**20:.2f} MiB")
    shutil.rmtree(a.folder, ignore_errors=True)


if __name__ == "__main__":
    main()
