"""strata.torch.bench: `strata bench offload` for the user's own model
(docs/torch.md, "What does offload cost for my model?"). Small on purpose (a
tiny model, 2 measured steps, 2 rows): CI runs this suite twice on 2 cores."""
import json
import math
import subprocess
import sys

import pytest
import torch

from conftest import small_model
from strata.errors import InvalidArgument, Unavailable
import strata.torch.bench as sb
from strata.torch import _bench_report
from strata.torch._bench_rows import default_rows, load_rows_file

VOCAB = 50
TWO_ROWS = [{"stage": 0}, {"stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"}]


def batch_of(i):
    g = torch.Generator().manual_seed(7 + i)
    return torch.randint(0, VOCAB, (4, 8), generator=g), torch.randint(0, VOCAB, (4, 8), generator=g)


def loss_of(output, micro_batch):
    return torch.nn.functional.cross_entropy(output.reshape(-1, VOCAB), micro_batch[1].reshape(-1))


class TokensOnly(torch.nn.Module):
    """small_model taking (ids, targets) as train_batch passes a tuple: engine(*mb)."""

    def __init__(self):
        super().__init__()
        self.net = small_model()

    def forward(self, ids, targets):
        return self.net(ids)


def bench(**kw):
    args = dict(model_fn=TokensOnly, batch_fn=batch_of, loss_fn=loss_of, rows=TWO_ROWS, steps=2, warmup=1,
                repeats=2)
    args.update(kw)
    return sb.offload(**args)


def test_every_row_has_finite_medians_and_the_fastest_row_has_penalty_one(tmp_path):
    out = tmp_path / "bench.json"
    doc = bench(json_path=out)
    assert json.loads(out.read_text()) == json.loads(json.dumps(doc))
    assert doc["bench"] == "offload" and doc["front_end"] == "strata.torch"
    assert [r["label"] for r in doc["rows"]] == ["s0 opt=none param=none fp32", "s3 opt=cpu param=cpu fp32"]
    assert doc["schedule"] == [[0, 1], [1, 0]]  # ABBA: the second repeat runs the rows in reverse
    for r in doc["rows"]:
        assert r["status"] == "ok", r["reason"]
        assert len(r["samples_ms"]) == 4 and len(r["repeat_median_ms"]) == 2
        assert all(math.isfinite(v) and v > 0 for v in r["samples_ms"] + [r["step_ms"]["median"]])
        assert r["tokens_per_s"] > 0 and r["penalty"] >= 1.0
        assert set(r["exposed_ms"]) == {"reduce", "optimizer", "gather", "nvme"}
        assert r["predicted_bytes"]["device"] > 0 and r["peak_bytes"]["device"] > 0
        assert r["peak_over_plan"]["device"] == r["peak_bytes"]["device"] / r["predicted_bytes"]["device"]
    fastest = min(doc["rows"], key=lambda r: r["step_ms"]["median"])
    assert fastest["penalty"] == 1.0 and doc["baseline_row"] == fastest["index"]
    in_memory, offloaded = doc["rows"]
    # The links say where the state lives: nothing crosses to the host in memory; the offloaded row copies every
    # gradient out and every parameter (its update and its stage-3 shard) in.
    assert in_memory["bytes_per_step"]["h2d"] == in_memory["bytes_per_step"]["d2h"] == 0
    assert offloaded["bytes_per_step"]["h2d"] > 0 and offloaded["bytes_per_step"]["d2h"] > 0
    assert offloaded["peak_bytes"]["pinned"] > in_memory["peak_bytes"]["pinned"]


def test_a_row_that_does_not_fit_is_reported_and_the_penalty_is_against_the_fastest_that_fits():
    # The in-memory row's plan holds parameters, gradients and Adam moments on the device (170.75 KiB, in
    # pieces of 2048 elements); the stage-3 row with the state in host memory holds 112 KiB there.
    doc = bench(device_memory="128KiB", repeats=1)
    in_memory, offloaded = doc["rows"]
    assert in_memory["status"] == "does_not_fit"
    assert "device memory" in in_memory["reason"]
    assert offloaded["status"] == "ok" and offloaded["penalty"] == 1.0 and doc["baseline_row"] == 1


def test_a_row_the_config_refuses_is_skipped_and_an_nvme_row_carries_the_configs_warning(tmp_path):
    config = {"train_micro_batch_size_per_gpu": 4, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
              "strata": {"optimizer_state_dtype": "int8"}}
    doc = bench(config=config, rows=[{"stage": 0}, {"stage": 2, "offload_optimizer": "nvme"}], repeats=1,
                nvme_path=tmp_path)
    refused, on_nvme = doc["rows"]
    assert refused["status"] == "skipped" and "the config refuses this placement" in refused["reason"]
    assert "optimizer_state_dtype" in refused["reason"]
    assert on_nvme["status"] == "ok" and on_nvme["penalty"] == 1.0 and doc["nvme_path"] == str(tmp_path)
    assert on_nvme["bytes_per_step"]["nvme_read"] > 0 and on_nvme["peak_bytes"]["nvme"] > 0
    assert any("pipeline_read false" in w for w in on_nvme["warnings"])
    assert doc["schedule"] == [[1]]


def test_with_gradient_accumulation_batch_fn_gets_every_micro_batch_of_a_run_in_order():
    calls = []

    def recorded(i):
        calls.append(i)
        return batch_of(i)

    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    doc = bench(batch_fn=recorded, config=config, rows=[{"stage": 2}], repeats=2)
    (row,) = doc["rows"]
    assert row["status"] == "ok" and len(row["samples_ms"]) == 4
    # micro-batch 0 once to check it, then 3 steps x 2 micro-batches per run, the same for every run
    assert calls == [0] + list(range(6)) * 2
    assert row["tokens_per_s"] == 2 * 4 * 8 / (row["step_ms"]["median"] / 1e3)
    with pytest.raises(InvalidArgument, match="config is not JSON"):
        bench(config={"gradient_clipping": float("nan")})


def test_the_default_matrix_is_the_cpp_benchs():
    labels = [r.label() for r in default_rows("bf16")]
    assert len(labels) == 19 and labels[0] == "s0 opt=none param=none bf16"
    assert labels[-3:] == [f"s3 opt=cpu param=none r={r} bf16" for r in ("0.25", "0.50", "0.75")]
    skipped = [r.label() for r in default_rows("bf16") if r.unsupported_reason()]
    assert skipped == ["s3 opt=none param=cpu bf16", "s3 opt=none param=nvme bf16"]
    nvme = default_rows("fp32")[13].config({"zero_optimization": {"offload_optimizer": {"ratio": 0.5}}}, "/swap")
    assert nvme["zero_optimization"]["offload_optimizer"] == {"device": "nvme", "ratio": 1.0, "nvme_path": "/swap"}
    assert nvme["zero_optimization"]["offload_param"] == {"device": "none"}


def test_a_row_files_labels_are_the_cpp_benchs(tmp_path):
    # The labels `strata plan --model tiny --configs FILE` printed for this file (apps/placement_rows.cpp):
    # plan --bench and the plots match rows by label.
    path = tmp_path / "rows.json"
    path.write_text(json.dumps({"rows": [
        {"stage": 3, "offload_optimizer": "cpu", "offload_param": "cpu"},
        {"stage": 3, "offload_optimizer": "cpu", "ratio": 0.5, "dtype": "fp32"},
        {"stage": 3, "offload_optimizer": "nvme", "optimizer_state_dtype": "int8"},
        {"stage": 3, "offload_optimizer": "nvme", "offload_param": "nvme", "gradient_shards": "nvme"},
        {"stage": 2, "offload_optimizer": "nvme", "pipeline_read": True, "pipeline_write": False,
         "speculative_optimizer": "on"},
        {"stage": 3, "offload_optimizer": "cpu", "ratio": 0.333}]}))
    assert [r.label() for r in load_rows_file(path, "bf16")] == [
        "s3 opt=cpu param=cpu bf16", "s3 opt=cpu param=none r=0.50 fp32", "s3 opt=nvme param=none bf16 m=int8",
        "s3 opt=nvme param=nvme bf16 grads=nvme", "s2 opt=nvme param=none bf16 early=on pipe=r",
        "s3 opt=cpu param=none r=0.333 bf16"]


def test_abba_order_gives_every_row_the_same_mean_position_over_a_pair():
    for count in (2, 3, 5):
        for pair in range(3):
            first, second = sb.abba_order(count, 2 * pair), sb.abba_order(count, 2 * pair + 1)
            assert second == first[::-1] and sorted(first) == list(range(count))
            assert {first.index(i) + second.index(i) for i in range(count)} == {count - 1}


@pytest.mark.parametrize("rows, named", [
    ([{"stage": 0}, {"stage": 3, "offload_optimizer": "disk"}], "rows[1].offload_optimizer: 'disk' is not"),
    ([{"stagee": 3}], "rows[0]: unknown key 'stagee'"),
    ([{"offload_optimizer": "cpu"}], 'rows[0]: "stage" is missing'),
    ([{"stage": 1, "offload_optimizer": "cpu", "offload_param": "cpu"}],
     "rows[0] (s1 opt=cpu param=cpu fp32): parameter offload needs stage 3"),
    ([{"stage": 3, "ratio": 1.5}], "rows[0].ratio: 1.5 is not in (0, 1]"),
    ([{"stage": 2, "dtype": "int4"}], "rows[0].dtype: 'int4' is not"),
    ([{"stage": 2}, {"stage": 2}], "rows[1] (s2 opt=none param=none fp32) is rows[0] again"),
    ([], '"rows" must be a non-empty list'),
])
def test_bad_rows_are_refused_by_name(rows, named):
    with pytest.raises(InvalidArgument) as e:
        bench(rows=rows)
    assert named in str(e.value)


@pytest.mark.parametrize("text, named", [
    ('{"rows": [{"stage": 3, "stage": 2}]}', "the key 'stage' is given twice"),
    ('{"rows": [{"stage": 3,}]}', "line 1 column"),
    ('{"row": [{"stage": 3}]}', "unknown key 'row'"),
    ('{"rows": [{"stage": 3, "pipeline_read": true, "offload_optimizer": "cpu"}]}',
     "rows[0] (s3 opt=cpu param=none fp32 pipe=r): pipeline_read and pipeline_write are the NVMe"),
])
def test_bad_row_files_are_refused_naming_the_file_the_row_and_the_key(tmp_path, text, named):
    path = tmp_path / "rows.json"
    path.write_text(text)
    with pytest.raises(InvalidArgument) as e:
        bench(rows=str(path))
    assert named in str(e.value) and str(path) in str(e.value)


def test_bad_arguments_are_named_before_any_row_runs(tmp_path):
    with pytest.raises(InvalidArgument, match="steps 0 is out of range"):
        bench(steps=0)
    with pytest.raises(InvalidArgument, match=r"plot_path '.*bench.svg' must name a .png file"):
        bench(plot_path=tmp_path / "bench.svg")
    with pytest.raises(InvalidArgument, match="json_path '.*' is a folder"):
        bench(json_path=tmp_path)
    with pytest.raises(InvalidArgument, match="nvme_path '/no/such/folder' is not a folder"):
        bench(rows=[{"stage": 2, "offload_optimizer": "nvme"}], nvme_path="/no/such/folder")
    with pytest.raises(InvalidArgument, match="config is refused with every row .*train_micro_batch_size_per_gpuu"):
        bench(config={"train_micro_batch_size_per_gpuu": 4})
    with pytest.raises(InvalidArgument, match="dtype 'fp8' is not fp32, bf16 or fp16"):
        bench(dtype="fp8")
    with pytest.raises(TypeError, match="batch_fn\\(0\\) returned str with no tensor"):
        bench(batch_fn=lambda i: "text")
    with pytest.raises(InvalidArgument, match="batch_fn is needed: the model has no config.vocab_size"):
        bench(batch_fn=None)


MODULE = """
import torch

VOCAB = 50


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(VOCAB, 16)
        self.head = torch.nn.Linear(16, VOCAB)

    def forward(self, ids, targets):
        return self.head(self.embed(ids))


def build():
    return Net()


def batch(i):
    g = torch.Generator().manual_seed(i)
    return torch.randint(0, VOCAB, (2, 8), generator=g), torch.randint(0, VOCAB, (2, 8), generator=g)


def loss(output, micro_batch):
    return torch.nn.functional.cross_entropy(output.reshape(-1, VOCAB), micro_batch[1].reshape(-1))
"""


def test_the_command_runs_a_module_function_model_with_a_row_file(tmp_path):
    (tmp_path / "tinymodel.py").write_text(MODULE)
    (tmp_path / "rows.json").write_text(json.dumps({"rows": TWO_ROWS}))
    done = subprocess.run([sys.executable, "-m", "strata.torch.bench", "--model", "tinymodel:build", "--batch",
                           "tinymodel:batch", "--loss", "tinymodel:loss", "--rows", "rows.json", "--steps", "2",
                           "--repeats", "2", "--json", "out.json", "--csv", "out.csv"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "s3 opt=cpu param=cpu fp32" in done.stdout and "penalty" in done.stdout
    doc = json.loads((tmp_path / "out.json").read_text())
    assert [r["status"] for r in doc["rows"]] == ["ok", "ok"] and doc["model"]["source"] == "tinymodel:build"
    lines = (tmp_path / "out.csv").read_text().splitlines()
    assert lines[0].startswith("index,label,stage") and len(lines) == 3


def test_the_command_names_the_bad_flag(tmp_path, capsys):
    assert sb.main(["--model", "no_such_module_here:build"]) == 2
    assert "--model 'no_such_module_here:build': cannot import no_such_module_here" in capsys.readouterr().err
    assert sb.main(["--model", "conftest:small_model", "--set", "n_layer=2"]) == 2
    assert "--set is for a Hugging Face config" in capsys.readouterr().err
    assert sb.main(["--model", "conftest:small_model", "--rows", str(tmp_path / "missing.json")]) == 2
    assert "--rows: row file" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        sb.main(["--model", "conftest:small_model", "--steps", "0"])
    assert e.value.code == 2 and "argument --steps: 0 is out of range" in capsys.readouterr().err


def test_the_command_benches_a_hugging_face_model_type_and_draws_the_png(tmp_path, capsys):
    pytest.importorskip("transformers")
    try:
        _bench_report.find_plot_tool()
    except Unavailable:
        pytest.skip("no python with matplotlib to draw the PNG")
    rows = tmp_path / "rows.json"
    rows.write_text(json.dumps({"rows": [{"stage": 2}, {"stage": 2, "offload_optimizer": "cpu"}]}))
    rc = sb.main(["--model", "gpt2", "--set", "n_layer=1", "--set", "n_embd=32", "--set", "n_head=2", "--set",
                  "vocab_size=64", "--set", "n_positions=16", "--batch-size", "2", "--seq", "16", "--rows", str(rows),
                  "--steps", "2", "--repeats", "1", "--warmup", "1", "--json", str(tmp_path / "b.json"),
                  "--plot", str(tmp_path / "b.png"), "--quiet"])
    assert rc == 0, capsys.readouterr().err
    doc = json.loads((tmp_path / "b.json").read_text())
    assert doc["model"]["class"] == "GPT2LMHeadModel" and doc["seq"] == 16 and doc["batch"] == 2
    assert all(r["status"] == "ok" for r in doc["rows"])
    assert (tmp_path / "b.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "b.png.json").exists()


def test_micro_batches_follow_the_engine_to_its_device():
    """The bench moves each micro-batch to engine.device before the step, as a training loop does
    (batch.to(engine.device)): batches made on the CPU train on the GPU. Nested tensors move, other values
    stay, the container's type is kept (a mapping that is not a dict becomes one)."""
    import collections
    from strata.torch.bench import to_device
    meta = torch.device("meta")
    ids = torch.arange(6).reshape(2, 3)
    moved = to_device({"input_ids": ids, "labels": [ids, (ids, "tag")], "n": 3}, meta)
    assert moved["input_ids"].device == meta and moved["labels"][0].device == meta
    assert moved["labels"][1][0].device == meta and moved["labels"][1][1] == "tag" and moved["n"] == 3
    assert isinstance(moved["labels"], list) and isinstance(moved["labels"][1], tuple)
    mapping = collections.UserDict({"input_ids": ids})
    assert to_device(mapping, meta)["input_ids"].device == meta
    assert to_device(ids, torch.device("cpu")) is ids  # already there: not copied
