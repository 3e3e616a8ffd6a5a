#!/usr/bin/env python3
"""strata.torch against plain torch and DeepSpeed, training the same model
(issue 23's performance section; docs/performance.md, "strata.torch against
plain torch and DeepSpeed").

One process trains one GPT2LMHeadModel (or, --model llama, a LlamaForCausalLM) per contender, every copy from the
same seed and initial weights, on the same pre-generated batches, with the
same torch thread count:

  torch                plain torch, torch.optim.AdamW, clip_grad_norm_ 1.0
  deepspeed-z2         DeepSpeed ZeRO-2, offload_optimizer cpu (DeepSpeedCPUAdam, AdamW mode)
  deepspeed-z3         DeepSpeed ZeRO-3, offload_optimizer and offload_param cpu
  strata-z2-cpu        strata.torch stage 2, offload_optimizer cpu
  strata-z3-cpu        strata.torch stage 3, offload_optimizer and offload_param cpu
  strata-z3-nvme       strata.torch stage 3, both on nvme (a folder under --nvme-dir)

After --warmup steps each (not timed; their losses are compared), every
round runs --steps-per-round steps of each contender, in an order rotated
by one every round. A contender's time for a round is the wall time of its
steps, ending when its work is done (strata.torch steps the optimizer in the
background while the next forward runs, so its round ends with the engine
drained), divided by the steps. Each step is also split into forward,
backward and step (optimizer) timers, and the drain is timed apart.

Run through scripts/bench-torch-peers.sh, which makes the venv with the
pinned torch / transformers / DeepSpeed and sets PYTHONPATH to the staged
strata package:

  scripts/bench-torch-peers.sh -- --rounds 12 --json /tmp/peers.json
"""
import argparse
import os
import platform
import shutil
import socket
import statistics
import sys
import tempfile
import time
import traceback
import json

ALL_CONTENDERS = ["torch", "deepspeed-z2", "deepspeed-z3", "strata-z2-cpu", "strata-z3-cpu", "strata-z3-nvme"]

# strata contender -> (the DeepSpeed peer of its stage, target vs plain torch, target vs that peer);
# None: measured beside the others, no target.
TARGETS = {
    "strata-z2-cpu": ("deepspeed-z2", 1.00, 0.90),
    "strata-z3-cpu": ("deepspeed-z3", 1.05, 0.85),
    "strata-z3-nvme": ("deepspeed-z3", None, None),
}

LR = 1e-4
WEIGHT_DECAY = 0.01
CLIP = 1.0


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", type=int, default=2, help="torch / OpenMP threads for every contender (default 2)")
    p.add_argument("--rounds", type=int, default=10, help="measured rounds (default 10)")
    p.add_argument("--steps-per-round", type=int, default=2, help="steps of each contender per round (default 2)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps of each contender first (default 3)")
    p.add_argument("--contenders", default=",".join(ALL_CONTENDERS),
                   help=f"comma-separated subset of {','.join(ALL_CONTENDERS)}")
    p.add_argument("--nvme-dir", default=None, help="folder for strata's NVMe swap files (default: a temporary "
                                                    "folder under /tmp, removed at exit)")
    p.add_argument("--model", choices=["gpt2", "llama"], default="gpt2",
                   help="GPT2LMHeadModel (default) or LlamaForCausalLM of the same dimensions")
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--embd", type=int, default=384)
    p.add_argument("--heads", type=int, default=6)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--batches", type=int, default=16, help="distinct pre-generated batches, cycled (default 16)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--json", default=None, help="write every round, median, ratio and loss here")
    p.add_argument("--strata-section", default="{}",
                   help='JSON merged into every strata contender\'s "strata" config section, e.g. '
                        '\'{"overlap_optimizer": false}\' (default: {"device": "cpu"} only)')
    p.add_argument("--profile", default="", help="comma-separated contenders to run --profile-steps more steps "
                                                 "of under torch.profiler after the measured rounds (top ops by "
                                                 "self CPU time)")
    p.add_argument("--profile-steps", type=int, default=2)
    return p.parse_args()


def set_environment(args):
    """Before torch is imported: the OpenMP runtimes (torch's and DeepSpeed's op may be different copies of
    libgomp) read these at start; a spinning OpenMP pool would steal the cores from the next contender."""
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    os.environ.setdefault("OMP_WAIT_POLICY", "passive")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    # torch.distributed for DeepSpeed: one process, world 1, gloo.
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            os.environ["MASTER_PORT"] = str(s.getsockname()[1])
    for key, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)


# -- the model and the data -------------------------------------------------------------------------
def build_model(args):
    """The benchmark's model: GPT2LMHeadModel (the issue's) or LlamaForCausalLM of the same width and depth
    (rotary, RMSNorm, SwiGLU with a 8/3 x width MLP rounded to 64, an untied head)."""
    import transformers
    # Dropout off: every contender must compute the same function for the losses to be comparable
    # (each engine would draw its dropout masks from the RNG in a different order).
    if args.model == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=args.vocab, hidden_size=args.embd, intermediate_size=(8 * args.embd // 3 + 63) // 64 * 64,
            num_hidden_layers=args.layers, num_attention_heads=args.heads, max_position_embeddings=args.seq,
            tie_word_embeddings=False))
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=args.vocab, n_positions=args.seq, n_embd=args.embd, n_layer=args.layers, n_head=args.heads,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def make_model(args, initial_state):
    import torch
    torch.manual_seed(args.seed)
    model = build_model(args)
    model.load_state_dict(initial_state)
    model.train()
    return model


def make_batches(args):
    import torch
    generator = torch.Generator().manual_seed(args.seed + 1)
    return [torch.randint(0, args.vocab, (args.micro_batch, args.seq), generator=generator)
            for _ in range(args.batches)]


# -- contenders -------------------------------------------------------------------------------------
class Contender:
    """One model copy and its training loop; forward / backward / step timed apart."""

    def __init__(self, name):
        self.name = name
        self.steps = 0
        self.losses = []
        self.phase_ms = {"forward": [], "backward": [], "step": [], "drain": []}

    def forward_loss(self, ids):
        raise NotImplementedError

    def backward(self, loss):
        raise NotImplementedError

    def optimizer_step(self):
        raise NotImplementedError

    def drain(self):
        """Waits for work the contender left running in the background (none by default)."""

    def train_step(self, batches):
        ids = batches[self.steps % len(batches)]
        t0 = time.perf_counter()
        loss = self.forward_loss(ids)
        t1 = time.perf_counter()
        self.backward(loss)
        t2 = time.perf_counter()
        self.optimizer_step()
        t3 = time.perf_counter()
        self.phase_ms["forward"].append(1e3 * (t1 - t0))
        self.phase_ms["backward"].append(1e3 * (t2 - t1))
        self.phase_ms["step"].append(1e3 * (t3 - t2))
        self.losses.append(float(loss.detach()))
        self.steps += 1

    def timed_drain(self):
        t0 = time.perf_counter()
        self.drain()
        self.phase_ms["drain"].append(1e3 * (time.perf_counter() - t0))


class PlainTorch(Contender):
    def __init__(self, name, model):
        import torch
        super().__init__(name)
        self.torch = torch
        self.model = model
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=WEIGHT_DECAY)

    def forward_loss(self, ids):
        return self.model(input_ids=ids, labels=ids).loss

    def backward(self, loss):
        loss.backward()

    def optimizer_step(self):
        self.torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def zero_section(stage, optimizer_device, param_device, nvme_path=None):
    section = {"stage": stage, "offload_optimizer": {"device": optimizer_device}}
    if param_device is not None:
        section["offload_param"] = {"device": param_device}
    if nvme_path is not None:
        for key in ("offload_optimizer", "offload_param"):
            if key in section:
                section[key]["nvme_path"] = nvme_path
    return section


def shared_config(args, zero):
    return {"train_micro_batch_size_per_gpu": args.micro_batch, "gradient_accumulation_steps": 1,
            "gradient_clipping": CLIP,
            "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": WEIGHT_DECAY}},
            "zero_optimization": zero}


class DeepSpeedApi(Contender):
    """A contender trained through DeepSpeed's engine API (DeepSpeed's own, or strata.torch's)."""

    def forward_loss(self, ids):
        return self.engine(input_ids=ids, labels=ids).loss

    def backward(self, loss):
        self.engine.backward(loss)

    def optimizer_step(self):
        self.engine.step()


class DeepSpeedPeer(DeepSpeedApi):
    """deepspeed.initialize with the config's AdamW: with offload_optimizer cpu DeepSpeed builds a
    DeepSpeedCPUAdam in AdamW mode (its cpu_adam op JIT-built at first use)."""

    def __init__(self, name, model, args, stage):
        import deepspeed
        super().__init__(name)
        config = shared_config(args, zero_section(stage, "cpu", "cpu" if stage == 3 else None))
        config["steps_per_print"] = 1 << 30
        self.engine, self.optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                                                 config=config)
        inner = getattr(self.optimizer, "optimizer", self.optimizer)  # ZeRO's wrapper holds the CPU optimizer
        self.optimizer_class = f"{type(self.optimizer).__name__} over {type(inner).__name__}"


class StrataTorch(DeepSpeedApi):
    def __init__(self, name, model, args, stage, device, nvme_path=None):
        import strata.torch as st
        super().__init__(name)
        config = shared_config(args, zero_section(stage, device, device if stage == 3 else None, nvme_path))
        config["strata"] = {"device": "cpu", **json.loads(args.strata_section)}
        self.config = config
        self.engine, self.optimizer, _, _ = st.initialize(model=model, model_parameters=model.parameters(),
                                                          config=config)

    def drain(self):
        # The optimizer's updates overlap the next forward (strata.overlap_optimizer); the round's time
        # must hold all of them, so the engine is drained before the next contender starts.
        self.engine.synchronize()


def build_contender(name, args, initial_state, nvme_root):
    model = make_model(args, initial_state)
    if name == "torch":
        return PlainTorch(name, model)
    if name == "deepspeed-z2":
        return DeepSpeedPeer(name, model, args, stage=2)
    if name == "deepspeed-z3":
        return DeepSpeedPeer(name, model, args, stage=3)
    if name == "strata-z2-cpu":
        return StrataTorch(name, model, args, stage=2, device="cpu")
    if name == "strata-z3-cpu":
        return StrataTorch(name, model, args, stage=3, device="cpu")
    if name == "strata-z3-nvme":
        folder = os.path.join(nvme_root, "strata-z3-nvme")
        os.makedirs(folder, exist_ok=True)
        return StrataTorch(name, model, args, stage=3, device="nvme", nvme_path=folder)
    raise ValueError(f"unknown contender '{name}': choose from {', '.join(ALL_CONTENDERS)}")


# -- the run ----------------------------------------------------------------------------------------
def versions():
    import torch
    import transformers
    found = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__}
    try:
        import deepspeed
        found["deepspeed"] = deepspeed.__version__
    except Exception as error:  # noqa: BLE001 - recorded, the strata contenders still run
        found["deepspeed"] = f"not importable: {error!r}"
    try:
        import strata
        info = strata.build_info()
        found["strata"] = {k: info[k] for k in ("version", "git_commit", "build_type") if k in info} or str(info)
    except Exception as error:  # noqa: BLE001
        found["strata"] = f"not importable: {error!r}"
    return found


def profile_contender(contender, batches, steps):
    """A few more steps under torch.profiler; the table of the ops with the most self CPU time."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(steps):
            contender.train_step(batches)
        contender.timed_drain()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15, max_name_column_width=48)


def median(values):
    return statistics.median(values) if values else float("nan")


def main():
    args = parse_args()
    set_environment(args)
    import torch
    torch.set_num_threads(args.threads)
    names = [n.strip() for n in args.contenders.split(",") if n.strip()]
    for n in names:
        if n not in ALL_CONTENDERS:
            sys.exit(f"bench_torch_peers.py: unknown contender '{n}' (choose from {', '.join(ALL_CONTENDERS)})")
    if "torch" not in names:
        sys.exit("bench_torch_peers.py: the plain torch contender is the reference; keep 'torch' in --contenders")
    if (os.cpu_count() or 0) != args.threads and any(n.startswith("strata") for n in names):
        print(f"note: strata's engine steps its CPU optimizer on {os.cpu_count()} threads (one per core), "
              f"not --threads {args.threads}")

    if any(n.startswith("deepspeed") for n in names):
        import deepspeed
        deepspeed.init_distributed(dist_backend="gloo")

    found = versions()
    print("versions:", json.dumps(found))
    print(f"threads {args.threads} (torch.get_num_threads {torch.get_num_threads()}), "
          f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, DS_ACCELERATOR={os.environ.get('DS_ACCELERATOR')}")

    torch.manual_seed(args.seed)
    reference = build_model(args)
    initial_state = {k: v.clone() for k, v in reference.state_dict().items()}
    n_params = sum(p.numel() for p in reference.parameters())
    model_name = type(reference).__name__
    del reference
    batches = make_batches(args)
    print(f"{model_name} {args.layers} layers x {args.embd}, {args.heads} heads, vocab {args.vocab}, "
          f"seq {args.seq}, micro batch {args.micro_batch}: {n_params / 1e6:.2f}M parameters, fp32, AdamW "
          f"lr {LR} wd {WEIGHT_DECAY}, clip {CLIP}, dropout 0")

    nvme_root = args.nvme_dir or tempfile.mkdtemp(prefix="strata-peers-nvme-", dir="/tmp")
    failures = {}
    contenders = {}
    for name in names:
        try:
            t0 = time.perf_counter()
            contenders[name] = build_contender(name, args, initial_state, nvme_root)
            built = contenders[name]
            detail = f" (optimizer {built.optimizer_class})" if isinstance(built, DeepSpeedPeer) else ""
            print(f"built {name} in {time.perf_counter() - t0:.1f} s{detail}")
        except Exception:  # noqa: BLE001 - the failure is reported, the others still run
            failures[name] = traceback.format_exc()
            print(f"FAILED to build {name}:\n{failures[name]}", file=sys.stderr)

    def run_steps(contender, count):
        try:
            torch.set_num_threads(args.threads)  # in case a contender changed it
            t0 = time.perf_counter()
            for _ in range(count):
                contender.train_step(batches)
            contender.timed_drain()
            return (time.perf_counter() - t0) / count
        except Exception:  # noqa: BLE001
            failures[contender.name] = traceback.format_exc()
            print(f"FAILED while training {contender.name} (step {contender.steps}):\n"
                  f"{failures[contender.name]}", file=sys.stderr)
            del contenders[contender.name]
            return None

    for contender in list(contenders.values()):  # warm-up, untimed
        run_steps(contender, args.warmup)
    for contender in contenders.values():
        for phase in contender.phase_ms.values():
            phase.clear()

    order = list(contenders)
    rounds = []  # per round: [(contender, ms per step)] in the order run
    per_contender = {name: [] for name in order}
    for r in range(args.rounds):
        rotated = order[r % len(order):] + order[:r % len(order)]
        this_round = []
        for name in rotated:
            if name not in contenders:
                continue
            seconds = run_steps(contenders[name], args.steps_per_round)
            if seconds is not None:
                this_round.append((name, 1e3 * seconds))
                per_contender[name].append(1e3 * seconds)
        rounds.append(this_round)
        print(f"round {r + 1:2d}: " + "  ".join(f"{name} {ms:.0f}" for name, ms in this_round), flush=True)

    medians = {name: median(times) for name, times in per_contender.items() if times}
    reference_ms = medians.get("torch")

    def per_round_ratios(name, other):
        """name's time over other's in each round both ran: the load of a shared machine moves between
        rounds more than within one, so these pair each time with its neighbour's."""
        ratios = []
        for this_round in rounds:
            times = dict(this_round)
            if name in times and other in times:
                ratios.append(times[name] / times[other])
        return ratios

    print()
    print("ratio of medians, and in [] the median of the per-round ratios:")
    print(f"{'contender':16} {'median ms/step':>14} {'min':>6} {'max':>6} {'vs torch':>17} {'vs DS peer':>17}  "
          f"targets")
    summary = {}
    for name, ms in medians.items():
        times = per_contender[name]
        vs_torch = ms / reference_ms if reference_ms else float("nan")
        round_vs_torch = median(per_round_ratios(name, "torch"))
        peer, torch_target, peer_target = TARGETS.get(name, (None, None, None))
        vs_peer = ms / medians[peer] if peer in medians else None
        round_vs_peer = median(per_round_ratios(name, peer)) if peer in medians else None
        verdicts = []

        def verdict(ratio, round_ratio, target):
            met = lambda r: "met" if r <= target else "NOT met"  # noqa: E731
            return f"{met(ratio)} (per-round: {met(round_ratio)})"
        if torch_target is not None:
            verdicts.append(f"<= {torch_target:.2f} x torch: {verdict(vs_torch, round_vs_torch, torch_target)}")
        if peer_target is not None and vs_peer is not None:
            verdicts.append(f"<= {peer_target:.2f} x {peer}: {verdict(vs_peer, round_vs_peer, peer_target)}")
        elif peer is not None and peer_target is None:
            verdicts.append("no target (measured beside)")
        torch_text = f"{vs_torch:.3f} [{round_vs_torch:.3f}]"
        peer_text = f"{vs_peer:.3f} [{round_vs_peer:.3f}]" if vs_peer is not None else "-"
        print(f"{name:16} {ms:14.1f} {min(times):6.0f} {max(times):6.0f} {torch_text:>17} {peer_text:>17}  "
              f"{'; '.join(verdicts)}")
        summary[name] = {"median_ms": ms, "min_ms": min(times), "max_ms": max(times), "vs_torch": vs_torch,
                         "per_round_vs_torch_median": round_vs_torch, "peer": peer, "vs_peer": vs_peer,
                         "per_round_vs_peer_median": round_vs_peer, "targets": verdicts}

    print()
    print("where the time goes (median ms per step; drain: per round, strata's queued optimizer work):")
    print(f"{'contender':16} {'forward':>8} {'backward':>9} {'step':>7} {'drain':>7}")
    for name, contender in contenders.items():
        ph = {k: median(v) for k, v in contender.phase_ms.items()}
        summary.setdefault(name, {})["phase_median_ms"] = ph
        print(f"{name:16} {ph['forward']:8.1f} {ph['backward']:9.1f} {ph['step']:7.1f} {ph['drain']:7.1f}")

    profiles = {}
    for name in [n.strip() for n in args.profile.split(",") if n.strip()]:
        if name not in contenders:
            print(f"--profile: no contender '{name}' running; skipped")
            continue
        profiles[name] = profile_contender(contenders[name], batches, args.profile_steps)
        print(f"\ntorch.profiler, {name}, {args.profile_steps} steps (top ops by self CPU time):")
        print(profiles[name])

    print()
    compare = min(args.warmup, 5) or 3
    print(f"losses (the first {compare} steps; all contenders train on the same batches in the same order):")
    reference_losses = contenders["torch"].losses if "torch" in contenders else []
    loss_report = {}
    for name, contender in contenders.items():
        first = contender.losses[:compare]
        common = min(len(reference_losses), len(contender.losses))
        diff_first = max((abs(a - b) for a, b in zip(first, reference_losses)), default=float("nan"))
        diff_all = max((abs(contender.losses[i] - reference_losses[i]) for i in range(common)), default=float("nan"))
        loss_report[name] = {"first": first, "max_abs_diff_first": diff_first, "steps_compared": common,
                             "max_abs_diff_all": diff_all}
        print(f"{name:16} {' '.join(f'{x:.6f}' for x in first)}   max |diff| vs torch: first {compare} "
              f"{diff_first:.2e}, all {common} steps {diff_all:.2e}")

    if failures:
        print()
        for name, text in failures.items():
            print(f"FAILED {name}:\n{text}")

    if args.json:
        with open(args.json, "w") as out:
            json.dump({"versions": found, "args": vars(args), "parameters": n_params,
                       "cpu_count": os.cpu_count(), "rounds": rounds, "ms_per_step": per_contender,
                       "summary": summary, "losses": loss_report,
                       "all_losses": {n: c.losses for n, c in contenders.items()},
                       "profiles": profiles, "failures": failures}, out, indent=1)
        print(f"wrote {args.json}")
    if args.nvme_dir is None:
        shutil.rmtree(nvme_root, ignore_errors=True)


if __name__ == "__main__":
    main()
