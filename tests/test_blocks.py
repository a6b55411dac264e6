"""The block table (``core/blocks.py``), model-checked against a naive reference: the set of every
held block prefix, as plain tuples of tokens.

Prompts are drawn from a bundle of earlier prompts, cut and extended, so chains share blocks and
diverge inside and at block boundaries. After every step: each block prefix is held at most once
(the table holds exactly the reference's blocks), every held block's parent is held, each block
counts exactly the held blocks that extend it, a chain's held length is the longest held block
prefix, and a block's tokens are its prefix's. Eviction takes leaves only; asking for a block that
another extends is a named error that changes nothing.
"""

from __future__ import annotations

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import Bundle, RuleBasedStateMachine, invariant, rule

from kvstate.core.blocks import BLOCK_TOKENS, BlockTable, NotALeaf, UnknownBlock, block_key, chain, namespace_key
from kvstate.core.tokens import packed

SIZE = 4  # tokens per block in the machine: small, so prompts span many blocks
NAMESPACES = ("a", "b")


def block_prefixes(prompt: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Every full-block prefix of ``prompt``, shortest first."""
    return [prompt[:end] for end in range(SIZE, len(prompt) + 1, SIZE)]


class BlockTableMachine(RuleBasedStateMachine):
    prompts = Bundle("prompts")

    def __init__(self):
        super().__init__()
        self.table = BlockTable()
        self.reference: set[tuple[str, tuple[int, ...]]] = set()  # (namespace, block prefix)

    @rule(target=prompts, tokens=st.lists(st.integers(0, 3), min_size=0, max_size=14).map(tuple))
    def new_prompt(self, tokens):
        return tokens

    @rule(target=prompts, base=prompts, cut=st.integers(0, 14), tail=st.lists(st.integers(0, 3), max_size=9))
    def extended_prompt(self, base, cut, tail):
        return base[:cut] + tuple(tail)

    @rule(prompt=prompts, namespace=st.sampled_from(NAMESPACES))
    def publish(self, prompt, namespace):
        before = {key for key in self.table.blocks}
        self.table, added = self.table.add(namespace, prompt, SIZE)
        new = [p for p in block_prefixes(prompt) if (namespace, p) not in self.reference]
        assert len(added) == len(new)                                   # only the blocks not held
        assert not set(added) & before
        self.reference |= {(namespace, p) for p in block_prefixes(prompt)}

    @rule(data=st.data())
    def evict_a_leaf(self, data):
        leaves = sorted(self.table.leaves(), key=lambda b: b.key)
        if not leaves:
            return
        leaf = data.draw(st.sampled_from(leaves))
        prefix = self.prefix_of(leaf.key)
        extended = [p for p in self.reference if p[0] == prefix[0] and len(p[1]) > len(prefix[1])
                    and p[1][:len(prefix[1])] == prefix[1]]
        assert not extended                                             # a leaf: nothing held extends it
        self.table = self.table.remove(leaf.key)
        self.reference.discard(prefix)

    @rule(data=st.data())
    def evicting_an_inner_block_is_refused(self, data):
        inner = sorted((b for b in self.table.blocks.values() if b.children), key=lambda b: b.key)
        if not inner:
            return
        block = data.draw(st.sampled_from(inner))
        before = self.table
        with pytest.raises(NotALeaf):
            self.table.remove(block.key)
        assert self.table == before

    @rule(prompt=prompts, namespace=st.sampled_from(NAMESPACES))
    def held_length_is_the_longest_held_block_prefix(self, prompt, namespace):
        keys = chain(namespace, prompt, SIZE)
        naive = 0
        for p in block_prefixes(prompt):
            if (namespace, p) not in self.reference:
                break
            naive += 1
        assert self.table.held(keys) == naive

    def prefix_of(self, key):
        block = self.table[key]
        return next(p for p in self.reference if len(p[1]) == (block.position + 1) * SIZE
                    and chain(p[0], p[1], SIZE)[-1] == key)

    @invariant()
    def each_block_prefix_is_held_once_and_nothing_else(self):
        keys = {chain(namespace, prefix, SIZE)[-1] for namespace, prefix in self.reference}
        assert len(keys) == len(self.reference)
        assert set(self.table.blocks) == keys

    @invariant()
    def parents_are_held_and_children_are_counted(self):
        for block in self.table.blocks.values():
            if block.parent is not None:
                assert block.parent in self.table
            assert block.children == sum(1 for other in self.table.blocks.values() if other.parent == block.key)

    @invariant()
    def a_block_holds_its_prefixs_tokens(self):
        for namespace, prefix in self.reference:
            key = chain(namespace, prefix, SIZE)[-1]
            assert self.table.tokens_of(key) == prefix
            assert self.table[key].position == len(prefix) // SIZE - 1


TestBlockTable = BlockTableMachine.TestCase
TestBlockTable.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


def test_two_prompts_that_agree_on_their_first_blocks_name_the_same_blocks_whatever_follows():
    a = tuple(range(2 * BLOCK_TOKENS)) + (7,) * 10
    b = tuple(range(2 * BLOCK_TOKENS)) + (8,) * 300
    assert chain("n", a)[:2] == chain("n", b)[:2] and len(chain("n", a)) == 2 and len(chain("n", b)) == 3
    assert chain("n", a) != chain("other", a)                       # namespaces never share a block
    assert chain("n", a)[0] == block_key(namespace_key("n"), packed(a[:BLOCK_TOKENS]))
    assert chain("n", a[:BLOCK_TOKENS - 1]) == ()                     # a partial block is not a block


def test_a_table_keeps_only_the_blocks_it_lacks_and_names_an_unknown_block():
    table, added = BlockTable().add("n", tuple(range(12)), 4)
    assert len(added) == 3 and len(table) == 3
    again, more = table.add("n", tuple(range(8)) + (9, 9, 9, 9, 1), 4)
    assert len(more) == 1 and len(again) == 4 and again[added[1]].children == 2
    with pytest.raises(UnknownBlock):
        table.remove(b"\0" * 16)
    with pytest.raises(ValueError):
        chain("n", (1, 2), 0)
    assert len(chain("n", (1, 2, 3), 1)) == 3                        # a block may hold a single token


def test_saved_chains_are_the_prefixes_whose_every_block_is_saved():
    from kvstate.core.blocks import block_names, saved_chains
    a, b, c = block_names("n", (1, 2, 3, 4, 5, 6), 2)
    d, = block_names("m", (7, 8), 2)
    assert sorted(saved_chains([a, b, c, d])) == [("m", (7, 8)), ("n", (1, 2)), ("n", (1, 2, 3, 4)),
                                                  ("n", (1, 2, 3, 4, 5, 6))]
    assert sorted(saved_chains([a, c])) == [("n", (1, 2))]          # c's parent is missing: no chain ends in it
    assert saved_chains([b, c]) == []                               # nor without the first block
    singles = block_names("n", (1, 2, 3), 1)                           # blocks of one token start at 0, 1, 2
    assert sorted(saved_chains(singles)) == [("n", (1,)), ("n", (1, 2)), ("n", (1, 2, 3))]
