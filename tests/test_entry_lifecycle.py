"""The entry lifecycle table, walked exhaustively."""

import itertools

import pytest

from kvstate.core.state import LIFECYCLE, IllegalMove, Move, Residence, moved


@pytest.mark.parametrize("residence, move", list(itertools.product(Residence, Move)))
def test_every_pair_is_a_move_or_one_named_error(residence, move):
    if (residence, move) in LIFECYCLE:
        assert moved(residence, move) is LIFECYCLE[(residence, move)]
    else:
        with pytest.raises(IllegalMove, match=residence.value):
            moved(residence, move)


def test_every_residence_is_reachable_from_ram_and_every_path_can_end():
    reachable, frontier = {Residence.RAM}, [Residence.RAM]
    while frontier:
        here = frontier.pop()
        for (start, _), after in LIFECYCLE.items():
            if start is here and after is not None and after not in reachable:
                reachable.add(after)
                frontier.append(after)
    assert reachable == set(Residence)
    ends = {start for (start, _), after in LIFECYCLE.items() if after is None}
    assert {Residence.RAM, Residence.DISK} <= ends


def test_pinned_residences_have_only_their_completions():
    for pinned, completions in ((Residence.SPILLING, {Move.WRITTEN, Move.WRITE_FAILED}),
                                # a chain's read ahead may land and not be taken up (UNREAD): still its completion
                                (Residence.PREFETCHING, {Move.READ, Move.READ_FAILED, Move.READ_ERROR, Move.UNREAD})):
        assert {move for (start, move) in LIFECYCLE if start is pinned} == completions
