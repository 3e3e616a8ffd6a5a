"""strata.torch on a GPU, checked and measured in one run (issue 50 §2 items 1 and 2).

  matrix    a tiny GPT-2 at ZeRO stages 0-3, optimizer state on the device, in host memory and on NVMe,
            stage-3 parameters on the device, in host memory and on NVMe: every run's losses bit-identical
            to each other (torch's deterministic algorithms on), and within 1e-5 of the same model on the
            cpu device. Exit status 1 when any of that fails.
  headline  a Llama-shaped model built under st.init from a config, stage 3 with the optimizer state and
            the parameters in pinned host memory, bf16: tokens/s, MFU against the GPU's dense bf16 peak,
            the device and host peaks beside the plan, the CPU optimizer step's time, the first losses; then
            the same with the optimizer state on NVMe in 8-bit moments. The model, batch and sequence are
            the peer's (scripts/gpu-peer-deepspeed.py) unless given.

Prints one JSON object per part and writes them to --json. Run by scripts/gpu-check.sh on the GPU
machine (the native module for its Python from the pack: scripts/gpu-torch-module.sh). Without a GPU the
parts say "skipped" and exit 0, unless --device cpu or --device recorded runs the matrix on the cpu
device or on the recorded stand-in of the cuda order (what CI runs, so the script keeps working).
"""
import argparse
import faulthandler
import json
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time

# Dense bf16 tensor-core peaks (TFLOP/s) by the name torch gives the GPU: the vendors' datasheets, without sparsity.
DENSE_BF16_PEAK_TFLOPS = {"H100 SXM": 989.4, "H100 80GB HBM3": 989.4, "H100 NVL": 835.0, "H100 PCIe": 756.0,
                          "H200": 989.4, "A100": 312.0}


def parse_arguments(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("part", choices=("matrix", "headline", "all", "bench"),
                        help="all: the matrix, then the headline; bench: strata.torch.bench's placement rows for the "
                             "headline model (a call of its own)")
    parser.add_argument("--device", choices=("cuda", "cpu", "recorded"), default="cuda",
                        help="where the matrix runs (cpu and recorded: the no-GPU checks CI runs)")
    parser.add_argument("--nvme", help="a folder for the NVMe placements (default: a temporary one)")
    parser.add_argument("--matrix-steps", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--accumulation", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--steps", type=int, default=6, help="timed steps")
    parser.add_argument("--skip-nvme-headline", action="store_true")
    parser.add_argument("--host-checkpoints", action="store_true",
                        help="headline: gradient_checkpointing_enable() with the checkpoints' inputs in pinned host "
                             "memory (activation_checkpointing.cpu_checkpointing)")
    parser.add_argument("--moments", choices=("fp32", "int8"), default="fp32",
                        help="the host-memory headline row's Adam moments (the NVMe row's are int8); int8 where host "
                             "memory needs it (7B: 112 GiB of state at fp32, 75 GiB at int8, per strata estimate)")
    parser.add_argument("--json", help="also write the results here")
    arguments = parser.parse_args(argv)
    for name in ("matrix_steps", "hidden", "layers", "heads", "intermediate", "vocab", "seq", "batch",
                 "accumulation", "steps"):
        if getattr(arguments, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(arguments, name)}")
    if arguments.warmup < 0:
        parser.error(f"--warmup must not be negative, got {arguments.warmup}")
    if arguments.hidden % arguments.heads:
        parser.error(f"--hidden {arguments.hidden} is not a multiple of --heads {arguments.heads}")
    return arguments


# -- the matrix ---------------------------------------------------------------------------------------------
PLACEMENTS = [(0, "none", "none"), (1, "none", "none"), (2, "none", "none"), (2, "cpu", "none"),
              (2, "nvme", "none"), (3, "none", "none"), (3, "cpu", "none"), (3, "cpu", "cpu"),
              (3, "nvme", "cpu"), (3, "nvme", "nvme")]
# The last row again with gradient_checkpointing_enable() and the checkpoints' inputs in pinned host memory
# (activation_checkpointing.cpu_checkpointing): its losses must equal the others'.
HOST_CHECKPOINTS_ROW = (3, "cpu", "cpu")


def matrix_config(stage, optimizer, params, nvme, device, host_checkpoints=False):
    zero = {"stage": stage, "offload_optimizer": {"device": optimizer}, "offload_param": {"device": params},
            "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 200000}
    for section, where in (("offload_optimizer", optimizer), ("offload_param", params)):
        if where == "nvme":
            zero[section]["nvme_path"] = nvme
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.999], "eps": 1e-8,
                                                      "weight_decay": 0.01}},
            "zero_optimization": zero,
            # A hung collective or gate fails the row in 120 s instead of taking the call's whole time.
            "strata": {"device": "cuda" if device == "cuda" else "cpu", "device_memory": "256MiB",
                       "wait_timeout_s": 120},
            "activation_checkpointing": {"cpu_checkpointing": host_checkpoints}}


def tiny_gpt2(transformers, torch):
    torch.manual_seed(11)
    config = transformers.GPT2Config(vocab_size=128, n_positions=32, n_embd=64, n_layer=2, n_head=4,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config)


def matrix_run(st, torch, transformers, config, steps, device, row):
    model = tiny_gpt2(transformers, torch)
    if config["activation_checkpointing"]["cpu_checkpointing"]:
        model.gradient_checkpointing_enable()
        model.train()
    # A swap folder of its own per row: one row that fails leaves none in the next one's way.
    engine, _, _, _ = st.initialize(model=model, config=config, job_name=f"matrix-{os.getpid()}-{row}")
    losses = []
    try:
        for index in range(steps * engine.gradient_accumulation_steps()):
            generator = torch.Generator().manual_seed(100 + index)
            ids = torch.randint(0, 128, (2, 17), generator=generator).to(engine.device)
            loss = engine(input_ids=ids, labels=ids).loss
            engine.backward(loss)
            boundary = engine.is_gradient_accumulation_boundary()
            engine.step()
            if boundary:
                losses.append(engine.metrics["loss"])
    finally:
        engine.close()
    return losses


def run_matrix(arguments, nvme):
    import torch
    import transformers
    import strata.torch as st
    from strata._torch_device import recorded_device_for_tests
    if arguments.device == "cuda" and not torch.cuda.is_available():
        return {"part": "matrix", "status": "skipped", "reason": "torch sees no GPU"}
    torch.use_deterministic_algorithms(True)
    try:
        rows, failures = matrix_rows(st, torch, transformers, arguments, nvme, recorded_device_for_tests)
    finally:
        torch.use_deterministic_algorithms(False)  # the headline is timed with torch's usual kernels
    sequences = [row["losses"] for row in rows if "losses" in row]
    if sequences and any(s != sequences[0] for s in sequences):
        failures.append("the placements' losses differ: " + "; ".join(
            f"{row['placement']}: {row['losses']}" for row in rows if "losses" in row))
    reference = None
    if arguments.device != "cpu" and sequences:  # the same model on the cpu device
        reference = matrix_run(st, torch, transformers, matrix_config(0, "none", "none", nvme, "cpu"),
                               arguments.matrix_steps, "cpu", "cpu-reference")
        worst = max(abs(a - b) for a, b in zip(sequences[0], reference))
        if worst > 1e-5:
            failures.append(f"the {arguments.device} losses differ from the cpu device's by {worst:.3g} (> 1e-5): "
                            f"{sequences[0]} vs {reference}")
    return {"part": "matrix", "status": "failed" if failures else "ok", "device": arguments.device,
            "deterministic": True, "rows": rows, "cpu_reference": reference, "failures": failures}


def matrix_rows(st, torch, transformers, arguments, nvme, recorded_device_for_tests):
    """Every placement's losses, or its error: one row failing must not hide the others. A row still running
    after 150 s dumps every thread's stack to stderr (the log), then goes on."""
    rows, failures = [], []
    rows_asked = [(placement, False) for placement in PLACEMENTS] + [(HOST_CHECKPOINTS_ROW, True)]
    for row, ((stage, optimizer, params), host_checkpoints) in enumerate(rows_asked):
        label = f"stage {stage}, optimizer {optimizer}, params {params}"
        if host_checkpoints:
            label += ", activation checkpoints in host memory"
        config = matrix_config(stage, optimizer, params, nvme, arguments.device, host_checkpoints)
        started = time.perf_counter()
        faulthandler.dump_traceback_later(150, exit=False)
        try:
            if arguments.device == "recorded":
                with recorded_device_for_tests():
                    losses = matrix_run(st, torch, transformers, config, arguments.matrix_steps, "recorded", row)
            else:
                losses = matrix_run(st, torch, transformers, config, arguments.matrix_steps, arguments.device, row)
        except Exception as error:
            failures.append(f"{label}: {type(error).__name__}: {error}")
            rows.append({"placement": label, "error": f"{type(error).__name__}: {error}"[:2000]})
            continue
        finally:
            faulthandler.cancel_dump_traceback_later()
        rows.append({"placement": label, "losses": losses, "seconds": round(time.perf_counter() - started, 2)})
    return rows, failures


# -- the headline run -------------------------------------------------------------------------------------
def headline_config(arguments, optimizer, nvme):
    offload_optimizer = {"device": optimizer, "pin_memory": True}
    if optimizer == "nvme":
        offload_optimizer.update(nvme_path=nvme, pipeline_read=True, pipeline_write=True)
    strata = {"device": "cuda"}
    if optimizer == "nvme" or arguments.moments == "int8":
        strata["optimizer_state_dtype"] = "int8"
    return {"train_micro_batch_size_per_gpu": arguments.batch,
            "gradient_accumulation_steps": arguments.accumulation, "gradient_clipping": 1.0,
            "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8,
                                                      "weight_decay": 0.0}},
            "zero_optimization": {"stage": 3, "offload_optimizer": offload_optimizer,
                                  "offload_param": {"device": "cpu", "pin_memory": True}},
            "activation_checkpointing": {"cpu_checkpointing": arguments.host_checkpoints},
            "strata": strata}


def dense_bf16_peak(name):
    for key, peak in DENSE_BF16_PEAK_TFLOPS.items():
        if key in name:
            return peak
    return None


def headline_run(arguments, optimizer, nvme):
    import torch
    import transformers
    import strata.torch as st
    config = headline_config(arguments, optimizer, nvme)
    model_config = transformers.LlamaConfig(
        vocab_size=arguments.vocab, hidden_size=arguments.hidden, intermediate_size=arguments.intermediate,
        num_hidden_layers=arguments.layers, num_attention_heads=arguments.heads,
        num_key_value_heads=arguments.heads, max_position_embeddings=arguments.seq, attn_implementation="sdpa")
    started = time.perf_counter()
    with st.init(config=config):
        model = transformers.LlamaForCausalLM(model_config)
    if arguments.host_checkpoints:
        model.gradient_checkpointing_enable()
        model.train()
    engine, _, _, _ = st.initialize(model=model, config=config, job_name=f"headline-{os.getpid()}")
    initialize_seconds = time.perf_counter() - started
    parameters = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())  # DeepSpeed's idiom
    generator = torch.Generator(device=engine.device).manual_seed(0)
    tokens = torch.randint(0, arguments.vocab, (arguments.batch, arguments.seq), device=engine.device,
                           generator=generator)
    losses, step_seconds, optimizer_ms, exposed_ms = [], [], [], []
    torch.cuda.reset_peak_memory_stats()
    for step in range(arguments.warmup + arguments.steps):
        torch.cuda.synchronize()  # timing only: the step itself has no host wait but its loss
        begun = time.perf_counter()
        for _ in range(arguments.accumulation):
            loss = engine(input_ids=tokens, labels=tokens).loss
            engine.backward(loss)
            engine.step()
        torch.cuda.synchronize()
        metrics = engine.metrics
        if step >= arguments.warmup:
            step_seconds.append(time.perf_counter() - begun)
            optimizer_ms.append(metrics["optimizer_ms"])
            exposed_ms.append(metrics["wait_optimizer_ms"])  # of the step's last micro-batch's report
        losses.append(round(metrics["loss"], 5))
    median = statistics.median(step_seconds)
    tokens_per_step = arguments.batch * arguments.seq * arguments.accumulation
    name = torch.cuda.get_device_name(engine.device)
    peak = dense_bf16_peak(name)
    model_flops = 6 * parameters * tokens_per_step / median
    memory = engine.memory()
    result = {
        "placement": f"stage 3, optimizer {optimizer}"
                     f"{' (8-bit moments)' if optimizer == 'nvme' or arguments.moments == 'int8' else ''}, "
                     f"parameters cpu, bf16{', activation checkpoints in host memory' if arguments.host_checkpoints else ''}",
        "activation_checkpoints": st.checkpointing.stats() if arguments.host_checkpoints else None,
        "gpu": name, "torch": torch.__version__, "transformers": transformers.__version__,
        "model": {"parameters": parameters, "hidden": arguments.hidden, "layers": arguments.layers,
                  "heads": arguments.heads, "intermediate": arguments.intermediate, "vocab": arguments.vocab},
        "batch": arguments.batch, "seq": arguments.seq, "accumulation": arguments.accumulation,
        "timed_steps": len(step_seconds),
        "step_ms": {"median": round(median * 1e3, 1), "min": round(min(step_seconds) * 1e3, 1),
                    "max": round(max(step_seconds) * 1e3, 1)},
        "tokens_per_second": round(tokens_per_step / median, 1),
        "model_tflops": round(model_flops / 1e12, 2),
        "mfu": None if peak is None else round(model_flops / (peak * 1e12), 4),
        "dense_bf16_peak_tflops": peak,
        # The CPU step's own time, and how long torch's stream waited for an update (Note [Who waits for an
        # acquired layer]): the part of the optimizer not hidden under forward and backward.
        "optimizer_ms_median": round(statistics.median(optimizer_ms), 1),
        "exposed_optimizer_ms_median": round(statistics.median(exposed_ms), 1),
        "losses": losses,
        "device_peak_torch_gib": round(torch.cuda.max_memory_allocated(engine.device) / 2**30, 2),
        "engine_memory": memory,
        "host_peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        "initialize_seconds": round(initialize_seconds, 1),
    }
    engine.close()
    return result


def run_headline(arguments, nvme):
    import torch
    if not torch.cuda.is_available():
        return {"part": "headline", "status": "skipped", "reason": "torch sees no GPU"}
    runs, errors = [], []
    for optimizer in ("cpu",) if arguments.skip_nvme_headline else ("cpu", "nvme"):
        try:
            runs.append(headline_run(arguments, optimizer, nvme))
        except Exception as error:
            errors.append(f"optimizer {optimizer}: {type(error).__name__}: {error}"[:2000])
    return {"part": "headline", "status": "failed" if errors else "ok", "runs": runs, "errors": errors}


# -- the penalty bench for the headline model (issue 50 section 3) ----------------------------------------------
BENCH_ROWS = [{"stage": 3, "offload_optimizer": "none", "offload_param": "none"},
              {"stage": 3, "offload_optimizer": "cpu", "offload_param": "none"},
              {"stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"},
              {"stage": 3, "offload_optimizer": "nvme", "offload_param": "cpu", "optimizer_state_dtype": "int8"}]


def run_bench(arguments, nvme):
    """What each placement costs the headline model: strata.torch.bench (python -m strata.torch.bench's
    entry point) over BENCH_ROWS, ABBA repeats, the penalty against the fastest row that fits. A row that does
    not fit (the whole state on one GPU) is reported with the engine's reason."""
    import torch
    import transformers
    import strata.torch.bench as bench
    if arguments.device == "cuda" and not torch.cuda.is_available():
        return {"part": "bench", "status": "skipped", "reason": "torch sees no GPU"}
    model_config = transformers.LlamaConfig(
        vocab_size=arguments.vocab, hidden_size=arguments.hidden, intermediate_size=arguments.intermediate,
        num_hidden_layers=arguments.layers, num_attention_heads=arguments.heads,
        num_key_value_heads=arguments.heads, max_position_embeddings=arguments.seq)
    base = headline_config(arguments, "cpu", nvme)
    base["strata"]["device"] = "cpu" if arguments.device == "cpu" else "cuda"
    base["strata"].pop("optimizer_state_dtype", None)  # each row says its own
    doc = bench.offload(lambda: transformers.LlamaForCausalLM(model_config),
                        batch_fn=bench.token_batches(arguments.vocab, arguments.batch, arguments.seq),
                        config=base, rows=BENCH_ROWS, steps=arguments.steps, warmup=arguments.warmup,
                        repeats=2, dtype="bf16", nvme_path=nvme)
    return {"part": "bench", "status": "ok" if any(r["status"] == "ok" for r in doc["rows"]) else "failed",
            "bench": doc}


def main(argv):
    arguments = parse_arguments(argv)
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # deterministic cuBLAS (the matrix)
    os.environ.setdefault("CUDA_MODULE_LOADING", "EAGER")       # as import strata.torch sets them (Note [CUDA's
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "32")  # environment for gated streams]), before torch
    nvme = arguments.nvme or tempfile.mkdtemp(prefix="strata-gpu-torch-")
    made_here = arguments.nvme is None
    results = []
    try:
        if arguments.part in ("matrix", "all"):
            results.append(run_matrix(arguments, nvme))
            print(json.dumps(results[-1], indent=1), flush=True)
        if arguments.part in ("headline", "all"):
            results.append(run_headline(arguments, nvme))
            print(json.dumps(results[-1], indent=1), flush=True)
        if arguments.part == "bench":
            results.append(run_bench(arguments, nvme))
            print(json.dumps(results[-1], indent=1), flush=True)
    finally:
        if made_here:
            shutil.rmtree(nvme, ignore_errors=True)
        if arguments.json:
            with open(arguments.json, "w") as file:
                json.dump(results, file, indent=1)
    return 1 if any(r["status"] == "failed" for r in results) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
