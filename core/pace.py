"""The hardware's pace: whether reading saved state back beats computing it again.

A disk hit saves the prefill of the tokens it covers and costs the read of its
file, hashes verified. On a CPU the read wins by orders of magnitude; on a
datacenter GPU a small model prefills faster than its state reads back, and a
disk hit makes the request slower than a miss. So the service learns both
paces from what it is told, as events (the core reads no clock):

- every read of saved state reports how long it took (``RestoreDone.seconds``,
  ``PrefetchDone.seconds``): seconds per byte read back;
- the serving loop reports its prefill (``PrefillMeasured``): seconds per token.

Each pace is a moving ratio: the seconds of the samples over what they moved (bytes, tokens), both
sums decayed by :data:`SMOOTHING` at each new sample. So recent samples count more, and large ones
more than small: a read of a few kilobytes or a prefill of one token is mostly fixed costs, and a
per-byte average of such samples would make every large read look slow (on a GPU, a 4 MB warm-up
read put the pace of an 880 MB restore at three times what it took, and the rule passed it up).
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

#: How much of the sums the newest sample decays: earlier samples keep 1 - SMOOTHING of their weight.
SMOOTHING = 0.25


def _decayed(total: float, sample: float) -> float:
    return (1.0 - SMOOTHING) * total + sample


def _check(value: object, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
        raise InvalidRequest(f"{what} must be a non-negative number, got {value!r}")
    return float(value)


def read_measured(d: Draft, file_bytes: int, seconds: float | None) -> None:
    """A read of ``file_bytes`` took ``seconds`` (None: the interpreter does not time its reads)."""
    _moved(d, "read", file_bytes, seconds, "a read's seconds")


def remote_measured(d: Draft, nbytes: int, seconds: float | None) -> None:
    """A fetch of ``nbytes`` from the shared tier, kept on disk, took ``seconds`` (None: not timed)."""
    _moved(d, "remote", nbytes, seconds, "a fetch's seconds")


def _moved(d: Draft, kind: str, nbytes: int, seconds: float | None, what: str) -> None:
    """``nbytes`` moved in ``seconds``: the decayed sums of the pace ``kind`` (``read`` or ``remote``)."""
    if seconds is None or nbytes <= 0:
        return
    seconds = _check(seconds, what)
    pace = d.pace
    d.pace = attrs.evolve(pace, **{f"{kind}_seconds": _decayed(getattr(pace, f"{kind}_seconds"), seconds),
                                   f"{kind}_bytes": _decayed(getattr(pace, f"{kind}_bytes"), nbytes)})


def prefill_measured(state: ServiceState, e: ev.PrefillMeasured) -> Step:
    """The serving loop prefilled ``tokens`` tokens in ``seconds``."""
    tokens = non_negative_int(e.tokens, "a prefill's tokens")
    seconds = _check(e.seconds, "prefill seconds")
    if tokens == 0 or seconds == 0:  # nothing prefilled, or a clock too coarse to see it: no measure
        return Step(state, (), None)
    d = Draft(state)
    d.pace = attrs.evolve(d.pace, prefill_seconds=_decayed(d.pace.prefill_seconds, seconds),
                          prefill_tokens=_decayed(d.pace.prefill_tokens, tokens))
    return d.step(None)


def read_pays(pace: Pace, file_bytes: int, tokens: int) -> bool:
    """Whether reading ``file_bytes`` back is faster than prefilling ``tokens`` (True while unmeasured)."""
    if pace.read_s_per_byte is None or pace.prefill_s_per_token is None:
        return True
    return file_bytes * pace.read_s_per_byte < tokens * pace.prefill_s_per_token
