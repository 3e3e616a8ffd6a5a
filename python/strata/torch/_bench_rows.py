"""Placement rows of strata.torch.bench: one way of placing the training
state (ZeRO stage, where the optimizer state and the stage-3 parameters
live, the offloaded fraction of the optimizer state, the parameter dtype and
the optional strata knobs). The same rows, labels and row files as `strata
bench offload` and `strata plan` (apps/placement_rows.h): a row file written
for one is read by the other, and labels match row for row."""
import copy
import json
import math
import os
import stat

from .._checks import printable, short_repr
from ..errors import InvalidArgument

__all__ = ["Row", "default_rows", "rows_from_list", "load_rows_file", "DTYPES"]

_DEVICES = ("none", "cpu", "nvme")
# The parameter dtypes a row trains in, by every name the engine's parse_dtype reads (core/src/dtype.cpp).
DTYPES = {"fp32": "fp32", "float32": "fp32", "float": "fp32", "f32": "fp32",
          "fp16": "fp16", "float16": "fp16", "half": "fp16", "f16": "fp16",
          "bf16": "bf16", "bfloat16": "bf16"}
_MOMENTS = ("fp32", "bf16", "int8")
_GRADIENT_SHARDS = ("auto", "pinned", "nvme")
_SPECULATION = ("auto", "on", "off")
_KEYS = ("stage", "offload_optimizer", "offload_param", "ratio", "dtype", "optimizer_state_dtype",
         "gradient_shards", "speculative_optimizer", "pipeline_read", "pipeline_write")
_MAX_ROW_FILE_BYTES = 4 << 20  # a row file lists a few dozen rows of a few keys each


class Row:
    """One placement. None in an optional field: the base config's own value."""

    def __init__(self, stage, optimizer="none", param="none", ratio=1.0, dtype="fp32", moments=None,
                 gradient_shards=None, speculation=None, pipeline_read=None, pipeline_write=None):
        self.stage = stage
        self.optimizer = optimizer
        self.param = param
        self.ratio = ratio
        self.dtype = dtype
        self.moments = moments
        self.gradient_shards = gradient_shards
        self.speculation = speculation
        self.pipeline_read = pipeline_read
        self.pipeline_write = pipeline_write

    def in_memory(self):
        return self.optimizer == "none" and self.param == "none"

    def uses_nvme(self):
        return "nvme" in (self.optimizer, self.param)

    def label(self):
        """'s3 opt=cpu param=none r=0.50 bf16' and the C++ bench's suffixes (m=, grads=nvme, early=, pipe=)."""
        text = f"s{self.stage} opt={self.optimizer} param={self.param}"
        if self.ratio < 1.0:
            text += f" r={_ratio_text(self.ratio)}"
        text += f" {self.dtype}"
        if self.moments is not None and self.moments != "fp32":
            text += f" m={self.moments}"
        if self.gradient_shards == "nvme":
            text += " grads=nvme"
        if self.speculation is not None and self.speculation != "auto":
            text += f" early={self.speculation}"
        if self.pipeline_read is not None or self.pipeline_write is not None:
            read, write = bool(self.pipeline_read), bool(self.pipeline_write)
            text += " pipe=" + (("r" if read else "") + ("w" if write else "") or "off")
        return text

    def unsupported_reason(self):
        """Why the engine cannot run this placement whatever the memory, or ""."""
        if self.stage == 0 and self.optimizer != "none":
            return "stage 0 keeps the optimizer state on the device (offload needs stage 1-3)"
        if self.param != "none" and self.stage != 3:
            return "parameter offload needs stage 3"
        if self.param != "none" and self.optimizer == "none":
            return ("the engine keeps parameters off the device only with the optimizer off it too "
                    "(offload_optimizer cpu or nvme)")
        if self.ratio < 1.0 and not (self.stage == 3 and self.optimizer == "cpu" and self.param == "none"):
            return "ratio < 1 needs stage 3, optimizer cpu, params none"
        if self.moments == "int8" and self.optimizer == "none":
            return "int8 optimizer states need the optimizer state offloaded (cpu or nvme)"
        if self.moments == "int8" and self.ratio < 1.0:
            return "int8 optimizer states need ratio 1 (no device part)"
        if self.gradient_shards == "nvme":
            blocker = _gradient_shards_nvme_blocker(self.optimizer, self.param, self.ratio)
            if blocker:
                return "gradient shards on NVMe: " + blocker
        if self.speculation == "on" and self.optimizer == "none":
            return "speculative_optimizer on needs the optimizer state offloaded (cpu or nvme)"
        if (self.pipeline_read is not None or self.pipeline_write is not None) and self.optimizer != "nvme":
            return "pipeline_read and pipeline_write are the NVMe optimizer tier's (offload_optimizer nvme)"
        return ""

    def settings(self):
        """The row's own keys as the JSON reports them (a row file's keys; null: the base config's)."""
        return {"stage": self.stage, "offload_optimizer": self.optimizer, "offload_param": self.param,
                "ratio": self.ratio, "dtype": self.dtype, "optimizer_state_dtype": self.moments,
                "gradient_shards": self.gradient_shards, "speculative_optimizer": self.speculation,
                "pipeline_read": self.pipeline_read, "pipeline_write": self.pipeline_write}

    def config(self, base, nvme_path):
        """The DeepSpeed config of this row: `base` (a dict, not changed) with the row's stage, placement,
        ratio, precision and strata knobs written in; the base's other keys in those sections kept."""
        cfg = copy.deepcopy(base)
        zero = cfg.get("zero_optimization")
        zero = dict(zero) if isinstance(zero, dict) else {}
        cfg["zero_optimization"] = zero
        zero["stage"] = self.stage
        optimizer = dict(zero.get("offload_optimizer") or {})
        optimizer["device"] = self.optimizer
        _place_nvme_path(optimizer, self.optimizer, nvme_path)
        if self.optimizer == "none":
            optimizer.pop("ratio", None)  # the checker warns that it has no effect there
        else:
            optimizer["ratio"] = self.ratio
        for key, own in (("pipeline_read", self.pipeline_read), ("pipeline_write", self.pipeline_write)):
            if self.optimizer != "nvme":
                optimizer.pop(key, None)
            elif own is not None:
                optimizer[key] = own
        zero["offload_optimizer"] = optimizer
        param = dict(zero.get("offload_param") or {})
        param["device"] = self.param
        _place_nvme_path(param, self.param, nvme_path)
        zero["offload_param"] = param
        for key in ("bf16", "fp16"):
            section = cfg.get(key)
            section = dict(section) if isinstance(section, dict) else {}
            section["enabled"] = self.dtype == key
            cfg[key] = section
        own = {"optimizer_state_dtype": self.moments, "gradient_shards": self.gradient_shards,
               "speculative_optimizer": self.speculation}
        strata_section = cfg.get("strata")
        strata_section = dict(strata_section) if isinstance(strata_section, dict) else {}
        for key, value in own.items():
            if value is not None:
                strata_section[key] = value
        # As the C++ rows do: a base's gradient shards on NVMe go back to auto where this row has no NVMe
        # folder for them.
        if (strata_section.get("gradient_shards") == "nvme"
                and _gradient_shards_nvme_blocker(self.optimizer, self.param, self.ratio)):
            strata_section["gradient_shards"] = "auto"
        if strata_section:
            cfg["strata"] = strata_section
        return cfg


def _place_nvme_path(section, device, nvme_path):
    if device == "nvme":
        section["nvme_path"] = nvme_path
    else:
        section.pop("nvme_path", None)  # the checker warns that it is ignored on another device


def _gradient_shards_nvme_blocker(optimizer, param, ratio):
    # The engine's rule (offload/src/engine_options.cpp, gradient_shards_nvme_blocker).
    if optimizer == "none":
        return "the optimizer state is on the device (offload_optimizer.device none): the gradient shards wait there"
    if ratio < 1.0:
        return f"offload_optimizer.ratio {ratio} < 1 steps part of each piece on the device"
    if optimizer != "nvme" and param != "nvme":
        return ("neither the optimizer state (offload_optimizer.device nvme) nor the parameter shards "
                "(offload_param.device nvme) are on NVMe: the gradient shards go to one of their folders")
    return ""


def _ratio_text(ratio):
    # Two decimals where they hold the ratio exactly (the default matrix's 0.25), else the shortest text that
    # reads back as the same float: no two ratios share a label.
    two = f"{ratio:.2f}"
    return two if float(two) == ratio else repr(ratio)


def default_rows(dtype):
    """The C++ bench's default matrix for one dtype: the 16 placements `strata estimate` prints (stage 0; stages
    1-2 x optimizer none/cpu/nvme; stage 3 x optimizer x params), then stage 3 + optimizer cpu at ratios 0.25,
    0.5 and 0.75. The two stage-3 rows with parameters off the device and the optimizer on it are listed (and
    reported as skipped), as the C++ bench lists them."""
    rows = [Row(0, dtype=dtype)]
    for stage in (1, 2):
        rows += [Row(stage, optimizer, dtype=dtype) for optimizer in _DEVICES]
    rows += [Row(3, optimizer, param, dtype=dtype) for optimizer in _DEVICES for param in _DEVICES]
    rows += [Row(3, "cpu", "none", ratio, dtype=dtype) for ratio in (0.25, 0.5, 0.75)]
    return rows


def _value(value):
    return printable(short_repr(value))


def _parse_row(item, where, default_dtype):
    if not isinstance(item, dict):
        raise InvalidArgument(f'{where}: a row must be an object like {{"stage": 3}}, not {_value(item)}')
    row = Row(stage=None, dtype=default_dtype)
    for key, value in item.items():
        at = f"{where}.{printable(str(key))}"
        if key == "stage":
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 3:
                raise InvalidArgument(f"{at}: {_value(value)} is not 0, 1, 2 or 3")
            row.stage = value
        elif key in ("offload_optimizer", "offload_param"):
            if value not in _DEVICES:
                raise InvalidArgument(f'{at}: {_value(value)} is not "none", "cpu" or "nvme"')
            if key == "offload_optimizer":
                row.optimizer = value
            else:
                row.param = value
        elif key == "ratio":
            if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                    or not 0.0 < value <= 1.0):
                raise InvalidArgument(f"{at}: {_value(value)} is not in (0, 1]")
            row.ratio = float(value)
        elif key == "dtype":
            if not isinstance(value, str) or value not in DTYPES:
                raise InvalidArgument(f'{at}: {_value(value)} is not "fp32", "bf16" or "fp16"')
            row.dtype = DTYPES[value]
        elif key == "optimizer_state_dtype":
            if value not in _MOMENTS:
                raise InvalidArgument(f'{at}: {_value(value)} is not "fp32", "bf16" or "int8"')
            row.moments = value
        elif key == "gradient_shards":
            if value not in _GRADIENT_SHARDS:
                raise InvalidArgument(f'{at}: {_value(value)} is not "auto", "pinned" or "nvme"')
            row.gradient_shards = value
        elif key == "speculative_optimizer":
            if value not in _SPECULATION:
                raise InvalidArgument(f'{at}: {_value(value)} is not "auto", "on" or "off"')
            row.speculation = value
        elif key in ("pipeline_read", "pipeline_write"):
            if not isinstance(value, bool):
                raise InvalidArgument(f"{at}: {_value(value)} is not true or false")
            setattr(row, key, value)
        else:
            raise InvalidArgument(f"{where}: unknown key '{printable(str(key))}' (a row has "
                                  f"{', '.join(_KEYS)})")
    if row.stage is None:
        raise InvalidArgument(f'{where}: "stage" is missing')
    why = row.unsupported_reason()
    if why:
        raise InvalidArgument(f"{where} ({row.label()}): {why}")
    return row


def rows_from_list(items, where, default_dtype):
    """Rows from a list of row dicts (a row file's "rows"); errors name `where`, the row's index and the key."""
    if not isinstance(items, list) or not items:
        raise InvalidArgument(f'{where}: "rows" must be a non-empty list of rows such as [{{"stage": 3}}]')
    rows = [_parse_row(item, f"{where}rows[{i}]", default_dtype) for i, item in enumerate(items)]
    seen = {}
    for i, row in enumerate(rows):
        first = seen.setdefault(row.label(), i)
        if first != i:
            raise InvalidArgument(f"{where}rows[{i}] ({row.label()}) is rows[{first}] again: each row would run "
                                  f"twice; give each placement once")
    return rows


def _no_duplicate_keys(pairs, source):
    keys = set()
    for key, _ in pairs:
        if key in keys:
            raise InvalidArgument(f"{source}: the key '{printable(key)}' is given twice in one object")
        keys.add(key)
    return dict(pairs)


def load_rows_file(path, default_dtype):
    """A row file, {"rows": [...]} or the bare list, read strictly: a regular file of at most 4 MiB, UTF-8 JSON
    (errors with line and column), no key twice, no other top-level key."""
    source = printable(os.fspath(path))
    try:
        info = os.stat(path)
    except OSError as e:
        raise InvalidArgument(f"row file {source}: {e.strerror}; give a file such as "
                              f'{{"rows": [{{"stage": 3, "offload_optimizer": "cpu"}}]}}') from None
    if not stat.S_ISREG(info.st_mode):
        raise InvalidArgument(f"row file {source} is not a regular file")
    if info.st_size > _MAX_ROW_FILE_BYTES:
        raise InvalidArgument(f"row file {source} has {info.st_size} bytes, more than a row file's "
                              f"{_MAX_ROW_FILE_BYTES} (4 MiB)")
    try:
        with open(path, "rb") as f:
            text = f.read(_MAX_ROW_FILE_BYTES + 1).decode("utf-8")
    except UnicodeDecodeError as e:
        raise InvalidArgument(f"row file {source}: not UTF-8 text (byte {e.start})") from None
    except OSError as e:
        raise InvalidArgument(f"row file {source}: {e.strerror}") from None
    try:
        doc = json.loads(text, object_pairs_hook=lambda pairs: _no_duplicate_keys(pairs, source))
    except json.JSONDecodeError as e:
        raise InvalidArgument(f"row file {source}: line {e.lineno} column {e.colno}: {e.msg}") from None
    if isinstance(doc, dict):
        unknown = [k for k in doc if k != "rows"]
        if unknown:
            raise InvalidArgument(f"{source}: unknown key '{printable(unknown[0])}' (the file has one key, \"rows\")")
        if "rows" not in doc:
            raise InvalidArgument(f'{source}: "rows" is missing')
        doc = doc["rows"]
    return rows_from_list(doc, f"{source}: ", default_dtype)
