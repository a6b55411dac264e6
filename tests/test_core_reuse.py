"""Reuse for a caller that holds no lease (``Lookup``, ``core/reuse.py``): the longest reusable prefix,
from RAM or read from disk, counted as a hit or a miss, and nothing left held. Each scenario drives
``step`` by hand (``tests/core_driver.py``) and checks the exact effects and replies that follow."""

import pytest

from kvstate.core import events as ev
from kvstate.core.errors import InvalidNamespace
from kvstate.core.replies import Acquired, Pending, Source
from kvstate.core.tokens import Tokens
from kvstate.effects import completions as done
from kvstate.effects import effects as fx
from tests.core_driver import CORRUPT, Core, on_disk_only, tiered


def lookup(core, prompt, handle=50, namespace="n"):
    return core(ev.Lookup(Tokens(prompt), namespace, handle))


def test_a_lookup_clones_the_longest_ram_prefix_and_holds_no_lease():
    core = Core()
    kept = core.keep((1, 2, 3, 4)).entry
    assert lookup(core, (1, 2, 3, 9)) == Acquired(None, 50, 3, Source.RAM)
    assert core.effects == (fx.CloneEntry(kept, 3, 50),)
    assert lookup(core, (7, 8), handle=51) == Acquired(None, 51, 0, Source.FRESH)
    assert core.effects == (fx.MakeFresh(51),)
    assert core.counts() == {"kept": 1, "hits": 1, "misses": 1, "prefill_tokens_saved": 3}
    assert len(core.state.leases) == 0 and len(core.state.acquiring) == 0
    assert lookup(core, (1, 2, 3, 9), namespace="other", handle=52).source is Source.FRESH  # namespaces never mix


def test_a_lookup_reads_a_longer_prefix_from_disk_and_falls_back_to_ram_when_the_read_fails():
    core = tiered()
    saved = on_disk_only(core, (1, 2, 3, 4, 5, 6))
    core.keep((1, 2))
    assert lookup(core, (1, 2, 3, 4, 5, 6, 7)) == Pending(50)
    assert core.of(fx.RestoreEntry)[0].entry == saved and core.state.reading[saved] == 1
    assert core(done.RestoreDone(saved, 50)) == Acquired(None, 50, 6, Source.DISK)
    assert saved not in core.state.reading and len(core.state.acquiring) == 0
    assert core.counts()["restores"] == 1 and core.counts()["hits"] == 1
    assert lookup(core, (1, 2, 3, 4, 5, 6, 7), handle=51) == Pending(51)
    reply = core(done.RestoreFailed(saved, 51, CORRUPT))               # rejected: RAM's shorter prefix serves
    assert reply == Acquired(None, 51, 2, Source.RAM) and core.of(fx.CloneEntry)
    assert core.counts()["rejected_files"] == 1 and len(core.state.acquiring) == 0


def test_a_lookup_on_a_service_that_keeps_nothing_is_fresh_and_not_counted():
    core = Core(ram_capacity_bytes=0)
    assert lookup(core, (1, 2, 3)) == Acquired(None, 50, 0, Source.FRESH)
    assert core.counts() == {}


def test_a_lookup_in_a_namespace_that_is_not_one_is_refused_and_changes_nothing():
    core = Core()
    before = core.state
    with pytest.raises(InvalidNamespace):
        lookup(core, (1, 2, 3), namespace="a/b")
    assert core.state == before


def test_a_lookup_that_reads_a_file_after_an_io_error_ends_its_run_of_errors_and_counts_as_the_disks_use():
    core = tiered()
    saved = on_disk_only(core, (1, 2, 3, 4, 5, 6))
    assert lookup(core, (1, 2, 3, 4, 5, 6, 7)) == Pending(50)
    assert lookup(core, (1, 2, 3, 4, 5, 6, 7), handle=51) == Pending(51)  # a second reader, the first fails
    core(done.RestoreFailed(saved, 50, done.FailureReason.IO_ERROR))
    assert core.state.entries[saved].read_errors == 1
    assert core(done.RestoreDone(saved, 51)) == Acquired(None, 51, 6, Source.DISK)
    assert core.state.entries[saved].read_errors == 0               # a good read ends the run
