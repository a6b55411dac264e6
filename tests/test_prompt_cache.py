"""KvStatePromptCache: the interface mlx_lm.server uses of its prompt cache, on a real model."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache

from kvstate import KvCacheService
from kvstate.interpreters.serving.prompt_cache import KvStatePromptCache
from kvstate.models.reference import build

MODEL_KEY = ("tiny", None, None)


def adapter(tmp_path=None, ram_bytes=64 << 20):
    model, config = build("llama", seed=81)
    options = {} if tmp_path is None else {"disk_dir": str(tmp_path), "disk_bytes": 64 << 20}
    service = KvCacheService.for_mlx(model, config=config, ram_bytes=ram_bytes, **options)
    return model, KvStatePromptCache(service, MODEL_KEY)


def computed(model, tokens):
    caches = make_prompt_cache(model)
    mx.eval(model(mx.array([list(tokens)]), cache=caches))
    return caches


def test_fetch_insert_and_the_counts_the_server_logs():
    model, cache = adapter()
    prompt = list(range(1, 41))
    assert cache.fetch_nearest_cache(MODEL_KEY, prompt) == (None, prompt)
    cache.insert_cache(MODEL_KEY, prompt[:20], computed(model, prompt[:20]), cache_type="system")
    cache.insert_cache(MODEL_KEY, prompt, computed(model, prompt), cache_type="assistant")
    assert len(cache) == 1  # the longer trimmable entry serves the system prefix: kept once
    stats = cache.stats_by_type()
    assert stats["assistant"]["n_sequences"] == 1 and stats["system"]["n_sequences"] == 0
    assert cache.nbytes == stats["assistant"]["n_bytes"] > 0
    caches, rest = cache.fetch_nearest_cache(MODEL_KEY, prompt[:30] + [200, 201])
    assert rest == [200, 201] and caches[0].offset == 30
    assert cache.fetch_nearest_cache(("other", None, None), prompt) == (None, prompt)
    assert cache.service.report().live_requests == 0


def test_trim_to_gives_ram_back_to_what_the_batch_leaves(tmp_path):
    model, cache = adapter(tmp_path)
    for n in range(4):
        tokens = [n * 50 + i + 1 for i in range(30)]
        cache.insert_cache(MODEL_KEY, tokens, computed(model, tokens))
    held = cache.nbytes
    cache.trim_to(n_bytes=held // 2)
    assert 0 < cache.nbytes <= held // 2
    # An entry whose spill is still in flight cannot be dropped yet (the write reads it); let the
    # first trim's writes land so the second trim is decided on settled state.
    assert cache.service.flush().durable
    cache.trim_to(n_sequences=1)
    assert len(cache) == 1
    assert cache.service.flush().durable
    assert cache.service.report().saved_entries == 4  # what was given back was spilled first


def test_the_per_request_stats_pass_over_the_entries_at_most_once_a_second(monkeypatch):
    """The server logs ``stats_by_type`` before every request: a pass over every entry each time
    would grow with the cache, so it is redone at most once a second."""
    from kvstate.interpreters.serving import prompt_cache as module

    model, cache = adapter()
    prompt = list(range(1, 41))
    cache.insert_cache(MODEL_KEY, prompt, computed(model, prompt), cache_type="user")
    clock = [100.0]
    monkeypatch.setattr(module.time, "monotonic", lambda: clock[0])
    passes = []
    count = cache._count_by_type
    monkeypatch.setattr(cache, "_count_by_type", lambda: passes.append(1) or count())
    first = cache.stats_by_type()
    clock[0] += 0.5
    assert cache.stats_by_type() == first and len(passes) == 1
    clock[0] += module.STATS_EVERY_S
    assert cache.stats_by_type()["user"]["n_sequences"] == 1 and len(passes) == 2


def test_in_the_server_a_call_no_request_announced_reuses_and_keeps_nothing():
    """``kvstate serve`` builds the cache with ``unannounced=None``: an insert or fetch whose request
    is not known is filed under no namespace, never the default one; inside ``serving`` (a request the
    server serves outside the batch) both are that request's."""
    model, cache = adapter()
    cache.unannounced = None
    prompt = list(range(1, 41))
    cache.insert_cache(MODEL_KEY, prompt, computed(model, prompt))
    assert len(cache) == 0 and cache.service.report().kept == 0
    with cache.serving("salt-c"):
        cache.insert_cache(MODEL_KEY, prompt, computed(model, prompt))
        caches, rest = cache.fetch_nearest_cache(MODEL_KEY, prompt + [99])
        assert rest == [99]
    assert cache.fetch_nearest_cache(MODEL_KEY, prompt + [99]) == (None, prompt + [99])
    assert cache.service.peek_prefix_len(prompt + [99], "salt-c") == 40
    assert cache.service.peek_prefix_len(prompt + [99], "default") == 0
    with cache.serving(None):  # a request without a salt: the default namespace
        assert cache.fetch_nearest_cache(MODEL_KEY, prompt + [99]) == (None, prompt + [99])
