"""A study's prompt sets drawn from a task's rows: disjoint by construction, stratified by group.

A task that holds a fixed list of rows (an imported task directory) cannot draw a fresh set by seed, as a
generator does: every set would be the same first rows. :func:`draw_sets` deals each named set its own rows,
none shared with another set, every (template, token length) group in every set in proportion to its size.

The rule (systematic stratified sampling): each group's rows are shuffled by the study's seed; row ``j`` of a
group of ``m`` rows gets the key ``(j + 1/2) / m``, and all rows are ordered by key (ties by a seeded order of the
groups). The first set (the mean-ablation reference where a study has one) takes one row of every group first,
as far as its size allows, so every scored group has reference prompts; then each set, in the order the study
names them, takes the next rows of that order no set holds yet: a set of ``b`` rows holds about ``b m / N`` rows
of each group (within two in the property test, ``tests/unit/tasks/test_prompt_sets.py``).
"""

from __future__ import annotations

import random
from collections import defaultdict
from typing import Hashable, Mapping, Sequence


class PromptSetError(ValueError):
    """A study whose prompt sets need more rows than its task holds."""


def stratified_order(strata: Sequence[Hashable], seed: int) -> list[int]:
    """Every row index once, ordered so that each prefix and each block holds every stratum in proportion."""
    groups: dict[Hashable, list[int]] = defaultdict(list)
    for i, s in enumerate(strata):
        groups[s].append(i)
    rng = random.Random(f"prompt-sets\x00{seed}")  # a str seed: SHA-512, the same on every machine
    names = sorted(groups, key=repr)
    rng.shuffle(names)
    rank = {name: r for r, name in enumerate(names)}
    keyed = []
    for name in names:
        rows = groups[name]
        rng.shuffle(rows)
        keyed.extend((((j + 0.5) / len(rows), rank[name]), row) for j, row in enumerate(rows))
    return [row for _, row in sorted(keyed)]


def draw_sets(strata: Sequence[Hashable], sizes: Mapping[str, int], seed: int) -> dict[str, list[int]]:
    """Each named set's row indices (``sizes``: name -> rows, in the order the blocks are dealt), disjoint and
    stratified by ``strata`` (one stratum per row); refused, naming each set's need, where the rows run out."""
    need = sum(sizes.values())
    if need > len(strata):
        parts = ", ".join(f"{name} {n}" for name, n in sizes.items())
        raise PromptSetError(
            f"the study's prompt sets need {need} rows ({parts}), and the task holds {len(strata)}; every set "
            f"draws rows no other set uses: add rows to the task (import more pairs) or lower the sets' n"
        )
    order = stratified_order(strata, seed)
    first_of_group = {}
    for row in order:
        first_of_group.setdefault(strata[row], row)
    out: dict[str, list[int]] = {}
    taken: set[int] = set()
    for i, (name, n) in enumerate(sizes.items()):
        # the first set (the reference) holds one row of every group first, where it is long enough
        chosen = list(first_of_group.values())[:n] if i == 0 else []
        taken.update(chosen)
        rest = (row for row in order if row not in taken)
        chosen += [row for _, row in zip(range(n - len(chosen)), rest)]
        taken.update(chosen)
        out[name] = sorted(chosen)
    return out


def describe_sets(sets: Mapping[str, Sequence[int]], strata: Sequence[Hashable]) -> dict:
    """What a report states of drawn sets, computed from the lists themselves: each set's size and groups,
    and the rows any two sets share (0 for sets drawn by :func:`draw_sets`)."""
    names = list(sets)
    shared = sum(len(set(sets[a]) & set(sets[b])) for i, a in enumerate(names) for b in names[i + 1 :])
    return {
        "sizes": {name: len(rows) for name, rows in sets.items()},
        "groups": {name: len({strata[r] for r in rows}) for name, rows in sets.items()},
        "n_groups": len(set(strata)),
        "n_rows": len(strata),
        "shared_rows": shared,
    }
