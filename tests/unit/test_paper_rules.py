"""The paper's rules (Prakash et al. 2024) as named options, pinned against direct computations:
pruning ``rule = "paper"``, DCM with an absolute sparsity weight, CMAP ``scope = "paper"``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import pytest

from mechdiff.circuits.circuit import Circuit
from mechdiff.circuits.scoring import Scorer
from mechdiff.circuits.pruning import minimality, pair_name, pairwise_minimality, paper_ratio, prune
from mechdiff.common.components import Head
from mechdiff.patching.evaluate import EvalResult
from mechdiff.tasks.entity_tracking import generate, reference_records

N_BOXES = 3


# --------------------------------------------------------------------------------------------------
# Pruning: the paper's pairwise rule
# --------------------------------------------------------------------------------------------------


@dataclass
class TableScorer:
    """A scorer whose F(C \\ S) is read from a table (answer probability, one prompt), for hand-written ratios."""

    pairs: list
    table: dict  # frozenset(removed pair names) -> F
    full_value: float = 1.0
    records: list = field(default_factory=lambda: [None])
    progress: bool = False
    asked: list = field(default_factory=list)

    def _result(self, value: float) -> EvalResult:
        return EvalResult(np.array([value > 0.5]), np.array([value]))

    def full(self) -> EvalResult:
        return self._result(self.full_value)

    def keep(self, pairs) -> EvalResult:
        removed = frozenset(pair_name(p) for p in self.pairs if p not in set(pairs))
        self.asked.append(removed)
        return self._result(self.table[removed])

    def keep_without(self, pairs, removed) -> EvalResult:
        return self.keep([p for p in pairs if p not in set(removed)])


def test_paper_ratio_is_signed_and_relative_to_the_smaller_circuit():
    assert paper_ratio(0.5, 0.4) == pytest.approx(0.5 / 0.4 - 1)  # removing v drops F: +0.25
    assert paper_ratio(0.4, 0.5) == pytest.approx(-0.2)  # removing v raises F: negative, never kept
    assert paper_ratio(0.3, 0.0) == math.inf and paper_ratio(0.0, 0.0) == 0.0


def test_paper_pruning_decision_on_a_hand_built_circuit():
    """Group A = {a, b, c, d} (K: at most ceil(0.3 * 4) = 2 heads), group C = {e}. Every F(C \\ S) is
    written out; the decisions follow F(C\\K) / F(C\\(K+v)) - 1 >= 0.01 and differ from the greedy rule."""
    a, b, c, d, e = Head(2, 0), Head(2, 1), Head(1, 0), Head(1, 1), Head(0, 0)
    circuit = Circuit("t", "et", {"A": [a, b, c, d], "C": [e]}, {"A": "last", "C": "query_label"})
    pairs = circuit.pairs()
    n = {h: pair_name((h, pos)) for h, pos in pairs}
    F = {frozenset(): 0.80,
         frozenset({n[a]}): 0.70, frozenset({n[b]}): 0.75, frozenset({n[c]}): 0.78, frozenset({n[d]}): 0.85,
         frozenset({n[e]}): 0.40}
    pair_values = {(a, b): 0.50, (a, c): 0.69, (a, d): 0.70, (b, c): 0.74, (b, d): 0.76, (c, d): 0.80}
    for (u, v), value in pair_values.items():
        F[frozenset({n[u], n[v]})] = value
    # the K + v sets the rule reaches (derived below; a set the rule asks for and the table lacks fails the test)
    F[frozenset({n[a], n[b], n[d]})] = 0.51
    F[frozenset({n[a], n[c], n[d]})] = 0.69
    scorer = TableScorer(pairs, F)
    res = pairwise_minimality(scorer, circuit, metric="prob", threshold=0.01)
    r = res["pairs"]
    # v = a: scores of u = F(C\u) - F(C\{u,a}): b 0.75-0.50=0.25, c 0.78-0.69=0.09, d 0.85-0.70=0.15
    # -> top 2 = {b, d}; F(C\{b,d}) = 0.76, F(C\{a,b,d}) = 0.51: 0.76/0.51 - 1 = 0.490 -> kept
    assert r[n[a]]["K"] == sorted([n[b], n[d]])
    assert r[n[a]]["score"] == pytest.approx(0.76 / 0.51 - 1) and r[n[a]]["kept"]
    # v = d: b 0.75-0.76=-0.01, a 0.70-0.70=0, c 0.78-0.80=-0.02: no positive score, K = {}
    # F(C) / F(C\d) - 1 = 0.80/0.85 - 1 = -0.059 -> removed (the greedy rule keeps it: |0.85-0.80|/0.80 > 0.01)
    assert r[n[d]]["K"] == [] and r[n[d]]["score"] == pytest.approx(0.80 / 0.85 - 1) and not r[n[d]]["kept"]
    # v = b: a 0.70-0.50=0.20, c 0.78-0.74=0.04, d 0.85-0.76=0.09 -> K = {a, d}: 0.70/0.51 - 1 = 0.373 -> kept
    assert r[n[b]]["K"] == sorted([n[a], n[d]]) and r[n[b]]["score"] == pytest.approx(0.70 / 0.51 - 1)
    # v = c: a 0.70-0.69=0.01, b 0.75-0.74=0.01, d 0.85-0.80=0.05 -> top 2 = {d, a} (a before b: circuit order)
    # F(C\{a,d}) = 0.70, F(C\{a,c,d}) = 0.69: 0.70/0.69 - 1 = 0.0145 -> kept
    assert r[n[c]]["K"] == sorted([n[a], n[d]]) and r[n[c]]["score"] == pytest.approx(0.70 / 0.69 - 1)
    assert r[n[c]]["kept"]
    # group C has one head: ceil(0.3) = 1 slot but no other head, K = {}; 0.80/0.40 - 1 = 1 -> kept
    assert r[n[e]]["K"] == [] and r[n[e]]["score"] == pytest.approx(1.0)
    # only removals within a group are asked for: no set mixes e with A's heads
    assert not any(n[e] in s and len(s) > 1 for s in scorer.asked)
    pruned = prune(circuit, res, threshold=0.01)
    kept_a = [h for h in (a, b, c, d) if r[n[h]]["kept"]]
    assert pruned.groups == {"A": kept_a, "C": [e]} and d not in kept_a
    assert pruned.meta["pruned"]["rule"] == "paper" and pruned.meta["pruned"]["share"] == 0.3
    # the same scores at a threshold above c's 0.0145 drop c
    assert c not in prune(circuit, res, threshold=0.02).groups["A"]


@pytest.fixture
def records(smollm2_tokenizer):
    return generate(smollm2_tokenizer, 6, n_boxes=N_BOXES, seed=0)


def test_paper_pruning_matches_a_direct_computation_on_a_tiny_model(tiny_llama, records, smollm2_tokenizer):
    reference = reference_records(smollm2_tokenizer, 6, N_BOXES, 1)
    circuit = Circuit("tiny", "et", {"A": [Head(2, 0), Head(1, 0), Head(1, 3), Head(2, 3)], "C": [Head(2, 2)]},
                      {"A": "last", "C": "query_label"})
    res = pairwise_minimality(Scorer.build(tiny_llama, records, reference, 6, False), circuit, metric="prob")
    direct = Scorer.build(tiny_llama, records, reference, 6, False)  # full runs, its own cache
    pairs = circuit.pairs()

    def F(removed) -> float:
        return float(direct.keep([p for p in pairs if p not in set(removed)]).prob.mean())

    for g in circuit.groups:
        members = [(h, circuit.positions[g]) for h in circuit.groups[g]]
        size = math.ceil(0.3 * len(members))
        for v in members:
            scores = [(F([u]) - F([u, v]), u) for u in members if u != v]
            ranked = sorted(scores, key=lambda t: -t[0])
            k = [u for s, u in ranked[:size] if s > 0]
            before, after = F(k), F([*k, v])
            got = res["pairs"][pair_name(v)]
            assert got["K"] == sorted(pair_name(u) for u in k)
            assert got["before"] == pytest.approx(before, rel=1e-4) and got["after"] == pytest.approx(after, rel=1e-4)
            assert got["score"] == pytest.approx(before / after - 1, rel=1e-3, abs=1e-5)
            if abs(before / after - 1 - 0.01) > 1e-3:
                assert got["kept"] == (before / after - 1 >= 0.01)


# --------------------------------------------------------------------------------------------------
# DCM: the paper's loss with an absolute lambda, and its training schedule
# --------------------------------------------------------------------------------------------------


def test_dcm_loss_at_an_explicit_mask_with_absolute_lambda(tiny_llama, smollm2_tokenizer):
    import torch

    from mechdiff.methods.dcm import DCMConfig, PairCache, _Mask, _step, loss_scale
    from mechdiff.tasks.entity_tracking import object_value_pairs, pair_batch_tensors

    model, pairs = tiny_llama, object_value_pairs(smollm2_tokenizer, 6, n_boxes=3, seed=0)
    heads, m = [Head(0, 1), Head(1, 2), Head(2, 0)], torch.tensor([0.25, 1.0, 0.6])
    config = DCMConfig.paper(micro_batch=4)  # two micro-batches (4 + 2) accumulate one step
    cache = PairCache.build(model, pairs, [(heads, "last")], 6)
    rows = list(range(6))
    assert loss_scale(model, heads, "last", cache, rows, config) == 1.0  # absolute: lambda as given
    mask = _Mask(len(heads), config, model.device)
    mask.param.data = m.clone()
    got = _step(model, heads, "last", cache, rows, mask, torch.optim.Adam([mask.param], lr=0.0), config)

    # direct: plain HF forwards; the o_proj input of each head at "last" mixed m * base + (1 - m) * source
    batch = pair_batch_tensors(pairs)
    d = model.shape.d_head
    layers = model.model.model.layers
    source: dict = {}
    hooks = [layers[h.layer].self_attn.o_proj.register_forward_pre_hook(
        lambda mod, args, layer=h.layer: source.__setitem__(layer, args[0].detach().clone())) for h in heads]
    with torch.no_grad():
        model.model(input_ids=batch["source"]["input_ids"], use_cache=False)
    for hook in hooks:
        hook.remove()
    rows_t = torch.arange(len(pairs))
    pb, ps = batch["base"]["positions"]["last"], batch["source"]["positions"]["last"]

    def mix(layer):
        def pre(mod, args):
            x = args[0].clone()
            for h, value in zip(heads, m.tolist()):
                if h.layer == layer:
                    cols = slice(h.head * d, (h.head + 1) * d)
                    x[rows_t, pb, cols] = value * x[rows_t, pb, cols] + (1 - value) * source[layer][rows_t, ps, cols]
            return (x,)
        return pre

    hooks = [layers[l].self_attn.o_proj.register_forward_pre_hook(mix(l)) for l in {h.layer for h in heads}]
    with torch.no_grad():
        logits = model.model(input_ids=batch["base"]["input_ids"], use_cache=False).logits
    for hook in hooks:
        hook.remove()
    target_logit = logits[rows_t, pb, batch["target_ids"]]
    # sum(1 - m) = 0.75 + 0 + 0.4 = 1.15; lambda = 0.01 absolute: the sparsity term is 0.0115
    expected = -float(target_logit.mean()) + 0.01 * 1.15
    assert got == pytest.approx(expected, rel=1e-4, abs=1e-4 * float(target_logit.abs().mean()))
    # mechdiff's default scales lambda by the unpatched mean |logit(target)|, so the same mask costs more
    scaled = DCMConfig(micro_batch=4)
    factor = loss_scale(model, heads, "last", cache, rows, scaled)
    assert factor != 1.0
    mask.param.data = m.clone()
    got_scaled = _step(model, heads, "last", cache, rows, mask, torch.optim.Adam([mask.param], lr=0.0), scaled, factor)
    assert got_scaled - got == pytest.approx(0.01 * 1.15 * (factor - 1), rel=1e-3, abs=1e-5)


def test_dcm_paper_preset_and_validation_schedule(tiny_llama, smollm2_tokenizer):
    from mechdiff.methods.dcm import DCMConfig, PairCache, train_mask, validates
    from mechdiff.tasks.entity_tracking import object_value_pairs

    paper = DCMConfig.paper()
    assert (paper.lam, paper.lam_scale, paper.lr, paper.epochs, paper.batch_size, paper.split, paper.shuffle) == \
        (0.01, "absolute", 0.1, 2, 32, (0.5, 0.25, 0.25), False)
    # the paper validates after batches 0, 4, 8, ... of each epoch; mechdiff every eval_every steps and the last
    assert [b for b in range(10) if validates(paper, 1, b, 20)] == [0, 4, 8]
    mine = DCMConfig(eval_every=4)
    assert [s for s in range(1, 11) if validates(mine, s, 0, 10)] == [4, 8, 10]
    pairs = object_value_pairs(smollm2_tokenizer, 12, n_boxes=3, seed=0)
    heads = [Head(2, 1), Head(1, 0)]
    cache = PairCache.build(tiny_llama, pairs, [(heads, "last")], 12)
    config = DCMConfig.paper(batch_size=1)  # 10 training pairs: 10 batches per epoch
    _, _, history = train_mask(tiny_llama, heads, "last", cache, list(range(10)), [10, 11], config, progress=False)
    assert [h["step"] for h in history] == [1, 5, 9, 11, 15, 19]
    _, _, history = train_mask(tiny_llama, heads, "last", cache, list(range(10)), [10, 11],
                               DCMConfig(batch_size=1, eval_every=4, epochs=2), progress=False)
    assert [h["step"] for h in history] == [0, 4, 8, 12, 16, 20]


def test_dcm_command_preset_paper():
    from mechdiff.cli import build_parser
    from mechdiff.commands.dcm import config_from_args
    from mechdiff.methods.dcm import DCMConfig

    args = build_parser().parse_args(["dcm", "--circuit", "c.json", "--preset", "paper", "--micro-batch", "8"])
    assert config_from_args(args) == DCMConfig.paper(micro_batch=8, eval_batch=32, n_random=5, random_pool="all",
                                                     seed=0)
    args = build_parser().parse_args(["dcm", "--circuit", "c.json", "--preset", "paper", "--epochs", "3"])
    with pytest.raises(SystemExit, match="--epochs"):
        config_from_args(args)


# --------------------------------------------------------------------------------------------------
# CMAP: rule "paper" (K/V strictly before the position, every position but the last reset to the base)
# --------------------------------------------------------------------------------------------------


def _paper_cmap_by_hand(base, donor, heads, kind, ids, last):
    """Last-position logits of the base with the donor's Q/K/V (``kind``) of ``heads`` (a group at the last
    position) patched as the paper: plain HF forwards with hooks. K/V at positions strictly before ``last``, Q at
    it; from the first patched layer on, every head's o_proj input at every position but the last is the base's
    clean one, and at the last the KV-group partners of patched K/V heads are the base's too (GQA)."""
    import torch

    d, group = base.shape.d_head, base.shape.group_size
    rows = torch.arange(ids.shape[0])
    layers_of = lambda lm: lm.model.model.layers  # noqa: E731
    captured: dict = {}

    def grab(store, key, pre=False):
        def hook(mod, args, out=None):
            store[key] = (args[0] if pre else out).detach().clone()
        return hook

    handles = []
    for l in {h.layer for h in heads}:
        for site in ("q", "k", "v"):
            handles.append(getattr(layers_of(donor)[l].self_attn, f"{site}_proj").register_forward_hook(
                grab(captured, (site, l))))
    with torch.no_grad():
        donor.model(input_ids=ids, use_cache=False)
    clean: dict = {}
    for l in range(base.shape.n_layers):
        handles.append(layers_of(base)[l].self_attn.o_proj.register_forward_pre_hook(grab(clean, l, pre=True)))
    with torch.no_grad():
        base.model(input_ids=ids, use_cache=False)
    for h in handles:
        h.remove()
    before = torch.arange(ids.shape[1])[None, :] < last[:, None]  # strictly before the group's position

    def patch_site(site, l):
        def hook(mod, args, out):
            out = out.clone()
            for h in (h for h in heads if h.layer == l):
                cols = slice(h.head * d, (h.head + 1) * d) if site == "q" else \
                    slice(h.head // group * d, (h.head // group + 1) * d)
                if site == "q":
                    out[rows, last, cols] = captured[(site, l)][rows, last, cols]
                else:
                    out[:, :, cols] = torch.where(before[..., None], captured[(site, l)][:, :, cols], out[:, :, cols])
            return out
        return hook

    first = min(h.layer for h in heads)

    def isolate(l):
        def pre(mod, args):
            x = args[0].clone()
            keep = torch.zeros(ids.shape, dtype=torch.bool)
            keep[rows, last] = True
            x[~keep] = clean[l][~keep]
            if set(kind) & {"k", "v"}:
                ours = {h.head for h in heads if h.layer == l}
                for partner in range(base.shape.n_heads):
                    if partner not in ours and any(partner // group == o // group for o in ours):
                        x[rows, last, partner * d:(partner + 1) * d] = clean[l][rows, last, partner * d:(partner + 1) * d]
            return (x,)
        return pre

    handles = [getattr(layers_of(base)[l].self_attn, f"{site}_proj").register_forward_hook(patch_site(site, l))
               for site in set(kind) for l in {h.layer for h in heads}]
    handles += [layers_of(base)[l].self_attn.o_proj.register_forward_pre_hook(isolate(l))
                for l in range(first, base.shape.n_layers)]
    with torch.no_grad():
        logits = base.model(input_ids=ids, use_cache=False).logits[rows, last]
    for h in handles:
        h.remove()
    return logits


@pytest.mark.parametrize("kind", ["q", "k", "v", "qkv"])
def test_paper_cmap_patches_and_restores_the_paper_sites(tiny_llama, smollm2_tokenizer, kind):
    import torch

    from conftest import make_tiny
    from mechdiff.methods.cmap import cmap_patches, paper_isolation_patches
    from mechdiff.patching.core import run
    from mechdiff.tasks.entity_tracking import batch_tensors

    donor = make_tiny("llama", seed=5)
    batch = batch_tensors(generate(smollm2_tokenizer, 6, n_boxes=3, seed=0))
    ids, positions = batch["input_ids"], batch["positions"]
    heads = [Head(1, 3), Head(2, 0)]  # KV partners: L1H2, L2H1
    scope = [(h, "last") for h in heads]
    shape = tiny_llama.shape
    sites = [(k, l) for l in range(shape.n_layers) for k in ("q", "k", "v", "z")]
    cap = run(donor, ids, capture=sites).captured
    base_z = {l: t for (k, l), t in run(tiny_llama, ids, capture=sites).captured.items() if k == "z"}
    isolation = paper_isolation_patches(tiny_llama, scope, kind, base_z, positions, ids.shape[1])
    got = run(tiny_llama, ids, cmap_patches(tiny_llama, scope, kind, cap, positions, ids.shape[1], strict=True)
              + isolation).logits  # the read-out: the last position
    want = _paper_cmap_by_hand(tiny_llama, donor, heads, kind, ids, positions["last"])
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))
    if set(kind) & {"k", "v"}:  # K/V also at the group's own position (mechdiff's base rule) is another run
        loose = run(tiny_llama, ids, cmap_patches(tiny_llama, scope, kind, cap, positions, ids.shape[1])
                    + isolation).logits
        assert not torch.allclose(loose, got, atol=1e-4)


def test_paper_cmap_runs_qkv_only_for_last_token_groups(tiny_llama, smollm2_tokenizer):
    import torch

    from conftest import make_tiny
    from mechdiff.methods.cmap import CMAP_KINDS, run_cmap
    from mechdiff.common.metrics import answer_prob
    from mechdiff.tasks.entity_tracking import batch_tensors

    donor = make_tiny("llama", seed=5)
    records = generate(smollm2_tokenizer, 6, n_boxes=3, seed=0)
    circuit = Circuit("tiny", "et", {"A": [Head(1, 3), Head(2, 0)], "C": [Head(1, 1)]},
                      {"A": "last", "C": "query_label"})
    res = run_cmap(tiny_llama, donor, circuit, records, CMAP_KINDS, batch_size=6, progress=False, rule="paper")
    kinds = {(r.scope, r.kind) for r in res.rows}
    assert kinds == {("A", k) for k in CMAP_KINDS} | {("C", "z"), ("circuit", "z")}
    assert res.settings["rule"] == "paper" and "strictly before" in res.caption
    batch = batch_tensors(records)
    for kind in ("k", "v"):
        logits = _paper_cmap_by_hand(tiny_llama, donor, circuit.groups["A"], kind, batch["input_ids"],
                                     batch["positions"]["last"])
        want = float(answer_prob(logits, batch["answer_ids"]).mean())
        row = next(r for r in res.rows if (r.scope, r.kind) == ("A", kind))
        assert row.answer_prob.value == pytest.approx(want, rel=1e-4)
    with pytest.raises(ValueError, match="isolate"):
        run_cmap(tiny_llama, donor, circuit, records, ["z"], rule="paper", isolate=False, progress=False)


# --------------------------------------------------------------------------------------------------
# The paper's study as a task file
# --------------------------------------------------------------------------------------------------

ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["entity_tracking_llama7b.toml", "entity_tracking_paper_form.toml"])
def test_task_file_resolves_to_the_paper_rules(name):
    from mechdiff.tasks.plan import default_plan
    from mechdiff.methods.dcm import PAPER_DCM
    from mechdiff.studies.circuits import dcm_config
    from mechdiff.studies.spec import load_spec

    spec = load_spec(ROOT / "tasks" / name)
    steps = [s.name for s in default_plan().steps]
    d, s, c, m = spec.discovery, spec.scoring, spec.dcm, spec.cmap
    # discovery: path patching of A-D with the paper's k (experiment_1/minimality.py: 58/10/25/5)
    # (on SmolLM2: scaled by 270 / 1024 heads and rounded up)
    k = {"A": 58, "B": 10, "C": 25, "D": 5}
    if "llama7b" not in name:
        k = {g: math.ceil(v * 270 / 1024) for g, v in k.items()}
    assert d.method == "path" and d.n == 100 and d.top_k == k
    assert list(d.top_k) == steps
    # pruning: the paper's pairwise rule on accuracy over 100 prompts
    assert (s.prune, s.prune_rule, s.prune_metric, s.prune_n, s.prune_threshold, s.prune_share) == \
        (True, "paper", "accuracy", 100, 0.01, 0.3)
    # DCM: the paper's training on the pruned groups A-D, 2000 pairs split 50/25/25
    assert c.circuit == "pruned" and c.groups == steps
    assert (c.n_train, c.n_val, c.n_test) == (1000, 500, 500)
    config = dcm_config(spec)
    for key, value in PAPER_DCM.items():
        assert getattr(config, key) == (pytest.approx(value) if key == "split" else value), key
    # CMAP: each fine-tune's pruned circuit cut to its DCM selections, the paper's patch sites
    assert m.scope == "paper" and m.groups == steps and m.isolate
    assert m.selection == {"A": "object_value", "B": "positional", "C": "positional"}
    assert set(m.selection.values()) <= set(c.desiderata) and set(m.parts) >= {"z", "q", "k", "v"}
    if "llama7b" in name:  # only = true runs the reproduction table; only = false the stages above
        assert spec.reproduce.only and spec.reproduce.circuit
    else:  # the same study on the embedded family, every stage
        assert (spec.models.base, spec.models.finetunes) == ("smollm2-et-early", ["smollm2-et"])
        assert not spec.reproduce.circuit


def test_task_file_paper_stages_need_pruning(tmp_path):
    from mechdiff.studies.spec import SpecError, load_spec

    text = (ROOT / "tasks" / "entity_tracking_llama7b.toml").read_text()
    bad = tmp_path / "bad.toml"
    bad.write_text(text.replace("[scoring]\n", "[scoring]\nprune = false\n"))
    with pytest.raises(SpecError, match="prune = true"):
        load_spec(bad)
    bad.write_text(text.replace('desiderata = ["positional", "object_value", "label_value"]',
                                'desiderata = ["label_value"]'))
    with pytest.raises(SpecError, match="selection names desiderata"):
        load_spec(bad)


def test_dcm_cut_keeps_each_groups_selected_heads():
    from mechdiff.methods.cmap import dcm_cut

    circuit = Circuit("ft", "et", {"A": [Head(2, 0), Head(1, 0)], "B": [Head(1, 1)], "D": [Head(0, 2), Head(0, 3)]},
                      {"A": "last", "B": "last", "D": "query_label_context"})
    dcm = [{"group": "A", "desideratum": "object_value", "selected": ["L1H0"]},
           {"group": "A", "desideratum": "positional", "selected": ["L2H0"]},
           {"group": "B", "desideratum": "positional", "selected": []}]
    cut = dcm_cut(circuit, dcm, {"A": "object", "B": "positional"})  # aliases: object == object_value
    assert cut.groups == {"A": [Head(1, 0)], "B": [], "D": [Head(0, 2), Head(0, 3)]}
    with pytest.raises(ValueError, match="no DCM result"):
        dcm_cut(circuit, dcm, {"D": "positional"})


def test_cli_cmap_and_prune_with_the_paper_rules(tmp_path, smollm2_tokenizer):
    import json

    from conftest import make_tiny
    from mechdiff.cli import main as cli_main

    for seed, d in ((0, "base"), (5, "ft")):
        m = make_tiny("llama", smollm2_tokenizer, seed=seed)
        m.model.save_pretrained(tmp_path / d)
        smollm2_tokenizer.save_pretrained(tmp_path / d)
    circuit = Circuit("tiny", "entity-tracking", {"A": [Head(2, 0), Head(1, 2)], "C": [Head(1, 1)]},
                      {"A": "last", "C": "query_label"}).save(tmp_path / "circuit.json")
    out = tmp_path / "cmap"
    assert cli_main(["cmap", "--base", str(tmp_path / "base"), "--finetune", str(tmp_path / "ft"),
                     "--circuit", str(circuit), "--n", "6", "--n-boxes", "3", "--batch-size", "3",
                     "--kinds", "z,k", "--rule", "paper", "--out", str(out)]) in (0, None)
    data = json.loads((out / "cmap.json").read_text())
    assert {(r["scope"], r["kind"]) for r in data["rows"]} == {("A", "z"), ("A", "k"), ("C", "z"), ("circuit", "z")}
    assert (out / "cmap.png").is_file() and data["settings"]["rule"] == "paper"
    pruned = tmp_path / "pruned.json"
    assert cli_main(["prune", "--model", str(tmp_path / "base"), "--circuit", str(circuit), "--out", str(pruned),
                     "--rule", "paper", "--metric", "prob", "--n", "6", "--n-boxes", "3"]) in (0, None)
    meta = json.loads(pruned.read_text())["meta"]["pruned"]
    assert meta["rule"] == "paper" and meta["share"] == 0.3 and meta["metric"] == "prob"
    table = (tmp_path / "pruned.minimality.md").read_text()
    assert "F(C\\K)" in table and "score" in table
