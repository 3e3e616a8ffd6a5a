"""strata.torch joins the job a launcher started (Note [Launchers] in
strata/torch/_launcher.py): two ranks under torchrun, under the `deepspeed`
launcher's environment set by hand, with a process group the script made,
and as two torchrun "nodes" on localhost, each train what one rank trains
(losses within 1e-5) and bit-identically to mpirun's two ranks (the same
world size, the engine's canonical reduction order); a rank alone in a job
of two, and save_checkpoint on rank 0 only, fail within the bounded wait
naming what is missing; the environment's bad numbers are named; the
strata.torch.comm names DeepSpeed scripts use."""
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
RANKS_WORKER = os.path.join(HERE, "torch_ranks_worker.py")
LAUNCHER_WORKER = os.path.join(HERE, "torch_launcher_worker.py")
MPIRUN = shutil.which("mpirun") or shutil.which("mpiexec")


def torchrun_command():
    """torchrun as `python -m torch.distributed.run`. torch 1.13 under Python 3.11 cannot parse its own default
    --redirects / --tee ("0": Std.from_str returns None, as 3.11's flags no longer iterate a zero member, and the
    agent fails in to_map); naming stderr for both works around it."""
    from torch.distributed.elastic.multiprocessing.api import Std
    workaround = ["--redirects", "2", "--tee", "2"] if Std.from_str("0") is None else []
    return [sys.executable, "-m", "torch.distributed.run", *workaround]


TORCHRUN = torchrun_command()
STAGE2 = ["--stage", "2", "--optimizer", "cpu", "--steps", "2"]
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                      "TORCHELASTIC_USE_AGENT_STORE", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "PMI_SIZE",
                      "PMIX_RANK", "MPI_LOCALNRANKS")


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_environment(**extra):
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES}
    env.update(OMP_NUM_THREADS="1", **extra)
    return env


def wait_all(processes, command, timeout=300):
    """Waits for every process; returns their (returncode, stdout, stderr)."""
    deadline = time.monotonic() + timeout
    done = []
    for p in processes:
        try:
            out, err = p.communicate(timeout=max(1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for q in processes:
                q.kill()
            raise AssertionError(f"{command} did not end within {timeout} s")
        done.append((p.returncode, out, err))
    return done


def read(out):
    with open(out) as f:
        return json.load(f)


def one_rank(tmp_path, name, *flags):
    out = tmp_path / f"{name}.json"
    command = [sys.executable, RANKS_WORKER, str(out), *flags]
    done = subprocess.run(command, cwd=HERE, env=clean_environment(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{command}\n{done.stdout}\n{done.stderr}"
    return read(out)


def torchrun(tmp_path, name, *flags, nodes=1):
    """Two ranks under torchrun: one torchrun of two processes, or `nodes` torchruns of one process each (the
    multi-node form on localhost)."""
    out = tmp_path / f"{name}.json"
    port = str(free_port())
    common = ["--master_addr", "127.0.0.1", "--master_port", port]
    if nodes == 1:
        commands = [[*TORCHRUN, "--nproc_per_node", "2", *common, RANKS_WORKER, str(out), *flags]]
    else:
        commands = [[*TORCHRUN, "--nnodes", str(nodes), "--node_rank", str(n), "--nproc_per_node", "1", *common,
                     RANKS_WORKER, str(out), *flags] for n in range(nodes)]
    processes = [subprocess.Popen(c, cwd=HERE, env=clean_environment(), stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True) for c in commands]
    for code, stdout, stderr in wait_all(processes, commands[0]):
        assert code == 0, f"{commands}\n{stdout}\n{stderr}"
    return read(out)


def by_hand(tmp_path, name, mode, *flags, world=2):
    """`world` ranks with the environment DeepSpeed's launcher gives each process, set by hand."""
    out = tmp_path / f"{name}.json"
    port = str(free_port())
    command = [sys.executable, LAUNCHER_WORKER, mode, str(out), *flags]
    processes = [subprocess.Popen(command, cwd=HERE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env=clean_environment(RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world),
                                                        LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                                                        MASTER_PORT=port))
                 for r in range(world)]
    for code, stdout, stderr in wait_all(processes, command):
        assert code == 0, f"{command}\n{stdout}\n{stderr}"
    return read(out)


def mpirun(tmp_path, name, *flags):
    if MPIRUN is None and os.environ.get("STRATA_REQUIRE_MPI") != "1":
        pytest.skip("mpirun is not installed (libopenmpi-dev / openmpi-bin)")
    out = tmp_path / f"{name}.json"
    command = [MPIRUN, "--allow-run-as-root", "--oversubscribe", "-np", "2", sys.executable, RANKS_WORKER, str(out),
               *flags]
    done = subprocess.run(command, cwd=HERE, env=clean_environment(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{command}\n{done.stdout}\n{done.stderr}"
    return read(out)


def assert_close(a, b, rel=1e-5):
    assert len(a) == len(b) and all(abs(x - y) <= rel * abs(y) for x, y in zip(a, b)), (a, b)


@pytest.fixture(scope="module")
def stage2(tmp_path_factory):
    """One rank and torchrun's two ranks at stage 2 with the optimizer on the host: what the other launchers
    must match."""
    tmp_path = tmp_path_factory.mktemp("stage2")
    one = one_rank(tmp_path, "one", *STAGE2)
    two = torchrun(tmp_path, "torchrun", *STAGE2)
    assert two["world"] == 2 and one["world"] == 1
    assert_close(two["losses"], one["losses"])
    assert two["losses"][-1] < two["losses"][0]
    return one, two


def test_torchrun_two_ranks_train_as_one_and_as_mpirun_at_stage2(tmp_path, stage2):
    _, two = stage2
    under_mpi = mpirun(tmp_path, "mpirun", *STAGE2)
    assert two["losses"] == under_mpi["losses"]  # bit-identical: one world size, one reduction order
    assert two["masters"] == under_mpi["masters"]


def test_torchrun_two_ranks_train_as_one_and_as_mpirun_at_stage3_nvme(tmp_path):
    flags = ["--stage", "3", "--optimizer", "nvme", "--params", "nvme", "--nvme", str(tmp_path), "--steps", "2"]
    one = one_rank(tmp_path, "one", *flags)
    two = torchrun(tmp_path, "torchrun", *flags)
    assert_close(two["losses"], one["losses"])
    under_mpi = mpirun(tmp_path, "mpirun", *flags)
    assert two["losses"] == under_mpi["losses"]
    assert two["masters"] == under_mpi["masters"]


def test_deepspeed_launcher_environment_and_init_distributed(tmp_path, stage2):
    """RANK / LOCAL_RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT as `deepspeed` sets them, and the script's
    deepspeed.init_distributed() (strata.torch.init_distributed); strata.torch.comm's collectives checked
    in the worker."""
    _, two = stage2
    assert by_hand(tmp_path, "deepspeed", "init-distributed", *STAGE2)["losses"] == two["losses"]


def test_a_process_group_made_before_initialize_is_used(tmp_path, stage2):
    _, two = stage2
    assert by_hand(tmp_path, "user", "user-group", *STAGE2)["losses"] == two["losses"]


def test_torchrun_two_nodes_on_localhost(tmp_path, stage2):
    _, two = stage2
    assert torchrun(tmp_path, "nodes", *STAGE2, nodes=2)["losses"] == two["losses"]


def test_comm_collectives_under_mpirun_make_their_group_from_mpiruns_variables():
    if MPIRUN is None and os.environ.get("STRATA_REQUIRE_MPI") != "1":
        pytest.skip("mpirun is not installed (libopenmpi-dev / openmpi-bin)")
    command = [MPIRUN, "--allow-run-as-root", "--oversubscribe", "-np", "2", sys.executable, LAUNCHER_WORKER,
               "mpi-comm"]
    done = subprocess.run(command, cwd=HERE, env=clean_environment(MASTER_PORT=str(free_port())),
                          capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, f"{done.stdout}\n{done.stderr}"


def failure_seconds(stderr):
    found = re.search(r"FAILED after ([0-9.]+) s: (.*)", stderr)
    assert found, stderr
    return float(found.group(1)), found.group(2)


@pytest.mark.parametrize("rank", [0, 1])
def test_a_rank_alone_fails_in_bounded_time_naming_what_is_missing(rank):
    port = free_port()
    env = clean_environment(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                            MASTER_PORT=str(port))
    done = subprocess.run([sys.executable, LAUNCHER_WORKER, "lonely"], cwd=HERE, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 3, done.stderr
    seconds, message = failure_seconds(done.stderr)
    assert seconds < 2 + 10, message  # strata.wait_timeout_s 2, and slack for a loaded machine
    assert f"127.0.0.1:{port}" in message and "DeadlineExceeded" in message, message
    missing = "rank(s) 1 did not join" if rank == 0 else "ranks that did not join: 0"
    assert missing in message, message


def save_on_rank0_only(command, env):
    done = subprocess.run(command, cwd=HERE, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode != 0, done.stderr
    seconds, message = failure_seconds(done.stderr + done.stdout)
    assert seconds < 3 + 10, message  # strata.wait_timeout_s 3
    assert "call save_checkpoint on every rank" in message, message
    assert "did not arrive: 1" in message or "collective mismatch" in message, message


def test_save_checkpoint_on_rank0_only_fails_in_bounded_time_under_torchrun(tmp_path):
    command = [*TORCHRUN, "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
               LAUNCHER_WORKER, "save-rank0", str(tmp_path / "ckpt")]
    save_on_rank0_only(command, clean_environment())


def test_save_checkpoint_on_rank0_only_fails_in_bounded_time_under_mpirun(tmp_path):
    if MPIRUN is None and os.environ.get("STRATA_REQUIRE_MPI") != "1":
        pytest.skip("mpirun is not installed (libopenmpi-dev / openmpi-bin)")
    command = [MPIRUN, "--allow-run-as-root", "--oversubscribe", "-np", "2", sys.executable, LAUNCHER_WORKER,
               "save-rank0", str(tmp_path / "ckpt")]
    save_on_rank0_only(command, clean_environment())


# In this process: the environment's checks, and strata.torch.comm without a job of several ranks.

@pytest.fixture
def launcher(monkeypatch):
    from strata.torch import _launcher
    for name in LAUNCHER_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(_launcher, "_job", None)
    return _launcher


@pytest.mark.parametrize("variables, named", [
    ({"WORLD_SIZE": "two", "RANK": "0"}, "WORLD_SIZE='two' is not a whole number"),
    ({"WORLD_SIZE": "0", "RANK": "0"}, "WORLD_SIZE=0 is out of range"),
    ({"WORLD_SIZE": "2", "RANK": "2"}, "RANK=2 is out of range: it must be in 0..1"),
    ({"WORLD_SIZE": "2"}, "no RANK"),
    ({"RANK": "1"}, "no WORLD_SIZE"),
    ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_WORLD_SIZE": "3"}, "LOCAL_WORLD_SIZE=3 is out of range"),
    ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "-1"}, "LOCAL_RANK='-1' is not a whole number"),
    ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_PORT": "70000"}, "MASTER_PORT=70000 is out of range"),
    ({"WORLD_SIZE": "2", "RANK": "0", "MASTER_ADDR": " "}, "MASTER_ADDR=' ' is not a host"),
    ({"OMPI_COMM_WORLD_SIZE": "x"}, "OMPI_COMM_WORLD_SIZE='x' is not a whole number"),
])
def test_bad_launcher_variables_are_named(launcher, monkeypatch, variables, named):
    from strata.errors import InvalidArgument
    for name, value in variables.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(InvalidArgument, match=re.escape(named)):
        launcher.join_launcher_job(1.0)


def test_world_of_two_without_a_rendezvous_address_is_an_error(launcher, monkeypatch):
    from strata.errors import InvalidArgument
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("MASTER_PORT", "29511")
    assert launcher.launcher_world() == 2
    with pytest.raises(InvalidArgument, match="WORLD_SIZE=2 but MASTER_ADDR is not set"):
        launcher.join_launcher_job(1.0)


def test_an_engine_told_world_two_with_nothing_to_join_refuses_to_run_alone(launcher, monkeypatch):
    """strata.Engine (backend 'auto') under a launcher's WORLD_SIZE=2 with no torch.distributed group: an
    error, never a silent run of one rank."""
    from strata.engine import Engine
    from strata.errors import FailedPrecondition
    from test_engine import config, layers_of, make_model
    monkeypatch.setenv("WORLD_SIZE", "2")
    layers = layers_of(make_model())
    with pytest.raises(FailedPrecondition, match="WORLD_SIZE=2 .* would train alone"):
        Engine(config(0), layers)
    with pytest.raises(ValueError, match="backend 'nccl' is not auto, local, mpi or torch"):
        Engine(config(0), layers, backend="nccl")


def test_comm_names_of_a_job_of_one_rank(launcher):
    import strata.torch.comm as dist
    from strata.errors import FailedPrecondition, InvalidArgument
    from strata.torch._names import NotProvided
    assert not dist.is_initialized()
    with pytest.raises(FailedPrecondition, match="call strata.torch.init_distributed"):
        dist.get_rank()
    launcher.join_launcher_job(1.0)  # what initialize does: no launcher, one process
    assert (dist.get_rank(), dist.get_world_size(), dist.get_local_rank()) == (0, 1, 0)
    assert dist.is_initialized() and dist.is_available()
    t = torch.tensor([3.0])
    dist.all_reduce(t)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    dist.broadcast(t, src=0)
    dist.barrier()
    assert float(t) == 3.0 and dist.all_reduce(t, async_op=True).wait()
    with pytest.raises(InvalidArgument, match="only rank is 0"):
        dist.broadcast(t, src=1)
    with pytest.raises(InvalidArgument, match="would truncate"):
        dist.all_reduce(torch.tensor([3]), op=dist.ReduceOp.AVG)
    with pytest.raises(TypeError, match="ReduceOp"):
        dist.all_reduce(t, op="sum")
    with pytest.raises(NotProvided, match=r"strata.torch.comm.all_gather \(DeepSpeed's deepspeed.comm.all_gather\): "
                                          r"use torch.distributed.all_gather"):
        dist.all_gather
    with pytest.raises(ImportError, match="not provided"):
        from strata.torch.comm import no_such_name  # noqa: F401
    import strata.torch as st
    assert st.init_distributed is dist.init_distributed
    with pytest.raises(InvalidArgument, match="world_size 0 is out of range"):
        st.init_distributed(world_size=0)
    with pytest.raises(TypeError, match="timedelta"):
        st.init_distributed(timeout=30)
