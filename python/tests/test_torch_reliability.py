"""strata.torch under careless and unlucky use (issue 48, the front end's
items): nothing lost, nothing trained on silently, every message in
Strata's own words naming the culprit (docs/reliability.md, "The torch
path's guarantees"). The exit and full-disk tests run real processes."""

import os
import re
import subprocess
import sys
import textwrap
import threading

import pytest
import torch

import strata
import strata.torch as st
from test_torch_frontend import MICRO, SEQ, VOCAB, config, lm_loss, make_lm, make_mlp, mlp_batch, mlp_loss, train_engine

HERE = os.path.dirname(os.path.abspath(__file__))


def run_script(body, *args, prefix=(), timeout=300):
    """Runs body as a Python script in a process of its own (this interpreter, this test folder on the path)."""
    script = "import sys, torch\nsys.path.insert(0, %r)\nimport strata.torch as st\n" % HERE + textwrap.dedent(body)
    return subprocess.run([*prefix, sys.executable, "-W", "ignore", "-c", script, *map(str, args)],
                          capture_output=True, text=True, timeout=timeout)


def swap_folders(path):
    return sorted(name for name in os.listdir(path) if name.startswith("strata-"))


# -- losing work ------------------------------------------------------------------------------------
SAVE_AS_THE_LAST_LINE = """
    nvme, save = sys.argv[1], sys.argv[2]
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)])
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": nvme},
                                 "offload_param": {"device": "nvme", "nvme_path": nvme}},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "strata": {"device": "cpu", "device_memory": "256MiB"}}
    engine, _, _, _ = st.initialize(model=model, config=cfg)
    x = torch.randn(2, 1024, generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        loss = engine(x).square().mean()  # still alive at the end: its graph holds the engine
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(save)
"""


def test_a_save_as_the_scripts_last_line_completes_and_the_swap_folder_is_removed(tmp_path):
    nvme, save = tmp_path / "nvme", tmp_path / "ckpt"
    nvme.mkdir()
    done = run_script(SAVE_AS_THE_LAST_LINE, nvme, save)
    assert done.returncode == 0, done.stderr
    assert sorted(os.listdir(save)) == ["global_step2", "latest"], os.listdir(save)  # no .tmp-* left
    assert swap_folders(nvme) == []
    # Complete: a fresh engine of the same model loads it and goes on.
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024) for _ in range(8)])
    cfg = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
           "zero_optimization": {"stage": 0}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
           "strata": {"device": "cpu", "device_memory": "256MiB"}}
    engine, _, _, _ = st.initialize(model=model, config=cfg)
    assert str(engine.load_checkpoint(save)[0]).endswith("global_step2")
    assert engine.global_steps == 2
    engine.close()


def test_a_start_names_the_stale_swap_folders_of_dead_processes(tmp_path):
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    killed = run_script("""
        import os, signal
        cfg = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 2, "offload_optimizer": {
            "device": "nvme", "nvme_path": sys.argv[1]}}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "strata": {"device": "cpu", "device_memory": "64MiB"}}
        engine = st.initialize(model=torch.nn.Linear(8, 8), config=cfg)[0]
        os.kill(os.getpid(), signal.SIGKILL)
    """, nvme)
    assert killed.returncode == -9, killed.stderr
    (left,) = swap_folders(nvme)
    with pytest.warns(RuntimeWarning, match="swap folder") as caught:
        engine = st.initialize(model=make_mlp(), config=config(2, "nvme", nvme_dir=nvme, accum=1))[0]
    text = "\n".join(str(w.message) for w in caught)
    assert left in text and f"strata swap clean --path {nvme}" in text and "died" in text
    assert left in swap_folders(nvme)  # named, never removed: it is not this process's
    engine.close()


def test_close_waits_for_the_save_frees_the_swap_folder_and_refuses_later_calls(tmp_path):
    engine = st.initialize(model=make_lm(), config=config(3, "nvme", "nvme", nvme_dir=tmp_path, accum=1))[0]
    train_engine(engine, lm_loss, 1)
    engine.save_checkpoint(tmp_path / "ckpt")
    done = engine.close()
    assert done["tag"] == "global_step1" and done["committed"]
    assert swap_folders(tmp_path) == []
    assert all(p.numel() == 0 for p in engine.module.parameters())  # nothing views the freed memory
    with pytest.raises(strata.FailedPrecondition, match="closed"):
        lm_loss(engine, 0)
    assert engine.close() is None  # closing twice is nothing


# -- training on silently -----------------------------------------------------------------------------
@pytest.mark.parametrize("stage", [0, 3])
def test_a_module_replaced_after_initialize_is_refused_at_the_next_forward(stage):
    model = make_mlp()
    engine = st.initialize(model=model, config=config(stage, accum=1))[0]
    train_engine(engine, mlp_loss, 1)
    model[1] = torch.nn.ReLU()  # no parameters: the engine's are as they were
    train_engine(engine, mlp_loss, 1, first_batch=1)
    model[2] = torch.nn.Linear(64, 64)
    x, _ = mlp_batch(2)
    for grad in (True, False):
        with torch.set_grad_enabled(grad), pytest.raises(strata.FailedPrecondition,
                                                         match=r"module '2' \(Linear\) holds parameter.*'2.weight'"):
            engine(x)
    model[2].weight = torch.nn.Parameter(torch.zeros(64, 64))  # a parameter replaced: named too
    with pytest.raises(strata.FailedPrecondition, match="'2.weight'"):
        engine(x)


class CrossUse(torch.nn.Module):
    """Two units; `cross` makes the second read the first's weight (outside the first's unit)."""

    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(16, 16)
        self.second = torch.nn.Linear(16, 16)
        self.cross = False

    def forward(self, x):
        x = self.first(x)
        if self.cross:
            x = x + self.first.weight.sum()
        return self.second(x)


def test_a_parameter_used_outside_its_unit_after_the_first_forward_is_named_in_eval_and_training():
    torch.manual_seed(0)
    model = CrossUse()
    engine = st.initialize(model=model, config=config(3, accum=1), units=[torch.nn.Linear])[0]
    x = torch.randn(4, 16)
    engine.backward(engine(x).square().mean())
    engine.step()
    model.cross = True
    with torch.no_grad(), pytest.raises(strata.Unsupported, match=r"'first.weight'.*reading|'first.weight'.*sum"):
        engine(x)  # the empty placeholder's sum() would be 0
    with pytest.raises(strata.Unsupported, match="'first.weight'"):
        engine(x)
    model.cross = False  # the refusals changed nothing: training goes on
    engine.backward(engine(x).square().mean())
    engine.step()
    assert engine.global_steps == 2
    with torch.no_grad():
        assert engine(x).shape == (4, 16)
    assert model.first.weight.dtype == torch.float32  # what the placeholder keeps is readable anywhere


def test_a_backward_that_reaches_no_unit_is_refused_and_the_micro_batch_goes_on():
    reference = train_engine(st.initialize(model=make_mlp(), config=config(0, accum=1))[0], mlp_loss, 2)
    engine = st.initialize(model=make_mlp(), config=config(0, accum=1))[0]
    x, y = mlp_batch(0)
    out = engine(x)
    foreign = (torch.ones(3, requires_grad=True) * 2).sum()
    with pytest.raises(strata.FailedPrecondition, match="reaches none of the model's outputs"):
        engine.backward(foreign)
    engine.backward(torch.nn.functional.mse_loss(out, y))  # the micro-batch was left open
    engine.step()
    losses = [engine.metrics["loss"]] + train_engine(engine, mlp_loss, 1, first_batch=1)
    assert losses == reference


class Affine(torch.nn.Module):
    """Elementwise only: trains in fp16 on the cpu device of torch 1.13 (no fp16 matmul there)."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(16))
        self.shift = torch.nn.Parameter(torch.zeros(16))

    def forward(self, x):
        return x * self.scale + self.shift


@pytest.mark.parametrize("precision", ["fp32", "bf16", "fp16"])
def test_an_empty_micro_batch_is_refused_in_every_precision(precision):
    cfg = config(0, accum=2)
    dtype = torch.float32
    if precision != "fp32":
        cfg[precision] = {"enabled": True} if precision == "bf16" else {"enabled": True, "loss_scale": 1.0}
        dtype = torch.float16 if precision == "fp16" else torch.bfloat16
    engine = st.initialize(model=Affine(), config=cfg)[0]

    def step(x):
        for _ in range(2):
            engine.backward(engine(x).float().square().mean())
            engine.step()

    step(torch.randn(4, 16).to(dtype))
    before = engine.master_parameters()
    empty = torch.zeros(0, 16, dtype=dtype)
    with pytest.raises(strata.InvalidArgument, match=r"micro-batch 1 of 2 of step 2 is empty.*argument 0.*\[0, 16\]"):
        engine(empty)
    with pytest.raises(strata.InvalidArgument, match=r"argument 'x'"):
        engine(x=empty)
    with pytest.raises(strata.InvalidArgument, match="is empty"):
        engine.module(empty)  # the model called directly: its hook refuses it
    after = engine.master_parameters()
    assert all(torch.equal(before[k], after[k]) for k in before)
    step(torch.randn(4, 16).to(dtype))  # nothing was opened: the step runs
    assert engine.global_steps == 2
    with torch.no_grad():
        assert engine(empty).shape == (0, 16)  # an evaluation of nothing changes nothing: allowed


def test_a_second_thread_is_refused_and_the_first_is_unharmed():
    reference = train_engine(st.initialize(model=make_lm(), config=config(3, accum=2))[0], lm_loss, 3)
    engine = st.initialize(model=make_lm(), config=config(3, accum=2))[0]
    inside, tried = threading.Event(), threading.Event()
    refusals = []

    def other_thread():
        inside.wait(timeout=120)
        calls = [lambda: lm_loss(engine, 99), lambda: engine.step(), lambda: engine.backward(torch.zeros(())),
                 lambda: engine.save_checkpoint("/nonexistent"), lambda: engine.wait_checkpoint()]
        with torch.no_grad():
            calls.append(lambda: engine(torch.zeros(MICRO, SEQ, dtype=torch.long)))
        for call in calls:
            try:
                call()
            except strata.FailedPrecondition as e:
                refusals.append(str(e))
        tried.set()

    block = engine.module.blocks[1]
    original = block.forward

    def forward_that_waits(x):  # the second thread tries while the first is inside a forward
        if not tried.is_set():
            inside.set()
            tried.wait(timeout=120)
        return original(x)

    block.forward = forward_that_waits
    losses = []

    def first_thread():
        losses.extend(train_engine(engine, lm_loss, 3))

    threads = [threading.Thread(target=first_thread, name="first", daemon=True),
               threading.Thread(target=other_thread, name="second", daemon=True)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not any(t.is_alive() for t in threads), "the two threads are stuck on the engine"
    assert losses == reference
    assert len(refusals) == 6, refusals
    assert all("thread 'second'" in r and "thread 'first' drives this engine" in r and
               "one engine is driven by one thread at a time" in r for r in refusals), refusals
    block.forward = original
    # Between steps another thread (this one) takes the engine over.
    train_engine(engine, lm_loss, 1, first_batch=6)
    assert engine.global_steps == 4


# -- messages -----------------------------------------------------------------------------------------
def test_a_non_utf8_byte_in_latest_is_shown_escaped(tmp_path):
    engine = st.initialize(model=make_mlp(), config=config(0, accum=1))[0]
    train_engine(engine, mlp_loss, 1)
    engine.save_checkpoint(tmp_path, sync=True)
    (tmp_path / "latest").write_bytes(b"global_step1\xff\x1b[2J\n")
    fresh = st.initialize(model=make_mlp(), config=config(0, accum=1))[0]
    with pytest.raises(strata.InvalidArgument) as refused:
        fresh.load_checkpoint(tmp_path)
    assert "global_step1\\xff\\x1b[2J" in str(refused.value) and "latest" in str(refused.value)
    assert "\x1b" not in str(refused.value)


def test_an_error_that_stops_the_engine_names_the_python_call():
    engine = st.initialize(model=make_mlp(), config=config(0, accum=1))[0]
    x, _ = mlp_batch(0)
    engine.backward(torch.sqrt(engine(x) * 0).sum())  # a finite loss (0) whose gradient is not (0 x inf)
    with pytest.raises(strata.DataLoss, match="gradient norm is not finite"):
        engine.step()
    with pytest.raises(strata.StrataError) as stopped:
        mlp_loss(engine, 1)
    assert "engine.load_checkpoint(DIR)" in str(stopped.value), str(stopped.value)
    assert "strata train --resume" not in str(stopped.value)
    # The failed step ended in the engine (Note [Driving the engine]): a call its phase refuses now says why the
    # engine stopped, not that the call is out of order.
    for call in (engine.step, engine.synchronize, lambda: engine.backward(torch.zeros(()))):
        with pytest.raises(strata.DataLoss, match="this engine stopped .*gradient norm is not finite"):
            call()


def test_a_second_engine_on_one_nvme_path_is_told_the_job_name_keyword(tmp_path):
    first = st.initialize(model=make_mlp(), config=config(1, "nvme", nvme_dir=tmp_path, accum=1))[0]
    with pytest.raises(strata.FailedPrecondition, match=r"initialize\(job_name=.*engine.close\(\)"):
        st.initialize(model=make_mlp(), config=config(1, "nvme", nvme_dir=tmp_path, accum=1))
    second = st.initialize(model=make_mlp(), config=config(1, "nvme", nvme_dir=tmp_path, accum=1),
                           job_name="second-run")[0]
    assert train_engine(first, mlp_loss, 2) == train_engine(second, mlp_loss, 2)
    assert "strata-second-run" in swap_folders(tmp_path)
    with pytest.raises(strata.InvalidArgument, match="job_name 'a/b' is not 1-48 characters"):
        st.initialize(model=make_mlp(), config=config(1, "nvme", nvme_dir=tmp_path, accum=1), job_name="a/b")
    # The engine's own check, for callers of strata.engine.Engine (no folder is made outside the nvme_path).
    with pytest.raises(strata.InvalidArgument, match=r"the swap folders' job name '\.\./up' is not 1-48 characters"):
        strata.engine.Engine(config(1, "nvme", nvme_dir=tmp_path, accum=1),
                             [("layer", [strata.engine.TensorSpec("w", [4], "float32")])], job_name="../up")
    first.close()
    second.close()
    assert swap_folders(tmp_path) == []


def test_a_nan_lr_names_its_key():
    with pytest.raises(strata.InvalidArgument, match=r"optimizer\.params\.lr is nan"):
        st.initialize(model=make_mlp(), config=config(0, accum=1, lr=float("nan")))
    engine, optimizer, _, _ = st.initialize(model=make_mlp(), config=config(0, accum=1))
    optimizer.param_groups[0]["lr"] = float("nan")
    engine.backward(mlp_loss(engine, 0))
    with pytest.raises(strata.InvalidArgument, match=r"param_groups\[0\]\['lr'\] is nan"):
        engine.step()


def test_a_json_nested_too_deep_names_the_depth_limit(tmp_path):
    deep = {}
    inner = deep
    for _ in range(100_000):
        inner["x"] = {}
        inner = inner["x"]
    cfg = config(0, accum=1)
    cfg["nest"] = deep
    with pytest.raises(strata.InvalidArgument, match="nests deeper than 64 levels"):
        st.initialize(model=make_mlp(), config=cfg)
    engine = st.initialize(model=make_mlp(), config=config(0, accum=1))[0]
    train_engine(engine, mlp_loss, 1)
    with pytest.raises(strata.InvalidArgument, match=r"client_state: x\.x\.x.*deeper than 62 levels"):
        engine.save_checkpoint(tmp_path, client_state=deep)


FULL_DISK = """
    import subprocess
    folder = sys.argv[1]
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", folder], check=True)
    torch.manual_seed(0)
    engine = st.initialize(model=torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)]), config={
        "train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
        "strata": {"device": "cpu", "device_memory": "64MiB"}})[0]
    engine.backward(engine(torch.randn(1, 256)).sum())
    engine.step()
    try:
        engine.save_checkpoint(folder, tag="synchronous", sync=True)
    except Exception as e:
        print(type(e).__name__, e)
    engine.save_checkpoint(folder)  # the last line: the save fails at exit
"""


def test_a_checkpoint_to_a_full_disk_says_how_many_bytes_it_needs(tmp_path):
    folder = tmp_path / "small"
    folder.mkdir()
    # A real 1 MiB file system, mounted in a mount namespace of the test's own (no root needed).
    done = run_script(FULL_DISK, folder, prefix=("unshare", "--user", "--map-root-user", "--mount"))
    assert re.search(r"ResourceExhausted checkpoint 'synchronous'.*: checkpoint 'synchronous' needs 3\.0\d MiB on rank 0 \(1\.0\d MiB of fp32 "
                     r"master weights, 2\.0\d MiB of optimizer state\); the file system of .* has .* free",
                     done.stdout), done.stdout + done.stderr
    assert done.returncode == 1, done.stderr  # the save asked for last did not complete: said, and the status
    assert re.search(r"checkpoint 'global_step1' needs 3\.0\d MiB", done.stderr) and "NOT saved" in done.stderr, \
        done.stderr
