"""strata.torch.GatheredParameters (Note [Gathered parameters]): parameters
whole between steps at every stage; modifier_rank writes the block's values
into the engine before the first step (training then equals a model built
with those values), and is refused after training began."""
import pytest
import torch

import strata.torch as st
from strata.errors import FailedPrecondition, Unsupported
from test_torch_frontend import config, lm_loss, make_lm, train_engine


@pytest.mark.parametrize("stage,placement", [(0, "none"), (2, "cpu"), (3, "cpu")])
def test_parameters_are_whole_inside_and_the_engines_values(stage, placement):
    engine, _, _, _ = st.initialize(model=make_lm(), config=config(stage, placement, placement if stage == 3 else
                                                                   "none"))
    train_engine(engine, lm_loss, 2)
    masters = engine.master_parameters()
    model = engine.module
    with st.GatheredParameters(model.parameters()):
        for name, p in model.named_parameters():
            assert torch.equal(p.detach(), masters[name]), name
    if stage == 3:
        assert model.blocks[0].fc.weight.numel() == 0  # a placeholder again between uses
    assert train_engine(engine, lm_loss, 1)  # training goes on


@pytest.mark.parametrize("stage", [0, 3])
def test_modifier_rank_before_the_first_step_sets_the_values_training_starts_from(stage):
    engine, _, _, _ = st.initialize(model=make_lm(), config=config(stage, "cpu" if stage else "none",
                                                                   "cpu" if stage == 3 else "none"))
    model = engine.module
    with st.GatheredParameters([model.blocks[1].fc.weight, model.ln_f.bias], modifier_rank=0):
        model.blocks[1].fc.weight.data.mul_(0.5)  # in place
        model.ln_f.bias.data = torch.full_like(model.ln_f.bias, 0.25)  # replaced
    ours = train_engine(engine, lm_loss, 3)

    reference_model = make_lm()
    with torch.no_grad():
        reference_model.blocks[1].fc.weight.mul_(0.5)
        reference_model.ln_f.bias.fill_(0.25)
    reference, _, _, _ = st.initialize(model=reference_model, config=config(0))
    assert ours == train_engine(reference, lm_loss, 3)


def test_modifier_rank_after_training_began_is_refused_and_nothing_changes():
    engine, _, _, _ = st.initialize(model=make_lm(), config=config(3, "cpu", "cpu"))
    train_engine(engine, lm_loss, 1)
    before = engine.master_parameters()
    with pytest.raises(Unsupported, match=r"'blocks\.0\.fc\.weight'.*after training has begun"):
        with st.GatheredParameters(engine.module.blocks[0].fc.weight, modifier_rank=0):
            engine.module.blocks[0].fc.weight.data.zero_()
    after = engine.master_parameters()
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert train_engine(engine, lm_loss, 1)


def test_misuse_is_refused_and_the_engine_goes_on():
    engine, _, _, _ = st.initialize(model=make_lm(), config=config(3, "cpu", "cpu"))
    weight = engine.module.blocks[0].fc.weight
    with pytest.raises(TypeError, match="modifier_rank"):
        st.GatheredParameters(weight, modifier_rank="0")
    with pytest.raises(ValueError, match="modifier_rank 2 is not a rank"):
        with st.GatheredParameters(weight, modifier_rank=2):
            pass
    with pytest.raises(TypeError, match=r"params\[0\]"):
        st.GatheredParameters([torch.zeros(2)])
    with pytest.raises(ValueError, match="shape"):
        with st.GatheredParameters(weight, modifier_rank=0):
            weight.data = torch.zeros(3, 3)
    engine.backward(lm_loss(engine, 0))
    engine.step()  # off the boundary: the step is open
    with pytest.raises(FailedPrecondition, match="between steps"):
        with st.GatheredParameters(weight):
            pass
    engine.backward(lm_loss(engine, 1))
    engine.step()
    with st.GatheredParameters(weight, enabled=False):
        assert weight.numel() == 0  # disabled: nothing gathered
    plain = torch.nn.Parameter(torch.ones(2))
    with st.GatheredParameters([plain], modifier_rank=0):  # not an engine's: left as it is
        plain.data.mul_(2)
    assert torch.equal(plain.detach(), torch.full((2,), 2.0))



def test_a_binding_that_fails_inside_gathered_parameters_leaves_no_layer_held(monkeypatch):
    """A layer whose binding fails after the engine lent it (torch refusing the .data, an interrupt) is handed
    back: the engine's hold counts (which every release reads) stay the front end's, and training after it
    gives a clean run's losses (the layer is unbound at its next release, its gradient handed over)."""
    import strata._torch_hooks as hooks
    clean_engine, _, _, _ = st.initialize(model=make_lm(), config=config(3, "cpu", "cpu"))
    clean = train_engine(clean_engine, lm_loss, 2)

    engine, _, _, _ = st.initialize(model=make_lm(), config=config(3, "cpu", "cpu"))
    model = engine.module
    real = hooks.mark_bound
    calls = []

    def refuse_the_third(p):
        calls.append(p)
        if len(calls) == 3:
            raise RuntimeError("binding refused")
        real(p)

    monkeypatch.setattr(hooks, "mark_bound", refuse_the_third)
    with pytest.raises(RuntimeError, match="binding refused"):
        with st.GatheredParameters(model.parameters()):
            pass
    monkeypatch.setattr(hooks, "mark_bound", real)
    assert [engine._engine.holds(i) for i in range(len(engine._layers))] == [0] * len(engine._layers)
    assert model.blocks[0].fc.weight.numel() == 0  # unbound again
    assert train_engine(engine, lm_loss, 2) == clean
