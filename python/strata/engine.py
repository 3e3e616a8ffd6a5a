"""The Strata engine driven from Python: the layer strata.torch stands on.

A model is described as layers of tensors (``TensorSpec``); the engine owns
every parameter, gradient and optimizer byte (ZeRO stages 0-3, optimizer
state and stage-3 parameters on the device, in pinned host memory or on
NVMe, as the DeepSpeed-style config says) and lends a layer's memory
between ``acquire`` and ``release`` as torch tensors that view it without a
copy. The caller drives each step::

    eng = strata.engine.Engine("ds.json", layers)
    for i, tensors in enumerate(initial_values):
        eng.put_initial_layer(i, tensors)
    eng.begin_step()
    eng.begin_micro_batch(last=True)
    view = eng.acquire(0, "forward")        # view.params["fc.weight"] is a torch tensor
    ...
    eng.release(0, "forward")
    ...                                     # backward: acquire(i, "backward"), add into view.grads
    eng.end_micro_batch(mean_loss, tokens)
    outcome = eng.finish_step()             # {"outcome": "applied", "metrics": {...}, ...}

This build drives the cpu device in one process (its memory is host
memory). A view is valid until its release: at stage 3 the engine frees or
reuses a layer's gathered memory afterwards, unless the layer is kept whole
(``keeps_whole``). See docs/python.md.
"""

import json
import operator
import os
from collections import namedtuple

from . import _native
from ._checks import check_finite, check_int, check_json, short_repr
from ._sizes import parse_size
from .errors import FailedPrecondition, InvalidArgument

__all__ = ["TensorSpec", "LayerView", "Engine"]

TensorSpec = namedtuple("TensorSpec", ["name", "shape", "dtype", "trainable", "weight_decay", "lr_scale"],
                        defaults=[True, None, 1.0])
TensorSpec.__doc__ = """One tensor of a layer. dtype: a torch dtype or its name (float32, bfloat16,
float16); weight_decay None = the optimizer's; lr_scale multiplies the schedule's lr."""

LayerView = namedtuple("LayerView", ["params", "grads"])
LayerView.__doc__ = """A layer's memory lent by acquire(): {tensor name: torch tensor} for the
parameters and (backward only) the gradient buffers, else grads is None."""

_DTYPE_NAMES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


def _dtype_name(dtype):
    name = str(dtype).replace("torch.", "")
    if name not in _DTYPE_NAMES:
        raise ValueError(f"dtype {dtype!r} is not float32, bfloat16 or float16")
    return name


def _torch():
    import torch  # torch is needed only to view engine memory as tensors
    return torch


def _from_dlpack_function():
    """torch's tensor-from-DLPack-capsule call (the native module makes the capsules: Note [Views through
    DLPack] in python/src/torch_views.h)."""
    torch = _torch()
    import torch.utils.dlpack
    return getattr(torch._C, "_from_dlpack", None) or torch.utils.dlpack.from_dlpack


class Engine:
    """One rank's engine over a model described by layers of TensorSpec."""

    def __init__(self, config, layers, device_memory=0, backend="auto", job_name=None,
                 resume_hint="engine.load_checkpoint(DIR) on a new engine", device=None):
        # job_name: the swap folders' (EngineOptions::job_name; None: train-<rank 0's process id>). resume_hint:
        # how this engine's caller resumes from a checkpoint, named where an error stops the engine. device:
        # strata.torch's TorchDevice (Note [The device strata.torch trains on]; None: the cpu device, torch's
        # work on the calling thread).
        if isinstance(config, dict):
            check_json(config, "the config dict")
            path, text = None, json.dumps(config)
        elif isinstance(config, (str, os.PathLike)):
            path, text = os.fspath(config), None
        else:
            raise TypeError(f"config must be a path or a dict, not {type(config).__name__}")
        described = describe_layers(layers)
        device_memory = _device_memory(device_memory)
        if not isinstance(backend, str):
            raise TypeError(f"backend must be a str (auto, local, mpi or torch), not {type(backend).__name__}")
        # backend: "auto" (this process as one rank of mpirun's world when mpirun started it, else of
        # torch.distributed's initialized group, else one process), "local" (one process), "mpi" or "torch"
        # (a rank of torch.distributed's default group, over gloo) (Note [Ranks of a driven engine]).
        if job_name is not None and not isinstance(job_name, str):
            raise TypeError(f"job_name must be a str, not {type(job_name).__name__}")
        self._device = device
        kind, ordinal, order = ("cpu", 0, "host") if device is None else \
            (device.engine_kind, device.ordinal, device.stream_order)
        self._native = _native.DrivenEngine.create(path, text, described, device_memory, backend, job_name or "",
                                                   str(resume_hint), kind, ordinal, order)
        self._layout = [self._native.layer_tensors(i) for i in range(self._native.layer_count)]
        self._from_dlpack = None  # torch's, looked up at the first acquire

    @property
    def layer_count(self):
        return self._native.layer_count

    @property
    def rank(self):
        return self._native.rank

    @property
    def world_size(self):
        return self._native.world_size

    @property
    def gradient_accumulation_steps(self):
        return self._native.grad_accum

    @property
    def optimizer_steps(self):
        return self._native.optimizer_steps

    @property
    def steps_begun(self):
        """Steps begun so far (begin_step calls that were not abandoned): the number the next checkpoint tag
        global_step<N> takes."""
        return self._native.steps_begun

    def keeps_whole(self, layer):
        """Whether layer `layer`'s parameters stay whole at one address for
        the whole run (every layer at stages 0-2; at stage 3 a layer with
        fewer elements than stage3_param_persistence_threshold): the views
        acquire() lends of them stay valid after release. Otherwise (a
        stage-3 shard) the memory may be freed or reused after release."""
        return self._native.keeps_layer_whole(self._layer_index(layer))

    def tensor_names(self, layer):
        return [t[0] for t in self._layout[self._layer_index(layer)]]

    def layout(self, layer):
        """Layer `layer`'s tensors as the engine lays them out: [(name, shape, dtype name, offset in bytes,
        offset in elements)]."""
        return self._layout[self._layer_index(layer)]

    def _layer_index(self, layer):
        """`layer` as an index into the model's layers: a whole number in
        0..layer_count-1 (a negative one is refused, not counted from the end)."""
        count = len(self._layout)
        if type(layer) is int and 0 <= layer < count:
            return layer
        if isinstance(layer, bool) or not hasattr(type(layer), "__index__"):
            raise TypeError(f"layer must be a whole number (a layer index), not {type(layer).__name__} "
                            f"({short_repr(layer)})")
        index = operator.index(layer)
        if not 0 <= index < count:
            raise InvalidArgument(f"layer {index} is out of range: the model has {count} layers (give 0..{count - 1})")
        return index

    def _layer_bytes(self, layer):
        """The bytes of layer `layer`'s packed parameters, as the engine lays them out."""
        return max((offset + _numel(shape) * _itemsize(dtype) for _, shape, dtype, offset, _ in self._layout[layer]),
                   default=0)

    # -- initial values --------------------------------------------------------------------------
    def put_initial_layer(self, layer, tensors, root=0):
        """Hands layer `layer`'s initial values in: `tensors` in the layer's
        order (or {name: tensor}), each of its declared shape; they are
        converted to the declared dtype, and fp32 copies seed the master
        weights. With several ranks every rank calls it and rank `root`'s
        values are taken."""
        torch = _torch()
        layer = self._layer_index(layer)
        root = check_int(root, "root", 0, self.world_size - 1)
        layout = self._layout[layer]
        if isinstance(tensors, dict):
            missing = [name for name, *_ in layout if name not in tensors]
            if missing:
                raise KeyError(f"layer {layer}: no initial value for {missing}")
            tensors = [tensors[name] for name, *_ in layout]
        if len(tensors) != len(layout):
            raise ValueError(f"layer {layer}: {len(tensors)} tensors given, the layer has {len(layout)}")
        nbytes = 0
        numel = 0
        for name, shape, dtype, offset_bytes, offset_elements in layout:
            count = _numel(shape)
            nbytes = max(nbytes, offset_bytes + count * _itemsize(dtype))
            numel = max(numel, offset_elements + count)
        packed = torch.zeros(nbytes, dtype=torch.uint8)
        # An all-fp32 layer's packed bytes are its fp32 values: no second copy (the largest layer's
        # size in transient memory).
        values = None if all(dtype == "float32" for _, _, dtype, _, _ in layout) else \
            torch.zeros(numel, dtype=torch.float32)
        for (name, shape, dtype, offset_bytes, offset_elements), value in zip(layout, tensors):
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"layer {layer}: the value of tensor {name!r} is a {type(value).__name__}, not a "
                                f"torch.Tensor")
            value = value.detach().to("cpu")
            if list(value.shape) != list(shape):
                raise ValueError(f"layer {layer}: tensor '{name}' has shape {list(value.shape)}, declared {shape}")
            flat = value.reshape(-1)
            count = flat.numel()
            typed = flat.to(getattr(torch, dtype)).contiguous()
            packed[offset_bytes:offset_bytes + count * _itemsize(dtype)] = typed.view(torch.uint8)
            if values is not None:
                values[offset_elements:offset_elements + count] = flat.to(torch.float32)
        self._native.put_initial_layer(layer, packed.numpy(), None if values is None else values.numpy(), int(root))

    def packed_views(self, layer):
        """For an all-fp32 layer: a zeroed uint8 tensor of its bytes as the
        engine lays them out and {name: an fp32 view of it with that
        tensor's shape}; values written into the views are handed in by
        put_initial_packed without a copy. None for other layers."""
        torch = _torch()
        layout = self._layout[self._layer_index(layer)]
        if any(dtype != "float32" for _, _, dtype, _, _ in layout):
            return None
        nbytes = max(offset + _numel(shape) * 4 for _, shape, _, offset, _ in layout)
        packed = torch.zeros(nbytes, dtype=torch.uint8)
        views = {name: packed[offset:offset + _numel(shape) * 4].view(torch.float32).view(shape)
                 for name, shape, _, offset, _ in layout}
        return packed, views

    def put_initial_packed(self, layer, packed, root=0):
        """put_initial_layer for packed_views' buffer, without a copy (the
        fp32 master weights are its values): a CPU, C-contiguous torch.uint8
        tensor of exactly the layer's packed size."""
        torch = _torch()
        layer = self._layer_index(layer)
        root = check_int(root, "root", 0, self.world_size - 1)
        expected = self._layer_bytes(layer)
        what = f"put_initial_packed(): the packed values of layer {layer}"
        if not isinstance(packed, torch.Tensor):
            raise TypeError(f"{what} are a {type(packed).__name__}: give the torch.uint8 tensor packed_views() "
                            f"returns")
        if packed.dtype != torch.uint8:
            raise TypeError(f"{what} have dtype {packed.dtype}: give the torch.uint8 tensor packed_views() returns "
                            f"(its bytes)")
        if packed.device.type != "cpu":
            raise ValueError(f"{what} are on {packed.device}: give a CPU tensor")
        if packed.layout != torch.strided or not packed.is_contiguous():
            raise ValueError(f"{what} are not contiguous (strides {tuple(packed.stride())}): give packed_views()' "
                             f"buffer, or call .contiguous() on it")
        if packed.dim() != 1 or packed.numel() != expected:
            raise ValueError(f"{what} have shape {tuple(packed.shape)}: the layer has {expected} bytes (a 1-D tensor "
                             f"of {expected} elements, as packed_views() returns)")
        self._native.put_initial_layer(layer, packed.numpy(), None, root)

    # -- the step's brackets (Note [Driving the engine]) ------------------------------------------
    @property
    def phase(self):
        """Where the driving thread is, as the engine says: "idle" (between
        steps), "step" (inside a step, between its micro-batches),
        "micro_batch", "evaluation"; "closed" after close(). A call refused
        for its order or arguments leaves it as it was; one that failed in
        its work leaves it where that work got to (Note [Driving the engine]
        in engine.h)."""
        if isinstance(self._native, _ClosedNative):
            return "closed"
        return self._native.phase

    @property
    def in_step(self):
        """A step is open: begin_step() ran and finish_step() or abandon_step() did not yet."""
        return self.phase in ("step", "micro_batch")

    @property
    def in_micro_batch(self):
        """A micro-batch is open: begin_micro_batch() ran and end_micro_batch() did not yet."""
        return self.phase == "micro_batch"

    def raise_if_stopped(self):
        """Raises why the engine stopped (an error it could not roll back: Note
        [Atomic steps]), or that it was closed; nothing while it can go on."""
        self._native.raise_if_stopped()

    def holds(self, layer):
        """How many passes hold layer `layer` now: acquires (of any pass) not
        yet released (0 after close())."""
        index = self._layer_index(layer)
        if isinstance(self._native, _ClosedNative):
            return 0
        return self._native.layer_holds(index)

    def begin_step(self):
        self._native.begin_step()

    def gradient_scale(self):
        """Multiply each micro-batch's mean loss by this before backward (the
        loss scale over accumulation steps times ranks)."""
        return self._native.gradient_scale()

    def begin_micro_batch(self, last):
        self._native.begin_micro_batch(bool(last))

    def end_micro_batch(self, mean_loss, tokens):
        self._native.end_micro_batch(float(mean_loss), check_int(tokens, "tokens", 0, 2 ** 63 - 1))

    def finish_step(self):
        return self._native.finish_step()

    def set_step_lr(self, lr):
        """The lr of every step from the next finish_step() on (a caller's own schedule), instead of the
        config's."""
        self._native.set_step_lr(lr)

    def abandon_step(self):
        """Drops the step in progress (Engine::abandon_step): layers still
        held are released, partial gradients discarded; the next begin_step()
        repeats the step."""
        self._native.abandon_step()

    def begin_evaluation(self):
        self._native.begin_evaluation()

    def finish_evaluation(self, loss_sum, batches):
        return self._native.finish_evaluation(float(loss_sum), check_int(batches, "batches", 0, 2 ** 63 - 1))

    # -- lending memory --------------------------------------------------------------------------
    def acquire(self, layer, pass_name):
        """Layer `layer`'s memory for pass forward, backward or eval, once
        everything it waits for is done, as torch tensors viewing it.

        The parameter tensors keep their memory lent while they live (Note
        [Lent memory outlives its release] in engine_bindings.cpp): a view
        autograd saved in forward stays valid after release; drop views you
        do not need, since a kept one keeps its memory."""
        if self._from_dlpack is None:
            self._from_dlpack = _from_dlpack_function()
        params, grads = self._native.acquire(self._layer_index(layer), pass_name, self._from_dlpack,
                                             self._torch_stream())
        return LayerView(params, grads)

    def release(self, layer, pass_name):
        """Hands the layer back; its views must not be used after this (on a
        GPU: torch's work issued on its current stream so far is the pass)."""
        self._native.release(self._layer_index(layer), pass_name, self._torch_stream())

    def _torch_stream(self):
        """Torch's current stream, which the engine orders the layer's use on (Note [Torch's stream and the
        engine's] in python/src/torch_stream_order.h); 0 on the cpu device."""
        return 0 if self._device is None else self._device.current_stream()

    def stream_order_log(self):
        """The recorded stand-in's log of the waits and records put on torch's streams: [(op, stream, what)]
        (an engine made on the recorded stand-in only; tests of the device branch)."""
        return self._native.stream_order_log()

    def read_layers(self, layers):
        """Yields (layer, {name: parameter tensor}) for each of `layers`,
        acquired for an evaluation (gathered at stage 3, read from NVMe
        where it lives) and released before the next: at most one layer's
        gathered copy at a time. Between steps; every rank iterates (the
        gathers are collectives). No evaluation is opened for no layers."""
        layers = list(layers)
        if not layers:
            return
        self.begin_evaluation()
        try:
            for layer in layers:
                view = self.acquire(layer, "eval")
                try:
                    yield layer, view.params
                finally:
                    del view
                    self.release(layer, "eval")
        finally:
            self.finish_evaluation(0.0, 1)

    # -- state -----------------------------------------------------------------------------------
    def gather_state(self, layer, kind="master"):
        """The layer's fp32 master weights (or exp_avg / exp_avg_sq), whole, as a torch tensor."""
        torch = _torch()
        return torch.tensor(self._native.gather_state(self._layer_index(layer), kind), dtype=torch.float32)

    def synchronize(self):
        self._native.synchronize()

    def predicted_memory(self):
        return self._native.predicted_memory()

    def close(self, hint="make a new Engine"):
        """Ends the engine: the native one is dropped here (its memory freed, its swap folders removed) and
        every later use is refused, naming `hint`."""
        self._native = _ClosedNative(hint)

    def describe(self):
        """The engine's own account of its options and placement (what `strata train` prints)."""
        return self._native.describe()

    # -- checkpoints (docs/checkpoints.md) --------------------------------------------------------
    def save_checkpoint(self, save_dir, tag="", keep=0, sync=False, app_json="{}"):
        """A collective: every rank calls it after the same step; returns once the snapshot is queued (sync:
        once it is durable). app_json is stored as the manifest's "app"."""
        return self._native.save_checkpoint(save_dir, tag, keep, sync, app_json)

    def wait_checkpoint(self):
        """Waits for the save in flight: what it did, or None when none was in flight."""
        return self._native.wait_checkpoint()

    def load_checkpoint(self, dir_or_tag):
        return self._native.load_checkpoint(dir_or_tag)

    def checkpoint_app_json(self, dir_or_tag):
        """The "app" JSON text a checkpoint's manifest holds."""
        return self._native.checkpoint_app_json(dir_or_tag)

    def measured_memory(self):
        """Peaks since creation per tier (device, pinned, nvme), as predicted_memory() plans them."""
        return self._native.measured_memory()


class _ClosedNative:
    """The native engine of a closed Engine: every use is refused."""

    def __init__(self, hint):
        self._hint = hint

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        raise FailedPrecondition(f"this engine was closed (engine.close(), or the interpreter's exit): its memory is "
                                 f"freed; {self._hint}")


def describe_layers(layers):
    """Layers of TensorSpec (or its tuples) as the native module takes them.
    Every number is checked (a bool or a float extent is refused, not
    truncated) and a name used twice in a layer is refused: acquire's views
    are keyed by name, so the second tensor would be unreachable."""
    described = []
    for li, (layer_name, tensors) in enumerate(layers):
        layer_name = str(layer_name)
        where = f"layer {li} {short_repr(layer_name)}"
        out, seen = [], set()
        for t in tensors:
            t = TensorSpec(*t) if not isinstance(t, TensorSpec) else t
            if not isinstance(t.name, str):
                raise TypeError(f"{where}: a tensor name must be a str, not {type(t.name).__name__} ({short_repr(t.name)})")
            if t.name in seen:
                raise InvalidArgument(f"{where}: tensor name {short_repr(t.name)} is used twice; names within a layer "
                                      f"must differ (acquire() returns the tensors by name)")
            seen.add(t.name)
            what = f"{where}, tensor {short_repr(t.name)}"
            if isinstance(t.shape, (str, bytes)) or not hasattr(t.shape, "__iter__"):
                raise TypeError(f"{what}: shape must be a list of whole numbers, not {type(t.shape).__name__}")
            # Extents as int64; their range (>= 1) the native layer checks, naming the tensor.
            shape = [check_int(d, f"{what}: shape extent", -2 ** 63, 2 ** 63 - 1) for d in t.shape]
            weight_decay = None if t.weight_decay is None else check_finite(t.weight_decay, f"{what}: weight_decay",
                                                                             0.0)
            lr_scale = check_finite(t.lr_scale, f"{what}: lr_scale", 0.0)
            out.append((t.name, shape, _dtype_name(t.dtype), bool(t.trainable), weight_decay, lr_scale))
        described.append((layer_name, out))
    return described


def _device_memory(value):
    """Engine's device_memory: 0 (the config's strata.device_memory, else a
    quarter of host memory) or bytes (int) or a size such as "8GiB"."""
    if type(value) is int and value == 0:
        return 0
    if isinstance(value, float) and not isinstance(value, bool):
        raise TypeError(f"device_memory must be bytes (an int) or a size such as \"8GiB\", not a float ({value!r})")
    return parse_size(value, "device_memory")



def _numel(shape):
    """Elements of a tensor of `shape` (a list, tuple or torch.Size): the one count the package uses."""
    count = 1
    for d in shape:
        count *= int(d)
    return count


def _itemsize(dtype_name):
    return {"float32": 4, "bfloat16": 2, "float16": 2}[dtype_name]
