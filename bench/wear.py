"""Disk wear on a bundled trace: what each disk write rule writes and what it gives back, for a disk
admission rule chosen by measurement.

Replays the trace through the service (simulator, whole prefixes, LRU, RAM a fraction of the
working set, a disk tier) once per rule:

- ``ram only``: no disk tier, the floor;
- ``all``: every kept entry written when kept (write-behind, the default);
- ``idle T``: nothing written when kept; an entry idle for ``T`` seconds is written and leaves RAM
  (``write_behind=False``, ``demote_idle_after=T``);
- ``write idle T``: an entry is written once idle ``T`` seconds and stays in RAM, so what is
  superseded, dropped or evicted sooner is never written (``write_idle_after=T``);
- ``cap B/h``: every kept entry written when kept, within a write-rate cap of ``B`` bytes an hour
  (``write_bytes_per_hour``).

Prints each rule's token hit ratio, bytes written and read, write amplification, and how fast the
replay ran (requests a second: the clock's rules are decided at every request's tick). Then, from the
``all`` run, which kept entries were ever read back from disk (their bytes are the least any rule
that keeps every restore must write: an oracle's), and how much of that a rule that writes only
some entries could keep: entries whose own request reused a prefix, and entries hit in RAM before
they left it (the restores such a rule keeps, and the bytes it writes).

    python bench/wear.py [--trace interpreters/traces/conversation_trace.jsonl] [--ram 10%]
                         [--disk 2TB] [--idle 30,120,600] [--write-idle 10,30,60]
                         [--caps 0.73TB,2TB]
"""

from __future__ import annotations

import argparse

import kvstate.interpreters.service as facade
from kvstate.core import events as ev
from kvstate.core.replies import Acquired, Kept
from kvstate.effects import effects as fx
from kvstate.interpreters.lab.sweep import parse_capacity
from kvstate.interpreters.lab.traces import read
from kvstate.interpreters.lab.replay import replay, replay_service
from kvstate.interpreters.sizes import parse_bytes
from kvstate.models.catalogue import model_spec


class EntryLog:
    """Watches every step of the facade: per kept entry, whether its request reused a prefix, its
    file's bytes, its RAM hits and its restores from disk."""

    def __init__(self) -> None:
        self.entries: dict[int, dict] = {}
        self._lease_of: dict[int, int] = {}  # id of a live request -> its lease
        self._reused: dict[int, int] = {}    # lease -> tokens its acquire reused
        self._step = facade.step
        facade.step = self._observed

    def close(self) -> None:
        facade.step = self._step

    def _observed(self, state, event):
        result = self._step(state, event)
        if isinstance(event, ev.Acquire):
            self._lease_of[id(event.request)] = event.lease
        if isinstance(result.reply, Acquired):  # a disk hit answers in its read's completion
            self._reused[result.reply.lease] = result.reply.reused_tokens
        for effect in result.effects:
            known = self.entries.get(getattr(effect, "entry", None))
            if known is not None and isinstance(effect, fx.CloneEntry):
                known["ram_hits"] += 1
            if known is not None and isinstance(effect, fx.RestoreEntry):
                known["restores"] += 1
        if isinstance(event, ev.Publish) and isinstance(result.reply, Kept) and not result.reply.duplicate:
            lease = self._lease_of.get(id(event.request))
            self.entries[result.reply.entry] = {"request_reused": self._reused.get(lease, 0) > 0,
                                                "bytes": event.file_bytes, "ram_hits": 0, "restores": 0}
        return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trace", default="interpreters/traces/conversation_trace.jsonl")
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--ram", default="10%", help="RAM, as the lab's --capacity takes it")
    parser.add_argument("--disk", default="2TB")
    parser.add_argument("--idle", default="30,120,600", help="seconds idle before a write and demotion, one run each")
    parser.add_argument("--write-idle", default="10,30,60", help="seconds idle before a write (staying in RAM)")
    parser.add_argument("--caps", default="0.73TB,2TB", help="write-rate caps in bytes an hour, one run each")
    args = parser.parse_args()
    trace, model = read(args.trace), model_spec(args.model)
    ram = parse_capacity(args.ram, "bytes", trace, model).nbytes
    disk = parse_bytes(args.disk)
    rules = [("ram only", {"disk_bytes": None}), ("all", {"disk_bytes": disk})]
    rules += [(f"idle {t}s", {"disk_bytes": disk, "write_behind": False, "demote_idle_after": float(t)})
              for t in args.idle.split(",") if t]
    rules += [(f"write idle {t}s", {"disk_bytes": disk, "write_idle_after": float(t)})
              for t in args.write_idle.split(",") if t]
    rules += [(f"cap {c}/h", {"disk_bytes": disk, "write_bytes_per_hour": parse_bytes(c)})
              for c in args.caps.split(",") if c]
    print(f"{trace.name}: {len(trace.requests):,} requests; LRU, RAM {args.ram} of the working set "
          f"({ram / 1e9:.0f} GB), disk {args.disk}")
    print(f"{'rule':18} {'token hit':>9} {'written TB':>11} {'read TB':>8} {'wr/rd':>6} {'requests/s':>10}")
    log = None
    for name, options in rules:
        if name == "all":
            log = EntryLog()
        outcome = replay(trace.requests, replay_service(model, refuse_past_context=False, ram_bytes=ram,
                                                        policy="lru", **options))
        if name == "all":
            log.close()
        wa = outcome.write_amplification
        print(f"{name:18} {outcome.token_hit_ratio:>9.4f} {outcome.disk_bytes_written / 1e12:>11.3f} "
              f"{outcome.disk_bytes_read / 1e12:>8.3f} {'-' if wa is None else f'{wa:.1f}':>6} "
              f"{outcome.requests / outcome.seconds:>10,.0f}")
    entries = list(log.entries.values())
    restores = sum(e["restores"] for e in entries)
    total = sum(e["bytes"] for e in entries)
    print(f"\nof the 'all' run: {len(entries):,} entries kept ({total / 1e12:.2f} TB of files), "
          f"{sum(1 for e in entries if e['restores']):,} of them read back, {restores:,} restores")
    oracle = sum(e["bytes"] for e in entries if e["restores"])
    print(f"  an oracle writing only the entries read back writes {oracle / 1e12:.3f} TB: the least any rule "
          f"that keeps every restore writes")
    for name, chosen in (("its request reused a prefix", lambda e: e["request_reused"]),
                         ("hit in RAM before it left", lambda e: e["ram_hits"] > 0)):
        picked = [e for e in entries if chosen(e)]
        print(f"  write only entries where {name}: {sum(e['bytes'] for e in picked) / total:.1%} of the bytes, "
              f"{sum(e['restores'] for e in picked) / max(1, restores):.1%} of the restores")


if __name__ == "__main__":
    main()
