"""The request as the service sees it: what the scheduler admits and runs.

A :class:`Request` is compared by identity: the object itself names its lease
from ``admit`` to ``release``, as one scheduler row does. Its fields are checked
when it is built, so a malformed request never reaches a transition.
"""

from __future__ import annotations

import array
import operator

import attrs

from kvstate.core.errors import InvalidRequest
from kvstate.core.tokens import Tokens


def as_tokens(tokens: object, what: str = "prompt", known: Tokens | None = None) -> Tokens:
    """``tokens`` as :class:`Tokens` of ids in 0 .. 2**64 - 1, or :class:`InvalidRequest` saying what is wrong.

    ``known`` is a request's prompt, already checked: tokens that start with it
    have only their remaining ids checked and packed.
    """
    if type(tokens) is Tokens:
        return tokens
    if known is not None and tokens is known.ids:  # the very tuple the prompt was built from
        return known
    if type(tokens) is list:
        tokens = tuple(tokens)
    if known and type(tokens) is tuple and len(tokens) >= len(known) and tokens[:len(known)] == known:
        if len(tokens) == len(known):
            return known
        rest = as_tokens(tokens[len(known):], what)
        return Tokens(tokens, known.packed + rest.packed)
    if type(tokens) is tuple:
        try:  # the common case, checked in C: every id an integer in 0 .. 2**64 - 1
            ids = array.array("Q", tokens)
        except (TypeError, OverflowError):
            pass  # the checks below say what is wrong
        else:
            if not tokens:
                raise InvalidRequest(f"{what} is empty: a request needs at least one token")
            # The caller's own int objects: a later comparison with the caller's tokens (a publish of
            # the prompt and what followed) finds them identical without comparing values.
            return Tokens(tokens, ids.tobytes())
    if isinstance(tokens, (str, bytes)):
        raise InvalidRequest(f"{what} must be a sequence of token ids, got {type(tokens).__name__}")
    try:
        result = tuple(map(operator.index, tokens))  # accepts numpy ints, refuses floats
    except TypeError:
        raise InvalidRequest(f"{what} must be a sequence of integer token ids") from None
    if not result:
        raise InvalidRequest(f"{what} is empty: a request needs at least one token")
    if min(result) < 0:
        raise InvalidRequest(f"{what} holds a negative token id ({min(result)})")
    if max(result) >= 1 << 64:
        raise InvalidRequest(f"{what} holds a token id above 2**64 - 1 ({max(result)})")
    return Tokens(result)


def _max_tokens(value: object) -> int:
    try:
        count = operator.index(value)
    except TypeError:
        raise InvalidRequest(f"max_tokens must be an integer, got {type(value).__name__}") from None
    if count < 1:
        raise InvalidRequest(f"max_tokens must be at least 1, got {count}")
    return count


def _optional_text(what: str):
    def check(value: object) -> str | None:
        if value is not None and (not isinstance(value, str) or not value):
            raise InvalidRequest(f"{what} must be a non-empty string or None, got {value!r}")
        return value
    return check


def _flag(what: str):
    def check(value: object) -> bool:
        if not isinstance(value, bool):
            raise InvalidRequest(f"{what} must be True or False, got {value!r}")
        return value
    return check


@attrs.frozen
class Continuation:
    """A replayable generation: its checkpoint key and the sampler seed it starts from."""

    key: str = attrs.field(converter=_optional_text("continuation key"))
    seed: int = attrs.field(converter=operator.index)
    seed_was_explicit: bool = attrs.field(default=False, converter=_flag("seed_was_explicit"))

    def __attrs_post_init__(self) -> None:
        if self.key is None:
            raise InvalidRequest("a continuation needs a key")


def _continuation(value: object) -> Continuation | None:
    if value is not None and not isinstance(value, Continuation):
        raise InvalidRequest(f"continuation must be a kvstate.Continuation or None, got {type(value).__name__}")
    return value


@attrs.frozen(eq=False)
class Request:
    """One request: prompt tokens, the tokens it may generate, and how its state may be shared.

    ``session_id`` ties turns of one conversation together (affinity counts);
    ``reuses_prefix=False`` marks a prompt whose prefix has no identity (media
    without one): it takes fresh state and nothing it produces is kept;
    ``continuation`` makes the generation replayable from checkpoints.
    """

    prompt: Tokens = attrs.field(converter=as_tokens, repr=lambda p: f"<{len(p)} tokens>")
    max_tokens: int = attrs.field(converter=_max_tokens)
    session_id: str | None = attrs.field(default=None, converter=_optional_text("session_id"))
    reuses_prefix: bool = attrs.field(default=True, converter=_flag("reuses_prefix"))
    continuation: Continuation | None = attrs.field(default=None, converter=_continuation)
