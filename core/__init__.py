"""The pure core: immutable state, events in, effects and replies out.

Nothing under ``core/`` does I/O, reads a clock, draws random numbers or
imports mlx (``tests/test_core_purity.py`` enforces it).
"""

from kvstate.core.errors import (
    CheckpointNotAllowed, ContextLimitExceeded, InvalidNamespace, InvalidRequest, KvStateError, NotAdmitted, OverBudget,
    RequestAlreadyAcquired, RequestKeepsNoState, ServiceClosed, StorageError, TokensDoNotMatchCaches,
    UnknownRequest, UsageError,
)
from kvstate.core.replies import Acquired, Admission, FlushResult, GaveBack, Kept, NotKept, NotKeptReason, Source
from kvstate.core.report import Report, report
from kvstate.core.request import Continuation, Request
from kvstate.core.state import InvalidConfig, ServiceConfig, ServiceState, initial_state
from kvstate.core.transitions import Step, step

__all__ = [
    "CheckpointNotAllowed", "ContextLimitExceeded", "InvalidNamespace", "InvalidRequest", "KvStateError", "NotAdmitted",
    "OverBudget", "RequestAlreadyAcquired", "RequestKeepsNoState", "ServiceClosed", "StorageError",
    "TokensDoNotMatchCaches", "UnknownRequest", "UsageError",
    "Acquired", "Admission", "FlushResult", "GaveBack", "Kept", "NotKept", "NotKeptReason", "Source",
    "Report", "report", "Continuation", "Request", "InvalidConfig", "ServiceConfig", "ServiceState",
    "initial_state", "Step", "step",
]
