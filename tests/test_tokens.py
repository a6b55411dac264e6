"""Packed token ids answer what the plain tuples answer: equality, hashing, prefixes, pickling."""

import pickle

import attrs
import hypothesis.strategies as st
import pytest
from hypothesis import given

from kvstate import InvalidRequest, KvCacheService, Request, model_spec
from kvstate.core.request import as_tokens
from kvstate.core.state import Entry
from kvstate.core.tokens import Tokens, common_prefix, ids_of, packed, starts_with

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
    assert ids_of(packed(values)) == values and len(packed(values)) == 8 * len(values)
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


def test_kept_state_holds_its_ids_packed_not_as_tuples_the_collector_scans():
    """An entry keeps its ids packed and a session its key packed: no tuple of ids stays in the
    state (CPython scans every new tuple of ints id by id before it stops tracking it, and never
    stops tracking a tuple subclass), and the simulator keeps its caches' content packed too."""
    spec = model_spec("llama-3.1-8b")
    service = KvCacheService.simulated(spec, ram_bytes=spec.bytes_for(10_000))
    prompts = [list(range(1000 * turn, 1000 * turn + 100)) for turn in range(3)]  # none a prefix of another
    for prompt in prompts:
        request = Request(prompt, 8, session_id="chat")
        state = service.acquire(request)
        service.publish(request, "default", prompt, service.interpreter.prefill(state.caches,
                                                                               prompt[state.reused_tokens:]))
        service.release(request)
    entries = sorted(service.state.entries.values(), key=lambda entry: entry.id)
    assert [entry.tokens for entry in entries] == [tuple(prompt) for prompt in prompts]
    for entry in entries:
        assert not any(isinstance(getattr(entry, field.name), tuple) for field in attrs.fields(Entry))
        assert entry.packed == packed(tuple(entry.tokens)) and entry.length == 100
        assert type(service.interpreter.ram_content(entry.id).packed) is bytes
    ((namespace, key),) = service.state.sessions.values()
    assert namespace == "default" and key == packed(tuple(prompts[-1]))


def test_publishing_the_prompts_own_tuple_reuses_its_packed_ids():
    prompt = tuple(range(50))
    request = Request(prompt, 4)
    assert request.prompt.ids is prompt
    assert as_tokens(prompt, known=request.prompt) is request.prompt
    assert as_tokens(list(prompt), known=request.prompt) == prompt  # an equal list: checked, same ids
