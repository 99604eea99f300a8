"""What every study shares, whatever its kind: a task file, a run directory, the one stage cache
(`StageCache`), the run lock, the manifest (``run.json``), how models load,
and the plan a run prints before it starts.

A study kind is a subclass of `Study` registered in `KINDS` under the name a task file gives as
``[study] kind`` (default ``"circuits"``). It says how its task file is read (`Study.from_file`), runs
its stages through ``self.cache`` (`Study.stages`) and writes its report from their records
(`Study.write`). `Study.plan` walks the same stages with the cache in planning mode, so the plan
names exactly the stages, keys and cache hits a run would have; ``mechdiff run TASKFILE`` prints it first.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import platform
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import Any, Callable, ClassVar, Optional

from ..common.io import check_writable, run_lock, write_json
from ..runs.stages import Pending, PlannedStage, StageCache, key_hash
from .spec import SpecError, StudySection, line_of, load_sections, read_task_file

#: Study kinds by the name a task file's ``[study] kind`` gives: the class, as ``module:Class`` (imported when
#: asked for, so this module imports no kind).
KINDS = {
    "circuits": "mechdiff.studies.circuits.study:CircuitsStudy",
    "knowledge": "mechdiff.studies.knowledge.study:KnowledgeStudy",
    "headmap": "mechdiff.studies.headmap.study:HeadMapStudy",
    "trajectory": "mechdiff.studies.trajectory.study:TrajectoryStudy",
}
DEFAULT_KIND = StudySection.kind
#: Packages whose versions a manifest records.
PACKAGES = ("mechdiff", "torch", "transformers", "nnsight", "peft", "h5py", "scipy", "numpy")


@dataclass
class OutputDir:
    """The ``[output]`` section of the knowledge and HeadMap kinds: where the results go."""

    dir: str = ""


def study_kind(path: str | Path) -> str:
    """The ``[study] kind`` of the task file ``path`` (default ``circuits``), refused with its line when unknown."""
    path = Path(path)
    text, data = read_task_file(path)
    section = data.get("study", {})
    kind = section.get("kind", DEFAULT_KIND) if isinstance(section, dict) else None
    if kind not in KINDS:
        raise SpecError(
            f"{path}:{line_of(text, 'study', 'kind')}: kind = {kind!r} in [study]; valid values: {', '.join(KINDS)}"
        )
    return kind


def study_class(kind: str) -> type["Study"]:
    """The class of study kind ``kind`` (`KINDS`)."""
    if kind not in KINDS:
        raise ValueError(f"unknown study kind {kind!r}; the kinds are {', '.join(KINDS)}")
    module, _, name = KINDS[kind].partition(":")
    return getattr(importlib.import_module(module), name)


def load_study(path: Optional[str | Path], **options: Any) -> "Study":
    """The study of the task file ``path`` (None: the embedded default circuits study), by its kind; checked
    before any weights load. ``options``: those of `Study.from_file`."""
    kind = study_kind(path) if path is not None else DEFAULT_KIND
    return study_class(kind).from_file(path, **options)


def model_loader(**kwargs: Any) -> Callable[[str], Any]:
    """How a study loads a model by name: `mechdiff.models.loading.load_model` with ``kwargs`` (dtype,
    device, device_map, remote, cache_dir)."""
    from ..models.loading import load_model

    return lambda name: load_model(name, **{k: v for k, v in kwargs.items() if v is not None})


def load_section_file(path: str | Path, section: str, settings: type, choices: dict, example: str) -> tuple[Any, str]:
    """The ``[section]`` settings (a ``settings`` instance) and the ``[output] dir`` of the task file ``path`` of a
    kind whose file is one settings section plus ``[study]`` and ``[output]``; unknown keys, and values outside
    ``choices`` (``(section, key)`` -> allowed values), refused with their line and ``example``."""
    built = load_sections(
        path, {section: settings, "study": StudySection, "output": OutputDir}, choices=choices, example=example
    )[0]
    return built[section], built["output"].dir


def section_study(
    cls: type["Study"],
    path: Optional[str | Path],
    out: Optional[str],
    progress: bool,
    models: Optional[dict],
    task: Optional[str],
    load_file: Callable[[str | Path], tuple[Any, str]],
    title: str,
    example: str,
) -> "Study":
    """A study of a kind whose task file is one settings section plus ``[output]`` (no ``[task]``):
    ``load_file(path)`` gives the settings and the output dir; ``cls(settings, out, load, progress)``."""
    if path is None or task is not None:
        raise ValueError(
            f"a {title} study is a task file's [{cls.kind}] section ({example}); it has no [task] to override"
        )
    settings, directory = load_file(path)
    if not (out or directory):
        raise ValueError(f"{path}: give [output] dir (where the results go) or --out")
    return cls(settings, out or directory, model_loader(**(models or {})), progress)


def vocabulary_digest(task: Any) -> str:
    """The digest of the objects ``task`` (a `Task`) holds out for evaluation, its
    ``eval`` split's vocabulary, which every stage's key carries; of None for a task that does not split its
    objects, so no other task's vocabulary re-keys its stages. (Entity tracking's is the digest of
    ``eval_objects()``, as before.)"""
    return key_hash(task.split_options("eval").get("vocabulary"))


def rows_inputs(task: Any, sets: Optional[dict] = None) -> dict:
    """``{"rows": digest}`` for a task imported from rows (`rows_digest`), which
    every stage's key then carries, with a digest of the prompt sets drawn from them (``sets``: name -> rows; each
    set's rows depend on every set's size); empty for a task that generates its prompts, whose keys stay as they
    were."""
    out = {"rows": task.rows_digest} if getattr(task, "rows_digest", None) else {}
    if sets:
        out["prompt_sets"] = hashlib.sha256(json.dumps(sets, sort_keys=True).encode()).hexdigest()[:16]
    return out


def versions() -> dict[str, str]:
    """Installed versions of the packages a result depends on."""
    out = {}
    for pkg in PACKAGES:
        try:
            out[pkg] = version(pkg)
        except Exception:  # noqa: BLE001 - a missing package is reported, not fatal
            out[pkg] = "not installed"
    return out


class Study(ABC):
    """One study of one kind: its stages run into ``self.dir`` through ``self.cache``."""

    kind: ClassVar[str]
    #: The manifest's key for `settings_record`.
    settings_key: ClassVar[str] = "settings"

    def __init__(self, out: str | Path, progress: bool = True):
        self.started = time.time()
        self.progress = progress
        self.dir = check_writable(Path(out), "run directory")  # writable before anything loads or computes
        self.cache = StageCache(self.dir)

    # -- what a kind defines ------------------------------------------------------------
    @classmethod
    @abstractmethod
    def from_file(
        cls,
        path: Optional[str | Path],
        out: Optional[str] = None,
        progress: bool = True,
        models: Optional[dict] = None,
        task: Optional[str] = None,
    ) -> "Study":
        """The study of a task file; ``out`` overrides its results directory, ``models`` how models load
        (dtype, device, device_map, remote), ``task`` its task (kinds that have one)."""

    @abstractmethod
    def stages(self) -> Any:
        """Run every stage through ``self.cache`` (or `caches`) and return what `write` reads. Writes
        nothing but stage records (stage computations may write their own files), so `plan` can walk it."""

    @abstractmethod
    def write(self, results: Any) -> Path:
        """Tables, figures and the report from the stage results; returns the report's path."""

    # -- the resource plan: each kind counts its own stages (`mechdiff.studies.planner`) ----------------------
    @classmethod
    def plan_inputs(cls, path: Optional[str | Path], task: Optional[str] = None, dtype: Optional[str] = None) -> Any:
        """What this kind's stage costs read (a `mechdiff.studies.planner.PlanInputs`), from the task file
        ``path`` and the models' configs alone: no weights load."""
        raise NotImplementedError(f"the {cls.kind} kind has no resource plan")

    @classmethod
    def stage_costs(cls, inputs: Any, device: Any) -> list:
        """Every stage a run of ``inputs`` meets, in order, each one's cost on ``device`` (a list of
        `mechdiff.studies.planner.StageCost`, counted by the functions beside each stage's computation)."""
        raise NotImplementedError(f"the {cls.kind} kind has no resource plan")

    @classmethod
    def with_batch(cls, settings: Any, cost: Any, batch: int) -> Any:
        """``settings`` with ``cost``'s batch option (``cost.batch_option``) at ``batch``, for the plan's remedies;
        unchanged where the kind has no such option."""
        return settings

    def settings_record(self) -> dict:
        """The study's settings as the manifest records them."""
        return {}

    def forget(self) -> None:  # noqa: B027 (a hook: a study that memoises records overrides it)
        """Drop whatever the study memoised from stage records (called after a plan, whose records may be still
        to compute)."""

    def run_model(self, name: str) -> None:
        """The stages of model ``name`` alone (``mechdiff run --model``); only kinds whose stages split by model
        (circuits) have them: the others refuse."""
        raise ValueError(f"--model runs one model's stages of a circuits study; this is a {self.kind} study")

    def caches(self) -> list[StageCache]:
        """Every stage cache the study writes (one, but for kinds that keep one per sub-study)."""
        return [self.cache]

    # -- shared ---------------------------------------------------------------------------
    def run(self) -> Path:
        """Every stage, then ``run.json`` and the report, under the run directory's lock (a second run on it is
        refused with the holder's PID). Each record is written atomically when its stage ends, so an
        interrupted run resumes at the stage in progress."""
        with run_lock(self.dir):
            results = self.stages()
            write_json(self.dir / "run.json", self.manifest())
            return self.write(results)

    def plan(self) -> list[PlannedStage]:
        """The stages a run would go through, in order: each with its key, whether it is cached, and what it
        cost (and its key) in the committed ``run.json``. Computes nothing."""
        caches = self.caches()
        for cache in caches:
            cache.planning, cache.planned = True, []
        try:
            self.stages()
        except Pending:  # a stage whose name needs a result still to compute: the plan ends there
            pass
        finally:
            for cache in caches:
                cache.planning = False
            self.forget()
        out = []
        for cache in caches:
            committed = committed_stages(cache.root)
            where = "" if cache.root == self.dir else f"{cache.root.relative_to(self.dir)}/"
            for p in cache.planned:
                saved = committed.get(p.name, {})
                out.append(
                    PlannedStage(where + p.name, p.key, p.cached, p.after, saved.get("seconds"), saved.get("key"))
                )
        return out

    def manifest(self) -> dict:
        """What was run: kind, settings, versions, stage keys and timings."""
        stages = {}
        for cache in self.caches():
            where = "" if cache.root == self.dir else f"{cache.root.relative_to(self.dir)}/"
            stages.update({where + n: s for n, s in cache.summary().items()})
        return {
            "kind": self.kind,
            self.settings_key: self.settings_record(),
            "versions": versions(),
            "python": platform.python_version(),
            "machine": platform.machine(),
            "stages": stages,
            "wall_seconds": time.time() - self.started,
        }


def committed_stages(run_dir: Path) -> dict[str, dict]:
    """Stage name -> ``{key, seconds}`` of the results committed in ``run_dir``: its ``run.json`` (or, for
    knowledge studies made before ``run.json``, ``study.json``); empty when there is none."""
    for name in ("run.json", "study.json"):
        path = run_dir / name
        try:
            saved = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        stages = saved.get("stages") if isinstance(saved, dict) else None
        if isinstance(stages, dict):
            return stages
    return {}


def detectable_text(sizes: dict[str, int], items: Optional[dict[str, int]] = None, discordance: float = 0.2) -> str:
    """Each prompt set's rows and items beside the smallest difference a test on its items detects with 80% power
    at 0.05 (`mechdiff.common.inference.detectable_difference`): a paired difference of two models'
    accuracies at the stated discordance, and one proportion against a fixed value near 0.5; so a user sees before
    the run which claims the sizes can carry. Every interval resamples items, so the difference is computed on
    the set's items (``items``: name -> the items the set takes; a set not named there, one row an item): a set
    of 200 rows in 19 items carries what 19 items do."""
    from ..common.inference import detectable_difference

    items, starred = items or {}, False
    lines = [
        "detectable differences, computed on each set's items "
        f"(80% power, two-sided 0.05; paired at discordance {discordance}):"
    ]
    for name, n in sizes.items():
        if n > 0:
            k = int(items.get(name, n))
            paired = detectable_difference(k, "paired", discordance)
            single = detectable_difference(k, "proportion")
            beyond = {"paired": paired > discordance, "single": single > 0.5}
            mark = {kind: "*" if over else "" for kind, over in beyond.items()}
            lines.append(
                f"  {name:10s} {n:5d} rows {k:5d} items: paired {paired:.3f}{mark['paired']}, "
                f"one proportion {single:.3f}{mark['single']}"
            )
            starred = starred or any(beyond.values())
    if starred:
        lines.append(
            f"  * beyond what a difference can be (paired: at most the discordance {discordance}; one proportion: "
            "at most 0.5 from 0.5): at 80% power these items carry no such claim"
        )
    return "\n".join(lines)


def format_plan(plan: list[PlannedStage]) -> str:
    """The plan as a table: stage, cached or not, and the committed results' cost of it."""
    if not plan:
        return "no stage to run"
    width = max(len(p.name) for p in plan)
    lines = [f"{'stage':{width}s}  {'now':9s}  committed run"]
    todo = 0.0
    for p in plan:
        state = "cached" if p.cached else "compute"
        if p.committed_seconds is None:
            cost = "not in the committed run.json"
        else:
            same = {True: "same inputs", False: "other inputs", None: "inputs not known yet"}[p.same_as_committed]
            cost = f"{p.committed_seconds:9.1f} s ({same})"
            todo += 0.0 if p.cached else float(p.committed_seconds)
        after = f" after {p.after}" if p.after else ""
        lines.append(f"{p.name:{width}s}  {state:9s}  {cost}{after}")
    n = sum(not p.cached for p in plan)
    lines.append(
        f"{n} of {len(plan)} stages to compute"
        + (f"; they took {todo:.0f} s when the committed results were made" if todo else "")
    )
    return "\n".join(lines)


class RunDirError(ValueError):
    """A run directory that holds another study's results: running there would overwrite them."""


def task_name_of(manifest: dict) -> Optional[str]:
    """The task name a ``run.json`` records (``spec`` of a circuits study, ``settings`` of the others), or None."""
    for section in ("spec", "settings"):
        block = manifest.get(section)
        task = block.get("task") if isinstance(block, dict) else None
        if isinstance(task, dict) and task.get("name"):
            return str(task["name"])
    return None


def check_run_dir(study: Study, force: bool = False) -> None:
    """Refuse, before anything loads, a run into a directory whose ``run.json`` records another kind of study or
    another task (e.g. ``--task DIR`` aimed at a committed study's directory); ``force`` writes there anyway."""
    path = study.dir / "run.json"
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError):
        return  # a new directory, or no readable record of what it holds
    ours = task_name_of({study.settings_key: study.settings_record()})
    theirs, kind = task_name_of(saved), saved.get("kind")
    if force or (kind in (None, study.kind) and (theirs is None or ours is None or theirs == ours)):
        return
    held = f"a {kind} study" + (f" of task {theirs}" if theirs else "")
    mine = f"this {study.kind} study" + (f" of task {ours}" if ours else "")
    raise RunDirError(
        f"{study.dir} holds {held} ({path}); {mine} would overwrite it. Give another directory (--out DIR, or "
        "[output] dir in the task file), or --force to write there anyway"
    )


def plan_text(study: Study, plan: list[PlannedStage]) -> str:
    """What a run prints of its ``plan`` (`Study.plan`) after where it writes: the stage table (`format_plan`) and,
    for a study that draws prompt sets, what their items can detect (`detectable_text`)."""
    lines = [format_plan(plan)]
    sizes = getattr(study, "prompt_set_sizes", None)
    if sizes is not None:
        items = getattr(study, "prompt_set_items", None)
        lines.append(detectable_text(sizes(), items() if items is not None else None))
    return "\n".join(lines)


def plan_then_run(study: Study, plan_only: bool = False, force: bool = False, **run_options: Any) -> Any:
    """What ``mechdiff run``, ``mechdiff knowledge`` and ``mechdiff headmap compare`` do: print where the study
    writes and its stage plan (`format_plan`), then, unless ``plan_only``, run it
    (``study.run(**run_options)``) and print each stage's time or ``cached``; a directory that holds another
    study's results is refused first (`check_run_dir`; ``force`` overrides). Returns what the run returns
    (None when only planned)."""
    if not plan_only:
        check_run_dir(study, force)
    print(f"{study.kind} study into {study.dir}:", flush=True)
    print(plan_text(study, study.plan()), flush=True)
    if plan_only:
        return None
    result = study.run(**run_options)
    for cache in study.caches():
        where = "" if cache.root == study.dir else f"{cache.root.relative_to(study.dir)}/"
        for name, rec in cache.records.items():
            print(f"  {where + name:32s} {'cached' if rec.cached else f'{rec.seconds:7.1f} s'}")
    return result
