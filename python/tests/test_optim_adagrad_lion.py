"""strata.optim.CPUAdagrad against torch.optim.Adagrad; CPULion against the
reference formula (torch has no Lion)."""
import copy

import pytest
import torch

from strata.optim import CPUAdagrad, CPULion
from conftest import assert_close_rel, batch, loss_of, small_model

PARITY_REL = 1e-5  # as for Adam: last-bit differences carried over 100 steps


def twin(torch_opt, strata_opt_of, steps):
    ref = small_model()
    ours = copy.deepcopy(ref)
    t_opt = torch_opt(ref.parameters())
    s_opt = strata_opt_of(ours.parameters())
    for step in range(steps):
        x, y = batch(step)
        t_opt.zero_grad()
        loss_of(ref, x, y).backward()
        for a, b in zip(ref.parameters(), ours.parameters()):
            b.grad = a.grad.clone()
        t_opt.step()
        s_opt.step()
    return ref, ours, t_opt, s_opt


@pytest.mark.parametrize("wd,init", [(0.0, 0.0), (0.01, 0.1)])
def test_adagrad_parity_100_steps(wd, init):
    ref, ours, t_opt, s_opt = twin(
        lambda p: torch.optim.Adagrad(p, lr=1e-2, weight_decay=wd, initial_accumulator_value=init, foreach=False),
        lambda p: CPUAdagrad(p, lr=1e-2, weight_decay=wd, initial_accumulator_value=init), 100)
    for i, (a, b) in enumerate(zip(ref.parameters(), ours.parameters())):
        assert_close_rel(b, a, PARITY_REL, f"param {i}")
        assert_close_rel(s_opt.state[b]["sum"], t_opt.state[a]["sum"], PARITY_REL, f"sum {i}")
        assert float(s_opt.state[b]["step"]) == float(t_opt.state[a]["step"]) == 100.0


def test_adagrad_loads_torch_state_dict():
    ref, ours, t_opt, _ = twin(lambda p: torch.optim.Adagrad(p, lr=1e-2, foreach=False),
                               lambda p: CPUAdagrad(p, lr=1e-2), 10)
    ours = copy.deepcopy(ref)
    s_opt = CPUAdagrad(ours.parameters(), lr=1.0)
    s_opt.load_state_dict(t_opt.state_dict())
    for step in range(10, 20):
        x, y = batch(step)
        t_opt.zero_grad()
        loss_of(ref, x, y).backward()
        for a, b in zip(ref.parameters(), ours.parameters()):
            b.grad = a.grad.clone()
        t_opt.step()
        s_opt.step()
    for i, (a, b) in enumerate(zip(ref.parameters(), ours.parameters())):
        assert_close_rel(b, a, PARITY_REL, f"param {i}")


def test_adagrad_errors():
    p = torch.nn.Parameter(torch.randn(4))
    with pytest.raises(ValueError, match="lr_decay"):
        CPUAdagrad([p], lr_decay=0.1)
    with pytest.raises(ValueError, match="eps > 0"):
        CPUAdagrad([p], eps=0.0)
    with pytest.raises(ValueError, match="initial_accumulator_value"):
        CPUAdagrad([p], initial_accumulator_value=-1.0)


def fma(a, b, c):
    """a * b + c rounded once to float32: the float32 product is exact in
    float64, so only the sum rounds (double rounding through float64 cannot
    change a result here: the tests compare bit for bit and would say so)."""
    return (a.double() * b.double() + c.double()).float()


def lion_reference(p, g, m, lr, b1, b2, wd):
    """Chen et al. 2023, exactly as Note [Update formulas] in cpu_adam/src/reference.cpp."""
    f = torch.float32
    c = fma(torch.tensor(1 - b1, dtype=f), g - m, m)
    p = p * torch.tensor(1 - lr * wd, dtype=f)
    p = fma(torch.tensor(-lr, dtype=f), torch.sign(c), p)
    m = fma(torch.tensor(1 - b2, dtype=f), g - m, m)
    return p, m


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_lion_against_reference(grad_dtype):
    torch.manual_seed(5)
    n = 33333
    p = torch.nn.Parameter(torch.randn(n))
    opt = CPULion([p], lr=1e-3, betas=(0.9, 0.99), weight_decay=0.1)
    ref_p, ref_m = p.detach().clone(), torch.zeros(n)
    for _ in range(20):
        g = torch.randn(n).to(grad_dtype)
        opt.step(grads=[[g]])
        ref_p, ref_m = lion_reference(ref_p, g.float(), ref_m, 1e-3, 0.9, 0.99, 0.1)
    # Bit for bit: with the kernel's FMAs reproduced, sign() cannot flip.
    assert torch.equal(opt.state[p]["exp_avg"], ref_m)
    assert torch.equal(p.detach(), ref_p)
    assert set(opt.state[p]) == {"step", "exp_avg"}


def test_lion_trains_and_round_trips_state():
    model = small_model()
    opt = CPULion(model.parameters(), lr=3e-3)
    x, y = batch(0)
    first = None
    for _ in range(30):
        opt.zero_grad()
        loss = loss_of(model, x, y)
        loss.backward()
        opt.step()
        first = first if first is not None else loss.item()
    assert loss.item() < 0.8 * first
    twin = copy.deepcopy(model)
    opt2 = CPULion(twin.parameters(), lr=3e-3)
    opt2.load_state_dict(opt.state_dict())
    loss_of(model, x, y).backward()
    for a, b in zip(model.parameters(), twin.parameters()):
        b.grad = a.grad.clone()
    opt.step()
    opt2.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))


def test_bf16_moments_for_every_optimizer():
    for cls, keys in ((CPUAdagrad, ("sum",)), (CPULion, ("exp_avg",))):
        p = torch.nn.Parameter(torch.randn(1000))
        opt = cls([p], moment_dtype=torch.bfloat16)
        p.grad = torch.randn(1000)
        opt.step()
        for k in keys:
            assert opt.state[p][k].dtype == torch.bfloat16
