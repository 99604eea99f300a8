"""The resource planner, one for every study kind: each stage's peak memory (host and device) and time, predicted
from the models' configs, the task's token lengths, each stage's settings and the dtype, on this machine or on a
named device (`mechdiff.models.devices`); for a stage that does not fit, what would.

Nothing loads: the configs are the shipped ones or the models' own metadata (`model_dims`), the token lengths come
from the task's prompts under the base's tokenizer or, where that is absent (the paper's models without their
weights), under the embedded SmolLM2 tokenizer (an estimate, said so).

This module restates no stage: it asks the study's kind (`Study.plan_inputs`, `Study.stage_costs`) for every
stage's `StageCost`, which each kind counts beside the stage's computation (the circuits kind in
`mechdiff.studies.circuits.stages`, one module a stage; the others after their stages in their ``study.py``), in
the units of `Counting`: a pass's FLOPs, its activations and the weights it reads.

Memory is the models' weights, what the stage keeps beside them and the transient activations of its largest
batch (`forward_bytes`, `backward_bytes`), and the
process's own before its models load (this process's resident memory: Python, torch, transformers, a tokenizer);
scratch files are counted apart, against the disk free under TMPDIR; beside a GPU, host memory against the
machine's (a named GPU's: 128 GiB and 64 GiB of disk unless ``--plan-host``/``--plan-disk`` say otherwise).
Time is FLOPs over the device's throughput (measured here, per CPU second; a named device's stated share of peak)
plus the weights each pass reads (the blocks it runs and the unembedding) over the device's bandwidth: a pass of few
rows (pruning's and DCM's short suffix runs) takes the time its weights take to read, whatever its FLOPs
(`mechdiff.models.devices`); each pass's fixed cost (Python, the intervention layer's trace: measured here,
`mechdiff.studies.machine.pass_overhead`; stated for a named GPU, ``GPU_OVERHEAD``); and the scratch files read back
over the disk's rate (measured here, `mechdiff.studies.machine.scratch_bandwidth`; stated for a named GPU's
machine). Passes are counted at each stage's batch size. Loading the models (their weights over the disk's rate)
and, on this machine, the wall time of the processes and threads the run will use are given after the totals, with a
warning where the throughput was measured under load.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from functools import partial
from statistics import mean
from typing import Any, Callable, Optional

from ..models.devices import GIB, Device
from ..models.footprint import (
    Dims,
    dtype_bytes,
    forward_bytes,
    forward_flops,
)
from .machine import with_overhead

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
    #: Each sampled prompt's tokens from each named position to the end (inclusive), as ``suffix`` averages them.
    spread: dict[str, tuple[float, ...]] = field(default_factory=dict)

    def after(self, position: Optional[str]) -> float:
        """Tokens computed by a suffix run from ``position`` (the whole prompt where it is not a named position)."""
        return self.suffix.get(position or "", self.tokens)

    def batch_after(self, position: Optional[str], rows: int) -> float:
        """Tokens a suffix run of ``rows`` prompts computes for each prompt: a batch runs from its earliest
        position on (``patching.core``'s start), so the expected most of ``rows`` prompts' tokens after ``position``
        drawn from the sample (`after` where the sample is not kept, or the position does not move)."""
        values = sorted(self.spread.get(position or "", ()))
        if not values:
            return self.after(position)
        m = len(values)
        return sum(v * (((i + 1) / m) ** rows - (i / m) ** rows) for i, v in enumerate(values))


def planning_tokenizer(model: str) -> tuple[Any, str]:
    """``model``'s tokenizer, else the stand-in's (`STAND_IN_TOKENIZER`), and the name the plan gives it."""
    from ..models.loading import load_tokenizer
    from ..models.resolve import resolve_spec

    try:
        return load_tokenizer(resolve_spec(model)), model
    except (OSError, ValueError):
        used = f"{STAND_IN_TOKENIZER}'s (an estimate: {model}'s tokenizer is absent)"
        return load_tokenizer(resolve_spec(STAND_IN_TOKENIZER)), used


def task_lengths(spec: Any, tokenizer: Any = None) -> Lengths:
    """Token lengths of ``LENGTH_SAMPLE`` of the study's prompts under the base's tokenizer (``tokenizer`` where the
    study holds it, else read), else the stand-in's. ``spec``: any kind's spec with ``models.base`` and ``[task]``
    (the circuits kind's `RunSpec`, a trajectory's); untyped so the generic planner imports no kind."""
    from ..runs.seeds import prompt_seed
    from ..tasks.base import get_task

    tokenizer, used = (tokenizer, spec.models.base) if tokenizer is not None else planning_tokenizer(spec.models.base)
    task = get_task(spec.task.name)
    n = min(LENGTH_SAMPLE, len(task.strata)) if task.strata else LENGTH_SAMPLE
    # an imported task's rows in file order may be one template: sample them stratified, as its prompt sets are
    task, _ = task.draw_prompt_sets({"eval": n}, spec.task.seed)
    options = {"n_boxes": spec.task.n_boxes, "prompt_set": "eval", **task.split_options("eval")}
    records = task.records(tokenizer, n, prompt_seed(spec.task.seed, "eval"), **options)
    extra = [_appended(r, task.metric) for r in records]  # answers of several tokens: teacher-forced runs
    sizes = [len(r.input_ids) * len(e) + sum(e) for r, e in zip(records, extra)]
    spread = {
        name: tuple(float((len(r.input_ids) - r.positions[name]) * len(e) + sum(e)) for r, e in zip(records, extra))
        for name, pos in records[0].positions.items()
        if isinstance(pos, int)
    }
    suffix = {name: mean(values) for name, values in spread.items()}
    masks = getattr(type(records[0]), "position_masks", None)
    classes = len(masks(records[:1], len(records[0].input_ids))) if masks else len(records[0].positions)
    distinct = {name: len({r.positions[name] for r in records}) for name in suffix}
    return Lengths(mean(sizes), max(sizes), suffix, classes, used, distinct, spread)


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
    #: ``host_kept`` is a batch's rows staged on the host on their way to a GPU (DCM's rows read back from its
    #: scratch file): on a CPU they are the batch's own tensors, which ``transient`` counts, so not again
    staged: bool = False

    def device_peak(self, device: Device) -> int:
        """Peak bytes on the device (on a CPU device: everything, the process's baseline included)."""
        peak = self.weights + self.kept + self.transient
        return peak if device.gpu else peak + (0 if self.staged else self.host_kept) + device.baseline

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


# ---------------------------------------------------------------------------------------------- the plan


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


def _gb(x: int) -> str:
    return f"{x / GIB:7.1f}"


def duration(seconds: float) -> str:
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
            f"{_gb(c.host_peak(device))}   {dev}   {_gb(c.disk)}  {duration(p.seconds):>9s}  {mark}"
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
        f"{duration(seconds).strip()} more (once each a process)"
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
            f"thread{'s' * (workers.threads > 1)}: about {duration(wall).strip()} (each process's CPU time over "
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
    out = [f"the run as written: {duration(sum(p.seconds for p in ran)).strip()} predicted"]
    if len(ran) < len(plan):
        out.append(f"the whole study ([reproduce] only = false): {duration(whole).strip()} predicted")
    kinds: dict[str, float] = {}
    for p in plan:
        kinds[p.cost.stage.split(":")[0]] = kinds.get(p.cost.stage.split(":")[0], 0.0) + p.seconds
    kind = max(kinds, key=kinds.__getitem__)
    out.append(
        f"dominant stage: {kind} ({duration(kinds[kind]).strip()} over its models, {kinds[kind] / whole:.0%} of the "
        f"whole study's time; its longest: {top.cost.stage}, {duration(top.seconds).strip()})"
    )
    if whole > THIRTY_MINUTES:
        rest = whole - kinds[kind]
        why = (
            f"{kind} keeps the study from it (the other stages: {duration(rest).strip()})"
            if rest <= THIRTY_MINUTES
            else f"its largest part is {kind}; the other stages alone take {duration(rest).strip()}"
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
    from ..models.weights import check_weights

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
