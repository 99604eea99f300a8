"""``mechdiff tokens`` and :func:`mechdiff.models.tokenization.tokens` (#52 item 6): a string's tokens offline, as a
task's records hold them."""

from __future__ import annotations

import json

import pytest

from mechdiff.cli import main
from mechdiff.models.tokenization import tokens, tokens_table

TEXT = "When Mary and John went to the store, John gave a drink to"


def test_tokens_are_the_ids_a_record_holds_with_their_text_and_spans(smollm2_tokenizer):
    toks = tokens(TEXT, tokenizer=smollm2_tokenizer)
    assert [t.id for t in toks] == list(smollm2_tokenizer(TEXT)["input_ids"])
    assert [t.index for t in toks] == list(range(len(toks)))
    assert "".join(t.piece for t in toks) == TEXT  # byte-level BPE, no added token: the pieces spell the text
    assert all(TEXT[t.start : t.end] == t.piece for t in toks)
    assert [t.piece for t in toks] == [p.replace("\u0120", " ") for p in smollm2_tokenizer.tokenize(TEXT)]
    table = tokens_table(toks).splitlines()
    assert len(table) == len(toks) + 1 and table[2].split() == ["1", str(toks[1].id), "'", "Mary'", "4-9"]
    with pytest.raises(ValueError, match="give a model"):
        tokens(TEXT)


def test_an_added_beginning_token_has_no_span():
    """A tiny word-level tokenizer that adds <s>: the added token is listed, with no characters of the text."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.WordLevel({"<s>": 0, "<unk>": 1, "keys": 2, "are": 3}, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    core.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", unk_token="<unk>")
    toks = tokens("keys are here", tokenizer=tok)
    assert [(t.id, t.start, t.end) for t in toks] == [(0, None, None), (2, 0, 4), (3, 5, 8), (1, 9, 13)]


def test_tokens_command_prints_each_text_and_refuses_an_unknown_model(smollm2_tokenizer, capsys):
    assert main(["tokens", "The keys are", "The key is", "--model", "smollm2-135m", "--json"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [[t["id"] for t in json.loads(line)] for line in lines] == [
        list(smollm2_tokenizer(t)["input_ids"]) for t in ("The keys are", "The key is")
    ]
    assert main(["tokens", "The keys are", "--model", "smollm2-135m"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("'The keys are': 3 tokens (smollm2-135m)\n#  id")
    assert main(["tokens", "x", "--model", "no-such-model"]) == 2
    assert "unknown model 'no-such-model'" in capsys.readouterr().err


def test_a_hub_id_out_of_the_cache_is_refused_before_any_download(tmp_path):
    """Refused from the cache's files alone, with what the model needs (offline, a download is retried for minutes)."""
    with pytest.raises(FileNotFoundError, match=r"hub:org/none is not on this machine \(hub org/none: a download"):
        tokens("x", "hub:org/none", cache_dir=str(tmp_path))
