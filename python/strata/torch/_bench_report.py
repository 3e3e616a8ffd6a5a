"""What strata.torch.bench writes: each row's JSON (the fields of `strata
bench offload --json`, docs/offload-bench.md), the table, the CSV, and the
PNG drawn by the same plot_offload.py the C++ bench calls."""
import csv
import os
import shutil
import stat
import statistics
import subprocess
import sys

from .._checks import printable
from ..errors import InvalidArgument, NotFound, Unavailable

__all__ = ["row_json", "print_table", "write_csv", "check_output_path", "find_plot_tool", "draw_plot"]

# (JSON name, StepMetrics key) of each link's bytes per step.
_LINKS = (("h2d", "h2d_bytes"), ("d2h", "d2h_bytes"), ("gather", "gather_bytes"), ("reduce", "reduce_bytes"),
          ("nvme_read", "nvme_read_bytes"), ("nvme_write", "nvme_write_bytes"))
_TIERS = ("device", "pinned", "nvme")


def _median_of(steps, key):
    return statistics.median(float(m[key]) for m in steps)


def row_json(index, result, baseline_ms):
    """One row as `strata bench offload --json` writes it, plus `wall_ms` (each step from the forward's
    call to engine.step()'s return, as the user's loop sees it) and `peak_over_plan`."""
    row = result.row
    j = {"index": index, "label": row.label()}
    j.update(row.settings())
    j["status"] = result.status
    j["reason"] = result.reason or None
    if result.status != "ok":
        return j
    steps = result.steps
    ms = [float(m["step_ms"]) for m in steps]
    med = statistics.median(ms)
    j["engine"] = result.engine
    j["step_ms"] = {"median": med, "min": min(ms), "max": max(ms), "spread": (max(ms) - min(ms)) / med if med > 0
                    else 0.0}
    j["repeat_median_ms"] = result.repeat_median_ms
    j["samples_ms"] = ms
    j["wall_ms"] = {"median": statistics.median(result.wall_ms), "samples": result.wall_ms}
    tokens = statistics.median(result.tokens) if result.tokens and None not in result.tokens else None
    j["tokens_per_s"] = tokens / (med / 1e3) if tokens is not None and med > 0 else None
    j["penalty"] = med / baseline_ms if baseline_ms else None
    j["phase_ms"] = {"forward": _median_of(steps, "forward_ms"), "backward": _median_of(steps, "backward_ms"),
                     "optimizer": _median_of(steps, "optimizer_ms")}
    j["early_updates"] = {"layers": _median_of(steps, "speculated_layers"),
                          "redone": _median_of(steps, "redone_layers")}
    j["exposed_ms"] = {"reduce": _median_of(steps, "wait_reduce_ms"),
                       "optimizer": _median_of(steps, "wait_optimizer_ms"),
                       "gather": _median_of(steps, "wait_gather_ms"), "nvme": _median_of(steps, "wait_nvme_ms")}
    j["bytes_per_step"] = {name: int(_median_of(steps, key)) for name, key in _LINKS}
    # Over the whole step: what the link carried on average, not its peak rate.
    j["gb_per_s_over_step"] = {name: (b / (med / 1e3) / 1e9 if med > 0 else 0.0)
                               for name, b in j["bytes_per_step"].items()}
    j["peak_bytes"] = {tier: max(int(m[f"peak_{tier}_bytes"]) for m in steps)
                       for tier in ("device", "pinned", "host", "nvme")}
    j["predicted_bytes"] = {tier: int(result.predicted[tier]) for tier in _TIERS}
    j["peak_over_plan"] = {tier: (j["peak_bytes"][tier] / j["predicted_bytes"][tier]
                                  if j["predicted_bytes"][tier] else None) for tier in _TIERS}
    return j


def _bytes_text(n):
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def print_table(doc, out=None):
    out = out or sys.stdout
    width = max([45] + [len(r["label"]) for r in doc["rows"]])
    print(f"\n{'row':<{width}} {'status':>12} {'step ms':>10} {'spread':>7} {'penalty':>7} | {'exp opt':>8} "
          f"{'exp red':>8} {'exp gath':>8} {'nvme wait':>9} | {'h2d GB/s':>8} {'d2h GB/s':>8} {'nvme GB/s':>9} | "
          f"{'peak dev':>10} {'/plan':>5} {'peak pin':>10} {'/plan':>5}", file=out)
    for r in doc["rows"]:
        if r["status"] != "ok":
            reason = r["reason"] or ""  # whole in the JSON
            print(f"{r['label']:<{width}} {r['status']:>12}  {reason if len(reason) <= 300 else reason[:297] + '...'}",
                  file=out)
            continue
        e, g, peak, plan = r["exposed_ms"], r["gb_per_s_over_step"], r["peak_bytes"], r["peak_over_plan"]
        penalty = "-" if r["penalty"] is None else f"{r['penalty']:.2f}x"
        ratio = {t: "-" if plan[t] is None else f"{plan[t]:.2f}" for t in plan}
        print(f"{r['label']:<{width}} {r['status']:>12} {r['step_ms']['median']:>10.2f} "
              f"{100 * r['step_ms']['spread']:>6.0f}% {penalty:>7} | {e['optimizer']:>8.2f} {e['reduce']:>8.2f} "
              f"{e['gather']:>8.2f} {e['nvme']:>9.2f} | {g['h2d']:>8.3f} {g['d2h']:>8.3f} "
              f"{g['nvme_read'] + g['nvme_write']:>9.3f} | {_bytes_text(peak['device']):>10} {ratio['device']:>5} "
              f"{_bytes_text(peak['pinned']):>10} {ratio['pinned']:>5}", file=out)
    print("(step ms: the engine's step, median over repeats x steps; spread: (max - min) / median; penalty: / the "
          "fastest row that ran; exp: exposed wait ms; nvme wait: ms the optimizer thread waited for the state's "
          "NVMe reads and writes; GB/s: bytes per step / step time; /plan: peak / the engine's plan)", file=out)


_CSV_COLUMNS = (
    ("index", ("index",)), ("label", ("label",)), ("stage", ("stage",)),
    ("offload_optimizer", ("offload_optimizer",)), ("offload_param", ("offload_param",)), ("ratio", ("ratio",)),
    ("dtype", ("dtype",)), ("optimizer_state_dtype", ("optimizer_state_dtype",)), ("status", ("status",)),
    ("step_ms_median", ("step_ms", "median")), ("step_ms_min", ("step_ms", "min")),
    ("step_ms_max", ("step_ms", "max")), ("tokens_per_s", ("tokens_per_s",)), ("penalty", ("penalty",)),
    ("forward_ms", ("phase_ms", "forward")), ("backward_ms", ("phase_ms", "backward")),
    ("optimizer_ms", ("phase_ms", "optimizer")), ("exposed_reduce_ms", ("exposed_ms", "reduce")),
    ("exposed_optimizer_ms", ("exposed_ms", "optimizer")), ("exposed_gather_ms", ("exposed_ms", "gather")),
    ("exposed_nvme_ms", ("exposed_ms", "nvme")), ("h2d_bytes", ("bytes_per_step", "h2d")),
    ("d2h_bytes", ("bytes_per_step", "d2h")), ("gather_bytes", ("bytes_per_step", "gather")),
    ("reduce_bytes", ("bytes_per_step", "reduce")), ("nvme_read_bytes", ("bytes_per_step", "nvme_read")),
    ("nvme_write_bytes", ("bytes_per_step", "nvme_write")), ("peak_device_bytes", ("peak_bytes", "device")),
    ("peak_pinned_bytes", ("peak_bytes", "pinned")), ("peak_nvme_bytes", ("peak_bytes", "nvme")),
    ("reason", ("reason",)))


def write_csv(path, doc):
    """One line per row, the C++ bench's columns."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow([name for name, _ in _CSV_COLUMNS])
        for row in doc["rows"]:
            line = []
            for _, keys in _CSV_COLUMNS:
                value = row
                for key in keys:
                    value = value.get(key) if isinstance(value, dict) else None
                line.append("" if value is None else value)
            writer.writerow(line)


def check_output_path(path, what):
    """Before anything is measured: `path` can be written as a new or replaced regular file."""
    text = printable(os.fspath(path))
    if not os.fspath(path):
        raise InvalidArgument(f"{what} is empty: give a file name")
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        info = None
    if info is not None and stat.S_ISDIR(info.st_mode):
        raise InvalidArgument(f"{what} '{text}' is a folder: give a file name")
    if info is not None and stat.S_ISLNK(info.st_mode):
        raise InvalidArgument(f"{what} '{text}' is a symbolic link: give the file it points to, or another name")
    if info is not None and not stat.S_ISREG(info.st_mode):
        raise InvalidArgument(f"{what} '{text}' is not a regular file (a FIFO or a device): give a file name")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise InvalidArgument(f"{what} '{text}': the folder '{printable(folder)}' does not exist")
    if not os.access(folder, os.W_OK | os.X_OK) or (info is not None and not os.access(path, os.W_OK)):
        raise InvalidArgument(f"{what} '{text}' cannot be written here (read-only)")


def _plot_script_candidates():
    """Where plot_offload.py is: staged beside this package (python/CMakeLists.txt copies it there), the
    source tree's scripts/ (running from a checkout), the share/strata of a `strata` on PATH (cmake --install)."""
    here = os.path.dirname(os.path.abspath(__file__))
    found = [os.path.join(here, "plot_offload.py"),
             os.path.normpath(os.path.join(here, "..", "..", "..", "scripts", "plot_offload.py"))]
    cli = shutil.which("strata")
    if cli:
        found.append(os.path.normpath(os.path.join(os.path.dirname(os.path.realpath(cli)), "..", "share", "strata",
                                                   "plot_offload.py")))
    return found


def find_plot_tool(script=None):
    """(python, script) that draw the PNG, found before anything is measured: this interpreter when it has
    matplotlib, else python3 on PATH, else /usr/bin/python3 (as the C++ bench looks)."""
    if script is not None:
        if not os.path.isfile(script):
            raise NotFound(f"plot_script '{printable(os.fspath(script))}' is not a file")
    else:
        candidates = _plot_script_candidates()
        script = next((c for c in candidates if os.path.isfile(c)), None)
        if script is None:
            raise NotFound(f"the plotting script plot_offload.py was not found (looked at {', '.join(candidates)}); "
                           f"give plot_script=PATH (--plot-script: scripts/plot_offload.py in the source tree)")
    seen = []
    for python in (sys.executable, shutil.which("python3"), "/usr/bin/python3"):
        if not python or python in seen or not os.path.exists(python):
            continue
        seen.append(python)
        probe = subprocess.run([python, "-c", "import matplotlib"], stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, check=False)
        if probe.returncode == 0:
            return python, script
    raise Unavailable(f"the plot needs a python with matplotlib to run {script}, and none of {', '.join(seen)} "
                      f"imports it: pip install matplotlib (or apt-get install python3-matplotlib), or drop the "
                      f"plot (the JSON and CSV do not need it)")


def draw_plot(tool, json_path, png_path):
    python, script = tool
    done = subprocess.run([python, script, os.fspath(json_path), os.fspath(png_path)], stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, check=False)
    if done.returncode != 0:
        raise Unavailable(f"{script} failed (exit status {done.returncode}): {done.stdout.strip()[-2000:]}")
