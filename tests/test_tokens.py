"""Packed token ids answer what the plain tuples answer: equality, hashing, prefixes, pickling."""

import gc
import pickle

import hypothesis.strategies as st
import pytest
from hypothesis import given

from kvstate import InvalidRequest, KvCacheService, Request, model_spec
from kvstate.core.request import as_tokens
from kvstate.core.tokens import Tokens, common_prefix, packed, starts_with, unpacked

ids = st.lists(st.sampled_from([0, 1, 2, 255, 256, 2**32, 2**64 - 1]), max_size=12).map(tuple)
either = st.one_of(ids, ids.map(Tokens))


def naive_common_prefix(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@given(either, either)
def test_comparisons_match_the_tuples(a, b):
    assert common_prefix(a, b) == naive_common_prefix(a, b)
    assert starts_with(a, b) == (tuple(a[:len(b)]) == tuple(b))
    assert (a == b) == (tuple(a) == tuple(b)) and (a != b) == (tuple(a) != tuple(b))
    if a == b:
        assert hash(a) == hash(b)


@given(ids)
def test_packing_round_trips_and_pickles(values):
    tokens = Tokens(values)
    assert tokens == values and hash(tokens) == hash(values) and tokens[1:] == values[1:]
    assert unpacked(packed(values)) == values and len(packed(values)) == 8 * len(values)
    copy = pickle.loads(pickle.dumps(tokens))
    assert type(copy) is Tokens and copy == tokens and copy.packed == tokens.packed


def test_a_request_packs_its_prompt_once_and_a_publish_extends_it():
    request = Request([5, 6, 7], 4)
    assert type(request.prompt) is Tokens and request.prompt.packed == packed((5, 6, 7))
    assert as_tokens(request.prompt) is request.prompt
    assert as_tokens((5, 6, 7), known=request.prompt) is request.prompt
    longer = as_tokens([5, 6, 7, 8], known=request.prompt)
    assert longer == (5, 6, 7, 8) and longer.packed == packed((5, 6, 7, 8))


@pytest.mark.parametrize("bad", [[2**64], [3, -1], [1.5], "abc", []])
def test_ids_outside_64_bits_are_refused(bad):
    with pytest.raises(InvalidRequest):
        Request(bad, 4)


def test_kept_state_holds_plain_tuples_the_collector_stops_tracking():
    """What the state keeps for long is a plain tuple (and bytes), never a Tokens: CPython stops
    tracking a plain tuple of ints, not a tuple subclass, and a full collection over many kept
    entries would otherwise visit every id of every one."""
    spec = model_spec("llama-3.1-8b")
    service = KvCacheService.simulated(spec, ram_bytes=spec.bytes_for(10_000))
    for turn in range(3):
        prompt = list(range(1000 * turn, 1000 * turn + 100))  # three prompts, none a prefix of another
        request = Request(prompt, 8, session_id="chat")
        state = service.acquire(request)
        service.publish(request, "default", prompt, service.interpreter.prefill(state.caches,
                                                                               prompt[state.reused_tokens:]))
        service.release(request)
    gc.collect()
    entries = list(service.state.entries.values())
    assert len(entries) == 3
    for entry in entries:
        assert type(entry.tokens) is tuple and not gc.is_tracked(entry.tokens)
        assert entry.packed == packed(entry.tokens)
    ((namespace, key),) = service.state.sessions.values()
    assert namespace == "default" and type(key) is bytes and key == packed(tuple(range(2000, 2100)))
