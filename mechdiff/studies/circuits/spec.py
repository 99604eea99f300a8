"""The circuits study's task file (``tasks/*.toml`` of kind "circuits"): its sections (`RunSpec`: ``[models]``,
``[eval]``, ``[positions]``, ``[discovery]``, ``[scoring]``, ``[cmap]``, ``[reproduce]``, ``[sets]``,
``[inference]``, with the shared ``[task]``, ``[dcm]``, ``[output]`` and ``[study]``), which options a stage key reads
(`section_inputs`), and the checks `load_spec` runs before anything loads. The schema machinery every kind shares
(`mechdiff.studies.spec`: `section`, `load_sections`, `SpecError`) reads the file."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import tomllib

from ...circuits.curve import SELECT, SIZES, TARGET
from ...common.inference import margins_of
from ...common.metrics import METRIC_ALIASES, metric_name
from ...methods.dcm import RANDOM_POOLS
from ...patching.path import SCORES
from ...tasks.base import is_relation_file
from ...tasks.desiderata import desideratum_name
from ...tasks.entity_tracking.pairs import COUNTERFACTUALS
from ..spec import (
    GROUP_OPTIONS,
    DcmSection,
    EvalSection,
    OutputSection,
    Real,
    SpecError,
    StudySection,
    TaskSection,
    _check_desiderata,
    _check_groups,
    _check_task,
    check_task,
    line_of,
    load_sections,
    section,
    task_group_names,
)


@section
class ModelsSection:
    base: str = "smollm2-et-early"
    finetunes: list[str] = field(default_factory=lambda: ["smollm2-et"])
    dtype: str = "float32"
    device_map: Optional[str] = None
    device: Optional[str] = None  # one device for every model: cpu, cuda, cuda:1 (device_map: auto shards)
    remote: bool = False  # every forward pass on NDIF (nnsight; API key from $NDIF_API_KEY)


@section
class StudyEval(EvalSection):
    """A circuits study's ``[eval]``: with ``floor``, the accuracy whose lower bound a model must exceed for the
    stages that explain a behaviour (position scan, circuit, pruning, matrix row, DCM, CMAP into it) to run for
    it (None: the task's chance level (entity tracking: 1 / n_boxes; IOI: 1/2), else derived from the accuracy
    prompts, `answer_chance`)."""

    floor: Optional[Real] = None


@section
class PositionsSection:
    """The position scan: greedy over the task's position classes, every head kept at the chosen ones."""

    n: int = 40  # prompts (0: no scan)
    stop_at: Real = 0.95  # stop once the chosen classes keep this faithfulness (accuracy)
    max_steps: int = 5


@section
class DiscoverySection:
    # "curve": every (head, position class) pair ranked by mean-ablation attribution on n prompts, nested
    # circuits scored on curve_n others, the smallest reaching `target` faithfulness is the circuit: its interval's
    # lower bound reaching it (select = "low") or its point estimate ("value").
    # "path": path patching as the paper (steps of the task's plan, top_k heads each) on n pairs.
    method: str = "curve"
    n: int = 160
    sizes: list[Real] = field(default_factory=lambda: list(SIZES))  # fractions of all (head, class) pairs
    target: Real = TARGET
    select: str = SELECT[0]
    curve_n: int = 200  # prompts scoring the nested circuits (disjoint from those ranking and reporting)
    stability_draws: int = 200  # bootstrap resamples of the ranking prompts (selection frequency)
    # path: receivers each step keeps for the next; a step not named keeps its plan's own k (never overridden)
    top_k: dict[str, int] = field(default_factory=dict)
    screen: bool = False  # path: exact path patching of every sender (suffix runs make it cheap)
    screen_multiple: Real = 2.0
    # path: a sender's score over the prompts, "ratio_of_means" (mechdiff) or "mean_of_ratios" (the paper's)
    score: str = SCORES[0]
    # path: heads each step puts in the circuit, cut from its scores (default: top_k, the receivers the next step
    # reads); the paper keeps 20/5/10/5 receivers on LLaMA-7B and cuts 58/10/25/5 from the same scores
    circuit_k: dict[str, int] = field(default_factory=dict)
    # path: step -> position of the counterfactual prompt its senders' values are read at (a position class, e.g.
    # "labels": one of its indices at random per sender and prompt); a step not named reads them at the clean
    # prompt's sender index. The paper reads D's at a random box label: { D = "labels" }
    source_position: dict[str, str] = field(default_factory=dict)
    # path: pairs whose activations are held at once (each group split into parts of at most this many, each part
    # run again at every pass over the parts: memory bounded by the part, two forwards a pair and step, four with the
    # attribution screen); unset: every pair's
    pairs_per_part: Optional[int] = None
    # path: how each clean prompt's counterfactual is built, where the task's pairs offer a choice (entity
    # tracking): "fresh" (mechdiff's: a new context, another box, a query letter absent from it) or "paper" (the
    # paper's data_utils.load_pp_data: the clean set's prompt querying box (j + 1) mod n_boxes, its query letter
    # overwritten by a uniform draw from A-Z that may be a label of its context)
    counterfactual: str = COUNTERFACTUALS[0]
    # path: what a model's own seed ([discovery.models.NAME] seed) redraws: "pairs" (its clean prompts and their
    # counterfactuals) or "counterfactuals" (the paper's: every model sees the study's clean prompts)
    model_seed_redraws: str = "pairs"
    # path: per model, any of top_k, circuit_k and seed (its discovery pairs' seed), e.g.
    # [discovery.models.goat-7b] top_k = {...}; a model not named uses the section's
    models: dict[str, dict] = field(default_factory=dict)


#: Options added to a section after results were committed, at the value every earlier study ran with: a stage key
#: leaves such an option out while it has that value, so the committed studies' keys do not move.
KEYED_WHEN_SET = {
    "discovery": {
        "score": SCORES[0],
        "circuit_k": {},
        "models": {},
        "source_position": {},
        "pairs_per_part": None,
        "counterfactual": COUNTERFACTUALS[0],
        "model_seed_redraws": "pairs",
    },
    "scoring": {"prune_disjoint": False, "models": {}},
}
#: Options whose default changed after results were committed: unset (the new default), a stage key reads the value
#: those studies were keyed with. Unset ``top_k`` now means each step's plan ``k``; the committed studies left it at
#: entity tracking's A-D ``k``, the same numbers its plan gives, and only path patching reads it (a circuit stage
#: keys it by `discovery_inputs`).
KEYED_AS = {"discovery": {"top_k": ({}, {"A": 8, "B": 3, "C": 5, "D": 3})}}
#: ``[scoring]`` options only the matrix's random control reads: pruning, keyed on the section, reads them at the
#: values the committed studies were keyed with (``random_prompts`` left out), so the control moves the matrix alone.
MATRIX_ONLY = {"random_draws": 20, "random_prompts": None}
#: What ``[discovery.models.NAME]`` may set for one model.
PER_MODEL_DISCOVERY = ("top_k", "circuit_k", "seed")
#: What ``[scoring.models.NAME]`` may set for one model (its pruning's seed).
PER_MODEL_SCORING = ("seed",)


def section_inputs(name: str, section: Any) -> dict:
    """A section's options as a stage key reads them (`KEYED_WHEN_SET` left out at their old values)."""
    quiet, keyed_as = KEYED_WHEN_SET.get(name, {}), KEYED_AS.get(name, {})
    out = {k: v for k, v in asdict(section).items() if not (k in quiet and v == quiet[k])}
    for k, (unset, old) in keyed_as.items():
        if out.get(k) == unset:
            out[k] = old
    return out


def discovery_inputs(section: "DiscoverySection", plan_k: Optional[dict[str, int]] = None) -> dict:
    """``[discovery]`` as a circuit stage's key reads it (`section_inputs`), ``top_k`` as the study uses it:
    path patching's each step of the task's plan (``plan_k``: step -> its plan ``k``) at the file's value where it
    names the step, else the plan's; the curve reads none, so its key holds the constant every committed study was
    keyed with (`KEYED_AS`), whatever the file sets."""
    out = section_inputs("discovery", section)
    if section.method == "path":
        out["top_k"] = {step: section.top_k.get(step, k) for step, k in (plan_k or {}).items()}
    else:
        out["top_k"] = KEYED_AS["discovery"]["top_k"][1]
    return out


@section
class ScoringSection:
    n: int = 200  # fresh held-out prompts per cell of the circuit x model matrix
    reference_n: int = 500  # held-out-object prompts whose position-wise means ablate
    random_draws: int = 100  # layer- and position-matched random circuits of each model's own circuit
    # matrix prompts each random circuit is scored on (a seeded subset stratified by template and token length;
    # 0: every one): 100 draws x 40 prompts cost what 20 draws x 200 prompts did
    random_prompts: int = 40
    completeness_draws: int = 2
    completeness_groups: list[str] = field(default_factory=list)  # groups removed whole (empty: as [dcm] groups)
    prune_n: int = 16  # prompts the pruning decides on (disjoint from those reported)
    # "greedy" (mechdiff): a pair stays if |F(C\(K+v)) - F(C\K)| / F(C) > prune_threshold, K grown greedily over
    # the whole circuit; "paper": per group, K from pairwise removals, v stays iff F(C\K)/F(C\(K+v)) - 1 >= threshold
    prune_rule: str = "greedy"
    prune_threshold: Real = 0.01
    # "prob" (the task's continuous metric: answer probability, or the logit difference on a logit_diff task) or
    # "accuracy" (the paper's); the continuous one resolves small sets
    prune_metric: str = "prob"
    prune_steps: int = 1  # greedy: steps growing K in the minimality search (0: K = {})
    prune_candidates: int = 1  # greedy: pairs tried per step (drawn at random)
    prune_share: Real = 0.3  # paper: K is at most ceil(prune_share |group|) heads
    prune: bool = True
    # true (the paper's): a head in two groups at one position is pruned with the later group only (A minus B)
    prune_disjoint: bool = False
    # per model, the pruning's seed ([scoring.models.NAME] seed = 10): it draws that model's mean-ablation reference
    # for pruning and the greedy rule's candidates (the paper's minimality seeds each model's run: LLaMA 10, Goat 56,
    # FLoAT 10); a model not named prunes with the study's reference and prompt seed
    models: dict[str, dict] = field(default_factory=dict)


@section
class CmapSection:
    n: int = 200
    parts: list[str] = field(default_factory=lambda: ["z", "q", "k", "v", "qk"])
    groups: list[str] = field(default_factory=list)  # as [dcm] groups
    isolate: bool = True  # scope "base": restore the base's other head outputs for Q/K/V (see mechdiff.methods.cmap)
    # "base" (mechdiff): the base's found circuit, K/V up to and including each group's position;
    # "paper": the fine-tune's pruned circuit cut per group to the heads its DCM selected (`selection`), K/V strictly
    # before the position, every head's output at every position but the last reset to the base's (Q/K/V: last-token
    # groups only)
    scope: str = "base"
    selection: dict[str, str] = field(default_factory=dict)  # scope "paper": group -> desideratum whose DCM selection
    # cuts it (a group not named keeps every head)
    n_random: int = 20  # draws of layer-matched random heads per group and part (the control), each kept
    # prompts each draw runs on (a seeded subset stratified by template and token length; 0: every one):
    # 20 draws x 30 prompts cost what 3 draws x 200 prompts did
    random_prompts: int = 30


@section
class ReproduceSection:
    """Score a released circuit on every model, beside the published figures (empty circuit: off)."""

    circuit: str = ""  # e.g. tasks/circuits/llama-7b-entity-tracking.json
    published: str = ""  # the paper's figures (default: the copy shipped in mechdiff/data)
    n: int = 500  # prompts (the paper: 500)
    only: bool = False  # true: the reproduction table only, not the rest of the study


#: The prompt sets ``[sets] nested = true`` draws as first-N of one draw, as the paper's discovery (300), pruning
#: (100) and evaluation (500) prompts are the first lines of one file: the accuracy (``eval``), path discovery, pruning
#: and the circuit x model matrix.
NESTED_SETS = ("eval", "discovery", "prune", "matrix")


@section
class SetsSection:
    """How a study's prompt sets relate. Default: every set disjoint from every other by item (a row's clean
    prompt, or the task's ``--item`` field). ``nested = true``: `NESTED_SETS` are first-N of one draw (the
    paper's); a departure from the disjointness rule the report and ``run.json`` state."""

    nested: bool = False


@section
class InferenceSection:
    """Report-only settings of the inference layer (docs/inference.md), read by the report and ``mechdiff restate``
    and never by a stage key, so changing them rewrites the report from cached stages. ``margins``: each kind of
    measure's equivalence margin ("same" is written only where the two one-sided tests pass against it, and the
    sentence names it); a file names those it changes, the others keep their defaults
    (`mechdiff.common.inference.MARGINS`): ``margins = { accuracy = 0.03, logit_difference = 1.0 }``."""

    margins: dict[str, Real] = field(default_factory=margins_of)


SECTIONS = {
    "task": TaskSection,
    "models": ModelsSection,
    "eval": StudyEval,
    "positions": PositionsSection,
    "discovery": DiscoverySection,
    "scoring": ScoringSection,
    "dcm": DcmSection,
    "cmap": CmapSection,
    "output": OutputSection,
    "reproduce": ReproduceSection,
    "study": StudySection,
    "sets": SetsSection,
    "inference": InferenceSection,
}
REQUIRED = {"task": ("name",), "models": ("base",)}
#: Fields with a fixed set of values (lists: every item), checked with the line before anything loads.
CHOICES = {
    ("discovery", "method"): ("curve", "path"),
    ("discovery", "select"): SELECT,
    ("discovery", "score"): SCORES,
    ("discovery", "counterfactual"): COUNTERFACTUALS,
    ("discovery", "model_seed_redraws"): ("pairs", "counterfactuals"),
    ("scoring", "prune_metric"): ("prob", "accuracy", *METRIC_ALIASES),  # answer_prob: read as prob
    ("scoring", "prune_rule"): ("greedy", "paper"),
    ("dcm", "random_pool"): RANDOM_POOLS,
    ("dcm", "lam_scale"): ("loss", "absolute"),
    ("dcm", "schedule"): ("steps", "epoch_batches"),
    ("dcm", "circuit"): ("found", "pruned"),
    ("dcm", "cache"): ("auto", "file", "memory", "recompute"),
    ("cmap", "scope"): ("base", "paper"),
    ("cmap", "parts"): ("z", "q", "k", "v", "qk", "qkv"),
}


@dataclass
class RunSpec:
    """A whole study: every section of a task file, defaults filled in."""

    task: TaskSection
    models: ModelsSection
    eval: StudyEval
    discovery: DiscoverySection
    scoring: ScoringSection
    dcm: DcmSection
    cmap: CmapSection
    output: OutputSection
    reproduce: ReproduceSection = field(default_factory=ReproduceSection)
    positions: PositionsSection = field(default_factory=PositionsSection)
    study: StudySection = field(default_factory=StudySection)
    sets: SetsSection = field(default_factory=SetsSection)
    inference: InferenceSection = field(default_factory=InferenceSection)
    source: str = "<defaults>"

    def to_dict(self) -> dict[str, Any]:
        """Every section as the task file spells it (margins' measures with ``_``: ``logit_difference``), so the
        dictionary written out as TOML loads back to this spec."""
        out = {name: asdict(getattr(self, name)) for name in SECTIONS}
        out["inference"]["margins"] = {m.replace(" ", "_"): v for m, v in out["inference"]["margins"].items()}
        return out

    @property
    def model_names(self) -> list[str]:
        return [self.models.base, *self.models.finetunes]


def default_spec() -> RunSpec:
    """The embedded default study (tasks/entity_tracking.toml): smollm2-et-early against smollm2-et, with entity
    tracking's desiderata and groups (the sections' own defaults take them from the task)."""
    spec = bare_spec()
    spec.dcm.desiderata = ["positional", "object_value", "label_value"]
    spec.dcm.groups = ["last", "query_label"]  # the paper's groups A/B and C/D sit there
    spec.cmap.groups = ["last", "query_label"]
    return spec


def bare_spec() -> RunSpec:
    """Every section at its own defaults: no groups, desiderata or ``top_k`` of any task (DCM and CMAP then take
    every group at a position of the task's prompts and every desideratum it declares; path patching each step's
    plan ``k``)."""
    return RunSpec(**{name: cls() for name, cls in SECTIONS.items()})


def study_spec(path: Optional[str | Path], task: Optional[str] = None) -> RunSpec:
    """The spec a study runs: the task file ``path``'s, else the embedded default study's, with ``[task] name``
    replaced by ``task`` where given. Without a file, ``task`` gets its own groups, desiderata and ``top_k``
    (`bare_spec`), never entity tracking's; with one, the groups and desiderata the file names are checked
    against ``task`` (refused, naming them, before anything loads)."""
    if task is None:
        return load_spec(path) if path is not None else default_spec()
    check_task(task)
    spec = load_spec(path) if path is not None else bare_spec()
    spec.task.name = task
    if path is not None:
        _check_override(spec, task, str(path))
    _check_plan(f"{path or 'the default study'} with --task {task}: ", spec.discovery.method, task)
    return spec


def _check_override(spec: RunSpec, task: str, path: str) -> None:
    """A task file's groups (``[dcm]``/``[cmap] groups``, ``[scoring] completeness_groups``, ``[cmap] selection``)
    and ``[dcm] desiderata`` must be ``task``'s where ``--task`` replaces the file's task."""
    known = task_group_names(task)
    for sec, key in GROUP_OPTIONS if known is not None else ():
        unknown = [g for g in getattr(getattr(spec, sec), key) if g not in known]
        if unknown:
            raise SpecError(
                f"{path}: [{sec}] {key} names {unknown}, which task {task} (--task) does not have; its groups are "
                f"{', '.join(sorted(known))} (run {task} without the task file, or with one that leaves {key} out)"
            )
    if spec.dcm.desiderata and not is_relation_file(task):
        from ...tasks.base import get_task

        own = get_task(task).desiderata
        unknown = [d for d in spec.dcm.desiderata if desideratum_name(d) not in own]
        if unknown:
            raise SpecError(
                f"{path}: [dcm] desiderata {unknown} are not task {task}'s (--task); it declares "
                f"{', '.join(sorted(own)) or 'none'} (run {task} without the task file, or with one that leaves "
                "desiderata out)"
            )


def output_dir(task: str) -> str:
    """The results directory of a study of ``task`` whose task file names none: ``results/<task's name>`` (an
    imported task's directory by its recorded name), never another task's directory."""
    from ...runs.stages import label
    from ...tasks.task_directory import load_task_meta

    name = load_task_meta(task)["name"] if Path(task).is_dir() else task
    return f"results/{label(name)}"


def load_spec(path: str | Path) -> RunSpec:
    """Parse and check a task file before anything loads; without ``[output] dir`` the results go to the
    task's own directory (`output_dir`)."""
    built, text = load_sections(path, SECTIONS, REQUIRED, CHOICES)
    built["scoring"].prune_metric = metric_name(built["scoring"].prune_metric)  # one vocabulary: prob
    _check_task(Path(path), text, built["task"].name)
    raw = tomllib.loads(text)  # which sections and keys the file itself sets (built holds the defaults too)
    if "dir" not in (raw.get("output") or {}):
        built["output"].dir = output_dir(built["task"].name)
    _check_paper_stages(Path(path), text, built)
    _check_parts(Path(path), text, built["discovery"])
    _check_pair_options(Path(path), text, built["discovery"], built["task"].name)
    _check_per_model(Path(path), text, built)
    _check_desiderata(Path(path), text, raw.get("dcm"), built["task"].name)
    _check_groups(Path(path), text, raw, built["task"].name)
    _check_margins(Path(path), text, built["inference"])
    _check_plan(f"{path}:{line_of(text, 'discovery', 'method')}: ", built["discovery"].method, built["task"].name)
    return RunSpec(**built, source=str(path))


def _check_margins(path: Path, text: str, section: InferenceSection) -> None:
    """``[inference] margins`` over the defaults (`margins_of`); an unknown
    measure or a margin not above 0 refused with its line before anything loads."""
    try:
        section.margins = margins_of(section.margins)
    except ValueError as err:
        raise SpecError(f"{path}:{line_of(text, 'inference', 'margins')}: {err} (in [inference])") from None


def _check_plan(where: str, method: str, task_name: str) -> None:
    """Path patching (``method = "path"``) reads the task's own plan; a task without one is refused before anything
    loads (`task_plan`)."""
    if method != "path" or is_relation_file(task_name):
        return
    from ...tasks.base import get_task
    from ...tasks.plan import task_plan

    try:
        task_plan(get_task(task_name))
    except ValueError as err:
        raise SpecError(f"{where}{err}") from None


def _check_per_model(path: Path, text: str, built: dict[str, Any]) -> None:
    """``[discovery.models.NAME]`` and ``[scoring.models.NAME]`` name a model of ``[models]`` and set only
    `PER_MODEL_DISCOVERY` (`PER_MODEL_SCORING`), each of its own type (a step -> k table, or an
    integer seed)."""
    models = built["models"]
    known = [models.base, *models.finetunes]
    for sec, allowed in (("discovery", PER_MODEL_DISCOVERY), ("scoring", PER_MODEL_SCORING)):
        for name, own in built[sec].models.items():
            headers = (f"{sec}.models.{name}", f'{sec}.models."{name}"')  # bare or quoted name
            line = next((n for n in (line_of(text, None, h) for h in headers) if n), line_of(text, sec, "models"))
            where = f"{path}:{line}: [{sec}.models.{name}]"
            if name not in known:
                raise SpecError(f"{where} names no model of [models] ({', '.join(known)})")
            if set(own) - set(allowed):
                raise SpecError(f"{where} may set {', '.join(allowed)}; got {own!r}")
            for key, value in own.items():
                _check_per_model_value(where, key, value)


def _check_per_model_value(where: str, key: str, value: Any) -> None:
    """One per-model value: a step -> k table (``top_k``, ``circuit_k``) or an integer ``seed``."""
    steps_ok = key != "seed" and isinstance(value, dict) and all(isinstance(k, int) for k in value.values())
    if not (steps_ok or (key == "seed" and isinstance(value, int) and not isinstance(value, bool))):
        raise SpecError(f"{where} {key} = {value!r}: give a step -> k table (or an integer seed)")


def _check_parts(path: Path, text: str, discovery: "DiscoverySection") -> None:
    """``[discovery] pairs_per_part``, where set, is for path discovery and at least 1 (an integer: `SCHEMA`)."""
    size = discovery.pairs_per_part
    if size is not None and discovery.method != "path":
        raise SpecError(
            f"{path}:{line_of(text, 'discovery', 'pairs_per_part')}: [discovery] pairs_per_part holds path "
            f"patching's pairs in parts; method = {discovery.method!r} reads no pairs: remove it (or use path)"
        )
    if size is not None and size < 1:
        raise SpecError(
            f"{path}:{line_of(text, 'discovery', 'pairs_per_part')}: [discovery] pairs_per_part = {size!r}: give a "
            "number of pairs of at least 1 (or leave it out to hold every pair's activations)"
        )


#: ``[discovery]`` options the task's pair generator must accept where set off their default: option -> (default,
#: the generator's keyword that carries it).
PAIR_OPTIONS = {"counterfactual": (COUNTERFACTUALS[0], "counterfactual"), "model_seed_redraws": ("pairs", "clean_seed")}


def _check_pair_options(path: Path, text: str, discovery: "DiscoverySection", task_name: str) -> None:
    """``[discovery] counterfactual`` and ``model_seed_redraws``, off their defaults, need path discovery and a task
    whose pairs take them (entity tracking); refused with the line before anything loads."""
    from ...tasks.base import get_task

    for key, (default, keyword) in PAIR_OPTIONS.items():
        value = getattr(discovery, key)
        if value == default:
            continue
        where = f"{path}:{line_of(text, 'discovery', key)}: [discovery] {key} = {value!r}"
        if discovery.method != "path":
            raise SpecError(f"{where} builds path patching's pairs; method = {discovery.method!r} reads none")
        if is_relation_file(task_name) or keyword not in get_task(task_name).options:
            raise SpecError(f"{where}: task {task_name}'s pairs offer no such choice; remove it (entity tracking does)")


def _check_paper_stages(path: Path, text: str, built: dict[str, Any]) -> None:
    """Stages that read the pruned circuit need pruning on; CMAP's DCM cut names desiderata DCM trains."""
    scoring, dcm, cmap = built["scoring"], built["dcm"], built["cmap"]
    if not scoring.prune and (dcm.circuit == "pruned" or cmap.scope == "paper"):
        key, section = ("circuit", "dcm") if dcm.circuit == "pruned" else ("scope", "cmap")
        raise SpecError(
            f"{path}:{line_of(text, section, key)}: [{section}] {key} reads the pruned circuit but "
            "[scoring] prune = false; set prune = true"
        )
    wanted = {desideratum_name(d) for d in dcm.desiderata}
    unknown = {g: d for g, d in cmap.selection.items() if desideratum_name(d) not in wanted}
    if unknown:
        raise SpecError(
            f"{path}:{line_of(text, 'cmap', 'selection')}: [cmap] selection names desiderata DCM does not "
            f"train ({unknown}); add them to [dcm] desiderata ({', '.join(dcm.desiderata)})"
        )
