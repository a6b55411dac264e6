"""Every path by which ``kvstate serve`` serves a request, held to the tenant guarantee, through the
real ``openai`` client: mlx_lm.server batches most requests, and serves one at a time those with a
``seed``, every request under ``--kv-bits`` and every request with a draft model. Whatever the path,
a request's state is fetched and kept in its own ``cache_salt``'s namespace only. Also: every name
the server answers to reaches the served model's cache, and the server's default ``max_tokens``
never turns a servable request into a refusal."""

from __future__ import annotations

import json
import urllib.request

import pytest

openai = pytest.importorskip("openai", reason="the serving tests talk through the real openai client")

from kvstate.models.model_dir import save_model_dir  # noqa: E402
from tests.test_serve import SYSTEM, Server, chat  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_model_dir(tmp_path_factory.mktemp("paths") / "llama", "llama", seed=13)


PATHS = {
    "batched": ((), {}),
    "seeded": ((), {"seed": 7}),
    "kv-bits": (("--kv-bits", "8"), {}),
    "draft-model": (("--draft-model", "{model}"), {}),
}


@pytest.mark.parametrize("path", sorted(PATHS))
def test_every_serving_path_keeps_each_tenants_state_to_itself(model_dir, tmp_path, path):
    flags, options = PATHS[path]
    flags = [flag.format(model=model_dir) for flag in flags]
    server = Server(model_dir, "--disk-dir", str(tmp_path / "disk"), "--disk-bytes", "64MiB", *flags,
                    log=tmp_path / "server.log")
    try:
        first = [SYSTEM, {"role": "user", "content": "A private question about my own account number 4417."}]

        def turn(salt, messages):
            body = {"cache_salt": salt} if salt is not None else {}
            return chat(server, messages, extra_body=body, **options)

        reply = turn("tenant-c", first)
        second = first + [{"role": "assistant", "content": reply.choices[0].message.content},
                          {"role": "user", "content": "And the balance?"}]
        assert turn(None, second).usage.prompt_tokens_details.cached_tokens == 0
        assert turn("tenant-b", second).usage.prompt_tokens_details.cached_tokens == 0
        own = turn("tenant-c", second).usage.prompt_tokens_details.cached_tokens
        metrics = server.metrics()
        if path == "draft-model":  # a draft model's caches are not kept: nothing to reuse, nothing to leak
            assert own == 0 and metrics["kvstate_kept_total"] == 0
        else:
            assert own >= reply.usage.prompt_tokens - 1
        private = [{"role": "user", "content": "Tenant C only: the launch code is 0451, keep it."}]
        third = turn("tenant-c", private)
        private += [{"role": "assistant", "content": third.choices[0].message.content},
                    {"role": "user", "content": "Repeat it."}]
    finally:
        server.stop()
    if path != "seeded":
        return
    # What the disk kept is the tenant's too: after a restart, from disk, only tenant C reuses it (others
    # share at most the chat template's first tokens with state of their own).
    server = Server(model_dir, "--disk-dir", str(tmp_path / "disk"), "--disk-bytes", "64MiB", *flags,
                    log=tmp_path / "restarted.log")
    try:
        assert turn(None, private).usage.prompt_tokens_details.cached_tokens < third.usage.prompt_tokens // 2
        assert turn("tenant-b", private).usage.prompt_tokens_details.cached_tokens < third.usage.prompt_tokens // 2
        assert turn("tenant-c", private).usage.prompt_tokens_details.cached_tokens >= third.usage.prompt_tokens - 1
        metrics = server.metrics()  # from disk: restored, or read ahead into RAM when the request came
        assert metrics["kvstate_restores_total"] + metrics["kvstate_prefetches_total"] >= 1
    finally:
        server.stop()


def test_the_id_v1_models_advertises_reaches_the_served_models_cache_and_budget(model_dir, tmp_path, monkeypatch):
    """The server is started on a path that is not its resolved form (a link); ``/v1/models``
    advertises the resolved path, and a client that names the model by it is served from the same
    cache and counted in the same budget as one that says ``default_model``, with no second load."""
    link = tmp_path / "model-link"
    link.symlink_to(model_dir, target_is_directory=True)
    (tmp_path / "hub").mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))  # /v1/models lists it: empty, not missing
    server = Server(link, "--kv-budget-bytes", "64MiB", log=tmp_path / "server.log")
    try:
        with urllib.request.urlopen(server.url("/v1/models"), timeout=10) as reply:
            advertised = [model["id"] for model in json.loads(reply.read())["data"]]
        assert str(model_dir.resolve()) in advertised
        name = str(model_dir.resolve())
        first = [SYSTEM, {"role": "user", "content": "Which model am I talking to, by its advertised name?"}]
        reply = server.client.chat.completions.create(model=name, messages=first, max_tokens=8, temperature=0.0)
        second = first + [{"role": "assistant", "content": reply.choices[0].message.content},
                          {"role": "user", "content": "And again?"}]
        again = server.client.chat.completions.create(model=name, messages=second, max_tokens=8, temperature=0.0)
        assert again.usage.prompt_tokens_details.cached_tokens >= reply.usage.prompt_tokens - 1
        by_default = chat(server, second)  # default_model: the same cache, the same state
        assert by_default.usage.prompt_tokens_details.cached_tokens >= reply.usage.prompt_tokens - 1
        metrics = server.metrics()
        assert metrics["kvstate_hits_total"] + metrics["kvstate_misses_total"] == 3
        assert metrics["kvstate_batch_peak_bytes"] > 0
    finally:
        server.stop()


def test_a_request_for_a_model_that_cannot_load_leaves_the_served_model_serving_as_before(model_dir, tmp_path):
    """A request names a model that does not exist: mlx-lm's provider drops the served model before it
    fails to load the other, so the next request meets no tokenizer at all. It is the server's to
    serve (it loads its model again), and it answers as before, from the same cache."""
    server = Server(model_dir, log=tmp_path / "server.log")
    try:
        messages = [SYSTEM, {"role": "user", "content": "Name a colour, then another."}]
        before = chat(server, messages)
        with pytest.raises(openai.APIStatusError):
            server.client.chat.completions.create(model=str(tmp_path / "no-such-model"), messages=messages,
                                                  max_tokens=8, temperature=0.0)
        after = chat(server, messages)
        assert after.choices[0].message.content == before.choices[0].message.content
        assert after.usage.prompt_tokens_details.cached_tokens >= before.usage.prompt_tokens - 1
    finally:
        server.stop()


@pytest.fixture(scope="module")
def short_model(tmp_path_factory):
    return save_model_dir(tmp_path_factory.mktemp("short") / "llama", "llama", seed=4, max_position_embeddings=512)


def test_the_servers_default_max_tokens_is_lowered_to_what_fits_never_a_refusal(short_model, tmp_path):
    """A client that sends no max_tokens gets the server's default (512 here) lowered to what fits the
    context (512 tokens) and the KV budget; a client's own max_tokens that does not fit gets a 400 that
    says the number was the request's; a prompt that leaves no room for one token gets a 400 that says so."""
    budget = 2048 * 512  # this llama's KV for 2,048 positions (with the batch's padding): the context binds first
    server = Server(short_model, "--kv-budget-bytes", str(budget), "--ram-bytes", "16MiB",
                    log=tmp_path / "server.log")
    try:
        long = [{"role": "user", "content": "the quick brown fox " * 110}]
        status, text = server.post("/v1/chat/completions", json.dumps(
            {"model": "default_model", "messages": long, "temperature": 0.0}).encode())
        assert status == 200, text
        usage = json.loads(text)["usage"]
        assert 400 < usage["prompt_tokens"] < 500 and usage["prompt_tokens"] + usage["completion_tokens"] <= 512
        with pytest.raises(openai.BadRequestError, match=r"max_tokens 200 \(the request's\).*context limit of 512"):
            chat(server, long, max_tokens=200)
        status, text = server.post("/v1/chat/completions", json.dumps(
            {"model": "default_model", "messages": [{"role": "user", "content": "the quick brown fox " * 140}]}
        ).encode())
        assert status == 400 and "leaves no room for one generated token" in json.loads(text)["error"]["message"]
    finally:
        server.stop()


def test_a_request_over_the_budget_only_with_the_caches_allocation_step_gets_a_400_saying_so(short_model, tmp_path):
    """mlx-lm's batch caches grow 256 positions at a time, so a row may hold up to 255 more than it
    uses: a request whose prompt and max_tokens fit the KV budget by themselves, but not with that step,
    can never run, and is refused at once with a 400 that says why; one token less runs."""
    per_token = 512  # this llama's KV bytes a position (see the test above)
    budget = per_token * 400
    server = Server(short_model, "--kv-budget-bytes", str(budget), "--ram-bytes", "16MiB", log=tmp_path / "server.log")
    try:
        messages = [{"role": "user", "content": "Tell me about the sea."}]
        prompt = chat(server, messages, max_tokens=1).usage.prompt_tokens
        fits = 400 - 255 - prompt          # prompt + max_tokens + 255 = 400 positions: exactly the budget
        assert chat(server, messages, max_tokens=fits).usage.completion_tokens >= 1
        with pytest.raises(openai.BadRequestError, match=r"max_tokens \d+ \(the request's\).*KV budget"):
            chat(server, messages, max_tokens=fits + 1)   # prompt + max_tokens alone is far under 400
        assert server.metrics()["kvstate_batch_waits_total"] == 0  # refused, never left waiting
    finally:
        server.stop()
