"""``kvstate serve --record-trace``: the server's own traffic as a trace in the bundled format, with
keyed block ids, that the lab's replay reads back to the hits the server reported.

The ids are checked against the format's promise (an id stands for its block, everything before it
and the namespace; another deployment's key gives other ids); the recorder with a clock the test
moves; and a served conversation, recorded, replayed through the same decisions.
"""

from __future__ import annotations

import json
import stat

import pytest

from kvstate.interpreters.lab.replay import replay, replay_service
from kvstate.interpreters.lab.traces import BLOCK_TOKENS, read
from kvstate.interpreters.serving.deployment_keys import KEY_BYTES
from kvstate.interpreters.serving.trace_recording import TraceHasher, TraceKeyUnreadable, TraceRecorder, deployment_key
from kvstate.models.model_dir import save_model_dir
from tests.test_serve import Server, chat

KEY = bytes(range(KEY_BYTES))


def test_an_id_stands_for_its_block_everything_before_it_and_the_namespace():
    hasher = TraceHasher(KEY)
    first = tuple(range(2 * BLOCK_TOKENS + 7))
    other = first[:BLOCK_TOKENS] + tuple(reversed(first[BLOCK_TOKENS:]))
    ids = hasher.ids("a", first)
    assert len(ids) == 3 and ids == hasher.ids("a", first)  # two full blocks and a partial one
    assert hasher.ids("a", other)[0] == ids[0] and hasher.ids("a", other)[1:] != ids[1:]
    assert not set(hasher.ids("b", first)) & set(ids)  # another tenant shares no id
    assert not set(TraceHasher(bytes(KEY_BYTES)).ids("a", first)) & set(ids)  # another deployment neither
    assert all(0 <= i < 1 << 63 for i in ids)
    assert hasher.namespace("a") != hasher.namespace("b") and "tenant" not in hasher.namespace("tenant")
    for prompt in (first, first[:BLOCK_TOKENS], first[:700], first[:9]):  # the shared blocks hashed once
        assert hasher.ids_of_both("a", prompt, first + (1, 2, 3)) == (hasher.ids("a", prompt),
                                                                       hasher.ids("a", first + (1, 2, 3)))


def test_the_key_is_made_once_owner_only_and_a_damaged_one_is_refused(tmp_path):
    path = tmp_path / "trace.jsonl.key"
    key = deployment_key(path)
    assert len(key) == KEY_BYTES and deployment_key(path) == key
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    path.write_bytes(b"short")
    with pytest.raises(TraceKeyUnreadable, match="not a trace key"):
        deployment_key(path)


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_a_request_is_written_when_answered_and_one_never_answered_at_close(tmp_path):
    clock, path = Clock(), tmp_path / "trace.jsonl"
    recorder = TraceRecorder(path, clock=clock)
    prompt, other = tuple(range(600)), tuple(range(1000, 1100))
    recorder.fetched("a", prompt, 0)
    clock.now += 1.5
    recorder.fetched("b", other, 40)
    recorder.answered("b", prompt + (7, 8, 9), 602)  # another tenant's tokens answer nothing
    recorder.answered("a", prompt + (7, 8, 9), 602)
    assert recorder.written == 1
    recorder.close()
    recorder.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    hasher = TraceHasher(path.with_name("trace.jsonl.key").read_bytes())
    assert lines[0] == {"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": hasher.ids("a", prompt),
                        "kept_ids": hasher.ids("a", (prompt + (7, 8, 9))[:602]), "kept_length": 602, "cached_tokens": 0,
                        "namespace": hasher.namespace("a")}
    assert lines[1]["timestamp"] == 1500 and lines[1]["output_length"] == 0 and lines[1]["cached_tokens"] == 40
    # A recording appended to after a restart goes on from its last timestamp.
    again = TraceRecorder(path, clock=Clock())
    again.fetched("a", prompt, 0)
    again.close()
    assert json.loads(path.read_text().splitlines()[-1])["timestamp"] == 1501
    assert [r.arrival for r in read(path).requests] == [0.0, 1.5, 1.501]


def test_a_recorded_conversation_replays_to_the_hits_the_server_reported(tmp_path):
    """Three turns of long messages served and recorded; the trace's cached tokens are what the client
    was told, and the lab's replay of it, through the same decisions on a simulated model, reuses at
    each turn the server's reuse in whole 512-token blocks."""
    model_dir = save_model_dir(tmp_path / "llama", "llama", seed=3)
    trace = tmp_path / "trace.jsonl"
    server = Server(model_dir, "--ram-bytes", "256MiB", "--record-trace", str(trace))
    words = "the cache keeps every block of the prompt once and shares it with the next turn".split()
    messages, told = [{"role": "system", "content": "You answer in one word."}], []
    try:
        for turn in range(3):
            question = " ".join(words[(turn + i) % len(words)] for i in range(420))
            messages.append({"role": "user", "content": question})
            reply = chat(server, messages, max_tokens=6)
            told.append(reply.usage.prompt_tokens_details.cached_tokens)
            messages.append({"role": "assistant", "content": reply.choices[0].message.content})
        # A seeded request is served outside the batch: recorded all the same, in its own tenant.
        seeded = chat(server, messages[:2], max_tokens=3, seed=7, extra_body={"cache_salt": "other"})
    finally:
        assert server.stop() == 0
    records = [json.loads(line) for line in trace.read_text().splitlines()]
    single = records.pop()
    assert single["cached_tokens"] == seeded.usage.prompt_tokens_details.cached_tokens == 0
    assert single["output_length"] == 3 and single["namespace"] != records[0]["namespace"]
    assert [r["cached_tokens"] for r in records] == told
    assert told[0] == 0 and min(told[1:]) >= BLOCK_TOKENS  # later turns reuse whole blocks: a replay can miss them
    requests = read(trace).requests
    outcome = replay(requests, replay_service("llama-3.2-1b", ram_bytes=1 << 34, refuse_past_context=False))
    assert outcome.requests == 4 and outcome.block_hits == sum(cached // BLOCK_TOKENS for cached in told)


def test_a_replay_keeps_what_the_server_kept_so_the_next_turn_reuses_the_reply_too():
    """A recording's ``kept_ids`` (the prompt and the reply) are what the replay keeps: a next prompt that
    runs on through the reply reuses its blocks, as the server did; Mooncake's prompt ids alone would
    stop at the first prompt's last full block."""
    from kvstate.interpreters.lab.traces import TraceRequest

    hasher = TraceHasher(KEY)
    prompt = tuple(range(BLOCK_TOKENS + 100))
    answered = prompt + tuple(range(5000, 5000 + BLOCK_TOKENS))   # a reply of a block and more
    following = answered + tuple(range(9000, 9050))
    first = TraceRequest(0.0, len(prompt), BLOCK_TOKENS, tuple(hasher.ids("a", prompt)),
                         kept=tuple(hasher.ids("a", answered)), kept_length=len(answered))
    second = TraceRequest(1.0, len(following), 1, tuple(hasher.ids("a", following)))
    for request, expected in ((first, 2), (TraceRequest(0.0, len(prompt), BLOCK_TOKENS, first.blocks), 1)):
        outcome = replay([request, second], replay_service("llama-3.2-1b", ram_bytes=1 << 34))
        assert outcome.block_hits == expected  # the reply's block too, or the prompt's only


def test_a_trace_that_cannot_be_recorded_is_refused_in_one_line_before_the_model_loads(tmp_path):
    import subprocess
    import sys

    for path, says in ((tmp_path / "no" / "such" / "dir" / "trace.jsonl", "cannot append to it (No such file"),
                       (tmp_path, "cannot append to it (Is a directory)")):
        done = subprocess.run([sys.executable, "-m", "kvstate.interpreters.cli", "serve", "--model",
                               str(tmp_path / "not-loaded"), "--record-trace", str(path)],
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and says in done.stderr and "Traceback" not in done.stderr
    key = tmp_path / "trace.jsonl.key"
    key.write_bytes(b"not a key")
    done = subprocess.run([sys.executable, "-m", "kvstate.interpreters.cli", "serve", "--model",
                           str(tmp_path / "not-loaded"), "--record-trace", str(tmp_path / "trace.jsonl")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "not a trace key" in done.stderr
