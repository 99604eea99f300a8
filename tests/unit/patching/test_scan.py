"""Patching scans against an independent loop: one component per plain HF forward with torch hooks
(written only here), on tiny models; the ``mechdiff scan`` command writes the tensor and a heatmap."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import hooked_last_logits
from tolerances import approx32, tol32
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
    logits = hooked_last_logits(lm, ids, pre_hooks=[(m, f) for m, kind, f in hooks if kind != "out"],
                                hooks=[(m, f) for m, kind, f in hooks if kind == "out"])
    return logits[torch.arange(len(answers)), answers]  # the answer's logit (metric answer_logit)


def _module_and_kind(lm, site, layer):
    """Where a site lives: (module, "pre" for its input or "out" for its output)."""
    if site == "z":
        return lm.arch.module(lm.model, "z", layer), "pre"
    return lm.arch.module(lm.model, site, layer), "out"


def _hook_value(lm, ids, site, layer):
    got = {}
    module, kind = _module_and_kind(lm, site, layer)
    f = (lambda m, a: got.__setitem__("x", a[0].clone())) if kind == "pre" else \
        (lambda m, a, o: got.__setitem__("x", o.clone()))
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
    result = scan(tiny_model, clean, source, answers, site=site, positions=pos, per_pass=5,
                  metric="answer_logit")
    want = _reference_heads(tiny_model, clean, source, answers, site, pos)
    assert result.axes == ("layer", "head") and result.metric == "answer_logit"
    assert result.effects.shape == want.shape
    logits = _prob(tiny_model, clean, answers)
    _close(result.effects, want, logits)
    assert result.clean == approx32(float(logits.mean()), scale=float(logits.abs().max()))


def test_head_scan_at_every_position(tiny_llama, prompts):
    clean, source, answers, _ = prompts
    result = scan(tiny_llama, clean, source, answers, site="z", positions=None, per_pass=7,
                  metric="answer_logit")
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
    result = scan(tiny_model, clean, source, answers, site="resid", positions=positions, per_pass=3,
                  metric="answer_logit")
    assert result.axes == ("layer", "position") and result.positions == positions
    p0 = _prob(tiny_model, clean, answers).mean()
    n_layers = tiny_model.shape.n_layers
    want = torch.zeros(n_layers, len(positions))
    for layer in range(n_layers):
        module = tiny_model.arch.block(tiny_model.model, layer)
        src = {}
        h = module.register_forward_pre_hook(lambda m, a, kw: src.__setitem__("x", a[0].clone()) if a else
                                             src.__setitem__("x", kw["hidden_states"].clone()), with_kwargs=True)
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
    assert main(["scan", "--model", "tiny", "--site", "z", "--position", "last", "--n", "3", "--n-boxes", "3",
                 "--metric", "answer_prob", "--out", str(out)]) == 0  # the earlier name, read as prob
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
    assert main(["scan", "--task", "ioi", "--model", "tiny", "--site", "z", "--position", "S2", "--n", "3",
                 "--out", str(out)]) == 0
    meta = json.loads((out / "scan_z_S2.json").read_text())
    assert meta["task"] == "ioi" and len(meta["effects"]) == 3 and loads == ["tiny"]
    assert main(["scan", "--task", "ioi", "--model", "tiny", "--position", "query_label", "--out", str(out)]) == 2
    assert loads == ["tiny"]  # refused before the model loads
