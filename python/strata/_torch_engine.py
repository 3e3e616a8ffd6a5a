"""strata.torch: StrataEngine, the nn.Module wrapper whose hooks drive the
engine (strata.engine.Engine) while torch runs the model's forward and
backward. The hooks themselves, and Note [Hooks per unit], are in
strata/_torch_hooks.py (UnitHooks)."""

import contextlib
import copy
import hashlib
import json
import os
import threading

import torch

from . import _torch_checkpoints
from ._checks import JSON_DEPTH_LIMIT, check_int, check_json, check_path
from .errors import FailedPrecondition, StrataError, Unavailable, Unsupported
from ._torch_device import StepLoss
from .engine import _numel
from ._torch_hooks import UnitHooks, _Flag, _LayerState, _ParameterUseCheck, _first_tensor
from ._torch_guards import (BackwardReach, ModelShape, ThreadGuard, close_engine, driven, mark_released,
                            refuse_empty_micro_batch)

__all__ = ["StrataEngine"]


class _AppliedStep:
    """Note [Feeding undone steps again]
    A step the engine applied whose update is not committed yet. With
    overlap on (the default) step t's update runs while step t + 1 computes,
    and its commit point is step t + 1's finish_step() (or a synchronize(),
    an evaluation): an NVMe write of step t's update that fails there rolls
    every rank back to the state after step t - 1, so two steps are undone,
    not one, and feeding only step t + 1's batches again would train them as
    step t. What feeding step t again needs is kept here until the next step
    applies: the engine's step count when it was begun (a rollback puts the
    count below it), the lr state before it (param_groups, the torch lr
    scheduler's state: the scheduler stepped after it), and, when
    train_batch() ran it, its micro-batches and loss_fn, which the next
    train_batch() replays before its own step."""

    __slots__ = ("number", "begun", "lr_before", "micro_batches", "loss_fn")

    def __init__(self, number, begun, lr_before):
        self.number = number          # the optimizer step it applied
        self.begun = begun            # the engine's steps_begun with it
        self.lr_before = lr_before    # _lr_state() before it
        self.micro_batches = None     # train_batch()'s, else None (not kept)
        self.loss_fn = None


class StrataEngine(UnitHooks, torch.nn.Module):
    """What strata.torch.initialize returns first: call it as the model,
    then backward(loss) and step() as with DeepSpeed's engine."""

    # At stage 3, (AVAILABLE, NOT_AVAILABLE) of strata.torch.zero.ZeroParamStatus: kept in each parameter's
    # ds_status as it is bound and unbound (DeepSpeed's attribute; set by strata.torch.initialize).
    _ds_status = None

    def __init__(self, model, units, plans, native, optimizer, lr_scheduler, config, device):
        super().__init__()
        self.module = model
        self._device = device                    # TorchDevice (Note [The device strata.torch trains on])
        self._step_loss = StepLoss(device)
        self.config = config                     # the resolved config (every default and "auto" filled in)
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self._engine = native                    # strata.engine.Engine
        self._units = units
        self._layers = [_LayerState(p, native.keeps_whole(index)) for index, p in enumerate(plans)]
        # Which of DeepSpeed's surfaces applies (its ds_* attributes at stage 3); where a layer's memory lives
        # is the engine's placement (_LayerState.kept_whole).
        self._stage = config["zero_optimization"]["stage"]
        self._config_scheduler = config["scheduler"]["type"] != "none"
        self._shown_lr = None      # with the config's scheduler: the lr last shown in param_groups
        self._gas = native.gradient_accumulation_steps
        self._placeholders = {}
        # The front end's own: whether torch is inside the root module's forward ("forward" or "eval"); the
        # engine's micro-batch lasts from that forward to backward's end and cannot tell where torch is in it.
        self._pass = None
        # Whether a step or a micro-batch is open, and how many passes hold a layer, are asked of the engine
        # (self._engine.in_step, .in_micro_batch, .holds(i)): no copy here that a failed call could leave out
        # of step (docs/engine.md, "The torch front end's state").
        self._no_sync = False      # inside no_sync()
        # DeepSpeed's micro_steps (engine.step() calls): the front end's own, since a step() off the
        # accumulation boundary is a no-op the engine never sees.
        self._micro_steps = 0
        self._global_steps = 0     # optimizer steps applied
        self._samples = 0          # the micro-batch's samples (its first tensor argument's first dimension)
        self._samples_hint = 0     # the same, seen by forward() (kwargs included)
        self._open_calls = []      # unit calls between pre- and post-backward
        self._root_calls = []      # the root unit's forward calls of this micro-batch (held for all of backward)
        self._in_backward = False  # inside engine.backward's autograd run
        self._stacks = {id(u): [] for u in units}
        self.metrics = None        # the last applied step's metrics (the engine's StepMetrics)
        self.gradient_copies = 0   # gradients handed over by an add (not accumulated in place by torch)
        self.last_outcome = None
        self._uncommitted = None   # _AppliedStep: the last applied step (Note [Feeding undone steps again])
        self._undone = None        # _AppliedStep a rollback undid besides the step in progress: fed again first
        self._handles = []
        self._entry_open = None    # the entry module whose own evaluation runs (Note [Evaluations that start inside
                                   # the model])
        # Modules that run other modules' blocks under Hugging Face's gradient checkpointing (a
        # `gradient_checkpointing` attribute, not a unit itself: a unit that checkpoints its own forward, as
        # transformers 5's layers do, runs inside its hooks; Note [Checkpointed forwards through the hooks]).
        self._unit_module_ids = {id(u.module) for u in units if not u.is_root}
        self._checkpointing_modules = [m for m in model.modules()
                                       if hasattr(m, "gradient_checkpointing") and id(m) not in self._unit_module_ids]
        # Units that checkpoint their own forward (transformers 5): routed only to keep their inputs in host memory
        # (Note [Activation checkpoints in host memory]).
        self._checkpointing_units = [m for m in model.modules()
                                     if hasattr(m, "gradient_checkpointing") and id(m) in self._unit_module_ids]
        self._install_hooks()
        self._layer_of = {p: index for index, plan in enumerate(plans) for _, p in plan.params}
        self._names = {p: name for plan in plans for name, p in plan.params}
        self._internal = _Flag()   # .active: inside the hooks' own tensor work (not checked)
        self._running_units = []   # units whose forward runs, innermost last
        # Check the next training forward for parameters used outside their unit (then off).
        self.check_parameter_use = True
        self._guard = ThreadGuard()                   # Note [One driving thread]
        self._shape = ModelShape(model, self._names)  # Note [The model initialize was given]
        self._reach = BackwardReach()                 # the outputs engine.backward's loss must reach
        self._closed = False
        self._save_pending = False                    # a save not waited for (Note [Saves finished at exit])
        self._job_name, self._nvme_paths = None, []   # the swap folders' (strata.torch.initialize sets them)
        for p in self._names:
            mark_released(p)  # until their unit's first acquire binds them (Note [Released parameters])

    # -- the DeepSpeed surface -------------------------------------------------------------------
    def forward(self, *args, **kwargs):
        # The micro-batch's size for the engine's throughput; the root module's hook sees no kwargs (torch 1.13).
        first = _first_tensor(args, kwargs)
        self._samples_hint = first.shape[0] if first is not None and first.dim() > 0 else 0
        if torch.is_grad_enabled() and self._pass is None:
            refuse_empty_micro_batch(self, args, kwargs)
        try:
            if not (self.check_parameter_use and torch.is_grad_enabled() and _ParameterUseCheck is not None):
                return self.module(*args, **kwargs)
            # The first training forward runs under the check: a parameter used while its unit is not
            # acquired is named (at stage 3 torch would see an empty placeholder and fail with a shape error).
            with _ParameterUseCheck(self):
                out = self.module(*args, **kwargs)
            self.check_parameter_use = False
            return out
        except BaseException:
            # The pass had begun, this thread's (a refusal before it, or of another thread, changed nothing).
            if self._pass is not None and self._guard.owner == threading.get_ident():
                self._abandon_pass()
            raise

    @contextlib.contextmanager
    def no_sync(self):
        """DeepSpeed's (and DDP's) no_sync(): the micro-batches inside do not
        reduce gradients across ranks. The engine reduces once per step, in
        the last of its gradient_accumulation_steps micro-batches, so every
        other micro-batch already is one; the last one inside the block is
        refused (it is where the step's gradients are reduced)."""
        self._no_sync = True
        try:
            yield
        finally:
            self._no_sync = False

    @driven("engine.synchronize()")
    def synchronize(self):
        """Waits for every queued optimizer update (the engine overlaps a
        step's update with the next forward) and commits it: before timing a
        run's end, or reading state with another tool. Between steps."""
        if self._engine.in_step:
            raise self._out_of_order("synchronize() in the middle of a step: call it after engine.step() at a "
                                     "gradient accumulation boundary")
        self._at_commit_point(self._engine.synchronize)

    def _out_of_order(self, message):
        """The error for a call the engine's phase does not allow now: why the engine stopped, when it did (a
        failed call then left the phase where it got to, which is not the caller's mistake), else
        FailedPrecondition(message)."""
        self._engine.raise_if_stopped()
        return FailedPrecondition(message)

    def memory(self):
        """The engine's memory per tier: {"predicted": its plan, "measured": the peaks so far}."""
        return {"predicted": self._engine.predicted_memory(), "measured": self._engine.measured_memory()}

    def is_gradient_accumulation_boundary(self):
        return (self._micro_steps + 1) % self._gas == 0

    def gradient_accumulation_steps(self):
        return self._gas

    @property
    def global_steps(self):
        return self._global_steps

    @property
    def global_rank(self):
        """This process's rank (0 in one process; its MPI rank under mpirun)."""
        return self._engine.rank

    @property
    def world_size(self):
        """The data-parallel ranks (1 in one process; mpirun's -np)."""
        return self._engine.world_size

    dp_world_size = world_size

    @property
    def local_rank(self):
        """This process's rank on its node (the launcher's LOCAL_RANK; 0 in one process)."""
        from .torch.accelerator import local_rank
        return local_rank()

    @property
    def device(self):
        """The device the module's tensors live on: the cpu or the GPU the engine trains on (DeepSpeed's
        engine.device; Note [The device strata.torch trains on])."""
        return self._device.torch_device

    def get_global_grad_norm(self):
        """The gradients' global norm of the last applied step (unscaled, before clipping), or None before the
        first step (DeepSpeed's)."""
        return None if self.metrics is None else self.metrics["grad_norm"]

    @driven("engine.backward(loss)")
    def backward(self, loss, retain_graph=False):
        """Runs autograd on loss scaled by the engine's gradient scale (1 /
        gradient_accumulation_steps, and the fp16 loss scale), hands every
        unit's gradients to the engine and ends the micro-batch."""
        if not self._engine.in_micro_batch:
            raise self._out_of_order("engine.backward(loss) without a training forward before it: call engine(...) "
                                     "with gradients enabled first")
        self._reach.refuse_unless_reached(loss)
        scale = self._engine.gradient_scale()
        self._in_backward = True
        try:
            # The root unit is held for the whole backward. Acquired here, not only by a hook on the forward's
            # outputs: a model may return its loss in an object the hooks cannot look into.
            root_calls, self._root_calls = self._root_calls, []
            for call in root_calls:
                self._pre_backward(call)
            (loss * scale if scale != 1.0 else loss).backward(retain_graph=retain_graph)
            self._in_backward = False
            self._flush_backward()
        except BaseException:
            self._in_backward = False
            self._abandon_pass()
            raise
        self._engine.end_micro_batch(self._step_loss.hand_in(loss, self.is_gradient_accumulation_boundary()),
                                     self._samples)
        self._reach.clear()
        return loss

    @driven("engine.step()")
    def step(self):
        """At the gradient accumulation boundary: the engine's step (norm,
        clipping, update, with the optimizer's lr) and the lr scheduler's.
        Elsewhere a no-op, as DeepSpeed's."""
        if self._engine.in_micro_batch:
            raise self._out_of_order("engine.step() after a forward without engine.backward(loss)")
        if self.is_gradient_accumulation_boundary():
            # Through the optimizer (so torch schedulers see it stepped): the step and the micro-step's end.
            self.optimizer.step()
            if self.lr_scheduler is not None and not self.metrics["skipped"]:  # DeepSpeed: not after an fp16 skip
                self.lr_scheduler.step()
        else:
            self._micro_steps += 1

    @driven("engine.train_batch()")
    def train_batch(self, batches=None, data_iter=None, loss_fn=None, retries=3):
        """One optimizer step from its micro-batches (the name of DeepSpeed's
        pipeline engine's call): for each of the step's
        gradient_accumulation_steps micro-batches the forward, the loss and
        engine.backward(loss), then engine.step(). When the engine rolls the
        step back on every rank (an NVMe I/O failure in an update, Note
        [Atomic steps] in docs/engine.md; engine.step() raises Unavailable)
        the same micro-batches run again, up to `retries` times in this call
        (strata train --step-retries), so the losses equal those of a run that
        never failed. With overlap on, a failed write of the previous step's
        update undoes that step too: train_batch() kept its micro-batches
        and replays them first (here, or in the next call after a rollback
        that ran out of retries); a previous step the caller's own loop ran
        was not kept, so the error says to feed it again instead (Note
        [Feeding undone steps again]). Returns the step's mean loss (a float).

        batches: a list of the step's micro-batches (one micro-batch, not in
        a list, when gradient_accumulation_steps is 1); or data_iter: an
        iterator they are drawn from (kept for the retries). A micro-batch is
        passed to the module as engine(**mb) for a dict, engine(*mb) for a
        tuple or list, else engine(mb). loss_fn(output, micro_batch) -> the
        loss; without it the output's .loss (Hugging Face) or the output
        itself when it is a scalar tensor."""
        if isinstance(retries, bool) or not isinstance(retries, int) or not 0 <= retries <= 1000:
            raise ValueError(f"train_batch(retries={retries!r}): retries is a count of repeated steps in 0..1000")
        if self._engine.in_micro_batch or self._micro_steps % self._gas != 0:
            raise self._out_of_order(f"train_batch() in the middle of a step (micro-batch {self._micro_steps % self._gas + 1} "
                                     f"of {self._gas}): finish it with engine.step() first")
        micro_batches = self._step_micro_batches(batches, data_iter)
        self._notice_undone_step()  # e.g. by a synchronize() since the last step
        while True:
            try:
                self._feed_undone_step()
                return self._run_step(micro_batches, loss_fn)
            except Unavailable:
                # Rolled back (or dropped) on every rank: the state is an earlier step's, the micro-batch count
                # is back at its first (_apply_step); a step undone besides this one is fed again first.
                if retries == 0 or self._micro_steps % self._gas != 0:
                    raise
                if self._undone is not None and self._undone.micro_batches is None:
                    raise  # its batches were the caller's loop's: the error says to feed them again
                retries -= 1

    def _run_step(self, micro_batches, loss_fn):
        """One step of train_batch(): the forward, loss and backward of each micro-batch, engine.step() after
        each; the mean loss. The applied step keeps its micro-batches (Note [Feeding undone steps again])."""
        losses = []
        for mb in micro_batches:
            output = self(**mb) if isinstance(mb, dict) else self(*mb) if isinstance(mb, (tuple, list)) \
                else self(mb)
            try:
                loss = self._loss_of(output, mb, loss_fn)
            except BaseException:
                self._abandon_pass()  # the forward's micro-batch is dropped with its step
                raise
            self.backward(loss)
            losses.append(loss.detach())
            self.step()
        self._uncommitted.micro_batches, self._uncommitted.loss_fn = micro_batches, loss_fn
        return sum(float(loss) for loss in losses) / len(losses)  # read once the step is over (a GPU's queue)

    def _feed_undone_step(self):
        """train_batch(): the step a rollback undid besides the one in progress, replayed from the micro-batches
        train_batch() kept (Note [Feeding undone steps again]). One the caller's loop ran was not kept: the
        rollback's error said to feed it again, so the batches given now are taken as that step's."""
        undone, self._undone = self._undone, None
        if undone is None or undone.micro_batches is None:
            return
        try:
            self._run_step(undone.micro_batches, undone.loss_fn)
        except BaseException:
            if self._undone is None and self._global_steps < undone.number:
                self._undone = undone  # not applied (rolled back itself, or a forward raised): still owed
            raise

    def _lr_state(self):
        """What an undone step's lr needs back: param_groups' lrs, the lr shown, the torch lr scheduler's state."""
        scheduler = None
        if self.lr_scheduler is not None and hasattr(self.lr_scheduler, "state_dict"):
            scheduler = self.lr_scheduler.state_dict()
            try:
                scheduler = copy.deepcopy(scheduler)
            except Exception:  # noqa: BLE001 (state a deep copy cannot take: torch's own schedulers replace theirs)
                pass
        return [g["lr"] for g in self.optimizer.param_groups], self._shown_lr, scheduler

    def _restore_lr(self, state):
        lrs, shown, scheduler = state
        if scheduler is not None:
            self.lr_scheduler.load_state_dict(scheduler)
        for group, lr in zip(self.optimizer.param_groups, lrs):
            group["lr"] = lr
        self._shown_lr = shown

    def _notice_undone_step(self):
        """The last applied step, when a rollback since undid it (the engine's step count went below it): the
        counters and the lr go back to the state before it and it is owed (self._undone); else None."""
        previous = self._uncommitted
        if previous is None or self._engine.steps_begun >= previous.begun:
            return None
        self._uncommitted = None
        self._undone = previous
        self._global_steps = self._engine.optimizer_steps
        self._micro_steps -= self._gas
        self._restore_lr(previous.lr_before)
        return previous

    def _what_to_feed_again(self, undone, with_current):
        """The advice of a rollback's error: which steps to feed again, and whether train_batch() replays one."""
        first = self._global_steps + 1
        if undone is None:
            return f"run the step's batches again (it is step {first} again)"
        steps = f"steps {first} and {first + 1} are undone (step {first}'s update failed while step {first + 1} " \
            f"ran)" if with_current else f"step {first} is undone (its update failed after engine.step() returned)"
        then = ", then the step in progress's" if with_current else ""
        if undone.micro_batches is not None:
            return (f"{steps}; train_batch() kept step {first}'s micro-batches and replays them before its own "
                    f"step: call it again with the {'same' if with_current else 'next'} batches (a loop of "
                    f"engine(...), backward and step() runs step {first}'s batches again{then})")
        return (f"{steps}; run step {first}'s batches again{then} (step {first} ran outside train_batch(), so its "
                f"micro-batches were not kept)")

    def _at_commit_point(self, call, *args):
        """A call that may reach the commit point of the last applied step outside a step (synchronize(), an
        evaluation, gathering state): when it rolls that step back, the counters and the lr follow the engine
        and the error (Unavailable) says what to feed again."""
        try:
            return call(*args)
        except StrataError as error:
            undone = self._notice_undone_step()
            if undone is None:
                raise
            raise Unavailable(f"{error}; the state is the one after step {self._global_steps}: "
                              f"{self._what_to_feed_again(undone, with_current=False)}") from error

    def _step_micro_batches(self, batches, data_iter):
        if (batches is None) == (data_iter is None):
            raise ValueError("train_batch() takes the step's micro-batches as batches=[...] or data_iter=iterator, "
                             "one of the two")
        if data_iter is not None:
            drawn = []
            for _ in range(self._gas):
                try:
                    drawn.append(next(data_iter))
                except StopIteration:
                    raise ValueError(f"train_batch(data_iter=...): the iterator ended after {len(drawn)} of the "
                                     f"step's {self._gas} micro-batches") from None
            return drawn
        if self._gas == 1 and not (isinstance(batches, list) and len(batches) == 1):
            return [batches]
        if not isinstance(batches, list) or len(batches) != self._gas:
            raise ValueError(f"train_batch(batches=...): a list of the step's {self._gas} micro-batches "
                             f"(gradient_accumulation_steps), not {type(batches).__name__}"
                             + (f" of {len(batches)}" if isinstance(batches, list) else ""))
        return batches

    @staticmethod
    def _loss_of(output, micro_batch, loss_fn):
        if loss_fn is not None:
            return loss_fn(output, micro_batch)
        loss = getattr(output, "loss", None)
        if loss is None and isinstance(output, dict):
            loss = output.get("loss")
        if loss is None and torch.is_tensor(output) and output.dim() == 0:
            loss = output
        if loss is None:
            raise ValueError(f"train_batch(): the module returned {type(output).__name__}, which has no .loss and "
                             f"is not a scalar tensor; pass loss_fn=lambda output, micro_batch: ...")
        return loss

    @driven("optimizer.step()")
    def _optimizer_step(self):
        """optimizer.step(), from engine.step() or from a loop that drives
        the optimizer directly (Hugging Face's Trainer calls optimizer.step()
        and its scheduler at the boundary, never engine.step() there): the
        engine's step and the micro-step's end, at the accumulation boundary
        only."""
        if self._engine.in_micro_batch:
            raise self._out_of_order("optimizer.step() after a forward without engine.backward(loss)")
        if not self.is_gradient_accumulation_boundary():
            raise FailedPrecondition(f"optimizer.step() before the gradient accumulation boundary (micro-batch "
                                     f"{self._micro_steps % self._gas + 1} of {self._gas}): call engine.step() after "
                                     f"each micro-batch, or optimizer.step() after the last one")
        metrics = self._apply_step()
        self._micro_steps += 1
        return metrics

    def _apply_step(self):
        if not self._engine.in_step:
            raise self._out_of_order("no micro-batch ran since the last step: engine(...), engine.backward(loss), "
                                     "then engine.step()")
        lr_before = self._lr_state()
        lr = self.optimizer.step_lr()
        if self._config_scheduler:
            if self._shown_lr is not None and abs(lr - self._shown_lr) > 1e-12 * self._shown_lr:
                raise Unsupported(f"the config's \"scheduler\" section drives the lr, but param_groups' lr was "
                                  f"changed to {lr:g} (a torch lr scheduler too?): use one of the two")
        else:
            self._engine.set_step_lr(lr)  # a torch lr scheduler drives param_groups' lr
        outcome = self._engine.finish_step()
        self.last_outcome = outcome
        if outcome["outcome"] != "applied":
            # The step's micro-batches run again from its first: the boundary is counted from there. With
            # overlap on, the step before it may be undone too (Note [Feeding undone steps again]).
            self._micro_steps -= self._gas - 1
            undone = self._notice_undone_step()
            self._global_steps = outcome["state_step"]
            raise Unavailable(f"the step was {outcome['outcome'].replace('_', ' ')}: {outcome['reason']}; the state "
                              f"is the one after step {outcome['state_step']}: "
                              f"{self._what_to_feed_again(undone, with_current=True)}")
        self.metrics = outcome["metrics"]
        self._global_steps = self.metrics["step"]
        self._undone = None  # fed again by the caller's loop (train_batch() took it before), or given up
        self._uncommitted = _AppliedStep(self._global_steps, self._engine.steps_begun, lr_before)
        if self._config_scheduler:  # the engine's schedule: show its lr in the groups
            self._shown_lr = self.metrics["lr"]
            base = self.optimizer.base_lr
            for group, (_, lr0) in zip(self.optimizer.param_groups, self.optimizer._created):
                group["lr"] = self.metrics["lr"] * (lr0 / base)
        return self.metrics

    def get_lr(self):
        return [g["lr"] for g in self.optimizer.param_groups]

    def _abandon_pass(self):
        """A forward or backward raised (the caller's error propagates): every
        unit it held is handed back. In training the engine drops the step in
        progress (Engine::abandon_step: partial gradients discarded, counters
        back), so the step's micro-batches run again from its first; an
        evaluation is closed. The engine and the model stay usable."""
        if self._pass == "eval":
            for index in range(len(self._layers)):
                while self._engine.holds(index) > 0:
                    self._release_unchecked(index, "eval")
            self._pass = None
            self._guard.pass_ended()
            self._engine.finish_evaluation(0.0, 1)
            return
        if self._engine.in_step:
            self._engine.abandon_step()  # releases what the engine lent; nothing to hand back one by one
            self._step_loss.drop()
        self._pass = None
        self._guard.pass_ended()
        self._reach.clear()
        self._open_calls = []
        self._root_calls = []
        self._micro_steps -= self._micro_steps % self._gas
        for layer in self._layers:
            layer.grads = None
            if not layer.kept_whole:
                for _, p in layer.plan.params:
                    p.data = self._placeholder(p.dtype)
                    mark_released(p)
                    if self._ds_status is not None:
                        p.ds_status = self._ds_status[1]
                layer.bound = None
        for p in self.module.parameters():
            p.grad = None

    # -- state -----------------------------------------------------------------------------------
    @driven("engine.master_parameters()")
    def master_parameters(self):
        """{parameter name: fp32 master weights} of every trainable
        parameter, gathered whole (after every queued update). Frozen
        parameters have no master weights and are not included."""
        out = {}
        self._at_commit_point(self._engine.synchronize)
        for index, layer in enumerate(self._layers):
            if not layer.plan.trainable:
                continue
            flat = self._engine.gather_state(index)
            for (name, shape, _, _, offset), (pname, p) in zip(self._engine.layout(index), layer.plan.params):
                out[pname] = flat[offset:offset + _numel(shape)].view(shape).clone()
        return out

    @driven("engine.save_checkpoint()")
    def save_checkpoint(self, save_dir, tag=None, client_state=None, save_latest=True, sync=False, keep=0,
                        exclude_frozen_parameters=False):
        """Saves the engine's state (fp32 master, moments, step counters) to
        save_dir/tag (default tag global_step<N>) with client_state (JSON:
        numbers, strings, lists, dicts), asynchronously unless sync: the next
        step runs while it is written; wait_checkpoint() waits. Between
        steps only (at a gradient accumulation boundary). An existing tag is
        replaced, synchronously, the old checkpoint loadable until the new
        one is durable (Note [Replacing a checkpoint tag]). Frozen parameters
        are never stored (their values are the model's own, checked at load),
        whatever exclude_frozen_parameters says."""
        if self._engine.in_step:
            raise self._out_of_order("save_checkpoint() in the middle of a step: save after engine.step() at a "
                                     "gradient accumulation boundary")
        if not save_latest:
            raise Unsupported("save_latest=False: the engine always points `latest` at the newest tag")
        # The manifest holds it two levels down ("app", "client_state"), within the depth Strata reads.
        check_json(client_state, "client_state", depth_limit=JSON_DEPTH_LIMIT - 2)
        app = {"strata_torch": {"micro_steps": self._micro_steps,
                                "param_groups": [{"lr": g["lr"]} for g in self.optimizer.param_groups],
                                "lr_scheduler": self._scheduler_state(),
                                "frozen_layers": self._frozen_layer_digests()},
               "client_state": client_state if client_state is not None else {}}
        try:
            text = json.dumps(app, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise TypeError(f"client_state must be JSON (numbers, strings, lists, dicts): {e}") from None
        save_dir = check_path(save_dir, "save_dir")
        tag = "" if tag is None else check_path(tag, "tag")
        # keep: the newest tags kept (0: every one); a C int in the engine.
        keep = check_int(keep, "keep", 0, 2 ** 31 - 1)
        _torch_checkpoints.save_checkpoint(self._engine, save_dir, tag, keep, bool(sync), text)
        self._save_pending = not sync
        return True

    @driven("engine.export_hf()")
    def export_hf(self, save_directory, dtype=None, max_shard_size="5GB", safe_serialization=True):
        """The trained model for Hugging Face's from_pretrained: safetensors
        by parameter name (sharded past max_shard_size, with the index) and
        the module's config.json, streamed one layer at a time; between
        steps, on every rank (rank 0 writes). dtype=None: the parameters'
        own dtype; torch.float32: the fp32 master weights. Returns the files
        written (strata/_torch_export.py, Note [Exporting a model from the engine])."""
        from ._torch_export import export_hf
        return export_hf(self, save_directory, dtype=dtype, max_shard_size=max_shard_size,
                         safe_serialization=safe_serialization)

    save_pretrained = export_hf

    @driven("engine.wait_checkpoint()")
    def wait_checkpoint(self):
        """Waits for the save in flight: {"tag", "committed", "seconds", "bytes"}, or None."""
        done = self._engine.wait_checkpoint()
        self._save_pending = False
        return done

    @driven("engine.close()")
    def close(self):
        """Waits for the checkpoint save in flight, then ends the engine: its
        memory is freed, its NVMe swap folders removed, and the model's
        parameters are left empty; every later call is refused. The save's
        outcome as wait_checkpoint() gives it (a failed save raises, after
        the engine is ended). The interpreter's exit closes every engine
        still alive (Note [Saves finished at exit])."""
        return close_engine(self)

    @driven("engine.load_checkpoint()")
    def load_checkpoint(self, load_dir, tag=None, load_module_strict=True, load_optimizer_states=True,
                        load_lr_scheduler_states=True, load_module_only=False, custom_load_fn=None):
        """Loads load_dir (its latest tag) or load_dir/tag into this engine,
        before its first step; saved at any stage or placement. Returns
        (the loaded checkpoint's folder, client_state) as DeepSpeed's, and
        (None, None) with a warning when load_dir holds no `latest` and no
        tag is given."""
        if not load_optimizer_states:
            raise Unsupported("load_optimizer_states=False: the engine loads master weights and moments together")
        if not load_module_strict or load_module_only or custom_load_fn is not None:
            raise Unsupported("load_module_strict=False, load_module_only=True and custom_load_fn are not supported: "
                              "a checkpoint restores every trained layer with its optimizer state; to start from "
                              "weights only, pass initial_weights= (an export_hf folder) to strata.torch.initialize")
        load_dir = check_path(load_dir, "load_dir")
        if _torch_checkpoints.nothing_to_load(load_dir, tag):
            return None, None
        path = os.path.join(load_dir, check_path(tag, "tag")) if tag else load_dir
        mine = _torch_app_state(self._engine.checkpoint_app_json(path))
        saved = mine.get("frozen_layers") or {}
        if saved:
            # Frozen layers are not in the checkpoint: their values are this model's; the saved digests say
            # whether they are the ones trained with (Note [Frozen layers in checkpoints] in checkpoint.h).
            here = self._frozen_layer_digests()
            for name, digest in saved.items():
                if name in here and here[name] != digest:
                    raise FailedPrecondition(
                        f"frozen layer '{name}' differs from the one checkpoint '{path}' was trained with (the "
                        f"checkpoint does not store frozen layers: their values are the model's own); build the "
                        f"model with the same frozen weights (e.g. the same pretrained checkpoint) before loading")
        info = self._engine.load_checkpoint(path)
        app = json.loads(info["app_json"])
        mine = app.get("strata_torch", {})
        self._micro_steps = int(mine.get("micro_steps", info["step_calls"] * self._gas))
        self._global_steps = int(info["step"])
        self._uncommitted = self._undone = None
        for group, saved in zip(self.optimizer.param_groups, mine.get("param_groups", [])):
            group["lr"] = saved["lr"]
        if load_lr_scheduler_states and self.lr_scheduler is not None and mine.get("lr_scheduler") is not None:
            self.lr_scheduler.load_state_dict(mine["lr_scheduler"])
        return _torch_checkpoints.loaded_path(load_dir, tag, info["tag"]), app.get("client_state", {})

    def _frozen_layer_digests(self):
        """{layer name: SHA-256 of its parameters' bytes} of every frozen
        layer, each acquired for an evaluation (every rank)."""
        frozen = [i for i, layer in enumerate(self._layers) if not layer.plan.trainable]
        digests = {}
        for index, params in self._engine.read_layers(frozen):
            h = hashlib.sha256()
            for name, _ in self._layers[index].plan.params:
                h.update(params[name].cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
            digests[self._layers[index].plan.name] = h.hexdigest()
        return digests

    def _scheduler_state(self):
        if self.lr_scheduler is None or not hasattr(self.lr_scheduler, "state_dict"):
            return None
        state = self.lr_scheduler.state_dict()
        try:
            json.dumps(state, allow_nan=False)
        except (TypeError, ValueError):
            return None  # not JSON (e.g. holds callables): not saved
        return state


def _torch_app_state(app_json):
    try:
        app = json.loads(app_json)
    except ValueError:
        return {}
    mine = app.get("strata_torch") if isinstance(app, dict) else None
    return mine if isinstance(mine, dict) else {}
