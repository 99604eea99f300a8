"""The trajectory study: an ordered list of checkpoints of one run (``[models] checkpoints``), measured at every
checkpoint by function and by structure (`mechdiff.methods.trajectory`).

Stages, each a record of the one stage cache (``<out>/stages/``), keyed by its inputs:

- ``accuracy:<ckpt>``: held-out accuracy (exact binomial) with each prompt's outcome;
- ``circuit:<ckpt>``: the checkpoint's own circuit at the target (attribution ranking, faithfulness curve) with
  its size, per-prompt attribution and selection frequencies;
- ``structure``: the within-checkpoint null (two discoveries on two disjoint random halves of the ranking prompts,
  a fresh split each draw), the structural change between consecutive checkpoints and of each checkpoint against
  the final one beyond it, and the overlap matrix of every two checkpoints;
- ``score:<ckpt>``: the final checkpoint's circuit, the first trained checkpoint's (the second in the list) and
  the checkpoint's own, scored in the checkpoint (faithfulness with bootstrap intervals);
- ``cmap:<ckpt>``: CMAP of the final circuit's groups (``[cmap] groups``, ``parts``) from the checkpoint into the
  first;
- ``dcm``: DCM labels of the final circuit's groups in the final checkpoint (or read from ``[dcm] labels``, a DCM
  table another study wrote);
- ``semantic:<ckpt>``: semantic patching of each DCM selection in the checkpoint;
- ``roles:<ckpt>`` (only where the task file has a ``[roles]`` section): every head of the chosen groups of any
  checkpoint's own circuit scored alone on each desideratum in the checkpoint (`
  head_scores`), or with ``method = "dcm"`` DCM over them with one fixed sparsity weight, several seeds
  (`dcm_seeds`), from which the report gives role membership over the steps and
  the heads that join, leave or take over a role;
- ``edges:<ckpt>`` and ``edges`` (only with ``[edges] on = true``): the EAP edge graph (heads and MLPs,
  position-free) scored per prompt on the ranking prompts with the node ranking's metric and mean ablation
  (`task_graph`) at ``[edges] steps`` (default: the steps the between-run null reads), then
  each checkpoint's top-n edges and their nodes, edge overlap beside node overlap between consecutive steps and
  against the final one, with the node structure's within-checkpoint null and prompt resamples
  (`edge_structure`).

The base loads once; the adapters are swapped (`Checkpoints`), and nothing loads
when every stage is cached. The report gives each quantity per step with its interval, its paired difference
against the first checkpoint, each component's normalised measure and formation steps with bootstrap intervals
(`formation`, computed from the stages' per-prompt outcomes, so no stage records more for
them), the pairs of components those intervals order, and the structural changes.
"""

from __future__ import annotations

import json
import logging
import math
import re
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Optional

from ...circuits.circuit import Circuit
from ...circuits.curve import SELECT, SIZES, TARGET
from ...common.io import check_writable, run_lock
from ...methods.dcm import DCMConfig
from ...methods.edge_structure import EDGES_N
from ...methods.knowledge.task_graph import EDGE_BATCH, IG_STEPS, METHODS
from ...methods.roles import SEEDS, THRESHOLD, VOTES
from ...methods.trajectory import (
    MARGIN,
    RESAMPLE_SPLITS,
    STABLE,
    STRUCTURE_DRAWS,
    STRUCTURE_RESAMPLES,
    Checkpoints,
    trajectory_specs,
)
from ...models.loading import load_tokenizer, spec_digest
from ...runs.seeds import derive, prompt_seed
from ...runs.stages import StageRecord, key_hash, label
from ..base import Study, rows_inputs, vocabulary_digest
from ..spec import (
    DcmSection,
    EvalSection,
    OutputSection,
    Real,
    SpecError,
    StudySection,
    TaskSection,
    line_of,
    load_sections,
    section,
)

log = logging.getLogger(__name__)

#: What the structure stage computes, in its key: a record of the first null (the halves resampled with
#: replacement, consecutive checkpoints only) or of the split spread alone (no interval over prompts) is not reused.
NULL = (
    "disjoint random halves per split; consecutive, against the final, matrix; intervals resampling the prompts "
    "outside the split; float16 attributions; the [runs] steps on their own ranking prompts"
)
#: Ranking prompts at the steps the between-run null reads (``[runs] steps``), of this run and the others.
RUNS_N = 256


@section
class CheckpointsSection:
    checkpoints: list[str] = field(default_factory=list)  # in training order; the first is the reference
    dtype: str = "float32"
    device: Optional[str] = None


@section
class TrajectoryDiscovery:
    """Each checkpoint's own circuit: (head, position class) pairs ranked by attribution on ``n`` prompts, nested
    circuits scored on ``curve_n`` others, the smallest reaching ``target`` (as the circuits study's curve)."""

    n: int = 40  # ranking prompts (halved for the within-checkpoint null)
    runs_n: int = RUNS_N  # ranking prompts at the [runs] steps (this run's and the other runs'); n elsewhere
    sizes: list[Real] = field(default_factory=lambda: list(SIZES))
    target: Real = TARGET
    select: str = SELECT[0]
    curve_n: int = 60
    stability_draws: int = 200


@section
class TrajectoryScoring:
    n: int = 100  # prompts scoring the circuits in every checkpoint
    reference_n: int = 200  # prompts whose position-wise means ablate


@section
class StructureSection:
    draws: int = STRUCTURE_DRAWS  # random disjoint splits into halves; bootstrap resamples of the ranking prompts
    stable: Real = STABLE  # selection frequency that makes a pair robustly in (1 - stable: robustly out)
    n_pairs: int = 0  # pairs each discovery keeps (0: the final checkpoint's circuit size)
    resamples: int = STRUCTURE_RESAMPLES  # resamples of the ranking prompts behind each overlap's interval
    resample_splits: int = RESAMPLE_SPLITS  # random splits into halves of each resample
    margin: Real = MARGIN  # equivalence margin (Jaccard): "no change" only where (null - cross) is shown inside it


@section
class TrajectoryDcm(DcmSection):
    labels: str = ""  # a DCM table (JSON rows: group, desideratum, position, selected) to use instead of training
    # DCM's random baseline as the committed trajectories ran it (the circuits study's controls changed after them;
    # the trajectories follow in their own issue): 5 draws from every head
    random_pool: str = "all"
    n_random: int = 5


#: ``[roles]`` fields the single-head scores do not read (left out of their stage key).
DCM_ONLY = ("steps", "method", "lam", "seeds", "votes", "n_random")


def roles_dcm_config(config: DCMConfig, roles: RolesSection) -> DCMConfig:
    """The DCM training of ``[roles] method = "dcm"``: ``[dcm]``'s (``config``), but the sparsity weight
    ``[roles] lam`` taken as is (absolute: the same at every checkpoint, not scaled by its logits) and
    ``[roles] n_random`` random head sets of the selection's layers."""
    return replace(config, lam=roles.lam, lam_scale="absolute", random_pool="layer", n_random=roles.n_random)


def dcm_key(d: TrajectoryDcm) -> dict:
    """``[dcm]`` as the trajectory's stage keys read it: ``n_random`` (a field added after the committed
    trajectories) left out at its value here, so their keys stay."""
    out = asdict(d)
    if out["n_random"] == TrajectoryDcm.n_random:
        del out["n_random"]
    return out


@section
class TrajectoryCmap:
    n: int = 100
    parts: list[str] = field(default_factory=lambda: ["z"])
    # the final circuit's groups patched (empty: as [dcm] groups, else every group at a position of the task's
    # prompts, a position class patched at every token of it); before any task could run, the default was entity
    # tracking's ["last", "query_label"]
    groups: list[str] = field(default_factory=list)


@section
class RolesSection:
    """Per-head desideratum scores at every checkpoint (`roles`); the stage runs only where
    the task file has a ``[roles]`` section."""

    n: int = 48  # pairs of each desideratum, a draw of their own
    threshold: Real = THRESHOLD  # a head holds a role where its share's lower bound exceeds this
    groups: list[str] = field(
        default_factory=list
    )  # empty: as [dcm] groups, else every group of the prompts' positions
    desiderata: list[str] = field(default_factory=list)  # empty: every desideratum the task declares
    # the heads scored in each group: "any" checkpoint's own circuit has there (a head that holds a role early and
    # loses it is scored too), or the "final" circuit's only (fewer heads: cheaper)
    heads: str = "any"
    steps: list[int] = field(default_factory=list)  # the steps scored (empty: every checkpoint)
    # "heads": each head scored alone (n pairs a desideratum); "dcm": DCM's masks trained in each checkpoint over the
    # candidate heads of the groups ([dcm] pairs and training), the heads a role needs together (the paper's method)
    method: str = "heads"
    # method "dcm" only: the sparsity weight, absolute and the same at every step (the paper's form; [dcm]'s
    # lam_scale does not apply); DCM trainings per step; the seeds that must select a head; random head sets of the
    # selection's layers the selection is tested against
    lam: Real = DCMConfig.lam
    seeds: int = SEEDS
    votes: int = VOTES
    n_random: int = DCMConfig.n_random


@section
class RunsSection:
    """The between-run null: other runs of the same recipe (another seed), each a directory of saved steps
    (``DIR@STEP``), read at ``steps`` (steps of the trajectory). Only their ranking attribution and accuracy are
    computed; the structure stage compares their circuits with the trajectory's at the same step."""

    dirs: list[str] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)


@section
class EdgesSection:
    """Edges as well as nodes (`edge_structure`): the EAP graph scored per prompt at ``steps``. Off by
    default: on SmolLM2 the scores of 256 prompts take 30 to 80 min a checkpoint on one CPU thread, where its node
    ranking takes about a minute (docs/trajectories.md, "Edges beside nodes")."""

    on: bool = False
    n: int = EDGES_N  # edges each discovery keeps (its nodes: the heads and MLPs they touch)
    steps: list[int] = field(default_factory=list)  # empty: the [runs] steps (every step without [runs]); + the final
    method: str = METHODS[0]  # "eap": at the full model, as the node ranking; "eap-ig": integrated gradients
    ig_steps: int = IG_STEPS  # EAP-IG's steps (method "eap-ig" only)
    batch_size: int = EDGE_BATCH  # prompts a forward and backward (every receiver holds its own residual stream)


@section
class TrajectoryOutput(OutputSection):
    dir: str = "results/trajectory"
    store: str = "cache/activations-trajectory.h5"


SECTIONS = {
    "study": StudySection,
    "task": TaskSection,
    "models": CheckpointsSection,
    "eval": EvalSection,
    "discovery": TrajectoryDiscovery,
    "scoring": TrajectoryScoring,
    "structure": StructureSection,
    "dcm": TrajectoryDcm,
    "cmap": TrajectoryCmap,
    "roles": RolesSection,
    "runs": RunsSection,
    "edges": EdgesSection,
    "output": TrajectoryOutput,
}
CHOICES = {
    ("edges", "method"): METHODS,
    ("discovery", "select"): SELECT,
    ("cmap", "parts"): ("z", "q", "k", "v", "qk", "qkv"),
    ("roles", "heads"): ("any", "final"),
    ("roles", "method"): ("heads", "dcm"),
}


@dataclass
class TrajectorySettings:
    study: StudySection
    task: TaskSection
    models: CheckpointsSection
    eval: EvalSection
    discovery: TrajectoryDiscovery
    scoring: TrajectoryScoring
    structure: StructureSection
    dcm: TrajectoryDcm
    cmap: TrajectoryCmap
    output: TrajectoryOutput
    roles: Optional[RolesSection] = None  # None: the task file has no [roles] section, and no roles stage runs
    runs: RunsSection = field(default_factory=RunsSection)  # no dirs: no between-run null
    edges: EdgesSection = field(default_factory=EdgesSection)  # off: no edge stage
    source: str = "<defaults>"


def load_settings(path: str | Path) -> TrajectorySettings:
    """A trajectory task file, checked (keys, types, choices, the checkpoints as one trajectory, the groups and
    desiderata as the task's, the DCM labels file) before anything loads."""
    import tomllib

    from ..spec import _check_desiderata, _check_groups, check_task

    built, text = load_sections(
        path, SECTIONS, {"models": ("checkpoints",)}, CHOICES, example="tasks/entity_tracking_trajectory.toml"
    )
    if built["study"].kind != "trajectory":
        raise SpecError(f'{path}:{line_of(text, "study", "kind")}: this loader reads [study] kind = "trajectory"')
    check_task(built["task"].name, f"{path}:{line_of(text, 'task', 'name')}: ")
    raw = tomllib.loads(text)
    _check_desiderata(Path(path), text, raw.get("dcm"), built["task"].name)
    _check_groups(Path(path), text, raw, built["task"].name)
    try:
        trajectory_specs(built["models"].checkpoints)
    except (ValueError, KeyError) as err:
        raise SpecError(f"{path}:{line_of(text, 'models', 'checkpoints')}: {err}") from None
    _check_runs(Path(path), text, built["runs"], built["models"].checkpoints)
    _check_structure(Path(path), text, built["discovery"], built["structure"])
    _check_edges(Path(path), text, built["edges"], built["models"].checkpoints)
    built["roles"] = _check_roles(
        Path(path), text, raw, built["roles"], built["task"].name, built["models"].checkpoints
    )
    labels = built["dcm"].labels
    if labels and not Path(labels).is_file():
        raise SpecError(
            f"{path}:{line_of(text, 'dcm', 'labels')}: no DCM table {labels}; give the tables/dcm.json "
            "of a circuits study, or leave labels empty to train DCM on the final checkpoint"
        )
    return TrajectorySettings(**built, source=str(path))


def other_runs(runs: RunsSection, checkpoints: list[str]) -> dict[str, list[str]]:
    """The other runs' checkpoints by the trajectory's checkpoint at the same step: ``{ckpt: ["DIR@STEP", ...]}``."""
    at = dict(zip(checkpoint_steps(checkpoints), checkpoints))
    return {at[s]: [f"{d}@{s}" for d in runs.dirs] for s in runs.steps if s in at and runs.dirs}


def _check_runs(path: Path, text: str, runs: RunsSection, checkpoints: list[str]) -> None:
    """``[runs]``: steps of the trajectory, and each ``DIR@STEP`` an adapter over the trajectory's base."""
    if not runs.dirs and not runs.steps:
        return
    steps = checkpoint_steps(checkpoints)
    missing = [s for s in runs.steps if s not in steps]
    if missing or not runs.steps or not runs.dirs:
        key = "steps" if missing or not runs.steps else "dirs"
        raise SpecError(
            f"{path}:{line_of(text, 'runs', key)}: [runs] needs dirs (other runs of the recipe) and steps among the "
            f"trajectory's ({', '.join(map(str, steps))})" + (f"; {missing} are not" if missing else "")
        )
    others = [o for names in other_runs(runs, checkpoints).values() for o in names]
    try:
        trajectory_specs([*checkpoints, *others])
    except (ValueError, KeyError) as err:
        raise SpecError(f"{path}:{line_of(text, 'runs', 'dirs')}: {err}") from None


def _check_structure(path: Path, text: str, d: TrajectoryDiscovery, s: StructureSection) -> None:
    """``[discovery] runs_n`` at least ``n`` (the [runs] steps take more ranking prompts, never fewer), and the
    structure's resamples and margin usable."""
    if d.runs_n < d.n:
        raise SpecError(
            f"{path}:{line_of(text, 'discovery', 'runs_n')}: [discovery] runs_n ({d.runs_n}) must be at least n "
            f"({d.n}): the steps the between-run null reads take more ranking prompts, the rest n"
        )
    if s.resamples < 1 or s.resample_splits < 1:
        raise SpecError(
            f"{path}:{line_of(text, 'structure', 'resamples')}: [structure] resamples and resample_splits "
            "must be at least 1"
        )
    if not 0 < s.margin < 1:
        raise SpecError(
            f"{path}:{line_of(text, 'structure', 'margin')}: [structure] margin is a Jaccard difference "
            "in (0, 1), e.g. 0.05"
        )


def _check_edges(path: Path, text: str, e: EdgesSection, checkpoints: list[str]) -> None:
    """``[edges]``: steps of the trajectory, a usable n, batch size and IG steps."""
    steps = checkpoint_steps(checkpoints)
    for key, bad, need in (
        ("steps", [s for s in e.steps if s not in steps], f"steps of the trajectory ({', '.join(map(str, steps))})"),
        ("n", e.n < 1, "at least 1 edge"),
        ("ig_steps", e.ig_steps < 1, "at least 1"),
        ("batch_size", e.batch_size < 1, "at least 1"),
    ):
        if bad:
            raise SpecError(f"{path}:{line_of(text, 'edges', key)}: [edges] {key} must be {need}")


def edge_checkpoints(edges: EdgesSection, runs: RunsSection, checkpoints: list[str]) -> list[str]:
    """The checkpoints the edge stages score, in order: those at ``[edges] steps``, else at the ``[runs]`` steps,
    else every one; the final one always (each is compared with it). None where ``[edges]`` is off."""
    if not edges.on:
        return []
    wanted = edges.steps or runs.steps
    return [
        c
        for c, s in zip(checkpoints, checkpoint_steps(checkpoints))
        if not wanted or s in wanted or c == checkpoints[-1]
    ]


def _check_roles(
    path: Path, text: str, raw: dict, roles: RolesSection, task: str, checkpoints: list[str]
) -> Optional[RolesSection]:
    """The ``[roles]`` section checked (None where the file has none)."""
    from ...tasks.base import get_task

    if "roles" not in raw:
        return None
    if roles.n < 1:
        raise SpecError(f"{path}:{line_of(text, 'roles', 'n')}: [roles] n must be at least 1 pair")
    steps = checkpoint_steps(checkpoints)
    if [s for s in roles.steps if s not in steps]:
        raise SpecError(
            f"{path}:{line_of(text, 'roles', 'steps')}: [roles] steps must be steps of the trajectory "
            f"({', '.join(map(str, steps))}), not {[s for s in roles.steps if s not in steps]}"
        )
    if not 0 <= roles.threshold < 1:
        raise SpecError(f"{path}:{line_of(text, 'roles', 'threshold')}: [roles] threshold must lie in [0, 1)")
    for key, bad, need in (
        ("lam", roles.lam <= 0, "a sparsity weight above 0"),
        ("seeds", roles.seeds < 1, "at least 1 DCM training a step"),
        ("votes", not 1 <= roles.votes <= roles.seeds, f"between 1 and seeds ({roles.seeds})"),
        ("n_random", roles.n_random < 1, "at least 1 random head set (the test against random heads needs one)"),
    ):
        if bad and roles.method == "dcm":
            raise SpecError(f"{path}:{line_of(text, 'roles', key)}: [roles] {key} must be {need}")
    from ...tasks.desiderata import desideratum_name

    own = get_task(task).desiderata
    unknown = [d for d in roles.desiderata if d not in own and desideratum_name(d) not in own]
    if unknown or not own:
        where = line_of(text, "roles", "desiderata") if unknown else line_of(text, None, "roles")
        raise SpecError(
            f"{path}:{where}: [roles] scores heads on the task's desiderata; task {task} declares "
            f"{', '.join(own) or 'none'}" + (f", not {', '.join(unknown)}" if unknown else "")
        )
    return roles


def step_of(name: str, index: int) -> int:
    """The training step of a checkpoint named ``NAME@STEP`` or a hub revision ``hub:ORG/NAME@stepSTEP``
    (``step``, ``step-``, ``step_`` before the number); its index in the list otherwise."""
    _, at, tail = name.rpartition("@")
    found = re.fullmatch(r"(?:step[-_]?)?(\d+)", tail) if at else None
    return int(found.group(1)) if found else index


def checkpoint_steps(checkpoints: list[str]) -> list[int]:
    """The training step of each checkpoint in the list (`step_of`)."""
    return [step_of(n, i) for i, n in enumerate(checkpoints)]


def read_labels(path: str | Path) -> list[dict]:
    """DCM selections from a DCM table (a circuits study's ``tables/dcm.json``: ``selected`` a space-separated
    string, ``-`` for none) or a list of `DCMResult.to_dict` records. A row whose table gives the test
    accuracy and the floor is kept only where the accuracy's interval lies above the floor's (DCM found the
    property there); the others are listed under ``dropped``."""
    rows = json.loads(Path(path).read_text())
    out = []
    for r in rows:
        sel = r["selected"]
        heads = [h for h in (sel.split() if isinstance(sel, str) else sel) if h != "-"]
        above = r.get("accuracy_low") is None or r.get("floor_high") is None or r["accuracy_low"] > r["floor_high"]
        out.append(
            {
                "group": r["group"],
                "desideratum": r["desideratum"],
                "position": r["position"],
                "selected": heads if above else [],
                **({} if above else {"dropped": heads}),
            }
        )
    return out


# --------------------------------------------------------------------------------------
# The cost of each stage of `TrajectoryStudy`, for the resource plan (`mechdiff.studies.planner`): passes of
# ``[eval] batch_size`` prompts; each checkpoint's reference means are computed by its first scorer (its circuit
# stage, or an other run's ranking) and read from the activation store by the later ones
# --------------------------------------------------------------------------------------


def _cost(meter: Any, st: TrajectorySettings, stage: str, n: int, passes: list, note: str = "", models: int = 1) -> Any:
    """A stage of ``n`` prompts whose passes are ``passes``: (rows each run holds, passes, FLOP factor: 2 for a
    forward and a backward to the activations); its largest batch's activations and mean-ablation writes."""
    from ...models.footprint import backward_bytes, dtype_bytes
    from ..planner import StageCost

    t, d = meter.lengths, meter.dims
    rows = meter.rows(n, st.eval.batch_size)
    flops = sum(factor * meter.fwd(run_rows, t.tokens) for run_rows, _, factor in passes)
    count = sum(p for _, p, _ in passes)
    backward = any(f > 1 for _, _, f in passes)
    act = (
        backward_bytes(d, rows, t.longest, d.n_layers, meter.dtype) if backward else meter.act(rows, t.longest)
    ) + d.n_layers * rows * t.longest * d.d_model * dtype_bytes(meter.dtype)
    return StageCost(
        stage, models, n, rows, flops, models * meter.weights, 0, act, note=note,
        batch_option="[eval] batch_size", reads=meter.reads(count),
    )  # fmt: skip


def trajectory_costs(
    meter: Any,
    st: TrajectorySettings,
    names: list[str],
    others: list[str],
    labels: list,
    circuits: Optional[dict[str, Any]] = None,
) -> list:
    """Every stage in the order `TrajectoryStudy.stages` meets them (see the module docstring), on the
    checkpoints ``names`` and the other runs' ``others``; ``labels``: the DCM table of ``[dcm] labels`` (empty:
    DCM trained here); ``circuits``: each checkpoint's circuit where a run found it (`trajectory_found`; else
    each checkpoint's own is assumed distinct). Counts as the circuits kind's: accuracy a pass a batch; a circuit
    the reference means, attribution (a forward and a backward a batch) on its ranking prompts and the curve's full
    model, empty circuit and sizes on ``curve_n``; a score the full model, the empty circuit and each distinct one
    of the three circuits; CMAP both checkpoints and one patched run per scope (each group, the whole circuit) and
    part; semantic patching two runs a test pair and one per selection."""
    b, d = st.eval.batch_size, st.discovery
    runs = {*others, *other_runs(st.runs, names)}  # ranked on runs_n: the other runs' and this run's at their steps

    def batches(n: int) -> int:
        return math.ceil(n / b)

    def ranking_n(name: str) -> int:
        return d.runs_n if name in runs else d.n

    def reference() -> tuple[int, int, int]:
        return st.scoring.reference_n, batches(st.scoring.reference_n), 1

    out = [_cost(meter, st, f"accuracy:{n}", st.eval.n, [(st.eval.n, batches(st.eval.n), 1)]) for n in names]
    for n in [names[-1], *names[:-1]]:
        r, c = ranking_n(n), d.curve_n
        passes = [reference(), (r, 2 * batches(r), 2), (c, batches(c) * (2 + len(d.sizes)), 1)]
        out.append(_cost(meter, st, f"circuit:{n}", r, passes))
    out += [_cost(meter, st, f"accuracy:{o}", st.eval.n, [(st.eval.n, batches(st.eval.n), 1)]) for o in others]
    for o in others:
        passes = [reference(), (d.runs_n, 2 * batches(d.runs_n), 2)]
        out.append(_cost(meter, st, f"ranking:{o}", d.runs_n, passes))
    out.append(_cost(meter, st, "structure", 0, [], "from the circuits' attributions: no pass", models=0))
    n, found = st.scoring.n, circuits or {}

    def scored(c: str) -> int:  # the full model, the empty circuit, each distinct circuit (a set of pairs runs once)
        return 2 + len({found.get(k, k) for k in (names[-1], names[1], c)})

    out += [_cost(meter, st, f"score:{c}", n, [(n, scored(c) * batches(n), 1)]) for c in names]
    scopes = len(st.cmap.groups or st.dcm.groups or ["last", "query_label"]) + 1
    note = "" if st.cmap.groups or st.dcm.groups else "two groups assumed"
    cmap = [(st.cmap.n, (2 + scopes * len(st.cmap.parts)) * batches(st.cmap.n), 1)]
    out += [_cost(meter, st, f"cmap:{c}", st.cmap.n, cmap, note, models=2) for c in names[1:]]
    out.append(_trajectory_dcm(meter, st, labels))
    chosen = [lab for lab in labels if lab.get("selected")]
    desiderata = {lab["desideratum"] for lab in chosen}
    semantic = [(st.dcm.n_test, (2 * len(desiderata) + len(chosen)) * batches(st.dcm.n_test), 1)]
    sem_note = "" if labels else "the selections DCM makes: none counted before it runs"
    out += [_cost(meter, st, f"semantic:{c}", st.dcm.n_test, semantic, sem_note) for c in names]
    if st.roles is not None:
        steps = [c for c, s in zip(names, checkpoint_steps(names)) if not st.roles.steps or s in st.roles.steps]
        roles = [(st.roles.n, 2 * batches(st.roles.n), 1)]
        why = "the pairs' runs; one more a head scored (the heads are the circuits', known after discovery)"
        out += [_cost(meter, st, f"roles:{c}", st.roles.n, roles, why) for c in steps]
    return out


def trajectory_found(run_dir: str | Path) -> dict[str, frozenset]:
    """Each checkpoint's circuit (its (head, position) pairs) that a run's ``circuit`` stage records hold: what
    the plan of the ``score`` stages otherwise assumes distinct."""
    out = {}
    for path in sorted((Path(run_dir) / "stages").glob("circuit*.json")):
        rec = json.loads(path.read_text())
        kind, _, name = rec["name"].partition(":")
        if kind == "circuit":
            c = Circuit.from_dict(rec["result"]["circuit"])
            out[name] = frozenset((str(h), c.positions[g]) for g, hs in c.groups.items() for h in hs)
    return out


def _trajectory_dcm(meter: Any, st: TrajectorySettings, labels: list) -> Any:
    """The ``dcm`` stage: reading ``[dcm] labels`` (no pass), else DCM trained in the final checkpoint: per
    desideratum its pairs' two runs, then per group ``epochs`` of training steps (a forward and a backward), the
    validation runs and the test runs of the selection, the floor and ``n_random`` random sets."""
    c = st.dcm
    if c.labels:
        return _cost(meter, st, "dcm", 0, [], f"read from {c.labels}: no pass", models=0)
    b = st.eval.batch_size
    k, groups = max(len(c.desiderata), 1), max(len(c.groups), 1)
    pairs = c.n_train + c.n_val + c.n_test
    steps = c.epochs * math.ceil(c.n_train / c.batch_size)
    tests = (2 + c.n_random) * math.ceil(c.n_test / b) + math.ceil(c.n_val / b) * (steps // max(c.eval_every, 1) + 1)
    passes = {
        pairs: (k * 2 * math.ceil(pairs / b), 1),
        c.batch_size: (k * groups * steps, 2),
        c.n_test: (k * groups * tests, 1),
    }
    note = "" if c.desiderata and c.groups else "one desideratum and one group assumed where none is named"
    return _cost(meter, st, "dcm", pairs, passes, note)


class TrajectoryStudy(Study):
    """The stages of one trajectory task file into ``out`` (see the module docstring)."""

    kind = "trajectory"

    def __init__(self, settings: TrajectorySettings, out: Optional[str | Path] = None, progress: bool = True):
        from ...tasks.base import get_task

        super().__init__(out or settings.output.dir, progress)
        self.st = settings
        self.store = str(Path(settings.output.store))
        check_writable(Path(self.store).parent, "activation store directory")
        self.names = list(settings.models.checkpoints)
        self.runs = other_runs(settings.runs, self.names)  # the between-run null's checkpoints by step
        self.others = [o for names in self.runs.values() for o in names]
        self.base_spec, specs = trajectory_specs([*self.names, *self.others])
        self.digests = {n: spec_digest(s) for n, s in zip([*self.names, *self.others], specs)}
        self.steps = checkpoint_steps(self.names)
        self.task = get_task(settings.task.name)
        self.tokenizer = load_tokenizer(self.base_spec)
        self._checkpoints: Optional[Checkpoints] = None
        self.check_prompts()  # before any weights load

    @classmethod
    def plan_inputs(cls, path: Optional[str | Path], task: Optional[str] = None, dtype: Optional[str] = None) -> Any:
        """The settings, the base's dims and the task's token lengths (`task_lengths`), the DCM table where
        ``[dcm] labels`` names one; no checkpoint loads."""
        from ...models.footprint import model_dims
        from ..planner import PlanInputs, task_lengths

        st = load_settings(path)
        if task:
            st.task.name = task
        names = list(st.models.checkpoints)
        others = [o for o_names in other_runs(st.runs, names).values() for o in o_names]
        dims, source = model_dims(names[0])
        lengths = task_lengths(SimpleNamespace(models=SimpleNamespace(base=names[0]), task=st.task))  # type: ignore[arg-type]
        labels = read_labels(st.dcm.labels) if st.dcm.labels else []
        rows = min(2048, st.eval.batch_size * lengths.longest)
        known = {"names": names, "others": others, "labels": labels}
        return PlanInputs(
            "trajectory", st, dims, source, lengths, dtype or st.models.dtype, tuple([*names, *others]), 1, rows,
            known=known,
        )  # fmt: skip

    @classmethod
    def stage_costs(cls, inputs: Any, device: Any) -> list:
        """Every stage (`trajectory_costs`)."""
        k = inputs.known
        costs = trajectory_costs(
            inputs.meter(device), inputs.settings, k["names"], k["others"], k["labels"], k.get("circuits")
        )
        return costs

    @classmethod
    def with_batch(cls, settings: Any, cost: Any, batch: int) -> Any:
        return replace(settings, eval=replace(settings.eval, batch_size=batch))

    @classmethod
    def from_file(
        cls,
        path: str | Path,
        out: Optional[str] = None,
        progress: bool = True,
        models: Optional[dict] = None,
        task: Optional[str] = None,
    ) -> "TrajectoryStudy":
        settings = load_settings(path)
        for key, value in (models or {}).items():
            if key in ("dtype", "device") and value is not None:
                setattr(settings.models, key, value)
        if task:
            settings.task.name = task
        return cls(settings, out, progress)

    # -- data ---------------------------------------------------------------------------
    @property
    def final(self) -> str:
        return self.names[-1]

    @property
    def first_trained(self) -> str:
        """The first checkpoint after the reference (the first in the list)."""
        return self.names[1]

    def checkpoints(self) -> Checkpoints:
        """The checkpoints, loaded when a stage first computes (the base once, the adapters swapped)."""
        if self._checkpoints is None:
            m = self.st.models
            self._checkpoints = Checkpoints([*self.names, *self.others], dtype=m.dtype, device=m.device)
        return self._checkpoints

    def seed(self, prompts: str) -> int:
        """The seed of one of the study's prompt sets (`prompt_seed`)."""
        return prompt_seed(self.st.task.seed, prompts)

    def options(self) -> dict:
        """Generator options: ``n_boxes``, and the held-out objects where the task splits its objects."""
        return {"n_boxes": self.st.task.n_boxes, **self.task.split_options("eval")}

    def records(self, prompts: str, n: int) -> list:
        """``n`` prompts of the prompt set ``prompts`` (an imported task hands out that set's rows)."""
        return self.task.records(self.tokenizer, n, self.seed(prompts), prompt_set=prompts, **self.options())

    def groups(self, circuit: Circuit, wanted: list[str]) -> list[str]:
        """The circuit's groups a stage patches: ``wanted`` (those with heads), else every group at a position of the
        task's prompts (`analysis_groups`)."""
        from ..circuits.stages.groups import analysis_groups

        return analysis_groups(self.task, self.records("eval", 16), circuit, wanted)

    def desideratum_names(self) -> list[str]:
        """``[dcm] desiderata`` (those the task declares; empty: every desideratum the task declares)."""
        from ...tasks.desiderata import chosen_desiderata

        return chosen_desiderata(self.st.dcm.desiderata, self.task.desiderata)

    def ranking_n(self, name: str) -> int:
        """Ranking prompts of checkpoint ``name``: ``[discovery] runs_n`` at a step the between-run null reads (this
        run's checkpoint there and the other runs'), ``n`` elsewhere."""
        d = self.st.discovery
        return d.runs_n if name in self.runs or name in self.others else d.n

    def prompt_set_sizes(self) -> dict[str, int]:
        """The rows of each prompt set the study scores (for the plan's detectable differences): the ranking set at
        its largest (``runs_n`` where the between-run null reads steps)."""
        d, e = self.st.discovery, self.st.eval
        ranking = max(self.ranking_n(n) for n in [*self.names, *self.others])
        return {
            "eval": e.n,
            "ranking": ranking,
            "curve": d.curve_n,
            "matrix": self.st.scoring.n,
            "cmap": self.st.cmap.n,
        }

    def scorer(self, name: str, prompts: str, n: int):
        from ...circuits.scoring import Scorer

        reference = self.task.reference_records(
            self.tokenizer, self.st.scoring.reference_n, self.seed("reference"), **self.options()
        )
        return Scorer.build(
            self.checkpoints().model(name),
            self.records(prompts, n),
            reference,
            self.st.eval.batch_size,
            self.progress,
            store=self.store,
        )

    def task_inputs(self) -> dict:
        from ...version import __version__

        return {
            "task": asdict(self.st.task),
            "dtype": self.st.models.dtype,
            "vocabulary": vocabulary_digest(self.task),
            "tokenizer": spec_digest(self.base_spec),
            "mechdiff": __version__,
            **rows_inputs(self.task),
        }

    def _reference(self) -> dict:
        return {"reference_n": self.st.scoring.reference_n, "batch_size": self.st.eval.batch_size}

    def check_prompts(self) -> None:
        """Before any weights load: every scored prompt's group (template, token length) has reference prompts."""
        from ...tasks.base import check_reference

        reference = self.task.reference_records(
            self.tokenizer, self.st.scoring.reference_n, self.seed("reference"), **self.options()
        )
        d = self.st.discovery
        ranking = max(self.ranking_n(n) for n in [*self.names, *self.others])
        for prompts, n in (("ranking", ranking), ("curve", d.curve_n), ("matrix", self.st.scoring.n)):
            check_reference(self.records(prompts, n), reference, f"{prompts} prompts")

    # -- stages -------------------------------------------------------------------------
    def accuracy(self, name: str) -> StageRecord:
        from ...methods.trajectory import checkpoint_accuracy

        e = self.st.eval
        return self.cache.run(
            f"accuracy:{name}",
            {"model": self.digests[name], "task": self.task_inputs(), "eval": asdict(e)},
            lambda: checkpoint_accuracy(
                self.checkpoints().model(name), self.records("eval", e.n), e.batch_size, self.progress
            ),
        )

    def circuit(self, name: str) -> StageRecord:
        from ...circuits.positions import task_classes
        from ...methods.trajectory import own_circuit

        d = self.st.discovery

        def compute() -> dict:
            ranker = self.scorer(name, "ranking", self.ranking_n(name))
            res = own_circuit(
                ranker,
                self.scorer(name, "curve", d.curve_n),
                task_classes(ranker),
                d.sizes,
                d.target,
                d.select,
                d.stability_draws,
                self.seed("ranking"),
                self.task.name,
            )
            Circuit.from_dict(res["circuit"]).save(self.dir / "circuits" / f"{label(name)}.json")
            return res

        return self.cache.run(f"circuit:{name}", self._circuit_inputs(name), compute)

    def _circuit_inputs(self, name: str) -> dict:
        # the key names the checkpoint's own ranking count as n (runs_n left out), so a step ranked on n keeps its key
        discovery = {k: v for k, v in asdict(self.st.discovery).items() if k != "runs_n"}
        return {
            "model": self.digests[name],
            "task": self.task_inputs(),
            "discovery": {**discovery, "n": self.ranking_n(name)},
            "scoring": self._reference(),
        }

    def ranking(self, name: str) -> StageRecord:
        """A checkpoint of another run (``[runs]``): its per-prompt attribution on the ranking prompts only (what
        the structure stage compares), as the circuit stage ranks."""
        from ...circuits.curve import prompt_attribution
        from ...circuits.positions import task_classes
        from ...methods.trajectory import encode_array

        def compute() -> dict:
            ranker = self.scorer(name, "ranking", self.ranking_n(name))
            classes = task_classes(ranker)
            return {
                "classes": list(classes),
                "attribution": encode_array(prompt_attribution(ranker, classes).float().numpy()),
            }

        inputs = {
            "model": self.digests[name],
            "task": self.task_inputs(),
            "ranking_n": self.ranking_n(name),
            "scoring": self._reference(),
        }
        return self.cache.run(f"ranking:{name}", inputs, compute)

    def structure(
        self, circuits: dict[str, StageRecord], rankings: Optional[dict[str, StageRecord]] = None
    ) -> StageRecord:
        """The structural null and changes (`structure`) on the float16
        attributions the study commits (`attributions`), every checkpoint on the ranking prompts all share
        (``[discovery] n``), with the between-run null where ``rankings`` holds other runs' checkpoints (``[runs]``);
        and, where those steps have more ranking prompts (``runs_n``), the same at those steps alone on them
        (``dense``)."""
        from ...methods.trajectory import structure_record

        s, rankings = self.st.structure, rankings or {}

        def compute() -> dict:
            n_pairs = s.n_pairs or circuits[self.final].result["n_pairs"]
            classes = circuits[self.final].result["classes"]
            attribution = self.attributions(circuits, rankings)
            return structure_record(
                attribution,
                self.names,
                self.runs,
                classes,
                n_pairs,
                self.st.discovery.n,
                asdict(s),
                self.seed("ranking"),
            )

        inputs = {"circuits": {c: r.key for c, r in circuits.items()}, "structure": asdict(s), "null": NULL}
        if rankings:  # a study without other runs keeps its key
            inputs["runs"] = {o: r.key for o, r in rankings.items()}
        return self.cache.run("structure", inputs, compute)

    def attributions(
        self, circuits: dict[str, StageRecord], rankings: Optional[dict[str, StageRecord]] = None
    ) -> dict[str, Any]:
        """Every checkpoint's per-prompt ranking attribution (the other runs' after the trajectory's) as the study
        commits it, float16 (`to_half`); a ranking of other classes than the
        final circuit's is refused."""
        from ...methods.trajectory import decode_array, to_half

        rankings = rankings or {}
        classes = circuits[self.final].result["classes"]
        odd = [o for o, rec in rankings.items() if rec.result["classes"] != classes]
        if odd:
            raise ValueError(f"{odd} rank other position classes than {self.final}: {classes}")
        every = {**circuits, **rankings}
        return {c: to_half(decode_array(rec.result["attribution"])) for c, rec in every.items()}

    def score(self, name: str, circuits: dict[str, StageRecord]) -> StageRecord:
        from ...methods.trajectory import circuits_scored

        scored = {"final": circuits[self.final], "first trained": circuits[self.first_trained], "own": circuits[name]}

        def compute() -> dict:
            loaded = {k: Circuit.from_dict(rec.result["circuit"]) for k, rec in scored.items()}
            return circuits_scored(self.scorer(name, "matrix", self.st.scoring.n), loaded)

        return self.cache.run(
            f"score:{name}",
            {
                "model": self.digests[name],
                "task": self.task_inputs(),
                "scoring": asdict(self.st.scoring),
                "circuits": {k: r.key for k, r in scored.items()},
            },
            compute,
        )

    def cmap_circuit(self, final: StageRecord) -> Optional[Circuit]:
        """The final circuit cut to the groups CMAP patches (`groups` of ``[cmap] groups``, else of ``[dcm]
        groups``; None: none)."""
        c = Circuit.from_dict(final.result["circuit"])
        groups = self.groups(c, self.st.cmap.groups or self.st.dcm.groups)
        if not groups:
            return None
        return Circuit(
            c.model, c.task, {g: c.groups[g] for g in groups}, {g: c.positions[g] for g in groups}, names=dict(c.names)
        )

    def cmap(self, name: str, final: StageRecord) -> StageRecord:
        from ...methods.trajectory import cmap_gain

        c = self.st.cmap

        def compute() -> dict:
            circuit = self.cmap_circuit(final)
            if circuit is None:
                wanted = c.groups or self.st.dcm.groups or "at a position of the task's prompts"
                return {"skipped": f"the final circuit has no heads in the groups {wanted}"}
            cp = self.checkpoints()
            first = cp.first()
            return cmap_gain(
                first,
                cp.model(name),
                circuit,
                self.records("cmap", c.n),
                c.parts,
                self.st.eval.batch_size,
                self.progress,
            )

        return self.cache.run(
            f"cmap:{name}",
            {
                "first": self.digests[self.names[0]],
                "model": self.digests[name],
                "circuit": final.key,
                "cmap": asdict(c),
                "task": self.task_inputs(),
                **self.class_groups(c.groups),
            },
            compute,
        )

    def desiderata(self, n: int, seed: Optional[int] = None, names: Optional[list[str]] = None) -> dict[str, list]:
        """``n`` pairs of every desideratum (``names``, default `desideratum_names`), drawn with ``seed``
        (default: the DCM prompt set's)."""
        from ...tasks.desiderata import desideratum_pairs

        opts = self.options()
        seed = self.seed("dcm") if seed is None else seed
        return {
            d: desideratum_pairs(
                d, self.tokenizer, n, opts.get("n_boxes"), seed, vocabulary=opts.get("vocabulary"), task=self.task.name
            )
            for d in (self.desideratum_names() if names is None else names)
        }

    def tests(self) -> dict[str, list]:
        """The test pairs of every desideratum: those DCM held out, or ``n_test`` pairs for labels read. Labels
        read were trained on a circuits study's DCM pairs (its ``dcm`` prompt set, whose first pairs any shorter
        draw of that set repeats), so their test pairs are a draw of their own."""
        from ...methods.dcm import split_pairs

        d = self.st.dcm
        if d.labels:
            return self.desiderata(d.n_test, derive(self.st.task.seed, "semantic-test-pairs"))
        config = self.dcm_config()
        return {
            k: split_pairs(v, config.split, config.seed)[2]
            for k, v in self.desiderata(d.n_train + d.n_val + d.n_test).items()
        }

    def dcm_config(self):
        from ..circuits.stages.dcm import dcm_config

        return dcm_config(SimpleNamespace(dcm=self.st.dcm, eval=self.st.eval, task=self.st.task))

    def train_dcm(self, name: str, final: StageRecord, groups: list[str], names: list[str]) -> tuple[list, list]:
        """DCM trained in checkpoint ``name`` over the final circuit's ``groups`` (`groups` of them) on the
        desiderata ``names``, with ``[dcm]``'s pairs and training: the results, and the groups left out (a class
        whose token count differs within a pair, `unpaired_classes`)."""
        from ...methods.dcm import dcm_circuit
        from ..circuits.stages.dcm import unpaired_classes

        d = self.st.dcm
        circuit = Circuit.from_dict(final.result["circuit"])
        desiderata, config = self.desiderata(d.n_train + d.n_val + d.n_test, names=names), self.dcm_config()
        chosen = self.groups(circuit, groups)
        left_out = unpaired_classes(circuit, chosen, desiderata, config.eval_batch)
        chosen = [g for g in chosen if g not in left_out]
        results = dcm_circuit(self.checkpoints().model(name), circuit, desiderata, config, chosen, self.progress)
        return [r.to_dict() for r in results], left_out

    def dcm(self, final: StageRecord) -> StageRecord:
        d = self.st.dcm

        def compute() -> dict:
            if d.labels:
                return {"source": d.labels, "dcm": read_labels(d.labels)}
            if not self.desideratum_names():
                return {"source": f"task {self.task.name} declares no desideratum: DCM not run", "dcm": []}
            results, left_out = self.train_dcm(self.final, final, d.groups, self.desideratum_names())
            out = {"source": f"DCM on the circuit of {self.final}", "dcm": results}
            return {**out, "left_out": left_out} if left_out else out

        return self.cache.run("dcm", self._dcm_inputs(final), compute)

    def _dcm_inputs(self, final: StageRecord) -> dict:
        d = self.st.dcm
        inputs = (
            {"labels": d.labels, "table": key_hash(Path(d.labels).read_text())}
            if d.labels
            else {"model": self.digests[self.final], "circuit": final.key}
        )
        return {**inputs, "dcm": dcm_key(d), "task": self.task_inputs(), **self.class_groups(d.groups)}

    def class_groups(self, wanted: list[str]) -> dict[str, list[str]]:
        """Key inputs naming the classes of several tokens a DCM, CMAP or roles stage may patch
        (`class_groups`; empty, so the keys stay, where every group is one
        named token)."""
        from ..circuits.stages.groups import class_groups

        return class_groups(self.records("eval", 16), wanted)

    def semantic(self, name: str, dcm: StageRecord) -> StageRecord:
        from ...methods.trajectory import semantic

        return self.cache.run(
            f"semantic:{name}",
            {
                "model": self.digests[name],
                "dcm": dcm.key,
                "dcm_settings": dcm_key(self.st.dcm),
                "task": self.task_inputs(),
                "batch_size": self.st.eval.batch_size,
            },
            lambda: {
                "rows": semantic(
                    self.checkpoints().model(name),
                    dcm.result["dcm"],
                    self.tests(),
                    self.st.eval.batch_size,
                    self.progress,
                )
            },
        )

    def role_checkpoints(self) -> list[str]:
        """The checkpoints the roles stage scores: those at ``[roles] steps`` (every one where empty; none without a
        ``[roles]`` section)."""
        r = self.st.roles
        if r is None:
            return []
        return [n for n, s in zip(self.names, self.steps) if not r.steps or s in r.steps]

    def role_sites(
        self, circuits: dict[str, StageRecord], pairs: Optional[dict[str, list]] = None
    ) -> list[tuple[str, str, list]]:
        """The (group, position, heads) whose heads the roles stage scores: the final circuit's groups (`groups`
        of ``[roles] groups``, else of ``[dcm] groups``), each with the heads any checkpoint's own circuit has in
        it (so that a head holding a role early and losing it is scored too; ``[roles] heads = "final"``: the final
        circuit's only), in layer then head order. ``pairs``: those the stage patches (default `role_pairs`),
        whose classes must hold as many tokens in both prompts of a pair."""
        final = Circuit.from_dict(circuits[self.final].result["circuit"])
        scored = circuits.values() if self.st.roles.heads == "any" else [circuits[self.final]]
        own = [Circuit.from_dict(rec.result["circuit"]) for rec in scored]
        from ..circuits.stages.dcm import unpaired_classes

        groups = self.groups(final, self.st.roles.groups or self.st.dcm.groups)
        # a class whose token count differs between a pair's two prompts is patched token for token nowhere: left
        # out, as DCM leaves it out
        unequal = unpaired_classes(final, groups, pairs or self.role_pairs(), self.st.eval.batch_size)
        out = []
        for g in (g for g in groups if g not in unequal):
            pos = final.positions[g]
            heads = {h for c in own if c.positions.get(g) == pos for h in c.groups.get(g, [])}
            out.append((g, pos, sorted(heads, key=lambda h: (h.layer, h.head))))
        return out

    def role_pairs(self) -> dict[str, list]:
        """``[roles] n`` pairs of each desideratum scored (``[roles] desiderata``, else every one the task
        declares), a draw of their own (neither DCM's nor semantic patching's)."""
        r = self.st.roles
        return self.desiderata(r.n, derive(self.st.task.seed, "role-pairs"), r.desiderata or list(self.task.desiderata))

    def roles(self, name: str, circuits: dict[str, StageRecord]) -> StageRecord:
        if self.st.roles.method == "dcm":
            return self.role_dcm(name, circuits)
        from ...methods.roles import head_scores

        def compute() -> dict:
            sites = self.role_sites(circuits)
            scores = head_scores(
                self.checkpoints().model(name), sites, self.role_pairs(), self.st.eval.batch_size, self.progress
            )
            return {"sites": [[g, p, [h.name for h in hs]] for g, p, hs in sites], **scores}

        return self.cache.run(
            f"roles:{name}",
            {
                "model": self.digests[name],
                "task": self.task_inputs(),
                # which steps are scored, by which method and DCM's settings do not change one step's head scores:
                # the key keeps the fields it had before they were added
                "roles": {k: v for k, v in asdict(self.st.roles).items() if k not in DCM_ONLY},
                "dcm_groups": self.st.dcm.groups,
                "circuits": {c: r.key for c, r in circuits.items()},
                "batch_size": self.st.eval.batch_size,
            },
            compute,
        )

    def role_dcm(self, name: str, circuits: dict[str, StageRecord]) -> StageRecord:
        """``[roles] method = "dcm"``: DCM trained in checkpoint ``name`` ``[roles] seeds`` times over the candidate
        heads of the final circuit's groups (`role_sites`: every head any checkpoint's own circuit has there)
        on ``[roles] desiderata`` (else the task's), with ``[dcm]``'s pairs and training but the fixed sparsity
        weight ``[roles] lam`` (`roles_dcm_config`); per role the selection, the seeds' frequencies and the
        per-pair test outcomes of the selection, the floor and layer-matched random heads
        (`dcm_seeds`)."""
        from ...methods.roles import dcm_seeds

        r, d = self.st.roles, self.st.dcm

        def compute() -> dict:
            pairs = self.desiderata(d.n_train + d.n_val + d.n_test, names=r.desiderata or list(self.task.desiderata))
            sites = self.role_sites(circuits, pairs)
            config = roles_dcm_config(self.dcm_config(), r)
            rows = dcm_seeds(self.checkpoints().model(name), sites, pairs, config, r.seeds, r.votes, self.progress)
            return {"method": "dcm", "sites": [[g, p, [h.name for h in hs]] for g, p, hs in sites], "rows": rows}

        return self.cache.run(
            f"roles:{name}",
            {
                "model": self.digests[name],
                "task": self.task_inputs(),
                "roles": {k: v for k, v in asdict(r).items() if k not in ("steps", "n", "threshold")},
                "dcm": dcm_key(d),
                "circuits": {c: rec.key for c, rec in circuits.items()},
                **self.class_groups(r.groups or d.groups),
            },
            compute,
        )

    def edge_checkpoints(self) -> list[str]:
        """The checkpoints the edge stages score (`edge_checkpoints`; none with ``[edges]`` off)."""
        return edge_checkpoints(self.st.edges, self.st.runs, self.names)

    def edge_prompts(self) -> int:
        """Ranking prompts the edge stages score: those every scored checkpoint's ranking shares (the first rows of
        the ranking set, as the structure stage reads them)."""
        return min(self.ranking_n(n) for n in self.edge_checkpoints())

    def edge_scores(self, name: str) -> StageRecord:
        """Checkpoint ``name``'s per-prompt edge attribution (float16) on the ranking prompts, with the node
        ranking's metric and position-wise mean ablation (`task_graph`)."""
        from ...methods.edge_structure import encode_half
        from ...methods.knowledge.graph import Graph
        from ...methods.knowledge.task_graph import group_ablations, prompt_edge_scores, task_batches

        e, n = self.st.edges, self.edge_prompts()

        def compute() -> dict:
            ranker = self.scorer(name, "ranking", n)  # the node ranking's prompts and metric
            model = self.checkpoints().model(name)
            graph = Graph.for_model(model)
            reference = self.task.reference_records(
                self.tokenizer, self.st.scoring.reference_n, self.seed("reference"), **self.options()
            )
            scores = prompt_edge_scores(
                model,
                graph,
                task_batches(ranker.records, e.batch_size, ranker.metric),
                group_ablations(model, graph, reference, e.batch_size),
                e.method,
                e.ig_steps,
                self.progress,
            )
            return {"graph": graph.to_dict(), "prompts": n, "metric": ranker.metric, "scores": encode_half(scores)}

        return self.cache.run(f"edges:{name}", self._edge_inputs(name), compute)

    def _edge_inputs(self, name: str) -> dict:
        e = self.st.edges
        return {
            "model": self.digests[name],
            "task": self.task_inputs(),
            "prompts": self.edge_prompts(),
            "scoring": self._reference(),
            "edges": {"method": e.method, **({"ig_steps": e.ig_steps} if e.method == "eap-ig" else {})},
        }

    def edges(self, scored: dict[str, StageRecord]) -> StageRecord:
        """Edge overlap beside node overlap across the scored checkpoints (`edge_structure`), with
        ``[structure]``'s splits, resamples and margin and the structure stage's seed."""
        from ...methods.edge_structure import decode_half, edge_structure
        from ...methods.knowledge.graph import Graph

        s = self.st.structure

        def compute() -> dict:
            g = next(iter(scored.values())).result["graph"]
            graph = Graph(g["n_layers"], g["n_heads"], g["n_kv_heads"], bool(g.get("parallel", False)))
            scores = {c: decode_half(rec.result["scores"]) for c, rec in scored.items()}
            return edge_structure(
                scores, graph, self.st.edges.n, s.draws, self.seed("ranking"), s.resamples, s.resample_splits, s.margin
            )

        inputs = {
            "scores": {c: r.key for c, r in scored.items()},
            "n": self.st.edges.n,
            "structure": {k: getattr(s, k) for k in ("draws", "resamples", "resample_splits", "margin")},
        }
        return self.cache.run("edges", inputs, compute)

    # -- the whole study ----------------------------------------------------------------
    def stages(self) -> dict[str, Any]:
        """Every stage in order: one checkpoint at a time where a stage needs one model (fewest swaps)."""
        accuracy = {n: self.accuracy(n) for n in self.names}
        circuits = {n: self.circuit(n) for n in [self.final, *self.names[:-1]]}
        circuits = {n: circuits[n] for n in self.names}
        others = {o: self.accuracy(o) for o in self.others}
        rankings = {o: self.ranking(o) for o in self.others}
        structure = self.structure(circuits, rankings)
        scores = {n: self.score(n, circuits) for n in self.names}
        cmap = {n: self.cmap(n, circuits[self.final]) for n in self.names[1:]}
        dcm = self.dcm(circuits[self.final])
        semantic = {n: self.semantic(n, dcm) for n in self.names}
        roles = {n: self.roles(n, circuits) for n in self.role_checkpoints()}
        scored = {n: self.edge_scores(n) for n in self.edge_checkpoints()}
        edges = {"edges": self.edges(scored)} if scored else {}  # [edges] off: no edge stage, no key
        return {
            **edges,
            "roles": roles,
            "runs": {"accuracy": others, "ranking": rankings},
            "accuracy": accuracy,
            "circuits": circuits,
            "structure": structure,
            "scores": scores,
            "cmap": cmap,
            "dcm": dcm,
            "semantic": semantic,
        }

    def run_checkpoints(self, names: list[str], poll: float = 10.0) -> None:
        """The stages of ``names`` only, so that several processes can share the cores (each with its own
        activation store): their accuracy and own circuit; once the final and first trained checkpoints'
        circuits are in the cache (written by whichever process has them), their scores, CMAP and semantic
        patching (and, in the process given the final checkpoint, the structure and DCM stages once every
        circuit is cached); with ``[edges]`` on, the edge scores of ``names`` and, in the final checkpoint's process
        once every edge score is cached, the edge comparison. A plain run afterwards finds every stage cached and
        writes the report."""
        unknown = [n for n in names if n not in self.names]
        if unknown:
            raise ValueError(f"{unknown} are not checkpoints of this study ({', '.join(self.names)})")
        store = Path(self.store)
        self.store = str(store.with_name(f"{store.stem}-{'-'.join(label(n) for n in names)}{store.suffix}"))
        with run_lock(self.dir / "stages" / "locks" / "-".join(label(n) for n in names)):
            for n in names:
                self.accuracy(n)
                self.circuit(n)
            self._wait([self.final, self.first_trained])
            circuits = {n: self.circuit(n) for n in {self.final, self.first_trained, *names}}
            for n in names:
                self.score(n, circuits)
                if n != self.names[0]:
                    self.cmap(n, circuits[self.final])
            dcm = self.dcm(circuits[self.final]) if self.final in names else None
            if dcm is None:
                self._wait_for("dcm", lambda: self.cache.ready("dcm", self._dcm_inputs(circuits[self.final])))
                dcm = self.dcm(circuits[self.final])
            for n in names:
                self.semantic(n, dcm)
            if self.final in names or self.st.roles:
                self._wait(self.names)
                every = {n: self.circuit(n) for n in self.names}
            if self.final in names:  # the other runs' checkpoints too (their accuracy, their ranking)
                for o in self.others:
                    self.accuracy(o)
                self.structure(every, {o: self.ranking(o) for o in self.others})
            for n in (n for n in names if n in self.role_checkpoints()):
                self.roles(n, every)
            for n in (n for n in names if n in self.edge_checkpoints()):
                self.edge_scores(n)
            if self.final in names and self.edge_checkpoints():
                for n in self.edge_checkpoints():
                    self._wait_for(f"edges:{n}", lambda n=n: self.cache.ready(f"edges:{n}", self._edge_inputs(n)))
                self.edges({n: self.edge_scores(n) for n in self.edge_checkpoints()})

    def _wait(self, names: list[str], poll: float = 10.0) -> None:
        for n in names:
            self._wait_for(f"circuit:{n}", lambda: self.cache.ready(f"circuit:{n}", self._circuit_inputs(n)), poll)

    @staticmethod
    def _wait_for(what: str, ready: Any, poll: float = 10.0) -> None:
        while not ready():
            log.info("waiting for %s (another process computes it)", what)
            time.sleep(poll)

    def write(self, results: dict[str, Any]) -> Path:
        from ...report.html import write_html
        from .report import write_trajectory_report

        self.write_attributions(results)
        report = write_trajectory_report(self, results)
        write_html(self.dir)  # report.html: read from what was just written (as `mechdiff view` does)
        return report

    def write_attributions(self, results: dict[str, Any]) -> Path:
        """``attributions.h5``: the per-prompt attributions behind the structure tables, float16, gzip, each
        checkpoint at the pairs some top-n of the structure stage selected
        (`write_attributions`), so the tables recompute from committed files."""
        from ...methods.trajectory import ATTRIBUTIONS, write_attributions

        st = results["structure"].result
        rankings = results.get("runs", {}).get("ranking", {})
        attribution = self.attributions(results["circuits"], rankings)
        kept = {
            c: sorted(set(st["kept"][c]) | set(st.get("dense", {}).get("kept", {}).get(c, []))) for c in attribution
        }
        meta = {
            "structure": asdict(self.st.structure),
            "n_pairs": st["n_pairs"],
            "seed": st["seed"],
            "ranking_n": self.st.discovery.n,
            "steps": dict(zip(self.names, self.steps)),
            "runs": self.runs,
        }
        classes = results["circuits"][self.final].result["classes"]
        return write_attributions(self.dir / ATTRIBUTIONS, attribution, kept, classes, meta)

    def settings_record(self) -> dict:
        return {
            **{k: asdict(getattr(self.st, k)) for k in SECTIONS if getattr(self.st, k) is not None},
            "source": self.st.source,
            "model_digests": self.digests,
        }
