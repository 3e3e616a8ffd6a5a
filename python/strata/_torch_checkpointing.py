"""The settings and the checkpoint function behind strata.torch.checkpointing
(DeepSpeed's activation checkpointing API): a checkpoint's inputs optionally
in pinned host memory (activation_checkpointing.cpu_checkpointing; Note
[Activation checkpoints in host memory] in _torch_activation_offload.py).

Note [Where the checkpointing settings come from]
One value, CheckpointingSettings, decided once: configure(...) when the
script calls it (its arguments over the config it names, as DeepSpeed's),
else the activation_checkpointing section of the config initialize is
given, else off. A Hugging Face model's gradient checkpointing
(`gradient_checkpointing_enable()`) runs through `checkpoint` below when
cpu_checkpointing is on, so its blocks' inputs move too (both the
reentrant and the non-reentrant setting: see `checkpoint`)."""
import contextlib
import functools
import threading
import warnings

import torch

from . import config as strata_config
from ._checks import printable
from ._torch_activation_offload import cuda_offload, recorded_offload
from .errors import InvalidArgument, Unsupported

__all__ = ["configure", "configure_from_config", "is_configured", "settings", "reset", "checkpoint",
           "non_reentrant_checkpoint", "through_checkpoint", "CheckpointingSettings", "stats",
           "recorded_offload_for_tests"]

_BOOLEANS = ("partition_activations", "contiguous_memory_optimization", "cpu_checkpointing",
             "synchronize_checkpoint_boundary", "profile")


class CheckpointingSettings:
    """The activation_checkpointing values strata.torch acts on (Note [Where the checkpointing settings come from])."""

    def __init__(self, section, source):
        self.source = source  # "configure()" or "the config"
        for key in _BOOLEANS:
            setattr(self, key, bool(section.get(key) or False))
        self.number_checkpoints = section.get("number_checkpoints")

    def __repr__(self):
        on = [key for key in _BOOLEANS if getattr(self, key)]
        return f"CheckpointingSettings({', '.join(on) or 'nothing on'}; from {self.source})"


_lock = threading.Lock()
_settings = None          # CheckpointingSettings, once configured
_offloads = {}            # torch device -> ActivationOffload
_recorded = []            # the stand-in a test put in place (recorded_offload_for_tests)
_warned = set()


def configure(mpu_=None, deepspeed_config=None, partition_activations=None, contiguous_checkpointing=None,
              num_checkpoints=None, checkpoint_in_cpu=None, synchronize=None, profile=None):
    """DeepSpeed's configure: the config's activation_checkpointing section
    (deepspeed_config: a path or a dict, checked as initialize checks it),
    each argument given overriding its key. mpu_ may be None or a
    model-parallel unit of one rank: strata.torch is data-parallel only."""
    global _settings
    _refuse_model_parallelism(mpu_)
    section = {}
    if deepspeed_config is not None:
        section = dict(strata_config.load(deepspeed_config).get("activation_checkpointing") or {})
    given = {"partition_activations": partition_activations, "contiguous_memory_optimization": contiguous_checkpointing,
             "cpu_checkpointing": checkpoint_in_cpu, "synchronize_checkpoint_boundary": synchronize,
             "profile": profile}
    names = {"contiguous_memory_optimization": "contiguous_checkpointing", "cpu_checkpointing": "checkpoint_in_cpu",
             "synchronize_checkpoint_boundary": "synchronize"}
    for key, value in given.items():
        if value is None:
            continue
        if not isinstance(value, bool):
            raise InvalidArgument(f"configure({names.get(key, key)}={printable(repr(value))}): expected True or "
                                  f"False (the config's activation_checkpointing.{key})")
        section[key] = value
    if num_checkpoints is not None:
        if isinstance(num_checkpoints, bool) or not isinstance(num_checkpoints, int) or num_checkpoints < 1:
            raise InvalidArgument(f"configure(num_checkpoints={printable(repr(num_checkpoints))}): expected an "
                                  f"integer >= 1 (the config's activation_checkpointing.number_checkpoints)")
        section["number_checkpoints"] = num_checkpoints
    with _lock:
        _settings = CheckpointingSettings(section, "configure()")
    _warn_about_what_is_not_acted_on(_settings)


def configure_from_config(resolved):
    """initialize's part: the config's section, unless the script configured checkpointing itself."""
    global _settings
    section = resolved.get("activation_checkpointing")
    with _lock:
        if _settings is not None and _settings.source == "configure()":
            return
        _settings = CheckpointingSettings(section, "the config") if section is not None else None
    if _settings is not None:
        _warn_about_what_is_not_acted_on(_settings)


def is_configured():
    """True once configure() ran, or initialize was given a config with an activation_checkpointing section."""
    return _settings is not None


def settings():
    """The settings in force (off when nothing configured them)."""
    return _settings or CheckpointingSettings({}, "the defaults")


def reset():
    """Gives back the pinned host buffers the offloaded inputs used (DeepSpeed's reset frees its contiguous
    buffers); inputs still waiting for their backward keep theirs until it runs."""
    with _lock:
        _offloads.clear()


def stats():
    """Per device: bytes offloaded and fetched back, pinned buffers made and their bytes."""
    with _lock:
        return {str(device): offload.stats() for device, offload in _offloads.items()}


def checkpoint(function, *args):
    """DeepSpeed's checkpoint: `function(*args)` runs without keeping its
    activations, and again inside backward. Its inputs are kept for that
    recompute: on the GPU, in pinned host memory when cpu_checkpointing is
    on. Reentrant, as DeepSpeed's: gradients reach the function's parameters
    through the inputs, so when no input requires a gradient and the
    function is a module (or its method) with trainable parameters, an
    empty input that does is added, and its parameters still learn (torch's
    reentrant checkpoint would leave them without a gradient)."""
    current = settings()
    if current.synchronize_checkpoint_boundary:
        _synchronize(args)
    inputs = args
    if torch.is_grad_enabled() and not any(isinstance(a, torch.Tensor) and a.requires_grad for a in args) \
            and _has_trainable_parameters(function):
        run, inputs = _DroppingFirst(function), (torch.empty(0, requires_grad=True),) + tuple(args)
    else:
        run = function
    offload = _offload_for(args) if current.cpu_checkpointing else None
    with offload.hooks() if offload is not None else contextlib.nullcontext():
        outputs = torch.utils.checkpoint.checkpoint(run, *inputs, use_reentrant=True)
    if current.synchronize_checkpoint_boundary:
        _synchronize(args)
    return outputs


def non_reentrant_checkpoint(function, *args):
    """DeepSpeed's non_reentrant_checkpoint: torch's non-reentrant checkpoint. Its inputs are held by the
    recompute itself, so cpu_checkpointing cannot move them: use `checkpoint` for that (strata.torch warns
    once when cpu_checkpointing is on)."""
    if settings().cpu_checkpointing:
        _warn_once("non_reentrant", "cpu_checkpointing is on but non_reentrant_checkpoint keeps its inputs on the "
                                    "device (torch's recompute holds them): use deepspeed.checkpointing.checkpoint "
                                    "to keep them in host memory")
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)


def through_checkpoint(function, *args, **kwargs):
    """A Hugging Face model's `_gradient_checkpointing_func` while cpu_checkpointing is on: `checkpoint`.
    torch's keywords for its own checkpoint (use_reentrant, preserve_rng_state, ...) are dropped:
    `checkpoint` keeps the RNG state and is reentrant, with its inputs in host memory. The layer's keyword
    arguments (given here, or bound in a functools.partial as transformers 5 binds them) stay keywords; a
    keyword tensor that needs a gradient becomes one of the checkpoint's inputs, so its gradient flows
    through the checkpoint once, as with torch's non-reentrant checkpoint."""
    for key in ("use_reentrant", "preserve_rng_state", "determinism_check", "debug", "context_fn"):
        kwargs.pop(key, None)
    bound = {}
    if isinstance(function, functools.partial) and function.keywords:
        bound = dict(function.keywords)
        function = functools.partial(function.func, *function.args)
    bound.update(kwargs)
    if not bound:
        return checkpoint(function, *args)
    for key, value in bound.items():
        if not isinstance(value, torch.Tensor) and _holds_tensor_needing_grad(value):
            raise Unsupported(f"activation checkpoint with cpu_checkpointing: keyword '{printable(key)}' holds a "
                              f"tensor that needs a gradient inside a {type(value).__name__}: pass that tensor as "
                              f"a keyword of its own or positionally, or turn "
                              f"activation_checkpointing.cpu_checkpointing off")
    needing_grad = [key for key, value in bound.items() if isinstance(value, torch.Tensor) and value.requires_grad]
    keyed = _WithKeywords(function, bound, needing_grad, len(args))
    return checkpoint(keyed, *args, *[bound[key] for key in needing_grad])


def _holds_tensor_needing_grad(value, depth=0):
    if isinstance(value, torch.Tensor):
        return value.requires_grad
    if depth < 4 and isinstance(value, (tuple, list)):
        return any(_holds_tensor_needing_grad(v, depth + 1) for v in value)
    if depth < 4 and isinstance(value, dict):
        return any(_holds_tensor_needing_grad(v, depth + 1) for v in value.values())
    return False


class _DroppingFirst:
    """function(*rest): the empty input that makes backward run is not the function's."""

    def __init__(self, function):
        self.function = function

    def __call__(self, _grad_anchor, *args):
        return self.function(*args)


class _WithKeywords:
    """function(*positional, **keywords), called with the positional inputs followed by the keyword tensors
    that need a gradient (checkpoint inputs, so their gradients flow back through it)."""

    def __init__(self, function, keywords, needing_grad, positional):
        self.function, self.keywords = function, keywords
        self.needing_grad, self.positional = needing_grad, positional
        self.__self__ = getattr(function, "__self__", None)  # a unit's bound forward stays recognizable
        self.__name__ = getattr(function, "__name__", "")

    def __call__(self, *inputs):
        keywords = dict(self.keywords)
        keywords.update(zip(self.needing_grad, inputs[self.positional:]))
        return self.function(*inputs[:self.positional], **keywords)


def _has_trainable_parameters(function):
    """Whether `function` is a module, a module's method or a partial of one, with a parameter that requires
    a gradient (unknown callables: False, torch's rule)."""
    seen = 0
    while seen < 8:
        seen += 1
        if isinstance(function, torch.nn.Module):
            return any(p.requires_grad for p in function.parameters())
        inner = getattr(function, "func", None) or getattr(function, "function", None)
        owner = getattr(function, "__self__", None)
        bound = getattr(function, "args", None)  # functools.partial(forward, module, ...), as transformers 5 calls
        if isinstance(bound, tuple) and bound and isinstance(bound[0], torch.nn.Module):
            function = bound[0]
        elif isinstance(owner, torch.nn.Module):
            function = owner
        elif inner is not None:
            function = inner
        else:
            return False
    return False


def _offload_for(args):
    """The ActivationOffload of the device the inputs are on (None on the cpu device: already host memory)."""
    if _recorded:
        return _recorded[-1]
    device = _gpu_of(args)
    if device is None:
        return None
    with _lock:
        offload = _offloads.get(device)
        if offload is None:
            offload = _offloads[device] = cuda_offload(device)
        return offload


def _synchronize(args):
    if _recorded:
        _recorded[-1].copies.synchronize()
        return
    device = _gpu_of(args)
    if device is not None:
        torch.cuda.synchronize(device)


def _gpu_of(args):
    """The GPU of the first input on one (None: the inputs are in host memory already)."""
    return next((a.device for a in args if isinstance(a, torch.Tensor) and a.device.type == "cuda"), None)


def _refuse_model_parallelism(mpu):
    if mpu is None:
        return
    size = getattr(mpu, "get_model_parallel_world_size", None) or getattr(mpu, "get_tensor_model_parallel_world_size",
                                                                          None)
    if size is None:
        raise InvalidArgument(f"configure(mpu_={type(mpu).__name__}): it has no get_model_parallel_world_size() "
                              f"(or get_tensor_model_parallel_world_size()), so its model-parallel size is unknown; "
                              f"pass mpu_=None (strata.torch is data-parallel only)")
    if size() == 1:
        return
    raise Unsupported(f"configure(mpu_={type(mpu).__name__}): model parallelism is not supported, strata.torch is "
                      f"data-parallel ZeRO only; pass mpu_=None (activation partitioning across model-parallel "
                      f"ranks then has nothing to do)")


def _warn_about_what_is_not_acted_on(current):
    if current.partition_activations:
        _warn_once("partition_activations", "activation_checkpointing.partition_activations has no effect in "
                                            "strata.torch: it splits checkpoints across model-parallel ranks, and "
                                            "there are none (cpu_checkpointing works without it)")
    if current.contiguous_memory_optimization:
        _warn_once("contiguous", "activation_checkpointing.contiguous_memory_optimization has no effect in "
                                 "strata.torch: with cpu_checkpointing the host copies reuse pinned buffers by size "
                                 "class; nothing is copied into one device buffer")
    if current.profile:
        _warn_once("profile", "activation_checkpointing.profile: strata.torch does not print DeepSpeed's "
                              "per-checkpoint timers (engine.metrics has each step's forward and backward times)")


def _warn_once(key, message):
    if key not in _warned:
        _warned.add(key)
        warnings.warn(message, UserWarning, stacklevel=3)


@contextlib.contextmanager
def recorded_offload_for_tests():
    """Within the block, `checkpoint` offloads through the recorded stand-in on the cpu device (the cuda order
    played with clones and logged: `.copies.log`), which the block yields. For tests only."""
    offload = recorded_offload()
    _recorded.append(offload)
    try:
        yield offload
    finally:
        _recorded.remove(offload)
