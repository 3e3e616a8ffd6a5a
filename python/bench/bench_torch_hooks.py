#!/usr/bin/env python3
"""strata.torch's overhead per unit event (docs/performance.md, "strata.torch
hook overhead"; issue 23's target: <= 30 us per unit event).

A model of --units tiny units (Linear(--width, --width) each, so the
arithmetic is negligible and what is timed is the bookkeeping), micro-batch
2, one thread, trained with plain torch (torch.optim.AdamW) and through
strata.torch at stage 0 and stage 3 (optimizer and parameters in host
memory), steps interleaved round by round in rotating order. Each unit has
4 events per step (pre-forward, post-forward, pre-backward, post-backward),
so the overhead per event is

    (strata ms/step - torch ms/step) / (4 x units)

which includes the engine's acquire and release and the optimizer's
per-tensor work beside torch's AdamW: the ceiling is the issue's target, not
a physical limit. Also runs cProfile over strata's steps with --profile.

    python bench_torch_hooks.py [--units 100] [--width 8] [--rounds 9] [--steps 20] [--json out.json] [--profile]
"""
import argparse
import cProfile
import json
import pstats
import statistics
import time

import torch

import strata.torch as st

TARGET_US = 30.0


def make_model(units, width, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(units)])


def batch(width, step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(2, width, generator=g)


def config(stage):
    zero = {"stage": stage}
    if stage == 3:
        zero.update(offload_optimizer={"device": "cpu"}, offload_param={"device": "cpu"},
                    stage3_param_persistence_threshold=0)
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.01}},
            "zero_optimization": zero, "strata": {"device": "cpu"}}


class PlainTorch:
    name = "torch"

    def __init__(self, units, width):
        self.model = make_model(units, width)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3, weight_decay=0.01)
        self.width = width

    def step(self, i):
        self.opt.zero_grad()
        self.model(batch(self.width, i)).square().mean().backward()
        self.opt.step()


class Strata:
    def __init__(self, units, width, stage):
        self.name = f"strata stage {stage}"
        model = make_model(units, width)
        self.engine, _, _, _ = st.initialize(model=model, config=config(stage), units=[torch.nn.Linear])
        self.width = width

    def step(self, i):
        loss = self.engine(batch(self.width, i)).square().mean()
        self.engine.backward(loss)
        self.engine.step()


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--units", type=int, default=100)
    parser.add_argument("--width", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=20, help="steps per contender per round")
    parser.add_argument("--json")
    parser.add_argument("--profile", action="store_true", help="cProfile strata stage 3's steps (top 25)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    contenders = [PlainTorch(args.units, args.width), Strata(args.units, args.width, 0),
                  Strata(args.units, args.width, 3)]
    for c in contenders:  # warm-up (the engine's first steps record the acquire order)
        for i in range(5):
            c.step(i)
    times = {c.name: [] for c in contenders}
    step = 5
    for r in range(args.rounds):
        order = contenders[r % len(contenders):] + contenders[:r % len(contenders)]
        for c in order:
            begin = time.perf_counter()
            for _ in range(args.steps):
                c.step(step)
                step += 1
            times[c.name].append((time.perf_counter() - begin) / args.steps * 1e3)
    events = 4 * args.units
    base = statistics.median(times["torch"])
    print(f"{args.units} units of Linear({args.width}, {args.width}), micro-batch 2, 1 thread, {args.rounds} rounds "
          f"x {args.steps} steps (interleaved, rotating order)")
    print(f"{'contender':16} {'median ms/step':>15} {'overhead us/event':>18}  (target <= {TARGET_US:.0f} us)")
    result = {"units": args.units, "width": args.width, "rounds": times, "target_us": TARGET_US}
    for name, values in times.items():
        median = statistics.median(values)
        overhead = (median - base) * 1e3 / events if name != "torch" else 0.0
        verdict = "" if name == "torch" else ("  met" if overhead <= TARGET_US else "  not met")
        print(f"{name:16} {median:15.2f} {overhead:18.1f}{verdict}")
        result[name] = {"median_ms": median, "overhead_us_per_event": overhead}
    print("per round (ms/step):")
    for name, values in times.items():
        print(f"  {name:16} " + " ".join(f"{v:.2f}" for v in values))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.profile:
        profiled = contenders[2]
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(args.steps):
            profiled.step(step)
            step += 1
        profiler.disable()
        pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
