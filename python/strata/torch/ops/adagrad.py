"""strata.torch.ops.adagrad: DeepSpeedCPUAdagrad with DeepSpeed's signature,
over strata.optim.CPUAdagrad (Strata's CPU kernels)."""

from ... import optim as strata_optim
from .._names import refusing_getattr
from ._checked import MetaParametersForInitialize, refuse_16bit_states, refuse_amsgrad

__all__ = ["DeepSpeedCPUAdagrad"]


class DeepSpeedCPUAdagrad(MetaParametersForInitialize, strata_optim.CPUAdagrad):
    """deepspeed.ops.adagrad.DeepSpeedCPUAdagrad's arguments and behaviour."""

    def __init__(self, model_params, lr=1e-2, eps=1e-10, weight_decay=0, amsgrad=False, fp32_optimizer_states=True):
        refuse_amsgrad("DeepSpeedCPUAdagrad", amsgrad)
        refuse_16bit_states("DeepSpeedCPUAdagrad", fp32_optimizer_states)
        super().__init__(model_params, lr=lr, eps=eps, weight_decay=weight_decay)


__getattr__ = refusing_getattr(__name__, {})
