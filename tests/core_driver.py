"""The pure core driven by hand: events in, the last reply and effects kept for the checks, for the
scenarios of the core's scenario files (``tests/test_core_requests.py`` and its siblings), each of
which reaches one transition on purpose."""

import itertools

from kvstate.core import events as ev
from kvstate.core.replies import GaveBack
from kvstate.core.request import Request
from kvstate.core.state import Residence, ServiceConfig, initial_state
from kvstate.core.transitions import step
from kvstate.effects import completions as done
from kvstate.effects import effects as fx
from kvstate.models import model_spec

SPEC = model_spec("llama-3.2-1b")
R = Residence
CORRUPT = done.FailureReason.CORRUPT


class Core:
    """The pure core, driven by hand: events in; the last reply and effects kept for the checks."""

    def __init__(self, **options):
        self.state = initial_state(ServiceConfig(**{"model": SPEC, "ram_capacity_bytes": 100, **options}))
        self.handles = itertools.count(1000)
        self.leases = itertools.count(1)
        self.effects: tuple = ()

    def __call__(self, event):
        result = step(self.state, event)
        self.state, self.effects = result.state, result.effects
        return result.reply

    def keep(self, tokens, nbytes=10, trimmable=True, session=None, namespace="n", file_bytes=None):
        """Publish ``tokens`` as a request would after prefill (its file as large as its state unless
        ``file_bytes`` says otherwise); the reply."""
        request = Request(tokens, 1, session_id=session)
        return self(ev.Publish(request, namespace, tuple(tokens), next(self.handles), len(tokens), nbytes,
                               trimmable, nbytes if file_bytes is None else file_bytes))

    def acquire(self, prompt, session=None, namespace="n", continuation=None):
        """Acquire for a new request; ``(lease, handle, reply)``."""
        lease, handle = next(self.leases), next(self.handles)
        request = Request(prompt, 4, session_id=session, continuation=continuation)
        return lease, handle, self(ev.Acquire(lease, request, namespace, handle))

    def settle_writes(self):
        """Complete every spill the last step started."""
        for effect in [e for e in self.effects if isinstance(e, fx.SpillEntry)]:
            self(done.SpillDone(effect.entry))

    def counts(self):
        """The counters that are not zero."""
        return {name: value for name, value in self.state.counters._asdict().items() if value}

    def residence(self, entry):
        return self.state.entries[entry].residence if entry in self.state.entries else None

    def of(self, kind):
        return [e for e in self.effects if isinstance(e, kind)]


def on_disk_only(core, tokens, nbytes=10, trimmable=True, session=None):
    """An entry kept, written to disk and then given back from RAM: disk-only. Its id."""
    entry = core.keep(tokens, nbytes, trimmable, session).entry
    core.settle_writes()
    assert core(ev.Boundary(pressure=True)) == GaveBack(1, nbytes)
    assert core.residence(entry) is R.DISK
    return entry


def tiered(**options):
    return Core(**{"disk_capacity_bytes": 1000, **options})


def checkpointing(**config):
    return tiered(checkpoint_every_tokens=1, **config)
