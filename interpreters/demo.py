"""``kvstate demo``: the reference scheduler on a tiny model over a seeded multi-turn chat.

Honest about what it is: random weights on the CPU, so the tokens mean
nothing and the timings are this machine's. What it shows is the service at
work: later turns of a conversation reuse the state of earlier ones (from RAM,
or from disk after the RAM tier evicted it), and their time to first token
drops with it.
"""

from __future__ import annotations

import random
import statistics
import tempfile

import attrs

from kvstate.core.request import Continuation, Request
from kvstate.interpreters.scheduler import Scheduler
from kvstate.interpreters.service import KvCacheService
from kvstate.models.reference import VOCAB, build


def workload(seed: int, sessions: int, turns: int, system_tokens: int):
    """``(session, turn, prompt)`` rounds: one shared system prompt, each turn resends the conversation."""
    rng = random.Random(seed)
    system = tuple(rng.randrange(VOCAB) for _ in range(system_tokens))
    conversations = {s: system for s in range(sessions)}
    for turn in range(turns):
        round_ = []
        for s in range(sessions):
            conversations[s] += tuple(rng.randrange(VOCAB) for _ in range(rng.randint(20, 60)))
            round_.append((s, turn, conversations[s]))
        yield round_


def run_demo(model_name: str = "llama", seed: int = 0, sessions: int = 3, turns: int = 4,
             system_tokens: int = 400, max_tokens: int = 24, print_=print) -> dict:
    model, config = build(model_name, seed=seed)
    print_(f"kvstate demo: the reference scheduler on a tiny random-weight {model_name} (CPU, float32).")
    print_("The tokens mean nothing; the reuse and the time to first token are real.\n")
    with tempfile.TemporaryDirectory(prefix="kvstate-demo-") as directory:
        probe = KvCacheService.for_mlx(model, config=config, ram_bytes=1)
        ram = probe.config.model.bytes_for(system_tokens + 200) * 2  # room for about two conversations
        service = KvCacheService.for_mlx(model, config=config, ram_bytes=ram, disk_dir=directory,
                                         disk_bytes=256 << 20, kv_budget_bytes=64 << 20,
                                         checkpoint_every_tokens=8)
        scheduler = Scheduler(model, service, temperature=0.7)
        print_(f"{'session':>7} {'turn':>4} {'prompt':>6} {'reused':>6} {'from':>10} {'TTFT ms':>8}")
        hits, misses = [], []
        for round_ in workload(seed, sessions, turns, system_tokens):
            requests = [(Request(prompt, max_tokens, session_id=f"chat-{s}",
                                 continuation=Continuation(f"chat-{s}-turn-{t}", seed=seed * 100 + s)), "chat")
                        for s, t, prompt in round_]
            sources = {}
            for (request, _), (s, t, _) in zip(requests, round_):
                sources[id(request)] = (s, t)
            for result in scheduler.run(requests):
                s, t = sources[id(result.request)]
                where = result.source.value
                milliseconds = result.first_token_seconds * 1000
                (hits if result.reused_tokens else misses).append(milliseconds)
                print_(f"{s:>7} {t:>4} {len(result.request.prompt):>6} {result.reused_tokens:>6} {where:>10} "
                       f"{milliseconds:>8.1f}")
        report = service.report()
        service.close()
    total = len(hits) + len(misses)
    print_(f"\nhit rate {len(hits) / total:.2f} ({len(hits)} of {total} requests reused state)")
    if hits and misses:
        print_(f"time to first token: {statistics.median(hits):.1f} ms median on hits, "
               f"{statistics.median(misses):.1f} ms on misses")
    print_(f"RAM tier: {ram / 1e6:.2f} MB; disk tier in {directory} (removed)")
    print_("service report:")
    for field in attrs.fields(type(report)):
        print_(f"  {field.name:24} {getattr(report, field.name)}")
    return {"hits": hits, "misses": misses, "report": report}
