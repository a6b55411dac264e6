"""``kvstate serve`` over real HTTP, with the real ``openai`` client, on tiny model directories built here.

Each test talks to a live server process on localhost: mlx-lm's own server with kvstate as its
prompt cache. The model directories are reference architectures with random weights and a
tokenizer trained in the fixture; nothing is downloaded.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

openai = pytest.importorskip("openai", reason="the serving tests talk through the real openai client")

from kvstate.interpreters.serving import serve as serving  # noqa: E402
from kvstate.models.model_dir import save_model_dir  # noqa: E402
from tests.test_weights_identity import fine_tune  # noqa: E402

SYSTEM = {"role": "system", "content": "You are a helpful assistant. Answer briefly and clearly."}


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Server:
    """A server process on a free port: ``kvstate serve`` (or stock ``mlx_lm.server``)."""

    def __init__(self, model_dir: Path, *extra: str, stock: bool = False, log: Path | None = None,
                 environment: dict[str, str] | None = None):
        self.port = free_port()
        command = ([sys.executable, "-m", "mlx_lm", "server"] if stock
                   else [sys.executable, "-m", "kvstate.interpreters.cli", "serve"])
        self.log = log or model_dir.parent / f"server-{self.port}.log"
        environment = {**os.environ, "KVSTATE_CACHE_DIR": str(model_dir.parent / "kvstate-cache"),
                       **(environment or {})}
        self.process = subprocess.Popen([*command, "--model", str(model_dir), "--port", str(self.port), *extra],
                                        stdout=open(self.log, "w"), stderr=subprocess.STDOUT, env=environment)
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(self.url("/health"), timeout=2) as reply:
                    if reply.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"the server did not start:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.2)
        self.client = openai.OpenAI(base_url=self.url("/v1"), api_key="none", max_retries=0, timeout=120)

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.port}{path}"

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(self.url("/metrics"), timeout=10) as reply:
            text = reply.read().decode()
        values = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                values[name] = float(value)
        return values

    def post(self, path: str, body: bytes) -> tuple[int, str]:
        request = urllib.request.Request(self.url(path), data=body, headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as reply:
                return reply.status, reply.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, error.read().decode()

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        return self.process.returncode


def chat(server: Server, messages, max_tokens=8, **options):
    return server.client.chat.completions.create(model="default_model", messages=messages, max_tokens=max_tokens,
                                                 temperature=0.0, **options)


def converse(server: Server, messages: list, turns: int, max_tokens: int = 8, follow: str = "Go on.") -> list:
    """``turns`` turns of one conversation from ``messages``: each reply, then ``follow``, is added."""
    replies = []
    for _ in range(turns):
        reply = chat(server, messages, max_tokens=max_tokens)
        replies.append(reply)
        messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                     {"role": "user", "content": follow}]
    return replies


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_model_dir(tmp_path_factory.mktemp("served") / "llama", "llama", seed=3)


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    disk = tmp_path_factory.mktemp("disk")
    running = Server(model_dir, "--disk-dir", str(disk), "--disk-bytes", "256MiB", "--ram-bytes", "64MiB")
    yield running
    running.stop()


def test_the_installed_mlx_lm_server_is_one_kvstate_embeds():
    from importlib import metadata

    from mlx_lm import server

    assert serving.check_server_internals() is server
    assert serving.supported_release(metadata.version("mlx-lm"))


@pytest.mark.parametrize("version, supported", [("0.32.0", False), ("0.32.1", False), ("0.32.2", True),
                                                ("0.32.9", True), ("0.33.0", False), ("0.31.5", False),
                                                ("0.32.3rc1", True)])
def test_the_supported_mlx_lm_range_starts_at_the_first_release_with_every_piece(version, supported):
    # 0.32.0 and 0.32.1 have no BatchCounters (0.32.0's _tokenize returns four values): refused by name.
    assert serving.supported_release(version) is supported


def test_a_moved_server_internal_is_refused_by_name(monkeypatch):
    from mlx_lm import server

    monkeypatch.delattr(server.ResponseGenerator, "stop_and_join")
    with pytest.raises(serving.ServerInternalsMoved, match="stop_and_join"):
        serving.check_server_internals()


def test_the_scan_at_start_is_logged_in_one_line_with_what_it_deleted_and_why():
    from kvstate.core.replies import ScanResult

    line = serving.scan_line(ScanResult(kept=9, kept_bytes=5 << 20, deleted=143, deleted_bytes=195 << 20,
                                        rejected=1, capacity_bytes=5 << 20))
    assert line.startswith("saved state on disk: kept 9 files (5 MiB); deleted 143 files (195 MiB) to fit "
                           "--disk-bytes 5 MiB")
    assert "least recently used first" in line and line.endswith("1 files rejected (moved aside)")
    assert "deleted" not in serving.scan_line(ScanResult(kept=2, kept_bytes=10, capacity_bytes=1 << 20))


def test_chat_completions_streamed_and_not_and_text_completions(server):
    reply = chat(server, [SYSTEM, {"role": "user", "content": "Hello, how are you?"}])
    assert reply.choices[0].message.content and reply.usage.completion_tokens == 8
    streamed = chat(server, [SYSTEM, {"role": "user", "content": "Hello, how are you?"}], stream=True)
    pieces = [chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices]
    assert "".join(pieces) == reply.choices[0].message.content  # greedy: the same text either way
    text = server.client.completions.create(model="default_model", prompt="The quick brown fox", max_tokens=6,
                                            temperature=0.0)
    assert text.choices[0].text and text.usage.completion_tokens == 6


def test_the_second_turn_of_a_chat_reports_cached_tokens(server):
    first = [SYSTEM, {"role": "user", "content": "Tell me about the weather today."}]
    reply = chat(server, first)
    second = first + [{"role": "assistant", "content": reply.choices[0].message.content},
                      {"role": "user", "content": "And what should I wear outside?"}]
    again = chat(server, second)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert cached >= reply.usage.prompt_tokens - 1  # the whole first turn's prompt, at least
    assert cached < again.usage.prompt_tokens


def test_eight_concurrent_clients_are_all_served_and_the_report_adds_up(server):
    before = server.metrics()
    errors, replies = [], []

    def client(n):
        try:
            messages = [SYSTEM, {"role": "user", "content": f"Numbers: {n} {n + 1} {n + 2}, and a cache."}]
            replies.extend(converse(server, messages, 2, max_tokens=6))
        except Exception as error:  # noqa: BLE001 - collected and reported
            errors.append(error)
    threads = [threading.Thread(target=client, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert errors == [] and len(replies) == 16
    after = server.metrics()
    lookups = (after["kvstate_hits_total"] + after["kvstate_misses_total"]
               - before["kvstate_hits_total"] - before["kvstate_misses_total"])
    assert lookups == 16
    assert after["kvstate_live_requests"] == 0 and after["kvstate_bytes"] <= after["kvstate_capacity_bytes"]
    assert after["kvstate_hits_total"] > before["kvstate_hits_total"]  # the second turns reused the first


def test_a_seeded_request_served_on_its_own_keeps_its_prompt_for_the_next_turn(server):
    """mlx_lm.server serves a request with a seed outside the batch, and offers its cache with the
    tokens it generated at the end: kept, so the conversation's next turn reuses it."""
    first = [SYSTEM, {"role": "user", "content": "A seeded question about prompt caches, please."}]
    reply = chat(server, first, seed=11)
    second = first + [{"role": "assistant", "content": reply.choices[0].message.content},
                      {"role": "user", "content": "And a second seeded one?"}]
    again = chat(server, second, seed=11)
    assert again.usage.prompt_tokens_details.cached_tokens >= reply.usage.prompt_tokens - 1


def test_metrics_are_the_report_in_prometheus_text(server):
    chat(server, [SYSTEM, {"role": "user", "content": "Hello"}])
    metrics = server.metrics()
    for name in ("kvstate_hits_total", "kvstate_misses_total", "kvstate_kept_total", "kvstate_spills_total",
                 "kvstate_pending_writes", "kvstate_saved_bytes", "kvstate_hit_ratio",
                 'kvstate_tier_bytes{tier="ram"}', 'kvstate_tier_bytes{tier="disk"}'):
        assert name in metrics, name
    assert 0.0 <= metrics["kvstate_hit_ratio"] <= 1.0
    # the batch's prefill pace reached the service: what it weighs every disk hit against
    assert metrics["kvstate_prefill_tokens_per_s"] > 0


def test_bad_input_gets_a_4xx_and_the_server_keeps_serving(server):
    assert server.post("/v1/chat/completions", b"{not json")[0] == 400
    assert server.post("/v1/chat/completions", json.dumps([1, 2]).encode())[0] == 400
    with pytest.raises(openai.NotFoundError):
        server.client.chat.completions.create(model="no-such-model", messages=[SYSTEM], max_tokens=4)
    assert chat(server, [SYSTEM, {"role": "user", "content": "Still there?"}]).choices[0].message.content
    assert server.metrics()["kvstate_live_requests"] == 0


def test_a_client_that_disconnects_mid_stream_releases_its_request(server):
    """A client gone mid-stream: nothing stays live, and the server serves the next request. (The
    prompt cache holds no lease across a request, so the first part holds by construction; the second
    is what a disconnect can break.)"""
    stream = chat(server, [SYSTEM, {"role": "user", "content": "Tell me a long story."}], max_tokens=200,
                  stream=True)
    for _ in zip(range(3), stream):
        pass
    stream.close()  # gone mid-stream
    deadline = time.monotonic() + 30
    while server.metrics()["kvstate_live_requests"] != 0 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert server.metrics()["kvstate_live_requests"] == 0
    assert chat(server, [SYSTEM, {"role": "user", "content": "Hello again"}]).choices[0].message.content


def test_a_cache_salt_keeps_each_tenants_state_to_itself(server):
    """Two tenants send the same conversation: each reuses its own first turn, never the other's, and
    a request without a salt does not reuse it either (the default namespace may hold other tests'
    prompts, which share the chat template's first tokens, but nothing of the tenants')."""
    first = [SYSTEM, {"role": "user", "content": "A private question about my own account number 4417."}]

    def turn(salt, messages):
        body = {"cache_salt": salt} if salt is not None else {}
        return chat(server, messages, extra_body=body)

    reply = turn("tenant-a", first)
    second = first + [{"role": "assistant", "content": reply.choices[0].message.content},
                      {"role": "user", "content": "And the balance?"}]
    assert turn("tenant-b", second).usage.prompt_tokens_details.cached_tokens == 0
    assert turn(None, second).usage.prompt_tokens_details.cached_tokens < reply.usage.prompt_tokens // 2
    assert turn("Tenant-A", second).usage.prompt_tokens_details.cached_tokens == 0  # salts compare exactly
    own = turn("tenant-a", second).usage.prompt_tokens_details.cached_tokens
    assert own >= reply.usage.prompt_tokens - 1
    assert server.metrics()["kvstate_live_requests"] == 0


@pytest.mark.parametrize("salt", [17, "", "x" * 257, "a\x00b", ["list"], {"a": 1}],
                         ids=["number", "empty", "too long", "control character", "list", "object"])
def test_a_bad_cache_salt_gets_a_400_and_the_server_keeps_serving(server, salt):
    body = {"model": "default_model", "messages": [SYSTEM, {"role": "user", "content": "Hi"}], "max_tokens": 4,
            "cache_salt": salt}
    status, text = server.post("/v1/chat/completions", json.dumps(body).encode())
    assert status == 400, text
    error = json.loads(text)["error"]
    assert "cache_salt" in error["message"] and error["param"] == "cache_salt"
    assert chat(server, [SYSTEM, {"role": "user", "content": "Still there?"}]).choices[0].message.content
    assert server.metrics()["kvstate_live_requests"] == 0


def turn_restart_turn(directory, disk, between=lambda: None):
    """One turn, a stop, ``between()``, a restart, and the conversation's next turn: the first server,
    its exit status, both replies and the second server's metrics."""
    options = ("--disk-dir", str(disk), "--disk-bytes", "256MiB", "--ram-bytes", "64MiB")
    conversation = [SYSTEM, {"role": "user", "content": "A cache keeps the state of a computation."}]
    first = Server(directory, *options)
    try:
        reply = chat(first, conversation)
    finally:
        status = first.stop()
    between()
    second = Server(directory, *options)
    try:
        follow = conversation + [{"role": "assistant", "content": reply.choices[0].message.content},
                                 {"role": "user", "content": "Why?"}]
        return first, status, reply, chat(second, follow), second.metrics()
    finally:
        second.stop()


def test_sigterm_right_after_a_request_exits_0_with_state_saved(model_dir, tmp_path):
    """A supervisor's SIGTERM just after an answer: the server closes its state, logs it durable and
    exits 0, every time (MLX's teardown aborted such an exit in most runs: 134)."""
    for run in range(6):
        server = Server(model_dir, "--disk-dir", str(tmp_path / "disk"), "--disk-bytes", "64MiB",
                        log=tmp_path / f"server-{run}.log")
        try:
            chat(server, [SYSTEM, {"role": "user", "content": f"Stop right after this, run {run}."}])
        finally:
            status = server.stop()
        assert status == 0, server.log.read_text()[-2000:]
        assert "durable\": true" in server.log.read_text()


def test_a_restarted_server_serves_earlier_conversations_from_disk(model_dir, tmp_path):
    first, status, reply, again, metrics = turn_restart_turn(model_dir, tmp_path / "disk")
    assert status == 0 and "durable\": true" in first.log.read_text()
    assert again.usage.prompt_tokens_details.cached_tokens >= reply.usage.prompt_tokens - 1
    # from disk: restored, or read ahead into RAM when the request came
    assert metrics["kvstate_restores_total"] + metrics["kvstate_prefetches_total"] >= 1
    assert metrics["kvstate_rejected_files_total"] == 0


@pytest.mark.parametrize("seed", [7, None], ids=["seeded-sequential", "batched"])
@pytest.mark.parametrize("family", ["llama", "gemma3_text", "qwen3_next", "mamba"])
def test_served_tokens_equal_stock_mlx_lm_server(family, seed, tmp_path):
    """The same model directory and conversation through kvstate serve and stock mlx_lm.server, with
    a seed (served one at a time) and without (batched): the same tokens, turn after turn. Batched,
    kvstate's later turns reuse kept state on every family, hybrid and recurrent ones too: the
    server's segment ends are kept as snapshots. One at a time, the server offers only the end of
    each generation, which a model whose caches cannot be trimmed reuses only at that exact length."""
    directory = save_model_dir(tmp_path / family, family, seed=5)
    texts, cached = {}, {}
    options = {} if seed is None else {"seed": seed}
    for stock in (False, True):
        server = Server(directory, stock=stock, log=tmp_path / f"{'stock' if stock else 'kvstate'}.log")
        try:
            messages, said, reused = [SYSTEM, {"role": "user", "content": "Hello, how are you?"}], [], []
            for turn in range(3):
                reply = chat(server, messages, max_tokens=10, **options)
                said.append(reply.choices[0].message.content)
                reused.append(reply.usage.prompt_tokens_details.cached_tokens)
                messages += [{"role": "assistant", "content": said[-1]},
                             {"role": "user", "content": f"Tell me more, part {turn}."}]
            texts[stock], cached[stock] = said, reused
        finally:
            server.stop()
    assert texts[False] == texts[True]
    if seed is None or family == "llama":
        assert all(n > 0 for n in cached[False][1:]), cached


def test_a_request_that_can_never_run_gets_a_400_that_says_why(tmp_path):
    directory = save_model_dir(tmp_path / "short", "llama", seed=4, max_position_embeddings=512)
    # 300 tokens of this llama's KV (2 layers x 2 heads x 16 dims x keys and values, float32): the
    # batch's caches grow 256 tokens at a time, so a short request holds up to a step beyond its end.
    budget = 300 * 512
    server = Server(directory, "--kv-budget-bytes", str(budget), "--ram-bytes", "16MiB")
    try:
        with pytest.raises(openai.BadRequestError, match="context limit"):
            chat(server, [SYSTEM, {"role": "user", "content": "the quick brown fox " * 160}], max_tokens=8)
        with pytest.raises(openai.BadRequestError, match="KV budget"):
            chat(server, [{"role": "user", "content": "Hello"}], max_tokens=300)
        assert chat(server, [{"role": "user", "content": "Hello"}], max_tokens=8).choices[0].message.content
        metrics = server.metrics()
        assert metrics["kvstate_live_requests"] == 0 and metrics["kvstate_hits_total"] + \
            metrics["kvstate_misses_total"] == 1  # the refused ones never reached the cache
    finally:
        server.stop()


def test_a_restart_on_changed_weights_restores_nothing_of_the_old_model(tmp_path):
    """The identity comes from the weight files, hashed once: a fine-tune (one bit of one tensor,
    same size, same modification time) is another model, and its server reuses nothing saved before."""
    directory = save_model_dir(tmp_path / "tuned", "llama", seed=6)
    _, _, _, again, metrics = turn_restart_turn(directory, tmp_path / "disk", between=lambda: fine_tune(directory))
    assert again.usage.prompt_tokens_details.cached_tokens == 0
    assert metrics["kvstate_restores_total"] == metrics["kvstate_prefetches_total"] == 0
    identities = [d for d in (tmp_path / "disk").iterdir() if d.is_dir()]
    assert len(identities) == 2  # the old model's state stays under its own identity, never read


def _batch_load(server: Server, eos: int) -> list[int]:
    """Eight clients at once, prompts of different lengths, each generating 300 tokens (no EOS)."""
    results: list[int] = []
    start = threading.Barrier(8)

    def client(i: int) -> None:
        words = "the quick brown fox jumps over the lazy dog " * (1 + 5 * i)
        start.wait()
        reply = chat(server, [{"role": "user", "content": words}], max_tokens=300, logit_bias={str(eos): -100})
        results.append(reply.usage.completion_tokens)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def test_the_running_batch_never_holds_more_than_the_kv_budget(model_dir, tmp_path):
    """Eight long requests at once: unbounded, the padded batch holds more than the budget; with
    ``--kv-budget-bytes`` the requests wait their turn, every one is served, and the batch's real
    bytes, and the batch with kept state, stay within the budget after every step."""
    eos = json.loads((model_dir / "config.json").read_text())["eos_token_id"]
    budget = 2 * 512 * 512  # two rows of 512 tokens of this llama (512 bytes of KV a token)
    unbounded = Server(model_dir, "--ram-bytes", "64MiB")
    try:
        assert _batch_load(unbounded, eos) == [300] * 8
        assert unbounded.metrics()["kvstate_batch_peak_bytes"] > budget  # without admission the batch overruns
    finally:
        unbounded.stop()
    bounded = Server(model_dir, "--ram-bytes", "64MiB", "--kv-budget-bytes", str(budget))
    try:
        assert _batch_load(bounded, eos) == [300] * 8
        metrics = bounded.metrics()
        assert metrics["kvstate_batch_waits_total"] > 0
        assert 0 < metrics["kvstate_batch_peak_bytes"] <= budget
        assert metrics["kvstate_held_peak_bytes"] <= budget
        assert metrics["kvstate_live_requests"] == 0 and metrics["kvstate_projected_bytes"] == 0
        assert metrics["kvstate_bytes"] <= budget
    finally:
        bounded.stop()


def _burst(server: Server, n: int = 4) -> list[int]:
    """``n`` requests at once sharing a long system prompt nothing holds yet: the cached tokens each
    reports, in arrival order of the replies."""
    # Long enough that its prefill outlasts the spread of the four arrivals, so they meet while it runs.
    shared = {"role": "system", "content": "You answer questions about the history of cartography. " * 60}
    cached: list[int] = []
    start = threading.Barrier(n)

    def client(i: int) -> None:
        start.wait()
        reply = chat(server, [shared, {"role": "user", "content": f"question {i}: who drew the map {i}?"}])
        details = reply.usage.prompt_tokens_details
        cached.append(details.cached_tokens if details is not None else 0)

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return cached


def test_requests_arriving_together_reuse_the_prefix_the_first_one_computes(model_dir):
    """Four requests that share a system prompt nothing holds: whether they meet in the queue or
    arrive one after another, every one after the first reuses what the first published at the end of
    its system segment. The wait is long enough that it ends on that publish, never on its timer, so
    the outcome does not depend on the machine's speed; which requests meet does, so that is left to
    the admission's own tests (tests/test_serving_admission.py, tests/test_sharing.py)."""
    waiting = Server(model_dir, "--ram-bytes", "64MiB", "--shared-prefix-wait", "600")
    try:
        cached = sorted(_burst(waiting))
        assert cached[0] == 0 and all(tokens > 300 for tokens in cached[1:])
    finally:
        waiting.stop()


def test_a_negative_shared_prefix_wait_is_refused(model_dir):
    result = subprocess.run([sys.executable, "-m", "kvstate.interpreters.cli", "serve", "--model", str(model_dir),
                             "--shared-prefix-wait", "-1"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and "--shared-prefix-wait" in result.stderr and "Traceback" not in result.stderr


SERVER_HOOKS = Path(__file__).parent / "server_hooks"


def with_server_hooks(**variables: str) -> dict[str, str]:
    """The environment of a server that loads ``tests/server_hooks/sitecustomize.py`` at start, with
    ``variables`` (``KVSTATE_TEST_CLOCK``, ``KVSTATE_TEST_KILL``) saying which hooks to set."""
    paths = [str(SERVER_HOOKS), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {"PYTHONPATH": os.pathsep.join(paths), **variables}


def set_clock(clock: Path, seconds: float) -> None:
    """Move the test's clock to ``seconds``, in one step the server never sees half done (a new file
    renamed over the old: a read finds the old time or the new, never an empty file)."""
    ticking = clock.with_name(clock.name + ".next")
    ticking.write_text(str(seconds))
    os.replace(ticking, clock)


def on_the_tests_clock(clock: Path) -> dict[str, str]:
    """The environment of a server whose service reads its clock from ``clock`` (seconds, written by the
    test with :func:`set_clock`: ``tests/server_hooks/sitecustomize.py``); it starts at 0."""
    set_clock(clock, 0)
    return with_server_hooks(KVSTATE_TEST_CLOCK=str(clock))


def _wear(server: Server, disk: Path, clock: Path) -> tuple[float, int]:
    """A three-turn conversation, then 10 s on the service's clock and one more request (the clock
    reaches the service at each request): the bytes the disk tier wrote, and the files it holds, once
    every write it began has landed.

    mlx-lm's server ends a reply's stream before it keeps the reply's state, so a client's next
    request is what orders them: the last request is sent twice, and the second, the same tokens, keeps
    nothing new, so once it is answered everything the first kept has been kept."""
    converse(server, [SYSTEM, {"role": "user", "content": "Tell me about the sea."}], turns=3)
    set_clock(clock, 10)
    for _ in range(2):
        chat(server, [{"role": "user", "content": "Something else entirely."}], max_tokens=2)
    deadline = time.monotonic() + 60
    while (metrics := server.metrics())["kvstate_pending_writes"] and time.monotonic() < deadline:
        time.sleep(0.05)  # each scrape hears of the writes the background writer finished
    assert metrics["kvstate_pending_writes"] == 0, "the server's writes did not land within a minute"
    return metrics["kvstate_bytes_written_total"], len(list(disk.rglob("*.safetensors")))


def test_an_idle_write_rule_writes_only_what_is_not_superseded_soon(model_dir, tmp_path):
    """Every kept state is written by default (the system and user segment ends and the end of each
    turn); with --disk-write-idle only what sat idle that long is, and the end of the last turn is."""
    every = tmp_path / "every"
    idle = tmp_path / "idle"
    clock = tmp_path / "clock"
    common = ("--disk-bytes", "256MiB", "--ram-bytes", "64MiB")
    default = Server(model_dir, "--disk-dir", str(every), *common, environment=on_the_tests_clock(clock))
    try:
        written_always, files_always = _wear(default, every, clock)
    finally:
        default.stop()
    waiting = Server(model_dir, "--disk-dir", str(idle), *common, "--disk-write-idle", "2",
                     environment=on_the_tests_clock(clock))
    try:
        written_idle, files_idle = _wear(waiting, idle, clock)
        assert waiting.metrics()["kvstate_spills_total"] >= 1  # the last turn's end, idle 10 s, was written
    finally:
        waiting.stop()
    assert 0 < written_idle < written_always / 2 and files_idle < files_always


@pytest.mark.parametrize("flag, value", [("--disk-write-idle", "0"), ("--disk-write-idle", "-3"),
                                         ("--disk-write-bytes-per-hour", "0")])
def test_bad_disk_wear_flags_are_refused(model_dir, flag, value):
    result = subprocess.run([sys.executable, "-m", "kvstate.interpreters.cli", "serve", "--model", str(model_dir),
                             flag, value], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and flag in result.stderr and "Traceback" not in result.stderr


def _refusal(*arguments: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvstate.interpreters.cli", "serve", *arguments],
                          capture_output=True, text=True, timeout=120)


def test_a_model_path_that_does_not_exist_and_a_disk_dir_that_cannot_be_made_are_one_line_each(tmp_path, model_dir):
    missing = _refusal("--model", str(tmp_path / "no-model"))
    assert missing.returncode == 2 and missing.stderr.strip() == \
        f"kvstate serve: --model {tmp_path / 'no-model'}: no such model directory"
    (tmp_path / "a-file").write_text("")
    blocked = _refusal("--model", str(model_dir), "--disk-dir", str(tmp_path / "a-file" / "disk"),
                       "--disk-bytes", "1GiB")
    assert blocked.returncode == 2 and blocked.stderr.count("\n") == 1 and "--disk-dir" in blocked.stderr
    assert "cannot be made" in blocked.stderr


def test_a_second_server_on_the_same_disk_dir_is_refused_in_one_line_naming_it(model_dir, tmp_path):
    disk = tmp_path / "shared-disk"
    first = Server(model_dir, "--disk-dir", str(disk), "--disk-bytes", "64MiB")
    try:
        second = _refusal("--model", str(model_dir), "--disk-dir", str(disk), "--disk-bytes", "64MiB",
                          "--port", str(free_port()))
        assert second.returncode == 2 and "Traceback" not in second.stderr
        line = [text for text in second.stderr.splitlines() if text.startswith("kvstate serve:")]
        assert len(line) == 1 and f"--disk-dir {disk}: another live kvstate serve" in line[0]
    finally:
        first.stop()


def test_a_reuse_of_the_chat_templates_opening_alone_is_counted_apart_from_hits(model_dir):
    """Two conversations with nothing in common but the template's opening: the second reuses those
    tokens (a hit to the service) but the hit ratio on /metrics does not count it."""
    from mlx_lm import load

    _, tokenizer = load(str(model_dir))
    opening = serving.chat_template_prefix(tokenizer)
    assert opening > 0
    fresh = Server(model_dir, "--ram-bytes", "64MiB")
    try:
        chat(fresh, [{"role": "user", "content": "Tell me about the sea."}])
        second = chat(fresh, [{"role": "user", "content": "Zebras cross roads."}])
        assert 0 < second.usage.prompt_tokens_details.cached_tokens <= opening
        metrics = fresh.metrics()
        assert metrics["kvstate_hits_total"] == 1 and metrics["kvstate_template_only_hits_total"] == 1
        assert metrics["kvstate_hit_ratio"] == 0
        converse(fresh, [{"role": "user", "content": "Tell me about the sea."}], turns=1)  # a real reuse
        metrics = fresh.metrics()
        assert metrics["kvstate_template_only_hits_total"] == 1 and metrics["kvstate_hit_ratio"] > 0
    finally:
        fresh.stop()
