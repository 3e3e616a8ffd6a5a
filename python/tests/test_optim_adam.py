"""strata.optim.CPUAdam against torch.optim.AdamW / Adam."""
import copy
import threading
import time

import pytest
import torch

import strata
from strata.optim import CPUAdam
from conftest import assert_close_rel, batch, loss_of, small_model

# The kernels round differently from torch only at the last bit (they fold
# 1/sqrt(1 - beta2^t) into a multiply; torch divides), and each step's
# rounding feeds the next. Measured after 100 steps of the small model
# (AdamW and Adam, wd 0.05): max |ours - torch| <= 5.6e-7 x max|torch| of the
# tensor, <= 2.8e-6 relative for elements above a tenth of the max, and
# 4-88% of the elements bit-equal. The bound (1e-5 relative + 1e-5 x max)
# leaves a decade of margin.
PARITY_REL = 1e-5


def twin_runs(torch_cls, strata_kwargs, torch_kwargs, steps=100, groups=None, schedule=None):
    """Trains model A with torch and steps model B (same init) with strata on
    A's gradients, so that the only difference is the optimizer arithmetic."""
    # torch.optim.AdamW's default weight_decay is 0.01, CPUAdam's 0 (DeepSpeedCPUAdam's).
    torch_kwargs = dict(torch_kwargs, weight_decay=strata_kwargs.get("weight_decay", 0.0))
    ref = small_model()
    ours = copy.deepcopy(ref)
    ref_params = groups(ref) if groups else ref.parameters()
    our_params = groups(ours) if groups else ours.parameters()
    t_opt = torch_cls(ref_params, **torch_kwargs)
    s_opt = CPUAdam(our_params, **strata_kwargs)
    t_sched = schedule(t_opt) if schedule else None
    s_sched = schedule(s_opt) if schedule else None
    for step in range(steps):
        x, y = batch(step)
        t_opt.zero_grad()
        loss_of(ref, x, y).backward()
        for a, b in zip(ref.parameters(), ours.parameters()):
            b.grad = a.grad.clone()
        t_opt.step()
        s_opt.step()
        if schedule:
            t_sched.step()
            s_sched.step()
    return ref, ours, t_opt, s_opt


def check_parity(ref, ours, t_opt, s_opt, rel=PARITY_REL):
    worst = 0.0
    for i, (a, b) in enumerate(zip(ref.parameters(), ours.parameters())):
        assert_close_rel(b, a, rel, f"param {i}")
        worst = max(worst, float((b.detach() - a.detach()).abs().max() / a.detach().abs().max()))
        ta, sa = t_opt.state[a], s_opt.state[b]
        assert float(ta["step"]) == float(sa["step"])
        assert_close_rel(sa["exp_avg"], ta["exp_avg"], rel, f"exp_avg {i}")
        assert_close_rel(sa["exp_avg_sq"], ta["exp_avg_sq"], rel, f"exp_avg_sq {i}")
    print(f"max |ours - torch| / max|torch| over the params: {worst:.3g}")
    return worst


@pytest.mark.parametrize("wd", [0.0, 0.05])
def test_adamw_parity_100_steps(wd):
    ref, ours, t_opt, s_opt = twin_runs(torch.optim.AdamW, dict(lr=3e-3, weight_decay=wd),
                                        dict(lr=3e-3, weight_decay=wd, foreach=False))
    check_parity(ref, ours, t_opt, s_opt)


@pytest.mark.parametrize("wd", [0.0, 0.05])
def test_adam_parity_100_steps(wd):
    ref, ours, t_opt, s_opt = twin_runs(torch.optim.Adam, dict(lr=3e-3, weight_decay=wd, adamw_mode=False),
                                        dict(lr=3e-3, weight_decay=wd, foreach=False))
    check_parity(ref, ours, t_opt, s_opt)


def test_training_loss_matches_torch():
    """Independent training runs (each model its own gradients) give the same losses."""
    losses = {}
    for name in ("torch", "strata"):
        model = small_model()
        opt = (torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01) if name == "torch"
               else CPUAdam(model.parameters(), lr=1e-2, weight_decay=0.01))
        out = []
        x, y = batch(0)  # one batch, memorized: the loss must fall
        for step in range(30):
            opt.zero_grad()
            loss = loss_of(model, x, y)
            loss.backward()
            opt.step()
            out.append(loss.item())
        losses[name] = out
    assert losses["strata"][-1] < losses["strata"][0] * 0.8, "the model did not train"
    for t, (a, b) in enumerate(zip(losses["torch"], losses["strata"])):
        assert abs(a - b) <= 1e-4 * abs(a), f"step {t}: loss {b} vs torch {a}"


def test_param_groups_with_own_hyper_parameters():
    def groups(model):
        params = list(model.parameters())
        return [{"params": params[:3], "lr": 1e-2, "weight_decay": 0.1},
                {"params": params[3:], "lr": 1e-3, "betas": (0.8, 0.99), "eps": 1e-6}]
    ref, ours, t_opt, s_opt = twin_runs(torch.optim.AdamW, dict(lr=5e-3), dict(lr=5e-3, foreach=False),
                                        steps=30, groups=groups)
    check_parity(ref, ours, t_opt, s_opt)
    assert s_opt.param_groups[1]["betas"] == (0.8, 0.99)


def test_scheduler_drives_lr():
    def schedule(opt):
        return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=40)
    ref, ours, t_opt, s_opt = twin_runs(torch.optim.AdamW, dict(lr=1e-3), dict(lr=1e-3, foreach=False),
                                        steps=40, schedule=schedule)
    check_parity(ref, ours, t_opt, s_opt)
    assert s_opt.param_groups[0]["lr"] == t_opt.param_groups[0]["lr"]


def test_bias_correction_off_matches_reference_formula():
    p = torch.nn.Parameter(torch.linspace(-1, 1, 1000))
    g = torch.linspace(0.5, -0.3, 1000)
    opt = CPUAdam([p], lr=0.1, bias_correction=False, betas=(0.9, 0.999), eps=1e-8)
    p.grad = g.clone()
    p0 = p.detach().clone()
    opt.step()
    m = 0.1 * g
    v = 0.001 * g * g
    expected = p0 - 0.1 * m / (v.sqrt() + 1e-8)
    assert_close_rel(p, expected, 1e-6, "param")


def test_closure_and_zero_grad():
    model = small_model()
    opt = CPUAdam(model.parameters(), lr=1e-3)
    x, y = batch(0)

    def closure():
        opt.zero_grad()
        loss = loss_of(model, x, y)
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert torch.is_tensor(loss) and loss.item() > 0
    opt.zero_grad(set_to_none=True)
    assert all(p.grad is None for p in model.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    opt.step()  # no gradients: nothing moves, no state is made for them
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


def test_state_dict_round_trip():
    ref, ours, t_opt, s_opt = twin_runs(torch.optim.AdamW, dict(lr=1e-3), dict(lr=1e-3, foreach=False), steps=5)
    saved = copy.deepcopy(s_opt.state_dict())
    twin = copy.deepcopy(ours)
    s2 = CPUAdam(twin.parameters(), lr=1e-3)
    s2.load_state_dict(saved)
    for step in range(5, 10):
        x, y = batch(step)
        ours.zero_grad()
        loss_of(ours, x, y).backward()
        for a, b in zip(ours.parameters(), twin.parameters()):
            b.grad = a.grad.clone()
        s_opt.step()
        s2.step()
    for a, b in zip(ours.parameters(), twin.parameters()):
        assert torch.equal(a, b), "a reloaded optimizer must continue bit-identically"


def test_loads_torch_adamw_state_dict_and_continues_like_torch():
    ref, ours, t_opt, _ = twin_runs(torch.optim.AdamW, dict(lr=1e-3, weight_decay=0.01),
                                    dict(lr=1e-3, weight_decay=0.01, foreach=False), steps=10)
    ours = copy.deepcopy(ref)
    s_opt = CPUAdam(ours.parameters(), lr=5.0)  # lr and wd come from the loaded dict
    s_opt.load_state_dict(t_opt.state_dict())
    assert s_opt.param_groups[0]["lr"] == 1e-3 and s_opt.param_groups[0]["weight_decay"] == 0.01
    assert s_opt.param_groups[0]["bias_correction"] is True  # ours, filled with the default
    for step in range(10, 30):
        x, y = batch(step)
        t_opt.zero_grad()
        loss_of(ref, x, y).backward()
        for a, b in zip(ref.parameters(), ours.parameters()):
            b.grad = a.grad.clone()
        t_opt.step()
        s_opt.step()
    check_parity(ref, ours, t_opt, s_opt)
    # ... and the other way: torch.optim.AdamW takes our state dict.
    t2 = torch.optim.AdamW(copy.deepcopy(ours).parameters(), lr=1e-3)
    t2.load_state_dict(s_opt.state_dict())
    assert float(t2.state_dict()["state"][0]["step"]) == 30.0


def test_bf16_moments_state_dict_round_trip_restores_bf16():
    p = torch.nn.Parameter(torch.randn(3000))
    opt = CPUAdam([p], lr=1e-3, moment_dtype=torch.bfloat16)
    p.grad = torch.randn(3000)
    opt.step()
    assert opt.state[p]["exp_avg"].dtype == torch.bfloat16
    m = opt.state[p]["exp_avg"].clone()
    q = torch.nn.Parameter(p.detach().clone())
    opt2 = CPUAdam([q], lr=1e-3, moment_dtype=torch.bfloat16)
    opt2.load_state_dict(opt.state_dict())  # torch casts moments to fp32 on load ...
    q.grad = p.grad.clone()
    opt.step()
    opt2.step()  # ... and the next step brings them back to bf16, losslessly
    assert opt2.state[q]["exp_avg"].dtype == torch.bfloat16
    assert torch.equal(p, q) and not torch.equal(m, opt.state[p]["exp_avg"])


def fma(a, b, c):
    """a * b + c rounded once to float32 (the float32 product is exact in float64)."""
    return (a.double() * b.double() + c.double()).float()


def _reference_adamw_step(p, g16, m, v, t, lr, b1, b2, eps, wd):
    """Note [Update formulas] (cpu_adam/src/reference.cpp), operation for
    operation: per-step scalars in double rounded once to float, the same FMAs."""
    f32 = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731  (double -> float, rounded once)
    g = g16.to(torch.float32)
    m = fma(f32(1.0 - b1), g - m, m)
    v = fma(f32(1.0 - b2) * g, g, v * f32(b2))
    # sqrt correctly rounded: through double (torch >= 2's float sqrt on the CPU is not, by an ulp)
    denom = fma(v.double().sqrt().float(), f32(1.0 / (1.0 - b2 ** t) ** 0.5), f32(eps))
    p = p * f32(1.0 - lr * wd)
    p = fma(f32(-lr / (1.0 - b1 ** t)), m / denom, p)
    return p, m, v


@pytest.mark.parametrize("path", strata._native.supported_kernel_paths())
def test_bf16_grads_and_bf16_copy_against_reference(path):
    """bf16 gradients through step(grads=...) and a bf16 copy written in the
    same pass, bit for bit against the C++ reference formulas, and the copy
    equal to the new params rounded to bf16."""
    torch.manual_seed(3)
    n = 70001  # not a multiple of any vector width or tile
    p = torch.nn.Parameter(torch.randn(n))
    opt = CPUAdam([p], lr=1e-2, weight_decay=0.02, kernel_path=path)
    ref_p, ref_m, ref_v = p.detach().clone(), torch.zeros(n), torch.zeros(n)
    copy_out = torch.empty(n, dtype=torch.bfloat16)
    for t in range(1, 6):
        g = (0.1 * torch.randn(n)).to(torch.bfloat16)
        opt.step(grads=[[g]], param_copies=[[copy_out]])
        ref_p, ref_m, ref_v = _reference_adamw_step(ref_p, g, ref_m, ref_v, t, 1e-2, 0.9, 0.999, 1e-8, 0.02)
        assert torch.equal(p.detach(), ref_p), f"param after step {t}"
        assert torch.equal(opt.state[p]["exp_avg"], ref_m), f"exp_avg after step {t}"
        assert torch.equal(opt.state[p]["exp_avg_sq"], ref_v), f"exp_avg_sq after step {t}"
        # The copy is the updated fp32 param rounded to bf16, exactly.
        assert torch.equal(copy_out, p.detach().to(torch.bfloat16)), f"bf16 copy after step {t}"
    # fp16 copy and fp16 grads too; DeepSpeed's name for the copies.
    copy16 = torch.empty(n, dtype=torch.float16)
    opt.step(grads=[[torch.randn(n).to(torch.float16)]], fp16_param_groups=[[copy16]])
    assert torch.equal(copy16, p.detach().to(torch.float16))


def test_bf16_grads_match_torch_with_upcast_grads():
    torch.manual_seed(4)
    n = 5000
    a = torch.nn.Parameter(torch.randn(n))
    b = torch.nn.Parameter(a.detach().clone())
    t_opt = torch.optim.AdamW([a], lr=1e-3, weight_decay=0.0, foreach=False)
    s_opt = CPUAdam([b], lr=1e-3)
    for _ in range(20):
        g = torch.randn(n).to(torch.bfloat16)
        a.grad = g.float()
        t_opt.step()
        s_opt.step(grads=[[g]])
    assert_close_rel(b, a, PARITY_REL, "param")


def test_errors_name_the_culprit():
    p = torch.nn.Parameter(torch.randn(10))
    with pytest.raises(ValueError, match="amsgrad"):
        CPUAdam([p], amsgrad=True)
    with pytest.raises(ValueError, match="learning rate"):
        CPUAdam([p], lr=-1.0)
    with pytest.raises(ValueError, match="beta"):
        CPUAdam([p], betas=(1.0, 0.999))
    with pytest.raises(TypeError, match="fp32 master"):
        CPUAdam([torch.nn.Parameter(torch.randn(4).to(torch.bfloat16))])
    with pytest.raises(TypeError, match="moment_dtype"):
        CPUAdam([p], moment_dtype=torch.float16)
    opt = CPUAdam([p])
    with pytest.raises(TypeError, match="dtype torch.float64"):
        opt.step(grads=[[torch.randn(10, dtype=torch.float64)]])
    with pytest.raises(ValueError, match="has 9 elements, the param 10"):
        opt.step(grads=[[torch.randn(9)]])
    with pytest.raises(ValueError, match="not contiguous"):
        opt.step(grads=[[torch.randn(10, 2)[:, 0]]])
    with pytest.raises(ValueError, match="one list per group"):
        opt.step(grads=[[torch.randn(10)], [torch.randn(10)]])
    with pytest.raises(TypeError, match="expected one of bfloat16, float16"):
        p.grad = torch.randn(10)
        opt.step(param_copies=[[torch.empty(10)]])
    with pytest.raises(strata.InvalidArgument, match="kernel path|avx|scalar"):
        CPUAdam([p], kernel_path="sse9")
    # a loaded torch state dict with amsgrad=True is refused, not ignored
    t = torch.optim.AdamW([torch.nn.Parameter(torch.randn(10))], amsgrad=True)
    with pytest.raises(ValueError, match="amsgrad"):
        opt.load_state_dict(t.state_dict())


def test_cuda_tensor_is_a_clear_error():
    """A parameter on a GPU (or a meta tensor where no GPU exists: the same
    device check) is refused with the fix."""
    device = "cuda" if torch.cuda.is_available() else "meta"
    p = torch.nn.Parameter(torch.empty(10, device=device))
    with pytest.raises(ValueError, match=f"is on {device}.*offload first"):
        CPUAdam([p])
    q = torch.nn.Parameter(torch.randn(10))
    opt = CPUAdam([q])
    with pytest.raises(ValueError, match=f"is on {device}"):
        opt.step(grads=[[torch.empty(10, device=device)]])


def test_gil_is_released_during_the_step():
    """A Python thread keeps running while a large step runs."""
    n = 1 << 24  # 64 MiB of params: a single-thread step takes well over 20 ms
    p = torch.nn.Parameter(torch.zeros(n))
    p.grad = torch.ones(n)
    opt = CPUAdam([p], lr=1e-3, threads=1)
    opt.step()  # first step allocates the state
    ticks = []
    running = threading.Event()
    stop = threading.Event()

    def ticker():
        running.set()
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.0005)

    th = threading.Thread(target=ticker)
    th.start()
    running.wait()
    time.sleep(0.01)
    start = time.perf_counter()
    opt.step()
    end = time.perf_counter()
    stop.set()
    th.join()
    during = [t for t in ticks if start < t < end]
    assert end - start > 0.005, "the step was too short to tell"
    assert len(during) >= 3, f"the ticker ran {len(during)} times during a {1e3 * (end - start):.1f} ms step"


def test_kernel_path_and_threads_are_reported():
    opt = CPUAdam([torch.nn.Parameter(torch.zeros(4))], threads=1, kernel_path="scalar")
    assert opt.kernel_path == "scalar" and opt.threads == 1
    assert "scalar" in strata._native.supported_kernel_paths()


def test_results_do_not_depend_on_threads_or_tiles():
    """Note [One parallel loop per group] (python/src/optim.cpp): a group is
    tiled across its tensors; every element still sees the same operations."""
    shapes = [(300, 7), (5,), (70000,), (1,), (129, 64)]
    results = []
    for threads, tile in ((1, 65536), (2, 65536), (2, 64), (3, 128)):
        g = torch.Generator().manual_seed(11)
        params = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]
        copies = [torch.empty(s, dtype=torch.bfloat16) for s in shapes]
        opt = CPUAdam(params, lr=1e-2, weight_decay=0.01, threads=threads, tile_elements=tile)
        for _ in range(3):
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
            opt.step(param_copies=[copies])
        results.append((params, copies, opt))
    base_params, base_copies, base_opt = results[0]
    for params, copies, opt in results[1:]:
        for a, b, ca, cb in zip(base_params, params, base_copies, copies):
            assert torch.equal(a, b) and torch.equal(ca, cb)
            assert torch.equal(base_opt.state[a]["exp_avg_sq"], opt.state[b]["exp_avg_sq"])


def test_deepcopy_and_pickle_keep_a_working_optimizer():
    import pickle
    p = torch.nn.Parameter(torch.randn(100))
    opt = CPUAdam([p], lr=1e-2, moment_dtype=torch.bfloat16, threads=1)
    p.grad = torch.randn(100)
    opt.step()
    for clone in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        q = clone.param_groups[0]["params"][0]
        q.grad = p.grad.clone()
        clone.step()
        assert clone.threads == 1 and clone.state[q]["exp_avg"].dtype == torch.bfloat16
        assert float(clone.state[q]["step"]) == 2.0
