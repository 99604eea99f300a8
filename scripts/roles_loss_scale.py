"""The sparsity weight ``[dcm] lam_scale = "loss"`` gives DCM in each checkpoint of a trajectory's ``[roles] steps``:
``[dcm] lam`` times the unpatched model's mean |logit(target)| on the first training micro-batch of each
desideratum's DCM pairs (``mechdiff.methods.dcm.loss_scale``, whose all-ones mask is the unpatched run), the number
``[roles] lam`` replaces by one weight at every step (docs/trajectories.md, "Roles by DCM over seeds").

    python scripts/roles_loss_scale.py tasks/entity_tracking_trajectory.toml

Loads each of those checkpoints once; writes nothing (the study's results directory is a temporary one)."""

from __future__ import annotations

import sys
import tempfile

import torch

from mechdiff.common.metrics import answer_logit
from mechdiff.methods.dcm import split_pairs
from mechdiff.patching.core import run
from mechdiff.studies.trajectory.study import TrajectoryStudy


def main(path: str) -> None:
    """Print, per ``[roles]`` step, each desideratum's loss-scaled weight and its scale."""
    with tempfile.TemporaryDirectory() as out:
        study = TrajectoryStudy.from_file(path, out=out, progress=False)
        d, config = study.st.dcm, study.dcm_config()
        names = study.st.roles.desiderata or list(study.task.desiderata)
        pairs = study.desiderata(d.n_train + d.n_val + d.n_test, names=names)
        for name, step in zip(study.names, study.steps):
            if study.st.roles.steps and step not in study.st.roles.steps:
                continue
            lm = study.checkpoints().model(name)
            cells = []
            for desideratum, these in pairs.items():
                first = split_pairs(these, config.split, config.seed)[0][: config.micro_batch]
                with torch.no_grad():
                    scale = [
                        float(
                            answer_logit(
                                run(lm, torch.tensor([p.base.input_ids])).logits, torch.tensor([p.target_id])
                            ).abs()
                        )
                        for p in first
                    ]
                mean = sum(scale) / len(scale)
                cells.append(f"{desideratum} {config.lam * mean:.3f} (x{mean:.2f})")
            print(f"step {step}: " + "; ".join(cells), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
