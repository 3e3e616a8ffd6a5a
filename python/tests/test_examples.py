"""examples/torch/train_gpt2.py (docs/torch.md) runs: trains, checkpoints,
exports, and from_pretrained gives the engine's logits."""
import os
import pathlib
import subprocess
import sys

import pytest

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "torch" / "train_gpt2.py"

if os.environ.get("STRATA_REQUIRE_TRANSFORMERS") != "1":
    pytest.importorskip("transformers")


def test_gpt2_example_trains_and_exports(tmp_path):
    done = subprocess.run([sys.executable, str(EXAMPLE), "--steps", "5", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "step 5: loss" in done.stdout
    assert "from_pretrained gives the engine's logits: True" in done.stdout
    assert (tmp_path / "model" / "model.safetensors").exists() and (tmp_path / "ckpt" / "latest").exists()
