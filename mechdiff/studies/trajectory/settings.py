"""The trajectory task file (``[study] kind = "trajectory"``): its sections, their checks before anything loads
(`load_settings`), and what the stages read off them (the checkpoints' steps, the other runs, the edge and role
checkpoints, a DCM table read as labels)."""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Optional

from ...circuits.curve import SELECT, SIZES, TARGET
from ...methods.checkpoints import trajectory_specs
from ...methods.dcm import DCMConfig
from ...methods.edge_structure import EDGES_N
from ...methods.knowledge.task_graph import EDGE_BATCH, IG_STEPS, METHODS
from ...methods.roles import SEEDS, THRESHOLD, VOTES
from ...methods.structure import (
    MARGIN,
    MATCHED_LEVELS,
    RESAMPLE_SPLITS,
    STABLE,
    STRUCTURE_DRAWS,
    STRUCTURE_RESAMPLES,
)
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
    computed; the structure stage compares their circuits with the trajectory's at the same step, and at each
    accuracy of ``levels`` each run's first step read at or above it (runs that learn at other speeds compared at
    matched accuracy)."""

    dirs: list[str] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    levels: list[float] = field(default_factory=lambda: list(MATCHED_LEVELS))


@section
class EdgesSection:
    """Edges as well as nodes (`edge_structure`): the EAP graph scored per prompt at ``steps``. Off by
    default: on SmolLM2 the scores of 256 prompts took 30 to 80 min a checkpoint on one CPU thread beside a study on
    two cores, where its node ranking takes about a minute (docs/trajectories.md, "Edges beside nodes"; ``--plan``
    counts both edge stages, `stages.edges`)."""

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
