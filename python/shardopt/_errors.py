"""The exceptions shardopt raises.

Every failed call to a server raises a subclass of :class:`Error` for its
canonical status code (absl and gRPC share the numbering), carrying the code
and the server's message, which names the server's address.
"""


class Error(RuntimeError):
    """A shardopt call failed. ``code`` is the canonical status code's name
    (e.g. ``"NOT_FOUND"``), ``code_value`` its number, ``message`` the
    message from the server or client."""

    code = "UNKNOWN"
    code_value = 2

    def __init__(self, message):
        super().__init__(f"{self.code}: {message}")
        self.message = message


class Cancelled(Error):
    code, code_value = "CANCELLED", 1


class Unknown(Error):
    code, code_value = "UNKNOWN", 2


class InvalidArgument(Error, ValueError):
    code, code_value = "INVALID_ARGUMENT", 3


class DeadlineExceeded(Error, TimeoutError):
    code, code_value = "DEADLINE_EXCEEDED", 4


class NotFound(Error, LookupError):
    code, code_value = "NOT_FOUND", 5


class AlreadyExists(Error):
    code, code_value = "ALREADY_EXISTS", 6


class PermissionDenied(Error):
    code, code_value = "PERMISSION_DENIED", 7


class ResourceExhausted(Error):
    code, code_value = "RESOURCE_EXHAUSTED", 8


class FailedPrecondition(Error):
    code, code_value = "FAILED_PRECONDITION", 9


class Aborted(Error):
    code, code_value = "ABORTED", 10


class OutOfRange(Error, IndexError):
    code, code_value = "OUT_OF_RANGE", 11


class Unimplemented(Error, NotImplementedError):
    code, code_value = "UNIMPLEMENTED", 12


class Internal(Error):
    code, code_value = "INTERNAL", 13


class Unavailable(Error, ConnectionError):
    code, code_value = "UNAVAILABLE", 14


class DataLoss(Error):
    code, code_value = "DATA_LOSS", 15


class Unauthenticated(Error):
    code, code_value = "UNAUTHENTICATED", 16


class UnsupportedDtype(InvalidArgument, TypeError):
    """A param's dtype is neither torch.bfloat16 nor torch.float32."""


class ParamsChanged(FailedPrecondition):
    """The optimizer's params are not the ones its job was created with."""


_BY_CODE = {cls.code_value: cls for cls in (
    Cancelled, Unknown, InvalidArgument, DeadlineExceeded, NotFound, AlreadyExists, PermissionDenied,
    ResourceExhausted, FailedPrecondition, Aborted, OutOfRange, Unimplemented, Internal, Unavailable, DataLoss,
    Unauthenticated)}


# Shown as shardopt.NotFound etc., where users catch them.
for _cls in (Error, UnsupportedDtype, ParamsChanged, *_BY_CODE.values()):
    _cls.__module__ = "shardopt"


def raise_status(code, message):
    """Raises the exception for a canonical status code (called by shardopt._C)."""
    raise _BY_CODE.get(code, Unknown)(message)
