"""Bad input to the pure-Python parts of strata: each is refused with an
error that names the culprit, before anything changes (optimizer steps,
exports, safetensors reads, engine layers, estimates, checkpoints)."""
import errno
import json
import os
import pickle
import signal
import struct
import warnings

import pytest
import torch

import strata
import strata.torch as st
from strata import _safetensors
from strata._safetensors import Checkpoint
from strata._torch_init import checkpoint_keys
from strata.engine import Engine, TensorSpec
from strata.errors import InvalidArgument, IoError, NotFound
from strata.optim import CPUAdagrad, CPUAdam, CPULion
from test_torch_frontend import config, make_mlp, mlp_loss, train_engine


# -- strata.optim ---------------------------------------------------------------------------------------

def _params(count=3, size=16):
    params = [torch.nn.Parameter(torch.ones(size)) for _ in range(count)]
    for p in params:
        p.grad = torch.full((size,), 0.5)
    return params


def test_optim_bad_step_count_of_a_later_param_changes_nothing():
    params = _params()
    opt = CPUAdam(params, lr=1e-2)
    opt.step()
    opt.state[params[2]]["step"] = -5.0
    before = [p.detach().clone() for p in params]
    moments = [opt.state[p]["exp_avg"].clone() for p in params]
    with pytest.raises(ValueError, match="param 2 of group 0: state 'step' is -5.0"):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(before, params))
    assert all(torch.equal(m, opt.state[p]["exp_avg"]) for m, p in zip(moments, params))
    assert [opt.state[p]["step"] for p in params] == [1.0, 1.0, -5.0]
    # A good count is taken in any of the forms state dicts hold: float, int, torch's tensor.
    for i, count in enumerate((1.0, 1, torch.tensor(1.0))):
        opt.state[params[i]]["step"] = count
    opt.step()
    assert [opt.state[p]["step"] for p in params] == [2.0, 2.0, 2.0]
    ref = torch.optim.AdamW([torch.nn.Parameter(torch.ones(16))], lr=1e-2)
    ref.param_groups[0]["params"][0].grad = torch.ones(16)
    ref.step()
    loaded = CPUAdam([torch.nn.Parameter(torch.ones(16))], lr=1e-2)
    loaded.load_state_dict(ref.state_dict())
    loaded.param_groups[0]["params"][0].grad = torch.ones(16)
    loaded.step()
    assert float(loaded.state[loaded.param_groups[0]["params"][0]]["step"]) == 2.0


def test_optim_bad_hyper_parameter_of_a_later_group_changes_nothing():
    q = _params(2, 10)
    opt = CPUAdam([{"params": [q[0]]}, {"params": [q[1]]}], lr=1e-2)
    opt.param_groups[1]["lr"] = float("nan")
    with pytest.raises(ValueError, match="'lr' of param group 1: nan"):
        opt.step()
    assert torch.equal(q[0].detach(), torch.ones(10)) and torch.equal(q[1].detach(), torch.ones(10))
    assert len(opt.state) == 0  # not even a fresh state was made
    opt.param_groups[1]["lr"] = 1e-2
    opt.param_groups[0]["betas"] = (0.9, 1.0)
    with pytest.raises(ValueError, match="beta parameter at index 1 of 'betas' of param group 0"):
        opt.step()
    opt.param_groups[0]["betas"] = (0.9, 0.999)
    opt.step()  # fixed: the step goes on
    assert opt.state[q[0]]["step"] == 1.0 and opt.state[q[1]]["step"] == 1.0


@pytest.mark.parametrize("kwargs, error, text", [
    (dict(lr=float("inf")), ValueError, "learning rate: inf"),
    (dict(eps=float("inf")), ValueError, "epsilon value: inf"),
    (dict(weight_decay=float("inf")), ValueError, "weight_decay value: inf"),
    (dict(lr=True), TypeError, "learning rate must be a number, not bool"),
    (dict(lr="1e-3"), TypeError, "learning rate must be a number, not str"),
    (dict(betas=(True, 0.9)), TypeError, "beta parameter at index 0"),
])
def test_optim_constructor_refuses_non_finite_and_bool(kwargs, error, text):
    with pytest.raises(error, match=text):
        CPUAdam(_params(1), **kwargs)


def test_optim_siblings_refuse_non_finite():
    with pytest.raises(ValueError, match="epsilon value: inf"):
        CPUAdagrad(_params(1), eps=float("inf"))
    with pytest.raises(ValueError, match="initial_accumulator_value value: inf"):
        CPUAdagrad(_params(1), initial_accumulator_value=float("inf"))
    with pytest.raises(ValueError, match="weight_decay value: inf"):
        CPULion(_params(1), weight_decay=float("inf"))
    with pytest.raises(TypeError, match="learning rate must be a number, not bool"):
        CPULion(_params(1), lr=False)
    # (refused before too, and still)
    with pytest.raises(ValueError, match="learning rate: nan"):
        CPUAdam(_params(1), lr=float("nan"))
    with pytest.raises(ValueError, match="beta parameter at index 1"):
        CPUAdam(_params(1), betas=(0.9, float("nan")))
    with pytest.raises(ValueError, match="betas must be two numbers"):
        CPUAdam(_params(1), betas=(0.9,))


@pytest.mark.parametrize("kwargs, error, text", [
    (dict(threads=True), TypeError, "threads must be a whole number, not bool"),
    (dict(threads=1.5), TypeError, "threads must be a whole number, not float"),
    (dict(threads=2 ** 40), ValueError, "threads 1099511627776 is out of range"),
    (dict(threads=-1), ValueError, "threads -1"),
    (dict(tile_elements=-64), ValueError, "tile_elements -64"),
    (dict(tile_elements=2 ** 70), ValueError, "tile_elements 1180591620717411303424 is out of range"),
    (dict(tile_elements=100), ValueError, "tile_elements 100 must be a multiple of 64"),
    (dict(tile_elements=True), TypeError, "tile_elements must be a whole number, not bool"),
    (dict(kernel_path=3), TypeError, "kernel_path must be a str"),
])
def test_optim_kernel_arguments_are_range_checked_by_name(kwargs, error, text):
    with pytest.raises(error, match=text):
        CPUAdam(_params(1), **kwargs)


def test_optim_kernel_path_control_characters_are_escaped():
    with pytest.raises(ValueError) as info:
        CPUAdam(_params(1), kernel_path="bogus\x1b[31m")
    assert "\x1b" not in str(info.value) and "\\x1b" in str(info.value)


@pytest.mark.parametrize("scale, error", [(0, ValueError), (-1.0, ValueError), (float("nan"), ValueError),
                                          (float("inf"), ValueError), (True, TypeError)])
def test_optim_grad_norm_refuses_a_bad_loss_scale(scale, error):
    opt = CPUAdam(_params(1))
    with pytest.raises(error, match="loss_scale"):
        opt.grad_norm(loss_scale=scale)
    assert opt.grad_norm(loss_scale=2.0) == pytest.approx(0.5 * 4 / 2.0)


@pytest.mark.parametrize("step, error", [
    (float("nan"), ValueError), (float("inf"), ValueError), (2.0 ** 70, ValueError), (2 ** 70, ValueError),
    (1.5, ValueError), (-1, ValueError), (torch.tensor(float("inf")), ValueError), ("3", TypeError),
    (True, TypeError), (torch.tensor([1.0, 2.0]), TypeError)])
def test_optim_bad_step_counts_are_named(step, error):
    params = _params(2)
    opt = CPUAdam([{"params": [params[0]]}, {"params": [params[1]]}])
    opt.step()
    opt.state[params[1]]["step"] = step
    before = params[0].detach().clone()
    with pytest.raises(error, match="param 0 of group 1: state 'step'"):
        opt.step()
    assert torch.equal(before, params[0])


def test_optim_refused_param_group_and_state_dict_are_not_kept():
    opt = CPUAdam(_params(1), lr=1e-2)
    with pytest.raises(ValueError, match="'lr' of param group 1"):
        opt.add_param_group({"params": _params(1), "lr": float("inf")})
    assert len(opt.param_groups) == 1
    sd = opt.state_dict()
    sd["param_groups"][0]["lr"] = float("nan")
    with pytest.raises(ValueError, match="'lr' of param group 0"):
        opt.load_state_dict(sd)
    assert opt.param_groups[0]["lr"] == 1e-2


def test_optim_grads_given_as_one_flat_list_is_named():
    opt = CPUAdam(_params(1))
    with pytest.raises(TypeError, match=r"grads\[0\] is a tensor"):
        opt.step(grads=[torch.ones(16)])


# -- strata.errors ----------------------------------------------------------------------------------------

def test_not_found_and_io_error_are_os_errors_with_their_message_code_and_args():
    names = strata._native._status_code_names()
    for name, bases in (("NotFound", (FileNotFoundError, OSError, LookupError)), ("IoError", (OSError,))):
        with pytest.raises(strata.StrataError) as info:
            strata._native._raise_status(names.index(name), f"cannot read 'x': {name}")
        e = info.value
        assert type(e).__name__ == name and isinstance(e, bases) and isinstance(e, RuntimeError)
        assert str(e) == f"cannot read 'x': {name}" and e.args == (f"cannot read 'x': {name}",)
        assert e.code == name and e.errno is None and e.filename is None
        again = pickle.loads(pickle.dumps(e))
        assert type(again) is type(e) and str(again) == str(e) and again.args == e.args
    made = NotFound("no tensor 7")  # raised from Python: the same .code
    assert made.code == "NotFound" and str(made) == "no tensor 7" and made.args == ("no tensor 7",)
    assert InvalidArgument("x").code == "InvalidArgument" and IoError("y").code == "IoError"
    with pytest.raises(FileNotFoundError):
        Checkpoint("/nonexistent/strata-test-folder")


# -- safetensors reader --------------------------------------------------------------------------------------

def _write_safetensors(path, header, data=b""):
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw + data)


def _one_tensor(path, **entry):
    fields = {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}
    fields.update(entry)
    _write_safetensors(path, {"w": fields}, b"\0" * 4)


def _with_alarm(seconds, fn):
    previous = signal.signal(signal.SIGALRM, lambda *_: pytest.fail("hung on a FIFO"))
    signal.alarm(seconds)
    try:
        return fn()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def test_safetensors_fifo_is_refused_without_hanging(tmp_path):
    (tmp_path / "c").mkdir()
    index = {"weight_map": {"s": "model-1.safetensors"}}
    (tmp_path / "c" / "model.safetensors.index.json").write_text(json.dumps(index))
    os.mkfifo(tmp_path / "c" / "model-1.safetensors")
    with pytest.raises(InvalidArgument, match=r"model-1.safetensors' is not a regular file \(a FIFO\)"):
        _with_alarm(10, lambda: Checkpoint(tmp_path / "c"))
    (tmp_path / "d").mkdir()
    os.mkfifo(tmp_path / "d" / "model.safetensors")
    with pytest.raises(InvalidArgument, match="not a regular file"):
        _with_alarm(10, lambda: Checkpoint(tmp_path / "d"))
    with pytest.raises(InvalidArgument, match="not a regular file"):
        _with_alarm(10, lambda: Checkpoint(tmp_path / "d" / "model.safetensors"))


@pytest.mark.parametrize("entry, text", [
    (dict(dtype=["F32"]), r"tensor 'w': dtype \['F32'\] is not one of"),
    (dict(dtype={"a": 1}), "tensor 'w': dtype"),
    (dict(shape=[2 ** 40, 2 ** 40, 0], data_offsets=[0, 0]), "tensor 'w': shape .* larger than a tensor can be"),
])
def test_safetensors_header_field_types_are_checked_naming_file_and_tensor(tmp_path, entry, text):
    _one_tensor(tmp_path / "model.safetensors", **entry)
    with pytest.raises(InvalidArgument, match=text) as info:
        Checkpoint(tmp_path)
    assert "model.safetensors" in str(info.value)


def test_safetensors_metadata_must_be_an_object(tmp_path):
    _write_safetensors(tmp_path / "model.safetensors",
                       {"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "__metadata__": 5}, b"\0" * 4)
    with pytest.raises(InvalidArgument, match="__metadata__"):
        Checkpoint(tmp_path)
    # (refused before too, and still)
    for entry, text in ((dict(shape=[True]), "tensor 'w': shape"), (dict(data_offsets=[0, "4"]), "data_offsets")):
        _one_tensor(tmp_path / "model.safetensors", **entry)
        with pytest.raises(InvalidArgument, match=text):
            Checkpoint(tmp_path)


def test_safetensors_single_file_link_out_of_the_folder_is_refused_like_a_shard(tmp_path):
    (tmp_path / "outside").mkdir()
    _one_tensor(tmp_path / "outside" / "secret.safetensors")
    (tmp_path / "b").mkdir()
    os.symlink("../outside/secret.safetensors", tmp_path / "b" / "model.safetensors")
    with pytest.raises(InvalidArgument, match="is a link leading out of"):
        Checkpoint(tmp_path / "b")
    (tmp_path / "i").mkdir()
    (tmp_path / "outside" / "index.json").write_text(json.dumps({"weight_map": {}}))
    os.symlink("../outside/index.json", tmp_path / "i" / "model.safetensors.index.json")
    with pytest.raises(InvalidArgument, match="is a link leading out of"):
        Checkpoint(tmp_path / "i")
    # A link inside the folder, and a file the user names directly, are read.
    (tmp_path / "e").mkdir()
    _one_tensor(tmp_path / "e" / "real.safetensors")
    os.symlink("real.safetensors", tmp_path / "e" / "model.safetensors")
    assert list(Checkpoint(tmp_path / "e").keys()) == ["w"]
    assert list(Checkpoint(tmp_path / "b" / "model.safetensors").keys()) == ["w"]


def test_safetensors_links_of_a_hugging_face_hub_snapshot_are_read(tmp_path):
    """snapshot_download's folder: <repo>/snapshots/<rev>/ holds links into <repo>/blobs/;
    those (and only those) leave the folder and are read, single file or sharded."""
    repo = tmp_path / "models--org--name"
    (repo / "blobs").mkdir(parents=True)
    _one_tensor(repo / "blobs" / "abc123")
    single = repo / "snapshots" / "rev1"
    single.mkdir(parents=True)
    os.symlink("../../blobs/abc123", single / "model.safetensors")
    assert list(Checkpoint(single).keys()) == ["w"]
    (repo / "blobs" / "idx456").write_text(json.dumps({"weight_map": {"w": "model-00001-of-00001.safetensors"}}))
    sharded = repo / "snapshots" / "rev2"
    sharded.mkdir(parents=True)
    os.symlink("../../blobs/idx456", sharded / "model.safetensors.index.json")
    os.symlink("../../blobs/abc123", sharded / "model-00001-of-00001.safetensors")
    assert list(Checkpoint(sharded).keys()) == ["w"]
    # A link from a snapshot anywhere else is still refused.
    (tmp_path / "elsewhere").mkdir()
    _one_tensor(tmp_path / "elsewhere" / "x.safetensors")
    other = repo / "snapshots" / "rev3"
    other.mkdir(parents=True)
    os.symlink("../../../elsewhere/x.safetensors", other / "model.safetensors")
    with pytest.raises(InvalidArgument, match="is a link leading out of"):
        Checkpoint(other)


def test_safetensors_only_a_missing_file_is_not_found(tmp_path, monkeypatch):
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "m1.safetensors"}}))
    with pytest.raises(NotFound, match="m1.safetensors") as info:
        Checkpoint(tmp_path / "c")
    assert isinstance(info.value, FileNotFoundError)
    _one_tensor(tmp_path / "model.safetensors")
    real_open = os.open

    def denied(path, *args, **kwargs):
        if os.fspath(path).endswith("model.safetensors"):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(_safetensors.os, "open", denied)
    with pytest.raises(IoError, match=r"model.safetensors': Permission denied \(errno EACCES\).*permissions") as info:
        Checkpoint(tmp_path)
    assert isinstance(info.value, OSError) and not isinstance(info.value, NotFound)


def test_checkpoint_keys_escape_the_location_and_names(tmp_path):
    folder = tmp_path / "we\x1b[31mights"
    folder.mkdir()
    _one_tensor(folder / "model.safetensors")
    model = torch.nn.Linear(2, 2)
    with pytest.raises(InvalidArgument) as info:
        checkpoint_keys(model, Checkpoint(folder))
    assert "\x1b" not in str(info.value) and "\\x1b" in str(info.value)
    _write_safetensors(folder / "model.safetensors", {"weight": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                                                      "bias": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}},
                       b"\0" * 12)
    with pytest.raises(InvalidArgument, match="has shape") as info:
        checkpoint_keys(model, Checkpoint(folder))
    assert "\x1b" not in str(info.value)


# -- strata.estimate ---------------------------------------------------------------------------------------

def test_estimate_escapes_control_characters_and_checks_counts():
    with pytest.raises(ValueError) as info:
        strata.estimate("7B", precision="fp8\n")
    assert "\n" not in str(info.value) and "'fp8\\n'" in str(info.value) and "precision" in str(info.value)
    with pytest.raises(TypeError, match="gpus_per_node must be a whole number, not float"):
        strata.estimate("7B", gpus_per_node=1.9)
    with pytest.raises(TypeError, match="nodes must be a whole number, not bool"):
        strata.estimate("7B", nodes=True)
    with pytest.raises(ValueError, match="gpus_per_node 8589934593"):
        strata.estimate("7B", gpus_per_node=2 ** 33 + 1)
    with pytest.raises(TypeError, match="params must be a number or text"):
        strata.estimate(True)
    with pytest.raises(ValueError, match="params nan is not finite"):
        strata.estimate(float("nan"))
    with pytest.raises(ValueError, match="config holds a NaN"):
        strata.estimate("7B", config={"x": float("nan")})
    assert strata.estimate("7B", gpus_per_node=2)  # good input still works


# -- strata.engine ----------------------------------------------------------------------------------------

def _layers():
    return [("l0", [TensorSpec("w", [4, 4], "float32")]), ("l1", [TensorSpec("b", [4], "float32")])]


def test_engine_refuses_a_name_used_twice_in_a_layer():
    with pytest.raises(InvalidArgument, match="layer 0 'l0': tensor name 'w' is used twice"):
        Engine(config(2, "cpu"), [("l0", [TensorSpec("w", [4], "float32"), TensorSpec("w", [4], "float32")])])
    # the same name in two layers is fine
    Engine(config(2, "cpu"), [("l0", [TensorSpec("w", [4], "float32")]), ("l1", [TensorSpec("w", [4], "float32")])])


@pytest.mark.parametrize("spec, error, text", [
    (TensorSpec("w", [2.7], "float32"), TypeError, "tensor 'w': shape extent must be a whole number, not float"),
    (TensorSpec("w", [True], "float32"), TypeError, "tensor 'w': shape extent must be a whole number, not bool"),
    (TensorSpec("w", [4], "float32", True, True), TypeError, "tensor 'w': weight_decay must be a number, not bool"),
    (TensorSpec("w", [4], "float32", True, None, "1"), TypeError, "tensor 'w': lr_scale must be a number, not str"),
])
def test_engine_layer_numbers_are_not_truncated(spec, error, text):
    with pytest.raises(error, match=text):
        Engine(config(2, "cpu"), [("l0", [spec])])


def test_engine_layer_index_is_range_checked():
    eng = Engine(config(2, "cpu"), _layers())
    with pytest.raises(InvalidArgument, match=r"layer -1 is out of range: the model has 2 layers \(give 0..1\)"):
        eng.tensor_names(-1)
    with pytest.raises(InvalidArgument, match="layer 5 is out of range"):
        eng.put_initial_layer(5, [torch.ones(4)])
    with pytest.raises(InvalidArgument, match="layer -1 is out of range"):
        eng.put_initial_layer(-1, [torch.ones(4, 4)])
    with pytest.raises(TypeError, match="layer must be a whole number"):
        eng.tensor_names(True)
    with pytest.raises(InvalidArgument, match="layer -1 is out of range"):
        eng.acquire(-1, "forward")
    with pytest.raises(InvalidArgument, match="layer 2 is out of range"):
        eng.packed_views(2)
    assert eng.tensor_names(1) == ["b"]


def test_engine_put_initial_packed_needs_the_packed_buffer():
    eng = Engine(config(2, "cpu"), _layers())
    with pytest.raises(ValueError, match="layer 0 have shape \\(10,\\): the layer has 64 bytes"):
        eng.put_initial_packed(0, torch.zeros(10, dtype=torch.uint8))
    with pytest.raises(ValueError, match="not contiguous"):
        eng.put_initial_packed(0, torch.zeros(1, dtype=torch.uint8).expand(64))
    with pytest.raises(ValueError, match="not contiguous"):
        eng.put_initial_packed(0, torch.arange(128, dtype=torch.uint8)[::2])
    with pytest.raises(TypeError, match="dtype torch.float32"):
        eng.put_initial_packed(0, torch.zeros(16))
    with pytest.raises(TypeError, match="are a ndarray"):
        eng.put_initial_packed(0, torch.zeros(64, dtype=torch.uint8).numpy())
    with pytest.raises(ValueError, match="have shape \\(8, 8\\)"):
        eng.put_initial_packed(0, torch.zeros(8, 8, dtype=torch.uint8))
    packed, views = eng.packed_views(0)
    views["w"].fill_(2.0)
    eng.put_initial_packed(0, packed)  # the buffer packed_views gives is taken
    eng.put_initial_layer(1, [torch.ones(4)])
    assert torch.equal(eng.gather_state(0), torch.full((16,), 2.0))


@pytest.mark.parametrize("value, error, text", [(1.5, TypeError, "device_memory must be bytes"),
                                                (True, TypeError, "not a bool"),
                                                (-1, ValueError, "device_memory -1"),
                                                ("lots", ValueError, "device_memory 'lots' is not a size")])
def test_engine_device_memory_is_bytes_or_a_size(value, error, text):
    with pytest.raises(error, match=text):
        Engine(config(2, "cpu"), _layers(), device_memory=value)


# -- strata.torch -----------------------------------------------------------------------------------------

def test_initialize_device_memory_takes_a_size_and_refuses_float_and_bool():
    for bad, error in ((1.5, TypeError), (True, TypeError)):
        with pytest.raises(error, match="device_memory"):
            st.initialize(model=make_mlp(), config=config(2, "cpu"), device_memory=bad)
    engine, _, _, _ = st.initialize(model=make_mlp(), config=config(2, "cpu"), device_memory="64MiB")
    train_engine(engine, mlp_loss, 1)


def test_save_checkpoint_keep_is_range_checked(tmp_path):
    engine, _, _, _ = st.initialize(model=make_mlp(), config=config(2, "cpu"))
    train_engine(engine, mlp_loss, 1)
    for keep, error in ((2 ** 40, ValueError), (-1, ValueError), (True, TypeError), (1.5, TypeError)):
        with pytest.raises(error, match="keep"):
            engine.save_checkpoint(tmp_path / "ck", keep=keep, sync=True)
    assert not (tmp_path / "ck").exists() or os.listdir(tmp_path / "ck") == []
    with pytest.raises(ValueError, match="NUL"):
        engine.save_checkpoint(tmp_path / "ck", tag="ok\0bad", sync=True)
    engine.save_checkpoint(tmp_path / "ck", keep=2, sync=True)


# -- export_hf: an earlier export's weight files ----------------------------------------------------------

def _trained_mlp():
    engine, _, _, _ = st.initialize(model=make_mlp(), config=config(2, "cpu"))
    train_engine(engine, mlp_loss, 1)
    return engine


def _reads_current(engine, out):
    masters = engine.master_parameters()
    ck = Checkpoint(out)
    return sorted(ck.keys()) == sorted(masters) and all(torch.equal(ck.read(k), masters[k]) for k in masters)


def test_export_sharded_then_single_then_sharded_leaves_no_stale_weights(tmp_path):
    engine = _trained_mlp()
    out = tmp_path / "exp"
    first = engine.export_hf(out, max_shard_size=2000)
    assert len(first) > 2
    (out / "README.md").write_text("kept")
    (out / "model_notes.safetensors").write_bytes(b"kept")  # not a name an export writes
    train_engine(engine, mlp_loss, 1, first_batch=2)
    engine.export_hf(out)
    assert sorted(os.listdir(out)) == ["README.md", "model.safetensors", "model_notes.safetensors"]
    assert _reads_current(engine, out)
    train_engine(engine, mlp_loss, 1, first_batch=4)
    written = engine.export_hf(out, max_shard_size=4000)
    names = sorted(os.path.basename(p) for p in written)
    assert sorted(os.listdir(out)) == sorted(names + ["README.md", "model_notes.safetensors"])
    assert "model.safetensors" not in names and "model.safetensors.index.json" in names
    assert _reads_current(engine, out)
    train_engine(engine, mlp_loss, 1, first_batch=6)
    written = engine.export_hf(out, max_shard_size=2000)  # more shards: the earlier ones' names go
    assert sorted(os.listdir(out)) == sorted([os.path.basename(p) for p in written] +
                                             ["README.md", "model_notes.safetensors"])
    assert _reads_current(engine, out)


def test_export_leaves_links_and_files_outside_alone(tmp_path):
    engine = _trained_mlp()
    out = tmp_path / "exp"
    out.mkdir()
    victim = tmp_path / "victim.safetensors"
    victim.write_bytes(b"precious")
    os.symlink(victim, out / "model-00009-of-00009.safetensors")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.export_hf(out)
    assert victim.read_bytes() == b"precious" and os.path.islink(out / "model-00009-of-00009.safetensors")
    assert any("model-00009-of-00009.safetensors" in str(w.message) for w in caught)


def test_export_that_fails_midway_keeps_the_earlier_export_and_the_next_replaces_it(tmp_path, monkeypatch):
    from strata import _torch_export
    engine = _trained_mlp()
    out = tmp_path / "exp"
    engine.export_hf(out, max_shard_size=2000)
    before = {name: (out / name).read_bytes() for name in os.listdir(out)}

    def broken(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    with monkeypatch.context() as patch:
        patch.setattr(_torch_export, "_write_values", broken)
        with pytest.raises(OSError, match="No space"):
            engine.export_hf(out)
    assert {name: (out / name).read_bytes() for name in os.listdir(out)} == before
    engine.export_hf(out)
    assert os.listdir(out) == ["model.safetensors"] and _reads_current(engine, out)
