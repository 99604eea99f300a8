"""Loading checkpoints, the named registry, model sets and architecture adapters."""

from .architectures import EXCEPTIONS, Architecture, ModelShape, UnsupportedModel, architecture_for, shape_of
from .loading import LoadedModel, load_config, load_model, load_tokenizer, model_fingerprint
from .modelset import IncompatibleModels, ModelPair, ModelSet
from .registry import REGISTRY, ModelSpec, get_spec
from .resolve import resolve_spec
from .tokenization import Token, tokens

__all__ = [
    "EXCEPTIONS",
    "Architecture",
    "ModelShape",
    "UnsupportedModel",
    "architecture_for",
    "shape_of",
    "LoadedModel",
    "load_config",
    "load_model",
    "load_tokenizer",
    "model_fingerprint",
    "resolve_spec",
    "IncompatibleModels",
    "ModelPair",
    "ModelSet",
    "REGISTRY",
    "ModelSpec",
    "get_spec",
    "Token",
    "tokens",
]
