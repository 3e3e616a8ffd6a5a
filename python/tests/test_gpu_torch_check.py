"""scripts/gpu-torch-check.py, the strata.torch part of the prepared GPU call (issue 50 §2), kept working
without a GPU: its correctness matrix runs here on the recorded stand-in of the cuda order and on the cpu
device, the headline part says "skipped" without a GPU, and a placement whose losses differ fails it."""
import importlib.util
import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

if os.environ.get("STRATA_REQUIRE_TRANSFORMERS") != "1":
    pytest.importorskip("transformers")

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "scripts" / "gpu-torch-check.py"


def run(*args, tmp_path):
    out = tmp_path / "out.json"
    done = subprocess.run([sys.executable, str(SCRIPT), *args, "--json", str(out)], capture_output=True, text=True,
                          timeout=900)
    return done, (json.loads(out.read_text()) if out.exists() else None)


def test_the_matrix_on_the_recorded_cuda_order_is_bit_identical_across_placements(tmp_path):
    done, results = run("matrix", "--device", "recorded", tmp_path=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    (matrix,) = results
    assert matrix["status"] == "ok", matrix["failures"]
    rows = matrix["rows"]
    assert len(rows) == 11 and all("losses" in row for row in rows), rows
    assert all(row["losses"] == rows[0]["losses"] for row in rows)
    assert rows[-1]["placement"] == "stage 3, optimizer cpu, params cpu, activation checkpoints in host memory"
    assert matrix["cpu_reference"] == rows[0]["losses"]  # the stand-in trains what the cpu device trains


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU path")
def test_without_a_gpu_the_cuda_parts_skip_and_the_cpu_matrix_runs(tmp_path):
    done, results = run("all", "--device", "cpu", "--matrix-steps", "2", tmp_path=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    matrix, headline = results
    assert matrix["status"] == "ok" and len(matrix["rows"]) == 11
    assert headline == {"part": "headline", "status": "skipped", "reason": "torch sees no GPU"}
    done, results = run("matrix", tmp_path=tmp_path)  # --device cuda, the GPU call's default
    assert done.returncode == 0 and results[0]["status"] == "skipped"


def test_a_placement_that_trains_otherwise_fails_the_check(tmp_path):
    spec = importlib.util.spec_from_file_location("gpu_torch_check", SCRIPT)
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    original = check.matrix_config

    def one_differs(stage, optimizer, params, nvme, device, host_checkpoints=False):
        config = original(stage, optimizer, params, nvme, device, host_checkpoints)
        if (stage, optimizer, params) == (2, "cpu", "none"):
            config["optimizer"]["params"]["lr"] = 2e-3
        return config
    check.matrix_config = one_differs
    arguments = check.parse_arguments(["matrix", "--device", "cpu", "--matrix-steps", "2"])
    result = check.run_matrix(arguments, str(tmp_path))
    assert result["status"] == "failed"
    assert "the placements' losses differ" in result["failures"][0]
    assert "stage 2, optimizer cpu, params none" in result["failures"][0]


def test_bad_arguments_are_refused_by_name(tmp_path):
    done, _ = run("matrix", "--matrix-steps", "0", tmp_path=tmp_path)
    assert done.returncode == 2 and "--matrix-steps must be at least 1, got 0" in done.stderr
    done, _ = run("headline", "--hidden", "100", "--heads", "16", tmp_path=tmp_path)
    assert done.returncode == 2 and "--hidden 100 is not a multiple of --heads 16" in done.stderr


def test_the_pack_carries_the_module_and_without_a_gpu_it_loads_from_there(tmp_path):
    """scripts/gpu-pack.sh packs strata.torch's native module (STRATA_GPU_PACK_PYTHON_MODULE: on the GPU
    machine's Python, built by scripts/gpu-torch-module.sh) and gpu-check.sh stages it beside the working tree's
    python/strata; without a GPU the check loads it from the pack with the machine's python3 (here this test's
    interpreter) and says so."""
    import strata
    build = pathlib.Path(strata.__file__).resolve().parents[2]
    if not (build / "CMakeCache.txt").exists() or not (build / "apps" / "strata").exists():
        pytest.skip("strata is not staged in a CMake build with its programs")
    if "STRATA_ENABLE_CUDA:BOOL=ON" not in (build / "CMakeCache.txt").read_text():
        pytest.skip("the build has no CUDA: gpu-pack.sh packs CUDA builds only")
    module = next(build.glob("python/strata/_native*.so"))
    source = SCRIPT.parents[1]
    pack = tmp_path / "pack.tar.xz"
    env = dict(os.environ, XZ_OPT="-0", STRATA_GPU_PACK_PYTHON_MODULE=str(module))
    done = subprocess.run([str(source / "scripts" / "gpu-pack.sh"), str(build), str(pack)], capture_output=True,
                          text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"strata.torch's module {module.name}" in done.stdout
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(sys.executable)  # gpu-check runs python3, as on the GPU machine
    env = dict(os.environ, PATH=f"{bin_dir}:{os.environ['PATH']}", STRATA_GPU_PACK=str(pack),
               OUT=str(tmp_path / "out"))
    done = subprocess.run([str(source / "scripts" / "gpu-check.sh")], capture_output=True, text=True, timeout=600,
                          env=env, cwd=str(source))
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the check ran the GPU steps instead")
    assert done.returncode == 0, done.stdout + done.stderr
    assert summary["status"] == "no_gpu"
    assert summary["torch"].startswith("skipped: no GPU; the packed module loads (strata "), summary["torch"]


def test_the_bench_part_runs_the_headline_models_rows_on_the_cpu_device(tmp_path):
    """The penalty bench for the headline model (a call of its own on the GPU): here on the cpu device at a
    tiny shape, every row trains and the fastest has penalty 1."""
    done, results = run("bench", "--device", "cpu", "--hidden", "32", "--layers", "2", "--heads", "4",
                        "--intermediate", "64", "--vocab", "128", "--seq", "16", "--batch", "2", "--warmup", "1",
                        "--steps", "2", "--nvme", str(tmp_path), tmp_path=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    (part,) = results
    assert part["status"] == "ok", part
    rows = part["bench"]["rows"]
    assert [row["status"] for row in rows] == ["ok"] * 4, rows
    assert part["bench"]["device"] == "cpu"
    assert min(row["penalty"] for row in rows) == 1.0
