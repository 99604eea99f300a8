"""Seeds derived by name: every random draw of a study gets its own seed from the study's seed and
what it is for (``derive(0, "random-heads")``), so draws stay independent of each other and of the
order stages run in, and a report names a draw instead of restating an offset. Prompt sets are named too:
`prompt_seed` (``prompt_seed(0, "eval")``), the one way every study seeds a set of prompts."""

from __future__ import annotations

import hashlib

#: Derived seeds lie in [0, 2**31): valid for torch, numpy and random alike.
SEED_BITS = 31


def derive(seed: int, name: str) -> int:
    """A stable seed for the draw ``name`` of a study seeded ``seed`` (SHA-256 of both; same on every
    machine and Python version, unlike ``hash``)."""
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int, not {type(seed).__name__} ({seed!r})")
    if not name:
        raise ValueError("a derived seed needs a non-empty name saying what the draw is for")
    digest = hashlib.sha256(f"{seed}\x00{name}".encode()).digest()
    return int.from_bytes(digest[:8], "big") % (1 << SEED_BITS)


#: Each prompt set of a study, by name: its seed is the study's seed plus this offset (the seeds every committed
#: result was made with; changing one changes that set's prompts). The reproduction's two sets share their
#: offsets with ``positions`` and ``ranking``: kept so, since the committed reproduction table was drawn with them.
#: The commands that score circuits (``score``, ``prune``, ``compare``, ``curve``) name theirs ``command-*``: the
#: scored prompts, the mean-ablation reference and the curve's ranking prompts. Their offsets are not the study's
#: for the same purposes (``curve``, ``reference``, ``ranking``): ``results/curve-smollm2`` was drawn with them.
PROMPT_OFFSETS = {
    "discovery": 0,
    "eval": 1,
    "matrix": 2,
    "reference": 3,
    "dcm": 4,
    "cmap": 5,
    "prune": 6,
    "positions": 7,
    "ranking": 8,
    "curve": 9,
    "reproduction": 7,
    "reproduction-reference": 8,
    "command-scoring": 0,
    "command-reference": 1,
    "command-ranking": 2,
}


def prompt_seed(seed: int, name: str) -> int:
    """The seed of the prompt set ``name`` (`PROMPT_OFFSETS`) of a study seeded ``seed``. Prompt sets keep
    offsets rather than `derive` so that the committed studies' prompts stay what they were."""
    if name not in PROMPT_OFFSETS:
        raise KeyError(f"no prompt set {name!r}; the sets are {', '.join(PROMPT_OFFSETS)} (mechdiff.runs.seeds)")
    return seed + PROMPT_OFFSETS[name]
