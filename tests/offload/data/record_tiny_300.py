#!/usr/bin/env python3
"""Records tiny_300_losses.json: `strata train` on defaults, 300 steps.

Usage: record_tiny_300.py <path to the strata binary> [commit]
The losses are stored as hex floats (exact) and as %.17g decimals (for
people); the progress text is stored whole and compared with its timing
fields masked. Re-record only when a change of the losses is intended, and
say why in the commit.
"""
import json
import os
import subprocess
import sys
import tempfile

ARGS = "train --preset tiny --steps 300 --seed 1234"


def main():
    binary = sys.argv[1]
    commit = sys.argv[2] if len(sys.argv) > 2 else ""
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "log.jsonl")
        out = subprocess.run([binary] + ARGS.split() + ["--json-log", log], check=True,
                             capture_output=True, text=True).stdout
        steps = []
        with open(log) as f:
            for line in f:
                j = json.loads(line)
                v = j["val_loss"]
                steps.append({
                    "step": j["step"],
                    "loss": float.hex(j["loss"]),
                    "loss_decimal": "%.17g" % j["loss"],
                    "val_loss": None if v is None else float.hex(v),
                    "val_loss_decimal": None if v is None else "%.17g" % v,
                })
    fixture = {
        "command": "strata " + ARGS + " --json-log <log>",
        "args": ARGS,
        "recorded_from": commit,
        "note": "losses as hex floats (exact); stdout compared with tok/s, ms, peak bytes, the memory line and the median masked",
        "steps": steps,
        "stdout": out.splitlines(),
    }
    json.dump(fixture, sys.stdout, indent=1)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
