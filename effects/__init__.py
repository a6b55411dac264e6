"""The vocabulary between the core and the interpreters.

Effects say what must happen to tensors and files; completion events say how
it went. Both are small frozen values, one line of doc each.
"""

from kvstate.effects.effects import (
    AdoptPublished, CloneEntry, DeleteCheckpoint, DeleteFile, DiskKey, DropEntry, DropPublished, Effect,
    MakeFresh, NotifyKept, PrefetchBlocks, PrefetchEntry, RestoreEntry, ResumeCheckpoint, SettleReadAhead,
    SpillEntry, Sync, WriteCheckpoint, CheckpointMeta,
)
from kvstate.effects.completions import (
    BlocksPrefetched, CheckpointFailed, CheckpointResumed, CheckpointWritten, Completion, FailureReason,
    PrefetchDone, PrefetchFailed, RestoreDone, RestoreFailed, ResumeFailed, SavedCheckpoint, SavedRecord, Scanned,
    SpillDone, SpillFailed, Synced,
)

__all__ = [
    "AdoptPublished", "CloneEntry", "DeleteCheckpoint", "DeleteFile", "DiskKey", "DropEntry", "DropPublished",
    "Effect", "MakeFresh", "NotifyKept", "PrefetchBlocks", "PrefetchEntry", "RestoreEntry", "ResumeCheckpoint",
    "SettleReadAhead", "SpillEntry", "Sync", "WriteCheckpoint", "CheckpointMeta",
    "BlocksPrefetched", "CheckpointFailed", "CheckpointResumed", "CheckpointWritten", "Completion", "FailureReason",
    "PrefetchDone", "PrefetchFailed", "RestoreDone", "RestoreFailed", "ResumeFailed", "SpillDone",
    "SpillFailed", "Synced", "SavedCheckpoint", "SavedRecord", "Scanned",
]
