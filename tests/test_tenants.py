"""A request's ``cache_salt`` as a namespace: exact, valid for any printable salt, keyed by the
deployment's secret, and never the salt's text."""

import os
import stat

import pytest
from hypothesis import given, strategies as st

from kvstate.core.errors import KvStateError
from kvstate.core.state import check_namespace
from kvstate.interpreters.serving.tenants import SALT_KEY_FILE, BadCacheSalt, salt_key, salt_namespace

KEY = bytes(range(32))
salts = st.text(st.characters(blacklist_categories=("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp")), min_size=1,
                max_size=256).filter(lambda s: s.isprintable() and s.strip())


@given(salts, salts)
def test_salts_share_a_namespace_exactly_when_they_are_the_same_text(a, b):
    assert (salt_namespace(a, KEY) == salt_namespace(b, KEY)) == (a == b)


@given(salts)
def test_every_salt_makes_a_valid_namespace_that_does_not_hold_it(salt):
    namespace = salt_namespace(salt, KEY)
    assert check_namespace(namespace) == namespace and namespace != "default"
    assert len(salt) < 8 or salt not in namespace


@pytest.mark.parametrize("near", ["Tenant", " tenant", "tenant ", "te\u0301nant", "t\u00e9nant"])
def test_case_whitespace_and_normal_form_make_different_tenants(near):
    assert salt_namespace(near, KEY) != salt_namespace("tenant", KEY)


def test_a_salts_namespace_cannot_be_made_without_the_deployments_key():
    assert salt_namespace("tenant-a", KEY) != salt_namespace("tenant-a", bytes(32))


@pytest.mark.parametrize("salt", [None, 3, 2.5, b"bytes", ["a"], "", "x" * 257, "a\nb", "a\x00b", "\ud800",
                                  "   ", "a\u200bb", "\ue000", "a\u2028b", "a\u00a0b", "\u0378"])
def test_a_salt_that_is_not_printable_text_is_refused_by_name(salt):
    with pytest.raises(BadCacheSalt) as raised:
        salt_namespace(salt, KEY)
    assert isinstance(raised.value, KvStateError) and "cache_salt" in str(raised.value)


def test_the_salt_key_is_made_once_owner_only_under_the_disk_root_and_kept(tmp_path):
    key = salt_key(tmp_path)
    path = tmp_path / SALT_KEY_FILE
    assert len(key) == 32 and stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert salt_key(tmp_path) == key                       # a restart names the same tenants alike
    assert salt_key(None) != salt_key(None)                # without a disk tier, a key of the process alone
