"""RAM blocks held as views of one array a layer (the MLX interpreter, real caches, the reference
llama): a conversation's chain is one backing, and a hit on it hands the loop a view of it, not a
copy; a branch, an eviction and a superseded partial block leave every block equal to what was
published and each token held once, no backing holding more than its slack for no block; and the
generation loop's writes into a hit's caches never reach the blocks they came from."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mlx_lm.models.cache import make_prompt_cache

from kvstate import KvCacheService, Request, Source
from kvstate.core.tokens import ids_of
from kvstate.interpreters.mlx import block_views
from kvstate.models.reference import build
from tests.test_mlx_block_store import last_logits, turn

SIZE = 16
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def llama():
    return build("llama", seed=11)


def service_for(model, config, ram_bytes=8 << 20):
    return KvCacheService.for_mlx(model, ram_bytes=ram_bytes, config=config, block_tokens=SIZE)


def ram_blocks(service):
    return {e.id: e for e in service.state.entries.values() if e.is_block and e.id in service.interpreter.ram_entries()}


def assert_held_once_as_published(service, model):
    """Every RAM block is in at most one backing, each backing holds at most its slack for no block,
    and every block holds its tokens' keys and values (a fresh prefill's, to float tolerance)."""
    seen: set[int] = set()
    blocks = ram_blocks(service)
    for backing in service.interpreter.ram_backings():
        assert not set(backing.members) & seen and set(backing.members) <= set(blocks)
        seen |= set(backing.members)
        assert 0 <= backing.unheld <= block_views.SLACK
    for entry in blocks.values():
        want = make_prompt_cache(model)
        last_logits(model, ids_of(entry.packed), want)
        for layer, cache in zip(service.interpreter.ram_caches(entry.id), want):
            for name in ("keys", "values"):
                got, expected = layer[name], getattr(cache, name)[..., entry.start:entry.length, :]
                assert got.shape == expected.shape
                assert float(mx.abs(got - expected).max()) <= TOLERANCE


def assert_recomputed(model, prompt, logits):
    want = last_logits(model, prompt, make_prompt_cache(model))
    assert float(mx.abs(logits - want).max()) <= TOLERANCE


def test_a_conversation_is_one_backing_and_a_hit_on_it_is_a_view_not_a_copy(llama):
    model, config = llama
    service = service_for(model, config)
    prompt: tuple[int, ...] = ()
    for step in range(5):
        prompt = prompt + tuple(range(20 + 13 * step, 33 + 13 * step))  # 13 tokens a turn: partial blocks
        state, logits = turn(service, model, prompt)
        assert_recomputed(model, prompt, logits)
        (backing,) = service.interpreter.ram_backings()
        assert set(backing.members) == set(ram_blocks(service))  # the superseded partial blocks are gone
        assert_held_once_as_published(service, model)
        if step:
            assert state.source is Source.RAM and state.reused_tokens == len(prompt) - 13
    request = Request(prompt, 4)
    state = service.acquire(request, "n")
    (backing,) = service.interpreter.ram_backings()
    held = [np.asarray(array) for layer in backing.layers for array in layer.values()]
    handed = [np.asarray(a) for c in state.caches for a in (c.keys, c.values)]
    assert state.reused_tokens == len(prompt) - 1
    assert all(np.shares_memory(h, a) for h, a in zip(held, handed))
    service.release(request)
    service.close()


def test_the_loops_writes_into_a_hit_never_reach_the_blocks(llama):
    model, config = llama
    service = service_for(model, config)
    prompt = tuple(range(1, 2 * SIZE + 6))
    turn(service, model, prompt)
    before = {entry: [{n: mx.array(a) for n, a in layer.items()} for layer in service.interpreter.ram_caches(entry)]
              for entry in ram_blocks(service)}
    request = Request(prompt[:SIZE + 3] + (250, 251, 252), 4)
    state = service.acquire(request, "n")
    assert state.reused_tokens == SIZE + 3
    for _ in range(3):  # the loop's updates write into the caches it was handed
        last_logits(model, (7, 8, 9), state.caches)
    service.release(request)
    for entry, layers in before.items():
        for kept, now in zip(layers, service.interpreter.ram_caches(entry)):
            assert all(mx.array_equal(kept[name], now[name]) for name in kept)
    service.close()


@pytest.mark.parametrize("slack", [0, block_views.SLACK], ids=["no-slack", "a-step"])
def test_a_branch_keeps_both_chains_as_published_each_token_once(llama, monkeypatch, slack):
    """With no slack the first chain's backing keeps its other blocks, so the branch's own blocks get
    a backing of their own; with a step's slack the shared blocks move onto the branch's arrays and
    the first chain's own blocks are copied out. Either way both continue as a recompute."""
    monkeypatch.setattr(block_views, "SLACK", slack)
    model, config = llama
    service = service_for(model, config)
    first = tuple(range(1, 3 * SIZE + 6))
    branch = first[:2 * SIZE + 3] + (200, 201, 202, 203)  # diverges inside the third block
    turn(service, model, first)
    state, logits = turn(service, model, branch)
    assert state.reused_tokens == 2 * SIZE + 3
    assert_recomputed(model, branch, logits)
    assert_held_once_as_published(service, model)
    assert len(service.interpreter.ram_backings()) == (2 if slack == 0 else 1)
    for prompt in (first, branch):
        request = Request(prompt + (9,), 4)
        state = service.acquire(request, "n")
        assert state.reused_tokens == len(prompt)
        assert_recomputed(model, prompt + (9,), last_logits(model, (9,), state.caches))
        service.release(request)
    service.close()


def test_an_eviction_past_the_slack_copies_the_rest_out_and_frees_the_backing(llama, monkeypatch):
    monkeypatch.setattr(block_views, "SLACK", 0)
    model, config = llama
    probe = service_for(model, config)
    turn(probe, model, tuple(range(1, SIZE + 1)))
    per_block = probe.state.ram.bytes
    probe.close()
    service = service_for(model, config, ram_bytes=4 * per_block)  # room for four blocks
    first = tuple(range(1, 4 * SIZE + 1))  # four blocks, one backing
    turn(service, model, first)
    assert len(service.interpreter.ram_backings()) == 1
    other = tuple(range(100, 100 + 2 * SIZE))  # two blocks more than fit: two of the first chain's leaves go
    turn(service, model, other)
    held = ram_blocks(service)
    assert sorted((e.namespace, e.start) for e in held.values() if e.start < 4 * SIZE and ids_of(e.packed)[0] == 1) == [
        ("n", 0), ("n", SIZE)]
    # The first chain's backing lost a block: its other blocks were copied out, it went.
    assert all(not set(b.members) & {e.id for e in held.values() if ids_of(e.packed)[0] == 1}
               for b in service.interpreter.ram_backings())
    assert_held_once_as_published(service, model)
    request = Request(first, 4)
    state = service.acquire(request, "n")
    assert state.reused_tokens == 2 * SIZE
    assert_recomputed(model, first, last_logits(model, first[2 * SIZE:], state.caches))
    service.release(request)
    service.close()


def test_two_conversations_on_one_system_prompt_each_stay_in_at_most_two_backings(llama, monkeypatch):
    """The shared prompt stays in one chain's backing; each conversation's own blocks move onto its
    latest publish (a copy of its own positions), so a hit joins two views, however many turns. (A
    block's slack here, as in production: a step of mlx-lm's caches is one block of 256.)"""
    monkeypatch.setattr(block_views, "SLACK", SIZE)
    model, config = llama
    service = service_for(model, config)
    system = tuple(range(1, 2 * SIZE + 1))
    prompts = {0: system, 1: system}
    for step in range(4):
        for who in (0, 1):
            prompts[who] = prompts[who] + tuple(range(40 + 100 * who + 11 * step, 51 + 100 * who + 11 * step))
            state, logits = turn(service, model, prompts[who])
            assert_recomputed(model, prompts[who], logits)
            assert_held_once_as_published(service, model)
    backing_of = {entry: i for i, backing in enumerate(service.interpreter.ram_backings()) for entry in backing.members}
    for who in (0, 1):
        chain = [e for e in ram_blocks(service).values() if prompts[who][:e.length] == ids_of(e.packed)]
        assert len({backing_of.get(e.id, ("own", e.id)) for e in chain}) <= 2
        assert len(chain) == len(prompts[who]) // SIZE + 1  # every full block and the partial last one in RAM
    service.close()


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(steps=st.lists(st.tuples(st.sampled_from(["extend", "branch"]), st.integers(0, 2), st.integers(1, 40),
                                st.integers(0, 10**6)), min_size=1, max_size=8))
def test_any_mix_of_turns_branches_and_evictions_keeps_every_block_once_and_as_published(llama, steps):
    """Random turns of three conversations, branches cut anywhere in one, and a RAM budget of six
    blocks (so evictions come): after each, every block is in at most one backing, no backing holds
    more than a step for no block (a block here, as in production), every block holds its tokens'
    keys and values, and the turn continued as a recompute."""
    model, config = llama
    saved, block_views.SLACK = block_views.SLACK, SIZE
    try:
        probe = service_for(model, config)
        turn(probe, model, tuple(range(1, SIZE + 1)))
        per_block = probe.state.ram.bytes
        probe.close()
        service = service_for(model, config, ram_bytes=6 * per_block)
        prompts = {who: tuple(range(1 + 50 * who, 9 + 50 * who)) for who in range(3)}
        for kind, who, n, seed in steps:
            prompt = prompts[who]
            if kind == "branch":
                prompt = prompt[:seed % len(prompt) + 1]
            prompts[who] = prompt + tuple((seed + 7 * i) % 200 + 1 for i in range(n))
            _, logits = turn(service, model, prompts[who])
            assert_recomputed(model, prompts[who], logits)
            assert_held_once_as_published(service, model)
        service.close()
    finally:
        block_views.SLACK = saved
