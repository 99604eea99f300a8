"""Path patching (Wang et al. 2022; Prakash et al. 2024), exact, several senders per forward pass.

For one sender head at its sender position:

1. *frozen run*: the clean prompt, the sender's ``z`` slice set to its counterfactual value
   at the sender position, every other head's ``z`` frozen to its clean value (MLPs
   recomputed); the receivers' Q (or V) at the receiver position is captured.
2. *receiver run*: the clean prompt with the receivers' Q/V at the receiver position
   overwritten by what the frozen run produced.

Score = ``(mean p_patched - mean p_clean) / mean p_clean`` on the answer token over the batch, ``p`` the task's
metric (the answer's probability, or for a ``logit_diff`` task the answer's logit minus the mean of its
alternatives') (``score="ratio_of_means"``, mechdiff's: stable where one prompt's clean probability is tiny), or the
paper's ``mean over prompts of (p_patched - p_clean) / p_clean`` (``score="mean_of_ratios"``, Prakash et al.'s
``experiment_1/path_patching.py``); the two can order the senders differently (`sender_score`). Without
receivers (step A: senders -> logits) the frozen run's own logits are read.

Freezing is applied from the earliest sender position on: positions before it cannot see
the sender (causal attention), so they equal the clean run already. Both runs compute only what
the patch can change, from the lowest sender or receiver layer on (resumed from the clean residual
stream, `Resume`). With every head's z frozen, the frozen run's
residual stream differs from the clean one only at the sender position, so where the receivers
sit there (or the logits are read there) the frozen run computes that one position per example;
otherwise positions from the earliest sender on. The receiver run computes the positions from
the earliest receiver position on. Earlier positions' keys and values come from the clean run's
cache (a suffix run, `Prefix`).
Senders are copies of the batch stacked along the batch dimension (``senders_per_pass`` at a
time), each copy's sender written by one indexed assignment (no per-head loop). Under grouped-query
attention V (and K) belongs to a KV group: patching a receiver's V patches its whole group
(all query heads that share it); `receiver_sites` merges receivers of one group.

By default a sender's counterfactual value is read at the clean prompt's sender index. ``source_position`` names a
position of the counterfactual prompt to read it at instead; a position class (one index per segment, e.g. entity
tracking's ``labels``) is drawn from at random, independently for each sender and prompt (`source_indices`).
The paper reads group D's sender, whose query label the counterfactual lacks, at a random box label
(``pp_utils.patching_sender_heads``: ``random.choice(range(6, 49, 7))``, one draw per sender and prompt).

Answers of several tokens are teacher-forced (`Continuations`): each pair's target
(and under ``logit_diff`` each alternative of its clean prompt) is a row of the batch running the prompt with the
answer's tokens but its last appended; ``p`` is the answer's probability (the product of its tokens') or its summed
log-probability minus the alternatives' mean. Senders and receivers are written at the prompt's positions only;
every other head is frozen at every position, the appended ones included (mechdiff's extension of the one-token
definition), so step A's frozen point run gives the first answer token's logits and the later ones are the clean
run's. A pair's rows share its sender draws; scores are per pair.

Pairs of several token lengths or templates are prepared group by group
(`grouped_batches`, one `PairBatch` each, held by `PairBatches`);
each group is patched on its own and the score is the same ratio of means over every prompt. With a part size
(``[discovery] pairs_per_part``) each group is split in order into parts held one at a time (`PairStream`):
a part's clean and counterfactual runs are computed when it is reached and dropped after it, so memory follows the
part, not the number of pairs. Those runs (`prepare`) are `mechdiff.patching.path_pairs`.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from typing import Optional, Sequence, Union

import torch
from einops import rearrange, repeat

from ..common.components import Head
from ..common.progress import progress_bar
from ..models.footprint import held_pair_bytes
from ..models.loading import LoadedModel
from ..models.memory import MAX_BATCH, auto_batch_size
from ..models.remote import keep
from .core import Patch, Prefix, Resume, run
from .path_pairs import PairBatch, PairBatches, PairStream, parts

log = logging.getLogger(__name__)

#: How a sender's per-prompt answer probabilities become its score: mechdiff's ratio of means (the default) or
#: the paper's mean of per-prompt relative changes.
SCORES = ("ratio_of_means", "mean_of_ratios")
SENDERS_PER_PASS = 8  # sender copies stacked in one pass on CPU and remote models (and path_patch's default)


@dataclass(frozen=True)
class Receivers:
    """Receiver heads, the site read on them (``q`` or ``v``; ``k`` allowed) and their position name."""

    heads: tuple[Head, ...]
    kind: str
    position: str

    def __post_init__(self) -> None:
        if self.kind not in ("q", "k", "v"):
            raise ValueError(f"receiver kind must be q, k or v, not {self.kind!r}")
        if not self.heads:
            raise ValueError("no receiver heads: path patching to receivers needs at least one")

    @property
    def max_layer(self) -> int:
        return max(h.layer for h in self.heads)


def receiver_sites(model: LoadedModel, receivers: Receivers) -> list[tuple[int, slice]]:
    """Distinct ``(layer, columns)`` written for the receivers (one per KV group for ``k``/``v``)."""
    seen: dict[tuple[int, int, int], None] = {}
    for h in receivers.heads:
        cols = model.arch.columns(receivers.kind, h.head, model.shape)
        seen.setdefault((h.layer, cols.start, cols.stop), None)
    merged = len(receivers.heads) - len(seen)
    if merged:
        log.info(
            "GQA: %d receiver heads share KV groups; patching %s patches whole groups (%d sites)",
            merged,
            receivers.kind.upper(),
            len(seen),
        )
    return [(layer, slice(a, b)) for layer, a, b in seen]


def eligible_senders(model: LoadedModel, receivers: Optional[Receivers]) -> list[Head]:
    """Heads that can affect the receivers: every head in a layer below the deepest receiver."""
    top = model.shape.n_layers if receivers is None else receivers.max_layer
    return [Head(l, h) for l in range(top) for h in range(model.shape.n_heads)]


def check_score(score: str) -> None:
    """Refuse a path-patching score that is not one of `SCORES`."""
    if score not in SCORES:
        raise ValueError(f"unknown path-patching score {score!r}; the scores are {', '.join(SCORES)}")


def sender_score(patched: torch.Tensor, clean: torch.Tensor, score: str = SCORES[0]) -> float:
    """One sender's score from its patched and the clean answer probabilities (``"batch"`` each): the ratio of
    means ``(mean patched - mean clean) / mean clean`` or the mean of ratios ``mean((patched - clean) / clean)``."""
    check_score(score)
    if score == "mean_of_ratios":
        return float(((patched - clean) / clean).mean())
    return float((patched.mean() - clean.mean()) / clean.mean())


def path_patch(
    model: LoadedModel,
    batch: Union[PairBatch, PairBatches, PairStream],
    senders: Sequence[Head],
    sender_position: str,
    receivers: Optional[Receivers] = None,
    senders_per_pass: int = SENDERS_PER_PASS,
    progress: bool = True,
    score: str = SCORES[0],
    source_position: Optional[str] = None,
    seed: int = 0,
) -> dict[Head, float]:
    """The path-patching score of each sender (see the module docstring; ``score``: one of `SCORES`).
    ``source_position``: where the counterfactual value is read (None: the clean sender index; a position class:
    a random one of its indices per sender and prompt, drawn from ``seed``, `source_indices`)."""
    check_score(score)  # before any forward pass
    out: dict[Head, float] = {}
    chunks = [list(senders[i : i + senders_per_pass]) for i in range(0, len(senders), senders_per_pass)]
    p_clean = batch.p_clean
    bar = progress and not model.remote  # remote: the step is one request, there is nothing to show per chunk
    per_group = []
    places = iter(batch.places) if isinstance(batch, PairStream) else None
    # each group (length) patched alone, the score over every prompt; no enumerate: its reused result tuple would
    # keep a streamed part alive while the next is prepared
    for part in parts(batch):
        group, offset, total = next(places) if places else (len(per_group), 0, part.pairs)
        src = [source_indices(model, part, c, source_position, f"{seed}:{group}", (offset, total)) for c in chunks]
        with model.session():  # remote: the whole step (every chunk's frozen and receiver runs) in one request
            per_group.append(keep(_chunk_probs(model, part, chunks, sender_position, receivers, bar, src)))
        del part, src  # a streamed part is freed before the next is prepared
    probs = [torch.cat(ps, dim=1) for ps in zip(*per_group)]
    for chunk, p in zip(chunks, probs):  # p: "sender batch"
        for head, ps in zip(chunk, p):
            out[head] = sender_score(ps, p_clean, score)
    return out


def source_indices(
    model: LoadedModel,
    batch: PairBatch,
    senders: Sequence[Head],
    position: Optional[str],
    seed: str = "0",
    within: Optional[tuple[int, int]] = None,
) -> Optional[torch.Tensor]:
    """Where each sender's counterfactual value is read in each source prompt (``"sender batch"``), or None (at
    the clean prompt's sender index, mechdiff's default). A one-index ``position`` of the source is read as it is;
    a position class (``"batch k"``) gives one of its ``k`` indices at random per sender and prompt, drawn from a
    table of every head of the model seeded by ``seed``, so a sender's draw does not depend on which others are
    patched or how many share a pass (the paper: ``random.choice`` per sender and prompt). ``within``: the batch's
    first pair's offset in its group and the group's pairs, for a part of a group (`PairStream`): its
    columns of the group's table, so a pair's draws do not depend on how its group is split."""
    if position is None:
        return None
    known = batch.source_positions or {}
    if position not in known:
        raise ValueError(f"unknown source position {position!r}; the sources record {sorted(known)}")
    where = known[position]
    if (where < 0).any():
        raise ValueError(f"source position {position!r} is missing (-1) in some counterfactual prompts")
    if where.ndim == 1:
        return repeat(where, "b -> s b", s=len(senders))
    n_heads, n = model.shape.n_heads, batch.pairs
    offset, total = within or (0, n)
    generator = torch.Generator().manual_seed(random.Random(seed).getrandbits(63))
    table = torch.randint(where.shape[1], (model.shape.n_layers * n_heads, total), generator=generator)
    picks = table[torch.tensor([h.layer * n_heads + h.head for h in senders], dtype=torch.long)]  # "sender pair"
    picks = picks[:, offset : offset + n]  # "sender batch"
    drawn = where[torch.arange(n)[None], picks]
    # teacher-forced rows "(c b)": one draw per pair, the same in each of its answers' rows
    return drawn if batch.forced is None else batch.forced.stack(drawn.T).T


def auto_senders_per_pass(model: LoadedModel, batch: Union[PairBatch, PairBatches, PairStream]) -> int:
    """Sender copies per pass sized by free GPU memory, as ``--batch-size auto`` sizes prompts per pass:
    the prompts that fit (`auto_batch_size` at this batch's length) over
    the batch's prompts, at least 1; `SENDERS_PER_PASS` on CPU and for remote models. Of a
    `PairStream` (no part held while it sizes) the largest part's activations are kept free."""
    shapes = batch.shapes if isinstance(batch, PairStream) else [tuple(p.clean_ids.shape) for p in parts(batch)]
    n, tokens = max(shapes, key=lambda shape: shape[0] * shape[1])
    reserve = 0
    if isinstance(batch, PairStream):
        s, value = model.shape, next(model.model.parameters()).element_size()
        reserve = n * held_pair_bytes(s.n_layers, s.d_model, 2 * s.n_kv_heads * s.d_head, tokens, value)
    rows = auto_batch_size(
        model,
        seq_len=tokens,
        default=n * SENDERS_PER_PASS,
        cap=max(MAX_BATCH, n * SENDERS_PER_PASS),
        reserve=reserve,
    )
    return max(1, rows // n)


def _chunk_probs(
    model: LoadedModel,
    batch: PairBatch,
    chunks: list[list[Head]],
    sender_position: str,
    receivers: Optional[Receivers],
    progress: bool,
    sources: Sequence[Optional[torch.Tensor]],
) -> list[torch.Tensor]:
    """`_patched_prob` of every chunk of senders (``"sender batch"`` each; ``sources``: each chunk's
    `source_indices`), on the model's side."""
    chunked = progress_bar(
        list(zip(chunks, sources)), desc=f"path patching {sender_position}", disable=not progress, leave=False
    )
    return [_patched_prob(model, batch, chunk, sender_position, receivers, src) for chunk, src in chunked]


def _patched_prob(
    model: LoadedModel,
    batch: PairBatch,
    senders: list[Head],
    sender_position: str,
    receivers: Optional[Receivers],
    src: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Answer probability after path patching each sender: ``"sender batch"`` (``src``: `source_indices`)."""
    n, s = len(batch), len(senders)
    spos = batch_position(batch, sender_position)
    src = repeat(spos, "b -> s b", s=s) if src is None else src
    if receivers is not None and any(h.layer >= receivers.max_layer for h in senders):
        raise ValueError(f"senders must lie below the deepest receiver layer {receivers.max_layer}")
    top = model.shape.n_layers if receivers is None else receivers.max_layer
    rpos = None if receivers is None else batch_position(batch, receivers.position)
    # The frozen run starts at the earliest sender position (or receiver position, where it must capture a
    # receiver before it) and at the lowest sender layer (or receiver layer, likewise).
    start = int(spos.min()) if rpos is None else min(int(spos.min()), int(rpos.min()))
    first = min([h.layer for h in senders] + ([h.layer for h in receivers.heads] if receivers else []))
    ids = repeat(batch.clean_ids, "b p -> (s b) p", s=s)
    suffix = {"prefix": batch.clean_kv} if batch.clean_kv is not None else {}
    read_at = spos.new_full(spos.shape, batch.last) if rpos is None else rpos
    point = batch.clean_kv is not None and torch.equal(spos, read_at)
    with torch.no_grad():
        if receivers is None:
            if point:
                logits = _frozen_point_run(model, batch, senders, (spos, src), range(first, top), first).logits
                logits = _with_clean_answer(batch, logits, s)
            else:
                patches = _frozen_patches(model, batch, senders, (spos, src), range(first, top), start)
                read = batch.readout(s)
                logits = run(model, ids, patches, resume=_resume(batch, first), start=start, **suffix, **read).logits
        else:
            sites = receiver_sites(model, receivers)
            capture = [(receivers.kind, l) for l in sorted({l for l, _ in sites})]
            if point:
                frozen = _frozen_point_run(model, batch, senders, (spos, src), range(first, top), first, capture)
                at = torch.zeros(n * s, dtype=torch.long)
            else:
                patches = _frozen_patches(model, batch, senders, (spos, src), range(first, top), start)
                frozen = run(
                    model, ids, patches, capture=capture, stop=True, resume=_resume(batch, first), start=start, **suffix
                )
                at = repeat(rpos, "b -> (s b)", s=s) - frozen.start
            rows = torch.arange(n * s)
            values = {
                (layer, cols.start): frozen.captured[(receivers.kind, layer)][rows, at, cols] for layer, cols in sites
            }
            # A receiver at or below every sender's layer reads its clean value: left unwritten, the run
            # resumes at the lowest receiver some sender lies below.
            sites = [(layer, cols) for layer, cols in sites if layer > min(h.layer for h in senders)]
            logits = _receiver_logits(model, batch, s, receivers.kind, sites, values, rpos)
    return batch.measure(logits, s).reshape(s, -1)


def _receiver_logits(
    model: LoadedModel,
    batch: PairBatch,
    s: int,
    kind: str,
    sites: list[tuple[int, slice]],
    values: dict[tuple[int, int], torch.Tensor],
    rpos: torch.Tensor,
) -> torch.Tensor:
    """The receiver runs of ``s`` stacked sender copies: read-out logits ``"(s b) vocab"``.

    Examples are grouped by receiver position, each group a suffix run from its own position (its rows'
    keys and values as prefix), so no example recomputes positions before its receivers."""
    n = len(batch)
    if batch.clean_kv is None:  # full-length runs: one run of every example
        groups = [torch.arange(n)]
    else:
        groups = [torch.nonzero(rpos == p).flatten() for p in torch.unique(rpos)]
    out = (
        None  # every row's read-out, filled group by group: one copy of the logits held, not each group's and two more
    )
    for g in groups:
        stacked = (torch.arange(s)[:, None] * n + g[None]).flatten()  # rows of group g in every copy, "(s g)"
        at = repeat(rpos[g], "g -> (s g)", s=s)
        writes = [Patch(kind, layer, values[(layer, cols.start)][stacked], at, cols) for layer, cols in sites]
        ids = repeat(batch.clean_ids[g], "g p -> (s g) p", s=s)
        prefix = None if batch.clean_kv is None else _rows_prefix(batch.clean_kv, g, len(groups) == 1)
        resume = _resume(batch, min(layer for layer, _ in sites)) if sites else None
        if resume is not None:
            resume = Resume(resume.layer, resume.hidden[g])
        read = {} if batch.forced is None else {"readout": batch.forced.readout(s)[stacked]}
        logits = run(model, ids, writes, resume=resume, prefix=prefix, **read).logits
        if len(groups) == 1:
            return logits
        out = logits.new_empty((n * s, *logits.shape[1:])) if out is None else out
        out[stacked] = logits
        del logits
    return out


def _with_clean_answer(batch: PairBatch, logits: torch.Tensor, s: int) -> torch.Tensor:
    """Step A's teacher-forced logits ``"(s b) w vocab"`` from a frozen point run's at the prompt's last position
    (``"(s b) vocab"``): with every head's z frozen at every position, appended answer positions included, the
    residual stream differs from the clean one only at the sender position, so the later answer tokens' logits are
    the clean run's. One-token answers: ``logits`` as they are."""
    if batch.forced is None:
        return logits
    rest = repeat(batch.clean_logits[:, 1:], "b w v -> (s b) w v", s=s).to(logits.device, logits.dtype)
    return torch.cat([logits[:, None], rest], 1)


def _rows_prefix(prefix: Prefix, rows: torch.Tensor, every: bool) -> Prefix:
    """The prefix of some examples (``every``: all of them, unchanged)."""
    if every:
        return prefix
    return Prefix([k[rows] for k in prefix.keys], [v[rows] for v in prefix.values])


def _resume(batch: PairBatch, layer: int) -> Optional[Resume]:
    """Start at ``layer`` from the clean residual stream (the driver cuts it to the suffix and stacks the copies)."""
    if layer == 0 or not batch.clean_resid:
        return None
    return Resume(layer, batch.clean_resid[layer - 1])


def _frozen_point_run(
    model: LoadedModel,
    batch: PairBatch,
    senders: list[Head],
    at: tuple[torch.Tensor, torch.Tensor],
    layers: range,
    first: int,
    capture: Sequence[tuple[str, int]] = (),
):
    """The frozen run at the sender position alone, one token per example: with every head's z frozen to
    the clean run's, the residual stream differs from the clean one only at the sender position, so
    that position (read out, or holding the receivers) is all that must be computed. Exact; attention
    there is overwritten, so no key/value prefix is read. ``at``: the clean sender index (``"batch"``) and where
    each sender's counterfactual value is read (``"sender batch"``)."""
    spos, src = at
    n, s = len(batch), len(senders)
    rows = torch.arange(n)
    patches = []
    for layer in layers:
        value = repeat(batch.clean_z[layer][rows, spos], "b c -> (s b) 1 c", s=s).clone()
        copies, heads = _layer_senders(senders, layer)
        if len(copies):
            view = rearrange(value, "(s b) 1 (h d) -> s b h d", s=s, h=model.shape.n_heads)
            view[copies[:, None], rows[None], heads[:, None]] = _source_values(model, batch, layer, src, copies, heads)
        patches.append(Patch("z", layer, value))
    ids = repeat(batch.clean_ids[rows, spos], "b -> (s b) 1", s=s)
    resume = None if first == 0 else Resume(first, batch.clean_resid[first - 1][rows, spos][:, None])
    return run(
        model,
        ids,
        patches,
        capture=capture,
        stop=bool(capture),
        resume=resume,
        position_ids=repeat(spos, "b -> (s b) 1", s=s),
    )


def _frozen_patches(
    model: LoadedModel,
    batch: PairBatch,
    senders: list[Head],
    at: tuple[torch.Tensor, torch.Tensor],
    layers: range,
    start: int,
) -> list[Patch]:
    """Each layer's z for every sender copy: clean from ``start`` on, the copy's sender slice at the clean sender
    index from the source (``at``: as `_frozen_point_run`)."""
    spos, src = at
    n, s = len(batch), len(senders)
    rows = torch.arange(n)
    patches = []
    for layer in layers:
        value = repeat(batch.clean_z[layer][:, start:], "b p c -> (s b) p c", s=s).clone()
        copies, heads = _layer_senders(senders, layer)
        if len(copies):
            view = rearrange(value, "(s b) p (h d) -> s b p h d", s=s, h=model.shape.n_heads)  # writes land in value
            view[copies[:, None], rows[None], (spos - start)[None], heads[:, None]] = _source_values(
                model, batch, layer, src, copies, heads
            )
        patches.append(Patch("z", layer, value, slice(start, None)))
    return patches


def _layer_senders(senders: list[Head], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The copies whose sender lies in ``layer`` and their head indices."""
    copies = [i for i, x in enumerate(senders) if x.layer == layer]
    return torch.tensor(copies, dtype=torch.long), torch.tensor([senders[i].head for i in copies], dtype=torch.long)


def _source_values(
    model: LoadedModel, batch: PairBatch, layer: int, src: torch.Tensor, copies: torch.Tensor, heads: torch.Tensor
) -> torch.Tensor:
    """The senders' counterfactual z (``"copy batch d_head"``): copy ``c``'s head read in each source prompt at
    ``src[c]``."""
    z = rearrange(batch.source_z[layer], "b p (h d) -> b p h d", h=model.shape.n_heads)
    return z[torch.arange(len(batch))[None], src[copies], heads[:, None]]


def batch_position(batch: PairBatch, name: str) -> torch.Tensor:
    if name not in batch.positions:
        raise ValueError(f"unknown position {name!r}; the dataset records {sorted(batch.positions)}")
    pos = batch.positions[name]
    if pos.ndim != 1 or (pos < 0).any():
        raise ValueError(f"position {name!r} is missing (-1) or not one per example in some clean prompts")
    return pos
