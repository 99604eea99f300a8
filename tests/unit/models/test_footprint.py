"""The config-only counts of mechdiff.models.footprint against a real model: parameters, forward FLOPs."""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM

from mechdiff.models.footprint import (
    Dims,
    backward_bytes,
    dtype_bytes,
    forward_bytes,
    forward_flops,
    model_dims,
    shipped_configs,
)
from mechdiff.models.memory import torch_peak
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


#: How far the modelled transient peak may lie from torch's: the model leaves out the rotary tables, the causal
#: mask and norms' brief float32 copies (each small beside the tensors counted).
PEAK_WITHIN = 0.1


def sized_llama(dtype: torch.dtype, width: int, d_ff: int, vocab: int) -> tuple[torch.nn.Module, Dims]:
    """A random two-block LLaMA (grouped KV heads, eager attention) of the given sizes."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        num_hidden_layers=2,
        hidden_size=width,
        num_attention_heads=8,
        num_key_value_heads=2,
        intermediate_size=d_ff,
        vocab_size=vocab,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval(), Dims.from_config(cfg)


@pytest.mark.parametrize(
    "dtype, width, d_ff, vocab, rows, tokens",
    [
        ("float32", 256, 704, 1000, 8, 40),  # the MLP's moment
        ("bfloat16", 256, 704, 1000, 8, 40),
        ("float32", 128, 256, 1000, 4, 160),  # attention's: the scores grow with the square of the tokens
        ("bfloat16", 128, 256, 1000, 4, 160),
        ("float32", 64, 128, 60_000, 16, 8),  # the read-out's: a wide vocabulary
    ],
)
def test_forward_bytes_are_the_peak_torch_allocates(dtype, width, d_ff, vocab, rows, tokens):
    """A forward without a cache read out at the last position, its logits in float32 and their softmax (as
    ``evaluate`` scores an answer's probability), against the peak of torch's own allocations."""
    model, dims = sized_llama(getattr(torch, dtype), width, d_ff, vocab)
    ids = torch.randint(0, vocab, (rows, tokens))

    def forward():
        logits = model(input_ids=ids, use_cache=False, logits_to_keep=1).logits[:, -1].float()
        logits.softmax(-1)

    with torch.no_grad():
        forward()  # first-call allocations
        measured = torch_peak(forward)
    assert forward_bytes(dims, rows, tokens, dtype) == pytest.approx(measured, rel=PEAK_WITHIN)


@pytest.mark.parametrize(
    "dtype, width, d_ff, rows, tokens",
    [("float32", 256, 704, 4, 40), ("bfloat16", 256, 704, 4, 40), ("float32", 128, 256, 2, 160)],
)
def test_backward_bytes_are_what_autograd_saves(dtype, width, d_ff, rows, tokens):
    """A forward from a leaf at the embeddings with the weights frozen, each block's ``z`` captured (as the curve's
    attribution runs it): the distinct tensors autograd saves for the backward, less the weights, and the captured
    copies of ``z``, against the count."""
    model, dims = sized_llama(getattr(torch, dtype), width, d_ff, 1000)
    model.requires_grad_(False)
    weights = {p.data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}
    captured = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.data_ptr() not in weights:
            saved[t.data_ptr()] = max(saved.get(t.data_ptr(), 0), t.untyped_storage().nbytes())
        return t

    for block in model.model.layers:
        block.self_attn.o_proj.register_forward_pre_hook(lambda m, args: captured.append(args[0].clone()))
    embeddings = model.model.embed_tokens(torch.randint(0, 1000, (rows, tokens))).detach().requires_grad_()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(inputs_embeds=embeddings, use_cache=False, logits_to_keep=1)
    measured = sum(saved.values()) + sum(t.nbytes for t in captured)
    assert backward_bytes(dims, rows, tokens, dims.n_layers, dtype) == pytest.approx(measured, rel=0.02)
