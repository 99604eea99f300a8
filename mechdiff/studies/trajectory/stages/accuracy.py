"""``accuracy:<ckpt>``: held-out accuracy (exact binomial) with each prompt's outcome, of every checkpoint and of
the other runs' (``[runs]``)."""

from __future__ import annotations

from dataclasses import asdict

from .base import PlanCounts, Stage


class AccuracyStage(Stage):
    kind = "accuracy"

    def inputs(self, name: str) -> dict:
        return {"model": self.s.digests[name], "task": self.s.task_inputs(), "eval": asdict(self.s.st.eval)}

    def compute(self, name: str) -> dict:
        from ....methods.trajectory import checkpoint_accuracy

        e = self.s.st.eval
        return checkpoint_accuracy(
            self.s.checkpoints().model(name), self.s.records("eval", e.n), e.batch_size, self.s.progress
        )

    @staticmethod
    def costs(p: PlanCounts, names: list[str]) -> list:
        """A pass a batch of ``[eval] n`` prompts, in each of ``names``."""
        n = p.st.eval.n
        return [p.cost(f"accuracy:{c}", n, [(n, p.batches(n), 1)]) for c in names]
