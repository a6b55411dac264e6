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
        if x.size and (int(mx.max(x).item()) >= self.weight.shape[0] or int(mx.min(x).item()) < 0):
            raise TokenOutsideVocabulary(f"token ids {int(mx.min(x).item())}..{int(mx.max(x).item())} fed to an "
                                         f"embedding of {self.weight.shape[0]} rows: use ids below that")
        return plain(self, x)

    nn.Embedding.__call__ = checked
    yield
    nn.Embedding.__call__ = plain
