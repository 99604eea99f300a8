"""The one stage cache of every study: ``<run>/stages/<name>.json`` keyed by a hash of the stage's inputs.

A stage is reused only when the hash of everything it depends on (its options, the digests of its
models, the keys of the stages it reads) matches the saved record's key, so a rerun recomputes only
what a changed option touches and a killed run resumes at the first unfinished stage. Records are
read through `mechdiff.common.io.read_record`, which sets an unreadable file aside. Records of the
first HeadMap study (``{"key": {...inputs...}, "value": ...}``) are read as well: their key is the
inputs themselves, hashed the same way.

A cache made with ``planning=True`` computes nothing: `StageCache.run` notes each stage as cached or to
compute (`PlannedStage`) and hands a stage still to compute a result that raises `Pending` when
read, so a study walks its stages once to say what a run would do (`mechdiff.studies.base.Study.plan`).

Each stage that ends (cached or computed) says so in one line (`StageRecord.line`): written to stderr where
no progress bar is drawn (a log file, CI; `mechdiff.common.progress.note`), logged at INFO on a terminal;
once per cache and key: a stage read again from the cache under the same key (a worker of ``mechdiff run`` polling
the other's stages) says nothing more.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from ..common.io import check_terminated, read_record, set_aside, write_json
from ..common.progress import note

log = logging.getLogger(__name__)


def label(name: str) -> str:
    """A file-name-safe label for a model name or path (``/data/ckpt-7/`` -> ``ckpt-7``)."""
    return re.sub(r"[^A-Za-z0-9._-]+", "_", Path(name.rstrip("/")).name or name) or "model"


def key_hash(data: Any) -> str:
    """16 hex digits of the SHA-256 of ``data`` as canonical JSON (sorted keys; other types by ``str``)."""
    return hashlib.sha256(json.dumps(data, sort_keys=True, default=str).encode()).hexdigest()[:16]


@dataclass
class StageRecord:
    """One stage's outcome: its key, result, wall time, whether it came from the cache, and the CPU seconds of
    this process while it computed (every thread's; None in a record written before they were kept)."""

    name: str
    key: str
    result: Any
    seconds: float
    cached: bool
    cpu_seconds: Optional[float] = None
    finished: Optional[float] = None  # when the record was written (seconds since the epoch)

    def line(self) -> str:
        """``stage NAME: cached (key K; computed in S s)`` or ``stage NAME: computed in S s (key K)``."""
        if self.cached:
            return f"stage {self.name}: cached (key {self.key}; computed in {self.seconds:.1f} s)"
        return f"stage {self.name}: computed in {self.seconds:.1f} s (key {self.key})"


class Pending(Exception):
    """In a plan: a stage's inputs read the result of ``stage``, which is still to compute."""

    def __init__(self, stage: str):
        super().__init__(f"its inputs read the result of {stage}, still to compute")
        self.stage = stage


class Unknown:
    """The result of a planned stage still to compute: reading it raises `Pending`."""

    def __init__(self, stage: str):
        self.stage = stage

    def __getitem__(self, key: Any) -> Any:
        raise Pending(self.stage)

    def get(self, *args: Any) -> Any:
        raise Pending(self.stage)

    def __iter__(self):
        raise Pending(self.stage)


@dataclass
class PlannedStage:
    """One stage of a plan: its key (None while its inputs read a stage still to compute, named in ``after``),
    whether its record is saved under that key, and what it cost when the committed results were made."""

    name: str
    key: Optional[str]
    cached: bool
    after: str = ""
    committed_seconds: Optional[float] = None
    committed_key: Optional[str] = None

    @property
    def same_as_committed(self) -> Optional[bool]:
        """Whether the committed results' record of this stage had the same key (None: unknown)."""
        if self.key is None or self.committed_key is None:
            return None
        return self.key == self.committed_key


@dataclass
class StageCache:
    """``<run>/stages/<name>.json``: a stage is reused only when its key matches.

    ``name`` is ``kind`` or ``kind:model`` (file ``kind__<label(model)>.json``)."""

    root: Path
    records: dict[str, StageRecord] = field(default_factory=dict)
    planning: bool = False  # note each stage as cached or to compute; compute nothing
    planned: list[PlannedStage] = field(default_factory=list)
    #: A wall-clock time (``time.time()``): a record saved since then was computed by this run's worker processes,
    #: so it is reported as computed, not as reused from the cache.
    computed_since: Optional[float] = None

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
        if self.planning:
            hit = saved is not None and saved["key"] == key
            self._note(PlannedStage(name, key, hit))
            return (
                StageRecord(name, key, saved["result"], saved["seconds"], True)
                if hit
                else StageRecord(name, key, Unknown(name), float("nan"), False)
            )
        if saved is not None:
            if saved["key"] == key:
                reused = self.computed_since is None or path.stat().st_mtime < self.computed_since
                cpu, finished = saved.get("cpu_seconds"), saved.get("finished")
                return self._keep(StageRecord(name, key, saved["result"], saved["seconds"], reused, cpu, finished))
            log.info("stage %s: inputs changed, recomputing", name)
        t0, c0 = time.perf_counter(), time.process_time()
        result = compute()
        seconds, cpu, finished = time.perf_counter() - t0, time.process_time() - c0, time.time()
        record = {"name": name, "key": key, "inputs": inputs, "seconds": seconds, "cpu_seconds": cpu}
        write_json(path, {**record, "finished": finished, "result": result})
        return self._keep(StageRecord(name, key, result, seconds, False, cpu, finished))

    def ready(self, name: str, inputs: dict) -> bool:
        """Whether stage ``name`` is saved under the key of ``inputs`` (e.g. by another process); a record
        saved under other inputs is not."""
        saved = _saved(self.path(name), name)
        return saved is not None and saved["key"] == key_hash(inputs)

    def pending(self, name: str, after: str) -> None:
        """Plan stage ``name``, whose inputs read the result of ``after`` (still to compute): key unknown."""
        self._note(PlannedStage(name, None, False, after))

    def _note(self, planned: PlannedStage) -> None:
        if all(p.name != planned.name for p in self.planned):
            self.planned.append(planned)

    def _keep(self, rec: StageRecord) -> StageRecord:
        """Record a stage that ended, and say so in one line (stderr off a terminal, else the log); a stage read
        again from the cache under the same key says nothing (a process waiting on the others' stages reads
        theirs at every poll)."""
        seen = self.records.get(rec.name)
        self.records[rec.name] = rec
        if rec.cached and seen is not None and seen.key == rec.key:
            return rec
        line = rec.line()
        if not note(line):
            log.info("%s", line)
        return rec

    def summary(self) -> dict[str, dict]:
        """Per stage run so far: key, wall and CPU seconds, when it was written, and whether it came from the
        cache (for a run manifest)."""
        return {
            n: {
                "key": r.key,
                "seconds": r.seconds,
                "cpu_seconds": r.cpu_seconds,
                "finished": r.finished,
                "cached": r.cached,
            }
            for n, r in self.records.items()
        }


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
