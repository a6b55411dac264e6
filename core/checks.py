"""Checks every concern makes of its input and of the service: open, sizes, context and budget."""

from __future__ import annotations

from kvstate.core.errors import ContextLimitExceeded, InvalidRequest, OverBudget, ServiceClosed
from kvstate.core.request import Request
from kvstate.core.state import Phase, ServiceState


def size_text(nbytes: int) -> str:
    """Bytes for a message: exact below a KiB, else three significant digits in binary units."""
    if nbytes < 1024:
        return f"{nbytes} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        nbytes /= 1024
        if nbytes < 1024 or unit == "TiB":
            return f"{nbytes:.3g} {unit}"


def ensure_open(state: ServiceState, what: str) -> None:
    if state.phase is not Phase.OPEN:
        raise ServiceClosed(f"{what} after close(); build a new service")


def keeps(state: ServiceState, request: Request) -> bool:
    """Whether state ``request`` publishes may be kept."""
    return request.reuses_prefix and state.config.ram_capacity_bytes > 0


def non_negative_int(value: object, what: str) -> int:
    """``value``, a count the caller reported (not a bool); :class:`InvalidRequest` naming ``what``."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise InvalidRequest(f"{what} is a non-negative int, got {value!r}")
    return value


def check_sizes(nbytes: object, file_bytes: object) -> None:
    for what, value in (("caches", nbytes), ("their file", file_bytes)):
        if not isinstance(value, int) or value < 0:
            raise InvalidRequest(f"{what} report {value!r} bytes")


def check_context(state: ServiceState, request: Request) -> None:
    limit = state.config.model.context_limit
    wanted = len(request.prompt) + request.max_tokens
    if limit is not None and wanted > limit:
        raise ContextLimitExceeded(
            f"prompt {len(request.prompt)} + max_tokens {request.max_tokens} = {wanted} tokens exceeds "
            f"{state.config.model.name}'s context limit of {limit}; shorten the prompt or lower max_tokens")


def check_budget(state: ServiceState, request: Request, need: int) -> None:
    budget = state.config.kv_budget_bytes
    if budget is not None and need > budget:
        raise OverBudget(
            f"request needs {size_text(need)} of KV (prompt {len(request.prompt)} + max_tokens "
            f"{request.max_tokens} on {state.config.model.name}), over the whole KV budget of "
            f"{size_text(budget)} on its own; lower max_tokens or raise the budget")
