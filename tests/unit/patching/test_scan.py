"""Patching scans against an independent loop: one component per plain HF forward with torch hooks
(written only here), on tiny models; the ``mechdiff scan`` command writes the tensor and a heatmap."""

from __future__ import annotations

import json
import re

import pytest
import torch
from conftest import hooked_last_logits, spy_runs
from tolerances import approx32, tol32

from mechdiff.common.components import Head
from mechdiff.patching.scan import scan
from mechdiff.tasks.entity_tracking import pair_batch_tensors, path_patching_pairs

TOL = 1e-4


def _close(got, want, logits):
    """Equal to the reference within 1e-4 absolute and 1% of its largest effect, never below float32 rounding
    of the answer logits the effects are differences of (tiny random models' effects are small: K on GPT-2's
    reach 4.4e-6 against a rounding bound of 7.9e-7), and the reference not vacuous."""
    scale = float(want.abs().max())
    assert scale > 2e-6, "vacuous: no component moved the metric"
    rounding = tol32(float(logits.abs().max()))
    assert rounding < 0.5 * scale, "vacuous: the effects are within float32 rounding of the logits"
    assert float((got - want).abs().max()) <= min(TOL, max(rounding, 1e-2 * scale))


@pytest.fixture(scope="module")
def prompts(smollm2_tokenizer):
    """Clean entity-tracking prompts; the source is random tokens (far from clean everywhere: large effects)."""
    t = pair_batch_tensors(path_patching_pairs(smollm2_tokenizer, 3, n_boxes=3, seed=7))
    clean = t["base"]["input_ids"]
    source = torch.randint(0, 5000, clean.shape, generator=torch.Generator().manual_seed(0))
    return clean, source, t["target_ids"], t["base"]["positions"]


def _prob(lm, ids, answers, hooks=()):
    """The answer logit at the last position of a plain HF forward with torch hooks."""
    logits = hooked_last_logits(
        lm,
        ids,
        pre_hooks=[(m, f) for m, kind, f in hooks if kind != "out"],
        hooks=[(m, f) for m, kind, f in hooks if kind == "out"],
    )
    return logits[torch.arange(len(answers)), answers]  # the answer's logit (metric answer_logit)


def _module_and_kind(lm, site, layer):
    """Where a site lives: (module, "pre" for its input or "out" for its output)."""
    if site == "z":
        return lm.arch.module(lm.model, "z", layer), "pre"
    return lm.arch.module(lm.model, site, layer), "out"


def _hook_value(lm, ids, site, layer):
    got = {}
    module, kind = _module_and_kind(lm, site, layer)
    f = (
        (lambda m, a: got.__setitem__("x", a[0].clone()))
        if kind == "pre"
        else (lambda m, a, o: got.__setitem__("x", o.clone()))
    )
    _prob(lm, ids, torch.zeros(len(ids), dtype=torch.long), [(module, kind, f)])
    return got["x"]


def _reference_heads(lm, clean, source, answers, site, pos):
    """One forward per (layer, head): the head's (KV group's) columns at ``pos`` taken from the source."""
    shape = lm.shape
    p0 = _prob(lm, clean, answers).mean()
    grid = torch.zeros(shape.n_layers, shape.n_heads)
    rows = torch.arange(len(clean))
    for layer in range(shape.n_layers):
        src = _hook_value(lm, source, site, layer)
        module, kind = _module_and_kind(lm, site, layer)
        for head in range(shape.n_heads):
            cols = lm.arch.columns(site, head, shape)

            def write(x):
                x = x.clone()
                x[rows, pos, cols] = src[rows, pos, cols]
                return x

            f = (lambda m, a: (write(a[0]),)) if kind == "pre" else (lambda m, a, o: write(o))
            grid[layer, head] = _prob(lm, clean, answers, [(module, kind, f)]).mean() - p0
    return grid


@pytest.mark.parametrize("site", ["z", "q", "k", "v"])
def test_head_scan_equals_one_head_per_pass_hooks(tiny_model, prompts, site):
    if site in ("q", "v") and tiny_model.arch.name != "llama":
        pytest.skip("q and v: on llama (GQA); z and k (the fused-QKV column layouts) on every family")
    clean, source, answers, positions = prompts
    # a query only changes its own position's output: scanned at the last position, the rest earlier
    pos = positions["last"] if site == "q" else positions["query_label"]
    result = scan(tiny_model, clean, source, answers, site=site, positions=pos, per_pass=5, metric="answer_logit")
    want = _reference_heads(tiny_model, clean, source, answers, site, pos)
    assert result.axes == ("layer", "head") and result.metric == "answer_logit"
    assert result.effects.shape == want.shape
    logits = _prob(tiny_model, clean, answers)
    _close(result.effects, want, logits)
    assert result.clean == approx32(float(logits.mean()), scale=float(logits.abs().max()))


def test_head_scan_at_every_position(tiny_llama, prompts):
    clean, source, answers, _ = prompts
    result = scan(tiny_llama, clean, source, answers, site="z", positions=None, per_pass=7, metric="answer_logit")
    shape = tiny_llama.shape
    p0 = _prob(tiny_llama, clean, answers).mean()
    want = torch.zeros(shape.n_layers, shape.n_heads)
    for layer in range(shape.n_layers):
        src = _hook_value(tiny_llama, source, "z", layer)
        module = tiny_llama.arch.module(tiny_llama.model, "z", layer)
        for head in range(shape.n_heads):
            cols = slice(head * 8, (head + 1) * 8)

            def pre(m, a, cols=cols, src=src):
                x = a[0].clone()
                x[:, :, cols] = src[:, :, cols]
                return (x,)

            want[layer, head] = _prob(tiny_llama, clean, answers, [(module, "pre", pre)]).mean() - p0
    _close(result.effects, want, _prob(tiny_llama, clean, answers))


def test_resid_scan_equals_hooks(tiny_model, prompts):
    """[layer, position]: the residual stream entering each block (the embedding output at layer 0)."""
    clean, source, answers, _ = prompts
    length = clean.shape[1]
    positions = [0, 5, length - 2, length - 1]
    result = scan(
        tiny_model, clean, source, answers, site="resid", positions=positions, per_pass=3, metric="answer_logit"
    )
    assert result.axes == ("layer", "position") and result.positions == positions
    p0 = _prob(tiny_model, clean, answers).mean()
    n_layers = tiny_model.shape.n_layers
    want = torch.zeros(n_layers, len(positions))
    for layer in range(n_layers):
        module = tiny_model.arch.block(tiny_model.model, layer)
        src = {}
        h = module.register_forward_pre_hook(
            lambda m, a, kw: (
                src.__setitem__("x", a[0].clone()) if a else src.__setitem__("x", kw["hidden_states"].clone())
            ),
            with_kwargs=True,
        )
        _prob(tiny_model, source, answers)
        h.remove()
        for j, p in enumerate(positions):

            def pre(m, a, kw, p=p):
                if a:
                    x = a[0].clone()
                    x[:, p] = src["x"][:, p]
                    return (x, *a[1:]), kw
                x = kw["hidden_states"].clone()
                x[:, p] = src["x"][:, p]
                return a, {**kw, "hidden_states": x}

            h = module.register_forward_pre_hook(pre, with_kwargs=True)
            want[layer, j] = _prob(tiny_model, clean, answers).mean() - p0
            h.remove()
    _close(result.effects, want, _prob(tiny_model, clean, answers))


def test_scan_rejects_bad_input(tiny_llama, prompts):
    clean, source, answers, _ = prompts
    with pytest.raises(ValueError, match="unknown scan site"):
        scan(tiny_llama, clean, source, answers, site="mlp")
    with pytest.raises(ValueError, match="unknown metric"):
        scan(tiny_llama, clean, source, answers, metric="loss")
    with pytest.raises(ValueError, match="differ in shape"):
        scan(tiny_llama, clean, source[:, 1:], answers)
    with pytest.raises(ValueError, match="other_ids"):
        scan(tiny_llama, clean, source, answers, metric="logit_diff")


def test_scan_command_writes_tensor_and_heatmap(tmp_path, monkeypatch, smollm2_tokenizer):
    from conftest import make_tiny

    from mechdiff.cli import main
    from mechdiff.commands import scan as command

    tiny = make_tiny("llama", smollm2_tokenizer)
    monkeypatch.setattr(command, "load_from_args", lambda name, args, tokenizer=None: tiny)
    monkeypatch.setattr(command, "tokenizer_from_args", lambda name, args: smollm2_tokenizer)
    out = tmp_path / "scan"
    assert (
        main(
            [
                "scan",
                "--model",
                "tiny",
                "--site",
                "z",
                "--position",
                "last",
                "--n",
                "3",
                "--n-boxes",
                "3",
                "--metric",
                "answer_prob",
                "--out",
                str(out),
            ]
        )
        == 0
    )  # the earlier name, read as prob
    saved = torch.load(out / "scan_z_last.pt")
    meta = json.loads((out / "scan_z_last.json").read_text())
    assert saved["effects"].shape == (3, 4) and meta["metric"] == "prob" and meta["axes"] == ["layer", "head"]
    assert (out / "scan_z_last.png").stat().st_size > 0


def test_scan_command_on_another_task(tmp_path, monkeypatch, smollm2_tokenizer):
    """`--task ioi` scans IOI's pairs at one of its positions; an unknown position is refused before loading."""
    from conftest import make_tiny

    from mechdiff.cli import main
    from mechdiff.commands import scan as command

    tiny = make_tiny("llama", smollm2_tokenizer)
    loads = []
    monkeypatch.setattr(command, "load_from_args", lambda name, args, tokenizer=None: loads.append(name) or tiny)
    monkeypatch.setattr(command, "tokenizer_from_args", lambda name, args: smollm2_tokenizer)
    out = tmp_path / "ioi"
    assert (
        main(
            [
                "scan",
                "--task",
                "ioi",
                "--model",
                "tiny",
                "--site",
                "z",
                "--position",
                "S2",
                "--n",
                "3",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    meta = json.loads((out / "scan_z_S2.json").read_text())
    assert meta["task"] == "ioi" and len(meta["effects"]) == 3 and loads == ["tiny"]
    assert main(["scan", "--task", "ioi", "--model", "tiny", "--position", "query_label", "--out", str(out)]) == 2
    assert loads == ["tiny"]  # refused before the model loads


@pytest.fixture
def small_pairs(smollm2_tokenizer):
    return path_patching_pairs(smollm2_tokenizer, 4, n_boxes=3, seed=5)


def test_scan_positions_as_an_int_a_name_or_a_tensor_and_the_record(tiny_llama, smollm2_tokenizer):
    """One int is that position in every example (the same scan as the tensor of it); ``"last"`` is the last
    position; the result records each example's position, the clean and source metrics and its fields."""
    from mechdiff.common.metrics import answer_prob
    from mechdiff.patching.scan import scan
    from mechdiff.tasks.entity_tracking import pair_batch_tensors

    t = pair_batch_tensors(path_patching_pairs(smollm2_tokenizer, 2, n_boxes=3, seed=7))
    clean, answers = t["base"]["input_ids"], t["target_ids"]
    source = torch.randint(0, 5000, clean.shape, generator=torch.Generator().manual_seed(0))
    n, length = clean.shape
    at = scan(tiny_llama, clean, source, answers, site="z", positions=length - 3, per_pass=5)
    same = scan(tiny_llama, clean, source, answers, site="z", positions=torch.full((n,), length - 3), per_pass=5)
    torch.testing.assert_close(at.effects, same.effects, rtol=0, atol=0)  # exact: one position given two ways
    assert at.positions == [length - 3] * n
    last = scan(tiny_llama, clean, source, answers, site="z", positions="last", per_pass=5)
    assert last.positions == [length - 1] * n
    assert scan(tiny_llama, clean, source, answers, site="z", positions=None, per_pass=12).positions == []
    with torch.no_grad():
        p_source = answer_prob(tiny_llama.model(source).logits[:, -1], answers).mean()
    assert last.source == pytest.approx(float(p_source), abs=1e-6)
    assert last.to_dict() == {
        "site": "z",
        "metric": "prob",
        "axes": ["layer", "head"],
        "label": "change in probability of the answer (prob)",
        "clean": last.clean,
        "source": last.source,
        "positions": [length - 1] * n,
        "effects": last.effects.tolist(),
    }
    with pytest.raises(ValueError, match="^per_pass must be at least 1$"):
        scan(tiny_llama, clean, source, answers, per_pass=0)
    for bad, message in (
        ("first", "positions must be 'last', an int, a LongTensor [batch] or None, not 'first'"),
        (length, f"positions must give one position in [0, {length}) per example"),
        (torch.tensor([1]), f"positions must give one position in [0, {length}) per example"),
    ):
        with pytest.raises(ValueError, match="^" + re.escape(message) + "$"):
            scan(tiny_llama, clean, source, answers, site="z", positions=bad)


def _scan_prompts(tokenizer, n: int = 2):
    from mechdiff.tasks.entity_tracking import pair_batch_tensors

    t = pair_batch_tensors(path_patching_pairs(tokenizer, n, n_boxes=3, seed=7))
    clean = t["base"]["input_ids"]
    return clean, torch.randint(0, 5000, clean.shape, generator=torch.Generator().manual_seed(0)), t["target_ids"]


def test_scan_logit_difference_is_the_difference_of_the_answer_logit_scans(tiny_llama, smollm2_tokenizer):
    """The effect on logit(a) - logit(o) is the effect on logit(a) minus the effect on logit(o): the
    alternative answers are stacked with the copies like the answers."""
    from mechdiff.patching.scan import scan

    clean, source, answers = _scan_prompts(smollm2_tokenizer)
    other = answers.roll(1) + 7
    diff = scan(tiny_llama, clean, source, answers, site="z", metric="logit_diff", other_ids=other, per_pass=5)
    a = scan(tiny_llama, clean, source, answers, site="z", metric="answer_logit", per_pass=5)
    o = scan(tiny_llama, clean, source, other, site="z", metric="answer_logit", per_pass=5)
    torch.testing.assert_close(diff.effects, a.effects - o.effects, rtol=1e-4, atol=1e-5)
    assert float(diff.effects.abs().max()) > 1e-3


def test_resid_scan_does_not_depend_on_how_positions_are_grouped(tiny_llama, smollm2_tokenizer):
    """Positions scanned two per pass (three passes, the last one short) or all in one pass, given as a list
    or a tensor: the same grid."""
    from mechdiff.patching.scan import scan

    clean, source, answers = _scan_prompts(smollm2_tokenizer)
    positions = [0, 3, 6, 9, clean.shape[1] - 1]
    two = scan(tiny_llama, clean, source, answers, site="resid", positions=positions, per_pass=2)
    one = scan(tiny_llama, clean, source, answers, site="resid", positions=positions, per_pass=8)
    torch.testing.assert_close(two.effects, one.effects, rtol=1e-4, atol=1e-6)
    as_tensor = scan(tiny_llama, clean, source, answers, site="resid", positions=torch.tensor(positions), per_pass=8)
    assert as_tensor.positions == positions
    torch.testing.assert_close(as_tensor.effects, one.effects, rtol=0, atol=0)  # exact: the same positions
    every = scan(tiny_llama, clean, source, answers, site="resid", positions=None, per_pass=32)
    assert every.positions == list(range(clean.shape[1]))
    torch.testing.assert_close(every.effects[:, positions], one.effects, rtol=1e-4, atol=1e-6)
    assert (
        scan(tiny_llama, clean, source, answers, site="resid", positions="all", per_pass=32).positions
        == every.positions
    )
    with pytest.raises(
        ValueError, match="^" + re.escape(f"resid scan positions must lie in [0, {clean.shape[1]})") + "$"
    ):
        scan(tiny_llama, clean, source, answers, site="resid", positions=[0, clean.shape[1]])
    assert bool((one.effects[:, -1] != 0).all())  # the last position moves the answer at every layer


def test_scans_and_activation_patches_are_suffix_runs(tiny_llama, small_pairs, monkeypatch):
    """Cost, not values: head scans at one position, resid scans and activation patches with a prefix read
    the clean keys and values; head scans resume at each pass's first layer."""
    import mechdiff.patching.activation as activation
    import mechdiff.patching.scan as scan_module
    from mechdiff.tasks.entity_tracking import pair_batch_tensors

    t = pair_batch_tensors(small_pairs)
    clean, source, answers = t["base"]["input_ids"], t["source"]["input_ids"], t["target_ids"]
    calls = spy_runs(scan_module, monkeypatch)
    scan_module.scan(tiny_llama, clean, source, answers, site="z", positions="last", per_pass=4)
    patched = calls[2:]  # after the clean and the source runs
    assert len(patched) == 3 and all(k["prefix"] is not None for _, k in patched)
    assert [None if k["resume"] is None else k["resume"].layer for _, k in patched] == [None, 1, 2]
    calls.clear()
    scan_module.scan(tiny_llama, clean, source, answers, site="resid", positions=[3, 5], per_pass=4)
    assert all(k["prefix"] is not None for _, k in calls[2:]) and len(calls) == 2 + 3
    calls = spy_runs(activation, monkeypatch)
    kv = activation.run(tiny_llama, clean, keep_kv=True).kv
    calls.clear()
    activation.activation_patch(
        tiny_llama, clean, source, [Head(1, 2)], t["base"]["positions"]["query_label"], prefix=kv
    )
    assert calls[-1][1]["prefix"] is kv


@pytest.mark.parametrize(
    ("task", "given", "want"), [("ioi", None, "logit_diff"), ("entity-tracking", None, "prob"), ("ioi", "prob", "prob")]
)
def test_the_scan_command_measures_the_tasks_metric_unless_told(monkeypatch, task, given, want):
    """``mechdiff scan`` without ``--metric`` scores the task's metric (IOI: the logit difference)."""
    from mechdiff.cli import build_parser
    from mechdiff.commands import scan as command

    seen = {}
    monkeypatch.setattr(command, "scan_task", lambda task, site, position, metric, *rest: seen.setdefault("m", metric))
    argv = ["scan", "--task", task, "--model", "tiny", *(["--metric", given] if given else [])]
    args = build_parser().parse_args(argv)
    assert args.func(args) == 0 and seen["m"] == want
