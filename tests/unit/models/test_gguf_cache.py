"""A GGUF checkpoint is converted once into a transformers directory and loaded from it: the same weights and
config (the fingerprint recorded from the GGUF path), the same tokenizer, no second conversion, nothing read
from a conversion that did not finish, and the GGUF file itself where the cache is off."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mechdiff.models import gguf_cache
from mechdiff.models.gguf_cache import MANIFEST, converted
from mechdiff.models.registry import get_spec
from mechdiff.models.resolve import resolve_source

RECORD = Path(__file__).resolve().parents[3] / "results" / "zoo" / "trajectory.json"


def _gguf() -> tuple[str, str]:
    spec = get_spec("smollm2-135m")
    return resolve_source(spec.source), spec.gguf_file


def test_the_cache_off_reads_the_gguf_file(monkeypatch):
    monkeypatch.setenv("MECHDIFF_CACHE", "off")
    src, name = _gguf()
    assert converted(src, name) == (src, {"gguf_file": name})


def test_an_unfinished_conversion_is_never_read(monkeypatch, tmp_path):
    """A directory without the manifest (a conversion killed before its rename could not leave one, but a
    hand-made or damaged one can) is converted again; a finished one is read without converting."""
    monkeypatch.setenv("MECHDIFF_CACHE", str(tmp_path))
    src, name = _gguf()
    final = tmp_path / "gguf" / f"{Path(name).stem}-{gguf_cache.file_digest(Path(src) / name)}"
    final.mkdir(parents=True)
    calls = []
    monkeypatch.setattr(gguf_cache, "convert", lambda path, out: calls.append(out) or out)
    assert converted(src, name) == (str(final), {}) and calls == [final]
    (final / MANIFEST).write_text("{}")
    assert converted(src, name) == (str(final), {}) and calls == [final]


@pytest.mark.slow
def test_the_conversion_loads_the_gguf_checkpoint_unchanged(monkeypatch, tmp_path):
    """Read back from the conversion: the fingerprint recorded from the GGUF file itself (config and weights),
    and the tokenizer transformers builds from the GGUF file."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mechdiff.models.loading import model_fingerprint

    monkeypatch.setenv("MECHDIFF_CACHE", str(tmp_path))
    src, name = _gguf()
    where, kwargs = converted(src, name)
    assert kwargs == {} and Path(where).parent == tmp_path / "gguf"
    assert json.loads((Path(where) / MANIFEST).read_text())["gguf"] == str(Path(src) / name)
    model = AutoModelForCausalLM.from_pretrained(where, attn_implementation="eager")
    assert model_fingerprint(model) == json.loads(RECORD.read_text())["steps"]["0"]["fingerprint"]
    mine, direct = AutoTokenizer.from_pretrained(where), AutoTokenizer.from_pretrained(src, gguf_file=name)
    text = ["The apple is in Box F, the key is in Box Q.", "Q: Which city is the capital of Peru? A: It is"]
    assert mine.get_vocab() == direct.get_vocab() and mine(text).input_ids == direct(text).input_ids
    monkeypatch.setattr(gguf_cache, "convert", lambda *a: pytest.fail("converted twice"))
    assert converted(src, name)[0] == where
