"""Exceptions raised by strata. Every error from the C++ layers is a
StrataError (a RuntimeError) carrying the C++ Status text as its message and
the StatusCode name as ``.code``; the class says the kind of failure.

Some also derive from the builtin a PyTorch / DeepSpeed user catches:
InvalidArgument is a ValueError, NotFound a FileNotFoundError (an OSError,
and still a LookupError: it also reports a missing key or tensor id), IoError
an OSError, OutOfMemory a MemoryError, DeadlineExceeded a TimeoutError. They
are made with one argument, the message: str(e) is the message and e.args
is (message,), as for the other classes (OSError's errno, strerror and
filename stay None: the message names the file and the errno)."""


class StrataError(RuntimeError):
    """Base class of every error from Strata's native layers."""

    code = "Unknown"


class InvalidArgument(StrataError, ValueError):
    """Bad input: a hyper-parameter, a size, a config value."""


class NotFound(StrataError, LookupError, FileNotFoundError):
    """A file, key or tensor id that does not exist (``except FileNotFoundError``,
    ``except OSError`` and ``except LookupError`` all catch it)."""


class AlreadyExists(StrataError):
    pass


class OutOfMemory(StrataError, MemoryError):
    pass


class ResourceExhausted(StrataError):
    """A bounded resource (disk space, queue slots) ran out."""


class FailedPrecondition(StrataError):
    """The object is not in a state to do this (closed, operation in flight)."""


class Unavailable(StrataError):
    """Transient: retrying may succeed."""


class DeadlineExceeded(StrataError, TimeoutError):
    pass


class IoError(StrataError, OSError):
    """A system call or device failed; the message names file, offset, length, errno
    (``except OSError`` catches it)."""


class DataLoss(StrataError):
    """Corruption detected: a checksum mismatch names the tensor, block and file."""


class Unsupported(StrataError):
    """This build or machine cannot do it."""


class Internal(StrataError):
    """A bug in Strata."""


_BY_CODE = {
    cls.__name__: cls
    for cls in (InvalidArgument, NotFound, AlreadyExists, OutOfMemory, ResourceExhausted, FailedPrecondition,
                Unavailable, DeadlineExceeded, IoError, DataLoss, Unsupported, Internal)
}
for _name, _cls in _BY_CODE.items():
    _cls.code = _name  # raised from Python: the same .code the native layer gives the instance
_BY_CODE["StrataError"] = StrataError

__all__ = ["StrataError"] + sorted(k for k in _BY_CODE if k != "StrataError")
