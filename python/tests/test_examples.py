"""examples/torch/train_gpt2.py and finetune_causal_lm.py (docs/torch.md) run: train, checkpoint,
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


FINETUNE = EXAMPLE.parent / "finetune_causal_lm.py"


def test_finetune_example_reads_a_pretrained_folder_and_nvme_gives_the_same_losses(tmp_path):
    """The first run saves a tiny random Llama and fine-tunes it with the state in host memory; the second names
    that folder with --pretrained and puts the state on NVMe: the same losses, and both exports load."""
    def run(*flags):
        done = subprocess.run([sys.executable, str(FINETUNE), "--steps", "3", *flags], capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, done.stdout + done.stderr
        assert "from_pretrained gives the engine's logits: True" in done.stdout, done.stdout
        return [line for line in done.stdout.splitlines() if line.startswith("step ")]

    first = run("--out", str(tmp_path / "a"))
    assert len(first) == 3
    (tmp_path / "nvme").mkdir()
    second = run("--out", str(tmp_path / "b"), "--pretrained", str(tmp_path / "a" / "pretrained"),
                 "--nvme", str(tmp_path / "nvme"))
    assert second == first


def test_gpt2_example_under_torchrun_shares_one_folder(tmp_path):
    """The README's launch: two ranks under torchrun, no --out: rank 0's temporary folder is told to rank 1 over
    strata.torch.comm, so the checkpoint and the export of both ranks land in one folder."""
    from test_torch_launchers import TORCHRUN
    port = free_port()
    command = [*TORCHRUN, "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(port),
               str(EXAMPLE), "--steps", "2"]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_SIZE")}
    env.update(OMP_NUM_THREADS="1", TMPDIR=str(tmp_path))
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "from_pretrained gives the engine's logits: True" in done.stdout + done.stderr
    made = [p for p in tmp_path.iterdir() if p.name.startswith("strata-gpt2-")]
    assert len(made) == 1, made  # one folder, rank 0's
    assert (made[0] / "ckpt" / "latest").exists() and (made[0] / "model" / "model.safetensors").exists()


def free_port():
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
