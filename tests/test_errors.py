"""Every error the port raises: its type, a message that says what to change, and state untouched."""

import pytest

import kvstate
from kvstate import (
    CheckpointNotAllowed, Continuation, ContextLimitExceeded, InvalidConfig, InvalidNamespace, InvalidRequest,
    KvCacheService, OverBudget, Request, RequestAlreadyAcquired, RequestKeepsNoState, ServiceClosed,
    TokensDoNotMatchCaches, UnknownModel, UnknownRequest, UsageError, model_spec,
)

SPEC = model_spec("llama-3.2-1b")


@pytest.fixture
def service():
    return KvCacheService.simulated(SPEC, ram_bytes=SPEC.bytes_for(4000), kv_budget_bytes=SPEC.bytes_for(2000))


def unchanged(service, call, error, match=None):
    before = service.state
    with pytest.raises(error, match=match):
        call()
    assert service.state == before
    assert service.state is before


def test_context_limit(service):
    request = Request([1] * 10, max_tokens=SPEC.context_limit)
    unchanged(service, lambda: service.admit(request), ContextLimitExceeded, "context limit of 131072")


def test_over_budget_alone(service):
    request = Request([1] * 1000, max_tokens=1500)
    unchanged(service, lambda: service.admit(request), OverBudget, "lower max_tokens or raise the budget")


def test_wait_is_a_value_not_an_error(service):
    first, second = Request([1] * 1000, 500), Request([2] * 1000, 500)
    assert service.admit(first)
    before = service.state
    assert service.admit(second) is False
    assert service.state == before
    assert not service.fits(second)
    service.release(first)
    assert service.fits(second) and service.admit(second)


@pytest.mark.parametrize("prompt, max_tokens, match", [
    ([], 5, "empty"), ([1, 2.5], 5, "integer"), ("hello", 5, "sequence of token ids"), ([1, -2], 5, "negative"),
    ([1], 0, "at least 1"), ([1], 2.0, "integer"),
])
def test_malformed_requests(prompt, max_tokens, match):
    with pytest.raises(InvalidRequest, match=match):
        Request(prompt, max_tokens)


def test_not_a_request(service):
    unchanged(service, lambda: service.admit("prompt"), InvalidRequest, "kvstate.Request")


def test_unknown_request_on_release(service):
    unchanged(service, lambda: service.release(Request([1], 1)), UnknownRequest, "never admitted")


def test_double_release_is_a_no_op(service):
    request = Request([1, 2, 3], 4)
    service.admit(request)
    service.release(request)
    before = service.state
    service.release(request)
    assert service.state is before


def test_acquire_twice(service):
    request = Request([1, 2, 3], 4)
    service.acquire(request, "n")
    unchanged(service, lambda: service.acquire(request, "n"), RequestAlreadyAcquired, "release it")


@pytest.mark.parametrize("namespace", ["", "a/b", "..", "a\\b", 3, None])
def test_bad_namespaces(service, namespace):
    request = Request([1, 2, 3], 4)
    unchanged(service, lambda: service.acquire(request, namespace), InvalidNamespace)


def test_publish_tokens_that_do_not_match_the_caches(service):
    request = Request([1, 2, 3], 4)
    state = service.acquire(request, "n")
    caches = service.interpreter.prefill(state.caches, [1, 2, 3])
    unchanged(service, lambda: service.publish(request, "n", [1, 2, 3, 4], caches), TokensDoNotMatchCaches,
              "covering 3")


def test_publish_foreign_caches(service):
    request = Request([1, 2, 3], 4)
    unchanged(service, lambda: service.publish(request, "n", [1, 2, 3], object()), InvalidRequest, "SimCaches")


def test_publish_for_a_request_that_keeps_nothing(service):
    request = Request([1, 2, 3], 4, reuses_prefix=False)
    state = service.acquire(request, "n")
    assert not service.keeps(request)
    caches = service.interpreter.prefill(state.caches, [1, 2, 3])
    unchanged(service, lambda: service.publish(request, "n", [1, 2, 3], caches), RequestKeepsNoState,
              "reuses_prefix=False")


def test_checkpoint_without_checkpoint_storage(service):
    request = Request([1, 2, 3], 4, continuation=Continuation("gen-1", seed=7))
    state = service.acquire(request, "n")
    caches = service.interpreter.prefill(state.caches, [1, 2, 3, 9])
    unchanged(service, lambda: service.checkpoint(request, caches, [1, 2, 3, 9], 1), CheckpointNotAllowed,
              "checkpoint_every_tokens")


def test_calls_after_close(service):
    service.close()
    unchanged(service, lambda: service.admit(Request([1], 1)), ServiceClosed, "after close")
    assert service.report().entries == 0
    assert service.close() == service.close()


def test_bad_configuration():
    with pytest.raises(InvalidConfig, match="ram_capacity_bytes"):
        KvCacheService.simulated(SPEC, ram_bytes=-1)
    with pytest.raises(InvalidConfig, match="unknown eviction policy"):
        KvCacheService.simulated(SPEC, ram_bytes=10, policy="random")
    with pytest.raises(UnknownModel, match="llama-3.1-8b"):
        KvCacheService.simulated("gpt-5", ram_bytes=10)


def test_errors_split_by_fault():
    assert issubclass(OverBudget, UsageError) and issubclass(UnknownRequest, UsageError)
    assert not issubclass(kvstate.StorageError, UsageError)


@pytest.mark.parametrize("options, match", [
    ({"checkpoint_every_tokens": 0}, "checkpoint_every_tokens"), ({"checkpoint_every_tokens": 2.5}, "checkpoint_every"),
    ({"demote_idle_after": 0}, "demote_idle_after"), ({"write_queue_bytes": -1}, "write_queue_bytes"),
    ({"kv_budget_bytes": True}, "kv_budget_bytes"),
])
def test_every_bad_setting_is_named(options, match):
    with pytest.raises(InvalidConfig, match=match):
        KvCacheService.simulated(SPEC, ram_bytes=10, disk_bytes=10, **options)
