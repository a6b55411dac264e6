"""The server's batch admission (``interpreters/serving/batch_admission.py``) on the simulator: the
order in which waiting requests are admitted, and the waits for a prefix a row in prefill will publish."""

from __future__ import annotations

from types import SimpleNamespace

from kvstate import KvCacheService
from kvstate.interpreters.serving.batch_admission import BatchAdmission
from kvstate.interpreters.serving.prompt_cache import KvStatePromptCache
from tests.test_padded_batch_admission import BUDGET, SPEC, STEP


def test_a_request_waiting_for_a_shared_prefix_lets_unrelated_ones_go_first():
    """Head of line: A waits for the system prompt a row in prefill will publish; B, behind A,
    shares nothing with that row, so it is admitted at once instead of waiting out A's wait."""
    service = KvCacheService.simulated(SPEC, ram_bytes=BUDGET * 8, kv_budget_bytes=BUDGET * 8,
                                       batch_padding_step=STEP)
    admission = BatchAdmission(KvStatePromptCache(service, "model"), share_wait_s=60.0, min_shared_tokens=8)
    system, user = list(range(1, 101)), list(range(500, 520))

    def item(prompt):
        return (SimpleNamespace(put=lambda _: None), SimpleNamespace(), SimpleNamespace(max_tokens=4)), prompt
    row, row_prompt = item(system + user)
    a, a_prompt = item(system + list(range(900, 910)))
    b, b_prompt = item(list(range(2000, 2030)))
    prompts = {id(row): row_prompt, id(a): a_prompt, id(b): b_prompt}
    arrivals = [row]

    def take(timeout):
        return arrivals.pop(0) if arrivals else None

    def tokenize(server_item):
        return (prompts[id(server_item)], [prompts[id(server_item)]], ["user"], "normal", None)
    assert admission.next_admitted(take, tokenize, 0) is row
    admission.placed([7], segments=[[system, user]], cached=[[]])  # a row in prefill: it publishes at 100
    arrivals.extend([a, b])
    assert admission.next_admitted(take, tokenize, 0) is b
    assert admission.shared_waits == 1 and [w.item for w in admission._waiting] == [a]
    assert service.report().live_requests == 2  # the row's lease and B's; A holds nothing while it waits
