"""strata.torch.ops.adam: DeepSpeedCPUAdam and FusedAdam with DeepSpeed's
signatures, over strata.optim.CPUAdam (Strata's CPU kernels). adamw_mode /
adam_w_mode True is AdamW (decoupled weight decay), False Adam with L2
weight decay, as in DeepSpeed. FusedAdam is DeepSpeed's GPU kernel; here it
runs on the CPU like the rest (strata.torch trains on the cpu device)."""

from ... import optim as strata_optim
from .._names import refusing_getattr
from ._checked import MetaParametersForInitialize, refuse_16bit_states, refuse_amsgrad

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]

class DeepSpeedCPUAdam(MetaParametersForInitialize, strata_optim.CPUAdam):
    """deepspeed.ops.adam.DeepSpeedCPUAdam's arguments and behaviour."""

    def __init__(self, model_params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, weight_decay=0,
                 amsgrad=False, adamw_mode=True, fp32_optimizer_states=True):
        refuse_amsgrad("DeepSpeedCPUAdam", amsgrad)
        refuse_16bit_states("DeepSpeedCPUAdam", fp32_optimizer_states)
        super().__init__(model_params, lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                         weight_decay=weight_decay, adamw_mode=bool(adamw_mode))

class FusedAdam(MetaParametersForInitialize, strata_optim.CPUAdam):
    """deepspeed.ops.adam.FusedAdam's arguments (adam_w_mode, set_grad_none) over the CPU kernels."""

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, adam_w_mode=True,
                 weight_decay=0., amsgrad=False, set_grad_none=True):
        refuse_amsgrad("FusedAdam", amsgrad)
        super().__init__(params, lr=lr, bias_correction=bias_correction, betas=betas, eps=eps,
                         weight_decay=weight_decay, adamw_mode=bool(adam_w_mode))
        self.set_grad_none = bool(set_grad_none)

    def zero_grad(self, set_to_none=None):
        """DeepSpeed's FusedAdam: gradients set to None when set_grad_none (its constructor's), else zeroed."""
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)

__getattr__ = refusing_getattr(__name__, {
    "ZenFlowCPUAdam": "ZenFlow is not supported: use DeepSpeedCPUAdam (the engine overlaps its CPU update with "
                      "the next forward on its own)",
    "ZenFlowSelectiveAdamW": "ZenFlow is not supported: use DeepSpeedCPUAdam or FusedAdam",
    "ZenFlowSelectiveAdamW_stage3": "ZenFlow is not supported: use DeepSpeedCPUAdam or FusedAdam",
})
