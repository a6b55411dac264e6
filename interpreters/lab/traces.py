"""Request traces, all in one shape: chained 512-token block ids per prompt.

Three sources: Mooncake JSONL (the bundled traces), kvstate's own JSONL
(session, namespace, prompt tokens or block ids, output length, arrival), and
seeded synthetic workloads (multi-turn chat over shared system prompts,
agentic tool loops, RAG over shared documents). A block id stands for the
block and everything before it (and its namespace), so two prompts share
their first k ids exactly when they share their first k blocks.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator

import attrs

#: Tokens per block: a Mooncake ``hash_ids`` entry stands for one block of this many prompt tokens.
BLOCK_TOKENS = 512


class TraceFormatError(ValueError):
    """A trace line that is not a request record of the trace's format."""


def trace_records(path: str | Path, kind: str, read: Callable[[dict], Any]) -> Iterator[tuple[int, Any]]:
    """``(line number, read(record))`` for every JSON line of ``path``; a bad line names itself."""
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                yield number, read(json.loads(line))
            except (ValueError, KeyError, TypeError) as error:
                raise TraceFormatError(f"{path}:{number}: not a {kind} record ({error})") from None


@attrs.frozen
class TraceRequest:
    """One request of a trace: its arrival (s), lengths in tokens, and chained block ids."""

    arrival: float
    input_length: int
    output_length: int
    blocks: tuple[int, ...] = attrs.field(repr=lambda b: f"<{len(b)} blocks>")
    session: str | None = None
    namespace: str = "default"
    #: The chained ids of the state the server kept after the request (its prompt and its reply), where
    #: the trace records them (``kvstate serve --record-trace``); None: the prompt's, as in Mooncake's.
    kept: tuple[int, ...] | None = attrs.field(default=None, repr=False)
    #: The tokens of that state (None: not recorded; the prompt and the output, at most its blocks).
    kept_length: int | None = None
    #: The prompt tokens the server reported reused, where the trace records them.
    cached_tokens: int | None = None


@attrs.frozen
class Trace:
    """Requests in arrival order, and where they came from."""

    name: str
    requests: tuple[TraceRequest, ...]

    @property
    def block_accesses(self) -> int:
        return sum(len(r.blocks) for r in self.requests)

    @property
    def unique_blocks(self) -> int:
        return len({b for r in self.requests for b in r.blocks})


class BlockChainer:
    """Gives chained ids to blocks: the same (namespace, parent, content) always gets the same id."""

    def __init__(self) -> None:
        self._ids: dict[tuple, int] = {}

    def chain(self, namespace: str, contents: Iterable[object]) -> tuple[int, ...]:
        parent, out = (namespace,), []
        for content in contents:
            key = (parent, content)
            block = self._ids.get(key)
            if block is None:
                block = self._ids[key] = len(self._ids)
            out.append(block)
            parent = block
        return tuple(out)


def mooncake(path: str | Path) -> Trace:
    """A Mooncake FAST'25 trace (``timestamp`` ms, ``hash_ids`` already chained), in timestamp order (a
    stable sort: Mooncake's files are in it already; a server's recording is in completion order).
    A recording's ``kept_ids``, ``kept_length``, ``cached_tokens`` and ``namespace`` are read where present."""
    def request_of(record: dict) -> TraceRequest:
        kept, kept_length = record.get("kept_ids"), record.get("kept_length")
        cached = record.get("cached_tokens")
        return TraceRequest(int(record["timestamp"]) / 1000, int(record["input_length"]),
                            int(record["output_length"]), tuple(int(h) for h in record["hash_ids"]),
                            namespace=str(record.get("namespace", "default")),
                            kept=None if kept is None else tuple(int(h) for h in kept),
                            kept_length=None if kept_length is None else int(kept_length),
                            cached_tokens=None if cached is None else int(cached))
    requests = []
    for number, request in trace_records(path, "Mooncake request", request_of):
        if request.input_length < 1 or not request.blocks:
            raise TraceFormatError(f"{path}:{number}: a request needs input_length >= 1 and hash_ids")
        requests.append(request)
    return Trace(Path(path).name, tuple(sorted(requests, key=lambda r: r.arrival)))


def kvstate_jsonl(path: str | Path) -> Trace:
    """kvstate's own JSONL: ``arrival`` (s), ``output_length``, optional ``session`` and ``namespace``,
    and either ``tokens`` (ids, cut into 512-token blocks here) or ``blocks`` (chained ids) with
    ``input_length``."""
    chainer, requests = BlockChainer(), []

    def request_of(record: dict) -> TraceRequest:
        namespace = str(record.get("namespace", "default"))
        if "tokens" in record:
            tokens = [int(t) for t in record["tokens"]]
            chunks = [tuple(tokens[i:i + BLOCK_TOKENS]) for i in range(0, len(tokens), BLOCK_TOKENS)]
            blocks, length = chainer.chain(namespace, chunks), len(tokens)
        else:
            blocks = chainer.chain(namespace, (("id", int(b)) for b in record["blocks"]))
            length = int(record.get("input_length", len(blocks) * BLOCK_TOKENS))
        return TraceRequest(float(record.get("arrival", 0.0)), length, int(record["output_length"]), blocks,
                          record.get("session"), namespace)
    for number, request in trace_records(path, "kvstate trace", request_of):
        if not request.blocks or request.input_length < 1:
            raise TraceFormatError(f"{path}:{number}: a request needs at least one token")
        requests.append(request)
    return Trace(Path(path).name, tuple(sorted(requests, key=lambda r: r.arrival)))


def read(path: str | Path) -> Trace:
    """Mooncake or kvstate JSONL, told apart by the first record's fields."""
    with open(path, encoding="utf-8") as lines:
        first = next((line for line in lines if line.strip()), "")
    try:
        fields = json.loads(first) if first else {}
    except ValueError:
        raise TraceFormatError(f"{path}:1: not JSON") from None
    return mooncake(path) if "hash_ids" in fields else kvstate_jsonl(path)


# ---------------------------------------------------------------- synthetic workloads


def _request(rng: random.Random, chainer: BlockChainer, arrival: float, contents: list, session: str | None,
             output: int) -> TraceRequest:
    blocks = chainer.chain("default", contents)
    partial = rng.randint(1, BLOCK_TOKENS)
    return TraceRequest(arrival, (len(blocks) - 1) * BLOCK_TOKENS + partial, output, blocks, session)


def chat(requests: int, seed: int = 0, system_prompts: int = 8, rate: float = 2.0) -> Trace:
    """Multi-turn conversations: each turn resends the system prompt and the conversation so far."""
    rng, chainer, out, fresh = random.Random(seed), BlockChainer(), [], iter(range(1 << 62))
    systems = [[("sys", s, i) for i in range(rng.randint(1, 6))] for s in range(system_prompts)]
    now, session = 0.0, 0
    while len(out) < requests:
        session += 1
        conversation = list(systems[rng.randrange(system_prompts)])
        start = now
        for _ in range(rng.randint(1, 12)):
            conversation += [next(fresh) for _ in range(rng.randint(1, 3))]  # the user's message
            out.append(_request(rng, chainer, start, conversation, f"chat-{session}", rng.randint(16, 600)))
            conversation += [next(fresh) for _ in range(rng.randint(0, 2))]  # the answer, sent back next turn
            start += rng.expovariate(1 / 30)
        now += rng.expovariate(rate)
    return Trace(f"synthetic chat (seed {seed})", tuple(sorted(out[:requests], key=lambda r: r.arrival)))


def agent(requests: int, seed: int = 0, rate: float = 1.0) -> Trace:
    """Agentic tool loops: a long tool-laden system prompt, then each step appends a tool's output."""
    rng, chainer, out, fresh = random.Random(seed), BlockChainer(), [], iter(range(1 << 62))
    tools = [("tools", i) for i in range(12)]
    now, task = 0.0, 0
    while len(out) < requests:
        task += 1
        context = tools + [next(fresh) for _ in range(rng.randint(1, 2))]
        start = now
        for _ in range(rng.randint(3, 20)):
            out.append(_request(rng, chainer, start, context, f"agent-{task}", rng.randint(32, 256)))
            context = context + [next(fresh) for _ in range(rng.randint(1, 4))]  # the call and its result
            start += rng.expovariate(1 / 5)
        now += rng.expovariate(rate)
    return Trace(f"synthetic agent (seed {seed})", tuple(sorted(out[:requests], key=lambda r: r.arrival)))


def rag(requests: int, seed: int = 0, documents: int = 200, rate: float = 4.0) -> Trace:
    """Retrieval: a system prompt, one to three shared documents (popular ones more often), a question."""
    rng, chainer, out = random.Random(seed), BlockChainer(), []
    system = [("rag-sys", i) for i in range(2)]
    weights = [1 / (d + 1) for d in range(documents)]
    now = 0.0
    for n in range(requests):
        chosen = rng.choices(range(documents), weights=weights, k=rng.randint(1, 3))
        contents = system + [("doc", d, i) for d in chosen for i in range(4)] + [("question", n)]
        out.append(_request(rng, chainer, now, contents, None, rng.randint(16, 300)))
        now += rng.expovariate(rate)
    return Trace(f"synthetic rag (seed {seed})", tuple(out))


SYNTHETIC = {"chat": chat, "agent": agent, "rag": rag}
