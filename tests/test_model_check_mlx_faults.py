"""The MLX interpreter, model-checked under faults below the file API (``tests/faults.py``).

A hypothesis state machine drives a real service (``for_mlx``: a random-weight llama, real arrays,
real safetensors files) through requests that share prefixes, memory pressure, flushes and
restarts, kept whole or in blocks, while the store's reads and writes fail at a rate drawn per run (EIO, short reads,
flipped bytes, ENOSPC, EIO on write and fsync). Against a naive reference, recomputation and the
list of what was published, every port call keeps its contract:

- no wrong state is ever restored: reused caches equal a fresh prefill of the reused tokens;
- a reuse is of a prefix some request published, never longer;
- no port call raises: a read that fails falls back to RAM or fresh state, a write that fails drops
  the entry's disk copy, and each is counted;
- nothing leaks: ``reading``, ``acquiring`` and the live requests return to 0 after each call;
- the report's counters add up: every acquire is a hit or a miss.
"""

from __future__ import annotations

import shutil
import tempfile

import hypothesis.strategies as st
import mlx.core as mx
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvstate import KvCacheService, Request
from kvstate.models.reference import build
from kvstate.interpreters.mlx.disk_store import LOADERS
from tests.faults import DiskFaults

MODEL, CONFIG = build("llama", seed=81)
#: Prompts from a few families sharing leading tokens, so reuse, spills and restores all happen.
FAMILIES = [tuple(range(10 * f + 1, 10 * f + 9)) for f in range(3)]
prompts = st.tuples(st.sampled_from(FAMILIES), st.lists(st.integers(100, 104), min_size=1, max_size=6)).map(
    lambda parts: parts[0] + tuple(parts[1]))


def prefilled(tokens: tuple[int, ...]) -> list:
    """Keys and values of a fresh prefill of ``tokens``: what a reuse of them must hold."""
    caches = MODEL.make_cache()
    if tokens:
        MODEL(mx.array([list(tokens)]), cache=caches)
    return keys_and_values(caches, len(tokens))


def keys_and_values(caches, length: int) -> list:
    return [(c.keys[..., :length, :].tolist(), c.values[..., :length, :].tolist()) if length else ([], [])
            for c in caches]


class ServiceUnderDiskFaults(RuleBasedStateMachine):
    """One service over one directory; reads and writes below it fail at the drawn rate."""

    @initialize(rate=st.sampled_from([0.0, 0.1, 0.3, 0.6]), seed=st.integers(0, 1000), loader=st.sampled_from(LOADERS),
                block_tokens=st.sampled_from([None, 4]))
    def start(self, rate, seed, loader, block_tokens):
        self.loader = loader  # how restores read a file: both ways meet the same faults
        self.block_tokens = block_tokens  # whole prefixes, or blocks of 4 (a chain read into place)
        self.directory = tempfile.mkdtemp(prefix="kvstate-faults-")
        self.faults = DiskFaults(rate, seed)
        self.reads = self.faults.installed()
        self.reads.__enter__()
        self.published: set[tuple[int, ...]] = set()
        self.acquires = 0
        self.service = self._open()

    def _open(self) -> KvCacheService:
        # RAM for about three prompts' caches: publishes evict, pressure spills, restores read files.
        return KvCacheService.for_mlx(MODEL, config=CONFIG, name="faults", ram_bytes=24 << 10,
                                      disk_dir=self.directory, disk_bytes=1 << 22,
                                      write_file=self.faults.write_file, background_writes=False,
                                      disk_loader=self.loader, block_tokens=self.block_tokens)

    def teardown(self):
        try:
            if hasattr(self, "service"):
                self.service.close()  # a write that fails at close leaves state RAM-only: never an error
        finally:
            if hasattr(self, "reads"):
                self.reads.__exit__(None, None, None)
                shutil.rmtree(self.directory, ignore_errors=True)

    @rule(prompt=prompts)
    def serve(self, prompt):
        request = Request(prompt, 2)
        state = self.service.acquire(request, "n")  # a failed read falls back to RAM or fresh: never an error
        self.acquires += 1
        reused = state.reused_tokens
        assert reused < len(prompt)
        if reused:
            assert any(p[:reused] == prompt[:reused] and len(p) >= reused for p in self.published), \
                "reused a prefix nothing published"
            assert keys_and_values(state.caches, reused) == prefilled(prompt[:reused]), "wrong state restored"
        MODEL(mx.array([list(prompt[reused:])]), cache=state.caches)
        if self.service.publish(request, "n", prompt, state.caches):  # a failed write drops it: never an error
            self.published.add(prompt)
        self.service.release(request)

    @rule()
    def pressure(self):
        self.service.boundary()

    @rule()
    def flush(self):
        self.service.flush()

    @precondition(lambda self: self.acquires > 0)
    @rule()
    def restart(self):
        self.service.close()
        self.service = self._open()
        self.acquires = 0  # a fresh service counts from zero

    @invariant()
    def nothing_leaks(self):
        if not hasattr(self, "service"):
            return
        state = self.service.state
        assert len(state.reading) == 0 and len(state.acquiring) == 0
        report = self.service.report()
        assert report.live_requests == 0
        assert report.hits + report.misses == self.acquires


TestServiceUnderDiskFaults = ServiceUnderDiskFaults.TestCase
TestServiceUnderDiskFaults.settings = settings(max_examples=60, stateful_step_count=25, deadline=None,
                                               suppress_health_check=[HealthCheck.too_slow])


def test_the_faults_strike_at_their_rate():
    """The fixture itself: at rate 1 every call meets a fault, at rate 0 none does."""
    always, never = DiskFaults(1.0, seed=1), DiskFaults(0.0, seed=1)
    for faults in (always, never):
        for _ in range(20):
            faults._strikes(("eio_on_read", "short_read"))
    assert sum(always.injected.values()) == 20 and not never.injected
