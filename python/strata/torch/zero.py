"""strata.torch.zero: DeepSpeed's deepspeed.zero names a training script
uses: Init (strata.torch.init: parameters built on the meta device,
materialized unit by unit by initialize), GatheredParameters (parameters
whole between steps) and ZeroParamStatus / ZeroParamType, the values of the
stage-3 parameters' ds_status (docs/torch.md, "Porting a DeepSpeed script")."""

from enum import Enum

from .._torch_gathered import GatheredParameters
from .._torch_init import init as Init
from ._names import refusing_getattr

__all__ = ["Init", "GatheredParameters", "ZeroParamStatus", "ZeroParamType"]


class ZeroParamType(Enum):
    NORMAL = 1       # a whole parameter
    PARTITIONED = 2  # split across the data-parallel ranks (stage 3)
    REMOTE = 3


class ZeroParamStatus(Enum):
    AVAILABLE = 1      # whole: its unit is acquired (or a GatheredParameters block holds it)
    NOT_AVAILABLE = 2  # an empty placeholder: the engine holds it, partitioned
    INFLIGHT = 3       # being gathered (the engine gathers inside acquire: never seen from Python)


__getattr__ = refusing_getattr(__name__, {
    "register_external_parameter": "a parameter used outside its module is acquired where its unit is: declare "
                                   "units so the module that uses it owns it (initialize(units=...)) or leave it to "
                                   "the root unit",
    "unregister_external_parameter": "see register_external_parameter: units decide where parameters are acquired",
    "MiCS_Init": "MiCS is not supported: use strata.torch.zero.Init",
    "TiledLinear": "tiled linear layers are not supported: declare finer units (initialize(units=...))",
    "TiledLinearReturnBias": "tiled linear layers are not supported: declare finer units (initialize(units=...))",
    "DeepSpeedZeRoOffload": "the engine offloads as the config's zero_optimization section says",
    "unwrap_model_for_generation": "engine.module.generate(...) runs as it is under torch.no_grad(): the engine "
                                   "acquires each unit as it runs",
    "DeepSpeedTensorOverride": "not supported",
})
