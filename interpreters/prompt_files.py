"""mlx-lm prompt-cache files in and out of a service on the MLX interpreter.

``mlx_lm.cache_prompt`` and ``mlx_lm.models.cache.save_prompt_cache`` write a
prompt's caches to a ``.safetensors`` file that ``mlx_lm.generate
--prompt-cache-file`` and ``load_prompt_cache`` read back. :func:`export_prompt_cache`
writes what a service holds for a prompt as such a file, readable by mlx-lm
unchanged, and adds to its metadata what kvstate needs to take it back: the
tokens it covers and the service's identity (model, tokenizer, config).
:func:`import_prompt_cache` reads such a file and offers it to the service as
published state. A file with a kvstate identity is refused unless it is this
service's; a file without one (``mlx_lm.cache_prompt``'s own, which names the
model only by its path) is refused with a clear error unless the caller says the
model is the same, and then it needs the tokens it covers, which it does not
record.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable

from kvstate.core.errors import KvStateError, UsageError
from kvstate.core.request import Request, as_tokens
from kvstate.interpreters.mlx import caches as mlx_caches
from kvstate.interpreters.service import DEFAULT_NAMESPACE, KvCacheService

IDENTITY_KEY = "kvstate_identity"  # no dot: mlx-lm unflattens dotted metadata keys
TOKENS_KEY = "kvstate_tokens"


class PromptFileRefused(KvStateError):
    """A prompt-cache file that this service will not take (another model's, or one of unknown origin)."""


class NothingToExport(UsageError):
    """The service holds no state for any prefix of the tokens asked for."""


def export_prompt_cache(service: KvCacheService, path: str | Path, tokens: Iterable[int],
                        namespace: str = DEFAULT_NAMESPACE) -> int:
    """Write the state ``service`` holds for the longest prefix of ``tokens`` it can serve (RAM or
    disk) to ``path`` in mlx-lm's prompt-cache format; the number of tokens the file covers."""
    from mlx_lm.models.cache import save_prompt_cache

    tokens = as_tokens(tokens, "tokens")
    probe = Request(tokens + (0,), 1)  # one token past the prompt: the whole prompt may be reused
    state = service.acquire(probe, namespace)
    try:
        covered = state.reused_tokens
        if covered == 0:
            raise NothingToExport(f"the service holds no state for any prefix of these {len(tokens)} tokens "
                                  f"in namespace {namespace!r}")
        metadata = {IDENTITY_KEY: service.config.identity, TOKENS_KEY: json.dumps(list(tokens[:covered])),
                    "model": service.config.model.name}
        save_prompt_cache(str(path), state.caches, metadata)
        return covered
    finally:
        service.release(probe)


def import_prompt_cache(service: KvCacheService, path: str | Path, *, tokens: Iterable[int] | None = None,
                        namespace: str = DEFAULT_NAMESPACE, same_model: bool = False) -> bool:
    """Offer the caches of the prompt-cache file at ``path`` to ``service``; True if kept.

    A file :func:`export_prompt_cache` wrote carries its tokens and identity. For
    a file without a kvstate identity, ``same_model=True`` says it was computed by
    this service's model (nothing in the file can show it), and ``tokens`` are the
    tokens it covers.
    """
    from mlx_lm.models.cache import load_prompt_cache

    try:
        caches, metadata = load_prompt_cache(str(path), return_metadata=True)
    except (OSError, ValueError, KeyError, TypeError, RuntimeError) as error:
        raise PromptFileRefused(f"{path}: not an mlx-lm prompt-cache file ({error})") from None
    identity = metadata.get(IDENTITY_KEY)
    if identity is None and not same_model:
        raise PromptFileRefused(f"{path}: carries no kvstate identity (mlx-lm names the model only by its "
                                f"path, {metadata.get('model')!r}); pass same_model=True and the tokens it "
                                f"covers if it was computed by this service's model")
    if identity is not None and identity != service.config.identity:
        raise PromptFileRefused(f"{path}: saved for another model, tokenizer or config than this service's")
    if tokens is None:
        if TOKENS_KEY not in metadata:
            raise PromptFileRefused(f"{path}: records no tokens; pass the tokens the prompt cache covers")
        tokens = json.loads(metadata[TOKENS_KEY])
    tokens = as_tokens(tokens, "tokens")
    covered = mlx_caches.covered(caches)
    if covered is not None and covered != len(tokens):
        raise PromptFileRefused(f"{path}: its caches cover {covered} tokens, not the {len(tokens)} given")
    request = Request(tokens, 1)
    if not service.keeps(request):
        return False
    return service.publish(request, namespace, tokens, caches)
