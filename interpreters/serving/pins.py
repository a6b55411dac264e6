"""Pins in the server: a request's ``cache_pin_seconds``, and warm prompts prefilled at start.

A client that will come back to a prefix (an agent waiting on a long tool call) sends
``"cache_pin_seconds": N`` with its request: once the request's state is kept, the prefix of its
prompt stays in RAM for N seconds, whatever else arrives (:mod:`kvstate.core.pins`). The handler
refuses, with a 400 that says which bound and by how much, a pin longer than ``--max-pin-seconds``
or one that would take pinned state past ``--pin-share`` of ``--ram-bytes``.

An operator names prompts every request starts with (``--warm-prompt FILE``, repeatable): a JSON
file of chat messages (a list, or ``{"messages": [...]}``), rendered through the model's chat
template as a conversation's start, or any other file as plain text for the completions endpoint.
Each is prefilled (or restored from the disk tier) before the server listens, so ``/health``
answers only once they are warm, and pinned until the server stops.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path
from typing import Any

import attrs

from kvstate.core.checks import size_text
from kvstate.core.errors import PinRefused, UsageError

#: The request attribute the handler sets to the pin a request asked for (a :class:`PinAsked`).
PIN_ATTRIBUTE = "kvstate_pin"
#: Prompt tokens a warm prompt is prefilled in at a time (mlx-lm's default prefill chunk).
PREFILL_STEP = 2048


class BadPinSeconds(UsageError, ValueError):
    """A ``cache_pin_seconds`` that is not a positive, finite number of seconds."""


class BadWarmPrompt(UsageError, ValueError):
    """A ``--warm-prompt`` file that cannot be read as chat messages or text, or that RAM cannot pin."""


@attrs.frozen
class PinAsked:
    """A request's pin: for how long, and the tokens of its prompt (0 until its prompt is known)."""

    seconds: float
    prompt_tokens: int = 0


def pin_seconds(value: object) -> float:
    """The seconds of a request's ``cache_pin_seconds``, or :class:`BadPinSeconds`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise BadPinSeconds(f"cache_pin_seconds must be a positive number of seconds, got {value!r}")
    return float(value)


def pin_kept(service: Any, namespace: str, tokens: tuple[int, ...], pin: PinAsked) -> None:
    """Pin the prefix ``pin`` asked for of the state just kept over ``tokens``; a pin the bounds refuse
    now (the handler checked them when the request came) is logged, and the request's answer stands."""
    prefix = tokens[:pin.prompt_tokens] if pin.prompt_tokens else tokens
    try:
        pinned = service.pin(prefix, namespace, pin.seconds)
    except PinRefused as error:
        logging.warning("kvstate: prefix of %d tokens not pinned: %s", len(prefix), error)
        return
    logging.info("kvstate: pinned %d tokens (%s) for %g s", pinned.tokens, size_text(pinned.nbytes), pin.seconds)


def warm_prompt_tokens(path: Path, tokenizer: Any) -> tuple[int, ...]:
    """The tokens a warm prompt file stands for: chat messages through the chat template (without the
    assistant's turn: the start every conversation on them shares), or plain text."""
    try:
        text = Path(path).read_text()
    except (OSError, UnicodeDecodeError) as error:
        raise BadWarmPrompt(f"warm prompt {path}: cannot be read as text ({error})") from None
    messages = None
    if str(path).endswith(".json"):
        try:
            loaded = json.loads(text)
        except json.JSONDecodeError as error:
            raise BadWarmPrompt(f"warm prompt {path}: not JSON ({error}); give a list of chat messages, "
                                f"or a file not named .json for plain text") from None
        messages = loaded.get("messages") if isinstance(loaded, dict) else loaded
        if not (isinstance(messages, list) and messages and all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages)):
            raise BadWarmPrompt(f"warm prompt {path}: expected a non-empty list of chat messages, each with a "
                                f"string 'role' and 'content' (or {{\"messages\": [...]}})")
    if messages is not None and getattr(tokenizer, "has_chat_template", False):
        tokens = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=True)
        if hasattr(tokens, "keys"):  # some tokenizers answer an encoding, not the ids
            tokens = tokens["input_ids"]
    else:
        tokens = tokenizer.encode(text if messages is None else "\n".join(m["content"] for m in messages))
    tokens = tuple(int(token) for token in tokens)
    if not tokens:
        raise BadWarmPrompt(f"warm prompt {path}: holds no tokens")
    return tokens


def warm(cache: Any, model: Any, tokens: tuple[int, ...], name: str) -> None:
    """Prefill ``tokens`` (what the service holds of them is reused, from RAM or disk), keep the state in
    the default namespace and pin it until the server stops; :class:`BadWarmPrompt` where RAM cannot
    keep or pin it."""
    import mlx.core as mx

    with cache.serving(None):
        caches, rest = cache.fetch_nearest_cache(cache.model_key, list(tokens))
        if caches is None:
            caches = cache.service.interpreter.fresh()
        for start in range(0, len(rest), PREFILL_STEP):
            model(mx.array(rest[start:start + PREFILL_STEP])[None], cache=caches)
            mx.eval([c.state for c in caches])
        cache.insert_cache(cache.model_key, list(tokens), caches, cache_type="system")
    service = cache.service
    try:
        pinned = service.pin(tokens, cache.namespace, None)
    except PinRefused as error:
        raise BadWarmPrompt(f"warm prompt {name} ({len(tokens)} tokens): {error}") from None
    if pinned.tokens < len(tokens):
        raise BadWarmPrompt(f"warm prompt {name} ({len(tokens)} tokens): RAM kept {pinned.tokens} of its tokens; "
                            f"give --ram-bytes room for {size_text(service.config.model.bytes_for(len(tokens)))}")
    logging.info("kvstate: warm prompt %s: %d tokens prefilled and pinned (%s)", name, len(tokens),
                 size_text(pinned.nbytes))
