"""Reading a model's tensors from safetensors files one tensor at a time
(strata.torch.initialize(initial_weights=...), Note [Construction on meta]).

A checkpoint is a folder holding `model.safetensors` or Hugging Face's
sharded `model.safetensors.index.json` (+ the shards it names), or one
`.safetensors` file. Every read is bounded and checked before it is made:
the header's length against the file, each tensor's dtype, shape and byte
range against the header's length and the file's size; a shard the index
names must be a plain file inside the folder (no path, no link leading out).
Only the requested tensor's bytes are read.
"""

import errno
import json
import os
import stat
import struct

import torch

from .errors import InvalidArgument, IoError, NotFound

__all__ = ["Checkpoint"]

_MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit
_MAX_INDEX_BYTES = 64 << 20
_MAX_TENSOR_BYTES = 2 ** 63 - 1
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2}  # (torch.dtype.itemsize is torch >= 2.1)


def _escape(text):
    return "".join(c if c.isprintable() else f"\\x{ord(c):02x}" for c in str(text))


def _os_error(e, path, doing="read"):
    """A failed system call on `path` as Strata's error naming the file:
    NotFound (a FileNotFoundError) when it does not exist, else IoError (an
    OSError) with the reason."""
    reason = e.strerror or str(e)
    code = errno.errorcode.get(e.errno, str(e.errno)) if e.errno is not None else "?"
    if e.errno in (errno.ENOENT, errno.ENOTDIR):
        return NotFound(f"cannot {doing} '{_escape(path)}': {reason} (errno {code})")
    hint = ""
    if e.errno in (errno.EACCES, errno.EPERM):
        hint = ": check the file's permissions (and its folders')"
    return IoError(f"cannot {doing} '{_escape(path)}': {reason} (errno {code}){hint}")


def _open_regular(path):
    """`path` opened for reading, only if it is a regular file: a FIFO or a
    device is refused before anything waits on it (O_NONBLOCK: opening a
    FIFO does not wait for a writer; the check is on the opened file)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError as e:
        raise _os_error(e, path) from e
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise InvalidArgument(f"'{_escape(path)}' is not a regular file (a {_kind(info.st_mode)}): a "
                                  f"safetensors checkpoint is made of plain files")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb"), info.st_size
    except BaseException:
        os.close(fd)
        raise


def _kind(mode):
    for test, name in ((stat.S_ISDIR, "folder"), (stat.S_ISFIFO, "FIFO"), (stat.S_ISCHR, "character device"),
                       (stat.S_ISBLK, "block device"), (stat.S_ISSOCK, "socket")):
        if test(mode):
            return name
    return "special file"


def _hub_blobs(folder):
    """The blob folder of a Hugging Face hub cache snapshot
    (<repo>/snapshots/<revision>/ holds links to <repo>/blobs/<sha>), else None."""
    real = os.path.realpath(folder)
    snapshots = os.path.dirname(real)
    if os.path.basename(snapshots) != "snapshots":
        return None
    blobs = os.path.join(os.path.dirname(snapshots), "blobs")
    return blobs if os.path.isdir(blobs) else None


def _inside(folder, path, what):
    """Refuses `path` (a name in `folder`) when it is a link leading out of
    the folder: nothing outside the folder the user gave is read. The one
    exception is the layout of a Hugging Face hub cache: a snapshot's files
    are links into its repository's blobs/ folder (what snapshot_download
    returns), which are read."""
    target = os.path.dirname(os.path.realpath(path))
    if target == os.path.realpath(folder) or target == _hub_blobs(folder):
        return
    raise InvalidArgument(f"'{_escape(path)}' ({what}) is a link leading out of '{_escape(folder)}': refused; "
                          f"copy the file into the folder")


class _File:
    """One safetensors file's header: {key: (dtype, shape, begin, end)}
    with offsets from the file's start."""

    def __init__(self, path):
        self.path = path
        f, size = _open_regular(path)
        try:
            with f:
                prefix = f.read(8)
                if len(prefix) < 8:
                    raise InvalidArgument(f"'{_escape(path)}' is not a safetensors file: {size} bytes, shorter than "
                                          f"its 8-byte header length")
                (length,) = struct.unpack("<Q", prefix)
                if length > _MAX_HEADER_BYTES:
                    raise InvalidArgument(f"'{_escape(path)}': header length {length} at offset 0 is over "
                                          f"safetensors' 100 MiB limit: not a safetensors file")
                if 8 + length > size:
                    raise InvalidArgument(f"'{_escape(path)}': header length {length} at offset 0 runs past the end "
                                          f"of the file ({size} bytes): not a safetensors file, or truncated")
                raw = f.read(length)
        except OSError as e:
            raise _os_error(e, path) from e
        try:
            header = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise InvalidArgument(f"'{_escape(path)}': the header (bytes 8..{8 + length}) is not JSON: "
                                  f"{_escape(e)}") from e
        if not isinstance(header, dict):
            raise InvalidArgument(f"'{_escape(path)}': the header is not a JSON object")
        data_start = 8 + length
        self.tensors = {}
        for key, entry in header.items():
            if key == "__metadata__":
                if not isinstance(entry, dict):
                    raise InvalidArgument(f"'{_escape(path)}': the header's \"__metadata__\" is "
                                          f"{_escape(json.dumps(entry))[:80]}, not an object of strings")
                continue
            where = f"'{_escape(path)}', tensor '{_escape(key)}'"
            if not isinstance(entry, dict):
                raise InvalidArgument(f"{where}: its header entry is not an object")
            dtype = entry.get("dtype")
            shape = entry.get("shape")
            offsets = entry.get("data_offsets")
            if not isinstance(dtype, str) or dtype not in _DTYPES:
                raise InvalidArgument(f"{where}: dtype {_escape(dtype)} is not one of {', '.join(_DTYPES)} "
                                      f"(initial weights are floating point)")
            if not isinstance(shape, list) or not all(type(d) is int and d >= 0 for d in shape):
                raise InvalidArgument(f"{where}: shape {_escape(shape)} is not a list of non-negative integers")
            if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
                    or not 0 <= offsets[0] <= offsets[1]):
                raise InvalidArgument(f"{where}: data_offsets {_escape(offsets)} is not [begin, end] with "
                                      f"0 <= begin <= end")
            count = extent = 1
            for d in shape:
                count *= d
                extent *= max(d, 1)
            if extent * _ITEMSIZE[dtype] > _MAX_TENSOR_BYTES:  # torch refuses such a shape, even with a 0 in it
                raise InvalidArgument(f"{where}: shape {shape} is larger than a tensor can be (over 2^63 bytes)")
            nbytes = count * _ITEMSIZE[dtype]
            if offsets[1] - offsets[0] != nbytes:
                raise InvalidArgument(f"{where}: data_offsets {offsets} span {offsets[1] - offsets[0]} bytes, its "
                                      f"shape {shape} in {dtype} needs {nbytes}")
            if data_start + offsets[1] > size:
                raise InvalidArgument(f"{where}: bytes {data_start + offsets[0]}..{data_start + offsets[1]} lie past "
                                      f"the end of the file ({size} bytes): truncated?")
            self.tensors[key] = (_DTYPES[dtype], tuple(shape), data_start + offsets[0], data_start + offsets[1])

    def read(self, key):
        dtype, shape, begin, end = self.tensors[key]
        out = torch.empty(shape, dtype=dtype)
        if end == begin:
            return out
        view = out.view(-1).view(torch.uint8).numpy()
        f, _ = _open_regular(self.path)
        with f:
            try:
                f.seek(begin)
                got = f.readinto(memoryview(view))
            except OSError as e:
                raise _os_error(e, self.path) from e
        if got != end - begin:
            raise InvalidArgument(f"'{_escape(self.path)}', tensor '{_escape(key)}': read {got} of {end - begin} "
                                  f"bytes at offset {begin}: the file shrank while it was read")
        return out


class Checkpoint:
    """The tensors of a safetensors checkpoint (a file, or a folder with
    model.safetensors or model.safetensors.index.json), read on demand."""

    def __init__(self, location):
        location = os.fspath(location)
        self.location = location
        self._files = {}
        self._where = {}  # key -> file path
        if os.path.isdir(location):
            index = os.path.join(location, "model.safetensors.index.json")
            single = os.path.join(location, "model.safetensors")
            if os.path.lexists(index):
                _inside(location, index, "the checkpoint's index")
                self._read_index(location, index)
            elif os.path.lexists(single):
                _inside(location, single, "the checkpoint's model.safetensors")
                self._add(single)
            else:
                raise NotFound(f"initial_weights '{_escape(location)}' holds neither model.safetensors nor "
                               f"model.safetensors.index.json (what export_hf and save_pretrained write)")
        elif os.path.lexists(location):
            self._add(location)  # one file: the user named it (a link is followed); not a plain file is refused
        else:
            raise NotFound(f"initial_weights '{_escape(location)}' is neither a safetensors file nor a folder")

    def _read_index(self, folder, index):
        f, size = _open_regular(index)
        with f:
            if size > _MAX_INDEX_BYTES:
                raise InvalidArgument(f"'{_escape(index)}' is {size} bytes, over the {_MAX_INDEX_BYTES >> 20} MiB "
                                      f"an index may have")
            try:
                raw = f.read(_MAX_INDEX_BYTES)
            except OSError as e:
                raise _os_error(e, index) from e
        try:
            weight_map = json.loads(raw.decode("utf-8")).get("weight_map")
        except (UnicodeDecodeError, json.JSONDecodeError, AttributeError) as e:
            raise InvalidArgument(f"'{_escape(index)}' is not a JSON object with a \"weight_map\": {_escape(e)}") from e
        if not isinstance(weight_map, dict):
            raise InvalidArgument(f"'{_escape(index)}': \"weight_map\" is not an object of tensor name -> file")
        for key, name in weight_map.items():
            if not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".", ".."):
                raise InvalidArgument(f"'{_escape(index)}': tensor '{_escape(key)}' is in '{_escape(name)}', not a "
                                      f"plain file name in the folder")
            path = os.path.join(folder, name)
            _inside(folder, path, f"named by the index for '{_escape(key)}'")
            file = self._add(path)
            if key not in file.tensors:
                raise InvalidArgument(f"'{_escape(index)}' puts tensor '{_escape(key)}' in '{_escape(name)}', which "
                                      f"does not hold it")
            self._where[key] = path

    def _add(self, path):
        if path not in self._files:
            file = _File(path)
            self._files[path] = file
            for key in file.tensors:
                self._where.setdefault(key, path)
        return self._files[path]

    def keys(self):
        return self._where.keys()

    def shape(self, key):
        return self._files[self._where[key]].tensors[key][1]

    def read(self, key):
        return self._files[self._where[key]].read(key)
