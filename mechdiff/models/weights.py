"""Whether a model's weights can be loaded here (`check_weights`), asked before anything loads: a missing
checkpoint is named with the ways to provide it, where a study would otherwise fail at its first load."""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Iterable, Optional

from .loading import offline
from .registry import ModelSpec
from .resolve import resolve_source, resolve_spec

log = logging.getLogger(__name__)

WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
    "adapter_model.safetensors",
    "adapter_model.bin",
)


class WeightsMissingError(FileNotFoundError):
    """A model's weights are neither on disk nor reachable; the message says how to provide them."""


def _hub_cached(repo: str, revision: Optional[str], cache_dir: Optional[str]) -> tuple[bool, bool]:
    """(config cached, weights cached) for a hub repo in the Hugging Face cache."""
    from huggingface_hub import try_to_load_from_cache

    def cached(name: str) -> bool:
        found = try_to_load_from_cache(repo, name, cache_dir=cache_dir, revision=revision)
        return isinstance(found, str)

    config = cached("config.json") or cached("adapter_config.json")
    return config, any(cached(f) for f in WEIGHT_FILES)


def missing_weights(spec: ModelSpec, cache_dir: Optional[str] = None) -> list[str]:
    """What is missing to load ``spec`` here (empty: loadable). A hub id not in the cache counts as
    missing only offline (``HF_HUB_OFFLINE=1``); online it downloads on first use."""
    if spec.kind == "hub":
        return _missing_hub(spec.name, spec.source, spec.revision, cache_dir)
    if spec.kind == "lora":
        src = spec.source
        if src.startswith("package:") or os.path.exists(os.path.expanduser(src)):
            own = _missing_path(spec)
        else:  # an adapter named by its hub id
            own = _missing_hub(spec.name, src, spec.revision, cache_dir)
        return own + missing_weights(resolve_spec(spec.base), cache_dir)
    return _missing_path(spec)


def _missing_path(spec: ModelSpec) -> list[str]:
    try:
        path = Path(resolve_source(spec.source)).expanduser()
    except ModuleNotFoundError as err:
        return [f"{spec.name}: {err}"]
    target = path / spec.gguf_file if spec.kind == "gguf" and spec.gguf_file else path
    return [] if target.exists() else [f"{spec.name}: {target} does not exist"]


def _missing_hub(name: str, repo: str, revision: Optional[str], cache_dir: Optional[str]) -> list[str]:
    config, weights = _hub_cached(repo, revision, cache_dir)
    if config and weights:
        return []
    if not offline():
        log.info("%s: %s is not in the Hugging Face cache; it will be downloaded", name, repo)
        return []
    what = "config and weights" if not config else "weights"
    return [f"{name}: the {what} of hub:{repo} are not in the Hugging Face cache and HF_HUB_OFFLINE is set"]


def check_weights(names: Iterable[str], cache_dir: Optional[str] = None, remote: bool = False) -> None:
    """Raise `WeightsMissingError` naming every model whose weights cannot be loaded here,
    before anything expensive. On NDIF (``remote``) only the config and tokenizer are needed."""
    missing: list[str] = []
    for name in names:
        spec = resolve_spec(name)
        if remote and spec.kind == "hub":
            continue
        missing += missing_weights(spec, cache_dir)
    if missing:
        raise WeightsMissingError(
            "weights missing:\n  " + "\n  ".join(missing) + "\nProvide them in one of these ways: download them "
            "into the Hugging Face cache (`huggingface-cli download <repo>` with network, then HF_HUB_OFFLINE=1 "
            "works), unset HF_HUB_OFFLINE to download on first use, give a local directory holding config.json "
            'and the weights instead of the registry name in [models] (e.g. base = "/data/llama-7b"), or run '
            "on NDIF with `remote = true` / --remote for the hub models it hosts."
        )
