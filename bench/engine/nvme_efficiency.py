#!/usr/bin/env python3
"""How close the engine's NVMe optimizer phase comes to the drive (issue 12).

Interleaves, round by round: `strata io-bench` on NVME_DIR (the raw
engine's O_DIRECT read and write GB/s at the default block size and depth:
the drive's ceiling; the tier adds checksums on top), then `strata train` with the optimizer on NVMe and
pipeline_read/write on, then off. For each training run, per step (steps
2..N): the optimizer state's NVMe bytes read and written (engine metrics) and
the optimizer thread's time; the drive would need
    ideal = read_bytes / read_GBps + write_bytes / write_GBps
so efficiency = ideal / optimizer_ms (1.0: the optimizer phase runs at the
drive's speed; the compute of the step hides in it). Target: >= 0.80 with
the pipeline on.

Usage: nvme_efficiency.py STRATA NVME_DIR [--rounds R] [--steps S] -- TRAIN ARGS
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile


def io_bench(strata, path):
    out = subprocess.run([strata, "io-bench", "--path", path, "--size", "256MiB", "--json"], check=True,
                         capture_output=True, text=True).stdout
    res = json.loads(out)["results"]
    rd = max(r["gb_per_s"] for r in res if r.get("mode") == "read")
    wr = max(r["gb_per_s"] for r in res if r.get("mode") == "write")
    return rd, wr


def train(strata, path, args, pipeline, steps):
    cfg = {"bf16": {"enabled": True},
           "zero_optimization": {"stage": 2, "sub_group_size": 2000000,
                                 "offload_optimizer": {"device": "nvme", "nvme_path": path, "buffer_count": 4,
                                                       "pipeline_read": pipeline, "pipeline_write": pipeline}}}
    with tempfile.TemporaryDirectory() as tmp:
        cfg_path = os.path.join(tmp, "ds.json")
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)
        log = os.path.join(tmp, "log.jsonl")
        subprocess.run([strata, "train", *args, "--config", cfg_path, "--steps", str(steps), "--eval-every", "0",
                        "--quiet", "--overlap-optimizer", "off", "--json-log", log], check=True,
                       stdout=subprocess.DEVNULL)
        with open(log) as f:
            rows = [json.loads(line) for line in f][1:]
    return [(r["bytes"]["nvme_read"], r["bytes"]["nvme_write"], r["optimizer_ms"]) for r in rows]


def main():
    argv = sys.argv[1:]
    train_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    strata, path = own[0], own[1]
    rounds = int(own[own.index("--rounds") + 1]) if "--rounds" in own else 2
    steps = int(own[own.index("--steps") + 1]) if "--steps" in own else 6
    eff = {True: [], False: []}
    for r in range(rounds):
        rd, wr = io_bench(strata, path)
        order = [True, False] if r % 2 == 0 else [False, True]
        for pipeline in order:
            for nr, nw, ms in train(strata, path, train_args, pipeline, steps):
                ideal_ms = (nr / (rd * 1e9) + nw / (wr * 1e9)) * 1e3
                eff[pipeline].append(ideal_ms / ms if ms > 0 else 0)
            print(f"round {r}: io-bench read {rd:.2f} GB/s write {wr:.2f} GB/s; pipeline "
                  f"{'on ' if pipeline else 'off'}: efficiency median {statistics.median(eff[pipeline][-(steps - 1):]):.2f} "
                  f"({nr / 1e6:.1f} MB read + {nw / 1e6:.1f} MB written per step in {ms:.1f} ms)", flush=True)
    for p in (True, False):
        print(f"pipeline {'on ' if p else 'off'}: efficiency median {statistics.median(eff[p]):.2f} over "
              f"{len(eff[p])} steps (target >= 0.80 with the pipeline on)")


if __name__ == "__main__":
    main()
