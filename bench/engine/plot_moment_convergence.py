"""Plots moment_convergence.sh's runs: validation loss (every 100 steps) and the
training loss (a 50-step moving mean) per moment storage and seed, and prints
the validation losses side by side with int8's and bf16's relative difference
to fp32 of the same seed, then the final losses of every seed and the spread.
Logs: RUN_DIR/<fp32|bf16|int8>-s<seed>.jsonl (or <moments>.jsonl, one seed:
the runs before seeds were named).
Usage: plot_moment_convergence.py RUN_DIR OUT.png [VALIDATION_BATCHES]"""
import glob
import json
import os
import re
import statistics
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

MOMENTS = ("fp32", "bf16", "int8")
COLORS = {"fp32": "tab:blue", "bf16": "tab:orange", "int8": "tab:green"}


def load(path):
    steps, losses, val = [], [], {}
    with open(path) as f:
        for line in f:
            j = json.loads(line)
            if "step" not in j:
                continue
            steps.append(j["step"])
            losses.append(j["loss"])
            if j.get("val_loss") is not None:
                val[j["step"]] = j["val_loss"]
    return steps, losses, val


def moving_mean(xs, n=50):
    out, total = [], 0.0
    for i, x in enumerate(xs):
        total += x
        if i >= n:
            total -= xs[i - n]
        out.append(total / min(i + 1, n))
    return out


def find_runs(run_dir):
    """{seed: {moments: (steps, losses, val)}}; seed None for unnamed logs."""
    runs = {}
    for m in MOMENTS:
        for path in glob.glob(os.path.join(run_dir, f"{m}-s*.jsonl")):
            seed = re.search(r"-s(\d+)\.jsonl$", path)
            if seed:
                runs.setdefault(int(seed.group(1)), {})[m] = load(path)
        unnamed = os.path.join(run_dir, f"{m}.jsonl")
        if os.path.exists(unnamed):
            runs.setdefault(None, {})[m] = load(unnamed)
    return {seed: r for seed, r in runs.items() if "fp32" in r}


def relative(a, b):
    return f"{a / b - 1:+.2%}"


def main():
    run_dir, png = sys.argv[1], sys.argv[2]
    batches = sys.argv[3] if len(sys.argv) > 3 else "8"
    runs = find_runs(run_dir)
    if not runs:
        sys.exit(f"plot_moment_convergence.py: no fp32 run (fp32-s<seed>.jsonl) in {run_dir}")
    fig, (train_ax, val_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for index, (seed, by_moments) in enumerate(sorted(runs.items(), key=lambda item: item[0] or 0)):
        for m, (steps, losses, val) in by_moments.items():
            label = m if index == 0 else None
            train_ax.plot(steps, moving_mean(losses), color=COLORS[m], label=label, linewidth=1, alpha=0.8)
            val_ax.plot(sorted(val), [val[s] for s in sorted(val)], color=COLORS[m], marker="o", markersize=2,
                        linewidth=1, alpha=0.8, label=label)
    seeds_text = ", ".join(str(s) for s in sorted(s for s in runs if s is not None)) or "one seed"
    train_ax.set(title="training loss (50-step mean)", xlabel="step", ylabel="loss")
    val_ax.set(title=f"validation loss ({batches} batches)", xlabel="step")
    for ax in (train_ax, val_ax):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"small preset, ZeRO-2 + optimizer cpu, bf16: moments fp32 / bf16 / int8 (seeds {seeds_text})")
    fig.tight_layout()
    fig.savefig(png, dpi=90)

    for seed, by_moments in sorted(runs.items(), key=lambda item: item[0] or 0):
        print(f"seed {seed}: validation loss")
        print("step  " + "  ".join(f"{m:>6}" for m in by_moments) + "  " +
              "  ".join(f"{m}/fp32-1" for m in by_moments if m != "fp32"))
        fp32_val = by_moments["fp32"][2]
        for s in sorted(fp32_val):
            row = {m: v[2].get(s) for m, v in by_moments.items()}
            if None in row.values():
                continue
            print(f"{s:5d} " + "  ".join(f"{row[m]:.4f}" for m in by_moments) + "  " +
                  "  ".join(f"{relative(row[m], row['fp32']):>9}" for m in by_moments if m != "fp32"))
    # Final validation loss and the training loss over the last 10 % of the steps, per seed.
    print("\nfinal losses (validation at the last evaluation; training: mean of the last 10 % of steps)")
    differences = {m: [] for m in MOMENTS if m != "fp32"}
    finals = {m: [] for m in MOMENTS}
    # Only seeds whose fp32 run reached the last evaluation of the longest
    # one count (runs still going are reported as such).
    last = max((max(r["fp32"][2]) for r in runs.values() if r["fp32"][2]), default=None)
    for seed, by_moments in sorted(runs.items(), key=lambda item: item[0] or 0):
        fp32_steps, fp32_losses, fp32_val = by_moments["fp32"]
        if last not in fp32_val:
            print(f"seed {seed}: still running (fp32 at step {fp32_steps[-1] if fp32_steps else 0})")
            continue
        tail = max(1, len(fp32_losses) // 10)
        cells = []
        for m, (steps, losses, val) in by_moments.items():
            if last not in val:
                continue
            train = statistics.fmean(losses[-tail:])
            finals[m].append(val[last])
            cell = f"{m} val {val[last]:.4f} train {train:.4f}"
            if m != "fp32":
                differences[m].append(val[last] / fp32_val[last] - 1)
                cell += f" ({relative(val[last], fp32_val[last])} val, " \
                        f"{relative(train, statistics.fmean(fp32_losses[-tail:]))} train)"
            cells.append(cell)
        print(f"seed {seed}, step {last}: " + "; ".join(cells))
    for m, values in finals.items():
        if len(values) > 1:
            print(f"{m}: final validation loss over {len(values)} seeds: mean {statistics.fmean(values):.4f}, "
                  f"spread {min(values):.4f} ... {max(values):.4f} (sd {statistics.stdev(values):.4f})")
    for m, values in differences.items():
        if len(values) > 1:
            print(f"{m} vs fp32 of the same seed: mean {statistics.fmean(values):+.2%}, "
                  f"range {min(values):+.2%} ... {max(values):+.2%} over {len(values)} seeds")


if __name__ == "__main__":
    main()
