#!/usr/bin/env python3
"""Fine-tune any Hugging Face causal language model folder through Strata
(docs/torch.md, "A model too large to build whole" and "Architectures
tested"): the model is built on the meta device (st.init), its pretrained
weights are read one tensor at a time as each unit is handed to the engine
(initial_weights), ZeRO stage 3 keeps the optimizer state and the parameters
in pinned host memory (or on NVMe with --nvme DIR), Hugging Face's gradient
checkpointing recomputes each block in backward, and the result is exported
for from_pretrained.

    python examples/torch/finetune_causal_lm.py --pretrained DIR [--steps 10] [--nvme DIR] [--out DIR]
    python examples/torch/finetune_causal_lm.py            # no DIR: a tiny random Llama is saved and used

DIR is what save_pretrained writes (config.json and model.safetensors or its
sharded index), e.g. a downloaded Llama, Mistral, Qwen2 or GPT-NeoX. The toy
data are random token ids below the model's vocabulary size: put your own
tokenized batches in their place. Needs torch and transformers.
"""
import argparse
import os
import tempfile

import torch
import transformers

import strata.torch as st


def config(nvme):
    placement = {"device": "nvme", "nvme_path": nvme} if nvme else {"device": "cpu"}
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "weight_decay": 0.0}},
            "zero_optimization": {"stage": 3, "offload_optimizer": dict(placement), "offload_param": dict(placement)},
            "strata": {"device": "cpu"}}


def tiny_llama(folder):
    """A random 2-layer Llama saved as a pretrained folder (what --pretrained would name)."""
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128))
    model.save_pretrained(folder)
    return folder


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pretrained", help="a Hugging Face model folder (default: a tiny random Llama)")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seq", type=int, default=32, help="tokens per sample of the toy data")
    parser.add_argument("--nvme", help="put the optimizer state and the parameters in this folder (NVMe)")
    parser.add_argument("--out", help="folder for the exported model (default: a temporary one)")
    args = parser.parse_args()
    out = args.out or tempfile.mkdtemp(prefix="strata-finetune-")
    os.makedirs(out, exist_ok=True)
    pretrained = args.pretrained or tiny_llama(os.path.join(out, "pretrained"))

    model_config = transformers.AutoConfig.from_pretrained(pretrained)
    with st.init():  # parameters on meta: the model never exists whole (torch < 2: built in full, with a warning)
        model = transformers.AutoModelForCausalLM.from_config(model_config)
    parameters = sum(p.numel() for p in model.parameters())  # meta shapes; at stage 3 placeholders after initialize
    # Each block's forward runs again in backward (transformers 5 names it activation_checkpointing_enable).
    (getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable)()
    engine, _, _, _ = st.initialize(model=model, model_parameters=model.parameters(), config=config(args.nvme),
                                    initial_weights=pretrained)
    units = [u.name for u in engine._units if not u.is_root]
    print(f"{type(model).__name__}: {parameters / 1e6:.3f}M parameters in "
          f"{len(units)} units + the root; pretrained weights from {pretrained}")

    vocab = model_config.vocab_size
    data = torch.randint(0, vocab, (32, args.seq), generator=torch.Generator().manual_seed(1))  # a toy corpus
    engine.train()
    for micro in range(args.steps * engine.gradient_accumulation_steps()):
        ids = data[[(2 * micro + i) % len(data) for i in range(2)]]
        engine.backward(engine(input_ids=ids, labels=ids).loss)
        boundary = engine.is_gradient_accumulation_boundary()
        engine.step()
        if boundary:
            print(f"step {engine.global_steps}: loss {engine.metrics['loss']:.4f}")

    engine.export_hf(os.path.join(out, "model"))
    loaded = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(out, "model")).eval()
    engine.eval()
    with torch.no_grad():
        same = torch.equal(loaded(input_ids=data[:2]).logits, engine(input_ids=data[:2]).logits)
    print(f"exported to {os.path.join(out, 'model')}; from_pretrained gives the engine's logits: {same}")


if __name__ == "__main__":
    main()
