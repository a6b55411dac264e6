"""The geometry of a model's caches, and the bytes that follow from it.

A :class:`ModelSpec` lists, per layer, which kind of cache the layer keeps
(full attention, sliding window, fixed-size recurrent state, latent attention)
and its shape, plus the KV storage scheme. From that come the two numbers the
service lives by: the bytes a request's caches hold after ``n`` tokens (live
tokens, not padded buffers) and whether such caches can be trimmed to a shorter
prefix. Admission projects ``prompt + max_tokens`` through :meth:`ModelSpec.bytes_for`.
"""

from __future__ import annotations

import enum

import attrs


class LayerKind(enum.Enum):
    """What one layer's cache holds."""

    #: Keys and values for every token (``KVCache`` / ``QuantizedKVCache``).
    FULL_ATTENTION = "full"
    #: Keys and values for the last ``window`` tokens (``RotatingKVCache``).
    SLIDING_WINDOW = "sliding"
    #: A fixed-size state whatever the length (``ArraysCache``: Mamba, gated DeltaNet).
    RECURRENT = "recurrent"
    #: One compressed latent vector per token (multi-head latent attention).
    LATENT_ATTENTION = "latent"


@attrs.frozen
class KvScheme:
    """How attention caches store one element: plain 16-bit (or 32-bit), or grouped quantisation.

    Quantised schemes pack ``bits`` per element and keep a scale and a bias of
    ``scale_bytes`` each per group of ``group_size`` elements, as mlx's
    ``mx.quantize`` (and mlx-lm's ``QuantizedKVCache``) lay them out.
    """

    name: str
    bits: int
    group_size: int = 0
    scale_bytes: int = 2

    def __attrs_post_init__(self) -> None:
        if self.bits not in (32, 16, 8, 4):
            raise ValueError(f"KV scheme {self.name!r}: bits must be 32, 16, 8 or 4, got {self.bits}")
        if self.quantized and self.group_size <= 0:
            raise ValueError(f"KV scheme {self.name!r}: a quantised scheme needs a positive group_size")

    @property
    def quantized(self) -> bool:
        return self.bits < 16

    def vector_bytes(self, elements: int) -> int:
        """Bytes of one stored vector of ``elements`` values under this scheme."""
        if not self.quantized:
            return elements * self.bits // 8
        groups = -(-elements // self.group_size)
        return elements * self.bits // 8 + groups * 2 * self.scale_bytes


FP32 = KvScheme("fp32", 32)
BF16 = KvScheme("bf16", 16)
FP16 = KvScheme("fp16", 16)
Q8 = KvScheme("q8", 8, group_size=64)
Q4 = KvScheme("q4", 4, group_size=64)


@attrs.frozen
class LayerSpec:
    """One layer's cache: its kind and shape.

    ``kv_heads`` and ``head_dim`` shape attention layers; ``window`` bounds a
    sliding window; ``latent_dim`` is the per-token latent width (compressed KV
    plus the rotary part) of latent attention; ``state_bytes`` is the fixed size
    of a recurrent layer's state.
    """

    kind: LayerKind
    kv_heads: int = 0
    head_dim: int = 0
    window: int | None = None
    latent_dim: int = 0
    state_bytes: int = 0

    def __attrs_post_init__(self) -> None:
        kind = self.kind
        if kind in (LayerKind.FULL_ATTENTION, LayerKind.SLIDING_WINDOW):
            if self.kv_heads <= 0 or self.head_dim <= 0:
                raise ValueError(f"{kind.value} layer needs positive kv_heads and head_dim")
        if kind is LayerKind.SLIDING_WINDOW and (self.window is None or self.window <= 0):
            raise ValueError("sliding-window layer needs a positive window")
        if kind is LayerKind.LATENT_ATTENTION and self.latent_dim <= 0:
            raise ValueError("latent-attention layer needs a positive latent_dim")
        if kind is LayerKind.RECURRENT and self.state_bytes <= 0:
            raise ValueError("recurrent layer needs positive state_bytes")

    def bytes_for(self, tokens: int, scheme: KvScheme) -> int:
        """Bytes this layer's cache holds after ``tokens`` tokens."""
        kind = self.kind
        if kind is LayerKind.RECURRENT:
            return self.state_bytes
        if kind is LayerKind.LATENT_ATTENTION:
            return tokens * scheme.vector_bytes(self.latent_dim)
        held = tokens if kind is LayerKind.FULL_ATTENTION else min(tokens, self.window)
        return 2 * held * self.kv_heads * scheme.vector_bytes(self.head_dim)

    def trimmable_at(self, tokens: int) -> bool:
        """Whether a cache of ``tokens`` tokens can serve any shorter prefix."""
        if self.kind is LayerKind.RECURRENT:
            return False
        if self.kind is LayerKind.SLIDING_WINDOW:
            return tokens < self.window  # as mlx-lm's RotatingKVCache: full means the next token rotates
        return True


@attrs.frozen
class ModelSpec:
    """A model's cache geometry: layers, KV scheme and context limit.

    ``context_limit`` is the most tokens (prompt plus generation) a request may
    span; ``None`` means the caches impose none (pure recurrent models).
    """

    name: str
    layers: tuple[LayerSpec, ...] = attrs.field(converter=tuple)
    context_limit: int | None
    kv: KvScheme = BF16
    source: str = ""
    #: Real tokens one position stands for: 1 normally; 512 when positions are 512-token blocks
    #: (the eviction lab replays block-id traces through the service that way).
    position_tokens: int = 1

    #: Distinct layers with their counts: ``bytes_for`` sums a few terms, not every layer (admission is hot).
    _terms: tuple[tuple[LayerSpec, int], ...] = attrs.field(init=False, eq=False, repr=False)
    #: ``(fixed, per position)`` bytes where no layer has a window (bytes grow linearly), else None.
    _linear: tuple[int, int] | None = attrs.field(init=False, eq=False, repr=False)

    def __attrs_post_init__(self) -> None:
        if not self.layers:
            raise ValueError(f"model {self.name!r} has no layers")
        counts: dict[LayerSpec, int] = {}
        for layer in self.layers:
            counts[layer] = counts.get(layer, 0) + 1
        object.__setattr__(self, "_terms", tuple(counts.items()))
        linear = None
        if all(layer.kind is not LayerKind.SLIDING_WINDOW for layer in counts):
            fixed = self._summed(0)
            linear = (fixed, self._summed(1) - fixed)
        object.__setattr__(self, "_linear", linear)
        if self.context_limit is not None and self.context_limit <= 0:
            raise ValueError(f"model {self.name!r}: context_limit must be positive or None")

    def per_block(self, block_tokens: int) -> "ModelSpec":
        """The same geometry counted in positions of ``block_tokens`` tokens each."""
        limit = None if self.context_limit is None else max(1, self.context_limit // block_tokens)
        return attrs.evolve(self, name=f"{self.name}/{block_tokens}-token blocks", context_limit=limit,
                            position_tokens=self.position_tokens * block_tokens)

    def bytes_for(self, tokens: int) -> int:
        """Bytes a request's caches hold after ``tokens`` positions (every layer, live tokens)."""
        linear = self._linear
        if linear is not None:
            return linear[0] + linear[1] * tokens
        return self._summed(tokens)

    def _summed(self, tokens: int) -> int:
        """``bytes_for`` layer by layer."""
        tokens *= self.position_tokens
        return sum(count * layer.bytes_for(tokens, self.kv) for layer, count in self._terms)

    @property
    def fixed_bytes(self) -> int:
        """Bytes a request holds whatever its length (recurrent state)."""
        return self.bytes_for(0)

    @property
    def bytes_per_token(self) -> int:
        """Bytes each further token adds while no window is full."""
        return self.bytes_for(1) - self.bytes_for(0)

    def trimmable_at(self, tokens: int) -> bool:
        """Whether caches covering ``tokens`` tokens serve any shorter prefix (every layer must)."""
        return all(layer.trimmable_at(tokens * self.position_tokens) for layer, _ in self._terms)
