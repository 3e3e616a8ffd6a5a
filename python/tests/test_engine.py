"""strata.engine: the engine driven from Python over torch tensors that view
its memory. A two-layer MLP is trained the way strata.torch drives a module
(bind each unit's parameters to the engine's memory, hand its gradients
back): against torch's own AdamW, and bit for bit across ZeRO stages and
placements."""
import copy

import pytest
import torch

import strata
from strata.engine import Engine, TensorSpec

ACCUM = 2
MICRO = 4


def make_model(seed=3):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 16))


def units_of(model):
    return [model[0], model[2]]


def data(step, micro):
    g = torch.Generator().manual_seed(1000 * step + micro)
    x = torch.randn(MICRO, 16, generator=g)
    return x, torch.sin(x)


def config(stage, optimizer="none", params="none", nvme_dir=None, lr=1e-2):
    zero = {"stage": stage, "offload_optimizer": {"device": optimizer}, "offload_param": {"device": params},
            "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 100000}
    if optimizer == "nvme":
        zero["offload_optimizer"]["nvme_path"] = str(nvme_dir)
    if params == "nvme":
        zero["offload_param"]["nvme_path"] = str(nvme_dir)
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": ACCUM, "gradient_clipping": 0.0,
            "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.999], "eps": 1e-8,
                                                      "weight_decay": 0.01}},
            "zero_optimization": zero, "strata": {"device": "cpu", "device_memory": "64MiB"}}


def layers_of(model):
    return [(f"fc{i}", [TensorSpec(f"fc{i}.weight", tuple(u.weight.shape), torch.float32),
                        TensorSpec(f"fc{i}.bias", tuple(u.bias.shape), torch.float32, weight_decay=0.0)])
            for i, u in enumerate(units_of(model))]


def bind(unit, i, view):
    unit.weight.data = view.params[f"fc{i}.weight"]
    unit.bias.data = view.params[f"fc{i}.bias"]


def train_with_engine(cfg, steps=4):
    """What strata.torch does for a module: every parameter lives in the
    engine; a unit's parameters are bound to the engine's memory while it is
    acquired, and its gradients are added into the engine's buffers."""
    model = make_model()
    units = units_of(model)
    eng = Engine(cfg, layers_of(model))
    for i, u in enumerate(units):
        eng.put_initial_layer(i, [u.weight, u.bias])
    losses = []
    for step in range(steps):
        eng.begin_step()
        for micro in range(ACCUM):
            eng.begin_micro_batch(last=micro == ACCUM - 1)
            x, y = data(step, micro)
            for i, u in enumerate(units):
                bind(u, i, eng.acquire(i, "forward"))
            loss = torch.nn.functional.mse_loss(model(x), y)
            for i in range(len(units)):
                eng.release(i, "forward")
            # Backward: each unit acquired again (stage 3 gathers it again) and rebound before autograd runs.
            views = {}
            for i in reversed(range(len(units))):
                views[i] = eng.acquire(i, "backward")
                bind(units[i], i, views[i])
            for p in model.parameters():
                p.grad = None
            (loss * eng.gradient_scale()).backward()
            for i in reversed(range(len(units))):
                views[i].grads[f"fc{i}.weight"].add_(units[i].weight.grad)
                views[i].grads[f"fc{i}.bias"].add_(units[i].bias.grad)
                eng.release(i, "backward")
            eng.end_micro_batch(float(loss), x.shape[0])
        outcome = eng.finish_step()
        assert outcome["outcome"] == "applied", outcome["reason"]
        losses.append(outcome["metrics"]["loss"])
    eng.synchronize()
    masters = [eng.gather_state(i) for i in range(len(units))]
    return losses, masters, eng


def train_with_torch(steps=4, lr=1e-2):
    model = make_model()
    decay = [u.weight for u in units_of(model)]
    no_decay = [u.bias for u in units_of(model)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=lr, betas=(0.9, 0.999), eps=1e-8)
    losses = []
    for step in range(steps):
        opt.zero_grad()
        total = 0.0
        for micro in range(ACCUM):
            x, y = data(step, micro)
            loss = torch.nn.functional.mse_loss(model(x), y)
            (loss / ACCUM).backward()
            total += float(loss)
        opt.step()
        losses.append(total / ACCUM)
    masters = [torch.cat([u.weight.detach().reshape(-1), u.bias.detach().reshape(-1)]) for u in units_of(model)]
    return losses, masters


def test_matches_torch_adamw():
    ours, our_masters, _ = train_with_engine(config(0))
    ref, ref_masters = train_with_torch()
    for step, (a, b) in enumerate(zip(ours, ref)):
        assert a == pytest.approx(b, rel=1e-5), f"step {step}: engine {a} vs torch {b}"
    for i, (a, b) in enumerate(zip(our_masters, ref_masters)):
        assert a.shape == b.shape
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6), f"layer {i}: max diff {float((a - b).abs().max())}"


PLACEMENTS = [(1, "none", "none"), (2, "none", "none"), (2, "cpu", "none"), (3, "none", "none"), (3, "cpu", "cpu"),
              (2, "nvme", "none"), (3, "nvme", "nvme")]


@pytest.mark.parametrize("stage,optimizer,params", PLACEMENTS, ids=[f"stage{s}-{o}-{p}" for s, o, p in PLACEMENTS])
def test_losses_bit_identical_across_stages_and_placements(stage, optimizer, params, tmp_path):
    baseline, base_masters, _ = train_with_engine(config(0))
    losses, masters, _ = train_with_engine(config(stage, optimizer, params, tmp_path))
    assert losses == baseline  # exact: the engine's determinism, not a tolerance
    for a, b in zip(masters, base_masters):
        assert torch.equal(a, b)


def test_gradient_shards_on_nvme_give_the_same_losses(tmp_path):
    # strata.gradient_shards nvme (docs/engine.md): the reduced gradients wait on NVMe beside the optimizer
    # state, or beside the parameter shards when the state is in host memory.
    for optimizer in ("nvme", "cpu"):
        (tmp_path / optimizer / "pinned").mkdir(parents=True)
        (tmp_path / optimizer / "nvme").mkdir()
        pinned, pinned_masters, _ = train_with_engine(config(3, optimizer, "nvme", tmp_path / optimizer / "pinned"))
        cfg = config(3, optimizer, "nvme", tmp_path / optimizer / "nvme")
        cfg["strata"]["gradient_shards"] = "nvme"
        losses, masters, _ = train_with_engine(cfg)
        assert losses == pinned, optimizer
        for a, b in zip(masters, pinned_masters):
            assert torch.equal(a, b)
    # Neither the state nor the parameters on NVMe: no folder for them, refused naming the key.
    (tmp_path / "none").mkdir()
    cfg = config(3, "cpu", "cpu", tmp_path / "none")
    cfg["strata"]["gradient_shards"] = "nvme"
    with pytest.raises(Exception, match="strata.gradient_shards"):
        train_with_engine(cfg)


def test_views_are_the_engines_memory():
    model = make_model()
    eng = Engine(config(0), layers_of(model))
    units = units_of(model)
    for i, u in enumerate(units):
        eng.put_initial_layer(i, {f"fc{i}.weight": u.weight, f"fc{i}.bias": u.bias})
    eng.begin_step()
    eng.begin_micro_batch(last=False)  # micro-batch 1 of 2
    view = eng.acquire(0, "forward")
    assert view.grads is None
    assert torch.equal(view.params["fc0.weight"], units[0].weight.detach())
    eng.release(0, "forward")
    back = eng.acquire(1, "backward")
    assert back.grads["fc1.weight"].shape == units[1].weight.shape
    assert float(back.grads["fc1.weight"].abs().sum()) == 0.0  # zeroed at the step's start
    eng.release(1, "backward")
    assert eng.tensor_names(1) == ["fc1.weight", "fc1.bias"]
    assert eng.gradient_accumulation_steps == ACCUM


@pytest.mark.parametrize("stage", [0, 3])
def test_views_have_the_declared_dtypes_and_shapes(stage):
    """Note [Views through DLPack]: each view has its tensor's dtype and shape (a scalar, 1-D, 2-D and 3-D; fp32,
    bf16, fp16), is contiguous, and views the engine's memory: a write through a permanent view (stages 0-2) is
    what the next acquire sees, in the same tensor objects; at stage 3 a view kept after release still reads
    its values (its lend is kept), and the gradient views have the gradient dtype."""
    specs = [TensorSpec("scale", (), torch.float32), TensorSpec("w", (3, 5), torch.float32),
             TensorSpec("b", (5,), torch.float32), TensorSpec("cube", (2, 3, 4), torch.float32)]
    values = {"scale": torch.tensor(2.5), "w": torch.arange(15.0).view(3, 5), "b": -torch.arange(5.0),
              "cube": torch.linspace(-1, 1, 24).view(2, 3, 4)}
    fp16 = [TensorSpec("h16", (4, 2), torch.float16)]
    bf16 = [TensorSpec("hb", (7,), torch.bfloat16)]
    half_values = {"h16": torch.linspace(0, 1, 8).view(4, 2), "hb": torch.linspace(-3, 3, 7)}
    eng = Engine(config(stage), [("fp32", specs), ("fp16", fp16), ("bf16", bf16)])
    eng.put_initial_layer(0, values)
    eng.put_initial_layer(1, {"h16": half_values["h16"]})
    eng.put_initial_layer(2, {"hb": half_values["hb"]})
    eng.begin_evaluation()
    for layer, spec_list, expected in ((0, specs, values), (1, fp16, half_values), (2, bf16, half_values)):
        view = eng.acquire(layer, "eval")
        for spec in spec_list:
            t = view.params[spec.name]
            assert t.dtype == spec.dtype and tuple(t.shape) == spec.shape and t.is_contiguous(), spec.name
            assert not t.requires_grad
            assert torch.equal(t, expected[spec.name].to(spec.dtype)), spec.name
        eng.release(layer, "eval")
    first = eng.acquire(0, "eval")
    kept = first.params["cube"]
    if stage == 0:
        first.params["w"][1, 2] = 100.0
    eng.release(0, "eval")
    again = eng.acquire(0, "eval")
    if stage == 0:
        assert again.params["w"] is first.params["w"]  # the same views while the memory stays put
        assert float(again.params["w"][1, 2]) == 100.0
        again.params["w"][1, 2] = 7.0  # back to the initial value
    eng.release(0, "eval")
    del first, again
    assert torch.equal(kept, values["cube"])  # a view outlives its release (stage 3: its lend is kept)
    del kept
    eng.finish_evaluation(0.0, 1)
    eng.begin_step()
    eng.begin_micro_batch(last=False)
    back = eng.acquire(0, "backward")
    for spec in specs:
        g = back.grads[spec.name]
        assert g.dtype == torch.float32 and tuple(g.shape) == spec.shape and g.is_contiguous(), spec.name
        assert float(g.abs().sum()) == 0.0  # zeroed at the step's start
    grads = back.grads
    eng.release(0, "backward")
    back = eng.acquire(1, "backward")
    assert tuple(back.grads["h16"].shape) == (4, 2) and back.grads["h16"].dtype in (torch.float32, torch.float16)
    eng.release(1, "backward")
    del grads


@pytest.mark.parametrize("stage", [0, 3])
def test_a_view_torch_refuses_leaves_the_layer_released(stage):
    """When torch's from-DLPack call raises, acquire raises it and the engine does not keep the layer held."""
    eng = Engine(config(stage), [("l", [TensorSpec("w", (3, 5), torch.float32)])])
    eng.put_initial_layer(0, {"w": torch.ones(3, 5)})
    eng.begin_evaluation()

    def refuse(capsule):
        raise RuntimeError("no views today")

    eng._from_dlpack = refuse
    with pytest.raises(RuntimeError, match="no views today"):
        eng.acquire(0, "eval")
    eng._from_dlpack = None
    with pytest.raises(strata.FailedPrecondition, match="not held"):
        eng.release(0, "eval")
    view = eng.acquire(0, "eval")
    assert torch.equal(view.params["w"], torch.ones(3, 5))
    eng.release(0, "eval")
    eng.finish_evaluation(0.0, 1)


def test_bad_config_names_the_key():
    model = make_model()
    bad = config(0)
    bad["zero_optimization"]["stage"] = 5
    with pytest.raises(strata.InvalidArgument, match="zero_optimization.stage"):
        Engine(bad, layers_of(model))
    with pytest.raises(TypeError, match="config must be a path or a dict"):
        Engine(42, layers_of(model))
    with pytest.raises(strata.InvalidArgument, match="missing.json"):
        Engine("/nonexistent/missing.json", layers_of(model))


def test_bad_layers_and_calls_are_refused_by_name():
    model = make_model()
    with pytest.raises(ValueError, match="is not float32, bfloat16 or float16"):
        Engine(config(0), [("l", [TensorSpec("w", (4,), torch.int64)])])
    with pytest.raises(strata.InvalidArgument, match="'w'"):
        Engine(config(0), [("l", [TensorSpec("w", (0,), torch.float32)])])
    eng = Engine(config(0), layers_of(model))
    units = units_of(model)
    with pytest.raises(ValueError, match="tensor 'fc0.weight' has shape"):
        eng.put_initial_layer(0, [units[1].weight, units[0].bias])
    for i, u in enumerate(units):
        eng.put_initial_layer(i, [u.weight, u.bias])
    with pytest.raises(strata.FailedPrecondition, match="acquire"):
        eng.acquire(0, "backward")  # outside a micro-batch
    eng.begin_step()
    eng.begin_micro_batch(last=False)  # micro-batch 1 of 2
    with pytest.raises(strata.InvalidArgument, match="layer 7 is out of range"):
        eng.acquire(7, "forward")
    with pytest.raises(strata.InvalidArgument, match="pass 'sideways'"):
        eng.acquire(0, "sideways")
    # The refused calls changed nothing: the step goes on.
    bind(units[0], 0, eng.acquire(0, "forward"))
    eng.release(0, "forward")


def test_engine_matches_its_own_plan():
    _, _, eng = train_with_engine(config(3, "cpu", "cpu"), steps=1)
    plan = eng.predicted_memory()
    assert plan["pinned_params"] > 0 and plan["pinned_optimizer"] > 0
    assert plan["device"] == plan["device_params"] + plan["device_grads"] + plan["device_optimizer"] + \
        plan["device_gathered"]


def test_copy_of_model_is_untouched():
    """put_initial_layer copies: the torch module the values came from is not bound to the engine."""
    model = make_model()
    before = copy.deepcopy(model.state_dict())
    eng = Engine(config(0), layers_of(model))
    for i, u in enumerate(units_of(model)):
        eng.put_initial_layer(i, [u.weight, u.bias])
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])


def run_with_a_layer_in_micro_batch_2_only(cfg, steps=2):
    """Three Linear(16, 16) layers; layer 1 is used only in the second micro-batch of each step (a module
    run conditionally): the first micro-batch's recorded acquire order does not hold it."""
    torch.manual_seed(7)
    mods = [torch.nn.Linear(16, 16) for _ in range(3)]
    eng = Engine(cfg, [(f"l{i}", [TensorSpec(f"l{i}.w", (16, 16), torch.float32),
                                  TensorSpec(f"l{i}.b", (16,), torch.float32)]) for i in range(3)])
    for i, m in enumerate(mods):
        eng.put_initial_layer(i, [m.weight, m.bias])
    for step in range(steps):
        eng.begin_step()
        for micro in range(ACCUM):
            eng.begin_micro_batch(last=micro == ACCUM - 1)
            used = [0, 1, 2] if micro == 1 else [0, 2]
            x, _ = data(step, micro)
            for i in used:
                view = eng.acquire(i, "forward")
                mods[i].weight.data, mods[i].bias.data = view.params[f"l{i}.w"], view.params[f"l{i}.b"]
            h = x
            for i in used:
                h = torch.tanh(mods[i](h))
            loss = h.square().mean()
            for i in used:
                eng.release(i, "forward")
            del view  # autograd keeps the forward views it needs (Note [Lent memory outlives its release])
            views = {}
            for i in reversed(used):
                views[i] = eng.acquire(i, "backward")
                mods[i].weight.data, mods[i].bias.data = views[i].params[f"l{i}.w"], views[i].params[f"l{i}.b"]
            for m in mods:
                m.weight.grad = m.bias.grad = None
            (loss * eng.gradient_scale()).backward()
            for i in reversed(used):
                views[i].grads[f"l{i}.w"].add_(mods[i].weight.grad)
                views[i].grads[f"l{i}.b"].add_(mods[i].bias.grad)
                eng.release(i, "backward")
            del views
            for i in used:  # nothing of torch's may keep lent memory (Note [Lent memory outlives its release])
                mods[i].weight.data, mods[i].bias.data = torch.empty(0), torch.empty(0)
            eng.end_micro_batch(float(loss), x.shape[0])
        assert eng.finish_step()["outcome"] == "applied"
    eng.synchronize()
    return [eng.gather_state(i) for i in range(3)]


# F.linear saves weight.t(), a view of the forward's gathered copy, for backward; when a micro-batch departs
# from the recorded order the copy is dropped at its forward release. The copy stays lent until autograd lets go
# of the view (Note [Lent memory outlives its release]); before that fix layers 0 and 1 came out wrong.
@pytest.mark.parametrize("stage,optimizer,params", [(3, "cpu", "none"), (3, "cpu", "cpu")])
def test_layer_first_used_in_a_later_micro_batch(stage, optimizer, params):
    base = run_with_a_layer_in_micro_batch_2_only(config(0))
    other = run_with_a_layer_in_micro_batch_2_only(config(stage, optimizer, params))
    for i, (a, b) in enumerate(zip(base, other)):
        assert torch.equal(a, b), f"layer {i}: max diff {float((a - b).abs().max())}"


def test_the_engine_layer_answers_what_the_torch_front_end_asks_and_refuses_use_after_close(tmp_path):
    """strata.torch asks strata.engine.Engine, never the native engine past it (issue 51 §7): the layout, the
    step counters, checkpoints; close() ends it and every later call is refused naming the hint."""
    engine = Engine(config(2), layers_of(make_model()))
    model = make_model()
    for i, unit in enumerate(units_of(model)):
        engine.put_initial_layer(i, [unit.weight, unit.bias])
    assert [entry[:3] for entry in engine.layout(0)] == [("fc0.weight", [64, 16], "float32"),
                                                        ("fc0.bias", [64], "float32")]
    assert engine.steps_begun == 0 and engine.optimizer_steps == 0
    engine.save_checkpoint(str(tmp_path / "ckpt"), sync=True)
    assert engine.wait_checkpoint() is None  # a sync save leaves nothing in flight
    assert (tmp_path / "ckpt" / "latest").read_text().strip() == "global_step0"
    assert engine.checkpoint_app_json(str(tmp_path / "ckpt")) == "{}"
    engine.close("make another with Engine(...)")
    with pytest.raises(strata.errors.FailedPrecondition, match="closed .* make another with Engine"):
        engine.begin_step()


def test_keeps_whole_is_the_engines_placement_and_its_views_outlive_a_release():
    """Engine.keeps_whole: every layer at stages 0-2; at stage 3 a layer with fewer elements than
    stage3_param_persistence_threshold (fc0 has 1088, fc1 1040), whose acquires lend the same views."""
    model = make_model()
    assert [Engine(config(2), layers_of(model)).keeps_whole(i) for i in range(2)] == [True, True]
    assert [Engine(config(3), layers_of(model)).keeps_whole(i) for i in range(2)] == [False, False]
    cfg = config(3)
    cfg["zero_optimization"]["stage3_param_persistence_threshold"] = 1050
    eng = Engine(cfg, layers_of(model))
    assert [eng.keeps_whole(i) for i in range(2)] == [False, True]
    with pytest.raises(strata.InvalidArgument, match="layer 2 is out of range"):
        eng.keeps_whole(2)
    for i, u in enumerate(units_of(model)):
        eng.put_initial_layer(i, [u.weight, u.bias])
    views = []
    eng.begin_evaluation()
    for _ in range(2):
        views.append([eng.acquire(i, "eval").params for i in range(2)])
        for i in range(2):
            eng.release(i, "eval")
    eng.finish_evaluation(0.0, 1)
    assert views[0][1] is views[1][1] and torch.equal(views[0][1]["fc1.bias"], model[2].bias)
    assert views[0][0] is not views[1][0]  # a gathered copy: lent anew at each acquire


def test_phase_and_holds_are_the_engines():
    """Engine.phase / in_step / in_micro_batch and holds(i) answer from the native engine (issue 51 §7): each
    bracket moves the phase, a refused call moves nothing, every acquire counts until its release,
    abandon_step releases every hold, a finish_evaluation that fails in its work has ended the evaluation;
    "closed" and 0 after close()."""
    model = make_model()
    eng = Engine(config(3, "cpu", "cpu"), layers_of(model))
    for i, u in enumerate(units_of(model)):
        eng.put_initial_layer(i, [u.weight, u.bias])
    assert (eng.phase, eng.in_step, eng.in_micro_batch) == ("idle", False, False)
    with pytest.raises(strata.FailedPrecondition, match="begin_micro_batch"):
        eng.begin_micro_batch(last=False)
    assert eng.phase == "idle"
    eng.begin_step()
    assert (eng.phase, eng.in_step, eng.in_micro_batch) == ("step", True, False)
    with pytest.raises(strata.InvalidArgument, match="last must be true on the final one only"):
        eng.begin_micro_batch(last=True)  # micro-batch 1 of 2
    assert eng.phase == "step"
    eng.begin_micro_batch(last=False)
    assert (eng.phase, eng.in_step, eng.in_micro_batch) == ("micro_batch", True, True)
    eng.acquire(0, "forward")
    eng.acquire(0, "forward")
    assert [eng.holds(i) for i in range(2)] == [2, 0]
    eng.release(0, "forward")
    assert eng.holds(0) == 1
    eng.release(0, "forward")
    assert eng.holds(0) == 0
    with pytest.raises(strata.FailedPrecondition, match="not held"):
        eng.release(0, "forward")
    assert eng.holds(0) == 0
    with pytest.raises(strata.InvalidArgument, match="layer 2 is out of range"):
        eng.holds(2)
    with pytest.raises(strata.InvalidArgument, match="tokens -1 is negative"):
        eng.end_micro_batch(1.0, -1)  # refused before the engine: the micro-batch is still open
    assert eng.phase == "micro_batch"
    eng.end_micro_batch(1.0, MICRO)
    assert eng.phase == "step"
    eng.begin_micro_batch(last=True)
    eng.acquire(1, "forward")
    eng.acquire(0, "forward")
    eng.acquire(0, "backward")
    assert [eng.holds(i) for i in range(2)] == [2, 1]
    eng.abandon_step()
    assert (eng.phase, [eng.holds(i) for i in range(2)]) == ("idle", [0, 0])
    eng.begin_evaluation()
    assert (eng.phase, eng.in_step) == ("evaluation", False)
    eng.acquire(1, "eval")
    assert eng.holds(1) == 1
    eng.release(1, "eval")
    with pytest.raises(strata.InvalidArgument, match="no rank evaluated a batch"):
        eng.finish_evaluation(0.0, 0)
    assert eng.phase == "idle"  # failed in its work: the evaluation is over
    eng.close()
    assert (eng.phase, eng.in_step, eng.in_micro_batch, eng.holds(0)) == ("closed", False, False, 0)
