"""Activation checkpoints in host memory (activation_checkpointing.cpu_checkpointing; Note [Activation
checkpoints in host memory] in python/strata/_torch_activation_offload.py) and DeepSpeed's checkpointing API
(strata.torch.checkpointing).

On a GPU a checkpoint's inputs go to pinned host memory on a copy stream of their own and come back ahead of
their recompute. Without a GPU the recorded stand-in plays that order on the cpu device (each copy a clone,
every copy and wait logged): these tests check the order, that the inputs leave the "device" after forward,
that the pinned buffers are reused after the first step, and that training is bit-identical with the inputs
moved, with torch's checkpoint and without checkpointing. The GPU run is docs/gpu-results.md's call."""
import contextlib
import gc
import os
import warnings
import weakref

import pytest
import torch

import strata.torch as st
from strata import _torch_checkpointing
from strata._torch_checkpointing import recorded_offload_for_tests
from strata.errors import InvalidArgument, Unsupported
from strata.torch._names import NotProvided
from test_torch_frontend import TinyLM, config, lm_loss, train_engine


@pytest.fixture(autouse=True)
def _settings_cleared():
    """The settings are the process's (as DeepSpeed's): each test starts and ends with none."""
    _torch_checkpointing._settings = None
    yield
    _torch_checkpointing._settings = None


class CheckpointedLM(TinyLM):
    """TinyLM whose blocks run through `checkpoint` (strata.torch.checkpointing's, or torch's)."""

    def __init__(self, how, layers=3):
        super().__init__(layers=layers)
        self.how = how

    def forward(self, ids):
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))
        for block in self.blocks:
            if self.how == "strata":
                x = st.checkpointing.checkpoint(block, x)
            elif self.how == "torch":
                x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=True)
            else:
                x = block(x)
        return self.head(self.ln_f(x))


def _with_section(cfg, **section):
    cfg = dict(cfg)
    cfg["activation_checkpointing"] = section
    return cfg


def _train(how, cfg, steps=3):
    torch.manual_seed(5)
    model = CheckpointedLM(how)
    engine, _, _, _ = st.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    losses = train_engine(engine, lm_loss, steps)
    masters = engine.master_parameters()
    engine.close()
    return losses, masters


@pytest.mark.parametrize("stage,offload", [(0, "none"), (2, "cpu"), (3, "cpu")], ids=["stage0", "stage2-cpu",
                                                                                      "stage3-cpu"])
def test_inputs_in_host_memory_train_bit_identically(stage, offload):
    plain_losses, plain_masters = _train("none", config(stage, offload, offload if stage == 3 else "none"))
    torch_losses, _ = _train("torch", config(stage, offload, offload if stage == 3 else "none"))
    with recorded_offload_for_tests() as offload_record:
        cfg = _with_section(config(stage, offload, offload if stage == 3 else "none"), cpu_checkpointing=True)
        losses, masters = _train("strata", cfg)
    assert losses == torch_losses == plain_losses and losses[-1] < losses[0]
    assert all(torch.equal(masters[n], plain_masters[n]) for n in plain_masters)
    # 3 steps x 2 micro-batches x 3 blocks, one input each, out and back once
    assert [kind for kind, _ in offload_record.copies.log].count("to_host") == 18
    assert [kind for kind, _ in offload_record.copies.log].count("to_device") == 18


def test_inputs_go_out_in_forward_and_come_back_one_checkpoint_ahead_of_their_recompute():
    with recorded_offload_for_tests() as offload_record:
        _train("strata", _with_section(config(3, "cpu", "cpu"), cpu_checkpointing=True), steps=1)
    log = offload_record.copies.log
    first = log[0][1]
    micro_batch = [(kind, checkpoint - first) for kind, checkpoint in log[:9]]
    # Forward: out as each block is called. Backward: the last block's inputs, then (before its recompute
    # waits) the block before's, so that copy runs under this block's recompute and backward; and so on.
    assert micro_batch == [("to_host", 0), ("to_host", 1), ("to_host", 2),
                           ("to_device", 2), ("to_device", 1), ("wait", 2),
                           ("to_device", 0), ("wait", 1),
                           ("wait", 0)]
    assert [(kind, checkpoint - first - 3) for kind, checkpoint in log[9:18]] == micro_batch  # the next micro-batch
    assert len(log) == 18 and "synchronize" not in {kind for kind, _ in log}


def test_offloaded_inputs_leave_the_device_and_pinned_buffers_are_reused():
    def forward_keeping(how, offload):
        torch.manual_seed(1)
        blocks = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(3))
        x = torch.randn(4, 8, requires_grad=True)
        inputs = []
        h = x
        for block in blocks:
            h = block(h) if how == "none" else st.checkpointing.checkpoint(block, h)
            inputs.append(weakref.ref(h))
        out = h.sum()
        del h
        gc.collect()
        alive = sum(ref() is not None for ref in inputs[:-1])  # the blocks' inputs but the first (x)
        out.backward()
        return alive, x.grad.clone(), [b.weight.grad.clone() for b in blocks]

    st.checkpointing.configure(checkpoint_in_cpu=True)
    _, plain_grad, plain_weights = forward_keeping("none", None)
    with recorded_offload_for_tests() as offload_record:
        alive, grad, weights = forward_keeping("strata", offload_record)
        made = offload_record.stats()["pinned_buffers"]
        for _ in range(2):
            forward_keeping("strata", offload_record)
        stats = offload_record.stats()
    assert alive == 0  # nothing held them on the "device": their copies are in host memory
    assert torch.equal(grad, plain_grad) and all(torch.equal(a, b) for a, b in zip(weights, plain_weights))
    assert made == 3 and stats["pinned_buffers"] == 3  # steps after the first allocate nothing
    assert stats["offloaded_bytes"] == stats["fetched_bytes"] == 9 * 4 * 8 * 4


def test_without_cpu_checkpointing_inputs_stay_and_nothing_is_copied():
    with recorded_offload_for_tests() as offload_record:
        losses, _ = _train("strata", _with_section(config(0), cpu_checkpointing=False))
    assert offload_record.copies.log == []
    plain, _ = _train("none", config(0))
    assert losses == plain


def test_on_the_cpu_device_inputs_are_already_in_host_memory():
    st.checkpointing.configure(checkpoint_in_cpu=True)
    block = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    st.checkpointing.checkpoint(block, x).sum().backward()
    assert st.checkpointing.stats() == {}  # no copies made: the cpu device's tensors are host memory
    assert x.grad is not None and block.weight.grad is not None


def test_a_module_whose_inputs_need_no_gradient_still_learns():
    """torch's reentrant checkpoint leaves a block's parameters without a gradient when no input requires one
    (a frozen embedding before it, as with adapters); strata.torch's checkpoint does not."""
    torch.manual_seed(2)
    block = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)  # no gradient
    block(x).pow(2).sum().backward()
    expected = block.weight.grad.clone()
    block.weight.grad = None
    with recorded_offload_for_tests():
        st.checkpointing.configure(checkpoint_in_cpu=True)
        st.checkpointing.checkpoint(block, x).pow(2).sum().backward()
    assert torch.equal(block.weight.grad, expected)
    frozen = torch.nn.Linear(4, 4).requires_grad_(False)  # nothing to learn: no empty input, torch's rule
    assert not st.checkpointing.checkpoint(frozen, x).requires_grad


def test_synchronize_checkpoint_boundary_synchronizes_around_each_checkpoint():
    with recorded_offload_for_tests() as offload_record:
        _train("strata", _with_section(config(0), cpu_checkpointing=True, synchronize_checkpoint_boundary=True),
               steps=1)
    kinds = [kind for kind, _ in offload_record.copies.log]
    assert kinds.count("synchronize") == 2 * 3 * 2  # before and after each of 3 blocks, 2 micro-batches
    assert kinds[:3] == ["synchronize", "to_host", "synchronize"]


def test_configure_its_arguments_over_the_config_it_names(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text('{"train_micro_batch_size_per_gpu": 1, "activation_checkpointing": '
                    '{"cpu_checkpointing": true, "number_checkpoints": 4}}')
    assert not st.checkpointing.is_configured()
    st.checkpointing.configure(None, deepspeed_config=str(path))
    current = st.checkpointing.settings()
    assert st.checkpointing.is_configured() and current.cpu_checkpointing and current.number_checkpoints == 4
    st.checkpointing.configure(None, deepspeed_config=str(path), checkpoint_in_cpu=False, num_checkpoints=2)
    current = st.checkpointing.settings()
    assert not current.cpu_checkpointing and current.number_checkpoints == 2 and current.source == "configure()"
    # The script's configure wins over the config initialize is given, as DeepSpeed's.
    _train("none", _with_section(config(0), cpu_checkpointing=True), steps=1)
    assert not st.checkpointing.settings().cpu_checkpointing


def test_initialize_takes_the_config_section_and_drops_it_with_the_next_config():
    _train("none", _with_section(config(0), cpu_checkpointing=True), steps=1)
    assert st.checkpointing.is_configured() and st.checkpointing.settings().cpu_checkpointing
    assert st.checkpointing.settings().source == "the config"
    _train("none", config(0), steps=1)
    assert not st.checkpointing.is_configured() and not st.checkpointing.settings().cpu_checkpointing


def test_bad_configure_arguments_and_configs_are_refused_by_name(tmp_path):
    with pytest.raises(InvalidArgument, match=r"configure\(checkpoint_in_cpu='yes'\).*cpu_checkpointing"):
        st.checkpointing.configure(checkpoint_in_cpu="yes")
    with pytest.raises(InvalidArgument, match=r"num_checkpoints=0.*integer >= 1"):
        st.checkpointing.configure(num_checkpoints=0)
    with pytest.raises(InvalidArgument, match=r"num_checkpoints=True"):
        st.checkpointing.configure(num_checkpoints=True)
    bad = tmp_path / "ds.json"
    bad.write_text('{"train_micro_batch_size_per_gpu": 1, "activation_checkpointing": {"cpu_checkpointing": 3}}')
    with pytest.raises(InvalidArgument, match="activation_checkpointing.cpu_checkpointing"):
        st.checkpointing.configure(None, deepspeed_config=str(bad))
    with pytest.raises(InvalidArgument, match="activation_checkpointing.cpu_checkpoint"):  # a misspelled key
        st.initialize(model=TinyLM(), config=_with_section(config(0), cpu_checkpoint=True))
    assert not st.checkpointing.is_configured()  # nothing half-configured by a refusal

    class ModelParallel:
        def __init__(self, size):
            self.size = size

        def get_model_parallel_world_size(self):
            return self.size

    with pytest.raises(Unsupported, match=r"mpu_=ModelParallel.*data-parallel.*mpu_=None"):
        st.checkpointing.configure(ModelParallel(2), checkpoint_in_cpu=True)
    st.checkpointing.configure(ModelParallel(1), checkpoint_in_cpu=True)  # one model-parallel rank: nothing to split
    assert st.checkpointing.settings().cpu_checkpointing


def test_what_is_not_acted_on_is_said():
    with pytest.warns(UserWarning, match="activation_checkpointing.profile"):
        st.checkpointing.configure(profile=True)
    _torch_checkpointing._warned.discard("non_reentrant")
    st.checkpointing.configure(checkpoint_in_cpu=True)
    with pytest.warns(UserWarning, match="non_reentrant_checkpoint keeps its inputs on the device"):
        st.checkpointing.non_reentrant_checkpoint(torch.nn.Linear(2, 2), torch.randn(1, 2, requires_grad=True))


def test_deepspeed_names_of_the_checkpointing_api():
    import strata.torch as deepspeed
    from strata.torch.runtime.activation_checkpointing import checkpointing
    assert checkpointing is deepspeed.checkpointing
    for name in ("configure", "is_configured", "reset", "checkpoint", "non_reentrant_checkpoint"):
        assert callable(getattr(deepspeed.checkpointing, name))
    with pytest.raises(NotProvided, match=r"deepspeed.checkpointing.get_cuda_rng_tracker.*Megatron"):
        deepspeed.checkpointing.get_cuda_rng_tracker()


def test_hugging_face_gradient_checkpointing_moves_its_blocks_inputs():
    """gradient_checkpointing_enable() (transformers 4's reentrant default and 5's non-reentrant one) with
    cpu_checkpointing: each decoder layer's inputs go to host memory and back, and the losses equal those of
    the same checkpointing without it."""
    transformers = pytest.importorskip("transformers") if os.environ.get("STRATA_REQUIRE_TRANSFORMERS") != "1" \
        else __import__("transformers")
    import test_torch_hf_models as hf

    def run(cfg):
        model = hf.make("llama")
        model.gradient_checkpointing_enable()
        model.train()
        engine, _, _, _ = st.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        losses = train_engine(engine, hf.loss_of("llama"), 2)
        engine.close()
        return losses

    assert transformers is not None
    kept = run(hf.config(3, "cpu", "cpu"))
    with recorded_offload_for_tests() as offload_record:
        moved = run(_with_section(hf.config(3, "cpu", "cpu"), cpu_checkpointing=True))
    assert moved == kept
    kinds = [kind for kind, _ in offload_record.copies.log]
    # 2 steps x 2 micro-batches x 2 decoder layers, at least the hidden state each
    assert kinds.count("to_host") >= 8 and kinds.count("to_device") == kinds.count("to_host")


def test_the_cuda_copies_order_their_streams_by_events(monkeypatch):
    """_CudaCopies itself, on a stand-in of torch.cuda's stream API (no GPU here): the copy out waits for
    torch's stream and is recorded on the input; the copy back is allocated and copied on the copy stream,
    records an event, and torch's stream waits on it and is recorded on the fetched tensor. No synchronize."""
    from strata import _torch_activation_offload as offload_module
    log = []

    class Stream:
        def __init__(self, name):
            self.name = name

        def wait_stream(self, other):
            log.append((self.name, "waits for", other.name))

        def wait_event(self, event):
            log.append((self.name, "waits on", event.name))

    class Event:
        made = 0

        def __init__(self):
            Event.made += 1
            self.name = f"event {Event.made}"

        def record(self, stream):
            log.append((stream.name, "records", self.name))

    torch_stream, streams_on = Stream("torch"), []

    @contextlib.contextmanager
    def on(stream):
        streams_on.append(stream)
        try:
            yield
        finally:
            streams_on.pop()

    def current_stream(device=None):
        return streams_on[-1] if streams_on else torch_stream

    def record_stream(tensor, stream):
        log.append((stream.name, "recorded on", tuple(tensor.shape)))

    monkeypatch.setattr(torch.cuda, "Stream", lambda device: Stream("copy"))
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "stream", on)
    monkeypatch.setattr(torch.cuda, "current_stream", current_stream)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: log.append(("device", "synchronized")))
    monkeypatch.setattr(torch.Tensor, "record_stream", record_stream)
    copies = offload_module._CudaCopies(torch.device("cpu"))  # "moves" the inputs on its device
    copies.pin = False  # pinned memory needs a CUDA driver
    offload = offload_module.ActivationOffload(copies)
    block = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    with offload.hooks():
        y = torch.utils.checkpoint.checkpoint(block, x.expand(3, 2, 4), use_reentrant=True)
    assert log == [("copy", "waits for", "torch"), ("copy", "recorded on", (8,))]
    del log[:]
    y.sum().backward()
    assert log == [("copy", "records", "event 1"), ("torch", "waits on", "event 1"), ("torch", "recorded on", (8,))]
    expected = torch.nn.Linear(4, 4)
    expected.load_state_dict(block.state_dict())
    x2 = x.detach().clone().requires_grad_(True)
    expected(x2.expand(3, 2, 4)).sum().backward()
    assert torch.equal(x.grad, x2.grad)  # the expanded input came back as it was: the same gradient


def test_a_keyword_tensor_needing_a_gradient_becomes_a_checkpoint_input():
    """transformers 5 binds a layer's keywords in partial(forward, self, **kwargs): a keyword tensor that needs
    a gradient (a learned position embedding shared by the layers) must get it once per layer, as with torch's
    non-reentrant checkpoint, not be recomputed through its history per layer (a second backward)."""
    import functools
    from strata._torch_checkpointing import through_checkpoint

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

        def forward(self, x, pos=None, scale=1.0):
            return self.linear(x + pos) * scale

    def run(checkpointed):
        torch.manual_seed(4)
        layers = [Layer(), Layer()]
        table = torch.nn.Parameter(torch.randn(2, 4))
        x = torch.randn(2, 4, requires_grad=True)
        pos = table * 2  # not a leaf: its history is shared by both layers
        for layer in layers:
            if checkpointed:
                x = through_checkpoint(functools.partial(Layer.forward, layer, pos=pos, scale=0.5), x,
                                       use_reentrant=False)
            else:
                x = layer(x, pos=pos, scale=0.5)
        x.sum().backward()
        return table.grad.clone(), [layer.linear.weight.grad.clone() for layer in layers]

    st.checkpointing.configure(checkpoint_in_cpu=True)
    plain = run(False)
    with recorded_offload_for_tests() as offload_record:
        moved = run(True)
    assert torch.equal(plain[0], moved[0]) and all(torch.equal(a, b) for a, b in zip(plain[1], moved[1]))
    assert [kind for kind, _ in offload_record.copies.log].count("to_host") == 4  # x and pos, per layer

    def nested(x, pair=None):
        return x + pair[0]

    with pytest.raises(Unsupported, match=r"keyword 'pair' holds a tensor that needs a gradient inside a tuple"):
        through_checkpoint(functools.partial(nested, pair=(torch.ones(2, requires_grad=True),)),
                           torch.ones(2, requires_grad=True))


def test_an_input_written_in_place_after_it_was_saved_is_refused():
    block = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4, requires_grad=True)
    h = x * 1.0
    with recorded_offload_for_tests():
        st.checkpointing.configure(checkpoint_in_cpu=True)
        y = st.checkpointing.checkpoint(block, h)
        with torch.no_grad():
            h.add_(1.0)  # after the checkpoint saved it: its recompute would see other values
        with pytest.raises(RuntimeError, match=r"activation checkpoint \d+ \(shape \(2, 4\)\) was modified in place"):
            y.sum().backward()


def test_pinned_buffers_come_in_size_classes_and_stay_at_the_working_set():
    """Dynamic padding: a different length every step reuses buffers of its size class, and the pool keeps
    free no more than the peak in use."""
    from strata._torch_activation_offload import HostBufferPool
    assert [HostBufferPool.size_class(n) for n in (1, 7, 8, 9, 100, 1000, 1024, 1025)] == \
        [1, 7, 8, 9, 104, 1024, 1024, 1152]
    st.checkpointing.configure(checkpoint_in_cpu=True)
    block = torch.nn.Linear(8, 8)
    with recorded_offload_for_tests() as offload_record:
        for length in range(100, 140):
            h = torch.randn(length, 8, requires_grad=True) * 1.0
            st.checkpointing.checkpoint(block, st.checkpointing.checkpoint(block, h)).sum().backward()
        pool = offload_record.pool
        assert pool.buffers_made <= 10, pool.buffers_made  # 5 classes x 2 in use; 80 without classes
        assert pool.free_bytes() <= 2 * 1152 * 8 * 4


def test_the_routing_follows_the_setting_from_one_forward_to_the_next():
    """configure() after the first forward: a Hugging Face model's checkpointing is routed again (through
    strata.torch's checkpoint when cpu_checkpointing goes on, back to transformers' own when it goes off)."""
    if os.environ.get("STRATA_REQUIRE_TRANSFORMERS") != "1":
        pytest.importorskip("transformers")
    import test_torch_hf_models as hf
    model = hf.make("llama")
    model.gradient_checkpointing_enable()
    model.train()
    engine, _, _, _ = st.initialize(model=model, model_parameters=model.parameters(), config=hf.config(3, "cpu", "cpu"))
    with recorded_offload_for_tests() as offload_record:
        train_engine(engine, hf.loss_of("llama"), 1)
        assert offload_record.copies.log == []
        st.checkpointing.configure(checkpoint_in_cpu=True)
        train_engine(engine, hf.loss_of("llama"), 1, first_batch=2)
        moved = len(offload_record.copies.log)
        assert moved > 0
        st.checkpointing.configure(checkpoint_in_cpu=False)
        train_engine(engine, hf.loss_of("llama"), 1, first_batch=4)
        assert len(offload_record.copies.log) == moved
    engine.close()


def test_an_mpu_without_a_model_parallel_size_is_named():
    with pytest.raises(InvalidArgument, match=r"mpu_=object.*no get_model_parallel_world_size"):
        st.checkpointing.configure(object(), checkpoint_in_cpu=True)


def test_settings_without_effect_say_so():
    _torch_checkpointing._warned.discard("partition_activations")
    with pytest.warns(UserWarning, match="partition_activations has no effect"):
        st.checkpointing.configure(partition_activations=True, checkpoint_in_cpu=True)
