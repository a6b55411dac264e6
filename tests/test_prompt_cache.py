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
    clock[0] += module.STATS_EVERY_S  # exactly a second after the last pass: redone
    cache.stats_by_type()
    assert len(passes) == 3


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


# ---------------------------------------------------------------- promises the server's log, trace and counters rely on


def test_a_reuse_of_no_more_than_the_templates_opening_is_counted_apart_and_only_then():
    model, cache = adapter()
    prompt = list(range(1, 41))
    cache.insert_cache(MODEL_KEY, prompt[:2], computed(model, prompt[:2]))
    caches, rest = cache.fetch_nearest_cache(MODEL_KEY, prompt[:1] + [77])
    assert caches[0].offset == 1 and cache.template_only_hits == 0  # no template told: no hit is the template's
    cache.template_tokens = 2
    cache.fetch_nearest_cache(MODEL_KEY, prompt[:1] + [77])  # a reuse of 1 token, within the template's 2
    cache.fetch_nearest_cache(MODEL_KEY, prompt[:2] + [77])  # of 2, the template's whole opening
    assert cache.template_only_hits == 2
    cache.insert_cache(MODEL_KEY, prompt, computed(model, prompt))
    cache.fetch_nearest_cache(MODEL_KEY, prompt + [77])  # past the template: the client's own reuse
    assert cache.template_only_hits == 2


def test_an_expectation_taken_back_leaves_the_next_fetch_to_no_request():
    from kvstate import Request

    model, cache = adapter()
    cache.unannounced = None
    prompt = list(range(1, 41))
    with cache.serving("a"):
        cache.insert_cache(MODEL_KEY, prompt, computed(model, prompt))
    request = Request(tuple(prompt + [77]), 4)
    cache.service.admit(request)
    cache.expect(request, "a")
    cache.unexpect(request)
    assert cache.fetch_nearest_cache(MODEL_KEY, prompt + [77]) == (None, prompt + [77])
    cache.service.release(request)


def test_announcements_are_bounded_and_the_oldest_is_forgotten_first():
    from kvstate.interpreters.serving.prompt_cache import MAX_ANNOUNCED

    model, cache = adapter()
    cache.unannounced = None
    first, second = [1, 2, 3], [4, 5, 6]
    cache.announce(first, "a")
    cache.announce(second, "a")
    for n in range(MAX_ANNOUNCED - 1):
        cache.announce([1000 + n], "a")
    # MAX_ANNOUNCED + 1 announced: the first is forgotten (its state kept nowhere), the second not
    cache.insert_cache(MODEL_KEY, first, computed(model, first))
    cache.insert_cache(MODEL_KEY, second, computed(model, second))
    assert cache.service.peek_prefix_len(first + [9], "a") == 0
    assert cache.service.peek_prefix_len(second + [9], "a") == 3


def test_the_state_at_the_end_of_a_generation_is_kept_without_the_token_the_caches_lack():
    """mlx-lm's server inserts the prompt and every generated token, but the caches lack the last one
    sampled: the state is kept for the tokens the caches cover; caches that cover more tokens than
    offered, or none, keep nothing."""
    model, cache = adapter()
    tokens = list(range(1, 41))
    cache.insert_cache(MODEL_KEY, tokens, computed(model, tokens[:-1]))
    assert cache.service.peek_prefix_len(tokens[:-1] + [99], "default") == 39
    one = [50, 51]
    cache.insert_cache(MODEL_KEY, one, computed(model, one[:1]))
    assert cache.service.peek_prefix_len(one[:1] + [99], "default") == 1
    kept = cache.service.report().kept
    longer = [60, 61, 62]
    cache.insert_cache(MODEL_KEY, longer[:2], computed(model, longer))  # caches past the tokens offered
    cache.insert_cache(MODEL_KEY, [70, 71], make_prompt_cache(model))  # caches that cover nothing
    cache.insert_cache(("other", None, None), [80, 81], computed(model, [80, 81]))  # another model's
    cache.insert_cache(MODEL_KEY, [90, 91], [])  # no caches
    assert cache.service.report().kept == kept and len(cache) == 2


def test_only_the_state_at_the_end_of_a_reply_answers_a_recorded_request(tmp_path):
    from kvstate.interpreters.serving.trace_recording import TraceRecorder

    model, cache = adapter()
    cache.recorder = TraceRecorder(tmp_path / "trace.jsonl")
    prompt = list(range(1, 41))
    cache.fetch_nearest_cache(MODEL_KEY, prompt)
    cache.insert_cache(MODEL_KEY, prompt, computed(model, prompt), cache_type="user")  # the prompt's own
    assert cache.recorder.written == 0
    cache.insert_cache(MODEL_KEY, prompt + [50], computed(model, prompt), cache_type="assistant")
    assert cache.recorder.written == 1
    cache.recorder.close()


def test_the_fetch_and_keep_lines_say_the_bytes_moved_and_a_time_within_the_call(tmp_path, caplog):
    import logging
    import re
    import time

    from kvstate.core.checks import size_text

    model, cache = adapter(tmp_path)
    prompt = list(range(1, 41))
    with caplog.at_level(logging.INFO):
        started = time.perf_counter()
        cache.insert_cache(MODEL_KEY, prompt, computed(model, prompt))
        outer_ms = 1e3 * (time.perf_counter() - started)
    kept_line = next(r.getMessage() for r in caplog.records if "state of 40 tokens" in r.getMessage())
    assert float(re.search(r" in ([0-9.]+) ms", kept_line).group(1)) <= outer_ms
    assert cache.service.flush().durable
    cache.trim_to(n_sequences=0)  # held on disk alone now
    caplog.clear()
    read_before = cache.service.counts().bytes_read
    with caplog.at_level(logging.INFO):
        started = time.perf_counter()
        caches, rest = cache.fetch_nearest_cache(MODEL_KEY, prompt + [77])
        outer_ms = 1e3 * (time.perf_counter() - started)
    read = cache.service.counts().bytes_read - read_before
    line = next(r.getMessage() for r in caplog.records if "fetch of 41 tokens" in r.getMessage())
    assert read > 0 and f", {size_text(read)} read from disk)" in line
    assert float(re.search(r" in ([0-9.]+) ms", line).group(1)) <= outer_ms
    other = list(range(100, 130))
    cache.insert_cache(MODEL_KEY, other, computed(model, other))
    caplog.clear()
    with caplog.at_level(logging.INFO):
        cache.fetch_nearest_cache(MODEL_KEY, other + [78])  # from RAM: nothing read
    line = next(r.getMessage() for r in caplog.records if "fetch of 31 tokens" in r.getMessage())
    assert "reused 30 (ram)" in line


def test_the_adapter_ticks_the_service_only_where_a_rule_reads_the_clock(tmp_path, monkeypatch):
    from kvstate.interpreters.serving import prompt_cache as module

    model, config = build("llama", seed=81)
    prompt = list(range(1, 41))
    every = {"checkpoint_every_tokens": 64}
    for n, (options, ticks) in enumerate([({}, False), ({"checkpoint_keep_s": 60.0}, False), (every, False),
                                          ({**every, "checkpoint_keep_s": 60.0}, True),
                                          ({"write_idle_after": 5.0}, True), ({"demote_idle_after": 5.0}, True)]):
        service = KvCacheService.for_mlx(model, config=config, ram_bytes=64 << 20, disk_dir=str(tmp_path / str(n)),
                                         disk_bytes=64 << 20, **options)
        cache = module.KvStatePromptCache(service, MODEL_KEY)
        told = []
        real = service.tick
        monkeypatch.setattr(service, "tick", lambda *a, **k: told.append(1) or real(*a, **k))
        cache.insert_cache(MODEL_KEY, prompt, computed(model, prompt))
        cache.fetch_nearest_cache(MODEL_KEY, prompt + [77])
        assert bool(told) is ticks, options


def test_a_prefills_chunk_is_kept_only_where_its_snapshot_is_worth_its_bytes_and_a_segments_end_always():
    model, config = build("qwen3_next", seed=5)
    service = KvCacheService.for_mlx(model, config=config, ram_bytes=64 << 20, block_tokens=4)
    cache = KvStatePromptCache(service, MODEL_KEY)
    prompt = list(range(1, 9))
    cache.insert_cache(MODEL_KEY, prompt, computed(model, prompt), cache_type="chunk")
    assert service.report().snapshots_passed_up == 1 and service.peek_prefix_len(prompt + [99], "default") == 0
    cache.insert_cache(MODEL_KEY, prompt, computed(model, prompt), cache_type="user")
    assert service.peek_prefix_len(prompt + [99], "default") == 8


def test_a_keep_that_spills_says_so_with_the_bytes_it_kept(tmp_path, caplog):
    import logging

    from kvstate.core.checks import size_text
    from kvstate.interpreters.mlx import caches as mlx_caches

    model, cache = adapter(tmp_path, ram_bytes=30 << 10)  # room for one 40-token state: a second spills the first
    first, second = list(range(1, 41)), list(range(100, 140))
    with caplog.at_level(logging.INFO):
        cache.insert_cache(MODEL_KEY, first, computed(model, first))
        caches = computed(model, second)
        cache.insert_cache(MODEL_KEY, second, caches)
    lines = [r.getMessage() for r in caplog.records if "state of 40 tokens" in r.getMessage()]
    assert f"({size_text(mlx_caches.live_bytes(caches))}) kept" in lines[1]
    assert "spill" not in lines[0] and "; 1 spill begun, " in lines[1] and lines[1].endswith("written to disk")
    third = list(range(200, 240))
    before = cache.service.counts()
    caplog.clear()
    with caplog.at_level(logging.INFO):
        cache.insert_cache(MODEL_KEY, third, computed(model, third))  # spills the second: one more begun
    after = cache.service.counts()
    line = next(r.getMessage() for r in caplog.records if "state of 40 tokens" in r.getMessage())
    assert after.spills - before.spills == 1
    assert line.endswith(f"; 1 spill begun, {size_text(after.bytes_written - before.bytes_written)} written to disk")
    assert cache.service.flush().durable


def test_an_expected_request_of_no_namespace_fetches_in_the_caches_own():
    from kvstate import Request

    model, cache = adapter()
    prompt = list(range(1, 41))
    cache.insert_cache(MODEL_KEY, prompt, computed(model, prompt))  # the cache used alone: its own namespace
    request = Request(tuple(prompt + [77]), 4)
    cache.service.admit(request)
    cache.expect(request)
    caches, rest = cache.fetch_nearest_cache(MODEL_KEY, prompt + [77])
    assert rest == [77] and caches[0].offset == len(prompt)
    cache.service.release(request)


def test_a_miss_is_never_a_template_only_hit():
    model, cache = adapter()
    cache.template_tokens = 2
    assert cache.fetch_nearest_cache(MODEL_KEY, [5, 6, 7]) == (None, [5, 6, 7])
    assert cache.template_only_hits == 0


def test_a_cache_not_told_to_hold_segment_ends_keeps_them_when_offered_from_a_row():
    """Only the batch generator's side holds a row's segment ends (it keeps them once the row
    generates); a cache used alone keeps every insert as it comes, a row announced or not."""
    model, cache = adapter()
    prompt = list(range(1, 41))
    cache.announce(prompt, "default", row=3)
    cache.insert_cache(MODEL_KEY, prompt, computed(model, prompt), cache_type="user")
    assert cache.service.peek_prefix_len(prompt + [99], "default") == len(prompt)


def test_a_draft_models_caches_keep_nothing_and_answer_a_recorded_reply_with_nothing_kept(tmp_path):
    """The server inserts a draft model's caches behind the model's: more layers than the model has.
    Nothing is kept; a reply's insert answers its recorded request with no state kept, a segment's does
    not answer it, and without a recorder nothing is told."""
    import json

    from kvstate.interpreters.serving.trace_recording import TraceRecorder

    model, cache = adapter()
    prompt = list(range(1, 41))
    with_draft = computed(model, prompt) * 2
    cache.insert_cache(MODEL_KEY, prompt, with_draft, cache_type="assistant")  # no recorder: nothing to tell
    cache.recorder = TraceRecorder(tmp_path / "trace.jsonl")
    cache.fetch_nearest_cache(MODEL_KEY, prompt)
    cache.insert_cache(MODEL_KEY, prompt, with_draft, cache_type="user")
    assert cache.recorder.written == 0
    cache.insert_cache(MODEL_KEY, prompt + [50], with_draft, cache_type="assistant")
    assert cache.recorder.written == 1
    cache.recorder.close()
    (line,) = (tmp_path / "trace.jsonl").read_text().splitlines()
    assert json.loads(line)["kept_length"] == len(prompt)  # its prompt, as the recorder counts a reply kept
    assert cache.service.report().kept == 0 and len(cache) == 0


def test_a_model_whose_caches_have_no_positions_is_kept_whole():
    """Caches that say no position (a recurrent model's: mamba) are kept for the tokens offered."""
    from kvstate import KvCacheService
    from kvstate.models.reference import build

    model, config = build("mamba", seed=81)
    cache = KvStatePromptCache(KvCacheService.for_mlx(model, config=config, ram_bytes=64 << 20), MODEL_KEY)
    prompt = list(range(1, 41))
    cache.insert_cache(MODEL_KEY, prompt, computed(model, prompt), cache_type="system")
    assert cache.service.report().kept == 1
    caches, rest = cache.fetch_nearest_cache(MODEL_KEY, prompt + [77])
    assert rest == [77]


def test_a_keeps_line_says_spills_begun_even_before_their_bytes_land():
    from types import SimpleNamespace

    from kvstate.interpreters.serving.prompt_cache import _disk_work

    def counts(spills, written):
        return SimpleNamespace(spills=spills, bytes_written=written)
    assert _disk_work(counts(0, 0), counts(0, 0)) == ""
    assert _disk_work(counts(2, 100), counts(3, 100)) == "; 1 spill begun, 0 B written to disk"
    assert _disk_work(counts(3, 100), counts(3, 2148)) == "; 0 spills begun, 2 KiB written to disk"
