"""mlx-lm prompt-cache files in and out of a service, on a real random-weight llama."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import load_prompt_cache, make_prompt_cache, save_prompt_cache

from kvstate import KvCacheService, Request
from kvstate.interpreters.prompt_files import (
    NothingToExport, PromptFileRefused, export_prompt_cache, import_prompt_cache,
)
from kvstate.models.reference import build
from kvstate.interpreters.mlx.disk_store import FORMAT_VERSION

PROMPT = tuple(range(3, 43))


@pytest.fixture(scope="module")
def llama():
    return build("llama", seed=1)


def service_for(model, config):
    return KvCacheService.for_mlx(model, ram_bytes=8 << 20, config=config)


def next_logits(model, tokens, caches):
    logits = model(mx.array([list(tokens)]), cache=caches)[0, -1]
    mx.eval(logits)
    return logits


def recomputed(model, tokens):
    return next_logits(model, tokens, make_prompt_cache(model))


def computed_caches(model, tokens):
    caches = make_prompt_cache(model)
    mx.eval(model(mx.array([list(tokens)]), cache=caches))
    return caches


def serve_once(service, model, tokens):
    """Compute ``tokens`` and publish their state, as a scheduler would."""
    request = Request(tokens, 1)
    state = service.acquire(request, "default")
    caches = state.caches
    mx.eval(model(mx.array([list(tokens[state.reused_tokens:])]), cache=caches))
    service.publish(request, "default", tokens, caches)
    service.release(request)


def exported(llama, path, asked=PROMPT) -> int:
    """Serve PROMPT on a fresh service of ``llama``, export what it holds for ``asked`` to ``path``."""
    model, config = llama
    service = service_for(model, config)
    serve_once(service, model, PROMPT)
    return export_prompt_cache(service, path, asked)


def test_an_exported_file_is_mlx_lms_own_and_continues_as_recompute(llama, tmp_path):
    model, _ = llama
    path = tmp_path / "prompt.safetensors"
    assert exported(llama, path, PROMPT + (99, 98)) == len(PROMPT)  # the longest prefix held
    caches, metadata = load_prompt_cache(str(path), return_metadata=True)  # mlx-lm reads it unchanged
    assert metadata["kvstate_tokens"] and "kvstate_identity" in metadata
    assert mx.allclose(next_logits(model, (7,), caches), recomputed(model, PROMPT + (7,)), atol=1e-4)


def test_an_exported_file_imports_into_a_service_of_the_same_model(llama, tmp_path):
    model, config = llama
    path = tmp_path / "prompt.safetensors"
    exported(llama, path)
    target = service_for(model, config)
    assert import_prompt_cache(target, path) is True
    request = Request(PROMPT + (7,), 1)
    state = target.acquire(request, "default")
    assert state.reused_tokens == len(PROMPT)
    assert mx.allclose(next_logits(model, (7,), state.caches), recomputed(model, PROMPT + (7,)), atol=1e-4)
    target.release(request)


def test_a_file_of_another_model_is_refused_and_nothing_is_kept(llama, tmp_path):
    path = tmp_path / "prompt.safetensors"
    exported(llama, path)
    other, other_config = build("llama", seed=2)
    target = service_for(other, other_config)
    with pytest.raises(PromptFileRefused, match="another model"):
        import_prompt_cache(target, path)
    with pytest.raises(PromptFileRefused, match="another model"):  # the caller's word vouches for no identity
        import_prompt_cache(target, path, same_model=True, tokens=PROMPT)
    assert target.report().entries == 0


def test_mlx_lms_own_file_needs_the_callers_word_and_its_tokens(llama, tmp_path):
    model, config = llama
    path = tmp_path / "cache_prompt.safetensors"
    save_prompt_cache(str(path), computed_caches(model, PROMPT), {"model": "some/path"})
    service = service_for(model, config)
    with pytest.raises(PromptFileRefused, match="no kvstate identity"):
        import_prompt_cache(service, path)
    with pytest.raises(PromptFileRefused, match="records no tokens"):
        import_prompt_cache(service, path, same_model=True)
    with pytest.raises(PromptFileRefused, match="cover 40 tokens"):
        import_prompt_cache(service, path, same_model=True, tokens=PROMPT[:30])
    assert service.report().entries == 0
    assert import_prompt_cache(service, path, same_model=True, tokens=PROMPT) is True
    assert service.peek_prefix_len(PROMPT + (7,)) == len(PROMPT)


def test_nothing_to_export_and_a_garbage_file_are_named_errors(llama, tmp_path):
    model, config = llama
    service = service_for(model, config)
    with pytest.raises(NothingToExport):
        export_prompt_cache(service, tmp_path / "none.safetensors", PROMPT)
    assert service.report().live_requests == 0
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x00\x01garbage" * 10)
    with pytest.raises(PromptFileRefused, match="not an mlx-lm prompt-cache file"):
        import_prompt_cache(service, garbage)


def test_the_safetensors_library_lists_a_saved_files_tensors_and_metadata(llama, tmp_path):
    """kvstate's own saved files are standard safetensors: ``safe_open`` reads their tensors and header."""
    from safetensors import safe_open

    model, config = llama
    service = KvCacheService.for_mlx(model, ram_bytes=8 << 20, config=config, disk_dir=str(tmp_path / "disk"),
                                     disk_bytes=64 << 20)
    serve_once(service, model, PROMPT)
    assert service.flush().durable
    (path,) = [p for p in (tmp_path / "disk").rglob("*.safetensors") if "rejected" not in p.parts]
    caches = computed_caches(model, PROMPT)
    with safe_open(str(path), framework="numpy") as saved:
        assert {f"{i}.{part}" for i in range(len(caches)) for part in ("keys", "values")} <= set(saved.keys())
        metadata = saved.metadata()
        assert metadata["kvstate.kind"] == "prefix" and metadata["kvstate.format"] == FORMAT_VERSION
        keys = saved.get_tensor("0.keys")
    assert keys.shape == (1, caches[0].keys.shape[1], len(PROMPT), caches[0].keys.shape[3])
    assert mx.allclose(mx.array(keys), caches[0].keys[..., :len(PROMPT), :], atol=1e-5)
