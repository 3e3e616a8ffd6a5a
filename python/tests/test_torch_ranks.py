"""strata.torch under mpirun (Note [Ranks of a driven engine]): two ranks,
each with half of a global micro-batch, train the same model as one rank
with all of it (within 1e-5: the gradient of a mean over 8 samples and the
mean of two 4-sample gradients round differently), at stages 0 and 3 with
offload; rank 0's initial values win though each rank seeds its own model;
a checkpoint saved by two ranks resumes in one; export_hf and
GatheredParameters(modifier_rank=1) work across ranks."""
import json
import os
import shutil
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(HERE, "torch_ranks_worker.py")
MPIRUN = shutil.which("mpirun") or shutil.which("mpiexec")

pytestmark = pytest.mark.skipif(MPIRUN is None and os.environ.get("STRATA_REQUIRE_MPI") != "1",
                                reason="mpirun is not installed (libopenmpi-dev / openmpi-bin)")


def run(tmp_path, name, ranks, *flags):
    out = tmp_path / f"{name}.json"
    command = [sys.executable, WORKER, str(out), *flags]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if ranks > 1:
        command = [MPIRUN, "--allow-run-as-root", "--oversubscribe", "-np", str(ranks), *command]
    done = subprocess.run(command, cwd=HERE, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{' '.join(command)}\n{done.stdout}\n{done.stderr}"
    with open(out) as f:
        return json.load(f)


def assert_close(a, b, rel=1e-5):
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert abs(x - y) <= rel * abs(y), (a, b)


# Note [Two ranks against one, on any CPU]
# Two ranks average two half-batch gradients; one rank takes the gradient of
# the whole batch. The two round differently (about 1e-7 relative, by an
# amount that depends on the CPU's kernels), and Adam, which divides each
# element's step by the element's own gradient size, turns that noise into
# whole steps wherever a gradient is near zero at some step; after a few steps
# the trajectories of such elements part chaotically. Plain torch does the
# same: on a tiny Llama, torch's AdamW over the whole batch and over two halves
# ended 7.7e-5 apart in one o_proj element, while each Strata run was within
# 1.5e-8 of its own torch twin (issue 52). So a bound on master sums tuned on
# one CPU (1e-4) failed on another. What holds on every CPU, and is asserted:
# - the losses agree within 1e-5 relative (the loss averages the noise out);
# - after the first step, elementwise: Adam's first update is lr * g / (|g| +
#   eps), i.e. -lr * sign(g), so where |g| stands clear of the rounding noise
#   (measured on this CPU as the difference between plain torch's one-rank and
#   two-rank gradients, times NOISE_MARGIN) and of eps (EPS_MARGIN * eps: the
#   step's sensitivity to a relative gradient error d is d * eps / |g|) both
#   runs take the same step and
#   their masters differ only by the rounding of p - step (a few ulps;
#   SIGNAL_BOUND allows 1e-3 of a step). Where the gradient is noise the signs
#   may differ: at most 2 lr apart. A wrong reduction (a rank stepping on its
#   own half, a missed layer) flips the signs of clear gradients and fails here;
# - at the end, elementwise, no element is further apart than two Adam runs
#   from the same start can be: each step moves an element by at most
#   lr * adam_step_bound(t) (Cauchy-Schwarz on the moment sums) plus the decay.
LR, WEIGHT_DECAY, BETA1, BETA2, EPS = 3e-3, 0.01, 0.9, 0.999, 1e-8  # torch_ranks_worker.py's AdamW
NOISE_MARGIN, EPS_MARGIN = 100.0, 1000.0
SIGNAL_BOUND = 1e-3 * LR


def adam_step_bound(step):
    """The largest |m_hat / sqrt(v_hat)| at 1-based `step` over any gradients."""
    ratio = BETA1 ** 2 / BETA2
    series = sum(ratio ** k for k in range(step))
    return ((1 - BETA1) / (1 - BETA1 ** step)) * ((1 - BETA2 ** step) / (1 - BETA2)) ** 0.5 * series ** 0.5


def assert_trains_as_one_rank(one_out, two_out, steps, label):
    """Note [Two ranks against one, on any CPU]; prints each bound's margin."""
    import torch
    one = torch.load(str(one_out) + ".pt")
    two = torch.load(str(two_out) + ".pt")
    gradients = one["reference_gradient"]
    drift_bound = 2 * LR * sum(adam_step_bound(t) for t in range(1, steps + 1))
    signal_worst = flip_worst = final_worst = 0.0
    clear = 0
    for name, first_one in one["first_step"].items():
        if name not in gradients["one"]:
            continue
        gradient = gradients["one"][name].double()
        noise = float((gradient - gradients["two"][name].double()).abs().max())
        floor = max(NOISE_MARGIN * noise, EPS_MARGIN * EPS)
        apart = (two["first_step"][name].double() - first_one.double()).abs()
        signal = gradient.abs() > floor
        clear += int(signal.sum())
        if signal.any():
            signal_worst = max(signal_worst, float(apart[signal].max()))
            assert float(apart[signal].max()) <= SIGNAL_BOUND, (label, name, "first step", float(apart[signal].max()))
        flip_worst = max(flip_worst, float(apart.max()))
        assert float(apart.max()) <= 2 * LR * (1 + 1e-3), (label, name, "first step", float(apart.max()))
        scale = float(first_one.abs().max()) + steps * LR * 2
        final = float((two["final"][name].double() - one["final"][name].double()).abs().max())
        final_worst = max(final_worst, final)
        assert final <= drift_bound + 2 * steps * LR * WEIGHT_DECAY * scale, (label, name, "final", final)
    assert clear > 0, label  # the sharp check compared something
    print(f"{label}: first step, {clear} elements with clear gradients: worst {signal_worst:.3g} <= "
          f"{SIGNAL_BOUND:.3g} ({SIGNAL_BOUND / max(signal_worst, 1e-30):.3g}x margin); any element: worst "
          f"{flip_worst:.3g} <= {2 * LR:.3g}; after {steps} steps: worst {final_worst:.3g} <= {drift_bound:.3g} "
          f"({drift_bound / max(final_worst, 1e-30):.3g}x margin)")


@pytest.mark.parametrize("flags", [["--stage", "0"],
                                   ["--stage", "3", "--optimizer", "cpu", "--params", "cpu"]],
                         ids=["stage0", "stage3-cpu"])
def test_two_ranks_train_what_one_rank_trains(tmp_path, flags):
    one = run(tmp_path, "one", 1, *flags, "--elementwise")
    two = run(tmp_path, "two", 2, *flags, "--elementwise")
    assert two["world"] == 2 and one["world"] == 1
    assert_close(two["losses"], one["losses"])
    assert two["losses"][-1] < two["losses"][0]
    # (GPT-2's key bias, whose gradient is 0 analytically, needs no exemption: its elements are noise.)
    assert_trains_as_one_rank(tmp_path / "one.json", tmp_path / "two.json", len(one["losses"]), flags[1])


def test_stage3_nvme_under_two_ranks_equals_stage0(tmp_path):
    (tmp_path / "nvme").mkdir()
    zero = run(tmp_path, "zero", 2, "--stage", "0")
    nvme = run(tmp_path, "nvme", 2, "--stage", "3", "--optimizer", "nvme", "--params", "nvme",
               "--nvme", str(tmp_path / "nvme"))
    assert nvme["losses"] == zero["losses"]  # one world size: bit-identical across stages and placements


def test_checkpoint_of_two_ranks_resumes_in_one(tmp_path):
    ckpt = tmp_path / "ckpt"
    whole = run(tmp_path, "whole", 2, "--stage", "2", "--optimizer", "cpu", "--steps", "6")
    run(tmp_path, "first", 2, "--stage", "2", "--optimizer", "cpu", "--steps", "3", "--save", str(ckpt))
    resumed = run(tmp_path, "resumed", 1, "--stage", "3", "--optimizer", "cpu", "--params", "cpu", "--steps", "3",
                  "--load", str(ckpt))
    assert_close(resumed["losses"], whole["losses"][3:])


def test_export_and_gathered_parameters_across_two_ranks(tmp_path):
    from test_torch_export import read_safetensors
    flags = ["--stage", "3", "--optimizer", "cpu", "--params", "cpu", "--modify-rank", "1"]
    two = run(tmp_path, "two", 2, *flags, "--export", str(tmp_path / "model"))
    # One rank halving the weight itself: rank 1's values won on both ranks (rank 0 zeroed its own copy).
    one = run(tmp_path, "one", 1, *flags[:-2], "--modify-rank", "0")
    assert_close(two["losses"], one["losses"])
    tensors = read_safetensors(tmp_path / "model" / "model.safetensors")
    for name, total in two["masters"].items():
        assert abs(float(tensors[name].double().sum()) - total) <= 1e-6 * max(1.0, abs(total)), name


@pytest.mark.filterwarnings("ignore:strata.torch.init:RuntimeWarning")
def test_a_model_built_under_init_on_two_ranks_trains_what_one_rank_trains(tmp_path):
    # Each rank makes its units' values from its own seed; rank 0's are taken, as one rank seeded as rank 0 makes.
    flags = ["--stage", "3", "--optimizer", "cpu", "--params", "cpu", "--init"]
    one = run(tmp_path, "one", 1, *flags)
    two = run(tmp_path, "two", 2, *flags)
    assert_close(two["losses"], one["losses"])
    assert two["losses"][-1] < two["losses"][0]


@pytest.mark.parametrize("arch", ["llama", "t5"])
def test_two_ranks_train_a_hugging_face_architecture_as_one_rank(tmp_path, arch):
    """Rotary buffers and grouped-query attention (Llama); an encoder-decoder with one embedding in three places
    (T5): stage 3 with offload, two ranks with half of each global micro-batch each equal one rank with all of it."""
    flags = ["--arch", arch, "--stage", "3", "--optimizer", "cpu", "--params", "cpu", "--elementwise"]
    one = run(tmp_path, "one", 1, *flags)
    two = run(tmp_path, "two", 2, *flags)
    assert two["world"] == 2 and one["world"] == 1
    assert_close(two["losses"], one["losses"])
    assert_trains_as_one_rank(tmp_path / "one.json", tmp_path / "two.json", len(one["losses"]), arch)
