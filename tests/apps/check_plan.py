#!/usr/bin/env python3
"""End-to-end checks of `strata plan` (ctest, label apps).

    check_plan.py STRATA SOURCE_DIR WORKDIR MODE

MODE estimator: with --params, every row's memory columns equal `strata
               estimate --json`'s for the same size, ranks, limits and config.
MODE engine:   with --model, every row's memory equals the engine's own plan
               as `strata bench offload` reports it (predicted_bytes), and the
               predicted bytes per link equal the measured ones within the
               shards' padding (3%), at 1 and 2 ranks.
MODE profiles: the shipped profiles load, every row gets a positive step
               time, the fastest fitting row is marked and is the fastest.
"""
import json
import os
import subprocess
import sys


def fail(msg):
    print(f"FAIL: {msg}")
    sys.exit(1)


def run_json(cmd):
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        fail(f"{' '.join(cmd)} exited {p.returncode}:\n{p.stdout}\n{p.stderr}")
    return p.stdout


def mode_estimator(strata, src, work):
    profile = os.path.join(src, "examples", "profiles", "dgx-h100.json")
    prof = json.load(open(profile))
    for extra in ([], ["--config", os.path.join(src, "examples", "configs", "zero3_nvme_offload.json")]):
        plan = json.loads(run_json([strata, "plan", "--params", "13B", "--gpus-per-node", "4", "--profile", profile,
                                    "--json"] + extra))
        est = json.loads(run_json([strata, "estimate", "--params", "13B", "--gpus-per-node", "4", "--json",
                                   "--gpu-memory", str(prof["device_memory_bytes"]),
                                   "--cpu-memory", str(prof["host_memory_bytes"]),
                                   "--nvme-memory", str(prof["nvme_bytes"])] + extra))
        by_place = {(r["stage"], r["offload_optimizer"], r["offload_param"]): r for r in est["rows"]}
        compared = 0
        for row in plan["rows"]:
            if row["ratio"] != 1:
                continue
            e = by_place.get((row["stage"], row["offload_optimizer"], row["offload_param"]))
            if e is None:
                fail(f"plan row {row['label']} is not an estimator row")
            for col in ("gpu_model_state_bytes", "gpu_buffer_bytes", "cpu_bytes_per_node",
                        "cpu_buffer_bytes_per_node", "nvme_bytes_per_node"):
                if row["memory"][col] != e[col]:
                    fail(f"{row['label']} {extra}: {col} plan {row['memory'][col]} != estimate {e[col]}")
            if row["fits"] != e["fits"]:
                fail(f"{row['label']}: fits plan {row['fits']} != estimate {e['fits']}")
            compared += 1
        if compared != 16:
            fail(f"compared {compared} rows, expected the estimator's 16")
    print("plan estimator ok")


def mode_engine(strata, src, work):
    rows = os.path.join(src, "tests", "apps", "data", "offload_rows.json")
    profile = os.path.join(src, "tests", "apps", "data", "test_profile.json")
    nvme = os.path.join(work, "nvme")
    os.makedirs(nvme, exist_ok=True)
    for ranks in ("1", "2"):
        out = os.path.join(work, f"bench{ranks}.json")
        shape = ["--embd", "128", "--batch", "2", "--seq", "32"]
        run_json([strata, "bench", "offload", "--preset", "tiny", *shape, "--ranks", ranks, "--steps", "1",
                  "--warmup", "1", "--repeats", "1", "--configs", rows, "--nvme-path", nvme, "--quiet",
                  "--json", out])
        bench = json.load(open(out))
        plan = json.loads(run_json([strata, "plan", "--model", "tiny", *shape, "--gpus-per-node", ranks,
                                    "--profile", profile, "--configs", rows, "--bench", out, "--json"]))
        compared = 0
        for prow, brow in zip(plan["rows"], bench["rows"]):
            if prow["label"] != brow["label"]:
                fail(f"row order differs: {prow['label']} / {brow['label']}")
            if brow["status"] != "ok":
                continue
            m, b = prow["memory"], brow["predicted_bytes"]
            if (m["device_bytes"], m["pinned_bytes_per_node"], m["nvme_bytes_per_node"]) != \
               (b["device"], b["pinned"] * int(ranks), b["nvme"] * int(ranks)):
                fail(f"ranks {ranks} {prow['label']}: plan memory {m} != the engine's plan {b}")
            for link, measured in brow["bytes_per_step"].items():
                predicted = prow["predicted"]["bytes_per_step"][link]
                if abs(predicted - measured) > 0.03 * max(measured, 1) + 0:
                    fail(f"ranks {ranks} {prow['label']}: {link} predicted {predicted} B, measured {measured} B")
            if "measured_step_ms" not in prow or prow["measured_step_ms"] != brow["step_ms"]["median"]:
                fail(f"ranks {ranks} {prow['label']}: --bench did not attach the measured step")
            compared += 1
        if compared < 4:
            fail(f"ranks {ranks}: only {compared} rows compared")
    print("plan engine ok")


def mode_profiles(strata, src, work):
    for name in ("dgx-h100.json", "consumer-24gb.json"):
        profile = os.path.join(src, "examples", "profiles", name)
        plan = json.loads(run_json([strata, "plan", "--params", "13B", "--profile", profile, "--batch", "1",
                                    "--seq", "2048", "--json"]))
        fitting = [r for r in plan["rows"] if r["runnable"] and r["fits"]]
        if not fitting:
            fail(f"{name}: no row fits 13B")
        for r in plan["rows"]:
            if r["runnable"] and not r["predicted"]["step_ms"] > 0:
                fail(f"{name} {r['label']}: step {r['predicted']['step_ms']}")
        for r in plan["rows"]:
            if not r["runnable"]:
                continue
            p = r["predicted"]
            parts = p["compute_ms"] + sum(p["exposed_ms"].values())
            if abs(parts - p["step_ms"]) > 1e-6 * p["step_ms"]:
                fail(f"{name} {r['label']}: step {p['step_ms']} != compute + exposed parts {parts}")
            if not p["ideal_ms"] <= p["step_ms"] * (1 + 1e-9):
                fail(f"{name} {r['label']}: ideal {p['ideal_ms']} above the predicted step {p['step_ms']}")
            if p["step_ms"] < p["compute_ms"]:
                fail(f"{name} {r['label']}: step below its compute")
        best = min(fitting, key=lambda r: r["predicted"]["step_ms"])
        if plan["fastest_fitting_row"] != best["index"]:
            fail(f"{name}: marked row {plan['fastest_fitting_row']}, fastest fitting is {best['index']}")
    print("plan profiles ok")


def main():
    strata, src, work, mode = sys.argv[1:]
    os.makedirs(work, exist_ok=True)
    {"estimator": mode_estimator, "engine": mode_engine, "profiles": mode_profiles}[mode](strata, src, work)


if __name__ == "__main__":
    main()
