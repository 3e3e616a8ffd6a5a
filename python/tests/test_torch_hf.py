"""strata.torch.hf.StrataTrainer (Note [The Trainer through the engine]):
trains a tiny GPT-2 with the same losses as the stock Trainer with
torch.optim.AdamW (within rounding), at stage 3 with offload, and saves a
model from_pretrained loads."""
import os

import pytest
import torch

if os.environ.get("STRATA_REQUIRE_TRANSFORMERS") != "1":
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
import transformers  # noqa: E402

from strata.errors import Unsupported  # noqa: E402
from strata.torch.hf import StrataTrainer  # noqa: E402


class ToyDataset(torch.utils.data.Dataset):
    def __init__(self, n=16, length=16, vocab=96):
        g = torch.Generator().manual_seed(3)
        self.ids = torch.randint(0, vocab, (n, length), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_gpt2(seed=11):
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


def arguments(tmp_path, **extra):
    values = dict(output_dir=str(tmp_path / "run"), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                  max_steps=6, learning_rate=3e-3, weight_decay=0.01, max_grad_norm=1.0, optim="adamw_torch",
                  lr_scheduler_type="linear", logging_steps=1, save_strategy="no", report_to=[], seed=0,
                  use_cpu=True, dataloader_num_workers=0)
    values.update(extra)
    return transformers.TrainingArguments(**values)


STAGE3_CPU = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"},
                                    "offload_param": {"device": "cpu"}, "stage3_param_persistence_threshold": 0},
              "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "gradient_clipping": "auto", "strata": {"device": "cpu", "device_memory": "64MiB"}}


def logged_losses(trainer):
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_strata_trainer_trains_as_the_stock_trainer_and_saves_a_loadable_model(tmp_path):
    stock = transformers.Trainer(model=tiny_gpt2(), args=arguments(tmp_path), train_dataset=ToyDataset())
    # transformers >= 4.46 divides a step's summed token losses by the label count it sees (num_items_in_batch,
    # which counts the unshifted labels: 16 where the loss has 15); StrataTrainer averages each micro-batch's
    # mean loss, as the Trainer does for a model that takes no loss kwargs.
    stock.model_accepts_loss_kwargs = False
    stock.train()
    expected = logged_losses(stock)

    trainer = StrataTrainer(model=tiny_gpt2(), args=arguments(tmp_path), train_dataset=ToyDataset(),
                            strata_config=STAGE3_CPU)
    trainer.train()
    ours = logged_losses(trainer)
    assert len(ours) == len(expected) == 6
    for a, b in zip(ours, expected):
        assert abs(a - b) <= 1e-4 * abs(b), (ours, expected)
    engine = trainer.strata_engine
    assert engine.global_steps == 6
    assert engine.config["gradient_clipping"] == 1.0 and engine.config["zero_optimization"]["stage"] == 3
    assert all("grad_norm" in h for h in trainer.state.log_history if "loss" in h)

    trainer.save_model(str(tmp_path / "model"))
    loaded = transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "model")).eval()
    ids = ToyDataset()[0]["input_ids"][None]
    engine.eval()
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, engine(input_ids=ids).logits)
    metrics = trainer.evaluate(ToyDataset(n=4))
    assert metrics["eval_loss"] == pytest.approx(expected[-1], rel=0.2)


def test_checkpoints_go_through_the_engine_and_resume_gives_the_same_losses(tmp_path):
    whole = StrataTrainer(model=tiny_gpt2(), args=arguments(tmp_path, save_strategy="steps", save_steps=3),
                          train_dataset=ToyDataset(), strata_config=STAGE3_CPU)
    whole.train()
    for step in (3, 6):
        folder = tmp_path / "run" / f"checkpoint-{step}"
        for name in ("strata/latest", "trainer_state.json", "scheduler.pt", "model.safetensors", "config.json"):
            assert (folder / name).exists(), name
    expected = logged_losses(whole)

    # A new process would build the model afresh (another seed here: the checkpoint's weights win) and resume.
    resumed = StrataTrainer(model=tiny_gpt2(seed=99), args=arguments(tmp_path, output_dir=str(tmp_path / "again")),
                            train_dataset=ToyDataset(), strata_config=STAGE3_CPU)
    resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-3"))
    # Its log holds the checkpoint's first 3 steps (the Trainer's state) and the 3 it ran: all equal.
    assert logged_losses(resumed) == expected
    assert resumed.strata_engine.global_steps == 6


def test_misuse_is_refused_naming_the_fix(tmp_path):
    with pytest.raises(ValueError, match="strata_config"):
        StrataTrainer(model=tiny_gpt2(), args=arguments(tmp_path), train_dataset=ToyDataset())
    with_scheduler = dict(STAGE3_CPU, scheduler={"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}})
    trainer = StrataTrainer(model=tiny_gpt2(), args=arguments(tmp_path), train_dataset=ToyDataset(),
                            strata_config=with_scheduler)
    with pytest.raises(Unsupported, match="call train\\(\\) before evaluate"):
        trainer.evaluate(ToyDataset(n=2))  # the run's step count is not known yet
    (tmp_path / "not-ours").mkdir()  # e.g. a stock Trainer's checkpoint: no engine checkpoint in it
    trainer = StrataTrainer(model=tiny_gpt2(), args=arguments(tmp_path), train_dataset=ToyDataset(),
                            strata_config=STAGE3_CPU)
    trainer.create_optimizer()
    with pytest.raises(FileNotFoundError, match="no engine checkpoint"):
        trainer._load_optimizer_and_scheduler(str(tmp_path / "not-ours"))  # what train(resume_from_checkpoint) calls


def test_strata_fit_fits_the_trainers_config_to_the_caps(tmp_path):
    plain = {k: v for k, v in STAGE3_CPU.items() if k != "zero_optimization"}
    plain["zero_optimization"] = {"stage": 0}
    trainer = StrataTrainer(model=tiny_gpt2(), args=arguments(tmp_path, max_steps=2), train_dataset=ToyDataset(),
                            strata_config=plain, strata_fit={"device_memory": "400KiB", "host_memory": "64MiB"})
    trainer.train()
    engine = trainer.strata_engine
    assert engine.config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert engine.memory()["measured"]["device"] <= 400 * 1024
    assert engine.global_steps == 2


@pytest.mark.filterwarnings("ignore:strata.torch.init:RuntimeWarning")  # torch 1.13: st.init builds in full
def test_a_model_built_under_init_trains_from_pretrained_weights_as_from_pretrained(tmp_path):
    import strata.torch as st
    tiny_gpt2(seed=21).save_pretrained(str(tmp_path / "pretrained"))
    reference = StrataTrainer(model=transformers.GPT2LMHeadModel.from_pretrained(str(tmp_path / "pretrained")),
                              args=arguments(tmp_path / "a"), train_dataset=ToyDataset(), strata_config=STAGE3_CPU)
    reference.train()
    with st.init():  # on meta: the Trainer must not move it, the engine places it
        model = transformers.GPT2LMHeadModel(tiny_gpt2().config)
    trainer = StrataTrainer(model=model, args=arguments(tmp_path / "b"), train_dataset=ToyDataset(),
                            strata_config=STAGE3_CPU, strata_initial_weights=str(tmp_path / "pretrained"))
    trainer.train()
    assert logged_losses(trainer) == logged_losses(reference)
    assert len(logged_losses(trainer)) == 6


def test_a_config_scheduler_and_optimizer_follow_transformers_deepspeed_path(tmp_path):
    """As with TrainingArguments(deepspeed=config): the config's "scheduler" runs (its "auto" values from the
    arguments: warmup_max_lr = learning_rate, warmup_num_steps = the warm-up steps, total_num_steps = the run's
    steps) and its "optimizer" gets every trainable parameter in one group."""
    config = dict(STAGE3_CPU,
                  optimizer={"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "betas": "auto",
                                                         "eps": "auto"}},
                  scheduler={"type": "WarmupDecayLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                                 "warmup_num_steps": "auto",
                                                                 "total_num_steps": "auto", "warmup_type": "linear"}})
    trainer = StrataTrainer(model=tiny_gpt2(), args=arguments(tmp_path, warmup_steps=2), train_dataset=ToyDataset(),
                            strata_config=config)
    trainer.train()
    engine = trainer.strata_engine
    params = engine.config["scheduler"]["params"]
    assert (params["warmup_min_lr"], params["warmup_max_lr"], params["warmup_num_steps"],
            params["total_num_steps"]) == (0, 3e-3, 2, 6)
    assert len(trainer.optimizer.param_groups) == 1 and trainer.optimizer.param_groups[0]["weight_decay"] == 0.01
    assert trainer.lr_scheduler is engine.lr_scheduler and trainer.lr_scheduler.last_batch_iteration == 5
    # The Trainer logs the schedule's lr after each step (DeepSpeed's get_last_lr()): iteration i = step - 1,
    # linear warm-up over W = 2 iterations, then a linear decay to 0 at total_num_steps.
    logged = [h["learning_rate"] for h in trainer.state.log_history if "loss" in h]
    expected = [3e-3 * (i / 2 if i < 2 else (6 - i) / 4) for i in range(6)]
    assert logged == pytest.approx(expected, rel=1e-9, abs=1e-15)
    assert engine.metrics["lr"] == pytest.approx(expected[4])  # the last update ran with iteration 4's lr


def _arguments_values(tmp_path, **extra):
    values = dict(output_dir=str(tmp_path / "run"), per_device_train_batch_size=2, gradient_accumulation_steps=2,
                  max_steps=4, learning_rate=3e-3, weight_decay=0.01, max_grad_norm=1.0, optim="adamw_torch",
                  lr_scheduler_type="linear", logging_steps=1, save_strategy="no", report_to=[], seed=0,
                  use_cpu=True, dataloader_num_workers=0)
    values.update(extra)
    return values


def test_a_deepspeed_trainer_job_ports_by_its_import_line(tmp_path):
    """Note [TrainingArguments(deepspeed=...)]: `from transformers import Trainer, TrainingArguments` becomes
    `from strata.torch.hf import Trainer, TrainingArguments`, and the job's TrainingArguments(deepspeed=...) (or
    HfArgumentParser's --deepspeed) is the engine's config: the same losses as StrataTrainer(strata_config=...)."""
    import json
    from strata.torch.hf import Trainer, TrainingArguments
    config_file = tmp_path / "ds_config.json"
    config_file.write_text(json.dumps(STAGE3_CPU))
    reference = StrataTrainer(model=tiny_gpt2(), args=transformers.TrainingArguments(**_arguments_values(tmp_path / "a")),
                              train_dataset=ToyDataset(), strata_config=str(config_file))
    reference.train()
    expected = logged_losses(reference)
    assert len(expected) == 4

    args = TrainingArguments(**_arguments_values(tmp_path / "b"), deepspeed=str(config_file))
    assert args.deepspeed is None and args.strata_config == str(config_file)
    assert getattr(args, "deepspeed_plugin", None) is None  # transformers' DeepSpeed integration stays off
    ported = Trainer(model=tiny_gpt2(), args=args, train_dataset=ToyDataset())
    ported.train()
    assert logged_losses(ported) == expected
    assert ported.strata_engine.config["zero_optimization"]["stage"] == 3
    ported.save_model(str(tmp_path / "saved"))  # pickles the arguments (training_args.bin)
    assert torch.load(str(tmp_path / "saved" / "training_args.bin"), weights_only=False).strata_config == str(config_file)

    # An HF example script's argument parsing: --deepspeed on the command line.
    parser = transformers.HfArgumentParser(TrainingArguments)
    (parsed,) = parser.parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path / "c"), "--deepspeed", str(config_file), "--per_device_train_batch_size", "2",
         "--gradient_accumulation_steps", "2", "--max_steps", "4", "--learning_rate", "3e-3", "--weight_decay",
         "0.01", "--optim", "adamw_torch", "--logging_steps", "1", "--save_strategy", "no", "--report_to", "none",
         "--seed", "0", "--use_cpu", "--dataloader_num_workers", "0"])
    parsed_run = Trainer(model=tiny_gpt2(), args=parsed, train_dataset=ToyDataset())
    parsed_run.train()
    assert logged_losses(parsed_run) == expected


def test_a_config_given_twice_or_to_transformers_integration_is_refused_naming_the_fix(tmp_path):
    from strata.torch.hf import Trainer, TrainingArguments
    with pytest.raises(ValueError, match="two configs, deepspeed='a.json' and strata_config='b.json'"):
        TrainingArguments(**_arguments_values(tmp_path), deepspeed="a.json", strata_config="b.json")
    assert TrainingArguments(**_arguments_values(tmp_path), deepspeed="a.json",
                             strata_config="a.json").strata_config == "a.json"  # the same config twice is one
    with pytest.raises(ValueError, match="empty string"):
        TrainingArguments(**_arguments_values(tmp_path), strata_config=" ")
    with pytest.raises(ValueError, match=r"two configs, strata_config='c\\x1b\[0m.json'"):
        Trainer(model=tiny_gpt2(), args=TrainingArguments(**_arguments_values(tmp_path), deepspeed="a.json"),
                train_dataset=ToyDataset(), strata_config="c\x1b[0m.json")
    with pytest.raises(ValueError, match="TrainingArguments\\(deepspeed=...\\)"):
        Trainer(model=tiny_gpt2(), args=TrainingArguments(**_arguments_values(tmp_path)), train_dataset=ToyDataset())
    # transformers' own arguments with deepspeed set (possible only where DeepSpeed is installed: set here after
    # the fact) would run transformers' DeepSpeed integration: refused, naming the arguments to use.
    stock_args = transformers.TrainingArguments(**_arguments_values(tmp_path))
    stock_args.deepspeed = STAGE3_CPU
    with pytest.raises(Unsupported, match="from strata.torch.hf import Trainer, TrainingArguments"):
        StrataTrainer(model=tiny_gpt2(), args=stock_args, train_dataset=ToyDataset())
