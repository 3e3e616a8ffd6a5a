"""strata.torch.ops.lion: DeepSpeedCPULion and FusedLion with DeepSpeed's
signatures and defaults (lr 1e-3, betas (0.9, 0.999)), over
strata.optim.CPULion (Strata's CPU kernels). FusedLion is DeepSpeed's GPU
kernel; here it runs on the CPU like the rest."""

from ... import optim as strata_optim
from .._names import refusing_getattr
from ._checked import MetaParametersForInitialize, refuse_16bit_states

__all__ = ["DeepSpeedCPULion", "FusedLion"]


class DeepSpeedCPULion(MetaParametersForInitialize, strata_optim.CPULion):
    """deepspeed.ops.lion.DeepSpeedCPULion's arguments and behaviour."""

    def __init__(self, model_params, lr=1e-3, betas=(0.9, 0.999), weight_decay=0, fp32_optimizer_states=True):
        refuse_16bit_states("DeepSpeedCPULion", fp32_optimizer_states)
        super().__init__(model_params, lr=lr, betas=betas, weight_decay=weight_decay)


class FusedLion(MetaParametersForInitialize, strata_optim.CPULion):
    """deepspeed.ops.lion.FusedLion's arguments (set_grad_none) over the CPU kernels."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), weight_decay=0., set_grad_none=True):
        super().__init__(params, lr=lr, betas=betas, weight_decay=weight_decay)
        self.set_grad_none = bool(set_grad_none)

    def zero_grad(self, set_to_none=None):
        """DeepSpeed's FusedLion: gradients set to None when set_grad_none (its constructor's), else zeroed."""
        super().zero_grad(set_to_none=self.set_grad_none if set_to_none is None else set_to_none)


__getattr__ = refusing_getattr(__name__, {})
