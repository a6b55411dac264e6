"""``kvstate serve``: mlx-lm's own server with kvstate as its prompt cache.

``serve`` runs the server and its metrics; ``prompt_cache`` is the ``LRUPromptCache`` interface
over the service; ``batch_admission`` holds the batch to the KV budget; ``tenants`` maps a
request's ``cache_salt`` to a namespace; ``model_names`` makes every name of the served model
reach its cache.
"""
