"""The one stage cache of every study: ``<run>/stages/<name>.json`` keyed by a hash of the stage's inputs.

A stage is reused only when the hash of everything it depends on (its options, the digests of its
models, the keys of the stages it reads) matches the saved record's key, so a rerun recomputes only
what a changed option touches and a killed run resumes at the first unfinished stage. Records are
read through :func:`mechdiff.io.read_record`, which sets an unreadable file aside. Records of the
first HeadMap study (``{"key": {...inputs...}, "value": ...}``) are read as well: their key is the
inputs themselves, hashed the same way.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..io import check_terminated, read_record, set_aside, write_json

log = logging.getLogger(__name__)


def label(name: str) -> str:
    """A file-name-safe label for a model name or path (``/data/ckpt-7/`` -> ``ckpt-7``)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", Path(name.rstrip("/")).name or name) or "model"


def key_hash(data: Any) -> str:
    """16 hex digits of the SHA-256 of ``data`` as canonical JSON (sorted keys; other types by ``str``)."""
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass
class StageRecord:
    """One stage's outcome: its key, result, wall time and whether it came from the cache."""

    name: str
    key: str
    result: Any
    seconds: float
    cached: bool


@dataclass
class StageCache:
    """``<run>/stages/<name>.json``: a stage is reused only when its key matches.

    ``name`` is ``kind`` or ``kind:model`` (file ``kind__<label(model)>.json``)."""

    root: Path
    records: dict[str, StageRecord] = field(default_factory=dict)

    def path(self, name: str) -> Path:
        """The record file of stage ``name``."""
        kind, _, model = name.partition(":")
        return self.root / "stages" / (f"{kind}__{label(model)}.json" if model else f"{kind}.json")

    def run(self, name: str, inputs: dict, compute: Callable[[], Any]) -> StageRecord:
        """The saved result of ``name`` if its key is ``key_hash(inputs)``; else ``compute()``, saved atomically."""
        check_terminated()  # a SIGTERM whose exception was swallowed stops the run here
        key = key_hash(inputs)
        path = self.path(name)
        saved = _saved(path, name)
        if saved is not None:
            if saved["key"] == key:
                log.info("stage %s: cached (key %s)", name, key)
                return self._keep(StageRecord(name, key, saved["result"], saved["seconds"], True))
            log.info("stage %s: inputs changed, recomputing", name)
        t0 = time.perf_counter()
        result = compute()
        seconds = time.perf_counter() - t0
        write_json(path, {"name": name, "key": key, "inputs": inputs, "seconds": seconds, "result": result})
        return self._keep(StageRecord(name, key, result, seconds, False))

    def ready(self, name: str, inputs: dict) -> bool:
        """Whether stage ``name`` is saved under the key of ``inputs`` (e.g. by another process); a record
        saved under other inputs is not."""
        saved = _saved(self.path(name), name)
        return saved is not None and saved["key"] == key_hash(inputs)

    def _keep(self, rec: StageRecord) -> StageRecord:
        self.records[rec.name] = rec
        return rec

    def summary(self) -> dict[str, dict]:
        """Per stage run so far: key, seconds and whether it came from the cache (for a run manifest)."""
        return {n: {"key": r.key, "seconds": r.seconds, "cached": r.cached} for n, r in self.records.items()}


def _saved(path: Path, name: str) -> dict | None:
    """The record at ``path`` as ``{key, result, seconds}``, a first-HeadMap-study record converted, or None."""
    saved = read_record(path, f"stage record of {name}", ("key", "seconds"))
    if saved is None:
        return None
    if isinstance(saved["key"], dict) and "value" in saved:  # the first HeadMap study's format
        return {"key": key_hash(saved["key"]), "result": saved["value"], "seconds": saved["seconds"]}
    if "result" not in saved:
        set_aside(path, f"stage record of {name}", "no field result")
        return None
    return saved
