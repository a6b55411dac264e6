"""A guard for every test that runs a model: a token id outside the model's vocabulary is an error.

mlx-lm's embedding gathers rows without a bounds check, so an id past the vocabulary reads memory
the weights do not own and the logits come out as garbage (now and then NaN) from one run to the
next: a test bug that looks like a cache bug. The reference models have 256 tokens.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest


class TokenOutsideVocabulary(AssertionError):
    """A test fed a model a token id its embedding has no row for."""


@pytest.fixture(autouse=True, scope="session")
def tokens_within_the_vocabulary():
    plain = nn.Embedding.__call__

    def checked(self, x):
        if x.size:
            low, high = (int(v) for v in mx.stack([mx.min(x), mx.max(x)]).tolist())
            if low < 0 or high >= self.weight.shape[0]:
                raise TokenOutsideVocabulary(f"token ids {low}..{high} fed to an embedding of "
                                             f"{self.weight.shape[0]} rows: use ids below that")
        return plain(self, x)

    nn.Embedding.__call__ = checked
    yield
    nn.Embedding.__call__ = plain
