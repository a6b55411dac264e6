"""State in blocks on the MLX interpreter, with real caches and real files: every reuse continues as a
recompute (from RAM, from disk after a restart, across branches), each block is held once in RAM and
written once to disk, and a bad or old-format block file is rejected, counted and never restored.

Blocks of 16 tokens here, so prompts of a few dozen tokens make chains of several blocks and a
partial last one; the reference llama model (random weights, float32), and for state that cannot
be cut, qwen3_next and gemma3_text (snapshots on blocks) and mamba (no layer to cut: kept whole).
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, make_prompt_cache

from kvstate import KvCacheService, Request, Source
from kvstate.core.blocks import spans
from kvstate.effects.completions import FailureReason
from kvstate.interpreters.mlx import disk_store
from kvstate.models.reference import build

SIZE = 16
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def llama():
    return build("llama", seed=5)


def service_for(model, config, directory, block_tokens=SIZE, **options):
    options.setdefault("background_writes", False)
    return KvCacheService.for_mlx(model, ram_bytes=8 << 20, disk_dir=str(directory), disk_bytes=64 << 20,
                                  config=config, block_tokens=block_tokens, **options)


def last_logits(model, tokens, caches):
    out = model(mx.array([list(tokens)]), cache=caches)
    mx.eval(out)
    return out[0, -1]


def turn(service, model, prompt, namespace="n"):
    """Acquire, prefill what is not covered, publish, release: the acquire's state and the next logits."""
    request = Request(prompt, 4)
    state = service.acquire(request, namespace)
    logits = last_logits(model, prompt[state.reused_tokens:], state.caches)
    service.publish(request, namespace, prompt, state.caches)
    service.release(request)
    return state, logits


def published_then_restarted(model, config, directory, prompt, **options):
    """A service on ``directory`` after another kept ``prompt`` there, made it durable and closed."""
    first = service_for(model, config, directory)
    turn(first, model, prompt)
    assert first.flush().durable
    first.close()
    return service_for(model, config, directory, **options)


def assert_recomputed(model, prompt, logits):
    want = last_logits(model, prompt, make_prompt_cache(model))
    assert float(mx.abs(logits - want).max()) <= TOLERANCE


def ram_blocks(service):
    return [e for e in service.state.entries.values() if e.is_block and e.residence.value in ("ram", "both", "spilling")]


def test_a_branch_reuses_the_shared_blocks_from_ram_and_continues_as_a_recompute(llama, tmp_path):
    model, config = llama
    service = service_for(model, config, tmp_path)
    first = tuple(range(1, 3 * SIZE + 6))                      # three full blocks and a partial one
    turn(service, model, first)
    branch = first[:2 * SIZE + 3] + (200, 201, 202, 203)       # diverges inside the third block
    state, logits = turn(service, model, branch)
    assert state.source is Source.RAM and state.reused_tokens == 2 * SIZE + 3
    assert all(type(c) is KVCache for c in state.caches)       # the classes mlx-lm's loop takes
    assert_recomputed(model, branch, logits)
    # The two prompts share their first two blocks: held once, each branch holds only its own.
    held = {(e.start, e.length) for e in ram_blocks(service)}
    assert held == {(0, SIZE), (SIZE, 2 * SIZE), (2 * SIZE, 3 * SIZE), (2 * SIZE, len(branch)),
                    (3 * SIZE, len(first))}
    per_token = service.state.ram.bytes // sum(stop - start for start, stop in held)
    assert service.state.ram.bytes == per_token * (len(first) + len(branch) - 2 * SIZE)
    service.close()


def test_a_conversation_writes_each_block_once(llama, tmp_path):
    """Each turn writes only the blocks no earlier turn wrote, plus its partial last block; whole
    prefixes write every turn whole (over twelve turns of 11 tokens, more than three times as much)."""
    model, config = llama
    blocked = service_for(model, config, tmp_path / "blocks")
    whole = service_for(model, config, tmp_path / "whole", block_tokens=None)
    prompt: tuple[int, ...] = ()
    for step in range(12):
        prompt = prompt + tuple(range(100 + 11 * step, 111 + 11 * step))  # 11 tokens a turn
        for service in (blocked, whole):
            state, logits = turn(service, model, prompt)
            assert_recomputed(model, prompt, logits)
            assert state.reused_tokens == (len(prompt) - 11 if step else 0)
    per_token = blocked.state.ram.bytes // len(prompt)
    written = blocked.report().bytes_written
    full_blocks = len(prompt) // SIZE * SIZE
    payload_once = per_token * full_blocks                     # every full block written once
    assert payload_once <= written < payload_once + 12 * (per_token * SIZE + 4096)  # + partial blocks, headers
    assert written * 3 < whole.report().bytes_written
    blocked.close()
    whole.close()


def test_after_a_restart_blocks_are_restored_from_disk_and_continue_as_a_recompute(llama, tmp_path):
    model, config = llama
    prompt = tuple(range(7, 7 + 4 * SIZE + 9))
    again = published_then_restarted(model, config, tmp_path, prompt)
    assert again.scan_result.kept == len(spans(len(prompt), SIZE))
    longer = prompt + (200, 201)
    state, logits = turn(again, model, longer)
    assert state.source is Source.DISK and state.reused_tokens == len(prompt)
    assert_recomputed(model, longer, logits)
    # Now in RAM: a branch is served from there, reading nothing more.
    read = again.report().bytes_read
    state, logits = turn(again, model, prompt[:3 * SIZE + 2] + (77,))
    assert state.source is Source.RAM and again.report().bytes_read == read
    assert_recomputed(model, prompt[:3 * SIZE + 2] + (77,), logits)
    again.close()


def test_a_chain_read_ahead_from_disk_serves_the_next_request_from_ram_as_a_recompute(llama, tmp_path):
    model, config = llama
    prompt = tuple(range(9, 9 + 3 * SIZE + 5))
    again = published_then_restarted(model, config, tmp_path, prompt)
    assert again.prefetch(prompt + (1,), "n") is True
    assert again.report().prefetches == 1 and again.report().bytes_read > 0
    read = again.report().bytes_read
    longer = prompt + (200, 201)
    state, logits = turn(again, model, longer)
    assert state.source is Source.RAM and state.reused_tokens == len(prompt)
    assert again.report().bytes_read == read  # served from what was read ahead
    assert_recomputed(model, longer, logits)
    again.close()


@pytest.mark.parametrize("damaged", [-3, 40], ids=["in-a-tensor", "in-the-header"])
def test_a_read_ahead_on_the_reader_thread_lands_at_a_poll_and_rejects_a_damaged_block(llama, tmp_path, damaged):
    """Blocks read ahead (headers checked where the read is asked for, files read and verified on the
    reader thread, tensors made where the completion is taken): the blocks before a damaged one come
    into RAM, the damaged one is rejected and moved aside, whether its tensors or its header fail, and
    the one after it, which serves nothing without it, is forgotten."""
    model, config = llama
    prompt = tuple(range(11, 11 + 3 * SIZE + 5))
    again = published_then_restarted(model, config, tmp_path, prompt, background_writes=True)
    entries = sorted((e for e in again.state.entries.values() if e.is_block), key=lambda e: e.start)
    path = again.interpreter.store.block_path(_name(again, entries[2]))
    data = bytearray(path.read_bytes())
    data[damaged] ^= 0x01
    path.write_bytes(bytes(data))
    assert again.prefetch(prompt + (1,), "n") is True
    assert {e.residence.value for e in again.state.entries.values()} == {"prefetching"}
    again.complete(again.interpreter.drain_reads())
    assert sorted(e.residence.value for e in again.state.entries.values()) == ["both", "both"]
    assert again.report().rejected_files == 1 and again.interpreter.store.rejected == [(path.name, FailureReason.CORRUPT)]
    assert again.interpreter.ram_entries() == {entries[0].id, entries[1].id}
    state, logits = turn(again, model, prompt[:2 * SIZE + 3] + (60,))
    assert state.source is Source.RAM and state.reused_tokens == 2 * SIZE
    assert_recomputed(model, prompt[:2 * SIZE + 3] + (60,), logits)
    again.close()


def test_a_damaged_block_is_rejected_and_the_request_served_from_the_blocks_before_it(llama, tmp_path):
    model, config = llama
    first = service_for(model, config, tmp_path)
    prompt = tuple(range(3, 3 + 3 * SIZE + 4))
    turn(first, model, prompt)
    first.flush()
    first.close()
    again = service_for(model, config, tmp_path)
    entries = sorted((e for e in again.state.entries.values() if e.is_block), key=lambda e: e.start)
    assert len(entries) == 4
    path = again.interpreter.store.block_path(_name(again, entries[2]))
    data = bytearray(path.read_bytes())
    data[-3] ^= 0xFF  # one flipped byte in the block's tensors
    path.write_bytes(bytes(data))
    state, logits = turn(again, model, prompt + (5,))
    assert state.reused_tokens == 2 * SIZE  # the two blocks before the damaged one, nothing after it
    assert_recomputed(model, prompt + (5,), logits)
    assert again.report().rejected_files == 1
    assert again.interpreter.store.rejected == [(path.name, FailureReason.CORRUPT)]  # moved aside, not deleted
    again.close()


def _name(service, entry):
    from kvstate.core.draft import Draft
    from kvstate.core.tiers import saved_name
    return saved_name(Draft(service.state), entry)


def test_files_of_the_earlier_format_are_rejected_and_counted_never_restored(llama, tmp_path, monkeypatch):
    model, config = llama
    monkeypatch.setattr(disk_store, "FORMAT_VERSION", "2")
    old = service_for(model, config, tmp_path, block_tokens=None)
    prompt = tuple(range(1, 40))
    turn(old, model, prompt)
    old.close()
    monkeypatch.undo()
    new = service_for(model, config, tmp_path)
    assert new.scan_result.rejected == 1 and new.report().rejected_files == 1
    state, _ = turn(new, model, prompt + (2,))
    assert state.reused_tokens == 0
    new.close()


@pytest.fixture(scope="module", params=["qwen3_next", "gemma3_text"])
def hybrid(request):
    model, config = build(request.param, seed=6)
    return request.param, model, config


def prefill_in_chunks(service, model, prompt, chunk, namespace="n"):
    """A prefill that publishes its state at every ``chunk`` tokens and at its end (as a server keeps
    chunk snapshots): the acquire's state, and the logits after the prompt."""
    request = Request(prompt, 4)
    state = service.acquire(request, namespace)
    at = state.reused_tokens
    logits = None
    while at < len(prompt):
        stop = min(len(prompt), (at // chunk + 1) * chunk)
        logits = last_logits(model, prompt[at:stop], state.caches)
        service.publish(request, namespace, prompt[:stop], state.caches)
        at = stop
    service.release(request)
    return state, logits


def edit_then_restart(service, model, config, directory, prompt, chunk):
    """An edit inside the fourth chunk of ``prompt`` reuses the first three chunks from RAM; after a
    restart a regenerate reuses all of ``prompt`` from disk; each continues as a recompute."""
    edited = prompt[:3 * chunk + 9] + (250, 251, 252)  # diverges inside the fourth chunk
    state, logits = prefill_in_chunks(service, model, edited, chunk)
    assert state.source is Source.RAM and state.reused_tokens == 3 * chunk
    assert_recomputed(model, edited, logits)
    assert service.flush().durable
    service.close()
    again = service_for(model, config, directory)
    regenerate = prompt + (9,)
    state, logits = turn(again, model, regenerate)
    assert state.source is Source.DISK and state.reused_tokens == len(prompt)
    assert_recomputed(model, regenerate, logits)
    again.close()
    # Read ahead instead: the chain's blocks and its snapshot come into RAM before the request.
    ahead = service_for(model, config, directory)
    assert ahead.prefetch(regenerate, "n") is True
    state, logits = turn(ahead, model, regenerate)
    assert state.source is Source.RAM and state.reused_tokens == len(prompt)
    assert_recomputed(model, regenerate, logits)
    ahead.close()


def test_a_hybrid_model_reuses_up_to_the_last_chunk_snapshot_before_a_divergence(hybrid, tmp_path):
    """Layers that cannot be cut are kept as snapshots at chunk ends, on the blocks of the layers that
    can: an edit inside the prompt reuses everything up to the last snapshot before it, from RAM and,
    after a restart, from disk, and continues as a recompute."""
    name, model, config = hybrid
    chunk = SIZE
    service = service_for(model, config, tmp_path)
    prompt = tuple(range(2, 2 + 5 * chunk + 7))
    prefill_in_chunks(service, model, prompt, chunk)
    snapshots = [e for e in service.state.entries.values() if e.is_snapshot]
    assert sorted(e.length for e in snapshots) == [chunk, 2 * chunk, 3 * chunk, 4 * chunk, 5 * chunk, len(prompt)]
    assert all(not e.trimmable for e in service.state.entries.values() if e.is_block)
    edit_then_restart(service, model, config, tmp_path, prompt, chunk)


def test_a_model_with_no_layer_to_cut_keeps_whole_states_and_reuses_up_to_the_last_before_a_divergence(tmp_path):
    """mamba's layers are all recurrent: with blocks configured, its states are kept whole, one at each
    chunk end (none can be cut back), and an edit inside the prompt reuses up to the last one before
    it, from RAM and after a restart from disk, and continues as a recompute."""
    model, config = build("mamba", seed=6)
    chunk = SIZE
    service = service_for(model, config, tmp_path)
    prompt = tuple(range(2, 2 + 5 * chunk + 7))
    prefill_in_chunks(service, model, prompt, chunk)
    kept = [e for e in service.state.entries.values()]
    assert not any(e.is_block or e.is_snapshot for e in kept)
    assert sorted(e.length for e in kept) == [chunk, 2 * chunk, 3 * chunk, 4 * chunk, 5 * chunk, len(prompt)]
    edit_then_restart(service, model, config, tmp_path, prompt, chunk)
