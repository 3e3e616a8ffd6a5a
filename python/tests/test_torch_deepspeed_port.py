"""Porting a DeepSpeed script by its imports alone (docs/torch.md, "Porting a
DeepSpeed script"): deepspeed_style_train.py, written for DeepSpeed, gets
the port rule applied to its import lines and nothing else, then trains
under strata.torch; its losses equal a plain-torch loop that does what
DeepSpeed does (DistributedSampler order with seed 0, AdamW, WarmupLR's
linear warm-up), and its checkpoints resume and replace as DeepSpeed's."""
import importlib.util
import json
import pathlib
import re
import subprocess
import sys

import pytest
import torch

SCRIPT = pathlib.Path(__file__).resolve().parent / "deepspeed_style_train.py"


def port(text):
    """The port rule, applied mechanically to import lines only."""
    lines = []
    for line in text.splitlines(keepends=True):
        line = re.sub(r"^(\s*)import deepspeed(\s*)$", r"\1import strata.torch as deepspeed\2", line)
        line = re.sub(r"^(\s*)from deepspeed((?:\.\w+)*) import ", r"\1from strata.torch\2 import ", line)
        lines.append(line)
    return "".join(lines)


def test_the_port_rule_changes_import_lines_only():
    original = SCRIPT.read_text()
    ported = port(original)
    changed = [(a, b) for a, b in zip(original.splitlines(), ported.splitlines()) if a != b]
    assert changed == [
        ("import deepspeed", "import strata.torch as deepspeed"),
        ("from deepspeed.accelerator import get_accelerator", "from strata.torch.accelerator import get_accelerator"),
        ("from deepspeed.ops.adam import DeepSpeedCPUAdam", "from strata.torch.ops.adam import DeepSpeedCPUAdam"),
        ("from deepspeed.runtime.lr_schedules import WarmupLR",
         "from strata.torch.runtime.lr_schedules import WarmupLR"),
        ("from deepspeed.utils import log_dist, set_z3_leaf_modules",
         "from strata.torch.utils import log_dist, set_z3_leaf_modules"),
    ]


def run_ported(tmp_path, stage, steps, ckpt=None):
    script = tmp_path / "ported_train.py"
    script.write_text(port(SCRIPT.read_text()))
    config = tmp_path / f"ds_stage{stage}.json"
    config.write_text(json.dumps({"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 1,
                                  "gradient_clipping": 1.0, "zero_optimization": {"stage": stage}}))
    command = [sys.executable, str(script), "--deepspeed", "--deepspeed_config", str(config), "--steps", str(steps)]
    if ckpt is not None:
        command += ["--ckpt", str(ckpt)]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600, cwd=str(SCRIPT.parent))
    assert done.returncode == 0, done.stdout + done.stderr
    records = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return records, done.stdout


def ported_module(tmp_path):
    """The ported script imported as a module: its model and data (main() runs only as a script)."""
    path = tmp_path / "ported_module.py"
    path.write_text(port(SCRIPT.read_text()))
    spec = importlib.util.spec_from_file_location("ported_module", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def reference_run(script, steps):
    """What DeepSpeed computes for the script, in plain torch: its data order (DistributedSampler, seed 0),
    AdamW, WarmupLR (linear) and gradient clipping. (losses, gradient norms)."""
    torch.manual_seed(0)
    model = script.Net()
    dataset = script.make_dataset()
    sampler = torch.utils.data.DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
    loader = torch.utils.data.DataLoader(dataset, batch_size=8, sampler=sampler)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01, eps=1e-8)

    def warmup_lr(iteration):  # WarmupLR, linear: min + (max - min) * i / W, W = 4; the constructor's is i = -1
        return 1e-4 if iteration < 0 else 1e-4 + (1e-3 - 1e-4) * min(iteration / 4, 1.0)

    iteration = -1
    for group in optimizer.param_groups:
        group["lr"] = warmup_lr(iteration)
    losses, norms = [], []
    for x, y in loader:
        if len(losses) == steps:
            break
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        iteration += 1
        for group in optimizer.param_groups:
            group["lr"] = warmup_lr(iteration)
    return losses, norms


@pytest.mark.parametrize("stage", [2, 3])
def test_ported_script_trains_as_deepspeed(tmp_path, stage):
    records, stdout = run_ported(tmp_path, stage, steps=8)
    script = ported_module(tmp_path)
    losses, norms = reference_run(script, 8)
    steps = [r for r in records if "step" in r]
    assert [r["step"] for r in steps] == list(range(1, 9))
    for ours, ref in zip([r["loss"] for r in steps], losses):
        assert abs(ours - ref) <= 1e-5 * abs(ref), (ours, ref)
    for ours, ref in zip([r["grad_norm"] for r in steps], norms):
        assert abs(ours - ref) <= 1e-4 * ref, (ours, ref)
    # WarmupLR's lr after each step, as DeepSpeed's get_last_lr() gives it: linear to 1e-3 over 4 iterations.
    assert [r["lr"] for r in steps] == pytest.approx([1e-4 + 9e-4 * min(i / 4, 1) for i in range(8)], rel=1e-12)
    header = records[0]
    # DeepSpeed's count (ds_numel at stage 3, numel below) is the model's size; args.local_rank is set.
    assert header == {"model_size": sum(p.numel() for p in script.Net().parameters()), "local_rank": 0,
                      "device": "cpu"}
    assert "model size:" in stdout
    # And DeepSpeed itself (0.19.8, run once on this script: data/deepspeed_port_losses.json says how): the same
    # losses, lrs and gradient norms, and the same model size.
    peer = json.loads((SCRIPT.parent / "data" / "deepspeed_port_losses.json").read_text())["stages"][str(stage)]
    for ours, theirs in zip([r["loss"] for r in steps], peer["losses"]):
        assert abs(ours - theirs) <= 1e-5 * abs(theirs), (ours, theirs)
    for ours, theirs in zip([r["grad_norm"] for r in steps], peer["grad_norms"]):
        assert abs(ours - theirs) <= 1e-5 * theirs, (ours, theirs)
    assert [r["lr"] for r in steps] == pytest.approx(peer["lrs"], rel=1e-12)
    assert header["model_size"] == peer["model_size"]
    worst = max(abs(r["loss"] - t) / abs(t) for r, t in zip(steps, peer["losses"]))
    print(f"stage {stage}: worst relative loss difference to DeepSpeed 0.19.8: {worst:.2g} (bound 1e-5)")


def test_ported_script_resumes_and_replaces_its_checkpoint(tmp_path):
    ckpt = tmp_path / "ckpt"
    first, _ = run_ported(tmp_path, 2, steps=3, ckpt=ckpt)
    assert {"loaded": None, "client_state": None} in first  # nothing to load yet: (None, None), not an error
    second, _ = run_ported(tmp_path, 2, steps=3, ckpt=ckpt)
    loaded = next(r for r in second if "loaded" in r)
    assert loaded == {"loaded": str(ckpt / "latest_run"), "client_state": {"step": 3}}
    assert [r["step"] for r in second if "step" in r] == [4, 5, 6]
    # The second run saved into the same tag: replaced, and the third run resumes from it.
    third, _ = run_ported(tmp_path, 2, steps=1, ckpt=ckpt)
    assert next(r for r in third if "loaded" in r)["client_state"] == {"step": 6}
    assert sorted(p.name for p in ckpt.iterdir()) == ["latest", "latest_run"]
