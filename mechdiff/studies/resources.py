"""The resource plan of a circuits study: each stage's peak memory (host and device) and time, predicted from
the models' configs, the task's token lengths, each stage's ``n`` and batch size and the dtype, on this machine
or on a named device (`mechdiff.models.devices`); for a stage that does not fit, what would.

Nothing loads: the configs are the shipped ones or the models' own metadata (`
model_dims`), the token lengths come from the task's prompts under the base's tokenizer or, where that is absent
(the paper's models without their weights), under the embedded SmolLM2 tokenizer (an estimate, said so).

Each stage is counted by its algorithm (`mechdiff.studies.circuits`), in forward passes of the model:

- ``accuracy``: one forward per prompt.
- scorer stages (``positions``, ``prune``, ``matrix``, ``reproduction``; curve discovery): the reference prompts
  whose means ablate, the full model, and one mean-ablated forward per prompt for every circuit scored (the
  position scan: every remaining class at each step; pairwise pruning: each head and each pair of a group).
  Pruning resumes each removal from F(C)'s run, which it keeps for every prompt (every layer's residual stream,
  keys and values: this grows with ``prune_n``).
- path discovery: clean and counterfactual runs of every pair, kept (every layer's ``z``, the residual stream,
  keys and values: this grows with ``n``), then per step every head below the deepest receiver as a sender (the
  found circuit's receiving group bounds it where known; before discovery the middle layer is assumed; a step
  into the logits: every head): a one-token frozen run over half the layers and receiver runs of the tokens after
  the receiver position over half the layers, one per distinct receiver position (step D: one per box), a pass.
- DCM: per desideratum a pair cache, in the mode `dcm_cache_choice` picks (the fastest that fits the
  machine's GPU, host memory and disk; ``[dcm] cache`` names one): ``file`` (two forwards a pair; every layer's
  keys and values of every pair written to a scratch HDF5 file under TMPDIR, one desideratum's file at a time, and
  read back by every patched run: disk grows with ``n``, memory holds one batch's rows; the bytes read over the
  disk's rate), ``memory`` (the sources' ``z`` at each group's position in host memory; patched runs in full) or
  ``recompute`` (nothing held; each patched batch's sources run again); then per group training (forward and
  backward to the activations, the weights frozen: two forwards' FLOPs), validation and test runs (``file``: from
  the group's position and lowest layer) and semantic patching's; it holds two models.
- CMAP: per prompt the base and the fine-tune once, then one patched base run per scope and part, from the scope's
  lowest layer (a ``z`` patch from its position, other parts over every token); two models.

Where a run has found them (``known``: `found_in`), the circuits, the position scan's steps and the share
of pairs greedy pruning searched are the run's; before it they are assumed (the plan's notes say which).

Memory is the models' weights, what the stage keeps beside them and the transient activations of its largest
batch (`forward_bytes`, `backward_bytes`), and the
process's own before its models load (this process's resident memory: Python, torch, transformers, a tokenizer);
scratch files are counted apart, against the disk free under TMPDIR; beside a GPU, host memory against the
machine's (a named GPU's: 128 GiB and 64 GiB of disk unless ``--plan-host``/``--plan-disk`` say otherwise).
Time is FLOPs over the device's throughput (measured here, per CPU second; a named device's stated share of peak)
plus the weights each pass reads (the blocks it runs and the unembedding) over the device's bandwidth: a pass of few
rows (pruning's and DCM's short suffix runs) takes the time its weights take to read, whatever its FLOPs
(`mechdiff.models.devices`); each pass's fixed cost (Python, the intervention layer's trace: measured here,
`pass_overhead`; stated for a named GPU, ``GPU_OVERHEAD``); and the scratch files read back over the disk's
rate (measured here, `scratch_bandwidth`; stated for a named GPU's machine). Passes are counted at each stage's
batch size. Loading the models (their weights over the disk's rate) and, on this machine, the wall time of the
processes and threads the run will use are given after the totals, with a warning where the throughput was
measured under load.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, replace
from functools import cached_property, partial
from pathlib import Path
from statistics import mean
from typing import Any, Callable, Optional

from ..methods.dcm import CACHE_MODES
from ..models.devices import GIB, Device
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
    #: Distinct token indices of each named position among the prompts (receiver runs of path patching: one each).
    distinct: dict[str, int] = field(default_factory=dict)

    def after(self, position: Optional[str]) -> float:
        """Tokens computed by a suffix run from ``position`` (the whole prompt where it is not a named position)."""
        return self.suffix.get(position or "", self.tokens)


def planning_tokenizer(model: str) -> tuple[Any, str]:
    """``model``'s tokenizer, else the stand-in's (`STAND_IN_TOKENIZER`), and the name the plan gives it."""
    from ..models.loading import load_tokenizer
    from ..models.resolve import resolve_spec

    try:
        return load_tokenizer(resolve_spec(model)), model
    except (OSError, ValueError):
        used = f"{STAND_IN_TOKENIZER}'s (an estimate: {model}'s tokenizer is absent)"
        return load_tokenizer(resolve_spec(STAND_IN_TOKENIZER)), used


def task_lengths(spec: RunSpec) -> Lengths:
    """Token lengths of ``LENGTH_SAMPLE`` of the study's prompts under the base's tokenizer, else the stand-in's."""
    from ..runs.seeds import prompt_seed
    from ..tasks.base import get_task

    tokenizer, used = planning_tokenizer(spec.models.base)
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
    distinct = {name: len({r.positions[name] for r in records}) for name in suffix}
    return Lengths(mean(sizes), max(sizes), suffix, classes, used, distinct)


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
    """What a stage's passes read and run beside their FLOPs: bytes of weights, passes, blocks run in all, and bytes
    read back from scratch files (DCM's pair cache)."""

    bytes: float = 0.0
    passes: float = 0.0
    blocks: float = 0.0
    scratch: float = 0.0

    def __add__(self, other: "Reads") -> "Reads":
        return Reads(
            self.bytes + other.bytes,
            self.passes + other.passes,
            self.blocks + other.blocks,
            self.scratch + other.scratch,
        )

    def __rmul__(self, k: float) -> "Reads":
        return Reads(k * self.bytes, k * self.passes, k * self.blocks, k * self.scratch)


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
        """Peak bytes on the device (on a CPU device: everything, the process's baseline included)."""
        peak = self.weights + self.kept + self.transient
        return peak if device.gpu else peak + self.host_kept + device.baseline

    def host_peak(self, device: Device) -> int:
        """Peak bytes on the host: everything on a CPU; beside a GPU, the process's baseline and one model's weights
        while it loads or what the stage keeps on the host, whichever is more."""
        if not device.gpu:
            return self.device_peak(device)
        return max(self.weights // max(self.models, 1), self.host_kept) + device.baseline

    def fits(self, device: Device) -> bool:
        """Whether the stage fits ``device``: its memory, its machine's host memory and disk where known."""
        host = device.host is None or self.host_peak(device) <= device.host
        disk = device.disk is None or self.disk <= device.disk
        return self.device_peak(device) <= device.memory and host and disk

    def seconds(self, device: Device, dtype: str) -> float:
        """Predicted time on ``device``: FLOPs over its throughput, weight reads over its bandwidth, its passes' and
        blocks' fixed costs and the scratch files read back over its disk's rate."""
        r = self.reads
        seconds = self.flops / device.throughput(dtype) + device.read_seconds(dtype, r.bytes)
        return seconds + device.overhead_seconds(r.passes, r.blocks) + device.disk_seconds(r.scratch)


@dataclass
class Placement:
    """A stage on a device: its peaks and time, whether it fits, and what would where it does not."""

    cost: StageCost
    device: Device
    dtype: str
    seconds: float
    fits: bool
    remedies: list[str] = field(default_factory=list)


class Counting:
    """The counts every kind's stage costs are written in (`Context` of the circuits kind, `Meter` of the
    others): a model's weight bytes, a pass's FLOPs (rows x tokens x layers), its activations and its reads."""

    dims: Dims
    dtype: str

    @property
    def weights(self) -> int:
        return self.dims.weight_bytes(self.dtype)

    def fwd(self, rows: float, tokens: float, context: Optional[float] = None, layers: Optional[float] = None) -> float:
        return forward_flops(self.dims, 1, tokens, context, layers) * rows

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


@dataclass
class Context(Counting):
    """What every stage's count reads: the spec, the models' dims, the task's lengths, the dtype, the device."""

    spec: RunSpec
    dims: Dims
    lengths: Lengths
    dtype: str
    device: Device
    #: What a run found that a plan cannot know before it (``mechdiff.studies.resources.KNOWN``); empty: assumed.
    known: dict = field(default_factory=dict)

    def rows(self, n: float) -> int:
        """Prompts a pass holds where a stage runs ``n`` prompts in batches of ``[eval] batch_size``: fewer prompts
        than a batch make a smaller one."""
        return max(1, min(self.spec.eval.batch_size, math.ceil(n)))

    def resumed_runs(self, prompts: int) -> int:
        """F(C)'s run that pruning resumes from (`keep_without`), kept for
        every prompt: the residual stream after every block and every layer's keys and values (grows with
        ``prompts``)."""
        per_token = self.dims.n_layers * (self.dims.d_model + self.dims.kv_width())
        return prompts * self.lengths.longest * per_token * dtype_bytes(self.dtype)

    def ablation_patches(self, rows: int) -> int:
        """Mean-ablation writes of one batch: every layer's ``z`` at every position."""
        return self.dims.n_layers * rows * self.lengths.longest * self.dims.d_model * dtype_bytes(self.dtype)

    @cached_property
    def desiderata(self) -> list[str]:
        """`_desiderata`, read once per context: it reads the task's whole directory, and a plan counts DCM a dozen
        times (each model, each pair-cache mode)."""
        return _desiderata(self)


@dataclass
class Meter(Counting):
    """What the stage costs of the kinds other than circuits read beside their own settings: the models' dims, the
    prompts' token lengths, the dtype and the device."""

    dims: Dims
    lengths: Lengths
    dtype: str
    device: Device

    def rows(self, n: float, batch: int) -> int:
        """Rows a pass holds where a stage runs ``n`` rows in batches of ``batch``."""
        return max(1, min(batch, math.ceil(n)))


@dataclass(frozen=True)
class PlanInputs:
    """What a study kind's stage costs read, from its task file alone (no weights): the kind, its settings (the
    kind's own object: a `RunSpec`, `KnowledgeSettings`, ...), the models' dims and where they came from, the
    prompts' token lengths, the dtype, the models a run loads (their weights checked before the stage table) and
    how many loads it makes, the tokens a batch's matrix multiply holds (this machine's throughput is measured at
    it), and in ``known`` what the kind's counts read beside its settings (the knowledge kind's facts per token
    length, HeadMap's tokens per task, the trajectory's checkpoints and DCM table) and what a finished run found
    (`found_in`, `knowledge_found`, `trajectory_found`; empty: assumed)."""

    kind: str
    settings: Any
    dims: Dims
    source: str
    lengths: Lengths
    dtype: str
    models: tuple[str, ...]
    loads: int
    batch_tokens: int
    remote: bool = False
    known: dict = field(default_factory=dict)

    def meter(self, device: Device) -> Meter:
        return Meter(self.dims, self.lengths, self.dtype, device)


# ---------------------------------------------------------------------------------------------- the stages


def _scored(ctx: Context, stage: str, n: int, scored: float, note: str = "") -> StageCost:
    """A scorer stage on ``n`` prompts: reference means (`_reference_runs`), the full model and ``scored``
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
    model's means of one reference set, so the model's first scorer stage that ablates with the study's set computes
    them (the position scan, curve discovery, pruning, the matrix row: the first that runs) and the later ones read
    them; pruning with a seed of its own (``[scoring.models.NAME] seed``) draws a set of its own, and so does the
    reproduction (its ``n`` prompts); a matrix cell alone (``"matrix-cell"``, benchmarks/gpu.py) meets a cold store."""
    s, (kind, _, name) = ctx.spec, stage.partition(":")  # a stage of no model ("matrix-cell"): name ""
    if kind == "reproduction":
        return s.reproduce.n
    own_seed = s.scoring.models.get(name, {}).get("seed") is not None
    if kind == "matrix-cell" or (kind == "prune" and own_seed):
        return s.scoring.reference_n
    runs = {
        "positions": s.positions.n >= 1,
        "circuit": s.discovery.method == "curve",
        "prune": s.scoring.prune and not own_seed,
        "matrix": True,
    }
    first = next(k for k, on in runs.items() if on)
    return s.scoring.reference_n if kind == first else 0


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
    flops, kept, transient, s = _path_cost(ctx, d.n, name=name)
    held, plan = _held_pairs(ctx, d.n), _plan_steps(ctx)
    parts = math.ceil(d.n / held)
    # the clean and counterfactual runs, then per step, part and pass of s senders a frozen run and the receiver runs
    reads = ctx.reads(parts * _prepared_runs(ctx, d.n, held, len(plan)))
    for step in plan:
        chunks = math.ceil(_step_senders(ctx, step, name) / s)
        reads += ctx.reads(parts * chunks * _step_runs(ctx, step), ctx.dims.n_layers / 2)
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


def _step_senders(ctx: Context, step: Any, name: Optional[str] = None) -> float:
    """Senders a path-patching step scores: every head below its deepest receiver (`
    eligible_senders`), every head of the model for a step into the logits. The deepest receiver is the deepest head of
    the receiving step's group in ``name``'s circuit where the run found it (an upper bound: the circuit keeps
    ``circuit_k`` heads, the receivers are the first ``top_k`` of them), else assumed at the middle layer."""
    dims = ctx.dims
    if not step.receiver:
        return dims.n_layers * dims.n_heads
    found = ctx.known.get("circuit", {}).get(name or "")
    heads = found["groups"].get(step.receiver, []) if found else []
    if heads:
        from ..common.components import parse_heads

        return max(h.layer for h in parse_heads(heads)) * dims.n_heads
    return dims.n_layers / 2 * dims.n_heads


def _step_runs(ctx: Context, step: Any) -> int:
    """Runs a path-patching step makes per pass of senders: the frozen run, and for a step with receivers one
    receiver run per distinct receiver position among a part's prompts (each a suffix run from its own position:
    step D of entity tracking, receivers at the context's label of the queried box, makes one per box)."""
    if not step.receiver:
        return 1
    return 1 + max(ctx.lengths.distinct.get(step.receiver_position, 1), 1)


def _path_cost(
    ctx: Context, n: int, steps: Optional[list[Any]] = None, held: Optional[int] = None, name: Optional[str] = None
) -> tuple[float, int, int, int]:
    """FLOPs, kept bytes, transient bytes and senders a pass of path patching on ``n`` pairs, ``held`` at a time
    (default as ``[discovery] pairs_per_part`` says; held in parts, the clean and counterfactual runs are run once
    more at each step); ``steps``: those of the task's plan to count, default all; ``name``: the model whose found
    circuit bounds each step's senders (`_step_senders`)."""
    t, dims = ctx.lengths, ctx.dims
    half = dims.n_layers / 2
    held = _held_pairs(ctx, n) if held is None else held
    kept = held * held_pair_bytes(dims.n_layers, dims.d_model, dims.kv_width(), t.longest, dtype_bytes(ctx.dtype))
    plan = _plan_steps(ctx) if steps is None else steps
    flops = ctx.fwd(n * _prepared_runs(ctx, n, held, len(plan)), t.tokens)
    s = senders_per_pass(ctx, held, kept)
    transient = ctx.act(held, t.longest)  # the clean and counterfactual runs, a part's pairs at once
    for step in plan:
        senders = _step_senders(ctx, step, name)
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
    """``cost`` keeps F(C)'s run of every one of its prompts (`Context.resumed_runs`), and says so."""
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
    """Every model's circuit (and pruned circuit) kept, and completeness: two runs a draw and two a group removed
    whole (``completeness_groups``, else ``[dcm] groups``); the own circuit's ``random_draws`` random circuits, one
    run each on ``random_prompts`` of the prompts."""
    s, models = ctx.spec.scoring, len(ctx.spec.model_names)
    groups = len(_completeness_groups(ctx, name))
    circuits = _distinct_circuits(ctx) or models * (2 if s.prune else 1)
    scored = circuits + (2 * s.completeness_draws + 2 * groups if s.completeness_draws else 0)
    drawn = min(s.random_prompts or s.n, s.n)
    note = f"{s.random_draws} random circuits x {drawn} prompts = {s.random_draws * drawn} runs"
    cost = _scored(ctx, f"matrix:{name}", s.n, scored, note if s.random_draws else "")
    cost.flops += ctx.fwd(s.random_draws * drawn, ctx.lengths.tokens)
    cost.reads += ctx.reads(s.random_draws * math.ceil(drawn / ctx.spec.eval.batch_size))
    return cost


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
    (`group_choice`): ``wanted`` where they name groups of the circuit the run
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


def dcm(ctx: Context, name: str, semantic: int, mode: Optional[str] = None) -> StageCost:
    """DCM of ``name``'s circuit (see the module docstring); ``semantic``: models its selections are patched into.
    Its pair cache in ``mode`` (one of `CACHE_MODES`), by default the one the run uses
    (`dcm_cache_choice`); its note compares the three."""
    costs = {m: _dcm_cost(ctx, name, semantic, m) for m in CACHE_MODES}
    ran = ctx.known.get("dcm_cache", {}).get(name)
    # a run chooses once, for the base's DCM (``CircuitsStudy.dcm_cache_mode``); every DCM stage runs in that mode
    chosen, why = (mode, "asked") if mode else (ran, "the run's") if ran else dcm_cache_choice(ctx)
    cost = costs[chosen]
    shown = []
    for m, c in costs.items():
        held = f"{c.disk / GIB:.1f} GiB on disk, {c.reads.scratch / 1e12:.2f} TB read" if m == "file" else ""
        held = held or (f"{c.host_kept / GIB:.2f} GiB in host memory" if m == "memory" else "sources run again")
        fit = "" if c.fits(ctx.device) else ", does not fit"
        shown.append(f"{m} ({held}): {_duration(_seconds(c, ctx)).strip()}{fit}")
    cost.note = f"pair cache {chosen} ({why}); " + "; ".join(shown)
    masked = name if ctx.spec.dcm.circuit != "pruned" or not ctx.spec.scoring.prune else f"{name} pruned"
    if masked in ctx.known.get("released", {}):
        cost.note += f"; groups as in {ctx.known['released'][masked]} (the released circuit, assumed)"
    if not cost.fits(ctx.device):
        others = [m for m, c in costs.items() if c.fits(ctx.device)]
        cost.remedy = f'[dcm] cache = "{others[0]}"' if others else ""
    return cost


def dcm_cache_choice(ctx: Context, costs: Optional[dict[str, StageCost]] = None) -> tuple[str, str]:
    """The pair-cache mode DCM runs in and why: ``[dcm] cache`` where it names one, else the fastest on
    ``ctx.device`` of those that fit it (memory, host memory, disk), else the one that holds least (recompute).
    ``costs``: each mode's cost (default: the base's DCM, as a run chooses)."""
    setting = ctx.spec.dcm.cache
    if setting != "auto":
        return setting, "[dcm] cache"
    base = ctx.spec.models.base
    costs = costs or {m: _dcm_cost(ctx, base, len(ctx.spec.model_names), m) for m in CACHE_MODES}
    fitting = [m for m, c in costs.items() if c.fits(ctx.device)]
    if not fitting:
        return "recompute", f"none fits {ctx.device.name}; recompute holds least"
    best = min(fitting, key=lambda m: _seconds(costs[m], ctx))
    return best, f"the fastest that fits {ctx.device.name}"


def _seconds(cost: StageCost, ctx: Context) -> float:
    """``cost``'s time on ``ctx.device``; infinite where the device's throughput in ``ctx.dtype`` is not known (a
    plan recounted under another dtype than this machine's measured one)."""
    try:
        return cost.seconds(ctx.device, ctx.dtype)
    except ValueError:
        return math.inf


def run_cache_mode(spec: RunSpec, lengths: Optional[Lengths] = None) -> tuple[str, str]:
    """The pair-cache mode a run of ``spec`` gives DCM, and why: ``[dcm] cache`` where it names one; else
    `dcm_cache_choice` on the machine the run's models are on (`run_device`); "file" on NDIF (no plan of
    its server)."""
    if spec.dcm.cache != "auto":
        return spec.dcm.cache, "[dcm] cache"
    try:
        dims, _ = model_dims(spec.models.base)
        lengths = lengths or task_lengths(spec)
    except (OSError, ValueError) as err:  # a model or tokenizer the plan cannot read: the file, as before plans
        return "file", f"no plan ({err})"
    device = run_device(spec, dims, lengths)
    if device is None:
        return "file", "a run on NDIF"
    return dcm_cache_choice(Context(spec, dims, lengths, spec.models.dtype, device))


def run_device(spec: RunSpec, dims: Dims, lengths: Optional[Lengths] = None) -> Optional[Device]:
    """The machine a run of ``spec`` computes on, as a plan's device: this CPU measured (throughput, weight and
    scratch-file bandwidth), or the first CUDA GPU as the named device of its kind (`gpu_device`) with this
    machine's host memory and disk; None on NDIF."""
    from ..models.devices import available_memory, scratch_disk, this_machine

    m = spec.models
    if m.remote:
        return None
    if m.device_map or m.device not in (None, "cpu"):
        return gpu_device().with_disk(scratch_disk()).with_host(available_memory()).with_baseline()
    rows = min(2048, spec.eval.batch_size * (lengths or task_lengths(spec)).longest)
    return replace(this_machine(dims, (m.dtype,), rows), disk_read=scratch_bandwidth())


def gpu_device() -> Device:
    """The first CUDA GPU as a named device: the one of its name (H100, H200, A100 of its memory), else an H100's
    figures with its own memory."""
    import torch

    from ..models.devices import DEVICES

    props = torch.cuda.get_device_properties(0)
    name = props.name.upper()
    for key, device in DEVICES.items():
        kind, size = key.split("-")
        if kind.upper() in name and abs(int(size[:-2]) * 1e9 - props.total_memory) < 16e9:
            return replace(device, memory=props.total_memory)
    return replace(DEVICES["h100-80gb"], name=props.name, memory=props.total_memory)


def _dcm_cost(ctx: Context, name: str, semantic: int, mode: str) -> StageCost:
    """DCM's cost with its pair cache in ``mode``: ``"file"`` writes every pair's row to a scratch file and reads it
    back for every patched run (suffix runs from the group's layer and position); ``"memory"`` holds the sources'
    ``z`` (every layer's at each group's position: random heads are drawn from every layer) and runs patched runs in
    full; ``"recompute"`` holds nothing and runs each patched batch's sources again, in full."""
    c, t, dims, b = ctx.spec.dcm, ctx.lengths, ctx.dims, dtype_bytes(ctx.dtype)
    n, k = c.n_train + c.n_val + c.n_test, len(ctx.desiderata)
    file, full = mode == "file", mode != "file"
    # pairs a cache write (and an evaluation) and a training step hold
    built, trained = ctx.rows(n), min(c.batch_size, c.n_train)
    flops = k * ctx.fwd((2 if mode != "recompute" else 1) * n, t.tokens)
    reads = k * ctx.reads((2 if mode != "recompute" else 1) * math.ceil(n / built))
    checks = c.epochs * math.ceil(c.n_train / c.batch_size) / max(c.eval_every, 1) + 1
    masked = name if c.circuit != "pruned" or not ctx.spec.scoring.prune else f"{name} pruned"
    # the random baseline and semantic patching run for a selection of heads: every one, unless the run chose none
    chose = ctx.known.get("dcm_selected", {}).get(name, 1.0)
    groups = _groups(ctx, masked, c.groups)
    starts = _group_starts(ctx, masked, groups)
    positions = {pos for _, pos in starts.values()} or {""}
    # a pair's row of the file: every layer's keys and values and a group's entering residual stream per token, and
    # the sources' z at each position; a patched run reads the keys and values, one stream and one position's z
    source = dims.n_layers * dims.d_model * b
    per_pair = int(t.longest * (dims.n_layers * dims.kv_width() + len(groups) * dims.d_model) * b)
    per_pair += len(positions) * source
    per_run = t.longest * (dims.n_layers * dims.kv_width() + dims.d_model) * b + source
    scratch = k * n * per_pair if file else 0.0  # written once, as the cache is built
    for layer, pos in starts.values():
        runs = 2 * c.epochs * c.n_train + checks * c.n_val + (2 + c.n_random * chose) * c.n_test
        rows_read = c.epochs * c.n_train + checks * c.n_val + (2 + c.n_random * chose) * c.n_test
        tokens, layers = (t.tokens, dims.n_layers) if full else (t.after(pos), dims.n_layers - layer)
        flops += k * ctx.fwd(runs, tokens, t.tokens, layers)
        passes = 2 * c.epochs * math.ceil(c.n_train / trained) + checks * math.ceil(c.n_val / built)
        passes += (2 + c.n_random * chose) * math.ceil(c.n_test / built)
        reads += k * ctx.reads(passes, layers)
        if mode == "recompute":  # every patched batch's sources again (forward only)
            flops += k * ctx.fwd(rows_read, t.tokens)
            reads += k * ctx.reads(passes - c.epochs * math.ceil(c.n_train / trained))
        scratch += k * rows_read * per_run if file else 0.0
        # semantic patching: per model a cache of the test pairs and one patched evaluation
        flops += k * chose * semantic * (ctx.fwd(2 * c.n_test, t.tokens) + ctx.fwd(c.n_test, tokens, t.tokens, layers))
        reads += k * chose * semantic * (ctx.reads(2 * math.ceil(c.n_test / built)))
        reads += k * chose * semantic * ctx.reads(math.ceil(c.n_test / built), layers)
        scratch += k * chose * semantic * c.n_test * (per_pair + per_run) if file else 0.0
        # semantic patching's random heads: n_random patched runs of the test pairs in every model
        flops += k * chose * semantic * ctx.fwd(c.n_random * c.n_test, tokens, t.tokens, layers)
        reads += k * chose * semantic * ctx.reads(c.n_random * math.ceil(c.n_test / built), layers)
    longest_after = max((t.after(p) for _, p in starts.values()), default=t.tokens) if file else t.tokens
    depth = dims.n_layers / 2 if file else dims.n_layers
    # a training step: its backward's activations and (file) the rows it read back (its keys and values prefix)
    step = backward_bytes(dims, trained, math.ceil(longest_after), depth, ctx.dtype, t.longest)
    step += trained * per_pair if file else 0
    # a cache write: a forward keeping (file) every layer's keys and values, and their stacked copy
    write = ctx.act(built, t.longest) + (2 * built * per_pair if file else 0)
    host = {"file": max(built, trained) * per_pair, "memory": n * len(positions) * source, "recompute": 0}[mode]
    disk = n * per_pair if file else 0  # the scratch file: every pair's row, one desideratum's file at a time
    stage = "dcm" if name == ctx.spec.models.base else f"dcm:{name}"
    return StageCost(
        stage,
        2,
        n,
        trained,
        flops,
        2 * ctx.weights,
        0,
        max(step, write),
        host,
        disk,
        batch_option="[dcm] batch_size",
        reads=replace(reads, scratch=scratch),
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
    the position) and the isolation of Q/K/V (`isolation_patches`, every position)
    from the first token."""
    c = ctx.spec.cmap
    whole = part != "z" and (c.isolate or c.scope == "paper" or bool(set(part) & {"k", "v"}))
    return ctx.lengths.tokens if whole else ctx.lengths.after(position)


def cmap(ctx: Context, finetune: str) -> StageCost:
    """Per prompt the fine-tune's run (capturing) and the base's; then per scope (each group, the whole circuit)
    and part one patched base run, and ``n_random`` more per group on ``random_prompts`` of the prompts: suffix runs
    from the scope's lowest layer and position (the base's circuit, as ``[cmap] scope = "base"`` patches it)."""
    c, t, b, dims = ctx.spec.cmap, ctx.lengths, ctx.spec.eval.batch_size, ctx.dims
    base = ctx.spec.models.base
    starts = _group_starts(ctx, base, _groups(ctx, base, c.groups))
    if starts:  # the whole circuit: from its lowest layer and its earliest position
        whole = min(v[0] for v in starts.values()), max((v[1] for v in starts.values()), key=t.after)
        starts = {**starts, "": whole}
    flops, batches = ctx.fwd(2 * c.n, t.tokens), math.ceil(c.n / b)
    reads = ctx.reads(2 * batches)
    # the random draws on random_prompts of the prompts: where fewer than all, in a pass of their own
    drawn = min(c.random_prompts or c.n, c.n) if c.n_random else c.n
    if drawn < c.n:
        flops, reads = flops + ctx.fwd(2 * drawn, t.tokens), reads + ctx.reads(2 * math.ceil(drawn / b))
    for group, (layer, pos) in starts.items():
        runs, passes = (
            c.n + (c.n_random * drawn if group else 0),
            batches + (c.n_random * math.ceil(drawn / b) if group else 0),
        )
        for part in c.parts:
            flops += ctx.fwd(runs, _cmap_tokens(ctx, part, pos), t.tokens, dims.n_layers - layer)
            reads += ctx.reads(passes, dims.n_layers - layer)
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


#: A stage's cost counted beside its computation in the study's own module (``(ctx, model) -> StageCost``), handed
#: in by the study (`CircuitsStudy.stage_costs`), so this module imports no study.
Counted = Callable[[Context, str], StageCost]


def stage_costs(ctx: Context, accuracy: Counted) -> list[StageCost]:
    """Every stage of the study, in the order a run meets them; those the file does not run (``[reproduce] only``)
    marked so. ``accuracy``: the accuracy stage's cost, counted beside it (`mechdiff.studies.circuits.accuracy_cost`;
    the others: below, here)."""
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
    fits = cost.fits(device)
    seconds = cost.seconds(device, dtype)
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


def circuits_inputs(
    spec: RunSpec, lengths: Optional[Lengths] = None, dtype: Optional[str] = None, known: Optional[dict] = None
) -> PlanInputs:
    """A circuits study's `PlanInputs`: the base's dims, the task's lengths (`task_lengths`), ``dtype`` (default
    the spec's), ``known`` (what a run found, `found_in`)."""
    dims, source = model_dims(spec.models.base)
    lengths = lengths or task_lengths(spec)
    rows = min(2048, spec.eval.batch_size * lengths.longest)  # a batch's tokens: the stages' matrix multiplies
    names = tuple(spec.model_names)
    return PlanInputs(
        "circuits", spec, dims, source, lengths, dtype or spec.models.dtype, names, len(names), rows,
        spec.models.remote, known or {},
    )  # fmt: skip


def circuits_costs(inputs: PlanInputs, device: Device, accuracy: Counted) -> list[StageCost]:
    """Every stage of a circuits study (`stage_costs`) on ``device``."""
    spec = inputs.settings
    ctx = Context(spec, inputs.dims, inputs.lengths, inputs.dtype, device, with_released(spec, inputs.known))
    return stage_costs(ctx, accuracy)


def resource_plan(
    spec: RunSpec,
    device: Device,
    lengths: Optional[Lengths] = None,
    dtype: Optional[str] = None,
    known: Optional[dict] = None,
) -> list[Placement]:
    """Every stage of the circuits study ``spec`` placed on ``device`` in ``dtype`` (default the spec's);
    ``known``: what a run found that the plan otherwise assumes (`Context`)."""
    return placements(circuits_inputs(spec, lengths, dtype, known), device)


def placements(inputs: PlanInputs, device: Device) -> list[Placement]:
    """Every stage of a study of any kind placed on ``device``: its kind's ``stage_costs`` (`Study.stage_costs`),
    each recounted under another dtype or batch size for the remedies of a stage that does not fit."""
    from .base import study_class

    kind = study_class(inputs.kind)
    costs = kind.stage_costs(inputs, device)

    def recount(i: int, cost: StageCost, dtype: str, batch: int) -> StageCost:
        again = replace(inputs, dtype=dtype, settings=kind.with_batch(inputs.settings, cost, batch))
        return kind.stage_costs(again, device)[i]

    return [place(c, device, inputs.dtype, partial(recount, i, c)) for i, c in enumerate(costs)]


@dataclass
class ResourcePlan:
    """A study's resource plan on one device, as data: its inputs, each stage placed, and on this machine the
    processes and threads a run would use (`format` prints it)."""

    inputs: PlanInputs
    placements: list[Placement]
    workers: Optional[Workers] = None

    def format(self) -> str:
        i = self.inputs
        return format_resources(self.placements, i.lengths, i.source, i.loads, self.workers)


def with_released(spec: RunSpec, known: dict) -> dict:
    """``known`` with the ``[reproduce] circuit`` (a released circuit of the base, e.g. the paper's pruned LLaMA-7B
    circuit) as the base's pruned circuit where the run has not found one: its groups' heads and lowest layers stand
    in for the middle layer the plan otherwise assumes (DCM and CMAP run from a group's lowest layer). Recorded under
    ``"released"``, so the notes say so."""
    base, path = spec.models.base, Path(spec.reproduce.circuit) if spec.reproduce.circuit else None
    pruned = f"{base} pruned"
    if path is None or not path.is_file() or pruned in known.get("circuit", {}):
        return known
    released = json.loads(path.read_text())
    if released.get("model") != base:
        return known
    return {**known, "circuit": {**known.get("circuit", {}), pruned: released}, "released": {pruned: str(path)}}


def found_in(run_dir: str | Path) -> dict:
    """What a plan assumes and a finished run's stage records know (``known`` of `resource_plan`): each
    circuit (``"NAME"``) and pruned circuit (``"NAME pruned"``), the position scan's steps, the share of pairs
    greedy pruning searched, the share of DCM's masks that selected a head, the mode of DCM's pair cache."""
    out: dict = {"circuit": {}, "scan_steps": {}, "searched": {}, "dcm_selected": {}, "dcm_cache": {}}
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
            if result.get("cache"):  # the pair-cache mode the run used (absent from runs before the modes)
                out["dcm_cache"][model or result["model"]] = result["cache"]
    return out


#: Width of the random model `pass_overhead` times: its FLOPs and weight reads are negligible.
OVERHEAD_WIDTH = 64


def pass_overhead(dims: Dims, min_seconds: float = 0.2) -> tuple[float, float]:
    """CPU seconds a pass costs beside its FLOPs and weight reads, and each block it runs: ``run`` (through the
    intervention layer) of one token on a random LLaMA of ``dims``' depth and `OVERHEAD_WIDTH`, timed in full
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
    """This machine (a CPU device) with `pass_overhead` and `scratch_bandwidth` measured; a GPU device as
    it is."""
    if device.gpu:
        return device
    each, block = pass_overhead(dims)
    disk = scratch_bandwidth()
    note = (
        f"{device.note}; {each * 1e3:.1f} ms a pass and {block * 1e3:.2f} ms a block beside them; scratch files "
        f"read back at {disk / 1e9:.1f} GB/s (wall)"
    )
    return replace(device, overhead=(each, block), note=note, disk_read=disk)


#: What `scratch_bandwidth` writes and reads back: rows of a few MB, as DCM's pair cache holds.
SCRATCH_ROWS, SCRATCH_ROW_BYTES = 32, 4 * 2**20


def scratch_bandwidth(min_seconds: float = 0.2) -> float:
    """Bytes a wall-clock second that rows of a scratch file (`RowStore`, read as
    DCM's pair cache reads them: batches of 8 rows in a shuffled order) come back under TMPDIR just after they were
    written (from the page cache where memory holds them, as a run's are). Wall time, not CPU time: a read that
    waits on the disk costs time but little CPU."""
    import time

    import numpy as np
    import torch

    from ..patching.store import RowStore

    store = RowStore(SCRATCH_ROWS)
    try:
        store.write("rows", range(SCRATCH_ROWS), torch.ones(SCRATCH_ROWS, SCRATCH_ROW_BYTES // 4))
        order = np.random.default_rng(0).permutation(SCRATCH_ROWS)
        batches = [sorted(order[i : i + 8].tolist()) for i in range(0, SCRATCH_ROWS, 8)]
        reps, start = 0, time.perf_counter()
        while (spent := time.perf_counter() - start) < min_seconds or reps < 2:
            for batch in batches:
                store.read("rows", batch)
            reps += 1
        return SCRATCH_ROWS * SCRATCH_ROW_BYTES * reps / spent
    finally:
        store.close()


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


@dataclass(frozen=True)
class Workers:
    """How a run will proceed on this machine: ``processes`` (one per model, or 1) of ``threads`` torch threads
    each, and why (``mechdiff.commands._workers.plan_workers``)."""

    processes: int
    threads: int
    reason: str = ""
    base: str = ""  # the base model, whose process runs the base's DCM (stage "dcm")


def format_resources(
    plan: list[Placement], lengths: Lengths, dims_source: str, loads: int = 0, workers: Optional[Workers] = None
) -> str:
    """The plan as a table: each stage's models held, n, batch, FLOPs, host and device peaks, time and fit; then
    what would fit where a stage does not, and the totals: with ``loads`` models to load, their loading; on this
    machine, the wall time of the run's ``workers``."""
    if not plan:
        return "no stage to plan"
    device, dtype = plan[0].device, plan[0].dtype
    width = max(len(p.cost.stage) for p in plan)
    unit = "CPU time" if not device.gpu else "time"
    head = f"{'stage':{width}s}  models      n  batch     PFLOP  host GiB  dev. GiB  disk GiB  {unit:>9s}  fits"
    disk = "disk not given" if device.disk is None else f"{device.disk / GIB:.0f} GiB free under TMPDIR"
    host = "" if device.host is None else f"; host {device.host / GIB:.0f} GiB"
    host += f"; {device.baseline / GIB:.2f} GiB a process before its models load" if device.baseline else ""
    lines = [
        f"resource plan on {device.name} ({device.memory / GIB:.0f} GiB{' available' if not device.gpu else ''}"
        f"{host}; {disk}; {device.note}), {dtype}",
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
    lines += _notes(plan) + _totals(plan) + _loading(plan, loads) + _wall(plan, workers)
    return "\n".join(lines)


def _loading(plan: list[Placement], loads: int) -> list[str]:
    """Loading ``loads`` models' weights from disk at the device's disk rate (not in the stages' times)."""
    device, cost = plan[0].device, plan[0].cost
    if not loads or not device.disk_read:
        return []
    each = cost.weights // max(cost.models, 1)
    seconds = loads * each / device.disk_read
    return [
        f"loading {loads} models ({each / GIB:.1f} GiB each) at {device.disk_read / 1e9:.1f} GB/s: "
        f"{_duration(seconds).strip()} more (once each a process)"
    ]


def _wall(plan: list[Placement], workers: Optional[Workers]) -> list[str]:
    """On this machine: the wall time of the stages that run in ``workers``' processes (each process's CPU seconds
    over its threads; the longest process), and a warning where the throughput was measured under load."""
    from ..models.devices import LOADED

    device = plan[0].device
    if device.gpu:
        return []
    out = []
    if workers is not None:
        per: dict[str, float] = {}
        for p in plan:
            owner = p.cost.stage.partition(":")[2] or workers.base  # the base's DCM: "dcm"
            key = owner if workers.processes > 1 else ""
            per[key] = per.get(key, 0.0) + (p.seconds if p.cost.runs else 0.0)
        wall = max(per.values(), default=0.0) / max(workers.threads, 1)
        out.append(
            f"wall time with {workers.processes} process{'es' * (workers.processes > 1)} of {workers.threads} "
            f"thread{'s' * (workers.threads > 1)}: about {_duration(wall).strip()} (each process's CPU time over "
            f"its threads, the longest process; {workers.reason})"
        )
    if device.load > LOADED:
        out.append(
            f"calibrated under load: the load average was {device.load:.1f} a core while this machine's throughput "
            "was measured, so a CPU second did less than on an idle machine and these times may run high; plan "
            "again when the machine is idle"
        )
    return out


def _notes(plan: list[Placement]) -> list[str]:
    out = []
    for p in plan:
        c, device = p.cost, p.device
        if c.note:
            out.append(f"  {c.stage}: {c.note}")
        if not p.fits:
            need = f"{c.device_peak(device) / GIB:.1f} GiB"
            if device.disk is not None and c.disk > device.disk:
                need += f", {c.disk / GIB:.1f} GiB on disk"
            if device.host is not None and c.host_peak(device) > device.host:
                need += f", {c.host_peak(device) / GIB:.1f} GiB of host memory"
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


def plan_inputs(path: Optional[str], task: Optional[str] = None, dtype: Optional[str] = None) -> PlanInputs:
    """The `PlanInputs` of the task file ``path`` (None: the embedded default circuits study), of any kind: its
    kind's ``plan_inputs`` (`Study.plan_inputs`), which reads the file and the models' configs, no weights."""
    from .base import DEFAULT_KIND, study_class, study_kind

    kind = study_kind(path) if path is not None else DEFAULT_KIND
    return study_class(kind).plan_inputs(path, task, dtype)


def study_resources(
    path: Optional[str],
    device: Optional[str] = None,
    dtype: Optional[str] = None,
    task: Optional[str] = None,
    disk_gib: Optional[float] = None,
    host_gib: Optional[float] = None,
    workers: Optional[Callable[[PlanInputs], Optional[Workers]]] = None,
) -> list[ResourcePlan]:
    """The resource plan of the study of the task file ``path``, of any kind, as data: on this machine (measured)
    and, where ``device`` names one, on that device (its machine with ``disk_gib`` GiB free under TMPDIR and
    ``host_gib`` GiB of host memory where given, else `COMMON_GPU_DISK` and ``COMMON_GPU_HOST``). ``workers``: how
    a run would proceed here (its processes and threads), for the wall time on this machine."""
    from ..models.devices import get_device, this_machine

    named = get_device(device) if device else None  # an unknown name is refused before anything is measured
    if named is not None:
        named = named.with_disk(None if disk_gib is None else int(disk_gib * GIB)).with_baseline()
        named = named.with_host(None if host_gib is None else int(host_gib * GIB))
    inputs = plan_inputs(path, task, dtype)
    here = with_overhead(this_machine(inputs.dims, (inputs.dtype,), inputs.batch_tokens), inputs.dims)
    out = [ResourcePlan(inputs, placements(inputs, here), workers(inputs) if workers else None)]
    if named is not None:
        out.append(ResourcePlan(inputs, placements(inputs, named)))
    return out


def print_resources(
    path: Optional[str],
    device: Optional[str],
    dtype: Optional[str] = None,
    task: Optional[str] = None,
    disk_gib: Optional[float] = None,
    host_gib: Optional[float] = None,
    workers: Optional[Callable[[PlanInputs], Optional[Workers]]] = None,
) -> bool:
    """What ``mechdiff run --plan`` prints first, for a study of any kind: its resource plan (`study_resources`)
    on this machine and on the named ``device``. Returns True where the models' weights are absent, so that the
    stage cache (which needs the tokenizer and weights checked) cannot be read: the plan then ends here, said so."""
    from .reproduce import check_weights

    plans = study_resources(path, device, dtype, task, disk_gib, host_gib, workers)
    print(plans[0].format())
    print(flush=True)
    for plan in plans[1:]:
        print(plan.format(), end="\n\n")
    inputs = plans[0].inputs
    try:
        check_weights(inputs.models, remote=inputs.remote)
    except FileNotFoundError as err:
        print(f"stage cache not read (the resource plan above needs only configs): {err}")
        return True
    return False
