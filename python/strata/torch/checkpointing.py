"""strata.torch.checkpointing: DeepSpeed's activation checkpointing API
(deepspeed.checkpointing), with the inputs a checkpoint keeps optionally in
pinned host memory (the config's activation_checkpointing.cpu_checkpointing).
How it works: python/strata/_torch_checkpointing.py and Note [Activation
checkpoints in host memory] in python/strata/_torch_activation_offload.py.

    import strata.torch as deepspeed
    deepspeed.checkpointing.configure(None, deepspeed_config="ds.json")   # or: the config given to initialize
    x = deepspeed.checkpointing.checkpoint(block, x)
"""
from .._torch_checkpointing import (CheckpointingSettings, checkpoint, configure, is_configured,
                                    non_reentrant_checkpoint, reset, settings, stats)
from ._names import refusing_getattr

__all__ = ["configure", "is_configured", "reset", "checkpoint", "non_reentrant_checkpoint", "CheckpointingSettings",
           "settings", "stats"]

__getattr__ = refusing_getattr(__name__, {
    "get_cuda_rng_tracker": "model-parallel RNG tracking is Megatron's: strata.torch is data-parallel, and "
                            "checkpoint keeps torch's RNG state for the recompute",
    "model_parallel_cuda_manual_seed": "model-parallel seeds are Megatron's: use torch.manual_seed",
    "model_parallel_reconfigure_tp_seed": "model-parallel seeds are Megatron's: use torch.manual_seed",
    "partition_activations_in_checkpoint": "activation partitioning needs model-parallel ranks, which strata.torch "
                                           "does not have",
    "set_num_layers": "number_checkpoints goes in the config's activation_checkpointing section",
}, deepspeed_namespace="deepspeed.checkpointing")
