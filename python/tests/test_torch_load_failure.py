"""engine.load_checkpoint() of a checkpoint damaged in a later layer (Note
[A failed load] in offload/include/strata/offload/engine.h): the load fails
naming the file, the offset and the layer after the layers before it were
written, and from then on the engine refuses every training step,
evaluation, save and read of its trained state, saying that a load failed,
until a load succeeds; then the run is the one that never stopped."""

import json
import os
import shutil

import pytest
import torch

import strata
import strata.torch as st
from test_torch_frontend import config, make_mlp, mlp_loss, train_engine

LOAD_FAILED = r"load_checkpoint\('[^']*'\) failed after it had begun to write this engine's state \(DataLoss: "


def damage_a_later_layer(good, bad):
    """A copy of checkpoint folder `good` in `bad` with one byte of the last trained layer's master weights
    flipped; (file name, extent offset, layer index, layer name)."""
    shutil.copytree(good, bad)
    tag = open(os.path.join(bad, "latest")).read().strip()
    manifest = json.load(open(os.path.join(bad, tag, "manifest.json")))
    columns = manifest["extents_columns"]
    extents = [dict(zip(columns, row)) for row in manifest["extents"]]
    model_files = {i for i, f in enumerate(manifest["files"]) if f["kind"] == "model"}
    last = max(e["layer"] for e in extents)
    extent = next(e for e in extents if e["layer"] == last and e["file"] in model_files)
    name = manifest["files"][extent["file"]]["name"]
    with open(os.path.join(bad, tag, name), "r+b") as f:
        f.seek(extent["offset"] + 5)
        byte = f.read(1)[0]
        f.seek(extent["offset"] + 5)
        f.write(bytes([byte ^ 0x40]))
    return name, extent["offset"], last, manifest["layers"][last]["name"]


@pytest.mark.parametrize("stage,placement", [(2, "cpu"), (3, "nvme")])
def test_a_load_that_fails_in_a_later_layer_leaves_every_use_refused_until_a_load_succeeds(tmp_path, stage,
                                                                                         placement):
    unbroken, _, _, _ = st.initialize(model=make_mlp(), config=config(2, "cpu"))
    expected = train_engine(unbroken, mlp_loss, 6)
    first, _, _, _ = st.initialize(model=make_mlp(), config=config(2, "cpu"))
    train_engine(first, mlp_loss, 3)
    good, bad = str(tmp_path / "good"), str(tmp_path / "bad")
    first.save_checkpoint(good, sync=True)
    file_name, offset, layer, layer_name = damage_a_later_layer(good, bad)
    assert layer > 0  # layers before it are written by the time it is read

    nvme = tmp_path / "nvme"
    nvme.mkdir()
    params = placement if stage == 3 else "none"
    resumed, _, _, _ = st.initialize(model=make_mlp(seed=99), config=config(stage, placement, params, nvme))
    with pytest.raises(strata.DataLoss) as raised:
        resumed.load_checkpoint(bad)
    message = str(raised.value)
    for part in (file_name, f"extent at byte {offset}", f"layer {layer} '{layer_name}'"):
        assert part in message, message
    assert resumed.global_steps == 0

    # Every use of the state refused, naming the failed load: a training forward, an evaluation, the master
    # weights, a save.
    with pytest.raises(strata.FailedPrecondition, match=LOAD_FAILED):
        mlp_loss(resumed, 0)
    with pytest.raises(strata.FailedPrecondition, match=LOAD_FAILED), torch.no_grad():
        mlp_loss(resumed, 0)
    with pytest.raises(strata.FailedPrecondition, match=LOAD_FAILED):
        resumed.master_parameters()
    with pytest.raises(strata.FailedPrecondition, match=LOAD_FAILED):
        resumed.save_checkpoint(str(tmp_path / "mixed"), sync=True)
    assert not (tmp_path / "mixed").exists() or not os.listdir(tmp_path / "mixed")
    with pytest.raises(strata.FailedPrecondition, match=LOAD_FAILED):
        mlp_loss(resumed, 0)  # still

    # An intact checkpoint loads, and the run goes on as the one that never stopped.
    resumed.load_checkpoint(good)
    assert resumed.global_steps == 3
    assert train_engine(resumed, mlp_loss, 3, first_batch=6) == expected[3:]
