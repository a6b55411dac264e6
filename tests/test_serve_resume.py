"""Resumable generations in ``kvstate serve`` (``--checkpoint-every``): a generation with a client key,
killed with SIGKILL at an exact point, is retried on a restarted server and completes to the text an
uninterrupted run gives, sent once; keys are per tenant and per request body.

The server kills itself at the point a test names (``tests/server_hooks/sitecustomize.py``), so no
test races a kill against the server's progress. Every request goes through the real ``openai``
client, with the key in the ``Idempotency-Key`` header or the ``idempotency_key`` body field.
"""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

openai = pytest.importorskip("openai", reason="the serving tests talk through the real openai client")

from kvstate.interpreters.serving.resumable import Note, ResumableKeys  # noqa: E402
from kvstate.models.model_dir import save_model_dir  # noqa: E402
from tests.test_serve import Server, with_server_hooks  # noqa: E402

EVERY = 4
MAX_TOKENS = 40
#: mlx-lm's own penalty on repeated tokens over the whole reply, in the batch (its context is every token).
VARIED = {"repetition_penalty": 1.5, "repetition_context_size": MAX_TOKENS}
MESSAGES = [{"role": "user", "content": "Tell me a long story about a cat, a dog and a boat on the river."}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_model_dir(tmp_path_factory.mktemp("resumed") / "llama", "llama", seed=3)


def start(model_dir: Path, disk: Path, kill: str | None = None) -> Server:
    """A server with checkpoints every ``EVERY`` tokens on ``disk``; with ``kill``, one that kills itself
    at that crash point."""
    environment = with_server_hooks(KVSTATE_TEST_KILL=kill) if kill is not None else None
    return Server(model_dir, "--disk-dir", str(disk), "--disk-bytes", "64MiB", "--checkpoint-every", str(EVERY),
                  environment=environment)


def generate(server: Server, key: str | None = None, stream: bool = False, in_body: bool = False, **options):
    """The reply's text (streamed: its chunks joined), and the reply (or the chunks)."""
    body = dict(options.pop("extra_body", {}))
    if "seed" not in options:  # greedy: a penalty on repeats keeps a random-weight model's text from looping
        body.update(VARIED)
    extra = {}
    if key is not None:
        if in_body:
            body["idempotency_key"] = key
        else:
            extra["extra_headers"] = {"Idempotency-Key": key}
    extra["extra_body"] = body
    options.setdefault("temperature", 0.0)
    reply = server.client.chat.completions.create(model="default_model", messages=MESSAGES, max_tokens=MAX_TOKENS,
                                                  stream=stream, **extra, **options)
    if not stream:
        return reply.choices[0].message.content, reply
    chunks = [chunk for chunk in reply]
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks


def killed(server: Server, **request) -> str:
    """Send ``request``; the server kills itself at its crash point on the way. What the client got
    before (a stream ends where the connection dropped; a reply in one piece raises)."""
    try:
        try:
            got, _ = generate(server, **request)
        except (openai.APIConnectionError, openai.APIError):
            got = ""
        assert server.process.wait(timeout=120) == -signal.SIGKILL
    except BaseException:
        server.stop()  # it never reached its crash point: no server is left behind by a failing test
        raise
    return got


@pytest.fixture(scope="module")
def uninterrupted(model_dir, tmp_path_factory):
    """The texts of uninterrupted runs (greedy, and seeded at a temperature), with their replies."""
    server = start(model_dir, tmp_path_factory.mktemp("reference-disk"))
    try:
        greedy = generate(server, logprobs=True, top_logprobs=2)
        seeded = generate(server, seed=11, temperature=0.9)
    finally:
        server.stop()
    for text, reply in (greedy, seeded):  # long and varied enough that a wrong resume would show
        assert reply.usage.completion_tokens == MAX_TOKENS and len(set(text)) > 20
    return {"greedy": greedy, "seeded": seeded}


def at_commit(checkpoint: int, before: bool = False) -> str:
    """The crash point at (``before``: just before) the commit of the ``checkpoint``-th checkpoint, with
    the generation held a few tokens past the point that checkpoint was taken at."""
    return f"{'before' if before else 'after'}-checkpoint-commit:{checkpoint}:{EVERY * checkpoint + EVERY}"


def checkpoint_files(disk: Path) -> list[Path]:
    return sorted(disk.rglob("checkpoint-*"))


@pytest.mark.parametrize("kill, stream, resumed", [
    ("prefill", False, 0),                     # before any token: nothing to resume, the retry starts over
    (at_commit(2), True, 1),                   # mid-generation, once a checkpoint is durable
    (at_commit(3, before=True), False, 1),     # the third checkpoint written, not committed: the second resumes
    ("token:23", True, None),                  # mid-generation, wherever the writes had got to
])
def test_a_generation_killed_at_any_point_completes_on_retry_to_the_uninterrupted_text_once(
        model_dir, tmp_path, uninterrupted, kill, stream, resumed):
    disk = tmp_path / "disk"
    before = killed(start(model_dir, disk, kill), key="story-1", stream=stream)
    assert uninterrupted["greedy"][0].startswith(before) and before != uninterrupted["greedy"][0]
    server = start(model_dir, disk)
    try:
        text, reply = generate(server, key="story-1", stream=stream)
        assert text == uninterrupted["greedy"][0]
        metrics = server.metrics()
        if resumed is not None:
            assert metrics["kvstate_resumes_total"] == resumed
        if stream:
            assert [c.choices[0].finish_reason for c in reply if c.choices][-1] == "length"
        else:
            assert reply.usage.completion_tokens == MAX_TOKENS and reply.usage.prompt_tokens == \
                uninterrupted["greedy"][1].usage.prompt_tokens
        assert metrics["kvstate_checkpoints"] == 0  # completed: let go
    finally:
        server.stop()
    assert checkpoint_files(disk) == []  # deleted, once the server has closed (its writes drained)


def test_a_resumed_reply_sends_the_tokens_and_logprobs_sent_before_the_crash(model_dir, tmp_path, uninterrupted):
    disk = tmp_path / "disk"
    killed(start(model_dir, disk, at_commit(3)), key="k", logprobs=True, top_logprobs=2)
    server = start(model_dir, disk)
    try:
        text, reply = generate(server, key="k", logprobs=True, top_logprobs=2)
        assert server.metrics()["kvstate_resumes_total"] == 1
    finally:
        server.stop()
    reference = uninterrupted["greedy"][1].choices[0].logprobs.content
    resumed = reply.choices[0].logprobs.content
    assert text == uninterrupted["greedy"][0]
    assert [t.token for t in resumed] == [t.token for t in reference]
    assert [t.logprob for t in resumed] == pytest.approx([t.logprob for t in reference], abs=1e-4)
    assert [[top.token for top in t.top_logprobs] for t in resumed] == \
        [[top.token for top in t.top_logprobs] for t in reference]


def test_a_seeded_generation_resumes_to_the_seeded_text(model_dir, tmp_path, uninterrupted):
    disk = tmp_path / "disk"
    killed(start(model_dir, disk, at_commit(4)), key="s", in_body=True, seed=11, temperature=0.9)
    server = start(model_dir, disk)
    try:
        text, _ = generate(server, key="s", in_body=True, seed=11, temperature=0.9)
        assert server.metrics()["kvstate_resumes_total"] == 1
    finally:
        server.stop()
    assert text == uninterrupted["seeded"][0]


def test_a_key_reused_with_another_body_is_a_422_and_another_tenants_key_resumes_nothing(
        model_dir, tmp_path, uninterrupted):
    disk = tmp_path / "disk"
    killed(start(model_dir, disk, at_commit(2)), key="shared", extra_body={"cache_salt": "tenant-a"})
    server = start(model_dir, disk)
    try:
        with pytest.raises(openai.UnprocessableEntityError, match="another request body"):
            generate(server, key="shared", extra_body={"cache_salt": "tenant-a"}, max_completion_tokens=12)
        text, _ = generate(server, key="shared", extra_body={"cache_salt": "tenant-b"})  # another tenant's key
        assert text == uninterrupted["greedy"][0]
        metrics = server.metrics()  # tenant-a's checkpoint still held; tenant-b's own, completed, let go
        assert metrics["kvstate_resumes_total"] == 0 and metrics["kvstate_checkpoints"] == 1
        text, _ = generate(server, key="shared", extra_body={"cache_salt": "tenant-a"})  # its own tenant's retry
        assert text == uninterrupted["greedy"][0]
        metrics = server.metrics()
        assert metrics["kvstate_resumes_total"] == 1 and metrics["kvstate_checkpoints"] == 0
    finally:
        server.stop()
    assert checkpoint_files(disk) == []  # deleted, once the server has closed (its writes drained)


def test_a_bad_key_is_refused_with_what_to_send(model_dir, tmp_path):
    server = start(model_dir, tmp_path / "disk")
    try:
        with pytest.raises(openai.BadRequestError, match="1 to 256 printable"):
            generate(server, key="x" * 300)
        with pytest.raises(openai.BadRequestError, match="differ"):
            generate(server, key="a", extra_body={"idempotency_key": "b"})
    finally:
        server.stop()


class _Checkpoints:
    """A service's checkpoint notes, as the key check reads them."""

    def __init__(self, notes: dict[tuple[str, str], str]):
        self.notes = notes

    def checkpoint_note(self, key: str, namespace: str) -> str | None:
        return self.notes.get((namespace, key))


def test_a_key_being_served_is_a_409_for_the_same_body_and_a_422_for_another_until_it_is_released():
    keys = ResumableKeys(_Checkpoints({("n", "kept"): Note("body-1").text()}))
    assert keys.claim("n", "k", "body-1") is None
    assert keys.claim("n", "k", "body-1").status == 409
    assert keys.claim("n", "k", "body-2").status == 422
    assert keys.claim("other-tenant", "k", "body-2") is None       # keys are per namespace
    keys.release("n", "k")
    assert keys.claim("n", "k", "body-2") is None
    assert keys.claim("n", "kept", "body-2").status == 422          # a checkpoint of another body
    assert keys.claim("n", "kept", "body-1") is None                # its own retry
