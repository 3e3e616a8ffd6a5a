"""strata.torch: DeepSpeed's names that strata.torch does not provide, refused
by name (Note [DeepSpeed names not provided]).

Note [DeepSpeed names not provided]
A DeepSpeed script ports by its import lines alone (docs/torch.md, "Porting
a DeepSpeed script"), so every namespace under strata.torch that stands for
one of DeepSpeed's (strata.torch itself, .accelerator, .ops.*, .utils,
.zero, .runtime.*) answers a name it lacks with NotProvided: the DeepSpeed
name, the Strata equivalent or "not supported", and where the provided names
are listed, never Python's AttributeError with a "did you mean" that points
at an unrelated name. NotProvided is an ImportError, so `from
strata.torch.ops.adam import X` raises it as it is (Python turns an
AttributeError from a module's __getattr__ into a bare "cannot import name")
and a script's `try: ... except ImportError:` fallback still runs. A missing
module (`import strata.torch.pipe`) gets the same kind of answer from a
finder placed last on sys.meta_path, consulted only when no other finder
found the module.
"""

import importlib.abc
import sys

from ..errors import Unsupported

__all__ = ["NotProvided", "ModuleNotProvided", "refusing_getattr", "install_module_finder"]

_GUIDE = "docs/torch.md, \"Porting a DeepSpeed script\", lists the DeepSpeed names strata.torch provides"


class NotProvided(Unsupported, ImportError):
    """A DeepSpeed name strata.torch does not provide; the message names the Strata equivalent or says it is
    not supported."""


class ModuleNotProvided(NotProvided, ModuleNotFoundError):
    """A DeepSpeed module strata.torch does not provide."""


def _message(namespace, name, equivalents, deepspeed_namespace):
    deepspeed_name = f"{deepspeed_namespace}.{name}"
    hint = equivalents.get(name)
    if hint is None:
        return (f"{namespace}.{name} (DeepSpeed's {deepspeed_name}) is not provided: strata.torch does not support "
                f"it ({_GUIDE})")
    return f"{namespace}.{name} (DeepSpeed's {deepspeed_name}): {hint} ({_GUIDE})"


def refusing_getattr(namespace, equivalents, deepspeed_namespace=None, lazy_modules=()):
    """A module-level __getattr__ for `namespace`: submodules named in
    lazy_modules are imported on first use; any other name raises
    NotProvided with its entry in equivalents ({name: what to use instead})
    or "not supported". Names starting with "_" (none of DeepSpeed's public
    ones does) raise AttributeError, as tools that probe modules (pickle,
    inspect, pytest) expect."""
    deepspeed_namespace = deepspeed_namespace or namespace.replace("strata.torch", "deepspeed", 1)

    def __getattr__(name):
        if name.startswith("_"):
            raise AttributeError(f"module '{namespace}' has no attribute '{name}'")
        if name in lazy_modules:
            return importlib.import_module(f"{namespace}.{name}")
        raise NotProvided(_message(namespace, name, equivalents, deepspeed_namespace))

    return __getattr__


# DeepSpeed modules a script may import, with what to use under strata.torch.
_MODULE_EQUIVALENTS = {
    "runtime.engine": "the engine is strata.torch.StrataEngine (what strata.torch.initialize returns)",
    "runtime.zero": "use strata.torch.zero (Init, GatheredParameters, ZeroParamStatus)",
    "runtime.config": "strata.config.load(config) checks and resolves a DeepSpeed config",
    "runtime.pipe": "pipeline parallelism is not supported: strata.torch is data-parallel ZeRO",
    "pipe": "pipeline parallelism is not supported: strata.torch is data-parallel ZeRO",
    "moe": "mixture-of-experts layers are not supported: strata.torch is data-parallel ZeRO",
    "inference": "DeepSpeed's inference engine is not supported: run the trained module under torch.no_grad()",
    "module_inject": "kernel injection is not supported: strata.torch runs the model's own modules",
    "launcher": "launch with torchrun or mpirun (docs/torch.md, \"Several ranks\")",
    "profiling": "engine.metrics has each step's times and bytes",
    "monitor": "engine.metrics has each step's loss, lr, grad norm and times",
    "autotuning": "strata.torch.initialize(..., fit={...}) fits the config to memory caps",
    "compression": "compression is not supported",
    "sequence": "sequence parallelism is not supported: strata.torch is data-parallel ZeRO",
}


class _MissingModuleFinder(importlib.abc.MetaPathFinder):
    """Last on sys.meta_path: a strata.torch.X module no other finder found
    is refused with what to use instead (Note [DeepSpeed names not provided])."""

    def find_spec(self, fullname, path=None, target=None):
        prefix = "strata.torch."
        if not fullname.startswith(prefix):
            return None
        relative = fullname[len(prefix):]
        hint = next((text for name, text in _MODULE_EQUIVALENTS.items()
                     if relative == name or relative.startswith(name + ".")), None)
        deepspeed_name = "deepspeed." + relative
        if hint is None:
            raise ModuleNotProvided(f"module {fullname} (DeepSpeed's {deepspeed_name}) is not provided: strata.torch "
                                    f"does not support it ({_GUIDE})")
        raise ModuleNotProvided(f"module {fullname} (DeepSpeed's {deepspeed_name}): {hint} ({_GUIDE})")


def install_module_finder():
    if not any(isinstance(finder, _MissingModuleFinder) for finder in sys.meta_path):
        sys.meta_path.append(_MissingModuleFinder())
