"""What path patching (`mechdiff.patching.path`) reads of its pairs: the clean and counterfactual runs captured once
(every layer's ``z``, the clean residual stream, keys and values and logits), one `PairBatch` per template and token
length, or a `PairStream` of parts each run again when it is reached, so memory follows the part.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional, Sequence, Union

import torch
from einops import repeat

from ..common.metrics import task_metric
from ..models.loading import LoadedModel
from ..models.remote import keep
from ..tasks.base import PairRecord, alternative_tokens, group_batches, pair_batch_tensors, take, target_tokens
from .core import Continuations, Prefix, continuations, run


@dataclass
class PairBatch:
    """Clean (base) and counterfactual (source) runs of one batch of pairs, captured once."""

    clean_ids: torch.Tensor  # "batch pos"
    source_ids: torch.Tensor  # "batch pos"
    answer_ids: torch.Tensor  # "batch"
    positions: dict[str, torch.Tensor]  # name -> "batch", from the clean (base) records
    clean_z: dict[int, torch.Tensor]  # layer -> "batch pos (head d_head)"
    source_z: dict[int, torch.Tensor]
    clean_logits: torch.Tensor  # "batch vocab" at the last token
    clean_resid: Optional[dict[int, torch.Tensor]] = None  # layer -> "batch pos d_model" after that block (for Resume)
    clean_kv: Optional[Prefix] = None  # the clean run's keys and values (for suffix runs); None: full runs
    source_positions: Optional[dict[str, torch.Tensor]] = None  # name -> "batch" or "batch k", the sources' own
    alternative_ids: Optional[torch.Tensor] = None  # "batch k": the clean prompts' alternative answers
    metric: str = "prob"  # the task's: what ``p`` is (answer probability or logit difference)
    # answers of several tokens: rows are "(c b)", each a prompt with one answer's tokens appended (teacher forcing);
    # clean_ids, clean_z, clean_resid and clean_kv cover the appended tokens, clean_logits is "(c b) w vocab"
    forced: Optional[Continuations] = None

    @property
    def p_clean(self) -> torch.Tensor:
        return self.measure(self.clean_logits)

    @property
    def pairs(self) -> int:
        """The number of pairs (rows over stacked answers)."""
        return len(self) if self.forced is None else self.forced.prompts

    @property
    def last(self) -> int:
        """The prompts' last position (where the first answer token is read)."""
        return self.clean_ids.shape[1] - 1 if self.forced is None else self.forced.prompt_length - 1

    def readout(self, copies: int = 1) -> dict:
        """``run``'s read-out argument for ``copies`` stacked copies: none (the last position) for one-token answers,
        else every position predicting an answer token."""
        return {} if self.forced is None else {"readout": self.forced.readout(copies)}

    def measure(self, logits: torch.Tensor, copies: int = 1) -> torch.Tensor:
        """The task's metric per pair ``"(copy pair)"`` of read-out logits ``"(copy batch) vocab"`` (teacher-forced:
        ``"(copy batch) w vocab"``) of ``copies`` stacked copies of the batch."""
        if self.forced is not None:
            return self.forced.measure(logits, copies)
        answers = repeat(self.answer_ids, "b -> (s b)", s=copies)
        alts = None if self.alternative_ids is None else repeat(self.alternative_ids, "b k -> (s b) k", s=copies)
        return task_metric(logits, answers, self.metric, alts)

    def __len__(self) -> int:
        return self.clean_ids.shape[0]


@dataclass
class PairBatches:
    """The `PairBatch` of each group (template, token length) of a pair set, in group order."""

    parts: list[PairBatch]

    @property
    def p_clean(self) -> torch.Tensor:
        return torch.cat([p.p_clean for p in self.parts])

    def __len__(self) -> int:
        return sum(len(p) for p in self.parts)


@dataclass
class PairStream:
    """A pair set run in parts of at most ``part_size`` pairs (each group split in order), each part's clean and
    counterfactual runs computed when the part is used and dropped after it: memory holds one part's activations,
    whatever the number of pairs, for two forwards a pair each time the parts are gone through.
    `prepare` makes one (``part_size``)."""

    model: LoadedModel
    chunks: list[list[PairRecord]]
    metric: str
    p_clean: torch.Tensor  # every pair's clean metric, part by part (read once, at construction)
    shapes: list[tuple[int, int]]  # each part's (rows, tokens): rows stack a pair's answers where they are several
    #: each part's group (its index among the groups), its first pair's offset in the group and the group's pairs:
    #: a part's random source draws are its columns of the group's (`source_indices`), as if held whole
    places: list[tuple[int, int, int]]

    def __iter__(self):
        for chunk in self.chunks:
            yield _prepare(self.model, chunk, self.metric)

    def __len__(self) -> int:
        return sum(rows for rows, _ in self.shapes)


def parts(batch: Union[PairBatch, PairBatches, PairStream]) -> Iterable[PairBatch]:
    """The one-length batches of ``batch`` (of a `PairStream`, each prepared as it is reached)."""
    if isinstance(batch, PairStream):
        return iter(batch)
    return batch.parts if isinstance(batch, PairBatches) else [batch]


def prepare(
    model: LoadedModel, pairs: Sequence[PairRecord], metric: str = "prob", part_size: Optional[int] = None
) -> Union[PairBatch, PairBatches, PairStream]:
    """Run clean and counterfactual once, capturing every layer's ``z`` (and the clean residual stream): one
    `PairBatch` where every pair has one template and length, else `PairBatches` (one per group);
    with ``part_size``, a `PairStream` of parts of at most that many pairs, each run again when it is used
    (memory bounded by the part, not by the number of pairs). ``metric``: the task's (``prob``, or ``logit_diff``
    against the clean prompts' alternatives, refused where a pair has none). A target (or alternative) of several
    tokens is teacher-forced (`Continuations`): each pair's answers are stacked rows
    whose runs append the answer's tokens but its last, the senders and receivers written at the prompt's positions
    only."""
    if metric == "logit_diff" and not all(getattr(p.base, "alternative_ids", ()) for p in pairs):
        raise ValueError("path patching under metric logit_diff needs pairs whose clean prompts have alternatives")
    if part_size is not None:
        return _stream(model, pairs, metric, part_size)
    groups = group_batches(pairs)
    if len(groups) > 1:
        return PairBatches([_prepare(model, take(pairs, rows), metric) for rows in groups])
    return _prepare(model, pairs, metric)


def _stream(model: LoadedModel, pairs: Sequence[PairRecord], metric: str, part_size: int) -> PairStream:
    """`PairStream` of ``pairs`` in parts of at most ``part_size``: each group split in order; the clean
    metric and shape of each part read by a clean run alone, one part at a time."""
    if part_size < 1:
        raise ValueError(f"part_size must be at least 1, not {part_size}")
    chunks, places, clean, shapes = [], [], [], []
    for g, rows in enumerate(group_batches(pairs)):
        for offset in range(0, len(rows), part_size):
            chunks.append(take(pairs, rows[offset : offset + part_size]))
            places.append((g, offset, len(rows)))
            part = _prepare(model, chunks[-1], metric, runs=False)
            clean.append(part.p_clean)
            shapes.append((len(part), part.clean_ids.shape[1]))
            del part  # one part alive at a time
    return PairStream(model, chunks, metric, torch.cat(clean), shapes, places)


def _prepare(model: LoadedModel, pairs: Sequence[PairRecord], metric: str = "prob", runs: bool = True) -> PairBatch:
    """The `PairBatch` of pairs of one group; ``runs=False``: the clean run's logits alone (nothing captured,
    no counterfactual run: what `_stream` reads of each part)."""
    tensors = pair_batch_tensors(pairs)
    sites = [("z", layer) for layer in range(model.shape.n_layers)] if runs else []
    resid = [("resid", layer) for layer in range(model.shape.n_layers - 1)] if runs else []
    clean_ids, source_ids = tensors["base"]["input_ids"], tensors["source"]["input_ids"]
    forced = pair_continuations(pairs, metric, clean_ids.shape[1])
    stack = (lambda t: t) if forced is None else forced.stack
    read = {} if forced is None else {"readout": forced.readout()}
    keys, values, source_z = [], [], {}  # set here: a remote session hands back only what it keeps
    with torch.no_grad():
        with model.session():  # remote: both runs in one request
            clean = run(
                model,
                clean_ids if forced is None else forced.ids(clean_ids),
                capture=sites + resid,
                keep_kv=runs,
                **read,
            )
            clean_z = keep({l: clean.captured[("z", l)] for _, l in sites})
            clean_logits = keep(clean.logits)
            clean_resid = keep({l: clean.captured[("resid", l)] for _, l in resid})
            if runs:
                keys, values = keep(clean.kv.keys), keep(clean.kv.values)
                source = run(model, source_ids, capture=sites)
                source_z = keep({l: stack(source.captured[("z", l)]) for _, l in sites})
    kv = Prefix(list(keys), list(values)) if runs else None
    if forced is not None:  # every row a pair with one of its answers appended; alternatives are rows
        return PairBatch(
            forced.ids(clean_ids),
            stack(source_ids),
            stack(tensors["target_ids"]),
            {k: stack(v) for k, v in tensors["base"]["positions"].items()},
            clean_z,
            source_z,
            clean_logits,
            clean_resid,
            kv,
            {k: stack(v) for k, v in tensors["source"]["positions"].items()},
            None,
            metric,
            forced,
        )
    return PairBatch(
        clean_ids,
        source_ids,
        tensors["target_ids"],
        tensors["base"]["positions"],
        clean_z,
        source_z,
        clean_logits,
        clean_resid,
        kv,
        tensors["source"]["positions"],
        tensors["base"].get("alternative_ids") if metric == "logit_diff" else None,
        metric,
    )


def pair_continuations(pairs: Sequence[PairRecord], metric: str, prompt_length: int) -> Optional[Continuations]:
    """The teacher-forced answers of ``pairs`` (each pair's target, then under ``logit_diff`` each alternative of
    its clean prompt), or None where every one is a token (read at the prompt's last position, as always)."""
    alternatives = [alternative_tokens(p.base) for p in pairs] if metric == "logit_diff" else None
    return continuations([target_tokens(p) for p in pairs], alternatives, metric, prompt_length)
