"""strata.torch.runtime.activation_checkpointing: where DeepSpeed keeps its
activation checkpointing; `from deepspeed.runtime.activation_checkpointing
import checkpointing` gives strata.torch.checkpointing."""

from .. import checkpointing

__all__ = ["checkpointing"]
