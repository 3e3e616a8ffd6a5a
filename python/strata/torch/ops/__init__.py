"""strata.torch.ops: DeepSpeed's optimizer classes (deepspeed.ops.adam,
.adagrad, .lion) under their names and arguments, running Strata's CPU
kernels (strata.optim). Given to strata.torch.initialize as the client
optimizer, their hyper-parameters and param groups become the engine's
(_torch_optimizer.optimizer_section_from_client); used on their own they
step CPU fp32 parameters as strata.optim does."""

from .._names import refusing_getattr
from . import adagrad, adam, lion

__all__ = ["adam", "adagrad", "lion"]

__getattr__ = refusing_getattr(__name__, {
    "lamb": "LAMB is not supported: the engine runs Adam/AdamW, Adagrad and Lion (strata.torch.ops.adam, "
            ".adagrad, .lion)",
    "transformer": "DeepSpeed's fused transformer kernels are not supported: strata.torch runs the model's own "
                   "modules",
    "sparse_attention": "sparse attention kernels are not supported: strata.torch runs the model's own modules",
    "fp_quantizer": "the fp quantizer kernels are not supported",
    "DeepSpeedTransformerLayer": "DeepSpeed's fused transformer kernels are not supported",
    "DeepSpeedTransformerConfig": "DeepSpeed's fused transformer kernels are not supported",
    "op_builder": "strata.torch builds no ops at run time: its kernels are in strata._native",
})
