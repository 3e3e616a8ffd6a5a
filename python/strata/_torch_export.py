"""strata.torch: StrataEngine.export_hf, the trained model as Hugging Face
loads it (safetensors by parameter name, config.json), streamed one engine
layer at a time.

Note [Exporting a model from the engine]
The engine owns the parameters: between steps each layer is acquired for an
evaluation pass (at stage 3 its shards are gathered, from NVMe where they
live), its tensors are written, and it is released before the next, so at
most one layer's whole copy exists beside the engine's own memory. The
values are the parameters the forward computes with, in the module's dtype
(bf16 under "bf16", as Hugging Face's save_pretrained writes the model's
dtype); dtype=torch.float32 writes the fp32 master weights of trainable
parameters instead (frozen ones have no masters: their values, widened).
Buffers that are part of the module's state_dict (persistent ones) come
from the module, which keeps them. A weight tied to another (an embedding
shared with the head) is one parameter and is written once, under its first
name, as save_pretrained does; from_pretrained ties it again.

Every rank runs the acquires (stage-3 gathers are collectives); rank 0
writes. (A write error on rank 0 before the gathers, e.g. a refused link,
leaves the other ranks waiting in their first gather until the
communicator's watchdog fails it: STRATA_COMM_TIMEOUT_MS, 5 minutes by
default.) Each file is written under a temporary name in the output folder,
flushed and renamed into place, so an interrupted export never leaves a
truncated model.safetensors behind. Files are split at tensor boundaries
past max_shard_size, with model.safetensors.index.json as save_pretrained
writes it.

An export into a folder that holds an earlier one replaces it: every new
file is written and fsynced under its temporary name, the new files are
renamed into place and the folder is synced, and only then are the earlier
export's weight files that the new one does not have removed (the index
first, then model.safetensors or the model-NNNNN-of-NNNNN.safetensors
shards), as save_pretrained removes stale shards. Otherwise a reader would
still find them: Strata's reader and Hugging Face's take the index before
model.safetensors or the other way round, so either could load the old
weights. Only regular files directly in the folder with those names are
removed (through the folder's descriptor: no link is followed, nothing
outside is touched); a link with such a name is left, with a warning. An
export that fails before the renames leaves the earlier one whole.
"""

import errno
import json
import os
import re
import stat
import struct
import warnings

import torch

from ._sizes import parse_size
from .engine import _numel

__all__ = ["export_hf"]

_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64",
                       torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                       torch.uint8: "U8", torch.bool: "BOOL"}
def parse_shard_size(value):
    """max_shard_size: bytes (int) or "5GB" / "500MB" / "2GiB" (Hugging Face's spelling)."""
    return parse_size(value, "max_shard_size")


class _Entry:
    """One tensor of the export: where its values come from and where they go."""
    __slots__ = ("name", "saved_name", "shape", "dtype", "nbytes", "layer", "offset", "source", "shard", "begin")

    def __init__(self, name, shape, dtype, layer, source, offset=0):
        self.name, self.shape, self.dtype = name, list(shape), dtype
        self.saved_name = name  # the key in the file (_name_as_save_pretrained)
        self.nbytes = _numel(shape) * torch.empty(0, dtype=dtype).element_size()
        self.layer, self.source = layer, source  # layer index (or None: a buffer), the parameter or buffer
        self.offset = offset  # elements into the layer's flat master weights
        self.shard, self.begin = 0, 0


def export_hf(engine, out_dir, dtype=None, max_shard_size="5GB", safe_serialization=True):
    """Writes engine's model to out_dir for `from_pretrained` (Note
    [Exporting a model from the engine]); returns the paths written (rank 0)."""
    if not safe_serialization:
        raise ValueError("safe_serialization=False (pickled pytorch_model.bin) is not written: safetensors only")
    if dtype is not None and dtype != torch.float32:
        raise ValueError(f"dtype {dtype}: export the parameters' own dtype (dtype=None) or the fp32 master weights "
                         f"(dtype=torch.float32)")
    shard_bytes = parse_shard_size(max_shard_size)
    if engine._engine.in_step:
        raise engine._out_of_order("export_hf() in the middle of a step: export after engine.step() at a gradient "
                                   "accumulation boundary")
    out_dir = os.fspath(out_dir)
    writer = engine.global_rank == 0
    if writer:
        _prepare_folder(out_dir)

    entries = _entries(engine, masters=dtype == torch.float32)
    _name_as_save_pretrained(engine.module, entries)
    shards = _assign_shards(entries, shard_bytes)
    names = _shard_file_names(len(shards))
    files = []
    try:
        if writer:
            for name, shard in zip(names, shards):
                files.append(_ShardFile(out_dir, name, shard))
        _write_values(engine, entries, files, masters=dtype == torch.float32)
        for f in files:
            f.seal()  # every byte durable under the temporary names before the first rename
        written = [f.commit() for f in files]
    except BaseException:
        for f in files:
            f.discard()
        raise
    if not writer:
        return []
    new_names = set(names)
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(e.nbytes for e in entries)},
                 "weight_map": {e.saved_name: names[e.shard] for e in sorted(entries, key=lambda e: e.saved_name)}}
        written.append(_write_file(out_dir, _INDEX_NAME, json.dumps(index, indent=2, sort_keys=True).encode() + b"\n"))
        new_names.add(_INDEX_NAME)
    written += _write_model_config(engine.module, out_dir)
    _remove_stale_weights(out_dir, new_names)
    return written


def _prepare_folder(out_dir):
    if os.path.islink(out_dir):
        raise ValueError(f"export folder {out_dir!r} is a symbolic link: give the folder itself")
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ValueError(f"export folder {out_dir!r} exists and is not a folder")
    os.makedirs(out_dir, exist_ok=True)


def _entries(engine, masters):
    """Every tensor to write, in the engine's layer order, then the module's persistent buffers."""
    entries = []
    for index, layer in enumerate(engine._layers):
        plan = layer.plan
        out_dtype = torch.float32 if masters else plan.dtype
        # The engine's layout: the declared shape (at stage 3 the module's parameter is an empty placeholder
        # between uses) and where the tensor starts in the layer's flat masters.
        layout = {name: (shape, offset) for name, shape, _, _, offset in engine._engine.layout(index)}
        for name, p in plan.params:
            shape, offset = layout[name]
            entries.append(_Entry(name, shape, out_dtype, index, p, offset))
    # state_dict lists every name of a parameter, tied ones included (named_parameters and named_modules list a
    # shared one once: T5's encoder.embed_tokens is the module `shared`); keep_vars gives the Parameter itself.
    for name, value in engine.module.state_dict(keep_vars=True).items():
        if isinstance(value, torch.nn.Parameter) or not isinstance(value, torch.Tensor):
            continue
        if value.dtype not in _SAFETENSORS_DTYPES:
            raise ValueError(f"buffer '{name}' has dtype {value.dtype}, which safetensors cannot store")
        entries.append(_Entry(name, value.shape, value.dtype, None, value))
    return entries


def _name_as_save_pretrained(model, entries):
    """Writes the keys save_pretrained writes. transformers >= 5 renames
    some architectures' tensors when it loads a checkpoint (ViT's
    attention.query -> q_proj, GPT-NeoX's embed_out -> lm_head) and writes
    the old names back when it saves, so that older releases and other tools
    read the files; the export does the same for a model whose mapping only
    renames. Where it also merges or splits tensors (a converter), the
    export keeps the module's names, which the transformers that built the
    model loads."""
    try:
        import transformers
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import PrefixChange, WeightConverter, apply_converters, apply_renamings
    except ImportError:
        return
    if not isinstance(model, transformers.PreTrainedModel):
        return
    # As save_pretrained does for a model not loaded by from_pretrained (revert_weight_conversion).
    forward = [t for t in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(t, PrefixChange)]
    reverse = [t.reverse_transform() for t in forward[::-1]]
    renamings = [t for t in reverse if not isinstance(t, WeightConverter)]
    converters = [t for t in reverse if isinstance(t, WeightConverter)]
    if not renamings or any(apply_converters(e.name, converters)[1] is not None for e in entries):
        return
    saved = [apply_renamings(e.name, renamings) for e in entries]
    if len(set(saved)) != len(saved):  # two tensors under one name: not a plain renaming; keep the module's names
        return
    for e, name in zip(entries, saved):
        e.saved_name = name


def _assign_shards(entries, shard_bytes):
    shards, current, size = [], [], 0
    for e in entries:
        if current and size + e.nbytes > shard_bytes:
            shards.append(current)
            current, size = [], 0
        e.shard, e.begin = len(shards), size
        current.append(e)
        size += e.nbytes
    shards.append(current)
    return shards


_INDEX_NAME = "model.safetensors.index.json"
# The weight files an export (or save_pretrained's default weights name) writes.
_WEIGHT_FILE = re.compile(r"model\.safetensors|model-\d{5}-of-\d{5}\.safetensors|model\.safetensors\.index\.json")


def _sync_folder(folder):
    """fsync of a folder's descriptor; some file systems (FUSE, CIFS) refuse
    it for folders, where there is nothing more to do than what they did."""
    try:
        os.fsync(folder)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise


def _remove_stale_weights(out_dir, new_names):
    """Removes the weight files of an earlier export in out_dir that this
    one did not write (Note [Exporting a model from the engine]): after the
    folder is synced (the new names are durable first), the index first,
    then the weights. Regular files only, by name in the folder's descriptor."""
    flags = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    try:
        folder = os.open(out_dir, flags)
    except OSError as e:
        raise OSError(e.errno, f"export_hf: cannot open the export folder {out_dir!r} to remove an earlier "
                               f"export's files: {e.strerror}") from None
    try:
        _sync_folder(folder)  # the renames of the new files first
        stale = sorted((name for name in os.listdir(folder) if _WEIGHT_FILE.fullmatch(name) and name not in new_names),
                       key=lambda name: (name != _INDEX_NAME, name))
        for name in stale:
            try:
                info = os.stat(name, dir_fd=folder, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if not stat.S_ISREG(info.st_mode):
                warnings.warn(f"export_hf: {os.path.join(out_dir, name)!r} (from an earlier export, not part of this "
                              f"one) is not a regular file (a link?) and was left in place: remove it, or a reader may "
                              f"load it instead of the new export", RuntimeWarning, stacklevel=3)
                continue
            os.unlink(name, dir_fd=folder)  # the name in this folder: never follows a link
        if stale:
            _sync_folder(folder)
    finally:
        os.close(folder)


def _shard_file_names(count):
    if count == 1:
        return ["model.safetensors"]
    return [f"model-{i + 1:05d}-of-{count:05d}.safetensors" for i in range(count)]


def _write_values(engine, entries, files, masters):
    """With masters: each trainable layer's fp32 master weights gathered
    (between steps, outside an evaluation). Every other layer acquired for
    an evaluation (gathered at stage 3), its tensors written, released.
    Then the buffers."""
    by_layer = {}
    for e in entries:
        by_layer.setdefault(e.layer, []).append(e)
    native = engine._engine
    from_masters = [i for i, layer in enumerate(engine._layers) if masters and layer.plan.trainable]
    for index in from_masters:
        flat = native.gather_state(index)
        for e in by_layer.get(index, []):
            if files:
                files[e.shard].write(e, flat[e.offset:e.offset + _numel(e.shape)].view(e.shape))
    acquired = [i for i in range(len(engine._layers)) if i not in set(from_masters)]
    for index, params in native.read_layers(acquired):
        for e in by_layer.get(index, []):
            if files:
                files[e.shard].write(e, params[e.name].to(device="cpu", dtype=e.dtype))  # a GPU's views too
    for e in by_layer.get(None, []):
        if files:
            files[e.shard].write(e, e.source.detach().to("cpu"))


class _ShardFile:
    """One .safetensors file: header (8-byte little-endian length, JSON,
    space-padded to 8 bytes), then each tensor's bytes, row-major, little-endian."""

    def __init__(self, out_dir, name, entries):
        self.path = os.path.join(out_dir, name)
        self.temporary = self.path + ".tmp"
        header = {"__metadata__": {"format": "pt"}}
        for e in entries:
            header[e.saved_name] = {"dtype": _SAFETENSORS_DTYPES[e.dtype], "shape": e.shape,
                              "data_offsets": [e.begin, e.begin + e.nbytes]}
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        self.data_start = 8 + len(text)
        self.expected = {e.name: e for e in entries}
        self.done = set()
        self.committed = False
        self.file = _create(self.temporary)
        self.file.write(struct.pack("<Q", len(text)) + text)

    def write(self, entry, value):
        if list(value.shape) != entry.shape or value.dtype != entry.dtype:
            raise AssertionError(f"tensor '{entry.name}': {tuple(value.shape)} {value.dtype} where the header says "
                                 f"{entry.shape} {entry.dtype}")
        self.file.seek(self.data_start + entry.begin)
        self.file.write(value.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        self.done.add(entry.name)

    def seal(self):
        """Every byte on disk under the temporary name."""
        missing = sorted(set(self.expected) - self.done)
        if missing:
            raise AssertionError(f"{self.path}: tensors never written: {missing[:5]}")
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()

    def commit(self):
        """The sealed file under its name."""
        os.replace(self.temporary, self.path)
        self.committed = True
        return self.path

    def discard(self):
        if not self.file.closed:
            self.file.close()
        if self.committed:
            return
        if os.path.lexists(self.temporary) and not os.path.islink(self.temporary):
            os.remove(self.temporary)  # ours (a link there was refused at creation and is not ours to remove)


def _create(path):
    """A new file at path for writing; a symbolic link there is refused, not followed (nothing is written
    outside the folder the caller gave)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as e:
        if os.path.islink(path):
            raise ValueError(f"{path!r} is a symbolic link: export_hf does not write through links") from None
        raise OSError(e.errno, f"cannot create {path!r}: {e.strerror}") from None
    return os.fdopen(fd, "wb")


def _write_file(out_dir, name, data):
    path = os.path.join(out_dir, name)
    with _create(path + ".tmp") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)
    return path


def _write_model_config(module, out_dir):
    """config.json (and generation_config.json) of a Hugging Face model, as save_pretrained writes them."""
    written = []
    config = getattr(module, "config", None)
    if config is not None and hasattr(config, "to_json_string"):
        written.append(_write_file(out_dir, "config.json", config.to_json_string().encode()))
    generation = getattr(module, "generation_config", None)
    if generation is not None and hasattr(generation, "to_json_string"):
        written.append(_write_file(out_dir, "generation_config.json", generation.to_json_string().encode()))
    return written
