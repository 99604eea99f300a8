"""What a model costs before it loads: parameters, weight bytes, forward FLOPs and activation bytes, from its
config alone (a few numbers: layers, width, heads, KV heads, MLP width, vocabulary).

The paper's models ship their configs with the package (``mechdiff/data/configs/NAME.json``), so their plan
needs no download; any other model's config is read from its own metadata (`load_config`: a GGUF
file's header, a local ``config.json``, the Hugging Face cache). The counts are those of a LLaMA-style decoder
(separate Q, K, V and O projections, a gated MLP of three matrices, RMS norms); `forward_flops` counts the
matrix multiplies a forward pass performs, as `torch.utils.flop_counter.FlopCounterMode` does (the tests
check it against that counter on a real model).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib.resources import files
from typing import Any, Mapping, Optional

#: Bytes per value of each dtype name a task file or ``--dtype`` accepts.
DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}


def dtype_bytes(dtype: str) -> int:
    """Bytes per value of ``dtype``, or an error naming the dtypes there are."""
    try:
        return DTYPE_BYTES[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(sorted(DTYPE_BYTES))}") from None


@dataclass(frozen=True)
class Dims:
    """The numbers of a decoder's config that decide its cost."""

    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    d_head: int
    d_ff: int
    vocab_size: int
    tied: bool = False

    @classmethod
    def from_config(cls, config: Any) -> "Dims":
        """From a transformers config or its dict (a multimodal config's ``text_config`` where it has one)."""
        c = config if isinstance(config, Mapping) else config.to_dict()
        c = c.get("text_config") or c
        heads = int(c["num_attention_heads"])
        return cls(
            n_layers=int(c["num_hidden_layers"]),
            d_model=int(c["hidden_size"]),
            n_heads=heads,
            n_kv_heads=int(c.get("num_key_value_heads") or heads),
            d_head=int(c.get("head_dim") or c["hidden_size"] // heads),
            d_ff=int(c["intermediate_size"]),
            vocab_size=int(c["vocab_size"]),
            tied=bool(c.get("tie_word_embeddings", False)),
        )

    @property
    def layer_linear(self) -> int:
        """Weights of one block's matrices: Q, K, V, O and the gated MLP's three."""
        q, kv = self.n_heads * self.d_head, self.n_kv_heads * self.d_head
        return self.d_model * (2 * q + 2 * kv) + 3 * self.d_model * self.d_ff

    def params(self) -> int:
        """Every parameter: embeddings (twice when untied), blocks with their two norms, the final norm."""
        embed = self.vocab_size * self.d_model * (1 if self.tied else 2)
        return embed + self.n_layers * (self.layer_linear + 2 * self.d_model) + self.d_model

    def weight_bytes(self, dtype: str) -> int:
        return self.params() * dtype_bytes(dtype)

    def kv_width(self) -> int:
        """Keys plus values per token and layer (values, not bytes)."""
        return 2 * self.n_kv_heads * self.d_head


def forward_flops(
    dims: Dims,
    rows: int,
    tokens: int,
    context: Optional[int] = None,
    layers: Optional[float] = None,
    readouts: Optional[int] = None,
) -> float:
    """Matrix-multiply FLOPs of ``rows`` sequences of ``tokens`` computed tokens each through ``layers`` blocks
    (default every block), each token attending to ``context`` positions (default ``tokens``: a full run; a suffix
    run over a key/value prefix attends to more), with ``readouts`` unembedded positions (default one per row)."""
    context = tokens if context is None else context
    layers = dims.n_layers if layers is None else layers
    readouts = rows if readouts is None else readouts
    per_token_layer = 2 * dims.layer_linear + 4 * context * dims.n_heads * dims.d_head
    return rows * tokens * layers * per_token_layer + 2 * readouts * dims.d_model * dims.vocab_size


def forward_bytes(dims: Dims, rows: int, tokens: int, dtype: str, context: Optional[int] = None) -> int:
    """Transient peak of one forward pass without gradients or a key/value cache (eager attention, as transformers'
    LLaMA and Gemma 3 run it), the largest of three moments, read from a CPU forward's allocations (within 1% of
    torch's peak for SmolLM2, Gemma-3-270M and LLaMA-7B's width in ``benchmarks/planner.py``; each moment checked
    on random LLaMA models by ``tests/unit/models/test_footprint.py``):

    - a block's MLP: four residual-width tensors (the embeddings, which the model's forward keeps to its end; the
      block's input; its residual after attention; its normed copy), the attention probabilities (the block keeps
      them until it returns) and the gate's activation, the up projection and their product;
    - its attention: three residual-width tensors, Q, K, V and the copies that rotary embeddings and the
      matrix multiplies make (four query widths and the keys and values), the scores and their float32 softmax
      (in a lower dtype also the scores' float32 copy it is computed from);
    - the read-out: float32 logits at one position per row and their softmax (the answer's probability).

    Departs from a run: norms' float32 copies in a lower dtype and Gemma's extra norms are not counted (each a
    residual width, briefly); the per-layer rotary tables are (tiny)."""
    b, context = dtype_bytes(dtype), tokens if context is None else context
    resid = rows * tokens * dims.d_model * b
    scores = rows * dims.n_heads * tokens * context
    mlp = 4 * resid + scores * b + 3 * rows * tokens * dims.d_ff * b
    q = dims.n_heads * dims.d_head
    upcast = 4 if b < 4 else 0  # the softmax's float32 copy of scores in a lower dtype, beside its float32 output
    attn = 3 * resid + rows * tokens * (4 * q + dims.kv_width()) * b + scores * (b + 4 + upcast)
    return max(mlp, attn, 2 * rows * dims.vocab_size * 4)


def held_pair_bytes(n_layers: int, d_model: int, kv_width: int, tokens: int, value_bytes: int) -> int:
    """What path patching holds of one pair of ``tokens`` tokens (`PairBatch`): the
    clean and counterfactual runs' ``z`` at every layer, the clean residual stream after every block but the last,
    and every layer's keys and values (``kv_width``: keys plus values per token and layer)."""
    return tokens * (2 * n_layers * d_model + (n_layers - 1) * d_model + n_layers * kv_width) * value_bytes


def backward_bytes(dims: Dims, rows: int, tokens: int, layers: float, dtype: str, context: Optional[int] = None) -> int:
    """What a forward keeps for its backward over ``layers`` blocks, the weights frozen (gradients to the
    activations only: attribution, DCM's masks), each of ``tokens`` tokens attending to ``context`` positions
    (default ``tokens``), as transformers' eager LLaMA and Gemma 3 save it (``tests/unit/models/test_footprint.py``
    checks it against the tensors autograd saves). Per row, token and block:

    - both norms' float32 inputs (two residual widths at 4 bytes);
    - the rotated queries and the keys and values repeated to every head (the two matrix multiplies'), and the
      attention's output (a capture's or a patch's copy of ``z``): four query widths;
    - the softmax's float32 output, a score per head and context position (in a lower dtype also the copy the
      matrix multiply saves);
    - the MLP's gate projection, its activation and the up projection: three MLP widths;

    and once, the final norm's float32 input. A linear layer with frozen weights saves nothing of its input, so none
    of its inputs are counted; nor are the rotary tables and the norms' scales (a value a token)."""
    b = dtype_bytes(dtype)
    context = tokens if context is None else context
    q = dims.n_heads * dims.d_head
    per_token = 2 * dims.d_model * 4 + (4 * q + 3 * dims.d_ff) * b + dims.n_heads * context * (4 + (b if b < 4 else 0))
    return int(rows * tokens * (layers * per_token + dims.d_model * 4))


def shipped_configs() -> list[str]:
    """The model names whose configs ship in ``mechdiff/data/configs``."""
    return sorted(
        p.name[:-5] for p in files("mechdiff").joinpath("data", "configs").iterdir() if p.name.endswith(".json")
    )


def model_dims(name: str) -> tuple[Dims, str]:
    """The `Dims` of model ``name`` and where they come from: the shipped config of a paper model, else the
    model's own config (`load_config`; a GGUF file's metadata, a directory, the hub cache)."""
    shipped = files("mechdiff").joinpath("data", "configs", f"{name}.json")
    if shipped.is_file():
        return Dims.from_config(json.loads(shipped.read_text())), f"mechdiff/data/configs/{name}.json"
    from .loading import load_config
    from .resolve import resolve_spec

    spec = resolve_spec(name)
    try:
        config = load_config(spec)
    except OSError as err:
        raise OSError(
            f"no config for {name}: it ships none (shipped: {', '.join(shipped_configs())}) and {err}"
        ) from None
    return Dims.from_config(config), f"{spec.kind}:{spec.source}"
