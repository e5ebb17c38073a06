"""shardopt: a remote optimizer service. ``shardopt.torch.RemoteAdamW`` is a
drop-in ``torch.optim.Optimizer`` backed by shardopt servers.

``shardopt._C`` is the C++ client; importing ``shardopt`` does not import
torch (``import shardopt.torch`` does).
"""
from ._errors import (Aborted, AlreadyExists, Cancelled, DataLoss, DeadlineExceeded, Error, FailedPrecondition,
                      Internal, InvalidArgument, NotFound, OutOfRange, ParamsChanged, PermissionDenied,
                      ResourceExhausted, Unauthenticated, Unavailable, Unimplemented, Unknown, UnsupportedDtype)
from ._C import expand_server_pattern

__all__ = ["Error", "Cancelled", "Unknown", "InvalidArgument", "DeadlineExceeded", "NotFound", "AlreadyExists",
           "PermissionDenied", "ResourceExhausted", "FailedPrecondition", "Aborted", "OutOfRange", "Unimplemented",
           "Internal", "Unavailable", "DataLoss", "Unauthenticated", "UnsupportedDtype", "ParamsChanged",
           "expand_server_pattern"]
