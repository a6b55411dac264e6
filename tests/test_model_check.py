"""Model checks: the facade on the simulator against naive reference models (DESIGN.md invariants).

``ExactServiceMachine`` runs RAM-only with FIFO eviction, where a naive
reference (an ordered dict under a byte capacity) predicts exactly what is
held, prefixes and tensor objects alike, so every acquire must reuse exactly
what the reference says (invariant 3), every object get must hit exactly when
the reference holds it, and every session hit and miss is predicted.

``TieredServiceMachine`` adds the disk tier with writes that complete later,
injected write failures, corrupted files, idle demotion, pressure, prefetch,
flush and restart, under every policy. There the reference tracks what was
published and admitted; reuse is checked against a naive scan of the held
listing (RAM and disk) and against what was ever published.
"""

from __future__ import annotations

import os

import attrs
import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import (
    Bundle, RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test,
)

from kvstate import (
    ContextLimitExceeded, KvCacheService, LayerKind, LayerSpec, ModelSpec, OverBudget, PinOverBudget, POLICIES, Request,
    RequestKeepsNoState, SimObject,
)
from kvstate.core.blocks import block_key, block_names, namespace_key
from kvstate.core.tokens import packed
from kvstate.core.state import IN_RAM, OBJECTS, ON_DISK, Residence
from kvstate.effects import DiskKey
from kvstate.effects.effects import BlockName, BlockRemoved, BlockStored, SnapshotName
from kvstate.interpreters.simulator import FaultPlan, FileModel, SimDisk
from tests.reference import NaiveFifoPrefixCache, attention_bytes, longest_usable, usable

LAYERS, KV_HEADS, HEAD_DIM = 2, 1, 4
CONTEXT = 256
TRIMMABLE = ModelSpec("check-dense", (LayerSpec(LayerKind.FULL_ATTENTION, kv_heads=KV_HEADS, head_dim=HEAD_DIM),) * LAYERS,
                      CONTEXT)
RECURRENT_STATE = 100
HYBRID = ModelSpec("check-hybrid", (LayerSpec(LayerKind.RECURRENT, state_bytes=RECURRENT_STATE),
                                    LayerSpec(LayerKind.FULL_ATTENTION, kv_heads=KV_HEADS, head_dim=HEAD_DIM)),
                   CONTEXT)


def reference_bytes(spec: ModelSpec, tokens: int) -> int:
    """The projection, computed from the test's own formula."""
    if spec is TRIMMABLE:
        return attention_bytes(LAYERS, KV_HEADS, HEAD_DIM, tokens)
    return RECURRENT_STATE + attention_bytes(1, KV_HEADS, HEAD_DIM, tokens)


BUDGET = attention_bytes(LAYERS, KV_HEADS, HEAD_DIM, 200)
RAM = attention_bytes(LAYERS, KV_HEADS, HEAD_DIM, 80)
DISK = attention_bytes(LAYERS, KV_HEADS, HEAD_DIM, 200)
#: A token no prompt holds: a pin or a peek of ``prompt + (SENTINEL,)`` may cover every token of ``prompt``.
SENTINEL = 9
#: Seconds unused after which the tiered machine's clock rule (idle demotion or idle writes) acts.
IDLE = 5.0
PROFILE = os.environ.get("KVSTATE_CHECK_PROFILE", "ci")
EXAMPLES = {"ci": 300, "long": 2000}[PROFILE]
STEPS = {"ci": 50, "long": 80}[PROFILE]
CHECK_SETTINGS = settings(max_examples=EXAMPLES, stateful_step_count=STEPS, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])

tails = st.lists(st.integers(0, 3), min_size=1, max_size=12).map(tuple)


@attrs.define
class Live:
    """A request the machine has admitted or acquired and not yet released."""

    request: Request
    namespace: str
    admitted_bytes: int = 0
    caches: object = None


class BaseMachine(RuleBasedStateMachine):
    """Rules shared by both machines: prompts sharing prefixes, admission, release, sessions."""

    prompts = Bundle("prompts")
    spec: ModelSpec = TRIMMABLE

    def __init__(self) -> None:
        super().__init__()
        self.live: list[Live] = []
        self.pressure_limit: int | None = None

    def make_service(self, **options):
        return KvCacheService.simulated(self.spec, ram_bytes=RAM, kv_budget_bytes=BUDGET,
                                        pressure=lambda held: self.pressure_limit is not None
                                        and held > self.pressure_limit, **options)

    @initialize(target=prompts)
    def first_prompt(self):
        return (0, 1, 2, 3, 0, 1)

    @rule(target=prompts, base=prompts, cut=st.integers(0, 40), tail=tails)
    def new_prompt(self, base, cut, tail):
        return (base[:cut] + tail)[:56]

    @rule(prompt=prompts, max_tokens=st.one_of(st.integers(1, 40), st.sampled_from([150, 250, 400])), session=st.sampled_from([None, "s1", "s2"]),
          namespace=st.sampled_from(["x", "y"]), reuses=st.sampled_from([True, True, True, False]))
    def admit(self, prompt, max_tokens, session, namespace, reuses):
        request = Request(prompt, max_tokens, session_id=session, reuses_prefix=reuses)
        need = reference_bytes(self.spec, len(prompt) + max_tokens)
        held = sum(live.admitted_bytes for live in self.live)
        before = self.service.state
        if len(prompt) + max_tokens > CONTEXT:
            with_error = ContextLimitExceeded
        elif need > BUDGET:
            with_error = OverBudget
        else:
            with_error = None
        if with_error is not None:
            try:
                self.service.admit(request)
            except with_error:
                assert self.service.state == before  # an error changes nothing
                return
            raise AssertionError(f"expected {with_error.__name__}")
        admitted = self.service.admit(request)
        assert admitted == (held + need <= BUDGET)
        if admitted:
            self.live.append(Live(request, namespace, need))
        else:
            assert self.service.state == before

    @rule(prompt=prompts, session=st.sampled_from([None, "s1", "s2"]), namespace=st.sampled_from(["x", "y"]),
          extra=st.lists(st.integers(0, 3), max_size=6).map(tuple), reuses=st.sampled_from([True] * 7 + [False]))
    def serve(self, prompt, session, namespace, extra, reuses):
        """One whole request as a scheduler runs it: admit, acquire, prefill, publish, release."""
        request = Request(prompt, 8, session_id=session, reuses_prefix=reuses)
        need = reference_bytes(self.spec, len(prompt) + 8)
        if not self.service.admit(request):
            assert sum(live.admitted_bytes for live in self.live) + need > BUDGET
            return
        live = Live(request, namespace, need)
        self.live.append(live)
        self.before_acquire()
        self.check_acquire(live, self.service.acquire(request, namespace))
        tokens = prompt + extra
        live.caches = self.service.interpreter.prefill(live.caches, tokens[len(live.caches.tokens):])
        if reuses:
            self.check_publish(live, tokens, self.service.publish(request, namespace, tokens, live.caches))
        self.live.remove(live)
        self.service.release(request, True)

    @precondition(lambda self: any(live.caches is None for live in self.live))
    @rule(data=st.data())
    def acquire(self, data):
        live = data.draw(st.sampled_from([live for live in self.live if live.caches is None]))
        self.before_acquire()
        self.check_acquire(live, self.service.acquire(live.request, live.namespace))

    @rule(prompt=prompts, namespace=st.sampled_from(["x", "y"]))
    def look_up(self, prompt, namespace):
        """A lookup for a request admitted elsewhere: the longest reusable prefix, no lease held."""
        self.before_acquire()
        state = self.service.lookup(prompt, namespace)
        assert state.caches.tokens == prompt[:state.reused_tokens]
        self.check_lookup(namespace, prompt, state.reused_tokens)
        assert self.service.report().live_requests == len(self.live)

    def before_acquire(self):
        """What a machine notes before an acquire, to judge it after (nothing, by default)."""

    @precondition(lambda self: any(live.caches is not None for live in self.live))
    @rule(data=st.data(), extra=st.lists(st.integers(0, 3), max_size=6).map(tuple))
    def publish(self, data, extra):
        live = data.draw(st.sampled_from([live for live in self.live if live.caches is not None]))
        prompt = live.request.prompt
        covered = len(live.caches.tokens)
        tokens = (prompt if covered <= len(prompt) else live.caches.tokens) + extra
        caches = self.service.interpreter.prefill(live.caches, tokens[covered:])
        live.caches = caches
        if not live.request.reuses_prefix:
            before = self.service.state
            try:
                self.service.publish(live.request, live.namespace, tokens, caches)
            except RequestKeepsNoState:
                assert self.service.state == before
                return
            raise AssertionError("publish of a request that keeps nothing must fail")
        self.check_publish(live, tokens, self.service.publish(live.request, live.namespace, tokens, caches))

    @precondition(lambda self: self.live)
    @rule(data=st.data(), completed=st.booleans())
    def release(self, data, completed):
        live = data.draw(st.sampled_from(self.live))
        self.live.remove(live)
        self.service.release(live.request, completed)

    @rule(limit=st.integers(0, RAM))
    def boundary_under_pressure(self, limit):
        self.pressure_limit = limit
        self.service.boundary()
        self.after_pressure(limit)
        self.pressure_limit = None

    @rule(session=st.sampled_from(["s1", "s2"]))
    def close_session(self, session):
        self.service.close_session(session)
        self.sessions.pop(session, None)

    @invariant()
    def admitted_bytes_within_budget(self):
        report = self.service.report()
        assert report.projected_bytes == sum(live.admitted_bytes for live in self.live)
        assert report.projected_bytes <= BUDGET

    @invariant()
    def ram_within_capacity_and_content_is_what_was_published(self):
        state = self.service.state
        in_ram = [e for e in state.entries.values() if e.residence in IN_RAM]
        assert sum(e.nbytes for e in in_ram) <= RAM
        assert state.ram.bytes <= RAM
        for entry in in_ram:
            content = self.service.interpreter.ram_content(entry.id)
            if entry.namespace == OBJECTS:
                assert content.payload == bytes(entry.tokens).decode()
            else:
                assert content.tokens == entry.tokens

    @invariant()
    def totals_are_the_sums_of_the_entries(self):
        """Every running total the core keeps equals what its entries and indexes add up to."""
        state = self.service.state
        entries = state.entries.values()
        # RAM charges its entries and the reads into it in flight (a chain's blocks read ahead).
        assert state.ram.bytes == sum(e.nbytes for e in entries if e.residence in IN_RAM
                                      or e.residence is Residence.PREFETCHING)
        spilling = [e for e in entries if e.residence is Residence.SPILLING]
        # the disk tier charges file bytes; a write in flight has its file's bytes reserved from the start
        assert state.disk.bytes == (sum(e.file_bytes for e in entries
                                        if e.residence in ON_DISK or e.residence is Residence.SPILLING)
                                    + sum(r.file_bytes + r.pending_file_bytes for r in state.checkpoints.values()))
        assert state.writes.count == len(spilling) + sum(r.pending for r in state.checkpoints.values())
        assert state.writes.bytes == (sum(e.nbytes for e in spilling)
                                             + sum(r.pending_bytes for r in state.checkpoints.values()))
        assert state.writes.count == getattr(self.service.interpreter, "pending_writes", 0)
        # The index lists whole prefixes and snapshots, and the blocks that serve alone where no block of
        # that tier extends them (the ends of its chains), recounted here from the entries.
        def extended_in(entry, tier):
            return any(c.parent == entry.id and c.residence in tier for c in entries)
        assert sorted((ns, t, i) for ns, t, i, _ in state.ram.index.items()) == sorted(
            (e.namespace, e.tokens, e.id) for e in entries if e.residence in IN_RAM and e.indexed
            and not (e.is_block and extended_in(e, IN_RAM)))
        if state.config.has_disk:
            assert sorted((ns, t, i) for ns, t, i, _ in state.disk.index.items()) == sorted(
                (e.namespace, e.tokens, e.id) for e in entries if e.residence in ON_DISK and e.indexed
                and not (e.is_block and extended_in(e, ON_DISK)))
        assert dict(state.blocks) == {(e.namespace, e.block): e.id for e in entries if e.is_block}
        for entry_id in state.reading:
            assert state.entries[entry_id].residence in ON_DISK  # a read in flight pins a saved entry

    def teardown(self):
        if not hasattr(self, "service"):
            return
        for live in list(self.live):
            self.service.release(live.request, True)
        assert self.service.report().projected_bytes == 0
        first = self.service.close()
        assert self.service.close() == first
        report = self.service.report()
        assert (report.entries, report.projected_bytes, report.live_requests) == (0, 0, 0)


class ExactServiceMachine(BaseMachine):
    """RAM only, FIFO: the reference predicts every held prefix and every reuse exactly."""

    def __init__(self) -> None:
        super().__init__()
        self.reference = NaiveFifoPrefixCache(RAM)
        self.sessions: dict[str, tuple] = {}
        self.session_hits = self.session_misses = 0
        self.object_hits = self.object_misses = 0
        self.hits = self.misses = self.tokens_saved = 0

    @initialize(hybrid=st.booleans())
    def build(self, hybrid):
        self.spec = HYBRID if hybrid else TRIMMABLE
        self.service = self.make_service(policy="fifo")

    def check_acquire(self, live, state):
        request = live.request
        prompt = request.prompt
        expected = longest_usable(self.reference.held(), live.namespace, prompt) if request.reuses_prefix else 0
        assert state.reused_tokens == expected
        assert state.caches.tokens == prompt[:expected]
        if request.reuses_prefix:
            self.hits += expected > 0
            self.misses += expected == 0
            self.tokens_saved += expected
        session = request.session_id
        if request.reuses_prefix and session in self.sessions:
            key = self.sessions[session]
            own = (key in self.reference.items and key[0] == live.namespace and expected > 0
                   and usable(key[1], self.reference.items[key][1], prompt) == expected)
            self.session_hits += own
            self.session_misses += not own
        live.caches = state.caches

    def check_lookup(self, namespace, prompt, reused):
        expected = longest_usable(self.reference.held(), namespace, prompt)
        assert reused == expected
        self.hits += expected > 0
        self.misses += expected == 0
        self.tokens_saved += expected

    def check_publish(self, live, tokens, kept):
        size = reference_bytes(self.spec, len(tokens))
        key = (live.namespace, tokens)
        assert kept == self.reference.put(key, size, self.spec is TRIMMABLE)
        if kept and live.request.session_id is not None:
            self.sessions[live.request.session_id] = key

    def after_pressure(self, limit):
        while self.reference.items and self.reference.held_bytes > limit:
            self.reference.drop_oldest()

    @rule(key=st.sampled_from(["img-a", "img-b", "img-c"]), nbytes=st.integers(1, RAM + 64))
    def put_object(self, key, nbytes):
        kept = self.service.objects.put(key, SimObject(key, nbytes))
        assert kept == self.reference.put((OBJECTS, tuple(key.encode())), nbytes, False)

    @rule(key=st.sampled_from(["img-a", "img-b", "img-c"]))
    def get_object(self, key):
        hit = self.service.objects.get(key)
        held = (OBJECTS, tuple(key.encode())) in self.reference.items
        assert (hit is not None) == held
        if hit is not None:
            assert hit.value.payload == key
        self.object_hits += held
        self.object_misses += not held

    @invariant()
    def held_prefixes_are_the_references(self):
        state = self.service.state
        held = {(ns, tokens) for ns, tokens, _, _ in state.ram.index.items()}
        assert held == set(self.reference.items)
        report = self.service.report()
        assert report.bytes == self.reference.held_bytes
        assert (report.session_hits, report.session_misses) == (self.session_hits, self.session_misses)
        assert (report.object_hits, report.object_misses) == (self.object_hits, self.object_misses)
        assert (report.hits, report.misses, report.prefill_tokens_saved) == (self.hits, self.misses,
                                                                             self.tokens_saved)
        counted = {name: getattr(report, name) for name in self.reference.counts}
        assert counted == self.reference.counts
        assert report.entries == len(self.reference.items)
        disk_only = ("spills", "restores", "prefetches", "disk_evictions", "rejected_files", "dropped_writes",
                     "failed_writes", "checkpoints_written", "resumes", "object_restores", "saved_entries",
                     "saved_bytes", "pending_writes", "pending_write_bytes", "checkpoints")
        assert {name: getattr(report, name) for name in disk_only} == dict.fromkeys(disk_only, 0)


class TieredServiceMachine(BaseMachine):
    """RAM over a disk tier, writes completing later, faults injected, every policy."""

    def __init__(self) -> None:
        super().__init__()
        self.published: set[tuple] = set()
        self.disk = SimDisk()
        self.faults = FaultPlan()
        self.sessions: dict = {}
        #: ``(namespace, prompt, tokens pinned, until)`` of every pin made (until on the simulator's clock).
        self.pins: list[tuple[str, tuple, int, float]] = []

    @initialize(policy=st.sampled_from(sorted(POLICIES)), hybrid=st.booleans(),
                header=st.sampled_from([0, 64, 700]), per_token=st.sampled_from([0, 8]),
                idle_rule=st.sampled_from(["demote", "write", "both"]))
    def build(self, policy, hybrid, header, per_token, idle_rule):
        self.spec = HYBRID if hybrid else TRIMMABLE
        self.policy = policy
        self.idle_rule = idle_rule
        self.files = FileModel(header, per_token)  # files larger than their state, as real headers make them
        self.service = self.restarted()

    def restarted(self):
        return self.make_service(
            policy=self.policy, disk_bytes=DISK, write_queue_bytes=RAM // 2,
            **({"demote_idle_after": IDLE} if self.idle_rule != "write" else {}),
            **({"write_idle_after": IDLE} if self.idle_rule != "demote" else {}),
            interpreter_options={"disk": self.disk, "faults": self.faults, "deferred_writes": True,
                                 "deferred_reads": True, "files": self.files})

    def own_tokens(self, entry):
        """What an entry's content is: the tokens it covers (a block's own, in the blocked machine)."""
        return entry.tokens

    def saved_key(self, entry):
        """The name of an entry's file on the simulated disk."""
        return DiskKey(entry.namespace, entry.tokens)

    def rotten_key(self, key):
        """The ``(namespace, tokens)`` a rejected file held."""
        return key.namespace, key.tokens

    def lost_with(self, key, rotten):
        """Whether kept state ``key`` is lost with the ``rotten`` files: only its own."""
        return key in rotten

    def held_listing(self, disk=True):
        state = self.service.state
        return ([(ns, t, trim) for ns, t, _, trim in state.ram.index.items()]
                + ([(ns, t, trim) for ns, t, _, trim in state.disk.index.items()] if disk else []))

    def before_acquire(self):
        self.read_errors_before = self.service.state.counters.read_errors

    def check_acquire(self, live, state):
        prompt = live.request.prompt
        reused = state.reused_tokens
        assert state.caches.tokens == prompt[:reused]
        if not live.request.reuses_prefix:
            assert reused == 0
        else:
            # A read that hit an I/O error leaves the file on disk; the request falls back to RAM.
            failed_read = self.service.state.counters.read_errors > self.read_errors_before
            assert reused == longest_usable(self.held_listing(disk=not failed_read), live.namespace, prompt)
            published = [(ns, t, True) for ns, t in self.published]
            assert reused <= longest_usable(published, live.namespace, prompt)
        live.caches = state.caches

    def check_lookup(self, namespace, prompt, reused):
        failed_read = self.service.state.counters.read_errors > self.read_errors_before
        assert reused == longest_usable(self.held_listing(disk=not failed_read), namespace, prompt)
        assert reused <= longest_usable([(ns, t, True) for ns, t in self.published], namespace, prompt)

    def check_publish(self, live, tokens, kept):
        if kept:
            self.published.add((live.namespace, tokens))

    def after_pressure(self, limit):
        pass

    def live_pins(self):
        """``(namespace, prompt, tokens)`` of the pins that have not run out."""
        now = self.service.interpreter.now
        return [(ns, prompt, length) for ns, prompt, length, until in self.pins if until > now]

    def serves_a_pin(self, entry):
        """Whether ``entry`` lies on the path of a live pin's prefix (so it may be held by it)."""
        for ns, prompt, length in self.live_pins():
            shared = min(len(entry.tokens), length)
            if entry.namespace == ns and entry.start <= length and entry.tokens[:shared] == prompt[:shared]:
                return True
        return False

    @precondition(lambda self: self.published)
    @rule(data=st.data(), cut=st.integers(0, 12), seconds=st.one_of(st.none(), st.floats(1.0, 3 * IDLE)))
    def pin_a_published_prefix(self, data, cut, seconds):
        namespace, tokens = data.draw(st.sampled_from(sorted(self.published)))
        self.pin_a_prefix(tokens[:max(1, len(tokens) - cut)], namespace, seconds)

    @rule(prompt=BaseMachine.prompts, namespace=st.sampled_from(["x", "y"]),
          seconds=st.one_of(st.none(), st.floats(1.0, 3 * IDLE)))
    def pin_a_prefix(self, prompt, namespace, seconds):
        self.service.tick()
        held = longest_usable(self.held_listing(disk=False), namespace, prompt + (SENTINEL,))
        before = self.service.state
        try:
            pinned = self.service.pin(prompt, namespace, seconds)
        except PinOverBudget:
            after = self.service.state
            assert after.pinned_until == before.pinned_until and after.entries == before.entries
            return
        assert pinned.tokens == held  # RAM's longest prefix of it, every token of it where RAM holds that
        if pinned.tokens:
            until = float("inf") if seconds is None else self.service.interpreter.now + seconds
            self.pins.append((namespace, prompt, pinned.tokens, until))

    @invariant()
    def a_pinned_prefix_stays_in_ram_and_pins_hold_at_most_their_share(self):
        for namespace, prompt, length in self.live_pins():
            assert self.service.peek_prefix_len(prompt + (SENTINEL,), namespace) >= length
        assert self.service.report().pinned_bytes <= self.service.config.pin_share * RAM

    @rule()
    def reads_ahead_complete(self):
        self.service.complete(self.service.interpreter.complete_reads())

    @invariant()
    def the_interpreter_holds_in_ram_exactly_the_entries_ram_holds(self):
        state = self.service.state
        assert self.service.interpreter.ram_entries() == {
            e.id for e in state.entries.values() if e.residence in IN_RAM}
        assert not self.service.interpreter.ahead_entries()  # what was read ahead is settled, one way or the other

    @rule(count=st.integers(1, 4))
    def writes_complete(self, count):
        self.service.complete(self.service.interpreter.poll(count))

    @rule()
    def next_read_hits_an_io_error(self):
        self.faults.fail_reads.add(self.service.interpreter.stats.reads + 1)

    @rule()
    def next_write_fails(self):
        sim = self.service.interpreter
        self.faults.fail_writes.add(sim.stats.writes + sim.pending_writes + 1)

    @precondition(lambda self: self.disk.files)
    @rule(data=st.data())
    def a_saved_file_rots(self, data):
        key = data.draw(st.sampled_from(sorted(self.disk.files, key=lambda k: (k.namespace, k.tokens))))
        self.disk.corrupt(key)

    @invariant()
    def every_entry_a_clock_rule_may_act_on_is_in_the_idle_order(self):
        state = self.service.state
        ordered = {entry.id for entry in state.idle.idle(lambda: state.entries, float("inf"))}
        for entry in state.entries.values():
            demotable = self.idle_rule != "write" and entry.residence in IN_RAM
            writable = (self.idle_rule != "demote" and entry.residence is Residence.RAM
                        and entry.nbytes <= state.config.write_queue_bytes)
            assert not (demotable or writable) or entry.id in ordered

    @rule(seconds=st.floats(0.5, 10.0))
    def time_passes(self, seconds):
        sim = self.service.interpreter
        sim.now += seconds
        self.service.boundary()
        # The clock's rule, checked by a scan of every entry: none idle past it is left undone.
        state = self.service.state
        for entry in state.entries.values():
            if entry.last_used > state.now - IDLE or self.serves_a_pin(entry):  # pinned: no rule takes it
                continue
            if entry.ram_children:  # a block goes after the blocks RAM holds that extend it (leaf first)
                continue
            if self.idle_rule != "write":  # given back: off RAM, or leaving it once its write lands
                assert entry.residence not in (Residence.RAM, Residence.BOTH)
                assert entry.residence is not Residence.SPILLING or entry.demote
            elif entry.residence is Residence.RAM:  # written, unless the write queue has no room for it
                # (and for the unwritten blocks it extends: a block is written after its parent), or the
                # disk has none that evicting everything saved could make (the rest being written)
                saved = [e for e in state.entries.values() if e.residence in (Residence.BOTH, Residence.DISK)]
                unwritten, at = [], entry
                while at is not None and at.residence is Residence.RAM:
                    unwritten.append(at)
                    at = state.entries.get(at.parent) if at.parent is not None else None
                assert (any(state.writes.bytes + e.nbytes > state.config.write_queue_bytes for e in unwritten)
                        or state.disk.bytes - sum(e.file_bytes for e in saved)
                        + sum(e.file_bytes for e in unwritten) > DISK)

    @rule(prompt=BaseMachine.prompts, namespace=st.sampled_from(["x", "y"]))
    def prefetch(self, prompt, namespace):
        self.service.prefetch(prompt, namespace)

    @precondition(lambda self: self.published)
    @rule(data=st.data())
    def prefetch_a_published_prompt(self, data):
        namespace, tokens = data.draw(st.sampled_from(sorted(self.published)))
        self.service.prefetch(tokens + (SENTINEL,), namespace)

    @rule()
    def flush_then_crash_and_restart(self):
        result = self.service.flush()
        state = self.service.state
        if not result.durable:
            return
        kept = {(e.namespace, e.tokens): e for e in state.entries.values()}
        for entry in kept.values():
            if entry.residence in IN_RAM:
                assert self.disk.files[self.saved_key(entry)].content == self.own_tokens(entry)
        # The process dies here: a fresh service finds every kept prefix on disk (invariant 5).
        self.service = self.restarted()
        self.pins.clear()  # pins are the running service's
        found = {(e.namespace, e.tokens) for e in self.service.state.entries.values()}
        rotten = {self.rotten_key(k) for k, _ in self.disk.rejected}
        assert {key for key in kept if not self.lost_with(key, rotten)} <= found
        self.live.clear()

    @invariant()
    def pinned_state_is_never_dropped(self):
        state = self.service.state
        sim = self.service.interpreter
        for entry in state.entries.values():
            if entry.residence is Residence.SPILLING:
                assert sim.ram_content(entry.id).tokens == self.own_tokens(entry)
        for effect, _ in sim._pending:
            if hasattr(effect, "entry"):
                assert state.entries[effect.entry].residence is Residence.SPILLING

    @invariant()
    def disk_within_capacity_and_holds_only_what_was_published(self):
        state = self.service.state
        assert self.disk.used_bytes() <= state.disk.bytes <= DISK  # what the disk holds, as it counts it
        for file in self.disk.files.values():
            assert file.file_bytes == self.files.file_bytes(file.nbytes, len(file.tokens))
            assert (file.namespace, file.tokens) in self.published
            assert file.content == file.tokens


def test_exact_machine():
    run_state_machine_as_test(ExactServiceMachine, settings=CHECK_SETTINGS)


def test_tiered_machine():
    run_state_machine_as_test(TieredServiceMachine, settings=CHECK_SETTINGS)


BLOCK = 4  # tokens a block holds in the blocked machine: prompts of up to 56 tokens make chains of up to 14


class RouterView:
    """What a router knows of one server from its block events alone: each tier's blocks by
    ``(namespace, key)``. A block is stored once per tier and removed only once stored."""

    def __init__(self) -> None:
        self.held: dict[str, dict] = {"ram": {}, "disk": {}, "remote": {}}

    def told(self, event) -> None:
        tier = self.held[event.medium]
        if isinstance(event, BlockStored):
            key = (event.name.namespace, event.name.key)
            assert key not in tier, f"{event.medium} told twice of one block"
            name = event.name
            assert len(name.tokens) == BLOCK and name.start % BLOCK == 0
            assert (name.start == 0) == (name.parent == namespace_key(name.namespace))
            assert name.key == block_key(name.parent, packed(name.tokens))  # a chain hash: its parent's key, its tokens
            tier[key] = name
        else:
            assert isinstance(event, BlockRemoved)
            assert tier.pop((event.namespace, event.key), None) is not None, f"{event.medium} removed a block never stored"


def saved_key(entry):
    """The name an entry's saved copy has on the simulated disk (a block's, or a whole prefix's)."""
    if entry.is_block:
        return block_names(entry.namespace, entry.tokens, BLOCK)[-1]
    if entry.is_snapshot:  # named after the block its chain ends in: the one ending where it does
        return SnapshotName(entry.namespace, entry.tokens, block_names(entry.namespace, entry.tokens, BLOCK)[-1].key)
    return DiskKey(entry.namespace, entry.tokens)


class BlockedServiceMachine(TieredServiceMachine):
    """The tiered machine with published KV kept in blocks of 4 tokens: reuse, content, bytes and
    faults checked as there, and the block tree against a naive recount after every step."""

    @initialize(policy=st.sampled_from(sorted(POLICIES)), hybrid=st.booleans(),
                header=st.sampled_from([0, 64, 700]), per_token=st.sampled_from([0, 8]),
                idle_rule=st.sampled_from(["demote", "write", "both"]), partial=st.booleans())
    def build(self, policy, hybrid, header, per_token, idle_rule, partial):
        self.partial = partial
        super().build(policy, hybrid, header, per_token, idle_rule)

    def restarted(self):
        service = self.make_service(
            policy=self.policy, disk_bytes=DISK, write_queue_bytes=RAM // 2, block_tokens=BLOCK,
            partial_blocks=self.partial, block_events=True,
            **({"demote_idle_after": IDLE} if self.idle_rule != "write" else {}),
            **({"write_idle_after": IDLE} if self.idle_rule != "demote" else {}),
            interpreter_options={"disk": self.disk, "faults": self.faults, "deferred_writes": True,
                                 "deferred_reads": True, "files": self.files})
        self.router = RouterView()  # a router that starts watching this process: told what is held, then changes
        service.on_block_events(self.router.told)
        return service

    @invariant()
    def a_router_told_by_block_events_sees_what_each_tier_holds(self):
        """What the block events told adds up to the full blocks the interpreter holds: in RAM, the
        entries whose state it holds; on disk, the block files the simulated disk holds. Each block
        told with its own tokens and its parent's key, as its name says."""
        state = self.service.state
        in_ram = {(e.namespace, e.block): e for e in (state.entries[i] for i in self.service.interpreter.ram_entries())
                  if e.is_block and e.length - e.start == BLOCK}
        assert self.router.held["ram"].keys() == in_ram.keys()
        for key, entry in in_ram.items():
            assert self.router.held["ram"][key].tokens == self.service.interpreter.ram_content(entry.id).tokens
        on_disk = {(name.namespace, name.key): name for name in self.disk.files
                   if isinstance(name, BlockName) and len(name.tokens) == BLOCK}
        assert self.router.held["disk"] == on_disk

    @invariant()
    def every_held_block_is_named_by_its_tokens_chain_hash(self):
        """In either tier, a block's key is the chain hash of the tokens from its namespace's start to
        its end, computed here afresh: a publish that reads held blocks' keys instead of hashing
        again never gives a block a key of tokens it does not hold."""
        for entry in self.service.state.entries.values():
            if entry.is_block:
                assert entry.block == block_names(entry.namespace, entry.tokens, BLOCK)[-1].key

    def own_tokens(self, entry):
        """What a block's content is (its own tokens), or a snapshot's (every token it is the state after)."""
        return entry.tokens if entry.is_snapshot else entry.tokens[entry.start:]

    @invariant()
    def ram_within_capacity_and_content_is_what_was_published(self):
        state = self.service.state
        in_ram = [e for e in state.entries.values() if e.residence in IN_RAM]
        reading = [e for e in state.entries.values() if e.residence is Residence.PREFETCHING]
        assert state.ram.bytes == sum(e.nbytes for e in in_ram + reading) <= RAM
        for entry in in_ram:
            content = self.service.interpreter.ram_content(entry.id)
            assert content.tokens == self.own_tokens(entry)
            if entry.is_block:  # a block charges its own positions' bytes, by the test's own formula
                assert entry.nbytes == (reference_bytes(self.spec, entry.length)
                                        - reference_bytes(self.spec, entry.start))
            if entry.is_snapshot:  # a snapshot, the recurrent state alone
                assert entry.nbytes == RECURRENT_STATE

    @invariant()
    def blocks_form_a_tree_kept_leaf_first(self):
        """Every block's parent is held and ends where it starts, a snapshot's where the snapshot is;
        the counts of what extends an entry are a recount's; RAM holds nothing without its parent (a hit
        assembles from RAM alone). The hybrid model's blocks serve nothing alone: only its snapshots
        are in the index."""
        state = self.service.state
        entries = state.entries
        listed = {entry_id for _, _, entry_id, _ in state.ram.index.items()} | {
            entry_id for _, _, entry_id, _ in state.disk.index.items()}
        for entry in entries.values():
            assert entry.chained and entry.trimmable == (self.spec is TRIMMABLE and entry.is_block)
            if entry.is_block and self.spec is not TRIMMABLE:
                assert entry.id not in listed  # it serves only under a snapshot
            if entry.is_snapshot:
                parent = entries[entry.parent]
                assert parent.is_block and parent.length == entry.length and entry.children == 0
                assert parent.tokens == entry.tokens
                continue
            children = [c for c in entries.values() if c.parent == entry.id]
            assert entry.children == len(children)
            assert entry.ram_children == sum(c.residence in IN_RAM for c in children)
            assert entry.disk_children == sum(c.residence in ON_DISK for c in children)
            if entry.trimmable and not self.partial:  # without partial blocks, every plain KV block is full
                assert entry.length - entry.start == BLOCK
            if entry.parent is None:
                assert entry.start == 0
                continue
            parent = entries[entry.parent]
            assert parent.length == entry.start and entry.tokens[:entry.start] == parent.tokens
            if entry.residence in IN_RAM:
                assert parent.residence in IN_RAM

    @invariant()
    def rams_policy_sets_aside_exactly_the_blocks_a_ram_block_extends(self):
        """Where RAM's policy sets aside what leaf-first eviction cannot take (GDSF), the tier has told it
        of exactly the RAM blocks another RAM block extends: none missing (it would read past them), none
        extra (it would never evict them)."""
        state = self.service.state
        parked = getattr(state.ram.policy, "parked", None)
        if parked is None:
            return
        extended = {e.id for e in state.entries.values() if e.residence in IN_RAM and e.ram_children}
        assert set(parked.keys()) == extended

    @invariant()
    def ram_holds_each_tokens_state_once(self):
        """No two RAM blocks hold the state of one position of one path: blocks from one parent never
        have one's tokens begin the other's (a partial block a longer one covers is let go; one whose write
        is in flight is pinned by it, and goes once that lands). Plain KV only: a hybrid model's snapshot
        needs the partial block that ends where it does, so two snapshots inside one block each hold
        their own (a cost the snapshots' admission is to weigh). A pinned partial block stays until its
        pin runs out."""
        state = self.service.state
        settled = [e for e in state.entries.values() if e.is_block and e.trimmable and not self.serves_a_pin(e) and (
            e.residence in (Residence.RAM, Residence.BOTH) or e.residence is Residence.SPILLING and not e.demote)]
        for a in settled:
            for b in settled:
                if a.id != b.id and a.parent == b.parent and a.namespace == b.namespace:
                    own_a, own_b = self.own_tokens(a), self.own_tokens(b)
                    assert own_b[:len(own_a)] != own_a, (a, b)

    def saved_key(self, entry):
        return saved_key(entry)

    def rotten_key(self, key):
        return saved_key_of(key)

    def lost_with(self, key, rotten):
        """A rotten block takes every block after it along: those serve nothing without it."""
        return any(key[0] == ns and key[1][:len(t)] == t for ns, t in rotten)

    @invariant()
    def disk_within_capacity_and_holds_only_what_was_published(self):
        state = self.service.state
        assert self.disk.used_bytes() <= state.disk.bytes <= DISK
        published_blocks = {name for ns, tokens in self.published for name in block_names(ns, tokens, BLOCK)}
        for key, file in self.disk.files.items():
            assert file.file_bytes == self.files.file_bytes(file.nbytes, len(file.tokens))
            assert file.content == file.tokens
            if isinstance(key, (DiskKey, SnapshotName)):
                assert (file.namespace, file.tokens) in self.published
            else:  # a block of a published prefix, its tokens what its name says
                assert key in published_blocks and file.tokens == key.tokens


class RamBlockedServiceMachine(BaseMachine):
    """RAM alone with state in blocks of 4 tokens, as ``kvstate serve`` keeps it by default (no disk
    tier, no idle rule, so no block is ever named by a write or an event): every reuse the longest
    prefix RAM's chains serve, and the block tree, content, bytes and names checked as in the blocked
    machine, under every policy."""

    def __init__(self) -> None:
        super().__init__()
        self.published: set[tuple] = set()
        self.sessions: dict = {}
        self.pins: list[tuple[str, tuple, int, float]] = []  # none are made: nothing is held for a pin

    @initialize(policy=st.sampled_from(sorted(POLICIES)), hybrid=st.booleans(), partial=st.booleans())
    def build(self, policy, hybrid, partial):
        self.spec = HYBRID if hybrid else TRIMMABLE
        self.partial = partial
        self.service = self.make_service(policy=policy, block_tokens=BLOCK, partial_blocks=partial)

    def ram_listing(self):
        return [(ns, t, trim) for ns, t, _, trim in self.service.state.ram.index.items()]

    def check_acquire(self, live, state):
        reused = state.reused_tokens
        assert state.caches.tokens == live.request.prompt[:reused]
        assert reused == (self.expected_reuse(live.namespace, live.request.prompt) if live.request.reuses_prefix
                          else 0)
        live.caches = state.caches

    def check_lookup(self, namespace, prompt, reused):
        assert reused == self.expected_reuse(namespace, prompt)

    def expected_reuse(self, namespace, prompt):
        """The longest prefix of ``prompt`` RAM's index serves, and never more than was published."""
        reused = longest_usable(self.ram_listing(), namespace, prompt)
        assert reused <= longest_usable([(ns, t, True) for ns, t in self.published], namespace, prompt)
        return reused

    def check_publish(self, live, tokens, kept):
        if kept:
            self.published.add((live.namespace, tokens))

    def after_pressure(self, limit):
        pass

    own_tokens = BlockedServiceMachine.own_tokens
    live_pins = TieredServiceMachine.live_pins
    serves_a_pin = TieredServiceMachine.serves_a_pin
    ram_within_capacity_and_content_is_what_was_published = (
        BlockedServiceMachine.ram_within_capacity_and_content_is_what_was_published)
    blocks_form_a_tree_kept_leaf_first = BlockedServiceMachine.blocks_form_a_tree_kept_leaf_first
    every_held_block_is_named_by_its_tokens_chain_hash = (
        BlockedServiceMachine.every_held_block_is_named_by_its_tokens_chain_hash)
    rams_policy_sets_aside_exactly_the_blocks_a_ram_block_extends = (
        BlockedServiceMachine.rams_policy_sets_aside_exactly_the_blocks_a_ram_block_extends)
    ram_holds_each_tokens_state_once = BlockedServiceMachine.ram_holds_each_tokens_state_once


def saved_key_of(key):
    """The ``(namespace, path)`` a rejected file held: a whole prefix's tokens, or a block's path up to
    its start (every prefix through it is lost with it)."""
    if isinstance(key, (DiskKey, SnapshotName)):
        return key.namespace, key.tokens
    return key.namespace, ()


def test_blocked_machine():
    run_state_machine_as_test(BlockedServiceMachine, settings=CHECK_SETTINGS)


def test_ram_blocked_machine():
    run_state_machine_as_test(RamBlockedServiceMachine, settings=CHECK_SETTINGS)
