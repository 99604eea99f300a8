"""The resource planner's prediction beside measurement, stage by stage, on randomly initialised LLaMA-7B-width models.

No weights and no network: models are made from the shipped LLaMA-7B config (``mechdiff/data/configs``), depth cut
to ``--layers`` (the vocabulary is SmolLM2's tokenizer's, whose prompts they read), randomly initialised on the
device (``--tokenizer``: a saved SmolLM2 tokenizer, as ``benchmarks/gpu_bundle.py`` exports it, in place of the GGUF's).
Each stage runs as the study runs it, on the entity-tracking prompts, and is counted by the planner
(:mod:`mechdiff.studies.planner`) for the same sizes:

- ``accuracy``: one forward a prompt (:func:`mechdiff.patching.evaluate.evaluate`);
- ``matrix-cell``: reference means, the full model and one circuit mean-ablated (a matrix cell;
  :class:`mechdiff.circuits.scoring.Scorer`);
- ``path-step-A`` to ``path-step-D``: path patching of each step of the task's plan, every eligible head an exact
  sender (:func:`mechdiff.patching.path.path_patch`), a step's receivers its receiver step's ``k`` heads in the
  deepest layers (:func:`path_steps`); step D's receiver runs are suffix runs from its position;
- ``path-step-A-parts``: step A with its pairs held in two parts (``[discovery] pairs_per_part``,
  :class:`mechdiff.patching.path_pairs.PairStream`);
- ``dcm-epoch``: DCM of one group for one epoch: the pair cache, training, validation, test and the random baseline
  (:func:`mechdiff.methods.dcm.run_dcm`), two models held;
- ``cmap-pass``: CMAP of one group and the circuit from a second model into the first
  (:func:`mechdiff.methods.cmap.run_cmap`), two models held.

Memory: on CUDA ``torch.cuda.max_memory_allocated`` above the allocation before the stage, against the planner's
bytes beside the weights (kept plus transient); on CPU the peak allocation above the stage's start (memray, as
``benchmarks/planner.py`` measures it; memray slows the CPU time it is measured beside a little; without memray,
as on a GPU image, not measured). Time: on CUDA wall
time with ``torch.cuda.synchronize``, against the planner's time on the named device of the same kind
(``--plan-device``, default from the GPU's name) and on the GPU's measured matrix-multiply throughput; on CPU the
CPU time against the planner's on this machine. ``--full`` adds LLaMA-7B's whole 32-layer config in bfloat16 for
the accuracy stage where it fits the device's memory. Each row is printed as it is measured, so a run stopped at
its time limit keeps what it measured. ``--plan-only`` prints the plan on ``--plan-device`` (default one H100) and
runs nothing (the models on the meta device), on any machine.

    python benchmarks/gpu.py --device cuda --layers 4          # what benchmarks/gpu.sh runs
    python benchmarks/gpu.py --device cpu --layers 2 --quick   # a reduced form, here
    python benchmarks/gpu.py --device cuda --plan-only         # the plan on one H100, anywhere
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Optional

import torch

GIB = 2**30
STAGES = (
    "accuracy",
    "matrix-cell",
    "path-step-A",
    "path-step-A-parts",
    "path-step-B",
    "path-step-C",
    "path-step-D",
    "dcm-epoch",
    "cmap-pass",
)


@dataclass
class Sizes:
    """Prompts and batches of every stage."""

    n: int = 32  # prompts of accuracy, the matrix cell and CMAP
    batch: int = 16
    reference: int = 32  # prompts whose means ablate
    pairs: int = 16  # path-patching pairs
    dcm_train: int = 32
    dcm_val: int = 8
    dcm_test: int = 8


QUICK = Sizes(n=4, batch=4, reference=4, pairs=2, dcm_train=4, dcm_val=2, dcm_test=2)


def smollm2_tokenizer(path: Optional[str] = None) -> Any:
    """SmolLM2's tokenizer: saved at ``path`` (``tokenizer.json``, as ``benchmarks/gpu_bundle.py`` exports it), else
    from the installed SmolLM2 GGUF."""
    from transformers import AutoTokenizer

    from mechdiff.models.loading import load_tokenizer
    from mechdiff.models.resolve import resolve_spec

    return AutoTokenizer.from_pretrained(path) if path else load_tokenizer(resolve_spec("smollm2-135m"))


def make_model(
    config: dict, layers: Optional[int], dtype: str, device: str, seed: int, name: str, tokenizer: Any
) -> Any:
    """A LoadedModel: LLaMA ``config`` cut to ``layers`` blocks with ``tokenizer``'s vocabulary, random."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from mechdiff.models.loading import DTYPES, LoadedModel, contiguous_unembedding
    from mechdiff.models.registry import ModelSpec

    config = {k: v for k, v in config.items() if not k.startswith("_")}
    config["vocab_size"] = len(tokenizer)
    if layers:
        config["num_hidden_layers"] = layers
    cfg = LlamaConfig(**config, attn_implementation="eager")
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=DTYPES[dtype]).eval()
    model.requires_grad_(False)
    contiguous_unembedding(model)  # as load_model does for every model mechdiff runs
    spec = ModelSpec(name, "local", "<memory>")
    return LoadedModel(name, spec, model, tokenizer, {"kind": "memory", "seed": seed})


def spec_for(sizes: Sizes, dtype: str) -> Any:
    """The study's spec at these sizes: what the planner counts."""
    from mechdiff.studies.circuits.spec import default_spec

    spec = default_spec()
    spec.models.dtype = dtype
    spec.task.n_boxes = 7
    spec.eval.n, spec.eval.batch_size = sizes.n, sizes.batch
    spec.scoring.reference_n = sizes.reference
    spec.discovery.method, spec.discovery.n = "path", sizes.pairs
    c = spec.dcm
    c.n_train, c.n_val, c.n_test, c.epochs, c.batch_size = sizes.dcm_train, sizes.dcm_val, sizes.dcm_test, 1, 8
    c.desiderata, c.groups = ["positional"], ["A"]
    spec.cmap.n, spec.cmap.groups, spec.cmap.parts, spec.cmap.n_random = sizes.n, ["A"], ["z"], 0
    return spec


class Measure:
    """Peak memory above the start and time of the ``with`` block: CUDA allocations and synchronised wall time, or
    allocations (memray; None where memray is not installed) and CPU time."""

    def __init__(self, device: str) -> None:
        self.cuda, self.meta = device.startswith("cuda"), device == "meta"

    def __enter__(self) -> "Measure":
        if self.meta:  # nothing runs (a plan only)
            self.seconds, self.bytes = 0.0, None
        elif self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.start = torch.cuda.memory_allocated()
            self.t0 = time.perf_counter()
        else:
            import tempfile

            try:
                import memray
            except ImportError:  # a bare machine's environment (gpu.sh --check-bare): CPU time only
                self.tracker, self.t0 = None, time.process_time()
                return self
            self.scratch = tempfile.TemporaryDirectory()
            self.trace = Path(self.scratch.name) / "stage.bin"
            self.tracker = memray.Tracker(self.trace, native_traces=False, trace_python_allocators=True)
            self.tracker.__enter__()
            self.t0 = time.process_time()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.meta:
            return
        if self.cuda:
            torch.cuda.synchronize()
            self.seconds = time.perf_counter() - self.t0
            self.bytes = torch.cuda.max_memory_allocated() - self.start
        else:
            self.seconds = time.process_time() - self.t0
            if self.tracker is None:
                self.bytes = None
                return
            import memray

            self.tracker.__exit__(None, None, None)
            self.bytes = memray.FileReader(self.trace).metadata.peak_memory
            self.scratch.cleanup()


def gpu_matmul_throughput(dims: Any, dtype: str, rows: int) -> float:
    """FLOP/s of ``(rows, d_model) @ (d_model, d_ff)`` on the GPU (wall time, synchronised)."""
    from mechdiff.models.loading import DTYPES

    a = torch.randn(rows, dims.d_model, dtype=DTYPES[dtype], device="cuda")
    b = torch.randn(dims.d_model, dims.d_ff, dtype=DTYPES[dtype], device="cuda")
    torch.mm(a, b)
    torch.cuda.synchronize()
    reps, t0 = 20, time.perf_counter()
    for _ in range(reps):
        torch.mm(a, b)
    torch.cuda.synchronize()
    return 2 * rows * dims.d_model * dims.d_ff * reps / (time.perf_counter() - t0)


def stages(models: list, sizes: Sizes, spec: Any, ctx: Any) -> dict[str, tuple[Callable[[], Any], Any]]:
    """Each stage: (its run, the planner's :class:`~mechdiff.studies.planner.StageCost` of it)."""
    from mechdiff.circuits.circuit import Circuit
    from mechdiff.circuits.scoring import Scorer
    from mechdiff.common.components import Head
    from mechdiff.methods.cmap import run_cmap
    from mechdiff.methods.dcm import random_pool, run_dcm
    from mechdiff.methods.dcm_cache import PairCache
    from mechdiff.patching.evaluate import evaluate
    from mechdiff.studies.circuits.stages import cmap, counting, dcm
    from mechdiff.studies.circuits.stages.accuracy import cost as accuracy_cost
    from mechdiff.studies.circuits.stages.dcm import dcm_config
    from mechdiff.tasks.base import get_task
    from mechdiff.tasks.entity_tracking import path_patching_pairs, positional_pairs

    base, other = models[0], models[-1]
    tok, shape = base.tokenizer, base.shape
    task = get_task("entity-tracking")
    records = task.records(tok, sizes.n, 0, n_boxes=7)
    reference = task.records(tok, sizes.reference, 1, n_boxes=7)
    step = counting.plan_steps(ctx)[0]
    heads = [Head(layer, h) for layer in range(shape.n_layers) for h in range(0, shape.n_heads, 4)]
    circuit = Circuit(base.name, "entity-tracking", {"A": heads}, {"A": step.sender})
    pairs = path_patching_pairs(tok, sizes.pairs, n_boxes=7, seed=0)
    dcm_pairs = positional_pairs(tok, sizes.dcm_train + sizes.dcm_val + sizes.dcm_test, n_boxes=7, seed=1)
    config = dcm_config(spec)

    def matrix_cell() -> None:
        scorer = Scorer.build(base, records, reference, sizes.batch, progress=False)
        scorer.full()
        scorer.keep([(h, step.sender) for h in heads])

    def dcm_epoch() -> None:
        groups = [(heads, step.sender), (random_pool(base, heads, config), step.sender)]
        cache = PairCache.build(base, dcm_pairs, groups, config.eval_batch)
        try:
            run_dcm(base, heads, step.sender, dcm_pairs, config, "positional", "A", progress=False, cache=cache)
        finally:
            cache.close()

    return {
        "accuracy": (lambda: evaluate(base, records, sizes.batch, progress=False), accuracy_cost(ctx, base.name)),
        "matrix-cell": (matrix_cell, counting.scored(ctx, "matrix-cell", sizes.n, 1)),
        **path_steps(ctx, base, pairs),
        "dcm-epoch": (dcm_epoch, dcm.cost(ctx, base.name, 0, "file")),  # the scratch file, as dcm_epoch builds it
        "cmap-pass": (
            lambda: run_cmap(base, other, circuit, records, ["z"], sizes.batch, ["A"], progress=False),
            cmap.cost(ctx, other.name),
        ),
    }


def path_steps(ctx: Any, base: Any, pairs: list) -> dict[str, tuple[Callable[[], Any], Any]]:
    """Path patching as discovery runs each step of the task's plan (A-D), every eligible head an exact sender,
    and step A again with its pairs held in two parts: each run and the planner's cost of it (its FLOPs, memory
    and weight reads, as ``stages.circuit.path_circuit_cost`` counts one step). A step's receivers are its receiver
    step's ``k`` heads in the deepest layers (every head below them a sender: the most a step can have; a study's are
    wherever the step before selected), read at the step's site and position: step D's receiver runs go from its
    position to the end (suffix runs)."""
    from mechdiff.common.components import Head
    from mechdiff.patching.path import Receivers, eligible_senders, path_patch
    from mechdiff.patching.path_pairs import prepare
    from mechdiff.studies import planner as r
    from mechdiff.studies.circuits.stages import circuit, counting

    shape, n, out = base.shape, len(pairs), {}
    deepest = [Head(layer, h) for layer in reversed(range(shape.n_layers)) for h in range(shape.n_heads)]
    plan = {step.name: step for step in counting.plan_steps(ctx)}

    def run(step: Any, held: int, per_pass: int) -> Callable[[], None]:
        receivers = None
        if step.receiver:
            receivers = Receivers(tuple(deepest[: plan[step.receiver].k]), step.site, step.receiver_position)

        def go() -> None:
            batch = prepare(base, pairs, part_size=held if held < n else None)
            senders = eligible_senders(base, receivers)
            path_patch(base, batch, senders, step.sender, receivers, per_pass, progress=False)

        return go

    def cost(name: str, step: Any, held: int) -> tuple[int, Any]:
        flops, kept, transient, per_pass = circuit.path_cost(ctx, n, [step], held=held)
        reads = circuit.path_reads(ctx, n, [step], held, per_pass)
        return per_pass, r.StageCost(name, 1, n, per_pass * held, flops, ctx.weights, kept, transient, reads=reads)

    for name, step in plan.items():
        per_pass, planned = cost(f"path-step-{name}", step, n)
        out[f"path-step-{name}"] = (run(step, n, per_pass), planned)
        if name == "A":  # the same step in two parts ([discovery] pairs_per_part)
            half = max(n // 2, 1)
            per_part, planned = cost("path-step-A-parts", step, half)
            out["path-step-A-parts"] = (run(step, half, per_part), planned)
    return out


LLAMA_7B = Path(__file__).parents[1] / "mechdiff/data/configs/llama-7b.json"


def run_case(
    layers: Optional[int],
    dtype: str,
    device: str,
    sizes: Sizes,
    only: tuple[str, ...],
    plan_device: Optional[str] = None,
    config_path: Path = LLAMA_7B,
    tokenizer: Optional[str] = None,
    plan_only: bool = False,
) -> list[dict]:
    """Measure ``only`` of :data:`STAGES` on the config at ``config_path`` (LLaMA-7B's) cut to ``layers`` blocks
    (None: all of its own); ``tokenizer``: a saved SmolLM2 tokenizer's folder (default: the GGUF's). ``plan_only``:
    print the plan on ``plan_device`` (default H100) and run nothing (the models on the meta device)."""
    from mechdiff.models.devices import get_device, this_machine
    from mechdiff.models.footprint import Dims
    from mechdiff.studies.circuits.stages.counting import Context
    from mechdiff.studies.planner import place
    from mechdiff.tasks.base import get_task

    config = json.loads(Path(config_path).read_text())
    two = bool({"dcm-epoch", "cmap-pass"} & set(only))
    tok = smollm2_tokenizer(tokenizer)
    with Measure("meta" if plan_only else device) as load:
        models = [
            make_model(config, layers, dtype, "meta" if plan_only else device, s, f"llama7b-width-{s}", tok)
            for s in range(2 if two else 1)
        ]
    dims = Dims.from_config(models[0].model.config)
    spec = spec_for(sizes, dtype)
    lengths = _lengths(get_task("entity-tracking").records(models[0].tokenizer, 16, 0, n_boxes=7))
    cuda = device.startswith("cuda")
    if plan_only:
        planned_on, measured = get_device(plan_device or "h100-80gb"), None
    elif cuda:
        name = torch.cuda.get_device_name().lower()
        planned_on = get_device(plan_device or ("h200-141gb" if "h200" in name else "h100-80gb"))
        measured = gpu_matmul_throughput(dims, dtype, sizes.batch * lengths.longest)
    else:
        planned_on = this_machine(dims, (dtype,), sizes.batch * lengths.longest)
        measured = planned_on.throughput(dtype)
    ctx = Context(spec, dims, lengths, dtype, planned_on)
    out = []
    runs = stages(models, sizes, spec, ctx)
    planned = sum(place(runs[stage][1], planned_on, dtype, lambda *_: runs[stage][1]).seconds for stage in only)
    print(
        f"plan: {2 * planned:.3g} s on {planned_on.name} for {len(only)} stages at L{dims.n_layers} {dtype}, each run "
        f"twice (warm-up, measured); the models' load and setup aside",
        flush=True,
    )
    if plan_only:
        each = (f"{s} {place(runs[s][1], planned_on, dtype, lambda *_: runs[s][1]).seconds:.3g}" for s in only)
        print(f"  seconds a run: {', '.join(each)}", flush=True)
        return []
    print(table([]), flush=True)  # each row follows as it is measured
    for stage in only:
        fn, cost = runs[stage]
        fn()  # warm-up: first-call allocations, kernels chosen
        with Measure(device) as m:
            fn()
        placed = place(cost, planned_on, dtype, lambda *_: cost)
        row = {
            "case": f"L{dims.n_layers} {dtype}",
            "stage": stage,
            "load_gib": None if load.bytes is None else load.bytes / GIB,
            "weights_planned_gib": cost.weights / GIB,
            "mem_measured_mib": None if m.bytes is None else m.bytes / 2**20,
            "mem_planned_mib": (cost.kept + cost.transient) / 2**20,
            "s_measured": m.seconds,
            "s_planned": placed.seconds,
            "s_at_measured_mm": cost.flops / measured,
            "gflop": cost.flops / 1e9,
            "mm_gflops": measured / 1e9,
            "planned_on": planned_on.name,
        }
        out.append(row)
        print(row_line(row), flush=True)  # as measured: a run stopped at its time limit keeps what it measured
    return out


def _lengths(records: list) -> Any:
    from statistics import mean

    from mechdiff.studies.planner import Lengths

    sizes = [len(r.input_ids) for r in records]
    named = [k for k, v in records[0].positions.items() if isinstance(v, int)]
    # as planner.task_lengths: each position's suffix lengths (group D's batch-earliest count) and distinct positions
    spread = {k: tuple(float(len(r.input_ids) - r.positions[k]) for r in records) for k in named}
    suffix = {k: mean(v) for k, v in spread.items()}
    distinct = {k: len({r.positions[k] for r in records}) for k in named}
    return Lengths(mean(sizes), max(sizes), suffix, len(records[0].positions), "smollm2-135m", distinct, spread)


def table(rows: list[dict]) -> str:
    """The measurements as a markdown table (``rows`` empty: its header)."""
    lines = [
        "| case | stage | GFLOP | memory MiB planned / measured | ratio | s planned / measured | ratio "
        "| s at measured mm rate | share of mm rate |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    return "\n".join(lines + [row_line(r) for r in rows])


def row_line(r: dict) -> str:
    """One measurement as a row of :func:`table` (memory "-" where it was not measured: CPU without memray)."""
    mem = r["mem_measured_mib"]
    mem_ratio = "-" if mem is None else f"{r['mem_planned_mib'] / max(mem, 1e-9):.2f}"
    return (
        f"| {r['case']} | {r['stage']} | {r['gflop']:.1f} "
        f"| {r['mem_planned_mib']:.0f} / {'-' if mem is None else f'{mem:.0f}'} | {mem_ratio} "
        f"| {r['s_planned']:.3g} / {r['s_measured']:.3g} | {r['s_planned'] / r['s_measured']:.2f} "
        f"| {r['s_at_measured_mm']:.3g} | {r['s_at_measured_mm'] / r['s_measured']:.0%} |"
    )


def main(argv: Optional[list[str]] = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--layers", type=int, default=4, help="blocks of LLaMA-7B's width (its own: 32)")
    parser.add_argument("--quick", action="store_true", help="a few prompts a stage (a check that it runs)")
    parser.add_argument("--full", action="store_true", help="also the 32-layer config's accuracy stage, if it fits")
    parser.add_argument("--stages", default=",".join(STAGES), help=f"comma-separated, of {', '.join(STAGES)}")
    parser.add_argument("--plan-device", default=None, help="the named device the plan is made for (CUDA only)")
    parser.add_argument("--config", default=str(LLAMA_7B), help="a LLaMA config.json (default: LLaMA-7B's)")
    parser.add_argument("--plan-only", action="store_true", help="print the plan (on --plan-device) and run nothing")
    parser.add_argument("--tokenizer", default=None, help="a saved SmolLM2 tokenizer's folder (default: the GGUF's)")
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else Sizes()
    only = tuple(s for s in args.stages.split(",") if s)
    unknown = set(only) - set(STAGES)
    if unknown:
        parser.error(f"unknown stages {sorted(unknown)}; choose from {', '.join(STAGES)}")
    case = (args.plan_device, Path(args.config), args.tokenizer, args.plan_only)
    rows = run_case(args.layers, args.dtype, args.device, sizes, only, *case)
    if args.full:
        rows += _full(args.device, sizes, args.plan_device, args.tokenizer, args.plan_only)
    if args.plan_only:
        return rows
    print("ratio: planned / measured; share of mm rate: FLOPs over the measured matrix-multiply rate, over the time")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return rows


def _full(
    device: str, sizes: Sizes, plan_device: Optional[str], tokenizer: Optional[str], plan_only: bool = False
) -> list[dict]:
    """The whole 32-layer config in bfloat16, accuracy only, where its weights and 4 GiB more fit the device."""
    from mechdiff.models.devices import available_memory, get_device
    from mechdiff.models.footprint import model_dims

    dims, _ = model_dims("llama-7b")
    if plan_only:
        free = get_device(plan_device or "h100-80gb").memory
    else:
        free = torch.cuda.mem_get_info()[0] if device.startswith("cuda") else available_memory()
    if free < dims.weight_bytes("bfloat16") + 4 * GIB:
        print(
            f"full 32-layer config skipped: {free / GIB:.1f} GiB free, {dims.weight_bytes('bfloat16') / GIB:.1f} "
            "GiB of weights and 4 more needed",
            flush=True,
        )
        return []
    return run_case(
        None, "bfloat16", device, replace(sizes), ("accuracy",), plan_device, LLAMA_7B, tokenizer, plan_only
    )


if __name__ == "__main__":
    main()
