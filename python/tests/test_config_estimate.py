"""strata.config.check / load and strata.estimate: core's checker and
estimator (the engine behind `strata config check` and `strata estimate`)."""
import json

import pytest

import strata


def test_estimate_matches_the_ledger():
    rows = strata.estimate(params="7B")
    stage0 = [r for r in rows if r["stage"] == 0][0]
    assert stage0["gpu_model_state_bytes"] == 112_000_000_000  # 16 B/param, design.md
    rows = strata.estimate(params=13_000_000_000, gpus_per_node=4)
    by = {(r["stage"], r["offload_optimizer"], r["offload_param"]): r for r in rows}
    assert by[(2, "none", "none")]["gpu_model_state_bytes"] == 71_500_000_000
    assert by[(3, "none", "none")]["gpu_model_state_bytes"] == 52_000_000_000
    assert len(rows) == 16
    assert by[(3, "nvme", "nvme")]["nvme_bytes_per_node"] > 0


def test_estimate_limits_and_fits():
    rows = strata.estimate(params="7B", gpus_per_node=8, gpu_memory="80GB", cpu_memory=512 * 10**9)
    assert all(r["fits"] is not None for r in rows)
    assert any(r["fits"] for r in rows) and not all(r["fits"] for r in rows)
    doc = strata.estimate(params="7B", full=True)
    assert doc["params"] == 7_000_000_000 and "rows" in doc


def test_estimate_precision_and_config():
    bf16_states = strata.estimate(params="1B", optimizer_states="bf16")
    fp32_states = strata.estimate(params="1B")
    assert bf16_states[0]["gpu_model_state_bytes"] < fp32_states[0]["gpu_model_state_bytes"]
    cfg = {"train_micro_batch_size_per_gpu": 1, "bf16": {"enabled": True},
           "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}}}
    rows = strata.estimate(params="1B", config=cfg)
    marked = [r for r in rows if r["config"]]
    assert len(marked) == 1 and marked[0]["stage"] == 3 and marked[0]["offload_optimizer"] == "cpu"


def test_estimate_errors():
    with pytest.raises(strata.InvalidArgument, match="params"):
        strata.estimate(params="seven billion")
    with pytest.raises(strata.InvalidArgument, match="gpus_per_node 0"):
        strata.estimate(params="7B", gpus_per_node=0)
    with pytest.raises(strata.InvalidArgument, match="gpu_memory"):
        strata.estimate(params="7B", gpu_memory="lots")
    with pytest.raises(strata.InvalidArgument, match="(?s)not valid.*stagee"):
        strata.estimate(params="7B", config={"zero_optimization": {"stagee": 3}})


def test_check_finds_misspelled_keys_and_strings_for_booleans():
    issues = strata.config.check({
        "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memroy": True}},
        "aio": {"single_submit": "false"},
    })
    errors = [i for i in issues if i.severity == "error"]
    paths = {i.path for i in errors}
    assert "zero_optimization.offload_optimizer.pin_memroy" in paths
    assert "aio.single_submit" in paths
    typo = [i for i in errors if i.path.endswith("pin_memroy")][0]
    assert "pin_memory" in typo.hint and "pin_memroy" in str(typo)


def test_check_a_file_and_world_size(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"train_batch_size": 32, "train_micro_batch_size_per_gpu": 4,
                                "gradient_accumulation_steps": 1}))
    assert [i for i in strata.config.check(path, world_size=8) if i.severity == "error"] == []
    bad = [i for i in strata.config.check(str(path), world_size=3) if i.severity == "error"]
    assert bad and "32" in bad[0].message + bad[0].hint
    missing = strata.config.check(tmp_path / "absent.json")
    assert missing and "absent.json" in missing[0].text


def test_load_resolves_or_raises(tmp_path):
    cfg = strata.config.load({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4}, world_size=2)
    assert cfg["train_batch_size"] == 16
    assert cfg["zero_optimization"]["stage"] == 0  # every key present, defaults filled
    with pytest.raises(strata.InvalidArgument, match="stagee"):
        strata.config.load({"zero_optimization": {"stagee": 1}})
    with pytest.raises(strata.InvalidArgument, match="not JSON"):
        strata.config.check({"lr": float("nan")})
    with pytest.raises(TypeError, match="path or a dict"):
        strata.config.check(42)


def test_every_status_code_maps_to_its_exception():
    for code, name in enumerate(strata._native._status_code_names()):
        if name == "Ok":
            continue
        with pytest.raises(strata.StrataError) as info:
            strata._native._raise_status(code, f"message {name}")
        assert type(info.value).__name__ == name and info.value.code == name
        assert str(info.value) == f"message {name}"
    assert issubclass(strata.InvalidArgument, ValueError)
