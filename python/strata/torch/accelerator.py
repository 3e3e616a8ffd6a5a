"""strata.torch.accelerator: DeepSpeed's get_accelerator() for a ported
script (`from deepspeed.accelerator import get_accelerator`).

get_accelerator() is the one strata.torch trains on by default (Note [The
device strata.torch trains on], strata.device "auto"): the CUDA one (torch.cuda
under DeepSpeed's method names) where torch has a GPU, else the CPU one, as
DeepSpeed detects its accelerator; DeepSpeed's own switch, DS_ACCELERATOR=cpu
or cuda, chooses instead. So a script that moves its batches with
`.to(get_accelerator().device_name())` keeps them where the engine wants them.
The CPU one's memory queries report this process's resident memory (what
DeepSpeed's CPU accelerator reports), total_memory() the machine's.
"""

import contextlib
import os

import torch

from ._names import refusing_getattr

__all__ = ["get_accelerator", "set_accelerator", "CpuAccelerator", "CudaAccelerator"]


def _env_int(names, default):
    for name in names:
        text = os.environ.get(name)
        if text is not None:
            if not text.strip().isdigit():
                raise ValueError(f"the launcher's {name}={text[:32]!r} is not a whole number")
            return int(text)
    return default


def local_rank():
    """This process's rank on its node, as the launchers set it (torchrun's LOCAL_RANK, mpirun's
    OMPI_COMM_WORLD_LOCAL_RANK / MPI_LOCALRANKID, SLURM's SLURM_LOCALID); 0 without a launcher."""
    return _env_int(("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"), 0)


def _page_bytes():
    return os.sysconf("SC_PAGE_SIZE")


def _resident_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _page_bytes()


def _meminfo_bytes(key):
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    raise OSError(f"/proc/meminfo has no {key} line")


def _numa_nodes_with_cpus():
    """The NUMA nodes that have CPUs (DeepSpeed's CPU device count); 1 where the system does not say."""
    root = "/sys/devices/system/node"
    try:
        names = [n for n in os.listdir(root) if n.startswith("node") and n[4:].isdigit()]
    except OSError:
        return 1
    count = 0
    for name in names:
        try:
            with open(os.path.join(root, name, "cpulist")) as f:
                count += bool(f.read().strip())
        except OSError:
            continue
    return max(count, 1)


def _check_seed(seed):
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"manual_seed(seed): seed must be an int, not {type(seed).__name__}")
    return seed


class CpuAccelerator:
    """DeepSpeed's CPU accelerator's methods, over torch's CPU calls."""

    _name = "cpu"

    def __init__(self):
        self._peak_resident = _resident_bytes()

    # -- device --------------------------------------------------------------------------------
    def device_name(self, device_index=None):
        return "cpu"

    def current_device_name(self):
        return "cpu"

    def device(self, device_index=None):
        return torch.device("cpu")

    def current_device(self):
        """This process's local rank (DeepSpeed's CPU accelerator: one device per local rank)."""
        return local_rank()

    def set_device(self, device_index):
        """Nothing to select on the CPU."""

    def device_count(self):
        """LOCAL_SIZE or LOCAL_WORLD_SIZE where a launcher sets it, else the NUMA nodes with CPUs (DeepSpeed's count)."""
        given = _env_int(("LOCAL_SIZE", "LOCAL_WORLD_SIZE"), 0)
        return given if given > 0 else _numa_nodes_with_cpus()

    def is_available(self):
        return True

    def is_synchronized_device(self):
        return True

    def synchronize(self, device_index=None):
        """CPU work is done when its call returns (the engine's own queue: engine.synchronize())."""

    def communication_backend_name(self):
        return "gloo"

    def on_accelerator(self, tensor):
        return tensor.device.type == "cpu"

    # -- random numbers ------------------------------------------------------------------------
    def manual_seed(self, seed):
        return torch.manual_seed(_check_seed(seed))

    def manual_seed_all(self, seed):
        return torch.manual_seed(_check_seed(seed))

    def initial_seed(self):
        return torch.initial_seed()

    def get_rng_state(self, device_index=None):
        return torch.get_rng_state()

    def set_rng_state(self, new_state, device_index=None):
        torch.set_rng_state(new_state)

    def random(self):
        return torch.random

    def default_generator(self, device_index=None):
        return torch.default_generator

    # -- memory (this process's resident set, as DeepSpeed's CPU accelerator reports) -----------
    def _resident(self):
        now = _resident_bytes()
        self._peak_resident = max(self._peak_resident, now)
        return now

    def empty_cache(self):
        """Nothing cached to give back on the CPU."""

    def memory_allocated(self, device_index=None):
        return self._resident()

    def max_memory_allocated(self, device_index=None):
        self._resident()
        return self._peak_resident

    def reset_max_memory_allocated(self, device_index=None):
        self._peak_resident = _resident_bytes()

    memory_reserved = memory_cached = memory_allocated
    max_memory_reserved = max_memory_cached = max_memory_allocated
    reset_max_memory_cached = reset_peak_memory_stats = reset_max_memory_allocated

    def memory_stats(self, device_index=None):
        now = self._resident()
        return {"allocated_bytes.all.current": now, "allocated_bytes.all.peak": self._peak_resident}

    def total_memory(self, device_index=None):
        return os.sysconf("SC_PHYS_PAGES") * _page_bytes()

    def available_memory(self, device_index=None):
        return _meminfo_bytes("MemAvailable")

    # -- data types ----------------------------------------------------------------------------
    def is_bf16_supported(self):
        return True

    def is_fp16_supported(self):
        return True

    def supported_dtypes(self):
        return [torch.float32, torch.bfloat16, torch.float16]

    # -- streams, events, ranges: none on the CPU ------------------------------------------------
    Stream = None
    Event = None

    def stream(self, stream):
        return contextlib.nullcontext()

    def current_stream(self, device_index=None):
        return None

    def default_stream(self, device_index=None):
        return None

    def range_push(self, msg, domain=None, category=None):
        """No profiler ranges on the CPU."""

    def range_pop(self, domain=None):
        """No profiler ranges on the CPU."""

    def lazy_call(self, callback):
        return callback()

    def pin_memory(self, tensor, align_bytes=1):
        return tensor

    def is_pinned(self, tensor):
        return tensor.is_pinned() if torch.cuda.is_available() else False

    def __repr__(self):
        return "strata.torch.accelerator.CpuAccelerator()"


class CudaAccelerator:
    """DeepSpeed's CUDA accelerator's methods, over torch.cuda (DS_ACCELERATOR=cuda)."""

    _name = "cuda"

    def __init__(self):
        if not torch.cuda.is_available():
            raise RuntimeError("DS_ACCELERATOR=cuda, but torch.cuda.is_available() is False (no GPU, or a CPU build "
                               "of torch): unset DS_ACCELERATOR (strata.torch trains on the cpu device)")

    def device_name(self, device_index=None):
        return "cuda" if device_index is None else f"cuda:{device_index}"

    def current_device_name(self):
        return f"cuda:{torch.cuda.current_device()}"

    def device(self, device_index=None):
        return torch.device("cuda", torch.cuda.current_device() if device_index is None else device_index)

    def current_device(self):
        return torch.cuda.current_device()

    def set_device(self, device_index):
        torch.cuda.set_device(device_index)

    def device_count(self):
        return torch.cuda.device_count()

    def is_available(self):
        return torch.cuda.is_available()

    def is_synchronized_device(self):
        return False

    def synchronize(self, device_index=None):
        torch.cuda.synchronize(device_index)

    def communication_backend_name(self):
        return "nccl"

    def on_accelerator(self, tensor):
        return tensor.device.type == "cuda"

    def manual_seed(self, seed):
        return torch.cuda.manual_seed(_check_seed(seed))

    def manual_seed_all(self, seed):
        return torch.cuda.manual_seed_all(_check_seed(seed))

    def initial_seed(self):
        return torch.cuda.initial_seed()

    def get_rng_state(self, device_index=None):
        return torch.cuda.get_rng_state("cuda" if device_index is None else device_index)

    def set_rng_state(self, new_state, device_index=None):
        torch.cuda.set_rng_state(new_state, "cuda" if device_index is None else device_index)

    def random(self):
        return torch.random

    def default_generator(self, device_index=None):
        return torch.cuda.default_generators[torch.cuda.current_device() if device_index is None else device_index]

    def empty_cache(self):
        torch.cuda.empty_cache()

    def memory_allocated(self, device_index=None):
        return torch.cuda.memory_allocated(device_index)

    def max_memory_allocated(self, device_index=None):
        return torch.cuda.max_memory_allocated(device_index)

    def reset_max_memory_allocated(self, device_index=None):
        torch.cuda.reset_peak_memory_stats(device_index)

    def memory_reserved(self, device_index=None):
        return torch.cuda.memory_reserved(device_index)

    def max_memory_reserved(self, device_index=None):
        return torch.cuda.max_memory_reserved(device_index)

    memory_cached = memory_reserved
    max_memory_cached = max_memory_reserved
    reset_max_memory_cached = reset_peak_memory_stats = reset_max_memory_allocated

    def memory_stats(self, device_index=None):
        return torch.cuda.memory_stats(device_index)

    def total_memory(self, device_index=None):
        return torch.cuda.get_device_properties(torch.cuda.current_device() if device_index is None
                                                else device_index).total_memory

    def available_memory(self, device_index=None):
        free, _ = torch.cuda.mem_get_info(device_index)
        return free

    def is_bf16_supported(self):
        return torch.cuda.is_bf16_supported()

    def is_fp16_supported(self):
        return True

    def supported_dtypes(self):
        return [torch.float32, torch.float16] + ([torch.bfloat16] if self.is_bf16_supported() else [])

    @property
    def Stream(self):
        return torch.cuda.Stream

    @property
    def Event(self):
        return torch.cuda.Event

    def stream(self, stream):
        return torch.cuda.stream(stream)

    def current_stream(self, device_index=None):
        return torch.cuda.current_stream(device_index)

    def default_stream(self, device_index=None):
        return torch.cuda.default_stream(device_index)

    def range_push(self, msg, domain=None, category=None):
        torch.cuda.nvtx.range_push(msg)

    def range_pop(self, domain=None):
        torch.cuda.nvtx.range_pop()

    def lazy_call(self, callback):
        return callback()

    def pin_memory(self, tensor, align_bytes=1):
        return tensor.pin_memory()

    def is_pinned(self, tensor):
        return tensor.is_pinned()

    def __repr__(self):
        return "strata.torch.accelerator.CudaAccelerator()"


_ACCELERATORS = {"cpu": CpuAccelerator, "cuda": CudaAccelerator}
_chosen = None


def get_accelerator():
    """The accelerator a ported script asks for: the one DS_ACCELERATOR names (cpu or cuda), else the CUDA one
    where torch has a GPU and the CPU one elsewhere (where strata.device "auto" trains)."""
    global _chosen
    if _chosen is None:
        name = os.environ.get("DS_ACCELERATOR") or ("cuda" if torch.cuda.is_available() else "cpu")
        if name not in _ACCELERATORS:
            raise ValueError(f"DS_ACCELERATOR={name[:32]!r}: strata.torch has the cpu and cuda accelerators "
                             f"(unset it: the cuda one where torch has a GPU, else the cpu one)")
        _chosen = _ACCELERATORS[name]()
    return _chosen


def set_accelerator(accelerator):
    """Makes `accelerator` (a CpuAccelerator or CudaAccelerator) what get_accelerator() returns."""
    global _chosen
    if not isinstance(accelerator, tuple(_ACCELERATORS.values())):
        raise TypeError(f"set_accelerator(): a strata.torch.accelerator.CpuAccelerator or CudaAccelerator, not "
                        f"{type(accelerator).__name__}")
    _chosen = accelerator


__getattr__ = refusing_getattr(__name__, {
    "is_current_accelerator_supported": "the cpu accelerator is always available (get_accelerator())",
    "DeepSpeedAccelerator": "the accelerators are strata.torch.accelerator.CpuAccelerator and CudaAccelerator",
})
