"""The same event script through the simulator and through the MLX interpreter gives the same answers.

Both facades run the same core; what may differ is how their interpreters
measure caches and carry out effects. With the geometry read off the model,
replies (admission, reused tokens, their source, keeps) and every report
counter must agree, on a RAM tier small enough to evict and a disk tier.

The disk tier charges the bytes a file really takes. The MLX interpreter's
files carry a header the simulator does not model, so the disk byte counts
differ by design: the disk tier here is sized so that neither evicts, and the
MLX side's count is held to the directory as the file system sees it instead.
"""

from __future__ import annotations

import os
import tempfile

import attrs
import hypothesis.strategies as st
import mlx.core as mx
from hypothesis import HealthCheck, given, settings

from kvstate import ContextLimitExceeded, KvCacheService, OverBudget, Request
from kvstate.models.mlx_adapter import spec_from_model
from kvstate.models.reference import build

MODELS = {name: build(name, seed=9) for name in ("llama", "qwen3_next")}
SPECS = {name: spec_from_model(model, name) for name, (model, _) in MODELS.items()}

prompts = st.lists(st.integers(0, 3), min_size=1, max_size=6).map(tuple)
steps = st.lists(st.tuples(st.sampled_from(["serve", "serve", "serve", "boundary", "flush"]),
                           st.integers(0, 5), prompts, st.integers(1, 40), st.booleans()), min_size=1, max_size=14)


def serve(service, prompt, max_tokens, namespace, prefill):
    request = Request(prompt, max_tokens)
    try:
        admitted = service.admit(request)
    except (OverBudget, ContextLimitExceeded) as error:
        return ("refused", type(error))
    if not admitted:
        return ("wait",)
    state = service.acquire(request, namespace)
    caches = prefill(state.caches, prompt[state.reused_tokens:])
    kept = service.publish(request, namespace, prompt, caches) if service.keeps(request) else None
    service.release(request)
    return ("served", state.reused_tokens, state.source, kept)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=st.sampled_from(sorted(MODELS)), script=steps, bases=st.lists(prompts, min_size=1, max_size=3))
def test_simulator_and_mlx_interpreter_agree(name, script, bases):
    model, config = MODELS[name]
    spec = SPECS[name]
    ram, disk = spec.bytes_for(40), 16 * (spec.bytes_for(30) + (16 << 10))  # room for every file of a script
    budget = spec.bytes_for(60)
    with tempfile.TemporaryDirectory() as directory:
        real = KvCacheService.for_mlx(model, ram_bytes=ram, kv_budget_bytes=budget, disk_dir=directory,
                                      disk_bytes=disk, config=config, spec=spec, background_writes=False)
        simulated = KvCacheService.simulated(spec, ram_bytes=ram, kv_budget_bytes=budget, disk_bytes=disk)

        def run_model(caches, tokens):
            if tokens:
                mx.eval(model(mx.array([list(tokens)]), cache=caches))
            return caches

        for action, base, tail, max_tokens, other_namespace in script:
            namespace = "b" if other_namespace else "a"
            prompt = (bases[base % len(bases)] * 3 + tail)[:30]
            if action == "serve":
                answers = [serve(real, prompt, max_tokens, namespace, run_model),
                           serve(simulated, prompt, max_tokens, namespace, simulated.interpreter.prefill)]
                assert answers[0] == answers[1]
            elif action == "boundary":
                real.boundary()
                simulated.boundary()
            else:
                assert real.flush() == simulated.flush()
            reports = [attrs.asdict(real.report()), attrs.asdict(simulated.report())]
            on_disk = sum(e.stat().st_size for e in os.scandir(real.interpreter.store.directory)
                          if e.name.endswith(".safetensors"))
            assert reports[0]["disk_bytes"] == reports[0]["saved_bytes"] == on_disk
            assert reports[1]["disk_evictions"] == 0
            assert reports[0]["bytes_written"] >= on_disk  # every file there was written, and counted
            for report in reports:  # file sizes differ by design (real headers), and paces are measured
                del report["disk_bytes"], report["saved_bytes"], report["bytes_written"], report["bytes_read"]
                del report["read_bytes_per_s"], report["prefill_tokens_per_s"]
            assert reports[0] == reports[1]
