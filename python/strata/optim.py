"""CPU optimizers over Strata's cpu_adam kernels, as torch.optim.Optimizers.

    opt = strata.optim.CPUAdam(model.parameters(), lr=1e-3, weight_decay=0.01)  # AdamW
    loss.backward(); opt.step(); opt.zero_grad()

Each param group is stepped by one native call: the tiled, multi-threaded
kernel runs over every tensor of the group with the GIL released. The
parameters are the fp32 master weights (CPU tensors); gradients are their
.grad (fp32) or given to step(grads=...) in fp32, bf16 or fp16; step can
write a bf16/fp16 copy of the updated parameters in the same pass
(step(param_copies=...), DeepSpeed's fp16_param_groups). Moments are fp32 or,
with moment_dtype=torch.bfloat16, bf16. State keys and layout match torch's
(exp_avg, exp_avg_sq / sum, step), so state dicts move between
torch.optim.AdamW / Adam / Adagrad and these classes both ways.
"""

import copy
import math
import numbers

import torch

from . import _native
from ._checks import check_int, short_repr
from ._tensors import span

__all__ = ["CPUAdam", "CPUAdagrad", "CPULion", "clip_coefficient"]

_GRAD_DTYPES = ("float32", "bfloat16", "float16")
_COPY_DTYPES = ("bfloat16", "float16")
_MOMENT_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
_KERNEL_PATHS = ("auto", "scalar", "avx2", "avx512", "avx512_bf16")
_INT_MAX = 2 ** 31 - 1       # the native threads is a C int
_MAX_TILE_ELEMENTS = 2 ** 31  # a tile of 8 GiB of fp32; larger ones overflow the native tile arithmetic
# Step counts are kept as Python floats (torch's layout): whole numbers are exact up to 2**53.
_MAX_STEP = 2 ** 53 - 1


class _CPUOptimizer(torch.optim.Optimizer):
    """Shared machinery: state creation, tensor checks, one native call per group."""

    _kind = None            # cpu_adam kind name
    _state_keys = ()        # moment tensors in the state, in kernel order (exp_avg, exp_avg_sq)

    def __init__(self, params, defaults, *, kind, moment_dtype, threads, tile_elements, kernel_path):
        if moment_dtype not in _MOMENT_DTYPES:
            raise TypeError(f"moment_dtype {moment_dtype} is not torch.float32 or torch.bfloat16")
        threads, tile_elements, kernel_path = _check_kernel_args(threads, tile_elements, kernel_path)
        self._moment_dtype = moment_dtype
        super().__init__(params, defaults)  # add_param_group checks every group
        # One kernel object: its threads and tile size; hyper-parameters come per call.
        self._native_args = (kind, threads, tile_elements, kernel_path)
        self._native = _native.CpuOptimizer(kind, threads=threads, tile_elements=tile_elements, path=kernel_path)

    # -- properties --------------------------------------------------------
    @property
    def kernel_path(self):
        """The SIMD path the kernels run (scalar, avx2, avx512, avx512_bf16) ..."""
        return self._native.path

    @property
    def kernel_path_reason(self):
        """... and why it was chosen (cpuid features or STRATA_CPU_ADAM_PATH)."""
        return self._native.path_reason

    @property
    def threads(self):
        return self._native.threads

    # -- torch.optim.Optimizer hooks ---------------------------------------
    def __getstate__(self):
        # torch's keeps defaults, state and param_groups; the kernel object is
        # rebuilt from its arguments (copy.deepcopy, pickle).
        state = super().__getstate__()
        state["_native_args"] = self._native_args
        state["_moment_dtype"] = self._moment_dtype
        return state

    def __setstate__(self, state):
        # load_state_dict comes here with new state and param_groups: a refused
        # one leaves the optimizer's own as they were.
        previous = {key: self.__dict__[key] for key in ("state", "param_groups") if key in self.__dict__}
        super().__setstate__(state)
        if "_native" not in self.__dict__ and "_native_args" in self.__dict__:
            kind, threads, tile_elements, kernel_path = self._native_args
            self._native = _native.CpuOptimizer(kind, threads=threads, tile_elements=tile_elements, path=kernel_path)
        # A state dict saved by torch.optim.AdamW/Adam/Adagrad has torch's
        # group keys only: ours take their defaults, theirs are checked.
        try:
            for gi, group in enumerate(self.param_groups):
                for key, value in self.defaults.items():
                    group.setdefault(key, value)
                self._check_group(gi, group)
        except BaseException:
            self.__dict__.update(previous)
            raise

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        try:
            self._check_group(len(self.param_groups) - 1, self.param_groups[-1])
        except BaseException:
            self.param_groups.pop()  # a refused group is not kept
            raise

    def _check_group(self, gi, group):
        if group.get("amsgrad", False):
            raise ValueError(f"param group {gi}: amsgrad=True is not supported by strata's CPU optimizers "
                             f"(use amsgrad=False)")
        if group.get("maximize", False):
            raise ValueError(f"param group {gi}: maximize=True is not supported; negate the loss instead")
        for pi, p in enumerate(group["params"]):
            self._check_param(p, f"param {pi} of group {gi}")
        self._group_hyper_checked(gi, group)

    @staticmethod
    def _check_param(p, what):
        if not p.is_cpu:
            raise ValueError(f"{what} is on {p.device}: strata.optim steps CPU tensors; offload first "
                             f"(keep fp32 master weights on the CPU and copy the update back, "
                             f"e.g. with step(param_copies=...))")
        if p.dtype != torch.float32:
            raise TypeError(f"{what} has dtype {p.dtype}: strata.optim steps fp32 master weights; keep an fp32 "
                            f"copy on the CPU and pass bf16/fp16 gradients with step(grads=...)")
        if not p.is_contiguous():
            raise ValueError(f"{what} is not contiguous: call .contiguous() on it before building the optimizer")

    # -- state -------------------------------------------------------------
    def _init_state(self, p, group):
        """A fresh state for p, torch's layout. `step` is a Python float: a
        0-dim tensor costs a torch dispatch per parameter per step to update;
        torch.optim's __setstate__ turns a float step into its tensor on load."""
        state = {"step": 0.0}
        for key in self._state_keys:
            state[key] = torch.zeros_like(p, dtype=self._moment_dtype, memory_format=torch.contiguous_format)
        return state

    def load_state_dict(self, state_dict):
        """torch.optim's, on a copy: torch >= 2 keeps the given state's
        tensors (the step counts, and moments already of the right dtype)
        instead of copying them, so this optimizer's in-place steps would
        write into the optimizer that saved them (and its steps into ours)."""
        super().load_state_dict(copy.deepcopy(state_dict))

    def _check_state(self, p, what):
        """p's existing state (none yet: nothing to check) has every moment
        with p's element count and a valid step count; returns the number of
        p's next step. Changes nothing."""
        state = self.state.get(p)
        if not state:
            return 1
        for key in self._state_keys:
            t = state.get(key)
            if t is None:
                raise KeyError(f"{what}: state has no '{key}' (was it saved by another optimizer?)")
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{what}: state '{key}' is a {type(t).__name__}, not a tensor (was the state dict "
                                f"edited?)")
            if t.numel() != p.numel():
                raise ValueError(f"{what}: state '{key}' has {t.numel()} elements, the param {p.numel()}")
        return self._next_step(state, what)

    def _state_for(self, p, group):
        """p's state (checked by _check_state), made on its first step."""
        state = self.state[p]
        if len(state) == 0:
            state.update(self._init_state(p, group))
        for key in self._state_keys:
            t = state[key]
            # load_state_dict casts moments to the param's dtype (fp32) and
            # may leave them on another device: bring them back to ours.
            if t.dtype != self._moment_dtype or not t.is_cpu or not t.is_contiguous():
                state[key] = t.to(device="cpu", dtype=self._moment_dtype, memory_format=torch.contiguous_format)
        return state

    # -- step --------------------------------------------------------------
    def _group_hyper(self, group):
        """(lr, beta1, beta2, eps, weight_decay, bias_correction) of a group."""
        raise NotImplementedError

    def _group_hyper_checked(self, gi, group):
        """_group_hyper, every value checked in the kernel's ranges and named
        (param group gi, its key): a scheduler or a user may have set any of
        them since the group was added."""
        where = f"of param group {gi}"
        for key in ("lr", "weight_decay"):
            if key in group:
                _check_number(group[key], f"'{key}' {where}", hint="must be finite and >= 0")
        if "eps" in group:
            if self._kind == "adagrad":
                _check_number(group["eps"], f"'eps' {where}", low_open=True, hint="must be finite and > 0 for "
                              "Adagrad, e.g. 1e-10")
            else:
                _check_number(group["eps"], f"'eps' {where}", hint="must be finite and >= 0, e.g. 1e-8")
        if "betas" in group:
            _check_betas(group["betas"], f"'betas' {where}")
        return self._group_hyper(group)

    @staticmethod
    def _next_step(state, what):
        """The step number of p's next update from its state's 'step' (how
        many it has had: a float, an int, or a one-element tensor in state
        dicts saved by torch), checked to be a whole number in 0..2**53-2."""
        name = f"{what}: state 'step'"
        if "step" not in state:
            raise KeyError(f"{what}: state has no 'step' (was it saved by another optimizer?)")
        value = state["step"]
        number = _number(value, name, hint="a step count is one number (was the state dict edited?)")
        if not (math.isfinite(number) and number == int(number) and 0 <= number <= _MAX_STEP - 1):
            raise ValueError(f"{name} is {short_repr(value)}: a step count is a whole number in 0..{_MAX_STEP - 1} "
                             f"(the updates it has had); was the state dict edited or saved by another optimizer?")
        return int(number) + 1

    def _gather(self, grads, param_copies):
        """Checks every tensor and builds, per param group, the spans for the
        native step: [(hyper-parameters, spans, keep, states)]. Every group's
        hyper-parameters and every state's step count are checked here, before
        the first native call, so a refused step changes nothing."""
        grads = self._per_group(grads, "grads")
        param_copies = self._per_group(param_copies, "param_copies")
        moment_dtype = _MOMENT_DTYPES[self._moment_dtype]
        # First every check (nothing changes), then the states are made and the spans built.
        checked = []
        for gi, group in enumerate(self.param_groups):
            params = group["params"]
            group_grads = self._per_param(grads[gi], gi, params, "grads")
            group_copies = self._per_param(param_copies[gi], gi, params, "param_copies")
            group_grads = group_grads if group_grads is not None else [p.grad for p in params]
            if all(g is None for g in group_grads):
                continue  # not stepped: its hyper-parameters are not used
            hyper = self._group_hyper_checked(gi, group)
            tensors = []
            for pi, p in enumerate(params):
                g = group_grads[pi]
                if g is None:
                    continue
                what = f"param {pi} of group {gi}"
                self._check_param(p, what)
                if not isinstance(g, torch.Tensor):
                    raise TypeError(f"the gradient of {what} is a {type(g).__name__}: expected a torch.Tensor or None")
                if g.is_sparse:
                    raise ValueError(f"the gradient of {what} is sparse: strata.optim needs dense gradients")
                g_ptr, g_count, g_dtype, _ = span(g, f"the gradient of {what}", dtypes=_GRAD_DTYPES)
                if g_count != p.numel():
                    raise ValueError(f"the gradient of {what} has {g_count} elements, the param {p.numel()} "
                                     f"(shape {tuple(g.shape)} vs {tuple(p.shape)})")
                c_ptr, c_dtype = 0, "bfloat16"
                copy = group_copies[pi] if group_copies is not None else None
                if copy is not None:
                    c_ptr, c_count, c_dtype, _ = span(copy, f"the param copy of {what}", dtypes=_COPY_DTYPES)
                    if c_count != p.numel():
                        raise ValueError(f"the param copy of {what} has {c_count} elements, the param {p.numel()}")
                step = self._check_state(p, what)
                tensors.append((p, g, g_ptr, g_dtype, copy, c_ptr, c_dtype, step))
            checked.append((group, hyper, tensors))
        work = []
        for group, hyper, tensors in checked:
            spans, keep, states = [], [], []
            for p, g, g_ptr, g_dtype, copy, c_ptr, c_dtype, step in tensors:
                state = self._state_for(p, group)
                moments = [state[k].data_ptr() for k in self._state_keys]
                exp_avg = moments[0] if self._kind != "adagrad" else 0
                exp_avg_sq = moments[-1] if self._kind != "lion" else 0
                spans.append((p.numel(), p.data_ptr(), g_ptr, g_dtype, exp_avg, exp_avg_sq, moment_dtype,
                              c_ptr, c_dtype, step))
                keep.append((g, copy))  # alive until the native call returns (GIL released inside)
                states.append((state, float(step)))
            work.append((hyper, spans, keep, states))
        return work

    @torch.no_grad()
    def step(self, closure=None, *, grads=None, param_copies=None, fp16_param_groups=None, loss_scale=1.0,
             clip_coefficient=1.0, skip_if_nonfinite=False):
        """One update of every parameter that has a gradient.

        closure: re-evaluates the model and returns the loss (torch semantics).
        grads: optional list (one per param group) of lists of gradient
            tensors (fp32, bf16 or fp16, CPU, one per param, None to skip)
            used instead of p.grad, e.g. bf16 gradients copied from a GPU.
        param_copies: optional list (one per group) of lists of bf16/fp16 CPU
            tensors (one per param, or None) that receive the updated params,
            rounded, in the same pass. fp16_param_groups is DeepSpeed's name
            for the same thing.
        loss_scale, clip_coefficient: the optimizer sees
            grad * (clip_coefficient / loss_scale), fused into the step (no
            pass over the gradients); clip_coefficient as from
            clip_coefficient(grad_norm(), max_norm).
        skip_if_nonfinite: first read every gradient (one pass); if any
            holds an Inf or NaN, change nothing (params, moments, step
            counts) and set last_step_skipped (dynamic loss scaling). Off:
            a non-finite gradient is applied, as in torch.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if fp16_param_groups is not None:
            if param_copies is not None:
                raise ValueError("pass param_copies or fp16_param_groups, not both")
            param_copies = fp16_param_groups
        loss_scale = _positive(loss_scale, "loss_scale")
        clip_coefficient = _positive(clip_coefficient, "clip_coefficient")
        work = self._gather(grads, param_copies)
        self.last_step_skipped = False
        if skip_if_nonfinite:
            _, finite = self._native.grad_stats_spans([(s[2], s[3], s[0]) for _, spans, _, _ in work for s in spans])
            if not finite:
                self.last_step_skipped = True
                return loss
        for hyper, spans, keep, states in work:
            lr, beta1, beta2, eps, weight_decay, bias_correction = hyper
            self._native.step_spans(spans, lr, beta1, beta2, eps, weight_decay, bias_correction,
                                    loss_scale=loss_scale, clip_coefficient=clip_coefficient)
            for state, step in states:
                state["step"] = step
            del keep
        return loss

    @torch.no_grad()
    def grad_norm(self, *, grads=None, loss_scale=1.0):
        """The L2 norm of every gradient the next step() would use, over all
        param groups (inf or nan when one holds an Inf or NaN), divided by
        loss_scale: one multi-threaded pass, GIL released, summed in double
        over fixed tiles (independent of the thread count)."""
        loss_scale = _positive(loss_scale, "loss_scale")
        spans = []
        grads = self._per_group(grads, "grads")
        for gi, group in enumerate(self.param_groups):
            group_grads = self._per_param(grads[gi], gi, group["params"], "grads")
            for pi, p in enumerate(group["params"]):
                g = group_grads[pi] if group_grads is not None else p.grad
                if g is None:
                    continue
                ptr, count, dtype, _ = span(g, f"the gradient of param {pi} of group {gi}", dtypes=_GRAD_DTYPES)
                spans.append((ptr, dtype, count))
        sum_squares, _ = self._native.grad_stats_spans(spans)
        return math.sqrt(sum_squares) / loss_scale


    def _per_group(self, lists, name):
        if lists is None:
            return [None] * len(self.param_groups)
        lists = list(lists)
        if len(lists) != len(self.param_groups):
            raise ValueError(f"{name} has {len(lists)} entries, the optimizer {len(self.param_groups)} param groups "
                             f"(one list per group)")
        return lists

    @staticmethod
    def _per_param(entries, gi, params, name):
        if entries is None:
            return None
        if isinstance(entries, torch.Tensor):
            raise TypeError(f"{name}[{gi}] is a tensor: give a list of tensors per param group, e.g. "
                            f"{name}=[[t0, t1, ...]] for one group")
        entries = list(entries)
        if len(entries) != len(params):
            raise ValueError(f"{name}[{gi}] has {len(entries)} tensors, param group {gi} has {len(params)} params")
        return entries


def clip_coefficient(total_norm, max_norm):
    """torch.nn.utils.clip_grad_norm_'s factor: min(1, max_norm / (total_norm + 1e-6));
    1 when max_norm <= 0 (no clipping) or the norm is not finite."""
    if max_norm <= 0 or not math.isfinite(total_norm):
        return 1.0
    return min(1.0, max_norm / (total_norm + 1e-6))



def _number(value, what, hint=None):
    """`value` as a float: a real number or a one-element tensor (torch
    allows a tensor lr); a bool, a string or anything else is refused, with
    `hint` (what the value is) after the message when given."""
    tail = f"; {hint}" if hint else ""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype == torch.bool or value.is_complex():
            raise TypeError(f"{what} is a tensor of shape {tuple(value.shape)} and dtype {value.dtype}: give one "
                            f"real number{tail}")
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be a number, not {type(value).__name__} ({short_repr(value)}){tail}")
    return float(value)


def _check_number(value, what, *, low=0.0, low_open=False, high=math.inf, high_open=False, hint):
    number = _number(value, what)
    ok = (math.isfinite(number) and (number > low if low_open else number >= low)
          and (number < high if high_open else number <= high))
    if not ok:
        raise ValueError(f"Invalid {what}: {short_repr(value)} ({hint})")
    return number


def _check_betas(betas, what):
    if isinstance(betas, (str, bytes)) or not hasattr(betas, "__len__") or len(betas) != 2:
        raise ValueError(f"{what} must be two numbers (beta1, beta2), got {short_repr(betas)}")
    for i, b in enumerate(betas):
        _check_number(b, f"beta parameter at index {i} of {what}", high=1.0, high_open=True,
                      hint="must be in [0, 1), e.g. 0.9 and 0.999")


def _positive(value, name):
    """loss_scale / clip_coefficient: a finite number > 0, as a float."""
    number = _number(value, name)
    if not (math.isfinite(number) and number > 0):
        raise ValueError(f"{name}={short_repr(value)} must be a finite number > 0")
    return number


def _check_kernel_args(threads, tile_elements, kernel_path):
    """The native kernel object's arguments, checked and named before it is made."""
    threads = check_int(threads, "threads", 0, _INT_MAX)
    tile_elements = check_int(tile_elements, "tile_elements", 64, _MAX_TILE_ELEMENTS)
    if tile_elements % 64:
        raise ValueError(f"tile_elements {tile_elements} must be a multiple of 64, e.g. 65536")
    if not isinstance(kernel_path, str):
        raise TypeError(f"kernel_path must be a str (one of {', '.join(_KERNEL_PATHS)}), not "
                        f"{type(kernel_path).__name__}")
    if not kernel_path.isprintable():
        raise ValueError(f"kernel_path {short_repr(kernel_path)} is not one of {', '.join(_KERNEL_PATHS)}")
    return threads, tile_elements, kernel_path


def _check_common(lr, eps, weight_decay, betas=None):
    _check_number(lr, "learning rate", hint="must be finite and >= 0")
    _check_number(eps, "epsilon value", hint="must be finite and >= 0")
    _check_number(weight_decay, "weight_decay value", hint="must be finite and >= 0")
    if betas is not None:
        _check_betas(betas, "betas")


class CPUAdam(_CPUOptimizer):
    """Adam/AdamW on the CPU (DeepSpeedCPUAdam's arguments; adamw_mode=True is
    torch.optim.AdamW, False is torch.optim.Adam with L2 weight decay)."""

    _state_keys = ("exp_avg", "exp_avg_sq")

    def __init__(self, params, lr=1e-3, bias_correction=True, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0,
                 amsgrad=False, adamw_mode=True, fp32_optimizer_states=True, *, moment_dtype=torch.float32,
                 threads=0, tile_elements=65536, kernel_path="auto"):
        if amsgrad:
            raise ValueError("amsgrad=True is not supported by strata.optim.CPUAdam (nor by DeepSpeedCPUAdam); "
                             "use amsgrad=False")
        if not fp32_optimizer_states:
            raise ValueError("fp32_optimizer_states=False: strata keeps fp32 master weights; for 16-bit moments "
                             "pass moment_dtype=torch.bfloat16")
        _check_common(lr, eps, weight_decay, betas)
        self.adamw_mode = adamw_mode
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, amsgrad=False)
        self._kind = "adamw" if adamw_mode else "adam"
        super().__init__(params, defaults, kind=self._kind, moment_dtype=moment_dtype, threads=threads,
                         tile_elements=tile_elements, kernel_path=kernel_path)

    def _group_hyper(self, group):
        beta1, beta2 = group["betas"]
        return (float(group["lr"]), float(beta1), float(beta2), float(group["eps"]), float(group["weight_decay"]),
                bool(group["bias_correction"]))


class CPUAdagrad(_CPUOptimizer):
    """torch.optim.Adagrad on the CPU (lr_decay 0). State key 'sum' as in torch."""

    _state_keys = ("sum",)
    _kind = "adagrad"

    def __init__(self, params, lr=1e-2, lr_decay=0.0, weight_decay=0.0, initial_accumulator_value=0.0, eps=1e-10,
                 *, moment_dtype=torch.float32, threads=0, tile_elements=65536, kernel_path="auto"):
        if lr_decay != 0.0:
            raise ValueError(f"lr_decay={lr_decay} is not supported by strata.optim.CPUAdagrad: use a learning-rate "
                             f"scheduler (torch.optim.lr_scheduler) instead")
        _check_number(eps, "epsilon value", low_open=True, hint="Adagrad needs eps > 0, finite")
        _check_number(initial_accumulator_value, "initial_accumulator_value value", hint="must be finite and >= 0")
        _check_common(lr, eps, weight_decay)
        defaults = dict(lr=lr, lr_decay=0.0, eps=eps, weight_decay=weight_decay,
                        initial_accumulator_value=initial_accumulator_value)
        super().__init__(params, defaults, kind="adagrad", moment_dtype=moment_dtype, threads=threads,
                         tile_elements=tile_elements, kernel_path=kernel_path)

    def _check_group(self, gi, group):
        super()._check_group(gi, group)
        if group.get("lr_decay", 0.0) != 0.0:
            raise ValueError(f"param group {gi}: lr_decay={group['lr_decay']} is not supported (use a scheduler)")
        if "initial_accumulator_value" in group:
            _check_number(group["initial_accumulator_value"], f"'initial_accumulator_value' of param group {gi}",
                          hint="must be finite and >= 0")

    def _init_state(self, p, group):
        state = super()._init_state(p, group)
        state["sum"].fill_(group["initial_accumulator_value"])
        return state

    def _group_hyper(self, group):
        return (float(group["lr"]), 0.9, 0.999, float(group["eps"]), float(group["weight_decay"]), False)


class CPULion(_CPUOptimizer):
    """Lion (Chen et al. 2023) on the CPU: sign of the interpolated momentum,
    decoupled weight decay. State key 'exp_avg'."""

    _state_keys = ("exp_avg",)
    _kind = "lion"

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, *, moment_dtype=torch.float32,
                 threads=0, tile_elements=65536, kernel_path="auto"):
        _check_common(lr, 0.0, weight_decay, betas)
        defaults = dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay)
        super().__init__(params, defaults, kind="lion", moment_dtype=moment_dtype, threads=threads,
                         tile_elements=tile_elements, kernel_path=kernel_path)

    def _group_hyper(self, group):
        beta1, beta2 = group["betas"]
        return (float(group["lr"]), float(beta1), float(beta2), 0.0, float(group["weight_decay"]), False)
