"""One `strata train` run's per-step JSON log reduced to medians (shared by
overlap.py and early_updates.py)."""
import json
import os
import statistics
import subprocess
import tempfile


def train_medians(strata, args, extra, steps, fields):
    """Runs `strata train ARGS EXTRA --steps STEPS` quietly with a JSON log and returns, for each
    name -> getter(row) in `fields`, the median over steps 2..STEPS (step 1 records the acquire sequence)."""
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "log.jsonl")
        cmd = [strata, "train", *args, *extra, "--steps", str(steps), "--eval-every", "0", "--quiet",
               "--json-log", log]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        with open(log) as f:
            rows = [json.loads(line) for line in f]
    rows = rows[1:]
    return {name: statistics.median(get(r) for r in rows) for name, get in fields.items()}
