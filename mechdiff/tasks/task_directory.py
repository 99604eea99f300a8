"""A task directory read back (`mechdiff.tasks.jsonl` writes it; `mechdiff.tasks.base.directory_task` makes it a
`Task`): its checked ``task.json`` and its pairs, with the prompt sets a study drew from them and each declared
desideratum's pairs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from .jsonl import FORMAT, ITEMS_FILE, PAIRS_FILE, TASK_FILE, tokenizer_digest
from .prompt_sets import clean_key
from .records import Example, Pair

log = logging.getLogger(__name__)


@dataclass
class ImportedTask:
    """The pairs of a task directory, after checking the asking tokenizer: a named prompt set's rows where the
    study drew its sets (``sets``: name -> row indices, `draw_sets`), else the
    first rows in file order."""

    directory: Path
    meta: dict
    pairs: list[Pair]
    sets: Optional[dict[str, list[int]]] = None
    #: Each declared DCM desideratum's pairs, one a row (`mechdiff.tasks.declared`).
    desiderata: dict[str, list[Pair]] = field(default_factory=dict)

    def _check(self, tokenizer: Any) -> None:
        if tokenizer is not None and tokenizer_digest(tokenizer) != self.meta["tokenizer"]:
            raise ValueError(
                f"task {self.directory} was imported for another tokenizer (model "
                f"{self.meta.get('model') or '?'}); import it again with --model for this model"
            )

    def rows(self, tokenizer: Any, n: int, prompt_set: Optional[str] = None) -> list[int]:
        """``n`` row indices: the first of the set ``prompt_set`` where sets were drawn, else the file's first."""
        self._check(tokenizer)
        if n < 1:
            raise ValueError("n must be at least 1")
        rows = list(range(len(self.pairs)))
        if self.sets is not None and prompt_set is not None:
            if prompt_set not in self.sets:
                raise ValueError(f"no prompt set {prompt_set!r} was drawn; the study drew {', '.join(self.sets)}")
            rows = self.sets[prompt_set]
        if n > len(rows):
            log.info("task %s: %d rows to draw from; using all of them (asked for %d)", self.directory, len(rows), n)
        return rows[:n]

    def take(self, tokenizer: Any, n: int, prompt_set: Optional[str] = None) -> list[Pair]:
        """``n`` pairs of the rows `rows` gives."""
        return [self.pairs[i] for i in self.rows(tokenizer, n, prompt_set)]

    @property
    def item_keys(self) -> tuple:
        """Each row's item: its value of the task's ``item`` field (`ITEMS_FILE`), else its clean prompt."""
        if self.meta.get("item"):
            keys = tuple((self.directory / ITEMS_FILE).read_text(encoding="utf-8").splitlines())
            if len(keys) != len(self.pairs):
                raise ValueError(
                    f"{self.directory / ITEMS_FILE} holds {len(keys)} items for {len(self.pairs)} rows; import the "
                    "task again"
                )
            return keys
        return tuple(clean_key(p) for p in self.pairs)

    @property
    def strata(self) -> tuple[tuple[str, int], ...]:
        """Each row's group: (template, token length), the unit prompt sets are stratified by."""
        return tuple((p.base.template, len(p.base.input_ids)) for p in self.pairs)

    @property
    def plan(self) -> Optional[Path]:
        """The plan imported with the pairs, if any."""
        return self.directory / self.meta["plan"] if self.meta.get("plan") else None

    @property
    def rows_digest(self) -> str:
        """16 hex digits of the SHA-256 of the imported records (``pairs.jsonl``, then each declared desideratum's
        pairs file): other rows, other digest."""
        digest = hashlib.sha256((self.directory / PAIRS_FILE).read_bytes())
        for d in (self.meta.get("desiderata") or {}).values():
            if d.get("pairs"):
                digest.update((self.directory / d["pairs"]).read_bytes())
        if self.meta.get("item"):  # the rows' items decide which rows a set draws
            digest.update((self.directory / ITEMS_FILE).read_bytes())
        return digest.hexdigest()[:16]

    def examples(self, tokenizer: Any, n: int, seed: int = 0, prompt_set: Optional[str] = None) -> list[Example]:
        """``n`` clean prompts of the set ``prompt_set`` (``seed`` is unused: the drawn sets fix the rows)."""
        return [p.base for p in self.take(tokenizer, n, prompt_set)]

    def discovery_pairs(self, tokenizer: Any, n: int, seed: int = 0, prompt_set: Optional[str] = None) -> list[Pair]:
        """``n`` pairs of the set ``prompt_set``, target the clean answer."""
        return self.take(tokenizer, n, prompt_set)

    def reference(self, tokenizer: Any, n: int, seed: int = 0, prompt_set: Optional[str] = None) -> list[Example]:
        """``n`` counterfactual prompts of the set ``prompt_set`` (the mean-ablation reference)."""
        return [p.source for p in self.take(tokenizer, n, prompt_set)]

    def desideratum(self, name: str) -> Callable[..., list[Pair]]:
        """The pair generator of desideratum ``name``: its pairs of the rows of the set ``prompt_set`` (DCM's)."""
        pairs = self.desiderata[name]

        def generate(tokenizer: Any, n: int, seed: int = 0, prompt_set: Optional[str] = None) -> list[Pair]:
            return [pairs[i] for i in self.rows(tokenizer, n, prompt_set)]

        return generate


def load_task_meta(directory: str | os.PathLike) -> dict:
    """``task.json`` of a task directory (checked)."""
    meta_path = Path(directory) / TASK_FILE
    if not meta_path.is_file():
        raise FileNotFoundError(
            f"{directory} is not a task directory (no {TASK_FILE}); "
            "write one with `mechdiff dataset import PAIRS.jsonl --model M --out DIR`"
        )
    meta = json.loads(meta_path.read_text(encoding="utf-8"))
    if meta.get("format") != FORMAT:
        raise ValueError(f"{meta_path}: format {meta.get('format')!r} is not {FORMAT!r}; import the pairs again")
    return meta


def read_task_directory(directory: str | os.PathLike) -> ImportedTask:
    """The pairs of a directory written by `import_pairs`."""
    directory = Path(directory)
    meta = load_task_meta(directory)
    lines = (directory / PAIRS_FILE).read_text(encoding="utf-8").splitlines()
    pairs = []
    for line in lines:
        d = json.loads(line)
        d.pop("type", None)
        pairs.append(Pair.from_dict(d))
    from .declared import read_desiderata

    return ImportedTask(directory, meta, pairs, desiderata=read_desiderata(directory, meta, pairs))
