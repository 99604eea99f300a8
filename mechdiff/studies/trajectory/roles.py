"""Role membership over the steps of a trajectory, from its ``roles:<ckpt>`` stage records: per role (group,
desideratum) which heads hold the role at each step, and which join, leave or take it over
(`mechdiff.methods.roles`), as report rows; for roles by DCM over seeds, the "roles" family of paired tests
that decides where a group holds a role, and the sentences that name what happens."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from ...common import inference as inf
from ...common.outcomes import from_bits
from ...methods.roles import held, transitions
from ...report.claims import ROLES, encodes, encodes_family


@dataclass(frozen=True)
class Role:
    """One role's scores: ``"head step"`` arrays of the share of pairs moved to the target and its bounds."""

    group: str
    desideratum: str
    position: str
    heads: list[str]
    value: np.ndarray
    low: np.ndarray
    high: np.ndarray


def roles_of(records: Sequence[dict]) -> list[Role]:
    """Every role of the ``roles`` stage records of the steps in order (each a `
    head_scores` result); the steps must have scored the same heads."""
    keys = [(r["group"], r["desideratum"], r["position"], r["head"]) for r in records[0]["rows"]]
    for rec in records[1:]:
        if [(r["group"], r["desideratum"], r["position"], r["head"]) for r in rec["rows"]] != keys:
            raise ValueError("the roles stages of a trajectory must score the same heads at every step")
    out = []
    for g, d, p in dict.fromkeys(k[:3] for k in keys):
        idx = [i for i, k in enumerate(keys) if k[:3] == (g, d, p)]
        cols = {
            c: np.array([[rec["rows"][i]["share"][c] for rec in records] for i in idx])
            for c in ("value", "low", "high")
        }
        out.append(Role(g, d, p, [keys[i][3] for i in idx], cols["value"], cols["low"], cols["high"]))
    return out


def score_rows(roles: Sequence[Role], steps: Sequence[int], threshold: float) -> list[dict]:
    """A row per role, head and step: the share with its exact binomial interval and whether the head holds it."""
    rows = []
    for r in roles:
        member = held(r.low, threshold)
        for i, h in enumerate(r.heads):
            for j, s in enumerate(steps):
                rows.append(
                    {
                        "group": r.group,
                        "desideratum": r.desideratum,
                        "head": h,
                        "step": s,
                        "share": float(r.value[i, j]),
                        "share_low": float(r.low[i, j]),
                        "share_high": float(r.high[i, j]),
                        "holds": bool(member[i, j]),
                    }
                )
    return rows


def membership_rows(roles: Sequence[Role], steps: Sequence[int], threshold: float) -> list[dict]:
    """A row per role and step: how many of the role's scored heads hold it and which (``-``: none)."""
    rows = []
    for r in roles:
        member = held(r.low, threshold)
        for j, s in enumerate(steps):
            holding = [h for i, h in enumerate(r.heads) if member[i, j]]
            rows.append(
                {
                    "group": r.group,
                    "desideratum": r.desideratum,
                    "step": s,
                    "heads_scored": len(r.heads),
                    "n_holding": len(holding),
                    "holding": " ".join(holding) or "-",
                }
            )
    return rows


def transition_rows(roles: Sequence[Role], steps: Sequence[int], threshold: float) -> list[dict]:
    """A row per role, step and head that joins, leaves or takes the role over there
    (`transitions`): ``others`` the heads it takes over from, or those that take over
    from it."""
    rows = []
    for r in roles:
        for t in transitions(held(r.low, threshold), r.heads, list(steps)):
            rows.append(
                {
                    "group": r.group,
                    "desideratum": r.desideratum,
                    "step": t["step"],
                    "head": t["head"],
                    "event": t["event"],
                    "others": " ".join(t["others"]) or "-",
                }
            )
    return rows


# --- roles by DCM over seeds ---------------------------------------------------------------------------------------


def seeded_rows(records: Sequence[Mapping[str, Any]], steps: Sequence[int]) -> list[dict]:
    """Every (role, step) row of the DCM roles stages (`dcm_seeds`), with its step
    and a label naming it in the "roles" family."""
    return [
        {**x, "step": s, "label": f"{x['group']}/{x['desideratum']} at step {s}"}
        for s, rec in zip(steps, records)
        for x in rec["rows"]
    ]


def role_outcomes(rows: Sequence[Mapping[str, Any]]) -> dict[str, dict]:
    """One roles stage's per-pair outcomes on the test pairs, as ``outcomes.json`` keeps them: per role
    (``group/desideratum``) its ``selection`` (where the step selected heads), its ``floor`` and each random head
    set (``random/<i>``), enough to recompute the "roles" family."""
    out: dict[str, dict] = {}
    for x in rows:
        role = f"{x['group']}/{x['desideratum']}"
        if x["selected"]:
            out[f"{role}/selection"] = {"correct": x["test_outcomes"]}
        out[f"{role}/floor"] = {"correct": x["floor_outcomes"]}
        out.update({f"{role}/random/{i}": {"correct": o} for i, o in enumerate(x.get("random_outcomes") or [])})
    return out


def roles_family(rows: Sequence[Mapping[str, Any]]) -> dict[tuple, inf.Test]:
    """Each step's selection against its floor and its layer-matched random heads (paired, on the same test pairs),
    every role and step adjusted together in the "roles" family: ``(group, desideratum, step, kind) -> test``."""
    return encodes_family(list(rows), ROLES, ("group", "desideratum", "step"))


def seeded_roles(rows: Sequence[Mapping[str, Any]], steps: Sequence[int], tests: Mapping) -> list[Role]:
    """Every role as `Role` membership (1 where a head is in the step's selection and the group holds the
    role there, `encodes` in the family; else 0: read at any threshold in [0, 1)),
    and each head's selection frequency (the share of seeds) as its value."""
    out = []
    for g, d, p in dict.fromkeys((x["group"], x["desideratum"], x["position"]) for x in rows):
        mine = {x["step"]: x for x in rows if (x["group"], x["desideratum"]) == (g, d)}
        heads = list(mine[steps[0]]["heads"])
        if any(list(mine[s]["heads"]) != heads for s in steps):
            raise ValueError(f"the roles stages must train DCM over the same heads at every step ({g}/{d})")
        holds = [encodes(tests, g, d, s) for s in steps]
        member = np.array([[float(h in mine[s]["selected"] and ok) for s, ok in zip(steps, holds)] for h in heads])
        freq = np.array([[mine[s]["frequency"][i] / len(mine[s]["seeds"]) for s in steps] for i in range(len(heads))])
        shape = (len(heads), len(steps))
        out.append(Role(g, d, p, heads, freq.reshape(shape), member.reshape(shape), member.reshape(shape)))
    return out


def seeded_step_rows(rows: Sequence[Mapping[str, Any]], tests: Mapping) -> list[dict]:
    """A row per role and step: the selection (heads in at least ``votes`` seeds, each with its count), its test
    accuracy and the floor (exact binomial 95% CI), the random heads' mean, each paired test's difference and Holm
    p in the "roles" family, and whether the group holds the role."""
    out = []
    for x in rows:
        key = (x["group"], x["desideratum"], x["step"])
        counts = dict(zip(x["heads"], x["frequency"]))
        draws = [from_bits(o) for o in x.get("random_outcomes") or []]
        row = {
            "group": x["group"],
            "desideratum": x["desideratum"],
            "step": x["step"],
            "candidates": len(x["heads"]),
            "selected": " ".join(f"{h} ({counts[h]}/{len(x['seeds'])})" for h in x["selected"]) or "-",
            **{
                f"test_accuracy{k}": x["test_accuracy"][v]
                for k, v in (("", "value"), ("_low", "low"), ("_high", "high"))
            },
            **{f"floor{k}": x["floor"][v] for k, v in (("", "value"), ("_low", "low"), ("_high", "high"))},
            "random": float(np.mean(draws)) if draws else None,
        }
        for kind in ("floor", "random"):
            t = tests.get((*key, kind))
            row[f"minus_{kind}"] = None if t is None else t.interval.value
            row[f"p_holm_{kind}"] = None if t is None else t.p_adjusted
        out.append({**row, "holds": encodes(tests, *key)})
    return out


def frequency_rows(rows: Sequence[Mapping[str, Any]], steps: Sequence[int]) -> list[dict]:
    """A row per role and head some seed selected at some step: its count of seeds at each step (``k/n``)."""
    out = []
    for g, d in dict.fromkeys((x["group"], x["desideratum"]) for x in rows):
        mine = {x["step"]: x for x in rows if (x["group"], x["desideratum"]) == (g, d)}
        heads = mine[steps[0]]["heads"]
        for i, h in enumerate(heads):
            counts = [mine[s]["frequency"][i] for s in steps]
            if any(counts):
                cols = {f"step_{s}": f"{c}/{len(mine[s]['seeds'])}" for s, c in zip(steps, counts)}
                out.append({"group": g, "desideratum": d, "head": h, **cols})
    return out


def role_sentences(steps: Sequence[int], step_rows: Sequence[Mapping[str, Any]], moves: Sequence[Mapping]) -> list[str]:
    """One sentence per role: the steps where the group holds it (and where it is not shown), then what happens
    at each later step, named as what it is (joins, leaves, takes over from)."""
    out = []
    for g, d in dict.fromkeys((r["group"], r["desideratum"]) for r in step_rows):
        mine = [r for r in step_rows if (r["group"], r["desideratum"]) == (g, d)]
        held_at = [r["step"] for r in mine if r["holds"]]
        missing = [r["step"] for r in mine if not r["holds"]]
        text = f"- **{g} / {d}**: " + (
            f"held at step{'s' if len(held_at) > 1 else ''} {', '.join(map(str, held_at))}"
            if held_at
            else "held at no step scored"
        )
        if held_at and missing:
            text += f"; not shown at {', '.join(map(str, missing))}"
        events = [f"at step {s} {_events(moves, g, d, s)}" for s in steps[1:] if _events(moves, g, d, s)]
        out.append(text + (": " + "; ".join(events) + "." if events else ". No head joins or leaves."))
    return out


def _events(moves: Sequence[Mapping[str, Any]], group: str, desideratum: str, step: int) -> str:
    """What happens to one role at one step, named: "A, B take over from C; D joins; C leaves" ('' for nothing)."""
    here = [m for m in moves if (m["group"], m["desideratum"], m["step"]) == (group, desideratum, step)]
    parts = []
    for event, one, many in (
        ("takes over", "takes over", "take over"),
        ("joins", "joins", "join"),
        ("leaves", "leaves", "leave"),
    ):
        heads = [m["head"] for m in here if m["event"] == event]
        if heads:
            verb = one if len(heads) == 1 else many
            tail = f" from {here[[m['event'] for m in here].index(event)]['others']}" if event == "takes over" else ""
            parts.append(f"{', '.join(heads)} {verb}{tail}")
    return "; ".join(parts)
