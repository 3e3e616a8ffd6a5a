"""One rank of a strata.torch run, started by test_torch_ranks.py in one
process or under `mpirun -np N` (by test_torch_launchers.py also under
torchrun and the deepspeed launcher): trains TinyLM on a global micro-batch of
GLOBAL_MICRO samples split evenly over the ranks, and writes the step losses
and (rank 0) the master weights' sums to a JSON file (with --elementwise also
the masters themselves and plain torch's first-step gradients, OUT.json.pt).

    python torch_ranks_worker.py OUT.json --stage S [--optimizer cpu] [--params cpu] [--nvme DIR]
        [--steps N] [--first-step K] [--save DIR] [--load DIR] [--init] [--arch NAME] [--elementwise]
"""
import argparse
import copy
import json
import os

import torch

import strata.torch as st
from test_torch_frontend import SEQ, VOCAB, TinyLM

GLOBAL_MICRO = 8


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--stage", type=int, default=0)
    parser.add_argument("--optimizer", default="none")
    parser.add_argument("--params", default="none")
    parser.add_argument("--nvme", default=None)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--save", default=None)
    parser.add_argument("--load", default=None)
    parser.add_argument("--export", default=None, help="export_hf into this folder at the end")
    parser.add_argument("--modify-rank", type=int, default=None,
                        help="before training, GatheredParameters(blocks.1.fc.weight, modifier_rank=R): rank R halves "
                             "it, the other ranks zero it (R's values must win)")
    parser.add_argument("--init", action="store_true", help="build the model under st.init (on meta)")
    parser.add_argument("--arch", default=None,
                        help="a Hugging Face architecture of test_torch_hf_models.MODELS instead of TinyLM")
    parser.add_argument("--elementwise", action="store_true",
                        help="rank 0 also writes OUT.pt: the masters after the first step and at the end, "
                             "elementwise, and (world 1) plain torch's first-step gradients as one and as two ranks")
    args = parser.parse_args()

    # mpirun's variables, or a PyTorch launcher's (torchrun, the deepspeed launcher: test_torch_launchers.py)
    world = int(os.environ.get("OMPI_COMM_WORLD_SIZE") or os.environ.get("WORLD_SIZE") or "1")
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK") or os.environ.get("RANK") or "0")
    # Each rank builds the model from its own seed: rank 0's values are broadcast at initialize.
    torch.manual_seed(5 + 1000 * rank)
    if args.arch:
        import test_torch_hf_models as hf
        model = hf.make(args.arch, seed=5 + 1000 * rank)
    elif args.init:
        with st.init():
            model = TinyLM()
    else:
        model = TinyLM()
    zero = {"stage": args.stage, "offload_optimizer": {"device": args.optimizer},
            "offload_param": {"device": args.params}, "stage3_param_persistence_threshold": 0,
            "reduce_bucket_size": 100000}
    for section, device in (("offload_optimizer", args.optimizer), ("offload_param", args.params)):
        if device == "nvme":
            zero[section]["nvme_path"] = args.nvme  # every rank makes its own swap folder in it
    config = {"train_micro_batch_size_per_gpu": GLOBAL_MICRO // world, "gradient_accumulation_steps": 2,
              "train_batch_size": GLOBAL_MICRO * 2, "gradient_clipping": 1.0, "zero_optimization": zero,
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
              "strata": {"device": "cpu", "device_memory": "64MiB"}}
    reference_gradient = None
    if args.elementwise and world == 1 and not args.init and not args.load:
        reference_gradient = first_gradients(model, args.arch)
    engine, _, _, _ = st.initialize(model=model, model_parameters=model.parameters(), config=config)
    assert engine.world_size == world and engine.global_rank == rank, (engine.world_size, engine.global_rank)
    if args.modify_rank is not None:
        weight = model.blocks[1].fc.weight
        with st.GatheredParameters(weight, modifier_rank=args.modify_rank):
            if rank == args.modify_rank:
                weight.data.mul_(0.5)
            else:
                weight.data.zero_()
    first = 0
    if args.load:
        _, client = engine.load_checkpoint(args.load)
        first = client["next_batch"]
    losses = []
    index = first
    first_step = None
    for _ in range(args.steps * 2):
        loss = micro_batch_loss(engine, args.arch, index, rank, world)
        index += 1
        engine.backward(loss)
        boundary = engine.is_gradient_accumulation_boundary()
        engine.step()
        if boundary:
            losses.append(engine.metrics["loss"])
            if len(losses) == 1 and args.elementwise:
                first_step = engine.master_parameters()  # every rank (the gathers)
    if args.save:
        engine.save_checkpoint(args.save, client_state={"next_batch": index}, sync=True)
    if args.export:
        engine.export_hf(args.export)  # every rank (the gathers); rank 0 writes
    masters = engine.master_parameters()
    result = {"world": world, "rank": rank, "losses": losses,
              "masters": {name: float(t.double().sum()) for name, t in sorted(masters.items())}}
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(result, f)
        if args.elementwise:  # beside the JSON: OUT.pt
            torch.save({"first_step": first_step, "final": masters, "reference_gradient": reference_gradient},
                       args.out + ".pt")


def micro_batch_loss(model, arch, index, rank, world):
    """The loss of this rank's share of global micro-batch `index` (all of it at world 1)."""
    per_rank = GLOBAL_MICRO // world
    if arch:  # the global micro-batch: GLOBAL_MICRO samples of the architecture's batches
        import test_torch_hf_models as hf
        pieces = [hf.batch(arch, index * 16 + k) for k in range(GLOBAL_MICRO // hf.MICRO)]
        inputs = {key: torch.cat([p[key] for p in pieces])[rank * per_rank:(rank + 1) * per_rank]
                  for key in pieces[0]}
        return model(**inputs).loss
    g = torch.Generator().manual_seed(2000 + index)
    ids = torch.randint(0, VOCAB, (GLOBAL_MICRO, SEQ + 1), generator=g)[rank * per_rank:(rank + 1) * per_rank]
    logits = model(ids[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def first_gradients(model, arch):
    """Plain torch's gradients of the first step on copies of the initial
    model: {"one": one rank's (each micro-batch whole, scaled by 1/2 as
    engine.backward does), "two": two ranks' (each half scaled by 1/2, then
    the ranks' sums averaged)}. Where they differ is rounding, measured on
    this CPU: the test tells gradients from noise by it."""
    found = {}
    for world in (1, 2):
        reference = copy.deepcopy(model)
        for index in range(2):
            for rank in range(world):
                (micro_batch_loss(reference, arch, index, rank, world) / (2 * world)).backward()
        found["one" if world == 1 else "two"] = {name: p.grad.detach().clone()
                                                 for name, p in reference.named_parameters() if p.grad is not None}
    return found


if __name__ == "__main__":
    main()
