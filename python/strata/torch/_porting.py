"""strata.torch.initialize's DeepSpeed behaviours that a ported script
relies on (docs/torch.md, "Porting a DeepSpeed script"): the parameters
after initialize, the training_data loader, a DeepSpeed schedule object
run by the engine, and `--deepspeed` / `--deepspeed_config`."""

import torch

from ..errors import Unsupported
from .accelerator import local_rank
from .runtime import lr_schedules
from .zero import ZeroParamStatus

__all__ = ["add_config_arguments", "present_parameters", "training_loader", "schedule_into_config",
           "config_schedule", "note_local_rank"]


def add_config_arguments(parser):
    """DeepSpeed's add_config_arguments: a "DeepSpeed" group on an
    argparse parser with --deepspeed (a flag for the script's own use) and
    --deepspeed_config PATH (the config strata.torch.initialize(args=args)
    reads). Returns the parser."""
    if not hasattr(parser, "add_argument_group"):
        raise TypeError(f"add_config_arguments(parser): an argparse.ArgumentParser, not {type(parser).__name__}")
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations (strata.torch)")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="a flag for the script's own use (strata.torch reads only --deepspeed_config)")
    group.add_argument("--deepspeed_config", default=None, type=str,
                       help="the DeepSpeed JSON config strata.torch.initialize(args=...) trains with")
    return parser


def note_local_rank(args):
    """DeepSpeed's initialize writes the launcher's local rank into args.local_rank where the script declared
    one (scripts add --local_rank for the launcher)."""
    if args is not None and hasattr(args, "local_rank"):
        args.local_rank = local_rank()


def present_parameters(engine):
    """Note [Parameters after initialize]
    As DeepSpeed's: at stages 0-2 every parameter has its full shape right
    after initialize (a script counting sum(p.numel()) gets the model's
    size): each layer is acquired once for an evaluation, which binds its
    parameters to the engine's memory for good (Note [Hooks per unit]). At
    stage 3 the parameters are empty placeholders until their unit's first
    acquire, as DeepSpeed's partitioned ones, and carry DeepSpeed's
    attributes: ds_numel and ds_shape (the full size and shape), ds_id (a
    number per parameter), ds_status (strata.torch.zero.ZeroParamStatus,
    AVAILABLE while bound) and ds_persist, so `p.ds_numel if hasattr(p,
    "ds_id") else p.numel()` counts the model. A layer the engine keeps whole
    (fewer elements than stage3_param_persistence_threshold: ds_persist
    True) stays bound and AVAILABLE from its first acquire on, as DeepSpeed
    keeps a persistent parameter gathered; the others are placeholders
    again after each release."""
    if engine._stage < 3:
        native = engine._engine
        native.begin_evaluation()
        try:
            for index in range(len(engine._layers)):
                engine._acquire(index, "eval")
                engine._release(index, "eval")
        finally:
            native.finish_evaluation(0.0, 1)
        return
    engine._ds_status = (ZeroParamStatus.AVAILABLE, ZeroParamStatus.NOT_AVAILABLE)
    number = 0
    for index, layer in enumerate(engine._layers):
        for (_, shape, *_), (_, p) in zip(engine._engine.layout(index), layer.plan.params):
            p.ds_shape = torch.Size(shape)
            p.ds_numel = p.ds_shape.numel()
            p.ds_id = number
            p.ds_status = ZeroParamStatus.NOT_AVAILABLE
            p.ds_persist = layer.kept_whole
            number += 1


def training_loader(training_data, batch_size, collate_fn, world_size, rank, drop_last):
    """Note [The training_data loader]
    DeepSpeed's loader for initialize(training_data=...): a
    DistributedSampler over the ranks with torch's defaults (shuffled, seed
    0, the last samples repeated to fill every rank's share), the same
    order every epoch (DeepSpeed never calls set_epoch), micro-batches of
    train_micro_batch_size_per_gpu, the config's dataloader_drop_last. So a
    port draws DeepSpeed's samples in DeepSpeed's order. (DeepSpeed also
    starts two worker processes and pins memory: neither changes the
    order; here the batches are read in the training process.)"""
    if not isinstance(drop_last, bool):
        raise TypeError(f"the config's dataloader_drop_last is {drop_last!r}: write true or false")
    if isinstance(training_data, torch.utils.data.IterableDataset):
        if world_size > 1:
            raise Unsupported(f"training_data is an IterableDataset, which no sampler can shard across the "
                              f"{world_size} ranks: shard it yourself (each rank reading its own part) and iterate "
                              f"it in your loop")
        return torch.utils.data.DataLoader(training_data, batch_size=batch_size, collate_fn=collate_fn,
                                           drop_last=drop_last)
    if not isinstance(training_data, torch.utils.data.Dataset):
        raise TypeError(f"training_data must be a torch.utils.data.Dataset, not {type(training_data).__name__}")
    sampler = torch.utils.data.DistributedSampler(training_data, num_replicas=world_size, rank=rank)
    return torch.utils.data.DataLoader(training_data, batch_size=batch_size, sampler=sampler, collate_fn=collate_fn,
                                       drop_last=drop_last)


def schedule_into_config(scheduler, raw_config, resolved):
    """A strata.torch.runtime.lr_schedules schedule given to initialize becomes the config's "scheduler"
    section, run by the engine (lr_schedules.adopt_into_config). Returns whether raw_config changed."""
    return lr_schedules.adopt_into_config(scheduler, raw_config, resolved["optimizer"]["params"]["lr"])


def config_schedule(optimizer, resolved):
    """The schedule object of the config's "scheduler" section (DeepSpeed's initialize returns one): it
    reports the lrs the engine runs; None without a section."""
    return lr_schedules.schedule_from_config(optimizer, resolved["scheduler"])
