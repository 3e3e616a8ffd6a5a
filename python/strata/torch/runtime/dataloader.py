"""strata.torch.runtime.dataloader: DeepSpeed's RepeatingLoader. The loader
DeepSpeed builds from training_data is what strata.torch.initialize returns
third (a torch DataLoader over DeepSpeed's DistributedSampler)."""

from .._names import refusing_getattr
from ..utils import RepeatingLoader

__all__ = ["RepeatingLoader"]

__getattr__ = refusing_getattr(__name__, {
    "DeepSpeedDataLoader": "strata.torch.initialize(training_data=dataset) returns the loader DeepSpeed builds "
                           "(third in its tuple)",
})
