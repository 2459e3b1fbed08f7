"""The exceptions of the Python API, made from the ops' errors.

The torch ops raise RuntimeError (what TorchScript and C++ see). The Python API raises, with
the same one-line message:

- ValueError for an argument the op refused ("invalid argument: ..."), as Python's own
  argument checks do;
- the OSError subclass of the operating system's error (FileNotFoundError, PermissionError,
  IsADirectoryError, ...) with `errno`, `strerror` and `filename` set, where a system call on a
  file failed: what `open()` and safetensors raise. Likewise IsADirectoryError for a
  directory where one file is read, and FileNotFoundError for an object URL with nothing
  behind it (HTTP 404). It is a RuntimeError as well, so code written for the earlier
  RuntimeError still catches it;
- `SafetensorError` for every other loader error (a malformed file, a file that changed, ...):
  a RuntimeError, and a subclass of `safetensors.SafetensorError` when safetensors is
  installed, so that code catching that keeps working.
"""

from __future__ import annotations

import errno as _errno
import functools
import os
import re
from typing import Callable, Dict, Optional, Tuple, Type, TypeVar

try:  # the peer's exception, so that `except safetensors.SafetensorError` catches ours too
    from safetensors import SafetensorError as _PeerError

    _PEER: Tuple[type, ...] = (_PeerError,)
except ImportError:
    _PEER = ()

__all__ = ["InvalidBackendError", "SafetensorError", "TensorKeyError", "from_op", "mapped_errors", "os_error",
           "reraise"]

INVALID_ARGUMENT = "invalid argument: "


class SafetensorError(RuntimeError, *_PEER):  # type: ignore[misc]
    """A loader error: the file breaks the format, changed while loading, a handle is
    closed, ... A RuntimeError, and a `safetensors.SafetensorError` when safetensors is
    installed."""


SafetensorError.__module__ = "fastsafetensors_rs"  # where users find it (and pickle does)


class InvalidBackendError(ValueError, SafetensorError):
    """A `backend=` safetensors does not know either (it raises SafetensorError there)."""


class TensorKeyError(KeyError, SafetensorError):
    """A tensor name the file does not hold: a KeyError, as a dict lookup raises, and a
    SafetensorError, as safetensors raises."""

    def __str__(self) -> str:  # the message, not KeyError's repr of it
        return str(self.args[0]) if self.args else ""


# "PATH: OP failed: DESCRIPTION (os error N)": rust/error.rs `Error::Io` around an
# std::io::Error from a system call (only those end with their errno). OP is one of a fixed
# set of verbs; PATH may hold anything, so the last " OP failed: " is the one. Every pattern
# here matches one line only.
_IO_ERROR = re.compile(r"^(?P<path>.*): (?P<op>[a-z][a-z ()_]*) failed: (?P<strerror>.*) \(os error (?P<errno>\d+)\)$")

# Errors that are not a system call's but mean what an errno means, by their fixed wording in
# rust/error.rs: a file that is not there, a directory given where one file is read
# (`IsDirectory`, which open(2) would not refuse), an object URL with nothing behind it
# (`RemoteNotFound`).
_LIKE_AN_ERRNO = (
    # A file that is not there, in safetensors' words (`NotFound`).
    (re.compile(r"^No such file or directory: (?P<path>.*)$"), _errno.ENOENT),
    (re.compile(r"^(?P<path>.*): is a directory, but .*$"), _errno.EISDIR),
    (re.compile(r"^(?P<path>.*): no such [a-z]+ \(HTTP 404\).*$"), _errno.ENOENT),
)

_os_error_types: Dict[type, type] = {}


def _os_error_type(base: Type[OSError]) -> type:
    """`base` (FileNotFoundError, ...) that is also a RuntimeError and prints its message as
    the loader wrote it."""
    found = _os_error_types.get(base)
    if found is None:
        found = type(base.__name__, (base, RuntimeError), {
            "__module__": __name__,
            "__doc__": f"{base.__name__} from the loader (also a RuntimeError); str() is its one-line message.",
            "__str__": lambda self: self.message,
            "__reduce__": lambda self: (os_error, (self.errno, self.strerror, self.filename, self.message)),
        })
        _os_error_types[base] = found
    return found


def os_error(code: int, strerror: str, filename: Optional[str], message: str) -> OSError:
    """The OSError subclass Python raises for errno `code` (as `OSError(code, ...)` picks it),
    with `errno`, `strerror` and `filename` set and `message` as its text."""
    base = type(OSError(code, strerror))
    error = _os_error_type(base)(code, strerror, filename)
    error.message = message
    return error


def from_op(message: str) -> Exception:
    """The exception for an op's RuntimeError with this message."""
    if message.startswith(INVALID_ARGUMENT):
        return ValueError(message[len(INVALID_ARGUMENT):])
    io = _IO_ERROR.match(message)
    if io is not None:
        code = int(io["errno"])
        if code in _errno.errorcode:
            return os_error(code, io["strerror"], io["path"], message)
    for pattern, code in _LIKE_AN_ERRNO:
        found = pattern.match(message)
        if found is not None:
            return os_error(code, os.strerror(code), found["path"], message)
    return SafetensorError(message)


def reraise(error: RuntimeError) -> None:
    """Raises an op's RuntimeError as `from_op` maps it; errors already mapped, and those
    of other types (torch's subclasses of RuntimeError), as they are."""
    if type(error) is not RuntimeError:
        raise error
    raise from_op(str(error)) from None


F = TypeVar("F", bound=Callable)


def mapped_errors(function: F) -> F:
    """Raises the RuntimeErrors that `function` lets through (the ops') as `from_op` maps
    them; exceptions of every other type, those already mapped included, pass unchanged."""

    @functools.wraps(function)
    def mapped(*args, **kwargs):
        try:
            return function(*args, **kwargs)
        except RuntimeError as e:
            reraise(e)

    return mapped  # type: ignore[return-value]
