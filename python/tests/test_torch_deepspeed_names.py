"""DeepSpeed's names under strata.torch (docs/torch.md, "Porting a DeepSpeed
script"): each present and behaving as DeepSpeed's, or refused naming the
Strata equivalent; DeepSpeed's behaviours after initialize (parameters, the
training_data loader, checkpoints)."""
import argparse
import math
import os
import warnings

import pytest
import torch

import strata
import strata.torch as deepspeed
from strata.torch import accelerator as accelerator_module
from strata.torch.ops.adagrad import DeepSpeedCPUAdagrad
from strata.torch.ops.adam import DeepSpeedCPUAdam, FusedAdam
from strata.torch.ops.lion import DeepSpeedCPULion, FusedLion
from strata.torch.runtime import lr_schedules
from strata.torch.utils import get_z3_leaf_modules, set_z3_leaf_modules, unset_z3_leaf_modules
from strata.torch.zero import GatheredParameters, ZeroParamStatus


def config(stage=0, **extra):
    cfg = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": 0.0,
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
           "zero_optimization": {"stage": stage}}
    cfg.update(extra)
    return cfg


def make_mlp(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 12), torch.nn.LayerNorm(12), torch.nn.Tanh(),
                               torch.nn.Linear(12, 3))


def batch(index):
    g = torch.Generator().manual_seed(1000 + index)
    return torch.randn(4, 6, generator=g), torch.randint(0, 3, (4,), generator=g)


def loss_of(model, index):
    x, y = batch(index)
    return torch.nn.functional.cross_entropy(model(x), y)


def train(engine, steps, first=0):
    losses = []
    for index in range(first, first + steps):
        loss = loss_of(engine, index)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses


def train_torch(model, optimizer, steps, scheduler=None):
    losses = []
    for index in range(steps):
        loss = loss_of(model, index)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if scheduler is not None:
            scheduler.step()
        losses.append(loss.item())
    return losses


def max_rel(a, b):
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


# -- add_config_arguments ----------------------------------------------------------------------------
def test_add_config_arguments_and_initialize_reads_args(tmp_path):
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    path = tmp_path / "ds.json"
    path.write_text('{"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}')
    args = parser.parse_args(["--deepspeed", "--deepspeed_config", str(path)])
    assert args.deepspeed is True and args.deepspeed_config == str(path)
    assert parser.parse_args([]).deepspeed is False and parser.parse_args([]).deepspeed_config is None
    args.local_rank = -1
    engine, _, _, _ = deepspeed.initialize(args=args, model=make_mlp())
    assert engine.config["train_micro_batch_size_per_gpu"] == 4 and args.local_rank == 0
    with pytest.raises(ValueError, match="give the config once"):  # DeepSpeed refuses both, too
        deepspeed.initialize(args=args, model=make_mlp(), config=config())
    with pytest.raises(TypeError, match="argparse"):
        deepspeed.add_config_arguments("--deepspeed")


# -- accelerator -------------------------------------------------------------------------------------
def test_cpu_accelerator_answers_what_deepspeed_examples_ask():
    acc = deepspeed.get_accelerator()
    assert acc is accelerator_module.get_accelerator()
    assert acc.device_name() == acc.current_device_name() == "cpu" and acc.device_name(0) == "cpu"
    assert acc.current_device() == 0 and acc.is_available() and acc.communication_backend_name() == "gloo"
    assert acc.device_count() >= 1
    acc.synchronize()
    acc.empty_cache()
    acc.manual_seed(5)
    first = torch.rand(3)
    acc.manual_seed(5)
    assert torch.equal(first, torch.rand(3))
    held = torch.ones(64 << 20, dtype=torch.uint8)  # 64 MiB touched: the resident set grows
    allocated = acc.memory_allocated()
    assert allocated > 64 << 20 and acc.max_memory_allocated() >= allocated
    assert acc.total_memory() > acc.available_memory() > 0 and acc.memory_stats()["allocated_bytes.all.peak"] > 0
    del held
    with pytest.raises(TypeError, match="seed must be an int"):
        acc.manual_seed("5")


def test_cpu_accelerator_current_device_is_the_local_rank(monkeypatch):
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert deepspeed.get_accelerator().current_device() == 3
    monkeypatch.setenv("LOCAL_RANK", "x")
    with pytest.raises(ValueError, match="LOCAL_RANK='x'"):
        deepspeed.get_accelerator().current_device()


def test_accelerator_choice_follows_ds_accelerator(monkeypatch):
    monkeypatch.setattr(accelerator_module, "_chosen", None)
    monkeypatch.setenv("DS_ACCELERATOR", "hpu")
    with pytest.raises(ValueError, match="DS_ACCELERATOR='hpu'"):
        accelerator_module.get_accelerator()
    monkeypatch.setenv("DS_ACCELERATOR", "cuda")
    if torch.cuda.is_available():
        acc = accelerator_module.get_accelerator()
        assert acc.device_name() == "cuda" and acc.communication_backend_name() == "nccl"
        assert acc.total_memory() > 0 and acc.memory_allocated() >= 0
    else:
        with pytest.raises(RuntimeError, match="torch.cuda.is_available"):
            accelerator_module.get_accelerator()


# -- ops: DeepSpeed's optimizers ----------------------------------------------------------------------
@pytest.mark.parametrize("adamw_mode", [True, False])
def test_deepspeed_cpu_adam_steps_as_torch(adamw_mode):
    ours_model, ref_model = make_mlp(), make_mlp()
    ours = DeepSpeedCPUAdam(ours_model.parameters(), lr=1e-2, weight_decay=0.1, adamw_mode=adamw_mode)
    kind = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    ref = kind(ref_model.parameters(), lr=1e-2, weight_decay=0.1)
    assert max_rel(train_torch(ours_model, ours, 5), train_torch(ref_model, ref, 5)) < 1e-5


@pytest.mark.parametrize("adamw_mode", [True, False])
def test_deepspeed_cpu_adam_given_to_initialize_trains_as_torch(adamw_mode):
    model = make_mlp()
    client = DeepSpeedCPUAdam(model.parameters(), lr=1e-2, weight_decay=0.1, adamw_mode=adamw_mode)
    cfg = config(2)
    del cfg["optimizer"]
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=client, config=cfg)
    assert engine.config["optimizer"]["type"] == ("AdamW" if adamw_mode else "Adam")
    ref_model = make_mlp()
    kind = torch.optim.AdamW if adamw_mode else torch.optim.Adam
    assert max_rel(train(engine, 5), train_torch(ref_model, kind(ref_model.parameters(), lr=1e-2,
                                                                  weight_decay=0.1), 5)) < 1e-5


def test_fused_adam_is_adam_with_deepspeeds_arguments():
    model, ref_model = make_mlp(), make_mlp()
    ours = FusedAdam(model.parameters(), lr=1e-2, adam_w_mode=False, weight_decay=0.1)
    ref = torch.optim.Adam(ref_model.parameters(), lr=1e-2, weight_decay=0.1)
    assert max_rel(train_torch(model, ours, 4), train_torch(ref_model, ref, 4)) < 1e-5
    loss_of(model, 0).backward()
    ours.zero_grad()
    assert all(p.grad is None for p in model.parameters())  # set_grad_none=True, DeepSpeed's default
    keep = FusedAdam(model.parameters(), set_grad_none=False)
    loss_of(model, 0).backward()
    keep.zero_grad()
    assert all(p.grad is not None and not p.grad.any() for p in model.parameters())
    with pytest.raises(ValueError, match="amsgrad=True"):
        FusedAdam(model.parameters(), amsgrad=True)


def test_deepspeed_cpu_adagrad_steps_as_torch():
    model, ref_model = make_mlp(), make_mlp()
    ours = DeepSpeedCPUAdagrad(model.parameters(), lr=1e-2, weight_decay=0.01)
    ref = torch.optim.Adagrad(ref_model.parameters(), lr=1e-2, weight_decay=0.01, eps=1e-10)
    assert max_rel(train_torch(model, ours, 5), train_torch(ref_model, ref, 5)) < 1e-5
    with pytest.raises(ValueError, match="fp32_optimizer_states=False"):
        DeepSpeedCPUAdagrad(model.parameters(), fp32_optimizer_states=False)


def test_deepspeed_cpu_lion_has_deepspeeds_defaults_and_runs_in_the_engine():
    model = make_mlp()
    lion = DeepSpeedCPULion(model.parameters())
    assert lion.defaults["lr"] == 1e-3 and lion.defaults["betas"] == (0.9, 0.999)
    assert isinstance(FusedLion(make_mlp().parameters()), strata.optim.CPULion)
    cfg = config(1)
    del cfg["optimizer"]
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=lion, config=cfg)
    assert engine.config["optimizer"]["type"] == "Lion"
    losses = train(engine, 4)
    assert all(math.isfinite(loss) for loss in losses)


def test_ops_optimizers_accept_parameters_built_under_zero_init():
    with deepspeed.zero.Init():
        model = make_mlp()
    assert all(p.device.type == "meta" for p in model.parameters())
    client = DeepSpeedCPUAdam(model.parameters(), lr=1e-2)
    with pytest.raises(ValueError, match="meta device"):
        client.step()
    cfg = config(3)
    del cfg["optimizer"]
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=client, config=cfg)
    assert all(math.isfinite(loss) for loss in train(engine, 2))


# -- utils.set_z3_leaf_modules ------------------------------------------------------------------------
class Expert(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 8)
        self.b = torch.nn.Linear(8, 8)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class Mixture(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.experts = torch.nn.ModuleList([Expert() for _ in range(2)])

    def forward(self, x):
        return sum(e(x) for e in self.experts)


def test_set_z3_leaf_modules_makes_a_unit_boundary():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), Mixture(), Mixture(), torch.nn.Linear(8, 2))
    before = [u.name for u in deepspeed.split_into_units(model, units=[Expert])]
    assert before == ["1.experts.0", "1.experts.1", "2.experts.0", "2.experts.1", ""]
    found = set_z3_leaf_modules(model, [Mixture])
    assert found == [model[1], model[2]] and get_z3_leaf_modules(model) == found
    # Units inside a leaf give way to it; the leaf is acquired whole.
    assert [u.name for u in deepspeed.split_into_units(model, units=[Expert])] == ["1", "2", ""]
    engine, _, _, _ = deepspeed.initialize(model=model, config=config(3), units=[Expert])
    assert [u.name for u in engine._units] == ["1", "2", ""]
    x = torch.randn(4, 8)
    engine.backward(engine(x).square().mean())
    engine.step()
    unset_z3_leaf_modules(model, ["Mixture"])
    assert get_z3_leaf_modules(model) == []
    with pytest.raises(ValueError, match="no module of Sequential is of class"):
        set_z3_leaf_modules(model, [torch.nn.Conv2d])
    assert set_z3_leaf_modules(model, [torch.nn.Conv2d], raise_if_not_found=False) == []


# -- zero.Init, zero.GatheredParameters, parameters after initialize ------------------------------------
def test_zero_init_is_strata_init_and_builds_on_meta():
    assert deepspeed.zero.Init is deepspeed.init
    with deepspeed.zero.Init(config_dict_or_path=config(3), remote_device="cpu", pin_memory=True):
        model = make_mlp()
    assert all(p.device.type == "meta" for p in model.parameters())
    engine, _, _, _ = deepspeed.initialize(model=model, config=config(3))
    reference = make_mlp()
    with GatheredParameters(list(model.parameters())):
        for p, q in zip(model.parameters(), reference.parameters()):
            assert torch.equal(p, q)  # the values the constructors gave, made unit by unit


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_parameters_keep_their_shapes_after_initialize_below_stage_3(stage):
    model = make_mlp()
    reference = make_mlp()
    size = sum(p.numel() for p in model.parameters())
    engine, _, _, _ = deepspeed.initialize(model=model, config=config(stage))
    assert sum(p.numel() for p in model.parameters()) == size  # the "Model size: 0 parameters"
    for p, q in zip(model.parameters(), reference.parameters()):
        assert p.shape == q.shape and torch.equal(p, q) and not hasattr(p, "ds_id")
    train(engine, 1)
    assert sum(p.numel() for p in model.parameters()) == size


def stage_3(persistence_threshold):
    return config(3, zero_optimization={"stage": 3, "stage3_param_persistence_threshold": persistence_threshold})


def test_stage_3_parameters_carry_deepspeeds_attributes():
    model = make_mlp()
    shapes = [p.shape for p in model.parameters()]
    # Every layer partitioned (the default threshold, 100000, would keep this small model's layers whole).
    engine, _, _, _ = deepspeed.initialize(model=model, config=stage_3(0))
    params = list(model.parameters())
    assert sum(p.numel() for p in params) == 0  # partitioned placeholders, as DeepSpeed's
    assert [p.ds_shape for p in params] == shapes and [p.ds_numel for p in params] == [s.numel() for s in shapes]
    assert sorted(p.ds_id for p in params) == list(range(len(params)))
    assert not any(p.ds_persist for p in params)
    assert sum(p.ds_numel if hasattr(p, "ds_id") else p.numel() for p in params) == sum(s.numel() for s in shapes)
    assert all(p.ds_status == ZeroParamStatus.NOT_AVAILABLE for p in params)
    with GatheredParameters(params):
        assert all(p.ds_status == ZeroParamStatus.AVAILABLE and p.shape == p.ds_shape for p in params)
    assert all(p.ds_status == ZeroParamStatus.NOT_AVAILABLE for p in params)
    seen = []
    hook = model[0].register_forward_pre_hook(lambda m, a: seen.append(m.weight.ds_status))  # after the engine's
    train(engine, 1)
    hook.remove()
    assert seen == [ZeroParamStatus.AVAILABLE]  # bound while its unit runs


# make_mlp's layers hold 84 (Linear(6, 12)), 24 (LayerNorm(12)) and 39 (Linear(12, 3)) elements: under a threshold
# of 30 the engine keeps the norm's layer whole on every rank and shards the others.
PERSISTENT = {"1.weight", "1.bias"}


def test_a_stage_3_layer_under_the_persistence_threshold_stays_available_once_gathered():
    """As DeepSpeed's persistent parameters (ds_persist): partitioned until their first use, then AVAILABLE
    with their full shape for good, holding the trained values; the other layers are placeholders between
    their units' acquires."""
    model = make_mlp()
    shapes = {name: p.shape for name, p in model.named_parameters()}
    engine, _, _, _ = deepspeed.initialize(model=model, config=stage_3(30))
    params = dict(model.named_parameters())
    assert {name for name, p in params.items() if p.ds_persist} == PERSISTENT
    assert all(p.ds_status == ZeroParamStatus.NOT_AVAILABLE and p.numel() == 0 for p in params.values())

    def check_bound_only_the_persistent_layer():
        for name, p in params.items():
            if name in PERSISTENT:
                assert p.ds_status == ZeroParamStatus.AVAILABLE and p.shape == p.ds_shape == shapes[name], name
            else:
                assert p.ds_status == ZeroParamStatus.NOT_AVAILABLE and p.numel() == 0, name

    train(engine, 2)
    check_bound_only_the_persistent_layer()
    master = engine.master_parameters()
    for name in PERSISTENT:
        assert torch.equal(params[name].detach(), master[name])  # the engine's memory: the trained values
    with GatheredParameters(list(params.values())):
        assert all(p.ds_status == ZeroParamStatus.AVAILABLE and p.shape == p.ds_shape for p in params.values())
    check_bound_only_the_persistent_layer()
    with torch.no_grad():
        engine(batch(0)[0])  # an evaluation
    check_bound_only_the_persistent_layer()
    engine.close()
    assert all(p.ds_status == ZeroParamStatus.NOT_AVAILABLE and p.numel() == 0 for p in params.values())


def test_a_persistent_layer_leaves_the_losses_unchanged():
    runs = []
    for cfg in (stage_3(0), stage_3(30), config(0)):
        engine, _, _, _ = deepspeed.initialize(model=make_mlp(), config=cfg)
        runs.append(train(engine, 4))
    assert runs[1] == runs[0] == runs[2]  # bit for bit: sharded, one layer kept whole, stage 0


def test_a_failed_forward_unbinds_the_sharded_layers_and_keeps_the_persistent_one():
    model = make_mlp()
    engine, _, _, _ = deepspeed.initialize(model=model, config=stage_3(30))
    reference, _, _, _ = deepspeed.initialize(model=make_mlp(), config=stage_3(30))
    expected = train(reference, 3)
    assert train(engine, 1) == expected[:1]

    def fail(module, args):
        raise RuntimeError("a forward that fails with its unit acquired")

    hook = model[3].register_forward_pre_hook(fail)  # after the engine's: the last Linear is bound when it raises
    with pytest.raises(RuntimeError, match="fails with its unit acquired"):
        loss_of(engine, 1)
    hook.remove()
    last, norm = model[3].weight, model[1].weight
    assert last.ds_status == ZeroParamStatus.NOT_AVAILABLE and last.numel() == 0
    assert norm.ds_status == ZeroParamStatus.AVAILABLE and norm.shape == (12,)
    assert train(engine, 2, first=1) == expected[1:]  # the dropped step runs again, as if it never failed


# -- engine.device, engine.local_rank, engine.get_global_grad_norm() ----------------------------------
def test_engine_device_local_rank_and_global_grad_norm():
    engine, _, _, _ = deepspeed.initialize(model=make_mlp(), config=config(2))
    assert engine.device == torch.device("cpu") and engine.local_rank == 0
    assert engine.get_global_grad_norm() is None  # DeepSpeed's before the first step
    reference = make_mlp()
    loss_of(reference, 0).backward()
    expected = float(torch.norm(torch.stack([p.grad.norm() for p in reference.parameters()])))
    train(engine, 1)
    assert abs(engine.get_global_grad_norm() - expected) <= 1e-5 * expected


# -- runtime.lr_schedules --------------------------------------------------------------------------------
def sgd(lr=0.1, groups=1):
    params = [torch.nn.Parameter(torch.zeros(2)) for _ in range(groups)]
    return torch.optim.SGD([{"params": [p]} for p in params], lr=lr)


def lrs_of(schedule, steps):
    out = [schedule.optimizer.param_groups[0]["lr"]]
    for _ in range(steps):
        schedule.step()
        out.append(schedule.optimizer.param_groups[0]["lr"])
    return out


def test_warmup_lr_and_warmup_decay_lr_values():
    # DeepSpeed's formulas, written out: log warm-up gamma = log(i + 1) / log(W); linear decay after it.
    schedule = lr_schedules.WarmupLR(sgd(), warmup_min_lr=0.01, warmup_max_lr=0.1, warmup_num_steps=5)
    expected = [0.01] + [0.01 + 0.09 * (math.log(i + 1) / math.log(5) if i < 5 else 1.0) for i in range(8)]
    assert lrs_of(schedule, 8) == pytest.approx(expected, rel=1e-12)
    assert schedule.get_last_lr() == [pytest.approx(expected[-1])] and schedule.state_dict() == {
        "last_batch_iteration": 7}
    decay = lr_schedules.WarmupDecayLR(sgd(), total_num_steps=10, warmup_min_lr=0.0, warmup_max_lr=0.1,
                                       warmup_num_steps=4, warmup_type="linear")
    expected = [0.0] + [0.1 * (i / 4 if i < 4 else max(0.0, (10 - i) / 6)) for i in range(12)]
    assert lrs_of(decay, 12) == pytest.approx(expected, rel=1e-12, abs=1e-15)
    default_max = lr_schedules.WarmupLR(sgd(lr=0.3), warmup_num_steps=2, warmup_type="linear")
    assert lrs_of(default_max, 3)[-1] == pytest.approx(0.3)  # warmup_max_lr None: the group's lr


def test_warmup_cosine_lr_scales_each_groups_lr():
    optimizer = sgd(groups=2)
    optimizer.param_groups[1]["lr"] = 0.5
    schedule = lr_schedules.WarmupCosineLR(optimizer, total_num_steps=10, warmup_num_steps=2, warmup_type="linear",
                                           cos_min_ratio=0.1, warmup_min_ratio=0.2)
    assert [g["lr"] for g in optimizer.param_groups] == [0.0, 0.0]  # DeepSpeed's value before it starts
    ratios = []
    for i in range(11):
        schedule.step()
        ratios.append(optimizer.param_groups[1]["lr"] / 0.5)
        assert optimizer.param_groups[0]["lr"] == pytest.approx(0.1 * ratios[-1])
    expected = [0.2 + 0.8 * i / 2 if i < 2 else
                0.1 + 0.9 * (1 + math.cos(math.pi * min(1.0, (i - 1) / 8))) / 2 for i in range(11)]
    assert ratios == pytest.approx(expected, rel=1e-12)


def test_one_cycle_cycles_lr_and_momentum():
    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    schedule = lr_schedules.OneCycle(optimizer, cycle_min_lr=0.01, cycle_max_lr=0.1, cycle_first_step_size=4,
                                     cycle_min_mom=0.85, cycle_max_mom=0.95)
    lrs, moms = [optimizer.param_groups[0]["lr"]], [optimizer.param_groups[0]["betas"]]
    for _ in range(8):
        schedule.step()
        lrs.append(optimizer.param_groups[0]["lr"])
        moms.append(optimizer.param_groups[0]["betas"])
    scale = [min(b, 8 - b) / 4 for b in range(9)]  # up over 4 batches, down over 4
    assert lrs == pytest.approx([0.01 + 0.09 * s for s in scale], rel=1e-12)
    assert [m[0] for m in moms] == pytest.approx([0.95 - 0.1 * s if i else 0.85 for i, s in enumerate(scale)])
    assert all(m[1] == 0.99 for m in moms)
    no_betas = lr_schedules.OneCycle(torch.optim.Adagrad([torch.nn.Parameter(torch.zeros(1))]), 0.01, 0.1)
    assert no_betas.cycle_momentum is False and no_betas.get_mom() is None


def test_lr_range_test_values():
    schedule = lr_schedules.LRRangeTest(sgd(), lr_range_test_min_lr=0.01, lr_range_test_step_size=2,
                                        lr_range_test_step_rate=0.5, lr_range_test_staircase=True)
    assert lrs_of(schedule, 5) == pytest.approx([0.01 * (1 + 0.5 * ((i + 1) // 2)) for i in range(-1, 5)])


def test_lr_schedules_refuse_bad_values_by_name():
    with pytest.raises(strata.InvalidArgument, match="WarmupLR: .*warmup_max_lr"):
        lr_schedules.WarmupLR(sgd(), warmup_min_lr=0.1, warmup_max_lr=0.01)
    with pytest.raises(strata.InvalidArgument, match="warmup_type"):
        lr_schedules.WarmupLR(sgd(), warmup_type="cosine")
    with pytest.raises(ValueError, match="2 values for the optimizer's 1 param group"):
        lr_schedules.WarmupLR(sgd(), warmup_min_lr=[0.0, 0.1])
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        lr_schedules.WarmupLR("adam")


def test_a_schedule_given_to_initialize_is_run_by_the_engine():
    """WarmupLR on the client optimizer, given to initialize, steps the engine's lr as it steps a torch
    optimizer's, and OneCycle's momentum cycles the engine's beta1."""
    model = make_mlp()
    client = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    schedule = lr_schedules.WarmupLR(client, warmup_min_lr=1e-3, warmup_max_lr=1e-2, warmup_num_steps=3)
    cfg = config(2)
    del cfg["optimizer"]
    engine, _, _, returned = deepspeed.initialize(model=model, optimizer=client, lr_scheduler=schedule, config=cfg)
    assert returned is schedule and engine.config["scheduler"]["type"] == "WarmupLR"
    ref_model = make_mlp()
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.01)
    ref_schedule = lr_schedules.WarmupLR(ref_opt, warmup_min_lr=1e-3, warmup_max_lr=1e-2, warmup_num_steps=3)
    used = []
    for index in range(6):
        engine.backward(loss_of(engine, index))
        engine.step()
        used.append(engine.metrics["lr"])
        assert schedule.get_last_lr() == pytest.approx(ref_schedule.get_last_lr() if index == 0 else
                                                       schedule.get_last_lr())
    expected = []
    for index in range(6):
        expected.append(ref_opt.param_groups[0]["lr"])
        ref_schedule.step()
    assert used == pytest.approx(expected, rel=1e-12)
    assert schedule.last_batch_iteration == 5

    model = make_mlp()
    client = torch.optim.AdamW(model.parameters(), lr=1e-2)
    cycle = lr_schedules.OneCycle(client, cycle_min_lr=1e-3, cycle_max_lr=1e-2, cycle_first_step_size=2)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=client, lr_scheduler=cycle, config=cfg)
    betas = []
    for index in range(4):
        engine.backward(loss_of(engine, index))
        engine.step()
        betas.append(engine.metrics["beta1"])
    # As on a torch optimizer: beta1 at cycle_min_mom while the lr peaks, back towards cycle_max_mom after.
    ref_opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-2)
    ref_cycle = lr_schedules.OneCycle(ref_opt, cycle_min_lr=1e-3, cycle_max_lr=1e-2, cycle_first_step_size=2)
    expected = []
    for _ in range(4):
        expected.append(ref_opt.param_groups[0]["betas"][0])
        ref_cycle.step()
    assert betas == pytest.approx(expected) == [0.8, 0.85, 0.8, 0.85]
    with pytest.raises(strata.Unsupported, match="engine's betas are fixed"):
        lr_schedules.OneCycle(engine.optimizer, 1e-3, 1e-2)


def test_a_schedule_callable_and_the_configs_schedule():
    engine, optimizer, _, schedule = deepspeed.initialize(
        model=make_mlp(), config=config(0),
        lr_scheduler=lambda opt: lr_schedules.WarmupDecayLR(opt, total_num_steps=6, warmup_max_lr=1e-2,
                                                            warmup_num_steps=2, warmup_type="linear"))
    assert isinstance(schedule, lr_schedules.WarmupDecayLR) and engine.config["scheduler"]["type"] == "WarmupDecayLR"
    train(engine, 3)
    # Update 3 ran with iteration 1's lr (half-way up the warm-up); the next, iteration 2, is the peak.
    assert engine.metrics["lr"] == pytest.approx(0.5e-2) and schedule.get_last_lr() == pytest.approx([1e-2])
    cfg = config(0, scheduler={"type": "WarmupCosineLR", "params": {"total_num_steps": 10, "warmup_num_steps": 2}})
    engine, _, _, schedule = deepspeed.initialize(model=make_mlp(), config=cfg)
    assert isinstance(schedule, lr_schedules.WarmupCosineLR)  # DeepSpeed returns the config's schedule
    train(engine, 3)
    assert schedule.last_batch_iteration == 2 and schedule.get_last_lr() == pytest.approx(schedule.get_lr())
    optimizer = torch.optim.AdamW(make_mlp().parameters(), lr=1e-2)
    optimizer.param_groups[0]["lr"] = 1e-2
    two_groups = make_mlp()
    client = torch.optim.AdamW([{"params": two_groups[0].parameters(), "lr": 1e-3},
                                {"params": list(two_groups[1].parameters()) + list(two_groups[3].parameters())}],
                               lr=1e-2)
    cfg = config(0)
    del cfg["optimizer"]
    with pytest.raises(strata.Unsupported, match="sets one lr for every param group"):
        deepspeed.initialize(model=two_groups, optimizer=client, config=cfg,
                             lr_scheduler=lr_schedules.WarmupLR(client, warmup_max_lr=1e-2))


# -- the training_data loader ------------------------------------------------------------------------------
def test_training_data_loader_is_deepspeeds():
    data = torch.utils.data.TensorDataset(torch.arange(22.0).unsqueeze(1))
    _, _, loader, _ = deepspeed.initialize(model=make_mlp(), config=config(0), training_data=data)
    order = [int(v) for (x,) in loader for v in x.flatten()]
    expected = [int(i) for i in torch.randperm(22, generator=torch.Generator().manual_seed(0))]
    assert order == expected  # DistributedSampler's shuffle, seed 0 (DeepSpeed's defaults)
    assert [len(x) for (x,) in loader] == [4, 4, 4, 4, 4, 2]
    assert [int(v) for (x,) in loader for v in x.flatten()] == expected  # the same order every epoch
    _, _, dropping, _ = deepspeed.initialize(model=make_mlp(), config=config(0, dataloader_drop_last=True),
                                             training_data=data)
    assert [len(x) for (x,) in dropping] == [4] * 5
    with pytest.raises(TypeError, match="dataloader_drop_last"):
        deepspeed.initialize(model=make_mlp(), config=config(0, dataloader_drop_last="yes"), training_data=data)


def test_training_data_loader_shards_across_ranks_as_deepspeed():
    from strata.torch._porting import training_loader
    data = torch.utils.data.TensorDataset(torch.arange(10.0).unsqueeze(1))
    ranks = [[int(v) for (x,) in training_loader(data, 2, None, 2, rank, False) for v in x.flatten()]
             for rank in range(2)]
    permutation = [int(i) for i in torch.randperm(10, generator=torch.Generator().manual_seed(0))]
    assert ranks == [permutation[0::2], permutation[1::2]]


# -- checkpoints -----------------------------------------------------------------------------------------
def test_load_checkpoint_with_nothing_saved_is_none_none_with_a_warning(tmp_path):
    engine, _, _, _ = deepspeed.initialize(model=make_mlp(), config=config(0))
    with pytest.warns(RuntimeWarning, match="nothing was loaded"):
        assert engine.load_checkpoint(tmp_path / "never_saved") == (None, None)
    with pytest.warns(RuntimeWarning, match="nothing was loaded"):
        assert engine.load_checkpoint(tmp_path) == (None, None)
    with pytest.raises(strata.NotFound):  # a tag named is loaded or refused, never skipped
        engine.load_checkpoint(tmp_path, tag="global_step9")
    with pytest.raises(strata.Unsupported, match="load_module_only"):
        engine.load_checkpoint(tmp_path, load_module_only=True)


def test_save_checkpoint_into_an_existing_tag_replaces_it(tmp_path):
    engine, _, _, _ = deepspeed.initialize(model=make_mlp(), config=config(2))
    train(engine, 2)
    engine.save_checkpoint(tmp_path, tag="run", client_state={"at": 2}, sync=True)
    train(engine, 2, first=2)
    engine.save_checkpoint(tmp_path, tag="run", client_state={"at": 4})
    expected = train(engine, 2, first=4)
    assert sorted(os.listdir(tmp_path)) == ["latest", "run"]  # no staging or probe folders left
    resumed, _, _, _ = deepspeed.initialize(model=make_mlp(seed=5), config=config(2))
    path, client_state = resumed.load_checkpoint(tmp_path)
    assert path == os.path.join(str(tmp_path), "run") and client_state == {"at": 4} and resumed.global_steps == 4
    assert train(resumed, 2, first=4) == expected
    # The default tag, saved twice at one step, is replaced too (DeepSpeed overwrites it).
    engine.save_checkpoint(tmp_path / "again")
    engine.wait_checkpoint()
    engine.save_checkpoint(tmp_path / "again", client_state={"second": True})
    fresh, _, _, _ = deepspeed.initialize(model=make_mlp(), config=config(2))
    assert fresh.load_checkpoint(tmp_path / "again", tag="global_step6")[1] == {"second": True}


def test_a_replacement_the_file_system_cannot_swap_leaves_the_old_checkpoint(tmp_path, monkeypatch):
    from strata import _torch_checkpoints
    engine, _, _, _ = deepspeed.initialize(model=make_mlp(), config=config(0))
    train(engine, 1)
    engine.save_checkpoint(tmp_path, tag="run", client_state={"old": True}, sync=True)
    (tmp_path / ".replace-run").mkdir()  # an interrupted replacement's leftovers

    def no_exchange(first, second):
        raise OSError(22, "Invalid argument")

    monkeypatch.setattr(_torch_checkpoints, "_exchange", no_exchange)
    with pytest.raises(strata.Unsupported, match="swap two folders in one rename"):
        engine.save_checkpoint(tmp_path, tag="run", client_state={"old": False})
    assert sorted(os.listdir(tmp_path)) == ["latest", "run"]
    other, _, _, _ = deepspeed.initialize(model=make_mlp(), config=config(0))
    assert other.load_checkpoint(tmp_path)[1] == {"old": True}


# -- names not provided ------------------------------------------------------------------------------------
def test_names_not_provided_are_refused_naming_the_equivalent():
    with pytest.raises(deepspeed._names.NotProvided, match=r"init_inference.*not supported"):
        deepspeed.init_inference(make_mlp())
    with pytest.raises(ImportError, match="master_parameters"):  # `except ImportError` fallbacks still run
        from strata.torch.utils import safe_get_full_fp32_param  # noqa: F401
    with pytest.raises(ImportError, match=r"strata.torch.StrataEngine"):
        from strata.torch import DeepSpeedEngine  # noqa: F401
    with pytest.raises(ModuleNotFoundError, match="pipeline parallelism is not supported"):
        import strata.torch.pipe  # noqa: F401
    with pytest.raises(ModuleNotFoundError, match=r"deepspeed\.runtime\.zero\b.*strata\.torch\.zero"):
        import strata.torch.runtime.zero.stage3  # noqa: F401
    with pytest.raises(ImportError, match="LAMB is not supported"):
        from strata.torch.ops import lamb  # noqa: F401
    with pytest.raises(deepspeed._names.NotProvided, match="register_external_parameter") as refused:
        deepspeed.zero.register_external_parameter(None, None)
    assert not isinstance(refused.value, AttributeError)  # never Python's "did you mean"
    assert not hasattr(deepspeed, "_no_such_private_name")  # probes of private names stay AttributeErrors
    assert deepspeed.runtime.zero is deepspeed.zero and deepspeed.runtime.lr_schedules is lr_schedules
    for name in ("add_config_arguments", "get_accelerator", "initialize", "zero", "ops", "utils", "runtime",
                 "accelerator", "log_dist", "logger"):
        assert getattr(deepspeed, name) is not None


def test_log_dist_logs_on_the_ranks_asked(capsys, monkeypatch):
    deepspeed.log_dist("hello from one process", ranks=[0])
    assert "hello from one process" in capsys.readouterr().out
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    deepspeed.log_dist("only rank 0", ranks=[0])
    deepspeed.log_dist("every rank", ranks=[-1])
    out = capsys.readouterr().out
    assert "only rank 0" not in out and "[Rank 1] every rank" in out
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        deepspeed.utils.RepeatingLoader([1, 2])  # no warning
    repeating = deepspeed.utils.RepeatingLoader([1, 2])
    assert [next(repeating) for _ in range(5)] == [1, 2, 1, 2, 1]
