"""Shared helpers of the strata Python tests. torch is required: these tests
exist to check strata against PyTorch, so a missing torch fails collection
(CI sets STRATA_REQUIRE_TORCH=1 too; there is no skip path)."""
import torch  # noqa: F401  (an ImportError here is the intended failure)
import numpy as np
import pytest


def small_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Embedding(50, 32),
        torch.nn.LayerNorm(32),
        torch.nn.Linear(32, 64),
        torch.nn.GELU(),
        torch.nn.Linear(64, 32),
        torch.nn.LayerNorm(32),
        torch.nn.Linear(32, 50, bias=False),
    )


def batch(step, seed=1):
    g = torch.Generator().manual_seed(seed * 100003 + step)
    x = torch.randint(0, 50, (8, 12), generator=g)
    y = torch.randint(0, 50, (8, 12), generator=g)
    return x, y


def loss_of(model, x, y):
    return torch.nn.functional.cross_entropy(model(x).reshape(-1, 50), y.reshape(-1))


def max_rel_diff(ours, ref):
    """Largest |ours - ref| / |ref| over the elements whose |ref| is above
    1e-3 of the tensor's max (elements that cancel to ~0 have no meaningful
    relative error; they are bounded by the absolute check instead)."""
    a = ours.detach().double().reshape(-1)
    b = ref.detach().double().reshape(-1)
    if b.numel() == 0:
        return 0.0
    nz = b.abs() > 1e-3 * b.abs().max()
    return float(((a - b).abs()[nz] / b.abs()[nz]).max()) if bool(nz.any()) else 0.0


def assert_close_rel(ours, ref, rel, what):
    """|ours - ref| <= rel * |ref| + rel * max|ref| elementwise."""
    a, b = ours.detach().double(), ref.detach().double()
    floor = rel * float(b.abs().max()) if b.numel() else 0.0
    err = (a - b).abs()
    bad = int((err > rel * b.abs() + floor).sum())
    assert bad == 0, f"{what}: {bad} elements differ by more than {rel:g} relative (max rel {max_rel_diff(a, b):.3g})"


@pytest.fixture
def rng():
    return np.random.default_rng(1234)
