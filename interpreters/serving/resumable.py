"""Generations that survive a crash: ``kvstate serve --checkpoint-every N``.

A request that carries a client key (the ``Idempotency-Key`` header, or an
``idempotency_key`` body field for clients that cannot set headers) is a
resumable generation. Every N tokens it generates, its state is checkpointed to
the disk tier (the service's checkpoints, :mod:`kvstate.core.checkpoints`), and
the checkpoint's note records what a retry needs: the request's fingerprint (a
hash of its body) and each token's logprobs sent so far. When the same request
comes again (same key, same body, same ``cache_salt``) after the server died or
the client lost its connection, it resumes from the last durable checkpoint:

- what was sent before the checkpoint is sent again at once, rebuilt from the
  checkpoint (text, tokens, logprobs), then the generation goes on from there.
  A streamed retry so starts from the beginning: a client that kept what it
  received skips that many characters (or chunks: each is what it was);
- the text equals an uninterrupted run's at temperature 0 and with a ``seed``
  (a seeded request's sampler is advanced past the draws already made); an
  unseeded request sampled at a temperature resumes with fresh draws.

A key held by a generation being served now gets a 409; a key whose checkpoint
another body made gets a 422; keys are per tenant (the checkpoint key holds the
``cache_salt`` namespace), so no request ever resumes another tenant's text. A
generation that completes deletes its checkpoint; one whose client went away
keeps it for a retry. Checkpoint files are charged to ``--disk-bytes``.

Not checkpointed (served as before, without a resume): requests with a draft
model, under ``--kv-bits``, with images, and seeded requests with a repetition,
presence or frequency penalty (mlx-lm's single-request path gives those
penalties only the tokens it computes, so a resumed run would see a shorter
history). A stop word that spans the checkpoint is matched by the handler's
text, as always, not by the token matcher of the resumed run.

Everything here but :class:`ResumableKeys` runs on the server's generation
thread.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from typing import Any, Callable

import attrs
import mlx.core as mx

from kvstate.core.errors import KvStateError
from kvstate.core.request import Continuation, Request
from kvstate.interpreters.mlx import caches as mlx_caches

#: The request header a client names its generation by, and the body field that may carry it instead.
IDEMPOTENCY_HEADER = "Idempotency-Key"
IDEMPOTENCY_FIELD = "idempotency_key"
#: The attribute of the server's ``CompletionRequest`` that carries its :class:`Resumable`.
RESUMABLE_ATTRIBUTE = "_kvstate_resumable"
MAX_KEY_CHARS = 256
#: The note format; a note of another is not replayed (the checkpoint is still resumed, without logprobs).
NOTE_VERSION = 1


class BadIdempotencyKey(KvStateError):
    """A client key that is not 1 to 256 printable characters, or a header and a body field that differ."""


def idempotency_key(header: str | None, body: dict) -> str | None:
    """The request's client key, from the header or the body field (None: neither); both may be given
    only alike. :class:`BadIdempotencyKey` for a key that is not text of 1 to 256 printable characters."""
    field = body.get(IDEMPOTENCY_FIELD)
    if header is not None and field is not None and header != field:
        raise BadIdempotencyKey(f"the {IDEMPOTENCY_HEADER} header ({header!r}) and the {IDEMPOTENCY_FIELD} field "
                                f"({field!r}) differ: send one of them, or both alike")
    key = header if header is not None else field
    if key is None:
        return None
    if not isinstance(key, str) or not 1 <= len(key) <= MAX_KEY_CHARS or not key.isprintable():
        raise BadIdempotencyKey(f"{IDEMPOTENCY_FIELD} must be a string of 1 to {MAX_KEY_CHARS} printable "
                                f"characters; got {str(key)[:40]!r}{' ...' if len(str(key)) > 40 else ''}")
    return key


def request_fingerprint(body: dict) -> str:
    """A hash of everything the request asked for but its key: a retry must ask for the same."""
    asked = {name: value for name, value in body.items() if name != IDEMPOTENCY_FIELD}
    text = json.dumps(asked, sort_keys=True, separators=(",", ":"), ensure_ascii=False, default=str)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


@attrs.frozen
class Resumable:
    """What the handler found on a request that asked to be resumable: its key and fingerprint."""

    key: str
    fingerprint: str


@attrs.frozen
class Sent:
    """One token the client was sent, as it was sent."""

    token: int
    logprob: float
    top_tokens: Any = ()


@attrs.frozen
class Note:
    """What a resumable generation's checkpoint records beside its caches: the request's fingerprint,
    and the logprobs of every token sent up to and including the checkpoint's pending token."""

    fingerprint: str
    logprobs: tuple[float, ...] = ()
    top_tokens: tuple[Any, ...] | None = None

    def text(self) -> str:
        return json.dumps({"version": NOTE_VERSION, "fingerprint": self.fingerprint,
                           "logprobs": list(self.logprobs),
                           "top_tokens": None if self.top_tokens is None else list(self.top_tokens)})

    @classmethod
    def parse(cls, text: str | None) -> "Note | None":
        """The note ``text`` holds, or None where it is not one of this version's."""
        try:
            fields = json.loads(text or "")
            if fields.get("version") != NOTE_VERSION or not isinstance(fields.get("fingerprint"), str):
                return None
            top = fields.get("top_tokens")
            return cls(fields["fingerprint"], tuple(float(p) for p in fields.get("logprobs") or ()),
                       None if top is None else tuple(top))
        except (ValueError, TypeError, AttributeError):
            return None


@attrs.frozen
class Refusal:
    """Why a request with a key is not served now: the HTTP status and what the client should do."""

    status: int
    message: str


class ResumableKeys:
    """The client keys of the generations being served now, and the check every request with a key
    passes before it is served (on the handler's threads)."""

    def __init__(self, service: Any):
        self.service = service
        self._lock = threading.Lock()
        self._serving: dict[tuple[str, str], str] = {}

    def claim(self, namespace: str, key: str, fingerprint: str) -> Refusal | None:
        """Hold ``key`` for this request, or say why not: held by a request being served (409), or its
        checkpoint made by another body (422)."""
        with self._lock:
            held = self._serving.get((namespace, key))
            if held is not None:
                if held == fingerprint:
                    return Refusal(409, f"a generation with {IDEMPOTENCY_HEADER} {key!r} is being served now; "
                                        f"retry once it ends (its checkpoint then resumes it)")
                return Refusal(422, f"{IDEMPOTENCY_HEADER} {key!r} is in use by a request with another body; "
                                    f"a retry must send the same body, or use a new key")
            kept = Note.parse(self.service.checkpoint_note(key, namespace))
            if kept is not None and kept.fingerprint != fingerprint:
                return Refusal(422, f"{IDEMPOTENCY_HEADER} {key!r} names a generation of another request body; "
                                    f"a retry must send the same body, or use a new key")
            self._serving[namespace, key] = fingerprint
            return None

    def release(self, namespace: str, key: str) -> None:
        with self._lock:
            self._serving.pop((namespace, key), None)


def penalised(args: Any) -> bool:
    """Whether a request's logits are penalised by the tokens before them (repetition, presence,
    frequency): mlx-lm's single-request path counts only the tokens it computes, so such a request
    served there cannot resume to the same text."""
    logits = args.logits
    return any((value or 0) != 0 for value in (logits.repetition_penalty, logits.presence_penalty,
                                                logits.frequency_penalty))


@attrs.define
class Held:
    """A snapshot taken when a multiple of N tokens was fed, written once the next token is known."""

    caches: list
    tokens: tuple[int, ...]


class Generation:
    """One resumable generation on the generation thread: what it sent, its checkpoints, its resume.

    ``lease`` is its request as the service holds it (with its continuation); ``replay`` the tokens a
    resume sends again before generating (empty for a first run); ``state`` gives the caches and
    tokens of its row now (set where the row is placed: the batch's row, or the single path's caches).
    """

    def __init__(self, service: Any, lease: Request, namespace: str, resumable: Resumable, every: int,
                 max_tokens: int, record_top_tokens: bool, detokenizer: Any, response: Callable[..., Any],
                 replay: tuple[Sent, ...] = ()):
        self.service = service
        self.lease = lease
        self.namespace = namespace
        self.resumable = resumable
        self.every = every
        self.max_tokens = max_tokens
        self.record_top_tokens = record_top_tokens
        self.replay = replay
        self.sent: list[Sent] = list(replay)
        self.state: Callable[[], tuple[list, tuple[int, ...] | None] | None] | None = None
        self.held: Held | None = None
        self.finished = False
        self.checkpoints = 0
        self._detokenizer = detokenizer if replay else None
        self._response = response

    @property
    def resumed(self) -> bool:
        return bool(self.replay)

    def replayed(self) -> list:
        """The server's responses for the tokens sent before the checkpoint, rebuilt as they were sent."""
        out = []
        for sent in self.replay:
            self._detokenizer.add_token(sent.token)
            out.append(self._response(self._detokenizer.last_segment, sent.token, sent.logprob, None,
                                      sent.top_tokens))
        return out

    def reported(self, response: Any) -> Any:
        """The server reports ``response`` (its next token): keep what was sent, checkpoint on the grid,
        and, for a resumed run, give the text as the uninterrupted run's detokenizer would."""
        if self._detokenizer is not None:  # the server's detokenizer began at the resume: continue ours
            if response.finish_reason != "stop":
                self._detokenizer.add_token(response.token)
            if response.finish_reason is not None:
                self._detokenizer.finalize()
            response.text = self._detokenizer.last_segment
        self.sent.append(Sent(response.token, response.logprob,
                              response.top_tokens if self.record_top_tokens else ()))
        if response.finish_reason is not None:
            self.finished, self.held = True, None
            return response
        try:
            self._checkpoint(response.token)
        except Exception:  # noqa: BLE001 - a checkpoint is insurance: the generation goes on without it
            self.held = None
            logging.exception("kvstate: a checkpoint of generation %r failed", self.resumable.key)
        return response

    def _checkpoint(self, token: int) -> None:
        """Write the snapshot held since the last report with ``token`` as its pending token; take the next
        one where the tokens fed reach a multiple of N (and at least one token would be left to resume)."""
        fed = len(self.sent)  # every token reported is in the caches by now; the next is being sampled
        if self.held is not None:
            held, self.held = self.held, None
            note = Note(self.resumable.fingerprint, tuple(s.logprob for s in self.sent),
                        tuple(s.top_tokens for s in self.sent) if self.record_top_tokens else None)
            generated = len(held.tokens) - len(self.lease.prompt)
            queued = self.service.checkpoint(self.lease, held.caches, held.tokens, generated, pending_token=token,
                                             note=note.text())
            self.checkpoints += queued
            logging.info("kvstate: checkpoint of generation %r after %d tokens %s", self.resumable.key, generated + 1,
                         "queued" if queued else "not written (no room in the write queue or on disk)")
        if fed % self.every or fed + 1 >= self.max_tokens or self.state is None:
            return
        row = self.state()
        if row is None:
            return
        caches, tokens = row
        covered = len(self.lease.prompt) + fed
        if mlx_caches.covered(caches) != covered or (tokens is not None and len(tokens) != covered):
            return  # not the state this point needs (a cache kind that runs ahead): no checkpoint here
        snapshot = mlx_caches.detached(caches, covered)  # copied out now: the row's buffers are not held
        self.held = Held(snapshot, self.lease.prompt + tuple(s.token for s in self.sent))


class ReplayingQueue:
    """A request's response queue as the generation thread sees it: a resumed generation's context is
    its own request's (prompt and cached tokens), what was sent before its checkpoint follows the
    context at once, and every token passes :meth:`Generation.reported` on its way."""

    def __init__(self, queue: Any, generation: Generation, context_type: type, response_type: type):
        self.queue = queue
        self.generation = generation
        self._context_type = context_type
        self._response_type = response_type

    def put(self, item: Any) -> None:
        generation = self.generation
        if isinstance(item, self._context_type):
            if generation.resumed:  # its own prompt, all of it served from the checkpoint
                item.prompt = list(generation.lease.prompt)
                item.prompt_cache_count = len(item.prompt)
            self.queue.put(item)
            for response in generation.replayed():
                self.queue.put(response)
            return
        if isinstance(item, self._response_type):
            item = generation.reported(item)
        self.queue.put(item)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.queue, name)


class CheckpointNotResumable(KvStateError):
    """A checkpoint under the request's key that this server cannot resume (it records no pending token)."""


class Resumption:
    """How ``kvstate serve`` checkpoints and resumes generations: every ``every`` tokens, with the
    server's own context and response types and sampler maker, and its model provider (the served
    tokenizer, and whether a draft model runs beside the model)."""

    def __init__(self, service: Any, every: int, server: Any, model_provider: Any):
        self.service = service
        self.every = every
        self.keys = ResumableKeys(service)
        self._server = server
        self._provider = model_provider

    def _tokenizer(self) -> Any:
        return self._provider.tokenizer

    def lease(self, request: Any, tokenized: tuple, args: Any, prompt: tuple[int, ...]) -> Request | None:
        """The service's request for a resumable server request (with its continuation), or None where
        the request is not resumable (no key, or a kind of request this server does not resume)."""
        resumable = getattr(request, RESUMABLE_ATTRIBUTE, None)
        if resumable is None or tokenized[4] is not None or getattr(self._provider, "draft_model", None) is not None:
            return None
        if args.seed is not None and penalised(args):
            return None
        continuation = Continuation(resumable.key, args.seed or 0, seed_was_explicit=args.seed is not None)
        return Request(prompt, args.max_tokens, continuation=continuation)

    def begin(self, lease: Request, namespace: str, request: Any, tokenized: tuple, args: Any
              ) -> tuple[Generation, tuple, Any]:
        """Acquire ``lease``'s state (a resumed checkpoint, else what reuse finds) and start its
        generation: the generation, the server's tokenization to run (a resume's prompt is the tokens
        its caches cover, then its pending token) and the acquired state. A resume lowers
        ``args.max_tokens`` by what it sends again. Raises :class:`CheckpointNotResumable` for a
        checkpoint this server cannot resume: the caller releases ``lease`` unfinished, so it stays."""
        state = self.service.acquire(lease, namespace)
        resumable = getattr(request, RESUMABLE_ATTRIBUTE)
        top = (args.top_logprobs or 0) > 0
        response = self._server.Response
        if state.resumed is None:
            generation = Generation(self.service, lease, namespace, resumable, self.every, args.max_tokens, top,
                                    None, response)
        else:
            meta = state.resumed
            if meta.pending_token is None:  # the caller releases the lease, the checkpoint kept
                raise CheckpointNotResumable(f"the checkpoint of {IDEMPOTENCY_HEADER} {resumable.key!r} records no "
                                             f"pending token; send the request with a new key")
            sent = state.resumed_tokens[len(lease.prompt):] + (meta.pending_token,)
            note = Note.parse(meta.note)
            logprobs = note.logprobs if note is not None and len(note.logprobs) == len(sent) else (0.0,) * len(sent)
            tops = (note.top_tokens if note is not None and note.top_tokens is not None
                    and len(note.top_tokens) == len(sent) else ((),) * len(sent))
            replay = tuple(Sent(token, logprob, tuple(top_tokens) if top_tokens else ())
                           for token, logprob, top_tokens in zip(sent, logprobs, tops))
            generation = Generation(self.service, lease, namespace, resumable, self.every, args.max_tokens, top,
                                    self._tokenizer().detokenizer, response, replay)
            args.max_tokens -= len(replay)
            prompt = list(state.resumed_tokens) + [meta.pending_token]
            tokenized = (prompt, [list(prompt)], ["assistant"], tokenized[3], None)
            logging.info("kvstate: generation %r resumed after %d tokens", resumable.key, len(replay))
        if args.seed is not None:  # served on the single-request path: its caches are these
            caches = state.caches
            generation.state = lambda: (caches, None)
        return generation, tokenized, state

    def queue(self, queue: Any, generation: Generation) -> ReplayingQueue:
        return ReplayingQueue(queue, generation, self._server.GenerationContext, self._server.Response)

    def advance_sampler(self, generation: Generation, args: Any, vocabulary: int) -> None:
        """Seed the sampler's random state as the server does, then make the draws the tokens sent
        before the checkpoint made, so the resumed run draws what the uninterrupted one would."""
        mx.random.seed(args.seed)
        sampler = self._server._make_sampler(args, self._tokenizer())
        logits = mx.zeros((1, vocabulary))
        for _ in generation.replay:
            mx.eval(sampler(logits))


def vocabulary(model: Any) -> int:
    """The number of logits ``model`` gives a token (its vocabulary), read off its arguments."""
    size = getattr(getattr(model, "args", None), "vocab_size", None)
    return size if isinstance(size, int) and size > 0 else 1 << 17
