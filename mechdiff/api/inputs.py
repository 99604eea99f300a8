"""What a study compares and on what: models (`pair`, `load_model`), tasks (`task`, `import_rows`) and a string's
tokens (`tokens`), each the function the commands call (``mechdiff dataset import``, ``mechdiff tokens``)."""

from __future__ import annotations

import json
import os
import re
import tempfile
import warnings
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

from ..models.loading import load_model, load_tokenizer
from ..models.modelset import ModelSet
from ..models.resolve import resolve_spec
from ..models.tokenization import Token, tokens
from ..tasks.base import Task, get_task
from ..tasks.jsonl import import_pairs
from ..tasks.row_checks import ImportErrors

__all__ = ["pair", "load_model", "task", "import_rows", "tokens", "Token"]

#: Where `import_rows` writes a task's directory when given no ``out``: ``tasks/<name>`` under the working directory.
TASKS_DIR = "tasks"


def pair(base: str, other: str, *more: str, **load: Any) -> ModelSet:
    """A base model and its fine-tune(s), checked as one set before any weights load (configs, shapes and
    vocabularies agree); each model loads on first use, ``pair[name]``.

    Each of ``base``, ``other`` and ``more`` is anything `load_model` takes: a registry name (``mechdiff
    models``), a hub id, a local directory, a GGUF file or a LoRA adapter. ``load``: `load_model`'s keywords
    (``dtype``, ``device``, ``device_map``, ``remote``, ``cache_dir``)."""
    return ModelSet([base, other, *more], **load)


def task(name: str | os.PathLike) -> Task:
    """The task ``name``: a registered one (``entity-tracking``, ``ioi``, ...; `mechdiff tasks`), a knowledge
    relation, or a task directory (``mechdiff dataset import`` or `import_rows` wrote it). An unknown name is
    refused naming the known ones."""
    return get_task(name)


def import_rows(
    rows: Sequence[Mapping[str, Any]],
    model: str,
    name: str = "",
    out: str | os.PathLike = "",
    metric: str = "prob",
    desiderata: Sequence[str] = (),
    item: Optional[str] = None,
    plan: Optional[str | os.PathLike] = None,
    force: bool = False,
) -> Task:
    """A task from rows in memory, with every check of ``mechdiff dataset import`` (every problem of every bad row
    reported at once, ``rows[i]: ...``), written to the task directory ``out`` (default ``tasks/<name>``) that a
    study names; returns its `Task`.

    Each row is a dict as a line of the import's JSONL file: ``clean``, ``counterfactual``, ``answer``, optional
    ``counterfactual_answer``, ``positions`` (name -> ``[start, end]`` character spans) and so on
    (docs/your-own-task.md). ``model``: whose tokenizer the spans and answers are checked against. ``metric``:
    ``prob`` or ``logit_diff``; ``desiderata``: ``NAME=COLUMN`` each; ``item``: the row key whose value is a row's
    item; ``plan``: a discovery plan TOML; ``force``: replace an existing directory. The rows are kept beside the
    directory as ``<out>.jsonl`` (``mechdiff dataset import`` imports them again). A warning the import prints (an
    answer that splits a word, an empty class) is a `UserWarning`."""
    if not name and not out:
        raise ValueError("give the task a name (its directory is then tasks/<name>) or its directory as out=")
    directory = Path(out or Path(TASKS_DIR) / name)
    if directory.exists() and not force:
        raise ValueError(f"{directory} exists; give another out= (or name=), or force=True to replace it")
    rows_file = directory.with_name(f"{directory.name}.jsonl")
    directory.parent.mkdir(parents=True, exist_ok=True)
    _write_rows(rows, rows_file)
    try:
        import_pairs(
            rows_file,
            load_tokenizer(resolve_spec(model)),
            directory,
            model=model,
            name=name or None,
            plan=plan,
            metric=metric,
            force=force,
            desiderata=desiderata,
            item=item,
            warn=lambda line: warnings.warn(line, UserWarning, stacklevel=4),
        )
    except ImportErrors as err:
        rows_file.unlink()
        lines = [_by_row(line, rows_file) for line in err.lines]
        message = f"{len(lines)} problem(s) in the rows; nothing was written:\n" + "\n".join(lines)
        raise ImportErrors(message, lines) from None
    except BaseException:
        rows_file.unlink()
        raise
    return get_task(directory)


def _write_rows(rows: Sequence[Mapping[str, Any]], path: Path) -> None:
    """The rows as the import's JSONL file, one object a line; a row that is not a dict is refused by its index."""
    if isinstance(rows, (str, bytes)) or not isinstance(rows, Sequence):
        raise TypeError(f"rows must be a list of dicts, got {type(rows).__name__}")
    bad = [i for i, r in enumerate(rows) if not isinstance(r, Mapping)]
    if bad:
        raise TypeError(f"rows {bad[:10]} are not dicts; each row is a dict as one line of the import's JSONL file")
    with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".jsonl", delete=False, encoding="utf-8") as f:
        f.write("".join(json.dumps(dict(r), ensure_ascii=False) + "\n" for r in rows))
    os.replace(f.name, path)


def _by_row(line: str, path: Path) -> str:
    """An import problem ``FILE:LINE: what`` as ``rows[LINE - 1]: what`` (the row's index in the list given)."""
    m = re.match(rf"{re.escape(str(path))}:(\d+): ", line)
    return f"rows[{int(m.group(1)) - 1}]: {line[m.end() :]}" if m else line.replace(str(path), "the rows")
