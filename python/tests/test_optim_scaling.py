"""Loss scaling, clipping and overflow skipping fused into CPUAdam.step;
grad_norm against torch.nn.utils.clip_grad_norm_."""
import copy
import math

import pytest
import torch

from strata.optim import CPUAdam, CPULion, clip_coefficient
from conftest import batch, loss_of, small_model


def grads_of(model):
    x, y = batch(0)
    model.zero_grad()
    loss_of(model, x, y).backward()
    return [p.grad.clone() for p in model.parameters()]


def test_loss_scale_and_clip_are_fused_exactly():
    """A power-of-two loss scale and clip coefficient are exact in float, so
    scaled gradients with the matching arguments give bit-identical results."""
    model = small_model()
    grads = grads_of(model)
    a, b = copy.deepcopy(model), copy.deepcopy(model)
    oa, ob = CPUAdam(a.parameters(), lr=1e-2), CPUAdam(b.parameters(), lr=1e-2)
    for _ in range(3):
        oa.step(grads=[[g * 0.5 for g in grads]])
        ob.step(grads=[[g * 1024.0 for g in grads]], loss_scale=1024.0, clip_coefficient=0.5)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))
    with pytest.raises(ValueError, match="loss_scale=0"):
        oa.step(loss_scale=0.0)
    with pytest.raises(ValueError, match="clip_coefficient=nan"):
        oa.step(clip_coefficient=float("nan"))


@pytest.mark.parametrize("threads", [1, 2])
def test_grad_norm_matches_torch_and_clipping_like_clip_grad_norm(threads):
    model = small_model()
    grads = grads_of(model)
    ref = copy.deepcopy(model)
    opt = CPUAdam(model.parameters(), lr=1e-2, threads=threads, tile_elements=64)
    for p, g in zip(model.parameters(), grads):
        p.grad = g.clone()
    norm = opt.grad_norm()
    t_ref = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.0)
    for p, g in zip(ref.parameters(), grads):
        p.grad = g.clone()
    torch_norm = float(torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm=0.1))
    assert abs(norm - torch_norm) <= 1e-6 * torch_norm
    assert abs(opt.grad_norm(loss_scale=4.0) - norm / 4) <= 1e-12 * norm
    opt.step(clip_coefficient=clip_coefficient(norm, 0.1))
    t_ref.step()
    for a, b in zip(ref.parameters(), model.parameters()):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)
    assert clip_coefficient(norm, 0.0) == 1.0 and clip_coefficient(float("inf"), 1.0) == 1.0


def test_grad_norm_is_independent_of_threads_and_sees_non_finite():
    g = torch.Generator().manual_seed(3)
    params = [torch.nn.Parameter(torch.zeros(s)) for s in ((1000, 70), (5,), (123457,))]
    grads = [torch.randn(p.shape, generator=g).to(torch.bfloat16) for p in params]
    norms = {CPUAdam(params, threads=t, tile_elements=256).grad_norm(grads=[grads]) for t in (1, 2, 3)}
    assert len(norms) == 1
    grads[1][2] = float("inf")
    assert math.isinf(CPUAdam(params).grad_norm(grads=[grads]))


@pytest.mark.parametrize("cls", [CPUAdam, CPULion])
def test_skip_if_nonfinite_changes_nothing(cls):
    model = small_model()
    opt = cls(model.parameters(), lr=1e-2)
    grads = grads_of(model)
    opt.step(grads=[grads])
    before = copy.deepcopy((list(model.parameters()), opt.state_dict()))
    bad = [g.clone() for g in grads]
    bad[-1][0, 0] = float("nan")  # one element of the last tensor
    opt.step(grads=[bad], skip_if_nonfinite=True)
    assert opt.last_step_skipped
    for a, b in zip(before[0], model.parameters()):
        assert torch.equal(a, b)
    after = opt.state_dict()["state"]
    for i, st in before[1]["state"].items():
        assert float(st["step"]) == float(after[i]["step"]) == 1.0
        assert torch.equal(st["exp_avg"], after[i]["exp_avg"])
    opt.step(grads=[grads], skip_if_nonfinite=True)  # finite: a normal step
    assert not opt.last_step_skipped
    assert float(opt.state_dict()["state"][0]["step"]) == 2.0
    opt.step(grads=[bad])  # without the check a NaN is applied, as in torch
    last = list(model.parameters())[-1]
    assert torch.isnan(opt.state[last]["exp_avg"]).any()  # (Lion's sign(NaN) is 0: its param stays finite)
