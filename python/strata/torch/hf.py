"""strata.torch.hf.StrataTrainer: Hugging Face's Trainer with the model
trained through Strata's engine (docs/torch.md, "The Hugging Face Trainer").

    from strata.torch.hf import StrataTrainer
    trainer = StrataTrainer(model=model, args=training_args, train_dataset=ds, strata_config="ds.json")
    trainer.train()
    trainer.save_model("out")          # safetensors + config.json, through the engine

Note [The Trainer through the engine]
A subclass, no monkey-patching: the Trainer's own loop runs (its data
loading, callbacks, logging, lr scheduler, evaluation) and these methods
route the model's training through the engine:
  create_optimizer   strata.torch.initialize(model, config) with the
                     Trainer's optimizer (AdamW with args' lr, betas, eps,
                     weight decay, and its no-decay groups for biases and
                     norms) unless the config has an "optimizer" section,
                     which gets every trainable parameter in one group (as
                     transformers' DeepSpeed path gives it); the config's
                     "auto" values from args as that path fills them (Note
                     [The Trainer's "auto" values]); the returned optimizer
                     is the Trainer's;
  create_scheduler   the Trainer's lr scheduler (args.lr_scheduler_type),
                     which drives the lr the engine steps with; or, when the
                     config has a "scheduler" section, that schedule, run by
                     the engine (the object initialize returns: its step()
                     follows the engine, its get_last_lr() is what the
                     Trainer logs), as transformers' DeepSpeed path does;
  _wrap_model        the StrataEngine, for training and evaluation;
  training_step      engine(...) through compute_loss, engine.backward(loss);
                     off the accumulation boundary engine.step(); at it the
                     Trainer's optimizer.step() is the engine's step;
  save_model         engine.export_hf (safetensors + config.json), also
                     into each checkpoint-N;
  _save_optimizer_and_scheduler
                     engine.save_checkpoint in checkpoint-N/strata (atomic,
                     reshardable) and the lr scheduler's state; the Trainer
                     adds its RNG states and trainer_state.json;
  _load_optimizer_and_scheduler
                     train(resume_from_checkpoint=...): the engine's
                     checkpoint and the scheduler's state (the Trainer then
                     skips the batches already seen and restores its RNGs).
Gradient clipping is the engine's (the config's gradient_clipping or
args.max_grad_norm); the Trainer's own clipping is turned off (its grad
norm would be over no gradients: the engine owns them), and the logged
grad_norm is the engine's.

Note [TrainingArguments(deepspeed=...)]
A job written for DeepSpeed passes its config as
transformers.TrainingArguments(deepspeed=...). transformers acts on that
field as the arguments are made, before any Trainer exists: it needs the
deepspeed package, registers a global that makes from_pretrained build
under deepspeed.zero.Init, and switches accelerate to its DeepSpeed plugin.
So the field cannot be taken over later without patching transformers;
strata.torch.hf.TrainingArguments takes it as it is made instead: the same
dataclass (every field, HfArgumentParser's --deepspeed flag), with the
config moved to its strata_config field, so transformers never turns its
integration on. The port is an import line:
    from transformers import Trainer, TrainingArguments
 -> from strata.torch.hf import Trainer, TrainingArguments
and the Trainer takes the config from the arguments. transformers' own
TrainingArguments with deepspeed set is refused (its DeepSpeed integration
is already on, and a model loaded since may be partitioned by DeepSpeed).
"""

import copy
import dataclasses
import os

import torch

try:
    import transformers
except ImportError as e:  # a clear message, not a traceback deep in an import
    raise ImportError("strata.torch.hf needs Hugging Face transformers (and accelerate): pip install transformers "
                      "accelerate (transformers 4.40.2 with torch 1.13)") from e

from .. import torch as st
from .._checks import printable, short_repr
from ..errors import Unsupported

__all__ = ["StrataTrainer", "Trainer", "TrainingArguments"]


@dataclasses.dataclass
class TrainingArguments(transformers.TrainingArguments):
    """transformers.TrainingArguments whose `deepspeed` (a DeepSpeed JSON
    config: a path or a dict) is the config Strata's engine trains with, kept
    as `strata_config` (Note [TrainingArguments(deepspeed=...)]); `deepspeed`
    itself stays None so transformers does not turn on its DeepSpeed
    integration. Every other field is transformers'."""

    strata_config: object = dataclasses.field(
        default=None, metadata={"help": "The DeepSpeed JSON config (a path or a dict) Strata's engine trains with; "
                                        "--deepspeed gives the same"})

    def __post_init__(self):
        given = self.deepspeed
        if given is not None and self.strata_config is not None and given != self.strata_config:
            raise ValueError(f"TrainingArguments got two configs, deepspeed={_shown(given)} and "
                             f"strata_config={_shown(self.strata_config)}: give one of them (they are the same "
                             f"setting)")
        if given is not None:
            self.strata_config = given
        if isinstance(self.strata_config, str) and not self.strata_config.strip():
            raise ValueError("TrainingArguments(deepspeed=...) is an empty string: give the DeepSpeed JSON config's "
                             "path or a dict")
        self.deepspeed = None  # transformers' DeepSpeed integration stays off: the engine takes the config
        super().__post_init__()


def _shown(config):
    """A config as an error names it: a path as given, a dict by its keys."""
    if isinstance(config, dict):
        return "{" + ", ".join(short_repr(k) for k in list(config)[:6]) + (", ..." if len(config) > 6 else "") + "}"
    if isinstance(config, (str, os.PathLike)):
        return "'" + printable(os.fspath(config))[:200] + "'"
    return short_repr(config)


class StrataTrainer(transformers.Trainer):
    """transformers.Trainer training its model through Strata's engine
    (Note [The Trainer through the engine]). strata_config: the DeepSpeed
    JSON config (path or dict) as for strata.torch.initialize; its "auto"
    values come from the TrainingArguments. strata_units: initialize's units.
    strata_fit: initialize's fit ({"device_memory", "host_memory",
    "nvme_path"}): the config fitted to those caps first.
    strata_initial_weights: initialize's initial_weights (a safetensors
    checkpoint read a tensor at a time; with a model built under st.init
    the model never exists whole). With strata.torch.hf.TrainingArguments
    the config may come from args (deepspeed= or strata_config=) instead
    (Note [TrainingArguments(deepspeed=...)])."""

    def __init__(self, *args, strata_config=None, strata_units="auto", strata_fit=None, strata_initial_weights=None,
                 **kwargs):
        training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
        if getattr(training_args, "deepspeed", None):
            raise Unsupported("transformers.TrainingArguments(deepspeed=...) has turned on transformers' own "
                              "DeepSpeed integration (accelerate's DeepSpeed plugin; from_pretrained under "
                              "deepspeed.zero.Init): make the arguments with strata.torch.hf.TrainingArguments "
                              "(the same fields; its deepspeed= is the engine's config), i.e. import them as "
                              "`from strata.torch.hf import Trainer, TrainingArguments`")
        from_args = getattr(training_args, "strata_config", None)
        if strata_config is not None and from_args is not None and strata_config != from_args:
            raise ValueError(f"StrataTrainer got two configs, strata_config={_shown(strata_config)} and the "
                             f"arguments' {_shown(from_args)} (TrainingArguments' deepspeed=/strata_config=): give "
                             f"one of them")
        strata_config = strata_config if strata_config is not None else from_args
        if strata_config is None:
            raise ValueError("StrataTrainer needs a config: the DeepSpeed JSON config (a path or a dict) the engine "
                             "trains with, as StrataTrainer(strata_config=...) or "
                             "strata.torch.hf.TrainingArguments(deepspeed=...)")
        super().__init__(*args, **kwargs)
        self._strata_config = strata_config
        self._strata_units = strata_units
        self._strata_fit = strata_fit
        self._strata_initial_weights = strata_initial_weights
        self._strata_engine = None
        self._strata_schedule = None         # the config's "scheduler", run by the engine
        self._strata_training_steps = None   # known once train() sizes its loop
        # The engine clips (Note [The Trainer through the engine]): the Trainer's clipping is off, on a copy of
        # the caller's arguments.
        self._strata_max_grad_norm = float(self.args.max_grad_norm or 0.0)
        self.args = copy.copy(self.args)
        self.args.max_grad_norm = 0.0

    @property
    def strata_engine(self):
        """The StrataEngine (None until training or evaluation starts)."""
        return self._strata_engine

    # -- the engine --------------------------------------------------------------------------------
    def _move_model_to_device(self, model, device):
        """Nothing: the engine places the parameters (a model built under
        st.init has them on meta, which torch cannot move)."""

    def create_optimizer(self, *args, **kwargs):
        if self._strata_engine is None:
            self._strata_initialize()
        return self.optimizer

    def _strata_initialize(self):
        raw = st._raw_config(self._strata_config)
        if "gradient_clipping" not in raw:
            raw["gradient_clipping"] = self._strata_max_grad_norm  # not in the config: the Trainer's max_grad_norm
        client = None
        if raw.get("optimizer") is None:
            client = torch.optim.AdamW(self._decay_groups(), lr=self.args.learning_rate,
                                       betas=(self.args.adam_beta1, self.args.adam_beta2), eps=self.args.adam_epsilon,
                                       weight_decay=self.args.weight_decay)
        scheduler = raw.get("scheduler") or {}
        by_steps = [k for k in ("total_num_steps", "warmup_num_steps") if (scheduler.get("params") or {}).get(k) == "auto"]
        if by_steps and self._strata_training_steps is None:
            raise Unsupported(f"the config's scheduler leaves {' and '.join(by_steps)} \"auto\": they come from the "
                              f"run's optimizer steps, known once train() starts; call train() before evaluate() "
                              f"or predict(), or write the numbers")
        # A config "optimizer" gets every trainable parameter in one group (model_parameters None), as
        # transformers' DeepSpeed path hands them to DeepSpeed.
        engine, optimizer, _, schedule = st.initialize(model=self.model, optimizer=client, config=raw,
                                                       units=self._strata_units, auto_values=self._auto_values(raw),
                                                       fit=self._strata_fit,
                                                       initial_weights=self._strata_initial_weights)
        self._strata_engine = engine
        self._strata_schedule = schedule if raw.get("scheduler") is not None else None
        self.optimizer = optimizer
        optimizer._hyper_parameters_only_state = True  # accelerate moves optimizers by a state_dict round trip
        return engine

    def _decay_groups(self):
        decay = set(self.get_decay_parameter_names(self.model))
        params = [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]
        groups = [{"params": [p for n, p in params if n in decay], "weight_decay": self.args.weight_decay},
                  {"params": [p for n, p in params if n not in decay], "weight_decay": 0.0}]
        return [g for g in groups if g["params"]]

    def _auto_values(self, raw):
        """Note [The Trainer's "auto" values]
        The TrainingArguments' values for the keys the config leaves "auto",
        as transformers' DeepSpeed path fills them (HfTrainerDeepSpeedConfig):
        the batch keys, gradient_clipping = max_grad_norm, the optimizer's
        lr, betas, eps and weight decay, the precision, and the scheduler's
        warmup_min_lr = 0, warmup_max_lr = learning_rate, total_num_steps =
        the run's optimizer steps and warmup_num_steps =
        args.get_warmup_steps(those steps) (known once train() sizes its
        loop). train_batch_size and the bucket sizes follow from these and
        the model (initialize, Note [Resolving "auto"]). Unlike transformers,
        a number written in the config is taken as it is, even where it
        differs from the arguments."""
        args = self.args
        values = {"train_micro_batch_size_per_gpu": args.per_device_train_batch_size,
                  "gradient_accumulation_steps": args.gradient_accumulation_steps,
                  "gradient_clipping": self._strata_max_grad_norm,
                  "optimizer.params.lr": args.learning_rate,
                  "optimizer.params.betas": [args.adam_beta1, args.adam_beta2],
                  "optimizer.params.eps": args.adam_epsilon,
                  "optimizer.params.weight_decay": args.weight_decay,
                  "bf16.enabled": bool(args.bf16 or args.bf16_full_eval), "fp16.enabled": bool(args.fp16),
                  "scheduler.params.warmup_min_lr": 0,
                  "scheduler.params.warmup_max_lr": args.learning_rate}
        steps = self._strata_training_steps
        if steps is not None:
            values["scheduler.params.total_num_steps"] = steps
            values["scheduler.params.warmup_num_steps"] = args.get_warmup_steps(steps)
        left = set(st._hf_autos(raw))
        return {k: v for k, v in values.items() if k in left}

    def create_optimizer_and_scheduler(self, num_training_steps):
        self._strata_training_steps = num_training_steps  # the config scheduler's "auto" step counts
        return super().create_optimizer_and_scheduler(num_training_steps)

    def _prepare_for_training(self, max_steps, *args, **kwargs):
        # transformers 5 sizes the loop here and calls create_optimizer() before create_scheduler(max_steps)
        self._strata_training_steps = max_steps
        return super()._prepare_for_training(max_steps, *args, **kwargs)

    def _get_learning_rate(self):
        # The config's schedule steps once per optimizer step, as DeepSpeed's engine steps it inside its own step,
        # so a log reports the lr after the step's schedule step whenever the Trainer asks: transformers 4 asks
        # after its scheduler.step(), transformers 5 between the optimizer step and its scheduler.step().
        schedule = self._strata_schedule
        if schedule is not None and self.lr_scheduler is schedule and self._strata_engine is not None:
            behind = self._strata_engine.global_steps - (schedule.last_batch_iteration + 1)
            if behind > 0:
                return schedule.lr_at(schedule.last_batch_iteration + behind)[0]
        return super()._get_learning_rate()

    def create_scheduler(self, num_training_steps, optimizer=None):
        if self.lr_scheduler is None and self._strata_schedule is not None:
            self.lr_scheduler = self._strata_schedule  # the config's schedule, run by the engine
        return super().create_scheduler(num_training_steps, optimizer)

    def _wrap_model(self, model, training=True, dataloader=None):
        if self._strata_engine is None:
            self.create_optimizer()
        return self._strata_engine

    # -- the loop ----------------------------------------------------------------------------------
    def training_step(self, model, inputs, *args, **kwargs):
        engine = self._strata_engine
        engine.train()
        inputs = self._prepare_inputs(inputs)
        with self.compute_loss_context_manager():
            loss = self.compute_loss(engine, inputs)
        engine.backward(loss)  # scaled by 1 / gradient_accumulation_steps in the engine
        if not engine.is_gradient_accumulation_boundary():
            engine.step()  # a no-op that counts the micro-batch; at the boundary the Trainer's optimizer.step()
        return loss.detach() / self.args.gradient_accumulation_steps

    def log(self, logs, *args, **kwargs):
        metrics = self._strata_engine.metrics if self._strata_engine is not None else None
        if metrics is not None and "loss" in logs:
            logs = dict(logs, grad_norm=metrics["grad_norm"])  # the engine's norm (before clipping)
        return super().log(logs, *args, **kwargs)

    # -- saving ------------------------------------------------------------------------------------
    def save_model(self, output_dir=None, _internal_call=False):
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if self._strata_engine is None:
            return super().save_model(output_dir, _internal_call)
        self._strata_engine.export_hf(output_dir)
        if self._strata_engine.global_rank == 0:
            tokenizer = getattr(self, "processing_class", None) or getattr(self, "tokenizer", None)
            if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
                tokenizer.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, "training_args.bin"))

    def _save_optimizer_and_scheduler(self, output_dir):
        """A checkpoint's optimizer part: the engine's checkpoint (master
        weights, moments, counters: atomic, resumable at another world
        size, stage or placement) in output_dir/strata, and the lr
        scheduler's state. The Trainer writes the model (save_model), the
        RNG states and its own state beside them."""
        self._strata_engine.save_checkpoint(os.path.join(output_dir, "strata"), sync=True,
                                            client_state={"trainer_global_step": self.state.global_step})
        if self._strata_engine.global_rank == 0 and self.lr_scheduler is not None:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, _SCHEDULER_FILE))

    # -- resuming ----------------------------------------------------------------------------------
    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        """Nothing: the weights come with the engine's checkpoint, loaded once the engine exists
        (_load_optimizer_and_scheduler)."""

    def _load_optimizer_and_scheduler(self, checkpoint):
        if checkpoint is None:
            return
        engine_checkpoint = os.path.join(checkpoint, "strata")
        if not os.path.isdir(engine_checkpoint):
            raise FileNotFoundError(f"'{checkpoint}' holds no engine checkpoint ('strata' folder): resume from a "
                                    f"checkpoint a StrataTrainer saved")
        self._strata_engine.load_checkpoint(engine_checkpoint)
        scheduler_file = os.path.join(checkpoint, _SCHEDULER_FILE)
        if self.lr_scheduler is not None and os.path.isfile(scheduler_file):
            self.lr_scheduler.load_state_dict(torch.load(scheduler_file))


_SCHEDULER_FILE = "scheduler.pt"  # the Trainer's own name for it

Trainer = StrataTrainer  # the port's import line: from strata.torch.hf import Trainer, TrainingArguments
