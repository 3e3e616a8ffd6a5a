"""strata.torch: nn.Modules trained through the engine with DeepSpeed's API
(initialize, engine(...), engine.backward, engine.step), against plain
torch training with torch.optim.AdamW (same fp32 arithmetic up to the CPU
kernel's last bit), and bit for bit across ZeRO stages and placements."""
import math
import warnings

import pytest
import torch
import torch.utils.checkpoint

import strata
import strata.torch as st

MICRO = 4
SEQ = 12
VOCAB = 64


# -- models -------------------------------------------------------------------------------------
def make_mlp(seed=3):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(),
                               torch.nn.Linear(64, 16))


class Block(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln1 = torch.nn.LayerNorm(d)
        self.qkv = torch.nn.Linear(d, 3 * d)
        self.proj = torch.nn.Linear(d, d)
        self.ln2 = torch.nn.LayerNorm(d)
        self.fc = torch.nn.Linear(d, 4 * d)
        self.out = torch.nn.Linear(4 * d, d)

    def forward(self, x):
        q, k, v = self.qkv(self.ln1(x)).chunk(3, dim=-1)
        scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
        causal = torch.ones(x.shape[1], x.shape[1], dtype=torch.bool).triu(1)
        x = x + self.proj(torch.softmax(scores.masked_fill(causal, float("-inf")), dim=-1) @ v)
        return x + self.out(torch.nn.functional.gelu(self.fc(self.ln2(x))))


class TinyLM(torch.nn.Module):
    """Embedding + blocks + final norm + a head tied to the embedding."""

    def __init__(self, d=32, layers=2):
        super().__init__()
        self.wte = torch.nn.Embedding(VOCAB, d)
        self.wpe = torch.nn.Embedding(SEQ, d)
        self.blocks = torch.nn.ModuleList(Block(d) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, VOCAB, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, ids):
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


class TinyHFStyleLM(TinyLM):
    _no_split_modules = ["Block"]  # what Hugging Face models declare


def make_lm(seed=5, cls=TinyLM):
    torch.manual_seed(seed)
    return cls()


# -- data, losses, configs ----------------------------------------------------------------------
def mlp_batch(index):
    g = torch.Generator().manual_seed(1000 + index)
    x = torch.randn(MICRO, 16, generator=g)
    return x, torch.sin(x)


def mlp_loss(model, index):
    x, y = mlp_batch(index)
    return torch.nn.functional.mse_loss(model(x), y)


def lm_loss(model, index):
    g = torch.Generator().manual_seed(2000 + index)
    ids = torch.randint(0, VOCAB, (MICRO, SEQ + 1), generator=g)
    logits = model(ids[:, :-1])
    return torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def config(stage=0, optimizer="none", params="none", nvme_dir=None, accum=2, lr=1e-2, weight_decay=0.01, clip=0.0,
           with_optimizer=True, overlap=True):
    zero = {"stage": stage, "offload_optimizer": {"device": optimizer}, "offload_param": {"device": params},
            "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 100000}
    if optimizer == "nvme":
        zero["offload_optimizer"]["nvme_path"] = str(nvme_dir)
    if params == "nvme":
        zero["offload_param"]["nvme_path"] = str(nvme_dir)
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": accum, "gradient_clipping": clip,
           "zero_optimization": zero,
           "strata": {"device": "cpu", "device_memory": "64MiB", "overlap_optimizer": overlap}}
    if with_optimizer:
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": lr, "betas": [0.9, 0.999], "eps": 1e-8,
                                                        "weight_decay": weight_decay}}
    return cfg


def train_engine(engine, loss_fn, steps, first_batch=0):
    """DeepSpeed's loop; returns each optimizer step's mean loss as the engine reports it."""
    losses = []
    index = first_batch
    for _ in range(steps * engine.gradient_accumulation_steps()):
        loss = loss_fn(engine, index)
        index += 1
        engine.backward(loss)
        boundary = engine.is_gradient_accumulation_boundary()
        engine.step()
        if boundary:
            losses.append(engine.metrics["loss"])
    return losses


def train_torch(model, optimizer, loss_fn, steps, accum=2, clip=0.0, scheduler=None):
    losses = []
    index = 0
    for _ in range(steps):
        # Zeros, not None (torch >= 2's default): the engine steps a parameter its micro-batches did not use with
        # a zero gradient (moments decay, weight decay applies), as DeepSpeed's ZeRO does; torch skips a None grad.
        optimizer.zero_grad(set_to_none=False)
        total = 0.0
        for _ in range(accum):
            loss = loss_fn(model, index)
            index += 1
            (loss / accum).backward()
            total += float(loss)
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        losses.append(total / accum)
    return losses


def decay_groups(model, weight_decay):
    """Hugging Face's grouping: no weight decay for biases and norms."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        (no_decay if name.endswith("bias") or ".ln" in name or name.startswith("ln") else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def max_rel(ours, ref):
    return max(abs(a - b) / abs(b) for a, b in zip(ours, ref))


def assert_masters_close(engine, reference, rel=1e-4):
    masters = engine.master_parameters()
    for name, p in reference.named_parameters():
        a, b = masters[name], p.detach()
        if name.endswith("qkv.bias"):
            # The key bias's gradient is 0 analytically (softmax ignores a constant per query): Adam
            # normalizes the rounding noise torch computes there, so only the query and value parts compare.
            d = a.shape[0] // 3
            a, b = torch.cat([a[:d], a[2 * d:]]), torch.cat([b[:d], b[2 * d:]])
        err = float((a - b).abs().max())
        assert err <= rel * float(b.abs().max()) + 1e-7, f"{name}: max diff {err}"


# -- parity with torch --------------------------------------------------------------------------
STEPS = 50


def test_mlp_matches_torch_adamw():
    engine, _, _, _ = st.initialize(model=make_mlp(), model_parameters=None, config=config(0))
    ours = train_engine(engine, mlp_loss, STEPS)
    ref_model = make_mlp()
    ref = train_torch(ref_model, torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.01), mlp_loss,
                      STEPS)
    assert max_rel(ours, ref) < 1e-5, (ours, ref)
    assert_masters_close(engine, ref_model)
    assert engine.gradient_copies == 0  # fp32: autograd accumulated into the engine's buffers in place


@pytest.mark.parametrize("cls", [TinyLM, TinyHFStyleLM], ids=["children-units", "no-split-modules"])
def test_tiny_lm_with_tied_head_matches_torch_adamw(cls):
    # A client AdamW with no-decay groups and gradient clipping: the engine takes its hyper-parameters.
    model = make_lm(cls=cls)
    client = torch.optim.AdamW(decay_groups(model, 0.1), lr=3e-3, betas=(0.9, 0.95), eps=1e-8)
    engine, optimizer, _, _ = st.initialize(model=model, optimizer=client,
                                            config=config(0, with_optimizer=False, clip=1.0))
    assert isinstance(optimizer, torch.optim.Optimizer)
    ours = train_engine(engine, lm_loss, STEPS)
    ref_model = make_lm(cls=cls)
    ref = train_torch(ref_model, torch.optim.AdamW(decay_groups(ref_model, 0.1), lr=3e-3, betas=(0.9, 0.95)),
                      lm_loss, STEPS, clip=1.0)
    assert max_rel(ours, ref) < 1e-5, (ours, ref)
    assert_masters_close(engine, ref_model)
    assert ours[-1] < ours[0]
    assert engine.gradient_copies == 0  # the tied weight too: both uses accumulated in the engine's buffer


def test_units_tied_weight_has_one_layer_used_where_needed():
    model = make_lm()
    engine, _, _, _ = st.initialize(model=model, config=config(0))
    owners = [layer.plan.name for layer in engine._layers if any(n == "wte.weight" for n, _ in layer.plan.params)]
    assert owners == ["wte"]
    head = next(u for u in engine._units if u.name == "head")
    assert head.layers == [] and head.uses == [engine._layers[0].plan.index]
    assert [u.name for u in engine._units] == ["wte", "wpe", "blocks.0", "blocks.1", "head", ""]
    hf = st.split_into_units(make_lm(cls=TinyHFStyleLM))
    assert [u.name for u in hf] == ["blocks.0", "blocks.1", ""]
    assert [u.name for u in st.split_into_units(make_lm(), [Block, torch.nn.Embedding])] == \
        ["wte", "wpe", "blocks.0", "blocks.1", ""]
    with pytest.raises(ValueError, match=r"units=\['Blok'\] matches no submodule of TinyLM"):
        st.split_into_units(make_lm(), ["Blok"])


class PeftStyleLora(torch.nn.Module):
    """peft's layout: the base layer and one adapter per name in ModuleDicts."""

    def __init__(self, d, rank=2):
        super().__init__()
        self.base_layer = torch.nn.Linear(d, d)
        self.lora_A = torch.nn.ModuleDict({"default": torch.nn.Linear(d, rank, bias=False)})
        self.lora_B = torch.nn.ModuleDict({"default": torch.nn.Linear(rank, d, bias=False)})

    def forward(self, x):
        return self.base_layer(x) + self.lora_B["default"](self.lora_A["default"](x))


class Backbone(torch.nn.Module):
    """Embeddings, repeated blocks, a relative-position table its blocks read without calling it, and one small
    parameter of its own (XLNet's mask_emb)."""

    def __init__(self, d=32, layers=3):
        super().__init__()
        self.mask_emb = torch.nn.Parameter(torch.zeros(d))
        self.embed = torch.nn.Embedding(VOCAB, d)
        self.rel = torch.nn.Embedding(SEQ, d)
        self.blocks = torch.nn.ModuleList(Block(d) for _ in range(layers))

    def forward(self, ids):
        x = self.embed(ids) + self.rel.weight[:ids.shape[1]] + self.mask_emb
        for block in self.blocks:
            x = block(x)
        return x


class HeadOverBackbone(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = Backbone()
        self.head = torch.nn.Linear(32, VOCAB)

    def forward(self, ids):
        return self.head(self.backbone(ids))


def test_units_of_a_backbone_are_its_blocks_and_a_lora_linear_stays_one():
    """Note [Units of a model without _no_split_modules]: a backbone holding most of the model is looked into,
    only its blocks become units (the table its blocks read uncalled joins the root, which is held throughout);
    a LoRA linear in peft's layout (ModuleDicts of one adapter) is not a backbone."""
    model = HeadOverBackbone()
    assert [u.name for u in st.split_into_units(model)] == \
        ["backbone.blocks.0", "backbone.blocks.1", "backbone.blocks.2", "head", ""]
    torch.manual_seed(1)
    base = train_engine(st.initialize(model=HeadOverBackbone(), config=config(0))[0], lm_loss, 2)
    torch.manual_seed(1)
    assert train_engine(st.initialize(model=HeadOverBackbone(), config=config(3, "cpu", "cpu"))[0], lm_loss, 2) \
        == base
    torch.manual_seed(1)
    lora = torch.nn.Sequential(torch.nn.Linear(16, 16), PeftStyleLora(64 * 2), torch.nn.Linear(16, 16))
    assert [u.name for u in st.split_into_units(lora)] == ["0", "1", "2", ""]


# -- bit-identical across stages and placements -------------------------------------------------
PLACEMENTS = [(1, "none", "none", True), (2, "none", "none", True), (2, "cpu", "none", True),
              (3, "none", "none", True), (3, "cpu", "cpu", True), (2, "nvme", "none", True),
              (3, "nvme", "nvme", True), (3, "cpu", "cpu", False)]


def lm_run(cfg, steps=4):
    model = make_lm()
    engine, _, _, _ = st.initialize(model=model, model_parameters=decay_groups(model, 0.1), config=cfg)
    losses = train_engine(engine, lm_loss, steps)
    return losses, engine.master_parameters()


@pytest.fixture(scope="module")
def lm_baseline():
    return lm_run(config(0))


@pytest.mark.parametrize("stage,optimizer,params,overlap", PLACEMENTS,
                         ids=[f"stage{s}-{o}-{p}" + ("" if ov else "-no-overlap") for s, o, p, ov in PLACEMENTS])
def test_losses_bit_identical_across_stages_and_placements(stage, optimizer, params, overlap, tmp_path, lm_baseline):
    losses, masters = lm_run(config(stage, optimizer, params, tmp_path, overlap=overlap))
    base_losses, base_masters = lm_baseline
    assert losses == base_losses  # exact: the engine's determinism, not a tolerance
    for name, value in base_masters.items():
        assert torch.equal(masters[name], value), name


def test_nvme_state_without_pipelines_is_named(tmp_path):
    """The optimizer state on NVMe without pipeline_read and pipeline_write (DeepSpeed's defaults) warns,
    naming both keys; with both on it does not."""
    (tmp_path / "off").mkdir()
    (tmp_path / "on").mkdir()
    cfg = config(2, "nvme", "none", tmp_path / "off")
    with pytest.warns(RuntimeWarning, match=r"offload_optimizer.pipeline_read false and pipeline_write false"):
        st.initialize(model=make_lm(), config=cfg)
    cfg = config(2, "nvme", "none", tmp_path / "on")  # (the first engine may still hold its swap folder)
    cfg["zero_optimization"]["offload_optimizer"].update({"pipeline_read": True, "pipeline_write": True})
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        st.initialize(model=make_lm(), config=cfg)


@pytest.mark.parametrize("stage,optimizer,params", [(1, "cpu", "none"), (3, "cpu", "cpu"), (3, "cpu", "nvme"),
                                                     (3, "nvme", "nvme")])
def test_early_updates_bit_identical_on_and_off(stage, optimizer, params, tmp_path):
    """strata.speculative_optimizer: each layer's CPU step starts under the backward (torch's hooks reduce it)
    and is kept or redone exactly at the step's end; clipping at a threshold some steps cross. With the
    stage-3 shards on NVMe each early update writes its shard back at once."""
    runs = {}
    for mode in ("on", "off"):
        nvme_dir = tmp_path / mode
        nvme_dir.mkdir()
        cfg = config(stage, optimizer, params, nvme_dir, clip=0.5)
        cfg["strata"]["speculative_optimizer"] = mode
        model = make_lm()
        engine, _, _, _ = st.initialize(model=model, model_parameters=decay_groups(model, 0.1), config=cfg)
        losses = train_engine(engine, lm_loss, 4)
        m = engine.metrics
        assert 0 <= m["redone_layers"] <= m["speculated_layers"]
        # The exposed optimizer time by layer: (layer, ms) pairs that add up to it.
        waits = m["optimizer_waits"]
        assert all(isinstance(layer, int) and ms > 0 for layer, ms in waits)
        assert sum(ms for _, ms in waits) == pytest.approx(m["wait_optimizer_ms"], abs=1e-9)
        if mode == "off":
            assert m["speculated_layers"] == 0
        # (with the state on NVMe the pending versions are on NVMe, not in pinned memory)
        assert (engine.memory()["predicted"]["pinned_speculation"] > 0) == (mode == "on" and optimizer == "cpu")
        runs[mode] = (losses, engine.master_parameters())
    assert runs["on"][0] == runs["off"][0]
    for name, value in runs["off"][1].items():
        assert torch.equal(runs["on"][1][name], value), name


def test_early_updates_bad_value_names_the_key():
    cfg = config(2, "cpu")
    cfg["strata"]["speculative_optimizer"] = "maybe"
    with pytest.raises(Exception, match="speculative_optimizer"):
        st.initialize(model=make_lm(), config=cfg)


# (stage, optimizer, params, overlap, speculative_optimizer): the last row steps layers early, out of place
# into pending buffers (the shared blocks too).
INT8_PLACEMENTS = [(1, "cpu", "none", True, "off"), (2, "cpu", "none", False, "off"), (3, "cpu", "cpu", True, "off"),
                   (2, "nvme", "none", True, "off"), (3, "nvme", "nvme", True, "off"), (2, "cpu", "none", True, "on")]


def test_int8_moments_bit_identical_across_placements_and_close_to_fp32(tmp_path):
    """strata.optimizer_state_dtype int8: block-wise 8-bit moments for offloaded state. The no-decay groups
    cut 256-element blocks (a LayerNorm's 32 weights then 32 biases, a Linear's bias after its weight), so
    the blocks those runs share step through fp32 (Note [Runs in 8-bit blocks]); losses stay bit-identical
    across stages and placements, and close to fp32 moments."""
    runs = []
    for i, (stage, optimizer, params, overlap, speculative) in enumerate(INT8_PLACEMENTS):
        cfg = config(stage, optimizer, params, tmp_path / str(i), overlap=overlap)
        (tmp_path / str(i)).mkdir()
        cfg["strata"]["optimizer_state_dtype"] = "int8"
        cfg["strata"]["speculative_optimizer"] = speculative
        runs.append(lm_run(cfg, steps=6))
    (losses, masters), rest = runs[0], runs[1:]
    for (other_losses, other_masters), placement in zip(rest, INT8_PLACEMENTS[1:]):
        assert other_losses == losses, placement
        for name, value in masters.items():
            assert torch.equal(other_masters[name], value), (placement, name)
    fp32_losses, fp32_masters = lm_run(config(1, "cpu"), steps=6)
    assert max_rel(losses, fp32_losses) < 0.02, (losses, fp32_losses)
    assert losses != fp32_losses  # the 8-bit moments were used
    assert losses[-1] < losses[0]


def test_int8_moments_on_the_device_are_refused_naming_the_key():
    cfg = config(2)
    cfg["strata"]["optimizer_state_dtype"] = "int8"
    with pytest.raises(Exception, match=r"strata.optimizer_state_dtype.*offload_optimizer.device is none"):
        st.initialize(model=make_mlp(), config=cfg)


def test_bf16_bit_identical_across_stages():
    """bf16 enabled: the layers hold bf16 parameters (the module is cast, as DeepSpeed does) over fp32
    masters; gradients accumulated in fp32 are handed over by one add per tensor."""
    runs = []
    for stage, optimizer, params in [(0, "none", "none"), (3, "cpu", "cpu")]:
        cfg = config(stage, optimizer, params)
        cfg["bf16"] = {"enabled": True}
        cfg["data_types"] = {"grad_accum_dtype": "fp32"}
        engine, _, _, _ = st.initialize(model=make_lm(), config=cfg)
        assert {layer.plan.dtype for layer in engine._layers} == {torch.bfloat16}
        runs.append((train_engine(engine, lm_loss, 4), engine.master_parameters()))
        assert engine.gradient_copies > 0
    (losses, masters), (losses3, masters3) = runs
    assert losses == losses3 and losses[-1] < losses[0]
    assert all(torch.equal(masters[n], masters3[n]) for n in masters)


class CheckpointedLM(TinyLM):
    """TinyLM with activation checkpointing on its blocks (their forward runs again in backward)."""

    def __init__(self, reentrant):
        super().__init__()
        self.reentrant = reentrant

    def forward(self, ids):
        x = self.wte(ids) + self.wpe(torch.arange(ids.shape[1]))
        for block in self.blocks:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=self.reentrant)
        return self.head(self.ln_f(x))


@pytest.mark.parametrize("reentrant", [True, False], ids=["reentrant", "non-reentrant"])
@pytest.mark.parametrize("stage,offload", [(0, "none"), (3, "cpu")], ids=["stage0", "stage3-cpu"])
def test_activation_checkpointing_recompute_is_folded_into_backward(reentrant, stage, offload):
    def frozen_first_block(model):
        for p in model.blocks[0].parameters():
            p.requires_grad_(False)  # the frozen-parameter recompute that crashes DeepSpeed (transformers#47254)
        return model

    torch.manual_seed(5)
    model = frozen_first_block(CheckpointedLM(reentrant))
    engine, _, _, _ = st.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                    config=config(stage, offload, offload))
    losses = train_engine(engine, lm_loss, 4)
    plain = frozen_first_block(make_lm())
    reference, _, _, _ = st.initialize(model=plain, model_parameters=[p for p in plain.parameters() if p.requires_grad],
                                       config=config(0))
    assert losses == train_engine(reference, lm_loss, 4)  # bit for bit: the same numbers, recomputed
    ours, ref = engine.master_parameters(), reference.master_parameters()
    assert all(torch.equal(ours[n], ref[n]) for n in ref)
    assert engine.gradient_copies == 0


# -- frozen parameters, accumulation, groups, evaluation -----------------------------------------
def test_frozen_layer_and_mixed_unit():
    def frozen_mlp():
        model = make_mlp()
        model[0].weight.requires_grad_(False)  # unit 0 mixes: frozen weight, trainable bias
        for p in model[2].parameters():
            p.requires_grad_(False)            # unit 2: a frozen layer
        return model

    model = frozen_mlp()
    frozen_before = model[2].weight.detach().clone()
    engine, _, _, _ = st.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                    config=config(3, "cpu", "cpu"))
    names = [layer.plan.name for layer in engine._layers]
    assert names == ["0.frozen", "0", "2.frozen", "4"]
    ours = train_engine(engine, mlp_loss, 6)
    ref_model = frozen_mlp()
    ref = train_torch(ref_model, torch.optim.AdamW([p for p in ref_model.parameters() if p.requires_grad], lr=1e-2,
                                                   weight_decay=0.01), mlp_loss, 6)
    assert max_rel(ours, ref) < 1e-5, (ours, ref)
    masters = engine.master_parameters()
    assert "2.weight" not in masters and "0.weight" not in masters
    for name in ("0.bias", "4.weight", "4.bias"):
        assert torch.allclose(masters[name], dict(ref_model.named_parameters())[name], rtol=1e-4, atol=1e-6)
    seen = []  # the frozen weight the engine's forward sees is the initial one
    hook = engine.module[2].register_forward_pre_hook(lambda m, a: seen.append(m.weight.detach().clone()))
    with torch.no_grad():
        x, _ = mlp_batch(50)
        out = engine(x)
    hook.remove()
    assert torch.equal(seen[0], frozen_before)
    assert torch.allclose(out, ref_model(x), rtol=1e-4, atol=1e-5)


class LoraLinear(torch.nn.Module):
    """A frozen base weight and a trainable low-rank adapter (LoRA)."""

    def __init__(self, d, rank=2):
        super().__init__()
        self.base = torch.nn.Linear(d, d)
        self.down = torch.nn.Linear(d, rank, bias=False)
        self.up = torch.nn.Linear(rank, d, bias=False)
        for p in self.base.parameters():
            p.requires_grad_(False)

    def forward(self, x):
        return self.base(x) + self.up(self.down(x))


def lora_mlp(seed=3):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), LoraLinear(64), torch.nn.GELU(),
                               torch.nn.Linear(64, 16))


@pytest.mark.parametrize("stage,placement,resume_stage", [(0, "none", 2), (3, "cpu", 3), (2, "nvme", 3)])
def test_lora_checkpoint_resumes_bit_for_bit_and_a_different_base_is_refused(tmp_path, stage, placement,
                                                                             resume_stage):
    made = []

    def engine_at(stage, placement, model):
        params = placement if stage == 3 else "none"
        nvme = tmp_path / f"nvme{len(made)}"  # engines alive together: a swap folder each
        nvme.mkdir()
        made.append(nvme)
        return st.initialize(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                             config=config(stage, placement, params, nvme_dir=nvme))[0]

    whole = engine_at(stage, placement, lora_mlp())
    ours = train_engine(whole, mlp_loss, 8)
    first = engine_at(stage, placement, lora_mlp())
    train_engine(first, mlp_loss, 4)
    first.save_checkpoint(tmp_path / "ckpt", client_state={"next": 8}, sync=True)
    resumed = engine_at(resume_stage, "cpu" if resume_stage else "none", lora_mlp())  # the base rebuilt as it was
    _, client = resumed.load_checkpoint(tmp_path / "ckpt")
    assert train_engine(resumed, mlp_loss, 4, first_batch=client["next"]) == ours[4:]
    after, expected = resumed.master_parameters(), whole.master_parameters()
    assert sorted(after) == sorted(expected) and all(torch.equal(after[n], expected[n]) for n in after)

    other_base = lora_mlp()
    with torch.no_grad():
        other_base[2].base.weight.add_(0.01)  # not the base the checkpoint was trained with
    refused = engine_at(resume_stage, "cpu" if resume_stage else "none", other_base)
    with pytest.raises(strata.FailedPrecondition, match=r"frozen layer '2.frozen' differs"):
        refused.load_checkpoint(tmp_path / "ckpt")


@pytest.mark.parametrize("accum", [1, 4])
def test_gradient_accumulation(accum):
    engine, _, _, _ = st.initialize(model=make_mlp(), config=config(2, "cpu", accum=accum))
    seen = []
    for index in range(2 * accum):
        engine.backward(mlp_loss(engine, index))
        seen.append(engine.is_gradient_accumulation_boundary())
        engine.step()
        assert engine.global_steps == (index + 1) // accum
    assert seen == ([False] * (accum - 1) + [True]) * 2
    ref_model = make_mlp()
    ref = train_torch(ref_model, torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.01), mlp_loss,
                      2, accum=accum)
    assert engine.metrics["loss"] == pytest.approx(ref[-1], rel=1e-5)
    assert_masters_close(engine, ref_model)


def test_no_decay_groups_become_per_tensor_weight_decay():
    model = make_mlp()
    groups = [{"params": [model[0].weight, model[2].weight, model[4].weight], "weight_decay": 0.5},
              {"params": [model[0].bias, model[2].bias, model[4].bias], "weight_decay": 0.0, "lr": 5e-3}]
    engine, optimizer, _, _ = st.initialize(model=model, model_parameters=groups, config=config(1))
    specs = {t.name: t for layer in engine._layers for t in layer.plan.specs(lambda p: (None, 1.0))}
    assert set(specs) == {"0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias"}
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.5, 0.0]
    ours = train_engine(engine, mlp_loss, 8)
    ref_model = make_mlp()
    ref_groups = [{"params": [ref_model[0].weight, ref_model[2].weight, ref_model[4].weight], "weight_decay": 0.5},
                  {"params": [ref_model[0].bias, ref_model[2].bias, ref_model[4].bias], "weight_decay": 0.0,
                   "lr": 5e-3}]
    ref = train_torch(ref_model, torch.optim.AdamW(ref_groups, lr=1e-2), mlp_loss, 8)
    assert max_rel(ours, ref) < 1e-5
    assert_masters_close(engine, ref_model)
    # The same run with decay on every tensor differs: the groups reached the engine.
    plain, _, _, _ = st.initialize(model=make_mlp(), config=config(1, weight_decay=0.5))
    assert train_engine(plain, mlp_loss, 8)[-1] != ours[-1]


def test_evaluation_forward_under_no_grad_uses_the_trained_weights():
    engine, _, _, _ = st.initialize(model=make_mlp(), config=config(3, "cpu", "cpu"))
    train_engine(engine, mlp_loss, 3)
    engine.eval()
    with torch.no_grad():
        x, _ = mlp_batch(99)
        ours = engine(x)
    engine.train()
    reference = make_mlp()
    reference.load_state_dict(engine.master_parameters())
    assert torch.equal(ours, reference(x).detach())
    assert engine.module is not reference and isinstance(engine.module, torch.nn.Sequential)
    train_engine(engine, mlp_loss, 1, first_batch=6)  # training goes on after the evaluation
    assert engine.global_steps == 4
    memory = engine.memory()
    assert memory["predicted"]["pinned_params"] > 0 and memory["predicted"]["pinned_optimizer"] > 0
    assert 0 < memory["measured"]["pinned"] <= memory["predicted"]["pinned"]
    assert engine.metrics["tokens_per_s"] > 0  # the micro-batch's samples reached the engine


# -- lr schedulers ------------------------------------------------------------------------------
def warmup(step):
    return min(1.0, (step + 1) / 4)


def test_lambda_lr_scheduler_drives_the_engine_lr():
    engine, optimizer, _, scheduler = st.initialize(
        model=make_mlp(), config=config(0), lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, warmup))
    ours = train_engine(engine, mlp_loss, 8)
    ref_model = make_mlp()
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.01)
    ref = train_torch(ref_model, ref_opt, mlp_loss, 8, scheduler=torch.optim.lr_scheduler.LambdaLR(ref_opt, warmup))
    assert max_rel(ours, ref) < 1e-5
    assert scheduler.get_last_lr() == [1e-2]


def test_config_scheduler_lr_shows_in_param_groups():
    cfg = config(0, accum=1)
    cfg["scheduler"] = {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2,
                                                      "warmup_num_steps": 4, "warmup_type": "linear"}}
    engine, optimizer, _, _ = st.initialize(model=make_mlp(), config=cfg)
    lrs = []
    for index in range(6):
        engine.backward(mlp_loss(engine, index))
        engine.step()
        lrs.append(engine.metrics["lr"])
        assert optimizer.param_groups[0]["lr"] == lrs[-1]
    assert lrs == sorted(lrs) and lrs[0] < lrs[-1] == 1e-2  # the engine's warmup, seen in the groups
    optimizer.param_groups[0]["lr"] = 1e-3  # a second lr schedule on top: refused, not ignored
    engine.backward(mlp_loss(engine, 6))
    with pytest.raises(strata.Unsupported, match="the config's \"scheduler\" section drives the lr"):
        engine.step()


# -- checkpoints --------------------------------------------------------------------------------
@pytest.mark.parametrize("resume_stage", [0, 3])
def test_checkpoint_resume_matches_an_unbroken_run(tmp_path, resume_stage):
    unbroken, _, _, _ = st.initialize(model=make_mlp(), config=config(2, "cpu"))
    expected = train_engine(unbroken, mlp_loss, 6)

    first, _, _, _ = st.initialize(model=make_mlp(), config=config(2, "cpu"))
    assert train_engine(first, mlp_loss, 3) == expected[:3]
    first.save_checkpoint(tmp_path, client_state={"epoch": 1, "seen": [1, 2, 3]})
    assert first.wait_checkpoint()["committed"]

    resumed, _, _, _ = st.initialize(model=make_mlp(seed=99), config=config(resume_stage, "cpu" if resume_stage else
                                                                               "none"))
    load_path, client_state = resumed.load_checkpoint(tmp_path)  # DeepSpeed's: the loaded checkpoint's folder
    assert load_path == str(tmp_path / "global_step3") and client_state == {"epoch": 1, "seen": [1, 2, 3]}
    assert resumed.global_steps == 3
    losses = train_engine(resumed, mlp_loss, 3, first_batch=6)
    assert losses == expected[3:]


def test_checkpoint_client_state_must_be_json(tmp_path):
    engine, _, _, _ = st.initialize(model=make_mlp(), config=config(0))
    with pytest.raises(TypeError, match="client_state must be JSON"):
        engine.save_checkpoint(tmp_path, client_state={"t": torch.zeros(2)})


# -- bad input ----------------------------------------------------------------------------------
def test_unsupported_client_optimizer_is_named():
    model = make_mlp()
    with pytest.raises(TypeError, match=r"torch\.optim\.sgd\.SGD is not supported"):
        st.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                      config=config(0, with_optimizer=False))
    with pytest.raises(strata.Unsupported, match="amsgrad=True"):
        st.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters(), amsgrad=True),
                      config=config(0, with_optimizer=False))
    with pytest.raises(ValueError, match="both a client optimizer"):
        st.initialize(model=model, optimizer=torch.optim.AdamW(model.parameters()), config=config(0))


def test_bad_config_key_is_named(tmp_path):
    bad = config(0)
    bad["zero_optimization"]["stage3_max_live_paramters"] = 10
    with pytest.raises(strata.InvalidArgument, match="stage3_max_live_paramters"):
        st.initialize(model=make_mlp(), config=bad)
    path = tmp_path / "ds.json"
    path.write_text('{"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 7}}')
    with pytest.raises(strata.InvalidArgument, match="zero_optimization.stage"):
        st.initialize(model=make_mlp(), config=str(path))


def test_auto_values_are_refused_by_key():
    cfg = config(0)
    cfg["optimizer"]["params"]["lr"] = "auto"
    cfg["gradient_clipping"] = "auto"
    with pytest.raises(strata.Unsupported, match=r"leaves (gradient_clipping, optimizer.params.lr|"
                                                 r"optimizer.params.lr, gradient_clipping) \"auto\""):
        st.initialize(model=make_mlp(), config=cfg)


def test_bad_parameters_are_named():
    model = make_mlp()
    with pytest.raises(ValueError, match="parameter '4.bias' requires grad but is in no param group"):
        st.initialize(model=model, model_parameters=[p for n, p in model.named_parameters() if n != "4.bias"],
                      config=config(0))
    with pytest.raises(strata.Unsupported, match=r"param_groups\[1\]\['betas'\]"):
        st.initialize(model=model, model_parameters=[{"params": [model[0].weight]},
                                                     {"params": [p for p in model.parameters()
                                                                 if p is not model[0].weight], "betas": (0.8, 0.9)}],
                      config=config(0))
    engine, _, _, _ = st.initialize(model=make_mlp(), config=config(0))
    with pytest.raises(strata.FailedPrecondition, match="without a training forward"):
        engine.backward(torch.zeros((), requires_grad=True))


def test_docs_example_trains(capsys):
    """docs/torch.md's "Porting a DeepSpeed loop" example runs and trains."""
    import pathlib
    import re

    docs = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "torch.md").read_text()
    section = docs[docs.index("## Porting a DeepSpeed loop"):]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    scope = {}
    exec(compile(code, "docs/torch.md (Porting a DeepSpeed loop)", "exec"), scope)
    assert scope["engine"].global_steps == 80
    assert scope["engine"].metrics["loss"] < 0.2, scope["engine"].metrics["loss"]
    assert "step 80: loss" in capsys.readouterr().out


class Reuse(torch.nn.Module):
    """A unit called twice per forward, and one skipped on some batches."""

    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(16, 64)
        self.shared = torch.nn.Linear(64, 64)
        self.sometimes = torch.nn.Linear(64, 64)
        self.out = torch.nn.Linear(64, 16)

    def forward(self, x, use_sometimes):
        h = self.shared(torch.tanh(self.shared(torch.tanh(self.inp(x)))))
        if use_sometimes:
            h = self.sometimes(torch.tanh(h))
        return self.out(torch.tanh(h))


def reuse_loss(model, index):
    x, y = mlp_batch(index)
    return torch.nn.functional.mse_loss(model(x, use_sometimes=index % 3 == 0), y)




@pytest.mark.parametrize("stage,offload", [(0, "none"), (2, "none"), (3, "cpu")])
def test_unit_called_twice_and_unit_skipped(stage, offload):
    torch.manual_seed(7)
    engine, _, _, _ = st.initialize(model=Reuse(), config=config(stage, offload, offload if stage == 3 else "none"))
    assert [u.name for u in engine._units] == ["inp", "shared", "sometimes", "out", ""]
    ours = train_engine(engine, reuse_loss, 6)
    torch.manual_seed(7)
    ref_model = Reuse()
    ref = train_torch(ref_model, torch.optim.AdamW(ref_model.parameters(), lr=1e-2, weight_decay=0.01), reuse_loss, 6)
    assert max_rel(ours, ref) < 1e-5, (ours, ref)
    assert_masters_close(engine, ref_model)
    assert engine.gradient_copies == 0


class WeightUsedOutsideItsUnit(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(16, 16)
        self.fc2 = torch.nn.Linear(16, 16)

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x))) @ self.fc1.weight.t()  # fc1's weight again, outside fc1


@pytest.mark.parametrize("stage", [0, 3])
def test_parameter_used_outside_its_unit_is_named(stage):
    torch.manual_seed(1)
    engine, _, _, _ = st.initialize(model=WeightUsedOutsideItsUnit(), config=config(stage))
    with pytest.raises(strata.Unsupported, match=r"parameter 'fc1.weight' \(unit 'fc1'\) was used by .* in no unit"):
        engine(mlp_batch(0)[0])
    # Declared as one unit (the root, holding both for the whole pass), the same model trains.
    torch.manual_seed(1)
    engine, _, _, _ = st.initialize(model=WeightUsedOutsideItsUnit(), config=config(stage), units=lambda n, m: False)
    assert len(train_engine(engine, mlp_loss, 2)) == 2


class ReadsWeightMetadataOutsideItsUnit(WeightUsedOutsideItsUnit):
    """Casts its input to fc1's dtype outside fc1, as Hugging Face models do (ViT's `weight.dtype`)."""

    def __init__(self, read="dtype"):
        super().__init__()
        self.read = read

    def forward(self, x):
        if self.read == "dtype":
            x = x.to(self.fc1.weight.dtype) if self.fc1.weight.is_floating_point() else x
        else:
            x = x.reshape(-1, self.fc1.weight.shape[1])  # the shape is not kept by a stage-3 placeholder
        return self.fc2(torch.tanh(self.fc1(x)))


@pytest.mark.parametrize("stage", [0, 3])
def test_reading_a_parameters_dtype_outside_its_unit_is_allowed_its_shape_is_not(stage):
    torch.manual_seed(1)
    engine, _, _, _ = st.initialize(model=ReadsWeightMetadataOutsideItsUnit("dtype"), config=config(stage))
    assert len(train_engine(engine, mlp_loss, 2)) == 2
    torch.manual_seed(1)
    engine, _, _, _ = st.initialize(model=ReadsWeightMetadataOutsideItsUnit("shape"), config=config(stage))
    with pytest.raises(strata.Unsupported, match=r"parameter 'fc1.weight' \(unit 'fc1'\) was used by reading .shape in no unit"):
        engine(mlp_batch(0)[0])


# -- a pass that raises ------------------------------------------------------------------------
class Flaky(torch.nn.Module):
    """An MLP whose forward raises when told to, after its first unit ran (held at stage 3)."""

    def __init__(self):
        super().__init__()
        self.net = make_mlp()
        self.fail_next = False

    def forward(self, x):
        h = self.net[1](self.net[0](x))
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("the data loader handed a bad batch")
        return self.net[4](self.net[3](self.net[2](h)))


@pytest.mark.parametrize("stage,offload", [(0, "none"), (2, "cpu"), (3, "cpu")])
def test_a_forward_that_raises_drops_the_step_and_training_goes_on(stage, offload):
    """A forward raising mid-step (in the step's second micro-batch, a unit held) drops the step
    (Engine::abandon_step); the loop then runs the step's batches again and the losses are those of
    a run in which nothing failed, bit for bit."""
    def run(fail_at):
        engine, _, _, _ = st.initialize(model=Flaky(), config=config(stage, offload, offload if stage == 3 else "none"))
        losses, index, calls = [], 0, 0
        while len(losses) < 4:
            step_start = index - index % 2
            try:
                for _ in range(2):
                    calls += 1
                    engine.module.fail_next = calls == fail_at
                    loss = mlp_loss(engine, index)
                    engine.backward(loss)
                    engine.step()
                    index += 1
            except RuntimeError as error:
                assert "bad batch" in str(error)
                index = step_start  # the step's batches again
                continue
            losses.append(engine.metrics["loss"])
        return losses, engine.master_parameters()

    clean_losses, clean_masters = run(fail_at=None)
    losses, masters = run(fail_at=4)  # step 2, second micro-batch
    assert losses == clean_losses
    for name, value in clean_masters.items():
        assert torch.equal(masters[name], value), name


def test_no_sync_around_all_but_the_last_micro_batch_changes_nothing():
    engine, _, _, _ = st.initialize(model=make_lm(), config=config(2, "cpu", accum=2))
    losses = []
    for step in range(3):
        with engine.no_sync():
            engine.backward(lm_loss(engine, 2 * step))
            engine.step()
        with pytest.raises(strata.FailedPrecondition, match="micro-batch 2 of 2 under no_sync"):
            with engine.no_sync():
                lm_loss(engine, 2 * step + 1)
        engine.backward(lm_loss(engine, 2 * step + 1))  # the last one, outside: the step's reduction
        engine.step()
        losses.append(engine.metrics["loss"])
    reference, _, _, _ = st.initialize(model=make_lm(), config=config(2, "cpu", accum=2))
    assert losses == train_engine(reference, lm_loss, 3)


def test_synchronize_waits_for_the_queued_update_and_is_refused_mid_step():
    engine, _, _, _ = st.initialize(model=make_lm(), config=config(2, "cpu", accum=2))
    train_engine(engine, lm_loss, 2)
    engine.synchronize()  # the last step's update (overlapped with the next forward) is done and committed
    before = engine.master_parameters()
    engine.synchronize()
    assert all(torch.equal(before[n], t) for n, t in engine.master_parameters().items())
    engine.backward(lm_loss(engine, 4))
    engine.step()  # off the boundary: the step is open
    with pytest.raises(strata.FailedPrecondition, match="middle of a step"):
        engine.synchronize()
