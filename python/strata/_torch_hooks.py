"""strata.torch: the hooks by which StrataEngine drives the engine while torch
runs the model's forward and backward (UnitHooks, a part of StrataEngine kept
in a file of its own: it installs the hooks and answers them with acquire and
release), and the small records they keep per unit call and per layer.

Note [Hooks per unit]
Each unit (strata/_torch_units.py) gets, per call of its forward:
  pre-forward   acquire every layer the unit uses (pass forward, or eval
                under torch.no_grad()), bind the parameters' .data to the
                engine's memory; wrap the inputs that need a gradient in
                _PostBackward (an identity autograd Function);
  post-forward  release those layers; hook the outputs that need a gradient;
  pre-backward  (the first output hook to fire) acquire the layers for
                backward, rebind, and preset each parameter's .grad to the
                engine's gradient buffer where the dtypes agree, so
                AccumulateGrad adds in place (in no-grad mode it does
                `grad += new`), with no copy;
  post-backward (_PostBackward.backward: the gradient of the unit's inputs
                is done, and with it the unit's AccumulateGrad nodes, which
                autograd runs first) hand any gradient torch made itself
                (another dtype, or a tied weight finished between holds) over
                by one add, and release.
engine.backward(loss) then flushes the calls whose post-backward did not
fire (integer inputs: the first unit, the root unit) and checks no
gradient was left outside the engine. The root module's pre-forward hook
opens the step and the micro-batch (begin_step / begin_micro_batch), or an
evaluation under torch.no_grad().

A layer whose shard the engine gathers (stage 3) may have its memory
reused once released, so its parameters are bound to empty placeholders
until the next acquire; a layer the engine keeps whole (Engine.keeps_whole:
every layer at stages 0-2, a stage-3 layer below
stage3_param_persistence_threshold) is the engine's memory for good, and its
binding stays from its first acquire on.
"""

import torch

from . import _torch_checkpointing as checkpointing
from .errors import FailedPrecondition, StrataError, Unsupported
from ._torch_guards import guarded_root_pre_forward, mark_bound, mark_released

__all__ = ["UnitHooks"]


class _PostBackward(torch.autograd.Function):
    """Identity on a unit's inputs; its backward runs once their gradients
    are computed, i.e. when the unit's backward is done."""

    @staticmethod
    def forward(ctx, engine, call, *tensors):
        ctx.engine, ctx.call = engine, call
        return tensors if len(tensors) != 1 else tensors[0]

    @staticmethod
    def backward(ctx, *grads):
        ctx.engine._post_backward(ctx.call)
        return (None, None) + grads


try:
    from torch.overrides import TorchFunctionMode
except ImportError:  # torch < 1.13: no check of parameters used outside their unit
    TorchFunctionMode = None

if TorchFunctionMode is not None:
    class _ParameterUseCheck(TorchFunctionMode):
        """Every torch call of a forward, checked for parameters whose unit is not acquired."""

        def __init__(self, engine):
            super().__init__()
            self.engine = engine

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if not self.engine._internal.active:
                self.engine.check_parameters_used(func, args, kwargs)
            return func(*args, **kwargs)
else:
    _ParameterUseCheck = None


# Tensor attributes an unacquired parameter answers truly (its stage-3 placeholder keeps them), so a model may
# read them anywhere: Hugging Face models read `weight.dtype` to cast their inputs and `self.dtype` / `self.device`
# (the first parameter's) outside every unit. The shape is not among them: the placeholder is empty.
# (The placeholder lives where the parameter does between acquires: the host, on the cpu device.)
_PLACEHOLDER_SAFE_ATTRIBUTES = frozenset({"dtype", "device", "requires_grad", "is_cuda", "is_cpu", "is_meta",
                                          "layout", "is_sparse", "is_quantized", "is_leaf", "itemsize"})
_PLACEHOLDER_SAFE_METHODS = frozenset({"is_floating_point", "is_complex", "is_signed", "element_size",
                                       "get_device"})


def _property_read(func):
    """The attribute a torch-function call reads (a property's getter is its getset descriptor's __get__), or
    None for any other call."""
    if getattr(func, "__name__", None) != "__get__":
        return None
    return getattr(getattr(func, "__self__", None), "__name__", "?")


def _reads_placeholder_safe_attribute(func):
    attribute = _property_read(func)
    if attribute is not None:
        return attribute in _PLACEHOLDER_SAFE_ATTRIBUTES
    return getattr(func, "__name__", None) in _PLACEHOLDER_SAFE_METHODS


def _call_name(func):
    attribute = _property_read(func)
    if attribute is not None:
        return f"reading .{attribute}"
    return getattr(func, "__name__", None) or str(func)


class _Flag:
    """A flag the hooks set per event. Not an attribute of the engine itself: setting one on an
    nn.Module (Module.__setattr__) costs microseconds."""

    __slots__ = ("active",)

    def __init__(self):
        self.active = False


class _UnitCall:
    """One call of a unit's forward, followed into its backward."""

    __slots__ = ("unit", "pre_backward_done", "post_backward_done")

    def __init__(self, unit):
        self.unit = unit
        self.pre_backward_done = False
        self.post_backward_done = False


class _LayerState:
    __slots__ = ("plan", "kept_whole", "grads", "bound")

    def __init__(self, plan, kept_whole):
        self.plan = plan
        self.kept_whole = kept_whole  # the engine's placement (Engine.keeps_whole), fixed for the run
        self.grads = None   # {name: tensor}: the gradient buffer while held for backward
        self.bound = None   # the {name: tensor} the parameters' .data are bound to (None: placeholders)


def _tensors_in(value, out):
    """Every tensor that needs a gradient in an output (tensor, tuple, list, dict, ModelOutput)."""
    if isinstance(value, torch.Tensor):
        if value.requires_grad:
            out.append(value)
    elif isinstance(value, (tuple, list)):
        for v in value:
            _tensors_in(v, out)
    elif isinstance(value, dict):
        for v in value.values():
            _tensors_in(v, out)
    return out


def _first_tensor(args, kwargs):
    for v in list(args) + list(kwargs.values()):
        if isinstance(v, torch.Tensor):
            return v
    return None


class UnitHooks:
    """StrataEngine's hooks (Note [Hooks per unit]) and the acquire/release
    they call; StrataEngine's own state (its _engine, _units, _layers) is
    what they work on."""

    def _install_hooks(self):
        kwargs_hooks = "with_kwargs" in torch.nn.Module.register_forward_pre_hook.__code__.co_varnames
        root = self.module
        self._handles.append(root.register_forward_pre_hook(lambda m, a: guarded_root_pre_forward(self, m, a)))
        entries = self._entry_modules()
        for entry in entries:
            self._handles.append(entry.register_forward_pre_hook(
                lambda m, a, e=entry: self._entry_pre_forward(e, a)))
        for unit in self._units:
            if not unit.uses:
                continue
            if kwargs_hooks:  # torch >= 2.0: tensors passed by keyword are followed into backward too
                pre = unit.module.register_forward_pre_hook(lambda m, a, k, u=unit: self._pre_forward(u, a, k),
                                                            with_kwargs=True)
            else:
                pre = unit.module.register_forward_pre_hook(lambda m, a, u=unit: self._pre_forward(u, a, None))
            self._handles.append(pre)
            post = unit.module.register_forward_hook(lambda m, a, out, u=unit: self._post_forward(u, out))
            self._handles.append(post)
        for entry in entries:
            self._handles.append(entry.register_forward_hook(lambda m, a, out, e=entry: self._entry_post_forward(e, out)))
        self._handles.append(root.register_forward_hook(self._root_post_forward))

    def _entry_modules(self):
        """Submodules a caller may run on their own, outside the model's
        forward: a Hugging Face encoder-decoder's encoder, which generate()
        calls once before the decoding steps (Note [Evaluations that start
        inside the model])."""
        get_encoder = getattr(self.module, "get_encoder", None)
        if not callable(get_encoder):
            return []
        try:
            encoder = get_encoder()
        except (AttributeError, NotImplementedError, TypeError):
            return []
        if not isinstance(encoder, torch.nn.Module) or encoder is self.module:
            return []
        return [encoder]

    def _entry_pre_forward(self, entry, args):
        """Note [Evaluations that start inside the model]
        An entry module (_entry_modules) called while no pass runs opens an
        evaluation of its own: the root unit's layers (the shared embedding
        the encoder reads) are acquired as the root's forward would, and its
        blocks' units acquire theirs as they run; everything is released and
        the evaluation closed when it returns. Called inside the model's
        forward or backward it is an ordinary submodule. Only without
        gradients: a training forward must run the whole model, so that the
        engine sees one forward and one backward per micro-batch."""
        if self._entry_open is not None:  # an earlier one raised before its end: hand back what it held
            self._close_stale_entry()
        if self._pass is not None or self._in_backward:
            return None
        if torch.is_grad_enabled():
            raise FailedPrecondition(f"{type(entry).__name__} ran on its own with gradients enabled: a training forward "
                                     f"runs the whole model (call the engine or engine.module); run it alone only "
                                     f"under torch.no_grad() (an evaluation, as generate() does)")
        self._route_checkpointed_forwards_through_hooks()
        self._at_commit_point(self._engine.begin_evaluation)
        self._pass = "eval"
        self._entry_open = entry
        try:
            self._pre_forward(self._units[-1], args, None)
        except BaseException:
            self._abandon_pass()
            self._entry_open = None
            raise
        return None

    def _close_stale_entry(self):
        self._entry_open = None
        self._abandon_pass()

    def _entry_post_forward(self, entry, output):
        if self._entry_open is not entry:
            return None
        self._entry_open = None
        self._post_forward(self._units[-1], output)
        self._end_pass()
        return None

    def _root_pre_forward(self, module, args):
        if self._entry_open is not None:  # an entry module's evaluation raised before its end
            self._close_stale_entry()
        if self._pass is not None:
            return None  # the root module called from inside its own forward
        self._route_checkpointed_forwards_through_hooks()
        first = _first_tensor(args, {})
        self._samples = first.shape[0] if first is not None and first.dim() > 0 else self._samples_hint
        self._samples_hint = 0
        if torch.is_grad_enabled():
            if self._no_sync and self.is_gradient_accumulation_boundary():
                raise FailedPrecondition(f"micro-batch {self._gas} of {self._gas} under no_sync(): the last micro-batch "
                                         f"of a step reduces its gradients (gradient_accumulation_steps "
                                         f"{self._gas}); run it outside no_sync()")
            if self._engine.in_micro_batch:
                raise self._out_of_order("a second training forward before engine.backward(loss): one forward, one "
                                         "backward per micro-batch (use torch.no_grad() for an evaluation)")
            if not self._engine.in_step:
                self._notice_undone_step()  # by a commit point since the last step (the error said so)
                self._engine.begin_step()
            self._engine.begin_micro_batch(last=self.is_gradient_accumulation_boundary())
            self._pass = "forward"
        else:
            self._at_commit_point(self._engine.begin_evaluation)
            self._pass = "eval"
        return None

    def _route_checkpointed_forwards_through_hooks(self):
        """Note [Checkpointed forwards through the hooks]
        transformers 4.x runs some models' checkpointed blocks as
        `self._gradient_checkpointing_func(layer_module.forward, ...)` (T5,
        BART, ...): the bound `forward` bypasses the module's hooks, so the
        unit would be neither acquired in forward nor in its recompute. Where
        a module has such a function (set by gradient_checkpointing_enable(),
        before or after initialize), it is wrapped once so that a unit's own
        `forward` is called through the module (`__call__`: its hooks run);
        anything else passes through unchanged. Routed at every forward,
        evaluation included (4.x checkpoints whenever the model is in
        training mode, under torch.no_grad() too). transformers 5
        (GradientCheckpointingLayer) checkpoints inside the module's call,
        so the hooks run around the checkpoint and not in the recompute:
        there the unit's backward hold, taken by the hook on its outputs
        before autograd reaches the recompute, keeps its parameters bound.
        With activation_checkpointing.cpu_checkpointing on, both forms run
        through strata.torch.checkpointing's checkpoint instead of torch's,
        which keeps the blocks' inputs in host memory (Note [Activation
        checkpoints in host memory])."""
        offloading = checkpointing.settings().cpu_checkpointing
        for module in self._checkpointing_units:  # the setting may change between forwards (configure())
            func = module.__dict__.get("_gradient_checkpointing_func")
            if func is None:
                continue
            if offloading and func is not checkpointing.through_checkpoint:
                module._strata_own_checkpointing_func = func  # transformers' own, given back when it goes off
                module._gradient_checkpointing_func = checkpointing.through_checkpoint
            elif not offloading and func is checkpointing.through_checkpoint:
                module._gradient_checkpointing_func = module.__dict__.pop("_strata_own_checkpointing_func")
        for module in self._checkpointing_modules:
            func = module.__dict__.get("_gradient_checkpointing_func")
            if func is None:
                continue
            if getattr(func, "_strata_routes_units", False):
                if func._strata_offloading == offloading:
                    continue
                func = func._strata_original  # routed under the other setting: routed again
            unit_ids = self._unit_module_ids
            run = checkpointing.through_checkpoint if offloading else func

            def through_the_hooks(function, *args, _run=run, **kwargs):
                owner = getattr(function, "__self__", None)
                if owner is not None and id(owner) in unit_ids and getattr(function, "__name__", "") == "forward":
                    function = owner
                return _run(function, *args, **kwargs)

            through_the_hooks._strata_routes_units = True
            through_the_hooks._strata_original = func
            through_the_hooks._strata_offloading = offloading
            module._gradient_checkpointing_func = through_the_hooks

    def _root_post_forward(self, module, args, output):
        self._end_pass()
        return None

    def _end_pass(self):
        finished = self._pass
        self._pass = None
        try:
            if finished == "eval":
                self._engine.finish_evaluation(0.0, 1)  # the engine's bracket; the caller computes its own loss
        finally:
            self._guard.pass_ended()  # after the engine's bracket: from here another thread may take the engine

    def _pre_forward(self, unit, args, kwargs):
        pass_name = self._pass
        if not self._in_backward:
            self._guard.check_unit(unit)
        if pass_name is None:
            if not self._in_backward:
                raise FailedPrecondition(f"unit '{unit.name or '<root>'}' ({type(unit.module).__name__}) ran "
                                         f"outside the model's forward: call the engine (or engine.module) as a whole")
            return self._pre_recompute(unit, args, kwargs)
        for index in unit.uses:
            self._acquire(index, pass_name)
        call = _UnitCall(unit)
        self._stacks[id(unit)].append(call)
        self._running_units.append(unit)
        if pass_name != "forward":
            return None
        return self._follow_inputs(call, args, kwargs)

    def _pre_recompute(self, unit, args, kwargs):
        """A unit's forward run again inside backward (activation
        checkpointing) is folded into its backward hold: acquired for
        backward here unless its backward already holds it, released by its
        post-backward (or the flush), never by this forward's end."""
        if any(c.unit is unit for c in self._open_calls):
            self._stacks[id(unit)].append(None)  # held already (non-reentrant recompute inside its backward)
            return None
        call = _UnitCall(unit)
        self._stacks[id(unit)].append(None)
        self._pre_backward(call)
        return self._follow_inputs(call, args, kwargs)

    def _follow_inputs(self, call, args, kwargs):
        """The inputs that need a gradient, through _PostBackward (so the call's post-backward runs)."""
        positions = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor) and a.requires_grad]
        names = [k for k, v in (kwargs or {}).items() if isinstance(v, torch.Tensor) and v.requires_grad]
        if not positions and not names:
            return None
        wrapped = _PostBackward.apply(self, call, *([args[i] for i in positions] + [kwargs[k] for k in names]))
        wrapped = wrapped if isinstance(wrapped, tuple) else (wrapped,)
        args = list(args)
        for i, t in zip(positions, wrapped):
            args[i] = t
        if kwargs is None:
            return tuple(args)
        kwargs = dict(kwargs)
        for k, t in zip(names, wrapped[len(positions):]):
            kwargs[k] = t
        return tuple(args), kwargs

    def _post_forward(self, unit, output):
        call = self._stacks[id(unit)].pop()
        if call is None:
            return None  # a recompute: its layers stay held for backward
        self._running_units.pop()
        pass_name = self._pass
        for index in reversed(unit.uses):
            self._release(index, pass_name)
        if pass_name == "forward":
            for t in _tensors_in(output, []):
                t.register_hook(lambda grad, c=call: self._pre_backward(c))
                self._reach.add(t)
            if unit.is_root:
                self._root_calls.append(call)
        return None

    def _pre_backward(self, call):
        if call.pre_backward_done:
            return None
        call.pre_backward_done = True
        for index in call.unit.uses:
            self._acquire(index, "backward")
        self._open_calls.append(call)
        return None

    def _post_backward(self, call):
        if not call.pre_backward_done or call.post_backward_done:
            return
        call.post_backward_done = True
        self._open_calls.remove(call)
        for index in reversed(call.unit.uses):
            self._release(index, "backward")

    def _flush_backward(self):
        for call in reversed(list(self._open_calls)):
            self._post_backward(call)
        # Every gradient went to the engine: one left on a parameter arrived after its layer was released.
        for layer in self._layers:
            if layer.plan.trainable:
                for name, p in layer.plan.params:
                    if p.grad is not None:
                        p.grad = None
                        raise Unsupported(f"parameter '{name}' got its gradient after its unit "
                                          f"'{layer.plan.unit.name or '<root>'}' finished backward (used outside its "
                                          f"unit?): declare coarser units (initialize(units=...))")

    # -- acquire / release -----------------------------------------------------------------------
    def _placeholder(self, dtype):
        if dtype not in self._placeholders:
            self._placeholders[dtype] = self._device.placeholder(dtype)
        return self._placeholders[dtype]

    def _acquire(self, index, pass_name):
        internal = self._internal
        internal.active = True
        try:
            self._acquire_unchecked(index, pass_name)
        finally:
            internal.active = False

    def _release(self, index, pass_name):
        internal = self._internal
        internal.active = True
        try:
            self._release_unchecked(index, pass_name)
        finally:
            internal.active = False

    def check_parameters_used(self, func, args, kwargs):
        """Raises naming a parameter `func` was given while its layer is not acquired."""
        if _reads_placeholder_safe_attribute(func):
            return
        for value in list(args) + list(kwargs.values()):
            for t in (value if isinstance(value, (list, tuple)) else (value,)):
                if isinstance(t, torch.nn.Parameter) and t in self._layer_of:
                    index = self._layer_of[t]
                    if self._engine.holds(index) == 0:
                        layer = self._layers[index]
                        where = (f"unit '{self._running_units[-1].name or '<root>'}'" if self._running_units
                                 else "no unit")
                        raise Unsupported(
                            f"parameter '{self._names[t]}' (unit '{layer.plan.unit.name or '<root>'}') was used by "
                            f"{_call_name(func)} in {where}, while its unit was not acquired: make "
                            f"the module that uses it part of its unit (initialize(units=...)) or leave it to the "
                            f"root unit")

    def _acquire_unchecked(self, index, pass_name):
        view = self._engine.acquire(index, pass_name)
        try:
            self._take(index, view)
        except BaseException:
            # The caller gets no layer (torch refused a binding, an interrupt): the engine must not keep it
            # held, or its count (which the releases read) would be one over what the front end holds.
            try:
                self._release_unchecked(index, pass_name)
            except StrataError:
                pass  # the binding's failure is the error to report
            raise

    def _take(self, index, view):
        """Binds an acquired layer's parameters to the engine's memory and hands torch its gradient buffer."""
        layer = self._layers[index]
        if layer.bound is not view.params:  # rebinding only when the memory moved (stage 3)
            for name, p in layer.plan.params:
                mark_bound(p)
                p.data = view.params[name]
                if self._ds_status is not None:
                    p.ds_status = self._ds_status[0]
            layer.bound = view.params
        if view.grads is None:
            return
        layer.grads = view.grads
        for name, p in layer.plan.params:
            buffer = view.grads[name]
            if buffer.dtype != p.dtype:
                continue  # torch accumulates in the parameter's dtype; handed over at release
            if p.grad is None:
                p.grad = buffer  # AccumulateGrad adds into the engine's buffer in place
            elif p.grad.data_ptr() != buffer.data_ptr():
                buffer.add_(p.grad)  # accumulated by torch between two holds (a tied weight)
                self.gradient_copies += 1
                p.grad = buffer

    def _release_unchecked(self, index, pass_name):
        layer = self._layers[index]
        others = self._engine.holds(index) - 1  # the passes still holding it after this release
        if pass_name == "backward" and layer.grads is not None:
            for name, p in layer.plan.params:
                grad = p.grad
                if grad is None:
                    continue
                buffer = layer.grads[name]
                if grad.data_ptr() != buffer.data_ptr():
                    buffer.add_(grad)  # converts to the engine's gradient dtype
                    self.gradient_copies += 1
                p.grad = buffer if others > 0 and buffer.dtype == p.dtype else None
            if others == 0:
                layer.grads = None
        self._engine.release(index, pass_name)
        if others == 0 and not layer.kept_whole:
            for _, p in layer.plan.params:
                p.data = self._placeholder(p.dtype)
                mark_released(p)
                if self._ds_status is not None:
                    p.ds_status = self._ds_status[1]
            layer.bound = None

    def remove_hooks(self):
        for h in self._handles:
            h.remove()
        self._handles = []
