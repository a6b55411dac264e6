"""A batch row's segment ends are kept after its first token, not between its prefill and that token.

Driven as ``mlx_lm.server``'s generation loop drives them: mlx-lm's real ``BatchGenerator`` (measured by
:func:`~kvstate.interpreters.serving.batch_admission.measured_batch_generator`), its ``extract_cache`` at
each segment's end and the server's ``insert_cache`` of it, on a tiny random-weight llama.
"""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import pytest
from mlx_lm.generate import BatchGenerator

from kvstate import KvCacheService
from kvstate.interpreters.serving.batch_admission import BatchAdmission, measured_batch_generator
from kvstate.interpreters.serving.prompt_cache import KvStatePromptCache
from kvstate.interpreters.serving.tenants import NAMESPACE_ATTRIBUTE
from kvstate.models.reference import build
from tests.test_prompt_cache import MODEL_KEY, computed

SYSTEM, USER, HEADER = list(range(1, 41)), list(range(100, 137)), [7, 8, 9]
PROMPT = SYSTEM + USER + HEADER
TENANT = "tenant-a"
NEW = 250  # a token no prompt here has at that place


def _server(hold_segments: bool):
    model, config = build("llama", seed=81)
    service = KvCacheService.for_mlx(model, config=config, ram_bytes=64 << 20)
    cache = KvStatePromptCache(service, MODEL_KEY, unannounced=None)
    admission = BatchAdmission(cache, share_wait_s=0.0, hold_segments=hold_segments)
    generator = measured_batch_generator(BatchGenerator, admission)(model, prefill_step_size=16)
    return model, service, cache, admission, generator


def _admitted(admission, cache, prompt):
    """The request admitted and fetched as the server does, in ``TENANT``'s namespace."""
    item = (SimpleNamespace(put=lambda _: None), SimpleNamespace(**{NAMESPACE_ATTRIBUTE: TENANT}),
            SimpleNamespace(max_tokens=3))
    taken = [item]
    assert admission.next_admitted(lambda timeout: taken.pop() if taken else None,
                                   lambda _: (prompt, [SYSTEM, USER, HEADER], ["system", "user"], "normal", None),
                                   0) is item
    return cache.fetch_nearest_cache(MODEL_KEY, prompt)


def _kept(service, prefix):
    """How many tokens of ``prefix`` plus one new token the tenant would reuse now."""
    return service.peek_prefix_len(tuple(prefix) + (NEW,), TENANT)


def _run(hold_segments: bool):
    """One request through the loop; what was kept of its user segment at each point, and its tokens."""
    model, service, cache, admission, generator = _server(hold_segments)
    caches, rest = _admitted(admission, cache, PROMPT)
    assert caches is None and rest == PROMPT
    types = ["system", "user"][::-1]
    (uid,) = generator.insert_segments(segments=[[SYSTEM, USER, HEADER]], max_tokens=[3], caches=[None],
                                       all_tokens=[[]])
    seen, tokens, prefills = {}, [], []
    while True:
        before = (generator._counters.prompt_tokens, generator._counters.prompt_time)
        prompt_responses, generation_responses = generator.next()
        prefills.append((generator._counters.prompt_tokens - before[0], generator._counters.prompt_time - before[1]))
        if tokens and "after the first token's step" not in seen:
            seen["after the first token's step"] = _kept(service, SYSTEM + USER)
        ends = [r.uid for r in prompt_responses if r.end_of_segment and not r.end_of_prompt and types]
        for _, (segment, key) in generator.extract_cache(ends).items():
            kind = types.pop()
            cache.insert_cache(MODEL_KEY, key[:], segment, cache_type=kind)
            seen[f"{kind} offered"] = _kept(service, key)
        for response in generation_responses:
            if not tokens:
                seen["first token"] = _kept(service, SYSTEM + USER)
            tokens.append(response.token)
            if response.finish_reason is not None:
                cache.insert_cache(MODEL_KEY, response.all_tokens[:], response.prompt_cache, cache_type="assistant")
        if any(r.finish_reason is not None for r in generation_responses):
            break
    assert uid not in admission._rows  # its lease ended with its row
    seen["prefills"] = prefills
    return model, service, cache, seen, tokens


def test_a_segment_end_is_kept_once_its_row_has_put_out_its_first_token():
    """Offered between the prefill and the first token, the user segment is held through that token
    and kept at the next step, in the row's namespace, with the state a fresh prefill computes."""
    model, service, cache, seen, tokens = _run(hold_segments=True)
    assert seen["system offered"] == 0 and seen["user offered"] == 0 and seen["first token"] == 0
    assert seen["after the first token's step"] == len(SYSTEM + USER)
    assert service.peek_prefix_len(tuple(SYSTEM + USER) + (NEW,), "default") == 0  # the row's tenant's alone
    with cache.serving(TENANT):
        fetched, rest = cache.fetch_nearest_cache(MODEL_KEY, SYSTEM + USER + [NEW])
    assert rest == [NEW]
    fresh = computed(model, SYSTEM + USER)
    n = len(SYSTEM + USER)
    for kept, expected in zip(fetched, fresh):
        assert kept.offset == expected.offset == n
        for ours, theirs in ((kept.keys, expected.keys), (kept.values, expected.values)):
            assert mx.allclose(ours[..., :n, :], theirs[..., :n, :], atol=1e-5).item()


def test_each_step_teaches_the_service_the_prefill_it_measured():
    """The pace a disk hit is weighed against is the batch's own: each step's prompt tokens over the
    time its prefill took (decayed sums, as :mod:`kvstate.core.pace` keeps them)."""
    from kvstate.core.pace import SMOOTHING
    _, service, _, seen, _ = _run(hold_segments=True)
    tokens = seconds = 0.0
    for step_tokens, step_seconds in seen["prefills"]:
        if step_tokens and step_seconds:
            tokens, seconds = (1 - SMOOTHING) * tokens + step_tokens, (1 - SMOOTHING) * seconds + step_seconds
    assert tokens > 0  # the run prefilled something
    assert service.report().prefill_tokens_per_s == pytest.approx(tokens / seconds)


def test_held_segments_change_when_state_is_kept_not_what_is_generated_nor_kept():
    """The same request with segment ends kept at once: the same tokens, the same state kept in the
    end; the segments were kept as they were offered."""
    *_, held_seen, held_tokens = _run(hold_segments=True)
    _, service, _, seen, tokens = _run(hold_segments=False)
    assert seen["user offered"] == len(SYSTEM + USER) and seen["first token"] == len(SYSTEM + USER)
    assert tokens == held_tokens
    assert held_seen["after the first token's step"] == seen["after the first token's step"]


def test_a_fetch_an_insert_a_trim_or_the_rows_end_keeps_what_is_held_first():
    """A held segment end is kept before anything that may read it: another request's fetch, a later
    insert (kept in the order offered), a trim, the row's end."""
    model, service, cache, admission, _ = _server(hold_segments=True)
    LATER = [240] + list(range(1, 40))

    def offer(row, tokens, kind="user"):
        admission._namespaces[row] = TENANT
        admission.publishing(row, tokens)
        cache.insert_cache(MODEL_KEY, tokens, computed(model, tokens), cache_type=kind)

    def fetch():
        with cache.serving(TENANT):  # a request served on its own: a lookup in its namespace
            cache.fetch_nearest_cache(MODEL_KEY, [1, 2, 3])

    triggers = {"fetch": fetch, "trim": lambda: cache.trim_to(n_bytes=1 << 40),
                "row's end": lambda: admission.ended([5]),
                "insert": lambda: offer(6, LATER, kind="assistant")}
    for n, (name, trigger) in enumerate(triggers.items()):
        segment = [200 + n] + list(range(1, 40))  # one prefix a trigger
        offer(5, segment)
        assert _kept(service, segment) == 0, name
        trigger()
        assert _kept(service, segment) == len(segment), name
    assert _kept(service, LATER) == len(LATER)  # the insert itself kept, after the segment
