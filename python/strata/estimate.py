"""strata.estimate: memory per GPU, per node (host) and on NVMe for every
ZeRO stage and offload placement, from the same estimator as
`strata estimate` (docs/estimate.md)."""

import json
import math
import numbers
import operator
import os

from . import _native
from ._checks import check_int, check_path
from .errors import InvalidArgument

__all__ = ["estimate"]


def _text(value, what):
    """A count or size as the native parser's text (an int, a float or text
    such as "7B" / "80GB"); a bool, a non-finite float or a control
    character is refused here, naming the argument."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise TypeError(f"{what} must be a number or text such as \"7B\" / \"80GB\", not a bool ({value!r})")
    if isinstance(value, numbers.Integral):  # numpy integers too
        return str(operator.index(value))
    if isinstance(value, numbers.Real):
        value = float(value)
        if not math.isfinite(value):
            raise InvalidArgument(f"{what} {value!r} is not finite: give a number such as 7e9 or text such as \"7B\"")
        return repr(value)
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a number or text such as \"7B\" / \"80GB\", not {type(value).__name__}")
    _check_printable(value, what)
    return value


def _choice(value, what):
    """precision / grad_dtype / optimizer_states: None or printable text (the native layer names the choices)."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError(f"{what} must be a str such as \"bf16\", not {type(value).__name__}")
    _check_printable(value, what)
    return value


def _check_printable(value, what):
    if not value.isprintable():
        shown = repr(value) if len(value) <= 60 else repr(value[:57]) + "..."
        raise InvalidArgument(f"{what} {shown} contains a control character: write plain text")


def estimate(params, *, largest_layer_params=None, gpus_per_node=1, nodes=1, config=None, gpu_memory=None,
             cpu_memory=None, nvme_memory=None, precision=None, grad_dtype=None, optimizer_states=None,
             full=False):
    """The estimate rows as a list of dicts (stage, offload_optimizer,
    offload_param, gpu_model_state_bytes, gpu_buffer_bytes,
    cpu_bytes_per_node, nvme_bytes_per_node, fits, ...).

    params, largest_layer_params: counts (int, or text such as "7B").
    gpu_memory, cpu_memory, nvme_memory: bytes (int, or text such as "80GB").
    config: a DeepSpeed config (path or dict): marks its row, takes buffers and precision.
    precision: bf16 (default) | fp16 | fp32; grad_dtype: fp32 or None; optimizer_states: fp32 | bf16.
    full=True returns the whole JSON document (inputs and rows).
    """
    config_path = config_text = None
    if isinstance(config, dict):
        try:
            config_text = json.dumps(config, allow_nan=False)
        except ValueError as e:
            raise InvalidArgument(f"config holds a NaN or infinite number, which a JSON config cannot: {e}") from None
        except TypeError as e:
            raise TypeError(f"config holds a value JSON cannot hold: {e}") from None
    elif config is not None:
        if not isinstance(config, (str, bytes, os.PathLike)):
            raise TypeError(f"config must be a path or a dict, not {type(config).__name__}")
        config_path = check_path(config, "config")
    if params is None:
        raise TypeError("params is required: a count such as 7000000000 or text such as \"7B\"")
    out = json.loads(_native.estimate(
        _text(params, "params"), largest_layer_params=_text(largest_layer_params, "largest_layer_params"),
        gpus_per_node=check_int(gpus_per_node, "gpus_per_node", 1, 4096), nodes=check_int(nodes, "nodes", 1, 1 << 20),
        config_path=config_path, config_text=config_text, gpu_memory=_text(gpu_memory, "gpu_memory"),
        cpu_memory=_text(cpu_memory, "cpu_memory"), nvme_memory=_text(nvme_memory, "nvme_memory"),
        precision=_choice(precision, "precision"), grad_dtype=_choice(grad_dtype, "grad_dtype"),
        optimizer_states=_choice(optimizer_states, "optimizer_states")))
    return out if full else out["rows"]
