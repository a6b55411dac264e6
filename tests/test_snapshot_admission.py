"""Chunk snapshots are kept where they are worth their bytes: a snapshot offered mid-prefill holds no
more bytes than the attention state of the tokens it saves over the snapshot held before it on its
chain. Checked on the simulator against the rule computed here, over random chunk positions and
state sizes; snapshots at the end of a prompt are always kept."""

from __future__ import annotations

import attrs
import hypothesis.strategies as st
from hypothesis import given, settings

from kvstate import KvCacheService, LayerKind, LayerSpec, ModelSpec, Request, SimCaches
from kvstate.core import events as ev
from kvstate.core.replies import Kept
from tests.core_driver import Core

KV_HEADS, HEAD_DIM = 1, 4
PER_TOKEN = 2 * KV_HEADS * HEAD_DIM * 2  # one attention layer, keys and values, 2-byte elements


def hybrid(state_bytes: int) -> ModelSpec:
    return ModelSpec(f"hybrid-{state_bytes}", (LayerSpec(LayerKind.RECURRENT, state_bytes=state_bytes),
                                              LayerSpec(LayerKind.FULL_ATTENTION, kv_heads=KV_HEADS, head_dim=HEAD_DIM)),
                     4096)


def prefill(service, spec, prompt, ends):
    """A prefill that offers a chunk snapshot at each of ``ends`` and a snapshot at its end."""
    request = Request(prompt, 1)
    service.acquire(request, "n")
    for end in ends:
        service.publish(request, "n", prompt[:end], SimCaches(prompt[:end], spec), chunk=True)
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
