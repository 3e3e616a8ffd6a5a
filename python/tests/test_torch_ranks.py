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


@pytest.mark.parametrize("flags", [["--stage", "0"],
                                   ["--stage", "3", "--optimizer", "cpu", "--params", "cpu"]],
                         ids=["stage0", "stage3-cpu"])
def test_two_ranks_train_what_one_rank_trains(tmp_path, flags):
    one = run(tmp_path, "one", 1, *flags)
    two = run(tmp_path, "two", 2, *flags)
    assert two["world"] == 2 and one["world"] == 1
    assert_close(two["losses"], one["losses"])
    assert two["losses"][-1] < two["losses"][0]
    for name, total in one["masters"].items():
        if name.endswith("qkv.bias"):
            continue  # the key bias's gradient is 0 analytically: Adam normalizes rounding noise there
        assert abs(two["masters"][name] - total) <= 1e-4 * max(1.0, abs(total)), name


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
    flags = ["--arch", arch, "--stage", "3", "--optimizer", "cpu", "--params", "cpu"]
    one = run(tmp_path, "one", 1, *flags)
    two = run(tmp_path, "two", 2, *flags)
    assert two["world"] == 2 and one["world"] == 1
    assert_close(two["losses"], one["losses"])
    for name, total in one["masters"].items():
        assert abs(two["masters"][name] - total) <= 1e-4 * max(1.0, abs(total)), (arch, name)
