"""strata.torch.initialize(..., fit={...}): the config fitted to memory caps
(Note [Config fit], `strata plan --fit`'s search over the model's own
layers) before the engine is made; the fitted run's losses equal the
unfitted stage-0 run's bit for bit (placements do not change the numbers)."""
import json

import pytest

import strata
import strata.torch as st
from test_torch_frontend import config, lm_loss, make_lm, train_engine


def test_the_fit_moves_state_off_the_device_and_trains_the_same_losses(capsys):
    reference, _, _, _ = st.initialize(model=make_lm(), config=config(0))
    expected = train_engine(reference, lm_loss, 4)
    cap = 300 * 1024  # the stage-0 plan needs 490 KiB of device memory for this model
    engine, _, _, _ = st.initialize(model=make_lm(), config=config(0),
                                    fit={"device_memory": "300KiB", "host_memory": "64MiB"})
    best = engine.fit["best"]
    assert engine.config["zero_optimization"]["stage"] > 0
    assert engine.config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert any(c["key"] == "zero_optimization.stage" and "does not fit" in c["reason"] for c in best["changes"])
    assert "strata.torch fit:" in capsys.readouterr().out
    assert engine.memory()["predicted"]["device"] <= cap
    assert train_engine(engine, lm_loss, 4) == expected
    assert engine.memory()["measured"]["device"] <= cap
    again, _, _, _ = st.initialize(model=make_lm(), config=json.loads(best["config_json"]))  # the written config
    assert train_engine(again, lm_loss, 4) == expected


def test_a_small_host_cap_with_an_nvme_folder_puts_the_optimizer_state_on_nvme(tmp_path):
    engine, _, _, _ = st.initialize(model=make_lm(), config=config(0),
                                    fit={"device_memory": "300KiB", "host_memory": "400KiB",
                                         "nvme_path": str(tmp_path)})
    assert engine.config["zero_optimization"]["offload_optimizer"]["device"] == "nvme"
    assert engine.memory()["predicted"]["pinned"] <= 400 * 1024
    losses = train_engine(engine, lm_loss, 3)
    assert losses[-1] < losses[0]


def test_no_fit_says_what_is_missing():
    with pytest.raises(strata.ResourceExhausted, match=r"no config fits device_memory 40KiB.*the cap is 40\.00 KiB"):
        st.initialize(model=make_lm(), config=config(0), fit={"device_memory": "40KiB", "host_memory": "64MiB"})


def test_int8_optimizer_states_are_chosen_only_when_allowed_and_needed():
    caps = {"device_memory": "300KiB", "host_memory": "500KiB"}  # fp32 state with cpu offload needs ~600 KiB
    with pytest.raises(strata.ResourceExhausted, match=r"8-bit optimizer states .* fits"):
        st.initialize(model=make_lm(), config=config(0), fit=caps)
    engine, _, _, _ = st.initialize(model=make_lm(), config=config(0), fit={**caps, "optimizer_states": ["fp32", "int8"]})
    assert engine.config["strata"]["optimizer_state_dtype"] == "int8"
    assert engine.config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert any(c["key"] == "strata.optimizer_state_dtype" for c in engine.fit["best"]["changes"])
    losses = train_engine(engine, lm_loss, 4)
    assert losses[-1] < losses[0]
    assert engine.memory()["measured"]["pinned"] <= 500 * 1024
    # With room for fp32 state the faster fp32 step wins even where int8 is allowed.
    roomy, _, _, _ = st.initialize(model=make_lm(), config=config(0),
                                   fit={"device_memory": "300KiB", "host_memory": "700KiB",
                                        "optimizer_states": ["fp32", "int8"]})
    assert roomy.config["strata"]["optimizer_state_dtype"] == "fp32"


def test_bf16_gradients_are_chosen_only_when_allowed_and_needed():
    # fp32 state and an fp32 gradient shard with cpu offload need ~16 B per parameter of host memory (515 KiB
    # here, with one piece of update staging); with bf16 gradients ~14 B (451 KiB): a host cap between the two.
    caps = {"device_memory": "300KiB", "host_memory": "480KiB"}
    with pytest.raises(strata.ResourceExhausted, match=r"bf16 gradients .* fits"):
        st.initialize(model=make_lm(), config=config(0), fit=caps)
    engine, _, _, _ = st.initialize(model=make_lm(), config=config(0), fit={**caps, "grad_dtypes": ["fp32", "bf16"]})
    assert engine.config["data_types"]["grad_accum_dtype"] == "bf16"
    assert any(c["key"] == "data_types.grad_accum_dtype" for c in engine.fit["best"]["changes"])
    losses = train_engine(engine, lm_loss, 4)
    assert losses[-1] < losses[0]
    assert engine.memory()["measured"]["pinned"] <= 480 * 1024


@pytest.mark.parametrize("fit,error,match", [
    ({"device_memory": "1GiB", "host_memory": "1GiB", "optimizer_states": "int8"}, ValueError,
     r"fit\['optimizer_states'\] 'int8' is not a list"),
    ({"device_memory": "1GiB", "host_memory": "1GiB", "optimizer_states": ["int4"]}, Exception,
     r"fit\['optimizer_states'\] 'int4' is not a moment storage"),
    ({"device_memory": "1GiB", "host_memory": "1GiB", "grad_dtypes": "bf16"}, ValueError,
     r"fit\['grad_dtypes'\] 'bf16' is not a list"),
    ({"device_memory": "1GiB", "host_memory": "1GiB", "grad_dtypes": ["int8"]}, Exception,
     r"fit\['grad_dtypes'\] 'int8' is not a gradient dtype"),
    ({"device_memory": "1GiB"}, ValueError, "needs 'host_memory'"),
    ({"device_memory": "1GiB", "host_memory": "1GiB", "cpu_memory": 1}, ValueError, r"unknown key\(s\) \['cpu_memory'\]"),
    ({"device_memory": "1 gallon", "host_memory": "1GiB"}, ValueError, r"fit\['device_memory'\] '1 gallon' is not a size"),
    ({"device_memory": 0, "host_memory": "1GiB"}, ValueError, "out of range"),
    ({"device_memory": "1GiB", "host_memory": "1GiB", "nvme_path": "/no/such/folder"}, ValueError, "is not a folder"),
    ({"device_memory": "1GiB", "host_memory": "1GiB", "seq": 0}, ValueError, r"fit\['seq'\] 0"),
    ("1GiB", TypeError, "fit must be a dict"),
])
def test_bad_fit_arguments_are_refused_naming_them(fit, error, match):
    with pytest.raises(error, match=match):
        st.initialize(model=make_lm(), config=config(0), fit=fit)
