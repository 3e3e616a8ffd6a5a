"""Sizes a user gives in bytes or as text ("5GB", "500MB", "2GiB")."""
import decimal
import math
import numbers
import operator
import re

from .errors import InvalidArgument

__all__ = ["parse_size"]

_SIZE_UNITS = {"": 1, "B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12,
               "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30, "TIB": 2 ** 40}
_MAX_BYTES = 2 ** 50


def parse_size(value, what):
    """Bytes (int) or a size such as "5GB" / "500MB" / "2GiB"; `what` names
    the argument in errors. 1 byte to 1 PiB; never rounded to 0 or wrapped."""
    if isinstance(value, bool):
        raise TypeError(f"{what} must be a number of bytes or a size such as \"5GB\", not a bool")
    if isinstance(value, numbers.Integral):  # numpy integers too
        size = operator.index(value)
    elif isinstance(value, numbers.Real) and math.isfinite(value) and float(value).is_integer():
        size = int(value)  # 1e8: a whole number of bytes written as a float
    elif isinstance(value, numbers.Real):
        raise TypeError(f"{what} must be a whole number of bytes or a size such as \"5GB\", not the float {value!r}")
    elif isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([A-Za-z]*)\s*", value)
        unit = match.group(2).upper() if match else None
        if not match or unit not in _SIZE_UNITS:
            raise InvalidArgument(f"{what} {value[:40]!r} is not a size: write bytes or e.g. \"5GB\", \"500MB\", \"2GiB\"")
        # Exact decimal arithmetic: "1.1GB" is 1100000000 bytes, and a
        # fraction of a byte ("1.5B") is refused rather than truncated.
        exact = decimal.Decimal(match.group(1)) * _SIZE_UNITS[unit]
        if exact != exact.to_integral_value():
            raise InvalidArgument(f"{what} {value[:40]!r} is not a whole number of bytes ({exact} B)")
        size = int(exact)
    else:
        raise TypeError(f"{what} must be a number of bytes or a size such as \"5GB\", not {type(value).__name__}")
    if not 1 <= size <= _MAX_BYTES:
        raise InvalidArgument(f"{what} {value!r} is out of range: give 1 byte to 1 PiB")
    return size
