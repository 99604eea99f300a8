"""Fixtures and helpers the unit tests share (tests/conftest.py holds those of every folder): tiny models fed
random token ids, with a vocabulary of their own, and two tiny llamas saved as checkpoints."""

from __future__ import annotations

import pytest
import torch
from conftest import tiny_config

from mechdiff.models.loading import LoadedModel
from mechdiff.models.registry import ModelSpec

#: The vocabulary of a tiny model fed random token ids below it (no tokenizer): at SmolLM2's 49,152 the
#: unembedding is most of a tiny model's forward (6 prompts of 30 tokens on one thread: 55 ms; at 2,048: 5 ms).
IDS_VOCAB = 2048


def make_tiny_ids(family: str, seed: int = 0, n_layers: int = 3) -> LoadedModel:
    """`make_tiny` without a tokenizer and with `IDS_VOCAB` token ids: for tests whose prompts are random ids.
    Named as `make_tiny` names its models (``tiny-<family>-<seed>``)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = tiny_config(family, vocab_size=IDS_VOCAB, n_layers=n_layers)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()
    model.requires_grad_(False)
    name = f"tiny-{family}-{seed}"
    return LoadedModel(name, ModelSpec(name, "local", "<memory>"), model, None, {"kind": "memory", "seed": seed})


@pytest.fixture(params=["llama", "gpt2", "gpt_neox"])
def tiny_ids_model(request) -> LoadedModel:
    """A tiny random model of each supported family fed random ids (`make_tiny_ids`), for tests that need no
    tokenizer."""
    return make_tiny_ids(request.param)


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
