"""The resource planner's prediction beside measurement, stage by stage, on randomly initialised LLaMA-7B-width models.

No weights and no network: models are made from the shipped LLaMA-7B config (``mechdiff/data/configs``), depth cut
to ``--layers`` (the vocabulary is SmolLM2's tokenizer's, whose prompts they read), randomly initialised on the
device. Each stage runs as the study runs it, on the entity-tracking prompts, and is counted by the planner
(:mod:`mechdiff.studies.resources`) for the same sizes:

- ``accuracy``: one forward a prompt (:func:`mechdiff.patching.evaluate.evaluate`);
- ``matrix-cell``: reference means, the full model and one circuit mean-ablated (a matrix cell;
  :class:`mechdiff.circuits.scoring.Scorer`);
- ``path-step-A``: path patching of step A, every head an exact sender (:func:`mechdiff.patching.path.path_patch`);
- ``path-step-A-parts``: the same step with its pairs held in two parts (``[discovery] pairs_per_part``,
  :class:`mechdiff.patching.path.PairStream`);
- ``dcm-epoch``: DCM of one group for one epoch: the pair cache, training, validation, test and the random baseline
  (:func:`mechdiff.methods.dcm.run_dcm`), two models held;
- ``cmap-pass``: CMAP of one group and the circuit from a second model into the first
  (:func:`mechdiff.methods.cmap.run_cmap`), two models held.

Memory: on CUDA ``torch.cuda.max_memory_allocated`` above the allocation before the stage, against the planner's
bytes beside the weights (kept plus transient); on CPU the peak allocation above the stage's start (memray, as
``benchmarks/planner.py`` measures it; memray slows the CPU time it is measured beside a little). Time: on CUDA wall
time with ``torch.cuda.synchronize``, against the planner's time on the named device of the same kind
(``--plan-device``, default from the GPU's name) and on the GPU's measured matrix-multiply throughput; on CPU the
CPU time against the planner's on this machine. ``--full`` adds LLaMA-7B's whole 32-layer config in bfloat16 for
the accuracy stage where it fits the device's memory.

    python benchmarks/gpu.py --device cuda --layers 4          # what benchmarks/gpu.sh runs
    python benchmarks/gpu.py --device cpu --layers 2 --quick   # a reduced form, here
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
STAGES = ("accuracy", "matrix-cell", "path-step-A", "path-step-A-parts", "dcm-epoch", "cmap-pass")


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


def make_model(config: dict, layers: Optional[int], dtype: str, device: str, seed: int, name: str) -> Any:
    """A LoadedModel: LLaMA ``config`` cut to ``layers`` blocks with the SmolLM2 tokenizer's vocabulary, random."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from mechdiff.models.loading import DTYPES, LoadedModel, contiguous_unembedding, load_tokenizer
    from mechdiff.models.registry import ModelSpec
    from mechdiff.models.resolve import resolve_spec

    tokenizer = load_tokenizer(resolve_spec("smollm2-135m"))
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
    from mechdiff.studies.spec import default_spec

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
    allocations (memray) and CPU time."""

    def __init__(self, device: str) -> None:
        self.cuda = device.startswith("cuda")

    def __enter__(self) -> "Measure":
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.start = torch.cuda.memory_allocated()
            self.t0 = time.perf_counter()
        else:
            import tempfile

            import memray

            self.scratch = tempfile.TemporaryDirectory()
            self.trace = Path(self.scratch.name) / "stage.bin"
            self.tracker = memray.Tracker(self.trace, native_traces=False, trace_python_allocators=True)
            self.tracker.__enter__()
            self.t0 = time.process_time()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.cuda:
            torch.cuda.synchronize()
            self.seconds = time.perf_counter() - self.t0
            self.bytes = torch.cuda.max_memory_allocated() - self.start
        else:
            import memray

            self.seconds = time.process_time() - self.t0
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
    """Each stage: (its run, the planner's :class:`~mechdiff.studies.resources.StageCost` of it)."""
    from mechdiff.circuits.circuit import Circuit
    from mechdiff.circuits.scoring import Scorer
    from mechdiff.common.components import Head
    from mechdiff.methods.cmap import run_cmap
    from mechdiff.methods.dcm import PairCache, random_pool, run_dcm
    from mechdiff.patching.evaluate import evaluate
    from mechdiff.patching.path import eligible_senders, path_patch, prepare
    from mechdiff.studies import resources as r
    from mechdiff.studies.circuits import dcm_config
    from mechdiff.tasks.base import get_task
    from mechdiff.tasks.entity_tracking import path_patching_pairs, positional_pairs

    base, other = models[0], models[-1]
    tok, shape = base.tokenizer, base.shape
    task = get_task("entity-tracking")
    records = task.records(tok, sizes.n, 0, n_boxes=7)
    reference = task.records(tok, sizes.reference, 1, n_boxes=7)
    step = r._plan_steps(ctx)[0]
    heads = [Head(layer, h) for layer in range(shape.n_layers) for h in range(0, shape.n_heads, 4)]
    circuit = Circuit(base.name, "entity-tracking", {"A": heads}, {"A": step.sender})
    flops, kept, transient, per_pass = r._path_cost(ctx, sizes.pairs, [step])
    path_cost = r.StageCost("path-step-A", 1, sizes.pairs, per_pass * sizes.pairs, flops, ctx.weights, kept, transient)
    half = max(sizes.pairs // 2, 1)  # the same step in two parts ([discovery] pairs_per_part)
    flops, kept, transient, per_part = r._path_cost(ctx, sizes.pairs, [step], held=half)
    parts_cost = r.StageCost("path-step-A-parts", 1, sizes.pairs, per_part * half, flops, ctx.weights, kept, transient)
    pairs = path_patching_pairs(tok, sizes.pairs, n_boxes=7, seed=0)
    dcm_pairs = positional_pairs(tok, sizes.dcm_train + sizes.dcm_val + sizes.dcm_test, n_boxes=7, seed=1)
    config = dcm_config(spec)

    def matrix_cell() -> None:
        scorer = Scorer.build(base, records, reference, sizes.batch, progress=False)
        scorer.full()
        scorer.keep([(h, step.sender) for h in heads])

    def path_step(part_size=None, senders_per_pass=per_pass) -> Callable[[], None]:
        def run() -> None:
            batch = prepare(base, pairs, part_size=part_size)
            path_patch(base, batch, eligible_senders(base, None), step.sender, None, senders_per_pass, progress=False)

        return run

    def dcm_epoch() -> None:
        groups = [(heads, step.sender), (random_pool(base, heads, config), step.sender)]
        cache = PairCache.build(base, dcm_pairs, groups, config.eval_batch)
        try:
            run_dcm(base, heads, step.sender, dcm_pairs, config, "positional", "A", progress=False, cache=cache)
        finally:
            cache.close()

    return {
        "accuracy": (lambda: evaluate(base, records, sizes.batch, progress=False), r.accuracy(ctx, base.name)),
        "matrix-cell": (matrix_cell, r._scored(ctx, "matrix-cell", sizes.n, 1)),
        "path-step-A": (path_step(), path_cost),
        "path-step-A-parts": (path_step(half, per_part), parts_cost),
        "dcm-epoch": (dcm_epoch, r.dcm(ctx, base.name, 0, "file")),  # the scratch file, as dcm_epoch builds it
        "cmap-pass": (
            lambda: run_cmap(base, other, circuit, records, ["z"], sizes.batch, ["A"], progress=False),
            r.cmap(ctx, other.name),
        ),
    }


LLAMA_7B = Path(__file__).parents[1] / "mechdiff/data/configs/llama-7b.json"


def run_case(
    layers: Optional[int],
    dtype: str,
    device: str,
    sizes: Sizes,
    only: tuple[str, ...],
    plan_device: Optional[str] = None,
    config_path: Path = LLAMA_7B,
) -> list[dict]:
    """Measure ``only`` of :data:`STAGES` on the config at ``config_path`` (LLaMA-7B's) cut to ``layers`` blocks
    (None: all of its own)."""
    from mechdiff.models.devices import get_device, this_machine
    from mechdiff.models.footprint import Dims
    from mechdiff.studies.resources import Context, place
    from mechdiff.tasks.base import get_task

    config = json.loads(Path(config_path).read_text())
    two = bool({"dcm-epoch", "cmap-pass"} & set(only))
    with Measure(device) as load:
        models = [make_model(config, layers, dtype, device, s, f"llama7b-width-{s}") for s in range(2 if two else 1)]
    dims = Dims.from_config(models[0].model.config)
    spec = spec_for(sizes, dtype)
    lengths = _lengths(get_task("entity-tracking").records(models[0].tokenizer, 16, 0, n_boxes=7))
    cuda = device.startswith("cuda")
    if cuda:
        name = torch.cuda.get_device_name().lower()
        planned_on = get_device(plan_device or ("h200-141gb" if "h200" in name else "h100-80gb"))
        measured = gpu_matmul_throughput(dims, dtype, sizes.batch * lengths.longest)
    else:
        planned_on = this_machine(dims, (dtype,), sizes.batch * lengths.longest)
        measured = planned_on.throughput(dtype)
    ctx = Context(spec, dims, lengths, dtype, planned_on)
    out = []
    runs = stages(models, sizes, spec, ctx)
    for stage in only:
        fn, cost = runs[stage]
        fn()  # warm-up: first-call allocations, kernels chosen
        with Measure(device) as m:
            fn()
        placed = place(cost, planned_on, dtype, lambda *_: cost)
        out.append(
            {
                "case": f"L{dims.n_layers} {dtype}",
                "stage": stage,
                "load_gib": load.bytes / GIB,
                "weights_planned_gib": cost.weights / GIB,
                "mem_measured_mib": m.bytes / 2**20,
                "mem_planned_mib": (cost.kept + cost.transient) / 2**20,
                "s_measured": m.seconds,
                "s_planned": placed.seconds,
                "s_at_measured_mm": cost.flops / measured,
                "gflop": cost.flops / 1e9,
                "mm_gflops": measured / 1e9,
                "planned_on": planned_on.name,
            }
        )
    return out


def _lengths(records: list) -> Any:
    from statistics import mean

    from mechdiff.studies.resources import Lengths

    sizes = [len(r.input_ids) for r in records]
    suffix = {
        k: mean(len(r.input_ids) - r.positions[k] for r in records)
        for k, v in records[0].positions.items()
        if isinstance(v, int)
    }
    return Lengths(mean(sizes), max(sizes), suffix, len(records[0].positions), "smollm2-135m")


def table(rows: list[dict]) -> str:
    """The measurements as a markdown table."""
    lines = [
        "| case | stage | GFLOP | memory MiB planned / measured | ratio | s planned / measured | ratio "
        "| s at measured mm rate | share of mm rate |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['stage']} | {r['gflop']:.1f} "
            f"| {r['mem_planned_mib']:.0f} / {r['mem_measured_mib']:.0f}"
            f" | {r['mem_planned_mib'] / max(r['mem_measured_mib'], 1e-9):.2f} | {r['s_planned']:.3g} / "
            f"{r['s_measured']:.3g} | {r['s_planned'] / r['s_measured']:.2f} | {r['s_at_measured_mm']:.3g} "
            f"| {r['s_at_measured_mm'] / r['s_measured']:.0%} |"
        )
    return "\n".join(lines)


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
    parser.add_argument("--json", default=None, help="write the rows here")
    args = parser.parse_args(argv)
    sizes = QUICK if args.quick else Sizes()
    only = tuple(s for s in args.stages.split(",") if s)
    unknown = set(only) - set(STAGES)
    if unknown:
        parser.error(f"unknown stages {sorted(unknown)}; choose from {', '.join(STAGES)}")
    rows = run_case(args.layers, args.dtype, args.device, sizes, only, args.plan_device, Path(args.config))
    if args.full:
        rows += _full(args.device, sizes, args.plan_device)
    print(table(rows), flush=True)
    print("ratio: planned / measured; share of mm rate: FLOPs over the measured matrix-multiply rate, over the time")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return rows


def _full(device: str, sizes: Sizes, plan_device: Optional[str]) -> list[dict]:
    """The whole 32-layer config in bfloat16, accuracy only, where its weights and 4 GiB more fit the device."""
    from mechdiff.models.devices import available_memory
    from mechdiff.models.footprint import model_dims

    dims, _ = model_dims("llama-7b")
    free = torch.cuda.mem_get_info()[0] if device.startswith("cuda") else available_memory()
    if free < dims.weight_bytes("bfloat16") + 4 * GIB:
        print(
            f"full 32-layer config skipped: {free / GIB:.1f} GiB free, {dims.weight_bytes('bfloat16') / GIB:.1f} "
            "GiB of weights and 4 more needed",
            flush=True,
        )
        return []
    return run_case(None, "bfloat16", device, replace(sizes), ("accuracy",), plan_device)


if __name__ == "__main__":
    main()
