"""strata.torch.init: build a model whose parameters never exist whole.

Note [Construction on meta]
Under ``with st.init():`` every parameter a module registers is replaced by
a parameter of the same shape, dtype and requires_grad on torch's meta
device (torch's global parameter-registration hook, torch >= 2.0; nothing of
torch, transformers or accelerate is patched). Buffers stay real: they are
small and their values (causal masks, position ids, rotary frequencies) can
be computed only where the module computes them. The initializers that
constructors run on those parameters cost nothing on meta.

Torch 1.13 has no registration hook; there a dispatch mode (Note [Empty
on meta]) gives the same result for the parameters that matter.

Note [Empty on meta]
On torch < 2.0, ``st.init`` runs a ``TorchDispatchMode`` that gives every
``torch.empty`` on the CPU (uninitialized memory, what nn.Linear,
nn.Embedding, nn.LayerNorm and Hugging Face's Conv1D register their weights
with) on the meta device instead, and turns an in-place operation on a meta
tensor (the initializers that follow) into a no-op. Nothing is lost: the
memory held no value, and the rules re-create it at materialization. A
tensor a constructor computes (``torch.zeros``, ``torch.ones(d) * v``,
``torch.tensor(x)``, the causal masks) stays real, so buffers keep their
values and such a parameter keeps its constructor's value (``initialize``
treats it as a kept value, Note [Values constructors give], at any size:
its memory exists already). A buffer made by ``torch.empty`` and then
filled ends up on meta and ``initialize`` refuses it by name.

``initialize`` then materializes the model one unit at a time
(materialize_unit): the unit's parameters get CPU memory, are filled with
NaN and re-initialized by the modules' own rules: ``reset_parameters()``
of every module that has one (what their constructors ran), then, for a
Hugging Face model, its ``_init_weights`` over the unit's modules in
``Module.apply``'s order (children first; what ``post_init`` runs). The
values are handed to the engine and the unit's memory is dropped before the
next unit is made, so the host holds one unit's values at a time, not the
model. A parameter still NaN afterwards had a value no rule reproduces (a
module that fills its parameter in its constructor and has no
``reset_parameters``): refused, naming it, unless its constructor's value
was kept (Note [Values constructors give]).

Note [Values constructors give]
Some parameters get their value only from the constructor's expression and
no rule re-creates it: CLIP's ``logit_scale = nn.Parameter(torch.tensor(
config.logit_scale_init_value))``, layer-scale vectors ``value *
torch.ones(dim)``. At registration the value is already there, so a
parameter of at most 64 Ki elements keeps a copy of it beside its meta
stand-in. While ``st.init`` runs, a ``TorchFunctionMode`` watches the meta
parameters that keep one: any in-place operation on such a parameter (an
initializer: ``uniform_``, ``normal_``, ``fill_``, ``copy_``, ...) or any
use of its ``.data`` means the constructor meant another value, which
only a rule can give, so the copy is dropped then (nn.Linear registers
``torch.empty`` and runs ``reset_parameters``: its copy goes at once). At
materialization a parameter no rule touched (every element still NaN)
takes its kept value; one without a kept value is refused as above.

The values come from the same rules as an eager construction but in another
order of the random stream, so they are not the eager values; they are the
same at every stage and placement (the engine takes rank 0's), which is what
the engine's determinism is about.

Identity: a meta parameter cannot take CPU memory in place (torch refuses
``set_data`` across devices), so ``swap_meta_parameters`` puts a new CPU
parameter (of no elements until its unit is made) in every module slot
that held the meta one, and returns the mapping that ``initialize``
applies to the parameters and groups it was given. (Memory for every
parameter at once, even untouched, would not do: the allocator serves the
units' tensors from one heap, and what a freed unit leaves in it is not
given back, so the process would grow to the model's size anyway; for
the same reason each made unit's freed pages are given back,
give_back_freed_memory.)
"""

import contextlib
import ctypes
import ctypes.util
import warnings

import torch

from ._safetensors import _escape
from .errors import InvalidArgument

try:
    from torch.overrides import TorchFunctionMode
except ImportError:  # torch < 1.13; st.init builds eagerly there anyway (no registration hook before 2.0)
    TorchFunctionMode = None
try:
    from torch.utils._python_dispatch import TorchDispatchMode
except ImportError:  # torch < 1.13: st.init builds eagerly
    TorchDispatchMode = None

__all__ = ["init", "has_meta_parameters", "swap_meta_parameters", "first_holders", "materialize_unit",
           "checkpoint_keys", "load_unit", "give_back_freed_memory"]


def _registration_hook_api():
    module = torch.nn.modules.module
    return getattr(module, "register_module_parameter_registration_hook", None)


@contextlib.contextmanager
def init(config=None, enabled=True, config_dict_or_path=None, **ignored):
    """deepspeed.zero.Init's role: modules built inside have their
    parameters on the meta device (Note [Construction on meta]);
    st.initialize materializes them one unit at a time. `config` (or
    `config_dict_or_path`) is accepted for DeepSpeed's signature (the engine
    reads it in initialize); enabled=False builds normally. On torch 1.13
    (no parameter-registration hook) the tensors made by torch.empty are on
    meta instead (Note [Empty on meta]); before 1.13 the model is built
    normally, with a warning: initialize then copies it in unit by unit."""
    del config, config_dict_or_path, ignored  # initialize reads the config; DeepSpeed's other knobs do not apply
    if not enabled:
        yield
        return
    register = _registration_hook_api()
    if register is None and TorchDispatchMode is not None:
        with _EmptyOnMeta():
            yield
        return
    if register is None:
        warnings.warn(f"strata.torch.init: torch {torch.__version__} has no parameter-registration hook (torch >= 2.0 "
                      f"has): the model is built in full on the CPU here; initialize copies it in unit by unit and "
                      f"drops it", RuntimeWarning, stacklevel=3)
        yield
        return

    def to_meta(module, name, param):
        if param is None or param.device.type == "meta":
            return None
        meta = torch.nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device="meta"),
                                  requires_grad=param.requires_grad)
        if param.numel() <= _KEPT_VALUE_ELEMENTS:  # Note [Values constructors give]
            meta._strata_constructed_value = param.detach().clone()
        return meta

    handle = register(to_meta)
    try:
        with _ConstructorWrites():
            yield
    finally:
        handle.remove()


# The largest parameter whose constructor's value st.init keeps (Note [Values constructors give]).
_KEPT_VALUE_ELEMENTS = 64 * 1024


class _ConstructorWrites(TorchFunctionMode if TorchFunctionMode is not None else object):
    """Drops the kept constructor value of a meta parameter that an in-place
    operation writes, or whose .data is used (Note [Values constructors give])."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if args:
            target = args[0]
            if getattr(target, "_strata_constructed_value", None) is not None and _writes_or_exposes(func):
                del target._strata_constructed_value
        return func(*args, **(kwargs or {}))


class _EmptyOnMeta(TorchDispatchMode if TorchDispatchMode is not None else object):
    """torch.empty on the CPU gives a meta tensor; an in-place operation on
    a meta tensor does nothing (Note [Empty on meta])."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _EMPTY_FACTORIES and kwargs.get("device") in (None, _CPU):
            return func(*args, **{**kwargs, "device": _META})
        if args and isinstance(args[0], torch.Tensor) and args[0].is_meta and _in_place(func):
            return args[0]
        return func(*args, **kwargs)


_CPU = torch.device("cpu")
_META = torch.device("meta")
_EMPTY_FACTORIES = (torch.ops.aten.empty.memory_format, torch.ops.aten.empty_strided.default)


def _in_place(func):
    name = func._schema.name  # "aten::uniform_"
    return name.endswith("_") and not name.endswith("__")


def _writes_or_exposes(func):
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):  # a property: .data hands out (or replaces) the storage
        return getattr(getattr(func, "__self__", None), "__name__", "") == "data"
    return name.endswith("_") and not name.endswith("__")  # in-place: uniform_, fill_, copy_, ...


def has_meta_parameters(model):
    return any(p.device.type == "meta" for p in model.parameters())


def swap_meta_parameters(model):
    """Every parameter of `model` (which has meta ones) replaced by an empty
    CPU parameter (no memory until materialize_unit gives it its shape's),
    tied parameters kept tied. A parameter that is not on meta (made by a
    constructor's expression on torch 1.13, Note [Empty on meta]) keeps its
    value as a kept one. Returns ({old parameter: new parameter}, {id(new
    parameter): its shape}); the mapping's keys keep the old parameters
    alive, so no id is reused while it is followed."""
    mapping, shapes = {}, {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            new = mapping.get(param)
            if new is None:
                new = torch.nn.Parameter(torch.empty(0, dtype=param.dtype), requires_grad=param.requires_grad)
                kept = getattr(param, "_strata_constructed_value", None)
                if param.device.type != "meta":
                    kept = param.detach()
                if kept is not None:
                    new._strata_constructed_value = kept
                mapping[param] = new
                shapes[id(new)] = param.shape
            module._parameters[name] = new
    return mapping, shapes


def _modules_post_order(module, skip):
    """module's submodules (itself last) in Module.apply's order, leaving
    out the subtrees in `skip` (other units')."""
    out = []

    def visit(m):
        for child in m.children():
            if id(child) not in skip:
                visit(child)
        out.append(m)

    visit(module)
    return out


def first_holders(model):
    """{id(parameter): the first module (model.modules() order) holding it}:
    for a tied weight, the module that made it (a head tied to the embedding
    holds the embedding's weight; its constructor's values were replaced)."""
    holders = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            holders.setdefault(id(param), module)
    return holders


def materialize_unit(root, unit, units, params, shapes, names, holders):
    """Gives `params` (the unit's own, swapped by swap_meta_parameters) their
    memory (`shapes`) and the values the modules' own rules give (Note
    [Construction on meta]). `names` maps each to its name for the refusal;
    `holders` is first_holders(root)."""
    skip = {id(u.module) for u in units if u is not unit}
    mine = {id(p) for p in params}
    # A module holding a weight another unit owns (tied, made already or
    # later) is left alone: its rules would write into that unit's values.
    modules = [m for m in _modules_post_order(unit.module, skip)
               if all(id(q) in mine for q in m.parameters(recurse=False))]
    with torch.no_grad():
        for p in params:
            if tuple(p.shape) != tuple(shapes[id(p)]):  # no home given yet (initialize gives fp32 layers theirs)
                p.data = torch.empty(shapes[id(p)], dtype=p.dtype)
            p.fill_(float("nan"))
        for m in modules:
            reset = getattr(m, "reset_parameters", None)
            own = list(m.parameters(recurse=False))
            # Only the module that made every weight it holds: a tied head's
            # reset would overwrite the embedding's values (not so eagerly).
            if callable(reset) and own and all(holders[id(q)] is m for q in own):
                reset()
        hf_init = getattr(root, "_init_weights", None)
        if callable(hf_init) and _is_hugging_face_model(root):
            for m in modules:
                hf_init(m)
    for p in params:
        kept = getattr(p, "_strata_constructed_value", None)
        if kept is not None:
            del p._strata_constructed_value
            if torch.isnan(p).all() and tuple(kept.shape) == tuple(p.shape):  # no rule touched it
                with torch.no_grad():
                    p.copy_(kept)
        if torch.isnan(p).any():
            owner = names[p]
            module = type(holders[id(p)]).__name__
            raise InvalidArgument(f"parameter '{owner}' was built on the meta device (st.init) and no rule "
                                  f"re-creates its value: its module ({module}) has no reset_parameters() and the "
                                  f"model is not a Hugging Face PreTrainedModel whose _init_weights covers it. Give "
                                  f"the module a reset_parameters() that sets it, or build the model outside st.init")


def _is_hugging_face_model(model):
    try:
        import transformers
    except ImportError:
        return False
    return isinstance(model, transformers.PreTrainedModel)


_libc = None


def give_back_freed_memory():
    """Returns the heap pages a made-and-dropped unit left free to the
    system (glibc's malloc_trim; nothing elsewhere). Without it glibc keeps
    them: units' tensors under its mmap threshold come from the heap, which
    shrinks only from its top, so the process would still grow to the
    model's size."""
    global _libc
    if _libc is None:
        name = ctypes.util.find_library("c")
        try:
            _libc = ctypes.CDLL(name) if name else False
        except OSError:
            _libc = False
    trim = getattr(_libc, "malloc_trim", None) if _libc else None
    if trim is not None:
        trim(0)


def checkpoint_keys(model, checkpoint):
    """{id(parameter): its key in `checkpoint`} for every parameter of
    `model`, checked before anything is made: a tied weight may be stored
    under any of its names; a Hugging Face model's keys with or without its
    base_model_prefix ("transformer." for GPT-2). A missing key or another
    shape is refused, naming the parameter (the first few of them)."""
    prefix = getattr(model, "base_model_prefix", "") or ""
    names = {}
    for module_name, module in model.named_modules():  # every name of a tied weight (torch 1.13 has no
        for local, p in module._parameters.items():     # named_parameters(remove_duplicate=False))
            if p is not None:
                names.setdefault(id(p), (p, []))[1].append(f"{module_name}.{local}" if module_name else local)
    available = set(checkpoint.keys())
    candidates_of = {}
    for p, aliases in names.values():
        candidates = []
        for name in aliases:
            candidates.append(name)
            if prefix and name.startswith(prefix + "."):
                candidates.append(name[len(prefix) + 1:])
            elif prefix:
                candidates.append(f"{prefix}.{name}")
        candidates_of[id(p)] = candidates
    # A checkpoint saved in a model's older layout (transformers >= 5 renames keys when it loads them, and
    # save_pretrained writes the old names back): the key each current name was renamed from, and the keys that
    # were renamed away (as transformers does, a key renamed onto one of the model's names is not also read under
    # its own name).
    model_names = {c for candidates in candidates_of.values() for c in candidates}
    renamed_from, renamed_away, converted = _hugging_face_renamings(model, available, model_names)
    keys, missing = {}, []
    for p, aliases in names.values():
        candidates = candidates_of[id(p)]
        key = next((renamed_from[c] for c in candidates if c in renamed_from), None)
        if key is None:
            key = next((c for c in candidates if c in available and c not in renamed_away), None)
        if key is None:
            missing.append(aliases[0])
            continue
        shape = tuple(checkpoint.shape(key))
        want = tuple(p.shape)
        if shape != want:
            raise InvalidArgument(f"initial_weights '{_escape(checkpoint.location)}': tensor '{_escape(key)}' has "
                                  f"shape {list(shape)}, parameter '{_escape(aliases[0])}' has {list(want)}: a "
                                  f"checkpoint of another model?")
        keys[id(p)] = key
    if missing:
        shown = ", ".join(f"'{_escape(n)}'" for n in missing[:5])
        shown += f" and {len(missing) - 5} more" if len(missing) > 5 else ""
        if converted:
            raise InvalidArgument(f"initial_weights '{_escape(checkpoint.location)}' has no tensor for parameter(s) "
                                  f"{shown}: transformers makes them by converting tensors such as "
                                  f"'{_escape(sorted(converted)[0])}' "
                                  f"(merged or split when loaded), which initial_weights does not do; build the model "
                                  f"with from_pretrained and pass it to initialize without initial_weights")
        raise InvalidArgument(f"initial_weights '{_escape(checkpoint.location)}' has no tensor for parameter(s) "
                              f"{shown} (looked up by name"
                              f"{f', with and without the prefix {prefix!r}' if prefix else ''}): a checkpoint "
                              f"of another model, or a model built with other options?")
    return keys


def _hugging_face_renamings(model, available, model_names):
    """({current name: checkpoint key} for the checkpoint keys transformers
    renames onto `model_names` when it loads them into `model`, {those
    keys}, {checkpoint keys it converts}). Keys are taken in sorted order and
    the first one renamed onto a name wins, as transformers does. Empty for
    other models and for transformers < 5 (no conversion mapping; 4.x
    renames nothing these architectures save)."""
    if not _is_hugging_face_model(model):
        return {}, set(), set()
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, rename_source_key
    except ImportError:
        return {}, set(), set()
    transforms = get_model_conversion_mapping(model)  # fresh copies: the transforms keep state across keys
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    renamed_from, renamed_away, converted = {}, set(), set()
    for key in sorted(available):
        new, converter_pattern = rename_source_key(key, renamings, converters)
        if converter_pattern is not None:
            converted.add(key)
        elif new != key and new in model_names:
            renamed_from.setdefault(new, key)
            renamed_away.add(key)
    return renamed_from, renamed_away, converted


def load_unit(params, keys, checkpoint):
    """Gives `params` (one unit's) their values from `checkpoint`, a tensor
    at a time, in their own dtype."""
    with torch.no_grad():
        for p in params:
            value = checkpoint.read(keys[id(p)])
            if tuple(p.shape) == tuple(value.shape) and p.numel() > 0:
                p.copy_(value)  # into the memory it has (its home in the engine's packed layout)
            else:
                p.data = value if value.dtype == p.dtype else value.to(p.dtype)
