"""LoRA fine-tuning (mechdiff.methods.finetune), the arithmetic task, the object split and the zoo."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from conftest import tiny_cfg

from mechdiff.methods.finetune import (
    FinetuneConfig,
    add_lora,
    answer_loss,
    finetune,
    last_logits,
    save_adapter,
    training_batch,
)
from mechdiff.models.loading import load_model
from mechdiff.tasks import arithmetic
from mechdiff.tasks.entity_tracking import generate, load_vocabulary, vocabulary_report
from mechdiff.tasks.entity_tracking.splits import eval_objects, split_objects, train_objects

ZOO_RESULTS = Path(__file__).resolve().parents[3] / "results" / "zoo" / "eval-500.json"


def save_base(lm, tmp_path: Path) -> Path:
    """Write a tiny model and its tokenizer to disk so that adapters can name it as their base."""
    base_dir = tmp_path / "base"
    lm.model.save_pretrained(base_dir)
    lm.tokenizer.save_pretrained(base_dir)
    return base_dir


def probe_ids(tokenizer) -> torch.Tensor:
    return torch.tensor([e.input_ids for e in generate(tokenizer, n=6, n_boxes=3, seed=5)])


def perturb_lora_b(peft_model, seed: int = 1) -> None:
    """LoRA B starts at zero (a no-op adapter); give it random values so merges are visible."""
    g = torch.Generator().manual_seed(seed)
    for name, p in peft_model.named_parameters():
        if "lora_B" in name:
            p.data = torch.randn(p.shape, generator=g) * 0.5


def test_merged_adapter_matches_unmerged_peft_model(tiny_llama, tmp_path):
    peft_model = add_lora(tiny_llama.model, tiny_cfg(tmp_path))
    perturb_lora_b(peft_model)
    ids = probe_ids(tiny_llama.tokenizer)
    with torch.no_grad():
        unmerged = last_logits(peft_model, ids)
        merged = last_logits(copy.deepcopy(peft_model).merge_and_unload(), ids)
    assert (unmerged - merged).abs().max() < 1e-5
    with peft_model.disable_adapter(), torch.no_grad():
        assert (last_logits(peft_model, ids) - unmerged).abs().max() > 1e-2  # the adapter does something


def test_fp16_adapter_round_trip_through_load_model(tiny_llama, tmp_path):
    """save_adapter writes float16 weights; load_model merges them into fp32 and matches the rounded adapter."""
    from safetensors.torch import load_file

    save_base(tiny_llama, tmp_path)
    cfg = tiny_cfg(tmp_path)
    peft_model = add_lora(tiny_llama.model, cfg)
    perturb_lora_b(peft_model)
    out = save_adapter(peft_model, tmp_path / "adapter", cfg.base, {"name": "adapter"})
    weights = load_file(str(out / "adapter_model.safetensors"))
    assert weights and all(w.dtype == torch.float16 for w in weights.values())
    assert json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"] == cfg.base
    for name, p in peft_model.named_parameters():
        if "lora_" in name:
            p.data = p.data.half().float()  # what the file holds
    ids = probe_ids(tiny_llama.tokenizer)
    loaded = load_model(str(out))
    assert loaded.provenance["kind"] == "lora" and loaded.provenance["merged"]
    assert next(loaded.model.parameters()).dtype == torch.float32
    with torch.no_grad():
        diff = (last_logits(loaded.model, ids) - last_logits(peft_model, ids)).abs().max()
    assert diff < 1e-5


def test_training_reduces_answer_loss(tiny_llama, tmp_path):
    # a random tiny model's logits span well under one nat; scale the head so the answer can be learned
    with torch.no_grad():
        tiny_llama.model.lm_head.weight.mul_(30)
    cfg = tiny_cfg(tmp_path, steps=12, eval_every=6, save_steps={})
    fixed = training_batch(cfg, tiny_llama.tokenizer, 0, train_objects())
    with torch.no_grad():
        before = answer_loss(tiny_llama.model, fixed).item()
    res = finetune(tiny_llama, cfg, tmp_path / "run", progress=False)
    with torch.no_grad():
        after = answer_loss(tiny_llama.model, fixed).item()  # the LoRA was injected into this model
    assert len(res.losses) == 12 and res.stopped_at == 12 and res.losses[0] == pytest.approx(before, abs=1e-4)
    assert after < before - 1.0, (before, after)
    assert [h["step"] for h in res.history] == [0, 6, 12]


def test_run_is_deterministic_and_recipe_has_every_option(smollm2_tokenizer, tmp_path):
    from conftest import make_tiny
    from safetensors.torch import load_file

    runs = []
    for i in range(2):
        lm = make_tiny("llama", smollm2_tokenizer, seed=0)
        cfg = tiny_cfg(tmp_path, save_steps={"early": 2, "last": 4})
        res = finetune(lm, cfg, tmp_path / f"run{i}", progress=False)
        runs.append(res)
    assert runs[0].losses == runs[1].losses
    w0 = load_file(str(tmp_path / "run0" / "last" / "adapter_model.safetensors"))
    w1 = load_file(str(tmp_path / "run1" / "last" / "adapter_model.safetensors"))
    assert w0.keys() == w1.keys() and all(torch.equal(w0[k], w1[k]) for k in w0)
    recipe = json.loads((tmp_path / "run0" / "early" / "recipe.json").read_text())
    assert set(recipe["options"]) == {f.name for f in dataclasses.fields(FinetuneConfig)}
    assert recipe["options"]["rank"] == 4 and recipe["options"]["target_modules"] == list(cfg.target_modules)
    assert recipe["step"] == 2 and [h["step"] for h in recipe["history"]] == [0, 2]
    assert all(0 <= h["et_accuracy"] <= 1 for h in recipe["history"])
    assert len(recipe["train_loss"]) == 2 and recipe["base"]["fingerprint"]
    assert {"torch", "transformers", "peft", "torch_threads", "cpu_capability"} <= set(recipe["versions"])
    assert recipe["versions"]["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert recipe["data"]["validation_seed"] == cfg.eval_seed


def test_stop_accuracy_and_bad_options(tiny_llama, tmp_path):
    with pytest.raises(ValueError, match="outside"):
        tiny_cfg(tmp_path, save_steps={"late": 99})
    with pytest.raises(ValueError, match="task"):
        tiny_cfg(tmp_path, task="sentiment")
    res = finetune(tiny_llama, tiny_cfg(tmp_path, save_steps={}, stop_accuracy=0.0), tmp_path / "r", progress=False)
    assert res.stopped_at == 0 and res.losses == []


def test_arithmetic_answers_are_single_tokens(smollm2_tokenizer):
    tok = smollm2_tokenizer
    for i, form in enumerate(arithmetic.FORMS):
        records = arithmetic.generate(tok, 40, seed=i, form=form)
        assert len({len(r.input_ids) for r in records}) == 1
        for r in records:
            full = tok(r.prompt + r.answer)["input_ids"]
            assert list(full) == [*r.input_ids, r.answer_id]
            assert tok.decode([r.answer_id]) == r.answer
            assert int(r.answer) == (r.a + r.b if r.op == "+" else r.a - r.b)
            assert len(str(r.a)) == form[1] and len(str(r.b)) == form[2] and r.op == form[0]
    with pytest.raises(ValueError, match="single digit"):
        arithmetic.make_example(tok, 7, 8, "+")
    batch = arithmetic.batch_tensors(arithmetic.generate(tok, 5, seed=3))
    assert batch["input_ids"].shape[0] == 5 and batch["answer_ids"].shape == (5,)


def test_arithmetic_is_deterministic(smollm2_tokenizer):
    a = arithmetic.generate(smollm2_tokenizer, 20, seed=7)
    assert a == arithmetic.generate(smollm2_tokenizer, 20, seed=7)
    assert a != arithmetic.generate(smollm2_tokenizer, 20, seed=8)


def test_object_splits_are_disjoint_and_cover_vocabulary(smollm2_tokenizer):
    train, held = set(train_objects()), set(eval_objects())
    assert not train & held
    assert train | held == set(load_vocabulary())
    assert set(split_objects("all")) == train | held
    assert 0.2 < len(held) / len(train | held) < 0.3
    assert len(vocabulary_report(smollm2_tokenizer, sorted(held)).kept) >= 10  # enough for 7-box prompts
    with pytest.raises(ValueError, match="split"):
        split_objects("test")
    train_batch = generate(smollm2_tokenizer, 50, n_boxes=7, seed=0, vocabulary=train_objects())
    assert not {o for e in train_batch for o in e.objects} & held


def test_a_task_maps_its_object_splits_to_generator_options():
    from mechdiff.tasks.base import SPLITS, get_task

    et = get_task("entity-tracking")
    assert {s: set(et.split_options(s)["vocabulary"]) for s in SPLITS} == {
        "eval": set(eval_objects()),
        "train": set(train_objects()),
        "all": set(load_vocabulary()),
    }
    assert get_task("ioi").split_options("train") == {}  # IOI does not split its names
    with pytest.raises(ValueError, match="split"):
        et.split_options("test")


@pytest.mark.slow
def test_zoo_checkpoint_loads_by_name_and_reproduces_accuracy(smollm2_et):
    """smollm2-et loads offline by registry name and scores as recorded on the first 100 held-out prompts."""
    from mechdiff.patching.evaluate import evaluate

    if not ZOO_RESULTS.is_file():
        pytest.fail(f"{ZOO_RESULTS} is missing; run scripts/build_zoo.sh")
    recorded = json.loads(ZOO_RESULTS.read_text())["smollm2-et"]
    lm = smollm2_et  # load_model("smollm2-et"), shared with tests/slow
    assert lm.provenance["kind"] == "lora" and lm.provenance["base"]["kind"] == "gguf"
    assert lm.fingerprint == recorded["fingerprint"]
    n = 100  # generate() is sequential in its seed: these are the first 100 of the recorded 500
    records = generate(lm.tokenizer, n=n, n_boxes=7, seed=recorded["seed"], vocabulary=eval_objects())
    res = evaluate(lm, records, batch_size=50, progress=False)
    expected = sum(recorded["correct"][:n]) / n
    assert abs(res.accuracy.value - expected) <= 0.02
