"""A small training script written for DeepSpeed, the way DeepSpeedExamples
write theirs: DeepSpeed's imports, its argument parser, a client
DeepSpeedCPUAdam and WarmupLR, the training_data loader initialize builds,
the accelerator for devices and seeds, DeepSpeed's parameter-count idiom,
and checkpoints it resumes from. It does not run as it is (DeepSpeed is not
installed here): test_torch_deepspeed_port.py changes its import lines by
the port rule (docs/torch.md, "Porting a DeepSpeed script") and runs the
result under strata.torch. Each optimizer step prints one JSON line.

    python deepspeed_style_train.py --deepspeed --deepspeed_config ds.json --steps 8 --ckpt DIR
"""
import argparse
import json

import torch
import deepspeed
from deepspeed.accelerator import get_accelerator
from deepspeed.ops.adam import DeepSpeedCPUAdam
from deepspeed.runtime.lr_schedules import WarmupLR
from deepspeed.utils import log_dist, set_z3_leaf_modules

FEATURES, CLASSES, SAMPLES = 16, 4, 96


class Block(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 2 * width)
        self.down = torch.nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(FEATURES, 32)
        self.blocks = torch.nn.ModuleList([Block(32) for _ in range(2)])
        self.head = torch.nn.Linear(32, CLASSES)

    def forward(self, x):
        x = self.embed(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make_dataset():
    g = torch.Generator().manual_seed(7)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    y = torch.randint(0, CLASSES, (SAMPLES,), generator=g)
    return torch.utils.data.TensorDataset(x, y)


def main():
    parser = argparse.ArgumentParser(description="a DeepSpeed-style training script")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--ckpt", default=None)
    parser.add_argument("--local_rank", type=int, default=-1)
    parser = deepspeed.add_config_arguments(parser)
    args = parser.parse_args()

    get_accelerator().manual_seed(0)
    torch.manual_seed(0)
    model = Net()
    set_z3_leaf_modules(model, [Block])
    optimizer = DeepSpeedCPUAdam(model.parameters(), lr=1e-3, weight_decay=0.01)
    scheduler = WarmupLR(optimizer, warmup_min_lr=1e-4, warmup_max_lr=1e-3, warmup_num_steps=4,
                         warmup_type="linear")
    engine, optimizer, loader, scheduler = deepspeed.initialize(args=args, model=model, optimizer=optimizer,
                                                                lr_scheduler=scheduler, training_data=make_dataset())
    size = sum(p.ds_numel if hasattr(p, "ds_id") else p.numel() for p in model.parameters())
    log_dist(f"model size: {size} parameters", ranks=[0])
    print(json.dumps({"model_size": size, "local_rank": args.local_rank, "device": str(engine.device)}), flush=True)

    start = 0
    if args.ckpt:
        load_path, client_state = engine.load_checkpoint(args.ckpt)
        if load_path is not None:
            start = client_state["step"]
        print(json.dumps({"loaded": load_path, "client_state": client_state}), flush=True)

    device = get_accelerator().device_name(engine.local_rank)
    step = start
    for x, y in loader:
        if step == start + args.steps:
            break
        x, y = x.to(device), y.to(device)
        loss = torch.nn.functional.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
        step += 1
        norm = engine.get_global_grad_norm()  # DeepSpeed gives a tensor at some stages
        print(json.dumps({"step": step, "loss": loss.item(), "lr": scheduler.get_last_lr()[0],
                          "grad_norm": None if norm is None else float(norm)}), flush=True)
        get_accelerator().synchronize()
    if args.ckpt:
        engine.save_checkpoint(args.ckpt, tag="latest_run", client_state={"step": step})
    print(json.dumps({"max_memory_allocated": get_accelerator().max_memory_allocated()}), flush=True)


if __name__ == "__main__":
    main()
