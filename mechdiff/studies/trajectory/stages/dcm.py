"""``dcm``: DCM labels of the final circuit's groups in the final checkpoint (or read from ``[dcm] labels``, a DCM
table another study wrote); ``semantic:<ckpt>``: semantic patching of each DCM selection in the checkpoint."""

from __future__ import annotations

import math
from pathlib import Path

from ....circuits.circuit import Circuit
from ....runs.stages import StageRecord, key_hash
from ..settings import dcm_key, read_labels
from .base import PlanCounts, Stage


class DcmStage(Stage):
    kind = "dcm"
    per_checkpoint = False

    def inputs(self, final: StageRecord) -> dict:
        s, d = self.s, self.s.st.dcm
        inputs = (
            {"labels": d.labels, "table": key_hash(Path(d.labels).read_text())}
            if d.labels
            else {"model": s.digests[s.final], "circuit": final.key}
        )
        return {**inputs, "dcm": dcm_key(d), "task": s.task_inputs(), **s.class_groups(d.groups)}

    def compute(self, final: StageRecord) -> dict:
        s, d = self.s, self.s.st.dcm
        if d.labels:
            return {"source": d.labels, "dcm": read_labels(d.labels)}
        if not s.desideratum_names():
            return {"source": f"task {s.task.name} declares no desideratum: DCM not run", "dcm": []}
        results, left_out = self.train(s.final, final, d.groups, s.desideratum_names())
        out = {"source": f"DCM on the circuit of {s.final}", "dcm": results}
        return {**out, "left_out": left_out} if left_out else out

    def train(self, name: str, final: StageRecord, groups: list[str], names: list[str]) -> tuple[list, list]:
        """DCM trained in checkpoint ``name`` over the final circuit's ``groups`` (`groups` of them) on the
        desiderata ``names``, with ``[dcm]``'s pairs and training: the results, and the groups left out (a class
        whose token count differs within a pair, `unpaired_classes`)."""
        from ....methods.dcm import dcm_circuit
        from ...circuits.stages.dcm import unpaired_classes

        s, d = self.s, self.s.st.dcm
        circuit = Circuit.from_dict(final.result["circuit"])
        desiderata, config = s.desiderata(d.n_train + d.n_val + d.n_test, names=names), s.dcm_config()
        chosen = s.groups(circuit, groups)
        left_out = unpaired_classes(circuit, chosen, desiderata, config.eval_batch)
        chosen = [g for g in chosen if g not in left_out]
        results = dcm_circuit(s.checkpoints().model(name), circuit, desiderata, config, chosen, s.progress)
        return [r.to_dict() for r in results], left_out

    @staticmethod
    def costs(p: PlanCounts) -> list:
        """Reading ``[dcm] labels`` (no pass), else DCM trained in the final checkpoint: per desideratum its pairs'
        two runs, then per group ``epochs`` of training steps (a forward and a backward), the validation runs and
        the test runs of the selection, the floor and ``n_random`` random sets."""
        st, c = p.st, p.st.dcm
        if c.labels:
            return [p.cost("dcm", 0, [], f"read from {c.labels}: no pass", models=0)]
        b = st.eval.batch_size
        k, groups = max(len(c.desiderata), 1), max(len(c.groups), 1)
        pairs = c.n_train + c.n_val + c.n_test
        steps = c.epochs * math.ceil(c.n_train / c.batch_size)
        every = steps // max(c.eval_every, 1) + 1
        tests = (2 + c.n_random) * math.ceil(c.n_test / b) + math.ceil(c.n_val / b) * every
        passes = [
            (pairs, k * 2 * math.ceil(pairs / b), 1),
            (c.batch_size, k * groups * steps, 2),
            (c.n_test, k * groups * tests, 1),
        ]
        note = "" if c.desiderata and c.groups else "one desideratum and one group assumed where none is named"
        return [p.cost("dcm", pairs, passes, note)]


class SemanticStage(Stage):
    kind = "semantic"

    def inputs(self, name: str, dcm: StageRecord) -> dict:
        s = self.s
        return {
            "model": s.digests[name],
            "dcm": dcm.key,
            "dcm_settings": dcm_key(s.st.dcm),
            "task": s.task_inputs(),
            "batch_size": s.st.eval.batch_size,
        }

    def compute(self, name: str, dcm: StageRecord) -> dict:
        from ....methods.trajectory import semantic

        s = self.s
        model = s.checkpoints().model(name)
        return {"rows": semantic(model, dcm.result["dcm"], s.tests(), s.st.eval.batch_size, s.progress)}

    @staticmethod
    def costs(p: PlanCounts) -> list:
        """Two runs a test pair of each desideratum and one per selection, in every checkpoint."""
        st, labels = p.st, p.labels
        chosen = [lab for lab in labels if lab.get("selected")]
        desiderata = {lab["desideratum"] for lab in chosen}
        semantic = [(st.dcm.n_test, (2 * len(desiderata) + len(chosen)) * p.batches(st.dcm.n_test), 1)]
        note = "" if labels else "the selections DCM makes: none counted before it runs"
        return [p.cost(f"semantic:{c}", st.dcm.n_test, semantic, note) for c in p.names]
