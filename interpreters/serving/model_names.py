"""The names a request may give the served model, so that every one reaches its cache and its budget.

``mlx_lm.server`` serves the model given by ``--model`` as ``default_model``,
while ``GET /v1/models`` advertises it by its resolved path. A request naming
that path (or the path as given) would make the server load a second copy and
key it apart, so its state would be neither fetched nor kept, nor charged to
the KV budget. Here those names are made aliases of ``default_model`` in the
server's own name maps: they load the served model, under the served model's
key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: The server's maps from a requested name to what it loads (``ModelProvider.load`` reads them).
NAME_MAPS = ("_model_map", "_adapter_map", "_draft_model_map")


def alias_served_model(provider: Any) -> list[str]:
    """Make the path ``--model`` gave and its resolved path (the id ``/v1/models`` advertises) names
    of the served model, with its adapter and draft model; the names added."""
    served = provider.cli_args.model
    names = [name for name in dict.fromkeys((served, str(Path(served).resolve()))) if name != "default_model"]
    for name in names:
        provider._model_map[name] = provider._model_map["default_model"]
        provider._adapter_map[name] = provider._adapter_map["default_model"]
        provider._draft_model_map[name] = provider._draft_model_map["default_model"]
    return names


def requested_key(provider: Any, model: Any) -> tuple:
    """The model key ``provider.load`` gives a request's ``ModelDescription`` (``model``, ``adapter``,
    ``draft``), as the server resolves its names: equal to the served model's key for every name of it."""
    adapter = provider._adapter_map.get(model.model, model.adapter)
    path = provider._model_map.get(model.model, model.model)
    draft = provider._draft_model_map.get(model.draft, model.draft)
    return path, adapter, draft
