#!/usr/bin/env python3
"""Early, exact updates (strata.speculative_optimizer) measured: how much of
the CPU optimizer step still shows in the step once it may start under the
backward (docs/engine.md, Note [Early, exact updates]).

Three variants of the same `strata train` run, in interleaved rounds (ABBA:
early, late, alone, then reversed):
  early  speculative_optimizer on,  overlap on  (updates under the backward and the next forward)
  late   speculative_optimizer off, overlap on  (updates under the next forward only)
  alone  speculative_optimizer off, overlap off (nothing overlaps: each phase alone)
and per variant the medians over steps 2..N of the step, forward, backward and
optimizer times (the optimizer thread's busy time), the time the model's
stream waited for updates, and the step end's wait for reductions and the
norm (which early updates can lengthen by the layer being stepped).

    ideal exposed = max(0, optimizer alone - (forward + backward) alone)
    exposed       = the model stream's waits for updates
                    + the step end's extra wait over `late` (reduce wait delta)
Target of issue 24 §1: exposed <= 1.10 x ideal + 5 % of the step, on a model
whose optimizer is longer than its forward and shorter than forward +
backward (today's engine, `late`, exposes about optimizer - forward there).

Usage: early_updates.py STRATA [--rounds R] [--steps S] [--json FILE] -- TRAIN ARGS...
"""
import argparse
import json
import statistics
import sys

from train_medians import train_medians


FIELDS = {"step_ms": lambda r: r["step_ms"], "forward_ms": lambda r: r["forward_ms"],
          "backward_ms": lambda r: r["backward_ms"], "optimizer_ms": lambda r: r["optimizer_ms"],
          "exposed_ms": lambda r: r["exposed_ms"]["optimizer"], "reduce_ms": lambda r: r["exposed_ms"]["reduce"],
          "early_layers": lambda r: r.get("early_updates", {}).get("layers", 0),
          "redone_layers": lambda r: r.get("early_updates", {}).get("redone", 0)}


def run(strata, args, extra, steps):
    return train_medians(strata, args, extra, steps, FIELDS)


def main():
    argv = sys.argv[1:]
    train_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    p = argparse.ArgumentParser()
    p.add_argument("strata")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--json", help="also write the medians, the rounds and the verdict here")
    a = p.parse_args(own)
    if a.rounds < 1 or a.steps < 3:
        sys.exit("early_updates.py: --rounds must be >= 1 and --steps >= 3")
    variants = {"early": ["--speculative-optimizer", "on", "--overlap-optimizer", "on"],
                "late": ["--speculative-optimizer", "off", "--overlap-optimizer", "on"],
                "alone": ["--speculative-optimizer", "off", "--overlap-optimizer", "off"]}
    order = []
    for r in range(a.rounds):
        seq = list(variants)
        order += seq if r % 2 == 0 else seq[::-1]
    results = {k: [] for k in variants}
    for name in order:
        res = run(a.strata, train_args, variants[name], a.steps)
        results[name].append(res)
        print(f"  {name:>5}: step {res['step_ms']:8.1f} ms  forward {res['forward_ms']:7.1f}  backward "
              f"{res['backward_ms']:7.1f}  optimizer {res['optimizer_ms']:7.1f}  exposed {res['exposed_ms']:7.2f}  "
              f"reduce wait {res['reduce_ms']:6.2f}  early layers {res['early_layers']:.0f} redone "
              f"{res['redone_layers']:.0f}", flush=True)
    med = {k: {f: statistics.median(x[f] for x in v) for f in v[0]} for k, v in results.items()}
    alone = med["alone"]
    ideal = max(0.0, alone["optimizer_ms"] - (alone["forward_ms"] + alone["backward_ms"]))
    late_ideal = max(0.0, alone["optimizer_ms"] - alone["forward_ms"])

    def exposed(v):
        return med[v]["exposed_ms"] + max(0.0, med[v]["reduce_ms"] - med["late"]["reduce_ms"])

    bound = 1.10 * ideal + 0.05 * med["early"]["step_ms"]
    print(f"args: {' '.join(train_args)}")
    print(f"alone (nothing overlapped): step {alone['step_ms']:.1f} ms: forward {alone['forward_ms']:.1f}, backward "
          f"{alone['backward_ms']:.1f}, optimizer {alone['optimizer_ms']:.1f}")
    print(f"late  (under the next forward): step {med['late']['step_ms']:.1f} ms, exposed {exposed('late'):.2f} ms "
          f"(its own ideal max(0, optimizer - forward) = {late_ideal:.2f})")
    print(f"early (under the backward too): step {med['early']['step_ms']:.1f} ms, exposed {exposed('early'):.2f} ms")
    verdict = "MET" if exposed("early") <= bound else "NOT MET"
    shape = ("optimizer between forward and forward + backward" if alone["forward_ms"] < alone["optimizer_ms"] <
             alone["forward_ms"] + alone["backward_ms"] else "optimizer NOT between forward and forward + backward")
    print(f"ceiling: ideal exposed max(0, optimizer - (forward + backward)) = {ideal:.2f} ms ({shape}); "
          f"target <= 1.10 x ideal + 5% of step = {bound:.2f} ms: early {exposed('early'):.2f} ms: {verdict}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": train_args, "order": order, "rounds": results, "medians": med, "ideal_ms": ideal,
                       "exposed_ms": {v: exposed(v) for v in ("early", "late")}, "bound_ms": bound,
                       "met": exposed("early") <= bound}, f, indent=1)


if __name__ == "__main__":
    main()
