"""The shared part of strata.torch.ops' optimizers: DeepSpeed's flags
checked by name, and parameters built under strata.torch.init /
zero.Init (on the meta device) accepted for initialize."""


def refuse_amsgrad(name, amsgrad):
    if amsgrad:
        raise ValueError(f"{name}(amsgrad=True): AMSGrad is not supported by the engine's kernels; "
                         f"use amsgrad=False")


def refuse_16bit_states(name, fp32_optimizer_states):
    if not fp32_optimizer_states:
        raise ValueError(f"{name}(fp32_optimizer_states=False): strata keeps fp32 master weights; for 16-bit "
                         f"moments set \"strata\": {{\"optimizer_state_dtype\": \"bf16\"}} in the config (or "
                         f"moment_dtype=torch.bfloat16 on strata.optim's classes)")


class MetaParametersForInitialize:
    """A mixin: parameters on the meta device (a model built under
    strata.torch.init / zero.Init) are accepted, as DeepSpeed's optimizers
    accept ZeRO-3's partitioned ones, since initialize only reads the
    optimizer's groups and hyper-parameters; stepping them is refused."""

    def _check_param(self, p, what):
        if p.device.type != "meta":
            super()._check_param(p, what)

    def step(self, closure=None, **kwargs):
        for gi, group in enumerate(self.param_groups):
            if any(p.device.type == "meta" for p in group["params"]):
                raise ValueError(f"{type(self).__name__}.step(): param group {gi} holds parameters on the meta device "
                                 f"(built under strata.torch.init): give the optimizer to strata.torch.initialize, "
                                 f"whose engine steps them")
        return super().step(closure, **kwargs)
