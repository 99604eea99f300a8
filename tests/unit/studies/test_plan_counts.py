"""What the plan counts against what the code does (mechdiff.studies.planner): path patching's runs per pass of
senders and the senders below the deepest receiver, counted on a tiny model; each stage's reference runs."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from conftest import spy_runs

from mechdiff.common.components import Head
from mechdiff.models.devices import Device
from mechdiff.models.footprint import Dims
from mechdiff.patching.path import Receivers, eligible_senders, path_patch
from mechdiff.patching.path_pairs import prepare
from mechdiff.studies.circuits.spec import default_spec, load_spec
from mechdiff.studies.circuits.stages.circuit import step_runs as _step_runs
from mechdiff.studies.circuits.stages.circuit import step_senders as _step_senders
from mechdiff.studies.circuits.stages.counting import Context
from mechdiff.studies.circuits.stages.counting import plan_steps as _plan_steps
from mechdiff.studies.circuits.stages.counting import reference_runs as _reference_runs
from mechdiff.studies.planner import Lengths
from mechdiff.tasks.entity_tracking import path_patching_pairs

CPU = Device("test cpu", 64 * 2**30, {"float32": 1e11}, gpu=False)


def _ctx(spec, model, lengths, known=None):
    return Context(spec, Dims.from_config(model.model.config), lengths, "float32", CPU, known or {})


@pytest.mark.parametrize("step_name", ["A", "B", "C", "D"])
def test_a_steps_runs_per_pass_of_senders_are_those_path_patching_makes(
    tiny_llama, smollm2_tokenizer, step_name, monkeypatch
):
    """Per pass of senders, path patching makes the frozen run and one receiver run per distinct receiver position
    (step D's receivers sit at the queried box's label, which moves between prompts): the plan's count."""
    import mechdiff.patching.path as path

    pairs = path_patching_pairs(smollm2_tokenizer, 12, n_boxes=3, seed=3)
    spec = default_spec()
    step = {s.name: s for s in _plan_steps(_ctx(spec, tiny_llama, Lengths(1, 1, {}, 1, "t")))}[step_name]
    distinct = {
        name: len({p.base.positions[name] for p in pairs}) for name in ("last", "query_label", "query_label_context")
    }
    assert distinct["query_label_context"] == 3 and distinct["last"] == 1  # a label per box; one last token
    ctx = _ctx(spec, tiny_llama, Lengths(1, 1, {}, 1, "t", distinct))
    batch = prepare(tiny_llama, pairs)
    receivers = Receivers((Head(2, 1),), step.site, step.receiver_position) if step.receiver else None
    senders = eligible_senders(tiny_llama, receivers)[:4]
    calls = spy_runs(path, monkeypatch)
    path_patch(tiny_llama, batch, senders, step.sender, receivers, senders_per_pass=2, progress=False)
    assert len(calls) == 2 * _step_runs(ctx, step)


def test_senders_lie_below_the_deepest_receiver_of_the_found_circuit(tiny_llama):
    """A step with receivers scores the heads below its deepest receiver (the path module's eligible senders): the
    found circuit's receiving group bounds them; before a run the middle layer is assumed; a step into the logits
    scores every head."""
    spec = default_spec()
    lengths = Lengths(1, 1, {}, 1, "t")
    steps = {s.name: s for s in _plan_steps(_ctx(spec, tiny_llama, lengths))}
    n_heads, n_layers = tiny_llama.shape.n_heads, tiny_llama.shape.n_layers
    found = {"circuit": {"m": {"groups": {"A": ["L1H0", "L0H2"]}, "positions": {"A": "last"}}}}
    ctx = _ctx(spec, tiny_llama, lengths, found)
    receivers = Receivers((Head(1, 0), Head(0, 2)), "q", "last")
    assert _step_senders(ctx, steps["B"], "m") == len(eligible_senders(tiny_llama, receivers)) == n_heads
    assert _step_senders(ctx, steps["A"], "m") == len(eligible_senders(tiny_llama, None)) == n_layers * n_heads
    assert _step_senders(_ctx(spec, tiny_llama, lengths), steps["B"], "m") == n_layers / 2 * n_heads


def test_reference_runs_fall_to_the_first_stage_that_ablates_with_the_studys_set():
    """The first scorer stage of a model computes the study's reference means, the later ones read them from the
    store; pruning with a seed of its own and the reproduction draw sets of their own; a lone matrix cell computes
    them. Without a position scan the paper's LLaMA-7B (pruned with its own seed) computes them in its matrix row,
    Vicuna (no seed of its own) in its pruning."""
    spec = load_spec("tasks/entity_tracking_llama7b.toml")
    ref, n = spec.scoring.reference_n, spec.reproduce.n
    assert spec.positions.n == 0  # the paper ran no position scan, and the file says so
    spec = replace(spec, positions=replace(spec.positions, n=40))  # with one, the scan computes them
    ctx = Context(spec, None, Lengths(1, 1, {}, 1, "t"), "float32", CPU)
    counts = {s: _reference_runs(ctx, s) for s in ("positions:llama-7b", "prune:llama-7b", "prune:vicuna-7b")}
    assert counts == {"positions:llama-7b": ref, "prune:llama-7b": ref, "prune:vicuna-7b": 0}
    assert _reference_runs(ctx, "matrix:vicuna-7b") == 0 and _reference_runs(ctx, "reproduction:goat-7b") == n
    assert _reference_runs(ctx, "matrix-cell") == ref
    unscanned = replace(ctx, spec=replace(spec, positions=replace(spec.positions, n=0)))
    assert _reference_runs(unscanned, "matrix:llama-7b") == ref and _reference_runs(unscanned, "prune:llama-7b") == ref
    assert _reference_runs(unscanned, "prune:vicuna-7b") == ref and _reference_runs(unscanned, "matrix:vicuna-7b") == 0


def _placed(stages: dict[str, float], device: Device) -> list:
    """Placements of stages of the given names and seconds (7B-like weights: 1 GiB a model)."""
    from mechdiff.studies.planner import Placement, StageCost

    costs = [StageCost(s, 1, 1, 1, 0.0, 2**30, 0, 0) for s in stages]
    return [Placement(c, device, "float32", seconds, True) for c, seconds in zip(costs, stages.values())]


def test_wall_time_is_the_longest_process_over_its_threads_and_load_is_warned():
    """With one process per model the wall time is the longest model's CPU seconds over its threads (the base's DCM
    in the base's process); in one process, the whole over its threads; a throughput measured under load is
    warned of; loading counts each model's weights at the disk's rate."""
    from mechdiff.studies.planner import Workers, _loading, _wall

    stages = {"accuracy:b": 60.0, "accuracy:f": 60.0, "dcm": 600.0, "cmap:f": 300.0}
    idle = replace(CPU, load=0.1, disk_read=2**30)
    two = _wall(_placed(stages, idle), Workers(2, 1, "two", "b"))
    assert two == [
        "wall time with 2 processes of 1 thread: about 11.0 min (each process's CPU time over its "
        "threads, the longest process; two)"
    ]
    one = _wall(_placed(stages, idle), Workers(1, 2, "one", "b"))
    assert "about 8.5 min" in one[0] and len(one) == 1  # (60 + 60 + 600 + 300) / 2 s
    assert "calibrated under load" in _wall(_placed(stages, replace(idle, load=1.5)), None)[0]
    assert _loading(_placed(stages, idle), 2) == [
        "loading 2 models (1.0 GiB each) at 1.1 GB/s: 2.0 s more (once each a process)"
    ]


def test_a_cpu_stage_holds_the_process_baseline_and_a_gpu_stage_holds_it_on_the_host():
    from mechdiff.studies.planner import StageCost

    cost = StageCost("accuracy:m", 1, 1, 1, 0.0, 100, 10, 5, host_kept=7)
    cpu = replace(CPU, baseline=1000)
    gpu = Device("gpu", 10**6, {"float32": 1.0}, baseline=1000)
    assert cost.device_peak(cpu) == 100 + 10 + 5 + 7 + 1000 and cost.host_peak(cpu) == cost.device_peak(cpu)
    assert cost.device_peak(gpu) == 115 and cost.host_peak(gpu) == 100 + 1000


def test_the_released_circuit_stands_in_for_the_bases_pruned_circuit_before_a_run():
    """Before a run, DCM on the paper's study starts each group at the released LLaMA-7B circuit's lowest layer (not
    the middle), and says so; a circuit the run found wins."""
    import json

    from mechdiff.models.devices import get_device
    from mechdiff.models.footprint import model_dims
    from mechdiff.studies.circuits.stages.counting import group_starts as _group_starts
    from mechdiff.studies.circuits.stages.dcm import cost as dcm
    from mechdiff.studies.circuits.stages.plan import with_released

    spec = load_spec("tasks/entity_tracking_llama7b.toml")
    released = json.loads(open(spec.reproduce.circuit).read())
    lowest = {g: min(int(h[1:].split("H")[0]) for h in heads) for g, heads in released["groups"].items()}
    known = with_released(spec, {})
    ctx = Context(spec, model_dims("llama-7b")[0], Lengths(53, 53, {}, 1, "t"), "float32", get_device("h100-80gb"))
    starts = _group_starts(replace(ctx, known=known), "llama-7b pruned", ["A", "B", "C", "D"])
    assert {g: layer for g, (layer, _) in starts.items()} == lowest == {"A": 14, "B": 11, "C": 1, "D": 8}
    assert "the released circuit, assumed" in dcm(replace(ctx, known=known), "llama-7b", 4).note
    found = {"circuit": {"llama-7b pruned": {"groups": {"A": ["L3H0"]}, "positions": {"A": "last"}}}}
    assert with_released(spec, found) == found


PATH_K = {"A": 2, "B": 1, "C": 1, "D": 1}


@pytest.fixture(scope="module")
def small_llama(smollm2_tokenizer):
    """A random llama whose layers outweigh its read-out (8 layers of width 256), hashed (`fingerprint`: a float64
    copy of each weight) before anything is measured, as a study hashes its models before a stage; 16 path-patching
    pairs of 7 boxes and their token lengths."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from mechdiff.models.loading import LoadedModel, ModelSpec

    torch.manual_seed(0)
    config = LlamaConfig(
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_size=256,
        intermediate_size=1024,
        vocab_size=49152,
    )
    model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval().requires_grad_(False)
    lm = LoadedModel("small", ModelSpec("small", "local", "<memory>"), model, smollm2_tokenizer, {"kind": "memory"})
    _ = lm.fingerprint
    pairs = path_patching_pairs(smollm2_tokenizer, 16, n_boxes=7, seed=0)
    (tokens,) = {len(p.base.input_ids) for p in pairs}
    names = ("last", "query_label", "query_label_context")
    lengths = Lengths(
        tokens,
        tokens,
        {n: sum(tokens - p.base.positions[n] for p in pairs) / len(pairs) for n in names},
        1,
        "t",
        {n: len({p.base.positions[n] for p in pairs}) for n in names},
    )
    return lm, pairs, lengths


def _path_spec(screen: bool):
    spec = default_spec()
    return replace(spec, discovery=replace(spec.discovery, method="path", n=16, screen=screen, top_k=PATH_K))


@pytest.mark.parametrize("screen", [False, True])
def test_path_patchings_planned_memory_is_what_torch_allocates(small_llama, screen):
    """The circuit stage's planned bytes beside the weights (every pair's runs kept, and the largest transient: with
    the attribution screen, its pass with gradients over every pair at once) within 25% of the most torch allocated
    at once over `discover` of steps A-D (the paper form's OOM: its screen was not counted, 3.4x low)."""
    from mechdiff.circuits.discovery import DiscoverySettings, discover
    from mechdiff.models.memory import torch_peak
    from mechdiff.studies.circuits.stages.circuit import cost as circuit

    lm, pairs, lengths = small_llama
    cost = circuit(_ctx(_path_spec(screen), lm, lengths), "small")
    settings = DiscoverySettings(k=PATH_K, screen=screen, n_prompts=16, n_boxes=7)
    measured = torch_peak(lambda: discover(lm, pairs, settings, progress=False))
    assert measured == pytest.approx(cost.kept + cost.transient, rel=0.25)


def test_step_ds_receiver_runs_hold_what_the_plan_counts(small_llama):
    """Step D's receivers sit at the queried box's label (7 positions among the pairs): one suffix run per position,
    each run's read-out logits written into one tensor of every row's. Its peak above the held pairs is the plan's
    transient of a pass of 8 sender copies, within 25% (`discover` on a random model above stops before D: its C
    receivers lie in layer 0)."""
    from mechdiff.models.memory import torch_peak
    from mechdiff.studies.circuits.stages.circuit import path_cost as _path_cost

    lm, pairs, lengths = small_llama
    assert lengths.distinct["query_label_context"] == 7
    ctx = _ctx(_path_spec(False), lm, lengths)
    step = {s.name: s for s in _plan_steps(ctx)}["D"]
    _, _, transient, per_pass = _path_cost(ctx, 16, [step])
    batch = prepare(lm, pairs)
    receivers = Receivers((Head(4, 1), Head(5, 0)), step.site, step.receiver_position)
    senders = eligible_senders(lm, receivers)[:per_pass]
    measured = torch_peak(lambda: path_patch(lm, batch, senders, step.sender, receivers, per_pass, progress=False))
    assert measured == pytest.approx(transient, rel=0.25)


def test_dcms_suffix_runs_compute_each_batch_from_its_earliest_position(tiny_llama, smollm2_tokenizer, monkeypatch):
    """A DCM group at a position that moves between prompts (group D at the queried box's label) runs each patched
    batch from the batch's earliest position: the tokens its runs compute per pair are the plan's `batch_after`,
    not the mean tokens after the position (`after`, the count before: 0.6 of these)."""
    import mechdiff.methods.dcm_cache as dcm
    from mechdiff.tasks.desiderata import desideratum_pairs

    position, batch = "query_label_context", 16
    pairs = desideratum_pairs("positional", smollm2_tokenizer, 64, 7, 0)
    tokens = len(pairs[0].base.input_ids)
    spread = tuple(float(tokens - p.base.positions[position]) for p in pairs)
    lengths = Lengths(tokens, tokens, {position: sum(spread) / len(spread)}, 1, "t", {}, {position: spread})
    heads = [Head(2, 0), Head(2, 3)]
    cache = dcm.PairCache.build(tiny_llama, pairs, [(heads, position)], batch)
    computed, original = [], dcm.run  # per patched run: its rows and the positions it computes (from its start on)

    def run(model, ids, *args, **kwargs):
        out = original(model, ids, *args, **kwargs)
        computed.append((ids.shape[0], ids.shape[1] - out.start))
        return out

    monkeypatch.setattr(dcm, "run", run)
    cache.accuracy(tiny_llama, range(len(pairs)), heads, position, batch)
    cache.close()
    assert len(computed) == len(pairs) // batch
    per_pair = sum(rows * n for rows, n in computed) / sum(rows for rows, _ in computed)
    assert per_pair == pytest.approx(lengths.batch_after(position, batch), rel=0.1)
    assert lengths.after(position) < 0.75 * per_pair


def test_batch_after_is_the_expected_most_of_a_batchs_tokens_after_a_position():
    """`Lengths.batch_after` against every batch of two and three prompts drawn from the sample, enumerated."""
    from itertools import product

    spread = (6.0, 13.0, 13.0, 41.0, 48.0)
    lengths = Lengths(53, 53, {"p": sum(spread) / 5}, 1, "t", {}, {"p": spread})
    for rows in (1, 2, 3):
        draws = list(product(spread, repeat=rows))
        assert lengths.batch_after("p", rows) == pytest.approx(sum(max(d) for d in draws) / len(draws))
    assert lengths.batch_after("last", 8) == lengths.after("last") == 53  # not a kept position: the whole prompt


def test_path_patchings_planned_flops_with_the_screen_are_those_discover_performs(small_llama):
    """With the attribution screen each step path-patches the `screen_multiple x k` senders the screen keeps, after
    the screen's passes with gradients over every pair: the plan's FLOPs of the steps `discover` ran (told the circuit
    it found) within 1.25 of torch's count (the count before: every eligible sender and no screen, 0.42 here: the
    screen's passes outweigh the senders it skips)."""
    import torch.utils.flop_counter

    from mechdiff.circuits.discovery import DiscoverySettings, discover
    from mechdiff.studies.circuits.stages.circuit import path_cost as _path_cost

    lm, pairs, lengths = small_llama
    settings = DiscoverySettings(k=PATH_K, screen=True, n_prompts=16, n_boxes=7)
    with torch.utils.flop_counter.FlopCounterMode(display=False) as counter:
        circuit, results = discover(lm, pairs, settings, progress=False)
    known = {"circuit": {"small": circuit.to_dict()}}
    ctx = _ctx(_path_spec(True), lm, lengths, known)
    ran = [s for s in _plan_steps(ctx) if s.name in results]
    assert [s.name for s in ran] == ["A", "B", "C"]  # D's receivers (C's heads) lie in layer 0 of this model
    planned = _path_cost(ctx, len(pairs), ran, name="small")[0]
    assert planned == pytest.approx(counter.get_total_flops(), rel=0.25)
