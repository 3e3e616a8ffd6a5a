"""strata.torch.runtime: the parts of deepspeed.runtime a training script
imports: lr_schedules (DeepSpeed's schedules), dataloader
(RepeatingLoader), zero (strata.torch.zero), activation_checkpointing
(its checkpointing is strata.torch.checkpointing)."""

import importlib

from .._names import refusing_getattr

__all__ = ["lr_schedules", "dataloader", "zero", "activation_checkpointing"]

_refusal = refusing_getattr(__name__, {
    "engine": "the engine is strata.torch.StrataEngine (what strata.torch.initialize returns)",
    "config": "strata.config.load(config) checks and resolves a DeepSpeed config",
    "pipe": "pipeline parallelism is not supported: strata.torch is data-parallel ZeRO",
    "utils": "see strata.torch.utils",
    "fp16": "the loss scaler is the engine's (the config's fp16 section)",
    "bf16_optimizer": "bf16 training is the config's bf16 section",
}, lazy_modules=("lr_schedules", "dataloader", "activation_checkpointing"))


def __getattr__(name):
    if name == "zero":  # deepspeed.runtime.zero is deepspeed.zero
        return importlib.import_module("strata.torch.zero")
    return _refusal(name)
