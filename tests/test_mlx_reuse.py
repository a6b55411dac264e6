"""Real tensors: state the service hands back continues exactly as recomputing from scratch would.

Every reference model (random weights, float32) on the MLX interpreter with a
disk tier in a temporary directory: a RAM hit, a trimmed hit where the caches
allow it, a disk hit from a fresh service, and the boundary snapshot of
non-trimmable models; then mlx-lm's own ``generate_step`` on acquired caches.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step

from kvstate import Continuation, KvCacheService, Request, Source
from kvstate.models.reference import CONFIGS, build

TOLERANCE = 1e-5
MODELS = sorted(CONFIGS)
TRIMMABLE = {"llama", "gemma3_text"}


@pytest.fixture(scope="module", params=MODELS)
def reference(request):
    model, config = build(request.param, seed=1)
    return request.param, model, config


def service_for(model, config, directory, **options):
    return KvCacheService.for_mlx(model, ram_bytes=8 << 20, disk_dir=str(directory), disk_bytes=64 << 20,
                                  config=config, **options)


def last_logits(model, tokens, caches=None):
    out = model(mx.array([list(tokens)]), cache=caches)
    mx.eval(out)
    return out[0, -1]


def recomputed(model, tokens):
    from mlx_lm.models.cache import make_prompt_cache
    return last_logits(model, tokens, make_prompt_cache(model))


def run(service, model, prompt, namespace="n", publish=True):
    """Acquire, prefill what is not covered, publish the prompt's state, release; the state and next logits."""
    request = Request(prompt, 4)
    state = service.acquire(request, namespace)
    logits = last_logits(model, prompt[state.reused_tokens:], state.caches)
    if publish:
        service.publish(request, namespace, prompt, state.caches)
    service.release(request)
    return state, logits


def assert_same(a, b):
    assert float(mx.abs(a - b).max()) <= TOLERANCE


def test_ram_hit_continues_as_recompute(reference, tmp_path):
    name, model, config = reference
    service = service_for(model, config, tmp_path)
    base = tuple(range(3, 23))
    run(service, model, base)
    prompt = base + (40, 41, 42)
    state, logits = run(service, model, prompt, publish=False)
    assert (state.source, state.reused_tokens) == (Source.RAM, len(base))
    assert_same(logits, recomputed(model, prompt))


def test_trimmed_hit_where_the_caches_allow_it(reference, tmp_path):
    name, model, config = reference
    service = service_for(model, config, tmp_path)
    run(service, model, tuple(range(3, 23)))
    prompt = tuple(range(3, 15)) + (90, 91)  # shares 12 tokens with a 20-token entry
    state, logits = run(service, model, prompt, publish=False)
    assert state.reused_tokens == (12 if name in TRIMMABLE else 0)
    assert_same(logits, recomputed(model, prompt))


def test_disk_hit_in_a_fresh_service(reference, tmp_path):
    name, model, config = reference
    first = service_for(model, config, tmp_path)
    base = tuple(range(5, 29))
    run(first, model, base)
    assert first.close().durable
    second = service_for(model, config, tmp_path)
    assert second.report().saved_entries == 1
    prompt = base + (7,)
    state, logits = run(second, model, prompt, publish=False)
    assert (state.source, state.reused_tokens) == (Source.DISK, len(base))
    assert_same(logits, recomputed(model, prompt))


def test_part_of_a_saved_prefix_restored_from_disk_continues_as_recompute(reference, tmp_path):
    """A trimmed restore: a fresh service reads a 24-token file and hands back only its first 14
    tokens where the caches allow it; the next logits equal a full recompute's."""
    name, model, config = reference
    first = service_for(model, config, tmp_path)
    run(first, model, tuple(range(5, 29)))
    assert first.close().durable
    second = service_for(model, config, tmp_path)
    prompt = tuple(range(5, 19)) + (99, 98)  # shares 14 tokens with the saved 24
    state, logits = run(second, model, prompt, publish=False)
    if name in TRIMMABLE:
        assert (state.source, state.reused_tokens) == (Source.DISK, 14)
    else:
        assert state.reused_tokens == 0  # recurrent state serves only its exact position
    assert_same(logits, recomputed(model, prompt))


def test_a_wrapped_sliding_window_serves_only_its_exact_position(tmp_path):
    model, config = build("gemma3_text", seed=2)
    window = config["sliding_window"]
    service = service_for(model, config, tmp_path)
    long = tuple(range(1, window + 10))  # past the window: wrapped
    run(service, model, long)
    shorter = long[:window - 5] + (77,)
    state, logits = run(service, model, shorter, publish=False)
    assert state.reused_tokens == 0
    exact, logits = run(service, model, long + (78,), publish=False)
    assert exact.reused_tokens == len(long)
    assert_same(logits, recomputed(model, long + (78,)))


def test_acquired_caches_share_nothing_with_what_is_kept(tmp_path):
    model, config = build("llama", seed=3)
    service = service_for(model, config, tmp_path)
    base = tuple(range(10, 30))
    run(service, model, base)
    request = Request(base + (1,), 4)
    state = service.acquire(request, "n")
    for token in range(50, 60):  # decode one token at a time: mlx-lm writes into the caches in place
        last_logits(model, [token], state.caches)
    service.release(request)
    again, logits = run(service, model, base + (2,), publish=False)
    assert again.reused_tokens == len(base)
    assert_same(logits, recomputed(model, base + (2,)))


@pytest.mark.parametrize("name", MODELS)
def test_generate_step_on_acquired_caches_gives_the_same_tokens(name, tmp_path):
    model, config = build(name, seed=4)
    service = service_for(model, config, tmp_path)
    system = tuple(range(30, 50))
    run(service, model, system)
    prompt = system + (60, 61, 62, 63)
    state = service.acquire(Request(prompt, 8), "n")
    assert state.reused_tokens == len(system)
    with_kvstate = [int(t) for t, _ in generate_step(mx.array(prompt[state.reused_tokens:]), model,
                                                     prompt_cache=state.caches, max_tokens=8)]
    without = [int(t) for t, _ in generate_step(mx.array(prompt), model, max_tokens=8)]
    assert with_kvstate == without


def test_a_checkpoint_resumes_in_a_fresh_service(tmp_path):
    model, config = build("qwen3_next", seed=5)
    service = service_for(model, config, tmp_path, checkpoint_every_tokens=4)
    prompt = tuple(range(1, 17))
    request = Request(prompt, 16, continuation=Continuation("chat-7", seed=11))
    state = service.acquire(request, "n")
    last_logits(model, prompt, state.caches)
    generated = (5, 6, 7, 8)
    last_logits(model, generated, state.caches)
    assert service.checkpoint(request, state.caches, prompt + generated, len(generated), pending_token=9)
    service.release(request, completed=False)
    assert service.flush().durable
    service.close()                                   # a restart: one live service per directory
    resumed_service = service_for(model, config, tmp_path, checkpoint_every_tokens=4)
    again = Request(prompt, 16, continuation=Continuation("chat-7", seed=11))
    resumed = resumed_service.acquire(again, "n")
    assert resumed.source is Source.CHECKPOINT and resumed.resumed_tokens == prompt + generated
    assert resumed.resumed.pending_token == 9
    assert_same(last_logits(model, [9], resumed.caches), recomputed(model, prompt + generated + (9,)))
    resumed_service.release(again, completed=True)
    assert resumed_service.flush().durable
    assert not list(tmp_path.rglob("checkpoint-*.safetensors"))


CHILD = """
import sys, mlx.core as mx
from mlx_lm.models.cache import make_prompt_cache
from kvstate import KvCacheService, Request, Source
from kvstate.models.reference import build
directory, name = sys.argv[1], sys.argv[2]
model, config = build(name, seed=12)
service = KvCacheService.for_mlx(model, ram_bytes=8 << 20, disk_dir=directory, disk_bytes=64 << 20, config=config)
prompt = tuple(range(5, 29)) + (7,)
state = service.acquire(Request(prompt, 4), "n")
assert (state.source, state.reused_tokens) == (Source.DISK, 24), (state.source, state.reused_tokens)
ours = model(mx.array([list(prompt[24:])]), cache=state.caches)[0, -1]
again = model(mx.array([list(prompt)]), cache=make_prompt_cache(model))[0, -1]
print(float(mx.abs(ours - again).max()))
"""


@pytest.mark.parametrize("name", MODELS)
def test_disk_hit_in_a_fresh_process(name, tmp_path):
    import subprocess
    import sys

    model, config = build(name, seed=12)
    service = service_for(model, config, tmp_path)
    run(service, model, tuple(range(5, 29)))
    assert service.close().durable
    child = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path), name], capture_output=True, text=True)
    assert child.returncode == 0, child.stderr
    assert float(child.stdout.strip()) <= TOLERANCE


def test_a_generation_that_completes_while_its_checkpoint_is_being_written_leaves_none_and_never_resumes(tmp_path):
    """The checkpoint's write is held on the writer thread (a gate in the store's write seam) while the
    generation completes; once the write goes through, the deletion that follows it removes the file,
    and a restarted service starts the same request afresh."""
    import threading

    from kvstate.interpreters.mlx import file_io

    writing, go = threading.Event(), threading.Event()

    def gated_write(path, chunks):
        if path.name.startswith(".checkpoint-"):
            writing.set()
            go.wait()
        file_io.write_durably(path, chunks)

    model, config = build("llama", seed=5)
    service = service_for(model, config, tmp_path, checkpoint_every_tokens=4, write_file=gated_write)
    prompt = tuple(range(1, 17))
    request = Request(prompt, 16, continuation=Continuation("chat-8", seed=11))
    state = service.acquire(request, "n")
    last_logits(model, prompt + (5, 6, 7, 8), state.caches)
    assert service.checkpoint(request, state.caches, prompt + (5, 6, 7, 8), 4, pending_token=9)
    assert writing.wait(timeout=60)                  # the write is in flight on the writer thread
    service.release(request, completed=True)         # the generation completes meanwhile
    go.set()
    assert service.flush().durable
    service.close()
    assert not list(tmp_path.rglob("checkpoint-*.safetensors"))
    restarted = service_for(model, config, tmp_path, checkpoint_every_tokens=4)
    again = restarted.acquire(Request(prompt, 16, continuation=Continuation("chat-8", seed=11)), "n")
    assert again.source is not Source.CHECKPOINT and again.resumed is None
    restarted.close()


def test_a_detached_copy_continues_as_the_caches_it_was_taken_from(reference):
    """``caches.detached`` (a checkpoint's snapshot of a running row) copies every array out of the
    row's buffers: the copy continues to the same logits as a recompute, and the row going on after it
    changes nothing in it."""
    from mlx_lm.models.cache import make_prompt_cache

    from kvstate.interpreters.mlx import caches as mlx_caches

    name, model, config = reference
    prompt = tuple(range(1, 25))
    running = make_prompt_cache(model)
    last_logits(model, prompt, running)
    copy = mlx_caches.detached(running, len(prompt))
    last_logits(model, (30, 31, 32), running)           # the row goes on
    assert_same(last_logits(model, (7,), copy), recomputed(model, prompt + (7,)))
