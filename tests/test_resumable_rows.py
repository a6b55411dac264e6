"""A resumable generation's row in the server's batch: its checkpoint stays for a retry whenever the row
ends unfinished (removed, as a client that went away is, or the server closing) and goes once the
generation finished; a resume this server cannot make is refused and keeps the checkpoint too.

Driven as ``mlx_lm.server``'s generation loop drives them: mlx-lm's real ``BatchGenerator`` (measured by
:func:`~kvstate.interpreters.serving.batch_admission.measured_batch_generator`), the real
:class:`~kvstate.interpreters.serving.resumable.Resumption` with mlx-lm's server module, on a tiny
random-weight llama whose service writes checkpoints to a disk tier.
"""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import pytest
from mlx_lm import server
from mlx_lm.generate import BatchGenerator

from kvstate import KvCacheService, Request
from kvstate.core.request import Continuation
from kvstate.interpreters.serving.batch_admission import BatchAdmission, measured_batch_generator
from kvstate.interpreters.serving.prompt_cache import KvStatePromptCache
from kvstate.interpreters.serving.resumable import RESUMABLE_ATTRIBUTE, CheckpointNotResumable, Resumable, Resumption
from kvstate.models.reference import build
from tests.test_prompt_cache import MODEL_KEY

PROMPT = list(range(1, 30))
EVERY = 4  # a checkpoint every four tokens fed
KEY = "retry-me"


class _Loop:
    """One server: the service, batch admission with resumption, and the measured batch generator."""

    def __init__(self, tmp_path):
        self.model, config = build("llama", seed=81)
        self.service = KvCacheService.for_mlx(self.model, config=config, ram_bytes=64 << 20, disk_dir=str(tmp_path),
                                              disk_bytes=256 << 20, checkpoint_every_tokens=EVERY,
                                              background_writes=False)
        self.cache = KvStatePromptCache(self.service, MODEL_KEY, unannounced=None)
        provider = SimpleNamespace(tokenizer=None, draft_model=None)
        self.admission = BatchAdmission(self.cache, share_wait_s=0.0,
                                        resumption=Resumption(self.service, EVERY, server, provider))
        self.generator = measured_batch_generator(BatchGenerator, self.admission)(self.model, prefill_step_size=16)
        self.sent: list = []

    def admitted(self, max_tokens: int = 12):
        """A request with the client key ``KEY`` admitted as the server admits it (None: refused), its
        queue the one its responses go through (which checkpoints them)."""
        request = SimpleNamespace(**{RESUMABLE_ATTRIBUTE: Resumable(KEY, "body")})
        args = SimpleNamespace(max_tokens=max_tokens, seed=None, top_logprobs=0,
                               logits=SimpleNamespace(repetition_penalty=0, presence_penalty=0, frequency_penalty=0))
        item = (SimpleNamespace(put=self.sent.append), request, args)
        taken = [item]
        return self.admission.next_admitted(lambda timeout: taken.pop() if taken else None,
                                            lambda _: (PROMPT, [PROMPT], ["user"], "normal", None), 0)

    def run(self, tokens: int, max_tokens: int = 12) -> int:
        """Admit the request, place its row and generate ``tokens`` tokens, each reported through its
        queue as the server does; the row's uid."""
        queue, _, _ = self.admitted(max_tokens)
        caches, rest = self.cache.fetch_nearest_cache(MODEL_KEY, PROMPT)
        (uid,) = self.generator.insert_segments(segments=[[rest]], max_tokens=[max_tokens], caches=[caches],
                                                all_tokens=[PROMPT[:len(PROMPT) - len(rest)]])
        made = 0
        while made < tokens:
            _, generated = self.generator.next()
            for response in generated:
                queue.put(server.Response("", response.token, 0.0, response.finish_reason, ()))
                made += 1
        return uid

    def saved_checkpoint(self) -> bool:
        """Whether a checkpoint of the key is kept (written, or being written)."""
        return self.service.checkpoint_note(KEY) is not None

    def retried(self) -> int:
        """The tokens a retry of the same request resumes (0: it starts over)."""
        lease = Request(tuple(PROMPT), 12, continuation=Continuation(KEY, 0, seed_was_explicit=False))
        self.service.admit(lease)
        state = self.service.acquire(lease)
        self.service.release(lease, completed=False)
        return len(state.resumed_tokens)


@pytest.fixture
def loop(tmp_path):
    loop = _Loop(tmp_path)
    yield loop
    loop.generator.close()
    loop.service.close()


def test_a_removed_row_keeps_its_checkpoint_and_a_retry_resumes_from_it(loop):
    uid = loop.run(EVERY + 2)
    loop.service.flush()
    assert loop.saved_checkpoint()
    loop.generator.remove([uid])  # the client went away: the generation did not finish
    assert loop.saved_checkpoint() and loop.retried() == len(PROMPT) + EVERY


def test_rows_running_when_the_server_closes_keep_their_checkpoints(loop):
    loop.run(EVERY + 2)
    loop.service.flush()
    loop.generator.close()
    assert loop.saved_checkpoint() and loop.retried() == len(PROMPT) + EVERY


def test_a_generation_that_finished_leaves_no_checkpoint_whether_or_not_its_row_was_then_removed(loop):
    uid = loop.run(EVERY + 2, max_tokens=EVERY + 2)  # its last token ends it
    loop.service.flush()
    assert not loop.saved_checkpoint() and loop.retried() == 0
    loop.generator.remove([uid])
    assert not loop.saved_checkpoint()


def test_a_checkpoint_with_no_pending_token_is_refused_as_not_resumable_and_kept(loop):
    lease = Request(tuple(PROMPT), 12, continuation=Continuation(KEY, 0, seed_was_explicit=False))
    loop.service.admit(lease)
    caches = loop.service.acquire(lease).caches
    loop.model(mx.array([PROMPT]), cache=caches)
    assert loop.service.checkpoint(lease, caches, PROMPT, 0, pending_token=None)  # an earlier server's, say
    loop.service.release(lease, completed=False)
    loop.service.flush()
    assert loop.admitted() is None  # refused: the queue has the reason, the batch nothing to run
    assert [type(item) for item in loop.sent] == [CheckpointNotResumable]
    assert "new key" in str(loop.sent[0])
    assert loop.saved_checkpoint() and loop.service.report().live_requests == 0
