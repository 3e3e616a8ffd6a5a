"""The peer on the GPU machine (issue 50 §2 item 3): DeepSpeed ZeRO-3 with the
optimizer and the parameters offloaded to host memory, on a Llama-shaped model
built from a config under zero.Init, random tokens, bf16. Prints one JSON
object (and writes it to --json): tokens/s and the median step time of the
timed steps, the model FLOP rate 6 x params x tokens/s, the losses, the device
and host peaks, and how long DeepSpeed's JIT took to build its CPU Adam.

Run by scripts/gpu-check.sh in the venv that scripts/gpu-peer-venv.sh makes;
one process, one GPU. DeepSpeed stays out of the project's dependencies.
"""
import argparse
import json
import os
import resource
import statistics
import sys
import time


def parse_arguments(argv):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--steps", type=int, default=6, help="timed steps")
    parser.add_argument("--json", help="also write the result here")
    arguments = parser.parse_args(argv)
    for name in ("hidden", "layers", "heads", "intermediate", "vocab", "seq", "batch", "steps"):
        if getattr(arguments, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(arguments, name)}")
    if arguments.warmup < 0:
        parser.error(f"--warmup must not be negative, got {arguments.warmup}")
    if arguments.hidden % arguments.heads:
        parser.error(f"--hidden {arguments.hidden} is not a multiple of --heads {arguments.heads}")
    return arguments


def deepspeed_config(batch):
    offload = {"device": "cpu", "pin_memory": True}
    return {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8,
                                                  "weight_decay": 0.0}},
        "zero_optimization": {"stage": 3, "offload_optimizer": offload, "offload_param": dict(offload),
                              "overlap_comm": True, "contiguous_gradients": True},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


def main(argv):
    arguments = parse_arguments(argv)
    for key, value in {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": "29517", "DS_ACCELERATOR": "cuda"}.items():
        os.environ.setdefault(key, value)
    import torch
    if not torch.cuda.is_available():
        return emit({"status": "skipped", "reason": "torch sees no GPU"}, arguments.json)
    import deepspeed
    import transformers

    config = deepspeed_config(arguments.batch)
    deepspeed.init_distributed(dist_backend="nccl")
    model_config = transformers.LlamaConfig(
        vocab_size=arguments.vocab, hidden_size=arguments.hidden, intermediate_size=arguments.intermediate,
        num_hidden_layers=arguments.layers, num_attention_heads=arguments.heads,
        num_key_value_heads=arguments.heads, max_position_embeddings=arguments.seq, attn_implementation="sdpa")
    with deepspeed.zero.Init(config_dict_or_path=config):
        model = transformers.LlamaForCausalLM(model_config)
    parameters = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())
    started = time.perf_counter()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    initialize_seconds = time.perf_counter() - started  # mostly the JIT build of CPU Adam

    generator = torch.Generator(device="cuda").manual_seed(0)
    tokens = torch.randint(0, arguments.vocab, (arguments.batch, arguments.seq), device="cuda", generator=generator)
    losses, step_seconds = [], []
    torch.cuda.reset_peak_memory_stats()
    for step in range(arguments.warmup + arguments.steps):
        torch.cuda.synchronize()
        started = time.perf_counter()
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        engine.step()
        torch.cuda.synchronize()
        if step >= arguments.warmup:
            step_seconds.append(time.perf_counter() - started)
        losses.append(round(float(loss), 5))
    median = statistics.median(step_seconds)
    tokens_per_step = arguments.batch * arguments.seq
    result = {
        "status": "ok",
        "peer": f"DeepSpeed {deepspeed.__version__} ZeRO-3, optimizer and parameters offloaded to cpu (pinned), bf16",
        "torch": torch.__version__, "transformers": transformers.__version__,
        "gpu": torch.cuda.get_device_name(0),
        "model": {"parameters": parameters, "hidden": arguments.hidden, "layers": arguments.layers,
                  "heads": arguments.heads, "intermediate": arguments.intermediate, "vocab": arguments.vocab},
        "batch": arguments.batch, "seq": arguments.seq, "warmup_steps": arguments.warmup,
        "timed_steps": len(step_seconds),
        "step_ms": {"median": round(median * 1e3, 1), "min": round(min(step_seconds) * 1e3, 1),
                    "max": round(max(step_seconds) * 1e3, 1)},
        "tokens_per_second": round(tokens_per_step / median, 1),
        "model_tflops": round(6 * parameters * tokens_per_step / median / 1e12, 2),
        "losses": losses,
        "device_peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        "host_peak_rss_gib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2),
        "initialize_seconds": round(initialize_seconds, 1),
    }
    return emit(result, arguments.json)


def emit(result, path):
    text = json.dumps(result, indent=1)
    print(text)
    if path:
        with open(path, "w") as file:
            file.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
