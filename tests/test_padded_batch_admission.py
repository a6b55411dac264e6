"""Admission for one padded batch (``batch_padding_step``), model-checked against a naive batch.

mlx-lm's ``BatchGenerator`` pads every row to the longest and grows its caches a
step of tokens at a time, from wherever they end. The reference below is that
batch written plainly: a list of live rows, each holding up to prompt +
max_tokens positions, the whole batch allocated at most rows x (the longest row
+ a step less one). The service
must admit exactly what fits the budget by that measure (topped up by a
measured batch that holds more than projected), and so the batch never holds
more than the budget. A second reference adds kept state: rows that reuse
prefixes are merged at the longest reuse, so each row holds the longest reuse
plus the longest rest.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from kvstate import (
    InvalidConfig, KvCacheService, LayerKind, LayerSpec, ModelSpec, NotAdmitted, OverBudget, Request,
)
from tests.reference import attention_bytes

LAYERS, KV_HEADS, HEAD_DIM, STEP = 2, 1, 4, 16
SPEC = ModelSpec("batch-dense", (LayerSpec(LayerKind.FULL_ATTENTION, kv_heads=KV_HEADS, head_dim=HEAD_DIM),) * LAYERS,
                 4096)
BUDGET = attention_bytes(LAYERS, KV_HEADS, HEAD_DIM, 4 * 128)


def batch_bytes(rows: list[int], step: int = STEP) -> int:
    """What a padded batch of rows (each its prompt + max_tokens) allocates at most: its last growth
    step may begin one position before the longest row ends."""
    if not rows:
        return 0
    return len(rows) * attention_bytes(LAYERS, KV_HEADS, HEAD_DIM, max(rows) - 1 + step)


class PaddedBatchMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.service = KvCacheService.simulated(SPEC, ram_bytes=0, kv_budget_bytes=BUDGET, batch_padding_step=STEP)
        self.live: list[tuple[Request, int]] = []   # admitted requests and their rows' positions
        self.measured = 0                             # the last measure, less the releases since

    @rule(prompt=st.integers(1, 300), max_tokens=st.integers(1, 200), implicit=st.booleans())
    def admit(self, prompt, max_tokens, implicit):
        request = Request(tuple(range(prompt)), max_tokens)
        rows = [wanted for _, wanted in self.live]
        if batch_bytes([prompt + max_tokens]) > BUDGET:  # can never run, even alone
            state = self.service.state
            with pytest.raises(OverBudget):
                self.service.acquire(request) if implicit else self.service.admit(request)
            assert self.service.state == state
            return
        before, after = batch_bytes(rows), batch_bytes([*rows, prompt + max_tokens])
        fits = after + max(0, self.measured - before) <= BUDGET
        if implicit:  # acquire without admit: admits as admit would, or refuses
            try:
                self.service.acquire(request)
            except NotAdmitted:
                assert not fits
                return
            assert fits
        else:
            assert self.service.admit(request) == fits
            if not fits:
                return
        self.live.append((request, prompt + max_tokens))

    @precondition(lambda self: self.live)
    @rule(which=st.integers(0, 50))
    def release(self, which):
        request, _ = self.live.pop(which % len(self.live))
        before = batch_bytes([wanted for _, wanted in self.live] + [len(request.prompt) + request.max_tokens])
        self.service.release(request)
        after = batch_bytes([wanted for _, wanted in self.live])
        self.measured = max(0, self.measured - (before - after)) if self.live else 0

    @rule(slack=st.integers(-2000, 2000))
    def measure(self, slack):
        """The batch measured near what the reference allocates, above or below; with nothing
        admitted, whatever is measured belongs to no request and counts nothing."""
        measured = max(0, batch_bytes([wanted for _, wanted in self.live]) + slack)
        self.service.measure_batch(measured)
        self.measured = measured if self.live else 0

    @invariant()
    def projection_is_the_padded_batch(self):
        report = self.service.report()
        assert report.projected_bytes == batch_bytes([wanted for _, wanted in self.live])
        assert report.measured_bytes == self.measured
        assert report.live_requests == len(self.live)

    @invariant()
    def the_batch_fits_the_budget(self):
        assert batch_bytes([wanted for _, wanted in self.live]) <= BUDGET


def test_padded_batch_admission_matches_a_naive_batch():
    run_state_machine_as_test(PaddedBatchMachine, settings=settings(
        max_examples=200, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]))


def test_a_short_request_beside_a_long_one_is_charged_the_long_ones_bytes():
    budget = attention_bytes(LAYERS, KV_HEADS, HEAD_DIM, 1000)
    service = KvCacheService.simulated(SPEC, ram_bytes=0, kv_budget_bytes=budget, batch_padding_step=STEP)
    long, short = Request(tuple(range(300)), 100), Request((1, 2, 3), 1)
    assert service.admit(long) and service.admit(short)
    assert service.report().projected_bytes == 2 * attention_bytes(LAYERS, KV_HEADS, HEAD_DIM, 400 + STEP - 1)
    service.release(long)
    assert service.report().projected_bytes == attention_bytes(LAYERS, KV_HEADS, HEAD_DIM, 4 + STEP - 1)


def test_summed_admission_is_unchanged_without_padding():
    service = KvCacheService.simulated(SPEC, ram_bytes=0, kv_budget_bytes=attention_bytes(LAYERS, KV_HEADS, HEAD_DIM, 1000))
    assert service.admit(Request(tuple(range(300)), 100)) and service.admit(Request((1, 2, 3), 1))
    assert service.report().projected_bytes == attention_bytes(LAYERS, KV_HEADS, HEAD_DIM, 404)


@pytest.mark.parametrize("step", [0, -1, 1.5, True, "256"])
def test_a_padding_step_that_is_not_a_positive_int_is_refused(step):
    with pytest.raises(InvalidConfig, match="batch_padding_step"):
        KvCacheService.simulated(SPEC, ram_bytes=0, batch_padding_step=step)


def test_a_padding_step_of_one_token_pads_nothing():
    service = KvCacheService.simulated(SPEC, ram_bytes=0, kv_budget_bytes=BUDGET, batch_padding_step=1)
    assert service.admit(Request(tuple(range(1, 11)), 5))
    assert service.report().projected_bytes == SPEC.bytes_for(15)


def test_a_measure_that_is_not_bytes_is_refused_and_changes_nothing():
    service = KvCacheService.simulated(SPEC, ram_bytes=0, kv_budget_bytes=BUDGET, batch_padding_step=STEP)
    before = service.state
    with pytest.raises(Exception, match="bytes"):
        service.measure_batch(-1)
    assert service.state == before


def _held(service, prompt, namespace="n"):
    """Keep the state of ``prompt`` (computed from nothing) in ``namespace``."""
    request = Request(prompt, 1)
    state = service.acquire(request, namespace)
    caches = service.interpreter.prefill(state.caches, tuple(prompt[state.reused_tokens:]))
    service.publish(request, namespace, prompt, caches)
    service.release(request)


def test_rows_that_reuse_prefixes_of_different_lengths_are_charged_the_longest_reuse_plus_the_longest_rest():
    """mlx-lm merges a batch's rows at the longest reuse and pads their rest to the longest rest: a row
    that reuses 200 tokens beside one that reuses none makes both rows 200 + the longest rest long."""
    positions = attention_bytes(LAYERS, KV_HEADS, HEAD_DIM, 1)
    service = KvCacheService.simulated(SPEC, ram_bytes=positions * 1000, kv_budget_bytes=positions * 4000,
                                       batch_padding_step=STEP)
    _held(service, tuple(range(1, 201)))
    reusing = Request(tuple(range(1, 221)), 10)   # 200 reused, 30 positions after
    fresh = Request(tuple(range(500, 720)), 10)   # nothing reused, 230 positions
    assert service.admit(reusing, "n") and service.admit(fresh, "n")
    assert service.report().projected_bytes == 2 * attention_bytes(LAYERS, KV_HEADS, HEAD_DIM, 200 + 230 + STEP - 1)
    assert service.acquire(reusing, "n").reused_tokens == 200  # as expected: the charge stays
    assert service.report().projected_bytes == 2 * attention_bytes(LAYERS, KV_HEADS, HEAD_DIM, 200 + 230 + STEP - 1)
    service.release(fresh)
    assert service.report().projected_bytes == attention_bytes(LAYERS, KV_HEADS, HEAD_DIM, 200 + 30 + STEP - 1)


def test_an_acquire_that_reuses_other_than_admission_expected_moves_the_charge():
    """Admitted without its namespace (nothing expected), a row is charged from its real reuse once
    its acquire finds it."""
    positions = attention_bytes(LAYERS, KV_HEADS, HEAD_DIM, 1)
    service = KvCacheService.simulated(SPEC, ram_bytes=positions * 1000, kv_budget_bytes=positions * 4000,
                                       batch_padding_step=STEP)
    _held(service, tuple(range(1, 201)))
    reusing, fresh = Request(tuple(range(1, 221)), 10), Request(tuple(range(500, 720)), 10)
    assert service.admit(reusing) and service.admit(fresh)
    assert service.report().projected_bytes == 2 * attention_bytes(LAYERS, KV_HEADS, HEAD_DIM, 230 + STEP - 1)
    service.acquire(reusing, "n")
    assert service.report().projected_bytes == 2 * attention_bytes(LAYERS, KV_HEADS, HEAD_DIM, 200 + 230 + STEP - 1)


def test_a_prompt_held_whole_is_expected_to_reuse_all_but_its_last_token():
    """The last token is always computed (its logits start the generation), so a row whose whole prompt
    is held is charged from a reuse one token short of it."""
    positions = attention_bytes(LAYERS, KV_HEADS, HEAD_DIM, 1)
    service = KvCacheService.simulated(SPEC, ram_bytes=positions * 1000, kv_budget_bytes=positions * 4000,
                                       batch_padding_step=STEP)
    prompt = tuple(range(1, 201))
    _held(service, prompt)
    assert service.admit(Request(prompt, 10), "n") and service.admit(Request(tuple(range(500, 720)), 10), "n")
    assert service.report().projected_bytes == 2 * attention_bytes(LAYERS, KV_HEADS, HEAD_DIM, 199 + 230 + STEP - 1)


def test_a_namespace_that_holds_nothing_for_the_prompt_expects_no_reuse():
    positions = attention_bytes(LAYERS, KV_HEADS, HEAD_DIM, 1)
    service = KvCacheService.simulated(SPEC, ram_bytes=positions * 1000, kv_budget_bytes=positions * 4000,
                                       batch_padding_step=STEP)
    _held(service, tuple(range(1, 201)), namespace="other")
    assert service.admit(Request(tuple(range(1, 221)), 10), "n")
    assert service.report().projected_bytes == attention_bytes(LAYERS, KV_HEADS, HEAD_DIM, 230 + STEP - 1)


#: Prompts of one family: a shared start of some length, then a tail of their own.
BASE = tuple(range(1, 301))
family_prompts = st.tuples(st.integers(1, 300), st.integers(0, 40), st.integers(0, 3)).map(
    lambda parts: BASE[:parts[0]] + tuple(1000 + 50 * parts[2] + i for i in range(parts[1])))


def _reusable(held: set, prompt: tuple[int, ...]) -> int:
    """What kept state serves of ``prompt`` (every kept prompt's state cuts back to any prefix): its
    longest common prefix with one, all but its last token at most."""
    best = 0
    for kept in held:
        common = 0
        for a, b in zip(kept, prompt):
            if a != b:
                break
            common += 1
        best = max(best, common)
    return min(best, len(prompt) - 1)


def reusing_batch_bytes(rows: list[tuple[int, int]], step: int = STEP) -> int:
    """A padded batch of rows (each its prompt + max_tokens, and the tokens it reuses): mlx-lm merges
    them at the longest reuse and pads the rest to the longest rest."""
    if not rows:
        return 0
    positions = max(reused for _, reused in rows) + max(wanted - reused for wanted, reused in rows)
    return len(rows) * attention_bytes(LAYERS, KV_HEADS, HEAD_DIM, positions - 1 + step)


class ReusingPaddedBatchMachine(RuleBasedStateMachine):
    """Admission of rows that reuse kept state, against a naive batch that charges the longest reuse
    plus the longest rest: a row is charged what its namespace holds when it is admitted (nothing
    without a namespace), then what it reuses once acquired."""

    def __init__(self) -> None:
        super().__init__()
        self.budget = attention_bytes(LAYERS, KV_HEADS, HEAD_DIM, 6 * 600)
        self.service = KvCacheService.simulated(SPEC, ram_bytes=attention_bytes(LAYERS, KV_HEADS, HEAD_DIM, 1 << 16),
                                                kv_budget_bytes=self.budget, batch_padding_step=STEP)
        self.held: set[tuple[int, ...]] = set()
        self.live: list[list] = []   # [request, wanted, reused, acquired]

    @precondition(lambda self: not self.live)  # its own acquire is a row too: kept between batches
    @rule(prompt=family_prompts)
    def keep(self, prompt):
        request = Request(prompt, 1)
        state = self.service.acquire(request, "n")
        caches = self.service.interpreter.prefill(state.caches, tuple(prompt[state.reused_tokens:]))
        self.service.publish(request, "n", prompt, caches)
        self.service.release(request)
        self.held.add(prompt)

    @rule(prompt=family_prompts, max_tokens=st.integers(1, 100), with_namespace=st.booleans())
    def admit(self, prompt, max_tokens, with_namespace):
        request = Request(prompt, max_tokens)
        reused = _reusable(self.held, prompt) if with_namespace else 0
        row = (len(prompt) + max_tokens, reused)
        fits = reusing_batch_bytes([(wanted, r) for _, wanted, r, _ in self.live] + [row]) <= self.budget
        assert self.service.admit(request, "n" if with_namespace else None) == fits
        if fits:
            self.live.append([request, row[0], reused, False])

    @precondition(lambda self: any(not acquired for *_, acquired in self.live))
    @rule(which=st.integers(0, 50))
    def acquire(self, which):
        waiting = [row for row in self.live if not row[3]]
        row = waiting[which % len(waiting)]
        assert self.service.acquire(row[0], "n").reused_tokens == _reusable(self.held, row[0].prompt)
        row[2], row[3] = _reusable(self.held, row[0].prompt), True

    @precondition(lambda self: self.live)
    @rule(which=st.integers(0, 50))
    def release(self, which):
        request = self.live.pop(which % len(self.live))[0]
        self.service.release(request)

    @invariant()
    def projection_is_the_reusing_padded_batch(self):
        assert self.service.report().projected_bytes == reusing_batch_bytes(
            [(wanted, reused) for _, wanted, reused, _ in self.live])


def test_admission_of_rows_that_reuse_kept_state_matches_a_naive_reusing_batch():
    run_state_machine_as_test(ReusingPaddedBatchMachine, settings=settings(
        max_examples=100, stateful_step_count=30, deadline=None, suppress_health_check=[HealthCheck.too_slow]))
