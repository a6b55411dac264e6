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


@pytest.mark.parametrize("served", [{}, {"seed": 7}], ids=["batched", "alone-with-a-seed"])
def test_a_pinned_prefix_survives_pressure_that_evicts_everything_else(model_dir, served):
    """Batched, or served outside the batch (a request with a seed), the pin holds its prefix."""
    server = Server(model_dir, "--ram-bytes", str(SMALL_RAM), "--pin-share", "0.5", "--max-pin-seconds", "600")

    def conversation(topic: int, **body):
        messages = [{"role": "user", "content": f"Conversation {topic}: " + "the quick brown fox jumps " * 25}]
        reply = chat(server, messages, extra_body=body)
        return messages + [{"role": "assistant", "content": reply.choices[0].message.content},
                           {"role": "user", "content": "And then?"}], reply.usage.prompt_tokens

    try:
        pinned, pinned_prompt = conversation(1, cache_pin_seconds=600, **served)
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


# ------------------------------------------------------------ the request's pin and warm prompt files, alone

@pytest.mark.parametrize("seconds", [0.5, 7, 600.25])
def test_a_pin_of_any_positive_finite_seconds_is_taken_as_given(seconds):
    from kvstate.interpreters.serving.pins import pin_seconds
    assert pin_seconds(seconds) == float(seconds)


@pytest.mark.parametrize("value", [0, 0.0, -1, float("inf"), float("nan"), True, "30", None])
def test_a_pin_of_no_time_endless_or_not_a_number_is_refused(value):
    from kvstate.interpreters.serving.pins import BadPinSeconds, pin_seconds
    with pytest.raises(BadPinSeconds, match="positive number of seconds"):
        pin_seconds(value)


@pytest.mark.parametrize("prompt_tokens", [None, 30])
def test_a_kept_state_is_pinned_over_the_prompt_the_request_asked_for(prompt_tokens):
    """A pin whose prompt was never told pins all the kept tokens; one told its prompt pins that much
    (state in blocks of 10: the pinned blocks are the prompt's)."""
    from kvstate import KvCacheService, Request, SimCaches
    from kvstate.interpreters.serving.pins import PinAsked, pin_kept
    from kvstate.models import model_spec
    spec = model_spec("qwen3-0.6b")
    service = KvCacheService.simulated(spec, ram_bytes=spec.bytes_for(4096), block_tokens=10)
    tokens = tuple(range(1, 51))
    service.publish(Request(tokens, 1), "default", tokens, SimCaches(tokens, spec))
    pin_kept(service, "default", tokens, PinAsked(60.0) if prompt_tokens is None else PinAsked(60.0, prompt_tokens))
    report = service.report()
    assert report.pins == 1
    assert report.pinned_bytes == spec.bytes_for(prompt_tokens or len(tokens))


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from mlx_lm.utils import load_tokenizer
    return load_tokenizer(model_dir)


def test_a_warm_prompt_of_messages_is_the_chat_templates_start_and_plain_text_is_encoded(tokenizer, tmp_path):
    from kvstate.interpreters.serving.pins import warm_prompt_tokens
    messages = [SYSTEM]
    as_json = tmp_path / "system.json"
    as_json.write_text(json.dumps(messages))
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=True)
    assert tokenizer.has_chat_template
    assert warm_prompt_tokens(as_json, tokenizer) == tuple(rendered["input_ids"] if hasattr(rendered, "keys")
                                                           else rendered)
    as_text = tmp_path / "system.txt"
    as_text.write_text(SYSTEM["content"])
    assert warm_prompt_tokens(as_text, tokenizer) == tuple(tokenizer.encode(SYSTEM["content"]))


def test_messages_for_a_tokenizer_that_knows_no_chat_template_are_their_contents_encoded(model_dir, tmp_path):
    """A tokenizer that does not say it has a chat template (a bare Hugging Face one) encodes the
    messages' contents, a line each."""
    from transformers import AutoTokenizer

    from kvstate.interpreters.serving.pins import warm_prompt_tokens
    bare = AutoTokenizer.from_pretrained(str(model_dir))
    assert not hasattr(bare, "has_chat_template")
    messages = [SYSTEM, {"role": "user", "content": "A first question."}]
    path = tmp_path / "start.json"
    path.write_text(json.dumps({"messages": messages}))
    assert warm_prompt_tokens(path, bare) == tuple(bare.encode("\n".join(m["content"] for m in messages)))
