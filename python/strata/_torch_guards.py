"""strata.torch: what a careless or unlucky caller does to an engine,
refused before it changes anything, or finished before the process ends
(docs/reliability.md, "The torch path's guarantees").

Note [One driving thread]
One engine is driven by one thread at a time. A call of the engine's API
(engine.backward, step, optimizer.step, train_batch, the checkpoint calls,
synchronize, export_hf, master_parameters, close, a GatheredParameters
block) and a forward of the model hold the engine for their thread while
they run, and a training step holds it from its first forward to
engine.step() at the accumulation boundary (its micro-batches' state lives
between those calls). Another thread's call meanwhile is refused before it
changes anything, so the holder goes on unharmed. Between steps any thread
may take the engine over (built in one thread, trained in another). Only
the entries are checked, never the hooks' own work: a CUDA backward runs the
hooks on autograd's threads, which are the holder's.

Note [Released parameters]
At stage 3 a parameter whose unit is not acquired is bound to an empty
placeholder. Its class is then ReleasedParameter, whose __torch_function__
refuses, while the model runs (a forward, an evaluation, a backward), every
torch call that would read it (the placeholder is empty: a sum() of it is 0,
a gradient of it has the wrong shape), naming the parameter, the unit that
owns it and the unit that used it. Reading what the placeholder keeps (dtype,
device) and hashing pass, and outside a pass everything passes, as for any
Parameter. An acquired parameter is a plain Parameter again, so the check
costs nothing per torch call of a forward (a TorchFunctionMode over every
forward would: about 8 us a call on torch 1.13, doubling a small model's
forward). The first training forward still runs under the full check
(_ParameterUseCheck), which also sees parameters at stages 0-2.

Note [The model initialize was given]
The engine trains, saves and exports the parameters it was given. A module
or parameter replaced (or added) afterwards would be used by forward and
never trained, so every forward first checks that the model still holds
them: per module, its children and parameters compared by identity (a dict
lookup each, in C loops: 5 us for the 4-unit test LM, 45 us for a 12-layer
GPT-2, against a forward of a millisecond or more); a difference sends it to a
comparison of the parameters themselves, which names the module when the
engine's parameters changed and accepts anything else (a parameterless
module swapped).

Note [Saves finished at exit]
save_checkpoint() writes on a thread of the engine. A script that ends right
after it would lose the save when nothing destroys the engine before the
interpreter exits (a live autograd graph holds it). Every engine is kept in
a weak registry, and at exit each still alive is closed (close_engine): the
save in flight is waited for, the engine freed and its NVMe swap folders
removed. A save that fails there is said on stderr and the process exits
with status 1.
"""

import atexit
import functools
import operator
import os
import re
import sys
import threading
import warnings
import weakref

import torch

from . import _native
from .errors import FailedPrecondition, InvalidArgument, StrataError

__all__ = ["ThreadGuard", "driven", "ReleasedParameter", "ModelShape", "BackwardReach", "refuse_empty_micro_batch",
           "guarded_root_pre_forward", "track", "close_engine", "check_job_name", "nvme_paths",
           "warn_stale_swap_folders", "refuse_shared_swap_folders", "job_name_hint"]


# -- Note [One driving thread] -------------------------------------------------------------------
class ThreadGuard:
    __slots__ = ("_lock", "owner", "owner_thread", "calls", "running", "forward")

    def __init__(self):
        self._lock = threading.Lock()
        self.owner = None          # threading.get_ident() of the thread that drives (or last drove) the engine
        self.owner_thread = None
        self.calls = 0             # API calls in progress on the owner (nested ones counted)
        self.running = ""          # the outermost of them
        self.forward = False       # a forward (or an evaluation) of the model runs

    def _claim(self, engine, call):
        """Under self._lock: the engine for this thread, or FailedPrecondition when another thread holds it."""
        me = threading.get_ident()
        if self.owner != me:
            if self.owner is not None and (self.calls or self.forward or engine._engine.in_step):
                if self.calls:
                    why = f"{self.running} is running there"
                elif self.forward:
                    why = "a forward of the model is running there"
                else:
                    why = (f"a training step is open there, from its first forward to engine.step() at the "
                           f"accumulation boundary")
                raise FailedPrecondition(
                    f"{call} from thread '{threading.current_thread().name}' while thread "
                    f"'{self.owner_thread.name}' drives this engine ({why}): one engine is driven by one thread at "
                    f"a time; nothing was changed. Drive it from that thread, or hand it over between steps (after "
                    f"engine.step() at the accumulation boundary, with no call running)")
            self.owner, self.owner_thread = me, threading.current_thread()

    def enter(self, engine, call):
        with self._lock:
            self._claim(engine, call)
            if self.calls == 0:
                self.running = call
            self.calls += 1

    def leave(self):
        self.calls -= 1  # only the owner changes it

    def claim_pass(self, engine):
        """A forward of the root module: True when it opens the pass (none of this thread's was running)."""
        with self._lock:
            self._claim(engine, "a forward of the model")
            opened = not self.forward
            self.forward = True
            return opened

    def pass_ended(self):
        self.forward = False

    def check_unit(self, unit):
        """A unit called by a thread other than the one whose forward runs."""
        if self.forward and threading.get_ident() != self.owner:
            raise FailedPrecondition(
                f"unit '{unit.name or '<root>'}' ({type(unit.module).__name__}) ran on thread "
                f"'{threading.current_thread().name}' while thread '{self.owner_thread.name}' runs the model's "
                f"forward: one engine is driven by one thread at a time")


def driven(call):
    """Decorates an engine method as one of its API calls (Note [One driving thread])."""
    def wrap(method):
        @functools.wraps(method)
        def guarded(engine, *args, **kwargs):
            guard = engine._guard
            guard.enter(engine, call)
            try:
                return method(engine, *args, **kwargs)
            finally:
                guard.leave()
        return guarded
    return wrap


# -- Note [Released parameters] ------------------------------------------------------------------
_TENSOR_HASH = torch.Tensor.__hash__


class ReleasedParameter(torch.nn.Parameter):
    """A stage-3 parameter bound to its empty placeholder (Note [Released parameters])."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not _TENSOR_HASH:
            _refuse_use_in_a_pass(func, args, kwargs)
        return torch._C._disabled_torch_function_impl(func, types, args, kwargs)

    def __deepcopy__(self, memo):
        if id(self) not in memo:  # a copy is the model's own parameter, not the engine's
            with torch._C.DisableTorchFunction():
                memo[id(self)] = torch.nn.Parameter(self.data.clone(), self.requires_grad)
        return memo[id(self)]


def _refuse_use_in_a_pass(func, args, kwargs):
    with torch._C.DisableTorchFunction():  # the checks below hash parameters
        for value in list(args) + list(kwargs.values()):
            for t in (value if isinstance(value, (list, tuple)) else (value,)):
                if not isinstance(t, ReleasedParameter):
                    continue
                owner = getattr(t, "_strata_engine", None)
                engine = owner() if owner is not None else None
                if engine is None or engine._internal.active:
                    return
                if engine._pass is not None or engine._in_backward:
                    engine.check_parameters_used(func, args, kwargs)  # names it (safe attributes pass)
                return


def mark_released(p):
    if type(p) is torch.nn.Parameter:  # a subclass of a library's of its own keeps its class (and the first check)
        p.__class__ = ReleasedParameter


def mark_bound(p):
    if type(p) is ReleasedParameter:
        p.__class__ = torch.nn.Parameter


# -- Note [The model initialize was given] --------------------------------------------------------
class ModelShape:
    def __init__(self, model, names):
        self.model = model
        self.names = names  # {Parameter: name}: every parameter the engine holds
        self._snapshot()

    def _snapshot(self):
        # Every module's children and parameters as parallel tuples (dict, name, value), compared in C loops.
        dicts = [d for m in self.model.modules() for d in (m._modules, m._parameters)]
        self.dicts, self.lengths = tuple(dicts), [len(d) for d in dicts]
        entries = [(d, name, value) for d in dicts for name, value in d.items()]
        self.owners, self.keys, self.values = (tuple(column) for column in zip(*entries)) if entries else ((),) * 3

    def check(self):
        if list(map(len, self.dicts)) != self.lengths or \
                not all(map(operator.is_, map(dict.get, self.owners, self.keys), self.values)):
            self._compare()

    def _compare(self):
        current = {}
        for name, p in self.model.named_parameters():
            current.setdefault(p, name)
        added = [name for p, name in current.items() if p not in self.names]
        gone = [name for p, name in self.names.items() if p not in current]
        if not added and not gone:
            self._snapshot()  # a change that leaves the engine's parameters as they were
            return None
        first = (added or gone)[0]
        module_name = first.rpartition(".")[0]
        module = self.model.get_submodule(module_name) if module_name and added else None
        what = f"module '{module_name or '<root>'}'" + (f" ({type(module).__name__})" if module is not None else "")
        parts = []
        if added:
            parts.append(f"holds parameter(s) {', '.join(repr(n) for n in added[:8])} the engine was not given")
        if gone:
            parts.append(f"parameter(s) {', '.join(repr(n) for n in gone[:8])} the engine was given "
                         f"{'are' if len(gone) > 1 else 'is'} no longer in the model")
        raise FailedPrecondition(
            f"the model changed after strata.torch.initialize: {what} {' and '.join(parts)}; a module or parameter "
            f"replaced or added after initialize would run in forward but never be trained, saved or exported. "
            f"Change the model before initialize (or initialize a new engine with it)")


# -- the checks at the start of every forward ----------------------------------------------------
def refuse_empty_micro_batch(engine, args, kwargs):
    """A training micro-batch whose first tensor argument has batch dimension (its first) 0 is refused, in every
    precision, before anything changes (its mean loss is NaN: fp32 would stop on it, fp16 would step on it)."""
    for where, value in [(f"argument {i}", v) for i, v in enumerate(args)] + \
            [(f"argument '{k}'", v) for k, v in (kwargs or {}).items()]:
        if not isinstance(value, torch.Tensor):
            continue
        if value.dim() == 0 or value.shape[0] != 0:
            return
        gas = engine._gas
        raise InvalidArgument(
            f"micro-batch {engine._micro_steps % gas + 1} of {gas} of step {engine.global_steps + 1} is empty: its "
            f"first tensor, {where}, has shape {list(value.shape)} (batch dimension 0), and an empty batch has no "
            f"loss to learn from (its mean is NaN); nothing was changed. Skip empty batches "
            f"(DataLoader(drop_last=True) drops a short last one)")


def guarded_root_pre_forward(engine, module, args):
    """The root module's pre-forward hook: the checks every forward of the model makes before it opens its pass
    (the model initialize was given; an empty training micro-batch; one driving thread), then the engine's own
    (StrataEngine._root_pre_forward)."""
    if engine._pass is None and not engine._in_backward:
        engine._shape.check()
        if torch.is_grad_enabled():
            refuse_empty_micro_batch(engine, args, None)
    opened = engine._guard.claim_pass(engine)
    try:
        return engine._root_pre_forward(module, args)
    except BaseException:
        if opened and engine._pass is None:
            engine._guard.pass_ended()
        raise


class BackwardReach:
    """The autograd nodes of the outputs a training forward hooked (the units' outputs that need a gradient):
    engine.backward(loss) refuses a loss whose graph reaches none of them (a loss the model did not produce
    would step on zero gradients). The search stops at the first one found, next to the loss as a rule."""

    __slots__ = ("nodes",)

    def __init__(self):
        self.nodes = set()

    def add(self, tensor):
        if tensor.grad_fn is not None:
            self.nodes.add(tensor.grad_fn)

    def clear(self):
        self.nodes = set()

    def refuse_unless_reached(self, loss):
        if not self.nodes or not isinstance(loss, torch.Tensor) or loss.grad_fn is None:
            return  # nothing hooked to look for (or no graph: autograd's own error says so)
        nodes, seen, frontier = self.nodes, set(), [loss.grad_fn]
        while frontier:
            following = []
            for node in frontier:
                if node in nodes:
                    return
                for child, _ in node.next_functions:
                    if child is not None and child not in seen:
                        seen.add(child)
                        following.append(child)
            frontier = following
        raise FailedPrecondition(
            "engine.backward(loss): the loss does not depend on this micro-batch's forward (its autograd graph "
            "reaches none of the model's outputs), so the step would train on zero gradients; nothing was changed. "
            "Pass the loss computed from the output engine(...) returned")


# -- Note [Saves finished at exit] ---------------------------------------------------------------
_live_engines = weakref.WeakSet()
_exit_registered = False


def track(engine):
    global _exit_registered
    _live_engines.add(engine)
    if not _exit_registered:
        atexit.register(_close_at_exit)
        _exit_registered = True


def close_engine(engine):
    """engine.close(): waits for the checkpoint save in flight, then ends the engine (its memory freed, its NVMe
    swap folders removed, the model's parameters left empty). The save's outcome as wait_checkpoint() gives it;
    a failed save raises, after the engine is ended."""
    if engine._closed:
        return None
    if engine._engine.in_step or engine._pass is not None:
        try:
            engine._abandon_pass()  # the step in progress is dropped, as after a failed forward
        except StrataError:
            pass  # the engine is ended below whatever its state
    error = done = None
    try:
        done = engine._engine.wait_checkpoint()
    except StrataError as e:
        error = e
    engine._save_pending = False
    placeholders = {}
    for layer in engine._layers:
        for _, p in layer.plan.params:
            if p.dtype not in placeholders:
                placeholders[p.dtype] = engine._device.placeholder(p.dtype)
            with torch._C.DisableTorchFunction():
                p.data = placeholders[p.dtype]  # nothing of the model views the engine's memory any more
                p.grad = None
            mark_released(p)
            if engine._ds_status is not None:
                p.ds_status = engine._ds_status[1]
        layer.grads, layer.bound = None, None
    engine._closed = True
    engine._engine.close("make a new one with strata.torch.initialize (engine.load_checkpoint resumes)")
    if error is not None:
        raise error
    return done


def _close_at_exit():
    failed = []
    for engine in list(_live_engines):
        pending = engine._save_pending
        try:
            engine.close()
        except BaseException as error:  # noqa: BLE001: every engine is closed, then the failures said
            failed.append((pending, error))
    lost = [error for pending, error in failed if pending]
    for pending, error in failed:
        print(f"strata.torch: at exit, {'a checkpoint save did not complete' if pending else 'an engine was not closed'}"
              f": {error}", file=sys.stderr)
    if lost:
        print("strata.torch: the checkpoint asked for was NOT saved (the previous `latest` stands); exiting with "
              "status 1", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(1)  # noqa: the only way to say it in the exit status once the interpreter is exiting


# -- swap folders ---------------------------------------------------------------------------------
_JOB_NAME = re.compile(r"[A-Za-z0-9._-]{1,48}")


def check_job_name(job_name):
    """initialize(job_name=...): the swap folders' name (None: the engine's default, train-<process id>)."""
    if job_name is None:
        return None
    if not isinstance(job_name, str):
        raise TypeError(f"job_name must be a str, not {type(job_name).__name__}")
    if not _JOB_NAME.fullmatch(job_name) or job_name in (".", ".."):
        raise InvalidArgument(f"job_name {job_name[:64]!r} is not 1-48 characters of A-Z a-z 0-9 . _ - (it names "
                              f"the engine's swap folders, strata-<job_name>*, under the nvme_path)")
    return job_name


def nvme_paths(resolved):
    """The nvme_paths a resolved config puts state on."""
    zero = resolved["zero_optimization"]
    return sorted({zero[s]["nvme_path"] for s in ("offload_optimizer", "offload_param")
                   if zero[s]["device"] == "nvme" and zero[s].get("nvme_path")})


def _listed(path):
    try:
        return _native.swap_folders(path)
    except StrataError:
        return []  # a missing or unreadable nvme_path: the engine's creation says so


def warn_stale_swap_folders(resolved):
    """A warning naming the swap folders of dead processes under the config's nvme_paths (what `strata report
    --path` counts as stale) and the command that removes them; nothing is removed."""
    for path in nvme_paths(resolved):
        stale = [f for f in _listed(path) if f["state"] == "stale"]
        if not stale:
            continue
        shown = "; ".join(f"{f['path']!r} (pid {f['pid']} on {f['host'] or '?'}, {_size(f['bytes'])})"
                          for f in stale[:8])
        more = f" and {len(stale) - 8} more" if len(stale) > 8 else ""
        warnings.warn(f"nvme_path {path!r} holds {len(stale)} swap folder(s) left by processes that died: {shown}"
                      f"{more}, {_size(sum(f['bytes'] for f in stale))} in all; remove them with "
                      f"`strata swap clean --path {path}` (it removes only folders no live process holds)",
                      RuntimeWarning, stacklevel=3)


def refuse_shared_swap_folders(resolved, job_name):
    """Refuses a second engine of this process on an nvme_path another live one uses with the same job name
    (the swap folders are locked by the first)."""
    paths = {os.path.realpath(p) for p in nvme_paths(resolved)}
    if not paths:
        return
    for other in list(_live_engines):
        if other._closed or other._job_name != job_name:
            continue
        shared = paths & {os.path.realpath(p) for p in other._nvme_paths}
        if shared:
            raise FailedPrecondition(
                f"nvme_path {sorted(shared)[0]!r} is used by another strata.torch engine of this process with the "
                f"same swap job name ({job_name or 'the default, train-<process id>'}), and two engines cannot share "
                f"a swap folder: pass initialize(job_name=\"...\") a name of this engine's own, or close the other "
                f"engine first (engine.close())")


def job_name_hint(resolved, job_name, error):
    """error with the way to pick another job name when an active swap folder of this job name holds one of the
    config's nvme_paths (another process uses it)."""
    own = job_name or f"train-{os.getpid()}"
    for path in nvme_paths(resolved):
        if any(f["state"] == "active" and f["job"].startswith(own) for f in _listed(path)):
            return type(error)(f"{error}; strata.torch picks the job name with initialize(job_name=\"...\")")
    return error


def _size(n):
    if n < 1024:
        return f"{n} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        n /= 1024
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
