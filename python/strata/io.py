"""NVMe tensor I/O over Strata's IoEngine (io_uring, libaio or psync, every
completion checked) and its checksummed SwapStore.

    aio = strata.io.AsyncIO()                      # engine="auto": io_uring if it works
    buf = strata.io.empty(1 << 20, torch.uint8)    # 4 KiB-aligned: O_DIRECT capable
    aio.pwrite(buf, "/nvme/x.bin", 0).wait()
    h = aio.pread(buf, "/nvme/x.bin", 0); ...; h.wait()

Tensors and numpy arrays cross without copies (their address is handed to
the engine); a handle keeps its tensor alive until it is done. Errors are
strata exceptions carrying the C++ Status text (file, offset, length, errno).
"""

import os

from . import _native
from ._checks import check_int, check_path
from ._sizes import _MAX_BYTES, parse_size
from ._tensors import span, torch

__all__ = ["AsyncIO", "IoHandle", "SwapStore", "SwapHandle", "empty", "choose_engine"]


# The largest buffer (the largest size any strata API takes, 1 PiB) and file
# offset: an offset past 2^62 overflows the engine's end-of-range arithmetic.
_MAX_BUFFER_BYTES = _MAX_BYTES
_MAX_OFFSET = 1 << 62


def choose_engine():
    """(engine name, reason): what engine="auto" picks on this machine and why."""
    return _native.choose_engine()


def empty(shape, dtype=None, *, alignment=4096, pin=False):
    """An uninitialised (zero-filled) CPU tensor whose memory is `alignment`-aligned
    (O_DIRECT needs 4 KiB) and optionally mlock'ed (pin=True; refused pinning
    leaves it usable, see .pinned on the buffer). The tensor keeps its buffer alive."""
    if torch is None:
        raise ImportError("strata.io.empty makes torch tensors; torch is not importable")
    dtype = dtype or torch.float32
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"strata.io.empty: dtype must be a torch.dtype, not {type(dtype).__name__}")
    shape = (shape,) if isinstance(shape, int) and not isinstance(shape, bool) else tuple(shape)
    count = 1
    for i, s in enumerate(shape):
        count *= check_int(s, f"strata.io.empty: shape[{i}]", 0, _MAX_BUFFER_BYTES)
    element = torch.empty((), dtype=dtype).element_size()
    if count * element > _MAX_BUFFER_BYTES:
        raise ValueError(f"strata.io.empty: shape {shape} of {dtype} is {count * element} bytes, more than the "
                         f"{_MAX_BUFFER_BYTES} a buffer may have")
    alignment = check_int(alignment, "strata.io.empty: alignment", 1, 1 << 30)
    buffer = _native.AlignedBuffer(max(count * element, 1), alignment, pin)
    flat = torch.frombuffer(buffer, dtype=torch.uint8)[: count * element]
    return flat.view(dtype).view(shape)


class IoHandle:
    """One pread/pwrite in flight: wait() blocks (GIL released) and raises its
    error; done() never blocks. Holds the tensor until done."""

    __slots__ = ("_handle", "_tensor", "path", "offset")

    def __init__(self, handle, tensor, path, offset):
        self._handle, self._tensor, self.path, self.offset = handle, tensor, path, offset

    def wait(self):
        try:
            self._handle.wait()
        finally:
            if self._handle.done():
                self._tensor = None
        return self.bytes

    def done(self):
        return self._handle.done()

    @property
    def bytes(self):
        return self._handle.bytes


class AsyncIO:
    """An asynchronous I/O handle over one IoEngine.

    engine: "auto" | "io_uring" | "libaio" | "psync"; block_size: bytes per
    piece; queue_depth: pieces in flight per worker; threads: workers
    (aio.intra_op_parallelism); direct_io: O_DIRECT where the file system
    allows it (pieces whose offset, length and address are aligned go direct,
    the rest through the page cache; info(path) says which and why not).
    """

    def __init__(self, engine="auto", block_size=1 << 20, queue_depth=8, threads=1, direct_io=True):
        if not isinstance(engine, str):
            raise TypeError(f"AsyncIO: engine must be a str such as \"auto\", not {type(engine).__name__}")
        if not isinstance(direct_io, bool):
            raise TypeError(f"AsyncIO: direct_io must be a bool, not {type(direct_io).__name__}")
        block_size = check_int(block_size, "AsyncIO: block_size", 1, 1 << 40)
        queue_depth = check_int(queue_depth, "AsyncIO: queue_depth", 1, (1 << 32) - 1)
        threads = check_int(threads, "AsyncIO: threads", 1, (1 << 32) - 1)
        self._engine = _native.IoEngine(engine, block_size, queue_depth, threads, direct_io)
        self._files = {}  # (path, writable) -> file id

    @property
    def engine(self):
        """The backend in use: io_uring, libaio or psync."""
        return self._engine.kind

    def describe(self):
        return self._engine.describe()

    def notes(self):
        """Degradations the engine chose (buffered fallback on tmpfs, refused registration)."""
        return self._engine.notes()

    def stats(self):
        return self._engine.stats()

    def _file(self, path, writable):
        path = check_path(path, "the path")
        key = (path, writable)
        fid = self._files.get(key)
        if fid is None:
            fid = self._engine.open(path, "w" if writable else "r")
            self._files[key] = fid
        return fid

    def info(self, path, writable=False):
        """{'path', 'direct', 'direct_alignment', 'writable', 'fallback_reason'} of an opened file."""
        return self._engine.file_info(self._file(path, writable))

    def pread(self, tensor, path, offset=0):
        """Reads len(tensor) bytes of `path` at `offset` into the tensor; returns an IoHandle."""
        address, _, _, nbytes = span(tensor, "the pread buffer", writable=True)
        offset = check_int(offset, f"pread of {os.fspath(path)!r}: offset", 0, _MAX_OFFSET)
        fid = self._file(path, False)
        return IoHandle(self._engine.submit("read", fid, offset, nbytes, address, tensor), tensor, os.fspath(path), offset)

    def pwrite(self, tensor, path, offset=0):
        """Writes the tensor's bytes to `path` at `offset` (created 0600 when
        absent, never truncated); returns an IoHandle."""
        address, _, _, nbytes = span(tensor, "the pwrite buffer")
        offset = check_int(offset, f"pwrite of {os.fspath(path)!r}: offset", 0, _MAX_OFFSET)
        fid = self._file(path, True)
        return IoHandle(self._engine.submit("write", fid, offset, nbytes, address, tensor), tensor, os.fspath(path), offset)

    def sync_pread(self, tensor, path, offset=0):
        return self.pread(tensor, path, offset).wait()

    def sync_pwrite(self, tensor, path, offset=0):
        return self.pwrite(tensor, path, offset).wait()

    def close(self, path=None):
        """Closes one path's descriptors (or all); fails while requests on it are in flight."""
        path = None if path is None else check_path(path, "close: the path")  # the key _file stored
        for key in [k for k in self._files if path is None or k[0] == path]:
            # Forgotten only once closed: a close refused (requests in
            # flight) leaves the descriptor known, to be closed again later.
            self._engine.close(self._files[key])
            del self._files[key]


class SwapHandle:
    """A swap read or write in flight; completes after checksum verification."""

    __slots__ = ("_handle", "_tensor")

    def __init__(self, handle, tensor):
        self._handle, self._tensor = handle, tensor

    def wait(self):
        try:
            self._handle.wait()
        finally:
            if self._handle.done():
                self._tensor = None

    def done(self):
        return self._handle.done()


def _tensor_id(tensor_id):
    return check_int(tensor_id, "SwapStore: tensor id", 0, (1 << 64) - 1)


class SwapStore:
    """Tensors on NVMe by integer id, one preallocated file per path,
    checksummed per block (XXH3), written by shadow writes: a corrupt block
    reads back as strata.DataLoss naming the tensor, block, file and both
    checksums; a failed write leaves the previous version readable.

    paths: folders (one swap file each, striped); capacity_bytes: data bytes.
    The files are removed by close() unless keep_files=True.
    """

    def __init__(self, paths, capacity_bytes, *, io=None, job="default", rank=0, checksum_block_bytes=64 << 10,
                 index_bytes=0, verify_checksums=True, verify_writes=True, keep_files=False, open_existing=False):
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        paths = [check_path(p, f"SwapStore: paths[{i}]") for i, p in enumerate(paths)]
        # 0 is valid with open_existing (the reopened files say the capacity).
        capacity_bytes = 0 if open_existing and capacity_bytes == 0 else parse_size(capacity_bytes,
                                                                                      "SwapStore: capacity_bytes")
        if not isinstance(job, str):
            raise TypeError(f"SwapStore: job must be a str, not {type(job).__name__}")
        rank = check_int(rank, "SwapStore: rank", 0, (1 << 31) - 1)
        checksum_block_bytes = check_int(checksum_block_bytes, "SwapStore: checksum_block_bytes", 1, 1 << 40)
        index_bytes = check_int(index_bytes, "SwapStore: index_bytes", 0, 1 << 40)
        for name, flag in (("verify_checksums", verify_checksums), ("verify_writes", verify_writes),
                           ("keep_files", keep_files), ("open_existing", open_existing)):
            if not isinstance(flag, bool):
                raise TypeError(f"SwapStore: {name} must be a bool, not {type(flag).__name__}")
        self._io = io if io is not None else AsyncIO()
        self._store = _native.SwapStore(self._io._engine, paths, capacity_bytes, job, rank, checksum_block_bytes,
                                        index_bytes, verify_checksums, verify_writes, keep_files, open_existing)

    def write(self, tensor_id, tensor):
        """Starts writing the tensor's bytes as tensor `tensor_id`; returns a SwapHandle.
        The tensor must not change until the handle is done."""
        tensor_id = _tensor_id(tensor_id)
        address, _, _, nbytes = span(tensor, f"tensor {tensor_id}")
        return SwapHandle(self._store.write(tensor_id, address, nbytes, tensor), tensor)

    def read(self, tensor_id, out):
        """Starts reading tensor `tensor_id` into `out` (same byte size); returns a SwapHandle."""
        tensor_id = _tensor_id(tensor_id)
        address, _, _, nbytes = span(out, f"the read buffer of tensor {tensor_id}", writable=True)
        return SwapHandle(self._store.read(tensor_id, address, nbytes, out), out)

    def write_range(self, tensor_id, offset, tensor):
        tensor_id = _tensor_id(tensor_id)
        offset = check_int(offset, f"write_range of tensor {tensor_id}: offset", 0, _MAX_OFFSET)
        address, _, _, nbytes = span(tensor, f"the range of tensor {tensor_id}")
        return SwapHandle(self._store.write_range(tensor_id, offset, address, nbytes, tensor), tensor)

    def read_range(self, tensor_id, offset, out):
        tensor_id = _tensor_id(tensor_id)
        offset = check_int(offset, f"read_range of tensor {tensor_id}: offset", 0, _MAX_OFFSET)
        address, _, _, nbytes = span(out, f"the range buffer of tensor {tensor_id}", writable=True)
        return SwapHandle(self._store.read_range(tensor_id, offset, address, nbytes, out), out)

    def save(self, tensor_id, tensor):
        """Synchronous write."""
        self.write(tensor_id, tensor).wait()

    def load(self, tensor_id, out):
        """Synchronous read into `out`; returns it."""
        self.read(tensor_id, out).wait()
        return out

    def remove(self, tensor_id):
        self._store.remove(_tensor_id(tensor_id))

    def __contains__(self, tensor_id):
        return self._store.contains(_tensor_id(tensor_id))

    def size_of(self, tensor_id):
        return self._store.size_of(_tensor_id(tensor_id))

    def extent_of(self, tensor_id):
        """(data offset, reserved bytes) of a tensor written whole, in the striped data space."""
        return self._store.extent_of(_tensor_id(tensor_id))

    def ids(self):
        return self._store.ids()

    @property
    def checksum_block_bytes(self):
        return self._store.checksum_block_bytes

    def file_paths(self):
        return self._store.file_paths()

    def verify_all(self):
        """Reads every tensor back and checks it; raises DataLoss on the first mismatch."""
        self._store.verify_all()

    def flush(self):
        self._store.flush()

    def stats(self):
        return self._store.stats()

    def close(self):
        self._store.close()

    @property
    def closed(self):
        return self._store.closed

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


