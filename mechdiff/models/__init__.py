"""Loading checkpoints, the named registry, model sets and architecture adapters."""

from .architectures import ARCHITECTURES, Architecture, ModelShape, architecture_for
from .loading import LoadedModel, load_config, load_model, load_tokenizer, model_fingerprint, resolve_spec
from .modelset import IncompatibleModels, ModelPair, ModelSet
from .registry import REGISTRY, ModelSpec, get_spec

__all__ = [
    "ARCHITECTURES", "Architecture", "ModelShape", "architecture_for", "LoadedModel", "load_config",
    "load_model", "load_tokenizer", "model_fingerprint", "resolve_spec", "IncompatibleModels", "ModelPair",
    "ModelSet", "REGISTRY", "ModelSpec", "get_spec",
]
