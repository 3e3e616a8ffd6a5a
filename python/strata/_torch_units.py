"""strata.torch: an nn.Module split into units, and each unit's parameters
packed into engine layers.

A unit is a submodule whose parameters are acquired together (one engine
call per layer per hook, never one per parameter): by default the classes
Hugging Face names in ``model._no_split_modules``, else the model's large
children (Note [Units of a model without _no_split_modules]); parameters no
unit holds form the root unit, held for the whole forward and backward.

A unit owns the parameters whose first name (``named_parameters()`` order,
which drops duplicates) lies inside it, one engine layer per (dtype,
trainable) kind it holds. A tied weight therefore belongs to one layer; a
unit that uses a weight owned elsewhere (a head tied to the embedding)
acquires that layer too, nested, where it is used.

Note [Units of a model without _no_split_modules]
The model's children holding at least 1 % of its parameters become units;
a container (nn.ModuleList, ModuleDict, Sequential) is looked into. A
backbone, a child that holds more than half of the model in repeated blocks
(a container with two or more children of one class) and at most 1 % in
parameters of its own, such as BertModel under a masked-LM head, is looked
into too, or one unit would hold most of the model and stage 3 would
gather all of it at once: inside it only the blocks of its containers
become units, and its other parts (embeddings, a relative-position table,
final norms) join the root unit. Those parts are often read by a parent or
a sibling without being called (DeBERTa's encoder hands
`rel_embeddings.weight` to its layers; ProphetNet calls
`position_embeddings._forward`), which a unit of their own would refuse; the
root is held for the whole pass. A module of a few leaves (a LoRA linear,
whose ModuleDicts hold one adapter each) stays one unit.
"""

from collections import namedtuple

import torch

from .engine import TensorSpec

__all__ = ["Unit", "LayerPlan", "split_into_units", "plan_layers"]

# A fraction of the model's parameters below which a child is not worth a unit of its own (its hooks
# would cost more than holding it for the whole pass): it joins the root unit.
_SMALL_CHILD_FRACTION = 0.01

# A backbone: a child that holds more than this fraction of the model in repeated blocks (Note [Units of a
# model without _no_split_modules]).
_LOOK_INTO_FRACTION = 0.5

_CONTAINERS = (torch.nn.ModuleList, torch.nn.ModuleDict, torch.nn.Sequential)


class Unit:
    """A submodule acquired as a whole: `layers` are the engine layers its
    own parameters live in, `uses` every layer its forward needs (its own and
    those of weights it shares with another unit)."""

    def __init__(self, name, module, is_root=False):
        self.name = name
        self.module = module
        self.is_root = is_root
        self.layers = []
        self.uses = []

    def __repr__(self):
        return f"Unit({self.name or '<root>'}: {type(self.module).__name__}, layers {self.uses})"


class LayerPlan:
    """One engine layer: the parameters (by name) of one unit of one dtype
    and trainability, in the unit's parameter order."""

    def __init__(self, name, unit, dtype, trainable):
        self.name = name
        self.unit = unit
        self.dtype = dtype
        self.trainable = trainable
        self.params = []  # [(name, torch.nn.Parameter)]
        self.index = -1

    def specs(self, hyper_of):
        """The layer's TensorSpecs; hyper_of(param) -> (weight_decay, lr_scale)."""
        out = []
        for name, p in self.params:
            decay, lr_scale = hyper_of(p) if self.trainable else (None, 1.0)
            out.append(TensorSpec(name, tuple(p.shape), self.dtype, self.trainable, decay, lr_scale))
        return out


def _param_count(module):
    return sum(p.numel() for p in module.parameters())


def _holds_repeated_blocks(module):
    """A container somewhere inside holding at least two children of one class (a model's layers)."""
    for m in module.modules():
        if isinstance(m, _CONTAINERS):
            kinds = [type(child) for child in m.children()]
            if any(kinds.count(kind) >= 2 for kind in set(kinds)):
                return True
    return False


def _auto_unit_modules(model):
    """[(name, module)] of the units `units="auto"` picks (Note [Units of a
    model without _no_split_modules])."""
    classes = set(getattr(model, "_no_split_modules", None) or [])
    if classes:
        chosen = []
        for name, module in model.named_modules():
            if name and type(module).__name__ in classes and not any(name.startswith(c + ".") for c, _ in chosen):
                chosen.append((name, module))
        if chosen:
            return chosen
    total = max(_param_count(model), 1)
    chosen = []

    def is_backbone(child, count):
        own = sum(p.numel() for p in child.parameters(recurse=False))
        return (not isinstance(child, _CONTAINERS) and count > _LOOK_INTO_FRACTION * total
                and own < _SMALL_CHILD_FRACTION * total and _holds_repeated_blocks(child))

    def visit(prefix, module, inside_backbone):
        for name, child in module.named_children():
            full = f"{prefix}{name}"
            count = _param_count(child)
            if count == 0:
                continue
            if isinstance(child, _CONTAINERS) and not list(child.parameters(recurse=False)):
                visit(full + ".", child, inside_backbone=False)
            elif is_backbone(child, count):
                visit(full + ".", child, inside_backbone=True)
            elif not inside_backbone and count >= _SMALL_CHILD_FRACTION * total:
                chosen.append((full, child))
            # else: the root unit holds it (a small child; or, inside a backbone, a part beside its blocks)

    visit("", model, inside_backbone=False)
    return chosen


def split_into_units(model, units="auto"):
    """The model's units, the root unit last. `units`: "auto", a list of
    module classes (or class names; [] keeps everything in the root unit),
    or a callable (name, module) -> bool."""
    if isinstance(units, str) and units == "auto":
        picked = _auto_unit_modules(model)
    else:
        names = set()
        if callable(units) and not isinstance(units, (list, tuple, type)):
            wants = units
        else:
            kinds = list(units) if isinstance(units, (list, tuple)) else [units]
            for i, kind in enumerate(kinds):
                if not isinstance(kind, (str, type)):
                    raise TypeError(f"units: {kind!r} (entry {i}) is a {type(kind).__name__}; give \"auto\", module "
                                    f"classes or their names, or a callable (name, module) -> bool")
            names = {k if isinstance(k, str) else k.__name__ for k in kinds}

            def wants(name, module):
                return type(module).__name__ in names

        picked = []
        for name, module in model.named_modules():
            if name and wants(name, module) and not any(name.startswith(c + ".") for c, _ in picked):
                picked.append((name, module))
        if names and not picked:  # a misspelled class, most likely (units=[] or a callable may pick none)
            raise ValueError(f"units={sorted(names)} matches no submodule of {type(model).__name__}")
    picked = _keep_leaf_modules_whole(model, picked)
    return [Unit(name, module) for name, module in picked] + [Unit("", model, is_root=True)]


def _keep_leaf_modules_whole(model, picked):
    """Note [Leaf modules]
    A module flagged as a leaf (DeepSpeed's `_z3_leaf`, set by
    strata.torch.utils.set_z3_leaf_modules) is acquired whole: units picked
    inside it give way to it, and one the picked units do not already hold
    becomes a unit of its own. A leaf model keeps everything in the root."""
    if getattr(model, "_z3_leaf", False):
        return []
    leaves = [(name, m) for name, m in model.named_modules() if name and getattr(m, "_z3_leaf", False)]
    if not leaves:
        return picked
    inside = lambda name, outer: name.startswith(outer + ".")
    outermost = [(name, m) for name, m in leaves if not any(inside(name, other) for other, _ in leaves)]
    kept = [(name, m) for name, m in picked if not any(inside(name, leaf) or name == leaf for leaf, _ in outermost)]
    added = [(name, m) for name, m in outermost if not any(inside(name, unit) for unit, _ in kept)]
    order = {name: i for i, (name, _) in enumerate(model.named_modules())}
    return sorted(kept + added, key=lambda unit: order[unit[0]])


def _owner_of(name, units):
    for unit in units[:-1]:
        if name.startswith(unit.name + "."):
            return unit
    return units[-1]


def _dtype_suffix(dtype):
    return str(dtype).replace("torch.", "")


def plan_layers(model, units, layer_dtype=None):
    """Engine layers for `units` (split_into_units), in unit order. Every
    parameter of the model is in exactly one layer. `layer_dtype(param)`
    gives the dtype its layer keeps it in (default: the parameter's)."""
    layer_dtype = layer_dtype or (lambda p: p.dtype)
    owner = {}
    kinds = {}  # (unit name, dtype, trainable) -> LayerPlan
    for name, p in model.named_parameters():  # drops tied duplicates: the first name owns the weight
        if not p.is_floating_point():
            raise TypeError(f"parameter '{name}' has dtype {p.dtype}: the engine trains floating-point parameters")
        unit = _owner_of(name, units)
        dtype = layer_dtype(p)
        key = (unit.name, dtype, p.requires_grad)
        if key not in kinds:
            base = unit.name or "root"
            kinds[key] = LayerPlan(base, unit, dtype, p.requires_grad)
        kinds[key].params.append((name, p))
        owner[p] = kinds[key]
    plans = []
    for unit in units:
        mine = [plan for (uname, _, _), plan in kinds.items() if uname == unit.name]
        mixed_dtypes = len({plan.dtype for plan in mine}) > 1
        for plan in mine:  # a unit of mixed kinds: one layer per kind, named so
            if mixed_dtypes:
                plan.name += f".{_dtype_suffix(plan.dtype)}"
            if not plan.trainable:
                plan.name += ".frozen"
            plan.index = len(plans)
            plans.append(plan)
            unit.layers.append(plan.index)
    for unit in units:
        used = list(unit.layers)
        # Shared weights this unit uses but does not own. The root unit uses the parameters of the modules no
        # other unit holds: e.g. a masked-LM head (root) tied to a word embedding inside an embeddings unit.
        for p in (_root_held_parameters(model, units) if unit.is_root else unit.module.parameters()):
            index = owner[p].index
            if index not in used:
                used.append(index)
        unit.uses = used
    return plans, owner


def _root_held_parameters(model, units):
    """The parameters of every module outside the non-root units (each
    module once, by identity; a tied parameter appears under each of its
    modules)."""
    unit_modules = {id(unit.module) for unit in units if not unit.is_root}
    seen, found = set(), []

    def visit(module):
        if id(module) in seen or id(module) in unit_modules:
            return
        seen.add(id(module))
        for p in module._parameters.values():
            if p is not None:
                found.append(p)
        for child in module._modules.values():
            if child is not None:
                visit(child)

    visit(model)
    return found
