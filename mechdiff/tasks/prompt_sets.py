"""A study's prompt sets drawn from a task's rows: disjoint by item by construction, stratified by group.

A task that holds a fixed list of rows (an imported task directory) cannot draw a fresh set by seed, as a
generator does: every set would be the same first rows. `draw_sets` deals each named set its own rows,
none of whose *items* another set holds, every (template, token length) group in every set in proportion to its
size.

An *item* is what a row is a draw of: by default its clean prompt (several rows may share one, each with another
counterfactual), or a field the task names (``mechdiff dataset import --item FIELD``). A row's counterfactual may
be another item's clean prompt: it is a source, not a scored prompt (`describe_sets` counts them).

The rule (systematic stratified sampling): each group's rows are shuffled by the study's seed; row ``j`` of a
group of ``m`` rows gets the key ``(j + 1/2) / m``, and all rows are ordered by key (ties by a seeded order of the
groups); where an item has several rows, the item is ordered in its first row's group, weighted by its rows
(key: the middle of its rows). The first set (the mean-ablation reference where a study has one)
takes the items of one row of every group first, as far as its size allows, so every scored group has reference
prompts; then each set, in the order the study names them, takes whole items in that order that no set holds yet
until its row count is reached (sizes stay in rows: the last item's rows beyond the count are left unused, never
dealt to another set). Where every item is one row this is the row draw it always was: a set of ``b`` rows holds
about ``b m / N`` rows of each group (within two in the property test, ``tests/unit/tasks/test_prompt_sets.py``).

Sets declared *nested* (``[sets] nested = true``: discovery, pruning and evaluation as first-N of one draw, as the
paper's first-N lines of one file) share one block of the largest of their sizes, each its first rows in draw order.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict
from typing import TYPE_CHECKING, Any, Hashable, Mapping, Optional, Sequence

if TYPE_CHECKING:
    import numpy as np


class PromptSetError(ValueError):
    """A study whose prompt sets need more rows than its task holds."""


def stratified_order(strata: Sequence[Hashable], seed: int, weights: Optional[Sequence[int]] = None) -> list[int]:
    """Every index once (a row, or an item of ``weights[i]`` rows), ordered so that each prefix and each block holds
    every stratum in proportion to its rows: an item's key is the middle of its rows in its stratum's shuffled
    order, ``(rows before it + its rows / 2) / the stratum's rows`` (``(j + 1/2) / m`` for rows)."""
    weights = [1] * len(strata) if weights is None else weights
    groups: dict[Hashable, list[int]] = defaultdict(list)
    for i, s in enumerate(strata):
        groups[s].append(i)
    rng = random.Random(f"prompt-sets\x00{seed}")  # a str seed: SHA-512, the same on every machine
    names = sorted(groups, key=repr)
    rng.shuffle(names)
    rank = {name: r for r, name in enumerate(names)}
    keyed = []
    for name in names:
        units = groups[name]
        rng.shuffle(units)
        total, before = sum(weights[u] for u in units), 0
        for u in units:
            keyed.append((((before + weights[u] / 2) / total, rank[name]), u))
            before += weights[u]
    return [u for _, u in sorted(keyed)]


def item_ids(keys: Sequence[Hashable]) -> list[int]:
    """Each row's item as an integer: the items numbered in order of their first row (``keys``: a row's item)."""
    ids: dict[Hashable, int] = {}
    return [ids.setdefault(k, len(ids)) for k in keys]


def clean_key(record: Any) -> tuple[int, ...]:
    """The default item of a record or pair: its clean prompt's token ids (a pair's base)."""
    base = record.base if hasattr(record, "base") and hasattr(record, "source") else record
    ids = getattr(base, "input_ids", None)
    return (base,) if ids is None else tuple(ids)  # a record without token ids is its own item


def items_of(records: Sequence[Any], keys: Optional[Sequence[Hashable]] = None) -> "np.ndarray":
    """An ``int64`` array of item ids aligned with ``records`` (a set's rows, as a stage scores them): rows of one
    item share an id, numbered by first appearance; an item is a row's clean prompt (`clean_key`), or
    ``keys[i]`` where given (the task's item field). What a cluster bootstrap over items resamples."""
    import numpy as np

    if keys is not None and len(keys) != len(records):
        raise ValueError(f"{len(keys)} item keys for {len(records)} rows; give one key per row")
    return np.asarray(item_ids(list(keys) if keys is not None else [clean_key(r) for r in records]), dtype=np.int64)


def set_items(record: Mapping[str, Any], name: str, rows: Optional[Sequence[Mapping[str, Any]]] = None) -> "np.ndarray":
    """The items of the prompt set ``name`` from ``run.json``'s ``prompt_sets`` record, aligned with that set's rows
    as its stages scored them: its ``item_ids`` (the study's ids: one item, one id across sets); where the record
    keeps none (a ``run.json`` written before items were recorded) but lists the set's rows of an imported task,
    each row's clean prompt (the default item) from ``rows``, the task's ``pairs.jsonl`` rows."""
    import numpy as np

    ids = record.get("item_ids") or {}
    if name in ids:
        return np.asarray(ids[name], dtype=np.int64)
    listed = (record.get("rows") or {}).get(name)
    if listed is not None and rows:
        return np.asarray([rows[r]["base"]["prompt"] for r in listed])
    raise KeyError(f"no item ids for prompt set {name!r} in the record; it lists {', '.join(ids) or 'none'}")


def _item_order(strata: Sequence[Hashable], items: Sequence[Hashable], seed: int) -> dict[Hashable, list[int]]:
    """Item -> its rows (in file order), items in the stratified order (`stratified_order` of the items, each
    of its first row's stratum, weighted by its rows)."""
    rows: dict[Hashable, list[int]] = {}
    for r, item in enumerate(items):
        rows.setdefault(item, []).append(r)
    units = list(rows)
    order = stratified_order([strata[rows[u][0]] for u in units], seed, [len(rows[u]) for u in units])
    return {units[i]: rows[units[i]] for i in order}


def draw_sets(
    strata: Sequence[Hashable],
    sizes: Mapping[str, int],
    seed: int,
    items: Optional[Sequence[Hashable]] = None,
    nested: Sequence[str] = (),
) -> dict[str, list[int]]:
    """Each named set's row indices (``sizes``: name -> rows, in the order the blocks are dealt), stratified by
    ``strata`` (one stratum per row) and disjoint by ``items`` (one item per row; default: each row its own);
    refused, naming each set's need, where the rows or the items run out. ``nested``: names whose sets are the
    first rows of one block (in draw order), not disjoint from each other."""
    items = list(range(len(strata))) if items is None else list(items)
    if len(items) != len(strata):
        raise ValueError(f"{len(items)} items for {len(strata)} rows; give one item per row")
    nested = [n for n in sizes if n in set(nested)]
    blocks = _blocks(sizes, nested)
    need = sum(blocks.values())
    if need > len(strata):
        parts = ", ".join(f"{name} {n}" for name, n in sizes.items())
        shared = f" ({', '.join(nested)} nested: the largest of them counts)" if nested else ""
        raise PromptSetError(
            f"the study's prompt sets need {need} rows ({parts}){shared}, and the task holds {len(strata)}; every "
            "set draws rows no other set uses: add rows to the task (import more pairs) or lower the sets' n"
        )
    by_item = _item_order(strata, items, seed)
    first_of_group: dict[Hashable, Hashable] = {}
    for item, rows in by_item.items():
        first_of_group.setdefault(strata[rows[0]], item)
    dealt: dict[str, list[int]] = {}
    taken: set[Hashable] = set()
    for i, (name, n) in enumerate(blocks.items()):
        # the first set (the reference) holds an item of every group first
        first = list(first_of_group.values()) if i == 0 else []
        dealt[name] = _take(by_item, [*first, *by_item], taken, n)
    short = {name: n - len(dealt[name]) for name, n in blocks.items() if len(dealt[name]) < n}
    if short:
        raise PromptSetError(_items_refusal(blocks, dealt, by_item, short, nested))
    out = {name: sorted(rows) for name, rows in dealt.items() if name != NESTED}
    for name in nested:
        out[name] = dealt[NESTED][: sizes[name]]
    return {name: out[name] for name in sizes}


#: The block nested sets share in `draw_sets`.
NESTED = "nested"


def _blocks(sizes: Mapping[str, int], nested: Sequence[str]) -> dict[str, int]:
    """The blocks `draw_sets` deals, in order: each set its own, the nested sets one (at the first's place)."""
    out: dict[str, int] = {}
    for name, n in sizes.items():
        if name in nested:
            out.setdefault(NESTED, max(sizes[m] for m in nested))
        else:
            out[name] = n
    return out


def _take(by_item: Mapping[Hashable, list[int]], candidates: Sequence[Hashable], taken: set, n: int) -> list[int]:
    """Rows of whole items of ``candidates`` (in order) no set holds, until ``n`` rows (the last item cut)."""
    chosen: list[int] = []
    for item in candidates:
        if len(chosen) >= n:
            break
        if item in taken:
            continue
        taken.add(item)
        chosen += by_item[item][: n - len(chosen)]
    return chosen


def _items_refusal(
    blocks: Mapping[str, int],
    dealt: Mapping[str, list[int]],
    by_item: Mapping[Hashable, list[int]],
    short: Mapping[str, int],
    nested: Sequence[str],
) -> str:
    """Each set's need in rows and items, where whole items ran out before every set had its rows."""
    n_rows = sum(len(rows) for rows in by_item.values())
    mean = n_rows / len(by_item)
    row_item = {r: item for item, rows in by_item.items() for r in rows}
    parts, total = [], 0
    for name, n in blocks.items():
        got = len({row_item[r] for r in dealt[name]})
        more = math.ceil(short.get(name, 0) / mean)
        total += got + more
        label = f"{'/'.join(nested)} (nested)" if name == NESTED else name
        parts.append(f"{label}: {n} rows in {got + more} items" + (f" ({more} beyond the task's)" if more else ""))
    return (
        f"the study's prompt sets need about {total} items ({'; '.join(parts)}; at the task's {mean:.1f} rows an "
        f"item), and the task holds {len(by_item)} items in {n_rows} rows. Every set takes whole items (a row's clean "
        "prompt, or the field the task was imported with, --item) that no other set holds: add rows with new clean "
        "prompts to the task, lower the sets' n (task file: [eval] n, [scoring] n, reference_n and prune_n, "
        "[discovery] n, [dcm] n_train/n_val/n_test, [cmap] n, [positions] n), or declare [sets] nested = true "
        "(discovery, pruning and evaluation as first-N of one draw, as the paper)"
    )


def describe_sets(
    sets: Mapping[str, Sequence[int]],
    strata: Sequence[Hashable],
    items: Optional[Sequence[Hashable]] = None,
    sources: Optional[Sequence[tuple[Hashable, Hashable]]] = None,
    nested: Sequence[str] = (),
) -> dict:
    """What a report states of drawn sets, computed from the lists themselves: each set's size (rows), items and
    groups, the rows and the items any two sets share (0 for sets drawn by `draw_sets`, nested sets aside),
    each row's item id per set, and (``sources``: each row's clean and counterfactual prompt keys) how many of a
    set's rows take their counterfactual from another item's clean prompt (a source, not a scored prompt) and how
    many of those from an item another set holds. ``nested``: sets declared first-N of one draw, whose sharing with
    each other is not counted."""
    items = list(range(len(strata))) if items is None else list(items)
    ids = item_ids(items)
    pairs = _set_pairs(list(sets), nested)
    shared = sum(len(set(sets[a]) & set(sets[b])) for a, b in pairs)
    of = {name: {items[r] for r in rows} for name, rows in sets.items()}
    shared_items = sum(len(of[a] & of[b]) for a, b in pairs)
    out = {
        "sizes": {name: len(rows) for name, rows in sets.items()},
        "items": {name: len(of[name]) for name, rows in sets.items()},
        "groups": {name: len({strata[r] for r in rows}) for name, rows in sets.items()},
        "n_groups": len(set(strata)),
        "n_rows": len(strata),
        "n_items": len(set(items)),
        "shared_rows": shared,
        "shared_items": shared_items,
        "item_ids": {name: [ids[r] for r in rows] for name, rows in sets.items()},
    }
    if sources is not None:
        out["counterfactual_sources"] = _sources(sets, items, sources, of)
    return out


def _set_pairs(names: Sequence[str], nested: Sequence[str] = ()) -> list[tuple[str, str]]:
    """Every two sets of ``names`` that must share no item (two nested sets aside)."""
    return [(a, b) for i, a in enumerate(names) for b in names[i + 1 :] if not (a in nested and b in nested)]


def describe_items(sets: Mapping[str, Sequence[Hashable]], nested: Sequence[str] = ()) -> dict:
    """`describe_sets` for sets given by each row's item (a generated task's: ``sets``: name -> the item of
    each of its prompts, in order): each set's size and items, the items two sets share, each row's item id."""
    ids = item_ids([key for keys in sets.values() for key in keys])
    flat = iter(ids)
    of = {name: set(keys) for name, keys in sets.items()}
    return {
        "sizes": {name: len(keys) for name, keys in sets.items()},
        "items": {name: len(of[name]) for name in sets},
        "n_items": len(set(ids)),
        "shared_items": sum(len(of[a] & of[b]) for a, b in _set_pairs(list(sets), nested)),
        "item_ids": {name: [next(flat) for _ in keys] for name, keys in sets.items()},
    }


def _sources(
    sets: Mapping[str, Sequence[int]], items: Sequence[Hashable], pairs: Sequence[tuple[Hashable, Hashable]], of: dict
) -> dict:
    """Per set: its rows whose counterfactual (``pairs[r]``: the row's clean and counterfactual prompt keys) is the
    clean prompt of another item's row, and of those, of an item another set holds."""
    item_of_prompt = {clean: items[r] for r, (clean, _) in enumerate(pairs)}
    out = {}
    for name, rows in sets.items():
        elsewhere = {item for other_name, held in of.items() if other_name != name for item in held}
        sources = [(items[r], item_of_prompt[pairs[r][1]]) for r in rows if pairs[r][1] in item_of_prompt]
        another = [src for own, src in sources if src != own]
        out[name] = {"another_item": len(another), "another_set": sum(src in elsewhere for src in another)}
    return out


def nested_departure(nested: list[str]) -> str:
    """What ``run.json`` and the report's departures say of declared nested sets."""
    return (
        f"prompt sets {', '.join(nested)} are first-N of one draw ([sets] nested = true, as the paper's discovery, "
        "pruning and evaluation prompts are the first lines of one file), not disjoint by item: a circuit is "
        "evaluated on prompts it was found and pruned on"
    )


class GeneratedSets:
    """A generated task's prompt sets made disjoint by item (its clean prompt): a generator may repeat a prompt
    across seeds (IOI's names and places do), so each set's draw leaves out the items of the sets dealt before it
    and draws on past them until it has its ``n``. Where no earlier set holds an item of a set, its prompts are
    exactly the generator's (each generator draws a prefix of a longer draw of the same seed), so a task whose
    prompts never repeat keeps its prompts and its stage keys. Repeats within one set stay (an item of several
    rows, clustered by the intervals).

    ``blocks``: name -> ``(n, seed)`` in the order the sets are dealt; ``nested``: names that are first-N of one
    draw (not disjoint from each other; one block at the first's place); ``options``: the generator options every
    set shares. A set's items are read from the task's ``examples`` with its seed (the reference's from its
    ``reference`` generator, else from its pairs): the pairs and desiderata of entity tracking and IOI draw the
    clean prompts their examples draw for the same seed (``tests/unit/tasks/test_prompt_sets.py``)."""

    def __init__(
        self,
        task: Any,
        blocks: Mapping[str, tuple[int, int]],
        nested: Sequence[str] = (),
        options: Optional[Mapping[str, Any]] = None,
    ):
        self.base, self.options = task, dict(options or {})
        self.nested = [n for n in blocks if n in set(nested)]
        self.blocks = {n: v for n, v in blocks.items() if n not in self.nested[1:]}
        if self.nested:
            first = self.nested[0]
            self.blocks[first] = (max(blocks[n][0] for n in self.nested), blocks[first][1])
        self._keys: dict[str, list] = {}
        self.replaced: dict[str, int] = {}

    def block(self, name: str) -> str:
        """The block a set is dealt in: its own, or the first nested set's."""
        return self.nested[0] if name in self.nested else name

    def excluded(self, name: str, tokenizer: Any) -> set:
        """The items of every block dealt before the set ``name``'s."""
        out: set = set()
        for other in self.blocks:
            if other == self.block(name):
                return out
            out.update(self.keys(other, tokenizer))
        return out

    def keys(self, name: str, tokenizer: Any) -> list:
        """The items of the set ``name``'s whole draw (its block's ``n`` and seed), in order."""
        if name not in self._keys:
            n, seed = self.blocks[name]
            if name == "reference" and self.base.reference is not None:
                generate, key = self.base.reference, clean_key
            elif name == "reference" and self.base.pairs is not None:
                generate, key = self.base.pairs, clean_key
            else:
                generate, key = self.base.examples, clean_key
            records, self.replaced[name] = self._draw(generate, tokenizer, name, n, seed, self._options())
            self._keys[name] = [key(r) for r in records]
        return self._keys[name]

    def _options(self) -> dict:
        return {k: v for k, v in self.options.items() if k in self.base.options}

    def draw(self, generate: Any, tokenizer: Any, name: str, n: int, seed: int, options: Mapping[str, Any]) -> list:
        """``n`` records of ``generate`` for the set ``name``: its seed's draw without the earlier blocks' items."""
        return self._draw(generate, tokenizer, name, n, seed, options)[0]

    def _draw(
        self, generate: Any, tokenizer: Any, name: str, n: int, seed: int, options: Mapping[str, Any]
    ) -> tuple[list, int]:
        """`draw`, and how many of the generator's first ``n`` were left out (an earlier set holds them)."""
        excluded = self.excluded(name, tokenizer)
        m = n
        while True:
            raw = generate(tokenizer, m, seed=seed, **options)
            kept = [r for r in raw if clean_key(r) not in excluded]
            if len(kept) >= n or len(raw) < m or m > 8 * n + 64:
                break
            m += 2 * (n - len(kept)) + 8
        if len(kept) < n:
            raise PromptSetError(
                f"task {self.base.name}: the prompt set {name} could draw {len(kept)} of its {n} prompts whose clean "
                f"prompt no earlier set holds ({len(excluded)} items held by earlier sets); the generator repeats "
                "its prompts: lower the sets' n"
            )
        return kept[:n], sum(clean_key(r) in excluded for r in raw[:n])

    def wrap(self, generate: Optional[Any]) -> Optional[Any]:
        """``generate`` drawing a named set (``prompt_set``) without the earlier blocks' items."""
        if generate is None:
            return None

        def drawn(tokenizer: Any, n: int, seed: int = 0, prompt_set: Optional[str] = None, **options: Any) -> list:
            if prompt_set is None or self.block(prompt_set) not in self.blocks:
                return generate(tokenizer, n, seed=seed, **options)
            return self.draw(generate, tokenizer, prompt_set, n, seed, options)

        return drawn

    def set_keys(self, sizes: Mapping[str, int], tokenizer: Any) -> dict[str, list]:
        """Each set's items, one a prompt in the order drawn (``sizes``: name -> n; a nested set the first ``n`` of
        its block's draw)."""
        return {name: self.keys(self.block(name), tokenizer)[:n] for name, n in sizes.items()}

    def left_out(self, tokenizer: Any) -> dict[str, int]:
        """Per block, how many of its generator's prompts an earlier block holds (drawn past): ``{}`` where none
        does, so that stage keys carry it only where it changed a set's prompts."""
        for name in self.blocks:
            self.keys(name, tokenizer)
        return {name: k for name, k in self.replaced.items() if k}

    def task(self) -> Any:
        """The task whose generators draw each named set disjoint by item (``prompt_set`` among its options)."""
        from dataclasses import replace

        t = self.base
        return replace(
            t,
            examples=self.wrap(t.examples),
            pairs=self.wrap(t.pairs),
            reference=self.wrap(t.reference),
            desiderata={d: self.wrap(g) for d, g in t.desiderata.items()},
            options=tuple(dict.fromkeys([*t.options, "prompt_set"])),
        )
