"""strata.io: AsyncIO pread/pwrite over the IoEngine and the checksummed SwapStore."""
import os
import threading
import time

import numpy as np
import pytest
import torch

import strata
from strata.io import AsyncIO, SwapStore


def engines():
    """Every backend this machine runs (the others are refused with a reason)."""
    out = []
    for name in ("io_uring", "libaio", "psync"):
        try:
            AsyncIO(engine=name)
            out.append(name)
        except strata.StrataError:
            pass
    assert "psync" in out, "the psync engine works everywhere"
    return out


@pytest.fixture(params=engines())
def aio(request):
    return AsyncIO(engine=request.param, block_size=64 << 10, queue_depth=4, threads=2)


SIZES = [1, 4095, 4096, 4097, (1 << 20) + 3]
OFFSETS = [0, 1, 4096, 12345]


def test_round_trip_odd_sizes_and_offsets(aio, tmp_path):
    path = tmp_path / "data.bin"
    g = torch.Generator().manual_seed(7)
    for size in SIZES:
        for offset in OFFSETS:
            src = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=g)
            aio.pwrite(src, path, offset).wait()
            dst = torch.zeros(size, dtype=torch.uint8)
            handle = aio.pread(dst, path, offset)
            assert handle.wait() == size
            assert handle.done()
            assert torch.equal(src, dst), f"{aio.engine}: {size} bytes at offset {offset}"
    stats = aio.stats()
    assert stats["failed_requests"] == 0 and stats["bytes_written"] == stats["bytes_read"]


def test_aligned_buffers_and_direct_io(aio, tmp_path):
    path = tmp_path / "direct.bin"
    buf = strata.io.empty((256, 1024), torch.float32)
    assert buf.data_ptr() % 4096 == 0 and buf.shape == (256, 1024)
    buf.copy_(torch.arange(buf.numel(), dtype=torch.float32).view(256, 1024))
    handles = [aio.pwrite(buf[i * 64:(i + 1) * 64], path, i * 64 * 4096) for i in range(4)]  # in flight together
    for h in handles:
        h.wait()
    out = strata.io.empty((256, 1024), torch.float32)
    aio.pread(out, path, 0).wait()
    assert torch.equal(buf, out)
    info = aio.info(path, writable=True)
    # O_DIRECT where the file system takes it; otherwise the reason is said.
    assert info["direct"] or info["fallback_reason"], info
    if info["direct"]:
        assert aio.stats()["direct_pieces"] > 0
    bf = strata.io.empty(1000, torch.bfloat16)
    assert bf.dtype == torch.bfloat16 and bf.numel() == 1000 and bf.data_ptr() % 4096 == 0


def test_numpy_arrays(tmp_path):
    aio = AsyncIO()
    a = np.arange(1001, dtype=np.float64)
    aio.sync_pwrite(a, tmp_path / "np.bin", 8)
    b = np.zeros_like(a)
    aio.sync_pread(b, tmp_path / "np.bin", 8)
    assert np.array_equal(a, b)
    with pytest.raises(ValueError, match="read-only"):
        ro = np.zeros(4)
        ro.flags.writeable = False
        aio.pread(ro, tmp_path / "np.bin", 0)


def test_errors_carry_the_status_text(tmp_path):
    aio = AsyncIO()
    missing = tmp_path / "absent.bin"
    with pytest.raises(strata.StrataError, match="absent.bin") as info:
        aio.pread(torch.zeros(10, dtype=torch.uint8), missing, 0)
    assert info.value.code in ("NotFound", "IoError")
    short = tmp_path / "short.bin"
    short.write_bytes(b"x" * 100)
    with pytest.raises(strata.StrataError, match="short.bin"):
        aio.pread(torch.zeros(200, dtype=torch.uint8), short, 0).wait()
    with pytest.raises(ValueError, match="not contiguous"):
        aio.pwrite(torch.zeros(10, 2)[:, 0], short, 0)
    with pytest.raises(ValueError, match="negative"):
        aio.pread(torch.zeros(1), short, -1)
    with pytest.raises(strata.InvalidArgument, match="engine"):
        AsyncIO(engine="floppy")
    with pytest.raises(strata.InvalidArgument):
        AsyncIO(queue_depth=0)


def test_wait_releases_the_gil(tmp_path):
    """A Python thread runs while wait() blocks: its timestamps fall strictly
    inside the wait (with the GIL held throughout, none could)."""
    aio = AsyncIO(engine="psync")
    data = torch.ones(64 << 20, dtype=torch.uint8)
    ticks = []
    running, stop = threading.Event(), threading.Event()

    def ticker():
        running.set()
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.0005)

    th = threading.Thread(target=ticker)
    th.start()
    running.wait()
    windows = []  # (start, end) of each wait; writes repeat until 50 ms were spent waiting
    try:
        for _ in range(20):
            handle = aio.pwrite(data, tmp_path / "big.bin", 0)
            start = time.perf_counter()
            handle.wait()
            windows.append((start, time.perf_counter()))
            if sum(e - s for s, e in windows) > 0.05:
                break
    finally:
        stop.set()
        th.join()
    waited = sum(e - s for s, e in windows)
    during = [t for t in ticks if any(s < t < e for s, e in windows)]
    assert waited > 0.005, f"{len(windows)} writes of 64 MiB waited only {1e3 * waited:.1f} ms"
    assert len(during) >= 2, f"the ticker ran {len(during)} times during {1e3 * waited:.1f} ms of waiting"


def store_options(tmp_path):
    return dict(capacity_bytes=8 << 20, index_bytes=64 << 10, checksum_block_bytes=4096)


def test_swap_store_round_trip(tmp_path):
    with SwapStore(tmp_path, **store_options(tmp_path)) as store:
        g = torch.Generator().manual_seed(9)
        tensors = {
            1: torch.randn(1001, generator=g),
            2: torch.randn(77, 13, generator=g).to(torch.bfloat16),
            3: torch.randint(0, 256, (4097,), dtype=torch.uint8, generator=g),
        }
        handles = [store.write(i, t) for i, t in tensors.items()]
        for h in handles:
            h.wait()
        assert sorted(store.ids()) == [1, 2, 3] and 2 in store and 4 not in store
        for i, t in tensors.items():
            assert store.size_of(i) == t.numel() * t.element_size()
            assert torch.equal(store.load(i, torch.empty_like(t)), t)
        store.save(1, tensors[1] * 2)  # a new version (shadow write)
        assert torch.equal(store.load(1, torch.empty_like(tensors[1])), tensors[1] * 2)
        head, tail = torch.empty(4096, dtype=torch.uint8), torch.empty(1, dtype=torch.uint8)
        store.read_range(3, 0, head).wait()
        store.read_range(3, 4096, tail).wait()  # the last, short block
        assert torch.equal(torch.cat([head, tail]), tensors[3])
        with pytest.raises(strata.InvalidArgument, match="checksum block"):
            store.read_range(3, 0, torch.empty(1024, dtype=torch.uint8))
        store.remove(2)
        assert 2 not in store
        with pytest.raises(strata.NotFound, match="2"):
            store.load(2, torch.empty_like(tensors[2]))
        with pytest.raises(strata.InvalidArgument):
            store.load(1, torch.empty(5))  # wrong size
        store.verify_all()
        assert store.stats()["verify_failures"] == 0
    assert store.closed
    with pytest.raises(strata.FailedPrecondition, match="closed"):
        store.ids()


def test_flipped_bit_is_data_loss_naming_the_tensor(tmp_path):
    opts = store_options(tmp_path)
    store = SwapStore(tmp_path, **opts)
    t = torch.randn(5000)
    store.save(7, t)
    offset, _ = store.extent_of(7)
    (swap_file,) = store.file_paths()
    where = opts["index_bytes"] + offset + 3 * 4096 + 77  # a byte in block 3 of tensor 7
    with open(swap_file, "r+b") as f:
        f.seek(where)
        byte = f.read(1)[0]
        f.seek(where)
        f.write(bytes([byte ^ 0x10]))
        f.flush()
        os.fsync(f.fileno())
    out = torch.empty_like(t)
    with pytest.raises(strata.DataLoss, match="tensor 7 block 3") as info:
        store.load(7, out)
    assert info.value.code == "DataLoss" and swap_file in str(info.value)
    with pytest.raises(strata.DataLoss, match="tensor 7"):
        store.verify_all()
    assert store.stats()["verify_failures"] >= 1
    store.save(7, t)  # rewriting the tensor heals it
    assert torch.equal(store.load(7, out), t)
    store.close()


def test_buffered_io_is_said(tmp_path):
    """direct_io=False (or a file system that refuses O_DIRECT) goes through
    the page cache, and info() says why; the data is the same."""
    aio = AsyncIO(direct_io=False)
    path = tmp_path / "buffered.bin"
    buf = strata.io.empty(8192, torch.uint8)
    buf.copy_(torch.arange(8192) % 251)
    aio.sync_pwrite(buf, path, 4096)
    info = aio.info(path, writable=True)
    assert not info["direct"] and info["fallback_reason"], info
    out = torch.zeros(8192, dtype=torch.uint8)
    aio.sync_pread(out, path, 4096)
    assert torch.equal(out, buf)
    assert aio.stats()["direct_pieces"] == 0


def test_pinned_empty_degrades_gracefully():
    """pin=True mlocks when RLIMIT_MEMLOCK allows; refused, the tensor still works."""
    t = strata.io.empty(1 << 20, torch.uint8, pin=True)
    t.fill_(3)
    assert int(t.sum()) == 3 << 20 and t.data_ptr() % 4096 == 0
