"""``cmap:<ckpt>``: CMAP of the final circuit's groups (``[cmap] groups``, ``parts``) from the checkpoint into the
first."""

from __future__ import annotations

from dataclasses import asdict
from typing import Optional

from ....circuits.circuit import Circuit
from ....runs.stages import StageRecord
from .base import PlanCounts, Stage


class CmapStage(Stage):
    kind = "cmap"

    def circuit(self, final: StageRecord) -> Optional[Circuit]:
        """The final circuit cut to the groups CMAP patches (`groups` of ``[cmap] groups``, else of ``[dcm]
        groups``; None: none)."""
        c = Circuit.from_dict(final.result["circuit"])
        groups = self.s.groups(c, self.s.st.cmap.groups or self.s.st.dcm.groups)
        if not groups:
            return None
        return Circuit(
            c.model, c.task, {g: c.groups[g] for g in groups}, {g: c.positions[g] for g in groups}, names=dict(c.names)
        )

    def inputs(self, name: str, final: StageRecord) -> dict:
        s, c = self.s, self.s.st.cmap
        return {
            "first": s.digests[s.names[0]],
            "model": s.digests[name],
            "circuit": final.key,
            "cmap": asdict(c),
            "task": s.task_inputs(),
            **s.class_groups(c.groups),
        }

    def compute(self, name: str, final: StageRecord) -> dict:
        from ....methods.trajectory import cmap_gain

        s, c = self.s, self.s.st.cmap
        circuit = self.circuit(final)
        if circuit is None:
            wanted = c.groups or s.st.dcm.groups or "at a position of the task's prompts"
            return {"skipped": f"the final circuit has no heads in the groups {wanted}"}
        cp = s.checkpoints()
        first = cp.first()
        return cmap_gain(
            first, cp.model(name), circuit, s.records("cmap", c.n), c.parts, s.st.eval.batch_size, s.progress
        )

    @staticmethod
    def costs(p: PlanCounts) -> list:
        """Both checkpoints and one patched run per scope (each group, the whole circuit) and part, on ``[cmap] n``
        prompts, in every checkpoint after the first."""
        st = p.st
        scopes = len(st.cmap.groups or st.dcm.groups or ["last", "query_label"]) + 1
        note = "" if st.cmap.groups or st.dcm.groups else "two groups assumed"
        cmap = [(st.cmap.n, (2 + scopes * len(st.cmap.parts)) * p.batches(st.cmap.n), 1)]
        return [p.cost(f"cmap:{c}", st.cmap.n, cmap, note, models=2) for c in p.names[1:]]
