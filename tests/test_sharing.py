"""``shared_target``: when a request should wait for a prefix another request is computing.

The reference publishes, for every boundary still ahead of a row, the entry that row would keep
(its prompt up to the boundary), and asks the naive reuse rule how much of the waiting prompt that
entry serves.
"""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import example, given

from kvstate.core import events as ev
from kvstate.core.sharing import Computing, shared_target
from kvstate.core.tokens import Tokens
from tests.core_driver import Core
from tests.reference import usable

prompts = st.lists(st.integers(0, 2), min_size=1, max_size=24).map(tuple)


@st.composite
def rows(draw):
    prompt = draw(prompts)
    boundaries = tuple(sorted(set(draw(st.lists(st.integers(1, len(prompt)), max_size=3)))))
    return Computing(prompt, boundaries, draw(st.integers(0, len(prompt))), draw(st.booleans()))


def naive_target(prompt, reusable, computing, min_gain):
    best = 0
    for row in computing:
        for boundary in row.boundaries:
            if boundary > row.position:
                best = max(best, usable(row.prompt[:boundary], row.trimmable, prompt))
    return best if best >= reusable + min_gain else 0


@given(prompt=prompts, reusable=st.integers(0, 24), computing=st.lists(rows(), max_size=4),
       min_gain=st.integers(1, 8))
# The edges a random search finds only now and then, pinned: a whole state whose boundary is exactly
# where the prompts part, and exactly the last token a reuse may cover; a trimmed one cut where they
# part; a boundary the row has just reached (published already); a gain of exactly the minimum.
@example(prompt=(1, 2, 0, 1, 2, 2), reusable=0, computing=[Computing((1, 2, 0, 1, 0), (4,), 0, False)], min_gain=1)
@example(prompt=(1, 2, 0, 1, 2), reusable=0, computing=[Computing((1, 2, 0, 1, 2, 2), (4,), 1, False)], min_gain=1)
@example(prompt=(1, 2, 0, 2, 2), reusable=0, computing=[Computing((1, 2, 0, 1, 2), (5,), 0, True)], min_gain=1)
@example(prompt=(1, 2, 0, 1, 2), reusable=0, computing=[Computing((1, 2, 0, 1, 2), (3,), 3, True)], min_gain=1)
@example(prompt=(1, 2, 0, 1, 2), reusable=1, computing=[Computing((1, 2, 0, 1, 2), (3,), 0, True)], min_gain=2)
def test_the_target_is_what_a_publish_still_to_come_would_serve(prompt, reusable, computing, min_gain):
    assert shared_target(prompt, reusable, computing, min_gain) == naive_target(prompt, reusable, computing, min_gain)


def test_a_boundary_already_passed_is_no_reason_to_wait():
    row = Computing((1, 2, 3, 4, 5, 6), (4,), 4, False)
    assert shared_target((1, 2, 3, 4, 9, 9), 0, [row], 1) == 0
    assert shared_target((1, 2, 3, 4, 9, 9), 0, [Computing(row.prompt, (4,), 3, False)], 1) == 4


def test_a_gain_below_the_minimum_is_no_reason_to_wait():
    row = Computing((1, 2, 3, 4, 5, 6), (4,), 0, False)
    assert shared_target((1, 2, 3, 4, 9), 1, [row], 4) == 0
    assert shared_target((1, 2, 3, 4, 9), 0, [row], 4) == 4


def test_an_exact_state_as_long_as_the_prompt_serves_nothing():
    """A non-trimmable state must leave the last prompt token to compute."""
    row = Computing((1, 2, 3, 4, 5, 6), (4,), 0, False)
    assert shared_target((1, 2, 3, 4), 0, [row], 1) == 0
    assert shared_target((1, 2, 3, 4), 0, [Computing(row.prompt, (4,), 0, True)], 1) == 3


def test_the_service_answers_a_wait_over_what_its_ram_serves_in_the_requests_namespace_only():
    from kvstate import KvCacheService, Request
    from kvstate.core.tokens import Tokens
    from kvstate.models import model_spec

    service = KvCacheService.simulated(model_spec("llama-3.2-1b"), ram_bytes=1 << 30)
    system = tuple(range(1, 101))
    row = Computing(Tokens(system + (500, 501)), (100,), 10, True)  # publishes at 100, has computed 10
    prompt = system + (900, 901)
    assert service.shared_wait(prompt, "a", [row], 8) == 100
    state = service.interpreter.prefill(service.acquire(request := Request(system, 1), "a").caches, system)
    service.publish(request, "a", system, state)
    service.release(request)
    assert service.shared_wait(prompt, "a", [row], 8) == 0      # RAM serves it already: no reason to wait
    assert service.shared_wait(prompt, "b", [row], 8) == 100    # another namespace's RAM serves it nothing


def test_a_wait_asked_of_the_core_without_a_minimum_gain_is_worth_a_single_token():
    core = Core()
    core.keep((1, 2, 3))  # RAM serves three tokens of the prompt now
    row = Computing(Tokens((1, 2, 3, 4, 5, 6)), (4,), 0, False)
    assert core(ev.SharedWait(Tokens((1, 2, 3, 4, 9)), "n", (row,))) == 4  # one token more is worth it
