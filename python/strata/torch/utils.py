"""strata.torch.utils: DeepSpeed's deepspeed.utils names a training script
uses: the ZeRO-3 leaf-module flags (set_z3_leaf_modules: a flagged module
becomes one unit, acquired whole; strata/_torch_units.py), the rank-aware
logger (logger, log_dist) and RepeatingLoader."""

import logging
import os
import sys

import torch

from ._names import refusing_getattr

__all__ = ["set_z3_leaf_modules", "unset_z3_leaf_modules", "get_z3_leaf_modules", "z3_leaf_module",
           "set_z3_leaf_module", "set_z3_leaf_modules_by_name", "set_z3_leaf_modules_by_suffix", "logger", "log_dist",
           "RepeatingLoader"]


# -- ZeRO-3 leaf modules --------------------------------------------------------------------------
# DeepSpeed's flag (the attribute `_z3_leaf` on the module): strata.torch.initialize makes each flagged
# module a unit of its own, or keeps it inside the unit that holds it (split_into_units), so its
# parameters are acquired together when it runs, whatever order its children run in (a mixture of
# experts' routing).

def z3_leaf_module(module):
    """Whether `module` is flagged as a leaf."""
    return bool(getattr(module, "_z3_leaf", False))


def set_z3_leaf_module(module, flag):
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"set_z3_leaf_module(module, flag): module must be a torch.nn.Module, not "
                        f"{type(module).__name__}")
    module._z3_leaf = bool(flag)


def get_z3_leaf_modules(model):
    """The modules of `model` flagged as leaves."""
    return [m for m in model.modules() if z3_leaf_module(m)]


def _class_matches(module, kinds):
    kind = type(module)
    for wanted in kinds:
        if isinstance(wanted, type):
            if isinstance(module, wanted):
                return True
        elif kind.__name__ == wanted or f"{kind.__module__}.{kind.__qualname__}" == wanted:
            return True
    return False


def _flag_by_class(model, leaf_module_classes, flag, raise_if_not_found, caller):
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{caller}(model, ...): model must be a torch.nn.Module, not {type(model).__name__}")
    kinds = list(leaf_module_classes) if isinstance(leaf_module_classes, (list, tuple)) else [leaf_module_classes]
    for i, kind in enumerate(kinds):
        if not isinstance(kind, (type, str)):
            raise TypeError(f"{caller}: leaf_module_classes[{i}] is a {type(kind).__name__}; give module classes or "
                            f"their names (\"MixtralSparseMoeBlock\" or \"module.path.ClassName\")")
    found = [m for m in model.modules() if _class_matches(m, kinds)]
    for m in found:
        m._z3_leaf = flag
    if not found and raise_if_not_found:
        names = [k.__name__ if isinstance(k, type) else k for k in kinds]
        raise ValueError(f"{caller}: no module of {type(model).__name__} is of class {names}")
    return found


def set_z3_leaf_modules(model, leaf_module_classes, raise_if_not_found=True):
    """Flags every module of `model` of one of leaf_module_classes (classes,
    or class names, plain or with their module path) as a leaf: its
    parameters are acquired together, as one unit. Returns those modules;
    none found is a ValueError unless raise_if_not_found=False. Call it
    before strata.torch.initialize, which reads the flags."""
    return _flag_by_class(model, leaf_module_classes, True, raise_if_not_found, "set_z3_leaf_modules")


def unset_z3_leaf_modules(model, leaf_module_classes, raise_if_not_found=True):
    """Clears the leaf flag of the modules of those classes."""
    return _flag_by_class(model, leaf_module_classes, False, raise_if_not_found, "unset_z3_leaf_modules")


def _flag_by_names(model, names, flag, raise_if_not_found, matches, caller):
    modules = dict(model.named_modules())
    found, missing = [], []
    for wanted in names:
        hits = [m for name, m in modules.items() if matches(name, wanted)]
        if not hits:
            missing.append(wanted)
        for m in hits:
            m._z3_leaf = flag
            if all(m is not f for f in found):
                found.append(m)
    if missing and raise_if_not_found:
        raise ValueError(f"{caller}: no module of {type(model).__name__} matches {missing}")
    return found, missing


def set_z3_leaf_modules_by_name(model, module_names, flag=True, raise_if_not_found=True):
    """Sets the leaf flag of the modules named (named_modules() names). Returns (modules, names not found)."""
    return _flag_by_names(model, module_names, flag, raise_if_not_found, lambda name, wanted: name == wanted,
                          "set_z3_leaf_modules_by_name")


def set_z3_leaf_modules_by_suffix(model, module_name_suffixes, flag=True, raise_if_not_found=True):
    """Sets the leaf flag of the modules whose names end with one of the suffixes. Returns (modules, suffixes
    not found)."""
    return _flag_by_names(model, module_name_suffixes, flag, raise_if_not_found,
                          lambda name, wanted: name.endswith(wanted), "set_z3_leaf_modules_by_suffix")


# -- logging ----------------------------------------------------------------------------------------
class _StdoutHandler(logging.StreamHandler):
    """Writes to the sys.stdout of the moment (a script or test may replace it after import)."""

    def emit(self, record):
        self.stream = sys.stdout
        super().emit(record)


logger = logging.getLogger("strata.torch")
if not logger.handlers:
    _handler = _StdoutHandler(sys.stdout)
    _handler.setFormatter(logging.Formatter("[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d:%(funcName)s] "
                                            "%(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def _launcher_rank_and_world():
    """(rank, world size) of this process: torch.distributed's when it is initialized, else the launcher's
    variables (torchrun's RANK / WORLD_SIZE, mpirun's OMPI_COMM_WORLD_* / PMI_*), else (0, 1)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank(), torch.distributed.get_world_size()
    for rank_name, world_name in (("RANK", "WORLD_SIZE"), ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
                                  ("PMI_RANK", "PMI_SIZE")):
        rank, world = os.environ.get(rank_name), os.environ.get(world_name)
        if rank is not None and world is not None and rank.isdigit() and world.isdigit():
            return int(rank), int(world)
    return 0, 1


def log_dist(message, ranks=None, level=logging.INFO):
    """DeepSpeed's log_dist: logs `message` prefixed with the rank, on the
    ranks listed (-1 first: every rank); in one process, always."""
    rank, world = _launcher_rank_and_world()
    ranks = list(ranks or [])
    if world == 1 or (ranks and (ranks[0] == -1 or rank in ranks)):
        logger.log(level, f"[Rank {rank if world > 1 else -1}] {message}")


class RepeatingLoader:
    """Iterates a loader again and again: a new pass starts when one ends (DeepSpeed's RepeatingLoader)."""

    def __init__(self, loader):
        self.loader = loader
        self._iterator = iter(loader)

    def __iter__(self):
        return self

    def __next__(self):
        try:
            return next(self._iterator)
        except StopIteration:
            self._iterator = iter(self.loader)
            return next(self._iterator)


__getattr__ = refusing_getattr(__name__, {
    "safe_get_full_fp32_param": "engine.master_parameters()[name] gives every trainable parameter's fp32 master "
                                "weights, gathered whole",
    "safe_get_local_fp32_param": "engine.master_parameters()[name] gives every trainable parameter's fp32 master "
                                 "weights, gathered whole",
    "safe_get_full_grad": "gradients live in the engine's buffers during backward only; not supported",
    "safe_get_full_optimizer_state": "the optimizer state lives in the engine (engine.save_checkpoint writes it); "
                                     "not supported",
    "safe_set_full_fp32_param": "change parameters before the first step with "
                                "strata.torch.zero.GatheredParameters(params, modifier_rank=0)",
    "safe_set_full_optimizer_state": "the optimizer state is the engine's; load one with engine.load_checkpoint",
    "OnDevice": "build the model under strata.torch.zero.Init() (strata.torch.init), which puts its parameters "
                "on the meta device",
    "groups": "model, expert and sequence parallel groups are not supported: strata.torch is data-parallel ZeRO",
    "z3_leaf_parameter": "use z3_leaf_module(module) on the module that holds the parameter",
    "log_dist_once": "use log_dist",
    "instrument_w_nvtx": "not supported: strata.torch runs on the cpu device",
    "get_numactl_cmd": "not supported: launch with torchrun or mpirun and pin processes with their own options",
})
