"""Loader paths, registry, ModelSet checks and fingerprints."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import make_tiny

from mechdiff.models import IncompatibleModels, ModelSet, get_spec, load_model, resolve_spec
from mechdiff.models.architectures import ModelShape


def _save(lm, path, tokenizer):
    lm.model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def _logits(lm, ids):
    with torch.no_grad():
        return lm.model(ids).logits


def test_unknown_name_lists_registry():
    with pytest.raises(KeyError) as err:
        resolve_spec("no-such-model")
    for name in ("smollm2-135m", "llama-7b", "goat-7b", "smollm2-et"):
        assert name in str(err.value)


def test_registry_paper_models():
    assert get_spec("goat-7b").kind == "lora" and get_spec("goat-7b").base == "llama-7b"
    assert get_spec("vicuna-7b").source == "AlekseyKorshuk/vicuna-7b"
    assert get_spec("vicuna-7b-v1.3").source == "lmsys/vicuna-7b-v1.3"
    assert get_spec("float-7b").source == "nikhil07prakash/float-7b"


def test_local_directory_roundtrip(tmp_path, smollm2_tokenizer):
    tiny = make_tiny("llama", smollm2_tokenizer)
    _save(tiny, tmp_path / "m", smollm2_tokenizer)
    lm = load_model(str(tmp_path / "m"))
    assert lm.provenance["kind"] == "local"
    ids = torch.randint(0, 1000, (2, 9))
    assert torch.equal(_logits(lm, ids), _logits(tiny, ids))
    assert lm.fingerprint == tiny.fingerprint
    assert lm.shape == ModelShape(3, 4, 2, 8, 32, 49152)


def test_hub_id_against_local_mirror(tmp_path, smollm2_tokenizer, monkeypatch):
    """The hub code path, served from a cache laid out as the hub's (no network)."""
    tiny = make_tiny("llama", smollm2_tokenizer)
    rev = "0123456789abcdef0123456789abcdef01234567"
    repo = tmp_path / "hub" / "models--mechdiff-test--tiny-llama"
    _save(tiny, repo / "snapshots" / rev, smollm2_tokenizer)
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(rev)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    lm = load_model("hub:mechdiff-test/tiny-llama@main", cache_dir=str(tmp_path / "hub"))
    assert lm.provenance == {
        "kind": "hub",
        "repo": "mechdiff-test/tiny-llama",
        "revision": "main",
        "dtype": "float32",
        "device_map": None,
    }
    ids = torch.randint(0, 1000, (2, 9))
    assert torch.equal(_logits(lm, ids), _logits(tiny, ids))
    assert resolve_spec("mechdiff-test/tiny-llama").kind == "hub"


def test_lora_adapter_merged(tmp_path, smollm2_tokenizer):
    from peft import LoraConfig, get_peft_model

    tiny = make_tiny("llama", smollm2_tokenizer)
    base_dir = _save(tiny, tmp_path / "base", smollm2_tokenizer)
    peft_model = get_peft_model(
        make_tiny("llama", smollm2_tokenizer).model,
        LoraConfig(r=4, target_modules=["q_proj", "v_proj", "o_proj"], init_lora_weights=False),
    )
    peft_model.save_pretrained(tmp_path / "adapter")
    lm = load_model(str(tmp_path / "adapter"), base=str(base_dir))
    assert lm.provenance["merged"] is True and lm.provenance["lora"]["r"] == 4
    ids = torch.randint(0, 1000, (2, 9))
    with torch.no_grad():
        expected = peft_model(input_ids=ids).logits
    assert torch.allclose(_logits(lm, ids), expected, atol=1e-5)
    assert lm.fingerprint != tiny.fingerprint
    json.dumps(lm.provenance)  # recorded merge is serialisable


def test_adapter_without_base_is_refused(tmp_path, smollm2_tokenizer):
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "adapter_config.json").write_text("{}")
    with pytest.raises(ValueError, match="--base"):
        resolve_spec(str(tmp_path / "a"))


def test_bad_dtype():
    with pytest.raises(ValueError, match="dtype"):
        load_model("smollm2-135m", dtype="int3")


def test_modelset_rejects_shape_mismatch(tmp_path, smollm2_tokenizer):
    a = _save(make_tiny("llama", smollm2_tokenizer), tmp_path / "a", smollm2_tokenizer)
    b = _save(make_tiny("llama", smollm2_tokenizer, n_layers=2), tmp_path / "b", smollm2_tokenizer)
    with pytest.raises(IncompatibleModels, match="n_layers differs"):
        ModelSet([str(a), str(b)])


def test_modelset_rejects_vocabulary_mismatch(tmp_path, smollm2_tokenizer):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import GPT2TokenizerFast

    a = _save(make_tiny("llama", smollm2_tokenizer), tmp_path / "a", smollm2_tokenizer)
    vocab = {f"t{i}": i for i in range(49152)}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    other = GPT2TokenizerFast(tokenizer_object=raw)
    b = _save(make_tiny("llama", smollm2_tokenizer), tmp_path / "b", other)
    with pytest.raises(IncompatibleModels, match="vocabularies differ"):
        ModelSet([str(a), str(b)])


def test_modelset_loads_lazily(tmp_path, smollm2_tokenizer):
    a = _save(make_tiny("llama", smollm2_tokenizer, seed=0), tmp_path / "a", smollm2_tokenizer)
    b = _save(make_tiny("llama", smollm2_tokenizer, seed=1), tmp_path / "b", smollm2_tokenizer)
    ms = ModelSet([str(a), str(b)])
    assert ms._loaded == {}
    assert ms[str(a)].fingerprint != ms[str(b)].fingerprint
    assert [m.name for m in ms] == [str(a), str(b)]


def test_a_sets_tokenizers_are_read_once_and_each_load_is_given_its_own(tmp_path, smollm2_tokenizer, monkeypatch):
    """The vocabulary check reads each model's tokenizer; loading the models reads none again: each loaded model
    holds the one its set read."""
    from transformers import AutoTokenizer

    a = _save(make_tiny("llama", smollm2_tokenizer, seed=0), tmp_path / "a", smollm2_tokenizer)
    b = _save(make_tiny("llama", smollm2_tokenizer, seed=1), tmp_path / "b", smollm2_tokenizer)
    reads, read = [], AutoTokenizer.from_pretrained
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda src, **kw: reads.append(str(src)) or read(src, **kw))
    ms = ModelSet([str(a), str(b)])
    assert reads == [str(a), str(b)]
    assert all(ms[name].tokenizer is ms.tokenizers[name] for name in ms.names) and len(reads) == 2


@pytest.mark.slow
def test_gguf_smollm2(smollm2):
    assert smollm2.provenance["kind"] == "gguf"
    assert smollm2.shape == ModelShape(30, 9, 3, 64, 576, 49152)
    ids = smollm2.tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        top = smollm2.model(ids).logits[0, -1].argmax().item()
    assert smollm2.tokenizer.decode(top).strip() == "Paris"


def test_the_unembedding_reads_a_contiguous_input_and_the_logits_do_not_change(smollm2_tokenizer):
    from mechdiff.models.loading import contiguous_unembedding

    tiny = make_tiny("llama", smollm2_tokenizer)
    ids = torch.randint(0, 1000, (4, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = tiny.model(input_ids=ids).logits[:, -1]
    seen = []
    contiguous_unembedding(tiny.model)
    tiny.model.lm_head.register_forward_pre_hook(lambda _, args: seen.append(args[0].is_contiguous()))
    with torch.no_grad():
        last = tiny.model(input_ids=ids, logits_to_keep=1).logits[:, -1]  # transformers passes hidden[:, -1:]
    assert seen == [True]
    torch.testing.assert_close(last, reference, atol=1e-6, rtol=1e-6)


def test_one_rows_view_reaches_the_unembedding_with_compact_strides(smollm2_tokenizer):
    """A batch of one: ``hidden[:, -1:]`` counts as contiguous but keeps the full sequence's strides, which a
    bfloat16 ``linear`` on CPU reads (a slow path); the unembedding gets a compact copy, the logits unchanged."""
    from mechdiff.models.loading import contiguous_unembedding, is_compact

    tiny = make_tiny("llama", smollm2_tokenizer)
    ids = torch.randint(0, 1000, (1, 7), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = tiny.model(input_ids=ids).logits[:, -1]
    view = torch.zeros(1, 7, 8)[:, -1:]
    assert (
        view.is_contiguous() and not is_compact(view) and is_compact(view.clone(memory_format=torch.contiguous_format))
    )
    strides = []
    contiguous_unembedding(tiny.model)
    tiny.model.lm_head.register_forward_pre_hook(lambda _, args: strides.append(is_compact(args[0])))
    with torch.no_grad():
        last = tiny.model(input_ids=ids, logits_to_keep=1).logits[:, -1]
    assert strides == [True]
    torch.testing.assert_close(last, reference, atol=1e-6, rtol=1e-6)


def test_the_fingerprint_tells_bfloat16_weights_from_float32_weights_of_the_same_values(smollm2_tokenizer):
    """A checkpoint stored in bfloat16 (as many hub checkpoints are) loads in float32 and in bfloat16 with the same
    values: the fingerprint (every stage key's and the activation store's) still tells them apart, so a bfloat16
    run never reads a float32 record. A float32 model's digest carries no dtype (committed float32 keys stay
    valid); ``dtype_inputs`` adds the dtype to a key read by model name only where it is not float32."""
    from mechdiff.models.loading import dtype_inputs, model_fingerprint, weights_dtype

    lm = make_tiny("llama", smollm2_tokenizer)
    with torch.no_grad():
        for p in lm.model.parameters():
            p.copy_(p.to(torch.bfloat16).float())  # float32 weights of bfloat16 values
    f32 = model_fingerprint(lm.model)
    assert weights_dtype(lm.model) == "float32" and dtype_inputs(lm.model) == {}
    lm.model.to(torch.bfloat16)
    assert weights_dtype(lm.model) == "bfloat16" and dtype_inputs(lm.model) == {"dtype": "bfloat16"}
    assert model_fingerprint(lm.model) != f32
    lm.model.float()  # back to float32, the same values: the same digest
    assert model_fingerprint(lm.model) == f32


def test_a_checkpoints_digest_is_read_once_and_anew_when_a_file_changes(tmp_path, monkeypatch):
    """`spec_digest` is the sha256 of the spec and each file's name and bytes (computed here); a second call reads
    no file; a file rewritten (size or change time) gives the digest of its new bytes."""
    import hashlib
    import os
    from pathlib import Path

    from mechdiff.models import loading

    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (d / "weights.bin").write_bytes(bytes(range(256)) * 9)
    spec = resolve_spec(str(d))

    def by_hand() -> str:
        h = hashlib.sha256(json.dumps([spec.kind, spec.source, spec.revision, spec.gguf_file]).encode())
        for f in sorted(d.iterdir()):
            h.update(f.name.encode() + f.read_bytes())
        return h.hexdigest()[:16]

    first = loading.spec_digest(spec)
    assert first == by_hand()
    reads = []
    monkeypatch.setattr(Path, "read_bytes", lambda self: reads.append(self) or b"")
    assert loading.spec_digest(spec) == first and reads == []
    monkeypatch.undo()
    stat = (d / "config.json").stat()
    (d / "config.json").write_text(json.dumps({"model_type": "LLAMA"}))  # the same size
    os.utime(d / "config.json", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert loading.spec_digest(spec) == by_hand() != first
