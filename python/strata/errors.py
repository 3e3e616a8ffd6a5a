"""Exceptions raised by strata. Every error from the C++ layers is a
StrataError (a RuntimeError) carrying the C++ Status text as its message and
the StatusCode name as ``.code``; the class says the kind of failure."""


class StrataError(RuntimeError):
    """Base class of every error from Strata's native layers."""

    code = "Unknown"


class InvalidArgument(StrataError, ValueError):
    """Bad input: a hyper-parameter, a size, a config value."""


class NotFound(StrataError, LookupError):
    """A file, key or tensor id that does not exist."""


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


class IoError(StrataError):
    """A system call or device failed; the message names file, offset, length, errno."""


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
_BY_CODE["StrataError"] = StrataError

__all__ = ["StrataError"] + sorted(k for k in _BY_CODE if k != "StrataError")
