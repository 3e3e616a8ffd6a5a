"""strata.estimate: memory per GPU, per node (host) and on NVMe for every
ZeRO stage and offload placement, from the same estimator as
`strata estimate` (docs/estimate.md)."""

import json
import os

from . import _native

__all__ = ["estimate"]


def _text(value):
    return None if value is None else str(value)


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
        config_text = json.dumps(config, allow_nan=False)
    elif config is not None:
        config_path = os.fspath(config)
    out = json.loads(_native.estimate(
        _text(params), largest_layer_params=_text(largest_layer_params), gpus_per_node=int(gpus_per_node),
        nodes=int(nodes), config_path=config_path, config_text=config_text, gpu_memory=_text(gpu_memory),
        cpu_memory=_text(cpu_memory), nvme_memory=_text(nvme_memory), precision=precision, grad_dtype=grad_dtype,
        optimizer_states=optimizer_states))
    return out if full else out["rows"]
