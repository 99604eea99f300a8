"""The one intervention driver: a forward pass with patches written and sites captured, on nnsight.

Sites are ``(kind, layer)`` with kind ``z``/``q``/``k``/``v`` (see
`mechdiff.models.architectures`); a site tensor is ``"batch pos columns"``.
A `Patch` overwrites some columns of one site, at one position per example
or at every position. Patches and captures are visited in execution order
(per layer: q, k, v, then z), as nnsight requires.

Two ways to compute only what an intervention changes, combinable:

- `Resume` skips the blocks below the first patched layer (their residual stream is
  the clean run's);
- a *suffix run* (``prefix=``) computes only positions ``>= start``: causal attention leaves
  every earlier position as in the clean run, so their keys and values are read from the
  clean run's cache (`Prefix`, kept by ``run(..., keep_kv=True)``). ``start`` is derived
  from the patches and the read-out positions. Senders stacked along the batch (``"(copy b)"``)
  share one prefix of batch ``b``.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Iterable, Optional, Sequence

import nnsight
import torch
from transformers.cache_utils import Cache, DynamicLayer

from ..common.components import Head
from ..common.metrics import metric_name, sequence_logprob
from ..models.loading import LoadedModel

SITE_ORDER = {"emb": -1, "q": 0, "k": 1, "v": 2, "z": 3, "pattern": 4, "resid": 5}
EMB_LAYER = -1  # the ("emb", -1) site: the token embedding output "batch pos d_model", before every layer
# ("resid", L): the residual stream after block L ("batch pos d_model"), what `Resume` starts from.


@dataclass
class Patch:
    """Write ``value`` into ``columns`` of site ``(kind, layer)``.

    ``positions``: LongTensor ``[batch]`` (one position per example; value ``"batch d"``),
    a ``slice`` of positions (value ``"batch sliced_pos d"``) or ``None`` (every position;
    value ``"batch pos d"``). ``columns=None`` means all columns.
    ``value`` may have batch 1 to broadcast over the batch.

    ``mask`` (optional) MIXES instead of overwriting: ``site <- site * mask + value * (1 - mask)``,
    with ``mask`` broadcastable to the patched slice (``"batch pos cols"``, or ``"batch cols"``
    with ``positions``). It may require grad: under ``run(..., grad=True)`` the mix stays in the
    autograd graph, so gradients reach the mask (DCM, learned circuit masks).
    """

    kind: str
    layer: int
    value: torch.Tensor
    positions: Optional[torch.Tensor] = None
    columns: Optional[slice] = None
    mask: Optional[torch.Tensor] = None

    def apply(self, site: torch.Tensor) -> None:
        cols = self.columns if self.columns is not None else slice(None)
        value = self.value.to(device=site.device, dtype=site.dtype)
        if self.positions is None:
            site[:, :, cols] = self._mix(site[:, :, cols], value)
        elif isinstance(self.positions, slice):
            site[:, self.positions, cols] = self._mix(site[:, self.positions, cols], value)
        else:
            rows = torch.arange(site.shape[0], device=site.device)
            positions = self.positions.to(site.device)
            value = value.expand(site.shape[0], -1) if value.shape[0] == 1 else value
            site[rows, positions, cols] = self._mix(site[rows, positions, cols], value)

    def _mix(self, current: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        if self.mask is None:
            return value
        mask = self.mask.to(device=current.device, dtype=current.dtype)
        # ``current`` may be a view of the site, which is written in place next: clone it so that
        # autograd keeps the pre-write values it needs for the mask's gradient.
        return current.clone() * mask + value * (1 - mask)


@dataclass
class Resume:
    """Start a run at block ``layer``: blocks ``0 .. layer-1`` are skipped (nnsight ``skip``) and the
    residual stream entering ``layer`` is ``hidden`` (``"batch pos d_model"``, e.g. a captured
    ``("resid", layer - 1)`` of the same prompts). Exact when nothing before ``layer`` is patched;
    it saves the cost of the skipped blocks (DCM and CMAP patch only late layers, many times)."""

    layer: int
    hidden: torch.Tensor


@dataclass
class Prefix:
    """The keys and values of every layer from a clean run (``run(..., keep_kv=True)``), each
    ``"batch kv_head pos d_head"`` as the attention reads them (after rotary embedding).

    A suffix run (``run(..., prefix=...)``) reads positions ``< start`` from here. The prefix is
    never written: each run builds a fresh read-only cache over these tensors (`prefix_cache`),
    so one prefix serves any number of runs, from any start, for any number of stacked copies.
    """

    keys: list[torch.Tensor]
    values: list[torch.Tensor]

    @property
    def batch(self) -> int:
        return self.keys[0].shape[0]

    @property
    def length(self) -> int:
        return self.keys[0].shape[-2]


@dataclass
class Run:
    """What one patched forward pass returned: logits at the read-out positions and captured sites."""

    logits: torch.Tensor  # "batch vocab" at each example's read-out position
    captured: dict = field(default_factory=dict)  # (kind, layer) -> "batch pos columns" (positions start..)
    start: int = 0  # first position computed: captured tensors cover positions start .. end
    kv: Optional[Prefix] = None  # with keep_kv=True: this run's keys and values


def head_patch(
    model: LoadedModel, kind: str, head: Head, value: torch.Tensor, positions: Optional[torch.Tensor] = None
) -> Patch:
    """A patch of one head's slice (its KV group's slice for ``k``/``v``)."""
    return Patch(kind, head.layer, value, positions, model.arch.columns(kind, head.head, model.shape))


def run(
    model: LoadedModel,
    input_ids: torch.Tensor,
    patches: Iterable[Patch] = (),
    capture: Sequence[tuple[str, int]] = (),
    readout: Optional[torch.Tensor] = None,
    attention_mask: Optional[torch.Tensor] = None,
    grad: bool = False,
    stop: bool = False,
    resume: Optional[Resume] = None,
    prefix: Optional[Prefix] = None,
    start: Optional[int] = None,
    keep_kv: bool = False,
    position_ids: Optional[torch.Tensor] = None,
) -> Run:
    """One forward pass of ``model`` on ``input_ids`` with ``patches`` written and ``capture`` saved.

    ``readout``: LongTensor ``[batch]`` of positions whose logits are returned (default: last), or
    ``[batch, k]``: ``k`` positions each, logits ``"batch k vocab"`` (unembedded from the earliest of them on).
    Captured tensors are cloned after this run's patches at that site. With ``grad=True``
    the captured tensors stay in the autograd graph (see the attribution screen).
    ``stop=True`` halts the model after the last patched/captured site (``logits`` is then ``None``).
    ``resume`` skips the blocks before ``resume.layer`` (see `Resume`); its ``hidden`` may
    cover every position or only the suffix, and batch ``b`` or the stacked ``copies * b``.
    ``prefix``: the clean run's keys and values (`Prefix`) of the same prompts (batch ``b``;
    ``input_ids`` may stack copies of them, ``"(copy b) pos"``): only positions ``>= start`` are
    computed, ``start`` defaulting to the first position any patch writes or the read-out reads
    (`suffix_start`; an earlier ``start`` is allowed, a later one refused; without ``prefix``
    every position is computed and ``start`` is ignored). Positions in patches and ``readout`` stay absolute; captured
    tensors cover positions ``start ..`` (``Run.start``). ``keep_kv=True`` returns this run's keys and
    values as ``Run.kv`` (a full run: no prefix, resume or stop). ``position_ids`` (``"batch pos"``,
    without ``prefix``) places the tokens at other positions, e.g. one token per example at its own.
    With ``attention_mask`` (``"batch pos"`` over every position) a padded row counts its positions
    from its first real token, in full and suffix runs alike.
    """
    patches = list(patches)
    if keep_kv and (prefix is not None or resume is not None or stop):
        raise ValueError("keep_kv needs a full run: no prefix, resume or stop")
    length = input_ids.shape[1]
    if prefix is not None:
        check_suffix_support(model)
        first = suffix_start(patches, readout, length)
        start = first if start is None else start
        if not 0 <= start <= first:
            raise ValueError(f"start {start} lies after the first patched or read-out position {first}")
        if prefix.length < start:
            raise ValueError(f"the prefix holds {prefix.length} positions, fewer than start {start}")
    else:
        start = 0
    by_site: dict[tuple[str, int], list[Patch]] = defaultdict(list)
    for p in patches:
        by_site[(p.kind, p.layer)].append(_shifted(p, start))
    sites = sorted(set(by_site) | set(capture), key=lambda s: (s[1], SITE_ORDER[s[0]]))
    if resume is not None and sites and sites[0][1] < resume.layer:
        raise ValueError(
            f"site {sites[0]} lies before the resumed layer {resume.layer}; resume at or before "
            "the first patched or captured layer"
        )
    arch, nn = model.arch, model.nn
    device = model.device
    if position_ids is not None and prefix is not None:
        raise ValueError("position_ids are derived in a suffix run; give either position_ids or prefix")
    kwargs = _inputs(input_ids.to(device), attention_mask, prefix, start, device)
    if position_ids is not None:
        kwargs["position_ids"] = position_ids.to(device)
    if keep_kv:  # full-attention cache layers: a sliding-window layer would keep only its window
        kwargs.update(use_cache=True, cache=Cache(layers=[DynamicLayer() for _ in range(model.shape.n_layers)]))
    if readout is None:
        kwargs["logits_to_keep"] = 1
    else:
        readout = readout - start
        if readout.ndim == 2:  # several read-outs each: the logits from the earliest on
            kwargs["logits_to_keep"] = length - start - int(readout.min())
            readout = readout - int(readout.min())
    captured: dict = {}
    with torch.set_grad_enabled(grad):
        out = None
        with model.trace(**kwargs) as tracer:  # on NDIF when the model is remote (see models.remote)
            fused_seen: dict[int, torch.Tensor] = {}
            if resume is not None:
                hidden = _suffix_hidden(resume.hidden, input_ids.shape[0], length, start).to(device)
                for layer in range(resume.layer):
                    arch.block(nn, layer).skip(hidden)
            for kind, layer in sites:
                site = _site(arch, nn, kind, layer, fused_seen)
                for p in by_site.get((kind, layer), ()):
                    p.apply(site)
                if (kind, layer) in capture:
                    captured[(kind, layer)] = site if grad else site.clone()
            if stop:
                captured = captured.save() if hasattr(captured, "save") else captured
                tracer.stop()
            logits = nn.output.logits
            if readout is None:
                out = logits[:, -1]
            elif readout.ndim == 2:
                out = logits[torch.arange(logits.shape[0], device=logits.device)[:, None], readout.to(logits.device)]
            else:
                out = logits[torch.arange(logits.shape[0], device=logits.device), readout.to(logits.device)]
            out = out.save()
            captured = captured.save() if hasattr(captured, "save") else captured
            if keep_kv:
                keys, values = _kept_kv(nn.output)
    return Run(out, captured, start, Prefix(keys, values) if keep_kv else None)


def answer_logits(
    model: LoadedModel, input_ids: torch.Tensor, answer_tokens: torch.Tensor, patches: Iterable[Patch] = ()
) -> torch.Tensor:
    """Teacher forcing: the logits ``"batch a vocab"`` predicting each of ``answer_tokens`` (``"batch a"``) after
    the prompts ``input_ids`` (``"batch pos"``). One run on the prompt with the answer's tokens but its last
    appended (causal attention: the appended tokens change nothing at the prompt's positions); ``patches`` write
    the prompt's positions only (`prompt_patch`), so positions the task names (``last`` included) are
    the prompt's as before. Position ``pos - 1 + i`` predicts answer token ``i``."""
    length, a = input_ids.shape[1], answer_tokens.shape[1]
    ids = torch.cat([input_ids, answer_tokens[:, :-1].to(input_ids.device)], 1)
    readout = (length - 1 + torch.arange(a))[None].expand(ids.shape[0], -1)
    return run(model, ids, [prompt_patch(p, length) for p in patches], readout=readout).logits


@dataclass(frozen=True)
class Continuations:
    """Answers of several tokens teacher-forced in stacked runs: each prompt's answers (its answer, then for a
    ``logit_diff`` metric each of its ``k`` alternatives) stacked along the batch, ``"(c b)"`` rows of ``c`` answers
    of ``b`` prompts, each right-padded to ``w`` tokens. A row runs its prompt with its answer's tokens but the last
    appended (`answer_logits`); the prompts' positions are every row's first ``prompt_length``.

    `measure` folds a row's teacher-forced logits into each prompt's metric: ``prob``, the answer's
    probability (the product of its tokens', ``exp`` of the summed log-probability, in float64), or ``logit_diff``,
    the answer's summed log-probability minus the mean of its alternatives' (for one token, the logit difference).
    """

    tokens: torch.Tensor  # "(c b) w", right-padded
    lengths: torch.Tensor  # "(c b)"
    count: int  # c: 1 (prob) or 1 + k (logit_diff)
    prompt_length: int
    metric: str

    @property
    def prompts(self) -> int:
        return self.tokens.shape[0] // self.count

    def stack(self, t: torch.Tensor) -> torch.Tensor:
        """A prompt-level tensor ``"b ..."`` repeated for every answer, ``"(c b) ..."``."""
        return t.repeat(self.count, *([1] * (t.ndim - 1)))

    def ids(self, prompts: torch.Tensor) -> torch.Tensor:
        """The rows' run inputs ``"(c b) (pos + w - 1)"`` from the prompts ``"b pos"``."""
        if prompts.shape[1] != self.prompt_length:
            raise ValueError(f"prompts of {prompts.shape[1]} tokens; these continuations follow {self.prompt_length}")
        return torch.cat([self.stack(prompts), self.tokens[:, :-1].to(prompts.device)], 1)

    def readout(self, copies: int = 1) -> torch.Tensor:
        """The positions ``"(copy c b) w"`` whose logits predict each answer token, for ``copies`` stacked copies."""
        at = self.prompt_length - 1 + torch.arange(self.tokens.shape[1])
        return at[None].expand(copies * self.tokens.shape[0], -1)

    def measure(self, logits: torch.Tensor, copies: int = 1) -> torch.Tensor:
        """Each prompt's metric ``"(copy b)"`` (float64) from the rows' logits ``"(copy c b) w vocab"``."""
        tokens, lengths = self.tokens.repeat(copies, 1), self.lengths.repeat(copies)
        logp = sequence_logprob(logits, tokens, lengths).double()
        logp = logp.reshape(copies, self.count, self.prompts)
        if self.metric == "prob":
            out = logp[:, 0].exp()
        else:
            out = logp[:, 0] - logp[:, 1:].mean(1)
        return out.reshape(-1)


def continuations(
    answers: Sequence[Sequence[int]],
    alternatives: Optional[Sequence[Sequence[Sequence[int]]]],
    metric: str,
    prompt_length: int,
) -> Optional[Continuations]:
    """The `Continuations` of prompts whose answers (and, for ``logit_diff``, ``alternatives``: ``k`` token
    lists per prompt) are token lists; None where every one is one token (read at the prompt's last position)."""
    metric = metric_name(metric)
    if metric not in ("prob", "logit_diff"):
        raise ValueError(f"answers of several tokens are scored under prob or logit_diff, not {metric!r}")
    rows = [list(a) for a in answers]
    if metric == "logit_diff":
        if alternatives is None or not all(alternatives) or len({len(a) for a in alternatives}) != 1:
            raise ValueError("metric logit_diff needs the same number of alternative answers for every prompt")
        rows += [list(alt[j]) for j in range(len(alternatives[0])) for alt in alternatives]
    if max(len(r) for r in rows) == 1:
        return None
    width = max(len(r) for r in rows)
    tokens = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.long)
    lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
    return Continuations(tokens, lengths, len(rows) // len(answers), prompt_length, metric)


def prompt_patch(patch: Patch, length: int) -> Patch:
    """``patch`` confined to a prompt's first ``length`` positions, for a run with tokens appended after it: a
    patch of every position patches the prompt's; negative positions count from the prompt's end. A patch
    writing past the prompt is refused."""
    pos = patch.positions
    if pos is None:
        return replace(patch, positions=slice(0, length))
    if isinstance(pos, slice):
        start, stop = pos.start or 0, length if pos.stop is None else pos.stop
        start, stop = (v + length if v < 0 else v for v in (start, stop))
        if pos.step not in (None, 1) or not 0 <= start <= stop <= length:
            raise ValueError(f"patch slice {pos} of ({patch.kind}, {patch.layer}) is not within the prompt's {length}")
        return replace(patch, positions=slice(start, stop))
    pos = torch.where(pos < 0, pos + length, pos)
    if bool(((pos < 0) | (pos >= length)).any()):
        raise ValueError(f"patch of ({patch.kind}, {patch.layer}) writes outside the prompt's {length} positions")
    return replace(patch, positions=pos)


SUFFIX_LAYER_TYPES = {"full_attention", "sliding_attention"}  # attention layers a suffix run is tested exact on


def suffix_supported(model: LoadedModel) -> bool:
    """Whether suffix runs are exact on ``model`` (`check_suffix_support` would pass)."""
    try:
        check_suffix_support(model)
    except ValueError:
        return False
    return True


def check_suffix_support(model: LoadedModel) -> None:
    """Refuse a suffix run on a model whose layers are not all (full or sliding-window) attention, or whose
    forward carries a recurrent state: earlier positions would not be read from the keys and values alone."""
    hf = model.model
    config = hf.config.get_text_config() if hasattr(hf.config, "get_text_config") else hf.config
    family = getattr(config, "model_type", type(hf).__name__)
    other = sorted(set(getattr(config, "layer_types", None) or ()) - SUFFIX_LAYER_TYPES)
    reason = (
        f"its layers include {other}"
        if other
        else "it carries a recurrent state"
        if getattr(hf, "_is_stateful", False)
        else None
    )
    if reason:
        raise ValueError(
            f"{model.name} ({family}): suffix runs (prefix=) are exact only over attention layers' keys "
            f"and values, and {reason}; run without a prefix (full-length runs)"
        )


def suffix_start(patches: Sequence[Patch], readout: Optional[torch.Tensor], length: int) -> int:
    """The first position a run must compute: the earliest position a patch writes or ``readout`` reads
    (the last position when ``readout`` is ``None``); 0 if a patch writes every position."""
    first = length - 1 if readout is None else int(readout.min())
    for p in patches:
        if p.positions is None:
            return 0
        at = (p.positions.start or 0) if isinstance(p.positions, slice) else int(p.positions.min())
        first = min(first, at if at >= 0 else at + length)
    return first


def _shifted(patch: Patch, start: int) -> Patch:
    """``patch`` with its positions counted from ``start`` (the first position of a suffix run)."""
    if start == 0:
        return patch
    pos = patch.positions
    if pos is None:
        raise ValueError(f"a patch of every position ({patch.kind}, {patch.layer}) needs start=0")
    if isinstance(pos, slice):
        if pos.step not in (None, 1) or (pos.start or 0) < start:
            raise ValueError(f"patch slice {pos} of ({patch.kind}, {patch.layer}) starts before position {start}")
        return replace(patch, positions=slice(pos.start - start, None if pos.stop is None else pos.stop - start))
    return replace(patch, positions=pos - start)


def _inputs(
    input_ids: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    prefix: Optional[Prefix],
    start: int,
    device: torch.device,
) -> dict:
    """The model's keyword arguments: a full run, or a suffix run from ``start`` over ``prefix``."""
    kwargs: dict = {"input_ids": input_ids[:, start:], "use_cache": start > 0}
    position_ids = None
    if attention_mask is not None:
        attention_mask = attention_mask.to(device)
        kwargs["attention_mask"] = attention_mask
        if not bool(attention_mask.all()):  # padded rows count from their first real token
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    if start > 0:
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=device)[None]
        kwargs["cache"] = prefix_cache(prefix, start)
        # A mask over prefix and suffix: nnsight's remote wrapper would otherwise make one of the suffix's width.
        kwargs.setdefault("attention_mask", torch.ones_like(input_ids))
    if position_ids is not None:
        kwargs["position_ids"] = position_ids[:, start:]
    return kwargs


def _suffix_hidden(hidden: torch.Tensor, batch: int, length: int, start: int) -> torch.Tensor:
    """A resumed residual stream cut to the suffix and stacked to ``batch`` rows."""
    if hidden.shape[1] == length and start > 0:
        hidden = hidden[:, start:]
    elif hidden.shape[1] != length - start:
        raise ValueError(
            f"resume.hidden covers {hidden.shape[1]} positions; expected {length} or the suffix's {length - start}"
        )
    if hidden.shape[0] != batch:
        if batch % hidden.shape[0]:
            raise ValueError(f"resume.hidden has batch {hidden.shape[0]}, which does not divide {batch}")
        hidden = hidden.repeat(batch // hidden.shape[0], 1, 1)
    return hidden


def _kept_kv(output) -> tuple[list, list]:
    """Keys and values of every layer from a model output's cache (``cache``, or ``past_key_values``)."""
    cache = getattr(output, "cache", None)
    if cache is None:
        cache = output.past_key_values
    keys, values = [layer.keys for layer in cache.layers], [layer.values for layer in cache.layers]
    return nnsight.save(keys), nnsight.save(values)


def prefix_cache(prefix: Prefix, start: int):
    """A transformers ``Cache`` over ``prefix``'s positions ``< start`` that is read, never written: each
    layer's ``update`` returns prefix + new keys/values (the prefix repeated over stacked copies)."""
    return Cache(
        layers=[_PrefixLayer(k[..., :start, :], v[..., :start, :]) for k, v in zip(prefix.keys, prefix.values)]
    )


class _PrefixLayer(DynamicLayer):
    """A cache layer holding a fixed prefix: ``update`` joins it to the new keys/values and stores nothing."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self.keys, self.values, self.device, self.is_initialized = keys, values, keys.device, True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        return _join(self.keys, key_states), _join(self.values, value_states)


def _join(prefix: torch.Tensor, new: torch.Tensor) -> torch.Tensor:
    """``"b h p d"`` prefix + ``"(copy b) h q d"`` new -> ``"(copy b) h (p+q) d"``, one allocation."""
    n, p = prefix.shape[0], prefix.shape[-2]
    b, h, q, d = new.shape
    if b % n:
        raise ValueError(f"a suffix run of batch {b} cannot stack a prefix of batch {n}")
    out = new.new_empty(b, h, p + q, d)
    out.view(b // n, n, h, p + q, d)[..., :p, :] = prefix.to(new.dtype)
    out[..., p:, :] = new
    return out


def _site(arch, nn, kind: str, layer: int, fused_seen: dict) -> torch.Tensor:
    """A site's tensor; fused Q/K/V projections are fetched once per layer; ``emb`` is the embedding output."""
    if kind == "emb":
        from ..models.architectures import get_path

        return get_path(nn, arch.embed).output
    if kind == "resid":
        return arch.block(nn, layer).output
    if kind in ("q", "k", "v") and arch.qkv_layout != "separate":
        if layer not in fused_seen:
            fused_seen[layer] = arch.site(nn, kind, layer)
        return fused_seen[layer]
    return arch.site(nn, kind, layer)


# ---- a forward whose body reads and writes the adapter's sites (the knowledge edge forward) ----------------


class Sites:
    """The sites of one traced forward, handed to a `trace_sites` body; read and write them in
    execution order (per layer: Q/K/V, z, the attention's residual contribution, the MLP input, the
    MLP's contribution; then the final norm and the logits). Tensors are ``"batch pos columns"``."""

    def __init__(self, model: LoadedModel, nn) -> None:
        self.arch, self.nn, self.shape = model.arch, nn, model.shape

    def resid_in(self, layer: int) -> torch.Tensor:
        """The residual stream entering block ``layer`` (block 0: embeddings, position embeddings included)."""
        return self.arch.block(self.nn, layer).input

    def write_qkv(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Overwrite the Q/K/V projection outputs of ``layer`` (before any Q/K norm or rotary embedding) with
        ``q`` ``"batch pos (head d_head)"`` and ``k``, ``v`` ``"batch pos (group d_head)"``."""
        arch = self.arch
        if arch.qkv_layout == "separate":
            for kind, value in (("q", q), ("k", k), ("v", v)):
                arch.projection(self.nn, kind, layer).output[:] = value
            return
        fused = torch.cat([q, k, v], -1)[..., fused_order(arch, self.shape).to(q.device)]
        arch.projection(self.nn, "q", layer).output[:] = fused

    def z(self, layer: int) -> torch.Tensor:
        """The input of the attention output projection, ``"batch pos (head d_head)"``."""
        return self.arch.site(self.nn, "z", layer)

    def attn_post_norm(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Input and output of the norm applied to the attention output (Gemma 2/3, OLMo 2)."""
        norm = _path(self.arch.block(self.nn, layer), self.arch.attn_post_norm)
        return norm.input, norm.output

    def write_mlp_in(self, layer: int, value: torch.Tensor) -> None:
        """Replace what the MLP of ``layer`` reads (the output of the norm before it)."""
        _path(self.arch.block(self.nn, layer), self.arch.mlp).input = value

    def mlp_out(self, layer: int) -> torch.Tensor:
        """The MLP's contribution to the residual stream (after its post-norm, if the block has one)."""
        block = self.arch.block(self.nn, layer)
        out = _path(block, self.arch.mlp_post_norm or self.arch.mlp).output
        return out[0] if isinstance(out, tuple) else out

    def write_final_norm(self, value: torch.Tensor) -> None:
        self.arch.final_norm_module(self.nn).output[:] = value

    def logits(self) -> torch.Tensor:
        """``"batch vocab"`` at the last position."""
        return self.nn.output.logits[:, -1]


def _path(root, path: str):
    from ..models.architectures import get_path

    return get_path(root, path)


def fused_order(arch, shape) -> torch.Tensor:
    """Column ``c`` of a fused Q/K/V output is column ``order[c]`` of ``cat([q "(head d)", k "(group d)",
    v "(group d)"])`` (the identity for the ``fused`` layout, a permutation for ``interleaved``)."""
    d, H, G = shape.d_head, shape.n_heads, shape.n_kv_heads
    order = torch.empty((H + 2 * G) * d, dtype=torch.long)
    for kind, base, units in (
        ("q", 0, range(H)),
        ("k", H * d, range(0, H, H // G)),
        ("v", (H + G) * d, range(0, H, H // G)),
    ):
        for i, head in enumerate(units):
            cols = arch.columns(kind, head, shape)
            order[cols] = torch.arange(base + i * d, base + (i + 1) * d)
    return order


def trace_sites(model: LoadedModel, input_ids: torch.Tensor, body, grad: bool = False, resume: Optional[Resume] = None):
    """Run ``model`` on ``input_ids`` (logits at the last position only) with ``body(Sites)`` reading and
    writing sites inside the trace; returns what ``body`` returns. ``grad``: keep the autograd graph.
    ``resume``: skip the blocks before ``resume.layer`` (``body`` then touches only later sites)."""
    kwargs = {"input_ids": input_ids.to(model.device), "use_cache": False, "logits_to_keep": 1}
    box: dict = {}
    with torch.set_grad_enabled(grad), model.trace(**kwargs):
        if resume is not None:
            hidden = resume.hidden.to(model.device)
            for layer in range(resume.layer):
                model.arch.block(model.nn, layer).skip(hidden)
        box["out"] = body(Sites(model, model.nn))
    return box["out"]
