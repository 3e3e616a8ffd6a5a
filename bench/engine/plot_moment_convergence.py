"""Plots moment_convergence.sh's runs: validation loss (every 100 steps) and the
training loss (a 50-step moving mean) per moment storage, and prints the
validation losses side by side with int8's and bf16's relative difference to fp32.
Usage: plot_moment_convergence.py RUN_DIR OUT.png [VALIDATION_BATCHES]"""
import json
import os
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


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


def main():
    run, png = sys.argv[1], sys.argv[2]
    batches = sys.argv[3] if len(sys.argv) > 3 else "8"
    runs = {m: load(os.path.join(run, f"{m}.jsonl")) for m in ("fp32", "bf16", "int8")}
    fig, (train_ax, val_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for m, (steps, losses, val) in runs.items():
        train_ax.plot(steps, moving_mean(losses), label=m, linewidth=1)
        val_ax.plot(sorted(val), [val[s] for s in sorted(val)], marker="o", markersize=3, label=m)
    train_ax.set(title="training loss (50-step mean)", xlabel="step", ylabel="loss")
    val_ax.set(title=f"validation loss ({batches} batches)", xlabel="step")
    for ax in (train_ax, val_ax):
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle("small preset, ZeRO-2 + optimizer cpu, bf16: optimizer moments fp32 / bf16 / int8")
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    fp32_val = runs["fp32"][2]
    print("step  fp32  bf16  int8  bf16/fp32-1  int8/fp32-1")
    for s in sorted(fp32_val):
        row = [runs[m][2].get(s) for m in ("fp32", "bf16", "int8")]
        if None in row:
            continue
        print(f"{s:5d} {row[0]:.4f} {row[1]:.4f} {row[2]:.4f} {row[1] / row[0] - 1:+.2%} {row[2] / row[0] - 1:+.2%}")


if __name__ == "__main__":
    main()
