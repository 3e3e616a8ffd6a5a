"""Joining the job a launcher started (Note [Launchers]).

Note [Launchers]
A launcher starts one process per rank and tells each where it stands:
every PyTorch launcher (torchrun, DeepSpeed's `deepspeed`, accelerate, SLURM
wrappers) through RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
MASTER_ADDR and MASTER_PORT; mpirun through OMPI_COMM_WORLD_* (PMI_* for
other MPIs). strata.torch joins that job, never N copies of a one-rank run:
- mpirun: the engine is a rank of MPI_COMM_WORLD (backend "mpi");
- torch.distributed already initialized (a group the user made,
  strata.torch.init_distributed, deepspeed.init_distributed): a rank of its
  default group (backend "torch": the engine's collectives run over gloo
  groups of their own, Note [Collectives over torch.distributed] in
  python/src/torch_distributed_communicator.cpp);
- a PyTorch launcher's environment: torch.distributed is initialized from
  it (gloo), then as above;
- none: one process (backend "local").
Every number of the environment is range-checked and an error names the
variable. An environment saying WORLD_SIZE N > 1 with no way to join is an
error. The rendezvous is bounded (strata.wait_timeout_s at initialize, the
timeout argument of init_distributed): each rank adds itself to a count in
the launcher's store (a TCPStore at MASTER_ADDR:MASTER_PORT, hosted by rank 0
or by torchrun's agent), and a rank whose peers do not all arrive in time
fails naming the missing ranks and the address.
"""

import datetime
import os
import re
import time
import warnings
from dataclasses import dataclass

from ..errors import DeadlineExceeded, FailedPrecondition, InvalidArgument, Unavailable

__all__ = ["Job", "launcher_world", "join_launcher_job", "init_process_group", "current_job", "mpi_launched",
           "local_rank_from_environment", "choose_backend"]

# What mpirun (OpenMPI) or another PMI launcher sets; the native module's launched_by_mpi reads the same.
_MPI_MARKERS = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK", "MPI_LOCALNRANKS")
_MAX_WORLD = 65536
_DIGITS = re.compile(r"[0-9]{1,9}")


@dataclass(frozen=True)
class Job:
    """This process's place in the job: rank, world size, rank and ranks on its node, and how it joined
    (backend "local", "mpi" or "torch"; rendezvous "MASTER_ADDR:MASTER_PORT" when it made one)."""
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    backend: str
    rendezvous: str = ""


_job = None  # the job joined so far (initialize or init_distributed), for strata.torch.comm


def current_job():
    return _job


def _record(job):
    global _job
    _job = job
    return job


def _number(name, low, high, required=False):
    """The environment's `name` as an int in [low, high], or None when unset (an error when required)."""
    text = os.environ.get(name)
    if text is None or text == "":
        if required:
            raise InvalidArgument(f"the launcher set no {name}: a PyTorch launcher sets RANK, WORLD_SIZE, "
                                  f"MASTER_ADDR and MASTER_PORT together (torchrun does); set {name} too")
        return None
    if not _DIGITS.fullmatch(text.strip()):
        raise InvalidArgument(f"the launcher's {name}={text[:32]!r} is not a whole number in {low}..{high}")
    value = int(text)
    if not low <= value <= high:
        raise InvalidArgument(f"the launcher's {name}={value} is out of range: it must be in {low}..{high}")
    return value


def local_rank_from_environment():
    """LOCAL_RANK (a PyTorch launcher's) or mpirun's local rank; 0 without a launcher."""
    for name in ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"):
        value = _number(name, 0, _MAX_WORLD - 1)
        if value is not None:
            return value
    return 0


def mpi_launched():
    return any(os.environ.get(name) is not None for name in _MPI_MARKERS)


def _mpi_job():
    """mpirun's view of this process: a Job (world 0 when only PMIX_RANK / MPI_LOCALNRANKS say MPI: MPI itself
    tells the engine its world)."""
    world = _number("OMPI_COMM_WORLD_SIZE", 1, _MAX_WORLD)
    if world is None:
        world = _number("PMI_SIZE", 1, _MAX_WORLD)
    top = world - 1 if world else _MAX_WORLD - 1
    rank = _number("OMPI_COMM_WORLD_RANK", 0, top)
    if rank is None:
        rank = _number("PMI_RANK", 0, top)
    if rank is None:
        rank = _number("PMIX_RANK", 0, top)
    local_world = _number("OMPI_COMM_WORLD_LOCAL_SIZE", 1, world or _MAX_WORLD)
    if local_world is None:
        local_world = _number("MPI_LOCALNRANKS", 1, world or _MAX_WORLD)
    local_rank = _number("OMPI_COMM_WORLD_LOCAL_RANK", 0, (local_world or _MAX_WORLD) - 1)
    if local_rank is None:
        local_rank = _number("MPI_LOCALRANKID", 0, (local_world or _MAX_WORLD) - 1)
    return Job(rank or 0, world or 0, local_rank or 0, local_world or world or 1, "mpi")


def _torch_environment():
    """The PyTorch launcher's variables, checked: (Job, MASTER_ADDR, MASTER_PORT), or None when neither RANK nor
    WORLD_SIZE is set. MASTER_ADDR / MASTER_PORT are None when unset (needed only to make a group)."""
    if os.environ.get("RANK") in (None, "") and os.environ.get("WORLD_SIZE") in (None, ""):
        return None
    world = _number("WORLD_SIZE", 1, _MAX_WORLD, required=True)
    rank = _number("RANK", 0, world - 1, required=True)
    local_world = _number("LOCAL_WORLD_SIZE", 1, world)
    local_rank = _number("LOCAL_RANK", 0, (local_world or world) - 1)
    address = os.environ.get("MASTER_ADDR")
    if address is not None and (address.strip() == "" or re.search(r"\s", address)):
        raise InvalidArgument(f"the launcher's MASTER_ADDR={address[:64]!r} is not a host name or address")
    port = _number("MASTER_PORT", 1, 65535)
    job = Job(rank, world, local_rank if local_rank is not None else rank,
              local_world if local_world is not None else world, "torch")
    return job, address, port


def _dist():
    import torch.distributed as dist
    return dist if dist.is_available() else None


def _initialized_group():
    dist = _dist()
    return dist if dist is not None and dist.is_initialized() else None


def _check_same(what, ours, theirs, source):
    if ours != theirs:
        raise FailedPrecondition(f"{source} says {what} {theirs} but torch.distributed's group says {ours}: the two "
                                 f"describe different jobs; launch with one launcher (or make the group from its "
                                 f"environment)")


def launcher_world():
    """The number of ranks the engine will have (Note [Launchers]), known before it exists."""
    if mpi_launched():
        job = _mpi_job()
        return job.world_size or 1
    dist = _initialized_group()
    environment = _torch_environment()
    if dist is not None:
        world = dist.get_world_size()
        if environment is not None:
            _check_same("WORLD_SIZE", world, environment[0].world_size, "the launcher's environment")
        return world
    if environment is not None:
        return environment[0].world_size
    return 1


def join_launcher_job(timeout_s):
    """Joins the launcher's job (Note [Launchers]) and returns the engine's backend: "mpi", "torch" or
    "local". Makes torch.distributed's group from a PyTorch launcher's environment when none exists; the
    rendezvous waits at most timeout_s (strata.wait_timeout_s)."""
    dist = _initialized_group()
    if mpi_launched():
        job = _mpi_job()
        if dist is not None and job.world_size:
            _check_same("world size", dist.get_world_size(), job.world_size, "mpirun (OMPI_COMM_WORLD_SIZE)")
            _check_same("rank", dist.get_rank(), job.rank, "mpirun (OMPI_COMM_WORLD_RANK)")
        _record(job)
        return "mpi"
    environment = _torch_environment()
    if dist is None and environment is not None and environment[0].world_size > 1:
        init_process_group("gloo", datetime.timedelta(seconds=timeout_s))
        dist = _initialized_group()
    if dist is not None:
        job = _job_of_group(dist, environment)
        _record(job)
        return "torch" if job.world_size > 1 else "local"
    _record(environment[0] if environment is not None else Job(0, 1, 0, 1, "local"))
    return "local"


def _job_of_group(dist, environment):
    rank, world = dist.get_rank(), dist.get_world_size()
    rendezvous = _job.rendezvous if _job is not None and _job.backend == "torch" else ""
    if environment is None:
        return Job(rank, world, rank, world, "torch", rendezvous)
    job = environment[0]
    _check_same("WORLD_SIZE", world, job.world_size, "the launcher's environment")
    _check_same("RANK", rank, job.rank, "the launcher's environment")
    return Job(rank, world, job.local_rank, job.local_world_size, "torch", rendezvous)


def init_process_group(backend, timeout, rank=None, world_size=None, init_method=None):
    """torch.distributed's default group from the launcher's environment (or the given rank, world_size and
    init_method), its rendezvous bounded by `timeout` and the missing ranks named. Returns the Job."""
    dist = _dist()
    environment = _torch_environment()
    if dist is None:
        world = environment[0].world_size if environment is not None else world_size
        raise FailedPrecondition(f"this torch has no torch.distributed, so a job of {world} ranks cannot be joined; "
                                 f"install a torch built with distributed support, or launch with mpirun")
    if dist.is_initialized():
        return _record(_job_of_group(dist, environment))
    if init_method is not None:  # torch's own rendezvous (tcp://, file://): rank and world_size as given
        dist.init_process_group(backend, init_method=init_method, timeout=timeout,
                                world_size=-1 if world_size is None else world_size,
                                rank=-1 if rank is None else rank)
        return _record(_job_of_group(dist, environment))
    if environment is None and rank is None:
        # One process with no launcher: a group of one, as DeepSpeed makes one (no address needed).
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return _record(Job(0, 1, 0, 1, "torch"))
    if environment is not None:
        job, address, port = environment
    else:
        address, port = os.environ.get("MASTER_ADDR"), _number("MASTER_PORT", 1, 65535)
        job = Job(rank, world_size, rank, world_size, "torch")
    for given, name, value in ((rank, "rank", job.rank), (world_size, "world_size", job.world_size)):
        if given is not None and given != value:
            raise InvalidArgument(f"init_distributed({name}={given}) but the launcher's environment says {value}")
    if job.world_size == 1:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        return _record(job)
    for name, value in (("MASTER_ADDR", address), ("MASTER_PORT", port)):
        if value is None:
            raise InvalidArgument(f"WORLD_SIZE={job.world_size} but {name} is not set: the ranks meet at "
                                  f"MASTER_ADDR:MASTER_PORT (rank 0's host and a free port); torchrun and the "
                                  f"deepspeed launcher set both")
    store = _rendezvous(job, address, port, timeout)
    try:
        dist.init_process_group(backend, store=store, rank=job.rank, world_size=job.world_size, timeout=timeout)
    except RuntimeError as e:
        raise Unavailable(f"rank {job.rank} of {job.world_size}: making torch.distributed's {backend} group over "
                          f"the rendezvous at {address}:{port} failed: {e}") from None
    return _record(Job(job.rank, job.world_size, job.local_rank, job.local_world_size, "torch",
                       f"{address}:{port}"))


_joins = 0  # rendezvous made by this process: each counts its arrivals under its own keys


def _rendezvous(job, address, port, timeout):
    """The launcher's store at address:port, once every rank has arrived at it (Note [Launchers])."""
    global _joins
    import torch.distributed as dist
    where = f"{address}:{port}"
    seconds = timeout.total_seconds()
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # torchrun's agent hosts the store
    try:
        if agent:
            store = dist.TCPStore(address, port, job.world_size, False, timeout)
            attempt = _number("TORCHELASTIC_RESTART_COUNT", 0, 1 << 30) or 0
            store = dist.PrefixStore(f"/worker/attempt_{attempt}", store)
        else:
            store = dist.TCPStore(address, port, job.world_size, job.rank == 0, timeout, wait_for_workers=False)
    except (RuntimeError, OSError) as e:  # torch 2's DistNetworkError / DistStoreError are RuntimeErrors too
        if job.rank == 0 and not agent:
            raise Unavailable(f"rank 0 of {job.world_size} could not host the rendezvous at {where}: {e}. Is "
                              f"MASTER_PORT={port} taken by another job? Give every rank the same free port") from None
        host = "torchrun's agent" if agent else "rank 0"
        raise DeadlineExceeded(f"rank {job.rank} of {job.world_size} could not reach the rendezvous at {where} "
                               f"within {seconds:g} s: {host} hosts it and did not answer, so rank 0 has not "
                               f"started (or MASTER_ADDR / MASTER_PORT are wrong): ranks that did not join: 0. Start "
                               f"every rank with the same MASTER_ADDR and MASTER_PORT, or raise "
                               f"strata.wait_timeout_s if rank 0 is only slow ({e})") from None
    _joins += 1
    prefix = f"strata-rendezvous-{_joins}"
    store.add(f"{prefix}/{job.rank}", 1)
    arrived = store.add(prefix, 1)
    deadline = time.monotonic() + seconds
    while arrived < job.world_size:
        if time.monotonic() >= deadline:
            missing = [r for r in range(job.world_size) if store.add(f"{prefix}/{r}", 0) == 0]
            raise DeadlineExceeded(
                f"rank {job.rank} of {job.world_size} (WORLD_SIZE={job.world_size}): rank(s) "
                f"{_rank_list(missing)} did not join the rendezvous at {where} within {seconds:g} s "
                f"(strata.wait_timeout_s, or init_distributed's timeout). Start all {job.world_size} ranks "
                f"(torchrun --nproc_per_node / --nnodes, or the same command with each RANK), or fix WORLD_SIZE")
        time.sleep(0.02)
        arrived = store.add(prefix, 0)
    return store


def _rank_list(ranks):
    """"1, 3-5": ranges compressed, as the engine's messages write them."""
    parts, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            parts.append(str(start) if start == r else f"{start}-{r}" if r > start + 1 else f"{start}, {r}")
            start = None
    return ", ".join(parts)


def choose_backend(dist_backend):
    """The torch.distributed backend for the cpu device: gloo, or the one asked for; "nccl" without a usable
    CUDA device falls back to gloo with a warning (a ported GPU script asks for it)."""
    if dist_backend is None:
        return "gloo"
    if not isinstance(dist_backend, str):
        raise TypeError(f"dist_backend must be a str such as 'gloo', not {type(dist_backend).__name__}")
    if dist_backend == "nccl":
        import torch
        if not torch.cuda.is_available():
            warnings.warn("dist_backend='nccl' needs CUDA devices and this process has none: torch.distributed "
                          "uses gloo (the engine runs its own collectives over gloo on the cpu device either way)",
                          RuntimeWarning, stacklevel=3)
            return "gloo"
    return dist_backend
