"""Generation checkpoints written, replaced, resumed and forgotten (``core/checkpoints.py``). Each scenario
drives ``step`` by hand (``tests/core_driver.py``) and checks the exact counters, effects, replies and pins
that follow."""

import attrs
import pytest

from kvstate.core import events as ev
from kvstate.core.errors import CheckpointNotAllowed, InvalidRequest, TokensDoNotMatchCaches
from kvstate.core.replies import Acquired, Pending, Source
from kvstate.core.request import Continuation, Request
from kvstate.effects import completions as done
from kvstate.effects import effects as fx
from tests.core_driver import CORRUPT, checkpointing, tiered



def interrupted(core, continuation, tokens=(1, 2, 3)):
    """A generation of the prompt (1, 2) that checkpointed ``tokens`` durably, then was released
    unfinished: the checkpoint's meta."""
    lease, _, _ = core.acquire((1, 2), continuation=continuation)
    assert core(ev.Checkpoint(lease, 9, tokens, len(tokens), len(tokens) - 2, None, 5, 6)) is True
    meta = core.of(fx.WriteCheckpoint)[0].meta
    core(done.CheckpointWritten(meta.key, len(tokens), 6))
    core(ev.Release(lease, completed=False))
    return meta


def test_a_checkpoint_before_acquire_is_refused_as_such():
    core = checkpointing()
    request = Request((1, 2), 4, continuation=Continuation("k", 1))
    core(ev.Admit(1, request))
    with pytest.raises(CheckpointNotAllowed, match="before acquire"):
        core(ev.Checkpoint(1, 9, (1, 2, 3), 3, 1, None, 5, 6))


@pytest.mark.parametrize("tokens, covered, generated", [((1, 2, 3), 3, -1), ((1, 2, 3), 3, 2), ((1, 2, 3), 2, 1),
                                                         ((1, 9, 3), 3, 1)])


def test_a_checkpoint_must_be_the_prompt_plus_what_was_generated(tokens, covered, generated):
    core = checkpointing()
    lease, _, _ = core.acquire((1, 2), continuation=Continuation("k", 1))
    before = core.state
    with pytest.raises(TokensDoNotMatchCaches):
        core(ev.Checkpoint(lease, 9, tokens, covered, generated, None, 5, 6))
    assert core.state == before


def test_a_checkpoint_of_nothing_generated_yet_is_written_and_resumed():
    core = checkpointing()
    continuation = Continuation("k", 1)
    meta = interrupted(core, continuation, tokens=(1, 2))
    assert meta == fx.CheckpointMeta("n\x1f\x1fk", "n", 2, 0, None, 1, seed_was_explicit=False)
    lease, handle, reply = core.acquire((1, 2), continuation=continuation)
    assert reply == Pending(handle) and core.of(fx.ResumeCheckpoint) == [fx.ResumeCheckpoint(meta.key, handle)]
    reply = core(done.CheckpointResumed(handle, meta, (1, 2)))
    assert (reply.source, reply.resumed, reply.resumed_tokens) == (Source.CHECKPOINT, meta, (1, 2))
    assert core.counts() == {"misses": 1, "hits": 1, "checkpoints_written": 1, "resumes": 1,
                             "prefill_tokens_saved": 2, "bytes_written": 6}


def test_a_checkpoint_still_being_written_or_only_failed_is_not_resumed():
    core = checkpointing()
    continuation = Continuation("k", 1)
    lease, _, _ = core.acquire((1, 2), continuation=continuation)
    core(ev.Checkpoint(lease, 9, (1, 2, 3), 3, 1, None, 5, 6))
    key = core.of(fx.WriteCheckpoint)[0].meta.key
    core(ev.Release(lease, completed=False))
    _, _, reply = core.acquire((1, 2), continuation=continuation)   # pending only
    assert isinstance(reply, Acquired) and reply.source is Source.FRESH
    core(done.CheckpointFailed(key, done.FailureReason.NO_SPACE))
    assert (core.state.writes.count, core.state.writes.bytes) == (0, 0)
    _, _, reply = core.acquire((1, 2), continuation=continuation)   # failed only
    assert reply.source is Source.FRESH
    assert core.counts() == {"misses": 3, "failed_writes": 1}


def test_the_write_queue_bounds_checkpoints_too():
    core = tiered(checkpoint_every_tokens=1, write_queue_bytes=5)
    lease, _, _ = core.acquire((1, 2), continuation=Continuation("k", 1))
    assert core(ev.Checkpoint(lease, 9, (1, 2, 3), 3, 1, None, 5, 6)) is True       # exactly the queue
    assert core(ev.Checkpoint(lease, 10, (1, 2, 3, 4), 4, 2, None, 1, 2)) is False  # one byte over
    assert core.of(fx.DropPublished) == [fx.DropPublished(10)]
    assert (core.state.writes.count, core.state.writes.bytes) == (1, 5)
    assert core.counts() == {"misses": 1, "dropped_writes": 1}


def test_checkpoint_writes_settle_one_share_at_a_time():
    core = checkpointing()
    lease, _, _ = core.acquire((1, 2), continuation=Continuation("k", 1))
    core(ev.Checkpoint(lease, 9, (1, 2, 3), 3, 1, None, 6, 7))
    key = core.of(fx.WriteCheckpoint)[0].meta.key
    core(ev.Checkpoint(lease, 10, (1, 2, 3, 4), 4, 2, None, 6, 7))
    core(done.CheckpointWritten(key, 3, 7))
    record = core.state.checkpoints[key]
    assert (record.pending, record.pending_bytes, record.durable_tokens) == (1, 6, 3)
    assert (core.state.writes.count, core.state.writes.bytes) == (1, 6)
    core(done.CheckpointWritten(key, 4, 7))
    assert core.state.checkpoints[key].durable_tokens == 4 and core.state.writes.bytes == 0
    assert core.counts()["checkpoints_written"] == 2


def test_a_completed_generation_deletes_its_checkpoint_and_its_queued_writes():
    core = checkpointing()
    lease, _, _ = core.acquire((1, 2), continuation=Continuation("k", 1))
    core(ev.Checkpoint(lease, 9, (1, 2, 3), 3, 1, None, 6, 7))
    core(ev.Checkpoint(lease, 10, (1, 2, 3, 4), 4, 2, None, 6, 7))
    key = core.of(fx.WriteCheckpoint)[0].meta.key
    assert core.state.disk.bytes == 14                     # both files reserved while written
    core(ev.Release(lease, completed=True))
    assert core.of(fx.DeleteCheckpoint) == [fx.DeleteCheckpoint(key)]
    assert (core.state.writes.count, core.state.writes.bytes, core.state.disk.bytes) == (0, 0, 0)
    before = core.state
    core(done.CheckpointWritten(key, 3, 7))                 # the late completion of a deleted record
    assert core.state.checkpoints == before.checkpoints and core.state.writes.count == 0


@pytest.mark.parametrize("wrong", ["prompt_tokens", "generated_tokens", "tokens", "prefix", "key"])
def test_an_inconsistent_checkpoint_is_deleted_and_the_acquire_falls_back(wrong):
    core = checkpointing()
    continuation = Continuation("k", 1)
    meta = interrupted(core, continuation)
    _, handle, _ = core.acquire((1, 2), continuation=continuation)
    tokens = (1, 2, 3)
    if wrong == "prompt_tokens":
        meta = attrs.evolve(meta, prompt_tokens=1)
    elif wrong == "generated_tokens":
        meta, tokens = attrs.evolve(meta, prompt_tokens=4, generated_tokens=-1), (1, 2, 3)
    elif wrong == "tokens":
        tokens = (1, 2, 3, 4)
    elif wrong == "prefix":
        tokens = (1, 9, 3)
    else:
        meta = attrs.evolve(meta, key="another")
    reply = core(done.CheckpointResumed(handle, meta, tokens))
    assert reply.source is Source.FRESH
    assert core.of(fx.DropPublished)[0] == fx.DropPublished(handle)
    assert fx.DeleteCheckpoint("n\x1f\x1fk") in core.effects
    assert core.counts() == {"misses": 2, "checkpoints_written": 1, "rejected_files": 1, "bytes_written": 6}


def test_a_checkpoint_that_fails_to_read_is_deleted_and_the_acquire_falls_back():
    core = checkpointing()
    continuation = Continuation("k", 1)
    key = interrupted(core, continuation).key
    lease, handle, _ = core.acquire((1, 2), continuation=continuation)
    reply = core(done.ResumeFailed(key, handle, CORRUPT))
    assert reply == Acquired(lease, handle, 0, Source.FRESH)
    assert core.effects == (fx.DeleteCheckpoint(key), fx.MakeFresh(handle))  # the handle is the caller's still
    assert core.counts() == {"misses": 2, "checkpoints_written": 1, "rejected_files": 1, "bytes_written": 6}


def test_a_checkpoints_note_is_recorded_in_its_meta_and_answered_for_its_key_in_its_namespace_only():
    core = checkpointing()
    lease, _, _ = core.acquire((1, 2), continuation=Continuation("k", 1))
    assert core(ev.CheckpointNote("n", "k")) is None
    assert core(ev.Checkpoint(lease, 9, (1, 2, 3), 3, 1, None, 5, 6, note='{"a": 1}')) is True
    assert core.of(fx.WriteCheckpoint)[0].meta.note == '{"a": 1}'
    assert core(ev.CheckpointNote("n", "k")) == '{"a": 1}'      # answered while its file is written
    assert core(ev.CheckpointNote("other", "k")) is None        # another tenant's key of the same name
    assert core(ev.CheckpointNote("n", "k2")) is None
    core(ev.Release(lease, completed=True))                    # a completed generation keeps no checkpoint
    assert core(ev.CheckpointNote("n", "k")) is None


def test_a_checkpoint_found_by_a_scan_answers_its_files_note():
    core = checkpointing()
    meta = fx.CheckpointMeta("n\x1f\x1fk", "n", 2, 1, None, 1, False, note="fingerprint")
    core(done.Scanned(checkpoints=(done.SavedCheckpoint(meta, 3, 6),)))
    assert core(ev.CheckpointNote("n", "k")) == "fingerprint"


def test_a_note_that_is_not_text_is_refused_and_changes_nothing():
    core = checkpointing()
    lease, _, _ = core.acquire((1, 2), continuation=Continuation("k", 1))
    before = core.state
    with pytest.raises(InvalidRequest, match="note must be a string"):
        core(ev.Checkpoint(lease, 9, (1, 2, 3), 3, 1, None, 5, 6, note=b"x"))
    assert core.state == before


def test_a_checkpoint_nothing_resumed_within_the_keep_time_is_deleted_at_a_tick_and_counted():
    core = checkpointing(checkpoint_keep_s=60)
    continuation = Continuation("k", 1)
    meta = interrupted(core, continuation)              # written before the tick at 100, its generation gone
    core(ev.Tick(100.0))
    core(ev.Tick(159.0))
    assert meta.key in core.state.checkpoints and core.of(fx.DeleteCheckpoint) == []
    core(ev.Tick(160.0))
    assert core.of(fx.DeleteCheckpoint) == [fx.DeleteCheckpoint(meta.key)]
    assert meta.key not in core.state.checkpoints and core.state.disk.bytes == 0
    assert core.counts()["checkpoints_expired"] == 1


def test_a_running_or_just_resumed_generations_checkpoint_is_kept_past_the_keep_time():
    core = checkpointing(checkpoint_keep_s=60)
    continuation = Continuation("k", 1)
    meta = interrupted(core, continuation)
    core(ev.Tick(100.0))
    lease, handle, _ = core.acquire((1, 2), continuation=continuation)   # the retry resumes it before 150
    core(done.CheckpointResumed(handle, meta, (1, 2, 3)))
    core(ev.Tick(150.0))
    core(ev.Tick(500.0))                                                 # running: kept however long
    assert meta.key in core.state.checkpoints
    core(ev.Release(lease, completed=False))                             # gone again, untouched since 150
    core(ev.Tick(509.0))
    assert meta.key not in core.state.checkpoints and core.counts()["checkpoints_expired"] == 1


def test_a_checkpoint_found_at_start_waits_the_whole_keep_time_from_the_first_tick():
    core = checkpointing(checkpoint_keep_s=60)
    meta = fx.CheckpointMeta("n\x1f\x1fk", "n", 2, 1, None, 1, False)
    core(done.Scanned(checkpoints=(done.SavedCheckpoint(meta, 3, 6),)))
    core(ev.Tick(10.0 ** 6))                 # the first tick after the restart, on a clock of any origin
    core(ev.Tick(10.0 ** 6 + 59))
    assert meta.key in core.state.checkpoints
    core(ev.Tick(10.0 ** 6 + 60))
    assert meta.key not in core.state.checkpoints


def test_without_a_keep_time_an_interrupted_generations_checkpoint_stays():
    core = checkpointing()
    meta = interrupted(core, Continuation("k", 1))
    core(ev.Tick(10.0 ** 9))
    assert meta.key in core.state.checkpoints and "checkpoints_expired" not in core.counts()
