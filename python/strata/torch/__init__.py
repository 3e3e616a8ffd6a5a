"""strata.torch: train a PyTorch nn.Module through the Strata engine with
DeepSpeed's API.

    import strata.torch as st
    engine, optimizer, _, scheduler = st.initialize(model=model, model_parameters=model.parameters(),
                                                    config="ds.json")
    for x, y in loader:
        loss = loss_fn(engine(x), y)
        engine.backward(loss)
        engine.step()            # a no-op off the gradient accumulation boundary

The engine owns every parameter, gradient and optimizer byte (ZeRO stages
0-3, optimizer state and stage-3 parameters on the device, in pinned host
memory or on NVMe, as the config says); the module's parameters are bound
to its memory unit by unit while torch runs them (strata/_torch_engine.py,
Note [Hooks per unit]). This build: the cpu device; one process, or one
rank per process under `mpirun -np N python train.py` (data parallel: each
rank runs its own micro-batches, the engine reduces the gradients; rank 0's
initial values are broadcast). The guide: docs/torch.md.

(This module is strata.torch; inside the strata package `import torch` is
PyTorch, as imports are absolute.)
"""

import copy
import json
import os
import warnings

try:
    import torch
except ImportError as e:  # what to install, not a traceback from deep inside an import
    if e.name != "torch":
        raise  # torch is there but failed to import: its own error says why
    raise ImportError("strata.torch needs PyTorch: pip install torch (or, on Debian, apt-get install "
                      "python3-torch and use /usr/bin/python3)") from e

from .. import config as strata_config
from .._torch_engine import StrataEngine
from .._torch_gathered import GatheredParameters, register_engine
from .._safetensors import Checkpoint as SafetensorsCheckpoint
from .._torch_init import (checkpoint_keys, first_holders, give_back_freed_memory, has_meta_parameters, init,
                           load_unit, materialize_unit, swap_meta_parameters)
from .._torch_optimizer import StrataOptimizer, optimizer_section_from_client
from .._torch_units import plan_layers, split_into_units
from .. import _native
from . import _launcher, _porting
from .comm import init_distributed
from .._sizes import parse_size
from .._torch_device import choose_device, device_budget, move_buffers
from ..engine import Engine, _device_memory, describe_layers
from .. import _torch_guards as _guards
from .. import _torch_checkpointing as _checkpointing
from .._checks import check_json
from ..errors import FailedPrecondition, InvalidArgument, ResourceExhausted, Unsupported

__all__ = ["initialize", "init", "init_distributed", "GatheredParameters", "StrataEngine", "StrataOptimizer",
           "split_into_units"]

_PRECISION_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def _warn_nvme_without_pipelines(resolved):
    """The optimizer state on NVMe without both of DeepSpeed's pipeline keys keeps its reads and writes on the
    step's path: the engine's note (what strata train prints), as a warning."""
    offload = resolved["zero_optimization"]["offload_optimizer"]
    note = _native.nvme_pipelines_note(offload["device"], offload["pipeline_read"], offload["pipeline_write"])
    if note:
        warnings.warn(note, RuntimeWarning, stacklevel=3)


def initialize(args=None, model=None, optimizer=None, model_parameters=None, training_data=None, lr_scheduler=None,
               mpu=None, dist_init_required=None, collate_fn=None, config=None, config_params=None, units="auto",
               device_memory=0, auto_values=None, fit=None, initial_weights=None, job_name=None):
    """deepspeed.initialize's signature and 4-tuple: (engine, optimizer,
    dataloader or None, lr_scheduler or None).

    config (or config_params, or args.deepspeed_config): the JSON file or
    dict `strata train` takes, checked strictly. optimizer: None (the
    config's "optimizer" section), or a client torch.optim.AdamW / Adam /
    Adagrad or strata.optim.CPUAdam / CPUAdagrad / CPULion, whose
    hyper-parameters and param_groups the engine takes. model_parameters:
    the parameters or param groups to train (default: every parameter that
    requires grad); a group's weight_decay and lr become its tensors'.
    lr_scheduler: a scheduler on the returned (or client) optimizer, or a
    callable taking the optimizer. units: "auto", module classes, or a
    callable (name, module) -> bool (strata/_torch_units.py).

    Hugging Face's "auto" values (Note [Resolving "auto"]): the bucket
    sizes from the model's config.hidden_size, the optimizer's from a client
    optimizer, the rest from auto_values ({"dotted.key": value}, what the
    Trainer fills in from its arguments); one left over is an error naming it.

    fit: {"device_memory": cap, "host_memory": cap, "nvme_path": DIR (optional),
    "seq": tokens per sample (optional, for ranking), "optimizer_states":
    ["fp32", "int8"] (optional: the storages of Adam's moments the search
    may choose, strata.optimizer_state_dtype; default the config's own), "grad_dtypes": ["fp32", "bf16"]
    (optional: the gradient accumulation dtypes it may choose, data_types.grad_accum_dtype; default the
    config's own)}: the config fitted to
    those caps before the engine is made (Note [Config fit]: `strata plan
    --fit`'s search): the fastest placement and knobs whose memory plan fits,
    each changed key printed with its reason (engine.fit has them); no fit
    is ResourceExhausted saying what is missing and the smallest change.

    initial_weights: a safetensors checkpoint (a folder with
    model.safetensors or model.safetensors.index.json, as export_hf and
    save_pretrained write, or one .safetensors file) whose tensors become the
    initial values, read a tensor at a time as each unit is handed in; with
    a model built under st.init, the model never exists whole (Note
    [Construction on meta]). Every parameter needs a tensor of its shape
    (a tied weight under any of its names; a Hugging Face model's keys with
    or without its base_model_prefix).

    job_name: the name of the engine's NVMe swap folders
    (<nvme_path>/strata-<job_name>*; default train-<process id>): two
    engines alive at once on one nvme_path need names of their own."""
    if model is None or not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, not {type(model).__name__}")
    if mpu is not None:
        raise Unsupported("mpu (model parallelism) is not supported: strata.torch is data-parallel ZeRO only")
    config = _config_argument(args, config, config_params)
    _porting.note_local_rank(args)
    for name, b in model.named_buffers():
        if b.device.type == "meta":  # torch.device("meta") loses buffer values no rule can give back
            raise InvalidArgument(f"buffer '{name}' is on the meta device: its value (computed by its module's "
                                  f"constructor) is lost there. Build the model under st.init instead of "
                                  f"torch.device('meta'): st.init puts only the parameters on meta")
    checkpoint = keys = None
    if initial_weights is not None:  # every key and shape checked before anything is made
        checkpoint = SafetensorsCheckpoint(initial_weights)
        keys = checkpoint_keys(model, checkpoint)
    world = _launcher_world()
    raw, engine_config, resolved = _config_for_engine(config, model, optimizer, auto_values, world)
    device = choose_device(resolved, model)  # Note [The device strata.torch trains on]
    move_buffers(model, device)
    # (Before the engine exists: a refusal leaves the model as it was.)
    facade, scheduler, engine_config, resolved = _optimizer_and_schedule(
        model, optimizer, model_parameters, lr_scheduler, raw, engine_config, resolved, world)
    hyper = {}
    for group, (decay, lr0) in zip(facade.param_groups, facade._created):
        for p in group["params"]:
            hyper[p] = (float(decay), float(lr0) / facade.base_lr)

    layer_dtype = _layer_dtype_rule(resolved)
    units_found = split_into_units(model, units)
    plans, _ = plan_layers(model, units_found, layer_dtype)
    layers = [(plan.name, plan.specs(lambda p: hyper[p])) for plan in plans]
    fitted = None
    if fit is not None:
        fitted = _fit(engine_config, layers, fit, world)
        engine_config = json.loads(fitted["best"]["config_json"])
        resolved = strata_config.load(engine_config, world_size=world)
        device_memory = device_memory or fitted["device_bytes"]
    _warn_nvme_without_pipelines(resolved)
    job_name = _guards.check_job_name(job_name)
    _guards.refuse_shared_swap_folders(resolved, job_name)
    _guards.warn_stale_swap_folders(resolved)
    # The launcher's job joined (Note [Launchers]): mpirun's, torch.distributed's (made from a PyTorch
    # launcher's environment when needed, bounded by strata.wait_timeout_s), or one process.
    backend = _launcher.join_launcher_job(resolved["strata"]["wait_timeout_s"])
    # Note [One device, two allocators]: on a GPU without a cap given, the free memory less torch's reserve.
    device_memory, split = device_budget(device, _device_memory(device_memory) or resolved["strata"]["device_memory"])
    try:
        native = Engine(engine_config, layers, device_memory=device_memory, backend=backend, job_name=job_name,
                        device=device)
    except FailedPrecondition as error:  # a swap folder in use: how strata.torch picks another job name
        raise _guards.job_name_hint(resolved, job_name, error) from None
    if split is not None and native.rank == 0:
        print(f"strata.torch: {device.torch_device}: {split}", flush=True)
    _hand_in_initial_values(native, model, units_found, plans, facade, device, checkpoint, keys)

    engine = StrataEngine(model, units_found, plans, native, facade, scheduler, resolved, device)
    engine.fit = fitted
    if fitted is not None and native.rank == 0:
        _print_fit(fitted)
    facade._engine = engine
    register_engine(engine)
    engine._job_name, engine._nvme_paths = job_name, _guards.nvme_paths(resolved)
    _guards.track(engine)  # closed at the interpreter's exit (Note [Saves finished at exit])
    _porting.present_parameters(engine)  # Note [Parameters after initialize]
    _checkpointing.configure_from_config(resolved)  # Note [Where the checkpointing settings come from]
    loader = None
    if training_data is not None:  # Note [The training_data loader]
        loader = _porting.training_loader(training_data, resolved["train_micro_batch_size_per_gpu"], collate_fn,
                                          native.world_size, native.rank, raw.get("dataloader_drop_last", False))
    return engine, facade, loader, scheduler


def _hand_in_initial_values(native, model, units_found, plans, facade, device, checkpoint, keys):
    """Every unit's initial values into the engine, unit by unit, then the module's own copy dropped (its
    parameters are bound to the engine's memory when their unit runs). A model built under st.init has its
    parameters on meta: CPU ones take their places (no pages yet), and each unit's values are made (or read
    from `checkpoint`) just before they are handed in (Note [Construction on meta])."""
    built_on_meta = has_meta_parameters(model)
    if built_on_meta:
        mapping, shapes = swap_meta_parameters(model)
        _follow_swap(mapping, facade, plans)
        if keys is not None:  # keyed by the parameters that replaced the meta ones
            keys.update({id(new): keys[id(old)] for old, new in mapping.items()})
        names = {p: n for n, p in model.named_parameters()}
        holders = first_holders(model)
    made_here = built_on_meta or checkpoint is not None
    for unit in units_found:
        unit_plans = [plans[index] for index in unit.layers]
        unit_params = [p for plan in unit_plans for _, p in plan.params]
        unit_on_gpu = any(p.device.type == "cuda" for p in unit_params)
        # Values made (or read) here go straight into the engine's packed layout where the layer is fp32
        # like the module: handed in without a packing copy.
        packs = _packed_homes(native, unit_plans) if made_here else {}
        if checkpoint is not None:
            load_unit(unit_params, keys, checkpoint)
        elif built_on_meta:
            materialize_unit(model, unit, units_found, unit_params, shapes, names, holders)
        for plan in unit_plans:
            if plan.index in packs:
                native.put_initial_packed(plan.index, _packed_values(plan, *packs.pop(plan.index)))
            else:
                native.put_initial_layer(plan.index, [p.detach() for _, p in plan.params])
            for _, p in plan.params:
                p.data = device.placeholder(plan.dtype)
        if made_here:
            give_back_freed_memory()
        if unit_on_gpu:
            torch.cuda.empty_cache()  # a model moved to the GPU before initialize: the unit's memory to the engine


def _optimizer_and_schedule(model, client_optimizer, model_parameters, lr_scheduler, raw, engine_config, resolved,
                            world):
    """(the optimizer the caller steps, its lr schedule or None, the engine's config, the resolved config): the
    parameter groups with their hyperparameters checked, a client schedule taken as it is, or (a DeepSpeed
    schedule) moved into the config for the engine to run, or the config's own schedule (DeepSpeed returns it
    too)."""
    if lr_scheduler is not None and resolved["scheduler"]["type"] != "none":
        raise ValueError(f"both a client lr_scheduler ({type(lr_scheduler).__name__}) and the config's "
                         f"\"scheduler\" section are given: drop one of them")
    if _porting.schedule_into_config(lr_scheduler, raw, resolved):  # a DeepSpeed schedule: the engine runs it
        engine_config = raw
        resolved = strata_config.load(engine_config, world_size=world)
    defaults = _optimizer_defaults(resolved)
    groups, shared = _param_groups(model, client_optimizer, model_parameters, defaults)
    facade = StrataOptimizer(groups, defaults, engine=None, shared_groups=shared)
    _check_group_hypers(facade, defaults)
    scheduler = lr_scheduler
    if scheduler is not None and not hasattr(scheduler, "step") and callable(scheduler):
        scheduler = scheduler(facade)  # DeepSpeed's form: a callable taking the optimizer
        if _porting.schedule_into_config(scheduler, raw, resolved):
            engine_config = raw
            resolved = strata_config.load(engine_config, world_size=world)
    if scheduler is None:
        scheduler = _porting.config_schedule(facade, resolved)
    return facade, scheduler, engine_config, resolved


def _config_for_engine(config, model, client_optimizer, auto_values, world):
    """(the raw config as a dict, the config the engine is made with: the caller's own or that dict, the
    resolved config): a client optimizer becomes the config's "optimizer" section, "auto" values are filled
    in (Note [Resolving "auto"]), and the whole is checked strictly (InvalidArgument naming every bad key; the
    batch keys against the launcher's world, the engine's ranks)."""
    raw = _raw_config(config)
    engine_config = config
    if client_optimizer is not None:
        if raw.get("optimizer") is not None:
            raise ValueError(f"both a client optimizer ({type(client_optimizer).__name__}) and the config's "
                             f"\"optimizer\" section are given: drop one of them")
        raw["optimizer"] = optimizer_section_from_client(client_optimizer)
        engine_config = raw
    if _hf_autos(raw) or auto_values:
        raw = _resolve_autos(raw, model, auto_values, world)
        engine_config = raw
    return raw, engine_config, strata_config.load(engine_config, world_size=world)


def _packed_homes(native, unit_plans):
    """{layer: (packed buffer, views)} for the unit's all-fp32 layers whose
    parameters are fp32: each parameter's memory becomes its view of the
    buffer the engine takes as is (Engine.packed_views)."""
    homes = {}
    for plan in unit_plans:
        if any(p.dtype != torch.float32 for _, p in plan.params):
            continue
        found = native.packed_views(plan.index)
        if found is None:
            continue
        packed, views = found
        with torch.no_grad():
            for name, p in plan.params:
                p.data = views[name]
        homes[plan.index] = (packed, views)
    return homes


def _packed_values(plan, packed, views):
    """The packed buffer with the plan's current values: a rule that
    replaced a parameter's memory instead of writing into it is copied in."""
    with torch.no_grad():
        for name, p in plan.params:
            view = views[name]
            if p.data_ptr() != view.data_ptr() or p.shape != view.shape:
                view.copy_(p.detach())
    return packed


def _follow_swap(mapping, facade, plans):
    """Points the optimizer's groups (a client's shared ones included) and
    the layer plans at the CPU parameters that replaced the meta ones."""
    for group in facade.param_groups:
        group["params"] = [mapping.get(p, p) for p in group["params"]]
    for plan in plans:
        plan.params = [(name, mapping.get(p, p)) for name, p in plan.params]


def _config_argument(args, config, config_params):
    given = [c for c in (config, config_params) if c is not None]
    if args is not None and getattr(args, "deepspeed_config", None) is not None:
        given.append(args.deepspeed_config)
    if len(given) != 1:
        raise ValueError("give the config once: config=path-or-dict (or config_params, or args.deepspeed_config); "
                         f"{len(given)} given")
    return given[0]


_FIT_KEYS = ("device_memory", "host_memory", "nvme_path", "seq", "optimizer_states", "grad_dtypes")


def _fit(config, layers, fit, world):
    """The search of Note [Config fit] for these layers: the native result,
    with the device cap; no fit raises ResourceExhausted."""
    if not isinstance(fit, dict):
        raise TypeError(f"fit must be a dict such as {{'device_memory': '8GiB', 'host_memory': '32GiB'}}, not "
                        f"{type(fit).__name__}")
    unknown = sorted(set(fit) - set(_FIT_KEYS))
    if unknown:
        raise ValueError(f"fit: unknown key(s) {unknown}; the keys are {', '.join(_FIT_KEYS)}")
    for key in ("device_memory", "host_memory"):
        if key not in fit:
            raise ValueError(f"fit needs '{key}' (the cap to fit under, e.g. \"8GiB\")")
    device_bytes = parse_size(fit["device_memory"], "fit['device_memory']")
    host_bytes = parse_size(fit["host_memory"], "fit['host_memory']")
    nvme_path = os.fspath(fit.get("nvme_path") or "")
    if nvme_path and not os.path.isdir(nvme_path):
        raise ValueError(f"fit['nvme_path'] '{nvme_path}' is not a folder")
    seq = fit.get("seq", 512)
    if isinstance(seq, bool) or not isinstance(seq, int) or not 1 <= seq <= 2 ** 24:
        raise ValueError(f"fit['seq'] {seq!r} is not a number of tokens in 1..16777216")
    states = fit.get("optimizer_states", [])
    if isinstance(states, str) or not all(isinstance(s, str) for s in states):
        raise ValueError(f"fit['optimizer_states'] {states!r} is not a list of names such as [\"fp32\", \"int8\"]")
    grads = fit.get("grad_dtypes", [])
    if isinstance(grads, str) or not all(isinstance(g, str) for g in grads):
        raise ValueError(f"fit['grad_dtypes'] {grads!r} is not a list of names such as [\"fp32\", \"bf16\"]")
    path, text = (None, json.dumps(config)) if isinstance(config, dict) else (os.fspath(config), None)
    result = _native.fit_config(path, text, describe_layers(layers), device_bytes, host_bytes, nvme_path, world, seq,
                                list(states), list(grads))
    if not result["fits"]:
        hint = "; ".join(result["suggestions"]) or "a larger cap"
        raise ResourceExhausted(f"no config fits device_memory {fit['device_memory']} and host_memory "
                                f"{fit['host_memory']}: {result['missing']}; what would fit: {hint}")
    result["device_bytes"] = device_bytes
    return result


def _print_fit(fitted):
    best = fitted["best"]
    print(f"strata.torch fit: {best['label']} ({best['bound']})")
    for change in best["changes"]:
        print(f"  {change['key']}: {change['before']} -> {change['after']}: {change['reason']}")
    for other in fitted["runners_up"]:
        print(f"  runner-up: {other['label']} ({other['bound']})")


def _launcher_world():
    """The world size the launcher gave this process (mpirun's, torch.distributed's group's, or a PyTorch
    launcher's WORLD_SIZE; 1 without one): the engine's ranks (Note [Launchers]), known before it exists."""
    return _launcher.launcher_world()


def _raw_config(config):
    if isinstance(config, dict):
        check_json(config, "the config dict")  # a NaN or a nesting too deep named, before deepcopy recurses
        return copy.deepcopy(config)
    if isinstance(config, (str, os.PathLike)):
        strata_config.load(config)  # a missing or invalid file: the checker's message, naming it
        with open(config) as f:
            return json.load(f)
    raise TypeError(f"config must be a path or a dict, not {type(config).__name__}")


# Note [Resolving "auto"]
# Hugging Face's DeepSpeed configs leave keys "auto" for the Trainer to fill.
# strata.torch fills them as the Trainer does, from what it knows:
#   - zero_optimization.reduce_bucket_size, stage3_prefetch_bucket_size and
#     stage3_param_persistence_threshold from the model's hidden size
#     (config.hidden_size, or the largest of config.hidden_sizes): h*h,
#     0.9*h*h and 10*h, computed by the config checker (hidden_size);
#   - the optimizer's from a client optimizer (its section replaces the config's);
#   - any key from auto_values, {"dotted.key": value}: the batch keys,
#     gradient_clipping, bf16/fp16 "enabled", the scheduler's parameters, as a
#     Trainer passes them from its TrainingArguments;
#   - train_batch_size, train_micro_batch_size_per_gpu or
#     gradient_accumulation_steps from the other two and the world size.
# Whatever is still "auto" is an error naming every such key (DeepSpeed's
# own defaults would silently train something else). The engine gets the
# config with the numbers written in. ("auto" is a value of its own in the
# aio and strata sections: not Hugging Face's placeholder.)
_HIDDEN_SIZE_KEYS = ("zero_optimization.reduce_bucket_size", "zero_optimization.stage3_prefetch_bucket_size",
                     "zero_optimization.stage3_param_persistence_threshold")


def _hf_autos(raw):
    return [k for k in _auto_keys(raw) if not k.startswith(("aio.", "strata."))]


def _hidden_size(model):
    config = getattr(model, "config", None)
    hidden = getattr(config, "hidden_size", None)
    if isinstance(hidden, int) and not isinstance(hidden, bool) and hidden > 0:
        return hidden
    sizes = getattr(config, "hidden_sizes", None)
    if isinstance(sizes, (list, tuple)) and sizes and all(isinstance(h, int) and h > 0 for h in sizes):
        return max(sizes)
    return None


def _resolve_autos(raw, model, auto_values, world):
    """raw with every Hugging Face "auto" replaced by its value (Note [Resolving "auto"])."""
    raw = copy.deepcopy(raw)
    autos = _hf_autos(raw)
    for key, value in (auto_values or {}).items():
        if key not in autos:
            raise ValueError(f"auto_values['{key}']: the config does not leave {key} \"auto\" (keys it leaves "
                             f"\"auto\": {', '.join(autos) or 'none'})")
        if value == "auto":
            raise ValueError(f"auto_values['{key}'] is \"auto\" again: give its value")
        _set_path(raw, key, value)
    autos = _hf_autos(raw)
    hidden = _hidden_size(model)
    by_hidden = [k for k in autos if k in _HIDDEN_SIZE_KEYS]
    if by_hidden and hidden is None:
        raise Unsupported(f"the config leaves {', '.join(by_hidden)} \"auto\", sized from the model's hidden size, "
                          f"but {type(model).__name__} has no config.hidden_size: write numbers, or pass them in "
                          f"auto_values")
    issues = strata_config.check(raw, world_size=world, hidden_size=hidden)
    left = [i.path for i in issues if "\"auto\" is unresolved" in i.message]
    if left:
        raise Unsupported(f"the config leaves {', '.join(left)} \"auto\" and nothing here gives {'it' if len(left) == 1 else 'them'} "
                          f"a value: write numbers, pass auto_values={{'{left[0]}': ...}} (what Hugging Face's "
                          f"Trainer fills in), or give a client optimizer for the optimizer's")
    resolved = strata_config.load(raw, world_size=world, hidden_size=hidden)
    for key in autos:
        try:
            value = _get_path(resolved, key)
        except KeyError:
            raise Unsupported(f"the config leaves {key} \"auto\": write its value (strata.torch could not find "
                              f"the value it resolved to)") from None
        _set_path(raw, key, value)
    return raw


def _path_parts(key):
    return key.split(".")


def _get_path(tree, key):
    for part in _path_parts(key):
        if not isinstance(tree, dict) or part not in tree:
            raise KeyError(key)
        tree = tree[part]
    return tree


def _set_path(tree, key, value):
    parts = _path_parts(key)
    for part in parts[:-1]:
        tree = tree[part]
    tree[parts[-1]] = value


def _auto_keys(value, path=""):
    """The dotted keys whose value is "auto"."""
    if value == "auto":
        return [path]
    if isinstance(value, dict):
        return [k for key, v in value.items() for k in _auto_keys(v, f"{path}.{key}" if path else key)]
    if isinstance(value, list):
        return [k for i, v in enumerate(value) for k in _auto_keys(v, f"{path}[{i}]")]
    return []


def _optimizer_defaults(resolved):
    params = resolved["optimizer"]["params"]
    defaults = {"lr": params["lr"], "weight_decay": params.get("weight_decay", 0.0)}
    if "betas" in params:
        defaults["betas"] = tuple(params["betas"])
    if "eps" in params:
        defaults["eps"] = params["eps"]
    return defaults


def _param_groups(model, client, model_parameters, defaults):
    """The groups the facade starts from, and the client's group list to share (or None)."""
    names = {p: n for n, p in model.named_parameters()}
    if client is not None:
        groups, shared = client.param_groups, client.param_groups
    elif model_parameters is None:
        groups, shared = [{"params": [p for p in model.parameters() if p.requires_grad]}], None
    else:
        listed = list(model_parameters)
        if listed and isinstance(listed[0], dict):
            groups = [dict(g) for g in listed]
        else:
            groups = [{"params": listed}]
        shared = None
    seen = set()
    for i, g in enumerate(groups):
        params = list(g["params"]) if not isinstance(g["params"], torch.Tensor) else [g["params"]]
        for p in params:
            if p not in names:
                raise ValueError(f"param group {i} holds a tensor of shape {tuple(p.shape)} that is not a parameter "
                                 f"of the model")
            if p in seen:
                raise ValueError(f"parameter '{names[p]}' is in two param groups")
            seen.add(p)
        if shared is None:
            g["params"] = params
    for p, name in names.items():
        if p.requires_grad and p not in seen:
            raise ValueError(f"parameter '{name}' requires grad but is in no param group: add it to "
                             f"model_parameters (or the optimizer), or set requires_grad=False to freeze it")
    return groups, shared


def _check_group_hypers(facade, defaults):
    for i, g in enumerate(facade.param_groups):
        for key in ("betas", "eps"):
            if key not in defaults or key not in g:
                continue
            value = tuple(g[key]) if key == "betas" else g[key]
            if value != defaults[key]:
                raise Unsupported(f"param_groups[{i}]['{key}'] = {g[key]} differs from the optimizer's "
                                  f"{defaults[key]}: the engine has one {key} for every tensor (per-tensor "
                                  f"weight_decay and lr only)")


def _layer_dtype_rule(resolved):
    """DeepSpeed casts the module to bf16 / fp16 when the config enables it."""
    for key, dtype in _PRECISION_DTYPES.items():
        if resolved[key]["enabled"]:
            return lambda p, dtype=dtype: dtype
    return lambda p: p.dtype


# -- DeepSpeed's names (docs/torch.md, "Porting a DeepSpeed script") ---------------------------------
from . import accelerator, checkpointing, ops, runtime, utils, zero  # noqa: E402  (deepspeed.<name> after `import ... as deepspeed`)
from ._names import install_module_finder, refusing_getattr  # noqa: E402
from ._porting import add_config_arguments  # noqa: E402
from .accelerator import get_accelerator  # noqa: E402
from .utils import log_dist, logger  # noqa: E402

__all__ += ["add_config_arguments", "get_accelerator", "log_dist", "logger", "accelerator", "checkpointing", "ops",
            "runtime", "utils", "zero"]
install_module_finder()  # Note [DeepSpeed names not provided]
__getattr__ = refusing_getattr(__name__, {
    "DeepSpeedEngine": "the engine is strata.torch.StrataEngine (what strata.torch.initialize returns)",
    "DeepSpeedConfig": "strata.config.load(config) checks and resolves a DeepSpeed config",
    "DeepSpeedConfigError": "a bad config raises strata.InvalidArgument naming every bad key",
    "DeepSpeedOptimizer": "the optimizer is strata.torch.StrataOptimizer (what strata.torch.initialize returns)",
    "DeepSpeedDataLoader": "strata.torch.initialize(training_data=dataset) returns DeepSpeed's loader third",
    "init_inference": "DeepSpeed's inference engine is not supported: run the trained module under "
                      "torch.no_grad()",
    "default_inference_config": "DeepSpeed's inference engine is not supported",
    "InferenceEngine": "DeepSpeed's inference engine is not supported",
    "PipelineModule": "pipeline parallelism is not supported: strata.torch is data-parallel ZeRO",
    "PipelineEngine": "pipeline parallelism is not supported: strata.torch is data-parallel ZeRO",
    "tp_model_init": "tensor parallelism is not supported: strata.torch is data-parallel ZeRO",
    "add_tuning_arguments": "the lr schedule's parameters go in the config's \"scheduler\" section",
    "OnDevice": "build the model under strata.torch.zero.Init() (strata.torch.init)",
    "version": "strata.__version__ is Strata's version",
    "DeepSpeedTransformerLayer": "DeepSpeed's fused transformer kernels are not supported",
    "DeepSpeedTransformerConfig": "DeepSpeed's fused transformer kernels are not supported",
    "module_inject": "kernel injection is not supported: strata.torch runs the model's own modules",
    "is_compile_supported": "torch.compile of the engine's module is not supported",
}, deepspeed_namespace="deepspeed", lazy_modules=("comm",))
