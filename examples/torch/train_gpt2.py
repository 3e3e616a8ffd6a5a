#!/usr/bin/env python3
"""A Hugging Face GPT-2 trained through Strata with DeepSpeed's API
(docs/torch.md). ZeRO stage 3 with the optimizer state and the parameters
offloaded (cpu, or nvme with --nvme DIR), a Hugging Face-style config whose
"auto" values are filled in, a checkpoint, and the model exported for
from_pretrained.

    python examples/torch/train_gpt2.py [--steps 20] [--nvme DIR] [--out DIR]
    torchrun --nproc_per_node 2 examples/torch/train_gpt2.py    # two data-parallel ranks
    mpirun -np 2 python examples/torch/train_gpt2.py            # the same under MPI

Needs torch and transformers (python/test.sh sets up a venv with both).
"""
import argparse
import os
import tempfile

import torch
import transformers

import strata.torch as st

CONFIG = {  # Hugging Face's ZeRO-3 shape: the Trainer (or auto_values) fills the "auto"s
    "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"},
                          "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto"},
    "strata": {"device": "cpu", "device_memory": "256MiB"},
}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--nvme", help="put the optimizer state and the parameters in this folder (NVMe)")
    parser.add_argument("--out", help="folder for the checkpoint and the exported model (default: a temporary one)")
    args = parser.parse_args()
    if args.nvme:
        for section in ("offload_optimizer", "offload_param"):
            CONFIG["zero_optimization"][section] = {"device": "nvme", "nvme_path": args.nvme}

    torch.manual_seed(0)
    gpt2 = transformers.GPT2Config(vocab_size=512, n_positions=64, n_embd=64, n_layer=4, n_head=4)
    model = transformers.GPT2LMHeadModel(gpt2)
    engine, optimizer, _, _ = st.initialize(
        model=model, model_parameters=model.parameters(), config=CONFIG,
        auto_values={"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
                     "gradient_clipping": 1.0, "optimizer.params.lr": 3e-3, "optimizer.params.weight_decay": 0.01})
    rank, world = engine.global_rank, engine.world_size
    out = shared_folder(args.out, rank, world)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 5))
    engine.lr_scheduler = scheduler  # a torch scheduler drives the lr the engine steps with

    data = torch.randint(0, 512, (64, 33), generator=torch.Generator().manual_seed(1))  # a toy corpus
    engine.train()
    for step in range(args.steps * engine.gradient_accumulation_steps()):
        rows = [(4 * (step * world + rank) + i) % len(data) for i in range(4)]  # each rank its own samples
        ids = data[rows]
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        boundary = engine.is_gradient_accumulation_boundary()  # this micro-batch ends a step
        engine.step()
        if boundary and rank == 0 and engine.global_steps % 5 == 0:
            print(f"step {engine.global_steps}: loss {engine.metrics['loss']:.3f}, lr {engine.get_lr()[0]:.2e}")

    engine.save_checkpoint(os.path.join(out, "ckpt"), client_state={"steps": args.steps}, sync=True)
    engine.export_hf(os.path.join(out, "model"))
    if rank == 0:
        loaded = transformers.GPT2LMHeadModel.from_pretrained(os.path.join(out, "model")).eval()
        engine.eval()
        with torch.no_grad():
            same = torch.equal(loaded(input_ids=data[:2]).logits, engine(input_ids=data[:2]).logits)
        print(f"exported to {os.path.join(out, 'model')}; from_pretrained gives the engine's logits: {same}")
    else:
        engine.eval()
        with torch.no_grad():
            engine(input_ids=data[:2])  # every rank runs the evaluation (stage-3 gathers are collectives)


def shared_folder(given, rank, world):
    """--out, else a temporary folder that rank 0 makes and tells the other
    ranks: the checkpoint and the export need one folder every rank sees."""
    if given:
        os.makedirs(given, exist_ok=True)
        return given
    name = tempfile.mkdtemp(prefix="strata-gpt2-") if rank == 0 else ""
    if world > 1:  # DeepSpeed's comm names (strata.torch.comm) over the engine's job
        encoded = torch.zeros(4096, dtype=torch.uint8)
        encoded[:len(name)] = torch.tensor(list(name.encode()), dtype=torch.uint8)
        st.comm.broadcast(encoded, src=0)
        name = bytes(encoded[encoded != 0].tolist()).decode()
    return name


if __name__ == "__main__":
    main()
