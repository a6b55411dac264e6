"""Pins in ``kvstate serve``, over real HTTP with the real ``openai`` client: a warm prompt is prefilled
before the server answers and hit by the first request; a request's ``cache_pin_seconds`` keeps its
prefix through pressure that evicts everything else; pins over their bounds get a 400 that says which;
bad pin flags and warm prompt files stop the server at start with a message."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

openai = pytest.importorskip("openai", reason="the serving tests talk through the real openai client")

from kvstate.models.model_dir import save_model_dir  # noqa: E402
from tests.test_serve import SYSTEM, Server, chat  # noqa: E402

#: RAM for kept state in the pressure test: about 800 tokens of the test llama's KV (512 bytes a token).
SMALL_RAM = 400 * 1024


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_model_dir(tmp_path_factory.mktemp("pinned") / "llama", "llama", seed=3)


def test_a_warm_prompt_is_prefilled_before_the_server_answers_and_pinned(model_dir, tmp_path):
    from transformers import AutoTokenizer

    warm = tmp_path / "system.json"
    warm.write_text(json.dumps({"messages": [SYSTEM]}))
    rendered = AutoTokenizer.from_pretrained(str(model_dir)).apply_chat_template(
        [SYSTEM], add_generation_prompt=False, tokenize=True)
    warm_tokens = len(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
    server = Server(model_dir, "--ram-bytes", "64MiB", "--warm-prompt", str(warm))
    try:
        metrics = server.metrics()  # the server answers: the warm prompt is in RAM already, pinned
        assert metrics["kvstate_pins_total"] == 1 and metrics["kvstate_pinned_entries"] >= 1
        assert metrics["kvstate_pinned_bytes"] == warm_tokens * 512
        first = chat(server, [SYSTEM, {"role": "user", "content": "The first question of the day."}])
        assert first.usage.prompt_tokens_details.cached_tokens == warm_tokens
    finally:
        server.stop()


def test_a_pinned_prefix_survives_pressure_that_evicts_everything_else(model_dir):
    server = Server(model_dir, "--ram-bytes", str(SMALL_RAM), "--pin-share", "0.5", "--max-pin-seconds", "600")

    def conversation(topic: int, **body):
        messages = [{"role": "user", "content": f"Conversation {topic}: " + "the quick brown fox jumps " * 25}]
        reply = chat(server, messages, extra_body=body)
        return messages + [{"role": "assistant", "content": reply.choices[0].message.content},
                           {"role": "user", "content": "And then?"}], reply.usage.prompt_tokens

    try:
        pinned, pinned_prompt = conversation(1, cache_pin_seconds=600)
        unpinned, unpinned_prompt = conversation(2)
        for topic in range(3, 15):  # each keeps about 150 tokens: RAM holds about five of them
            conversation(topic)
        metrics = server.metrics()
        assert metrics["kvstate_evictions_total"] > 0 and metrics["kvstate_pinned_entries"] >= 1
        again = chat(server, pinned).usage.prompt_tokens_details.cached_tokens
        assert again >= pinned_prompt
        # The unpinned one went: at most the chat template's first tokens, which every prompt shares.
        assert chat(server, unpinned).usage.prompt_tokens_details.cached_tokens < unpinned_prompt // 2
    finally:
        server.stop()


def test_pins_over_their_bounds_get_a_400_that_says_which(model_dir):
    server = Server(model_dir, "--ram-bytes", str(SMALL_RAM), "--pin-share", "0.1", "--max-pin-seconds", "60")
    short = [{"role": "user", "content": "A short question."}]
    try:
        with pytest.raises(openai.BadRequestError, match="61 s is longer than the 60 s"):
            chat(server, short, extra_body={"cache_pin_seconds": 61})
        with pytest.raises(openai.BadRequestError, match="positive number of seconds"):
            chat(server, short, extra_body={"cache_pin_seconds": -5})
        with pytest.raises(openai.BadRequestError, match="pin_share.*--pin-share"):
            chat(server, [{"role": "user", "content": "the quick brown fox " * 30}],
                 extra_body={"cache_pin_seconds": 30})
        assert chat(server, short, extra_body={"cache_pin_seconds": 30}).choices[0].message.content
        assert server.metrics()["kvstate_live_requests"] == 0
    finally:
        server.stop()


@pytest.mark.parametrize("flags, says", [
    (("--pin-share", "1.5"), "--pin-share is a share"),
    (("--max-pin-seconds", "-1"), "--max-pin-seconds is seconds"),
    (("--warm-prompt", "/nonexistent/system.json"), "no such file"),
])
def test_bad_pin_flags_are_refused_at_start(model_dir, flags, says):
    done = subprocess.run([sys.executable, "-m", "kvstate.interpreters.cli", "serve", "--model", str(model_dir),
                           *flags], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and says in done.stderr


def test_a_warm_prompt_file_that_is_not_messages_stops_the_server_with_a_message(model_dir, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"messages": [{"role": "system"}]}))
    done = subprocess.run([sys.executable, "-m", "kvstate.interpreters.cli", "serve", "--model", str(model_dir),
                           "--warm-prompt", str(bad)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "a string 'role' and 'content'" in done.stderr
