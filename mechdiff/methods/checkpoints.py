"""The checkpoints of one trajectory (`mechdiff.methods.trajectory`), checked before any weights load and held so
that each can run: LoRA adapters over one base loaded into one peft model and swapped (merged over the base's own
weights, restored before each swap), or full-weight checkpoints of one architecture loaded one at a time.
"""

from __future__ import annotations

import copy
import json
from functools import cached_property
from pathlib import Path
from typing import Any, Optional, Sequence

import torch

from ..models.loading import LoadedModel, load_model, model_fingerprint, spec_digest
from ..models.registry import ModelSpec
from ..models.resolve import resolve_source, resolve_spec


class TrajectoryError(ValueError):
    """A list of checkpoints that is not one trajectory over one base."""


def trajectory_specs(names: Sequence[str]) -> tuple[ModelSpec, list[ModelSpec]]:
    """The base and each checkpoint's spec, checked before any weights load: at least two distinct checkpoints,
    either each a LoRA adapter over one base or that base itself, or each a full-weight checkpoint (a directory, a
    hub ``revision``) of one architecture, the first standing as the base."""
    if len(names) < 2 or len(set(names)) != len(names):
        raise TrajectoryError(f"a trajectory needs at least two distinct checkpoints in order, got {list(names)}")
    specs = [resolve_spec(n) for n in names]
    adapters = [s for s in specs if s.kind == "lora"]
    if not adapters:
        check_one_architecture(specs)
        return specs[0], specs
    bases = {s.base for s in adapters}
    base = resolve_spec(adapters[0].base)
    digest = spec_digest(base)
    if len(bases) > 1 and len({spec_digest(resolve_spec(b)) for b in bases}) > 1:
        raise TrajectoryError(
            f"the adapters sit on different bases ({', '.join(sorted(bases))}); a trajectory is one run over one base"
        )
    plain = [s.name for s in specs if s.kind != "lora" and spec_digest(s) != digest]
    if plain:
        raise TrajectoryError(
            f"{', '.join(plain)} is neither a LoRA adapter nor the adapters' base {base.name}; a trajectory is all "
            "adapters over one base (and the base), or all full-weight checkpoints"
        )
    return base, specs


#: The config entries that make two full-weight checkpoints one architecture (those a config states).
ARCHITECTURE = ("architectures", "model_type", "num_hidden_layers", "num_attention_heads", "hidden_size", "vocab_size")


def check_one_architecture(specs: Sequence[ModelSpec]) -> None:
    """Full-weight checkpoints of one run share one architecture: compared on the ``config.json`` of each local
    directory (a hub revision's config is read when its weights load)."""
    seen: dict[str, dict] = {}
    for spec in specs:
        config = Path(resolve_source(spec.source)) / "config.json"
        if spec.kind == "local" and config.is_file():
            full = json.loads(config.read_text())
            seen[spec.name] = {k: full.get(k) for k in ARCHITECTURE}
    shapes = {json.dumps(v, sort_keys=True) for v in seen.values()}
    if len(shapes) > 1:
        first, *_ = seen
        other = next(n for n, v in seen.items() if v != seen[first])
        raise TrajectoryError(
            f"{other} is not the architecture of {first} ({seen[other]} against {seen[first]}); the checkpoints of "
            "a trajectory are one run of one model"
        )


class _Merged:
    """The peft-wrapped model seen as the plain merged model (``.base_layer`` folded, adapters dropped), so
    `model_fingerprint` gives the fingerprint `load_model` gives."""

    def __init__(self, model: torch.nn.Module):
        self.config = model.config
        self._model = model

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k.replace(".base_layer.", "."): v for k, v in self._model.state_dict().items() if ".lora_" not in k}


class _Swapped(LoadedModel):
    """A checkpoint served by `Checkpoints`' shared peft model; refuses to trace unless it is active."""

    owner: Any = None

    def trace(self, **kwargs: Any) -> Any:
        self.owner.require_active(self.name)
        return super().trace(**kwargs)

    @cached_property
    def fingerprint(self) -> str:
        """`load_model`'s fingerprint of this checkpoint (the swapped weights seen as the merged model;
        forgotten at every swap)."""
        self.owner.require_active(self.name)
        return model_fingerprint(_Merged(self.model))


class Checkpoints:
    """The checkpoints of one trajectory: the base loaded once, the adapters swapped in one peft model; or, for
    full-weight checkpoints, the first loaded once and each other loaded when asked for (one held at a time).

    ``first()`` (the first checkpoint) is a model of its own, so that it and any other checkpoint can run side by
    side (CMAP); every other adapter is merged into the shared model by ``model(name)`` when asked for, and the
    model returned refuses to run once another adapter is swapped in."""

    def __init__(self, names: Sequence[str], dtype: str = "float32", device: Optional[str] = None):
        from peft import PeftModel
        from peft.tuners.lora import LoraLayer

        self.names = list(names)
        self.base_spec, specs = trajectory_specs(self.names)
        self.specs = dict(zip(self.names, specs))
        self._load = {"dtype": dtype, "device": device}
        self.base = load_model(self.base_spec, dtype=dtype, device=device)  # the one load of the base
        self._full = not any(s.kind == "lora" for s in specs)
        self._loaded: Optional[LoadedModel] = None  # full weights: the one checkpoint held beside the first
        self._keys = {n: f"ckpt{i}" for i, n in enumerate(self.names) if self.specs[n].kind == "lora"}
        self._first = self._merged_copy(self.names[0]) if self.names[0] in self._keys else None
        if self._full:
            return
        peft_model = None
        for name, key in self._keys.items():
            src = resolve_source(self.specs[name].source)
            if peft_model is None:
                peft_model = PeftModel.from_pretrained(copy.deepcopy(self.base.model), src, adapter_name=key)
            else:
                peft_model.load_adapter(src, adapter_name=key)
        peft_model.requires_grad_(False)
        self._peft = peft_model
        self._inner = peft_model.base_model.model  # the transformers model, its projections LoRA layers
        self._layers = [m for m in self._inner.modules() if isinstance(m, LoraLayer)]
        self._w0 = [m.get_base_layer().weight.detach().clone() for m in self._layers]
        self._active: Optional[str] = None
        self._views: dict[str, _Swapped] = {}

    def _merged_copy(self, name: str) -> LoadedModel:
        """``name`` merged into a copy of the base, as `load_model` merges it."""
        from peft import PeftModel

        spec = self.specs[name]
        merged = PeftModel.from_pretrained(copy.deepcopy(self.base.model), resolve_source(spec.source))
        merged = merged.merge_and_unload()
        return LoadedModel(name, spec, merged, self.base.tokenizer, self._provenance(name))

    def _provenance(self, name: str) -> dict:
        return {
            "kind": "lora",
            "adapter": self.specs[name].source,
            "merged": True,
            "base": self.base.provenance,
            "swapped": name != self.names[0],
        }

    def first(self) -> LoadedModel:
        """The first checkpoint, a model of its own (the base itself where the first is the base)."""
        return self._first or self.base

    def model(self, name: str) -> LoadedModel:
        """Checkpoint ``name``; an adapter other than the first's is merged into the shared model now."""
        if name not in self.specs:
            raise KeyError(f"{name!r} is not a checkpoint of this trajectory ({', '.join(self.names)})")
        if name == self.names[0]:
            return self.first()
        if self._full:
            return self._full_weights(name)
        if name not in self._keys:
            return self.base
        if self._active != name:
            self._swap(name)
        if name not in self._views:
            view = _Swapped(name, self.specs[name], self._inner, self.base.tokenizer, self._provenance(name))
            view.owner = self
            self._views[name] = view
        return self._views[name]

    def _full_weights(self, name: str) -> LoadedModel:
        """Full-weight checkpoint ``name``, loaded now unless it is the one held (the one held before is dropped:
        a model returned earlier stays usable while its caller holds it)."""
        if self._loaded is None or self._loaded.name != self.specs[name].name:
            self._loaded = None
            self._loaded = load_model(self.specs[name], **self._load)
        return self._loaded

    def _swap(self, name: str) -> None:
        if self._active is not None:
            self._peft.unmerge_adapter()
        with torch.no_grad():  # the base's own weights back, so no rounding of earlier merges accumulates
            for layer, w in zip(self._layers, self._w0):
                layer.get_base_layer().weight.copy_(w)
        self._peft.set_adapter(self._keys[name])
        self._peft.merge_adapter()
        self._peft.requires_grad_(False)
        self._active = name
        view = self._views.get(name)
        if view is not None:
            view.__dict__.pop("fingerprint", None)

    def require_active(self, name: str) -> None:
        """Raise unless ``name``'s adapter is the one merged in the shared model."""
        if self._active != name:
            raise RuntimeError(
                f"{name} is not the active checkpoint ({self._active} is); ask Checkpoints.model("
                f"{name!r}) again before running it"
            )

    def fingerprint(self, name: str) -> str:
        """The fingerprint `load_model` gives checkpoint ``name`` (computed on the swapped weights)."""
        return self.model(name).fingerprint
