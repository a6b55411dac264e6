"""Bundled request traces (Mooncake FAST'25, Apache-2.0; see README.md and the licence here)."""

from importlib.resources import files


def bundled(name: str = "conversation_trace.jsonl"):
    """The path of a bundled trace file."""
    return files(__name__) / name
