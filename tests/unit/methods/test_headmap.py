"""HeadMap: masking, batched layer-conditioned locating, the HeadMap module and its training (tiny models),
and the multiple-choice task (real tokenizer)."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny
from tolerances import assert_close32

from mechdiff.common.components import Head
from mechdiff.methods.finetune import last_logits
from mechdiff.methods.headmap import (
    HeadMap,
    TrainConfig,
    example_losses,
    heads_by_layer,
    layer_losses,
    locate,
    lora_params,
    random_heads,
    select_samples,
    train,
)
from mechdiff.tasks import multiple_choice as mc


def _batch(model, n=12, length=10, seed=0):
    """Random prompts whose answers are the model's own predictions (so the losses are low-ish)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, model.shape.vocab_size, (n, length), generator=g)
    with torch.no_grad():
        answers = last_logits(model.model, ids).argmax(-1)
    return {"input_ids": ids, "answer_ids": answers}


def _plain_losses(model, batch):
    with torch.no_grad():
        logits = last_logits(model.model, batch["input_ids"])
    return torch.nn.functional.cross_entropy(logits, batch["answer_ids"], reduction="none")


def test_masking_no_heads_leaves_loss_unchanged(tiny_llama):
    batch = _batch(tiny_llama)
    plain = _plain_losses(tiny_llama, batch)
    # losses of ~ln(vocab) = 10.8: rounding scales with them (the tiny model's logits are far smaller)
    assert_close32(example_losses(tiny_llama, batch, masked=()), plain)
    # the "nothing more" variant of a layer pass is the same loss
    means, _ = layer_losses(tiny_llama, batch, 0, fixed=())
    assert_close32(means[-1], plain.mean())
    # masking a head does change it
    assert not torch.allclose(example_losses(tiny_llama, batch, masked=[Head(1, 0)]), plain)


def test_zero_mask_equals_zeroed_o_proj_columns(tiny_llama):
    """Masking head h zeroes exactly its slice of the o_proj input: same as zeroing its o_proj weight columns."""
    batch = _batch(tiny_llama)
    masked = example_losses(tiny_llama, batch, masked=[Head(2, 1), Head(0, 3)])
    d = tiny_llama.shape.d_head
    with torch.no_grad():
        for layer, head in ((2, 1), (0, 3)):
            tiny_llama.model.model.layers[layer].self_attn.o_proj.weight[:, head * d : (head + 1) * d] = 0
    torch.testing.assert_close(masked, _plain_losses(tiny_llama, batch), rtol=0, atol=1e-5)


@pytest.mark.parametrize("batch_size", [5, 64])
def test_batched_locating_equals_per_head_loop(tiny_llama, batch_size):
    samples = _batch(tiny_llama, n=6)
    res = locate(tiny_llama, samples, k=2, batch_size=batch_size, progress=False)
    selected: list[Head] = []
    for layer in range(tiny_llama.shape.n_layers):
        losses = {}
        for h in range(tiny_llama.shape.n_heads):
            losses[h] = float(example_losses(tiny_llama, samples, masked=selected + [Head(layer, h)]).mean())
            assert res.candidate_loss[Head(layer, h)] == pytest.approx(losses[h], abs=1e-5)
        assert res.curve[layer] == pytest.approx(float(example_losses(tiny_llama, samples, selected).mean()), abs=1e-5)
        selected += sorted(Head(layer, h) for h in sorted(losses, key=lambda h: -losses[h])[:2])
    assert res.heads == selected
    assert res.curve[-1] == pytest.approx(float(example_losses(tiny_llama, samples, selected).mean()), abs=1e-5)
    L, H, n = tiny_llama.shape.n_layers, tiny_llama.shape.n_heads, 6
    # per layer: the variants, and (after layer 0) one block-wise pass carrying the entry residual forward
    assert res.forward_passes == L * -(-(H + 1) * n // batch_size) + L * -(-n // batch_size)


def test_locating_a_subset_of_layers_resumes_exactly(tiny_llama):
    """Skipped layers carry no selection; the entry residual of a later layer still has the earlier ones zeroed."""
    samples = _batch(tiny_llama, n=5)
    last = tiny_llama.shape.n_layers - 1
    res = locate(tiny_llama, samples, k=1, batch_size=4, layers=[last, 0], progress=False)
    assert [h.layer for h in res.heads] == [0, last]
    first = res.heads[0]
    for h in range(tiny_llama.shape.n_heads):
        want = float(example_losses(tiny_llama, samples, masked=[first, Head(last, h)]).mean())
        assert res.candidate_loss[Head(last, h)] == pytest.approx(want, abs=1e-5)


def test_locating_finds_a_planted_head(smollm2_tokenizer):
    model = make_tiny("llama", smollm2_tokenizer, seed=3)
    d, planted = model.shape.d_head, Head(1, 2)
    with torch.no_grad():  # head L1H2 writes 30x louder than the rest and the read-out is sharp:
        model.model.model.layers[1].self_attn.o_proj.weight[:, 2 * d : 3 * d] *= 30.0  # the answers depend on it
        model.model.lm_head.weight *= 100.0
    samples = _batch(model, n=8)
    res = locate(model, samples, k=1, progress=False)
    assert planted in res.heads
    layer1 = {h: v for h, v in res.candidate_loss.items() if h.layer == 1}
    assert max(layer1, key=layer1.get) == planted
    assert layer1[planted] > res.curve[1] + 1.0  # masking it raises the loss a lot


def test_select_samples_keeps_lowest_losses(tiny_llama):
    pool = _batch(tiny_llama, n=10)
    pool["answer_ids"][::2] = 7  # half the answers are arbitrary: high loss
    samples, losses = select_samples(tiny_llama, pool, 4)
    kept = example_losses(tiny_llama, samples)
    assert len(kept) == 4 and kept.max() <= torch.sort(losses).values[3] + 1e-6


def test_headmap_at_init_leaves_logits_unchanged_and_only_maps_train(tiny_llama):
    ids = _batch(tiny_llama)["input_ids"]
    with torch.no_grad():
        before = tiny_llama.model(input_ids=ids).logits
    heads = {0: [1, 3], 2: [0]}
    s = tiny_llama.shape
    hm = HeadMap(heads, s.d_head, s.d_model, rank=3).attach(tiny_llama)
    with torch.no_grad():
        after = tiny_llama.model(input_ids=ids).logits
    assert torch.equal(before, after)
    assert hm.n_params() == HeadMap.n_params_for(heads, s.d_head, s.d_model, 3) == 3 * (2 * 8 + 32) + 3 * (8 + 32)
    assert not any(p.requires_grad for p in tiny_llama.model.parameters())
    assert all(p.requires_grad for p in hm.parameters())
    hm.detach()


def test_headmap_training_lowers_the_loss_on_a_fixed_batch(tiny_llama):
    batch = _batch(tiny_llama, n=8)
    batch["answer_ids"] = torch.arange(8) + 100  # targets the random model does not predict
    s = tiny_llama.shape
    hm = HeadMap({1: [0, 2], 2: [3]}, s.d_head, s.d_model, rank=4, seed=0).attach(tiny_llama)
    opt = torch.optim.AdamW(hm.parameters(), lr=5e-2)
    losses = []
    for _ in range(15):
        loss = torch.nn.functional.cross_entropy(last_logits(tiny_llama.model, batch["input_ids"]), batch["answer_ids"])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    hm.detach()
    assert losses[-1] < losses[0] - 0.3
    with torch.no_grad():  # detached: the model is the plain model again
        torch.testing.assert_close(
            _plain_losses(tiny_llama, batch),
            torch.nn.functional.cross_entropy(
                last_logits(tiny_llama.model, batch["input_ids"]), batch["answer_ids"], reduction="none"
            ),
        )


def test_headmap_maps_train_in_float32_in_a_bfloat16_model(smollm2_tokenizer):
    """In a bfloat16 model the maps keep float32 weights (cast at use), so AdamW's first step moves every weight
    with a gradient by the learning rate (``lr * g / (|g| + 1e-8)``, within 1e-3 of it for ``|g| > 1e-5``). A
    bfloat16 weight of size 0.05 has a spacing of 2^-12 = 2.4e-4: a step of lr = 1e-4 would round away. The
    model's logits stay bfloat16."""
    lm = make_tiny("llama", smollm2_tokenizer)
    lm.model.to(torch.bfloat16)
    s = lm.shape
    hm = HeadMap({1: [0, 2]}, s.d_head, s.d_model, rank=4, seed=0).attach(lm)
    with torch.no_grad():
        for p in hm.parameters():
            p.fill_(0.05)
    before = [p.detach().clone() for p in hm.parameters()]
    opt, lr = torch.optim.AdamW(hm.parameters(), lr=1e-4, weight_decay=0.0), 1e-4
    batch = _batch(lm, n=4)
    logits = last_logits(lm.model, batch["input_ids"])
    torch.nn.functional.cross_entropy(logits, batch["answer_ids"] + 1).backward()
    grads = [p.grad.detach().clone() for p in hm.parameters()]
    opt.step()
    hm.detach()
    assert all(p.dtype == torch.float32 for p in hm.parameters())
    assert lm.model(input_ids=batch["input_ids"][:1]).logits.dtype == torch.bfloat16
    for p, p0, g in zip(hm.parameters(), before, grads):
        moved = g.abs() > 1e-5
        assert moved.sum() > 0.5 * g.numel()
        step = (p.detach() - p0)[moved]
        torch.testing.assert_close(step, -lr * g[moved].sign(), rtol=0, atol=lr * 1e-3)


def test_train_counts_parameters_and_leaves_the_base_untouched(tiny_llama):
    s = tiny_llama.shape
    heads = {0: [1], 2: [0, 3]}
    before = [p.clone() for p in tiny_llama.model.parameters()]
    cfg = TrainConfig(task="entity-tracking", steps=2, batch_size=2, rank=2, lr=1e-2)
    hm = train(tiny_llama, cfg, heads, progress=False)
    assert hm["trainable"] == HeadMap.n_params_for(heads, s.d_head, s.d_model, 2) == hm["headmap_params"]
    lora = train(tiny_llama, TrainConfig(steps=1, batch_size=2, lora_rank=2), None, progress=False)
    assert lora["trainable"] == lora_params(s, 2)
    both = train(tiny_llama, TrainConfig(steps=1, batch_size=2, rank=2, lora_rank=2), heads, progress=False)
    assert both["trainable"] == lora_params(s, 2) + hm["trainable"]
    assert all(torch.equal(a, b) for a, b in zip(before, tiny_llama.model.parameters()))


def test_random_heads_respect_exclusion():
    class S:
        n_heads = 4

    located = [Head(0, 0), Head(0, 1), Head(1, 3)]
    out = random_heads(S, {0: 2, 1: 2}, seed=0, exclude=located)
    assert out[0] == [2, 3] and 3 not in out[1] and len(out[1]) == 2
    assert heads_by_layer(located) == {0: [0, 1], 1: [3]}
    with pytest.raises(ValueError, match="outside the excluded set"):
        random_heads(S, {0: 3}, exclude=located)


def test_multiple_choice_task(smollm2_tokenizer):
    records = mc.generate(smollm2_tokenizer, 40, seed=0, split="train")
    assert len({len(r.input_ids) for r in records}) == 1
    assert [r.correct for r in records[:8]] == [0, 1, 2, 3, 0, 1, 2, 3]
    for r in records:
        assert r.prompt.endswith("Answer:") and r.answer == " " + mc.LETTERS[r.correct]
        line = r.prompt.splitlines()[1 + r.correct]
        a, op, b = _parse(r.prompt.splitlines()[0])
        assert line == f"{mc.LETTERS[r.correct]}. {a + b if op == '+' else a - b}"
        assert len(set(r.choices)) == 4 and all(10 <= c <= 99 for c in r.choices)
        assert smollm2_tokenizer.decode([r.answer_id]) == r.answer
    train_names, _ = mc.vocabulary(smollm2_tokenizer, "train")
    eval_names, _ = mc.vocabulary(smollm2_tokenizer, "eval")
    assert not set(train_names) & set(eval_names)
    assert mc.batch_tensors(records)["input_ids"].shape[0] == 40


def _parse(sentence: str) -> tuple[int, str, int]:
    words = sentence.split()
    a = int(words[2])
    if "gets" in words:
        return a, "+", int(words[words.index("gets") + 1])
    return a, "-", int(words[words.index("away") + 1].rstrip("."))


# --------------------------------------------------------------------------------------
# The study's new logic: 64-sample locating, the learning-rate choice, seed aggregation
# --------------------------------------------------------------------------------------


def test_locating_uses_the_64_lowest_loss_samples_of_the_pool(tiny_llama):
    """locate_task on a pool of 256: the samples are the 64 lowest-loss prompts (losses computed here with a
    plain forward pass, not the patching path), so the located run's unmasked loss is their mean."""
    from mechdiff.methods.headmap import LocateConfig, get_task, locate_task

    cfg = LocateConfig(n=64, pool=256, k=1, batch_size=128, seed=3)
    res = locate_task(tiny_llama, "entity-tracking", cfg, progress=False)
    pool = get_task("entity-tracking").pool_batch(tiny_llama.tokenizer, 256, 3)
    losses = _plain_losses(tiny_llama, pool)
    lowest = torch.sort(losses).values[:64]
    assert res.settings["n_samples"] == 64 and res.settings["pool"] == 256
    assert res.base_loss == pytest.approx(float(lowest.mean()), rel=1e-4)
    assert res.pool_loss == pytest.approx(float(losses.mean()), rel=1e-4)
    assert res.base_loss < float(torch.sort(losses).values[64:].mean())  # the rest of the pool is harder
    assert res.rows == 3 * (4 + 1) * 64 + 64  # layers x (heads + 1) x n, plus the final all-masked pass


def test_choose_lr_takes_the_best_validation_accuracy_and_the_smaller_rate_on_ties():
    from mechdiff.methods.headmap import choose_lr

    assert choose_lr({1e-3: 0.5, 3e-3: 0.7, 1e-2: 0.6}) == 3e-3
    assert choose_lr({1e-2: 0.7, 1e-3: 0.7, 3e-3: 0.2}) == 1e-3
    with pytest.raises(ValueError, match="no learning rates"):
        choose_lr({})


def test_validation_prompts_hold_training_objects_and_none_of_the_eval_prompts(smollm2_tokenizer):
    from mechdiff.methods.headmap import get_task, validation_batch
    from mechdiff.tasks.entity_tracking.splits import eval_objects, train_objects

    val = validation_batch("entity-tracking", smollm2_tokenizer, 40, 2_000_000)
    ev = get_task("entity-tracking").eval_batch(smollm2_tokenizer, 40, 1_000_000)
    token = lambda words: {smollm2_tokenizer.encode(" " + w)[0] for w in words}  # noqa: E731
    assert set(val["answer_ids"].tolist()) <= token(train_objects())
    assert not set(val["answer_ids"].tolist()) & token(eval_objects())
    assert not {tuple(r) for r in val["input_ids"].tolist()} & {tuple(r) for r in ev["input_ids"].tolist()}


def test_the_study_chooses_each_rate_on_validation_prompts_only(tiny_llama, tmp_path, monkeypatch):
    """A fake trainer whose validation outcomes favour one rate and held-out outcomes another: each method
    trains its seeds at the rate the validation prompts favour, HeadMap and LoRA each by their own sweep."""
    import numpy as np

    import mechdiff.studies.headmap.study as study_mod
    from mechdiff.studies.headmap.settings import TASK, VAL, HeadMapSettings

    best_val = {0: 3e-3, 4: 1e-2}  # lora rank -> the rate its validation outcomes favour
    calls = []

    def fake_train(model, cfg, heads, ev, progress=True):
        lr = cfg.lr if cfg.lora_rank else cfg.headmap_lr
        calls.append((cfg.lora_rank, lr, cfg.seed))
        val = [1.0 if lr == best_val[cfg.lora_rank] else 0.0] * len(ev[VAL]["answer_ids"])
        held_out = [1.0 if lr == 1e-3 else 0.0] * len(ev[TASK]["answer_ids"])  # favours another rate
        return {
            "config": {"lr": cfg.lr, "headmap_lr": cfg.headmap_lr, "lora_rank": cfg.lora_rank},
            "heads": {str(k): v for k, v in (heads or {}).items()},
            "trainable": 1,
            "headmap_params": 0,
            "losses": [1.0],
            "train_seconds": 0.0,
            "correct": {TASK: held_out, VAL: val},
        }

    monkeypatch.setattr(study_mod, "train", fake_train)
    settings = HeadMapSettings(
        model="tiny",
        path_patching=(),
        n=4,
        pool=8,
        k=1,
        batch_size=16,
        eval_n=6,
        val_n=5,
        lora_small=4,
        seeds=(0, 1),
        lrs=(1e-3, 3e-3, 1e-2),
        runs=("located", "random", "lora-small"),
    )
    study = study_mod.HeadMapStudy(settings, tmp_path, lambda name: tiny_llama, progress=False)
    results = study.results(study.prompts())
    assert study.chosen_lrs({}) == (1e-2, 3e-3)  # (LoRA, HeadMap)
    # the sweep: every rate, seed 0, each method once; then seed 1 at the chosen rates (seed 0 reused)
    assert sorted(calls) == sorted(
        [(0, lr, 0) for lr in settings.lrs]
        + [(4, lr, 0) for lr in settings.lrs]
        + [(0, 3e-3, 1), (0, 3e-3, 0), (0, 3e-3, 1), (4, 1e-2, 1)]
    )
    assert [r["config"]["headmap_lr"] for r in results["located"] + results["random"]] == [3e-3] * 4
    assert [r["config"]["lr"] for r in results["lora-small"]] == [1e-2] * 2
    from mechdiff.studies.headmap.tables import sweep_rows

    rows = sweep_rows(study.sweep({}), study.names(), study.chosen_lrs({}))
    chosen = {r["method"]: r["lr"] for r in rows if r["chosen"]}
    assert chosen == {"HeadMap (located)": 3e-3, "LoRA r=4 (q,k,v,o)": 1e-2}
    assert all(r["val_accuracy"] == (1.0 if r["chosen"] else 0.0) for r in rows)
    assert np.mean(results["located"][0]["correct"][TASK]) == 0.0  # the held-out outcomes were not used
