"""The resource plan (mechdiff.studies.planner): memory bounded by the batch, fit and remedies on a named device,
and ``mechdiff run --plan`` on the paper's task file without its weights."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from mechdiff.models.devices import Device, get_device
from mechdiff.models.footprint import model_dims
from mechdiff.studies.circuits.spec import load_spec
from mechdiff.studies.circuits.stages.accuracy import cost as accuracy
from mechdiff.studies.circuits.stages.circuit import cost as circuit
from mechdiff.studies.circuits.stages.cmap import cost as cmap
from mechdiff.studies.circuits.stages.counting import Context
from mechdiff.studies.circuits.stages.counting import circuit_groups as _groups
from mechdiff.studies.circuits.stages.dcm import cost as dcm
from mechdiff.studies.circuits.stages.dcm import desiderata as _desiderata
from mechdiff.studies.circuits.stages.plan import resource_plan
from mechdiff.studies.circuits.stages.prune import cost as prune
from mechdiff.studies.planner import Lengths, place, task_lengths

LENGTHS = Lengths(53.0, 53, {"last": 1.0, "query_label": 3.0, "query_label_context": 27.0}, 13, "given")
CPU = Device("test cpu", 64 * 2**30, {"float32": 1e11, "bfloat16": 1e11}, gpu=False)


@pytest.fixture(scope="module")
def paper_spec():
    return load_spec("tasks/entity_tracking_llama7b.toml")


def context(spec, dtype="float32", device=CPU):
    return Context(spec, model_dims(spec.models.base)[0], LENGTHS, dtype, device)


def with_eval(spec, n, batch):
    return replace(spec, eval=replace(spec.eval, n=n, batch_size=batch))


def test_activation_memory_follows_the_batch_not_n(paper_spec):
    small = accuracy(context(with_eval(paper_spec, 50, 10)), "llama-7b")
    many = accuracy(context(with_eval(paper_spec, 500, 10)), "llama-7b")
    wide = accuracy(context(with_eval(paper_spec, 50, 20)), "llama-7b")
    assert many.transient == small.transient and many.weights == small.weights
    assert many.flops == pytest.approx(10 * small.flops)  # time follows n
    assert wide.transient == pytest.approx(2 * small.transient, rel=0.01)


def test_a_stage_of_fewer_prompts_than_a_batch_plans_the_smaller_batch(paper_spec):
    """A stage runs ``min(n, batch)`` prompts a pass: 4 prompts in batches of 20 hold 4 prompts' activations."""
    from mechdiff.models.footprint import forward_bytes

    few = context(with_eval(paper_spec, 4, 20))
    four = accuracy(few, "llama-7b")
    assert four.batch == 4 and four.transient == forward_bytes(few.dims, 4, LENGTHS.longest, "float32")
    cut = replace(paper_spec, cmap=replace(paper_spec.cmap, n=4))
    assert cmap(context(with_eval(cut, 4, 20)), "vicuna-7b").transient == pytest.approx(
        cmap(context(with_eval(cut, 4, 4)), "vicuna-7b").transient
    )
    assert (
        cmap(context(with_eval(cut, 4, 20)), "vicuna-7b").transient
        < cmap(context(with_eval(paper_spec, 40, 20)), "vicuna-7b").transient
    )


def test_two_7b_models_in_float32_do_not_fit_40gb_and_bfloat16_is_named(paper_spec):
    device = get_device("a100-40gb")
    ctx = context(paper_spec, device=device)
    cost = cmap(ctx, "vicuna-7b")
    assert cost.models == 2 and cost.weights == 2 * 6_738_415_616 * 4
    placed = place(cost, device, "float32", lambda dtype, batch: cmap(replace(ctx, dtype=dtype), "vicuna-7b"))
    assert not placed.fits
    assert any(r.startswith("--dtype bfloat16") for r in placed.remedies)
    assert any("NDIF" in r for r in placed.remedies)


def test_plan_on_an_h100_names_each_stage(paper_spec):
    plan = resource_plan(paper_spec, get_device("h100-80gb"), LENGTHS)
    names = [p.cost.stage for p in plan]
    assert names[0] == "reproduction:llama-7b" and "dcm" in names and "cmap:float-7b" in names
    assert all(p.seconds > 0 for p in plan)
    assert [p.cost.runs for p in plan[:4]] == [True] * 4 and not any(p.cost.runs for p in plan[4:])
    for p in plan:  # whatever does not fit says what would
        assert p.fits or p.remedies


def with_pairs(spec, n_train):
    return replace(spec, dcm=replace(spec.dcm, n_train=n_train))


def with_cache(spec, mode):
    return replace(spec, dcm=replace(spec.dcm, cache=mode))


def test_dcm_pair_cache_file_is_on_disk_and_memory_follows_the_batch(paper_spec):
    """DCM's pair cache in a scratch file: its disk need grows with the pairs, host and device memory hold one
    batch's rows whatever their number; a disk too small for it is a stage that does not fit, and the remedies name
    the host-memory mode and TMPDIR."""
    device = get_device("h100-80gb").with_disk(None)
    spec = with_cache(paper_spec, "file")
    few, many = (dcm(context(with_pairs(spec, n), device=device), "llama-7b", 4) for n in (1000, 10000))
    assert many.n > 5 * few.n and many.disk / many.n == few.disk / few.n  # disk: every pair's row
    assert (many.host_kept, many.transient) == (few.host_kept, few.transient) and few.host_kept < few.disk / 10
    assert few.host_peak(device) == few.weights // 2  # a model's weights while loading, more than a batch's rows
    small = device.with_disk(64 * 2**30)

    def recount(dtype, batch):
        return dcm(context(spec, dtype, small), "llama-7b", 4)

    cost = dcm(context(spec, device=small), "llama-7b", 4)
    assert cost.disk > 64 * 2**30 and cost.device_peak(small) <= small.memory
    placed = place(cost, small, "float32", recount)
    assert not placed.fits and placed.remedies[0] == '[dcm] cache = "memory"'
    assert placed.remedies[1] == "TMPDIR on a disk with 113 GiB free (this one has 64)"
    assert place(cost, device.with_disk(200 * 2**30), "float32", recount).fits
    assert "pair cache file ([dcm] cache); file (112.9 GiB on disk" in cost.note


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_papers_study_fits_one_h100_machine(paper_spec, dtype):
    """On one H100 (80 GB) with 128 GiB of host memory and 64 GiB of disk every stage of the paper's study fits, in
    float32 and bfloat16; DCM holds its sources' z in host memory (the fastest that fits), its scratch file would not
    fit the disk in float32."""
    device = get_device("h100-80gb")
    assert (device.disk, device.host) == (64 * 2**30, 128 * 2**30)
    plan = resource_plan(paper_spec, device, LENGTHS, dtype)
    assert all(p.fits for p in plan), [p.cost.stage for p in plan if not p.fits]
    costs = [p.cost for p in plan if p.cost.stage.startswith("dcm")]
    assert len(costs) == 4 and all(c.note.startswith("pair cache memory (the fastest that fits") for c in costs)
    assert all(c.disk == 0 and 0 < c.host_kept < 4 * 2**30 for c in costs)
    file = dcm(context(with_cache(paper_spec, "file"), dtype, device), "llama-7b", 4)
    assert file.fits(device) == (dtype == "bfloat16")


def test_the_cache_mode_is_the_fastest_that_fits_else_the_smallest(paper_spec):
    """With a disk as fast as memory the file (suffix runs) is fastest; a disk too small rules it out; a host too
    small for anything leaves recompute, which holds least; a mode named in [dcm] cache is kept."""
    from mechdiff.studies.circuits.stages.dcm import dcm_cache_choice

    fast = replace(get_device("h100-80gb"), disk=10**13, disk_read=1e12)
    assert dcm_cache_choice(context(paper_spec, "bfloat16", fast))[0] == "file"
    assert dcm_cache_choice(context(paper_spec, "bfloat16", fast.with_disk(2**30)))[0] == "memory"
    tiny_host = fast.with_disk(2**30).with_host(2**30)
    assert dcm_cache_choice(context(paper_spec, "bfloat16", tiny_host))[0] == "recompute"
    assert dcm_cache_choice(context(with_cache(paper_spec, "file"), "bfloat16", tiny_host)) == ("file", "[dcm] cache")


def test_the_memory_mode_holds_what_the_cache_holds(tiny_llama, smollm2_tokenizer):
    """The plan's host memory for the memory mode is the bytes a PairCache in that mode holds: the sources' z of
    every layer (random heads are drawn from all) at each group's position, for every pair."""
    from mechdiff.common.components import all_heads
    from mechdiff.methods.dcm_cache import PairCache
    from mechdiff.models.footprint import Dims
    from mechdiff.studies.circuits.spec import default_spec
    from mechdiff.studies.circuits.stages.dcm import mode_cost as _dcm_cost
    from mechdiff.tasks.entity_tracking import object_value_pairs

    spec = default_spec()
    spec = replace(spec, dcm=replace(spec.dcm, n_train=4, n_val=3, n_test=3, desiderata=["object_value"]))
    dims = Dims.from_config(tiny_llama.model.config)
    ctx = Context(spec, dims, LENGTHS, "float32", CPU)
    planned = _dcm_cost(ctx, spec.models.base, 0, "memory").host_kept
    pairs = object_value_pairs(smollm2_tokenizer, 10, n_boxes=3, seed=0)
    every = all_heads(tiny_llama.shape.n_layers, tiny_llama.shape.n_heads)
    sites = [(every, position) for position in _groups(ctx, spec.models.base, spec.dcm.groups)]
    cache = PairCache.build(tiny_llama, pairs, sites, 5, mode="memory")
    assert planned == cache.store.nbytes() > 0
    cache.close()


def test_path_patching_says_how_many_pairs_fit(paper_spec):
    """Path patching keeps every pair's activations: its note gives the most pairs that fit the device, and that
    many fit while one more does not."""
    import re

    device = get_device("h100-80gb")
    cost = circuit(context(paper_spec, device=device), "llama-7b")
    most = int(re.search(r"n up to (\d+) fits h100-80gb", cost.note).group(1))
    assert most > paper_spec.discovery.n  # the paper's 300 pairs fit one H100 in float32

    def peak(n):
        spec = replace(paper_spec, discovery=replace(paper_spec.discovery, n=n))
        return circuit(context(spec, device=device), "llama-7b").device_peak(device)

    assert peak(most) <= device.memory < peak(most + 1)
    assert "no n fits" in circuit(context(paper_spec, device=replace(device, memory=2**30)), "llama-7b").note


def test_path_patching_in_parts_holds_a_part_and_is_named_where_every_pair_does_not_fit(paper_spec):
    """``[discovery] pairs_per_part`` holds that many pairs' activations (a sixth of the paper's 300 in parts of
    50) for a clean run of each part and its two runs again at each step (twice with the attribution screen); a
    device too small for every pair is told the largest part that fits, and that part does fit."""
    device = get_device("a100-40gb")
    parted = replace(paper_spec, discovery=replace(paper_spec.discovery, pairs_per_part=50))
    whole, part = circuit(context(paper_spec), "llama-7b"), circuit(context(parted), "llama-7b")
    assert part.kept * 6 == pytest.approx(whole.kept, rel=1e-6) and "holds 50 pairs" in part.note
    steps = len(paper_spec.discovery.top_k or {"A": 1, "B": 1, "C": 1, "D": 1})
    one = 300 * context(paper_spec).fwd(1, LENGTHS.tokens)  # a forward of every pair
    # a clean run of each part, then its two runs at each step, where every pair held needed its two runs once
    assert part.flops - whole.flops == pytest.approx((2 * steps - 1) * one, rel=1e-6)
    # with the attribution screen both runs again at each pass of the screen too; the screen's own passes and the
    # senders it keeps are the same held whole or in parts (test_plan_counts counts them against a run), so compare
    # screened with screened: before the plan counted the screen, this compared with the unscreened part
    screen = replace(paper_spec.discovery, screen=True)
    whole = circuit(context(replace(paper_spec, discovery=screen)), "llama-7b")
    part = circuit(context(replace(paper_spec, discovery=replace(screen, pairs_per_part=50))), "llama-7b")
    assert part.flops - whole.flops == pytest.approx((4 * steps - 1) * one, rel=1e-6)
    plan = resource_plan(paper_spec, device, LENGTHS)
    (too_big,) = [p for p in plan if p.cost.stage == "circuit:llama-7b"]
    assert not too_big.fits
    size = int(re.search(r"pairs_per_part = (\d+)", too_big.remedies[0]).group(1))
    spec = replace(paper_spec, discovery=replace(paper_spec.discovery, pairs_per_part=size))
    assert circuit(context(spec, device=device), "llama-7b").device_peak(device) <= device.memory


def test_unknown_device_is_refused_with_the_names():
    with pytest.raises(ValueError, match="h100-80gb"):
        get_device("h100")


def test_run_plan_prints_the_resources_without_the_weights(capsys, monkeypatch):
    from mechdiff.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["run", "tasks/entity_tracking_llama7b.toml", "--plan", "--plan-device", "h100-80gb"]) == 0
    out = capsys.readouterr().out
    assert "resource plan on this machine" in out and "resource plan on h100-80gb" in out
    assert "mechdiff/data/configs/llama-7b.json" in out and "dominant stage:" in out
    dominant = out.split("dominant stage: ")[1].split(" ")[0]
    assert f"over 30 min: its largest part is {dominant}; the other stages alone take" in out  # hours


def test_plan_device_without_plan_is_refused():
    from mechdiff.cli import main

    assert main(["run", "tasks/entity_tracking_llama7b.toml", "--plan-device", "h100-80gb"]) != 0
    assert main(["run", "tasks/entity_tracking_llama7b.toml", "--plan", "--plan-disk", "64"]) != 0


def test_totals_name_the_stage_that_keeps_a_study_over_30_minutes():
    """The plan names the stage without which a study would fit 30 minutes, and says where no one stage does."""
    from mechdiff.models.devices import get_device
    from mechdiff.studies.planner import Placement, StageCost, _totals

    def placed(stage: str, minutes: float) -> Placement:
        cost = StageCost(stage, 1, 10, 10, 1e12, 0, 0, 0)
        return Placement(cost, get_device("h100-80gb"), "float32", minutes * 60, True)

    one = _totals([placed("matrix:a", 40), placed("accuracy:a", 5), placed("prune:a", 10)])
    assert any(line.startswith("over 30 min: matrix keeps the study from it (the other stages: 15") for line in one)
    two = _totals([placed("matrix:a", 40), placed("prune:a", 35)])
    assert any("its largest part is matrix; the other stages alone take 35" in line for line in two)
    assert not any("over 30 min" in line for line in _totals([placed("matrix:a", 20), placed("prune:a", 9)]))


def test_an_imported_tasks_lengths_and_desiderata_are_the_studys():
    """On the committed capitals task (rows in file order: the 5-token template first; 11 tokens at most): the plan's
    prompt lengths come from a sample stratified like the study's prompt sets, not the first rows, and DCM's cost
    counts the two desiderata the task declares (the study trains each), not the spec's defaults."""
    import json
    from pathlib import Path

    spec = load_spec("tasks/capitals.toml")
    meta = json.loads((Path(spec.task.name) / "task.json").read_text())
    lengths = task_lengths(spec)
    # each prompt counted with its teacher-forced runs (the answer, and under logit_diff the counterfactual one)
    assert lengths.longest > max(meta["n_tokens"]) and min(meta["n_tokens"]) < lengths.tokens < lengths.longest
    ctx = Context(spec, model_dims(spec.models.base)[0], lengths, "float32", CPU)
    assert _desiderata(ctx) == list(meta["desiderata"])
    one = Context(replace(spec, dcm=replace(spec.dcm, desiderata=["swapped"])), ctx.dims, lengths, "float32", CPU)
    assert _desiderata(one) == ["swapped"]
    assert dcm(ctx, spec.models.base, 2).flops > dcm(one, spec.models.base, 2).flops


def test_groups_left_unnamed_are_the_ones_the_study_picks():
    """``[dcm]``/``[cmap] groups`` unset (the capitals study): the plan counts the groups the study would patch, as
    ``group_choice`` picks them: every non-empty group of the circuit a run found, else the task's named positions
    (before, none: DCM and CMAP were counted over no group)."""
    spec = load_spec("tasks/capitals.toml")
    assert spec.dcm.groups == [] and spec.cmap.groups == []
    ctx = Context(spec, model_dims(spec.models.base)[0], task_lengths(spec), "float32", CPU)
    base = spec.models.base
    assert _groups(ctx, base, []) == ["country", "last"]
    found = {"groups": {"last": ["L20H1"], "country": [], "after_country": ["L2H0"]}, "positions": {}}
    known = replace(ctx, known={"circuit": {base: found}})
    assert _groups(known, base, []) == ["last", "after_country"]
    assert _groups(known, base, ["country", "last"]) == ["last"]
    # without random draws (they scale with a group's suffix, and an unknown group's suffix is the whole prompt)
    some = replace(ctx, spec=replace(spec, dcm=replace(spec.dcm, n_random=0)))
    none = replace(ctx, spec=replace(spec, dcm=replace(spec.dcm, groups=["absent"], n_random=0)))
    assert dcm(some, base, 2).flops > dcm(none, base, 2).flops


def test_a_prompt_counts_the_tokens_its_teacher_forced_runs_append():
    """An answer of several tokens is scored by one run per answer with its tokens but the last appended: the
    plan counts 2 extra tokens for a 3-token answer, and under ``logit_diff`` the counterfactual's run too; a task
    whose answers are one token computes the prompt alone (its plan is what it was)."""
    from mechdiff.studies.planner import _appended
    from mechdiff.tasks.records import Example

    one = Example("a b", (1, 2), " c", 3, alternatives=(" d",), alternative_ids=(4,))
    long = Example(
        "a b",
        (1, 2),
        " c e f",
        3,
        alternatives=(" d g",),
        alternative_ids=(4,),
        answer_tokens=(3, 5, 6),
        alternative_tokens=((4, 7),),
    )
    assert _appended(one, "logit_diff") == [0] and _appended(one, "prob") == [0]
    assert _appended(long, "prob") == [2] and _appended(long, "logit_diff") == [2, 1]


def test_a_pass_reads_the_weights_of_the_blocks_it_runs(paper_spec):
    """Each of the accuracy stage's passes reads every block's weights and the unembedding once: LLaMA-7B's
    published parameter count less its input embeddings, in the dtype's bytes; the time adds them over the
    device's bandwidth, and each pass's and block's overhead."""
    spec = with_eval(paper_spec, 500, 50)
    unembedded = 6_738_415_616 - 32_000 * 4096  # huggyllama/llama-7b less embed_tokens
    for dtype in ("float32", "bfloat16"):
        cost = accuracy(context(spec, dtype), "llama-7b")
        assert cost.reads.bytes == 10 * (unembedded - 4096) * (4 if dtype == "float32" else 2)  # less the final norm
        assert (cost.reads.passes, cost.reads.blocks) == (10, 10 * 32)
    here = Device("given", 1 << 40, {"float32": 1e11}, False, bandwidth={"float32": 1e10}, overhead=(0.01, 0.001))
    cost = accuracy(context(spec, "float32", here), "llama-7b")
    expected = cost.flops / 1e11 + cost.reads.bytes / 1e10 + 10 * 0.01 + 320 * 0.001
    assert place(cost, here, "float32", lambda *_: cost).seconds == pytest.approx(expected)


def test_pruning_plans_the_resumed_runs_the_scorer_keeps(paper_spec, tiny_llama, smollm2_tokenizer):
    """Pruning keeps F(C)'s run of every prompt to resume removals from: the plan's bytes are the tensors a
    scorer holds after one removal on 8 prompts (two batches), and twice as many prompts keep twice as much."""
    from mechdiff.circuits.scoring import Scorer
    from mechdiff.common.components import Head
    from mechdiff.models.footprint import Dims
    from mechdiff.tasks.entity_tracking import generate, reference_records

    records = generate(smollm2_tokenizer, 8, n_boxes=3, seed=0)
    scorer = Scorer.build(
        tiny_llama, records, reference_records(smollm2_tokenizer, 4, 3, seed=1), batch_size=4, progress=False
    )
    scorer.keep_without([(Head(2, 0), "last"), (Head(1, 0), "last")], [(Head(2, 0), "last")])
    held = sum(
        t.numel() * t.element_size() for resid, kv in scorer.runs.values() for t in [*resid, *kv.keys, *kv.values]
    )
    tokens = len(records[0].input_ids)
    assert {len(r.input_ids) for r in records} == {tokens}
    ctx = Context(
        paper_spec, Dims.from_config(tiny_llama.model.config), Lengths(tokens, tokens, {}, 1, "t"), "float32", CPU
    )
    assert ctx.resumed_runs(8) == held and ctx.resumed_runs(16) == 2 * held
    few = replace(paper_spec, scoring=replace(paper_spec.scoring, prune_n=50))
    assert prune(context(paper_spec), "llama-7b").kept == 2 * prune(context(few), "llama-7b").kept > 0
