"""Architecture adapters: where a head's output, Q, K, V and attention pattern live.

An adapter is declarative: module paths relative to the model root, plus the
column layout of the Q/K/V projection outputs. Every site is addressed by a
*kind* and a layer:

- ``"z"``: the input of the attention output projection, ``"batch pos (head d_head)"``;
  a head's output is its ``d_head`` slice.
- ``"q"``, ``"k"``, ``"v"``: the projection outputs (before rotary embedding).
  Under grouped-query attention K and V have one slice per KV group, not per head.
- ``"pattern"``: the attention module's second output, ``"batch head query key"``
  (needs ``attn_implementation="eager"``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from ..components import kv_group

Kind = Literal["z", "q", "k", "v"]
KINDS: tuple[str, ...] = ("z", "q", "k", "v")


@dataclass(frozen=True)
class ModelShape:
    """The dimensions two models must share to be compared."""

    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_head: int
    d_model: int
    vocab_size: int

    @classmethod
    def from_config(cls, config: Any) -> "ModelShape":
        """Read the shape from a transformers config of any supported family."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        n_heads = _first(text, "num_attention_heads", "n_head")
        d_model = _first(text, "hidden_size", "n_embd")
        n_kv = getattr(text, "num_key_value_heads", None) or n_heads
        d_head = getattr(text, "head_dim", None) or d_model // n_heads
        return cls(
            n_layers=_first(text, "num_hidden_layers", "n_layer"),
            n_heads=n_heads,
            n_kv_heads=n_kv,
            d_head=d_head,
            d_model=d_model,
            vocab_size=text.vocab_size,
        )

    @property
    def group_size(self) -> int:
        """Query heads per KV group."""
        return self.n_heads // self.n_kv_heads


def _first(config: Any, *names: str) -> int:
    for n in names:
        value = getattr(config, n, None)
        if value is not None:
            return int(value)
    raise ValueError(f"config {type(config).__name__} has none of {names}")


@dataclass(frozen=True)
class Architecture:
    """Declarative map of one model family's modules."""

    name: str
    layers: str  # path from the model root to the list of decoder blocks
    attn: str  # attention module, relative to a block
    out_proj: str  # relative to the attention module; its input is z
    q_proj: str
    k_proj: str
    v_proj: str
    qkv_layout: Literal["separate", "gpt2", "neox"]
    mlp: str
    embed: str
    final_norm: str
    unembed: str

    def block(self, root: Any, layer: int) -> Any:
        """Decoder block ``layer`` of ``root`` (a torch module or an nnsight envoy)."""
        return _get(root, self.layers)[layer]

    def attention(self, root: Any, layer: int) -> Any:
        return _get(self.block(root, layer), self.attn)

    def module(self, root: Any, kind: str, layer: int) -> Any:
        """The module whose input (``z``) or output (``q``/``k``/``v``/``pattern``) is the site."""
        attn = self.attention(root, layer)
        if kind == "z":
            return _get(attn, self.out_proj)
        if kind == "pattern":
            return attn
        return _get(attn, {"q": self.q_proj, "k": self.k_proj, "v": self.v_proj}[kind])

    def site(self, root: Any, kind: str, layer: int) -> Any:
        """The tensor of a site inside an nnsight trace (``"batch pos columns"``)."""
        mod = self.module(root, kind, layer)
        if kind == "z":
            return mod.input
        if kind == "pattern":
            return mod.output[1]
        return mod.output

    def columns(self, kind: str, head: int, shape: ModelShape) -> slice:
        """Columns of the site tensor that belong to query ``head`` (K/V: to its KV group)."""
        d = shape.d_head
        if kind == "z":
            return slice(head * d, (head + 1) * d)
        if kind not in ("q", "k", "v"):
            raise ValueError(f"unknown site kind {kind!r}; expected one of {KINDS}")
        index = head if kind == "q" else kv_group(head, shape.n_heads, shape.n_kv_heads)
        which = "qkv".index(kind)
        if self.qkv_layout == "separate":
            start = index * d
        elif self.qkv_layout == "gpt2":
            start = which * shape.n_heads * d + index * d
        else:  # neox: "(head three d_head)"
            start = index * 3 * d + which * d
        return slice(start, start + d)

    def unembed_module(self, root: Any) -> Any:
        return _get(root, self.unembed)

    def final_norm_module(self, root: Any) -> Any:
        return _get(root, self.final_norm)


def _get(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


_LLAMA = dict(
    layers="model.layers", attn="self_attn", out_proj="o_proj", q_proj="q_proj", k_proj="k_proj",
    v_proj="v_proj", qkv_layout="separate", mlp="mlp", embed="model.embed_tokens",
    final_norm="model.norm", unembed="lm_head",
)
ARCHITECTURES: dict[str, Architecture] = {
    **{t: Architecture(name=t, **_LLAMA) for t in ("llama", "mistral", "qwen2", "gemma", "gemma2", "qwen3")},
    "gpt2": Architecture(
        name="gpt2", layers="transformer.h", attn="attn", out_proj="c_proj", q_proj="c_attn",
        k_proj="c_attn", v_proj="c_attn", qkv_layout="gpt2", mlp="mlp", embed="transformer.wte",
        final_norm="transformer.ln_f", unembed="lm_head",
    ),
    "gpt_neox": Architecture(
        name="gpt_neox", layers="gpt_neox.layers", attn="attention", out_proj="dense",
        q_proj="query_key_value", k_proj="query_key_value", v_proj="query_key_value", qkv_layout="neox",
        mlp="mlp", embed="gpt_neox.embed_in", final_norm="gpt_neox.final_layer_norm", unembed="embed_out",
    ),
}


def architecture_for(config: Any) -> Architecture:
    """The adapter for a transformers config, or a clear error naming the supported families."""
    model_type = getattr(config, "model_type", None)
    if model_type not in ARCHITECTURES:
        raise ValueError(
            f"no architecture adapter for model_type {model_type!r}; supported: {sorted(ARCHITECTURES)}. "
            "Add an Architecture entry in mechdiff/models/architectures.py."
        )
    return ARCHITECTURES[model_type]
