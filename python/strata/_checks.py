"""Checks of the numbers and paths a user passes to the Python API, before
they reach the native layer (where pybind11 would refuse an out-of-range int
with an unnamed "incompatible function arguments", or truncate a float, and a
NUL byte would cut a path short). Each error names the argument: a wrong
type is a TypeError, a wrong value strata.InvalidArgument (a ValueError)."""
import math
import numbers
import operator

from .errors import InvalidArgument

__all__ = ["check_int", "check_path", "check_finite", "check_json", "printable", "short_repr"]

# The deepest nesting of JSON Strata reads (the native config reader refuses deeper before parsing).
JSON_DEPTH_LIMIT = 64


def check_int(value, what, low, high):
    """`value` as an int in [low, high]; a bool or a float (even 2.0) is refused."""
    if isinstance(value, bool) or not hasattr(type(value), "__index__"):
        raise TypeError(f"{what} must be a whole number, not {type(value).__name__} ({short_repr(value)})")
    number = operator.index(value)
    if number < 0 <= low:
        raise InvalidArgument(f"{what} {number} is negative: give {low}..{high}")
    if not low <= number <= high:
        raise InvalidArgument(f"{what} {number} is out of range: give {low}..{high}")
    return number


def check_finite(value, what, low=-math.inf, high=math.inf):
    """`value` as a float that is finite and in [low, high]; a bool is refused."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):  # numpy floats and ints too
        raise TypeError(f"{what} must be a number, not {type(value).__name__} ({short_repr(value)})")
    number = float(value)
    if not math.isfinite(number):
        raise InvalidArgument(f"{what} {number} is not finite: give a finite number")
    if not low <= number <= high:
        raise InvalidArgument(f"{what} {number} is out of range: give {low}..{high}")
    return number


def check_path(path, what):
    """`path` (str or os.PathLike) as a str without NUL bytes: the native layer
    would end the name at the first NUL and open another file."""
    import os
    text = os.fspath(path)
    if isinstance(text, bytes):
        text = os.fsdecode(text)
    if "\0" in text:
        raise InvalidArgument(f"{what} {short_repr(text)} contains a NUL byte")
    return text


def check_json(value, what, depth_limit=JSON_DEPTH_LIMIT):
    """Raises InvalidArgument naming the key path of a number that is not finite, or of a dict or list nested
    deeper than depth_limit in `value` (json.dumps would write NaN, or raise RecursionError); iterative."""
    pending = [(value, "", 1)]
    while pending:
        node, path, depth = pending.pop()
        if isinstance(node, float) and not math.isfinite(node):
            raise InvalidArgument(f"{what} is not JSON: {path or 'the value'} is {node} (a JSON number is finite)")
        if not isinstance(node, (dict, list, tuple)):
            continue
        if depth > depth_limit:
            raise InvalidArgument(f"{what}: {path or 'the value'} nests deeper than {depth_limit} levels of dicts "
                                  f"and lists, the most Strata reads")
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for key, child in items:
            name = printable(str(key))[:64]  # a key is the user's text: escaped, cut
            child_path = f"{path}[{key}]" if not isinstance(node, dict) else f"{path}.{name}" if path else name
            pending.append((child, child_path, depth + 1))


def printable(text):
    """`text` with control characters (and DEL) escaped as \\xNN, the rest kept."""
    return "".join(c if c >= " " and c != "\x7f" else f"\\x{ord(c):02x}" for c in text)


def short_repr(value):
    """repr(value), cut to 80 characters for a message."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
