#!/usr/bin/env python3
"""strata's CPU AdamW against PyTorch's torch.optim.AdamW on the same machine.

For each thread count, times torch.optim.AdamW.step() (fp32 params, grads and
moments, the default single-tensor CPU implementation; also foreach=True)
over --params elements, median of --reps steps after a warm-up, and runs
`strata bench cpu-adam --kernel adamw --json` with the same size and
threads. Prints params/s of both and the speedup (bar: >= 6x).

  /usr/bin/python3 bench/adam_vs_torch.py --strata build/apps/strata [--params 16M] [--threads 1,2] [--json]
"""
import argparse
import json
import statistics
import subprocess
import sys
import time

try:
    import torch
except ImportError as e:
    print(f"SKIP: {sys.executable} cannot import torch ({e}); install Debian's python3-torch "
          "(scripts/install-deps.sh --with-torch) and run this with /usr/bin/python3")
    sys.exit(77)


def parse_count(text):
    mult = {"K": 1e3, "M": 1e6, "B": 1e9, "G": 1e9}
    t = text.strip().upper()
    return int(float(t[:-1]) * mult[t[-1]]) if t[-1] in mult else int(float(t))


def time_torch(n, threads, reps, foreach):
    torch.set_num_threads(threads)
    p = torch.nn.Parameter(torch.rand(n, dtype=torch.float32) * 2 - 1)
    p.grad = torch.rand(n, dtype=torch.float32) * 2e-3 - 1e-3
    opt = torch.optim.AdamW([p], lr=1e-4, weight_decay=0.01, foreach=foreach)
    opt.step()  # allocates the moments
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        opt.step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--strata", required=True, help="path of the strata CLI")
    ap.add_argument("--params", default="16M")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    n = parse_count(args.params)
    rows = []
    for threads in [int(t) for t in args.threads.split(",")]:
        torch_s = time_torch(n, threads, args.reps, foreach=False)
        torch_foreach_s = time_torch(n, threads, args.reps, foreach=True)
        out = subprocess.run([args.strata, "bench", "cpu-adam", "--kernel", "adamw", "--params", str(n),
                              "--threads", str(threads), "--reps", str(max(args.reps, 5)), "--json"],
                             check=True, capture_output=True, text=True).stdout
        ours = json.loads(out)
        best_torch = min(torch_s, torch_foreach_s)
        rows.append({
            "threads": threads, "params": n,
            "torch_params_per_second": n / torch_s,
            "torch_foreach_params_per_second": n / torch_foreach_s,
            "strata_params_per_second": ours["params_per_second"],
            "strata_ratio_to_ceiling": ours["ratio"],
            "speedup_vs_best_torch": ours["params_per_second"] * best_torch / n,
        })
    if args.json:
        print(json.dumps(rows))
        return 0
    print(f"AdamW, fp32, {n} params, torch {torch.__version__} (bar: strata >= 6x torch)")
    for r in rows:
        print(f"  threads {r['threads']}: torch {r['torch_params_per_second'] / 1e9:.3f} Gparam/s "
              f"(foreach {r['torch_foreach_params_per_second'] / 1e9:.3f}), "
              f"strata {r['strata_params_per_second'] / 1e9:.3f} Gparam/s "
              f"(ratio to ceiling {r['strata_ratio_to_ceiling']:.3f}) -> {r['speedup_vs_best_torch']:.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
