"""The task protocol: what the engine reads from any task's records, the :class:`Task` every command sees,
and the one task registry.

Records, pairs, batching and hashing are defined in :mod:`mechdiff.tasks.records` and re-exported here:
import them from this module. A *record* is one prompt with its answer token and named token positions
(a single index, or a tuple: a position class); a *pair* is a clean record, a counterfactual record of the
same token length and the target answer. Records of several lengths and templates are batched by
:func:`grouped_batches` (one batch per template and length, no padding); every batch carries position
classes (the record type's own, the record's ``classes``, else :func:`derived_classes`).

The engine (patching, discovery, scoring, DCM, CMAP, the store) touches records only through
:func:`grouped_batches`, :func:`batch_tensors`, :func:`pair_batch_tensors` and :func:`dataset_hash`, and tasks
only through :class:`Task` objects found by :func:`get_task`: a registered name (:data:`TASKS`), a knowledge
relation (``country_capital``, :mod:`mechdiff.tasks.relations`) or a directory written by
``mechdiff dataset import`` (:mod:`mechdiff.tasks.jsonl`).
"""

from __future__ import annotations

import difflib
import importlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from ..common.metrics import TASK_METRICS
from .jsonl import read_task_directory
from .records import (  # noqa: F401
    AFTER,
    BEFORE,
    LAST,
    Batch,
    Example,
    GroupKey,
    Pair,
    PairRecord,
    Position,
    Record,
    answer_batch,
    batch_tensors,
    canonical_json,
    check_pair,
    check_reference,
    dataset_hash,
    derived_class_names,
    derived_classes,
    group_batches,
    group_key,
    group_name,
    grouped_batches,
    is_pair,
    own_classes,
    pair_batch_tensors,
    record_dict,
    record_order,
    take,
    template_of,
)
from .relation_data import available_relations


def step_seed(data_seed: int, step: int) -> int:
    """The data seed of training step ``step`` (distinct from every validation seed)."""
    return data_seed * 1_000_003 + step


Generator = Callable[..., list]  # (tokenizer, n, seed=...) -> records or pairs
#: The named splits of a task's objects: held out from every fine-tune (``eval``), the fine-tunes' (``train``),
#: all of them. A task that splits its objects maps each to generator options (:meth:`Task.split_options`).
SPLITS = ("eval", "train", "all")


@dataclass(frozen=True)
class Task:
    """A task as every command sees it.

    ``examples(tokenizer, n, seed)``: evaluation records. ``pairs(tokenizer, n, seed)``: the
    counterfactual pairs discovery patches from. ``reference(tokenizer, n, seed)``: the prompts
    whose mean activations replace ablated heads. ``desiderata``: name -> pair generator (DCM).
    ``plan``: the discovery plan file (:mod:`mechdiff.tasks.plan`). ``metric``: ``prob`` or
    ``logit_diff``. ``train_batch(tokenizer, batch_size, data_seed, step, **options)``,
    ``eval_batch(tokenizer, n, seed)`` (held out) and ``pool_batch(tokenizer, n, seed)`` (HeadMap's
    locating pool): ``{"input_ids", "answer_ids"}`` batches for fine-tuning and HeadMap (tasks
    without them cannot be trained on). ``options``: extra keyword arguments the generators accept
    (entity tracking: ``n_boxes``, ``vocabulary``, ``letters``). ``splits(split)``: the generator options
    of one of :data:`SPLITS` (entity tracking: ``{"vocabulary": objects}``); none for a task without splits.
    """

    name: str
    description: str
    examples: Generator
    pairs: Optional[Generator] = None
    reference: Optional[Generator] = None
    desiderata: Mapping[str, Generator] = field(default_factory=dict)
    plan: Optional[Path] = None
    metric: str = "prob"
    positions: tuple[str, ...] = ()
    group_names: Mapping[str, str] = field(default_factory=dict)
    train_batch: Optional[Callable[..., Batch]] = None
    eval_batch: Optional[Callable[..., Batch]] = None
    pool_batch: Optional[Callable[..., Batch]] = None
    options: tuple[str, ...] = ()
    splits: Optional[Callable[[str], Mapping[str, Any]]] = None
    #: The digest of the rows an imported task holds (its ``pairs.jsonl``); None for a task that generates its
    #: prompts. Stage keys carry it, so rows imported again with other content recompute every stage.
    rows_digest: Optional[str] = None

    def __post_init__(self) -> None:
        if self.metric not in TASK_METRICS:
            raise ValueError(
                f"task {self.name}: unknown metric {self.metric!r}; choose one of {', '.join(TASK_METRICS)}"
            )

    def kwargs(self, **given: Any) -> dict[str, Any]:
        """The options among ``given`` this task's generators accept (``None`` values dropped)."""
        return {k: v for k, v in given.items() if k in self.options and v is not None}

    def split_options(self, split: str) -> dict[str, Any]:
        """The generator options of the objects of ``split`` (one of :data:`SPLITS`); ``{}`` where the task does
        not split its objects."""
        if split not in SPLITS:
            raise ValueError(f"unknown split {split!r}; choose one of {', '.join(SPLITS)}")
        return dict(self.splits(split)) if self.splits is not None else {}

    def discovery_pairs(self, tokenizer: Any, n: int, seed: int = 0, **options: Any) -> list:
        if self.pairs is None:
            raise ValueError(f"task {self.name} has no counterfactual pairs; discovery needs them")
        return self.pairs(tokenizer, n, seed=seed, **self.kwargs(**options))

    def records(self, tokenizer: Any, n: int, seed: int = 0, **options: Any) -> list:
        return self.examples(tokenizer, n, seed=seed, **self.kwargs(**options))

    def reference_records(self, tokenizer: Any, n: int, seed: int = 0, **options: Any) -> list:
        """The ablation reference set (default: the counterfactual prompts of the discovery pairs)."""
        if self.reference is not None:
            return self.reference(tokenizer, n, seed=seed, **self.kwargs(**options))
        return [p.source for p in self.discovery_pairs(tokenizer, n, seed, **options)]

    def desideratum(self, name: str, tokenizer: Any, n: int, seed: int = 0, **options: Any) -> list:
        if name not in self.desiderata:
            raise ValueError(
                f"task {self.name} has no desideratum {name!r}; it has {sorted(self.desiderata) or 'none'}"
            )
        return self.desiderata[name](tokenizer, n, seed=seed, **self.kwargs(**options))


#: name -> "module:attribute" of a :class:`Task`; imported on first use, so this module imports no task.
TASKS: dict[str, str] = {
    "entity-tracking": "mechdiff.tasks.entity_tracking:TASK",
    "ioi": "mechdiff.tasks.ioi:TASK",
    "arithmetic": "mechdiff.tasks.arithmetic:TASK",
    "multiple-choice": "mechdiff.tasks.multiple_choice:TASK",
    "fact-edit": "mechdiff.tasks.fact_edit:TASK",
}
#: Old names kept working.
ALIASES: dict[str, str] = {"arithmetic-mc": "multiple-choice", "entity_tracking": "entity-tracking"}
#: Every knowledge relation (:func:`~mechdiff.tasks.relation_data.available_relations`, e.g. ``country_capital``) is a
#: task by its name, built on first use by this "module:function" from the relation's name.
RELATION_TASK = "mechdiff.tasks.relations:relation_task"


def task_names(include_aliases: bool = True, include_relations: bool = True) -> list[str]:
    """Every registered task name (and the aliases, and the knowledge relations)."""
    return [*TASKS, *(ALIASES if include_aliases else ()), *(available_relations() if include_relations else ())]


def is_registered(name: str) -> bool:
    """True for a registered task, an alias or a knowledge relation (not a task directory)."""
    return name in TASKS or name in ALIASES or name in available_relations()


def trainable_tasks() -> list[str]:
    """Registered tasks with training batches (fine-tuning, HeadMap), and their aliases."""
    names = [n for n in TASKS if get_task(n).train_batch is not None]
    return names + [a for a, n in ALIASES.items() if n in names]


def known_tasks(name: str) -> str:
    """The names a task name may take (the registered tasks, the knowledge relations), nearest to ``name`` first."""
    near = difflib.get_close_matches(name, task_names(), n=1)
    return (
        f"{f'did you mean {near[0]}? ' if near else ''}registered tasks: "
        f"{', '.join(task_names(include_relations=False))}; knowledge relations: "
        f"{', '.join(available_relations())}; a relation JSON file; or a directory written by `mechdiff dataset import`"
    )


def canonical_name(name: str) -> str:
    """The registry name of ``name`` (aliases resolved); raises on an unknown name."""
    key = ALIASES.get(name, name)
    if not is_registered(key):
        raise ValueError(f"unknown task {name!r}; {known_tasks(name)}")
    return key


def get_task(name: str | os.PathLike) -> Task:
    """The task registered as ``name`` (or an alias), the knowledge relation ``name`` (or a relation JSON file),
    or the task in a directory written by ``mechdiff dataset import``. An unknown name is refused, naming the
    known ones, before anything loads."""
    if is_relation_file(name):
        return _relation(str(name))
    if isinstance(name, os.PathLike) or (isinstance(name, str) and not is_registered(name) and Path(name).is_dir()):
        return directory_task(name)
    key = canonical_name(str(name))
    if key in TASKS:
        module, attr = TASKS[key].split(":")
        return getattr(importlib.import_module(module), attr)
    return _relation(key)


def is_relation_file(name: str | os.PathLike) -> bool:
    """True for a path to a relation JSON file in the LRE format (:mod:`mechdiff.tasks.relation_data`)."""
    return str(name).endswith(".json") and Path(name).is_file()


def _relation(name: str) -> Task:
    module, attr = RELATION_TASK.split(":")
    return getattr(importlib.import_module(module), attr)(name)


def directory_task(directory: str | os.PathLike) -> Task:
    """The :class:`Task` of a directory written by ``mechdiff dataset import``: its pairs in file order (checked
    against the asking tokenizer); the ``counterfactual`` desideratum where every row gave a counterfactual answer."""
    imported = read_task_directory(directory)
    meta = imported.meta
    desiderata = {"counterfactual": imported.counterfactual_pairs} if imported.has_counterfactual_answers else {}
    return Task(
        name=meta["name"],
        description=f"imported from {meta['source']}",
        examples=imported.examples,
        pairs=imported.discovery_pairs,
        reference=imported.reference,
        desiderata=desiderata,
        plan=imported.plan,
        metric=meta["metric"],
        positions=tuple(meta["positions"]),
        rows_digest=imported.rows_digest,
    )
