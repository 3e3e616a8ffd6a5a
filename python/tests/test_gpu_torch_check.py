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
    assert len(rows) == 10 and all("losses" in row for row in rows), rows
    assert all(row["losses"] == rows[0]["losses"] for row in rows)
    assert matrix["cpu_reference"] == rows[0]["losses"]  # the stand-in trains what the cpu device trains


@pytest.mark.skipif(torch.cuda.is_available(), reason="the no-GPU path")
def test_without_a_gpu_the_cuda_parts_skip_and_the_cpu_matrix_runs(tmp_path):
    done, results = run("all", "--device", "cpu", "--matrix-steps", "2", tmp_path=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    matrix, headline = results
    assert matrix["status"] == "ok" and len(matrix["rows"]) == 10
    assert headline == {"part": "headline", "status": "skipped", "reason": "torch sees no GPU"}
    done, results = run("matrix", tmp_path=tmp_path)  # --device cuda, the GPU call's default
    assert done.returncode == 0 and results[0]["status"] == "skipped"


def test_a_placement_that_trains_otherwise_fails_the_check(tmp_path):
    spec = importlib.util.spec_from_file_location("gpu_torch_check", SCRIPT)
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    original = check.matrix_config

    def one_differs(stage, optimizer, params, nvme, device):
        config = original(stage, optimizer, params, nvme, device)
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
