"""``kvstate serve`` on a hybrid model (qwen3_next: gated-delta recurrent layers beside attention):
chunk snapshots taken during prefill let an edit inside the last message reuse up to the last
snapshot before the edit, where segment-end snapshots alone reuse only the system prompt; the text
is stock ``mlx_lm.server``'s. Through the real ``openai`` client; the tokenizer is trained in the
fixture; nothing is downloaded."""

from __future__ import annotations

import pytest

pytest.importorskip("openai", reason="the serving tests talk through the real openai client")

from mlx_lm.tokenizer_utils import load as load_tokenizer  # noqa: E402

from kvstate.models.model_dir import save_model_dir  # noqa: E402
from tests.test_serve import SYSTEM, Server, chat  # noqa: E402

CHUNK = 32
WORDS = "the river runs past the old mill and the children count the boats that drift by in the evening".split()


@pytest.fixture(scope="module")
def hybrid_dir(tmp_path_factory):
    return save_model_dir(tmp_path_factory.mktemp("served-hybrid") / "qwen3_next", "qwen3_next", seed=4)


def story(n: int, salt: int = 0) -> str:
    return " ".join(WORDS[(i * 5 + salt) % len(WORDS)] for i in range(n))


def cached(reply) -> int:
    details = reply.usage.prompt_tokens_details
    return details.cached_tokens if details is not None else 0


def shared_tokens(model_dir, first: list, second: list) -> int:
    """How many leading tokens the two conversations' prompts share, by the served tokenizer."""
    tokenizer = load_tokenizer(model_dir)
    a, b = (tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=True) for m in (first, second))
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_an_edit_inside_the_last_message_reuses_up_to_the_last_chunk_snapshot_before_it(hybrid_dir):
    first = [SYSTEM, {"role": "user", "content": story(120) + " what is left at the end?"}]
    edited = [SYSTEM, {"role": "user", "content": story(120) + " who stays until the night?"}]
    shared = shared_tokens(hybrid_dir, first, edited)
    chunks = ("--prefill-step-size", str(CHUNK))
    with_snapshots = Server(hybrid_dir, "--ram-bytes", "64MiB", *chunks, "--snapshot-every", str(CHUNK))
    try:
        chat(with_snapshots, first)
        reply = chat(with_snapshots, edited)
        reused = cached(reply)
    finally:
        with_snapshots.stop()
    segment_ends = Server(hybrid_dir, "--ram-bytes", "64MiB", *chunks, "--snapshot-every", "0")
    try:
        chat(segment_ends, first)
        at_segment_ends = cached(chat(segment_ends, edited))
    finally:
        segment_ends.stop()
    stock = Server(hybrid_dir, *chunks, stock=True)
    try:
        stock_text = chat(stock, edited).choices[0].message.content
    finally:
        stock.stop()
    assert reply.choices[0].message.content == stock_text
    assert shared > 100 and at_segment_ends < shared - 2 * CHUNK  # segment ends reuse the system prompt only
    # Chunks run from each segment's start, so the last snapshot before the edit is less than two
    # chunks before it; it is at least 90 % of the shared tokens here.
    assert shared - 2 * CHUNK < reused <= shared and reused >= 0.9 * (shared // CHUNK * CHUNK) - CHUNK
