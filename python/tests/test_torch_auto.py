"""strata.torch resolves Hugging Face's "auto" values (Note [Resolving
"auto"] in strata/torch.py): bucket sizes from the model's hidden size, the
optimizer's from a client optimizer, the rest from auto_values or the
other batch keys; anything left is an error naming it."""
import types

import pytest
import torch

import strata.torch as st
from strata.errors import Unsupported
from test_torch_frontend import config, lm_loss, make_lm, train_engine

HF_ZERO3 = {  # the shape of Hugging Face's ds_config_zero3.json
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
    "optimizer": {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}},
    "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"},
                          "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto"},
    "strata": {"device": "cpu", "device_memory": "64MiB"},
}
TRAINER_VALUES = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "gradient_clipping": 1.0,
                  "optimizer.params.lr": 1e-2, "optimizer.params.betas": [0.9, 0.999],
                  "optimizer.params.eps": 1e-8, "optimizer.params.weight_decay": 0.01}


def lm_with_hidden_size(hidden=32):
    model = make_lm()
    model.config = types.SimpleNamespace(hidden_size=hidden)  # what a Hugging Face model carries
    return model


def test_hf_zero3_config_resolves_and_trains_as_the_numbers_do():
    engine, _, _, _ = st.initialize(model=lm_with_hidden_size(), config=HF_ZERO3, auto_values=TRAINER_VALUES)
    zero = engine.config["zero_optimization"]
    assert (zero["reduce_bucket_size"], zero["stage3_prefetch_bucket_size"],
            zero["stage3_param_persistence_threshold"]) == (32 * 32, int(0.9 * 32 * 32), 320)
    assert engine.config["train_batch_size"] == 8  # derived from the other two and the world size
    assert engine.config["gradient_clipping"] == 1.0
    ours = train_engine(engine, lm_loss, 4)
    numbers = config(3, "cpu", "cpu", clip=1.0)
    numbers["zero_optimization"].update(reduce_bucket_size=1024, stage3_prefetch_bucket_size=921,
                                        stage3_param_persistence_threshold=320)
    reference, _, _, _ = st.initialize(model=make_lm(), config=numbers)
    assert ours == train_engine(reference, lm_loss, 4)


def test_optimizer_autos_come_from_a_client_optimizer():
    model = lm_with_hidden_size()
    raw = dict(HF_ZERO3)
    del raw["optimizer"]
    client = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.05)
    values = {k: v for k, v in TRAINER_VALUES.items() if not k.startswith("optimizer.")}
    engine, optimizer, _, _ = st.initialize(model=model, optimizer=client, config=raw, auto_values=values)
    assert engine.config["optimizer"]["params"]["lr"] == pytest.approx(3e-3)
    assert optimizer.param_groups[0]["weight_decay"] == pytest.approx(0.05)


def test_autos_left_without_a_value_are_named():
    values = dict(TRAINER_VALUES)
    del values["gradient_clipping"]
    del values["optimizer.params.lr"]
    with pytest.raises(Unsupported, match=r"gradient_clipping.*optimizer\.params\.lr|optimizer\.params\.lr.*"
                                          r"gradient_clipping") as error:
        st.initialize(model=lm_with_hidden_size(), config=HF_ZERO3, auto_values=values)
    assert "auto_values" in str(error.value)


def test_bucket_autos_need_the_models_hidden_size():
    with pytest.raises(Unsupported, match=r"reduce_bucket_size.*no config\.hidden_size"):
        st.initialize(model=make_lm(), config=HF_ZERO3, auto_values=TRAINER_VALUES)


def test_auto_values_for_keys_that_are_not_auto_are_refused():
    with pytest.raises(ValueError, match=r"auto_values\['zero_optimization.stage'\].*does not leave"):
        st.initialize(model=lm_with_hidden_size(), config=HF_ZERO3,
                      auto_values={**TRAINER_VALUES, "zero_optimization.stage": 2})
    with pytest.raises(ValueError, match="is \"auto\" again"):
        st.initialize(model=lm_with_hidden_size(), config=HF_ZERO3,
                      auto_values={**TRAINER_VALUES, "gradient_clipping": "auto"})


def test_a_bad_value_given_for_auto_is_the_checkers_error_naming_the_key():
    with pytest.raises(Exception, match="gradient_clipping"):
        st.initialize(model=lm_with_hidden_size(), config=HF_ZERO3,
                      auto_values={**TRAINER_VALUES, "gradient_clipping": -1.0})


@pytest.mark.parametrize("module,missing,says", [("strata.torch", "torch", "strata.torch needs PyTorch: pip install torch"),
                                                 ("strata.torch.hf", "transformers",
                                                  "strata.torch.hf needs Hugging Face transformers")])
def test_a_missing_dependency_says_what_to_install(module, missing, says):
    # (Without torch the rest of the package still imports: config, estimate, io on numpy.)
    import subprocess
    import sys
    # (torch itself imported first when transformers is the one missing: torch 2 looks for transformers too)
    first = "import torch; " if missing != "torch" else ""
    code = f"import sys; {first}sys.modules[{missing!r}] = None\ntry:\n    import {module}\nexcept ImportError as e:\n    print(e)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert says in done.stdout, done.stdout + done.stderr


def test_without_torch_the_package_imports_and_strata_optim_says_what_to_install():
    import subprocess
    import sys
    code = ("import sys; sys.modules['torch'] = None\nimport strata\nprint(strata.config.check({}) is not None)\n"
            "try:\n    strata.optim\nexcept ImportError as e:\n    print(e)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "True" in done.stdout and "strata.optim needs PyTorch" in done.stdout, done.stdout + done.stderr
