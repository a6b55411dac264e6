"""A request's ``cache_salt`` as a namespace: exact, valid for any salt, and never the salt's text."""

import pytest
from hypothesis import given, strategies as st

from kvstate.core.errors import KvStateError
from kvstate.core.state import check_namespace
from kvstate.interpreters.serving.tenants import BadCacheSalt, salt_namespace

salts = st.text(st.characters(blacklist_categories=("Cc", "Cs")), min_size=1, max_size=256)


@given(salts, salts)
def test_salts_share_a_namespace_exactly_when_they_are_the_same_text(a, b):
    assert (salt_namespace(a) == salt_namespace(b)) == (a == b)


@given(salts)
def test_every_salt_makes_a_valid_namespace_that_does_not_hold_it(salt):
    namespace = salt_namespace(salt)
    assert check_namespace(namespace) == namespace and namespace != "default"
    assert len(salt) < 8 or salt not in namespace


@pytest.mark.parametrize("near", ["Tenant", " tenant", "tenant ", "te\u0301nant", "t\u00e9nant"])
def test_case_whitespace_and_normal_form_make_different_tenants(near):
    assert salt_namespace(near) != salt_namespace("tenant")


@pytest.mark.parametrize("salt", [None, 3, 2.5, b"bytes", ["a"], "", "x" * 257, "a\nb", "a\x00b", "\ud800"])
def test_a_bad_salt_is_refused_by_name(salt):
    with pytest.raises(BadCacheSalt) as raised:
        salt_namespace(salt)
    assert isinstance(raised.value, KvStateError) and "cache_salt" in str(raised.value)
