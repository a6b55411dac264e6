"""Checks every concern makes of its input and of the service: open, sizes, context and budget."""

from __future__ import annotations

from kvstate.core.admission import alone_bytes
from kvstate.core.errors import ContextLimitExceeded, InvalidRequest, OverBudget, ServiceClosed
from kvstate.core.replies import MaxTokensFit
from kvstate.core.request import Request
from kvstate.core.state import Phase, ServiceConfig, ServiceState


def size_text(nbytes: int) -> str:
    """Bytes for a message: exact below a KiB, else three significant digits in binary units."""
    if nbytes < 1024:
        return f"{nbytes} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        nbytes /= 1024
        if nbytes < 1024 or unit == "TiB":
            return f"{nbytes:.3g} {unit}"


def most_tokens_within(config: ServiceConfig, budget_bytes: int) -> int:
    """The most positions (prompt + max_tokens) a request running alone may take within ``budget_bytes``."""
    low, high = 0, 1
    while alone_bytes(config, high) <= budget_bytes:
        low, high = high, high * 2
    while high - low > 1:  # alone_bytes grows with the tokens: the last that fits lies in [low, high)
        middle = (low + high) // 2
        low, high = (middle, high) if alone_bytes(config, middle) <= budget_bytes else (low, middle)
    return low


def fit_max_tokens(config: ServiceConfig, prompt: int, max_tokens: int, requested: bool) -> MaxTokensFit:
    """Whether a request of ``prompt`` tokens can ever run, and with what max_tokens.

    A ``requested`` max_tokens (the client's own) stands, and a request whose prompt plus it passes the
    model's context or the whole KV budget is refused. A default (the client sent none) never turns a
    servable request into a refusal: it is lowered to what fits, and only a prompt that leaves no room
    for one token is refused. Every refusal says which number came from where.
    """
    limit, budget = config.model.context_limit, config.kv_budget_bytes
    most = None if budget is None else most_tokens_within(config, budget)
    within_limit = f"{config.model.name}'s context limit of {limit} tokens"
    within_budget = f"the whole KV budget of {size_text(budget or 0)} on its own"
    if not requested:
        room = max_tokens
        if limit is not None:
            room = min(room, limit - prompt)
        if most is not None:
            room = min(room, most - prompt)
        if room >= 1:
            return MaxTokensFit(room, None)
        within = within_limit if limit is not None and prompt >= limit else within_budget
        return MaxTokensFit(max_tokens, f"the prompt of {prompt} tokens leaves no room for one generated token "
                                        f"within {within}; shorten the prompt")
    asked = f"the prompt of {prompt} tokens + max_tokens {max_tokens} (the request's) = {prompt + max_tokens} tokens"
    if limit is not None and prompt + max_tokens > limit:
        return MaxTokensFit(max_tokens, f"{asked} is past {within_limit}; shorten the prompt or lower max_tokens")
    if most is not None and prompt + max_tokens > most:
        need = size_text(alone_bytes(config, prompt + max_tokens))
        return MaxTokensFit(max_tokens, f"{asked} need {need} of KV, over {within_budget}; lower max_tokens")
    return MaxTokensFit(max_tokens, None)


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
