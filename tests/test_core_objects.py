"""Exact-key tensor objects under the prefixes' budget and tiers (``core/objects.py``). Each scenario drives
``step`` by hand (``tests/core_driver.py``) and checks the exact counters, effects, replies and pins that
follow."""

from kvstate.core import events as ev
from kvstate.core.replies import Kept, NotKept, NotKeptReason, ObjectFound, ObjectMissing, Source
from kvstate.core.state import OBJECTS
from kvstate.effects import completions as done
from kvstate.effects import effects as fx
from tests.core_driver import CORRUPT, Core, tiered


def test_objects_read_from_disk_are_pinned_per_reader_counted_and_never_prefixes():
    core = tiered(ram_capacity_bytes=10)
    assert core(ev.ObjectPut("weights", 1, 10, 10)) == Kept(1)
    assert not core.of(fx.NotifyKept)                          # observers hear of prefixes only
    assert core.of(fx.SpillEntry)[0].trimmable is False         # an object is never trimmed
    core.settle_writes()
    core(ev.Boundary(pressure=True))
    core(ev.ObjectGet("weights", 2))
    core(ev.ObjectGet("weights", 3))
    assert core.state.reading[1] == 2
    assert core(done.RestoreDone(1, 2)) == ObjectFound(2, Source.DISK)
    assert core.state.reading[1] == 1
    assert core(done.RestoreFailed(1, 3, CORRUPT)) == ObjectMissing()
    assert 1 not in core.state.reading
    assert core.counts() == {"kept": 1, "spills": 1, "demotions": 1, "object_hits": 1, "object_restores": 1,
                             "object_misses": 1, "rejected_files": 1, "bytes_written": 10,
                             "bytes_read": 10}


def test_an_object_read_from_disk_refreshes_the_disk_policy():
    core = tiered(ram_capacity_bytes=10, disk_capacity_bytes=20)
    for handle, key in enumerate(("a", "b")):
        core(ev.ObjectPut(key, handle, 10, 10))
        core.settle_writes()
        core(ev.Boundary(pressure=True))
    core(ev.ObjectGet("a", 7))
    core(done.RestoreDone(1, 7))
    core(ev.ObjectPut("c", 8, 10, 10))                 # disk LRU: "b" was used longest ago
    assert core.of(fx.DeleteFile) == [fx.DeleteFile(fx.DiskKey(OBJECTS, tuple(b"b")))]


def test_an_object_put_needs_ram_and_fits_the_smallest():
    assert Core(ram_capacity_bytes=0)(ev.ObjectPut("k", 1, 0, 0)) == NotKept(NotKeptReason.TOO_LARGE)
    assert Core(ram_capacity_bytes=1)(ev.ObjectPut("k", 1, 1, 1)) == Kept(1)
