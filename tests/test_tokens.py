"""Packed token ids answer what the plain tuples answer: equality, hashing, prefixes, pickling."""

import pickle

import hypothesis.strategies as st
import pytest
from hypothesis import given

from kvstate import InvalidRequest, Request
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
