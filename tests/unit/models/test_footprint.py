"""The config-only counts of mechdiff.models.footprint against a real model: parameters, forward FLOPs."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM

from mechdiff.models.footprint import Dims, dtype_bytes, forward_bytes, forward_flops, model_dims, shipped_configs
from tests.conftest import tiny_config


def tiny_llama(tied: bool) -> tuple[torch.nn.Module, Dims]:
    cfg = tiny_config("llama", vocab_size=101)
    cfg.tie_word_embeddings = tied
    cfg._attn_implementation = "eager"
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg).eval(), Dims.from_config(cfg)


@pytest.mark.parametrize("tied", [False, True])
def test_params_equal_the_models_own(tied):
    model, dims = tiny_llama(tied)
    assert dims.n_kv_heads < dims.n_heads  # grouped KV heads are counted as such
    assert dims.params() == sum(p.numel() for p in model.parameters())


def test_forward_flops_equal_the_flop_counter():
    model, dims = tiny_llama(False)
    ids = torch.randint(0, 101, (3, 9))
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        model(input_ids=ids, logits_to_keep=1)
    assert forward_flops(dims, rows=3, tokens=9) == counter.get_total_flops()


def test_forward_flops_with_every_position_read_out():
    model, dims = tiny_llama(True)
    ids = torch.randint(0, 101, (2, 5))
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        model(input_ids=ids)  # logits at every position
    assert forward_flops(dims, rows=2, tokens=5, readouts=10) == counter.get_total_flops()


def test_llama_7b_config_ships_and_counts_its_known_parameters():
    assert {"llama-7b", "vicuna-7b", "goat-7b", "float-7b"} <= set(shipped_configs())
    dims, source = model_dims("llama-7b")
    assert source.endswith("configs/llama-7b.json")
    assert dims.params() == 6_738_415_616  # LLaMA-7B's published count (huggyllama/llama-7b)
    assert {model_dims(n)[0] for n in ("vicuna-7b", "goat-7b", "float-7b")} == {dims}  # one architecture


def test_activation_bytes_are_linear_in_the_batch():
    dims, _ = model_dims("llama-7b")
    assert forward_bytes(dims, 8, 53, "float32") == 2 * forward_bytes(dims, 4, 53, "float32")
    assert forward_bytes(dims, 4, 53, "bfloat16") < forward_bytes(dims, 4, 53, "float32")


def test_unknown_dtype_is_refused_with_the_names():
    with pytest.raises(ValueError, match="bfloat16"):
        dtype_bytes("int4")
