"""Bad input at the native boundary (the bindings, io.py, config.py): crashes,
a wrong file written, hangs and unnamed pybind11 errors a review found. Each
case failed before its fix (a segfault or heap corruption, a write to the
name cut at a NUL, a blocked open, an "incompatible function arguments")."""
import os
import signal

import pytest
import torch

import strata
from strata.engine import Engine, TensorSpec
from strata.io import AsyncIO, SwapStore

from test_engine import config


def test_a_dropped_handle_keeps_its_buffer_until_the_read_is_done(tmp_path):
    source = tmp_path / "ones.bin"
    source.write_bytes(b"\x01" * (1 << 20))
    aio = AsyncIO(engine="psync", direct_io=False)
    overwritten = 0
    for _ in range(20):
        aio.pread(torch.empty(1 << 18, dtype=torch.float32), source, 0)  # handle dropped at once
        fresh = torch.zeros(1 << 18, dtype=torch.float32)  # may reuse the freed buffer's memory
        aio.sync_pread(torch.empty(4, dtype=torch.uint8), source, 0)  # behind the dropped read
        overwritten += bool(fresh.any())
    assert overwritten == 0


def test_a_dropped_swap_handle_keeps_its_buffer(tmp_path):
    with SwapStore(tmp_path, 8 << 20, checksum_block_bytes=4096) as store:
        store.save(1, torch.ones(1 << 18))
        for _ in range(10):
            store.read(1, torch.empty(1 << 18))  # dropped at once
            fresh = torch.zeros(1 << 18)
            store.load(1, torch.empty(1 << 18))
            assert not fresh.any()


def test_a_nul_in_a_path_is_refused_before_any_file_is_touched(tmp_path):
    victim = tmp_path / "sm"
    victim.write_bytes(b"original")
    aio = AsyncIO(engine="psync")
    with pytest.raises(strata.InvalidArgument, match="NUL"):
        aio.sync_pwrite(torch.ones(4, dtype=torch.uint8), f"{victim}\0all", 0)
    assert victim.read_bytes() == b"original"
    with pytest.raises(strata.InvalidArgument, match=r"paths\[0\].*NUL"):
        SwapStore(f"{tmp_path}\0x", 1 << 20)


def test_a_fifo_or_a_folder_is_refused_not_waited_on(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    aio = AsyncIO(engine="psync")
    previous = signal.signal(signal.SIGALRM, lambda *_: pytest.fail("the open blocked on a FIFO"))
    signal.alarm(30)  # a hang fails the test instead of the suite
    try:
        with pytest.raises(strata.InvalidArgument, match="a FIFO, not a regular file"):
            aio.sync_pread(torch.empty(8, dtype=torch.uint8), fifo, 0)
        with pytest.raises(strata.InvalidArgument, match="a directory, not a regular file"):
            aio.sync_pread(torch.empty(8, dtype=torch.uint8), tmp_path, 0)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.mark.parametrize("make, error, says", [
    (lambda aio, p: aio.pread(torch.empty(8), p, 2 ** 64), strata.InvalidArgument, "offset .* out of range"),
    (lambda aio, p: aio.pread(torch.empty(8), p, 1.5), TypeError, "offset must be a whole number, not float"),
    (lambda aio, p: aio.pread(torch.empty(8), p, True), TypeError, "offset must be a whole number, not bool"),
    (lambda aio, p: AsyncIO(block_size=-1), strata.InvalidArgument, "block_size -1 is negative"),
    (lambda aio, p: AsyncIO(queue_depth=2 ** 33), strata.InvalidArgument, "queue_depth .* out of range"),
    (lambda aio, p: SwapStore(p.parent, -1), strata.InvalidArgument, "capacity_bytes -1 is out of range"),
    (lambda aio, p: SwapStore(p.parent, 1.9), TypeError, "capacity_bytes must be a whole number of bytes .* not the float 1.9"),
    (lambda aio, p: SwapStore(p.parent, 1 << 20, rank=2 ** 40), strata.InvalidArgument, "rank .* out of range"),
    (lambda aio, p: strata.io.empty(-5), strata.InvalidArgument, r"shape\[0\] -5 is negative"),
])
def test_numbers_are_range_checked_and_named(tmp_path, make, error, says):
    target = tmp_path / "f.bin"
    target.write_bytes(b"x" * 64)
    with pytest.raises(error, match=says):
        make(AsyncIO(engine="psync"), target)


def test_a_swap_tensor_id_is_checked(tmp_path):
    with SwapStore(tmp_path, 1 << 20, checksum_block_bytes=4096) as store:
        with pytest.raises(strata.InvalidArgument, match="tensor id -1 is negative"):
            store.save(-1, torch.ones(4))
        with pytest.raises(TypeError, match="tensor id must be a whole number, not bool"):
            store.save(True, torch.ones(4))


def test_hidden_size_is_range_checked():
    auto = {"zero_optimization": {"reduce_bucket_size": "auto"}}
    with pytest.raises(strata.InvalidArgument, match="hidden_size 1099511627776 is out of range"):
        strata.config.load(auto, hidden_size=2 ** 40)  # its square left int64: reduce_bucket_size 0
    with pytest.raises(strata.InvalidArgument, match="hidden_size -1 is negative"):
        strata.config.load(auto, hidden_size=-1)
    with pytest.raises(TypeError, match="hidden_size must be a whole number, not bool"):
        strata.config.load(auto, hidden_size=True)
    assert strata.config.load(auto, hidden_size=1024)["zero_optimization"]["reduce_bucket_size"] == 1024 * 1024


def test_issue_fields_escape_control_characters():
    issues = strata.config.check({"zero_optimizatio\x1b[31mn": 1})
    assert issues and all("\x1b" not in value for i in issues for value in i.values() if isinstance(value, str))
    assert "\\x1b" in issues[0].path


def _engine():
    return Engine(config(0), [("l0", [TensorSpec("w", (4, 4), torch.float32)])])


def test_an_engine_error_from_put_initial_layer_is_raised_not_a_crash():
    engine = _engine()
    engine.put_initial_layer(0, [torch.ones(4, 4)])
    engine.begin_step()
    with pytest.raises(strata.StrataError):
        engine.put_initial_layer(0, [torch.ones(4, 4)])  # after begin_step: refused (a segfault before)



def test_a_size_string_is_exact_and_never_truncated():
    from strata._sizes import parse_size
    assert parse_size("1.1GB", "size") == 1_100_000_000  # float arithmetic gave 1100000000.0000002
    assert parse_size("1.5KiB", "size") == 1536
    with pytest.raises(ValueError, match="not a whole number of bytes"):
        parse_size("1.5B", "size")  # was 1


def test_units_of_a_wrong_type_are_named():
    from strata._torch_units import split_into_units
    model = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match=r"units: 42 \(entry 0\) is a int"):
        split_into_units(model, 42)  # an AttributeError ('int' has no __name__) before
    assert len(split_into_units(model, [torch.nn.Linear])) == 2


def test_numpy_numbers_and_whole_floats_are_accepted_where_they_were(tmp_path):
    np = pytest.importorskip("numpy")
    from strata._sizes import parse_size
    assert parse_size(np.int64(1 << 20), "size") == 1 << 20
    assert parse_size(1e8, "size") == 100_000_000
    with SwapStore(tmp_path, np.int64(1 << 20), checksum_block_bytes=4096) as store:
        assert store.file_paths()
    assert strata.estimate(np.int64(7_000_000_000)) is not None


def test_close_takes_the_path_as_it_was_opened(tmp_path):
    target = tmp_path / "f.bin"
    target.write_bytes(b"x" * 4096)
    aio = AsyncIO(engine="psync")
    aio.sync_pread(torch.empty(16, dtype=torch.uint8), os.fsencode(target), 0)
    assert aio._files
    aio.close(os.fsencode(target))  # bytes: the cache holds the decoded str
    assert not aio._files
