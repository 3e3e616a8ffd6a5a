"""strata.torch's device branch without a GPU (Note [The device strata.torch
trains on] in python/strata/_torch_device.py, Note [Torch's stream and the
engine's] in python/src/torch_stream_order.h).

On a GPU torch only queues its kernels: the engine must order them by
stream waits and recorded completions, never by host waits. The recorded
stand-in plays that order on the cpu device (torch's "streams" are handles,
each a stream of the cpu device the engine waits and records on) and logs
every wait and record; these tests check the log, that nothing reads a
value on the host inside the step but the step's loss once, and that the
branch trains bit-identically to the cpu branch. The device choice and the
memory split are plain arithmetic, tested here; the GPU run is the
prepared call of docs/gpu-results.md."""
import contextlib

import pytest
import torch

import strata
import strata.torch as st
from strata import _native
from strata._torch_device import (CUDA_ENVIRONMENT, TorchDevice, choose_device, move_buffers,
                                  prepare_cuda_environment, recorded_device_for_tests, split_free_memory)
from strata.engine import TensorSpec, describe_layers
from strata.errors import FailedPrecondition, InvalidArgument, Unavailable
from test_torch_frontend import config, decay_groups, lm_loss, make_lm, train_engine

_GIB = 1 << 30


def _run(cfg, steps=3):
    """(engine, losses, masters) of a run, its engine closed (swap folders removed) but still answering."""
    model = make_lm()
    engine, _, _, _ = st.initialize(model=model, model_parameters=decay_groups(model, 0.1), config=cfg)
    losses = train_engine(engine, lm_loss, steps)
    masters = engine.master_parameters()
    log = engine._engine.stream_order_log() if engine._device.stream_order == "recorded" else None
    engine.close()
    return engine, losses, masters, log


class _HostReads:
    """Counts tensor values read on the host (float(t), t.item(), t.tolist()): on a GPU each waits for the
    queue."""

    def __init__(self, monkeypatch):
        self.count = 0
        for name in ("__float__", "item", "tolist"):
            original = getattr(torch.Tensor, name)

            def counted(tensor, *args, _original=original, **kwargs):
                self.count += 1
                return _original(tensor, *args, **kwargs)
            monkeypatch.setattr(torch.Tensor, name, counted)


PLACEMENTS = [(0, "none", "none"), (2, "cpu", "none"), (3, "cpu", "cpu"), (3, "nvme", "nvme")]


@pytest.mark.parametrize("stage,optimizer,params", PLACEMENTS, ids=[f"stage{s}-{o}-{p}" for s, o, p in PLACEMENTS])
def test_the_device_order_trains_bit_identically_to_the_cpu_branch(stage, optimizer, params, tmp_path):
    cfg = config(stage, optimizer, params, tmp_path)
    _, expected_losses, expected_masters, _ = _run(cfg)
    with recorded_device_for_tests() as device:
        engine, losses, masters, log = _run(cfg)
    assert losses == expected_losses
    assert set(masters) == set(expected_masters)
    for name in masters:
        assert torch.equal(masters[name], expected_masters[name]), name
    assert engine.device == device.torch_device
    # Every layer's use was ordered on torch's stream, in both passes: a wait before, a record after.
    layers = len(engine._layers)
    for what in [f"layer {i} {p}" for i in range(layers) for p in ("forward", "backward")]:
        ops = [op for op, _, w in log if w == what]
        assert ops and ops[0] == "wait" and ops[-1] == "record", (what, ops)
        assert ops.count("wait") == ops.count("record"), (what, ops)
    assert {stream for _, stream, _ in log} == {device.current_stream()}


@pytest.mark.parametrize("order", ["host", "recorded"])
def test_the_exposed_optimizer_wait_is_measured_where_torch_waits(order):
    """Note [Who waits for an acquired layer]: strata.torch's engine has no model stream of its own, so each
    acquire names who waits for the layer (the host on the cpu device, torch's stream on a GPU, here the
    stand-in's). With the optimizer overlapped, the next step's first forward reaches a layer whose CPU step
    (4M parameters of Adam) is still running: that wait is reported, by layer. Before the waiter was named it
    read 0 on this path."""
    class Wide(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList(torch.nn.Linear(2048, 2048) for _ in range(2))

        def forward(self, x):
            for layer in self.layers:
                x = torch.tanh(layer(x))
            return x

    cfg = config(1, "cpu", "none", accum=1)
    cfg["strata"]["device_memory"] = "256MiB"
    context = recorded_device_for_tests() if order == "recorded" else contextlib.nullcontext()
    with context:
        torch.manual_seed(3)
        model = Wide()
        engine, _, _, _ = st.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        exposed, by_layer = 0.0, 0.0
        for _ in range(4):
            loss = engine(torch.randn(1, 2048)).square().mean()
            engine.backward(loss)
            engine.step()
            exposed += engine.metrics["wait_optimizer_ms"]
            by_layer += sum(ms for _, ms in engine.metrics["optimizer_waits"])
        engine.close()
    assert exposed > 0
    assert by_layer == pytest.approx(exposed, abs=1e-6)


def test_a_step_under_a_stream_the_user_selects_is_ordered_on_that_stream(tmp_path):
    with recorded_device_for_tests() as device:
        model = make_lm()
        engine, _, _, _ = st.initialize(model=model, model_parameters=decay_groups(model, 0.1),
                                        config=config(3, "cpu", "cpu", tmp_path))
        train_engine(engine, lm_loss, 1)
        before = len(engine._engine.stream_order_log())
        with device.stream(0xBEEF):  # torch.cuda.stream(s) on a GPU
            train_engine(engine, lm_loss, 1, first_batch=2)
        log = engine._engine.stream_order_log()[before:]
    assert log and {stream for _, stream, _ in log} == {0xBEEF}


def test_inside_a_step_only_the_steps_loss_is_read_on_the_host(monkeypatch, tmp_path):
    """The cpu branch reads each micro-batch's loss as it ends; the device branch sums them on the device and
    reads the sum once, at the step's last micro-batch (the step waits for the queue there anyway)."""
    accum, steps = 4, 2
    cfg = config(3, "cpu", "cpu", tmp_path, accum=accum)
    cpu_engine, _, _, _ = _run(cfg, steps=1)
    with recorded_device_for_tests():
        model = make_lm()
        engine, _, _, _ = st.initialize(model=model, model_parameters=decay_groups(model, 0.1), config=cfg)
        reads = _HostReads(monkeypatch)
        losses = []
        for index in range(steps * accum):
            loss = lm_loss(engine, index)
            engine.backward(loss)
            engine.step()
        losses.append(engine.metrics["loss"])
        monkeypatch.undo()
    assert reads.count == steps, f"{reads.count} host reads in {steps} steps of {accum} micro-batches"
    assert engine._step_loss.host_reads == steps
    cpu_reads = cpu_engine._step_loss.host_reads
    assert cpu_reads == accum  # the cpu branch: one per micro-batch


def test_an_abandoned_step_drops_its_losses_on_the_device(tmp_path):
    """A forward that raises part-way through a step gives the step up (Engine.abandon_step): the losses its
    earlier micro-batches summed on the device go with it, and the repeated step reports a clean run's loss."""
    cfg = config(2, "cpu", "none", tmp_path)
    with recorded_device_for_tests():
        model = make_lm()
        engine, _, _, _ = st.initialize(model=model, model_parameters=decay_groups(model, 0.1), config=cfg)
        engine.backward(lm_loss(engine, 0))
        engine.step()
        assert engine._step_loss._pending is not None  # the first micro-batch's loss, on the device
        with pytest.raises(IndexError):
            engine(torch.full((2, 8), 10 ** 6, dtype=torch.long))  # an id past the vocabulary
        assert engine._step_loss._pending is None
        # Torch's queued work on the given-up step ran out before the engine zeroed and freed what it touched.
        assert ("drain", 0, "the step given up") in engine._engine.stream_order_log()
        losses = train_engine(engine, lm_loss, 1)
        engine.close()
    _, expected, _, _ = _run(cfg, steps=1)
    assert losses == expected


# -- the device choice and the memory split ------------------------------------------------------
def _resolved(device="auto"):
    return strata.config.load({"train_micro_batch_size_per_gpu": 1, "strata": {"device": device}})


def test_the_device_follows_the_config_and_the_model():
    model = make_lm()
    assert choose_device(_resolved("cpu"), model).stream_order == "host"
    if not torch.cuda.is_available():
        chosen = choose_device(_resolved("auto"), model)
        assert (chosen.engine_kind, chosen.stream_order, chosen.torch_device) == ("cpu", "host", torch.device("cpu"))
        with pytest.raises(Unavailable, match='strata.device is "cuda" but torch sees no GPU'):
            choose_device(_resolved("cuda"), model)


def test_a_model_on_another_device_is_refused_by_parameter():
    class OnMeta(torch.nn.Module):  # a parameter's device as the check reads it, without a GPU
        def __init__(self, device):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.empty(2, device="meta"))
            self._fake = torch.device(device)

        def named_parameters(self, *args, **kwargs):
            class P:
                device = self._fake
            yield "weight", P()
    with pytest.raises(InvalidArgument, match="parameter 'weight' is on xla:0"):
        choose_device(_resolved(), OnMeta("xla:0"))
    with pytest.raises(InvalidArgument, match="strata.device is \"cpu\" but parameter 'weight' is on cuda:0"):
        choose_device(_resolved("cpu"), OnMeta("cuda:0"))


def test_the_engine_cap_leaves_torch_its_reserve():
    # An 80 GiB GPU with 79 GiB free: 10 % (8 GiB) left to torch.
    cap, words = split_free_memory(79 * _GIB, 80 * _GIB)
    assert cap == 71 * _GIB
    assert "71.00 GiB = 79.00 GiB free of 80.00 GiB less 8.00 GiB left to torch" in words
    # A 16 GiB GPU: the 2 GiB floor.
    assert split_free_memory(15 * _GIB, 16 * _GIB)[0] == 13 * _GIB
    with pytest.raises(Unavailable, match="1.00 GiB free of 16.00 GiB: less than the 2.00 GiB left to torch"):
        split_free_memory(1 * _GIB, 16 * _GIB)


def test_the_native_engine_refuses_a_device_it_cannot_make():
    cfg = '{"train_micro_batch_size_per_gpu": 1}'
    described = describe_layers([("layer0", [TensorSpec("w", (4,), "float32")])])
    with pytest.raises(InvalidArgument, match="device 'gpu' is not cpu or cuda"):
        _native.DrivenEngine.create(None, cfg, described, 0, "local", "", "", "gpu", 0, "host")
    with pytest.raises(InvalidArgument, match="stream order 'device' does not go with the cpu device"):
        _native.DrivenEngine.create(None, cfg, described, 0, "local", "", "", "cpu", 0, "device")
    with pytest.raises(InvalidArgument, match="device ordinal -1"):
        _native.DrivenEngine.create(None, cfg, described, 0, "local", "", "", "cuda", -1, "device")
    host = _native.DrivenEngine.create(None, cfg, described, 0, "local", "", "", "cpu", 0, "host")
    with pytest.raises(FailedPrecondition, match="not made with stream_order 'recorded'"):
        host.stream_order_log()
    if not torch.cuda.is_available():  # no GPU here: making the cuda device fails, naming why
        with pytest.raises(strata.errors.StrataError, match="cuda"):
            _native.DrivenEngine.create(None, cfg, described, 0, "local", "", "", "cuda", 0, "device")


def test_the_stand_in_is_not_a_users_device():
    """A TorchDevice is chosen by initialize, never given: the stand-in exists only inside the test block."""
    with recorded_device_for_tests() as device:
        assert choose_device(_resolved("cpu"), make_lm()) is device
    assert choose_device(_resolved("cpu"), make_lm()) is not device
    assert isinstance(device, TorchDevice)


def test_buffers_follow_the_training_device():
    """DeepSpeed moves the module; the engine holds the parameters, so initialize moves the buffers."""
    model = torch.nn.BatchNorm1d(4)
    model.register_buffer("absent", None)
    move_buffers(model, TorchDevice(torch.device("meta"), "cpu", 0, "host"))  # any other device than the CPU
    assert {name: b.device.type for name, b in model.named_buffers()} == {
        "running_mean": "meta", "running_var": "meta", "num_batches_tracked": "meta"}
    assert model.absent is None and model.weight.device.type == "cpu"  # the parameters are the engine's


def test_the_cuda_environment_is_set_unless_the_user_set_it(monkeypatch):
    for name in CUDA_ENVIRONMENT:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")  # the user's, e.g. for Megatron's overlap
    in_time = prepare_cuda_environment()
    import os
    assert os.environ["CUDA_MODULE_LOADING"] == "EAGER"
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    assert in_time == (not torch.cuda.is_initialized())


def test_a_launchers_rank_takes_its_local_ranks_gpu(monkeypatch):
    """As DeepSpeed's engine: the GPU of LOCAL_RANK (modulo the GPUs); without a launcher, torch's current one."""
    from strata import _torch_device
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for name in ("LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"):
        monkeypatch.delenv(name, raising=False)
    assert _torch_device._launcher_gpu() is None
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert _torch_device._launcher_gpu() == 1
    monkeypatch.setenv("LOCAL_RANK", "-1")
    with pytest.raises(Exception, match="LOCAL_RANK"):
        _torch_device._launcher_gpu()
