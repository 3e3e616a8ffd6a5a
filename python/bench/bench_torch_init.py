"""Peak host memory of building a Hugging Face GPT-2 and handing it to the
engine, with and without strata.torch.init (Note [Construction on meta]).

Each variant runs in a process of its own (peak RSS is per process); the
order is eager, init, init, eager per round (ABBA). The engine is stage 3
with the optimizer state and the parameters on NVMe under a host budget, so
its own host memory stays small and what differs is the model's copy:
eagerly, every parameter exists whole (fp32) before initialize copies it in;
under init, one unit's values exist at a time. The floor printed is the
largest unit's fp32 bytes (what init must hold at once) over the process's
RSS before the model is built.

    build/python/venv-torch2/bin/python python/bench/bench_torch_init.py --nvme DIR [--layers 12 --hidden 768]
        [--weights PRETRAINED_DIR]   # from_pretrained vs st.init + initial_weights
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile


def rss_mib():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def child(args):
    import torch
    import transformers
    import strata.torch as st
    from strata.torch import split_into_units

    torch.set_num_threads(1)
    cfg = transformers.GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=args.hidden // 64,
                                  vocab_size=args.vocab, n_positions=args.seq)
    ds = {"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
          "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": args.nvme},
                                "offload_param": {"device": "nvme", "nvme_path": args.nvme, "buffer_size": (args.vocab + args.seq + 4) * args.hidden,
                                                  "buffer_count": 3, "max_in_cpu": 0},
                                "stage3_param_persistence_threshold": 0, "sub_group_size": 4000000,
                                "reduce_bucket_size": 4000000, "stage3_max_live_parameters": 60000000},
          "strata": {"device": "cpu", "device_memory": "1GiB", "gradient_shards": "nvme",
                     "host_memory_budget": args.host_budget}}
    before = rss_mib()
    torch.manual_seed(0)
    extra = {}
    if args.variant == "init":
        with st.init(config=ds):
            model = transformers.GPT2LMHeadModel(cfg)
        if args.weights:
            extra["initial_weights"] = args.weights
    elif args.weights:
        model = transformers.GPT2LMHeadModel.from_pretrained(args.weights)
    else:
        model = transformers.GPT2LMHeadModel(cfg)
    built = rss_mib()
    params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    sizes = [sum(p.numel() for p in u.module.parameters()) for u in split_into_units(model) if not u.is_root]
    largest_unit = max(sizes + [params - sum(sizes)])  # the root unit: what no other unit holds
    engine, _, _, _ = st.initialize(model=model, model_parameters=model.parameters(), config=ds, **extra)
    after = rss_mib()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"variant": args.variant, "params": params, "rss_before_mib": before, "rss_built_mib": built,
                      "rss_after_mib": after, "peak_mib": peak, "largest_unit_fp32_mib": largest_unit * 4 / 2**20}))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nvme", required=True, help="folder for the engine's NVMe state (a scratch folder is made in it)")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--host-budget", default="2GiB")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--weights", help="a pretrained folder (save_pretrained's) of this shape: eager = "
                        "from_pretrained, init = st.init + initial_weights (written there first if absent)")
    parser.add_argument("--variant", choices=["eager", "init"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        child(args)
        return
    if not os.path.isdir(args.nvme):
        sys.exit(f"--nvme '{args.nvme}' is not a folder")
    if args.weights and not os.path.exists(os.path.join(args.weights, "config.json")):
        import torch
        import transformers
        cfg = transformers.GPT2Config(n_layer=args.layers, n_embd=args.hidden, n_head=args.hidden // 64,
                                      vocab_size=args.vocab, n_positions=args.seq)
        torch.manual_seed(1)
        transformers.GPT2LMHeadModel(cfg).save_pretrained(args.weights)
        del cfg
    rows = []
    for _ in range(args.rounds):
        for variant in ("eager", "init", "init", "eager"):
            with tempfile.TemporaryDirectory(dir=args.nvme) as scratch:
                cmd = [sys.executable, __file__, "--variant", variant, "--nvme", scratch, "--layers", str(args.layers),
                       "--hidden", str(args.hidden), "--vocab", str(args.vocab), "--seq", str(args.seq),
                       "--host-budget", args.host_budget] + (["--weights", args.weights] if args.weights else [])
                done = subprocess.run(cmd, capture_output=True, text=True)
                if done.returncode != 0:
                    sys.exit(f"the {variant} run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
                row = json.loads(done.stdout.strip().splitlines()[-1])
                rows.append(row)
                print(f"{variant:5s} params {row['params'] / 1e6:.1f}M  RSS before {row['rss_before_mib']:.0f} MiB, "
                      f"built {row['rss_built_mib']:.0f}, after initialize {row['rss_after_mib']:.0f}, "
                      f"peak {row['peak_mib']:.0f} MiB (peak over before: {row['peak_mib'] - row['rss_before_mib']:.0f}"
                      f" MiB; floor for init: largest unit {row['largest_unit_fp32_mib']:.0f} MiB)", flush=True)
    for variant in ("eager", "init"):
        extra = sorted(r["peak_mib"] - r["rss_before_mib"] for r in rows if r["variant"] == variant)
        print(f"{variant}: peak over the pre-build RSS, MiB: {', '.join(f'{x:.0f}' for x in extra)}")


if __name__ == "__main__":
    main()
