"""Relations in the LRE format (subject, relation template, object) and the facts built from them.

A relation file is JSON: ``{"name", "relation_type", "prompt_templates": ["The official language
of {} is", ...], "samples": [{"subject": "France", "object": "French"}, ...]}`` (the format of
Hernandez et al.'s LRE data that Yao et al. use). The starter set written for mechdiff lives in
``mechdiff/data/knowledge/`` (factual: ``country_capital``, ``country_language``,
``city_country``; linguistic: ``antonym``; commonsense: ``object_color``).

An *edit file* is a relation file whose samples give subjects new objects, with ``"edits_of"``: the relation
they rewrite (``edits/capital_swap``: four capitals swapped, what the committed ``smollm2-capital-edit``
LoRA learned). `Relation.unedited` gives the same prompts with their original objects: the facts of
the edit before it.

A prompt is tokenised piece by piece (template prefix, subject, template suffix) so the subject's
token span is exact; the answer is the first token of ``" " + object``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Sequence

import torch

DATA_DIR = Path(__file__).resolve().parent.parent / "data" / "knowledge"


@dataclass
class Relation:
    name: str
    relation_type: str
    prompt_templates: list[str]
    samples: list[dict]
    edits_of: Optional[str] = None  # an edit file: the relation whose objects its samples rewrite

    @classmethod
    def load(cls, name_or_path: str) -> "Relation":
        """A relation by name (``mechdiff/data/knowledge/<name>.json``) or JSON path."""
        path = Path(name_or_path)
        if not path.suffix:
            path = DATA_DIR / f"{name_or_path}.json"
        if not path.is_file():
            raise FileNotFoundError(
                f"no relation {name_or_path!r}; known: {', '.join(available_relations())} "
                "(or give a JSON file in the LRE format)"
            )
        data = json.loads(path.read_text())
        missing = {"name", "prompt_templates", "samples"} - set(data)
        if missing:
            raise ValueError(f"{path}: relation file lacks {sorted(missing)}")
        for t in data["prompt_templates"]:
            if t.count("{}") != 1:
                raise ValueError(f"{path}: template {t!r} must contain exactly one '{{}}' for the subject")
        return cls(
            data["name"],
            data.get("relation_type", "factual"),
            list(data["prompt_templates"]),
            list(data["samples"]),
            data.get("edits_of"),
        )

    def unedited(self) -> "Relation":
        """An edit file's subjects with the objects of the relation it rewrites (the facts before the edit)."""
        if self.edits_of is None:
            raise ValueError(
                f"relation {self.name!r} is not an edit file (no \"edits_of\"); 'unedited' applies "
                "to edit files such as edits/capital_swap"
            )
        original = {s["subject"]: s["object"] for s in Relation.load(self.edits_of).samples}
        missing = [s["subject"] for s in self.samples if s["subject"] not in original]
        if missing:
            raise ValueError(f"edit file {self.name!r}: subjects {missing} are not in {self.edits_of!r}")
        return Relation(
            f"{self.name}-unedited",
            self.relation_type,
            self.prompt_templates,
            [{**s, "object": original[s["subject"]]} for s in self.samples],
        )


def available_relations() -> list[str]:
    """Relation names under ``mechdiff/data/knowledge`` (edit files as ``edits/<name>``)."""
    return sorted(p.relative_to(DATA_DIR).with_suffix("").as_posix() for p in DATA_DIR.rglob("*.json"))


@dataclass
class Fact:
    subject: str
    object: str
    prompt: str
    ids: list[int]
    subject_span: tuple[int, int]  # [start, end) token positions of the subject
    answer_id: int

    @property
    def last_subject(self) -> int:
        return self.subject_span[1] - 1

    def relation_positions(self) -> list[int]:
        """Template (relation) token positions: every non-subject position except 0 (the attention sink)."""
        s, e = self.subject_span
        return [p for p in range(1, len(self.ids)) if not (s <= p < e)]

    def to_dict(self) -> dict:
        return {"subject": self.subject, "object": self.object, "prompt": self.prompt}


def build_facts(tokenizer, relation: Relation, template_index: int = 0) -> list[Fact]:
    """Tokenised facts of ``relation`` with its template number ``template_index``."""
    template = relation.prompt_templates[template_index]
    prefix, suffix = template.split("{}")
    enc = lambda text: tokenizer(text, add_special_tokens=False)["input_ids"] if text else []  # noqa: E731
    facts = []
    for sample in relation.samples:
        subj = sample["subject"]
        lead = prefix.endswith(" ")
        pre_ids = enc(prefix.rstrip(" ")) if lead else enc(prefix)
        subj_ids = enc((" " if lead else "") + subj)
        suf_ids = enc(suffix)
        ids = pre_ids + subj_ids + suf_ids
        answer = enc(" " + sample["object"])
        facts.append(
            Fact(
                subj,
                sample["object"],
                template.format(subj),
                ids,
                (len(pre_ids), len(pre_ids) + len(subj_ids)),
                answer[0],
            )
        )
    return facts


@dataclass
class FactBatch:
    """Facts of one token length (no padding), as tensors."""

    facts: list[Fact]
    ids: torch.Tensor  # "batch pos"
    answers: torch.Tensor  # "batch"
    last_subject: torch.Tensor  # "batch"

    def __len__(self) -> int:
        return len(self.facts)


def batches(facts: Sequence[Fact], batch_size: int = 32) -> list[FactBatch]:
    """Facts grouped by token length, in chunks of ``batch_size`` (no padding anywhere)."""
    by_len: dict[int, list[Fact]] = {}
    for f in facts:
        by_len.setdefault(len(f.ids), []).append(f)
    out = []
    for n in sorted(by_len):
        group = by_len[n]
        for i in range(0, len(group), batch_size):
            chunk = group[i : i + batch_size]
            out.append(
                FactBatch(
                    chunk,
                    torch.tensor([f.ids for f in chunk]),
                    torch.tensor([f.answer_id for f in chunk]),
                    torch.tensor([f.last_subject for f in chunk]),
                )
            )
    return out
