#!/usr/bin/env python3
"""Two `strata` binaries on the same training run, in interleaved pairs.

Runs `A train ARGS` and `B train ARGS` alternately (ABBA: A first in even
pairs, B first in odd ones), each with --json-log, and reports per run the
median over steps 2..N of the step time and of the optimizer thread's time
(step 1 records the acquire sequence), then the pair ratios B/A and their
median. Use it to see what a change to the engine costs: A the build
before, B the build after.

Usage: ab_train.py A B [--pairs P] -- TRAIN ARGS
  e.g. ab_train.py /tmp/old/apps/strata build/apps/strata --pairs 6 -- \
         --preset small --seq 16 --batch 1 --steps 8 --eval-every 0 --config nvme.json
"""
import json
import os
import statistics
import subprocess
import sys
import tempfile


def run(strata, args):
    with tempfile.TemporaryDirectory() as tmp:
        log = os.path.join(tmp, "log.jsonl")
        subprocess.run([strata, "train", *args, "--quiet", "--json-log", log], check=True, stdout=subprocess.DEVNULL)
        with open(log) as f:
            rows = [json.loads(line) for line in f]
    steps = [r for r in rows if "step_ms" in r][1:]
    if not steps:
        sys.exit("ab_train.py: the log has no steps after the first; give --steps 2 or more")
    return statistics.median(r["step_ms"] for r in steps), statistics.median(r["optimizer_ms"] for r in steps)


def main():
    argv = sys.argv[1:]
    if "--" not in argv or len(argv[:argv.index("--")]) < 2:
        sys.exit(__doc__)
    own, train_args = argv[:argv.index("--")], argv[argv.index("--") + 1:]
    a, b = own[0], own[1]
    pairs = int(own[own.index("--pairs") + 1]) if "--pairs" in own else 4
    if not 1 <= pairs <= 1000:
        sys.exit(f"ab_train.py: --pairs {pairs} is not in 1..1000")
    step_ratio, opt_ratio = [], []
    for p in range(pairs):
        order = [("A", a), ("B", b)] if p % 2 == 0 else [("B", b), ("A", a)]
        got = {}
        for name, exe in order:
            got[name] = run(exe, train_args)
        step_ratio.append(got["B"][0] / got["A"][0])
        opt_ratio.append(got["B"][1] / got["A"][1] if got["A"][1] > 0 else float("nan"))
        print(f"pair {p} ({order[0][0]} first): step ms A {got['A'][0]:.1f} B {got['B'][0]:.1f} (B/A "
              f"{step_ratio[-1]:.3f}); optimizer ms A {got['A'][1]:.1f} B {got['B'][1]:.1f} (B/A {opt_ratio[-1]:.3f})",
              flush=True)
    print("step time B/A per pair: " + " ".join(f"{r:.3f}" for r in step_ratio))
    print(f"median B/A: step {statistics.median(step_ratio):.3f}, optimizer {statistics.median(opt_ratio):.3f}")


if __name__ == "__main__":
    main()
