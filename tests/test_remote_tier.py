"""The shared tier, model-checked on the simulator: two servers, each with its own disk, share one
object store. Conversations move between them at random; the store goes down and comes back; its
objects rot. Checked after every step against a naive reference (the prompts each server was given,
and the blocks any server wrote): every reuse is of what was published; a block is on the store only
once a server wrote it to disk, exactly as written; what a server fetched and keeps is what the store
held, never a rotten object; a fetch that lands leaves nothing in flight; the disk's charge is its
files'."""

from __future__ import annotations

import attrs
import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule, run_state_machine_as_test

from kvstate import KvCacheService
from kvstate.core.request import Request
from kvstate.core.replies import Source
from kvstate.effects.effects import BlockName
from kvstate.interpreters.simulator import SimDisk, SimRemote
from tests.test_model_check import RouterView

BLOCK = 4
NAMESPACE = "n"
#: A few conversations: each a system prompt and turns, so prompts share prefixes across servers.
BASES = [tuple(range(10, 22)), tuple(range(10, 18)) + (90, 91, 92, 93), tuple(range(50, 59))]


class FleetMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.remote = SimRemote()
        self.disks = [SimDisk(), SimDisk()]
        self.published: set[tuple[int, ...]] = set()   # every prompt any server kept
        self.written: dict[BlockName, tuple[int, ...]] = {}  # every full block a server wrote to disk
        self.servers: list[KvCacheService] = []
        self.routers: list[RouterView | None] = [None, None]

    def server(self, at: int) -> KvCacheService:
        service = KvCacheService.simulated("llama-3.1-8b", ram_bytes=64 * 131072, disk_bytes=96 * 131072,
                                           block_tokens=BLOCK, block_events=True,
                                           interpreter_options={"remote": self.remote, "disk": self.disks[at]})
        self.routers[at] = RouterView()  # what a router learns of this server from its block events
        service.on_block_events(self.routers[at].told)
        return service

    @initialize()
    def start(self):
        self.servers = [self.server(0), self.server(1)]

    def teardown(self):
        for service in self.servers:
            service.close()

    @rule(at=st.integers(0, 1), base=st.integers(0, len(BASES) - 1), tail=st.lists(st.integers(0, 3), max_size=9),
          fetch=st.booleans())
    def a_turn_served_on_one_server(self, at, base, tail, fetch):
        service = self.servers[at]
        prompt = BASES[base] + tuple(tail)
        if fetch:
            if service.remote_lookup(prompt, NAMESPACE):
                service.collect()  # the simulator's fetch has landed by now
                assert not service.reading_ahead(prompt, NAMESPACE)
        request = Request(prompt, 4)
        service.admit(request, NAMESPACE)
        state = service.acquire(request, NAMESPACE)
        reused = state.reused_tokens
        assert state.caches.tokens == prompt[:reused]  # reuse is of what was published, never more
        assert reused == 0 or any(p[:reused] == prompt[:reused] for p in self.published)
        caches = service.interpreter.prefill(state.caches, prompt[reused:])
        service.publish(request, NAMESPACE, prompt, caches)
        service.release(request)
        self.published.add(prompt)

    @rule(at=st.integers(0, 1))
    def writes_land(self, at):
        disk = self.disks[at]
        self.servers[at].flush()
        for name, file in disk.files.items():
            if isinstance(name, BlockName):
                self.written.setdefault(name, file.content)

    @rule(down=st.booleans())
    def the_store_goes_down_or_comes_back(self, down):
        self.remote.down = down

    @precondition(lambda self: self.remote.objects)
    @rule(data=st.data())
    def an_object_rots(self, data):
        key = data.draw(st.sampled_from(sorted(self.remote.objects, key=lambda k: (k[1].start, k[1].key))))
        self.remote.corrupt(*key)

    @rule(at=st.integers(0, 1))
    def a_server_restarts(self, at):
        self.servers[at].close()
        self.servers[at] = self.server(at)

    @invariant()
    def the_store_holds_blocks_as_a_server_wrote_them(self):
        for (_, name), stored in self.remote.objects.items():
            assert 0 < len(name.tokens) <= BLOCK and name.start % BLOCK == 0  # a block, or a partial last one
            if not stored.corrupt:
                assert stored.content == self.written.get(name, stored.content)
                assert stored.content == name.tokens  # a block's content: its own tokens

    @invariant()
    def what_a_server_keeps_from_the_store_is_sound_and_nothing_is_in_flight(self):
        for at, service in enumerate(self.servers):
            state = service.state
            assert not state.remote_reading
            for name, file in self.disks[at].files.items():
                assert not file.corrupt, "a rotten object was kept"
                if isinstance(name, BlockName):
                    assert file.content == name.tokens
            assert state.disk.bytes == sum(f.file_bytes for f in self.disks[at].files.values()) + sum(
                c.file_bytes for c in self.disks[at].checkpoints.values())

    @invariant()
    def a_router_sees_each_servers_tiers_and_only_blocks_the_store_holds(self):
        for at, service in enumerate(self.servers):
            router, state = self.routers[at], service.state
            in_ram = {(e.namespace, e.block) for e in (state.entries[i] for i in service.interpreter.ram_entries())
                      if e.is_block and e.length - e.start == BLOCK}
            assert router.held["ram"].keys() == in_ram
            assert router.held["disk"] == {(n.namespace, n.key): n for n in self.disks[at].files
                                           if isinstance(n, BlockName) and len(n.tokens) == BLOCK}
            stored = {(name.namespace, name.key): name for _, name in self.remote.objects}
            assert all(stored.get(key) == name for key, name in router.held["remote"].items())

    @invariant()
    def counts_add_up(self):
        reports = [service.report() for service in self.servers]
        for report in reports:
            assert report.remote_blocks_read <= report.remote_fetches * 32


def test_fleet_machine():
    run_state_machine_as_test(FleetMachine, settings=settings(
        max_examples=150, stateful_step_count=40, deadline=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))


def fleet(remote=None):
    remote = remote or SimRemote()
    return remote, [KvCacheService.simulated("llama-3.1-8b", ram_bytes=1 << 30, disk_bytes=8 << 30, block_tokens=BLOCK,
                                             interpreter_options={"remote": remote, "disk": SimDisk()})
                    for _ in range(2)]


def turn(service, prompt):
    request = Request(prompt, 4)
    service.admit(request, NAMESPACE)
    state = service.acquire(request, NAMESPACE)
    service.publish(request, NAMESPACE, prompt, service.interpreter.prefill(state.caches, prompt[state.reused_tokens:]))
    service.release(request)
    return state


def test_a_conversation_moved_to_another_server_continues_from_the_store():
    remote, (a, b) = fleet()
    prompt = tuple(range(30))
    turn(a, prompt)
    a.flush()
    # Its 7 full blocks and its partial last one (2 tokens), each written once.
    assert a.report().remote_writes == len(remote.objects) == 8
    follow = prompt + (7, 7, 7)
    assert b.remote_lookup(follow, NAMESPACE)
    b.collect()
    state = turn(b, follow)
    # The 7 full blocks, then, where the store lacks the next full block, the partial one a kept: all of it.
    assert state.source is Source.DISK and state.reused_tokens == len(prompt)
    report = b.report()
    assert report.remote_fetches == 1 and report.remote_blocks_read == 8
    b.flush()
    # What it fetched is not offered back: only the blocks its turn added (a full one and a partial one).
    assert b.report().remote_writes == 2


def test_a_partial_block_alone_is_fetched_where_every_full_block_is_held():
    remote, (a, b) = fleet()
    turn(a, tuple(range(8)))
    turn(b, tuple(range(8)))  # b holds the two full blocks; a goes on, b does not
    turn(a, tuple(range(10)))
    a.flush()
    follow = tuple(range(10)) + (5,)
    assert b.remote_lookup(follow, NAMESPACE)
    b.collect()
    assert not b.reading_ahead(follow, NAMESPACE)
    assert turn(b, follow).reused_tokens == 10


def test_the_first_server_writes_a_block_and_the_second_finds_it_there():
    remote, (a, b) = fleet()
    turn(a, tuple(range(8)))
    turn(b, tuple(range(8)))  # the same blocks, computed on both
    a.flush()
    b.flush()
    assert (a.report().remote_writes, b.report().remote_writes) == (2, 0)
    assert b.report().remote_already_held == 2 and len(remote.objects) == 2


def test_a_rotten_object_is_rejected_counted_and_the_request_prefilled():
    remote, (a, b) = fleet()
    turn(a, tuple(range(12)))
    a.flush()
    second = sorted(remote.objects, key=lambda k: k[1].start)[1]
    remote.corrupt(*second)
    assert b.remote_lookup(tuple(range(13)), NAMESPACE)
    b.collect()
    assert b.report().remote_rejected == 1 and second[1] not in b.interpreter.disk.files  # nothing of it kept
    state = turn(b, tuple(range(13)))
    assert state.reused_tokens == BLOCK  # the block before the rotten one, and nothing after it


def test_a_store_that_is_down_changes_no_answer():
    remote, (a, b) = fleet()
    remote.down = True
    turn(a, tuple(range(12)))
    a.flush()  # its offers fail as its writes land, and again at the flush: counted
    assert a.report().remote_failures == 6 and not remote.objects
    assert b.remote_lookup(tuple(range(12)), NAMESPACE)
    b.collect()
    assert b.report().remote_failures == 1 and not b.state.remote_reading
    state = turn(b, tuple(range(12)))
    assert state.reused_tokens == 0 and state.caches.tokens == ()  # served: prefilled from its own tiers


def test_a_fetch_that_would_not_beat_prefill_is_not_made():
    remote, (a, b) = fleet()
    turn(a, tuple(range(12)))
    a.flush()
    b.remote_lookup(tuple(range(4)) + (9,), NAMESPACE)  # one block, to measure the store's pace
    b.collect()
    b.measure_prefill(1_000_000, 1.0)  # a prefill far faster than any fetch
    assert not b.remote_lookup(tuple(range(12)), NAMESPACE)
    assert b.report().remote_passed_up == 1


def test_a_model_whose_layers_cannot_all_be_cut_fetches_nothing():
    from tests.test_model_check import HYBRID
    service = KvCacheService.simulated(HYBRID, ram_bytes=1 << 30, disk_bytes=8 << 30, block_tokens=BLOCK,
                                       interpreter_options={"remote": SimRemote(), "disk": SimDisk()})
    assert not service.remote_lookup(tuple(range(20)), NAMESPACE)  # its blocks serve only under a snapshot
    turn(service, tuple(range(20)))
    service.flush()
    assert service.report().remote_fetches == service.report().remote_writes == 0  # nor are they offered


def test_a_router_hears_which_blocks_each_server_learnt_the_store_holds():
    remote = SimRemote()
    servers = [KvCacheService.simulated("llama-3.1-8b", ram_bytes=1 << 30, disk_bytes=8 << 30, block_tokens=BLOCK,
                                        block_events=True, interpreter_options={"remote": remote, "disk": SimDisk()})
               for _ in range(2)]
    routers = [RouterView(), RouterView()]
    for service, router in zip(servers, routers):
        service.on_block_events(router.told)
    a, b = servers
    prompt = tuple(range(14))
    turn(a, prompt)
    a.flush()
    full = {(name.namespace, name.key) for _, name in remote.objects if len(name.tokens) == BLOCK}
    assert routers[0].held["remote"].keys() == full and len(full) == 3  # written by it
    assert b.remote_lookup(prompt + (1,), NAMESPACE)
    b.collect()
    assert routers[1].held["remote"].keys() == full  # fetched by it
    late = RouterView()
    b.on_block_events(late.told)  # a router that starts watching later is told the same
    assert late.held["remote"].keys() == full


def test_a_flush_or_a_clean_stop_offers_what_the_store_is_not_known_to_hold():
    remote, (a, _) = fleet()
    remote.down = True
    turn(a, tuple(range(12)))  # its offers fail while the store is down
    remote.down = False
    a.flush()
    assert a.report().remote_writes == 3 and len(remote.objects) == 3
    a.flush()  # known to be there now: nothing offered again
    assert a.report().remote_writes == 3 and a.report().remote_already_held == 0
    remote.objects.clear()  # a store that lost them (or a bucket emptied)
    turn(a, tuple(range(12)) + (1, 1, 1, 1))
    a.close()  # a clean stop writes what is kept and not there: the new block (the rest are known there)
    assert len(remote.objects) == 1


def test_without_a_shared_tier_a_lookup_fetches_nothing():
    service = KvCacheService.simulated("llama-3.1-8b", ram_bytes=1 << 30, disk_bytes=8 << 30, block_tokens=BLOCK)
    assert service.remote_lookup(tuple(range(20)), NAMESPACE) is False
    assert service.report().remote_fetches == 0


def test_a_fetch_in_flight_is_not_asked_for_twice_and_lands_at_a_collect():
    remote = SimRemote()
    a = KvCacheService.simulated("llama-3.1-8b", ram_bytes=1 << 30, disk_bytes=8 << 30, block_tokens=BLOCK,
                                 interpreter_options={"remote": remote, "disk": SimDisk()})
    b = KvCacheService.simulated("llama-3.1-8b", ram_bytes=1 << 30, disk_bytes=8 << 30, block_tokens=BLOCK,
                                 interpreter_options={"remote": remote, "disk": SimDisk(), "deferred_reads": True})
    turn(a, tuple(range(12)))
    a.flush()
    prompt = tuple(range(12)) + (3,)
    assert b.remote_lookup(prompt, NAMESPACE) and b.reading_ahead(prompt, NAMESPACE)
    assert b.remote_lookup(prompt, NAMESPACE)  # in flight: not asked for again
    assert b.report().remote_fetches == 1
    b.collect()
    assert not b.reading_ahead(prompt, NAMESPACE) and turn(b, prompt).reused_tokens == 12


def test_a_server_that_holds_a_chains_start_fetches_only_the_blocks_after_it():
    remote, (a, b) = fleet()
    turn(b, tuple(range(8)))  # b holds the first two blocks
    turn(a, tuple(range(16)))
    a.flush()
    prompt = tuple(range(16)) + (9,)
    assert b.remote_lookup(prompt, NAMESPACE)
    b.collect()
    assert b.report().remote_blocks_read == 2  # the third and fourth, under the second
    assert turn(b, prompt).reused_tokens == 16


def test_the_same_prompt_on_another_server_reuses_all_but_its_last_token_from_the_store():
    remote, (a, b) = fleet()
    prompt = tuple(range(14))  # three full blocks and a partial one of 2 tokens, its last token the prompt's
    turn(a, prompt)
    a.flush()
    assert b.remote_lookup(prompt, NAMESPACE)
    b.collect()
    assert b.report().remote_blocks_read == 4 and turn(b, prompt).reused_tokens == len(prompt) - 1


def test_a_server_that_serves_all_it_can_already_asks_the_store_nothing():
    remote, (a, b) = fleet()
    prompt = tuple(range(14))
    turn(a, prompt + (1, 1))
    a.flush()
    turn(b, prompt)  # b holds the prompt itself: a reuse can take no more
    assert b.remote_lookup(prompt, NAMESPACE) is False and b.report().remote_fetches == 0
    assert b.remote_lookup(prompt + (1,), NAMESPACE) is False  # it serves all but the last token already
    longer = prompt + (1, 1, 7)
    assert b.remote_lookup(longer, NAMESPACE)  # a longer one whose next block it lacks: asked
    b.collect()
    assert turn(b, longer).reused_tokens == len(prompt) + 2


def test_a_fetch_pays_where_fetching_and_reading_back_beat_prefilling():
    from kvstate.core.remote import fetch_pays
    from kvstate.core.state import Pace
    state = fleet()[1][0].state
    assert fetch_pays(state, 10**9, 1)  # unmeasured: taken
    # Fetched at 1 GB/s and read back at 1 GB/s: 2 s for 1 GB, against a prefill of 1 ms a token.
    measured = attrs.evolve(state, pace=Pace(read_seconds=1.0, read_bytes=1e9, prefill_seconds=1.0,
                                             prefill_tokens=1000.0, remote_seconds=1.0, remote_bytes=1e9))
    assert fetch_pays(measured, 10**9, 2001) and not fetch_pays(measured, 10**9, 1999)  # the read back counts
    assert not fetch_pays(measured, 10**9, 2000)  # a tie prefills: no read for nothing


def test_a_partial_block_alone_is_fetched_only_where_it_pays():
    remote, (a, b) = fleet()
    turn(a, tuple(range(8)))
    turn(b, tuple(range(8)))
    turn(a, tuple(range(11)))
    a.flush()
    b.measure_prefill(1, 1.0)  # a slow prefill: any fetch pays
    assert b.remote_lookup(tuple(range(11)) + (5,), NAMESPACE)
    b.collect()
    assert b.report().remote_blocks_read == 1


def test_a_server_that_serves_less_of_what_follows_the_full_blocks_asks_for_the_store_s_longer_partial():
    remote, (a, b) = fleet()
    prompt = tuple(range(15))  # three full blocks, then 12, 13, 14
    turn(b, prompt[:13])  # b: a partial block of one token after them
    turn(a, prompt[:14])  # the store: one of two
    a.flush()
    b.measure_prefill(1, 1.0)
    assert b.remote_lookup(prompt, NAMESPACE)
    b.collect()
    assert turn(b, prompt).reused_tokens == 14


def test_what_the_disk_serves_counts_as_held():
    remote, (a, b) = fleet()
    prompt = tuple(range(14))
    turn(a, prompt)
    a.flush()
    turn(b, prompt)
    b.flush()
    b.boundary(max_bytes=0)  # RAM gives it all back: the disk holds it
    assert b.state.ram.bytes == 0
    assert b.remote_lookup(prompt + (1,), NAMESPACE) is False  # the disk serves all a reuse can take


def test_a_partial_fetch_is_judged_by_its_own_tokens_once_fetches_are_measured():
    remote, (a, b) = fleet()
    turn(a, tuple(range(40, 48)))
    turn(a, tuple(range(8)))
    turn(b, tuple(range(8)))
    turn(a, tuple(range(11)))
    a.flush()
    assert b.remote_lookup(tuple(range(40, 48)) + (1,), NAMESPACE)  # a fetch, to measure the store's pace
    b.collect()
    assert b.state.pace.remote_s_per_byte is not None
    b.measure_prefill(1, 1.0)  # a slow prefill: fetching three tokens' state pays
    assert b.remote_lookup(tuple(range(11)), NAMESPACE)  # every full block held: the partial one alone
    b.collect()
    assert b.report().remote_blocks_read == 2 + 1
