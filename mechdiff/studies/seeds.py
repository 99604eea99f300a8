"""Seeds derived by name: every random draw of a study gets its own seed from the study's seed and
what it is for (``derive(0, "random-heads")``), so draws stay independent of each other and of the
order stages run in, and a report names a draw instead of restating an offset."""

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
