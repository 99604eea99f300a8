"""Knowledge relations as tasks: ``mechdiff eval/scan/circuit --task country_capital`` and the circuits study
(``[task] name = "country_capital"``) run on any relation under ``mechdiff/data/knowledge`` (or a relation
file in the LRE format, ``--task my_relation.json``).

A relation (`Relation`: subject -> object facts and prompt templates) gives
one record per fact and template: the prompt ``template.format(subject)`` tokenised whole, as every task's
prompts are, and the answer the first token the model should write after it (the first token of
``" " + object`` continuing the prompt: first-token accuracy, the rule of the LRE data and of
`mechdiff.methods.knowledge`). Each record names three token positions:

- ``subject``: the subject's last token (where factual recall enriches the subject: Meng et al. 2022,
  Geva et al. 2023);
- ``relation``: the template token nearest the read-out that is neither a subject token nor the last
  (``of`` in "The capital of France is", ``city`` in "France's capital city is");
- ``last``: the last token (the read-out).

Position classes are derived from them (`derived_classes`: ``before``,
``subject``, ``after_subject``, ``relation``, ``after_relation``, ``last``): a partition of every prompt by
its named tokens, so a multi-token subject's earlier tokens fall in ``before`` (templates that open with
the subject) or in ``after_relation`` (templates that name the relation first). A record's ``template`` is
its template text, so records are batched, and mean-ablated, within one (template, token length) group.

Counterfactual pairs (discovery, scans, DCM) put each fact beside another subject of the same relation,
the same template and the same token length whose answer token differs; discovery's target is the clean
answer, the DCM desideratum ``subject`` targets the counterfactual's. A fact whose group holds no such
partner is left out of the pairs (logged); a relation whose groups hold none at all is refused.

A relation has a fixed set of facts (``country_capital``: 55 facts x 2 templates). ``records(n, seed)`` is a
seeded permutation of all its prompts cut to ``n``: prompt sets of different seeds overlap once ``n``
exceeds half the prompts, so a study's evaluation, discovery and scoring sets of one relation are not
disjoint, unlike entity tracking's generated prompts.
"""

from __future__ import annotations

import functools
import logging
import random
from pathlib import Path
from typing import Any

from .base import Task
from .records import Example, Pair, derived_class_names, group_key, group_name
from .relation_data import Relation
from .row_checks import encode_offsets, locate

log = logging.getLogger(__name__)

POSITIONS = ("subject", "relation", "last")
PLAN = Path(__file__).resolve().parent / "plans" / "knowledge.toml"
GROUP_NAMES = {"EXT": "attribute extraction", "QRY": "query builder", "ENR": "subject enrichment"}


def fact_record(tokenizer: Any, template: str, subject: str, obj: str) -> Example:
    """The record of one fact under one template (raises ValueError where the subject does not sit on token
    boundaries, the template holds no relation token but the last, or the answer merges with the prompt)."""
    prompt = template.format(subject)
    ids, offsets = encode_offsets(tokenizer, prompt)
    start = template.index("{}")
    subject_last = locate(prompt, offsets, [start, start + len(subject)], "subject")
    subject_tokens = {t for t, (a, b) in enumerate(offsets) if b > a and a < start + len(subject) and b > start}
    last = len(ids) - 1
    if subject_last == last:
        raise ValueError(f"{prompt!r}: the subject is the prompt's last token; a template must end in relation words")
    relation = [t for t in range(last) if t not in subject_tokens and offsets[t][1] > offsets[t][0]]
    if not relation:
        raise ValueError(f"template {template!r} has no relation token besides the last one; reword it")
    full = [int(i) for i in tokenizer(prompt + " " + obj)["input_ids"]]
    if full[: len(ids)] != ids or len(full) == len(ids):
        raise ValueError(f"{prompt!r}: the answer {' ' + obj!r} merges with the prompt's last token")
    answer_id = full[len(ids)]
    return Example(
        prompt,
        tuple(ids),
        tokenizer.decode([answer_id]),
        answer_id,
        {"subject": subject_last, "relation": relation[-1], "last": last},
        template=template,
    )


class RelationTask:
    """One relation's records and counterfactual pairs (each call re-tokenises: a few ms for ~100 prompts)."""

    def __init__(self, relation: Relation, name: str = "") -> None:
        self.relation = relation
        self.name = name or relation.name

    def all_records(self, tokenizer: Any) -> list[Example]:
        """Every fact under every template, in file order; facts that cannot be records are logged and left out."""
        out, skipped = [], []
        for template in self.relation.prompt_templates:
            for sample in self.relation.samples:
                try:
                    out.append(fact_record(tokenizer, template, sample["subject"], sample["object"]))
                except ValueError as err:
                    skipped.append(str(err))
        if skipped:
            log.warning(
                "relation %s: %d of %d prompts left out: %s",
                self.name,
                len(skipped),
                len(skipped) + len(out),
                "; ".join(skipped[:3]) + ("; ..." if len(skipped) > 3 else ""),
            )
        if not out:
            raise ValueError(f"relation {self.name}: no fact gives a record under this tokenizer")
        return out

    def _order(self, records: list, seed: int) -> list:
        order = list(range(len(records)))
        random.Random(f"{self.name}:{seed}").shuffle(order)
        return [records[i] for i in order]

    def records(self, tokenizer: Any, n: int, seed: int = 0) -> list[Example]:
        """``n`` prompts: a permutation of every prompt (seeded) cut to ``n`` (all of them where ``n`` exceeds it)."""
        if n < 1:
            raise ValueError("n must be at least 1")
        records = self._order(self.all_records(tokenizer), seed)
        if n > len(records):
            log.info("relation %s has %d prompts; using all of them (asked for %d)", self.name, len(records), n)
        return records[:n]

    def pairs(self, tokenizer: Any, n: int, seed: int = 0, target: str = "clean") -> list[Pair]:
        """``n`` counterfactual pairs: each prompt (seeded order) beside a random other subject of its group
        (template and token length) whose answer differs; target the clean answer, or (``"source"``) the
        counterfactual's."""
        if n < 1:
            raise ValueError("n must be at least 1")
        records = self._order(self.all_records(tokenizer), seed)
        groups: dict = {}
        for r in records:
            groups.setdefault(group_key(r), []).append(r)
        rng = random.Random(f"{self.name}:{seed}:pairs")
        out, alone = [], []
        for r in records:
            partners = [s for s in groups[group_key(r)] if s.answer_id != r.answer_id]
            if not partners:
                alone.append(r)
                continue
            s = rng.choice(partners)
            tid = r.answer_id if target == "clean" else s.answer_id
            out.append(Pair(r, s, tokenizer.decode([tid]), tid, "subject"))
        if not out:
            sizes = "; ".join(f"{group_name(k)}: {len(v)} fact(s)" for k, v in groups.items())
            raise ValueError(
                f"relation {self.name} gives no counterfactual pair: patching needs two facts "
                f"of one template and one token length with different answers, and its groups are "
                f"{sizes}; add facts of equal length, or use `mechdiff eval` (no pairs needed)"
            )
        if alone:
            log.info(
                "relation %s: %d of %d prompts have no partner of their template and length with another "
                "answer; left out of the pairs",
                self.name,
                len(alone),
                len(records),
            )
        if n > len(out):
            log.info("relation %s gives %d pairs; using all of them (asked for %d)", self.name, len(out), n)
        return out[:n]

    def task(self) -> Task:
        r = self.relation
        example = r.prompt_templates[0].format(r.samples[0]["subject"])
        return Task(
            name=self.name,
            description=f"knowledge relation {self.name} ({r.relation_type}; {len(r.samples)} facts x "
            f"{len(r.prompt_templates)} templates, e.g. {example!r})",
            examples=self.records,
            pairs=self.pairs,
            reference=self.records,
            desiderata={"subject": lambda tok, n, seed=0: self.pairs(tok, n, seed, target="source")},
            plan=PLAN,
            metric="prob",
            positions=tuple(dict.fromkeys([*POSITIONS, *derived_class_names(POSITIONS)])),
            group_names=GROUP_NAMES,
        )


@functools.cache
def relation_task(name: str) -> Task:
    """The task of the relation ``name`` (``mechdiff/data/knowledge/<name>.json``) or of a relation JSON file."""
    relation = Relation.load(name)
    return RelationTask(relation, relation.name if name.endswith(".json") else name).task()
