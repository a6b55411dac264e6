"""Model check of generation checkpoints (DESIGN.md invariants 5 and 6), with crashes injected.

Replayable generations run on the simulator with a disk tier, writes that
complete later and fail on demand, and crash points between effects. Each
generation's tokens are a fixed function of its key, so the naive reference
knows what every resumed generation must hold: a completed generation leaves
no checkpoint, an interrupted one resumes exactly to a prefix of its own
tokens, and a crash never makes the service claim a checkpoint it did not
write.
"""

from __future__ import annotations

import os

import attrs
import hypothesis.strategies as st
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from kvstate import Continuation, KvCacheService, Request, SimulatedCrash, Source
from kvstate.interpreters.simulator import FaultPlan, SimDisk
from tests.test_model_check import RAM, TRIMMABLE

KEYS = ("g1", "g2", "g3")
PROMPTS = {key: tuple(range(10 * i, 10 * i + 12)) for i, key in enumerate(KEYS, 1)}
EVERY = 4
CRASHED = object()
PROFILE = os.environ.get("KVSTATE_CHECK_PROFILE", "ci")


def generated(key: str, count: int) -> tuple[int, ...]:
    """The tokens generation ``key`` produces, a fixed function of its key (the sampler seed's role)."""
    return tuple((sum(map(ord, key)) * 7 + i * 3) % 11 for i in range(count))


@attrs.define
class Generation:
    request: Request
    caches: object
    produced: int  # generated tokens fed into the caches


class CheckpointMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.disk = SimDisk()
        self.faults = FaultPlan()
        self.live: dict[str, Generation] = {}
        self.completed: set[str] = set()
        self.service = self.build()

    def build(self) -> KvCacheService:
        return KvCacheService.simulated(
            TRIMMABLE, ram_bytes=RAM, disk_bytes=RAM * 8, checkpoint_every_tokens=EVERY,
            interpreter_options={"disk": self.disk, "faults": self.faults, "deferred_writes": True})

    def guarded(self, call):
        """Run ``call``; a crash kills the process: restart on what the disk holds, running requests gone."""
        try:
            return call()
        except SimulatedCrash:
            self.faults.crash_before_effect = None
            self.service = self.build()
            self.live.clear()
            return CRASHED

    @precondition(lambda self: len(self.live) < len(KEYS))
    @rule(data=st.data())
    def start(self, data):
        key = data.draw(st.sampled_from([k for k in KEYS if k not in self.live]))
        prompt = PROMPTS[key]
        request = Request(prompt, 40, continuation=Continuation(key, seed=sum(map(ord, key))))
        state = self.guarded(lambda: self.service.acquire(request, "chat"))
        if state is CRASHED:
            return
        if state.source is Source.CHECKPOINT:
            produced = len(state.resumed_tokens) - len(prompt)
            # Invariant 6: a resumed generation holds exactly its own tokens so far, and its next token.
            assert key not in self.completed
            assert state.resumed_tokens == prompt + generated(key, produced)
            assert state.caches.tokens == state.resumed_tokens
            assert state.resumed.pending_token == generated(key, produced + 1)[-1]
            assert produced % EVERY == 0 and produced > 0
            self.live[key] = Generation(request, state.caches, produced)
        else:
            caches = self.service.interpreter.prefill(state.caches, prompt[state.reused_tokens:])
            self.live[key] = Generation(request, caches, 0)
        self.completed.discard(key)

    @precondition(lambda self: self.live)
    @rule(data=st.data(), steps=st.integers(1, 16))
    def generate(self, data, steps):
        key = data.draw(st.sampled_from(sorted(self.live)))
        generation = self.live[key]
        for _ in range(steps):
            produced = generation.produced
            if produced and produced % EVERY == 0:
                tokens = PROMPTS[key] + generated(key, produced)
                pending = generated(key, produced + 1)[-1]
                if self.guarded(lambda: self.service.checkpoint(generation.request, generation.caches, tokens,
                                                                produced, pending_token=pending)) is CRASHED:
                    return
            generation.caches = self.service.interpreter.prefill(generation.caches, generated(key, produced + 1)[-1:])
            generation.produced += 1

    @precondition(lambda self: self.live)
    @rule(data=st.data(), completed=st.sampled_from([True, False, False]))
    def finish(self, data, completed):
        key = data.draw(st.sampled_from(sorted(self.live)))
        generation = self.live.pop(key)
        if self.guarded(lambda: self.service.release(generation.request, completed)) is not CRASHED and completed:
            self.completed.add(key)

    @rule(count=st.integers(1, 3))
    def writes_complete(self, count):
        self.guarded(lambda: self.service.complete(self.service.interpreter.poll(count)))

    @rule()
    def next_write_fails(self):
        sim = self.service.interpreter
        self.faults.fail_writes.add(sim.stats.writes + sim.pending_writes + 1)

    @rule(after=st.integers(1, 6))
    def crash_soon(self, after):
        self.faults.crash_before_effect = self.service.interpreter.stats.effects + after

    @rule()
    def flush(self):
        result = self.guarded(self.service.flush)
        if result is not CRASHED and result.durable:
            assert self.service.report().pending_writes == 0

    @invariant()
    def a_completed_generation_leaves_no_checkpoint(self):
        for key in self.completed:
            assert not any(saved.meta.key.endswith("\x1f" + key) for saved in self.disk.checkpoints.values())

    @invariant()
    def what_is_on_disk_is_what_was_generated(self):
        for saved in self.disk.checkpoints.values():
            key = saved.meta.key.rsplit("\x1f", 1)[-1]
            assert saved.tokens == PROMPTS[key] + generated(key, saved.meta.generated_tokens)


def test_checkpoints_survive_crashes_and_completed_ones_go():
    run_state_machine_as_test(CheckpointMachine, settings=settings(
        max_examples={"ci": 300, "long": 1500}[PROFILE], stateful_step_count={"ci": 40, "long": 80}[PROFILE],
        deadline=None, suppress_health_check=[HealthCheck.too_slow]))
