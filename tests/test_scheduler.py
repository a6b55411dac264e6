"""The reference scheduler: the same tokens as mlx-lm alone, and generations that survive kill -9."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from kvstate import KvCacheService, Request
from kvstate.interpreters.scheduler import Scheduler, sample
from kvstate.models.reference import build


def chat_workload(seed: int, turns: int = 3, sessions: int = 2):
    """Sessions over one shared system prompt; each turn resends the conversation so far."""
    import random
    rng = random.Random(seed)
    system = tuple(rng.randrange(256) for _ in range(24))
    conversations = {s: system for s in range(sessions)}
    for turn in range(turns):
        for s in range(sessions):
            conversations[s] = conversations[s] + tuple(rng.randrange(256) for _ in range(rng.randint(3, 8)))
            yield s, turn, conversations[s]


@pytest.mark.parametrize("name", ["llama", "qwen3_next"])
def test_the_scheduler_gives_the_tokens_mlx_lm_gives_alone(name, tmp_path):
    model, config = build(name, seed=30)
    service = KvCacheService.for_mlx(model, config=config, ram_bytes=16 << 20, disk_dir=str(tmp_path),
                                     disk_bytes=64 << 20, kv_budget_bytes=1 << 24)
    scheduler = Scheduler(model, service)
    prompts = [prompt for _, _, prompt in chat_workload(seed=1)]
    results = []
    for prompt in prompts:  # turn by turn, so later turns find earlier ones
        results += scheduler.run([(Request(prompt, 6), "chat")])
    assert any(r.reused_tokens for r in results)
    for result, prompt in zip(results, prompts):
        alone = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=6)]
        assert list(result.tokens) == alone


def test_rows_run_side_by_side_under_a_budget(tmp_path):
    model, config = build("llama", seed=31)
    spec_bytes = KvCacheService.for_mlx(model, config=config, ram_bytes=1).config.model.bytes_for(60)
    service = KvCacheService.for_mlx(model, config=config, ram_bytes=16 << 20, kv_budget_bytes=2 * spec_bytes)
    prompts = [tuple(range(i, i + 50)) for i in range(4)]
    finished = Scheduler(model, service).run([(Request(p, 10), "n") for p in prompts])
    assert sorted(r.request.prompt for r in finished) == sorted(prompts)
    assert service.report().live_requests == 0 and service.report().projected_bytes == 0
    for result in finished:
        alone = [int(t) for t, _ in generate_step(mx.array(result.request.prompt), model, max_tokens=10)]
        assert list(result.tokens) == alone


CHILD = """
import sys
from kvstate import Continuation, KvCacheService, Request
from kvstate.interpreters.scheduler import Scheduler
from kvstate.models.reference import build
directory, name, resume = sys.argv[1], sys.argv[2], sys.argv[3] == "resume"
model, config = build(name, seed=40)
service = KvCacheService.for_mlx(model, config=config, ram_bytes=16 << 20, disk_dir=directory,
                                 disk_bytes=64 << 20, checkpoint_every_tokens=4)
request = Request(tuple(range(3, 40)), 48, continuation=Continuation("story-1", seed=1234, seed_was_explicit=True))
scheduler = Scheduler(model, service, temperature=0.8)
if not resume:  # held halfway (until killed): the parent kills it there, mid-generation
    original = scheduler._step
    def step_then_hold(row):
        original(row)
        if len(row.generated) == 24:
            print("HOLD", flush=True)
            sys.stdin.readline()
    scheduler._step = step_then_hold
result = scheduler.run([(request, "n")])[0]
service.close()
print("RESULT", result.resumed, " ".join(map(str, result.tokens)), flush=True)
"""


def uninterrupted(name: str) -> list[int]:
    """The same seeded generation with no service at all: prefill, then token by token."""
    from mlx_lm.models.cache import make_prompt_cache
    model, _ = build(name, seed=40)
    caches = make_prompt_cache(model)
    logits = model(mx.array([list(range(3, 40))]), cache=caches)[0, -1]
    tokens = [sample(logits, 1234, 0, 0.8)]
    while len(tokens) < 48:
        logits = model(mx.array([[tokens[-1]]]), cache=caches)[0, -1]
        tokens.append(sample(logits, 1234, len(tokens), 0.8))
    return tokens


@pytest.mark.parametrize("name", ["llama", "qwen3_next"])
def test_a_generation_killed_with_sigkill_resumes_to_the_same_tokens(name, tmp_path):
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(tmp_path), name, "first"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert child.stdout.readline().strip() == "HOLD", child.stderr.read()   # held 24 tokens in
    deadline = time.monotonic() + 120  # its checkpoints are written in the background: wait for one
    while not list(tmp_path.rglob("checkpoint-*.safetensors")) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert list(tmp_path.rglob("checkpoint-*.safetensors")) and child.poll() is None
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    assert child.returncode == -signal.SIGKILL
    resumed = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), name, "resume"],
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    line = next(l for l in resumed.stdout.splitlines() if l.startswith("RESULT"))
    _, was_resumed, *tokens = line.split()
    assert was_resumed == "True"
    assert [int(t) for t in tokens] == uninterrupted(name)
    assert not list(tmp_path.rglob("checkpoint-*.safetensors"))  # completed: its checkpoints are gone


def test_the_demo_runs_and_reuses_state():
    done = subprocess.run([sys.executable, "-m", "kvstate.interpreters.cli", "demo", "--sessions", "2",
                           "--turns", "2"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "random-weight" in done.stdout and "hit rate 0.75 (3 of 4" in done.stdout
    assert "service report:" in done.stdout
