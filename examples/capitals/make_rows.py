"""Write the committed capitals task's rows (``examples/capitals/capitals.jsonl``) and its second desideratum.

Each row asks one template for one country's capital; its counterfactual asks the same template for another
country whose name is as many tokens long in SmolLM2's tokenizer (so the two prompts have one length). The
countries of each template are those ``smollm2-135m`` completes correctly under it by greedy decoding
(``known.json``, written by ``probe.py``); a template is used where it completes at least MIN_KNOWN countries.
Answers are of one to six tokens (" Kuala Lumpur"). Each (template, country) prompt is one item (the study's sets
are disjoint by clean prompt) with up to PARTNERS rows: few rows an item, so that the default study's sets find
enough items (twelve partners over three templates gave 2,038 rows on only 185 items).

Two DCM desiderata:

- ``swapped`` (the column of that name): the counterfactual country's capital, i.e. patching the group moves the
  country;
- ``rome`` (``rome.jsonl``): " Rome" whatever the country, a control: a group that carries the country should not
  carry a fixed answer, so DCM should find (almost) nothing for it.

``python examples/capitals/make_rows.py`` then ``mechdiff dataset import examples/capitals/capitals.jsonl --model
smollm2-135m --out tasks/capitals --metric logit_diff --desideratum swapped=swapped
--desideratum rome=examples/capitals/rome.jsonl``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from countries import CAPITALS, TEMPLATES

HERE = Path(__file__).parent
PARTNERS = 4  # counterfactual countries a (template, country): ~4 rows an item, items enough for the default sets
MIN_KNOWN = 16  # a template is used where smollm2-135m completes at least this many countries under it


def used(known: dict[str, dict[str, list]]) -> list[str]:
    """The templates under which the base completes at least MIN_KNOWN countries, in TEMPLATES' order."""
    return [t for t in TEMPLATES if sum(good for good, _, _ in known[t].values()) >= MIN_KNOWN]


def rows(known: dict[str, dict[str, list]], seed: int = 0) -> list[dict]:
    """The task's rows: every known (template, country) against up to PARTNERS other known countries of its length."""
    rng = random.Random(seed)
    capital = dict(CAPITALS)
    out = []
    for name in used(known):
        text, at = TEMPLATES[name], TEMPLATES[name].index("{c}")
        ok = {c: n for c, (good, _, n) in known[name].items() if good}
        for c in sorted(ok):
            partners = sorted(c2 for c2 in ok if c2 != c and ok[c2] == ok[c])
            for c2 in rng.sample(partners, min(PARTNERS, len(partners))):
                out.append(
                    {
                        "clean": text.format(c=c),
                        "counterfactual": text.format(c=c2),
                        "answer": capital[c],
                        "counterfactual_answer": capital[c2],
                        "swapped": capital[c2],
                        "template": name,
                        "positions": {"country": [at, at + len(c)]},
                        "counterfactual_positions": {"country": [at, at + len(c2)]},
                    }
                )
    return out


def main() -> None:
    known = json.loads((HERE / "known.json").read_text())["smollm2-135m"]
    table = rows(known)
    (HERE / "capitals.jsonl").write_text("".join(json.dumps(r) + "\n" for r in table))
    (HERE / "rome.jsonl").write_text("".join(json.dumps({"target": " Rome"}) + "\n" for _ in table))
    print(f"{len(table)} rows")


if __name__ == "__main__":
    main()
