#!/usr/bin/env python3
"""Draws `strata bench offload --json` results: what each placement costs.

    python3 scripts/plot_offload.py bench.json out.png

Top panel: each row's median step time as stacked bars (compute = forward +
backward on the model's stream; exposed transfer = the waits for gathers,
reductions and NVMe; exposed optimizer = the forward's wait for parameters
still being updated; other = the rest of the step), with the penalty against
the fastest in-memory row written above each bar, and the step-time model's
prediction as a black tick when the bench ran with --profile. Bottom panel: peak bytes
per tier (device, pinned host, NVMe) of rank 0. Rows that did not run (skipped,
do not fit) are listed under the figure with their status.

Needs matplotlib: apt-get install python3-matplotlib (or pip install matplotlib).
"""
import json
import sys


def main(argv):
    if len(argv) != 3:
        print("usage: plot_offload.py BENCH.json OUT.png", file=sys.stderr)
        return 2
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("plot_offload.py: matplotlib is missing: apt-get install python3-matplotlib "
              "(or pip install matplotlib)", file=sys.stderr)
        return 3
    with open(argv[1], encoding="utf-8") as f:
        doc = json.load(f)
    if doc.get("bench") != "offload" or not isinstance(doc.get("rows"), list):
        print(f"plot_offload.py: {argv[1]} is not the JSON of `strata bench offload`", file=sys.stderr)
        return 2
    ran = [r for r in doc["rows"] if r.get("status") == "ok"]
    other = [r for r in doc["rows"] if r.get("status") != "ok"]
    if not ran:
        print(f"plot_offload.py: {argv[1]} has no row that ran", file=sys.stderr)
        return 2

    labels = [r["label"] for r in ran]
    x = range(len(ran))
    compute, transfer, optim, rest = [], [], [], []
    for r in ran:
        step = r["step_ms"]["median"]
        c = r["phase_ms"]["forward"] + r["phase_ms"]["backward"]
        e = r["exposed_ms"]
        # The step's own waits: gathers and reductions (exposed_ms.nvme is the
        # optimizer thread's wait, off the step's path: it shows up as
        # exposed optimizer or gather time when the step waits for it).
        t = e["gather"] + e["reduce"]
        o = e["optimizer"]
        # forward/backward already contain the waits that happen inside them;
        # the bar's height stays the step time.
        c = max(0.0, min(c - e["gather"] - o, step - t - o))
        compute.append(c)
        transfer.append(t)
        optim.append(o)
        rest.append(max(0.0, step - c - t - o))

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(max(8, 0.7 * len(ran) + 3), 9), sharex=True)
    m = doc.get("model", {})
    fig.suptitle(f"strata bench offload: {m.get('describe', '')}, {doc.get('ranks')} rank(s), "
                 f"batch {doc.get('batch')} x seq {doc.get('seq')}  ({doc.get('date', '')})", fontsize=10)
    bottom_acc = [0.0] * len(ran)
    for values, name, color in ((compute, "compute", "#4c72b0"), (transfer, "exposed transfer", "#dd8452"),
                                (optim, "exposed optimizer", "#c44e52"), (rest, "other", "#bbbbbb")):
        top.bar(x, values, bottom=bottom_acc, label=name, color=color)
        bottom_acc = [a + v for a, v in zip(bottom_acc, values)]
    predicted = [(i, r["predicted"]["step_ms"]) for i, r in enumerate(ran) if "predicted" in r]
    if predicted:
        top.scatter([i for i, _ in predicted], [v for _, v in predicted], marker="_", s=400, color="black",
                    zorder=3, label=f"predicted ({doc.get('profile', 'profile')})")
    for i, r in enumerate(ran):
        if r.get("penalty") is not None:
            top.text(i, bottom_acc[i], f"{r['penalty']:.2f}x", ha="center", va="bottom", fontsize=8)
    top.set_ylabel("median step (ms)")
    top.legend(fontsize=8, loc="lower right")
    top.set_title("step time: compute / exposed transfer / exposed optimizer", fontsize=9)

    width = 0.27
    for k, (tier, color) in enumerate((("device", "#4c72b0"), ("pinned", "#55a868"), ("nvme", "#8172b2"))):
        vals = [r["peak_bytes"][tier] / 2**20 for r in ran]
        bottom.bar([i + (k - 1) * width for i in x], vals, width=width, label=tier, color=color)
    bottom.set_ylabel("peak MiB (rank 0)")
    bottom.legend(fontsize=8)
    bottom.set_title("peak bytes per tier", fontsize=9)
    bottom.set_xticks(list(x))
    bottom.set_xticklabels(labels, rotation=45, ha="right", fontsize=8)
    if other:
        fig.text(0.01, 0.005, "not run: " + "; ".join(f"{r['label']} ({r['status']})" for r in other),
                 fontsize=6, wrap=True)
    fig.tight_layout(rect=(0, 0.04, 1, 0.97))
    # The panels are named in the PNG's metadata (tests read it back).
    fig.savefig(argv[2], dpi=110, metadata={"Title": "strata bench offload",
                                            "Description": "panels: step time; peak bytes per tier"})
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
