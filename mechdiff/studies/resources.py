"""The resource plan of a circuits study: each stage's peak memory (host and device) and time, predicted from
the models' configs, the task's token lengths, each stage's ``n`` and batch size and the dtype, on this machine
or on a named device (:mod:`mechdiff.models.devices`); for a stage that does not fit, what would.

Nothing loads: the configs are the shipped ones or the models' own metadata (:func:`~mechdiff.models.footprint.
model_dims`), the token lengths come from the task's prompts under the base's tokenizer or, where that is absent
(the paper's models without their weights), under the embedded SmolLM2 tokenizer (an estimate, said so).

Each stage is counted by its algorithm (:mod:`mechdiff.studies.circuits`), in forward passes of the model:

- ``accuracy``: one forward per prompt.
- scorer stages (``positions``, ``prune``, ``matrix``, ``reproduction``; curve discovery): the reference prompts
  whose means ablate, the full model, and one mean-ablated forward per prompt for every circuit scored (the
  position scan: every remaining class at each step; pairwise pruning: each head and each pair of a group).
  Pruning resumes each removal from F(C)'s run, which it keeps for every prompt (every layer's residual stream,
  keys and values: this grows with ``prune_n``).
- path discovery: clean and counterfactual runs of every pair, kept (every layer's ``z``, the residual stream,
  keys and values: this grows with ``n``), then per step every head below the receivers as a sender: a one-token
  frozen run over half the layers and a receiver run of the tokens after the receiver position over half the
  layers (the receivers' layers are not known before discovery: the middle is assumed).
- DCM: per desideratum a pair cache (two forwards a pair; every layer's keys and values of every pair, streamed
  through a scratch HDF5 file under TMPDIR, one desideratum's file at a time: disk grows with ``n``, memory holds
  one batch's rows), then per group training (forward and backward to the activations, the weights frozen: two
  forwards' FLOPs), validation and test runs from the group's position and lowest layer; it holds two models.
- CMAP: per prompt the base and the fine-tune once, then one patched base run per scope and part, from the scope's
  lowest layer (a ``z`` patch from its position, other parts over every token); two models.

Where a run has found them (``known``: :func:`found_in`), the circuits, the position scan's steps and the share
of pairs greedy pruning searched are the run's; before it they are assumed (the plan's notes say which).

Memory is the models' weights, what the stage keeps beside them and the transient activations of its largest
batch (:func:`~mechdiff.models.footprint.forward_bytes`, :func:`~mechdiff.models.footprint.backward_bytes`);
scratch files are counted apart, against the disk free under TMPDIR.
Time is FLOPs over the device's throughput (measured here, per CPU second; a named device's stated share of peak)
plus the weights each pass reads (the blocks it runs and the unembedding) over the device's bandwidth: a pass of few
rows (pruning's and DCM's short suffix runs) takes the time its weights take to read, whatever its FLOPs
(:mod:`mechdiff.models.devices`); and on this machine each pass's fixed cost (Python, the intervention layer's
trace: :func:`pass_overhead`). Passes are counted at each stage's batch size.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from statistics import mean
from typing import Any, Callable, Optional

from ..methods.dcm import DCMConfig
from ..models.devices import COMMON_GPU_DISK, GIB, Device
from ..models.footprint import (
    Dims,
    backward_bytes,
    dtype_bytes,
    forward_bytes,
    forward_flops,
    held_pair_bytes,
    model_dims,
)
from .spec import RunSpec

#: The tokenizer that estimates token lengths where a model's own is absent.
STAND_IN_TOKENIZER = "smollm2-135m"
#: Prompts drawn to measure the task's token lengths.
LENGTH_SAMPLE = 64


@dataclass(frozen=True)
class Lengths:
    """The task's token lengths: mean and longest prompt, mean tokens from each named position to the end
    (inclusive), the number of position classes a scan tries, and the tokenizer that counted them."""

    tokens: float
    longest: int
    suffix: dict[str, float]
    classes: int
    tokenizer: str

    def after(self, position: Optional[str]) -> float:
        """Tokens computed by a suffix run from ``position`` (the whole prompt where it is not a named position)."""
        return self.suffix.get(position or "", self.tokens)


def task_lengths(spec: RunSpec) -> Lengths:
    """Token lengths of ``LENGTH_SAMPLE`` of the study's prompts under the base's tokenizer, else the stand-in's."""
    from ..models.loading import load_tokenizer
    from ..models.resolve import resolve_spec
    from ..runs.seeds import prompt_seed
    from ..tasks.base import get_task

    try:
        tokenizer, used = load_tokenizer(resolve_spec(spec.models.base)), spec.models.base
    except (OSError, ValueError):
        tokenizer = load_tokenizer(resolve_spec(STAND_IN_TOKENIZER))
        used = f"{STAND_IN_TOKENIZER}'s (an estimate: {spec.models.base}'s tokenizer is absent)"
    task = get_task(spec.task.name)
    n = min(LENGTH_SAMPLE, len(task.strata)) if task.strata else LENGTH_SAMPLE
    # an imported task's rows in file order may be one template: sample them stratified, as its prompt sets are
    task, _ = task.draw_prompt_sets({"eval": n}, spec.task.seed)
    options = {"n_boxes": spec.task.n_boxes, "prompt_set": "eval", **task.split_options("eval")}
    records = task.records(tokenizer, n, prompt_seed(spec.task.seed, "eval"), **options)
    extra = [_appended(r, task.metric) for r in records]  # answers of several tokens: teacher-forced runs
    sizes = [len(r.input_ids) * len(e) + sum(e) for r, e in zip(records, extra)]
    suffix = {
        name: mean((len(r.input_ids) - r.positions[name]) * len(e) + sum(e) for r, e in zip(records, extra))
        for name, pos in records[0].positions.items()
        if isinstance(pos, int)
    }
    masks = getattr(type(records[0]), "position_masks", None)
    classes = len(masks(records[:1], len(records[0].input_ids))) if masks else len(records[0].positions)
    return Lengths(mean(sizes), max(sizes), suffix, classes, used)


def _appended(record: Any, metric: str) -> list[int]:
    """Tokens each teacher-forced run of ``record`` appends to its prompt (its answer's tokens but the last; and,
    under ``logit_diff``, each alternative's): ``[0]`` where every answer is one token (one run, the prompt alone).
    A task of longer answers costs these runs in every stage that scores an answer (the plan counts each prompt
    as their tokens together)."""
    from ..tasks.records import alternative_tokens, answer_tokens

    answers = [answer_tokens(record)]
    if metric == "logit_diff":
        answers += list(alternative_tokens(record))
    if all(len(a) <= 1 for a in answers):
        return [0]
    return [len(a) - 1 for a in answers]


@dataclass(frozen=True)
class Reads:
    """What a stage's passes read and run beside their FLOPs: bytes of weights, passes, and blocks run in all."""

    bytes: float = 0.0
    passes: float = 0.0
    blocks: float = 0.0

    def __add__(self, other: "Reads") -> "Reads":
        return Reads(self.bytes + other.bytes, self.passes + other.passes, self.blocks + other.blocks)

    def __rmul__(self, k: float) -> "Reads":
        return Reads(k * self.bytes, k * self.passes, k * self.blocks)


@dataclass
class StageCost:
    """One stage's work and memory on one device: FLOPs; bytes of the models it holds, of what it keeps beside
    them (on the device with the models; ``host_kept`` on the host wherever the models are), of its largest
    batch's activations, and of its scratch files under TMPDIR (``disk``)."""

    stage: str
    models: int
    n: int
    batch: int
    flops: float
    weights: int
    kept: int
    transient: int
    host_kept: int = 0
    disk: int = 0
    runs: bool = True
    note: str = ""
    batch_option: str = "[eval] batch_size"
    reads: Reads = field(default_factory=Reads)  # what its passes read and run
    remedy: str = ""  # the stage's own way to fit, listed first where it does not

    def device_peak(self, device: Device) -> int:
        """Peak bytes on the device (on a CPU device: everything)."""
        peak = self.weights + self.kept + self.transient
        return peak if device.gpu else peak + self.host_kept

    def host_peak(self, device: Device) -> int:
        """Peak bytes on the host: everything on a CPU; beside a GPU, one model's weights while it loads or what the
        stage keeps on the host, whichever is more."""
        if not device.gpu:
            return self.device_peak(device)
        return max(self.weights // max(self.models, 1), self.host_kept)


@dataclass
class Placement:
    """A stage on a device: its peaks and time, whether it fits, and what would where it does not."""

    cost: StageCost
    device: Device
    dtype: str
    seconds: float
    fits: bool
    remedies: list[str] = field(default_factory=list)


@dataclass
class Context:
    """What every stage's count reads: the spec, the models' dims, the task's lengths, the dtype, the device."""

    spec: RunSpec
    dims: Dims
    lengths: Lengths
    dtype: str
    device: Device
    #: What a run found that a plan cannot know before it (``mechdiff.studies.resources.KNOWN``); empty: assumed.
    known: dict = field(default_factory=dict)

    @property
    def weights(self) -> int:
        return self.dims.weight_bytes(self.dtype)

    def fwd(self, rows: float, tokens: float, context: Optional[float] = None, layers: Optional[float] = None) -> float:
        return forward_flops(self.dims, 1, tokens, context, layers) * rows

    def rows(self, n: float) -> int:
        """Prompts a pass holds where a stage runs ``n`` prompts in batches of ``[eval] batch_size``: fewer prompts
        than a batch make a smaller one."""
        return max(1, min(self.spec.eval.batch_size, math.ceil(n)))

    def act(self, rows: int, tokens: float, context: Optional[float] = None) -> int:
        c = None if context is None else math.ceil(context)
        return forward_bytes(self.dims, rows, math.ceil(tokens), self.dtype, c)

    def reads(self, passes: float, layers: Optional[float] = None) -> Reads:
        """What ``passes`` passes through ``layers`` blocks (default every block) read: each block's weights and the
        unembedding's, once a pass."""
        dims, b = self.dims, dtype_bytes(self.dtype)
        layers = dims.n_layers if layers is None else layers
        per_pass = (layers * (dims.layer_linear + 2 * dims.d_model) + dims.vocab_size * dims.d_model) * b
        return Reads(passes * per_pass, passes, passes * layers)

    def resumed_runs(self, prompts: int) -> int:
        """F(C)'s run that pruning resumes from (:meth:`~mechdiff.circuits.scoring.Scorer.keep_without`), kept for
        every prompt: the residual stream after every block and every layer's keys and values (grows with
        ``prompts``)."""
        per_token = self.dims.n_layers * (self.dims.d_model + self.dims.kv_width())
        return prompts * self.lengths.longest * per_token * dtype_bytes(self.dtype)

    def ablation_patches(self, rows: int) -> int:
        """Mean-ablation writes of one batch: every layer's ``z`` at every position."""
        return self.dims.n_layers * rows * self.lengths.longest * self.dims.d_model * dtype_bytes(self.dtype)


# ---------------------------------------------------------------------------------------------- the stages


def accuracy(ctx: Context, name: str) -> StageCost:
    e, t = ctx.spec.eval, ctx.lengths
    return StageCost(
        f"accuracy:{name}",
        1,
        e.n,
        ctx.rows(e.n),
        ctx.fwd(e.n, t.tokens),
        ctx.weights,
        0,
        ctx.act(ctx.rows(e.n), t.longest),
        reads=ctx.reads(math.ceil(e.n / e.batch_size)),
    )


def _scored(ctx: Context, stage: str, n: int, scored: float, note: str = "") -> StageCost:
    """A scorer stage on ``n`` prompts: reference means (:func:`_reference_runs`), the full model and ``scored``
    mean-ablated runs a prompt."""
    b, t = ctx.spec.eval.batch_size, ctx.lengths
    reference = _reference_runs(ctx, stage)
    flops = ctx.fwd(reference + n * (1 + scored), t.tokens)
    rows = ctx.rows(max(n, reference))
    transient = ctx.act(rows, t.longest) + ctx.ablation_patches(rows)
    passes = math.ceil(reference / b) + math.ceil(n / b) * (1 + scored)
    return StageCost(stage, 1, n, rows, flops, ctx.weights, 0, transient, note=note, reads=ctx.reads(passes))


def _reference_runs(ctx: Context, stage: str) -> int:
    """Reference prompts whose means a scorer stage computes: the activation store (``[output] store``) keeps a
    model's means of one reference set, so the model's first scorer stage computes them and the later ones read
    them; pruning with a seed of its own (``[scoring.models.NAME] seed``) draws a set of its own."""
    s, (kind, _, name) = ctx.spec, stage.partition(":")  # a stage of no model ("matrix-cell"): name ""
    first = "positions" if s.positions.n >= 1 else "circuit" if s.discovery.method == "curve" else "prune"
    own_seed = kind == "prune" and s.scoring.models.get(name, {}).get("seed") is not None
    return s.scoring.reference_n if kind == first or own_seed else 0


def positions(ctx: Context, name: str) -> Optional[StageCost]:
    """The greedy scan: at each step one run a prompt per remaining class; ``max_steps`` steps, or as many as the
    run took where known (``stop_at`` ends it sooner)."""
    p, c = ctx.spec.positions, ctx.lengths.classes
    if p.n < 1:
        return None
    steps = min(ctx.known.get("scan_steps", {}).get(name) or p.max_steps or c, c)
    note = "" if name in ctx.known.get("scan_steps", {}) else "every step tried (stop_at may end it sooner)"
    return _scored(ctx, f"positions:{name}", p.n, sum(c - i for i in range(steps)), note)


def circuit(ctx: Context, name: str) -> StageCost:
    return _path_circuit(ctx, name) if ctx.spec.discovery.method == "path" else _curve_circuit(ctx, name)


def _curve_circuit(ctx: Context, name: str) -> StageCost:
    """Attribution on the ranking prompts (a forward and a backward to the activations only, no weight gradients:
    two forwards' FLOPs), then the full model, the empty circuit and the nested circuits on the curve prompts."""
    d, t, b = ctx.spec.discovery, ctx.lengths, ctx.spec.eval.batch_size
    reference = _reference_runs(ctx, f"circuit:{name}")
    flops = ctx.fwd(reference + d.n * 2 + d.curve_n * (2 + len(d.sizes)), t.tokens)
    rows = ctx.rows(max(d.n, d.curve_n, reference))
    transient = backward_bytes(ctx.dims, rows, t.longest, ctx.dims.n_layers, ctx.dtype) + ctx.ablation_patches(rows)
    passes = math.ceil(reference / b) + 2 * math.ceil(d.n / b) + math.ceil(d.curve_n / b) * (2 + len(d.sizes))
    return StageCost(f"circuit:{name}", 1, d.n, rows, flops, ctx.weights, 0, transient, reads=ctx.reads(passes))


def _plan_steps(ctx: Context) -> list[Any]:
    from ..tasks.base import get_task
    from ..tasks.plan import task_plan

    return list(task_plan(get_task(ctx.spec.task.name)).steps)


def senders_per_pass(ctx: Context, n: int, kept: int) -> int:
    """Sender copies per pass: 8 on a CPU; on a GPU as ``auto_senders_per_pass`` sizes them from the memory left."""
    from ..models.architectures import ModelShape
    from ..models.memory import MAX_BATCH, example_bytes
    from ..patching.path import SENDERS_PER_PASS

    if not ctx.device.gpu:
        return SENDERS_PER_PASS
    dims = ctx.dims
    shape = ModelShape(dims.n_layers, dims.n_heads, dims.n_kv_heads, dims.d_head, dims.d_model, dims.vocab_size)
    free = max(ctx.device.memory - ctx.weights - kept, 0)
    rows = max(
        1,
        min(
            max(MAX_BATCH, n * SENDERS_PER_PASS),
            int(free * 0.6) // example_bytes(shape, ctx.lengths.longest, dtype_bytes(ctx.dtype)),
        ),
    )
    return max(1, rows // n)


def _path_circuit(ctx: Context, name: str) -> StageCost:
    """Path patching as the plan's steps run it (see the module docstring)."""
    d = ctx.spec.discovery
    flops, kept, transient, s = _path_cost(ctx, d.n)
    held, steps = _held_pairs(ctx, d.n), len(_plan_steps(ctx))
    senders, parts = ctx.dims.n_layers * ctx.dims.n_heads, math.ceil(d.n / held)
    # the clean and counterfactual runs, then per step, part and pass of s senders a frozen and a receiver run
    reads = ctx.reads(parts * _prepared_runs(ctx, d.n, held, steps))
    reads += ctx.reads(2 * steps * parts * math.ceil(senders / s), ctx.dims.n_layers / 2)
    most = _path_most_pairs(ctx)
    if held < d.n:
        note = f"holds {held} pairs' activations at a time ({kept / GIB:.1f} GiB; [discovery] pairs_per_part)"
    else:
        fit = f"n up to {most} fits {ctx.device.name}" if most else f"no n fits {ctx.device.name}"
        note = f"keeps every pair's activations ({kept / GIB:.1f} GiB, grows with n: {fit})"
    remedy = f"[discovery] pairs_per_part = {most} (holds {most} pairs at a time)" if 0 < most < held else ""
    return StageCost(
        f"circuit:{name}",
        1,
        d.n,
        s * held,
        flops,
        ctx.weights,
        kept,
        transient,
        note=f"{note}; {s} senders a pass",
        batch_option="senders a pass",
        reads=reads,
        remedy=remedy,
    )


def _prepared_runs(ctx: Context, n: int, held: int, steps: int) -> int:
    """Forwards a pair's clean and counterfactual runs take over ``steps`` steps: both once where every pair is
    held; in parts, a clean run to read each part, then both again at each pass over the parts a step makes (path
    patching, and the attribution screen where on)."""
    if held >= n:
        return 2
    return 1 + 2 * steps * (2 if ctx.spec.discovery.screen else 1)


def _held_pairs(ctx: Context, n: int) -> int:
    """Pairs path patching holds at once: ``[discovery] pairs_per_part`` where set (and fewer than ``n``), else all."""
    part = ctx.spec.discovery.pairs_per_part
    return min(n, part) if part else n


def _path_cost(
    ctx: Context, n: int, steps: Optional[list[Any]] = None, held: Optional[int] = None
) -> tuple[float, int, int, int]:
    """FLOPs, kept bytes, transient bytes and senders a pass of path patching on ``n`` pairs, ``held`` at a time
    (default as ``[discovery] pairs_per_part`` says; held in parts, the clean and counterfactual runs are run once
    more at each step); ``steps``: those of the task's plan to count, default all."""
    t, dims = ctx.lengths, ctx.dims
    half = dims.n_layers / 2
    held = _held_pairs(ctx, n) if held is None else held
    kept = held * held_pair_bytes(dims.n_layers, dims.d_model, dims.kv_width(), t.longest, dtype_bytes(ctx.dtype))
    plan = _plan_steps(ctx) if steps is None else steps
    flops, senders = ctx.fwd(n * _prepared_runs(ctx, n, held, len(plan)), t.tokens), dims.n_layers * dims.n_heads
    s = senders_per_pass(ctx, held, kept)
    transient = ctx.act(held, t.longest)  # the clean and counterfactual runs, a part's pairs at once
    for step in plan:
        after = t.after(step.receiver_position) if step.receiver else 0.0
        flops += senders * n * (ctx.fwd(1, 1, 1, half) + (ctx.fwd(1, after, t.tokens, half) if after else 0.0))
        transient = max(transient, ctx.act(s * held, max(after, 1), t.longest))
    return flops, kept, transient, s


def _path_most_pairs(ctx: Context) -> int:
    """The most pairs path patching keeps within the device's memory (one sender a pass at the least; 0: none)."""

    def fits(n: int) -> bool:
        _, kept, transient, _ = _path_cost(ctx, n, held=n)
        return ctx.weights + kept + transient <= ctx.device.memory

    if not fits(1):
        return 0
    low, high = 1, 2
    while fits(high) and high < 10**7:
        low, high = high, 2 * high
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low


def _group_sizes(ctx: Context, name: str) -> list[int]:
    """Each group's heads before pruning: the path circuit's ``circuit_k`` (or ``top_k``) for ``name``; a curve
    circuit's largest size spread over the position classes."""
    d, dims = ctx.spec.discovery, ctx.dims
    if d.method == "path":
        own = d.models.get(name, {})
        return list((own.get("circuit_k") or d.circuit_k or own.get("top_k") or d.top_k).values())
    pairs = max(d.sizes) * dims.n_layers * dims.n_heads * ctx.lengths.classes
    return [math.ceil(pairs / ctx.lengths.classes)] * ctx.lengths.classes


def circuit_pairs(ctx: Context, name: str) -> list[tuple[float, str]]:
    """``name``'s circuit as (layer, position) pairs: the run's where known (``known["circuit"]``), else assumed:
    a path circuit's ``circuit_k`` heads a step at the middle layer; a curve circuit the middle of ``[discovery]
    sizes`` (an assumption: the pick is not known before the curve) spread over every layer and position class."""
    from ..common.components import parse_heads

    found = ctx.known.get("circuit", {}).get(name)
    if found is not None:
        pos = found["positions"]
        return [(h.layer, pos[g]) for g, heads in found["groups"].items() for h in parse_heads(heads)]
    d, dims = ctx.spec.discovery, ctx.dims
    if d.method == "path":
        return [
            (dims.n_layers / 2, p) for g, p in zip(_group_sizes(ctx, name), _group_positions(ctx)) for _ in range(g)
        ]
    size = sorted(d.sizes)[len(d.sizes) // 2]
    count = round(size * dims.n_layers * dims.n_heads * ctx.lengths.classes)
    return [((dims.n_layers - 1) / 2, "")] * count


def _greedy_prune(ctx: Context, name: str) -> StageCost:
    """mechdiff's greedy minimality: F(M), F(C) and F(C)'s run kept for resuming; per pair v, F(C \\ {v}) and, for
    each pair searched, ``prune_steps * prune_candidates`` runs F(C \\ {v, u}) (F(C \\ {u}) is u's own first run);
    each a suffix run from v's layer and position. The share of pairs searched (the others pass the threshold at
    K = {}) is the run's where known, else all."""
    s, t, dims = ctx.spec.scoring, ctx.lengths, ctx.dims
    pairs = circuit_pairs(ctx, name)
    assumed = "" if name in ctx.known.get("circuit", {}) else f" (a circuit of {len(pairs)} pairs assumed)"
    cost = _scored(ctx, f"prune:{name}", s.prune_n, 2, f"greedy: suffix runs a pair and candidate{assumed}")
    _keep_resumed(ctx, cost)
    searched = ctx.known.get("searched", {}).get(name, 1.0)
    passes = 1 + searched * s.prune_steps * s.prune_candidates  # a pair's runs, each of its prune_n prompts
    for layer, pos in pairs:
        cost.flops += ctx.fwd(s.prune_n * passes, t.after(pos), t.tokens, dims.n_layers - layer)
        cost.reads += ctx.reads(passes * math.ceil(s.prune_n / ctx.spec.eval.batch_size), dims.n_layers - layer)
    return cost


def _keep_resumed(ctx: Context, cost: StageCost) -> None:
    """``cost`` keeps F(C)'s run of every one of its prompts (:meth:`Context.resumed_runs`), and says so."""
    cost.kept = ctx.resumed_runs(cost.n)
    cost.note += f"; keeps F(C)'s run of each of its {cost.n} prompts ({cost.kept / GIB:.1f} GiB, grows with prune_n)"


def prune(ctx: Context, name: str) -> Optional[StageCost]:
    s = ctx.spec.scoring
    if not s.prune:
        return None
    sizes, t = _group_sizes(ctx, name), ctx.lengths
    if s.prune_rule != "paper":
        return _greedy_prune(ctx, name)
    # F(C \\ {u}) and F(C \\ {u, v}) once per set (the scorer caches them), each a suffix run from the group's
    # position over the layers from the lowest removed head (half of them, on average)
    cost = _scored(ctx, f"prune:{name}", s.prune_n, 1, "pairwise: each head and each pair of heads of a group")
    _keep_resumed(ctx, cost)
    for g, pos in zip(sizes, _group_positions(ctx, len(sizes))):
        runs = s.prune_n * (g + g * (g - 1) / 2)
        cost.flops += ctx.fwd(runs, t.after(pos), t.tokens, ctx.dims.n_layers / 2)
        passes = (g + g * (g - 1) / 2) * math.ceil(s.prune_n / ctx.spec.eval.batch_size)
        cost.reads += ctx.reads(passes, ctx.dims.n_layers / 2)
    return cost


def matrix(ctx: Context, name: str) -> StageCost:
    """Every model's circuit (and pruned circuit) kept, the own circuit's random draws, and completeness: two runs
    a draw and two a group removed whole (``completeness_groups``, else ``[dcm] groups``)."""
    s, models = ctx.spec.scoring, len(ctx.spec.model_names)
    groups = len(_completeness_groups(ctx, name))
    circuits = _distinct_circuits(ctx) or models * (2 if s.prune else 1)
    scored = circuits + s.random_draws + (2 * s.completeness_draws + 2 * groups if s.completeness_draws else 0)
    return _scored(ctx, f"matrix:{name}", s.n, scored)


def _distinct_circuits(ctx: Context) -> int:
    """Circuits of different pairs among every model's circuit and pruned circuit, where the run found them all
    (the scorer runs a set of pairs once); else 0."""
    names = [n for m in ctx.spec.model_names for n in ([m, f"{m} pruned"] if ctx.spec.scoring.prune else [m])]
    found = ctx.known.get("circuit", {})
    if not all(n in found for n in names):
        return 0
    sets = {frozenset((h, found[n]["positions"][g]) for g, hs in found[n]["groups"].items() for h in hs) for n in names}
    return len(sets)


def _groups(ctx: Context, name: str, wanted: list[str]) -> list[str]:
    """The groups of ``name``'s circuit a stage looks at, as the study picks them
    (:func:`~mechdiff.studies.circuits.group_choice`): ``wanted`` where they name groups of the circuit the run
    found (those with heads), else its every non-empty group; before a run, ``wanted``, else a path plan's steps
    or the task's named positions (a curve circuit's groups are position classes)."""
    found = ctx.known.get("circuit", {}).get(name)
    if found is not None:
        present = [g for g in wanted if found["groups"].get(g)]
        return present if set(wanted) & set(found["groups"]) else [g for g, hs in found["groups"].items() if hs]
    if wanted:
        return list(wanted)
    if ctx.spec.discovery.method == "path":
        return [step.name for step in _plan_steps(ctx)]
    return list(ctx.lengths.suffix)


def _completeness_groups(ctx: Context, name: str) -> list[str]:
    """The groups completeness removes whole: ``completeness_groups`` (else ``[dcm] groups``) that have heads in
    ``name``'s circuit where the run found it, else every non-empty group where they name none of its groups."""
    wanted = ctx.spec.scoring.completeness_groups or ctx.spec.dcm.groups
    return _groups(ctx, name, wanted)


def _desiderata(ctx: Context) -> list[str]:
    """The desiderata DCM trains, as the study picks them: those of ``[dcm] desiderata`` the task declares, else
    every one the task declares."""
    from ..tasks.base import get_task
    from ..tasks.desiderata import chosen_desiderata

    return chosen_desiderata(ctx.spec.dcm.desiderata, get_task(ctx.spec.task.name).desiderata)


def _group_positions(ctx: Context, count: Optional[int] = None) -> list[str]:
    """The position of each group DCM looks at (``count``: of the circuit's first ``count`` groups): a path
    circuit's step's sender position, else the group's name (a position class)."""
    steps = {step.name: step.sender for step in _plan_steps(ctx)} if ctx.spec.discovery.method == "path" else {}
    groups = ctx.spec.dcm.groups if count is None else list(steps)[:count] or ctx.spec.dcm.groups[:count]
    return [steps.get(g, g) for g in groups]


def dcm(ctx: Context, name: str, semantic: int) -> StageCost:
    """DCM of ``name``'s circuit (see the module docstring); ``semantic``: models its selections are patched into."""
    c, t, dims, half = ctx.spec.dcm, ctx.lengths, ctx.dims, ctx.dims.n_layers / 2
    n, k = c.n_train + c.n_val + c.n_test, len(_desiderata(ctx))
    flops = k * ctx.fwd(2 * n, t.tokens)
    # pairs a cache write (and an evaluation) and a training step hold
    built, trained = ctx.rows(n), min(c.batch_size, c.n_train)
    reads = k * ctx.reads(2 * math.ceil(n / built))
    checks = c.epochs * math.ceil(c.n_train / c.batch_size) / max(c.eval_every, 1) + 1
    masked = name if c.circuit != "pruned" or not ctx.spec.scoring.prune else f"{name} pruned"
    # the random baseline and semantic patching run for a selection of heads: every one, unless the run chose none
    chose = ctx.known.get("dcm_selected", {}).get(name, 1.0)
    groups = _groups(ctx, masked, c.groups)
    for layer, pos in _group_starts(ctx, masked, groups).values():
        runs = 2 * c.epochs * c.n_train + checks * c.n_val + (2 + DCMConfig.n_random * chose) * c.n_test
        flops += k * ctx.fwd(runs, t.after(pos), t.tokens, dims.n_layers - layer)
        flops += k * chose * semantic * ctx.fwd(2 * c.n_test, t.tokens)
        passes = 2 * c.epochs * math.ceil(c.n_train / trained) + checks * math.ceil(c.n_val / built)
        passes += (2 + DCMConfig.n_random * chose) * math.ceil(c.n_test / built)
        reads += k * ctx.reads(passes, dims.n_layers - layer)
        reads += k * chose * semantic * ctx.reads(2 * math.ceil(c.n_test / built))
    # a pair's row of the cache: every layer's keys and values and a group's entering residual stream per token
    per_pair = int(t.longest * (dims.n_layers * dims.kv_width() + len(groups) * dims.d_model) * dtype_bytes(ctx.dtype))
    longest_after = max((t.after(p) for _, p in _group_starts(ctx, masked, groups).values()), default=t.tokens)
    transient = max(
        # a training step: its backward's activations and the rows it read back (its keys and values prefix)
        backward_bytes(dims, trained, math.ceil(longest_after), half, ctx.dtype, t.longest) + trained * per_pair,
        # a cache write: a forward keeping every layer's keys and values, and their stacked copy
        ctx.act(built, t.longest) + 2 * built * per_pair,
    )
    host = max(built, trained) * per_pair  # one batch's rows, as written to or read from the file
    disk = n * per_pair  # the scratch file: every pair's row, one desideratum's file at a time
    stage = "dcm" if name == ctx.spec.models.base else f"dcm:{name}"
    note = (
        f"a pair cache of {disk / GIB:.1f} GiB streamed through a scratch file under TMPDIR (every layer's keys "
        f"and values of {n} pairs; memory holds one batch's rows, {host / GIB:.2f} GiB)"
    )
    return StageCost(
        stage,
        2,
        n,
        trained,
        flops,
        2 * ctx.weights,
        0,
        transient,
        host,
        disk,
        note=note,
        batch_option="[dcm] batch_size",
        reads=reads,
    )


def _group_starts(ctx: Context, name: str, groups: list[str]) -> dict[str, tuple[float, str]]:
    """Each of ``groups``' lowest layer and position in ``name``'s circuit: the run's where known, else assumed
    (a path circuit's group at the middle layer; a curve circuit's, spread over every layer, from the first)."""
    from ..common.components import parse_heads

    found = ctx.known.get("circuit", {}).get(name)
    if found is not None:
        heads = {g: parse_heads(found["groups"].get(g, [])) for g in groups}
        return {g: (min(h.layer for h in hs), found["positions"][g]) for g, hs in heads.items() if hs}
    path = ctx.spec.discovery.method == "path"
    senders = {step.name: step.sender for step in _plan_steps(ctx)} if path else {}
    return {g: (ctx.dims.n_layers / 2 if path else 0, senders.get(g, g)) for g in groups}


def _cmap_tokens(ctx: Context, part: str, position: str) -> float:
    """Tokens a CMAP run of ``part`` computes: a ``z`` patch from the group's position on; K/V patches (written up to
    the position) and the isolation of Q/K/V (:func:`~mechdiff.methods.cmap.isolation_patches`, every position)
    from the first token."""
    c = ctx.spec.cmap
    whole = part != "z" and (c.isolate or c.scope == "paper" or bool(set(part) & {"k", "v"}))
    return ctx.lengths.tokens if whole else ctx.lengths.after(position)


def cmap(ctx: Context, finetune: str) -> StageCost:
    """Per prompt the fine-tune's run (capturing) and the base's; then per scope (each group, the whole circuit)
    and part one patched base run, and ``n_random`` more per group: suffix runs from the scope's lowest layer and
    position (the base's circuit, as ``[cmap] scope = "base"`` patches it)."""
    c, t, b, dims = ctx.spec.cmap, ctx.lengths, ctx.spec.eval.batch_size, ctx.dims
    base = ctx.spec.models.base
    starts = _group_starts(ctx, base, _groups(ctx, base, c.groups))
    if starts:  # the whole circuit: from its lowest layer and its earliest position
        whole = min(v[0] for v in starts.values()), max((v[1] for v in starts.values()), key=t.after)
        starts = {**starts, "": whole}
    flops, batches = ctx.fwd(2 * c.n, t.tokens), math.ceil(c.n / b)
    reads = ctx.reads(2 * batches)
    for group, (layer, pos) in starts.items():
        draws = 1 + (c.n_random if group else 0)
        for part in c.parts:
            flops += ctx.fwd(c.n * draws, _cmap_tokens(ctx, part, pos), t.tokens, dims.n_layers - layer)
            reads += ctx.reads(draws * batches, dims.n_layers - layer)
    rows = ctx.rows(c.n)
    captured = 4 * dims.n_layers * rows * t.longest * dims.d_model * dtype_bytes(ctx.dtype)
    return StageCost(
        f"cmap:{finetune}",
        2,
        c.n,
        rows,
        flops,
        2 * ctx.weights,
        0,
        ctx.act(rows, t.longest) + captured,
        reads=reads,
    )


def reproduction(ctx: Context, name: str) -> StageCost:
    r = ctx.spec.reproduce
    return _scored(ctx, f"reproduction:{name}", r.n, 1)


# ---------------------------------------------------------------------------------------------- the plan


def stage_costs(ctx: Context) -> list[StageCost]:
    """Every stage of the study, in the order a run meets them; those the file does not run (``[reproduce] only``)
    marked so."""
    spec, names = ctx.spec, ctx.spec.model_names
    out: list[StageCost] = []
    if spec.reproduce.circuit:
        out += [reproduction(ctx, n) for n in names]
    rest: list[Optional[StageCost]] = [accuracy(ctx, n) for n in names]
    rest += [positions(ctx, n) for n in names] + [circuit(ctx, n) for n in names] + [prune(ctx, n) for n in names]
    rest += [matrix(ctx, n) for n in names] + [dcm(ctx, spec.models.base, len(names))]
    rest += [cmap(ctx, ft) for ft in spec.models.finetunes]
    if spec.cmap.scope == "paper":
        rest += [dcm(ctx, ft, 0) for ft in spec.models.finetunes]
    skip = bool(spec.reproduce.circuit and spec.reproduce.only)
    return out + [replace(c, runs=not skip) for c in rest if c is not None]


def place(cost: StageCost, device: Device, dtype: str, recount: Callable[[str, int], StageCost]) -> Placement:
    """``cost`` on ``device``: time, fit, and where it does not fit, what would (``recount(dtype, batch)`` counts the
    stage again under another dtype or batch size)."""
    r = cost.reads
    seconds = cost.flops / device.throughput(dtype) + device.read_seconds(dtype, r.bytes)
    seconds += device.overhead_seconds(r.passes, r.blocks)
    fits = cost.device_peak(device) <= device.memory and (device.disk is None or cost.disk <= device.disk)
    return Placement(cost, device, dtype, seconds, fits, [] if fits else remedies(cost, device, dtype, recount))


def remedies(cost: StageCost, device: Device, dtype: str, recount: Callable[[str, int], StageCost]) -> list[str]:
    """What would make the stage fit: bfloat16, a smaller batch, two GPUs, NDIF; for scratch files larger than the
    disk, a larger disk under TMPDIR (or bfloat16, where that halves them enough)."""
    out = [cost.remedy] if cost.remedy else []
    if device.disk is not None and cost.disk > device.disk:
        out.append(f"TMPDIR on a disk with {cost.disk / GIB:.0f} GiB free (this one has {device.disk / GIB:.0f})")
        if dtype == "float32" and recount("bfloat16", cost.batch).disk <= device.disk:
            out.append(f"--dtype bfloat16 ({recount('bfloat16', cost.batch).disk / GIB:.1f} GiB on disk)")
        if cost.device_peak(device) <= device.memory:
            return out
    if dtype == "float32" and (bf := recount("bfloat16", cost.batch)).device_peak(device) <= device.memory:
        out.append(f"--dtype bfloat16 ({bf.device_peak(device) / GIB:.1f} GiB)")
    for batch in (cost.batch // 2**i for i in range(1, 12)):
        if batch >= 1 and (smaller := recount(dtype, batch)).device_peak(device) <= device.memory:
            out.append(f"{cost.batch_option} {batch} ({smaller.device_peak(device) / GIB:.1f} GiB)")
            break
    if device.gpu and cost.device_peak(device) <= 2 * device.memory:
        out.append(f"--device-map auto over two GPUs (about {cost.device_peak(device) / 2 / GIB:.1f} GiB each)")
    out.append("--remote on NDIF (the server's memory; its hosted models only)")
    return out


def resource_plan(
    spec: RunSpec,
    device: Device,
    lengths: Optional[Lengths] = None,
    dtype: Optional[str] = None,
    known: Optional[dict] = None,
) -> list[Placement]:
    """Every stage of ``spec`` placed on ``device`` in ``dtype`` (default the spec's); ``known``: what a run found
    that the plan otherwise assumes (:class:`Context`)."""
    dtype = dtype or spec.models.dtype
    dims, _ = model_dims(spec.models.base)
    lengths = lengths or task_lengths(spec)
    ctx = Context(spec, dims, lengths, dtype, device, known or {})
    out = []
    for i, cost in enumerate(stage_costs(ctx)):
        out.append(place(cost, device, dtype, lambda dt, b, i=i: _recount(ctx, i, dt, b)))
    return out


def found_in(run_dir: str | Path) -> dict:
    """What a plan assumes and a finished run's stage records know (``known`` of :func:`resource_plan`): each
    circuit (``"NAME"``) and pruned circuit (``"NAME pruned"``), the position scan's steps, the share of pairs
    greedy pruning searched, the share of DCM's masks that selected a head."""
    out: dict = {"circuit": {}, "scan_steps": {}, "searched": {}, "dcm_selected": {}}
    for path in sorted((Path(run_dir) / "stages").glob("*.json")):
        rec = json.loads(path.read_text())
        kind, _, model = rec["name"].partition(":")
        result = rec["result"]
        if kind == "circuit":
            out["circuit"][model] = result["circuit"]
        elif kind == "positions":
            out["scan_steps"][model] = len(result["scan"]["steps"])
        elif kind == "prune":
            out["circuit"][f"{model} pruned"] = result["circuit"]
            pairs = result["minimality"]["pairs"].values()
            if result["minimality"].get("rule") == "greedy":
                out["searched"][model] = sum(p["searched"] for p in pairs) / max(len(pairs), 1)
        elif kind == "dcm" and result.get("dcm"):
            out["dcm_selected"][model or result["model"]] = mean(bool(r["selected"]) for r in result["dcm"])
    return out


#: Width of the random model :func:`pass_overhead` times: its FLOPs and weight reads are negligible.
OVERHEAD_WIDTH = 64


def pass_overhead(dims: Dims, min_seconds: float = 0.2) -> tuple[float, float]:
    """CPU seconds a pass costs beside its FLOPs and weight reads, and each block it runs: ``run`` (through the
    intervention layer) of one token on a random LLaMA of ``dims``' depth and :data:`OVERHEAD_WIDTH`, timed in full
    and resumed at its last block; the difference is the blocks' share. A departure: the model's own norms,
    attention and rotary code is LLaMA's, not necessarily the planned model's."""
    import time

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from ..models.loading import LoadedModel
    from ..models.registry import ModelSpec
    from ..patching.core import Resume, run

    w, layers = OVERHEAD_WIDTH, dims.n_layers
    config = LlamaConfig(
        num_hidden_layers=layers, hidden_size=w, intermediate_size=2 * w, num_attention_heads=4, vocab_size=w
    )
    config._attn_implementation = "eager"
    model = LoadedModel("overhead", ModelSpec("overhead", "local", ""), LlamaForCausalLM(config).eval(), None)
    ids, hidden = torch.zeros(1, 1, dtype=torch.long), torch.zeros(1, 1, w)

    def seconds(resume: Optional[Resume]) -> float:
        run(model, ids, resume=resume)
        reps, start = 0, time.process_time()
        while (spent := time.process_time() - start) < min_seconds or reps < 3:
            run(model, ids, resume=resume)
            reps += 1
        return spent / reps

    with torch.no_grad():
        full, last = seconds(None), seconds(Resume(layers - 1, hidden))
    block = max(full - last, 0.0) / max(layers - 1, 1)
    return max(last - block, 0.0), block


def with_overhead(device: Device, dims: Dims) -> Device:
    """This machine (a CPU device) with :func:`pass_overhead` measured; a GPU device as it is."""
    if device.gpu:
        return device
    each, block = pass_overhead(dims)
    note = f"{device.note}; {each * 1e3:.1f} ms a pass and {block * 1e3:.2f} ms a block beside them"
    return replace(device, overhead=(each, block), note=note)


def run_record(spec: RunSpec) -> Optional[dict]:
    """What ``run.json`` records of the plan, so the report's stage table reads it from committed files: this
    machine's matrix-multiply throughput and weight bandwidth measured now (FLOP and bytes per CPU second in the
    run's dtype, as ``--plan`` measures them) and each stage's planned FLOPs. None for a run on a GPU or NDIF (the
    CPU's throughput is not theirs)."""
    from ..models.devices import this_machine

    m = spec.models
    if m.remote or m.device_map or m.device not in (None, "cpu"):
        return None
    dims, _ = model_dims(m.base)
    lengths = task_lengths(spec)
    rows = min(2048, spec.eval.batch_size * lengths.longest)
    device = this_machine(dims, (m.dtype,), rows)  # no pass_overhead: it runs a model, and a cached run runs none
    plan = resource_plan(spec, device, lengths, m.dtype)
    return {
        "dtype": m.dtype,
        "throughput": device.throughput(m.dtype),
        "bandwidth": device.bandwidth[m.dtype],
        "stage_flops": {p.cost.stage: p.cost.flops for p in plan},
    }


def _recount(ctx: Context, index: int, dtype: str, batch: int) -> StageCost:
    """Stage ``index`` counted again in ``dtype`` with batch size ``batch`` in its batch option."""
    spec = _with_batch(ctx.spec, stage_costs(ctx)[index], batch)
    return stage_costs(replace(ctx, spec=spec, dtype=dtype))[index]


def _with_batch(spec: RunSpec, cost: StageCost, batch: int) -> RunSpec:
    if cost.batch_option == "[dcm] batch_size":
        return replace(spec, dcm=replace(spec.dcm, batch_size=batch))
    if cost.batch_option == "[eval] batch_size":
        return replace(spec, eval=replace(spec.eval, batch_size=batch))
    return spec  # senders a pass: sized from the memory left, not an option


def _gb(x: int) -> str:
    return f"{x / GIB:7.1f}"


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:7.1f} s"
    if seconds < 7200:
        return f"{seconds / 60:5.1f} min"
    return f"{seconds / 3600:7.1f} h"


def format_resources(plan: list[Placement], lengths: Lengths, dims_source: str) -> str:
    """The plan as a table: each stage's models held, n, batch, FLOPs, host and device peaks, time and fit; then
    what would fit where a stage does not, and the totals."""
    if not plan:
        return "no stage to plan"
    device, dtype = plan[0].device, plan[0].dtype
    width = max(len(p.cost.stage) for p in plan)
    unit = "CPU time" if not device.gpu else "time"
    head = f"{'stage':{width}s}  models      n  batch     PFLOP  host GiB  dev. GiB  disk GiB  {unit:>9s}  fits"
    disk = "disk not given" if device.disk is None else f"{device.disk / GIB:.0f} GiB free under TMPDIR"
    lines = [
        f"resource plan on {device.name} ({device.memory / GIB:.0f} GiB{' available' if not device.gpu else ''}; "
        f"{disk}; {device.note}), {dtype}",
        f"configs: {dims_source}; prompts {lengths.tokens:.0f} tokens on average, {lengths.longest} at most "
        f"(tokenizer: {lengths.tokenizer})",
        head,
    ]
    for p in plan:
        c = p.cost
        dev = _gb(c.device_peak(device)) if device.gpu else "      -"
        mark = ("yes" if p.fits else "NO") + ("" if c.runs else "  (only = false)")
        lines.append(
            f"{c.stage:{width}s}  {c.models:6d}  {c.n:5d}  {c.batch:5d}  {c.flops / 1e15:8.3f}  "
            f"{_gb(c.host_peak(device))}   {dev}   {_gb(c.disk)}  {_duration(p.seconds):>9s}  {mark}"
        )
    lines += _notes(plan) + _totals(plan)
    return "\n".join(lines)


def _notes(plan: list[Placement]) -> list[str]:
    out = []
    for p in plan:
        c, device = p.cost, p.device
        if c.note:
            out.append(f"  {c.stage}: {c.note}")
        if c.disk > COMMON_GPU_DISK and device.disk is None:
            out.append(
                f"  {c.stage}: its {c.disk / GIB:.0f} GiB of scratch files exceed a {COMMON_GPU_DISK / GIB:.0f} GiB "
                "disk (a common single-GPU machine's): point TMPDIR at a larger disk (--plan-disk GIB checks yours)"
            )
        if not p.fits:
            need = f"{c.device_peak(device) / GIB:.1f} GiB"
            if device.disk is not None and c.disk > device.disk:
                need += f", {c.disk / GIB:.1f} GiB on disk"
            out.append(f"  {c.stage} does not fit ({need}); would: " + "; ".join(p.remedies))
    return out


def _totals(plan: list[Placement]) -> list[str]:
    ran = [p for p in plan if p.cost.runs]
    whole = sum(p.seconds for p in plan)
    top = max(plan, key=lambda p: p.seconds)
    out = [f"the run as written: {_duration(sum(p.seconds for p in ran)).strip()} predicted"]
    if len(ran) < len(plan):
        out.append(f"the whole study ([reproduce] only = false): {_duration(whole).strip()} predicted")
    kinds: dict[str, float] = {}
    for p in plan:
        kinds[p.cost.stage.split(":")[0]] = kinds.get(p.cost.stage.split(":")[0], 0.0) + p.seconds
    kind = max(kinds, key=kinds.__getitem__)
    out.append(
        f"dominant stage: {kind} ({_duration(kinds[kind]).strip()} over its models, {kinds[kind] / whole:.0%} of the "
        f"whole study's time; its longest: {top.cost.stage}, {_duration(top.seconds).strip()})"
    )
    if whole > THIRTY_MINUTES:
        rest = whole - kinds[kind]
        why = (
            f"{kind} keeps the study from it (the other stages: {_duration(rest).strip()})"
            if rest <= THIRTY_MINUTES
            else f"its largest part is {kind}; the other stages alone take {_duration(rest).strip()}"
        )
        out.append(
            f"over 30 min: {why} (predicted: each stage's forward passes counted from its settings; how far that is "
            "from measured stage times: benchmarks/README.md)"
        )
    return out


#: The study time an issue set for the default study on this machine; the plan names the stage that keeps a study
#: above it.
THIRTY_MINUTES = 30 * 60


def print_resources(
    path: Optional[str],
    device: Optional[str],
    dtype: Optional[str] = None,
    task: Optional[str] = None,
    disk_gib: Optional[float] = None,
) -> bool:
    """What ``mechdiff run --plan`` prints first for a circuits study (other kinds: nothing): its resource plan on
    this machine and on the named ``device`` (with ``disk_gib`` GiB free under TMPDIR where given). Returns True
    where the models' weights are absent, so that the stage cache (which needs the tokenizer and weights checked)
    cannot be read: the plan then ends here, said so."""
    from ..models.devices import get_device, this_machine
    from .base import study_kind
    from .reproduce import check_weights
    from .spec import study_spec

    if path is not None and study_kind(path) != "circuits":
        return False
    named = get_device(device) if device else None  # an unknown name is refused before anything is measured
    if named is not None and disk_gib is not None:
        named = named.with_disk(int(disk_gib * GIB))
    spec = study_spec(path, task)
    dtype = dtype or spec.models.dtype
    dims, source = model_dims(spec.models.base)
    lengths = task_lengths(spec)
    rows = min(2048, spec.eval.batch_size * lengths.longest)  # a batch's tokens: the stages' matrix multiplies
    for where in [with_overhead(this_machine(dims, (dtype,), rows), dims)] + ([named] if named else []):
        print(format_resources(resource_plan(spec, where, lengths, dtype), lengths, source), end="\n\n", flush=True)
    try:
        check_weights(spec.model_names, remote=spec.models.remote)
    except FileNotFoundError as err:
        print(f"stage cache not read (the resource plan above needs only configs): {err}")
        return True
    return False
