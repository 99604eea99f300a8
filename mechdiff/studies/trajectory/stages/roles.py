"""``roles:<ckpt>`` (only where the task file has a ``[roles]`` section): every head of the chosen groups of any
checkpoint's own circuit scored alone on each desideratum in the checkpoint (`head_scores`), or with ``method =
"dcm"`` DCM over them with one fixed sparsity weight, several seeds (`dcm_seeds`), from which the report gives role
membership over the steps and the heads that join, leave or take over a role."""

from __future__ import annotations

from dataclasses import asdict
from typing import Optional

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
        """The pairs' runs at each step scored; one more a head scored is not counted (the heads are the circuits',
        known after discovery)."""
        st = p.st
        if st.roles is None:
            return []
        steps = [c for c, s in zip(p.names, checkpoint_steps(p.names)) if not st.roles.steps or s in st.roles.steps]
        roles = [(st.roles.n, 2 * p.batches(st.roles.n), 1)]
        why = "the pairs' runs; one more a head scored (the heads are the circuits', known after discovery)"
        return [p.cost(f"roles:{c}", st.roles.n, roles, why) for c in steps]
