"""The radix tree answers what a naive scan of every entry answers, and stays persistent."""

import hypothesis.strategies as st
from hypothesis import given, settings

from kvstate.core.prefix_index import Node, PrefixIndex
from kvstate.core.tokens import WIDTH, Tokens, ids_of
from tests.reference import longest_usable, usable

plain_lists = st.lists(st.integers(0, 3), min_size=1, max_size=14).map(tuple)
#: Plain tuples (packed when compared) and packed Tokens, mixed: the index answers the same.
token_lists = st.one_of(plain_lists, plain_lists.map(Tokens))
operation = st.tuples(st.booleans(), st.sampled_from(["a", "b"]), token_lists, st.booleans())
#: Short runs, and long ones that grow and prune deep trees (short lists are hypothesis' favourite).
operations = st.one_of(st.lists(operation, max_size=10), st.lists(operation, min_size=20, max_size=60))


@settings(max_examples=300, deadline=None)
@given(operations, st.lists(token_lists, min_size=1, max_size=10))
def test_longest_usable_matches_a_naive_scan(ops, prompts):
    index, naive, history = PrefixIndex(), {}, []
    for insert, namespace, tokens, trimmable in ops:
        history.append((index, dict(naive)))
        key = (namespace, tokens)
        if insert:
            entry = len(history)
            index = index.insert(namespace, tokens, entry, trimmable)
            naive[key] = (entry, trimmable)
        elif key in naive:
            index = index.remove(namespace, tokens)
            del naive[key]
        assert len(index) == len(naive)
        for root in index.roots.values():
            assert_compact_and_counted(root, is_root=True)
    held = [(ns, t, trim) for (ns, t), (_, trim) in naive.items()]
    for namespace in ("a", "b"):
        for prompt in prompts:
            length, entry = index.longest(namespace, prompt)
            assert length == longest_usable(held, namespace, prompt)
            if length:
                tokens, trimmable = next((t, trim) for (ns, t), (e, trim) in naive.items()
                                         if e == entry and ns == namespace)
                assert usable(tokens, trimmable, prompt) >= length  # the entry named can serve it
                exact_untrimmable = any(ns == namespace and not trim and t == prompt[:length] for ns, t, trim in held)
                if exact_untrimmable:  # at equal reuse, state that needs no trim is preferred
                    assert tokens == prompt[:length]
            else:
                assert entry is None
            strict_prefixes = sorted((len(t), e, trim) for (ns, t), (e, trim) in naive.items()
                                     if ns == namespace and len(t) < len(prompt) and prompt[:len(t)] == t)
            assert sorted(index.prefixes_of(namespace, prompt)) == strict_prefixes
            assert index.exact(namespace, prompt) == naive.get((namespace, prompt), (None,))[0]
            assert index.extends(namespace, prompt) == any(ns == namespace and t[:len(prompt)] == prompt
                                                           for ns, t, _ in held)
    assert sorted((ns, t, e, trim) for ns, t, e, trim in index.items()) == \
        sorted((ns, t, e, trim) for (ns, t), (e, trim) in naive.items())
    # Old versions never change (persistence).
    for old, old_naive in history:
        assert {(ns, t) for ns, t, _, _ in old.items()} == set(old_naive)
        for (ns, t), (e, _) in old_naive.items():
            assert old.exact(ns, t) == e


def assert_compact_and_counted(node: Node, is_root: bool = False) -> tuple[int, int]:
    """Every node's counts of entries and trimmable entries at or below it are exact, and no node
    below the root is bare or a lone link (those are merged away). Returns the node's counts."""
    count, trim = int(node.entry is not None), int(node.entry is not None and node.trimmable)
    for first, child in node.children.items():
        assert child.label and ids_of(child.label[:WIDTH]) == (first,)
        below = assert_compact_and_counted(child)
        count, trim = count + below[0], trim + below[1]
    assert (node.count, node.trim_below) == (count, trim)
    if not is_root:
        assert node.entry is not None or len(node.children) >= 2
    if node.entry is None:
        assert not node.trimmable
    return count, trim


def test_exact_and_remove_of_missing_tokens():
    index = PrefixIndex().insert("n", (1, 2, 3), 7, True)
    assert index.exact("n", (1, 2, 3)) == 7
    assert index.exact("n", (1, 2)) is None
    assert index.exact("m", (1, 2, 3)) is None
    try:
        index.remove("n", (1, 2))
    except KeyError:
        pass
    else:
        raise AssertionError("removing tokens nobody holds must raise KeyError")


def test_one_token_is_always_left_to_compute():
    index = PrefixIndex().insert("n", (1, 2, 3), 1, True)
    assert index.longest("n", (1, 2, 3)) == (2, 1)
    exact_only = PrefixIndex().insert("n", (1, 2, 3), 1, False)
    assert exact_only.longest("n", (1, 2, 3)) == (0, None)
    assert exact_only.longest("n", (1, 2, 3, 4)) == (3, 1)
    assert exact_only.longest("n", (1, 2, 4, 4)) == (0, None)


def test_removing_a_trimmable_entry_above_exact_only_ones_leaves_no_trimmable_claim():
    index = (PrefixIndex().insert("n", (1, 2), 1, True).insert("n", (1, 2, 3), 2, False)
             .insert("n", (1, 2, 4), 3, False))
    assert index.longest("n", (1, 2, 5)) == (2, 1)
    index = index.remove("n", (1, 2))
    assert index.longest("n", (1, 2, 5)) == (0, None)
    assert index.longest("n", (1, 2, 3, 9)) == (3, 2)


def test_a_trimmed_reuse_names_the_trimmable_entry_below_an_exact_only_one():
    """The prompt ends inside an exact-only entry's tokens: only the longer trimmable entry can serve it."""
    index = PrefixIndex().insert("a", (1, 2, 3), 1, False).insert("a", (1, 2, 3, 4, 5), 2, True)
    assert index.longest("a", (1, 2, 3)) == (2, 2)
