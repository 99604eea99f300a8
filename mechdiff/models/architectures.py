"""Architecture adapters: where a head's output, Q, K, V and attention pattern live, for any causal LM.

An adapter is declarative: module paths relative to the model root, plus the column layout of
the Q/K/V projection outputs. It is resolved from the module structure of the loaded model
(`architecture_for`), not from a table of model types:

- the blocks: the top-level ``ModuleList`` of one block class (``model.layers``, ``transformer.h``);
- the attention: the shallowest module of a block with a Q/K/V projection (separate ``q_proj``,
  ``k_proj``, ``v_proj`` or one fused ``qkv_proj``/``c_attn``/``query_key_value``) and an output
  projection (``o_proj``, ``dense``, ``c_proj``, ``out_proj``), checked against the head count;
- ``num_key_value_heads`` and ``head_dim`` from the projection widths;
- the embedding and unembedding from ``get_input_embeddings``/``get_output_embeddings``, the final
  norm as the last norm beside the blocks;
- the norms before attention and MLP, post-norms, parallel blocks: from one probe forward on three
  tokens (torch hooks that read which module's output feeds which; removed at once, nothing written).

Every site is addressed by a *kind* and a layer:

- ``"z"``: the input of the attention output projection, ``"batch pos (head d_head)"``;
  a head's output is its ``d_head`` slice.
- ``"q"``, ``"k"``, ``"v"``: the projection outputs (before rotary embedding; after a Q/K norm that
  spans all heads, as in OLMo 2, so that a head's columns are its own). Under grouped-query
  attention K and V have one slice per KV group, not per head.
- ``"pattern"``: the attention module's second output, ``"batch head query key"``
  (needs ``attn_implementation="eager"``).

Explicit entries (`EXCEPTIONS`) exist only where a family departs from the pattern: fused
Q/K/V whose columns interleave per head (GPT-NeoX, Bloom, Persimmon), and fused layouts no rule
describes (refused).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, replace
from typing import Any, Literal, Optional

import torch

from ..common.components import kv_group

log = logging.getLogger(__name__)

Kind = Literal["z", "q", "k", "v"]
KINDS: tuple[str, ...] = ("z", "q", "k", "v")
Layout = Literal["separate", "fused", "interleaved"]

# Names of the projections inside an attention module (matched whole, case-insensitive).
_Q = re.compile(r"^(q|q_proj|query|wq|q_lin)$", re.I)
_K = re.compile(r"^(k|k_proj|key|wk|k_lin)$", re.I)
_V = re.compile(r"^(v|v_proj|value|wv|v_lin)$", re.I)
_QKV = re.compile(r"^(qkv|qkv_proj|c_attn|query_key_value|wqkv|w_pack)$", re.I)
_OUT = re.compile(r"^(o|o_proj|out_proj|dense|c_proj|wo|out_lin|proj)$", re.I)
_QNORM = re.compile(r"^(q|query)_?(norm|layernorm|ln)$", re.I)
_KNORM = re.compile(r"^(k|key)_?(norm|layernorm|ln)$", re.I)

# Families that depart from the pattern, by model_type: fields of Architecture to override,
# or "refuse": the reason a family cannot be served.
EXCEPTIONS: dict[str, dict[str, str]] = {
    # fused Q/K/V as "(group (heads_per_group + 2) d_head)": each head's q, k, v side by side
    "gpt_neox": {"qkv_layout": "interleaved"},
    "gpt_neox_japanese": {"qkv_layout": "interleaved"},
    "bloom": {"qkv_layout": "interleaved"},
    "persimmon": {"qkv_layout": "interleaved"},
    "falcon": {"refuse": "its fused query_key_value layout depends on new_decoder_architecture/multi_query"},
    "codegen": {"refuse": "its fused qkv_proj is split in mp_num model-parallel chunks"},
}


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
        """Read the shape from a transformers config (no weights; see `shape_of` for a model)."""
        text = _text_config(config)
        n_heads = _first(text, "num_attention_heads", "n_head", "num_heads")
        d_model = _first(text, "hidden_size", "n_embd", "d_model")
        n_kv = getattr(text, "num_key_value_heads", None) or (1 if getattr(text, "multi_query", False) else n_heads)
        d_head = getattr(text, "head_dim", None) or d_model // n_heads
        return cls(
            n_layers=_first(text, "num_hidden_layers", "n_layer", "num_layers"),
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


def _text_config(config: Any) -> Any:
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _first(config: Any, *names: str) -> int:
    for n in names:
        value = getattr(config, n, None)
        if value is not None:
            return int(value)
    raise ValueError(f"config {type(config).__name__} has none of {names}")


@dataclass(frozen=True)
class Architecture:
    """Declarative map of one model's modules (paths relative to the model root, a block or the attention)."""

    name: str  # the config's model_type
    layers: str  # path from the model root to the list of decoder blocks
    attn: str  # attention module, relative to a block
    out_proj: str  # relative to the attention module; its input is z
    q_proj: str
    k_proj: str
    v_proj: str
    qkv_layout: Layout  # separate projections; fused "q | k | v"; fused interleaved per KV group
    mlp: Optional[str]  # relative to a block (None: the MLP is not one module, e.g. OPT)
    embed: str
    final_norm: str
    unembed: str
    n_heads: int = 0
    n_kv_heads: int = 0
    d_head: int = 0
    q_site: Optional[str] = None  # relative to the attention: a Q norm spanning all heads, read instead of q_proj
    k_site: Optional[str] = None
    # The block's data flow (from the probe forward; ``flow=False`` when it could not run):
    attn_norm: Optional[str] = None  # relative to a block: the norm whose output the attention reads
    mlp_norm: Optional[str] = None  # the norm whose output the MLP reads (the same one in a shared-norm block)
    attn_post_norm: Optional[str] = None  # a norm applied to the attention output before the residual add
    mlp_post_norm: Optional[str] = None
    parallel: bool = False  # the MLP reads the block input, not input + attention (GPT-J, NeoX, Phi, Cohere)
    additive: Optional[bool] = None  # block output = input + attention + MLP contributions (None: not checked)
    flow: bool = False  # True when the fields above come from a probe forward

    def block(self, root: Any, layer: int) -> Any:
        """Decoder block ``layer`` of ``root`` (a torch module or an nnsight envoy)."""
        return get_path(root, self.layers)[layer]

    def attention(self, root: Any, layer: int) -> Any:
        return get_path(self.block(root, layer), self.attn)

    def projection(self, root: Any, kind: str, layer: int) -> Any:
        """The Q, K or V projection module (the fused one for a fused layout; ``o`` the output projection)."""
        path = {"q": self.q_proj, "k": self.k_proj, "v": self.v_proj, "o": self.out_proj}[kind]
        return get_path(self.attention(root, layer), path)

    def module(self, root: Any, kind: str, layer: int) -> Any:
        """The module whose input (``z``) or output (``q``/``k``/``v``/``pattern``) is the site."""
        attn = self.attention(root, layer)
        if kind == "z":
            return get_path(attn, self.out_proj)
        if kind == "pattern":
            return attn
        site = {"q": self.q_site, "k": self.k_site}.get(kind)
        return get_path(attn, site) if site else self.projection(root, kind, layer)

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
        g = kv_group(head, shape.n_heads, shape.n_kv_heads)
        index = head if kind == "q" else g
        if self.qkv_layout == "separate":
            start = index * d
        elif self.qkv_layout == "fused":  # "(q: head d) | (k: group d) | (v: group d)"
            start = {"q": 0, "k": shape.n_heads * d, "v": (shape.n_heads + shape.n_kv_heads) * d}[kind] + index * d
        else:  # interleaved: "(group (query heads of the group, k, v) d_head)"
            r = shape.group_size
            offset = {"q": head - g * r, "k": r, "v": r + 1}[kind]
            start = (g * (r + 2) + offset) * d
        return slice(start, start + d)

    def unembed_module(self, root: Any) -> Any:
        return get_path(root, self.unembed)

    def final_norm_module(self, root: Any) -> Any:
        return get_path(root, self.final_norm)

    def embed_module(self, root: Any) -> Any:
        return get_path(root, self.embed)


def get_path(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = obj[int(part)] if part.isdigit() else getattr(obj, part)
    return obj


class UnsupportedModel(ValueError):
    """A model whose module structure fits no adapter pattern; the message lists what was found."""


# ---- resolution -------------------------------------------------------------------------------------------


def architecture_for(model: Any) -> Architecture:
    """The adapter of a loaded causal LM (a ``torch.nn.Module``), resolved from its modules.

    Raises `UnsupportedModel` naming what was found when no pattern fits.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            "architecture_for takes the loaded model (a torch.nn.Module), not "
            f"{type(model).__name__}; adapters are resolved from the module structure"
        )
    config = _text_config(model.config)
    model_type = getattr(config, "model_type", None)
    extra = dict(EXCEPTIONS.get(model_type, {}))
    if "refuse" in extra:
        raise UnsupportedModel(
            f"{type(model).__name__} (model_type {model_type!r}) is not supported: "
            f"{extra['refuse']}. Add a layout to mechdiff/models/architectures.py."
        )
    layers = _find_layers(model, config)
    block = get_path(model, layers)[0]
    n_heads = _first(config, "num_attention_heads", "n_head", "num_heads")
    attn_path, found = _find_attention(block, n_heads, getattr(config, "head_dim", None))
    if attn_path is None:
        raise UnsupportedModel(
            _describe(model, model_type, layers, block, "no attention module with Q/K/V and output projections", found)
        )
    parts = found[attn_path]
    if parts["layout"] != "separate" and "qkv_layout" in extra:
        parts["layout"] = extra.pop("qkv_layout")
    arch = Architecture(
        name=str(model_type),
        layers=layers,
        attn=attn_path,
        out_proj=parts["o"],
        q_proj=parts["q"],
        k_proj=parts["k"],
        v_proj=parts["v"],
        qkv_layout=parts["layout"],
        mlp=_find_mlp(block, attn_path),
        embed=_path_of(model, model.get_input_embeddings(), "input embedding"),
        final_norm=_find_final_norm(model, layers, model_type),
        unembed=_path_of(model, model.get_output_embeddings(), "output embedding (lm_head)"),
        n_heads=n_heads,
        n_kv_heads=parts["n_kv"],
        d_head=parts["d_head"],
        q_site=parts.get("q_site"),
        k_site=parts.get("k_site"),
    )
    return _probe_flow(model, replace(arch, **extra))


def shape_of(model: Any, arch: Optional[Architecture] = None) -> ModelShape:
    """The shape of a loaded model: layer count from its blocks, heads, KV groups and head size from
    its projections (the config's values where it names them differently, e.g. multi-query)."""
    arch = arch or architecture_for(model)
    config = _text_config(model.config)
    d_model = _weight_dims(arch.projection(model, "o", 0))[1]  # the residual width (OPT embeds narrower)
    return ModelShape(
        n_layers=len(get_path(model, arch.layers)),
        n_heads=arch.n_heads,
        n_kv_heads=arch.n_kv_heads,
        d_head=arch.d_head,
        d_model=d_model,
        vocab_size=int(config.vocab_size),
    )


def _is_norm(module: Any) -> bool:
    return "norm" in type(module).__name__.lower() and not any(isinstance(m, torch.nn.Linear) for m in module.modules())


def _weight_dims(module: Any) -> tuple[int, int]:
    """``(in, out)`` of a linear-like module (``nn.Linear``, GPT-2's ``Conv1D``) or an embedding ``(vocab, d)``."""
    w = getattr(module, "weight", None)
    if not isinstance(w, torch.Tensor) or w.dim() != 2:
        raise ValueError(f"{type(module).__name__} has no 2-D weight")
    if type(module).__name__ == "Conv1D":
        return int(w.shape[0]), int(w.shape[1])
    return int(w.shape[1]), int(w.shape[0])


def _find_layers(model: Any, config: Any) -> str:
    """The path of the top-level ModuleList of identical blocks (the one as long as the config's layer count)."""
    lists = []
    for name, mod in model.named_modules():
        if isinstance(mod, torch.nn.ModuleList) and len(mod) and not any(name.startswith(p + ".") for p, _ in lists):
            if len({type(m) for m in mod}) == 1:
                lists.append((name, mod))
    n_layers = next(
        (getattr(config, k) for k in ("num_hidden_layers", "n_layer", "num_layers") if getattr(config, k, None)), None
    )
    matching = [n for n, m in lists if len(m) == n_layers] or [n for n, _ in lists]
    if len(matching) != 1:
        found = ", ".join(f"{n} ({type(m[0]).__name__} x{len(m)})" for n, m in lists) or "none"
        raise UnsupportedModel(
            f"{type(model).__name__}: cannot tell the decoder blocks ({n_layers} layers in the "
            f"config) among the module lists found: {found}"
        )
    return matching[0]


def _find_attention(block: Any, n_heads: int, head_dim: Optional[int]) -> tuple[Optional[str], dict]:
    """The shallowest module of ``block`` whose children are Q/K/V and output projections of ``n_heads`` heads."""
    found: dict[str, dict] = {}
    for name, mod in block.named_modules():
        if not name:
            continue
        parts = _classify(mod, n_heads, head_dim)
        found[name] = parts
        if parts.get("ok"):
            return name, found
    return None, found


def _classify(attn: Any, n_heads: int, head_dim: Optional[int]) -> dict:
    """Name and check the projections among ``attn``'s children; ``ok`` when they fit one pattern."""
    proj, norms = {}, {}
    for name, child in attn.named_children():
        try:
            proj[name] = _weight_dims(child)
        except ValueError:
            if _is_norm(child):
                norms[name] = child
    parts: dict[str, Any] = {"children": proj}
    pick = {
        key: [n for n in proj if rx.match(n)]
        for key, rx in (("q", _Q), ("k", _K), ("v", _V), ("qkv", _QKV), ("o", _OUT))
    }
    if len(pick["o"]) != 1:
        return parts
    o = pick["o"][0]
    width, d_model = proj[o]
    if width % n_heads:
        return parts
    d = head_dim or width // n_heads
    if width != n_heads * d:
        return parts
    if all(len(pick[k]) == 1 for k in "qkv"):
        q, k, v = (pick[x][0] for x in "qkv")
        kv_width = proj[k][1]
        if proj[q] != (d_model, n_heads * d) or proj[v] != (d_model, kv_width) or kv_width % d:
            return parts
        parts.update(ok=True, layout="separate", q=q, k=k, v=v, o=o, d_head=d, n_kv=kv_width // d)
        parts.update(_head_spanning_norms(norms, n_heads * d, kv_width, d))
    elif len(pick["qkv"]) == 1:
        qkv = pick["qkv"][0]
        fused_in, fused_out = proj[qkv]
        n_kv2 = fused_out // d - n_heads
        if fused_in != d_model or fused_out % d or n_kv2 <= 0 or n_kv2 % 2:
            return parts
        parts.update(ok=True, layout="fused", q=qkv, k=qkv, v=qkv, o=o, d_head=d, n_kv=n_kv2 // 2)
    return parts


def _head_spanning_norms(norms: dict, q_width: int, kv_width: int, d: int) -> dict:
    """Q/K norms over all heads' columns (OLMo 2): the site is their output, where heads no longer mix."""
    out = {}
    for name, norm in norms.items():
        w = getattr(norm, "weight", None)
        size = int(w.numel()) if isinstance(w, torch.Tensor) else 0
        if _QNORM.match(name) and size == q_width and q_width > d:
            out["q_site"] = name
        if _KNORM.match(name) and size == kv_width and kv_width > d:
            out["k_site"] = name
    return out


def _find_mlp(block: Any, attn_path: str) -> Optional[str]:
    """The one child of the block, besides the attention and the norms, that holds parameters."""
    top = attn_path.split(".")[0]
    rest = [n for n, c in block.named_children() if n != top and not _is_norm(c) and any(True for _ in c.parameters())]
    return rest[0] if len(rest) == 1 else None


def _path_of(model: Any, module: Any, what: str) -> str:
    for name, mod in model.named_modules():
        if mod is module and name:
            return name
    raise UnsupportedModel(f"{type(model).__name__}: no {what} module found")


def _find_final_norm(model: Any, layers: str, model_type: Any) -> str:
    """The norm beside the blocks (``model.norm``, ``transformer.ln_f``); of several, the last one after them."""
    parent_path, _, list_name = layers.rpartition(".")
    parent = get_path(model, parent_path) if parent_path else model
    names = [n for n, _ in parent.named_children()]
    norms = [n for n in names if _is_norm(getattr(parent, n))]
    after = [n for n in norms if names.index(n) > names.index(list_name)] if len(norms) > 1 else norms
    if not after:
        raise UnsupportedModel(
            f"{type(model).__name__} (model_type {model_type!r}): no final norm after "
            f"{layers}; children of {parent_path or 'the root'}: {names}"
        )
    return f"{parent_path}.{after[-1]}" if parent_path else after[-1]


def _describe(model: Any, model_type: Any, layers: str, block: Any, problem: str, found: dict) -> str:
    lines = [
        f"{type(model).__name__} (model_type {model_type!r}) fits no adapter pattern: {problem}.",
        f"Blocks at {layers} ({type(block).__name__}); linear children of its modules:",
    ]
    for name, parts in found.items():
        if parts.get("children"):
            dims = ", ".join(f"{n} {i}->{o}" for n, (i, o) in parts["children"].items())
            lines.append(f"  {name}: {dims}")
    lines.append(
        "Expected q_proj/k_proj/v_proj (or a fused qkv_proj/c_attn/query_key_value) and "
        "o_proj/dense/c_proj/out_proj. Add an entry to EXCEPTIONS in mechdiff/models/architectures.py."
    )
    return "\n".join(lines)


# ---- the probe forward: which module's output feeds which ----------------------------------------------


def _probe_flow(model: Any, arch: Architecture) -> Architecture:
    """Fill the norm and residual fields from one forward on three tokens (hooks on block 0 read only)."""
    block = arch.block(model, 0)
    mods = {"block": block, "attn": get_path(block, arch.attn)}
    if arch.mlp:
        mods["mlp"] = get_path(block, arch.mlp)
    norms = {n: c for n, c in block.named_children() if _is_norm(c)}
    seen: dict[str, tuple] = {}

    def hook(key):
        def record(mod, args, kwargs, out):
            x = args[0] if args else kwargs.get("hidden_states")
            seen.setdefault(key, (x, out[0] if isinstance(out, tuple) else out))

        return record

    handles = [
        m.register_forward_hook(hook(k), with_kwargs=True)
        for k, m in {**mods, **{"norm:" + n: c for n, c in norms.items()}}.items()
    ]
    training = model.training
    try:
        device = next(model.parameters()).device
        with torch.no_grad():
            model.eval()  # no dropout: a module's output is what the next one reads
            model(input_ids=torch.tensor([[1, 2, 3]], device=device))  # use_cache=False fails on meta
    except Exception as exc:  # noqa: BLE001 - a model that cannot run here keeps flow=False
        log.info("probe forward of %s failed (%s); norms and parallel blocks left unresolved", arch.name, exc)
        return arch
    finally:
        model.train(training)
        for h in handles:
            h.remove()
    if not {"block", "attn"} <= set(seen):
        return arch
    return _read_flow(arch, seen, list(norms))


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.shape != b.shape:
        return False
    if a.is_meta or b.is_meta:
        return False
    return bool(torch.equal(a, b))


def _read_flow(arch: Architecture, seen: dict, norms: list[str]) -> Architecture:
    block_in, block_out = seen["block"]
    attn_in, attn_out = seen["attn"]

    def norm_from(tensor_in=None, tensor_out=None) -> Optional[str]:
        """The norm whose input is ``tensor_in`` or output ``tensor_out``: the same object first, else equal values."""
        for same in (lambda a, b: a is b, _same):
            for n in norms:
                nin, nout = seen.get("norm:" + n, (None, None))
                if (tensor_out is not None and same(nout, tensor_out)) or (
                    tensor_in is not None and same(nin, tensor_in)
                ):
                    return n
        return None

    attn_norm = norm_from(tensor_out=attn_in)
    attn_post = norm_from(tensor_in=attn_out)
    fields: dict[str, Any] = dict(attn_norm=attn_norm, attn_post_norm=attn_post, flow=True)
    attn_add = seen["norm:" + attn_post][1] if attn_post else attn_out
    if "mlp" in seen:
        mlp_in, mlp_out = seen["mlp"]
        mlp_norm = norm_from(tensor_out=mlp_in)
        mlp_post = norm_from(tensor_in=mlp_out)
        read = seen["norm:" + mlp_norm][0] if mlp_norm else mlp_in
        mlp_add = seen["norm:" + mlp_post][1] if mlp_post else mlp_out
        fields.update(mlp_norm=mlp_norm, mlp_post_norm=mlp_post, parallel=_same(read, block_in))
        if not block_out.is_meta:
            expected = block_in + attn_add + mlp_add
            fields["additive"] = bool(torch.allclose(block_out, expected, atol=1e-5, rtol=1e-4))
    return replace(arch, **fields)
