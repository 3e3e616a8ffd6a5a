#!/usr/bin/env python3
"""Benchmarks of the strata Python package (docs/performance.md, "Python package").

optim: one optimizer step over a GPT-2-small-shaped parameter list (124.4M
fp32 params, 148 tensors), interleaved rounds of
  strata.optim.CPUAdam.step()                       (the Python layer, one native call per group)
  native flat step                                  (the same kernels on one 124.4M span, one call:
                                                     what `strata bench cpu-adam` times in C++)
  torch.optim.AdamW(foreach=False) / (foreach=True)
Each round runs every contender once, in rotating order; medians are printed
and every round is kept in --json.

io: strata.io.AsyncIO pwrite/pread of --io-size bytes vs `strata io-bench`
(same engine, block size, depth, threads), interleaved pairs.

  python bench_python.py optim [--threads 2] [--rounds 7] [--deepspeed] [--json out.json]
  python bench_python.py io --path DIR --cli build/apps/strata [--io-size 512MiB] [--pairs 5]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import torch

import strata


def gpt2_small_shapes(vocab=50257, ctx=1024, d=768, layers=12):
    shapes = [(vocab, d), (ctx, d)]
    for _ in range(layers):
        shapes += [(d,), (d,), (d, 3 * d), (3 * d,), (d, d), (d,), (d,), (d,), (d, 4 * d), (4 * d,), (4 * d, d), (d,)]
    shapes += [(d,), (d,)]
    return shapes


def make_params(shapes, seed):
    g = torch.Generator().manual_seed(seed)
    params = []
    for s in shapes:
        p = torch.nn.Parameter(torch.randn(s, generator=g) * 0.02)
        p.grad = torch.randn(s, generator=g) * 1e-3
        params.append(p)
    return params


def timed(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_optim(args):
    torch.set_num_threads(args.threads)
    shapes = gpt2_small_shapes()
    n = sum(torch.Size(s).numel() for s in shapes)
    contenders = {}

    ours = make_params(shapes, 1)
    s_opt = strata.optim.CPUAdam(ours, lr=1e-4, weight_decay=0.01, threads=args.threads)
    contenders["strata CPUAdam.step"] = s_opt.step

    flat = {k: torch.zeros(n) for k in ("p", "m", "v")}
    flat["g"] = torch.randn(n) * 1e-3
    native = strata._native.CpuOptimizer("adamw", threads=args.threads)
    flat_step = [0]

    def native_flat():
        flat_step[0] += 1
        native.step_spans([(n, flat["p"].data_ptr(), flat["g"].data_ptr(), "float32", flat["m"].data_ptr(),
                            flat["v"].data_ptr(), "float32", 0, "bfloat16", flat_step[0])],
                          1e-4, 0.9, 0.999, 1e-8, 0.01, True)
    contenders["native flat step (C++ bench equivalent)"] = native_flat

    for foreach in (False, True):
        tp = make_params(shapes, 1)
        t_opt = torch.optim.AdamW(tp, lr=1e-4, weight_decay=0.01, foreach=foreach)
        contenders[f"torch AdamW foreach={foreach}"] = t_opt.step

    if args.deepspeed:
        # DeepSpeed's op builder JIT-compiles cpu_adam (needs torch's C++
        # headers: Debian's libtorch-dev) on first use, with -march=native and OpenMP.
        from deepspeed.ops.adam import DeepSpeedCPUAdam
        dp = make_params(shapes, 1)
        ds_opt = DeepSpeedCPUAdam(dp, lr=1e-4, weight_decay=0.01, adamw_mode=True)
        contenders["DeepSpeedCPUAdam.step"] = ds_opt.step

    for fn in contenders.values():  # warm-up: allocates the states
        fn()
    names = list(contenders)
    rounds = {k: [] for k in names}
    for r in range(args.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for k in order:
            rounds[k].append(timed(contenders[k]))
    med = {k: statistics.median(v) for k, v in rounds.items()}
    print(f"params {n / 1e6:.1f}M in {len(shapes)} tensors, fp32, threads {args.threads}, "
          f"kernel path {s_opt.kernel_path}, {args.rounds} interleaved rounds, torch {torch.__version__}")
    print(f"{'contender':42} {'median s':>9} {'Gparam/s':>9}")
    for k in names:
        print(f"{k:42} {med[k]:9.4f} {n / med[k] / 1e9:9.3f}")
    best_torch = min(med["torch AdamW foreach=False"], med["torch AdamW foreach=True"])
    print(f"strata vs the faster torch path: {best_torch / med['strata CPUAdam.step']:.2f}x")
    if args.deepspeed:
        print(f"strata vs DeepSpeedCPUAdam: {med['DeepSpeedCPUAdam.step'] / med['strata CPUAdam.step']:.2f}x")
    per_round = [a / b - 1 for a, b in zip(rounds["strata CPUAdam.step"],
                                            rounds["native flat step (C++ bench equivalent)"])]
    ratio_of_medians = med["strata CPUAdam.step"] / med["native flat step (C++ bench equivalent)"] - 1
    ratio_of_minimums = min(rounds["strata CPUAdam.step"]) / min(rounds["native flat step (C++ bench equivalent)"]) - 1
    print(f"Python layer overhead vs one flat native step: {100 * ratio_of_medians:+.1f}% (ratio of medians), "
          f"{100 * ratio_of_minimums:+.1f}% (ratio of fastest rounds); "
          f"median of per-round ratios {100 * statistics.median(per_round):+.1f}% "
          f"(per round: {', '.join(f'{100 * x:+.1f}%' for x in per_round)})")
    return {"params": n, "tensors": len(shapes), "threads": args.threads, "rounds_s": rounds, "median_s": med,
            "kernel_path": s_opt.kernel_path, "torch": torch.__version__}


def parse_size(text):
    units = {"KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
    for u, m in units.items():
        if text.endswith(u):
            return int(text[:-len(u)]) * m
    return int(text)


def bench_io(args):
    size = parse_size(args.io_size)
    aio = strata.io.AsyncIO(engine=args.engine, block_size=1 << 20, queue_depth=args.queue_depth, threads=args.threads)
    buf = strata.io.empty(size, torch.uint8, alignment=2 << 20)
    buf.fill_(7)
    path = os.path.join(args.path, "strata-python-io-bench.bin")
    aio.sync_pwrite(buf, path, 0)  # lay the file out once
    results = {"python_write": [], "python_read": [], "cli_write": [], "cli_read": []}
    cli_args = [args.cli, "io-bench", "--path", args.path, "--size", str(size), "--engine", aio.engine,
                "--block-size", "1MiB", "--queue-depth", str(args.queue_depth), "--threads", str(args.threads),
                "--json", "--file", "strata-cli-io-bench.bin"]
    for pair in range(args.pairs):
        def python_side():
            results["python_write"].append(size / timed(lambda: aio.sync_pwrite(buf, path, 0)) / 1e9)
            results["python_read"].append(size / timed(lambda: aio.sync_pread(buf, path, 0)) / 1e9)

        def cli_side():
            out = subprocess.run(cli_args + (["--overwrite"] if pair else []), check=True, capture_output=True,
                                 text=True).stdout
            for row in json.loads(out)["results"]:
                results[f"cli_{row['mode']}"].append(row["gb_per_s"] if "gb_per_s" in row else row["GBps"])
        for side in ((python_side, cli_side) if pair % 2 == 0 else (cli_side, python_side)):
            side()
    med = {k: statistics.median(v) for k, v in results.items() if v}
    print(f"engine {aio.engine} ({aio.describe()}), {size >> 20} MiB, 1 MiB blocks, depth {args.queue_depth}, "
          f"{args.threads} thread(s), {args.pairs} ABBA pairs; info: {aio.info(path, True)}")
    for k, v in results.items():
        print(f"{k:14} median {med.get(k, float('nan')):.3f} GB/s  ({', '.join(f'{x:.2f}' for x in v)})")
    for mode in ("write", "read"):
        if f"cli_{mode}" in med:
            print(f"python/cli {mode}: {med[f'python_{mode}'] / med[f'cli_{mode}']:.3f}")
    os.unlink(path)
    return {"results": results, "median": med}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["optim", "io"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--path")
    ap.add_argument("--cli")
    ap.add_argument("--engine", default="auto")
    ap.add_argument("--io-size", default="512MiB")
    ap.add_argument("--queue-depth", type=int, default=32)
    ap.add_argument("--pairs", type=int, default=5)
    ap.add_argument("--deepspeed", action="store_true",
                    help="optim: add DeepSpeedCPUAdam (run with OMP_NUM_THREADS=--threads, in a venv with deepspeed)")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.what == "io" and not (args.path and args.cli):
        ap.error("io needs --path DIR and --cli PATH_TO_strata")
    out = bench_optim(args) if args.what == "optim" else bench_io(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
