"""kvstate: the KV-cache state service for LLM inference on MLX.

The public face: the service facade, the request, the configuration, the
errors, and the model catalogue. Everything else is importable from
``kvstate.core``, ``kvstate.effects``, ``kvstate.interpreters`` and
``kvstate.models``.
"""

from importlib.metadata import PackageNotFoundError, version as _version

from kvstate.core.errors import (
    CheckpointNotAllowed, ContextLimitExceeded, InvalidNamespace, InvalidRequest, KvStateError, NotAdmitted, OverBudget,
    PinOverBudget, PinRefused, PinTooLong, RequestAlreadyAcquired, RequestKeepsNoState, ServiceClosed, StorageError, TokensDoNotMatchCaches,
    UnknownRequest, UsageError,
)
from kvstate.core import retention
from kvstate.core.policies import POLICIES, UnknownPolicy
from kvstate.core.replies import FlushResult, Source
from kvstate.core.report import Report
from kvstate.core.request import Continuation, Request
from kvstate.core.state import InvalidConfig, ServiceConfig
from kvstate.interpreters.service import AcquiredState, KvCacheService, ObjectHit
from kvstate.interpreters.simulator import CostModel, FaultPlan, SimCaches, SimDisk, SimObject, SimulatedCrash
from kvstate.models import CATALOGUE, KvScheme, LayerKind, LayerSpec, ModelSpec, UnknownModel, model_spec

try:
    __version__ = _version("kvstate")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0.0.0"

__all__ = [
    "KvCacheService", "AcquiredState", "ObjectHit", "SimObject", "retention", "Request", "Continuation", "ServiceConfig", "Report", "FlushResult",
    "Source", "POLICIES",
    "KvStateError", "UsageError", "StorageError", "InvalidRequest", "InvalidNamespace", "InvalidConfig",
    "ContextLimitExceeded", "OverBudget", "NotAdmitted", "UnknownRequest", "RequestAlreadyAcquired", "RequestKeepsNoState",
    "TokensDoNotMatchCaches", "CheckpointNotAllowed", "PinRefused", "PinTooLong", "PinOverBudget", "ServiceClosed", "UnknownPolicy", "UnknownModel",
    "CostModel", "FaultPlan", "SimCaches", "SimDisk", "SimulatedCrash",
    "CATALOGUE", "KvScheme", "LayerKind", "LayerSpec", "ModelSpec", "model_spec", "__version__",
]
