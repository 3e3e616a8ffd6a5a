"""StrataEngine.export_hf (strata/_torch_export.py): the trained model as
safetensors by parameter name plus config.json, read back here by a
minimal reader and (where transformers is installed) by from_pretrained,
with the same logits as the engine's own forward."""
import json
import os
import struct

import pytest
import torch

import strata.torch as st
from strata.errors import FailedPrecondition
from test_torch_frontend import SEQ, VOCAB, TinyLM, config, lm_loss, make_lm, train_engine

_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I64": torch.int64,
           "BOOL": torch.bool, "U8": torch.uint8}


def read_safetensors(path):
    """{name: tensor} of a .safetensors file (format: u64 header length, JSON header, data)."""
    with open(path, "rb") as f:
        data = f.read()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    header.pop("__metadata__", None)
    out = {}
    for name, info in header.items():
        begin, end = info["data_offsets"]
        raw = bytearray(data[8 + length + begin:8 + length + end])
        out[name] = torch.frombuffer(raw, dtype=_DTYPES[info["dtype"]]).reshape(info["shape"]) if raw else \
            torch.empty(info["shape"], dtype=_DTYPES[info["dtype"]])
    return out


def trained(stage=3, optimizer="cpu", params="cpu", nvme_dir=None, bf16=False, steps=3):
    cfg = config(stage, optimizer, params, nvme_dir=nvme_dir)
    if bf16:
        cfg["bf16"] = {"enabled": True}
    engine, _, _, _ = st.initialize(model=make_lm(), config=cfg)
    train_engine(engine, lm_loss, steps)
    return engine


def eval_logits(model_or_engine, ids):
    with torch.no_grad():
        out = model_or_engine(ids)
    return getattr(out, "logits", out)


def test_export_reads_back_and_gives_the_engines_logits(tmp_path):
    engine = trained()
    written = engine.export_hf(tmp_path / "out")
    assert [os.path.basename(p) for p in written] == ["model.safetensors"]
    assert sorted(os.listdir(tmp_path / "out")) == ["model.safetensors"]  # no temporary left, no config (not HF)
    tensors = read_safetensors(tmp_path / "out" / "model.safetensors")
    names = [n for n, _ in TinyLM().named_parameters()]
    assert sorted(tensors) == sorted(names)  # the tied head is written once, under the embedding's name
    assert "head.weight" not in tensors
    masters = engine.master_parameters()
    for name in names:
        assert torch.equal(tensors[name], masters[name]), name  # fp32: the parameters are the masters
    model = TinyLM()
    model.load_state_dict(tensors, strict=False)
    model.head.weight = model.wte.weight
    ids = torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(9))
    assert torch.equal(eval_logits(model, ids), eval_logits(engine, ids))


def test_bf16_export_writes_the_working_copy_and_fp32_the_masters(tmp_path):
    engine = trained(stage=3, optimizer="cpu", params="cpu", bf16=True)
    engine.export_hf(tmp_path / "bf16")
    engine.export_hf(tmp_path / "fp32", dtype=torch.float32)
    low = read_safetensors(tmp_path / "bf16" / "model.safetensors")
    high = read_safetensors(tmp_path / "fp32" / "model.safetensors")
    masters = engine.master_parameters()
    for name, value in low.items():
        assert value.dtype == torch.bfloat16 and high[name].dtype == torch.float32
        assert torch.equal(high[name], masters[name]), name
        assert torch.equal(value, masters[name].to(torch.bfloat16)), name  # the working copy: masters rounded


def test_sharded_export_has_an_index_covering_every_tensor(tmp_path):
    engine = trained(stage=2, optimizer="none", params="none")
    written = engine.export_hf(tmp_path / "out", max_shard_size="20KB")
    shards = sorted(p for p in written if p.endswith(".safetensors"))
    assert len(shards) > 2
    with open(tmp_path / "out" / "model.safetensors.index.json") as f:
        index = json.load(f)
    merged = {}
    for path in shards:
        part = read_safetensors(path)
        assert os.path.getsize(path) <= 20_000 + 4096 or len(part) == 1
        for name in part:
            assert index["weight_map"][name] == os.path.basename(path)
        merged.update(part)
    assert sorted(merged) == sorted(index["weight_map"])
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in merged.values())
    masters = engine.master_parameters()
    assert all(torch.equal(merged[n], masters[n]) for n in masters)


def test_nvme_parameters_export(tmp_path):
    (tmp_path / "nvme").mkdir()
    engine = trained(stage=3, optimizer="nvme", params="nvme", nvme_dir=tmp_path / "nvme")
    engine.export_hf(tmp_path / "out")
    tensors = read_safetensors(tmp_path / "out" / "model.safetensors")
    masters = engine.master_parameters()
    assert all(torch.equal(tensors[n], masters[n]) for n in masters)


def test_bad_export_arguments_are_refused_naming_them(tmp_path):
    engine = trained(stage=0, optimizer="none", params="none", steps=1)
    for size, error in (("5XB", ValueError), (0, ValueError), (True, TypeError), (2 ** 60, ValueError),
                        (1.5, TypeError)):
        with pytest.raises(error, match="max_shard_size"):
            engine.export_hf(tmp_path / "a", max_shard_size=size)
    with pytest.raises(ValueError, match="dtype"):
        engine.export_hf(tmp_path / "a", dtype=torch.float16)
    with pytest.raises(ValueError, match="safetensors only"):
        engine.export_hf(tmp_path / "a", safe_serialization=False)
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match="is not a folder"):
        engine.export_hf(tmp_path / "file")
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    with pytest.raises(ValueError, match="symbolic link"):
        engine.export_hf(tmp_path / "link")
    assert os.listdir(tmp_path / "real") == []
    # A link planted where the export writes its temporary file: refused, the link's target untouched.
    (tmp_path / "planted").mkdir()
    (tmp_path / "outside.bin").write_bytes(b"keep")
    os.symlink(tmp_path / "outside.bin", tmp_path / "planted" / "model.safetensors.tmp")
    with pytest.raises(ValueError, match="symbolic link"):
        engine.export_hf(tmp_path / "planted")
    assert (tmp_path / "outside.bin").read_bytes() == b"keep"
    # In the middle of a step: refused; the step goes on.
    engine.backward(lm_loss(engine, 0))
    engine.step()  # off the accumulation boundary: the step is still open
    with pytest.raises(FailedPrecondition, match="middle of a step"):
        engine.export_hf(tmp_path / "b")
    assert not (tmp_path / "b").exists()
    engine.backward(lm_loss(engine, 1))
    engine.step()
    engine.export_hf(tmp_path / "b")
    assert os.path.exists(tmp_path / "b" / "model.safetensors")


transformers = pytest.importorskip("transformers") if os.environ.get("STRATA_REQUIRE_TRANSFORMERS") != "1" \
    else __import__("transformers")


def tiny_gpt2(seed=11):
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(vocab_size=96, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                                  resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(cfg)


def gpt2_batch(index):
    g = torch.Generator().manual_seed(500 + index)
    return torch.randint(0, 96, (2, 16), generator=g)


@pytest.mark.parametrize("placement", ["cpu", "nvme"])
def test_gpt2_export_loads_with_from_pretrained_and_gives_the_same_logits(tmp_path, placement):
    zero = {"stage": 3, "offload_optimizer": {"device": placement}, "offload_param": {"device": placement},
            "stage3_param_persistence_threshold": 0}
    if placement == "nvme":
        (tmp_path / "nvme").mkdir()
        zero["offload_optimizer"]["nvme_path"] = zero["offload_param"]["nvme_path"] = str(tmp_path / "nvme")
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
           "zero_optimization": zero, "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "weight_decay": 0.01}},
           "strata": {"device": "cpu", "device_memory": "64MiB"}}
    engine, _, _, _ = st.initialize(model=tiny_gpt2(), config=cfg)
    engine.train()
    losses = []
    for _ in range(4):
        ids = gpt2_batch(0)  # one batch, learnt
        loss = engine(input_ids=ids, labels=ids).loss
        engine.backward(loss)
        engine.step()
        losses.append(engine.metrics["loss"])
    assert losses[-1] < losses[0]
    engine.export_hf(tmp_path / "gpt2")
    assert {"model.safetensors", "config.json"} <= set(os.listdir(tmp_path / "gpt2"))
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path / "gpt2")
    loaded.eval()
    engine.eval()
    ids = gpt2_batch(99)
    with torch.no_grad():
        ours = engine(input_ids=ids).logits
        theirs = loaded(input_ids=ids).logits
    assert torch.equal(ours, theirs)
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()  # tied again on load
