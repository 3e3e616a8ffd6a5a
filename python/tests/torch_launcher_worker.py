"""One rank of test_torch_launchers.py, started by torchrun, by hand with the
`deepspeed` launcher's environment, or by mpirun.

    python torch_launcher_worker.py MODE [torch_ranks_worker.py's arguments]

MODE:
  init-distributed  strata.torch.init_distributed() first (a DeepSpeed script's
                    deepspeed.init_distributed()), checks strata.torch.comm's
                    rank, world, local rank, all_reduce, broadcast and barrier,
                    then trains as torch_ranks_worker.py does;
  user-group        torch.distributed.init_process_group("gloo") made by the
                    script itself before initialize, then trains;
  mpi-comm          (mpirun) initialize, then strata.torch.comm's checks: its
                    group is made from mpirun's variables at the first use;
  lonely            initialize alone (strata.wait_timeout_s 2): must fail;
  save-rank0 DIR    two steps, then save_checkpoint on rank 0 only
                    (strata.wait_timeout_s 3): rank 0 must fail; the engines
                    stay alive until interpreter exit (their shutdown runs then).
A failure that must happen is printed as "FAILED after S s: Class: message"
and ends the process with status 3.
"""
import datetime
import os
import sys
import time

import torch

import strata.torch as st
import strata.torch.comm as dist
import torch_ranks_worker
from test_torch_frontend import SEQ, VOCAB, TinyLM

_kept = []  # engines alive at interpreter exit (Note [Collectives over torch.distributed]: shutdown)


def check_comm():
    rank, world = dist.get_rank(), dist.get_world_size()
    # A PyTorch launcher's variables, or mpirun's (its RANK / WORLD_SIZE are set when comm makes its group)
    names = ("WORLD_SIZE", "RANK", "LOCAL_RANK") if "WORLD_SIZE" in os.environ else \
        ("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK")
    assert (world, rank) == (int(os.environ[names[0]]), int(os.environ[names[1]])), (world, rank)
    assert dist.get_local_rank() == int(os.environ.get(names[2], rank))
    assert dist.is_initialized()
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    assert float(total) == world * (world + 1) / 2, float(total)
    mean = torch.tensor([float(rank)])
    dist.all_reduce(mean, op=dist.ReduceOp.AVG)
    assert float(mean) == (world - 1) / 2, float(mean)
    value = torch.tensor([float(rank) + 10])
    dist.broadcast(value, src=world - 1)
    assert float(value) == world + 9, float(value)
    dist.barrier()


def tiny_engine(wait_timeout_s):
    model = TinyLM(d=16, layers=1)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "strata": {"device": "cpu", "device_memory": "64MiB", "wait_timeout_s": wait_timeout_s}}
    engine, _, _, _ = st.initialize(model=model, model_parameters=model.parameters(), config=config)
    return engine


def train_steps(engine, steps):
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        ids = torch.randint(0, VOCAB, (2, SEQ + 1), generator=g)
        logits = engine(ids[:, :-1])
        engine.backward(torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1)))
        engine.step()


def expect_failure(call, unexpected):
    """Runs `call`, which must raise: prints how long it took and the error (the test reads them), exits 3."""
    start = time.monotonic()
    try:
        call()
    except Exception as e:  # the error under test, whatever its class
        print(f"FAILED after {time.monotonic() - start:.2f} s: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        raise SystemExit(3)
    raise SystemExit(unexpected)


def main():
    mode, rest = sys.argv[1], sys.argv[2:]
    if mode == "init-distributed":
        st.init_distributed(dist_backend="gloo")
        check_comm()
    elif mode == "user-group":
        torch.distributed.init_process_group("gloo")
    elif mode == "mpi-comm":  # under mpirun: the engine on MPI, strata.torch.comm's group made at its first use
        tiny_engine(30)
        assert not torch.distributed.is_initialized()
        check_comm()
        assert torch.distributed.is_initialized()
        return
    elif mode == "lonely":
        expect_failure(lambda: tiny_engine(2), "initialize() returned in a job whose other ranks never started")
    elif mode == "save-rank0":
        if "TORCHELASTIC_RUN_ID" in os.environ:
            # Under torchrun the job is joined first with a generous bound: the 3 s below are for the save, and
            # two ranks importing torch on a loaded machine can start seconds apart.
            st.init_distributed(timeout=datetime.timedelta(seconds=120))
        engine = tiny_engine(3)
        _kept.append(engine)
        train_steps(engine, 2)
        if engine.global_rank == 0:
            expect_failure(lambda: engine.save_checkpoint(rest[0], sync=True),
                           "save_checkpoint on rank 0 alone returned")
        return
    else:
        raise SystemExit(f"unknown mode {mode}")
    sys.argv = [sys.argv[0], *rest]
    torch_ranks_worker.main()


if __name__ == "__main__":
    main()
