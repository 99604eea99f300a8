"""Fixtures the unit tests share (tests/conftest.py holds those of every folder): two tiny llamas saved as
checkpoints."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def tiny_pair_dirs(tmp_path_factory, smollm2_tokenizer) -> list[str]:
    """Two tiny llamas (seeds 0 and 1, three layers) saved with the SmolLM2 tokenizer as checkpoints ``tiny-0``
    and ``tiny-1``: the models of the single commands' tests (circuits/test_scoring.py, api/test_compare.py).
    Shared by the whole run: tests only read them."""
    from conftest import make_tiny

    root = tmp_path_factory.mktemp("tiny-pair")
    dirs = []
    for seed in (0, 1):
        path = root / f"tiny-{seed}"
        make_tiny("llama", smollm2_tokenizer, seed=seed).model.save_pretrained(path)
        smollm2_tokenizer.save_pretrained(path)
        dirs.append(str(path))
    return dirs
