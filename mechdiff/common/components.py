"""Component names: one way everywhere, ``L14H7``, ``MLP17``, ``EMB``, ``LOGITS``.

A query head's K and V belong to its KV group under grouped-query attention:
``group = head // (n_heads // n_kv_heads)``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Union

if TYPE_CHECKING:
    import random

_HEAD = re.compile(r"^L(\d+)H(\d+)$")
_MLP = re.compile(r"^MLP(\d+)$")
SPECIAL = ("EMB", "LOGITS")


@dataclass(frozen=True, order=True)
class Head:
    """One attention (query) head."""

    layer: int
    head: int

    @property
    def name(self) -> str:
        return f"L{self.layer}H{self.head}"

    def kv_group(self, n_heads: int, n_kv_heads: int) -> int:
        """The KV group whose K and V this query head reads."""
        return kv_group(self.head, n_heads, n_kv_heads)

    def __str__(self) -> str:
        return self.name


@dataclass(frozen=True, order=True)
class MLP:
    """The MLP block of one layer."""

    layer: int

    @property
    def name(self) -> str:
        return f"MLP{self.layer}"

    def __str__(self) -> str:
        return self.name


Component = Union[Head, MLP, str]


def kv_group(head: int, n_heads: int, n_kv_heads: int) -> int:
    """KV group of a query head: ``head // (n_heads // n_kv_heads)``."""
    if n_heads % n_kv_heads:
        raise ValueError(f"n_heads={n_heads} is not a multiple of n_kv_heads={n_kv_heads}")
    return head // (n_heads // n_kv_heads)


def parse(name: str | Head | MLP | list | tuple) -> Component:
    """Parse ``L14H7``, ``MLP17``, ``EMB``, ``LOGITS`` (or ``[layer, head]``) into a component."""
    if isinstance(name, (Head, MLP)):
        return name
    if isinstance(name, (list, tuple)) and len(name) == 2:
        return Head(int(name[0]), int(name[1]))
    text = str(name).strip()
    if m := _HEAD.match(text):
        return Head(int(m[1]), int(m[2]))
    if m := _MLP.match(text):
        return MLP(int(m[1]))
    if text in SPECIAL:
        return text
    raise ValueError(
        f"cannot parse component {name!r}: expected L<layer>H<head> (e.g. L14H7), MLP<layer>, EMB or LOGITS"
    )


def parse_heads(names: Iterable[str | list | tuple | Head]) -> list[Head]:
    """Parse a list of head names, rejecting anything that is not a head."""
    heads = []
    for n in names:
        c = parse(n)
        if not isinstance(c, Head):
            raise ValueError(f"{n!r} is not an attention head (expected L<layer>H<head>)")
        heads.append(c)
    return heads


def all_heads(n_layers: int, n_heads: int) -> list[Head]:
    """Every head of a model, in layer-major order."""
    return [Head(l, h) for l in range(n_layers) for h in range(n_heads)]


def layer_matched(heads: Iterable[Head], n_heads: int, rng: "random.Random") -> list[Head]:
    """Random heads with the same depth profile: as many per layer as ``heads`` has there, drawn uniformly
    (without replacement) from that layer's ``n_heads``; sorted."""
    per_layer: dict[int, int] = {}
    for h in heads:
        per_layer[h.layer] = per_layer.get(h.layer, 0) + 1
    return sorted(Head(layer, i) for layer, k in per_layer.items() for i in rng.sample(range(n_heads), k))


def check_heads(heads: Iterable[Head], n_layers: int, n_heads: int) -> None:
    """Raise if a head lies outside a model of this shape."""
    bad = [h.name for h in heads if not (0 <= h.layer < n_layers and 0 <= h.head < n_heads)]
    if bad:
        raise ValueError(f"heads {bad} do not exist in a model with {n_layers} layers x {n_heads} heads")
