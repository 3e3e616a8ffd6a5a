#!/usr/bin/env python3
"""End-to-end checks of `strata bench offload` (ctest, label apps).

    check_bench_offload.py STRATA ROWS.json WORKDIR MODE

MODE schema: the JSON's keys and types, every row's status, the penalty
            against the fastest in-memory row, and the interleaved order;
            without --nvme-path the NVMe row runs under $STRATA_NVME_DIR
            (said on the terminal and in the JSON) and leaves nothing there.
MODE nofit: under a device cap, rows the engine refuses are "does_not_fit"
            with the engine's reason; the rest run; no penalty without a
            baseline.
MODE csv:   one header and one line per row, the same medians as the JSON;
            with --profile every row carries the model's prediction.
MODE plot:  --plot writes a PNG that opens, with the two panels named in its
            metadata (exit 77, skipped, without matplotlib).
"""
import csv
import json
import math
import os
import struct
import subprocess
import sys
import zlib

SKIP = 77


def fail(msg):
    print(f"FAIL: {msg}")
    sys.exit(1)


def run(strata, args):
    p = subprocess.run([strata, "bench", "offload", *args], capture_output=True, text=True, timeout=600)
    if p.returncode != 0:
        fail(f"strata bench offload {' '.join(args)} exited {p.returncode}:\n{p.stdout}\n{p.stderr}")
    return p.stdout


def common(rows_file, work, name, extra):
    out = os.path.join(work, name + ".json")
    repeats = [] if "--repeats" in extra else ["--repeats", "3"]
    args = ["--preset", "tiny", "--embd", "128", "--batch", "2", "--seq", "32", "--steps", "2", "--warmup", "1",
            "--configs", rows_file, "--json", out] + repeats + extra
    return out, args


def expect_schedule(doc):
    rows = doc["rows"]
    n = len(rows)
    if len(doc["schedule"]) != doc["repeats"]:
        fail(f"schedule has {len(doc['schedule'])} repeats, expected {doc['repeats']}")
    for r, got in enumerate(doc["schedule"]):
        rotated = [(i + r) % n for i in range(n)]
        # A row that ran once runs in every repeat; a refused row only in the first, where every row is tried.
        want = [i for i in rotated
                if rows[i]["status"] == "ok" or (r == 0 and rows[i]["status"] in ("does_not_fit", "failed"))]
        if got != want:
            fail(f"repeat {r} ran rows {got}, expected the rotation {want}")


def check_types(doc):
    for key, typ in (("bench", str), ("date", str), ("model", dict), ("ranks", int), ("batch", int), ("seq", int),
                     ("tokens_per_step", int), ("warmup", int), ("steps", int), ("repeats", int),
                     ("schedule", list), ("rows", list)):
        if not isinstance(doc.get(key), typ):
            fail(f"top-level '{key}' is missing or not {typ.__name__}: {doc.get(key)!r}")
    if doc["bench"] != "offload":
        fail("bench is not 'offload'")
    for r in doc["rows"]:
        for key in ("index", "label", "stage", "offload_optimizer", "offload_param", "ratio", "dtype", "status",
                    "reason"):
            if key not in r:
                fail(f"row {r.get('label')} has no '{key}'")
        if r["status"] != "ok":
            if not isinstance(r["reason"], str) or not r["reason"]:
                fail(f"row {r['label']} is {r['status']} without a reason")
            continue
        sm = r["step_ms"]
        if not (0 < sm["min"] <= sm["median"] <= sm["max"]):
            fail(f"row {r['label']}: step_ms min/median/max out of order: {sm}")
        if len(r["samples_ms"]) != doc["steps"] * doc["repeats"]:
            fail(f"row {r['label']}: {len(r['samples_ms'])} samples, expected steps x repeats")
        if len(r["repeat_median_ms"]) != doc["repeats"]:
            fail(f"row {r['label']}: {len(r['repeat_median_ms'])} repeat medians")
        tps = doc["tokens_per_step"] / (sm["median"] / 1e3)
        if not math.isclose(r["tokens_per_s"], tps, rel_tol=1e-9):
            fail(f"row {r['label']}: tokens_per_s {r['tokens_per_s']} != tokens_per_step / median step {tps}")
        for group, keys in (("phase_ms", ("forward", "backward", "optimizer")),
                            ("exposed_ms", ("reduce", "optimizer", "gather", "nvme")),
                            ("bytes_per_step", ("h2d", "d2h", "gather", "reduce", "nvme_read", "nvme_write")),
                            ("gb_per_s_over_step", ("h2d", "d2h", "gather", "reduce", "nvme_read", "nvme_write")),
                            ("peak_bytes", ("device", "pinned", "host", "nvme")),
                            ("predicted_bytes", ("device", "pinned", "nvme"))):
            for k in keys:
                v = r.get(group, {}).get(k)
                if not isinstance(v, (int, float)) or v < 0:
                    fail(f"row {r['label']}: {group}.{k} is {v!r}")
        offloaded = r["offload_optimizer"] != "none"
        if offloaded and (r["bytes_per_step"]["d2h"] == 0 or r["peak_bytes"]["pinned"] == 0):
            fail(f"row {r['label']}: optimizer offload moved no D2H bytes or held no pinned memory")
        if not offloaded and r["bytes_per_step"]["d2h"] != 0:
            fail(f"row {r['label']}: no offload but {r['bytes_per_step']['d2h']} D2H bytes")


def mode_schema(strata, rows_file, work):
    out, args = common(rows_file, work, "schema", [])
    text = run(strata, args)
    doc = json.load(open(out))
    check_types(doc)
    status = {r["label"]: r["status"] for r in doc["rows"]}
    want = {"s0 opt=none param=none bf16": "ok", "s1 opt=cpu param=none bf16": "ok",
            "s3 opt=cpu param=cpu bf16": "ok", "s3 opt=cpu param=none r=0.50 bf16": "ok",
            "s1 opt=nvme param=none bf16": "ok", "s2 opt=cpu param=none fp32": "ok",
            "s1 opt=nvme param=none bf16 m=int8": "ok", "s1 opt=nvme param=none bf16 grads=nvme": "ok",
            "s3 opt=cpu param=nvme bf16 grads=nvme": "ok", "s1 opt=nvme param=none bf16 m=int8 pipe=rw": "ok"}
    if status != want:
        fail(f"statuses {status}, expected {want}")
    # No --nvme-path: the NVMe row runs where strata train's swap files go by default, and says where.
    nvme_dir = os.environ["STRATA_NVME_DIR"]
    if doc.get("nvme_path") != nvme_dir:
        fail(f"the JSON's nvme_path is {doc.get('nvme_path')!r}, expected $STRATA_NVME_DIR {nvme_dir!r}")
    if f"nvme     the NVMe rows swap under {nvme_dir} ($STRATA_NVME_DIR" not in text:
        fail(f"the terminal does not say where the NVMe rows swap:\n{text}")
    nvme_row = doc["rows"][4]
    if nvme_row["bytes_per_step"]["nvme_write"] == 0 or nvme_row["bytes_per_step"]["nvme_read"] == 0:
        fail(f"the NVMe row moved no NVMe bytes: {nvme_row['bytes_per_step']}")
    # int8 moments: master 4 B + 2 x ~1 B per element against 12 B (each part 4 KiB-aligned on NVMe).
    int8_row = doc["rows"][6]
    if int8_row["optimizer_state_dtype"] != "int8" or nvme_row["optimizer_state_dtype"] != "fp32":
        fail(f"optimizer_state_dtype {int8_row['optimizer_state_dtype']} / {nvme_row['optimizer_state_dtype']}")
    # (per step: a read started ahead may complete on either side of a step's end, so allow for one piece)
    ratio = int8_row["bytes_per_step"]["nvme_read"] / nvme_row["bytes_per_step"]["nvme_read"]
    if not 0.3 < ratio < 0.7:
        fail(f"the int8 NVMe row read {ratio:.3f} of the fp32 row's NVMe bytes, expected about half")
    # Gradient shards on NVMe: the row says so, and its gradients are on NVMe beside the state.
    grads_row = doc["rows"][7]
    if grads_row["gradient_shards"] != "nvme" or nvme_row["gradient_shards"] != "pinned":
        fail(f"gradient_shards {grads_row['gradient_shards']} / {nvme_row['gradient_shards']}")
    if not grads_row["peak_bytes"]["nvme"] > nvme_row["peak_bytes"]["nvme"]:
        fail(f"the gradient-shards row holds no more on NVMe: {grads_row['peak_bytes']} vs {nvme_row['peak_bytes']}")
    # The state in host memory, the parameters' folder on NVMe: the gradients go there (the row's only
    # per-step NVMe bytes: each gradient byte written under the backward and read back by the update).
    host_state_row = doc["rows"][8]
    if host_state_row["gradient_shards"] != "nvme" or host_state_row["peak_bytes"]["nvme"] == 0:
        fail(f"the state-in-host-memory row kept its gradients off NVMe: {host_state_row['peak_bytes']}")
    if host_state_row["bytes_per_step"]["nvme_write"] == 0:
        fail(f"the state-in-host-memory row wrote no gradient bytes: {host_state_row['bytes_per_step']}")
    # The row's own NVMe pipelining (null: the engine's default): it reads each piece once per step, as the
    # unpipelined row does (allowing one piece either side of a step's end, as above).
    piped_row = doc["rows"][9]
    if (piped_row["pipeline_read"], piped_row["pipeline_write"]) != (True, True) or int8_row["pipeline_read"] is not None:
        fail(f"pipeline_read/pipeline_write {piped_row['pipeline_read']}/{piped_row['pipeline_write']} and "
             f"{int8_row['pipeline_read']}")
    ratio = piped_row["bytes_per_step"]["nvme_read"] / int8_row["bytes_per_step"]["nvme_read"]
    if not 0.7 < ratio < 1.3:
        fail(f"the pipelined NVMe row read {ratio:.3f} of the unpipelined row's NVMe bytes, expected about the same")
    if os.listdir(nvme_dir):
        fail(f"the bench left {os.listdir(nvme_dir)} in {nvme_dir}")
    if doc["baseline_row"] != 0 or doc["rows"][0]["penalty"] != 1.0:
        fail(f"the only in-memory row (0) is not the baseline with penalty 1: {doc['baseline_row']}")
    base = doc["rows"][0]["step_ms"]["median"]
    for r in doc["rows"]:
        if r["status"] == "ok" and not math.isclose(r["penalty"], r["step_ms"]["median"] / base, rel_tol=1e-9):
            fail(f"row {r['label']}: penalty {r['penalty']} is not its median / the baseline's")
    expect_schedule(doc)
    for label in want:
        if label not in text:
            fail(f"the terminal table has no line for {label}")
    print("bench offload schema ok")


def mode_nofit(strata, rows_file, work):
    out, args = common(rows_file, work, "nofit", ["--device-memory", "7MiB"])
    run(strata, args)
    doc = json.load(open(out))
    check_types(doc)
    rows = doc["rows"]
    if rows[0]["status"] != "does_not_fit":
        fail(f"stage 0 under a 7 MiB cap is {rows[0]['status']}, expected does_not_fit")
    for needle in ("OutOfMemory", "stage 0, optimizer none", "device memory", "raise --device-memory"):
        if needle not in rows[0]["reason"]:
            fail(f"the refusal does not say '{needle}': {rows[0]['reason']}")
    if rows[2]["status"] != "ok":
        fail(f"stage 3 with everything offloaded does not run under 7 MiB: {rows[2]['reason']}")
    if any(r["status"] == "ok" and r["offload_optimizer"] == "none" for r in rows):
        fail("an in-memory row ran under the cap")
    if doc["baseline_row"] is not None or rows[2]["penalty"] is not None:
        fail("a penalty without an in-memory row that ran")
    expect_schedule(doc)
    print("bench offload nofit ok")


def mode_csv(strata, rows_file, work):
    profile = os.path.join(os.path.dirname(rows_file), "test_profile.json")
    out, args = common(rows_file, work, "csv", ["--csv", os.path.join(work, "bench.csv"), "--repeats", "1",
                                                 "--quiet", "--profile", profile])
    run(strata, args)
    doc = json.load(open(out))
    with open(os.path.join(work, "bench.csv"), newline="") as f:
        lines = list(csv.DictReader(f))
    if len(lines) != len(doc["rows"]):
        fail(f"{len(lines)} CSV lines for {len(doc['rows'])} rows")
    for line, row in zip(lines, doc["rows"]):
        if line["label"] != row["label"] or line["status"] != row["status"]:
            fail(f"CSV line {line['label']} / {line['status']} does not match {row['label']}")
        if row["status"] == "ok" and float(line["step_ms_median"]) != row["step_ms"]["median"]:
            fail(f"CSV median {line['step_ms_median']} != JSON {row['step_ms']['median']}")
    # --profile: each row that ran carries the step-time model's prediction beside the measurement.
    for row in doc["rows"]:
        if row["status"] != "ok":
            continue
        p = row.get("predicted")
        if not p or not p["step_ms"] > 0 or not 0 < p["ideal_ms"] <= p["step_ms"] * (1 + 1e-9):
            fail(f"row {row['label']}: no sound prediction with --profile: {p}")
        if not math.isclose(p["error"], p["step_ms"] / row["step_ms"]["median"] - 1, rel_tol=1e-9, abs_tol=1e-12):
            fail(f"row {row['label']}: error {p['error']} is not predicted / measured - 1")
    if doc.get("profile") != "test machine":
        fail(f"the JSON does not name the profile: {doc.get('profile')}")
    print("bench offload csv ok")


def png_info(path):
    data = open(path, "rb").read()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        fail(f"{path} is not a PNG")
    pos, text, size = 8, {}, None
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos:pos + 4])
        kind = data[pos + 4:pos + 8]
        body = data[pos + 8:pos + 8 + length]
        if zlib.crc32(kind + body) != struct.unpack(">I", data[pos + 8 + length:pos + 12 + length])[0]:
            fail(f"{path}: chunk {kind} has a bad CRC")
        if kind == b"IHDR":
            size = struct.unpack(">II", body[:8])
        elif kind == b"tEXt":
            k, _, v = body.partition(b"\0")
            text[k.decode()] = v.decode("latin-1")
        pos += 12 + length
    return size, text, len(data)


def mode_plot(strata, rows_file, work):
    have = False
    for py in ("python3", "/usr/bin/python3"):
        try:
            have |= subprocess.run([py, "-c", "import matplotlib"], capture_output=True).returncode == 0
        except OSError:
            pass
    if not have:
        print("matplotlib is missing (apt-get install python3-matplotlib): skipped")
        sys.exit(SKIP)
    png = os.path.join(work, "bench.png")
    if os.path.exists(png):
        os.remove(png)
    out, args = common(rows_file, work, "plot", ["--plot", png, "--repeats", "1"])
    text = run(strata, args)
    if f"plot     {png}" not in text:
        fail("the bench did not say where the plot is")
    (w, h), meta, nbytes = png_info(png)
    if w < 600 or h < 600 or nbytes < 10000:
        fail(f"{png}: {w}x{h}, {nbytes} bytes: too small for two panels")
    panels = meta.get("Description", "")
    for panel in ("step time", "peak bytes per tier"):
        if panel not in panels:
            fail(f"{png}: panel '{panel}' is not in its metadata: {meta}")
    print(f"bench offload plot ok: {w}x{h}, {nbytes} bytes, panels: {panels}")


def main():
    if len(sys.argv) != 5:
        print(__doc__)
        return 2
    strata, rows_file, work, mode = sys.argv[1:]
    os.makedirs(work, exist_ok=True)
    # The NVMe row's default folder (no --nvme-path), this test's own.
    os.environ["STRATA_NVME_DIR"] = os.path.join(work, "nvme")
    os.makedirs(os.environ["STRATA_NVME_DIR"], exist_ok=True)
    {"schema": mode_schema, "nofit": mode_nofit, "csv": mode_csv, "plot": mode_plot}[mode](strata, rows_file, work)
    return 0


if __name__ == "__main__":
    sys.exit(main())
