"""A tiny mlx-lm model directory, built offline: a reference architecture with random weights, a
byte-level BPE tokenizer trained on a built-in text, and a chat template.

``mlx_lm.load`` (and so ``mlx_lm.server`` and ``kvstate serve``) loads it like any model from the
hub, with nothing downloaded: tests and benchmarks serve real HTTP on it.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvstate.models.reference import build

#: Enough merges over the bytes for short English words to be a token or two.
VOCAB = 512
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "You are a helpful assistant. Answer briefly and clearly.",
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Tell me about the weather today, and what I should wear outside.",
    "A cache keeps the state of a computation so that it need not be done again.",
    "Tools return results; the agent reads them and decides what to call next.",
    "Hello, how are you? I am fine, thank you. What would you like to know?",
    "Numbers: one two three four five six seven eight nine ten 0 1 2 3 4 5 6 7 8 9.",
]


def train_tokenizer(vocab_size: int = VOCAB):
    """A byte-level BPE (the ``tokenizers`` library) trained on :data:`CORPUS`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(CORPUS * 4, trainer)
    return tokenizer


def save_model_dir(path: str | Path, name: str = "llama", seed: int = 0, dtype=None, **overrides) -> Path:
    """Write reference model ``name`` (weights from ``seed``, config ``overrides``, in ``dtype``) with a
    tokenizer to ``path``; the path."""
    from mlx_lm.utils import save_config, save_model

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer()
    import mlx.core as mx

    model, config = build(name, seed=seed, dtype=dtype or mx.float32, vocab_size=VOCAB, **overrides)
    save_model(path, model)
    save_config({**config, "eos_token_id": tokenizer.token_to_id("<|im_end|>")}, path / "config.json")
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "chat_template": CHAT_TEMPLATE,
        "bos_token": None, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
        "unk_token": None, "model_max_length": 4096, "add_bos_token": False,
    }, indent=1))
    return path
