"""Model geometries: what a model's caches hold per token and per request.

Pure data (no mlx import here): admission and the simulator read bytes and
trimmability from a :class:`ModelSpec`; the catalogue names published models.
"""

from kvstate.models.spec import KvScheme, LayerKind, LayerSpec, ModelSpec, BF16, FP16, FP32, Q8, Q4
from kvstate.models.catalogue import CATALOGUE, UnknownModel, model_spec

__all__ = [
    "KvScheme", "LayerKind", "LayerSpec", "ModelSpec", "BF16", "FP16", "FP32", "Q8", "Q4",
    "CATALOGUE", "UnknownModel", "model_spec",
]
