"""engine.train_batch(): one optimizer step from its micro-batches, with the
step repeated when the engine rolls it back (docs/torch.md, "train_batch")."""

import pytest
import torch

import strata
import strata.torch as st
from test_torch_frontend import MICRO, SEQ, VOCAB, config, lm_loss, make_lm, train_engine


def lm_ids(index):
    """The token ids lm_loss(model, index) trains on."""
    g = torch.Generator().manual_seed(2000 + index)
    return torch.randint(0, VOCAB, (MICRO, SEQ + 1), generator=g)


def next_token_loss(logits, ids):
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


class LossOut(torch.nn.Module):
    """The LM returning a Hugging Face-style output with .loss."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, ids):
        class Output:
            pass

        out = Output()
        out.loss = next_token_loss(self.lm(ids[:, :-1]), ids)
        return out


def train_with_train_batch(engine, steps):
    """The same micro-batches as train_engine(engine, lm_loss, steps), through train_batch()."""
    losses = []
    for step in range(steps):
        micro = [lm_ids(step * 2 + k) for k in range(2)]
        # The module sees the inputs; the loss function the whole micro-batch.
        mean = engine.train_batch([MicroBatch(ids) for ids in micro],
                                  loss_fn=lambda logits, mb: next_token_loss(logits, mb.ids))
        losses.append(engine.metrics["loss"])
        assert mean == pytest.approx(engine.metrics["loss"], rel=1e-6)
    return losses


class MicroBatch:
    """A micro-batch object that is neither a dict nor a tuple: passed to the module as it is."""

    def __init__(self, ids):
        self.ids = ids


class InputsOf(torch.nn.Module):
    """The LM taking a MicroBatch (its inputs are the ids but the last)."""

    def __init__(self, lm):
        super().__init__()
        self.lm = lm

    def forward(self, mb):
        return self.lm(mb.ids[:, :-1])


def test_train_batch_equals_the_deepspeed_loop():
    manual, _, _, _ = st.initialize(model=make_lm(), config=config(2, "cpu"))
    reference = train_engine(manual, lm_loss, 3)
    batched, _, _, _ = st.initialize(model=InputsOf(make_lm()), config=config(2, "cpu"))
    assert train_with_train_batch(batched, 3) == reference
    # Hugging Face style: the module returns an output with .loss, micro-batches as tuples, no loss_fn.
    hf, _, _, _ = st.initialize(model=LossOut(make_lm()), config=config(2, "cpu"))
    losses = []
    for step in range(3):
        hf.train_batch([(lm_ids(step * 2 + k),) for k in range(2)])
        losses.append(hf.metrics["loss"])
    assert losses == reference
    # data_iter: the micro-batches drawn from an iterator, two per step.
    it_engine, _, _, _ = st.initialize(model=LossOut(make_lm()), config=config(2, "cpu"))
    data = iter([{"ids": lm_ids(i)} for i in range(6)])
    losses = []
    for _ in range(3):
        it_engine.train_batch(data_iter=data)
        losses.append(it_engine.metrics["loss"])
    assert losses == reference


def fail_steps_once(engine, failing):
    """The engine's finish_step drops the steps numbered in `failing` (1-based, the first time each is
    finished) as a rolled-back step is dropped on every rank: Engine::abandon_step undoes the step in
    progress (gradients discarded, counters back) and the outcome says "rolled_back"."""
    native = engine._engine
    real = native.finish_step
    seen = set()

    def finish_step():
        step = engine.global_steps + 1
        if step in failing and step not in seen:
            seen.add(step)
            native._native.abandon_step()
            return {"outcome": "rolled_back", "reason": "injected: an NVMe write of the optimizer state failed",
                    "state_step": step - 1, "metrics": None}
        return real()

    native.finish_step = finish_step
    return seen


def test_a_rolled_back_step_runs_again_and_the_losses_equal_a_run_that_never_failed():
    clean, _, _, _ = st.initialize(model=InputsOf(make_lm()), config=config(2, "cpu"))
    reference = train_with_train_batch(clean, 4)
    engine, _, _, _ = st.initialize(model=InputsOf(make_lm()), config=config(2, "cpu"))
    failed = fail_steps_once(engine, {2, 3})
    assert train_with_train_batch(engine, 4) == reference
    assert failed == {2, 3}
    assert engine.global_steps == 4


def test_retries_run_out_with_the_engines_error_and_the_step_can_run_again():
    engine, _, _, _ = st.initialize(model=InputsOf(make_lm()), config=config(2, "cpu"))
    fail_steps_once(engine, {1})
    micro = [MicroBatch(lm_ids(k)) for k in range(2)]
    loss_fn = lambda logits, mb: next_token_loss(logits, mb.ids)  # noqa: E731
    with pytest.raises(strata.Unavailable, match="rolled back: injected"):
        engine.train_batch(micro, loss_fn=loss_fn, retries=0)
    assert engine.global_steps == 0
    engine.train_batch(micro, loss_fn=loss_fn, retries=0)  # the step again, from its first micro-batch
    assert engine.global_steps == 1


@pytest.mark.parametrize("kwargs,error,match", [
    ({"batches": [1, 2], "retries": -1}, ValueError, r"retries=-1"),
    ({"batches": [1, 2], "retries": True}, ValueError, r"retries=True"),
    ({"batches": [1, 2], "retries": 1001}, ValueError, r"0\.\.1000"),
    ({}, ValueError, "one of the two"),
    ({"batches": [1, 2], "data_iter": iter([])}, ValueError, "one of the two"),
    ({"batches": [1, 2, 3]}, ValueError, r"a list of the step's 2 micro-batches .* of 3"),
    ({"batches": (1, 2)}, ValueError, r"not tuple"),
    ({"data_iter": iter([1])}, ValueError, r"ended after 1 of the step's 2"),
])
def test_bad_arguments_are_refused_naming_them(kwargs, error, match):
    engine, _, _, _ = st.initialize(model=make_lm(), config=config(2, "cpu"))
    with pytest.raises(error, match=match):
        engine.train_batch(**kwargs)


def test_an_output_without_a_loss_asks_for_loss_fn_and_mid_step_is_refused():
    engine, _, _, _ = st.initialize(model=make_lm(), config=config(2, "cpu"))
    with pytest.raises(ValueError, match="pass loss_fn"):
        engine.train_batch([(lm_ids(0)[:, :-1],), (lm_ids(1)[:, :-1],)])
    # The failed forward handed everything back: a DeepSpeed-style micro-batch, then train_batch mid-step.
    engine.backward(lm_loss(engine, 0))
    engine.step()
    with pytest.raises(strata.FailedPrecondition, match="in the middle of a step"):
        engine.train_batch([(lm_ids(0),), (lm_ids(1),)])


@pytest.fixture
def file_size_limit():
    """set(n): the kernel fails this process's writes at offsets >= n bytes with EFBIG (RLIMIT_FSIZE;
    SIGXFSZ ignored so that the write returns the error instead of ending the process): a real I/O
    error under the engine, no test seam. Lifted (and the signal restored) after the test."""
    import resource
    import signal
    previous_signal = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    previous_limit = resource.getrlimit(resource.RLIMIT_FSIZE)

    def set_limit(n):  # None: lifted again
        resource.setrlimit(resource.RLIMIT_FSIZE, (previous_limit[0] if n is None else n, previous_limit[1]))

    yield set_limit
    resource.setrlimit(resource.RLIMIT_FSIZE, previous_limit)
    signal.signal(signal.SIGXFSZ, previous_signal)


def test_a_real_nvme_write_failure_rolls_the_step_back_and_its_repeat_gives_the_clean_losses(tmp_path,
                                                                                             file_size_limit):
    # Stage 3 with optimizer state and parameters on NVMe, updates inside the step (overlap off: the failing
    # writes are the step's own). The swap files are preallocated: with the limit at 4 KiB every write-back
    # past the first 4 KiB fails with EFBIG.
    for name in ("clean", "faulty"):
        (tmp_path / name).mkdir()
    clean, _, _, _ = st.initialize(model=InputsOf(make_lm()),
                                   config=config(3, "nvme", "nvme", tmp_path / "clean", overlap=False))
    reference = train_with_train_batch(clean, 4)
    engine, _, _, _ = st.initialize(model=InputsOf(make_lm()),
                                    config=config(3, "nvme", "nvme", tmp_path / "faulty", overlap=False))
    loss_fn = lambda logits, mb: next_token_loss(logits, mb.ids)  # noqa: E731
    losses = []
    for step in range(4):
        micro = [MicroBatch(lm_ids(step * 2 + k)) for k in range(2)]
        if step == 2:
            file_size_limit(4096)
            with pytest.raises(strata.Unavailable, match=r"rolled back.*(NVMe|swap write).*"):
                engine.train_batch(micro, loss_fn=loss_fn, retries=0)
            file_size_limit(None)
            assert engine.global_steps == 2  # dropped: the step runs again from its first micro-batch
        engine.train_batch(micro, loss_fn=loss_fn, retries=0)
        losses.append(engine.metrics["loss"])
    assert losses == reference
    assert engine.global_steps == 4


class NormOverLossOut(LossOut):
    """Parameters of the root unit itself (a final norm) under an output object the hooks cannot look into."""

    def __init__(self, lm):
        super().__init__(lm)
        self.norm = torch.nn.LayerNorm(VOCAB)

    def forward(self, ids):
        out = super().forward(ids)
        out.loss = out.loss + self.norm(self.lm(ids[:, :-1])).square().mean() * 1e-3
        return out


@pytest.mark.parametrize("stage,placement", [(0, "none"), (3, "cpu")])
def test_root_unit_is_held_for_backward_when_the_loss_comes_in_an_object(stage, placement):
    """The root unit is acquired for backward by engine.backward itself: no hook on the output is needed."""
    losses = []
    for cfg in (config(0), config(stage, placement, placement if stage == 3 else "none")):
        engine, _, _, _ = st.initialize(model=NormOverLossOut(make_lm()), config=cfg,
                                        units=lambda name, module: name.startswith("lm.blocks."))
        assert engine._units[-1].layers  # the root unit owns layers (wte, wpe, ln_f, norm)
        losses.append(train_engine(engine, lambda m, i: m(lm_ids(i)).loss, 2))
    assert losses[0] == losses[1]
