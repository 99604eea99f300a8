"""``roles:<ckpt>`` (only where the task file has a ``[roles]`` section): every head of the chosen groups of any
checkpoint's own circuit scored alone on each desideratum in the checkpoint (`head_scores`), or with ``method =
"dcm"`` DCM over them with one fixed sparsity weight, several seeds (`dcm_seeds`), from which the report gives role
membership over the steps and the heads that join, leave or take over a role."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Optional

from ....circuits.circuit import Circuit
from ....runs.stages import StageRecord
from ..settings import DCM_ONLY, checkpoint_steps, dcm_key, roles_dcm_config
from .base import PlanCounts, Stage

Records = dict[str, StageRecord]


class RolesStage(Stage):
    kind = "roles"

    def sites(self, circuits: Records, pairs: Optional[dict[str, list]] = None) -> list[tuple[str, str, list]]:
        """The (group, position, heads) whose heads the roles stage scores: the final circuit's groups (`groups`
        of ``[roles] groups``, else of ``[dcm] groups``), each with the heads any checkpoint's own circuit has in
        it (so that a head holding a role early and losing it is scored too; ``[roles] heads = "final"``: the final
        circuit's only), in layer then head order. ``pairs``: those the stage patches (default `role_pairs`),
        whose classes must hold as many tokens in both prompts of a pair."""
        from ...circuits.stages.dcm import unpaired_classes

        s = self.s
        final = Circuit.from_dict(circuits[s.final].result["circuit"])
        scored = circuits.values() if s.st.roles.heads == "any" else [circuits[s.final]]
        own = [Circuit.from_dict(rec.result["circuit"]) for rec in scored]
        groups = s.groups(final, s.st.roles.groups or s.st.dcm.groups)
        # a class whose token count differs between a pair's two prompts is patched token for token nowhere: left
        # out, as DCM leaves it out
        unequal = unpaired_classes(final, groups, pairs or s.role_pairs(), s.st.eval.batch_size)
        out = []
        for g in (g for g in groups if g not in unequal):
            pos = final.positions[g]
            heads = {h for c in own if c.positions.get(g) == pos for h in c.groups.get(g, [])}
            out.append((g, pos, sorted(heads, key=lambda h: (h.layer, h.head))))
        return out

    def inputs(self, name: str, circuits: Records) -> dict:
        s, r = self.s, self.s.st.roles
        if r.method == "dcm":
            return {
                "model": s.digests[name],
                "task": s.task_inputs(),
                "roles": {k: v for k, v in asdict(r).items() if k not in ("steps", "n", "threshold")},
                "dcm": dcm_key(s.st.dcm),
                "circuits": {c: rec.key for c, rec in circuits.items()},
                **s.class_groups(r.groups or s.st.dcm.groups),
            }
        return {
            "model": s.digests[name],
            "task": s.task_inputs(),
            # which steps are scored, by which method and DCM's settings do not change one step's head scores:
            # the key keeps the fields it had before they were added
            "roles": {k: v for k, v in asdict(r).items() if k not in DCM_ONLY},
            "dcm_groups": s.st.dcm.groups,
            "circuits": {c: rec.key for c, rec in circuits.items()},
            "batch_size": s.st.eval.batch_size,
        }

    def compute(self, name: str, circuits: Records) -> dict:
        if self.s.st.roles.method == "dcm":
            return self.dcm(name, circuits)
        from ....methods.roles import head_scores

        s = self.s
        sites = self.sites(circuits)
        scores = head_scores(s.checkpoints().model(name), sites, s.role_pairs(), s.st.eval.batch_size, s.progress)
        return {"sites": [[g, p, [h.name for h in hs]] for g, p, hs in sites], **scores}

    def dcm(self, name: str, circuits: Records) -> dict:
        """``[roles] method = "dcm"``: DCM trained in checkpoint ``name`` ``[roles] seeds`` times over the candidate
        heads of the final circuit's groups (`sites`: every head any checkpoint's own circuit has there) on
        ``[roles] desiderata`` (else the task's), with ``[dcm]``'s pairs and training but the fixed sparsity weight
        ``[roles] lam`` (`roles_dcm_config`); per role the selection, the seeds' frequencies and the per-pair test
        outcomes of the selection, the floor and layer-matched random heads (`dcm_seeds`)."""
        from ....methods.roles import dcm_seeds

        s, r, d = self.s, self.s.st.roles, self.s.st.dcm
        pairs = s.desiderata(d.n_train + d.n_val + d.n_test, names=r.desiderata or list(s.task.desiderata))
        sites = self.sites(circuits, pairs)
        config = roles_dcm_config(s.dcm_config(), r)
        rows = dcm_seeds(s.checkpoints().model(name), sites, pairs, config, r.seeds, r.votes, s.progress)
        return {"method": "dcm", "sites": [[g, p, [h.name for h in hs]] for g, p, hs in sites], "rows": rows}

    @staticmethod
    def costs(p: PlanCounts) -> list:
        """At each step scored: with ``method = "heads"`` the pairs' runs (one more a head scored is not counted: the
        heads are the circuits', known after discovery); with ``method = "dcm"`` what `dcm_seeds` runs
        (`dcm_cost`)."""
        st = p.st
        if st.roles is None:
            return []
        steps = [c for c, s in zip(p.names, checkpoint_steps(p.names)) if not st.roles.steps or s in st.roles.steps]
        if st.roles.method == "dcm":
            return [dcm_cost(p, c) for c in steps]
        roles = [(st.roles.n, 2 * p.batches(st.roles.n), 1)]
        why = "the pairs' runs; one more a head scored (the heads are the circuits', known after discovery)"
        return [p.cost(f"roles:{c}", st.roles.n, roles, why) for c in steps]


def dcm_cost(p: PlanCounts, name: str) -> Any:
    """``roles:<name>`` by DCM (`RolesStage.dcm`), counted as the circuits study's DCM is (`work_cost`, its pair
    cache in a scratch file, as `dcm_seeds` builds it): per desideratum of ``[roles] desiderata`` the pair cache
    of ``[dcm]``'s pairs, then per group (`candidate_starts`) ``[roles] seeds`` masks trained (``epochs`` of
    training steps, a forward and a backward a micro-batch, and the validation runs), and on the test pairs the
    selection and ``[roles] n_random`` layer-matched random head sets (the floor is the cache's: no run). Every
    mask is assumed to select heads from its first step on: a validation or a test with none selected runs
    nothing, so a run where masks select late or nothing costs less."""
    from ...circuits.stages.dcm import DcmWork, work_cost

    st, r = p.st, p.st.roles
    starts, note = candidate_starts(p)
    k = len(r.desiderata or _task_desiderata(st.task.name))
    work = DcmWork(st.dcm, k, len(starts), starts, r.n_random, seeds=r.seeds, whole=0, models=1)
    cost = work_cost(p.meter, st.eval.batch_size, work, "file", f"roles:{name}")
    cost.note = f"DCM: {r.seeds} seeds x {k} desiderata x {len(starts)} groups; {note}"
    return cost


def candidate_starts(p: PlanCounts) -> tuple[dict[str, tuple[float, str]], str]:
    """Each group the roles stage trains DCM over (`RolesStage.sites`) with the lowest layer of its candidate heads
    and its position, and how it is known: from the circuits a run found (`PlanCounts.circuits`: a curve circuit's
    group is its position class; every checkpoint's heads there, or the final's with ``[roles] heads = "final"``);
    before discovery assumed as the circuits study's DCM assumes a curve circuit's groups (`group_starts`): the
    named groups (else the task's named positions), each from the first layer."""
    from ....common.components import parse_heads

    st = p.st
    wanted = st.roles.groups or st.dcm.groups
    final = p.circuits.get(p.names[-1])
    if final is None:
        groups = list(wanted) or list(p.meter.lengths.suffix)
        return {g: (0, g) for g in groups}, "candidates from the first layer, assumed (known after discovery)"
    scored = p.circuits.values() if st.roles.heads == "any" else [final]
    present = {pos for _, pos in final}
    groups = [g for g in wanted if g in present] if set(wanted) & present else sorted(present)
    heads = {g: parse_heads(sorted({h for c in scored for h, pos in c if pos == g})) for g in groups}
    starts = {g: (min(h.layer for h in hs), g) for g, hs in heads.items() if hs}
    return starts, "candidates from the run's circuits"


def _task_desiderata(task: str) -> list[str]:
    """Every desideratum task ``task`` declares (what the stage trains where ``[roles] desiderata`` is empty)."""
    from ....tasks.base import get_task

    return list(get_task(task).desiderata)
