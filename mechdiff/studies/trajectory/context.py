"""What every stage of the trajectory study reads (`TrajectoryContext`): the checkpoints (loaded when a stage
first computes: the base once, the adapters swapped), the task's prompt sets and desideratum pairs, each with its
seed, the scorer, and the inputs every stage key shares."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from types import SimpleNamespace
from typing import Optional

from ...circuits.circuit import Circuit
from ...common.io import check_writable
from ...methods.checkpoints import Checkpoints, trajectory_specs
from ...models.loading import load_tokenizer, spec_digest
from ...runs.seeds import derive, prompt_seed
from ..base import Study, rows_inputs, vocabulary_digest
from .settings import TrajectorySettings, checkpoint_steps, edge_checkpoints, other_runs


class TrajectoryContext(Study):
    """The checkpoints, prompt sets and shared key inputs of one trajectory task file (`TrajectoryStudy` runs its
    stages on them)."""

    def __init__(self, settings: TrajectorySettings, out: Optional[str | Path] = None, progress: bool = True):
        from ...tasks.base import get_task

        super().__init__(out or settings.output.dir, progress)
        self.st = settings
        self.store = str(Path(settings.output.store))
        check_writable(Path(self.store).parent, "activation store directory")
        self.names = list(settings.models.checkpoints)
        self.runs = other_runs(settings.runs, self.names)  # the between-run null's checkpoints by step
        self.others = [o for names in self.runs.values() for o in names]
        self.base_spec, specs = trajectory_specs([*self.names, *self.others])
        self.digests = {n: spec_digest(s) for n, s in zip([*self.names, *self.others], specs)}
        self.steps = checkpoint_steps(self.names)
        self.task = get_task(settings.task.name)
        self.tokenizer = load_tokenizer(self.base_spec)
        self._checkpoints: Optional[Checkpoints] = None
        self.check_prompts()  # before any weights load

    # -- data ---------------------------------------------------------------------------
    @property
    def final(self) -> str:
        return self.names[-1]

    @property
    def first_trained(self) -> str:
        """The first checkpoint after the reference (the first in the list)."""
        return self.names[1]

    def checkpoints(self) -> Checkpoints:
        """The checkpoints, loaded when a stage first computes (the base once, the adapters swapped)."""
        if self._checkpoints is None:
            m = self.st.models
            self._checkpoints = Checkpoints([*self.names, *self.others], dtype=m.dtype, device=m.device)
        return self._checkpoints

    def seed(self, prompts: str) -> int:
        """The seed of one of the study's prompt sets (`prompt_seed`)."""
        return prompt_seed(self.st.task.seed, prompts)

    def options(self) -> dict:
        """Generator options: ``n_boxes``, and the held-out objects where the task splits its objects."""
        return {"n_boxes": self.st.task.n_boxes, **self.task.split_options("eval")}

    def records(self, prompts: str, n: int) -> list:
        """``n`` prompts of the prompt set ``prompts`` (an imported task hands out that set's rows)."""
        return self.task.records(self.tokenizer, n, self.seed(prompts), prompt_set=prompts, **self.options())

    def groups(self, circuit: Circuit, wanted: list[str]) -> list[str]:
        """The circuit's groups a stage patches: ``wanted`` (those with heads), else every group at a position of the
        task's prompts (`analysis_groups`)."""
        from ..circuits.stages.groups import analysis_groups

        return analysis_groups(self.task, self.records("eval", 16), circuit, wanted)

    def desideratum_names(self) -> list[str]:
        """``[dcm] desiderata`` (those the task declares; empty: every desideratum the task declares)."""
        from ...tasks.desiderata import chosen_desiderata

        return chosen_desiderata(self.st.dcm.desiderata, self.task.desiderata)

    def ranking_n(self, name: str) -> int:
        """Ranking prompts of checkpoint ``name``: ``[discovery] runs_n`` at a step the between-run null reads (this
        run's checkpoint there and the other runs'), ``n`` elsewhere."""
        d = self.st.discovery
        return d.runs_n if name in self.runs or name in self.others else d.n

    def prompt_set_sizes(self) -> dict[str, int]:
        """The rows of each prompt set the study scores (for the plan's detectable differences): the ranking set at
        its largest (``runs_n`` where the between-run null reads steps)."""
        d, e = self.st.discovery, self.st.eval
        ranking = max(self.ranking_n(n) for n in [*self.names, *self.others])
        return {
            "eval": e.n,
            "ranking": ranking,
            "curve": d.curve_n,
            "matrix": self.st.scoring.n,
            "cmap": self.st.cmap.n,
        }

    def scorer(self, name: str, prompts: str, n: int):
        from ...circuits.scoring import Scorer

        reference = self.task.reference_records(
            self.tokenizer, self.st.scoring.reference_n, self.seed("reference"), **self.options()
        )
        return Scorer.build(
            self.checkpoints().model(name),
            self.records(prompts, n),
            reference,
            self.st.eval.batch_size,
            self.progress,
            store=self.store,
        )

    def task_inputs(self) -> dict:
        from ...version import __version__

        return {
            "task": asdict(self.st.task),
            "dtype": self.st.models.dtype,
            "vocabulary": vocabulary_digest(self.task),
            "tokenizer": spec_digest(self.base_spec),
            "mechdiff": __version__,
            **rows_inputs(self.task),
        }

    def reference_inputs(self) -> dict:
        return {"reference_n": self.st.scoring.reference_n, "batch_size": self.st.eval.batch_size}

    def check_prompts(self) -> None:
        """Before any weights load: every scored prompt's group (template, token length) has reference prompts."""
        from ...tasks.base import check_reference

        reference = self.task.reference_records(
            self.tokenizer, self.st.scoring.reference_n, self.seed("reference"), **self.options()
        )
        d = self.st.discovery
        ranking = max(self.ranking_n(n) for n in [*self.names, *self.others])
        for prompts, n in (("ranking", ranking), ("curve", d.curve_n), ("matrix", self.st.scoring.n)):
            check_reference(self.records(prompts, n), reference, f"{prompts} prompts")

    def desiderata(self, n: int, seed: Optional[int] = None, names: Optional[list[str]] = None) -> dict[str, list]:
        """``n`` pairs of every desideratum (``names``, default `desideratum_names`), drawn with ``seed``
        (default: the DCM prompt set's)."""
        from ...tasks.desiderata import desideratum_pairs

        opts = self.options()
        seed = self.seed("dcm") if seed is None else seed
        return {
            d: desideratum_pairs(
                d, self.tokenizer, n, opts.get("n_boxes"), seed, vocabulary=opts.get("vocabulary"), task=self.task.name
            )
            for d in (self.desideratum_names() if names is None else names)
        }

    def tests(self) -> dict[str, list]:
        """The test pairs of every desideratum: those DCM held out, or ``n_test`` pairs for labels read. Labels
        read were trained on a circuits study's DCM pairs (its ``dcm`` prompt set, whose first pairs any shorter
        draw of that set repeats), so their test pairs are a draw of their own."""
        from ...methods.dcm import split_pairs

        d = self.st.dcm
        if d.labels:
            return self.desiderata(d.n_test, derive(self.st.task.seed, "semantic-test-pairs"))
        config = self.dcm_config()
        return {
            k: split_pairs(v, config.split, config.seed)[2]
            for k, v in self.desiderata(d.n_train + d.n_val + d.n_test).items()
        }

    def dcm_config(self):
        from ..circuits.stages.dcm import dcm_config

        return dcm_config(SimpleNamespace(dcm=self.st.dcm, eval=self.st.eval, task=self.st.task))

    def class_groups(self, wanted: list[str]) -> dict[str, list[str]]:
        """Key inputs naming the classes of several tokens a DCM, CMAP or roles stage may patch
        (`class_groups`; empty, so the keys stay, where every group is one
        named token)."""
        from ..circuits.stages.groups import class_groups

        return class_groups(self.records("eval", 16), wanted)

    def role_checkpoints(self) -> list[str]:
        """The checkpoints the roles stage scores: those at ``[roles] steps`` (every one where empty; none without a
        ``[roles]`` section)."""
        r = self.st.roles
        if r is None:
            return []
        return [n for n, s in zip(self.names, self.steps) if not r.steps or s in r.steps]

    def role_pairs(self) -> dict[str, list]:
        """``[roles] n`` pairs of each desideratum scored (``[roles] desiderata``, else every one the task
        declares), a draw of their own (neither DCM's nor semantic patching's)."""
        r = self.st.roles
        return self.desiderata(r.n, derive(self.st.task.seed, "role-pairs"), r.desiderata or list(self.task.desiderata))

    def edge_checkpoints(self) -> list[str]:
        """The checkpoints the edge stages score (`edge_checkpoints`; none with ``[edges]`` off)."""
        return edge_checkpoints(self.st.edges, self.st.runs, self.names)
