"""A tokenizer's digest (which ids a task's records hold) is taken once per tokenizer object, and again where its
vocabulary grew: always what a tokenizer never digested before gives."""

from __future__ import annotations

import copy

from mechdiff.tasks.jsonl import tokenizer_digest


def test_a_digest_is_taken_once_and_again_after_the_vocabulary_grows(smollm2_tokenizer, monkeypatch):
    tok = copy.deepcopy(smollm2_tokenizer)  # its own vocabulary: the tokens added below reach no other test
    first = tokenizer_digest(tok)
    assert first == tokenizer_digest(copy.deepcopy(smollm2_tokenizer))  # a fresh object, digested afresh

    reads = []
    real = type(tok).get_vocab
    monkeypatch.setattr(type(tok), "get_vocab", lambda self: reads.append(self) or real(self))
    assert tokenizer_digest(tok) == first and reads == []  # held

    tok.add_tokens(["<never-seen-before>"])
    grown = tokenizer_digest(tok)
    assert reads == [tok] and grown != first
    assert grown == tokenizer_digest(copy.deepcopy(tok)) and len(reads) == 2  # what a fresh object gives
    assert tokenizer_digest(tok) == grown and len(reads) == 2  # the grown vocabulary's digest held in its turn
