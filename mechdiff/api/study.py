"""A study as an object (`Study`): built from keyword sections or a task file, planned (`Plan`), run, serialised
back to a task file. A task file and a `Study` are two spellings of one thing: keyword ``eval={"n": 40}`` is
the file's ``[eval] n = 40``, checked by the same loader (`mechdiff.studies.circuits.spec.load_spec`, or the kind's
own) with the same messages, and `Study.run` is ``mechdiff run``'s study (`mechdiff.studies.base.load_study` and
`mechdiff.studies.base.plan_then_run`): the same stages, keys, cache and files."""

from __future__ import annotations

import json
import math
import os
import re
import tempfile
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Sequence, Union

import pandas as pd

from ..models.modelset import ModelSet
from ..runs.stages import PlannedStage
from ..studies.base import Study as StudyKind
from ..studies.base import load_study, plan_text, plan_then_run, study_kind
from ..studies.circuits.spec import RunSpec, load_spec
from ..studies.planner import Placement, study_resources
from ..studies.spec import read_task_file
from ..tasks.base import Task
from .results import Results

__all__ = ["Study", "Plan", "toml_text"]

#: What ``task=`` takes: a registered name or a task directory, a `Task`, or the ``[task]`` section's fields.
TaskLike = Union[str, os.PathLike, Task, Mapping[str, Any]]
#: What ``models=`` takes: a `pair` (or `ModelSet`), the names base first, or the ``[models]`` section's fields.
ModelsLike = Union[ModelSet, Sequence[str], Mapping[str, Any]]
#: How a study built from keywords names itself in its errors and its report.
KEYWORDS_SOURCE = "md.Study"
#: The ``[models]`` fields a `pair`'s load options carry into a study.
LOAD_FIELDS = ("dtype", "device", "device_map", "remote")


class Study:
    """One study: its task, its models and every section of its task file, checked before anything loads.

    ``Study(task="ioi", models=md.pair("smollm2-135m", "smollm2-et"), out="results/x", eval={"n": 40})`` is the
    task file ``[task] name = "ioi"``, ``[models] base = ... finetunes = [...]``, ``[output] dir = "results/x"``
    and ``[eval] n = 40``: each keyword section is a dict of that section's fields (docs/your-own-task.md lists
    them; ``study={"kind": "knowledge"}`` picks another kind), and a bad field is refused with the message the
    same field gets in a file. ``progress``: progress bars while it runs."""

    def __init__(
        self,
        task: Optional[TaskLike] = None,
        models: Optional[ModelsLike] = None,
        out: str | os.PathLike = "",
        *,
        progress: bool = True,
        **sections: Mapping[str, Any],
    ):
        raw = {name: _section_dict(name, values) for name, values in sections.items()}
        if task is not None:
            raw["task"] = {**raw.get("task", {}), **_task_fields(task)}
        if models is not None:
            raw["models"] = {**raw.get("models", {}), **_model_fields(models)}
        if out:
            raw["output"] = {**raw.get("output", {}), "dir": str(out)}
        self._init(raw, None, progress)

    def _init(self, raw: dict[str, dict[str, Any]], path: Optional[Path], progress: bool) -> None:
        self._raw, self._path, self.progress = raw, path, progress
        with self._file() as file:
            self.kind = study_kind(file)
            self._spec = load_spec(file) if self.kind == "circuits" else None
            self._other = None if self._spec is not None else load_study(file, progress=progress)

    @classmethod
    def from_file(cls, path: str | os.PathLike, progress: bool = True) -> "Study":
        """The study of the task file ``path`` (any kind), checked as ``mechdiff run`` checks it."""
        study = cls.__new__(cls)
        study._init(read_task_file(Path(path))[1], Path(path), progress)
        return study

    @property
    def spec(self) -> Optional[RunSpec]:
        """A circuits study's every section, defaults filled in (None for the other kinds)."""
        return self._spec

    @property
    def source(self) -> str:
        """The task file the study was read from, or ``md.Study`` for one built from keywords."""
        return str(self._path) if self._path is not None else KEYWORDS_SOURCE

    @property
    def out(self) -> Path:
        """The results directory."""
        return Path(self._spec.output.dir) if self._spec is not None else self._inner().dir

    def __repr__(self) -> str:
        if self._spec is None:
            return f"Study({self.kind}, from {self.source}, out={str(self.out)!r})"
        models = ", ".join(self._spec.model_names)
        return f"Study(task={self._spec.task.name!r}, models=[{models}], out={str(self.out)!r})"

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """The sections and fields the study sets (a file's own, or the keywords), as the task file spells them."""
        copied: dict[str, dict[str, Any]] = json.loads(json.dumps(self._raw))
        return copied

    def to_toml(self, path: Optional[str | os.PathLike] = None) -> str:
        """The study as a task file (`to_dict` in TOML); written to ``path`` where given. ``mechdiff run`` on that
        file runs this study, and `from_file` reads it back to an equal one."""
        text = toml_text(self._raw)
        if path is not None:
            Path(path).write_text(text, encoding="utf-8")
        return text

    @contextmanager
    def _file(self) -> Iterator[Path]:
        """The study's task file: the one it was read from, else its keywords written to a temporary one, whose
        name the loader's messages then give as ``md.Study`` (a field's line there means nothing to the caller)."""
        if self._path is not None:
            yield self._path
            return
        with tempfile.TemporaryDirectory(prefix="mechdiff-study-") as tmp:
            file = Path(tmp) / "study.toml"
            file.write_text(toml_text(self._raw), encoding="utf-8")
            try:
                yield file
            except ValueError as err:  # SpecError among them
                if str(file) not in str(err):
                    raise
                raise type(err)(_keyword_message(str(err), file)) from None

    def _inner(self) -> StudyKind:
        """The study of the kind the sections give, as ``mechdiff run`` builds it (`load_study`); built anew for
        each plan or run of a circuits study (weights checked then, not before), once for the other kinds."""
        if self._other is not None:
            return self._other
        with self._file() as file:
            inner = load_study(file, progress=self.progress)
        inner.spec.source = self.source  # type: ignore[attr-defined]  # what the report names, not a temp file
        return inner

    def plan(self) -> "Plan":
        """What ``mechdiff run --plan`` prints (without ``--plan-device``), as an object: each stage with its key,
        whether it is cached and what it cost in the committed ``run.json``, and its predicted memory and time on
        this machine (a one-process run; every study kind: `study_resources`). Computes nothing."""
        from ..models.weights import check_weights

        with self._file() as file:
            here = study_resources(str(file))[0]  # every kind's stages, predicted on this machine
        resources: list[Placement] = here.placements
        lines = [here.format(), ""]
        try:
            check_weights(here.inputs.models, remote=here.inputs.remote)
        except FileNotFoundError as err:
            lines.append(f"stage cache not read (the resource plan above needs only configs): {err}")
            return Plan(self.kind, self.out, [], resources, "\n".join(lines))
        inner = self._inner()
        stages = inner.plan()
        lines += [f"{inner.kind} study into {inner.dir}:", plan_text(inner, stages)]
        return Plan(self.kind, inner.dir, stages, resources, "\n".join(lines))

    def run(self, force: bool = False) -> Results:
        """Every stage not cached, then ``run.json``, the tables, figures and report, as ``mechdiff run
        --workers 1`` (one process: `plan_then_run`, which prints the plan and each stage's time); returns the
        `Results`. A directory holding another study's results is refused unless ``force``."""
        inner = self._inner()
        plan_then_run(inner, force=force)
        return Results(inner.dir)

    def results(self) -> Results:
        """The results already in the study's directory (a run's, or committed ones)."""
        return Results(self.out)


@dataclass
class Plan:
    """A study's plan (`Study.plan`): ``stages``, each a `mechdiff.runs.stages.PlannedStage` (key, cached, the
    committed run's seconds and key), and ``resources``, each stage's predicted
    `mechdiff.studies.planner.Placement` on this machine. ``str(plan)`` is the text ``mechdiff run --plan``
    prints."""

    kind: str
    out: Path
    stages: list[PlannedStage] = field(default_factory=list)
    resources: list[Placement] = field(default_factory=list)
    text: str = ""

    def __str__(self) -> str:
        return self.text

    def to_frame(self) -> pd.DataFrame:
        """One row a stage: ``stage``, ``cached``, ``key``, ``after``, ``committed_seconds``, ``same_as_committed``
        and, where predicted, ``models``, ``n``, ``batch``, ``pflop``, ``host_gib``, ``device_gib``, ``disk_gib``,
        ``seconds`` and ``fits`` on this machine (GiB: 2**30 bytes)."""
        rows: dict[str, dict[str, Any]] = {}
        for s in self.stages:
            rows[s.name] = {
                "stage": s.name,
                "cached": s.cached,
                "key": s.key,
                "after": s.after,
                "committed_seconds": s.committed_seconds,
                "same_as_committed": s.same_as_committed,
            }
        for p in self.resources:
            c, gib = p.cost, 2.0**30
            rows.setdefault(c.stage, {"stage": c.stage}).update(
                models=c.models,
                n=c.n,
                batch=c.batch,
                pflop=c.flops / 1e15,
                host_gib=c.host_peak(p.device) / gib,
                device_gib=c.device_peak(p.device) / gib if p.device.gpu else None,
                disk_gib=c.disk / gib,
                seconds=p.seconds,
                fits=p.fits,
            )
        return pd.DataFrame(list(rows.values()))


def _section_dict(name: str, values: Any) -> dict[str, Any]:
    """A keyword section as a dict of its fields; anything else refused naming the section."""
    if not isinstance(values, Mapping):
        raise TypeError(
            f"{name}= is the [{name}] section of the task file: give a dict of its fields, e.g. {name}={{...}}"
        )
    return dict(values)


def _task_fields(task: TaskLike) -> dict[str, Any]:
    """The ``[task]`` fields ``task=`` gives: a name or directory, a `Task` (an imported one by its directory), or
    the fields themselves."""
    if isinstance(task, Task):
        return {"name": task.source or task.name}
    if isinstance(task, (str, os.PathLike)):
        return {"name": os.fspath(task)}
    return _section_dict("task", task)


def _model_fields(models: ModelsLike) -> dict[str, Any]:
    """The ``[models]`` fields ``models=`` gives: a `ModelSet`'s names (base first) and load options, a list of
    names, or the fields themselves."""
    if isinstance(models, ModelSet):
        names = models.names
        load = {k: v for k, v in models.load_kwargs.items() if k in LOAD_FIELDS and v is not None}
        return {"base": names[0], "finetunes": names[1:], **load}
    if isinstance(models, Mapping):
        return dict(models)
    if isinstance(models, str) or not all(isinstance(m, str) for m in models) or len(models) < 2:
        raise TypeError("models= takes md.pair(base, finetune), a list of names (base first) or a dict of [models]")
    return {"base": models[0], "finetunes": list(models[1:])}


def _keyword_message(message: str, file: Path) -> str:
    """A loader's message about the temporary task file as one about the keywords: ``FILE:LINE: what`` becomes
    ``md.Study: what``."""
    located = re.sub(rf"{re.escape(str(file))}(:\d+)?: ", f"{KEYWORDS_SOURCE}: ", message)
    return located.replace(str(file), KEYWORDS_SOURCE)


# -------------------------------------------------------------------------------------------- TOML out


def toml_text(raw: Mapping[str, Mapping[str, Any]]) -> str:
    """Sections of fields as a task file: ``[section]`` then ``key = value`` a line (inline tables for dicts);
    a None field is left out (TOML has no null; every such field defaults to None)."""
    lines = []
    for section, values in raw.items():
        lines.append(f"[{_toml_key(section)}]")
        for key, value in _section_dict(section, values).items():
            if value is not None:
                lines.append(f"{_toml_key(key)} = {_toml_value(value, f'[{section}] {key}')}")
        lines.append("")
    return "\n".join(lines)


def _toml_key(key: str) -> str:
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", str(key)) else json.dumps(str(key))


def _toml_value(value: Any, where: str) -> str:
    """One value in TOML: strings, booleans, numbers, lists and inline tables."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isfinite(value):
            return repr(value)
        return "nan" if math.isnan(value) else ("-inf" if value < 0 else "inf")
    if isinstance(value, (str, os.PathLike)):
        return json.dumps(os.fspath(value), ensure_ascii=False)
    if isinstance(value, Mapping):
        return "{ " + ", ".join(f"{_toml_key(k)} = {_toml_value(v, where)}" for k, v in value.items()) + " }"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v, where) for v in value) + "]"
    raise TypeError(f"{where} = {value!r}: give a string, number, boolean, list or dict (a task file's TOML values)")
