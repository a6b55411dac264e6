"""Requests and admission: admit under the KV budget, publish, release, sessions.

Admission charges a request its projected bytes (prompt + max_tokens, from the
model geometry; in a padded batch, the batch's longest row: see
:mod:`~kvstate.core.admission`) until release; the running caches' measured
bytes top the projection up. Publish hands kept state to the tiers; when RAM
is full only of entries pinned by writes in flight, it waits for them
(backpressure: a :class:`~kvstate.core.replies.Pending` reply and a ``Sync``),
then keeps or drops the state once they settle.
"""

from __future__ import annotations

from kvstate.core import admission, checks, events as ev
from kvstate.core.checkpoints import forget_completed
from kvstate.core.checks import (
    check_budget, check_context, check_sizes, ensure_open, keeps, non_negative_int,
)
from kvstate.core.draft import Draft, Step, without
from kvstate.core.errors import InvalidRequest, RequestKeepsNoState, TokensDoNotMatchCaches
from kvstate.core.replies import Admission, NotKept, NotKeptReason, Pending
from kvstate.core.state import OBJECTS, Lease, Phase, ServiceState, check_namespace, request_check
from kvstate.core.tiers import Offer, keep
from kvstate.effects import effects as fx


def admit_lease(d: Draft, lease: Lease) -> Lease | None:
    """The one admission rule, for ``admit`` and for an acquire of a request never admitted: a request
    past the context or over the whole KV budget on its own is refused (``ContextLimitExceeded``,
    ``OverBudget``); one already admitted stays as it is; else it is admitted where the budget has room
    for its charge (the projection grows by it) and None where it has none."""
    request = lease.request
    check_context(d, request)
    need = admission.own_bytes(d, request)
    check_budget(d, request, need)
    if lease.admitted:
        return lease
    projected = admission.charge_with(d, request, need, lease.reused)
    if not admission.has_room(d, projected):
        return None
    d.projected_bytes = projected
    return lease.admitted_with(need)


def admit(state: ServiceState, e: ev.Admit):
    ensure_open(state, "admit")
    lease = state.leases.get(e.lease)
    if lease is None:
        lease = Lease(request_check(e.request))
        if e.namespace is not None:
            lease = lease.expecting(admission.expected_reuse(state, check_namespace(e.namespace), lease.request.prompt))
    d = Draft(state)
    admitted = admit_lease(d, lease)
    if admitted is None:
        return Step(state, (), Admission.WAIT)
    if admitted is lease:
        return Step(state, (), Admission.ADMITTED)
    d.lease_set(e.lease, admitted)
    return d.step(Admission.ADMITTED)


def fits(state: ServiceState, e: ev.Fits):
    request = request_check(e.request)
    limit = state.config.model.context_limit
    if state.phase is not Phase.OPEN or (limit is not None and admission.wanted_tokens(request) > limit):
        return Step(state, (), False)
    # A request over the whole budget on its own has no room beside any others either.
    return Step(state, (), admission.has_room(state, admission.charge_with(state, request)))


def fit_max_tokens(state: ServiceState, e: ev.FitMaxTokens) -> Step:
    prompt = non_negative_int(e.prompt_tokens, "a prompt's tokens")
    if isinstance(e.max_tokens, bool) or not isinstance(e.max_tokens, int) or e.max_tokens < 1:
        raise InvalidRequest(f"max_tokens must be a positive int, got {e.max_tokens!r}")
    return Step(state, (), checks.fit_max_tokens(state.config, prompt, e.max_tokens, bool(e.requested)))


def batch_measured(state: ServiceState, e: ev.BatchMeasured):
    """The running caches were measured: admission goes by the measure where it exceeds the projection."""
    nbytes = non_negative_int(e.nbytes, "a batch measure (bytes)")
    d = Draft(state)
    d.measured_bytes = nbytes if state.projected_bytes else 0  # caches of no admitted request: not ours
    return d.step(None)


def keeps_query(state: ServiceState, e: ev.Keeps):
    return Step(state, (), keeps(state, request_check(e.request)))


def publish(state: ServiceState, e: ev.Publish):
    """Keep published state, or drop it; with RAM full of entries pinned by writes in flight, wait."""
    return decide_publish(state, e, may_wait=True)


def decide_publish(state: ServiceState, e: ev.Publish, may_wait: bool):
    """The publish decision: keep or drop, or (``may_wait``, with writes in flight pinning RAM full) wait
    for the writes to settle; a publish that waited is decided again once they have, without waiting."""
    ensure_open(state, "publish")
    request = request_check(e.request)
    namespace = check_namespace(e.namespace)
    if not keeps(state, request):
        why = ("its prefix has no identity (reuses_prefix=False)" if not request.reuses_prefix
               else "the service keeps no prefixes (RAM capacity 0)")
        raise RequestKeepsNoState(f"this service keeps no state for the request: {why}; check keeps() first")
    if e.covered != len(e.tokens):
        raise TokensDoNotMatchCaches(f"published {len(e.tokens)} tokens with caches covering {e.covered}; "
                                     f"publish exactly the tokens the caches hold")
    check_sizes(e.nbytes, e.file_bytes)
    if e.next_chunk and not e.chunk:
        raise InvalidRequest(f"next_chunk ({len(e.next_chunk)} tokens) was given for a publish that is not a "
                             f"chunk snapshot; pass chunk=True, or no next_chunk")
    if e.blocks:
        _check_blocks(state, e)
    protected = bool(state.config.retention(namespace, e.tokens, request)) if state.config.retention else False
    d = Draft(state)
    reply = keep(d, Offer(namespace, e.tokens, e.handle, e.nbytes, e.file_bytes, e.trimmable, request.session_id,
                          protected, blocks=_blocks_of(e, namespace), snapshot=e.snapshot if e.blocks else None, chunk=e.chunk,
                          next_chunk=e.next_chunk))
    if may_wait and state.writes.count and reply == NotKept(NotKeptReason.NO_ROOM):
        # Backpressure: RAM is full of entries pinned by writes in flight; keep once they settle.
        d = Draft(state)
        d.deferred = e
        d.out.append(fx.Sync())
        return d.step(Pending())
    return d.step(reply)


def _blocks_of(e: ev.Publish, namespace: str) -> tuple[tuple[int, int], ...]:
    """The blocks a publish is kept in: every layer cut (trimmable), or a snapshot beside them."""
    if namespace == OBJECTS or not (e.trimmable or e.snapshot is not None):
        return ()
    return e.blocks


def _check_blocks(state: ServiceState, e: ev.Publish) -> None:
    """A publish in blocks names the sizes of exactly the blocks the config cuts its tokens into."""
    block_tokens = state.config.block_tokens
    if block_tokens is None:
        raise InvalidRequest("a publish in blocks reached a service that keeps whole prefixes (block_tokens None)")
    expected = -(-len(e.tokens) // block_tokens)  # its full blocks and a partial last one (spans)
    if len(e.blocks) != expected:
        raise InvalidRequest(f"a publish of {len(e.tokens)} tokens in blocks of {block_tokens} names "
                             f"{len(e.blocks)} blocks' sizes; it is cut into {expected}")
    for nbytes, file_bytes in e.blocks + ((e.snapshot,) if e.snapshot is not None else ()):
        check_sizes(nbytes, file_bytes)



def release(state: ServiceState, e: ev.Release):
    lease = state.leases.get(e.lease)
    if lease is None:
        return Step(state, (), None)  # a second release is a no-op
    if not isinstance(e.completed, bool):
        raise InvalidRequest(f"completed must be True or False, got {e.completed!r}")
    d = Draft(state)
    d.leases = d.leases.delete(e.lease)
    if lease.admitted:
        before = state.projected_bytes
        d.projected_bytes = admission.charge_without(state, lease, d.leases.values())
        # The measure is older than this release: take the released share off it too.
        d.measured_bytes = max(0, state.measured_bytes - (before - d.projected_bytes)) if d.projected_bytes else 0
    if lease.pending_handle is not None:
        d.acquiring = without(d.acquiring, lease.pending_handle)
    forget_completed(d, lease, e.completed)
    return d.step(None)


def close_session(state: ServiceState, e: ev.CloseSession):
    if not isinstance(e.session_id, str):
        raise InvalidRequest(f"session id must be a string, got {e.session_id!r}")
    if e.session_id not in state.sessions:
        return Step(state, (), None)
    d = Draft(state)
    d.sessions = d.sessions.delete(e.session_id)
    return d.step(None)
