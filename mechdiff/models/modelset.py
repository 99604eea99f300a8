"""Sets of models that can be compared: same shape, same tokenizer vocabulary."""

from __future__ import annotations

import logging
from dataclasses import fields
from typing import Any, Iterator, Optional, Sequence

from .architectures import ModelShape
from .loading import LoadedModel, load_config, load_model, load_tokenizer
from .registry import ModelSpec
from .resolve import resolve_spec

log = logging.getLogger(__name__)


class IncompatibleModels(ValueError):
    """Two models differ in a way that makes their mechanisms incomparable."""


def check_shapes(named: dict[str, ModelShape]) -> None:
    """Raise naming the first field where the shapes differ."""
    (first, ref), *rest = named.items()
    for name, shape in rest:
        for f in fields(ModelShape):
            a, b = getattr(ref, f.name), getattr(shape, f.name)
            if a != b:
                raise IncompatibleModels(
                    f"models cannot be compared: {f.name} differs ({first}: {a}, {name}: {b}). "
                    "mechdiff compares checkpoints of one model; pick models of the same shape."
                )


def check_vocabularies(named: dict[str, Any]) -> None:
    """Raise if two tokenizers map any token to a different id."""
    (first, ref), *rest = named.items()
    ref_vocab = ref.get_vocab()
    for name, tok in rest:
        vocab = tok.get_vocab()
        if vocab != ref_vocab:
            diff = len(set(vocab.items()) ^ set(ref_vocab.items()))
            raise IncompatibleModels(
                f"models cannot be compared: tokenizer vocabularies differ ({first}: {len(ref_vocab)} tokens, "
                f"{name}: {len(vocab)} tokens, {diff} differing entries). Use checkpoints that share a tokenizer."
            )


class ModelSet:
    """Two or more checkpoints of one model, checked before any weights load."""

    def __init__(self, models: Sequence[str | ModelSpec], cache_dir: Optional[str] = None, **load_kwargs: Any):
        if len(models) < 1:
            raise ValueError("a ModelSet needs at least one model")
        self.specs = [resolve_spec(m) for m in models]
        names = [s.name for s in self.specs]
        if len(set(names)) != len(names):
            raise ValueError(f"model names repeat in {names}")
        self.cache_dir = cache_dir
        self.load_kwargs = load_kwargs
        self.shapes = {s.name: ModelShape.from_config(load_config(s, cache_dir)) for s in self.specs}
        check_shapes(self.shapes)
        #: Each model's tokenizer, read once: the vocabulary check's, then each load's and the study's.
        self.tokenizers = {s.name: load_tokenizer(s, cache_dir) for s in self.specs}
        check_vocabularies(self.tokenizers)
        self._loaded: dict[str, LoadedModel] = {}

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.specs]

    @property
    def shape(self) -> ModelShape:
        return next(iter(self.shapes.values()))

    def __getitem__(self, name: str) -> LoadedModel:
        """Load (once) and return one model of the set."""
        if name not in self._loaded:
            spec = next((s for s in self.specs if s.name == name), None)
            if spec is None:
                raise KeyError(f"{name!r} is not in this set: {self.names}")
            kwargs = {"tokenizer": self.tokenizers[name], **self.load_kwargs}  # a tokenizer the caller gave stands
            self._loaded[name] = load_model(spec, cache_dir=self.cache_dir, **kwargs)
        return self._loaded[name]

    @property
    def loaded(self) -> dict[str, LoadedModel]:
        """The models loaded so far, by name (a copy: `release` drops one)."""
        return dict(self._loaded)

    def release(self, name: str) -> Optional[LoadedModel]:
        """Forget the loaded model ``name`` (loaded again on the next access); returns it, or None if not loaded."""
        return self._loaded.pop(name, None)

    def __iter__(self) -> Iterator[LoadedModel]:
        for name in self.names:
            yield self[name]

    def __len__(self) -> int:
        return len(self.specs)


def ModelPair(base: str | ModelSpec, other: str | ModelSpec, **kwargs: Any) -> ModelSet:
    """A base and one fine-tune, checked as a set of two."""
    return ModelSet([base, other], **kwargs)
