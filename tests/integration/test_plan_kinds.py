"""The resource plan of every study kind (``Study.stage_costs``): the forward passes each stage's cost counts
equal the passes the stage runs, counted apart from the planner by a hook on the model's forward (every pass,
nnsight trace or plain call, enters it once) while a tiny study runs; and ``mechdiff run --plan`` prints a memory
and a time column for every stage of a task file of each kind."""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import replace

import pytest
import torch
from conftest import make_tiny
from torch.utils.flop_counter import FlopCounterMode

from mechdiff.models.devices import get_device
from mechdiff.models.footprint import Dims
from mechdiff.runs import stages as stage_module
from mechdiff.studies.headmap.settings import TASK, HeadMapSettings
from mechdiff.studies.headmap.study import HeadMapStudy
from mechdiff.studies.knowledge.facts import fact_lengths, load_facts
from mechdiff.studies.knowledge.plan import knowledge_found
from mechdiff.studies.knowledge.settings import KnowledgeSettings
from mechdiff.studies.knowledge.study import KnowledgeStudy
from mechdiff.studies.planner import Lengths, PlanInputs
from mechdiff.tasks.relation_data import batches


class PassCounter:
    """Forward passes per stage: a pre-hook on each model's forward counts a pass into the innermost stage
    `StageCache.run` is computing; with ``flops``, also each stage's matrix-multiply FLOPs (torch's FLOP counter)."""

    def __init__(self, monkeypatch, models, flops: bool = False):
        self.passes: Counter = Counter()
        self.flops: Counter = Counter()
        self.stack: list[str] = []

        def count(module, args, kwargs):  # a function, not a bound method: a deep copy of the model keeps it
            if self.stack:
                self.passes[self.stack[-1]] += 1

        for m in models:
            m.model.register_forward_pre_hook(count, with_kwargs=True)
        run = stage_module.StageCache.run

        def counted(cache, name, inputs, compute, *a, **k):
            def wrapped():
                self.stack.append(name)
                try:
                    if not flops:
                        return compute()
                    with FlopCounterMode(display=False) as counter:
                        result = compute()
                    self.flops[name] += counter.get_total_flops()
                    return result
                finally:
                    self.stack.pop()

            return run(cache, name, inputs, wrapped, *a, **k)

        monkeypatch.setattr(stage_module.StageCache, "run", counted)


def _warm(model) -> None:
    """nnsight runs a model's first trace twice (once to set it up): trace it once before counting."""
    from mechdiff.patching.core import run

    run(model, torch.zeros(1, 3, dtype=torch.long))


def _inputs(kind: str, settings, model, known: dict) -> PlanInputs:
    dims = Dims.from_config(model.model.config)
    return PlanInputs(kind, settings, dims, "tiny", Lengths(8, 8, {}, 0, "tiny"), "float32", (), 1, 64, known=known)


@pytest.mark.parametrize("method", ["eap", "eap-ig", "iterative"])
def test_knowledge_stage_costs_count_the_passes_each_stage_runs(tmp_path, smollm2_tokenizer, monkeypatch, method):
    model = make_tiny("llama", smollm2_tokenizer, seed=3, n_layers=2)
    settings = KnowledgeSettings(
        method=method,
        ig_steps=3,
        shrink=0.5,
        k=30000,
        target=0.9,  # a random model: some sizes fall short, so scoring tries more than one
        sizes=(0.01, 0.05, 0.3),
        curve_sizes=(0.1, 0.5, 1.0),
        n_random=2,
        max_facts=12,
        batch_size=4,  # several batches of each token length
        models=(model.name,),
    )
    _warm(model)
    counter = PassCounter(monkeypatch, [model], flops=True)
    study = KnowledgeStudy(settings, tmp_path / "k", {model.name: model}.__getitem__, progress=False)
    study.run()
    facts = load_facts(model, settings)
    relation = settings.relation
    known = {"facts": {relation: fact_lengths(facts)}, "found": {relation: knowledge_found(study.dir, facts)}}
    costs = KnowledgeStudy.stage_costs(_inputs("knowledge", settings, model, known), get_device("h100-80gb"))
    assert {c.stage: c.reads.passes for c in costs} == dict(counter.passes)
    assert len(costs) == 4 and all(c.flops > 0 and c.transient > 0 for c in costs)
    # the passes with gradients (`FactSet.gradient_flops`: a backward to the activations one forward's FLOPs, as
    # every kind counts it; they were counted as two) and the edge forwards: torch's FLOP counter, within 25%
    ratios = {c.stage: c.flops / counter.flops[c.stage] for c in costs if not c.stage.startswith("analysis")}
    assert all(1 / 1.25 <= r <= 1.25 for r in ratios.values()), ratios


def test_knowledge_plan_before_the_run_assumes_every_size_tried(smollm2_tokenizer):
    """Before a run the plan counts every size of the sweep: at least the passes of the run that stopped early."""
    model = make_tiny("llama", smollm2_tokenizer, seed=3, n_layers=2)
    settings = KnowledgeSettings(sizes=(0.01, 0.05, 0.3), max_facts=6, models=(model.name,))
    facts = load_facts(model, settings)
    counts = {settings.relation: fact_lengths(facts)}
    device = get_device("h100-80gb")
    before = KnowledgeStudy.stage_costs(_inputs("knowledge", settings, model, {"facts": counts}), device)
    found = {settings.relation: {"tried": {model.name: 1}}}
    after = KnowledgeStudy.stage_costs(_inputs("knowledge", settings, model, {"facts": counts, "found": found}), device)
    n_batches = len(batches(facts, settings.batch_size))
    scoring = [(b.reads.passes, a.reads.passes) for b, a in zip(before, after) if b.stage.startswith("scoring")]
    assert scoring == [(scoring[0][1] + 2 * n_batches, scoring[0][1])]  # two sizes more, each every batch once


def _headmap_settings() -> HeadMapSettings:
    return HeadMapSettings(
        model="tiny-base",
        lora_zoo="tiny-zoo",
        path_patching=(),
        n=4,
        pool=8,
        k=1,
        batch_size=6,  # pool, samples and variants each in several passes
        steps=2,
        batch=4,
        eval_n=8,
        val_n=6,
        lora_small=1,
        lora_large=2,
        seeds=(0, 1),
        lrs=(1e-3, 1e-2),
        runs=("base", "located", "random", "outside", "lora-small", "lora-large", "transfer", "lora-zoo"),
    )


def _headmap_names(passes: dict[str, float]) -> Counter:
    """(stage without its rates, passes): the plan names a run at the sweep's chosen rates before it knows them."""
    return Counter((re.sub(r"-h?lr[0-9.e-]+$| \(.*\)$", "", name), round(n)) for name, n in passes.items())


def test_headmap_stage_costs_count_the_passes_each_stage_runs(tmp_path, smollm2_tokenizer, monkeypatch):
    models = {
        "tiny-base": make_tiny("llama", smollm2_tokenizer, seed=1, n_layers=3),
        "tiny-zoo": make_tiny("llama", smollm2_tokenizer, seed=2, n_layers=3),
    }
    for m in models.values():
        _warm(m)
    counter = PassCounter(monkeypatch, models.values())
    settings = _headmap_settings()
    HeadMapStudy(settings, tmp_path / "hm", models.__getitem__, progress=False).run()
    tokens = {TASK: 40, settings.transfer_task: 30}
    costs = HeadMapStudy.stage_costs(
        _inputs("headmap", settings, models["tiny-base"], {"tokens": tokens}), get_device("h100-80gb")
    )
    planned = {c.stage: c.reads.passes for c in costs}
    assert _headmap_names(planned) == _headmap_names(dict(counter.passes))
    assert len(costs) == len(counter.passes)
    located = next(c for c in costs if c.stage == f"locate-{TASK}")
    assert located.reads.blocks < located.reads.passes * models["tiny-base"].shape.n_layers  # resumed passes


def test_plan_prints_memory_and_time_for_every_stage_of_each_kind(capsys, monkeypatch):
    """``mechdiff run --plan`` on a task file of each kind: a resource table whose every stage row has a host
    memory, a device memory and a time (the named device's table), before the stage cache is read; this machine's
    throughput is a stand-in (measuring it is `mechdiff.models.devices`' own test)."""
    import mechdiff.models.devices as devices
    from mechdiff.commands import run as run_command
    from mechdiff.studies import planner

    cpu = devices.Device("this machine", 16 * 2**30, {"float32": 5e10, "bfloat16": 5e10}, False, bandwidth={})
    monkeypatch.setattr(
        devices, "this_machine", lambda dims, dtypes, rows=None: replace(cpu, bandwidth={"float32": 4e9})
    )
    monkeypatch.setattr(planner, "with_overhead", lambda device, dims: device)
    printed = {}

    def stop(*a, **k):  # the stage table loads the models: the resource plan is what this test reads
        raise SystemExit(0)

    monkeypatch.setattr("mechdiff.studies.base.load_study", stop)
    for path in ("tasks/knowledge.toml", "tasks/headmap.toml", "tasks/entity_tracking_trajectory.toml"):
        try:
            assert run_command.main(_args(path)) == 0  # weights absent: the plan ends after the resource table
        except SystemExit:
            pass
        printed[path] = capsys.readouterr().out
    for path, out in printed.items():
        named = out.split("resource plan on h100-80gb")[1]
        head, *rows = [line for line in named.splitlines()[2:] if line and not line.startswith(" ")]
        assert "host GiB" in head and "dev. GiB" in head and head.split()[-2] == "time", path
        stages = [r for r in rows if re.search(r"\s(yes|NO)\b", r)]
        assert len(stages) >= 4, (path, named)
        for row in stages:
            host, dev = re.findall(r"\s(\d+\.\d)\s", row)[:2]  # then disk GiB
            assert float(host) > 0 and (float(dev) > 0 or row.startswith(("structure", "dcm "))), row
            assert re.search(r"\d+\.\d (s|min|h)\s+(yes|NO)", row), row


def _args(path: str):
    import argparse

    from mechdiff.commands import run as run_command

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    run_command.register(sub)
    return parser.parse_args(["run", path, "--plan", "--plan-device", "h100-80gb"])


def test_trajectory_stage_costs_count_the_passes_each_stage_runs(tiny_run, tmp_path, monkeypatch):
    """The tiny trajectory of tests/integration/test_trajectory_study.py (three checkpoints, DCM read from a table),
    its passes counted by a global hook on every causal LM's forward (not the architecture probe a checkpoint runs
    once when it loads, which the plan leaves out), and each stage's FLOPs by torch's counter."""
    from test_trajectory_study import positional_labels, task_file

    from mechdiff.studies.trajectory import study as tr
    from mechdiff.studies.trajectory.stages.circuit import trajectory_found

    base, run = tiny_run
    labels = positional_labels(tmp_path, "L0H0")
    path = task_file(tmp_path / "t.toml", run, tmp_path / "out", extra=f'labels = "{labels}"')
    counter = PassCounter(monkeypatch, [], flops=True)
    from mechdiff.models import architectures

    probe, probing, probe_flops = architectures._probe_flow, [], Counter()

    def probed(*a, **k):  # a checkpoint's architecture probe when it loads (3 tokens): not a stage's pass or FLOPs
        probing.append(1)
        try:
            with FlopCounterMode(display=False) as inner:  # counted by the stage's counter too: taken off below
                return probe(*a, **k)
        finally:
            probing.pop()
            if counter.stack:
                probe_flops[counter.stack[-1]] += inner.get_total_flops()

    monkeypatch.setattr(architectures, "_probe_flow", probed)

    def count(module, args):
        name = type(module).__name__
        if name.endswith("ForCausalLM") and not name.startswith("Peft") and counter.stack and not probing:
            counter.passes[counter.stack[-1]] += 1

    handle = torch.nn.modules.module.register_module_forward_pre_hook(count)
    try:
        study = tr.TrajectoryStudy.from_file(path, progress=False)
        study.run()
    finally:
        handle.remove()
    inputs = tr.TrajectoryStudy.plan_inputs(path)
    inputs = replace(inputs, known={**inputs.known, "circuits": trajectory_found(study.dir)})
    costs = {c.stage: c for c in tr.TrajectoryStudy.stage_costs(inputs, get_device("h100-80gb"))}
    assert set(counter.passes) <= set(costs)
    assert {s: costs[s].reads.passes for s in counter.passes} == dict(counter.passes)
    # FLOPs within 25% of torch's counter (each pass's sweep of rows, not one sweep a stage: 0.25-0.52 before)
    ratios = {s: costs[s].flops / (counter.flops[s] - probe_flops[s]) for s in counter.passes}
    assert all(0.8 <= r <= 1.25 for r in ratios.values()), ratios
