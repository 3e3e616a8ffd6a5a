"""strata.torch.comm: DeepSpeed's deepspeed.comm names over the job
strata.torch joined (Note [Launchers] in strata/torch/_launcher.py).

    import strata.torch.comm as dist          # was: from deepspeed import comm as dist
    strata.torch.init_distributed()           # was: deepspeed.init_distributed()
    if dist.get_rank() == 0: ...

Provided: init_distributed, is_initialized, is_available, get_rank, get_world_size,
get_local_rank, barrier, all_reduce, broadcast and ReduceOp; any other name
of deepspeed.comm raises NotProvided (an ImportError) saying what to use.
The collectives act on the caller's tensors through torch.distributed (the
group the launcher's job made); the engine's own collectives never go
through here. Under mpirun with no torch.distributed group yet, the first
collective makes one from mpirun's environment, as DeepSpeed's MPI discovery
does (every rank calls it, as every rank calls a collective).
"""

import datetime
import enum
import os

import torch

from . import _launcher
from ..errors import FailedPrecondition, InvalidArgument

__all__ = ["init_distributed", "is_initialized", "is_available", "get_rank", "get_world_size", "get_local_rank",
           "barrier", "all_reduce", "broadcast", "ReduceOp"]

TORCH_DISTRIBUTED_DEFAULT_PORT = 29500  # DeepSpeed's distributed_port default


class ReduceOp(enum.Enum):
    """DeepSpeed's reduction names; all_reduce also takes torch.distributed.ReduceOp."""
    SUM = 0
    PRODUCT = 1
    MIN = 2
    MAX = 3
    BAND = 4
    BOR = 5
    BXOR = 6
    AVG = 7
    UNUSED = 8


def init_distributed(dist_backend=None, auto_mpi_discovery=True, distributed_port=TORCH_DISTRIBUTED_DEFAULT_PORT,
                     verbose=True, timeout=datetime.timedelta(minutes=10), init_method=None, dist_init_required=None,
                     config=None, rank=-1, world_size=-1):
    """DeepSpeed's init_distributed: joins the launcher's job by making torch.distributed's default group (gloo
    on the cpu device; dist_backend names another) unless one exists, which is then used as it is.

    The environment of a PyTorch launcher (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT), else mpirun's when
    auto_mpi_discovery (MASTER_ADDR: the environment's, or 127.0.0.1 when every rank is on this node;
    MASTER_PORT: the environment's, else distributed_port), else init_method with rank and world_size, else a
    group of one. timeout bounds the rendezvous (a rank whose peers do not arrive fails naming them and the
    address) and the group's collectives. dist_init_required=False only checks that a group exists; verbose
    and config are accepted for DeepSpeed's signature."""
    if not isinstance(timeout, datetime.timedelta):
        raise TypeError(f"timeout must be a datetime.timedelta, not {type(timeout).__name__}")
    if not datetime.timedelta(milliseconds=1) <= timeout <= datetime.timedelta(days=7):
        raise InvalidArgument(f"timeout {timeout} is out of range: give 1 ms .. 7 days")
    for name, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int (-1: from the launcher), not {type(value).__name__}")
    if world_size != -1 and not 1 <= world_size <= 65536:
        raise InvalidArgument(f"world_size {world_size} is out of range: give 1..65536 (or -1: from the launcher)")
    if rank != -1 and not 0 <= rank < (world_size if world_size != -1 else 65536):
        raise InvalidArgument(f"rank {rank} is out of range: give 0..world_size-1 (or -1: from the launcher)")
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        _launcher.init_process_group(None, timeout)  # records the group the user made
        return
    if dist_init_required is False:
        raise FailedPrecondition("init_distributed(dist_init_required=False) but torch.distributed is not "
                                 "initialized: make its group first, or leave dist_init_required as None")
    backend = _launcher.choose_backend(dist_backend)
    if auto_mpi_discovery and _launcher.mpi_launched() and os.environ.get("RANK") in (None, ""):
        _environment_from_mpi(distributed_port)
    _launcher.init_process_group(backend, timeout, rank=None if rank == -1 else rank,
                                 world_size=None if world_size == -1 else world_size, init_method=init_method)


def _environment_from_mpi(distributed_port):
    """RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT from mpirun's variables, set in os.environ as
    DeepSpeed's MPI discovery sets them."""
    job = _launcher._mpi_job()
    if not job.world_size:
        raise FailedPrecondition("mpirun started this process but set neither OMPI_COMM_WORLD_SIZE nor PMI_SIZE: "
                                 "set RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT for torch.distributed")
    if isinstance(distributed_port, bool) or not isinstance(distributed_port, int) or \
            not 1 <= distributed_port <= 65535:
        raise InvalidArgument(f"distributed_port {distributed_port!r} is not a port number in 1..65535")
    address = os.environ.get("MASTER_ADDR")
    if address in (None, ""):
        if job.local_world_size != job.world_size:
            raise FailedPrecondition(f"mpirun's {job.world_size} ranks span several nodes and MASTER_ADDR is not "
                                     f"set: export MASTER_ADDR=<rank 0's host> (mpirun -x MASTER_ADDR)")
        address = "127.0.0.1"
    os.environ.update({"RANK": str(job.rank), "WORLD_SIZE": str(job.world_size), "LOCAL_RANK": str(job.local_rank),
                       "LOCAL_WORLD_SIZE": str(job.local_world_size), "MASTER_ADDR": address,
                       "MASTER_PORT": os.environ.get("MASTER_PORT") or str(distributed_port)})


def is_initialized():
    """True once this process joined a job: torch.distributed's group exists, or strata.torch.initialize ran
    (under mpirun its engine's ranks are MPI's)."""
    return _group() is not None or _launcher.current_job() is not None


def _group():
    import torch.distributed as dist
    return dist if dist.is_available() and dist.is_initialized() else None


def _joined(name):
    job = _launcher.current_job()
    if job is None:
        raise FailedPrecondition(f"strata.torch.comm.{name}(): no job joined yet; call strata.torch.init_distributed() "
                                 f"or strata.torch.initialize() first (DeepSpeed requires the same)")
    return job


def get_rank(group=None):
    """This process's rank in `group` (default: the whole job)."""
    dist = _group()
    if dist is not None:
        return dist.get_rank(group) if group is not None else dist.get_rank()
    return _joined("get_rank").rank


def get_world_size(group=None):
    """The number of ranks in `group` (default: the whole job)."""
    dist = _group()
    if dist is not None:
        return dist.get_world_size(group) if group is not None else dist.get_world_size()
    return _joined("get_world_size").world_size


def get_local_rank():
    """This process's rank on its node (the launcher's LOCAL_RANK)."""
    job = _launcher.current_job()
    if job is None and _group() is None:
        _joined("get_local_rank")
    return job.local_rank if job is not None else _launcher.local_rank_from_environment()


def is_available():
    """True when torch.distributed is available (this torch was built with it)."""
    import torch.distributed as dist
    return dist.is_available()


class _DoneWork:
    """The handle of a collective that needed no communication (a job of one rank) or already finished."""

    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True


def _collective_group(name):
    """torch.distributed for a collective: the existing group, None for a job of one rank, or (under mpirun) a
    group made now from mpirun's environment."""
    dist = _group()
    if dist is not None:
        return dist
    job = _joined(name)
    if job.world_size <= 1:
        return None
    init_distributed()
    return _group()


def barrier(group=None, async_op=False, device_ids=None, prof=False, log_name="barrier", debug=None):
    """Returns once every rank of `group` reached it."""
    dist = _collective_group("barrier")
    if dist is None:
        return _DoneWork() if async_op else None
    return dist.barrier(group=group, async_op=async_op) if group is not None else dist.barrier(async_op=async_op)


def _torch_op(op):
    import torch.distributed as dist
    if isinstance(op, ReduceOp):
        if op is ReduceOp.UNUSED:
            raise InvalidArgument("ReduceOp.UNUSED is not a reduction")
        return op.name
    for name in ("SUM", "PRODUCT", "MIN", "MAX", "BAND", "BOR", "BXOR", "AVG"):
        if hasattr(dist.ReduceOp, name) and op == getattr(dist.ReduceOp, name):
            return name
    raise TypeError(f"op must be a strata.torch.comm.ReduceOp or torch.distributed.ReduceOp, not {op!r}")


def all_reduce(tensor, op=ReduceOp.SUM, group=None, async_op=False, prof=False, log_name="all_reduce", debug=None):
    """Reduces `tensor` in place over the ranks of `group` (AVG: the sum divided by the group's size, as gloo
    has no AVG)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"all_reduce needs a torch.Tensor, not {type(tensor).__name__}")
    name = _torch_op(op)
    if name == "AVG" and not (tensor.is_floating_point() or tensor.is_complex()):
        raise InvalidArgument(f"all_reduce(op=AVG) of a {tensor.dtype} tensor would truncate: reduce SUM and divide")
    dist = _collective_group("all_reduce")
    if dist is None:
        return _DoneWork() if async_op else None
    extra = {} if group is None else {"group": group}
    if name == "AVG":
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM, **extra)
        tensor.div_(dist.get_world_size(group) if group is not None else dist.get_world_size())
        return _DoneWork() if async_op else None
    return dist.all_reduce(tensor, op=getattr(dist.ReduceOp, name), async_op=async_op, **extra)


def broadcast(tensor, src, group=None, async_op=False, prof=False, log_name="broadcast", debug=None):
    """Rank `src`'s `tensor` into every rank's `tensor`."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"broadcast needs a torch.Tensor, not {type(tensor).__name__}")
    dist = _collective_group("broadcast")
    if dist is None:
        if src != 0:
            raise InvalidArgument(f"broadcast(src={src}) in a job of one rank: the only rank is 0")
        return _DoneWork() if async_op else None
    extra = {} if group is None else {"group": group}
    return dist.broadcast(tensor, src, async_op=async_op, **extra)


_USE_TORCH = "use torch.distributed.{} (strata.torch joins torch.distributed's group: its functions work after " \
             "initialize or init_distributed)"
_COMMS_LOGGER = "DeepSpeed's comms logger is not provided: engine.metrics has each step's gather and reduce bytes " \
                "and wait times"
_NOT_PROVIDED = {
    **{name: _USE_TORCH.format(name) for name in (
        "all_gather", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor", "all_to_all_single",
        "all_to_all", "send", "recv", "isend", "irecv", "gather", "scatter", "reduce", "new_group",
        "destroy_process_group", "get_global_rank", "monitored_barrier", "all_reduce_coalesced",
        "all_gather_coalesced")},
    "get_world_group": "use torch.distributed.group.WORLD",
    "allgather_fn": _USE_TORCH.format("all_gather_into_tensor"),
    "reduce_scatter_fn": _USE_TORCH.format("reduce_scatter_tensor"),
    "log_summary": _COMMS_LOGGER,
    "configure": _COMMS_LOGGER,
}


def __getattr__(name):
    """deepspeed.comm's other names: NotProvided saying what to use (Note [DeepSpeed names not provided])."""
    from ._names import refusing_getattr
    return refusing_getattr(__name__, _NOT_PROVIDED, deepspeed_namespace="deepspeed.comm")(name)
