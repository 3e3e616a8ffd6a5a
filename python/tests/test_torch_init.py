"""strata.torch.init (Note [Construction on meta]): a model built under it
has its parameters on the meta device and never whole in memory;
initialize makes each unit's values by the modules' own rules just before
handing them to the engine. On torch 1.13 (no parameter-registration hook)
the parameters made by torch.empty are the ones on meta (Note [Empty on
meta]); those a constructor computes stay real and keep their values."""
import math
import os
import warnings

import pytest
import torch

import strata
import strata.errors
import strata.torch as st
from strata.torch import GatheredParameters

# torch >= 2.0: every parameter is on meta; torch 1.13: those made by torch.empty (Note [Empty on meta]).
HAS_HOOK = hasattr(torch.nn.modules.module, "register_module_parameter_registration_hook")

VOCAB = 64
SEQ = 12
MICRO = 4


class Block(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.ln = torch.nn.LayerNorm(d)
        self.fc = torch.nn.Linear(d, 4 * d)
        self.out = torch.nn.Linear(4 * d, d)
        self.register_buffer("scale", torch.arange(1, d + 1, dtype=torch.float32) / d)

    def forward(self, x):
        return x + self.out(torch.nn.functional.gelu(self.fc(self.ln(x)))) * self.scale


class TiedLM(torch.nn.Module):
    _no_split_modules = ["Block"]

    def __init__(self, d=32, layers=3):
        super().__init__()
        self.wte = torch.nn.Embedding(VOCAB, d)
        self.blocks = torch.nn.ModuleList(Block(d) for _ in range(layers))
        self.ln_f = torch.nn.LayerNorm(d)
        self.head = torch.nn.Linear(d, VOCAB, bias=False)
        self.head.weight = self.wte.weight  # tied: the embedding made it

    def forward(self, ids):
        x = self.wte(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def lm_loss(model, index):
    g = torch.Generator().manual_seed(4000 + index)
    ids = torch.randint(0, VOCAB, (MICRO, SEQ + 1), generator=g)
    return torch.nn.functional.cross_entropy(model(ids[:, :-1]).reshape(-1, VOCAB), ids[:, 1:].reshape(-1))


def config(stage=0, optimizer="none", params="none", nvme_dir=None, with_optimizer=True):
    zero = {"stage": stage, "offload_optimizer": {"device": optimizer}, "offload_param": {"device": params},
            "stage3_param_persistence_threshold": 0, "reduce_bucket_size": 100000}
    for section, device in (("offload_optimizer", optimizer), ("offload_param", params)):
        if device == "nvme":
            zero[section]["nvme_path"] = str(nvme_dir)
    cfg = {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": 1, "zero_optimization": zero,
           "strata": {"device": "cpu", "device_memory": "64MiB"}}
    if with_optimizer:
        cfg["optimizer"] = {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}}
    return cfg


def build_under_init(cls=TiedLM, seed=7, cfg=None):
    torch.manual_seed(seed)
    with st.init(config=cfg):
        return cls()


def train(engine, steps=4):
    losses = []
    for index in range(steps):
        loss = lm_loss(engine, index)
        engine.backward(loss)
        engine.step()
        losses.append(engine.metrics["loss"])
    return losses


def values_after_initialize(model, cfg):
    engine, _, _, _ = st.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    with GatheredParameters(list(model.parameters())):
        values = {n: p.detach().clone() for n, p in model.named_parameters()}
    return engine, values


def test_parameters_are_built_on_meta_and_buffers_stay_real():
    model = build_under_init()
    assert {p.device.type for p in model.parameters()} == {"meta"}
    assert model.head.weight is model.wte.weight
    for block in model.blocks:  # a buffer's value is computed by its constructor and kept
        assert block.scale.device.type == "cpu"
        assert torch.equal(block.scale, torch.arange(1, 33, dtype=torch.float32) / 32)
    # outside the context, modules are built as usual
    assert torch.nn.Linear(3, 3).weight.device.type == "cpu"


def test_initialize_makes_values_by_the_modules_own_rules():
    model = build_under_init()
    engine, values = values_after_initialize(model, config())
    assert model.head.weight is model.wte.weight
    for name, value in values.items():
        assert torch.isfinite(value).all(), name
    for i in range(3):  # LayerNorm.reset_parameters: ones and zeros
        assert torch.equal(values[f"blocks.{i}.ln.weight"], torch.ones(32))
        assert torch.equal(values[f"blocks.{i}.ln.bias"], torch.zeros(32))
        # Linear.reset_parameters: kaiming-uniform, every value within 1/sqrt(fan_in)
        for layer, fan_in in (("fc", 32), ("out", 128)):
            weight = values[f"blocks.{i}.{layer}.weight"]
            assert weight.abs().max() <= 1 / math.sqrt(fan_in)
            assert weight.std() > 0.4 / math.sqrt(fan_in)
    # The tied weight keeps the embedding's N(0, 1), not the head's kaiming bound (1/sqrt(32) = 0.18): as eagerly.
    assert 0.8 < float(values["wte.weight"].std()) < 1.2
    # The units' values differ from each other (the random stream moves on between units).
    assert not torch.equal(values["blocks.0.fc.weight"], values["blocks.1.fc.weight"])
    assert train(engine, 2)[0] > 0


def test_losses_bit_identical_across_stages_and_placements(tmp_path):
    runs = {}
    for key, cfg in (("stage 0", config()), ("stage 2 optimizer cpu", config(2, "cpu")),
                     ("stage 3 optimizer and parameters on nvme", config(3, "nvme", "nvme", tmp_path))):
        model = build_under_init()
        engine, _, _, _ = st.initialize(model=model, model_parameters=model.parameters(), config=cfg)
        runs[key] = train(engine)
    assert runs["stage 2 optimizer cpu"] == runs["stage 0"]
    assert runs["stage 3 optimizer and parameters on nvme"] == runs["stage 0"]
    assert runs["stage 0"][-1] < runs["stage 0"][0]


def test_a_client_optimizer_over_the_meta_parameters_follows_them():
    model = build_under_init()
    no_decay = [p for n, p in model.named_parameters() if n.endswith(".bias") or ".ln" in n]
    decay = [p for n, p in model.named_parameters() if not (n.endswith(".bias") or ".ln" in n)]
    client = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                               lr=1e-2)
    engine, optimizer, _, _ = st.initialize(model=model, optimizer=client, config=config(with_optimizer=False))
    for group in optimizer.param_groups:
        assert all(p.device.type == "cpu" for p in group["params"])
    ids = {id(p) for group in optimizer.param_groups for p in group["params"]}
    assert ids == {id(p) for p in model.parameters()}
    losses = train(engine, 3)
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]


class Unreproducible(torch.nn.Module):
    """A gain the constructor fills in place after registering it: no rule makes that value again."""

    def __init__(self, how="fill", size=8):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        if how == "fill":
            self.gain = torch.nn.Parameter(torch.empty(size))
            with torch.no_grad():
                self.gain.fill_(0.5)
        elif how == "data":
            self.gain = torch.nn.Parameter(torch.empty(size))
            self.gain.data.normal_()
        else:  # "large": the value is the constructor's expression, but too large to keep beside the meta stand-in
            self.gain = torch.nn.Parameter(torch.randn(size))

    def forward(self, x):
        return self.proj(x) * self.gain[:8]


@pytest.mark.parametrize("how,size", [("fill", 8), ("data", 8), ("large", 64 * 1024 + 1)])
def test_a_parameter_no_rule_remakes_is_refused_by_name(how, size):
    if how == "large" and not HAS_HOOK:
        pytest.skip("torch 1.13 builds torch.randn's parameter for real and keeps its value "
                    "(test_on_torch_1_13_a_computed_parameter_keeps_its_value_at_any_size)")
    model = build_under_init(lambda: Unreproducible(how, size))
    with pytest.raises(ValueError, match=r"parameter 'gain' was built on the meta device .*its module \(Unreproducible\) has no reset_parameters"):
        st.initialize(model=model, config=config())


class ConstructorValues(torch.nn.Module):
    """Values that exist only in the constructor's expressions (CLIP's logit_scale, a layer scale)."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.logit_scale = torch.nn.Parameter(torch.tensor(2.6592))
        self.layer_scale = torch.nn.Parameter(1e-6 * torch.ones(8))

    def forward(self, x):
        return self.proj(x) * self.layer_scale * self.logit_scale.exp()


def test_a_value_only_the_constructor_gives_is_kept():
    """Note [Values constructors give]: a small parameter that no initializer wrote keeps its constructor's value."""
    model = build_under_init(ConstructorValues)
    assert model.proj.weight.is_meta
    # torch 1.13: the computed ones are real (Note [Empty on meta])
    assert model.logit_scale.is_meta == model.layer_scale.is_meta == HAS_HOOK
    engine, values = values_after_initialize(model, config())
    assert torch.equal(values["logit_scale"], torch.tensor(2.6592))
    assert torch.equal(values["layer_scale"], 1e-6 * torch.ones(8))
    assert not torch.isnan(values["proj.weight"]).any()  # its rule (reset_parameters) made it, not a kept value


def test_a_model_built_under_torch_device_meta_is_refused_naming_the_buffer():
    if not hasattr(torch, "device") or not hasattr(torch.device("meta"), "__enter__"):
        pytest.skip("torch < 2.0 has no device context manager")
    with torch.device("meta"):
        model = TiedLM()
    with pytest.raises(ValueError, match=r"buffer 'blocks.0.scale' is on the meta device.*st.init"):
        st.initialize(model=model, config=config())


def test_init_disabled_builds_normally():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with st.init(enabled=False):
            model = TiedLM()
    assert {p.device.type for p in model.parameters()} == {"cpu"}


def test_on_torch_1_13_a_computed_parameter_keeps_its_value_at_any_size():
    if HAS_HOOK:
        pytest.skip("torch >= 2.0 puts every parameter on meta (test_a_parameter_no_rule_remakes_is_refused_by_name)")
    torch.manual_seed(3)
    model = build_under_init(lambda: Unreproducible("large", 64 * 1024 + 1))
    assert model.proj.weight.is_meta and not model.gain.is_meta
    gain = model.gain.detach().clone()
    engine, values = values_after_initialize(model, config())
    assert torch.equal(values["gain"], gain)
    assert not torch.isnan(values["proj.weight"]).any()  # its rule (reset_parameters) made it


class FilledFromEmpty(torch.nn.Module):
    """A buffer made by torch.empty and filled: on torch 1.13 st.init cannot keep its value."""

    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.register_buffer("offset", torch.empty(8).fill_(0.25))

    def forward(self, x):
        return self.proj(x) + self.offset


def test_on_torch_1_13_a_buffer_filled_from_empty_is_refused_by_name():
    if HAS_HOOK:
        pytest.skip("torch >= 2.0 keeps every buffer real under st.init")
    model = build_under_init(FilledFromEmpty)
    assert model.offset.is_meta
    with pytest.raises(ValueError, match=r"buffer 'offset' is on the meta device"):
        st.initialize(model=model, config=config())
    # Outside st.init the same module is real, and so is everything torch.empty makes.
    assert not FilledFromEmpty().offset.is_meta and not torch.empty(3).is_meta


transformers = None
if os.environ.get("STRATA_REQUIRE_TRANSFORMERS") == "1":
    import transformers
else:
    try:
        import transformers
    except ImportError:
        pass


@pytest.mark.skipif(transformers is None, reason="transformers is not installed")
def test_a_hugging_face_model_gets_its_own_initialization():
    cfg = transformers.GPT2Config(vocab_size=96, n_positions=32, n_embd=48, n_layer=3, n_head=4, resid_pdrop=0.0,
                                  embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    eager = transformers.GPT2LMHeadModel(cfg)
    torch.manual_seed(0)
    with st.init(config="ds.json"):  # DeepSpeed's signature: the engine reads the config in initialize
        model = transformers.GPT2LMHeadModel(cfg)
    real = {n for n, p in model.named_parameters() if not p.is_meta}
    # torch 1.13: Conv1D's biases come from torch.zeros and stay real (Note [Empty on meta])
    conv1d_biases = {n for n, _ in model.named_parameters() if n.endswith(".bias") and (".attn." in n or ".mlp." in n)}
    assert len(conv1d_biases) == 12 and real == (set() if HAS_HOOK else conv1d_biases)
    engine, values = values_after_initialize(model, config(3, "cpu", "cpu"))
    assert model.lm_head.weight is model.transformer.wte.weight
    for name, reference in eager.named_parameters():
        got, reference = values[name], reference.detach()
        if reference.std() == 0:  # LayerNorm ones, zero biases: exactly
            assert torch.equal(got, reference), name
        else:  # N(0, 0.02); the projections N(0, 0.02 / sqrt(2 n_layer)): the same rule, other draws
            assert abs(float(got.std()) / float(reference.std()) - 1) < 0.15, name
    assert abs(float(values["transformer.h.1.mlp.c_proj.weight"].std()) - 0.02 / math.sqrt(6)) < 0.002
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(4):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(engine.metrics["loss"])
    assert losses[-1] < losses[0]


# -- initial_weights: a safetensors checkpoint read a tensor at a time ---------------------------------------------
def tiny_gpt2_config():
    return transformers.GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=4, resid_pdrop=0.0,
                                   embd_pdrop=0.0, attn_pdrop=0.0)


def gpt2_losses(engine, steps=3):
    ids = torch.randint(0, 96, (2, 16), generator=torch.Generator().manual_seed(5))
    losses = []
    for _ in range(steps):
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(engine.metrics["loss"])
    return losses


def gathered(model):
    with GatheredParameters(list(model.parameters())):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.fixture
def trained_export(tmp_path):
    """A GPT-2 trained 2 steps through the engine, exported in fp32 (its master weights), sharded small."""
    torch.manual_seed(3)
    model = transformers.GPT2LMHeadModel(tiny_gpt2_config())
    engine, _, _, _ = st.initialize(model=model, model_parameters=model.parameters(), config=config(2, "cpu"))
    gpt2_losses(engine, 2)
    out = tmp_path / "export"
    engine.export_hf(str(out), dtype=torch.float32, max_shard_size="40KB")
    assert (out / "model.safetensors.index.json").exists()
    return out


@pytest.mark.skipif(transformers is None, reason="transformers is not installed")
def test_initial_weights_from_a_sharded_export_equal_from_pretrained(trained_export, tmp_path):
    for folder in ("a", "b"):
        (tmp_path / folder).mkdir()
    reference = transformers.GPT2LMHeadModel.from_pretrained(str(trained_export))
    expected = {n: p.detach().clone() for n, p in reference.named_parameters()}
    engine, _, _, _ = st.initialize(model=reference, model_parameters=reference.parameters(),
                                    config=config(3, "nvme", "nvme", tmp_path / "a"))
    reference_losses = gpt2_losses(engine)

    with st.init():
        model = transformers.GPT2LMHeadModel(tiny_gpt2_config())
    engine, _, _, _ = st.initialize(model=model, model_parameters=model.parameters(),
                                    config=config(3, "nvme", "nvme", tmp_path / "b"), initial_weights=trained_export)
    assert model.lm_head.weight is model.transformer.wte.weight
    values = gathered(model)
    for name, value in expected.items():
        assert torch.equal(values[name], value), name
    assert gpt2_losses(engine) == reference_losses


@pytest.mark.skipif(transformers is None, reason="transformers is not installed")
def test_initial_weights_of_the_base_model_fill_the_head_model_and_an_eager_model(tmp_path):
    torch.manual_seed(4)
    base = transformers.GPT2Model(tiny_gpt2_config())  # keys without "transformer."
    base.save_pretrained(str(tmp_path / "base"))
    for build_on_meta in (True, False):
        if build_on_meta:
            with st.init():
                model = transformers.GPT2LMHeadModel(tiny_gpt2_config())
        else:
            model = transformers.GPT2LMHeadModel(tiny_gpt2_config())
        st.initialize(model=model, model_parameters=model.parameters(), config=config(),
                      initial_weights=tmp_path / "base" / "model.safetensors")
        values = gathered(model)
        for name, p in base.named_parameters():
            assert torch.equal(values["transformer." + name], p.detach()), (build_on_meta, name)
        assert model.lm_head.weight is model.transformer.wte.weight


def write_safetensors(path, tensors, header_edit=None, cut=0):
    """A safetensors file by hand (the tests' bad files)."""
    import json
    import struct
    header, blobs, offset = {}, [], 0
    for key, t in tensors.items():
        raw = t.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        header[key] = {"dtype": {torch.float32: "F32", torch.int32: "I32"}[t.dtype], "shape": list(t.shape),
                       "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    if header_edit:
        header_edit(header)
    text = json.dumps(header).encode()
    data = struct.pack("<Q", len(text)) + text + b"".join(blobs)
    path.write_bytes(data[:len(data) - cut] if cut else data)


def mlp():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))


def mlp_tensors():
    return {n: p.detach().clone() + 1 for n, p in mlp().named_parameters()}


def test_initial_weights_of_a_plain_torch_model(tmp_path):
    write_safetensors(tmp_path / "w.safetensors", mlp_tensors())
    model = mlp()
    st.initialize(model=model, config=config(), initial_weights=tmp_path / "w.safetensors")
    values = gathered(model)
    for name, value in mlp_tensors().items():
        assert torch.equal(values[name], value), name


@pytest.mark.parametrize("case, match", [
    ("missing", r"has no tensor for parameter\(s\) '1.bias'"),
    ("shape", r"tensor '0.weight' has shape \[4, 8\], parameter '0.weight' has \[8, 4\]"),
    ("int", r"tensor '0.bias'.*dtype I32 is not one of"),
    ("offsets", r"tensor '0.weight'.*data_offsets .* span 4 bytes, its shape \[8, 4\] in F32 needs 128"),
    ("truncated", r"tensor '1.bias'.*lie past the end of the file"),
    ("header", r"header length 1000 at offset 0 runs past the end of the file \(10 bytes\)"),
    ("huge header", r"header length 1099511627776 at offset 0 is over safetensors' 100 MiB limit"),
    ("not json", r"the header .* is not JSON"),
])
def test_bad_initial_weights_are_refused_by_name(tmp_path, case, match):
    path = tmp_path / "w.safetensors"
    tensors = mlp_tensors()
    if case == "missing":
        del tensors["1.bias"]
        write_safetensors(path, tensors)
    elif case == "shape":
        tensors["0.weight"] = tensors["0.weight"].t().contiguous()
        write_safetensors(path, tensors)
    elif case == "int":
        tensors["0.bias"] = torch.zeros(8, dtype=torch.int32)
        write_safetensors(path, tensors)
    elif case == "offsets":
        write_safetensors(path, tensors, header_edit=lambda h: h["0.weight"].update(data_offsets=[0, 4]))
    elif case == "truncated":
        write_safetensors(path, tensors, cut=3)
    elif case == "header":
        path.write_bytes((1000).to_bytes(8, "little") + b"{}")
    elif case == "huge header":
        path.write_bytes((1 << 40).to_bytes(8, "little") + b"{}")
    elif case == "not json":
        path.write_bytes((4).to_bytes(8, "little") + b"{{{{")
    model = mlp()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(strata.errors.StrataError, match=match):
        st.initialize(model=model, config=config(), initial_weights=path)
    for name, p in model.named_parameters():  # refused before anything was made: the model is as it was
        assert torch.equal(p.detach(), before[name])


def test_initial_weights_folders_are_checked(tmp_path):
    import json
    with pytest.raises(strata.errors.NotFound, match="holds neither model.safetensors nor"):
        st.initialize(model=mlp(), config=config(), initial_weights=tmp_path)
    with pytest.raises(strata.errors.NotFound, match="is neither a safetensors file nor a folder"):
        st.initialize(model=mlp(), config=config(), initial_weights=tmp_path / "absent")
    folder = tmp_path / "ckpt"
    folder.mkdir()
    outside = tmp_path / "outside.safetensors"
    write_safetensors(outside, mlp_tensors())
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"0.weight": "../outside.safetensors"}}))
    with pytest.raises(strata.errors.InvalidArgument, match="not a plain file name in the folder"):
        st.initialize(model=mlp(), config=config(), initial_weights=folder)
    os.symlink(outside, folder / "link.safetensors")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"0.weight": "link.safetensors"}}))
    with pytest.raises(strata.errors.InvalidArgument, match="is a link leading out of"):
        st.initialize(model=mlp(), config=config(), initial_weights=folder)


def test_init_with_a_fit_plans_from_the_meta_shapes(tmp_path):
    # The fit reads only shapes: it runs on the meta model before any unit is made.
    model = build_under_init()
    cfg = config()
    cfg["zero_optimization"] = {"stage": 0}
    engine, _, _, _ = st.initialize(model=model, model_parameters=model.parameters(), config=cfg,
                                    fit={"device_memory": "2MiB", "host_memory": "64MiB", "nvme_path": str(tmp_path)})
    assert engine.fit is not None and engine.fit["best"]["label"].startswith("s")
    losses = train(engine, 3)
    assert all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]


class Reassigning(torch.nn.Module):
    """reset_parameters gives the weight new memory instead of writing into it."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(4, 4))
        torch.nn.init.zeros_(self.weight)  # (in place: a meta tensor takes no new memory)

    def reset_parameters(self):
        self.weight.data = torch.arange(16, dtype=torch.float32).reshape(4, 4) / 16

    def forward(self, x):
        return x @ self.weight


def test_a_rule_that_replaces_a_parameters_memory_still_hands_its_values_in():
    model = build_under_init(lambda: torch.nn.Sequential(Reassigning(), torch.nn.Linear(4, 2)))
    st.initialize(model=model, model_parameters=model.parameters(), config=config())
    values = gathered(model)
    assert torch.equal(values["0.weight"], torch.arange(16, dtype=torch.float32).reshape(4, 4) / 16)
