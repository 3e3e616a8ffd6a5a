"""DeepSpeed-style JSON configs checked by Strata's config engine (the one
behind `strata config check`): every key known and typed, did-you-mean for
misspellings, invalid combinations rejected with the fix."""

import json
import os

from . import _native
from ._checks import check_int, check_json, printable
from .errors import InvalidArgument

__all__ = ["check", "load", "Issue"]


class Issue(dict):
    """One problem: severity ('error'|'warning'), path (JSON path), message,
    hint, and text (the one-line form the CLI prints). A dict, with attributes."""

    __getattr__ = dict.__getitem__

    def __init__(self, fields):
        # A key or value of the user's config may hold control characters:
        # escaped here as in .text (escape sequences never reach a terminal).
        super().__init__({k: printable(v) if isinstance(v, str) and k != "text" else v for k, v in fields.items()})

    def __str__(self):
        return self["text"]


def _run(path_or_dict, world_size, hidden_size):
    world_size = check_int(world_size, "world_size", 1, 1 << 24)
    if hidden_size is not None:
        hidden_size = check_int(hidden_size, "hidden_size", 1, 1 << 24)
    if isinstance(path_or_dict, dict):
        check_json(path_or_dict, "the config dict")  # a key's NaN or a nesting too deep, named before json.dumps
        try:
            text = json.dumps(path_or_dict, allow_nan=False)
        except (TypeError, ValueError) as e:
            raise InvalidArgument(f"the config dict is not JSON: {e}") from None
        return _native.check_config(text=text, world_size=world_size, hidden_size=hidden_size)
    if isinstance(path_or_dict, (str, os.PathLike)):
        return _native.check_config(path=os.fspath(path_or_dict), world_size=world_size, hidden_size=hidden_size)
    raise TypeError(f"config is a {type(path_or_dict).__name__}: expected a path or a dict")


def check(path_or_dict, world_size=1, hidden_size=None):
    """Every problem of a config (a file path or a dict), errors and warnings,
    in document order, as a list of Issue; empty when the config is clean."""
    return [Issue(i) for i in _run(path_or_dict, world_size, hidden_size)["issues"]]


def load(path_or_dict, world_size=1, hidden_size=None):
    """The fully resolved config as a dict (every key present, canonical
    names); raises InvalidArgument listing every error when it is invalid."""
    result = _run(path_or_dict, world_size, hidden_size)
    if not result["ok"]:
        errors = [i["text"] for i in result["issues"] if i["severity"] == "error"]
        raise InvalidArgument(f"the config is not valid ({len(errors)} error(s)):\n  " + "\n  ".join(errors))
    return json.loads(result["config_json"])
