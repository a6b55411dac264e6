"""Chunk snapshots are kept where they are worth their bytes: a snapshot offered mid-prefill holds no
more bytes than the attention state of the tokens it saves over the snapshot held before it on its
chain. Checked on the simulator against the rule computed here, over random chunk positions and
state sizes; snapshots at the end of a prompt are always kept."""

from __future__ import annotations

import attrs
import hypothesis.strategies as st
import pytest
from hypothesis import given, settings

from kvstate import InvalidRequest, KvCacheService, LayerKind, LayerSpec, ModelSpec, Request, SimCaches
from kvstate.core import events as ev
from kvstate.core.replies import Kept
from tests.core_driver import Core

KV_HEADS, HEAD_DIM = 1, 4
PER_TOKEN = 2 * KV_HEADS * HEAD_DIM * 2  # one attention layer, keys and values, 2-byte elements


def hybrid(state_bytes: int) -> ModelSpec:
    return ModelSpec(f"hybrid-{state_bytes}", (LayerSpec(LayerKind.RECURRENT, state_bytes=state_bytes),
                                              LayerSpec(LayerKind.FULL_ATTENTION, kv_heads=KV_HEADS, head_dim=HEAD_DIM)),
                     4096)


def prefill(service, spec, prompt, ends, say_next=False):
    """A prefill that offers a chunk snapshot at each of ``ends`` and a snapshot at its end; ``say_next``:
    each chunk says where the next is taken."""
    request = Request(prompt, 1)
    service.acquire(request, "n")
    for end, following in zip(ends, list(ends[1:]) + [len(prompt)]):
        service.publish(request, "n", prompt[:end], SimCaches(prompt[:end], spec), chunk=True,
                        next_chunk=prompt[end:following] if say_next else ())
    service.publish(request, "n", prompt, SimCaches(prompt, spec))
    service.release(request)


def kept_snapshots(service):
    return sorted(e.length for e in service.state.entries.values() if e.is_snapshot)


@settings(max_examples=150, deadline=None)
@given(state_bytes=st.integers(1, 40 * PER_TOKEN), chunks=st.lists(st.integers(1, 12), min_size=1, max_size=8))
def test_a_chunk_snapshot_is_kept_only_where_it_holds_no_more_than_the_attention_state_it_saves(state_bytes,
                                                                                              chunks):
    spec = hybrid(state_bytes)
    service = KvCacheService.simulated(spec, ram_bytes=1 << 30, block_tokens=4)
    ends, at = [], 0
    for chunk in chunks:
        at += chunk
        ends.append(at)
    prompt = tuple(range(1, at + 6))
    prefill(service, spec, prompt, ends)
    expected, before = [], 0
    for end in ends:  # the rule, computed here: bytes against what the snapshot saves since the last kept
        if state_bytes <= (end - before) * PER_TOKEN:
            expected.append(end)
            before = end
    assert kept_snapshots(service) == expected + [len(prompt)]  # the prompt's end is always kept
    assert service.report().snapshots_passed_up == len(ends) - len(expected)


def test_a_request_that_diverges_reuses_the_last_snapshot_kept_before_it():
    spec = hybrid(6 * PER_TOKEN)  # worth keeping only six or more tokens after the one before
    service = KvCacheService.simulated(spec, ram_bytes=1 << 30, block_tokens=4)
    prompt = tuple(range(1, 40))
    prefill(service, spec, prompt, [4, 8, 12, 16, 20, 24])  # kept: 8 (8 tokens), 16, 24; passed up: the rest
    assert kept_snapshots(service) == [8, 16, 24, len(prompt)]
    edited = prompt[:22] + (900, 901)
    state = service.acquire(Request(edited, 1), "n")
    assert state.reused_tokens == 16 and state.caches.tokens == edited[:16]


def test_a_snapshot_published_to_the_core_without_saying_chunk_is_a_segments_end_and_kept():
    """The core's ``Publish`` leaves ``chunk`` off unless told: a snapshot however large is then kept,
    where a chunk one that large would be passed up."""
    spec = hybrid(1 << 20)  # far more than the attention state of any prompt here
    tokens = tuple(range(1, 9))
    attention = 4 * PER_TOKEN
    core = Core(model=spec, ram_capacity_bytes=1 << 30, block_tokens=4)
    offer = ev.Publish(Request(tokens, 1), "n", tokens, 1, len(tokens), 2 * attention + (1 << 20), False, 0,
                       ((attention, attention), (attention, attention)), (1 << 20, 1 << 20))
    assert isinstance(core(offer), Kept)
    chunk = Core(model=spec, ram_capacity_bytes=1 << 30, block_tokens=4)
    assert not isinstance(chunk(attrs.evolve(offer, chunk=True)), Kept)


def test_a_chunk_snapshot_no_held_prefix_goes_past_is_a_guess_kept_only_in_free_ram():
    spec = hybrid(2 * PER_TOKEN)  # worth keeping from two tokens on: only the room decides here
    prompt = tuple(range(1, 25))
    held = spec.bytes_for(len(prompt))  # RAM holds this prompt's state and nothing more
    service = KvCacheService.simulated(spec, ram_bytes=held, block_tokens=4)
    prefill(service, spec, prompt, [])
    before = service.state
    other = tuple(range(100, 124))  # shares nothing: every chunk of its prefill is a guess
    request = Request(other, 1)
    service.acquire(request, "n")
    for end in (8, 16):
        assert not service.publish(request, "n", other[:end], SimCaches(other[:end], spec), chunk=True)
    assert service.state.entries == before.entries and service.state.ram == before.ram  # nothing was evicted
    assert service.report().snapshots_passed_up == 2
    assert service.publish(request, "n", other, SimCaches(other, spec))  # its end is no guess: room is made
    service.release(request)
    roomy = KvCacheService.simulated(spec, ram_bytes=4 * held, block_tokens=4)
    prefill(roomy, spec, prompt, [])
    prefill(roomy, spec, other, [8, 16])  # in free RAM the same guesses are kept
    assert kept_snapshots(roomy) == [8, 16, 24, 24]


def test_a_chunk_snapshot_a_held_prefix_goes_past_is_kept_as_any_snapshot_so_the_next_branch_reuses_it():
    spec = hybrid(40 * PER_TOKEN)  # never worth its bytes as a guess on these prompts
    service = KvCacheService.simulated(spec, ram_bytes=1 << 30, block_tokens=4)
    prompt = tuple(range(1, 25))
    prefill(service, spec, prompt, [4, 8, 12, 16, 20])  # the first request: every chunk a guess, passed up
    assert kept_snapshots(service) == [24]
    branch = prompt[:12] + tuple(range(900, 912))  # leaves the held prompt after 12 tokens
    prefill(service, spec, branch, [4, 8, 12, 16, 20])  # 4, 8 and 12: a held prefix goes past them
    assert kept_snapshots(service) == [4, 8, 12, 24, 24]
    assert service.report().snapshots_passed_up == 5 + 2
    third = prompt[:14] + (7, 7, 7)  # the next to branch there reuses up to the branch point's chunk
    state = service.acquire(Request(third, 1), "n")
    assert state.reused_tokens == 12 and state.caches.tokens == third[:12]


@settings(max_examples=150, deadline=None)
@given(held=st.integers(2, 30), shared=st.integers(0, 29), gaps=st.lists(st.integers(1, 6), min_size=1, max_size=8))
def test_a_chunk_that_says_its_next_is_kept_as_evidence_only_if_it_is_the_last_before_the_branch_point(held, shared,
                                                                                                      gaps):
    """Each chunk says where the next is taken: of the chunks a held prompt goes past, only the last
    before the point where the prompt leaves it is kept (Marconi's one snapshot a branch); the others
    are guesses, never worth these bytes. The rule, computed here from the shared length alone."""
    spec = hybrid(1 << 20)  # far more than any prompt's attention state: no guess is worth its bytes
    service = KvCacheService.simulated(spec, ram_bytes=1 << 30, block_tokens=4)
    first = tuple(range(1, held + 1))
    prefill(service, spec, first, [])
    shared = min(shared, held - 1)
    branch = first[:shared] + tuple(range(1000, 1000 + 8 + sum(gaps)))  # leaves ``first`` after ``shared``
    ends = [sum(gaps[:i + 1]) for i in range(len(gaps))]
    prefill(service, spec, branch, ends, say_next=True)
    following = ends[1:] + [len(branch)]
    last_before = [end for end, after in zip(ends, following) if end <= shared < after]
    assert kept_snapshots(service) == sorted(last_before + [held, len(branch)])
    assert service.report().snapshots_passed_up == len(ends) - len(last_before)


def test_next_chunk_for_a_publish_that_is_not_a_chunk_is_refused_and_changes_nothing():
    spec = hybrid(PER_TOKEN)
    service = KvCacheService.simulated(spec, ram_bytes=1 << 30, block_tokens=4)
    prompt = tuple(range(1, 13))
    request = Request(prompt, 1)
    service.acquire(request, "n")
    before = service.state
    with pytest.raises(InvalidRequest, match="not a chunk"):
        service.publish(request, "n", prompt[:8], SimCaches(prompt[:8], spec), next_chunk=prompt[8:])
    assert service.state == before
    assert service.publish(request, "n", prompt[:8], SimCaches(prompt[:8], spec), chunk=True, next_chunk=prompt[8:])


def test_a_pure_recurrent_models_chunk_states_are_guesses_too_unless_a_held_prompt_goes_past_them():
    spec = ModelSpec("recurrent", (LayerSpec(LayerKind.RECURRENT, state_bytes=1000),), 4096)
    service = KvCacheService.simulated(spec, ram_bytes=2000, block_tokens=4)  # room for two states
    prompt = tuple(range(1, 25))
    prefill(service, spec, prompt, [8])  # free RAM: the guess at 8 is kept, and the end
    assert sorted(e.length for e in service.state.entries.values()) == [8, 24]
    other = tuple(range(100, 124))
    prefill(service, spec, other, [8])  # RAM full: the guess is passed up; the end takes the room
    assert service.report().snapshots_passed_up == 1
    assert sorted(e.tokens for e in service.state.entries.values()) == [prompt, other]
    again = Request(prompt + (1,), 1)  # the first prompt used again: the other is the least recent
    assert service.acquire(again, "n").reused_tokens == len(prompt)
    service.release(again)
    branch = prompt[:16] + (7, 7)
    request = Request(branch, 1)
    service.acquire(request, "n")
    # The held prompt goes past 8: kept as any state, though RAM is full (the policy takes the other).
    assert service.publish(request, "n", branch[:8], SimCaches(branch[:8], spec), chunk=True)
    assert sorted(e.tokens for e in service.state.entries.values()) == sorted([prompt, branch[:8]])
