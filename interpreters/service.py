"""The service facade: the scheduler port over the pure core and one interpreter.

It holds the current state, turns each call into an event, runs
:func:`kvstate.core.step`, hands the effects to its interpreter and feeds the
completion events back until the call's reply is known. One lock makes it
thread-safe. Requests are named by identity: the facade gives each request
object a lease id the first time it sees it.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections import deque
from typing import Any, Callable, Iterable

import attrs

from kvstate.core import events as ev
from kvstate.core.blocks import spans
from kvstate.core.errors import InvalidConfig, UnknownRequest
from kvstate.core.replies import (
    Admission, FlushResult, Kept, MaxTokensFit, ObjectFound, Pinned, RamHeld, ScanResult, Source,
)
from kvstate.core.report import Report
from kvstate.core.request import Request, as_tokens
from kvstate.core.state import (
    OBJECTS, Counters, ServiceConfig, ServiceState, check_namespace, initial_state, object_tokens, request_check,
)
from kvstate.core.transitions import optional_bytes, step
from kvstate.effects.effects import BlockRemoved, BlockStored, CheckpointMeta, DiskKey
from kvstate.interpreters.base import BlockSizes, CacheFacts, Interpreter
from kvstate.interpreters.observers import Observers
from kvstate.models.spec import ModelSpec

DEFAULT_NAMESPACE = "default"
#: ``tick()``'s default: the time the interpreter's own clock reads.
OWN_CLOCK = object()


@attrs.frozen(eq=False)
class ObjectHit:
    """A tensor object ``objects.get`` found: a copy the caller owns, and where it came from."""

    value: Any
    source: Source


class ObjectCache:
    """Exact-key tensor objects (an encoder's output for one prepared image, say) under the prefixes'
    RAM budget, policy and disk tier."""

    def __init__(self, service: "KvCacheService"):
        self._service = service

    def get(self, key: str) -> ObjectHit | None:
        """The object kept under ``key`` (from RAM, else read from disk), or None for a miss."""
        service = self._service
        with service._lock:
            handle = next(service._handles)
            reply = service._run(ev.ObjectGet(key, handle))
            if not isinstance(reply, ObjectFound):
                return None
            return ObjectHit(service._interpreter.take_object(reply.handle), reply.source)

    def put(self, key: str, value: Any) -> bool:
        """Offer ``value`` for keeping under ``key``; True if kept. On an error the caller keeps it."""
        service = self._service
        with service._lock:
            handle = next(service._handles)
            nbytes = service._interpreter.stage_object(handle, value)
            try:
                file_bytes = service._file_bytes(handle, OBJECTS, object_tokens(key), CacheFacts(None, nbytes, False))
                return isinstance(service._run(ev.ObjectPut(key, handle, nbytes, file_bytes)), Kept)
            except BaseException:
                service._interpreter.unstage(handle)
                raise


@attrs.frozen(eq=False)
class AcquiredState:
    """A request's state, now owned by the caller.

    ``caches`` go straight into the generation loop; ``reused_tokens`` prompt
    tokens are already covered (0 is a miss), so prefill starts there.
    ``resumed`` is set for a resumed generation: ``caches`` then cover
    ``resumed_tokens`` (the prompt, then the tokens generated before the
    checkpoint); ``resumed.pending_token`` is the sampled token to feed next.
    """

    caches: Any
    reused_tokens: int
    source: Source
    resumed: CheckpointMeta | None = None
    resumed_tokens: tuple[int, ...] = ()


class KvCacheService:
    """The scheduler's port to the KV-cache state service (DESIGN.md's table)."""

    def __init__(self, config: ServiceConfig, interpreter: Interpreter, *,
                 pressure: Callable[[int], bool] | None = None):
        self._state: ServiceState = initial_state(config)
        self._interpreter = interpreter
        self._pressure = pressure
        self._lock = threading.RLock()
        self._leases: weakref.WeakKeyDictionary[Request, int] = weakref.WeakKeyDictionary()
        self._lease_ids = itertools.count(1)
        self._handles = itertools.count(1)
        #: Block events a step told, held until it ends: each observer hears one step's together.
        self._told: list[BlockStored | BlockRemoved] = []
        self._block_observers = Observers("block events")
        interpreter.block_observers.append(self._told.append)
        #: What the scan at start kept, deleted to fit the disk budget, and rejected.
        self.scan_result: ScanResult = self._run(interpreter.scan())

    @classmethod
    def simulated(cls, model: str | ModelSpec = "llama-3.1-8b", *, pressure: Callable[[int], bool] | None = None,
                  **options: Any) -> "KvCacheService":
        """A service on the simulator, for a catalogue model or a ``ModelSpec``: the options are
        :func:`kvstate.interpreters.simulator.simulated_parts`'."""
        from kvstate.interpreters.simulator import simulated_parts  # the simulator never imports the port
        config, interpreter = simulated_parts(model, **options)
        return cls(config, interpreter, pressure=pressure)

    @classmethod
    def for_mlx(cls, model: Any, *, pressure: Callable[[int], bool] | None = None,
                **options: Any) -> "KvCacheService":
        """A service on the MLX interpreter for a loaded mlx-lm ``model``: the options are
        :func:`kvstate.interpreters.mlx.interpreter.mlx_parts`'."""
        from kvstate.interpreters.mlx.interpreter import mlx_parts  # the interpreter never imports the port
        config, interpreter = mlx_parts(model, **options)
        try:
            return cls(config, interpreter, pressure=pressure)
        except BaseException:
            interpreter.close()  # a start that failed holds nothing: not the directory, not the root's lock
            raise

    # ------------------------------------------------------------ plumbing

    @property
    def state(self) -> ServiceState:
        """The current state (immutable: safe to keep and compare)."""
        return self._state

    @property
    def interpreter(self) -> Any:
        return self._interpreter

    @property
    def config(self) -> ServiceConfig:
        return self._state.config

    def _run(self, event: Any) -> Any:
        """Step ``event``, carry out its effects and their completions' effects; the call's reply.
        The block events they told go to the observers once all are carried out, even where one failed."""
        with self._lock:
            try:
                return self._carry_out(event)
            finally:
                if self._told:
                    self._tell_block_events()

    def _carry_out(self, event: Any) -> Any:
        result = step(self._state, event)
        self._state = result.state
        reply = result.reply
        if not result.effects:
            return reply
        queue = deque(result.effects)
        while queue:
            for completion in self._interpreter.perform(queue.popleft()):
                follow = step(self._state, completion)
                self._state = follow.state
                queue.extend(follow.effects)
                if follow.reply is not None:
                    reply = follow.reply
        return reply

    def _tell_block_events(self) -> None:
        told = self._told[:]
        self._told.clear()
        self._block_observers.tell(told)

    @property
    def observer_failures(self) -> int:
        """Calls of an observer (``on_put``, ``on_block_events``) that raised: each logged (logger
        ``kvstate``) and counted here; the other observers were told, and the call went on."""
        return self._interpreter.observers.failures + self._block_observers.failures

    def complete(self, completions: Iterable[Any]) -> None:
        """Feed completion events that arrived later (a background writer's)."""
        with self._lock:
            for completion in completions:
                self._run(completion)

    def _lease(self, request: Request, create: bool) -> int:
        request = request_check(request)
        with self._lock:
            lease = self._leases.get(request)
            if lease is None:
                if not create:
                    raise UnknownRequest("this request was never admitted or acquired by this service")
                lease = self._leases[request] = next(self._lease_ids)
            return lease

    # ------------------------------------------------------------ the port

    def admit(self, request: Request, namespace: str | None = None) -> bool:
        """Admit under the KV budget: True holds the request's projected bytes until release; False: wait.
        With the ``namespace`` it will acquire in, a padded batch charges it as starting from what that
        namespace holds for its prompt now.

        Raises :class:`~kvstate.ContextLimitExceeded` or :class:`~kvstate.OverBudget`
        for a request that can never be admitted.
        """
        with self._lock:
            return self._run(ev.Admit(self._lease(request, create=True), request, namespace)) is Admission.ADMITTED

    def measure_batch(self, nbytes: int) -> None:
        """The running requests' caches hold ``nbytes`` now (a batch's real bytes, padding included):
        admission goes by this measure wherever it exceeds the projection."""
        self._run(ev.BatchMeasured(nbytes))

    def measure_prefill(self, tokens: int, seconds: float) -> None:
        """The generation loop prefilled ``tokens`` prompt tokens in ``seconds``: with the reads' own
        timings, this decides whether a disk hit beats a recompute here (:mod:`kvstate.core.pace`)."""
        self._run(ev.PrefillMeasured(tokens, seconds))

    def fit_max_tokens(self, prompt_tokens: int, max_tokens: int, requested: bool = True) -> MaxTokensFit:
        """Whether a request of ``prompt_tokens`` can ever run here, and with what max_tokens: a
        ``requested`` one (the client's) stands or is refused; a default is lowered to what fits the
        context and the KV budget. ``refusal`` says why not, naming where each number came from."""
        return self._run(ev.FitMaxTokens(prompt_tokens, max_tokens, requested))

    def fits(self, request: Request) -> bool:
        """Whether ``admit`` would admit ``request`` now; holds nothing."""
        return self._run(ev.Fits(request))

    def acquire(self, request: Request, namespace: str = DEFAULT_NAMESPACE) -> AcquiredState:
        """The request's state: resumed generation, else the longest reusable prefix, else fresh caches.

        A request not admitted yet is admitted here; :class:`~kvstate.NotAdmitted` if the KV budget
        has no room for it now (``try_acquire`` waits instead).
        """
        return self._acquire(request, namespace, or_wait=False)

    def try_acquire(self, request: Request, namespace: str = DEFAULT_NAMESPACE) -> AcquiredState | None:
        """``admit`` and ``acquire`` in one call, for a scheduler that starts what it admits at once:
        the request's state, or None while the KV budget has no room for it (nothing is held then;
        try again once a running request releases).

        Raises :class:`~kvstate.ContextLimitExceeded` or :class:`~kvstate.OverBudget`
        for a request that can never be admitted.
        """
        return self._acquire(request, namespace, or_wait=True)

    def _acquire(self, request: Request, namespace: str, or_wait: bool) -> AcquiredState | None:
        with self._lock:
            handle = next(self._handles)
            reply = self._run(ev.Acquire(self._lease(request, create=True), request, namespace, handle, or_wait))
            if reply is Admission.WAIT:
                return None
            caches = self._interpreter.take(reply.handle)
            return AcquiredState(caches, reply.reused_tokens, reply.source, reply.resumed, reply.resumed_tokens)

    def lookup(self, prompt: Iterable[int], namespace: str = DEFAULT_NAMESPACE) -> AcquiredState:
        """The longest reusable prefix of ``prompt`` (RAM, else disk where longer and faster than a
        prefill) in caches the caller owns, for a caller that holds no lease (a server's request it runs
        on its own, already admitted elsewhere): counted as a hit or a miss, nothing to release."""
        with self._lock:
            handle = next(self._handles)
            reply = self._run(ev.Lookup(as_tokens(prompt), namespace, handle))
            return AcquiredState(self._interpreter.take(reply.handle), reply.reused_tokens, reply.source)

    def keeps(self, request: Request) -> bool:
        """Whether state ``request`` publishes may be kept (skip copying it otherwise)."""
        return self._run(ev.Keeps(request))

    def publish(self, request: Request, namespace: str, tokens: Iterable[int], caches: Any, *,
                chunk: bool = False, next_chunk: Iterable[int] = ()) -> bool:
        """Offer ``caches`` covering ``tokens`` for reuse; True if kept. On an error the caller keeps them.
        ``chunk``: the state is a prefill's, mid-prompt, offered for the snapshot of a model whose
        layers cannot all be cut; kept as any state where it is the last chunk before a branch point,
        else only where worth its bytes and in free RAM. ``next_chunk``: the prompt's tokens after it, to
        where the next snapshot is taken (or the prompt's end), so that only the last chunk before a
        branch point is kept as such."""
        request = request_check(request)
        tokens = as_tokens(tokens, "published tokens", known=request.prompt)
        check_namespace(namespace)
        with self._lock:
            self.collect()
            handle = next(self._handles)
            facts = self._interpreter.stage(handle, caches)
            try:
                covered = len(tokens) if facts.covered is None else facts.covered  # recurrent state knows no length
                file_bytes = self._file_bytes(handle, namespace, tokens, facts)
                sizes = self._block_sizes(handle, namespace, tokens)
                event = ev.Publish(request, namespace, tokens, handle, covered, facts.nbytes, facts.trimmable,
                                   file_bytes, sizes.blocks if sizes else (), sizes.snapshot if sizes else None,
                                   chunk, as_tokens(next_chunk, "next_chunk") if next_chunk else ())
                return isinstance(self._run(event), Kept)  # under backpressure the core waits for writes
            except BaseException:
                self._interpreter.unstage(handle)
                raise

    def _file_bytes(self, handle: int, namespace: str, tokens: tuple[int, ...], facts: CacheFacts) -> int:
        """What the file of the staged caches would take on disk: the disk tier's unit (0 without one)."""
        if not self._state.config.has_disk:
            return 0
        return self._interpreter.file_bytes(handle, DiskKey(namespace, tokens), facts)

    def _block_sizes(self, handle: int, namespace: str, tokens: tuple[int, ...]) -> BlockSizes | None:
        """Where the config keeps state in blocks and some layers of the staged caches can be cut: each
        block's bytes in RAM and on disk, and a snapshot's (None: kept whole)."""
        block_tokens = self._state.config.block_tokens
        if block_tokens is None or namespace == OBJECTS or not tokens:
            return None
        return self._interpreter.block_bytes(handle, namespace, tokens, spans(len(tokens), block_tokens))

    def collect(self) -> None:
        """Feed back the writes the interpreter finished in the background (unpinning their entries),
        so the report is current; safe from any thread. (An interpreter whose writes complete only when
        its caller says, ``deferred_writes``, keeps them until ``boundary``.)"""
        if not getattr(self._interpreter, "deferred_writes", False):
            with self._lock:
                self.complete(self._interpreter.poll())

    def checkpoint(self, request: Request, caches: Any, tokens: Iterable[int], generated_tokens: int,
                   pending_token: int | None = None, note: str = "") -> bool:
        """Save a resumable point of a replayable generation; True if the write was queued.

        ``tokens`` are the prompt plus the generated tokens ``caches`` cover;
        ``pending_token`` is the sampled token not yet fed to the model; ``note`` is recorded beside
        them as given (a resume hands it back in ``AcquiredState.resumed.note``).
        """
        tokens = as_tokens(tokens, "checkpoint tokens", known=request_check(request).prompt)
        with self._lock:
            lease = self._lease(request, create=False)
            handle = next(self._handles)
            facts = self._interpreter.stage(handle, caches)
            try:
                covered = len(tokens) if facts.covered is None else facts.covered
                # The file is measured for a checkpoint the core plans; for any other the core refuses the
                # checkpoint itself, with its own error.
                meta, file_bytes = self._run(ev.PlanCheckpoint(lease, generated_tokens, pending_token, note)), 0
                if meta is not None:
                    file_bytes = self._interpreter.checkpoint_file_bytes(handle, meta, tokens)
                return self._run(ev.Checkpoint(lease, handle, tokens, covered, generated_tokens,
                                               pending_token, facts.nbytes, file_bytes, note))
            except BaseException:
                self._interpreter.unstage(handle)
                raise

    def checkpoint_note(self, key: str, namespace: str = DEFAULT_NAMESPACE) -> str | None:
        """The note of the checkpoint kept for continuation ``key`` in ``namespace`` (written or being
        written), or None where none is kept."""
        return self._run(ev.CheckpointNote(namespace, key))

    def release(self, request: Request, completed: bool = True) -> None:
        """The request is done: its bytes return to the budget; a completed one's checkpoints go.

        A second release of the same request does nothing; a request never seen
        raises :class:`~kvstate.UnknownRequest`.
        """
        with self._lock:
            self._run(ev.Release(self._lease(request, create=False), completed))

    def boundary(self, *, max_bytes: int | None = None, max_entries: int | None = None) -> None:
        """An execution boundary: collect finished writes, advance the clock, and give RAM back while the
        core finds kept state over its limits (``max_bytes``, ``max_entries`` RAM entries, the KV budget
        where the config holds RAM to it) or the ``pressure`` callback says memory is over."""
        with self._lock:
            self.complete(self._interpreter.poll())
            self._run(ev.Tick(self._interpreter.now))
            waited_in_vain = False
            while True:
                pressed = self._pressure is not None and self._pressure(self._held_bytes())
                gave = self._run(ev.Boundary(pressed, max_bytes, max_entries))
                if gave.entries:
                    waited_in_vain = False
                    continue
                if not gave.waited or waited_in_vain:
                    break  # within the limits, or nothing left to give back and waiting did not help
                waited_in_vain = True

    def _held_bytes(self) -> int:
        return optional_bytes(self._state)

    def tick(self, now: Any = OWN_CLOCK) -> None:
        """The clock reads ``now`` seconds (by default the interpreter's own clock, the one ``boundary``
        reads): entries idle past the demotion threshold move to disk."""
        self._run(ev.Tick(self._interpreter.now if now is OWN_CLOCK else now))

    def prefetch(self, prompt: Iterable[int], namespace: str = DEFAULT_NAMESPACE) -> bool:
        """Start reading the saved prefix of ``prompt`` into RAM; True if a read started."""
        return self._run(ev.Prefetch(as_tokens(prompt), namespace))

    def remote_lookup(self, prompt: Iterable[int], namespace: str = DEFAULT_NAMESPACE) -> bool:
        """A request for ``prompt`` arrived: start fetching the blocks of it this server lacks from the
        shared tier, where that beats prefilling them; whether a fetch of them was started or is in
        flight (one that runs in the background lands at a ``collect`` or ``boundary``:
        ``reading_ahead`` says while it has not). False without a shared tier."""
        return self._run(ev.RemoteLookup(tuple(prompt), namespace))

    def reading_ahead(self, prompt: Iterable[int], namespace: str = DEFAULT_NAMESPACE) -> bool:
        """Whether blocks that would serve ``prompt`` are being read ahead into RAM now (a ``prefetch``
        in flight: their completions land at a ``collect`` or ``boundary``)."""
        return self._run(ev.ReadingAhead(as_tokens(prompt), namespace))

    def pin(self, prompt: Iterable[int], namespace: str = DEFAULT_NAMESPACE, seconds: float | None = None) -> Pinned:
        """Hold the RAM state serving the longest prefix of ``prompt`` held now out of every rule's reach
        (eviction, pressure, idle demotion) for ``seconds`` on the service's clock, read first from the
        interpreter's own (None: until close). :class:`~kvstate.core.errors.PinTooLong` or
        :class:`~kvstate.core.errors.PinOverBudget` where the config's bounds refuse it (nothing pinned);
        the reply says what was pinned (0 tokens: RAM held none of it)."""
        self.tick()
        return self._run(ev.Pin(namespace, as_tokens(prompt), seconds))

    def pin_refusal(self, nbytes: int, seconds: float | None = None) -> str | None:
        """Why a pin of ``nbytes`` of state for ``seconds`` would be refused now, or None: a server asks
        before it serves a request that wants its prefix pinned."""
        return self._run(ev.PinFits(nbytes, seconds))

    def peek_prefix_len(self, prompt: Iterable[int], namespace: str = DEFAULT_NAMESPACE) -> int:
        """Prompt tokens RAM could serve now; takes nothing."""
        return self._run(ev.PeekPrefixLen(as_tokens(prompt), namespace))

    def shared_wait(self, prompt: Iterable[int], namespace: str, computing: Iterable[Any], min_gain: int) -> int:
        """The prompt tokens a wait for ``computing`` (``kvstate.core.sharing.Computing`` rows in
        prefill, in ``namespace``) would let ``prompt`` reuse, where that beats what RAM serves now by
        ``min_gain`` tokens; 0: not worth a wait."""
        return self._run(ev.SharedWait(as_tokens(prompt), namespace, tuple(computing), min_gain))

    def close_session(self, session_id: str) -> None:
        """Drop a session's affinity; its state stays reusable."""
        self._run(ev.CloseSession(session_id))

    @property
    def objects(self) -> ObjectCache:
        """Exact-key tensor objects under the same budget and disk tier as prefixes."""
        return ObjectCache(self)

    def on_put(self, observe: Callable[[tuple[int, ...], str], None]) -> None:
        """Call ``observe(tokens, namespace)`` for every prefix the service keeps (a router's index).
        An observer that raises is logged and counted (:attr:`observer_failures`), never raised."""
        self._interpreter.observers.append(observe)

    def on_block_events(self, observe: Callable[[Any], None], *, together: bool = False) -> None:
        """Call ``observe`` with each change of which full blocks a tier holds (``BlockStored``,
        ``BlockRemoved``; the service is built with ``block_events``). It is first told a
        ``BlockStored`` for every block held now, then every change, in order: what it is told always
        adds up to what the tiers hold. With ``together`` it is called once per call of the port that
        changed something, with that call's events as a list (the held blocks being the first list),
        as vLLM publishes one batch a scheduler step. An observer that raises is logged and counted
        (:attr:`observer_failures`), never raised: the others are told, and the call goes on."""
        if not self.config.block_events:
            raise InvalidConfig("block events need a service built with block_events=True (and blocks)")
        observers = self._block_observers
        if not together:
            def observe_each(told: list, observe=observe) -> None:
                for event in told:
                    observers.call(observe, event)
        with self._lock:
            held = list(self._run(ev.HeldBlocksQuery()).blocks)
            if held:
                observers.call(observe if together else observe_each, held)
            observers.append(observe if together else observe_each)

    def saved_prefixes(self) -> list[tuple[str, tuple[int, ...]]]:
        """``(namespace, tokens)`` of every prefix saved state holds, read from headers alone."""
        with self._lock:
            return self._interpreter.saved_prefixes()

    def ram(self, each: bool = False) -> RamHeld:
        """What RAM holds now: entries and bytes, and with ``each`` every entry (a pass over them all)."""
        return self._run(ev.RamQuery(each))

    def counts(self) -> Counters:
        """The monotonic counters alone, as the core keeps them: cheap to read often (``report`` walks
        every entry for its gauges)."""
        return self._state.counters

    def report(self) -> Report:
        """The counters, as one frozen record."""
        return self._run(ev.ReportQuery(*self._interpreter.rejected_held()))

    def flush(self) -> FlushResult:
        """Make kept state durable; ``durable`` says whether every kept prefix and checkpoint now is."""
        return self._run(ev.Flush())

    def close(self) -> FlushResult:
        """Flush, then clear RAM state; a second close returns the first one's result."""
        with self._lock:
            result = self._run(ev.Close())
            self._interpreter.close()  # idempotent: releases what it holds (the saved-state root's lease)
            return result

    def __enter__(self) -> "KvCacheService":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
