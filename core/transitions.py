"""Every decision of the service: ``step(state, event) -> Step(state, effects, reply)``.

Theory of operation. Admission, reuse, keeping, eviction, spilling,
restoring, prefetching, demotion, checkpoints and flushing are all decided
under ``core/`` and nowhere else; this module is the one dispatch, a table from
each event to the handler of its concern:

- :mod:`~kvstate.core.requests`: admission, publish (with backpressure), release, sessions;
- :mod:`~kvstate.core.reuse`: acquire, the reads it waits on, the reuse rules;
- :mod:`~kvstate.core.tiers`: keeping, eviction, spills, giving RAM back, prefetch;
- :mod:`~kvstate.core.checkpoints`: generation checkpoints written and resumed;
- :mod:`~kvstate.core.objects`: exact-key tensor objects;
- :mod:`~kvstate.core.pace`: whether reading saved state back beats prefilling it;
- :mod:`~kvstate.core.pins`: prefixes held in RAM out of every rule's reach, until a time;
- :mod:`~kvstate.core.lifecycle`: the scan at start, flush, close, the clock, the report.

A handler reads the immutable state and an event, builds the next state once
(:class:`~kvstate.core.draft.Draft`), and returns it with the effects an
interpreter must carry out and the reply for the caller. Nothing here does I/O,
reads a clock, draws a random number or imports mlx; time arrives in
:class:`~kvstate.core.events.Tick`, outcomes of effects in completion events. A
handler that raises leaves the caller's state as it was, so every error is clean.
A call that waits on effects in flight replies :class:`~kvstate.core.replies.Pending`;
its answer is the reply of the completion that ends the wait.
"""

from __future__ import annotations

from typing import Any, Callable

from kvstate.core import checkpoints, events as ev, lifecycle, objects, pace, pins, remote, requests, reuse, sharing, tiers
from kvstate.core.admission import own_bytes
from kvstate.core.checks import ensure_open, keeps
from kvstate.core.checkpoints import checkpoint_key, checkpoint_meta
from kvstate.core.draft import Draft, Step
from kvstate.core.reuse import usable_length
from kvstate.core.state import ServiceState, check_namespace
from kvstate.core.tiers import optional_bytes
from kvstate.effects import completions as done

__all__ = ["Step", "step", "UnknownEvent", "HANDLERS", "checkpoint_key", "checkpoint_meta", "keeps",
           "optional_bytes", "own_bytes", "usable_length"]


def _on_draft(handler: Callable[[Draft, Any], Any]) -> Callable[[ServiceState, Any], Step]:
    """A tier handler that works on a draft (its effects in the draft, its reply returned), as a transition."""
    def transition(state: ServiceState, event: Any) -> Step:
        d = Draft(state)
        reply = handler(d, event)
        return d.step(reply)
    transition.__name__ = handler.__name__
    return transition


def _prefetch(state: ServiceState, e: ev.Prefetch) -> Step:
    ensure_open(state, "prefetch")
    namespace = check_namespace(e.namespace)
    d = Draft(state)
    reply = tiers.prefetch(d, namespace, e.prompt)
    return d.step(reply) if d.out or d.counts else Step(state, (), reply)  # nothing started or counted: unchanged


def _reading_ahead(state: ServiceState, e: ev.ReadingAhead) -> Step:
    namespace = check_namespace(e.namespace)
    return Step(state, (), tiers.reading_ahead(state, namespace, e.prompt) or remote.fetching(state, namespace, e.prompt))


#: Each event and completion, and the handler of its concern.
HANDLERS: dict[type, Callable[[ServiceState, Any], Step]] = {
    ev.Admit: requests.admit,
    ev.Fits: requests.fits,
    ev.FitMaxTokens: requests.fit_max_tokens,
    ev.BatchMeasured: requests.batch_measured,
    ev.PrefillMeasured: pace.prefill_measured,
    ev.Keeps: requests.keeps_query,
    ev.Publish: requests.publish,
    ev.Release: requests.release,
    ev.CloseSession: requests.close_session,
    ev.Acquire: reuse.acquire,
    ev.PeekPrefixLen: reuse.peek,
    ev.Lookup: reuse.lookup,
    ev.SharedWait: sharing.shared_wait,
    ev.Checkpoint: checkpoints.checkpoint,
    ev.PlanCheckpoint: checkpoints.plan_checkpoint,
    ev.CheckpointNote: checkpoints.kept_note,
    ev.Prefetch: _prefetch,
    ev.ReadingAhead: _reading_ahead,
    ev.RemoteLookup: remote.lookup,
    ev.Pin: pins.pin,
    ev.PinFits: pins.pin_fits,
    ev.ObjectGet: objects.object_get,
    ev.ObjectPut: objects.object_put,
    ev.Boundary: lifecycle.boundary,
    ev.Tick: lifecycle.tick,
    ev.RamQuery: lifecycle.ram_query,
    ev.HeldBlocksQuery: lifecycle.held_blocks_query,
    ev.ReportQuery: lifecycle.report_query,
    ev.Flush: lifecycle.flush,
    ev.Close: lifecycle.close,
    done.Scanned: lifecycle.scanned,
    done.RemoteFetched: remote.fetched,
    done.RemoteOffered: remote.offered,
    done.SpillDone: _on_draft(tiers.spill_done),
    done.SpillFailed: _on_draft(tiers.spill_failed),
    done.PrefetchDone: _on_draft(tiers.prefetch_done),
    done.PrefetchFailed: _on_draft(tiers.prefetch_failed),
    done.BlocksPrefetched: _on_draft(tiers.blocks_prefetched),
    done.RestoreDone: reuse.restore_done,
    done.RestoreFailed: reuse.restore_failed,
    done.CheckpointWritten: checkpoints.checkpoint_written,
    done.CheckpointFailed: checkpoints.checkpoint_failed,
    done.CheckpointResumed: reuse.checkpoint_resumed,
    done.ResumeFailed: reuse.resume_failed,
    done.Synced: lifecycle.synced,
}


class UnknownEvent(TypeError):
    """``step`` was given something that is not an event or completion it knows."""


def step(state: ServiceState, event: object) -> Step:
    """The one transition: ``state`` and ``event`` in, next state, effects and reply out."""
    handler = HANDLERS.get(type(event))
    if handler is None:
        raise UnknownEvent(f"no transition for {type(event).__name__}: {event!r}")
    return handler(state, event)
