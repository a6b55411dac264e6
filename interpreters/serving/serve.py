"""``kvstate serve``: mlx-lm's own OpenAI-compatible server, with kvstate as its prompt cache.

The server is ``mlx_lm.server`` itself: its flags, endpoints, continuous
batching and tool calling are unchanged. kvstate replaces one piece, the
prompt cache the server builds in ``run()``, with a
:class:`~kvstate.interpreters.serving.prompt_cache.KvStatePromptCache` over a service
on the MLX interpreter, and adds ``GET /metrics`` (Prometheus text format) to
the request handler. With ``--disk-dir`` kept state is spilled to disk and a
restarted server serves earlier conversations' prefixes from it; identity is
checked on every file as everywhere else.

The pieces of ``mlx_lm.server`` this relies on are checked at start
(:func:`check_server_internals`); a version whose internals moved is refused
with a message that names what moved.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import json
import logging
import math
import os
import signal
import sys
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, NoReturn, Sequence

from kvstate.core.blocks import BLOCK_TOKENS
from kvstate.core.checks import size_text
from kvstate.core.errors import KvStateError
from kvstate.core.replies import MaxTokensFit, ScanResult
from kvstate.interpreters.serving.batch_admission import (
    CACHE_STEP, BatchAdmission, admitting_generator, measured_batch_generator,
)
from kvstate.interpreters.mlx import blocks as mlx_blocks
from kvstate.interpreters.mlx.disk_store import DirectoryInUse
from kvstate.interpreters.serving.disk_notices import DiskNotices, default_disk_bytes, start_notices
from kvstate.interpreters.mlx.host_memory import keep_freed_memory
from kvstate.interpreters.serving.model_names import NAME_MAPS, alias_served_model
from kvstate.interpreters.serving.pins import (
    PIN_ATTRIBUTE, BadPinSeconds, BadWarmPrompt, PinAsked, pin_seconds, warm, warm_prompt_tokens,
)
from kvstate.interpreters.serving.prompt_cache import KvStatePromptCache
from kvstate.interpreters.serving.resumable import (
    IDEMPOTENCY_FIELD, IDEMPOTENCY_HEADER, RESUMABLE_ATTRIBUTE, BadIdempotencyKey, Resumable, Resumption,
    idempotency_key, request_fingerprint,
)
from kvstate.interpreters.service import DEFAULT_NAMESPACE, KvCacheService
from kvstate.interpreters.serving.tenants import NAMESPACE_ATTRIBUTE, BadCacheSalt, salt_namespace
from kvstate.interpreters.serving.tenants import salt_key as tenant_salt_key
from kvstate.interpreters.serving.trace_recording import TraceRecorder, recording_refusal

#: The mlx-lm releases whose server internals ``kvstate serve`` is built and tested against.
SUPPORTED_MLX_LM = ((0, 32, 2), (0, 33, 0))
#: The same range as pip writes it.
SUPPORTED_MLX_LM_TEXT = ">=0.32.2,<0.33"


class ServerInternalsMoved(KvStateError):
    """The installed mlx-lm's server is not one ``kvstate serve`` knows how to embed."""


def _release(version: str) -> tuple[int, int, int]:
    """``"0.32.2"`` as ``(0, 32, 2)`` (a suffix such as ``.dev0`` or ``rc1`` on the patch is dropped)."""
    parts = (version.split(".") + ["0", "0"])[:3]
    return tuple(int("".join(c for c in part if c.isdigit()) or 0) for part in parts)  # type: ignore[return-value]


def supported_release(version: str) -> bool:
    """Whether mlx-lm ``version`` is in :data:`SUPPORTED_MLX_LM` (lowest included, highest not)."""
    lowest, beyond = SUPPORTED_MLX_LM
    return lowest <= _release(version) < beyond


def check_server_internals() -> Any:
    """``mlx_lm.server``, once every piece ``kvstate serve`` uses is where it expects it; else
    :class:`ServerInternalsMoved` naming what moved."""
    import inspect

    from mlx_lm import server
    from mlx_lm.models import cache as cache_module

    generate_module = importlib.import_module("mlx_lm.generate")  # the package's ``generate`` is a function
    version = metadata.version("mlx-lm")
    supported = SUPPORTED_MLX_LM_TEXT
    if not supported_release(version):
        raise ServerInternalsMoved(f"kvstate serve embeds mlx-lm {supported}; mlx-lm {version} is installed. "
                                   f"Install a supported release (pip install 'mlx-lm{supported}').")
    expected: dict[str, Callable[[], bool]] = {
        "ResponseGenerator(model_provider, prompt_cache)": lambda: list(
            inspect.signature(server.ResponseGenerator.__init__).parameters)[1:3] == ["model_provider",
                                                                                    "prompt_cache"],
        "_run_http_server(host, port, response_generator, server_class, handler_class)": lambda: list(
            inspect.signature(server._run_http_server).parameters) == ["host", "port", "response_generator",
                                                                       "server_class", "handler_class"],
        "run(host, port, model_provider, ...)": lambda: list(inspect.signature(server.run).parameters)[:3] == [
            "host", "port", "model_provider"],
        "ModelProvider.load(model_path, adapter_path, draft_model_path)": lambda: list(
            inspect.signature(server.ModelProvider.load).parameters)[1:] == ["model_path", "adapter_path",
                                                                             "draft_model_path"],
        "APIHandler.do_GET": lambda: callable(getattr(server.APIHandler, "do_GET", None)),
        "APIHandler.handle_completion(request, stop_words)": lambda: list(
            inspect.signature(server.APIHandler.handle_completion).parameters)[1:] == ["request", "stop_words"],
        "ResponseGenerator.stop_and_join": lambda: callable(getattr(server.ResponseGenerator, "stop_and_join", None)),
        "main() parsing sys.argv": lambda: callable(getattr(server, "main", None)),
        "ResponseGenerator._next_request(timeout)": lambda: list(
            inspect.signature(server.ResponseGenerator._next_request).parameters)[1:] == ["timeout"],
        "ResponseGenerator._serve_single(request, stream)": lambda: list(
            inspect.signature(server.ResponseGenerator._serve_single).parameters)[1:] == ["request", "stream"],
        "ResponseGenerator._tokenize(tokenizer, request, args)": lambda: list(
            inspect.signature(server.ResponseGenerator._tokenize).parameters)[1:] == ["tokenizer", "request", "args"],
        "BatchGenerator with insert_segments, next, extract_cache, remove, close and prompt_cache_nbytes":
            lambda: all(hasattr(server.BatchGenerator, name) for name in (
                "insert_segments", "next", "extract_cache", "remove", "close", "prompt_cache_nbytes")),
        "CompletionRequest, a dataclass that takes new attributes": lambda: not hasattr(
            server.CompletionRequest, "__slots__"),
        "BatchKVCache.step": lambda: getattr(cache_module.BatchKVCache, "step", None) == CACHE_STEP,
        "BatchGenerator._counters, a BatchCounters with prompt_tokens and prompt_time": lambda: {
            "prompt_tokens", "prompt_time"} <= {f.name for f in dataclasses.fields(generate_module.BatchCounters)},
        "BatchGenerator.insert_segments(segments, max_tokens, caches, all_tokens, samplers, logits_processors, "
        "stop_sequences)": lambda: list(inspect.signature(server.BatchGenerator.insert_segments).parameters)[1:] == [
            "segments", "max_tokens", "caches", "all_tokens", "samplers", "logits_processors", "stop_sequences"],
        "ResponseGenerator._tokenize returning (prompt, segments, segment_types, initial_state, vision)": lambda: len(
            server.ResponseGenerator._tokenize(None, _Encoder(), server.CompletionRequest("text", "x", [], None, None),
                                               None)) == 5,
        "Response(text, token, logprob, finish_reason, top_tokens)": lambda: [
            f.name for f in dataclasses.fields(server.Response)] == ["text", "token", "logprob", "finish_reason",
                                                                     "top_tokens"],
        "GenerationContext with prompt and prompt_cache_count": lambda: {"prompt", "prompt_cache_count"} <= {
            f.name for f in dataclasses.fields(server.GenerationContext)},
        "_make_sampler(args, tokenizer)": lambda: list(inspect.signature(server._make_sampler).parameters) == [
            "args", "tokenizer"],
    }
    for piece, holds in expected.items():
        try:
            ok = holds()
        except (AttributeError, TypeError, ValueError):
            ok = False
        if not ok:
            raise ServerInternalsMoved(f"mlx-lm {version}'s server no longer has {piece}, which kvstate serve "
                                       f"embeds; install mlx-lm{supported}")
    return server


class _Encoder:
    """A tokenizer that encodes any text as one token: the start-up check's stand-in for the model's."""

    def encode(self, text: str) -> list[int]:
        return [1]


# ---------------------------------------------------------------- metrics


#: Report fields that go up and down; every other count only grows (a Prometheus counter).
_GAUGES = frozenset({"entries", "bytes", "capacity_bytes", "saved_entries", "saved_bytes", "saved_capacity_bytes",
                     "disk_bytes", "pending_writes", "pending_write_bytes", "checkpoints", "checkpoint_bytes",
                     "live_requests", "projected_bytes", "measured_bytes", "budget_bytes", "rejected_held_files",
                     "rejected_held_bytes", "read_bytes_per_s", "prefill_tokens_per_s", "pinned_entries",
                     "pinned_bytes", "remote_bytes_per_s"})


class ReportCollector:
    """Every counter of the service's report, hit ratios and bytes per tier, read at each scrape."""

    def __init__(self, service: KvCacheService, admission: BatchAdmission | None = None):
        self.service = service
        self.admission = admission
        self.cache = admission.cache if admission is not None else None

    def collect(self):
        import attrs
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        self.service.collect()  # an idle server hears of its finished writes at the scrape
        report = self.service.report()
        for field in attrs.fields(type(report)):
            value = getattr(report, field.name)
            if value is None:
                continue
            name = f"kvstate_{field.name}"
            if field.name in _GAUGES:
                yield GaugeMetricFamily(name, f"kvstate report: {field.name}", value=value)
            else:
                yield CounterMetricFamily(name, f"kvstate report: {field.name}", value=value)
        lookups = report.hits + report.misses
        template_only = self.cache.template_only_hits if self.cache is not None else 0
        yield CounterMetricFamily("kvstate_template_only_hits", "hits that reused no more than the chat template's "
                                  "own first tokens (counted in kvstate_hits_total, not in kvstate_hit_ratio)",
                                  value=template_only)
        yield GaugeMetricFamily("kvstate_hit_ratio", "acquires that reused more of a prompt than the chat template's "
                                "own first tokens, of all acquires",
                                value=(report.hits - template_only) / lookups if lookups else 0.0)
        objects = report.object_hits + report.object_misses
        yield GaugeMetricFamily("kvstate_object_hit_ratio", "object gets that found the object",
                                value=report.object_hits / objects if objects else 0.0)
        tiers = GaugeMetricFamily("kvstate_tier_bytes", "bytes each tier charges", labels=["tier"])
        tiers.add_metric(["ram"], report.bytes)
        tiers.add_metric(["disk"], report.disk_bytes)
        yield tiers
        if self.admission is not None:
            yield GaugeMetricFamily("kvstate_batch_peak_bytes", "the most the running batch's caches were measured "
                                    "holding after a step, padding included", value=self.admission.peak_batch_bytes)
            yield GaugeMetricFamily("kvstate_held_peak_bytes", "the most the running batch and kept RAM state held "
                                    "together after a step", value=self.admission.peak_held_bytes)
            yield CounterMetricFamily("kvstate_batch_waits", "requests that waited for room in the KV budget "
                                      "before joining the batch", value=self.admission.waited)
            yield CounterMetricFamily("kvstate_shared_prefix_waits", "requests that waited for a prefix another "
                                      "request was computing", value=self.admission.shared_waits)


def metrics_text(service: KvCacheService, admission: BatchAdmission | None = None) -> bytes:
    """The Prometheus text exposition of ``service``'s report (and of the batch's admission)."""
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    registry.register(ReportCollector(service, admission))
    return generate_latest(registry)


def chat_template_prefix(tokenizer: Any) -> int:
    """How many first tokens the chat template renders alike for any conversation that opens with the
    same role (the most over a user's and a system's opening; 0 without a chat template): a reuse of no
    more is the template's, not the client's."""
    if tokenizer is None or not getattr(tokenizer, "has_chat_template", False):
        return 0

    def common(role: str) -> int:
        a, b = (tokenizer.apply_chat_template([{"role": role, "content": text}], add_generation_prompt=True,
                                              tokenize=True) for text in ("a", "zebra crossing"))
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    try:
        return max(common("user"), common("system"))
    except Exception:  # noqa: BLE001 - a template that cannot render these: nothing is set apart
        return 0


def prompt_tokens(tokenizer: Any, request: Any) -> int:
    """How many tokens the server will prefill for ``request`` (chat through its template)."""
    if request.request_type == "chat" and tokenizer.has_chat_template:
        messages = [{**m, "content": m["content"] if isinstance(m.get("content"), str) else
                     " ".join(p.get("text", "") for p in m.get("content") or [] if isinstance(p, dict))}
                    for m in request.messages]
        return len(tokenizer.apply_chat_template(messages, tools=request.tools, add_generation_prompt=True,
                                                 tokenize=True))
    text = request.prompt if request.request_type == "text" else " ".join(
        str(m.get("content", "")) for m in request.messages)
    return len(tokenizer.encode(text))


def fitted_max_tokens(service: KvCacheService, tokenizer: Any, request: Any, max_tokens: int, from_client: bool
                      ) -> MaxTokensFit:
    """The max_tokens to serve ``request`` with, and why it can never run (the core's answer,
    :func:`kvstate.core.checks.fit_max_tokens`): a client's own max_tokens stands or is refused, the
    server's default (``--max-tokens``) is lowered to what fits."""
    try:
        prompt = prompt_tokens(tokenizer, request)
    except Exception:  # noqa: BLE001 - a prompt the template cannot render: the server's own answer stands
        return MaxTokensFit(max_tokens, None)
    return service.fit_max_tokens(prompt, max_tokens, requested=from_client)


def pin_refusal(service: KvCacheService, tokenizer: Any, request: Any, seconds: float) -> str | None:
    """Why the pin ``request`` asks for would be refused now (None: it fits): its prompt's state, as the
    model's geometry sizes it, against what pins may still hold, and its seconds against the most."""
    try:
        prompt = prompt_tokens(tokenizer, request) if tokenizer is not None else 0
    except Exception:  # noqa: BLE001 - a prompt the template cannot render: the server answers it itself
        prompt = 0
    return service.pin_refusal(service.config.model.bytes_for(prompt), seconds)


def scan_line(result: ScanResult) -> str:
    """One line of what the scan at start found on disk, kept, deleted (and why) and rejected, with sizes."""
    if result.capacity_bytes is None:
        return "no disk tier (--disk-dir not given)"
    line = f"saved state on disk: kept {result.kept} files ({size_text(result.kept_bytes)})"
    if result.deleted:
        line += (f"; deleted {result.deleted} files ({size_text(result.deleted_bytes)}) to fit --disk-bytes "
                 f"{size_text(result.capacity_bytes)}, the policy's victims with files in the order they were "
                 f"last used (least recently used first under lru)")
    return line + f"; {result.rejected} files rejected (moved aside)"


def handler_with_metrics(server: Any, service: KvCacheService, admission: BatchAdmission | None = None,
                         salt_key: bytes | None = None) -> type:
    """mlx-lm's request handler with ``GET /metrics`` added, a request's ``cache_salt`` made its
    namespace, the server's default max_tokens lowered to what fits, a request with a client key made
    resumable (:mod:`~kvstate.interpreters.serving.resumable`), and requests that can never run (or
    with a bad salt or key, or a key in use) refused before they reach the generation thread;
    everything else is the server's own."""
    from prometheus_client import CONTENT_TYPE_LATEST

    resumption = admission.resumption if admission is not None else None
    salt_key = salt_key if salt_key is not None else tenant_salt_key(None)

    class KvStateHandler(server.APIHandler):
        def handle_completion(self, request, stop_words):
            body = self.body if isinstance(self.body, dict) else {}
            salt = body.get("cache_salt")
            if salt is not None:
                try:
                    setattr(request, NAMESPACE_ATTRIBUTE, salt_namespace(salt, salt_key))
                except BadCacheSalt as error:
                    return self._refuse(str(error), "cache_salt")
            try:
                key = idempotency_key(self.headers.get(IDEMPOTENCY_HEADER), body)
            except BadIdempotencyKey as error:
                return self._refuse(str(error), IDEMPOTENCY_FIELD)
            if key is None or resumption is None:
                return self._serve(request, stop_words, body)
            namespace = getattr(request, NAMESPACE_ATTRIBUTE, None) or DEFAULT_NAMESPACE
            fingerprint = request_fingerprint(body)
            refusal = resumption.keys.claim(namespace, key, fingerprint)
            if refusal is not None:
                return self._refuse(refusal.message, IDEMPOTENCY_FIELD, refusal.status)
            try:
                setattr(request, RESUMABLE_ATTRIBUTE, Resumable(key, fingerprint))
                return self._serve(request, stop_words, body)
            finally:
                resumption.keys.release(namespace, key)

        def _serve(self, request, stop_words, body):
            pin = None
            if body.get("cache_pin_seconds") is not None:
                try:
                    pin = PinAsked(pin_seconds(body["cache_pin_seconds"]))
                except BadPinSeconds as error:
                    return self._refuse(str(error), "cache_pin_seconds")
            tokenizer = self.response_generator.model_provider.tokenizer
            if tokenizer is not None and isinstance(self.max_tokens, int):
                from_client = body.get("max_completion_tokens") is not None or "max_tokens" in body
                fit = fitted_max_tokens(service, tokenizer, request, self.max_tokens, from_client)
                if fit.refusal is not None:
                    return self._refuse(fit.refusal, "max_tokens" if from_client else None)
                self.max_tokens = fit.max_tokens
            if pin is not None:
                refusal = pin_refusal(service, tokenizer, request, pin.seconds)
                if refusal is not None:
                    return self._refuse(refusal, "cache_pin_seconds")
                setattr(request, PIN_ATTRIBUTE, pin)
            return super().handle_completion(request, stop_words)

        def _refuse(self, why: str, param: str | None, status: int = 400) -> None:
            self._set_completion_headers(status)
            self.end_headers()
            # the OpenAI error shape, so clients show the reason
            self.wfile.write(json.dumps({"error": {"message": why, "type": "invalid_request_error",
                                                   "param": param, "code": None}}).encode())

        def do_GET(self):
            if self.path.split("?", 1)[0] != "/metrics":
                return super().do_GET()
            body = metrics_text(service, admission)
            self.send_response(200)
            self.send_header("Content-Type", CONTENT_TYPE_LATEST)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    return KvStateHandler


# ---------------------------------------------------------------- the command


def kvstate_options() -> argparse.ArgumentParser:
    """kvstate's own flags of ``kvstate serve``; every other flag is mlx-lm's server's."""
    from kvstate.core.policies import POLICIES
    from kvstate.interpreters.sizes import size_argument

    parser = argparse.ArgumentParser(prog="kvstate serve", add_help=False,
                                     description="mlx-lm's server with kvstate as its prompt cache. Every flag "
                                                 "not listed here is mlx_lm.server's own (see below).")
    parser.add_argument("-h", "--help", action="store_true", help="show this help, then mlx_lm.server's")
    parser.add_argument("--ram-bytes", type=size_argument, default=size_argument("8GiB"),
                        help="RAM for kept prompt state (default 8GiB)")
    parser.add_argument("--kv-budget-bytes", type=size_argument, default=None,
                        help="memory for kept state and the running batch together: kept state is given back "
                             "(spilled first with a disk tier) while the batch needs it (default: none)")
    parser.add_argument("--disk-dir", default=None, help="directory of the disk tier (default: none)")
    parser.add_argument("--disk-bytes", type=size_argument, default=None,
                        help="byte budget of the disk tier, the bytes its files take (default with --disk-dir: "
                             "half of what its file system can give at start, said in the log)")
    parser.add_argument("--policy", default="lru", choices=list(POLICIES), help="eviction policy (default lru)")
    parser.add_argument("--shared-prefix-wait", type=float, default=None, metavar="SECONDS",
                        help="a request that shares a prefix with one in prefill waits up to this long for its "
                             "publish instead of computing the prefix again (0: never wait; default "
                             f"{SHARED_PREFIX_WAIT_S:g}, or 0 on CUDA, where a batched prefill of a few rows costs "
                             "about one row's)")
    parser.add_argument("--read-ahead", action="store_true",
                        help="with state in blocks on a disk tier, start reading a request's saved blocks into "
                             "RAM when it arrives while the batch is busy, off the generation thread; it joins "
                             "the batch once they are in RAM (default: off; a request restores its own state "
                             "when admitted)")
    parser.add_argument("--record-trace", default=None, metavar="PATH",
                        help="append a line for each request served to this trace, in the bundled traces' "
                             "format with keyed block ids (the key beside it, PATH.key), for kvstate simulate "
                             "and kvstate replay (default: none)")
    parser.add_argument("--disk-write-idle", type=float, default=None, metavar="SECONDS",
                        help="write kept state to disk only once it has sat idle this long, so state a later "
                             "turn supersedes soon is never written (default: written when kept)")
    parser.add_argument("--disk-write-bytes-per-hour", type=size_argument, default=None, metavar="SIZE",
                        help="cap what spills write to disk, for the SSD's wear (default: no cap)")
    parser.add_argument("--block-tokens", type=int, default=BLOCK_TOKENS, metavar="TOKENS",
                        help="keep plain and quantised KV in blocks of this many tokens, each held once in RAM "
                             "and written once to disk, shared by every prompt that contains it (0: keep each "
                             f"prompt's state whole; default {BLOCK_TOKENS}, the step mlx-lm's caches grow by)")
    parser.add_argument("--snapshot-every", type=int, default=SNAPSHOT_EVERY, metavar="TOKENS",
                        help="for a model with recurrent or sliding-window layers, keep its state whenever a "
                             "prefill passes a multiple of this many tokens (at the end of the chunk that "
                             "passes it; chunks are --prefill-step-size long), so an edit or a regenerate "
                             "reuses up to the last one before it (0: at segment ends only; default "
                             f"{SNAPSHOT_EVERY})")
    parser.add_argument("--checkpoint-every", type=int, default=None, metavar="TOKENS",
                        help="checkpoint each generation that carries a client key (the Idempotency-Key header, "
                             "or an idempotency_key body field) every this many generated tokens, on the disk "
                             "tier; the same request sent again after a crash or a lost connection resumes from "
                             "its last checkpoint (needs --disk-dir; default: none)")
    parser.add_argument("--checkpoint-keep", type=float, default=CHECKPOINT_KEEP_S, metavar="SECONDS",
                        help="delete the checkpoint of a generation that stopped unfinished once nothing has "
                             f"resumed it for this long (a client that never retried; default {CHECKPOINT_KEEP_S:g})")
    parser.add_argument("--remote", default=None, metavar="s3://BUCKET[/PREFIX]",
                        help="a saved-state tier the servers of a fleet share, on an S3-compatible object store: "
                             "blocks this server writes to disk are written there once, and a request's blocks "
                             "this server lacks are fetched from there (verified) where that beats prefilling "
                             "them; credentials from the usual AWS variables (needs --disk-dir and the fleet "
                             "extra)")
    parser.add_argument("--remote-endpoint", default=None, metavar="URL",
                        help="the object store's URL, for a store that is not AWS's (SeaweedFS, MinIO, Garage)")
    parser.add_argument("--remote-timeout", type=float, default=None, metavar="SECONDS",
                        help="how long one call to the shared tier may take before it counts as failed (a block "
                             f"is one call: give a slow link the time its largest block takes; default "
                             f"{REMOTE_TIMEOUT_S:g})")
    parser.add_argument("--salt-key-file", default=None, metavar="PATH",
                        help="the key tenants' namespaces are hashed with (made there if missing): give the "
                             "servers that share --remote one key, so a tenant's state is found on each "
                             "(default: one under --disk-dir)")
    parser.add_argument("--kv-events", default=None, metavar="ENDPOINT",
                        help="publish which blocks RAM and disk hold, as vLLM's KV events over ZMQ, for a "
                             "fleet's router: bound where the endpoint has a wildcard (tcp://*:5557), else "
                             "connected to (needs blocks and the fleet extra: pip install 'kvstate[fleet]')")
    parser.add_argument("--kv-events-replay", default=None, metavar="ENDPOINT",
                        help="bind a replay socket here: a subscriber that missed batches asks for them again "
                             "from a sequence number, as vLLM's subscribers do (default: none)")
    parser.add_argument("--kv-events-topic", default="", metavar="TOPIC",
                        help="the topic frame of every KV event message (default: empty)")
    parser.add_argument("--no-verify", action="store_true", help="skip content hashes on restores from disk")
    parser.add_argument("--warm-prompt", action="append", default=[], metavar="FILE",
                        help="prefill this prompt before serving and keep it in RAM until the server stops: a "
                             ".json file of chat messages (a list, or {\"messages\": [...]}) rendered as a "
                             "conversation's start, or a text file for the completions endpoint (repeatable)")
    parser.add_argument("--pin-share", type=float, default=0.5, metavar="SHARE",
                        help="the share of --ram-bytes that pinned state (warm prompts, and requests' "
                             "cache_pin_seconds) may hold, from 0 to 1 (default 0.5)")
    parser.add_argument("--max-pin-seconds", type=float, default=3600.0, metavar="SECONDS",
                        help="the longest a request's cache_pin_seconds may pin its prompt's state for "
                             "(default 3600)")
    return parser


#: How long the checkpoint of an unfinished generation waits for its retry by default.
CHECKPOINT_KEEP_S = 3600.0


#: Tokens between a hybrid model's chunk snapshots by default: mlx-lm's default prefill chunk.
SNAPSHOT_EVERY = 2048


#: How long a request waits by default for a shared prefix another request is computing.
SHARED_PREFIX_WAIT_S = 5.0


#: How long one call to the shared tier may take by default (a fetch or write of one block).
REMOTE_TIMEOUT_S = 5.0


def default_shared_prefix_wait() -> float:
    """:data:`SHARED_PREFIX_WAIT_S`, but 0 on a CUDA device: measured on an H200, six rows prefilled
    together cost about what one does, so waiting for the first row's publish only serialises them
    (bench/README.md, the burst workload); on a CPU the wait saves the prefix's compute per row."""
    import mlx.core as mx

    cuda = getattr(mx, "cuda", None)
    on_cuda = cuda is not None and cuda.is_available() and mx.default_device() == mx.gpu
    return 0.0 if on_cuda else SHARED_PREFIX_WAIT_S


def build_prompt_cache(model_provider: Any, options: argparse.Namespace) -> KvStatePromptCache:
    """Load the default model and build the kvstate prompt cache for it."""
    from mlx_lm.utils import load_config

    model, tokenizer = model_provider.load("default_model", None, "default_model")
    config = load_config(Path(model_provider.cli_args.model))
    # Identity from the weight files, hashed once (an adapter on top changes the weights: hash those then).
    plain = model_provider.cli_args.adapter_path is None and any(Path(model_provider.cli_args.model).glob(
        "*.safetensors"))
    service = KvCacheService.for_mlx(
        model, ram_bytes=options.ram_bytes, kv_budget_bytes=options.kv_budget_bytes, batch_padding_step=CACHE_STEP,
        disk_dir=options.disk_dir, disk_bytes=options.disk_bytes, name=Path(model_provider.cli_args.model).name,
        config=config, tokenizer=tokenizer, policy=options.policy, verify=not options.no_verify,
        ram_within_kv_budget=True, weights_dir=model_provider.cli_args.model if plain else None,
        write_idle_after=options.disk_write_idle, write_bytes_per_hour=options.disk_write_bytes_per_hour,
        block_tokens=options.block_tokens or None, pin_share=options.pin_share,
        max_pin_seconds=options.max_pin_seconds, checkpoint_every_tokens=options.checkpoint_every,
        checkpoint_keep_s=options.checkpoint_keep if options.checkpoint_every is not None else None,
        block_events=options.kv_events is not None, remote=options.remote, remote_endpoint=options.remote_endpoint,
        remote_timeout_s=options.remote_timeout or REMOTE_TIMEOUT_S)
    cache = KvStatePromptCache(service, model_provider.model_key, unannounced=None)
    cache.template_tokens = chat_template_prefix(tokenizer)
    if options.disk_dir is not None:
        block_bytes = service.config.model.bytes_for(options.block_tokens or BLOCK_TOKENS)
        for notice in start_notices(Path(options.disk_dir), options.disk_bytes, block_bytes):
            logging.warning("kvstate: %s", notice)
        cache.disk_notices = DiskNotices(service, Path(options.disk_dir), options.disk_bytes,
                                         options.disk_write_bytes_per_hour)
    try:
        if options.kv_events is not None:
            cache.kv_events = kv_event_publisher(service, options)
        if options.record_trace is not None:
            cache.recorder = TraceRecorder(options.record_trace)
            logging.info("kvstate: recording requests to %s", options.record_trace)
        for path in options.warm_prompt:
            warm(cache, model, warm_prompt_tokens(Path(path), tokenizer), path)
    except BaseException:
        if cache.recorder is not None:
            cache.recorder.close()
        service.close()
        if cache.kv_events is not None:
            cache.kv_events.close()
        raise
    return cache


def kv_event_publisher(service: KvCacheService, options: argparse.Namespace) -> Any:
    """A publisher of ``service``'s block events on ``--kv-events`` (replays on ``--kv-events-replay``),
    told first what the tiers hold (what the scan found on disk)."""
    from kvstate.interpreters.fleet.kv_events import KvEventPublisher

    publisher = KvEventPublisher(options.kv_events, block_size=service.config.block_tokens,
                                 replay_endpoint=options.kv_events_replay, topic=options.kv_events_topic,
                                 default_namespace=DEFAULT_NAMESPACE)
    service.on_block_events(publisher.told_together, together=True)
    logging.info("kvstate: KV events on %s%s", publisher.endpoint or options.kv_events,
                 f", replays on {publisher.replay_endpoint}" if publisher.replay_endpoint else "")
    return publisher


def serve(options: argparse.Namespace, server_argv: Sequence[str]) -> int:
    """Run mlx-lm's server (parsing ``server_argv`` with its own parser) with kvstate's prompt cache."""
    server = check_server_internals()
    if options.kv_budget_bytes is not None:
        server_argv = [*server_argv, "--prompt-cache-bytes", str(options.kv_budget_bytes)]
    served: dict[str, Any] = {}

    def run(host: str, port: int, model_provider: Any, *rest: Any, **named: Any) -> None:
        if model_provider.cli_args.model is None:
            raise SystemExit("kvstate serve needs --model PATH: the mlx-lm model directory to serve")
        if options.checkpoint_every is not None and model_provider.cli_args.kv_bits is not None:
            raise SystemExit("kvstate serve: --checkpoint-every does not work with --kv-bits (caches quantised "
                             "during generation are not checkpointed); drop one of them")
        if not all(isinstance(getattr(model_provider, name, None), dict) for name in NAME_MAPS):
            raise ServerInternalsMoved(f"mlx-lm's ModelProvider no longer has {', '.join(NAME_MAPS)}, which "
                                       f"kvstate serve extends; install mlx-lm{SUPPORTED_MLX_LM_TEXT}")
        alias_served_model(model_provider)
        if keep_freed_memory():
            logging.info("kvstate: freed host memory is kept for reuse (restores fault in no fresh pages)")
        cache = served["cache"] = build_prompt_cache(model_provider, options)
        logging.info("kvstate: %s", scan_line(cache.service.scan_result))
        if options.remote is not None:
            logging.info("kvstate: shared tier %s%s", options.remote,
                         f" at {options.remote_endpoint}" if options.remote_endpoint else "")
        wait = options.shared_prefix_wait if options.shared_prefix_wait is not None else default_shared_prefix_wait()
        # Chunk snapshots are for models whose layers cannot all be cut: blocks serve any prefix of the others.
        snapshot_every = None if mlx_blocks.blockable(cache.service.interpreter.fresh()) else options.snapshot_every
        resumption = None
        if options.checkpoint_every is not None:
            resumption = Resumption(cache.service, options.checkpoint_every, server, model_provider)
        admission = BatchAdmission(cache, share_wait_s=wait, snapshot_every=snapshot_every or None,
                                   read_ahead=options.read_ahead, resumption=resumption,
                                   hold_segments=True)
        # The generation thread builds its BatchGenerator by this module-level name.
        server.BatchGenerator = measured_batch_generator(previous_batch, admission)
        generator = admitting_generator(server, admission)(model_provider, cache)
        handler = handler_with_metrics(server, cache.service, admission,
                                       tenant_salt_key(options.disk_dir, options.salt_key_file))
        server._run_http_server(host, port, generator, handler_class=handler)

    def stop(signum, frame):
        raise KeyboardInterrupt  # the server's own shutdown path: stop serving, join the generation thread

    previous_run, previous_argv, previous_batch = server.run, sys.argv, server.BatchGenerator
    previous_term = signal.signal(signal.SIGTERM, stop)
    server.run, sys.argv = run, ["mlx_lm.server", *server_argv]
    try:
        server.main()
    finally:
        server.run, sys.argv, server.BatchGenerator = previous_run, previous_argv, previous_batch
        signal.signal(signal.SIGTERM, previous_term)
        cache = served.get("cache")
        if cache is not None:
            if cache.recorder is not None:
                cache.recorder.close()
            result = cache.service.close()
            if cache.kv_events is not None:
                cache.kv_events.close()  # after the close: a router hears RAM's blocks go
            logging.info("kvstate: closed, %s", json.dumps({"durable": result.durable,
                                                             "ram_only_entries": result.ram_only_entries}))
    return 0


def main(argv: Sequence[str]) -> int:
    options, server_argv = kvstate_options().parse_known_args(argv)
    if options.help:
        kvstate_options().print_help()
        print("\nmlx_lm.server's own options:\n")
        server_argv = ["--help"]
    if options.disk_dir is None and options.disk_bytes is not None:
        print("kvstate serve: --disk-bytes needs --disk-dir: where saved state lives", file=sys.stderr)
        return 2
    for flag, value in (("--ram-bytes", options.ram_bytes), ("--kv-budget-bytes", options.kv_budget_bytes),
                        ("--disk-bytes", options.disk_bytes)):
        if value == 0:
            print(f"kvstate serve: {flag} 0 holds nothing: no state could be kept (or, for the KV budget, no "
                  f"request run); give a size, or leave the flag out", file=sys.stderr)
            return 2
    if options.disk_write_idle is not None and not 0 < options.disk_write_idle < float("inf"):
        print(f"kvstate serve: --disk-write-idle is seconds, more than 0; got {options.disk_write_idle}",
              file=sys.stderr)
        return 2
    if options.disk_write_bytes_per_hour is not None and options.disk_write_bytes_per_hour < 1:
        print(f"kvstate serve: --disk-write-bytes-per-hour is a size of at least 1 byte; "
              f"got {options.disk_write_bytes_per_hour}", file=sys.stderr)
        return 2
    if options.checkpoint_every is not None and (options.checkpoint_every < 1 or options.disk_dir is None):
        print(f"kvstate serve: --checkpoint-every is a number of tokens, 1 or more, and needs --disk-dir (where "
              f"checkpoints are written); got {options.checkpoint_every}"
              f"{'' if options.disk_dir else ' without --disk-dir'}", file=sys.stderr)
        return 2
    if not 0 < options.checkpoint_keep < float("inf"):
        print(f"kvstate serve: --checkpoint-keep is seconds, more than 0; got {options.checkpoint_keep}",
              file=sys.stderr)
        return 2
    if options.snapshot_every < 0:
        print(f"kvstate serve: --snapshot-every is a number of tokens, 0 (segment ends only) or more; "
              f"got {options.snapshot_every}", file=sys.stderr)
        return 2
    if options.block_tokens < 0:
        print(f"kvstate serve: --block-tokens is a number of tokens, 0 (whole prompts) or more; "
              f"got {options.block_tokens}", file=sys.stderr)
        return 2
    refusal = kv_events_refusal(options) or remote_refusal(options)
    if refusal is not None:
        print(f"kvstate serve: {refusal}", file=sys.stderr)
        return 2
    if not 0 <= options.pin_share <= 1:
        print(f"kvstate serve: --pin-share is a share of --ram-bytes from 0 to 1; got {options.pin_share}",
              file=sys.stderr)
        return 2
    if not 0 <= options.max_pin_seconds < float("inf"):
        print(f"kvstate serve: --max-pin-seconds is seconds, 0 or more; got {options.max_pin_seconds}",
              file=sys.stderr)
        return 2
    for path in options.warm_prompt:
        if not Path(path).is_file():
            print(f"kvstate serve: --warm-prompt {path}: no such file", file=sys.stderr)
            return 2
    if options.shared_prefix_wait is not None and not options.shared_prefix_wait >= 0:
        print(f"kvstate serve: --shared-prefix-wait is seconds, 0 or more; got {options.shared_prefix_wait}",
              file=sys.stderr)
        return 2
    if options.record_trace is not None:
        refusal = recording_refusal(Path(options.record_trace))
        if refusal is not None:
            print(f"kvstate serve: --record-trace {options.record_trace}: {refusal}", file=sys.stderr)
            return 2
    refusal = start_refusal(options, server_argv)
    if refusal is not None:
        print(f"kvstate serve: {refusal}", file=sys.stderr)
        return 2
    if options.disk_dir is not None and options.disk_bytes is None:
        options.disk_bytes = default_disk_bytes(Path(options.disk_dir).expanduser())
        print(f"kvstate serve: --disk-bytes not given: {size_text(options.disk_bytes)}, half of what the file "
              f"system of --disk-dir can give now", file=sys.stderr)
    try:
        status = serve(options, server_argv)
    except (ServerInternalsMoved, BadWarmPrompt) as error:
        print(f"kvstate serve: {error}", file=sys.stderr)
        return 2
    except DirectoryInUse as error:
        print(f"kvstate serve: --disk-dir {options.disk_dir}: another live kvstate serve (or service) writes "
              f"this model's state there; stop it, or give this server its own --disk-dir ({error})",
              file=sys.stderr)
        return 2
    leave(status)


def kv_events_refusal(options: argparse.Namespace) -> str | None:
    """Why the KV-event flags cannot work (None: they can, or are not given): events tell blocks, so
    they need state in blocks; a replay or a topic needs the events; the endpoints need ZMQ's form;
    publishing needs the fleet extra."""
    if options.kv_events is None:
        if options.kv_events_replay is not None or options.kv_events_topic:
            return "--kv-events-replay and --kv-events-topic need --kv-events ENDPOINT: where events are published"
        return None
    if options.block_tokens == 0:
        return "--kv-events tells which blocks a server holds: it needs state in blocks (drop --block-tokens 0)"
    for flag, endpoint in (("--kv-events", options.kv_events), ("--kv-events-replay", options.kv_events_replay)):
        if endpoint is not None and not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            return f"{flag} {endpoint}: not a ZMQ endpoint (tcp://HOST:PORT, tcp://*:PORT or ipc://PATH)"
    if importlib.util.find_spec("zmq") is None or importlib.util.find_spec("msgspec") is None:
        return "--kv-events needs pyzmq and msgspec: pip install 'kvstate[fleet]'"
    return None


def remote_refusal(options: argparse.Namespace) -> str | None:
    """Why the shared-tier flags cannot work (None: they can, or are not given)."""
    if options.remote is None:
        if options.remote_endpoint is not None:
            return "--remote-endpoint needs --remote s3://BUCKET[/PREFIX]: the tier it serves"
        if options.remote_timeout is not None:
            return "--remote-timeout needs --remote s3://BUCKET[/PREFIX]: the tier it bounds"
        return None
    if options.remote_timeout is not None and not 0 < options.remote_timeout < math.inf:
        return f"--remote-timeout is a positive number of seconds, got {options.remote_timeout:g}"
    from kvstate.interpreters.fleet.remote_store import BadRemoteUrl, parse_remote
    try:
        parse_remote(options.remote)
    except BadRemoteUrl as error:
        return f"--remote {error}"
    if options.disk_dir is None:
        return "--remote needs --disk-dir: the disk keeps what is fetched from the shared tier"
    if options.block_tokens == 0:
        return "--remote shares blocks: it needs state in blocks (drop --block-tokens 0)"
    if importlib.util.find_spec("boto3") is None:
        return "--remote needs boto3: pip install 'kvstate[fleet]'"
    return None


def start_refusal(options: argparse.Namespace, server_argv: Sequence[str]) -> str | None:
    """Why the server cannot start, found before the model loads (None: nothing found): a ``--model``
    given as a local path that does not exist, or a ``--disk-dir`` that cannot be made or written."""
    model = None
    for i, argument in enumerate(server_argv):
        if argument == "--model" and i + 1 < len(server_argv):
            model = server_argv[i + 1]
        elif argument.startswith("--model="):
            model = argument.split("=", 1)[1]
    if model is not None and (os.path.isabs(model) or model.startswith((".", "~"))):
        if not Path(model).expanduser().is_dir():
            return f"--model {model}: no such model directory"
    if options.disk_dir is not None:
        directory = Path(options.disk_dir).expanduser()
        try:
            directory.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            return f"--disk-dir {options.disk_dir}: cannot be made ({error.strerror})"
        if not directory.is_dir() or not os.access(directory, os.W_OK | os.X_OK):
            return f"--disk-dir {options.disk_dir}: not a directory this server can write to"
    return None


def leave(status: int) -> NoReturn:
    """End the server's process with ``status`` once its state is closed (flushed, logged): the logs
    and streams are flushed, and the process exits without the interpreter's teardown, in which MLX's
    threads, destroyed under a thread still finishing, abort now and then ("terminate called without
    an active exception", exit 134) after a clean stop: a supervisor would see a crash."""
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(status)
