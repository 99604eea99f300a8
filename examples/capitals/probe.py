"""Which capitals each model completes under each template (greedy decoding of the whole answer, teacher forced:
every answer token the top-1), written to ``known.json`` as ``{model: {template: {country: [correct, answer
tokens, prompt tokens]}}}``. ``make_rows.py`` keeps the countries ``smollm2-135m`` knows.

``python examples/capitals/probe.py`` (about 5 minutes a model on 2 cores; a template already in ``known.json``
is not probed again)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from countries import CAPITALS, TEMPLATES

from mechdiff.models.loading import load_model

HERE = Path(__file__).parent
MODELS = {"smollm2-135m": list(TEMPLATES), "smollm2-capital-edit": ["short", "city", "seat"]}


def probe(name: str, templates: list[str]) -> dict[str, dict[str, list]]:
    """``{template: {country: [correct, answer tokens, prompt tokens]}}`` for model ``name``."""
    lm = load_model(name)
    tok, model = lm.tokenizer, lm.model.eval()
    out: dict[str, dict[str, list]] = {}
    for t in templates:
        for country, answer in CAPITALS:
            prompt = TEMPLATES[t].format(c=country)
            ids, full = tok(prompt)["input_ids"], tok(prompt + answer)["input_ids"]
            with torch.no_grad():
                logits = model(torch.tensor([full])).logits[0]
            top = logits[len(ids) - 1 : len(full) - 1].argmax(-1).tolist()
            out.setdefault(t, {})[country] = [top == full[len(ids) :], len(full) - len(ids), len(ids)]
    return out


def main() -> None:
    """Probe every (model, template) that ``known.json`` does not hold yet, and add it there."""
    path = HERE / "known.json"
    known = json.loads(path.read_text()) if path.exists() else {}
    for name, templates in MODELS.items():
        missing = [t for t in templates if t not in known.get(name, {})]
        if missing:
            known.setdefault(name, {}).update(probe(name, missing))
    path.write_text(json.dumps(known, indent=1) + "\n")


if __name__ == "__main__":
    main()
