"""The device strata.torch trains on, as torch sees it.

Note [The device strata.torch trains on]
The engine runs on the cpu device or on one GPU, chosen once at initialize
from the config's strata.device and the model:
  "cpu"    the cpu device; a parameter on a GPU is refused by name;
  "cuda"   the GPU the model's parameters are on, else the launcher's
           LOCAL_RANK's (modulo the GPUs, as DeepSpeed's engine takes it), else
           torch's current one; it becomes torch's current device;
  "auto"   (the default) "cuda" when the model is on a GPU or torch has one,
           as DeepSpeed takes its accelerator; else "cpu".
The choice is one value, TorchDevice, that the rest asks: where lent views
and placeholders live (`torch_device`), how torch's work is ordered
against the engine's (`stream_order`, Note [Torch's stream and the
engine's] in python/src/torch_stream_order.h) and which stream torch is on
now (`current_stream()`, read at every acquire and release so a
`torch.cuda.stream(s)` block is followed), and when a micro-batch's loss is
read on the host (`StepLoss`).

Note [One device, two allocators]
On a GPU torch's caching allocator holds the activations and the engine
holds its plan (parameters, gradients, gathered copies, device-side
state); neither sees the other's allocations. The engine's cap is
strata.device_memory (or initialize's device_memory) when given; otherwise
the GPU's free memory at initialize less a reserve left to torch: the
larger of 10 % of the GPU and 2 GiB (`device_budget`). initialize prints
the split on rank 0, and an out-of-memory error of either side names the
split, so the side that ran out and by how much is plain.
"""
import contextlib
import os
import warnings

import torch

from .errors import InvalidArgument, Unavailable

__all__ = ["TorchDevice", "choose_device", "device_budget", "StepLoss", "prepare_cuda_environment", "move_buffers"]

# Note [CUDA's environment for gated streams]
# The engine parks streams on host-signalled gates (torch's own, once
# borrowed). Two CUDA defaults can then hang a run (docs/core.md): a kernel's
# first launch loading it lazily may wait for the whole device, and 8
# hardware queues let a gated stream hold up one that would release it. So,
# as the strata CLI does, CUDA_MODULE_LOADING=EAGER and
# CUDA_DEVICE_MAX_CONNECTIONS=32 unless the user set them, at `import
# strata.torch` (CUDA reads them when torch creates its context); initialize
# warns on the GPU when torch made its context before they were set.
CUDA_ENVIRONMENT = {"CUDA_MODULE_LOADING": "EAGER", "CUDA_DEVICE_MAX_CONNECTIONS": "32"}


def prepare_cuda_environment():
    """Sets CUDA_ENVIRONMENT's variables the user left unset (Note [CUDA's environment for gated streams]);
    True when CUDA's context did not exist yet, so they take effect."""
    context_made = torch.cuda.is_initialized()
    for name, value in CUDA_ENVIRONMENT.items():
        os.environ.setdefault(name, value)
    return not context_made


def _warn_if_environment_came_late(device, prepared_in_time):
    if device.engine_kind != "cuda" or prepared_in_time:
        return
    missing = [f"{name}={value}" for name, value in CUDA_ENVIRONMENT.items() if os.environ.get(name) != value]
    if missing:
        warnings.warn(f"torch made its CUDA context before strata.torch was imported, without {' and '.join(missing)}: "
                      f"a stream the engine gates may then hold up the work that would release it (docs/torch.md, "
                      f"On a GPU); import strata.torch first, or set them in the environment",
                      RuntimeWarning, stacklevel=3)

_GIB = 1 << 30
RESERVE_FRACTION = 0.10
RESERVE_FLOOR = 2 * _GIB


class TorchDevice:
    """Where strata.torch trains (Note [The device strata.torch trains on])."""

    def __init__(self, torch_device, engine_kind, ordinal, stream_order):
        self.torch_device = torch_device  # where lent views and placeholders live
        self.engine_kind = engine_kind    # the engine's device: "cpu" | "cuda"
        self.ordinal = ordinal
        self.stream_order = stream_order  # "host" | "device" | "recorded"

    @property
    def queues_work(self):
        """True where torch only queues its work (a GPU): reading a value on the host waits for the queue."""
        return self.stream_order != "host"

    def current_stream(self):
        """The handle of torch's current stream (a cudaStream_t as an int; 0 on the cpu device)."""
        if self.engine_kind == "cuda":
            return int(torch.cuda.current_stream(self.torch_device).cuda_stream)
        return 0

    def placeholder(self, dtype):
        return torch.empty(0, dtype=dtype, device=self.torch_device)

    def __repr__(self):
        return f"TorchDevice({self.torch_device}, order {self.stream_order})"


class _RecordedDevice(TorchDevice):
    """The cuda device's order played on the cpu device, for tests of the
    device branch without a GPU: torch computes on the CPU, the engine runs
    on the cpu device, and torch's "streams" are handles a test selects with
    stream(); the engine logs every wait and record it puts on them
    (Engine.stream_order_log())."""

    def __init__(self):
        super().__init__(torch.device("cpu"), "cpu", 0, "recorded")
        self._streams = [0x5100]

    def current_stream(self):
        return self._streams[-1]

    @contextlib.contextmanager
    def stream(self, handle):
        self._streams.append(int(handle))
        try:
            yield
        finally:
            self._streams.pop()


_recorded = []  # the stand-in a test put in place (recorded_device_for_tests)


@contextlib.contextmanager
def recorded_device_for_tests():
    """Within the block, initialize() trains on the recorded stand-in of the
    cuda order (_RecordedDevice), which the block yields. For tests only."""
    device = _RecordedDevice()
    _recorded.append(device)
    try:
        yield device
    finally:
        _recorded.remove(device)


def choose_device(resolved, model):
    """The TorchDevice for `model` under the resolved config (Note [The device strata.torch trains on])."""
    if _recorded:
        return _recorded[-1]
    asked = resolved["strata"]["device"]
    on_gpu = {}
    for name, p in model.named_parameters():
        if p.device.type not in ("cpu", "meta"):  # meta: built under st.init (Note [Construction on meta])
            if p.device.type != "cuda":
                raise InvalidArgument(f"parameter '{name}' is on {p.device}: strata.torch trains on the cpu device "
                                      f"or a cuda GPU; move the model to one of them (or build it under st.init)")
            on_gpu.setdefault(p.device, name)
    if len(on_gpu) > 1:
        (first, a), (second, b) = list(on_gpu.items())[:2]
        raise InvalidArgument(f"the model's parameters are on two GPUs ('{a}' on {first}, '{b}' on {second}): "
                              f"one engine trains on one GPU; move the model to one device")
    if asked == "cpu":
        if on_gpu:
            device, name = next(iter(on_gpu.items()))
            raise InvalidArgument(f"strata.device is \"cpu\" but parameter '{name}' is on {device}: move the model "
                                  f"to the CPU (model.cpu()), or set strata.device to \"cuda\" (or \"auto\")")
        return TorchDevice(torch.device("cpu"), "cpu", 0, "host")
    has_gpu = torch.cuda.is_available()
    if asked == "cuda" and not has_gpu:
        raise Unavailable("strata.device is \"cuda\" but torch sees no GPU (torch.cuda.is_available() is False: a "
                          "CPU-only torch build, no driver, or CUDA_VISIBLE_DEVICES empty): set strata.device to "
                          "\"cpu\" or \"auto\", or run where torch has a GPU")
    if asked == "cuda" or on_gpu or has_gpu:
        index = next(iter(on_gpu)).index if on_gpu else _launcher_gpu()
        index = torch.cuda.current_device() if index is None else index
        # The engine's CUDA calls make its GPU the thread's current device: torch's is made the same up front.
        torch.cuda.set_device(index)
        device = TorchDevice(torch.device("cuda", index), "cuda", index, "device")
        _warn_if_environment_came_late(device, _environment_in_time)
        return device
    return TorchDevice(torch.device("cpu"), "cpu", 0, "host")


def _launcher_gpu():
    """The GPU of this rank when a launcher started it (LOCAL_RANK modulo the GPUs, as DeepSpeed's engine takes
    its local rank's), else None (torch's current one)."""
    if not any(name in os.environ for name in ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID")):
        return None
    from .torch._launcher import local_rank_from_environment
    return local_rank_from_environment() % torch.cuda.device_count()


def move_buffers(model, device):
    """The model's buffers (position ids, norm statistics, rotary tables) onto the training device, as
    DeepSpeed moves the module: the parameters are the engine's, the buffers stay torch's."""
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.device != device.torch_device:
                module._buffers[name] = buffer.to(device.torch_device)


def device_budget(device, asked_bytes):
    """(the engine's cap in bytes, how it was decided) on `device` (Note [One
    device, two allocators]): `asked_bytes` when nonzero, else on a GPU its
    free memory less the reserve left to torch; 0 on the cpu device (the
    engine's own default)."""
    if asked_bytes or device.engine_kind != "cuda":
        return asked_bytes, None
    free, total = torch.cuda.mem_get_info(device.torch_device)
    return split_free_memory(free, total)


def split_free_memory(free, total):
    """(the engine's cap, the split as words) given a GPU's free and total bytes."""
    reserve = max(int(total * RESERVE_FRACTION), RESERVE_FLOOR)
    if free <= reserve:
        raise Unavailable(f"the GPU has {_gib(free)} free of {_gib(total)}: less than the {_gib(reserve)} left to "
                          f"torch for activations (10 % of the GPU, at least 2 GiB), so nothing is left for the "
                          f"engine; free GPU memory first, or set strata.device_memory (the engine's cap) and "
                          f"activation checkpointing")
    cap = free - reserve
    return cap, (f"the engine's cap {_gib(cap)} = {_gib(free)} free of {_gib(total)} less {_gib(reserve)} left to "
                 f"torch (set strata.device_memory to choose the split)")


def _gib(n):
    return f"{n / _GIB:.2f} GiB"


class StepLoss:
    """The losses a step's micro-batches hand the engine (it sums them for
    the step's metrics). On the cpu device each is read as it ends; where
    torch queues its work, reading one would wait for the queue, so they
    are summed on the device and read once, at the step's last micro-batch
    (the engine's step waits there anyway)."""

    def __init__(self, device):
        self._queued = device.queues_work
        self._pending = None
        self.host_reads = 0  # how many times a loss was read on the host

    def hand_in(self, loss, last):
        """The value to give end_micro_batch for this micro-batch's loss."""
        value = loss.detach()
        if not self._queued:
            self.host_reads += 1
            return float(value)
        value = value.to(torch.float64)
        self._pending = value if self._pending is None else self._pending + value
        if not last:
            return 0.0
        total, self._pending = self._pending, None
        self.host_reads += 1
        return float(total)

    def drop(self):
        """The step was abandoned: its losses go with it."""
        self._pending = None


_environment_in_time = prepare_cuda_environment()  # at import (Note [CUDA's environment for gated streams])
