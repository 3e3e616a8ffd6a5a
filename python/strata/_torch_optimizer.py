"""strata.torch: the optimizer a user gets back from initialize(), and the
client optimizers it accepts.

The engine steps every parameter (its CPU kernels, its placement); the
returned ``StrataOptimizer`` is a torch.optim.Optimizer whose
``param_groups`` carry lr, weight_decay, betas and eps, so torch's and
Hugging Face's lr schedulers work on it. A group's weight decay becomes its
tensors' weight decay in the engine (per-tensor hyper-parameters); a
group's lr relative to the optimizer's base lr becomes their lr scale.
"""

import math
import numbers

import torch

from .errors import InvalidArgument, Unsupported

__all__ = ["StrataOptimizer", "optimizer_section_from_client"]


def optimizer_section_from_client(optimizer):
    """The config's "optimizer" section a client optimizer maps onto (the
    engine's CPU kernels), or TypeError / Unsupported naming what does not map."""
    from . import optim as strata_optim

    kind = type(optimizer)
    name = f"{kind.__module__}.{kind.__qualname__}"
    d = optimizer.defaults
    for flag in ("amsgrad", "maximize", "capturable", "differentiable"):
        if d.get(flag):
            raise Unsupported(f"the client optimizer {name} has {flag}=True; the engine's kernels do not do it")
    if kind in (torch.optim.AdamW, torch.optim.Adam):
        params = {"lr": d["lr"], "betas": list(d["betas"]), "eps": d["eps"], "weight_decay": d["weight_decay"]}
        if kind is torch.optim.Adam:
            return {"type": "Adam", "params": dict(params, adam_w_mode=False)}
        return {"type": "AdamW", "params": params}
    # isinstance: strata.torch.ops' DeepSpeed-named classes (DeepSpeedCPUAdam, FusedAdam, ...) derive from these.
    if isinstance(optimizer, strata_optim.CPUAdam):
        params = {"lr": d["lr"], "betas": list(d["betas"]), "eps": d["eps"], "weight_decay": d["weight_decay"],
                  "bias_correction": d["bias_correction"]}
        if optimizer._native_args[0] == "adamw":  # its kernel's kind (kept by copies, unlike .adamw_mode)
            return {"type": "AdamW", "params": params}
        return {"type": "Adam", "params": dict(params, adam_w_mode=False)}
    if kind is torch.optim.Adagrad or isinstance(optimizer, strata_optim.CPUAdagrad):
        if d.get("lr_decay", 0.0) or d.get("initial_accumulator_value", 0.0):
            raise Unsupported(f"the client optimizer {name} has lr_decay or initial_accumulator_value set; the "
                              f"engine's Adagrad has neither (use an lr scheduler for the decay)")
        return {"type": "Adagrad", "params": {"lr": d["lr"], "eps": d["eps"], "weight_decay": d["weight_decay"]}}
    if isinstance(optimizer, strata_optim.CPULion):
        return {"type": "Lion", "params": {"lr": d["lr"], "betas": list(d["betas"]),
                                            "weight_decay": d["weight_decay"]}}
    raise TypeError(f"the client optimizer {name} is not supported: strata.torch steps parameters with the engine's "
                    f"CPU kernels, which run torch.optim.AdamW, torch.optim.Adam, torch.optim.Adagrad, "
                    f"strata.optim.CPUAdam / CPUAdagrad / CPULion and DeepSpeed's DeepSpeedCPUAdam / FusedAdam / "
                    f"DeepSpeedCPUAdagrad / DeepSpeedCPULion / FusedLion (strata.torch.ops); pass one of those, or "
                    f"none and an \"optimizer\" section in the config")


class StrataOptimizer(torch.optim.Optimizer):
    """The engine's optimizer seen from torch: param_groups whose lr,
    weight_decay and betas the engine reads at each step. zero_grad() is a
    no-op (the engine owns the gradients); step() is engine.step()."""

    def __init__(self, param_groups, defaults, engine, shared_groups=None):
        super().__init__(param_groups, defaults)
        if shared_groups is not None:
            # A client optimizer's groups, shared: a scheduler built on the
            # client optimizer drives these same dicts.
            self.param_groups = shared_groups
        self._engine = engine
        # What the engine was created with, per group: its weight decay and lr scale are fixed per tensor.
        # (A scheduler built before us set each group's "initial_lr": the lr the ratios are taken from.)
        self._created = [(g["weight_decay"], g.get("initial_lr", g["lr"])) for g in self.param_groups]
        self.base_lr = defaults["lr"]
        if not self.base_lr > 0:
            raise ValueError(f"the optimizer's lr is {self.base_lr}: it must be > 0 (groups' lrs are scales of it)")

    def zero_grad(self, set_to_none=True):
        """Nothing to do: the engine zeroes its gradient buffers at each step."""

    def step(self, closure=None):
        if closure is not None:
            raise Unsupported("StrataOptimizer.step(closure): closures re-run the model; drive the steps with "
                              "engine(...), engine.backward(loss) and engine.step()")
        return self._engine._optimizer_step()

    # Under strata.torch.hf.StrataTrainer: accelerate moves an optimizer to its device by a state_dict round
    # trip, so there state_dict() is the param groups' hyper-parameters only (the Trainer's checkpoints go
    # through the engine). Elsewhere asking for it is an error: a caller saving it would lose the moments.
    _hyper_parameters_only_state = False

    def state_dict(self):
        if self._hyper_parameters_only_state:
            return {"state": {}, "param_groups": [{k: v for k, v in g.items() if k != "params"}
                                                  for g in self.param_groups]}
        raise Unsupported("the optimizer state lives in the engine (sharded, possibly on NVMe): save it with "
                          "engine.save_checkpoint(dir) and load it with engine.load_checkpoint(dir)")

    def load_state_dict(self, state_dict):
        if self._hyper_parameters_only_state and not state_dict.get("state") and \
                len(state_dict.get("param_groups", ())) == len(self.param_groups):
            for group, saved in zip(self.param_groups, state_dict["param_groups"]):
                group.update({k: v for k, v in saved.items() if k != "params"})  # in place: groups stay shared
            return
        raise Unsupported("the optimizer state lives in the engine: load it with engine.load_checkpoint(dir)")

    def add_param_group(self, param_group):
        if getattr(self, "_engine", None) is not None:
            raise Unsupported("add_param_group after initialize(): the engine's layers are fixed; pass every "
                              "parameter group to strata.torch.initialize")
        super().add_param_group(param_group)

    def step_lr(self):
        """The lr of the next step, as the groups say: one value for the
        engine's base lr, every group's lr keeping the ratio it had at
        creation (its tensors' lr scale). Anything else is refused by name."""
        base = None
        for i, (group, (decay, lr0)) in enumerate(zip(self.param_groups, self._created)):
            if group["weight_decay"] != decay:
                raise Unsupported(f"param_groups[{i}]['weight_decay'] changed from {decay} to "
                                  f"{group['weight_decay']}: a tensor's weight decay is fixed when the engine is made")
            if isinstance(group["lr"], bool) or not isinstance(group["lr"], numbers.Real) or \
                    not math.isfinite(group["lr"]) or group["lr"] < 0:
                raise InvalidArgument(f"param_groups[{i}]['lr'] is {group['lr']!r}: an lr must be a finite number "
                                      f">= 0 (set by the training loop or an lr scheduler)")
            scale = lr0 / self.base_lr
            lr = group["lr"] / scale
            if base is None:
                base = lr
            elif abs(lr - base) > 1e-12 * max(abs(base), 1e-30):
                raise Unsupported(f"param_groups[{i}]['lr'] is {group['lr']}, not {scale:g} x the first group's as "
                                  f"when the engine was made: groups' lrs keep their ratios")
        return base
