"""A step rolled back after a real failing NVMe write, fed again through
strata.torch (Note [Feeding undone steps again] in strata/_torch_engine.py,
Note [Atomic steps] in docs/engine.md).

With overlap on (the default) step t's update is written while step t + 1
computes, so a write of step t that fails is found at step t + 1's commit
point and every rank goes back to the state after step t - 1: two steps are
undone. train_batch() (its own retry, or the caller's next call) replays
step t from the micro-batches it kept, then step t + 1; a loop of its own is
told which steps to feed again. The write fails for real: the swap file is
made immutable (chattr +i: EPERM), or where that is not possible the
process's file-size limit fails it (EFBIG). Every test compares each step's
loss, bit for bit, with a run that never failed, overlap on and off."""

import glob
import os
import resource
import signal
import subprocess

import pytest
import torch

import strata
import strata.torch as st
from test_torch_frontend import config, make_lm
from test_torch_train_batch import InputsOf, MicroBatch, lm_ids, next_token_loss

STEPS = 5
FAILING = 3  # the step whose update's write fails


def step_batches(step):
    """Step `step`'s (1-based) two micro-batches."""
    return [MicroBatch(lm_ids((step - 1) * 2 + k)) for k in range(2)]


def loss_fn(logits, mb):
    return next_token_loss(logits, mb.ids)


def make_engine(folder, overlap):
    """Stage 2 with the optimizer state on NVMe, under a torch lr scheduler whose lr changes every step (a step
    fed again with another step's lr would show in the losses)."""
    os.makedirs(folder, exist_ok=True)
    engine, _, _, _ = st.initialize(
        model=InputsOf(make_lm()), config=config(2, "nvme", "none", folder, overlap=overlap),
        lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + s)))
    applied = {}  # step -> loss of every applied finish_step (a step fed again overwrites its entry)
    real = engine._engine.finish_step

    def finish_step():
        outcome = real()
        if outcome["outcome"] == "applied":
            applied[outcome["metrics"]["step"]] = outcome["metrics"]["loss"]
        return outcome

    engine._engine.finish_step = finish_step
    return engine, applied


@pytest.fixture(scope="module")
def clean_losses(tmp_path_factory):
    """{step: loss} of runs that never failed, by overlap."""
    out = {}
    for overlap in (True, False):
        engine, applied = make_engine(str(tmp_path_factory.mktemp("clean")), overlap)
        for step in range(1, STEPS + 1):
            engine.train_batch(step_batches(step), loss_fn=loss_fn)
        out[overlap] = (applied, engine.get_lr())
    return out


class FailingSwapWrites:
    """Every write to the engine's swap files under `folder` fails for real while on: the files are made
    immutable (chattr +i; the kernel refuses writes to an immutable file with EPERM, even through a file
    descriptor opened before), or, where this process cannot set the flag (not root, or a file system
    without it), the process's file-size limit is lowered to 4 KiB with SIGXFSZ ignored (EFBIG)."""

    def __init__(self, folder):
        self.folder = folder
        self.files = []
        self.limit = None
        probe = os.path.join(folder, "immutable-probe")
        with open(probe, "w"):
            pass
        self.immutable = subprocess.run(["chattr", "+i", probe], capture_output=True).returncode == 0
        if self.immutable:
            subprocess.run(["chattr", "-i", probe], check=True)
        os.remove(probe)
        self.errno_text = "Operation not permitted" if self.immutable else "File too large"

    def on(self):
        if self.immutable:
            self.files = glob.glob(os.path.join(self.folder, "**", "swap.bin"), recursive=True)
            assert self.files, f"no swap file under {self.folder}"
            for f in self.files:
                subprocess.run(["chattr", "+i", f], check=True)
        else:
            self.signal = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
            self.limit = resource.getrlimit(resource.RLIMIT_FSIZE)
            resource.setrlimit(resource.RLIMIT_FSIZE, (4096, self.limit[1]))

    def off(self):
        for f in self.files:
            subprocess.run(["chattr", "-i", f], check=True)
        self.files = []
        if self.limit is not None:
            resource.setrlimit(resource.RLIMIT_FSIZE, self.limit)
            signal.signal(signal.SIGXFSZ, self.signal)
            self.limit = None


@pytest.fixture
def failing_writes(tmp_path):
    folder = str(tmp_path / "nvme")
    os.makedirs(folder)
    writes = FailingSwapWrites(folder)
    yield writes
    writes.off()


def off_after_a_rollback(engine, writes):
    """The failing writes end as soon as a step is not applied (so that train_batch()'s own retry can
    succeed): the engine's finish_step, observed."""
    observed = engine._engine.finish_step

    def finish_step():
        outcome = observed()
        if outcome["outcome"] != "applied":
            writes.off()
        return outcome

    engine._engine.finish_step = finish_step


def run_to_the_failing_step(engine, writes):
    """Steps before FAILING, every update committed (synchronize: the failing writes are then step FAILING's
    own, whatever the timing), then the writes fail from step FAILING's update on."""
    for step in range(1, FAILING):
        engine.train_batch(step_batches(step), loss_fn=loss_fn)
    engine.synchronize()
    writes.on()


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap_on", "overlap_off"])
@pytest.mark.parametrize("retry", ["train_batch_retries", "callers_call"])
def test_train_batch_after_a_real_failing_write_gives_the_losses_of_a_run_that_never_failed(
        overlap, retry, failing_writes, clean_losses):
    engine, applied = make_engine(failing_writes.folder, overlap)
    off_after_a_rollback(engine, failing_writes)
    run_to_the_failing_step(engine, failing_writes)
    undone = f"steps {FAILING} and {FAILING + 1} are undone" if overlap else f"is step {FAILING} again"
    for step in range(FAILING, STEPS + 1):
        if retry == "train_batch_retries":
            engine.train_batch(step_batches(step), loss_fn=loss_fn, retries=1)
            continue
        try:
            engine.train_batch(step_batches(step), loss_fn=loss_fn, retries=0)
        except strata.Unavailable as error:
            # Overlap on: found at the next step's commit point, which is undone with it.
            assert step == (FAILING + 1 if overlap else FAILING)
            message = str(error)
            assert failing_writes.errno_text in message and "swap" in message, message
            assert f"the state is the one after step {FAILING - 1}" in message, message
            assert undone in message, message
            if overlap:
                assert f"train_batch() kept step {FAILING}'s micro-batches and replays them" in message, message
            assert engine.global_steps == FAILING - 1
            engine.train_batch(step_batches(step), loss_fn=loss_fn, retries=0)  # the caller's retry
        else:
            assert step != (FAILING + 1 if overlap else FAILING), "the failing write was not found"
    want, want_lr = clean_losses[overlap]
    assert applied == want
    assert engine.global_steps == STEPS
    assert engine.get_lr() == want_lr


def test_a_loop_of_its_own_is_told_which_steps_to_feed_again(failing_writes, clean_losses):
    """DeepSpeed's loop (engine(...), backward, step()) with overlap on: the error names both undone steps and
    the batches to feed; global_steps says where the state is; feeding them gives the clean losses."""
    engine, applied = make_engine(failing_writes.folder, True)
    for step in range(1, FAILING):
        engine.train_batch(step_batches(step), loss_fn=loss_fn)
    engine.synchronize()
    failing_writes.on()

    def manual_step(step):
        for mb in step_batches(step):
            engine.backward(loss_fn(engine(mb), mb))
            engine.step()

    manual_step(FAILING)
    with pytest.raises(strata.Unavailable) as raised:
        manual_step(FAILING + 1)
    failing_writes.off()
    message = str(raised.value)
    assert f"steps {FAILING} and {FAILING + 1} are undone" in message, message
    assert f"run step {FAILING}'s batches again, then the step in progress's (step {FAILING} ran outside " \
           f"train_batch()" in message, message
    assert engine.global_steps == FAILING - 1
    assert engine.get_lr() == [pytest.approx(1e-2 / FAILING)] * len(engine.get_lr())  # step FAILING's lr again
    for step in range(FAILING, STEPS + 1):
        manual_step(step)
    assert applied == clean_losses[True][0]


def test_train_batch_does_not_retry_a_step_it_did_not_keep(failing_writes, clean_losses):
    """The step before was the caller's loop's: train_batch() cannot replay it and raises instead of training
    this step's batches as that step; the caller's next call is taken as that step, as the error says."""
    engine, applied = make_engine(failing_writes.folder, True)
    off_after_a_rollback(engine, failing_writes)
    for step in range(1, FAILING):
        engine.train_batch(step_batches(step), loss_fn=loss_fn)
    engine.synchronize()
    failing_writes.on()
    for mb in step_batches(FAILING):
        engine.backward(loss_fn(engine(mb), mb))
        engine.step()
    with pytest.raises(strata.Unavailable, match=f"run step {FAILING}'s batches again"):
        engine.train_batch(step_batches(FAILING + 1), loss_fn=loss_fn, retries=3)
    assert engine.global_steps == FAILING - 1
    for step in range(FAILING, STEPS + 1):
        engine.train_batch(step_batches(step), loss_fn=loss_fn)
    assert applied == clean_losses[True][0]


def test_a_step_undone_at_synchronize_is_replayed_by_the_next_train_batch(failing_writes, clean_losses):
    """The commit point of the last step outside a step: synchronize() rolls it back and says so
    (Unavailable, global_steps back one); the next train_batch() replays it before its own."""
    engine, applied = make_engine(failing_writes.folder, True)
    run_to_the_failing_step(engine, failing_writes)
    engine.train_batch(step_batches(FAILING), loss_fn=loss_fn)
    with pytest.raises(strata.Unavailable) as raised:
        engine.synchronize()
    failing_writes.off()
    message = str(raised.value)
    assert f"step {FAILING} is undone" in message and "replays them before its own step" in message, message
    assert engine.global_steps == FAILING - 1
    for step in range(FAILING + 1, STEPS + 1):
        engine.train_batch(step_batches(step), loss_fn=loss_fn)
    assert applied == clean_losses[True][0]
    assert engine.get_lr() == clean_losses[True][1]
