"""strata.torch.runtime.lr_schedules: DeepSpeed's learning-rate schedules
(deepspeed.runtime.lr_schedules) under their names and arguments: WarmupLR,
WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest.

Their values come from the engine's own schedule (offload/lr_schedule.h,
through strata._native.LrSchedule), the one a config's "scheduler" section
runs, so the two never disagree. Two ways to use one:

  - given to strata.torch.initialize (lr_scheduler=, or a callable taking
    the optimizer): it becomes the config's "scheduler" section and the
    engine runs it (its momentum too: OneCycle's cycle_momentum), as
    DeepSpeed steps a client scheduler after each applied step; the object
    then reports the engine's values (get_last_lr) without writing them;
  - on any torch optimizer (DeepSpeed's own use: scheduler.step() after each
    optimizer step): it writes each param group's lr (and OneCycle's betas),
    as DeepSpeed's does, its constructor writing the first values.

Note [Schedule iterations]
As in DeepSpeed, last_batch_iteration counts scheduler steps from -1 (the
constructor's values); iteration i is the native schedule's update i + 2
(LrSchedule: Note [Which lr the k-th update uses]).

Differences from DeepSpeed's: values DeepSpeed accepts and then misuses are
refused with the config checker's message (e.g. warmup_max_lr below
warmup_min_lr, total_num_steps below warmup_num_steps, an unknown
warmup_type); given to initialize, a schedule that sets one lr for every
group (all but WarmupCosineLR) needs the groups to start at one lr, since the
engine keeps each group's lr as a fixed multiple of the schedule's.
"""

import json
import numbers

import torch

from ... import _native
from ...errors import InvalidArgument, Unsupported
from .._names import refusing_getattr

__all__ = ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest", "VALID_LR_SCHEDULES",
           "adopt_into_config"]

LR_RANGE_TEST = "LRRangeTest"
ONE_CYCLE = "OneCycle"
WARMUP_LR = "WarmupLR"
WARMUP_DECAY_LR = "WarmupDecayLR"
WARMUP_COSINE_LR = "WarmupCosineLR"
VALID_LR_SCHEDULES = [LR_RANGE_TEST, ONE_CYCLE, WARMUP_LR, WARMUP_DECAY_LR, WARMUP_COSINE_LR]


def _torch_optimizer(optimizer, owner):
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        return inner
    raise TypeError(f"{owner}: optimizer must be a torch.optim.Optimizer (or wrap one as .optimizer), not "
                    f"{type(optimizer).__name__}")


def _per_group(optimizer, value, name, owner):
    """DeepSpeed's scalar-or-list parameters: one value per param group."""
    groups = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != groups:
            raise ValueError(f"{owner}: {name} has {len(value)} values for the optimizer's {groups} param group(s)")
        return list(value)
    return [value] * groups


def _native_schedule(section, owner):
    # Base lr 1: the schedule's values are absolute lrs, or (WarmupCosineLR) ratios of each group's lr.
    config = {"train_batch_size": 1, "optimizer": {"type": "AdamW", "params": {"lr": 1.0}}, "scheduler": section}
    try:
        text = json.dumps(config, allow_nan=False)
    except (TypeError, ValueError) as e:
        raise TypeError(f"{owner}: the schedule's parameters must be numbers, strings and bools: {e}") from None
    try:
        return _native.LrSchedule(text)
    except InvalidArgument as e:
        raise InvalidArgument(f"{owner}: {e}") from None


def _group_lr(group):
    lr = group["lr"]
    return float(lr) if torch.is_tensor(lr) else lr


def _set_group_lr(group, lr):
    if torch.is_tensor(group["lr"]):
        group["lr"].fill_(lr)
    else:
        group["lr"] = lr


class _Schedule:
    """What the five schedules share: one native schedule per param group,
    stepped by last_batch_iteration (Note [Schedule iterations])."""

    _type = ""
    _ratio_of_group_lr = False  # WarmupCosineLR: its values scale each group's own lr

    def _setup(self, optimizer, params, per_group_keys, last_batch_iteration, engine_driven=False):
        owner = type(self).__name__
        self.optimizer = _torch_optimizer(optimizer, owner)
        if isinstance(last_batch_iteration, bool) or not isinstance(last_batch_iteration, numbers.Integral) \
                or last_batch_iteration < -1:
            raise ValueError(f"{owner}: last_batch_iteration {last_batch_iteration!r} is not -1 (a new schedule) or "
                             f"the index of the last batch trained")
        groups = self.optimizer.param_groups
        self._initial_lrs = [_group_lr(g) for g in groups]
        self._initial_betas = [g.get("betas") for g in groups]  # OneCycle writes its own
        lists = {key: _per_group(self.optimizer, params[key], key, owner) for key in per_group_keys if key in params}
        self._sections = []
        for gi in range(len(groups)):
            section_params = dict(params)
            section_params.update({key: values[gi] for key, values in lists.items()})
            self._sections.append({"type": self._type, "params": section_params})
        self._schedules = [_native_schedule(section, owner) for section in self._sections]
        self.last_batch_iteration = int(last_batch_iteration)
        self._engine_driven = engine_driven
        self._last_lr = None
        if last_batch_iteration == -1:
            self._apply()

    def _betas(self):
        return None

    def _apply(self):
        lrs = self.get_lr()
        if not self._engine_driven:
            for group, lr in zip(self.optimizer.param_groups, lrs):
                _set_group_lr(group, lr)
            betas = self._betas()
            if betas is not None:
                for group, pair in zip(self.optimizer.param_groups, betas):
                    group["betas"] = pair
        self._last_lr = lrs

    def get_lr(self):
        """The lrs of the current iteration, one per param group (not written)."""
        return self.lr_at(self.last_batch_iteration)

    def lr_at(self, last_batch_iteration):
        """The lrs, one per param group, once the schedule is at last_batch_iteration (nothing changes)."""
        update = last_batch_iteration + 2  # Note [Schedule iterations]
        lrs = [schedule.lr(update) for schedule in self._schedules]
        if self._ratio_of_group_lr:
            lrs = [initial * ratio for initial, ratio in zip(self._initial_lrs, lrs)]
        return lrs

    def get_last_lr(self):
        """The lrs last set (DeepSpeed's: after the constructor of a new schedule, or a step())."""
        if self._last_lr is None:
            raise RuntimeError(f"{type(self).__name__}.get_last_lr() before any lr was set: call step() first")
        return list(self._last_lr)

    def step(self, last_batch_iteration=None):
        """Moves to the next iteration (or to last_batch_iteration) and sets its lr."""
        if last_batch_iteration is None:
            last_batch_iteration = self.last_batch_iteration + 1
        if isinstance(last_batch_iteration, bool) or not isinstance(last_batch_iteration, numbers.Integral) \
                or last_batch_iteration < -1:
            raise ValueError(f"{type(self).__name__}.step({last_batch_iteration!r}): an iteration index >= -1")
        self.last_batch_iteration = int(last_batch_iteration)
        self._apply()

    def state_dict(self):
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, state_dict):
        self.last_batch_iteration = int(state_dict["last_batch_iteration"])

    # -- given to strata.torch.initialize -----------------------------------------------------------
    def _engine_section(self, optimizer_lr):
        """The config's "scheduler" section that runs this schedule in the
        engine; Unsupported naming what the engine cannot run."""
        owner = type(self).__name__
        first = self._sections[0]
        for gi, section in enumerate(self._sections[1:], start=1):
            if section != first:
                differing = sorted(k for k in section["params"] if section["params"][k] != first["params"].get(k))
                raise Unsupported(f"{owner} has per-group values ({', '.join(differing)} differ in param group {gi}): "
                                  f"the engine runs one schedule for every group (each group's lr a fixed multiple "
                                  f"of it); give one value")
        if not self._ratio_of_group_lr:
            for gi, lr in enumerate(self._initial_lrs):
                if lr != optimizer_lr:
                    raise Unsupported(f"{owner} sets one lr for every param group, but param group {gi} starts at "
                                      f"lr {lr} and the optimizer at {optimizer_lr}: the engine keeps each group's lr "
                                      f"a fixed multiple of the schedule's; give the groups one lr (or use "
                                      f"WarmupCosineLR, which scales each group's own lr)")
        section = {"type": first["type"], "params": dict(first["params"])}
        if self.last_batch_iteration != -1:
            section["params"]["last_batch_iteration"] = self.last_batch_iteration
        return section


class WarmupLR(_Schedule):
    """deepspeed.runtime.lr_schedules.WarmupLR: from warmup_min_lr up to
    warmup_max_lr (default: each group's lr) over warmup_num_steps, "log" or
    "linear", then flat."""

    _type = WARMUP_LR

    def __init__(self, optimizer, warmup_min_lr=0.0, warmup_max_lr=None, warmup_num_steps=1000, warmup_type="log",
                 last_batch_iteration=-1):
        if warmup_max_lr is None:
            warmup_max_lr = [_group_lr(g) for g in _torch_optimizer(optimizer, type(self).__name__).param_groups]
        self._setup(optimizer, {"warmup_min_lr": warmup_min_lr, "warmup_max_lr": warmup_max_lr,
                                "warmup_num_steps": warmup_num_steps, "warmup_type": warmup_type},
                    ("warmup_min_lr", "warmup_max_lr"), last_batch_iteration)


class WarmupDecayLR(_Schedule):
    """deepspeed.runtime.lr_schedules.WarmupDecayLR: WarmupLR's warm-up, then
    a linear decay to 0 at total_num_steps."""

    _type = WARMUP_DECAY_LR

    def __init__(self, optimizer, total_num_steps, warmup_min_lr=0.0, warmup_max_lr=0.001, warmup_num_steps=1000,
                 warmup_type="log", last_batch_iteration=-1):
        self._setup(optimizer, {"total_num_steps": total_num_steps, "warmup_min_lr": warmup_min_lr,
                                "warmup_max_lr": warmup_max_lr, "warmup_num_steps": warmup_num_steps,
                                "warmup_type": warmup_type},
                    ("warmup_min_lr", "warmup_max_lr"), last_batch_iteration)


class WarmupCosineLR(_Schedule):
    """deepspeed.runtime.lr_schedules.WarmupCosineLR: each group's lr times a
    ratio rising from warmup_min_ratio to 1 over warmup_num_steps, then a
    cosine down to cos_min_ratio at total_num_steps."""

    _type = WARMUP_COSINE_LR
    _ratio_of_group_lr = True

    def __init__(self, optimizer, total_num_steps, warmup_min_ratio=0.0, warmup_num_steps=1000, cos_min_ratio=0.0001,
                 warmup_type="log", last_batch_iteration=-1):
        self._setup(optimizer, {"total_num_steps": total_num_steps, "warmup_min_ratio": warmup_min_ratio,
                                "warmup_num_steps": warmup_num_steps, "cos_min_ratio": cos_min_ratio,
                                "warmup_type": warmup_type}, (), last_batch_iteration)


class OneCycle(_Schedule):
    """deepspeed.runtime.lr_schedules.OneCycle: the lr up from cycle_min_lr to
    cycle_max_lr and back, then an optional decay; with cycle_momentum (and
    an optimizer with betas) beta1 cycles the other way, beta2 set to 0.99."""

    _type = ONE_CYCLE

    def __init__(self, optimizer, cycle_min_lr, cycle_max_lr, decay_lr_rate=0., cycle_first_step_size=2000,
                 cycle_second_step_size=None, cycle_first_stair_count=0, cycle_second_stair_count=None,
                 decay_step_size=0, cycle_momentum=True, cycle_min_mom=0.8, cycle_max_mom=0.9, decay_mom_rate=0.,
                 last_batch_iteration=-1):
        torch_optimizer = _torch_optimizer(optimizer, "OneCycle")
        # DeepSpeed's: no momentum to cycle in an optimizer without betas (Adagrad).
        self.cycle_momentum = bool(cycle_momentum) and "betas" in torch_optimizer.defaults
        if self.cycle_momentum and _is_engine_optimizer(torch_optimizer):
            raise Unsupported("OneCycle(cycle_momentum=True) on the optimizer strata.torch.initialize returned: the "
                              "engine's betas are fixed once it is made; give the schedule to initialize "
                              "(lr_scheduler=OneCycle(client_optimizer, ...)) or the config's \"scheduler\" section, "
                              "where the engine cycles them, or pass cycle_momentum=False")
        params = {"cycle_min_lr": cycle_min_lr, "cycle_max_lr": cycle_max_lr, "decay_lr_rate": decay_lr_rate,
                  "cycle_first_step_size": cycle_first_step_size, "cycle_second_step_size": cycle_second_step_size,
                  "cycle_first_stair_count": cycle_first_stair_count,
                  "cycle_second_stair_count": cycle_second_stair_count, "decay_step_size": decay_step_size,
                  "cycle_momentum": self.cycle_momentum}
        if self.cycle_momentum:
            params.update(cycle_min_mom=cycle_min_mom, cycle_max_mom=cycle_max_mom, decay_mom_rate=decay_mom_rate)
        self._setup(optimizer, params, ("cycle_min_lr", "cycle_max_lr", "cycle_min_mom", "cycle_max_mom"),
                    last_batch_iteration)

    def _betas(self):
        if not self.cycle_momentum:
            return None
        update = self.last_batch_iteration + 2
        return [tuple(schedule.betas(update)) for schedule in self._schedules]

    def get_mom(self):
        """The (beta1, beta2) of the current iteration per param group, or None without cycle_momentum."""
        return self._betas()


class LRRangeTest(_Schedule):
    """deepspeed.runtime.lr_schedules.LRRangeTest: the lr grows from
    lr_range_test_min_lr by lr_range_test_step_rate every
    lr_range_test_step_size steps (continuously, or in stairs)."""

    _type = LR_RANGE_TEST

    def __init__(self, optimizer, lr_range_test_min_lr=1e-3, lr_range_test_step_size=2000,
                 lr_range_test_step_rate=1.0, lr_range_test_staircase=False, last_batch_iteration=-1):
        self._setup(optimizer, {"lr_range_test_min_lr": lr_range_test_min_lr,
                                "lr_range_test_step_size": lr_range_test_step_size,
                                "lr_range_test_step_rate": lr_range_test_step_rate,
                                "lr_range_test_staircase": lr_range_test_staircase},
                    ("lr_range_test_min_lr",), last_batch_iteration)


def _is_engine_optimizer(optimizer):
    """The optimizer of an engine already made (initialize's callable form gets it before: then the schedule
    becomes the engine's)."""
    from ..._torch_optimizer import StrataOptimizer
    return isinstance(optimizer, StrataOptimizer) and optimizer._engine is not None


def adopt_into_config(scheduler, raw_config, optimizer_lr):
    """For strata.torch.initialize: when `scheduler` is one of these
    schedules, writes its section into raw_config["scheduler"] (the engine
    runs it), gives the param groups back the lrs (and betas) they had before the
    schedule wrote its first values (the engine's groups keep their ratios to
    those) and makes the object report the engine's values from then on.
    Returns whether it did. A config with its own "scheduler" section is
    refused by initialize (one schedule)."""
    if not isinstance(scheduler, _Schedule):
        return False
    if raw_config.get("scheduler") is not None:
        raise ValueError(f"both a client lr_scheduler ({type(scheduler).__name__}) and the config's \"scheduler\" "
                         f"section are given: drop one of them")
    raw_config["scheduler"] = scheduler._engine_section(optimizer_lr)
    for group, lr, betas in zip(scheduler.optimizer.param_groups, scheduler._initial_lrs, scheduler._initial_betas):
        _set_group_lr(group, lr)
        if betas is not None:
            group["betas"] = betas
    scheduler._engine_driven = True
    return True


def schedule_from_config(optimizer, section):
    """The schedule object of a resolved config's "scheduler" section, reporting the engine's values (what
    DeepSpeed's initialize returns for a config scheduler); None for "none"."""
    kinds = {cls._type: cls for cls in (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle, LRRangeTest)}
    kind = kinds.get(section.get("type"))
    if kind is None:
        return None
    schedule = kind.__new__(kind)
    schedule.cycle_momentum = bool(section["params"].get("cycle_momentum", False))
    params = {k: v for k, v in section["params"].items() if k != "last_batch_iteration"}
    if kind is WarmupLR and params.get("warmup_max_lr") is None:  # null: the optimizer's lr, as in the engine
        params["warmup_max_lr"] = optimizer.defaults["lr"]
    schedule._setup(optimizer, params, (), section["params"].get("last_batch_iteration", -1), engine_driven=True)
    return schedule


__getattr__ = refusing_getattr(__name__, {
    "add_tuning_arguments": "the schedule's parameters go in the config's \"scheduler\" section (or the "
                            "classes' arguments); there are no command-line tuning flags",
    "get_config_from_args": "the schedule's parameters go in the config's \"scheduler\" section",
    "get_lr_from_config": "the config's optimizer.params.lr (strata.config.load(config)[\"optimizer\"])",
})
