"""The hardware's pace: whether reading saved state back beats computing it again.

A disk hit saves the prefill of the tokens it covers and costs the read of its
file, hashes verified. On a CPU the read wins by orders of magnitude; on a
datacenter GPU a small model prefills faster than its state reads back, and a
disk hit makes the request slower than a miss. So the service learns both
paces from what it is told, as events (the core reads no clock):

- every read of saved state reports how long it took (``RestoreDone.seconds``,
  ``PrefetchDone.seconds``): seconds per byte read back;
- the serving loop reports its prefill (``PrefillMeasured``): seconds per token.

Each pace is a moving average (weight :data:`SMOOTHING` on the newest sample).
While either is unknown every read is taken. Once both are known, a disk entry
serves a request only where reading its file is faster than prefilling the
tokens it adds over what RAM holds, and a kept entry is written to disk only
where reading it back would beat prefilling all of it: state that can never pay
back its read is not written (no wear for nothing). ``flush`` still writes
everything: durability asked for is not second-guessed.
"""

from __future__ import annotations

import attrs

from kvstate.core import events as ev
from kvstate.core.checks import non_negative_int
from kvstate.core.draft import Draft, Step
from kvstate.core.errors import InvalidRequest
from kvstate.core.state import Pace, ServiceState

#: The weight of the newest sample in each moving average.
SMOOTHING = 0.25


def _average(old: float | None, sample: float) -> float:
    return sample if old is None else old + SMOOTHING * (sample - old)


def _check(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise InvalidRequest(f"{what} must be a non-negative number, got {value!r}")
    return float(value)


def read_measured(d: Draft, file_bytes: int, seconds: float | None) -> None:
    """A read of ``file_bytes`` took ``seconds`` (None: the interpreter does not time its reads)."""
    if seconds is None or file_bytes <= 0:
        return
    sample = _check(seconds, "a read's seconds") / file_bytes
    d.pace = attrs.evolve(d.pace, read_s_per_byte=_average(d.pace.read_s_per_byte, sample))


def prefill_measured(state: ServiceState, e: ev.PrefillMeasured) -> Step:
    """The serving loop prefilled ``tokens`` tokens in ``seconds``."""
    tokens = non_negative_int(e.tokens, "a prefill's tokens")
    seconds = _check(e.seconds, "prefill seconds")
    if tokens == 0 or seconds == 0:  # nothing prefilled, or a clock too coarse to see it: no measure
        return Step(state, (), None)
    d = Draft(state)
    d.pace = attrs.evolve(d.pace, prefill_s_per_token=_average(d.pace.prefill_s_per_token, seconds / tokens))
    return d.step(None)


def read_pays(pace: Pace, file_bytes: int, tokens: int) -> bool:
    """Whether reading ``file_bytes`` back is faster than prefilling ``tokens`` (True while unmeasured)."""
    if pace.read_s_per_byte is None or pace.prefill_s_per_token is None:
        return True
    return file_bytes * pace.read_s_per_byte < tokens * pace.prefill_s_per_token
