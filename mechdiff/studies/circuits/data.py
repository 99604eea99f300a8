"""The circuits study's prompt sets and the key inputs every stage shares: the task with its sets drawn
(disjoint by item, seeded by name), each set's records, the mean-ablation reference and scorers, the groups DCM,
CMAP and completeness look at, and ``run.json``'s account of the sets. `CircuitsStudy` (the orchestrator of the
stages, `mechdiff.studies.circuits.stages`) is built on it."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any, Optional

from ...circuits.circuit import Circuit
from ...models.loading import LoadedModel
from ...runs.seeds import prompt_seed
from ...tasks.base import Task, get_task
from ..base import Study, rows_inputs, vocabulary_digest
from .stages.groups import class_groups, group_choice


class CircuitsData(Study):
    """What the circuits study's stages read besides their own section (the study's ``spec``, ``tokenizer``,
    ``digests``, ``models`` and ``store``, set by `CircuitsStudy`)."""

    spec: Any
    tokenizer: Any
    digests: dict
    store: str

    def task_inputs(self) -> dict:
        """What every stage depends on besides its own section: the task, how models load, the
        held-out vocabulary, the tokenizer (the base's) and the code version."""
        from ...version import __version__

        return {
            "task": asdict(self.spec.task),
            "dtype": self.spec.models.dtype,
            "device_map": self.spec.models.device_map,
            "vocabulary": vocabulary_digest(self.task),
            "tokenizer": self.digests[self.spec.models.base],
            "mechdiff": __version__,
            **rows_inputs(self.task, self.prompt_sets),
            **self.item_inputs(),
            **({"remote": True} if self.spec.models.remote else {}),
        }

    def item_inputs(self) -> dict:
        """What items add to every stage's key: the nested sets where declared, and for a generated task the
        prompts each set drew past (an earlier set held their item); empty where neither, so the keys of a study
        whose generated prompts never repeat across sets stay what they were."""
        out: dict = {"nested_sets": self.nested_sets()} if self.spec.sets.nested else {}
        generated = self.generated_sets
        left_out = generated.left_out(self.tokenizer) if generated is not None else {}
        return {**out, "items_left_out": left_out} if left_out else out

    def metric_inputs(self) -> dict:
        """The task's metric, in the keys of the stages whose continuous scores it sets (the position scan, the
        circuit, pruning, the matrix, CMAP); none for ``prob``, so those stages' keys stay as they were before it
        counted."""
        return {} if self.task.metric == "prob" else {"metric": self.task.metric}

    @property
    def task(self) -> Task:
        """The task the task file's ``[task]`` section names (registered, or an imported task directory), with the
        study's prompt sets drawn from its rows where it holds a fixed list of them (`prompt_sets`), else its
        generators drawing each named set disjoint by item (`GeneratedSets`)."""
        if getattr(self, "_task", None) is None or self._task[0] != self.spec.task.name:
            from ...tasks.prompt_sets import GeneratedSets

            base = get_task(self.spec.task.name)
            sizes, nested = self.prompt_set_sizes(base), self.nested_sets(base)
            task, sets = base.draw_prompt_sets(sizes, self.spec.task.seed, nested)
            generated = None
            if base.strata is None:
                seed, options = self.spec.task.seed, {"n_boxes": self.spec.task.n_boxes, **base.split_options("eval")}
                blocks = {n: (k, prompt_seed(seed, nested[0] if n in nested else n)) for n, k in sizes.items()}
                generated = GeneratedSets(base, blocks, nested, base.kwargs(**options))
                task = generated.task()
            self._task = (self.spec.task.name, task, sets, generated)
        return self._task[1]

    @property
    def prompt_sets(self) -> dict[str, list[int]]:
        """Each prompt set's task rows (indices into an imported task's pairs), disjoint by item and stratified by
        (template, token length); empty for a task that generates its prompts (each set seeded by its name)."""
        self.task  # noqa: B018 - draws the sets
        return self._task[2]

    @property
    def generated_sets(self) -> Any:
        """A generated task's `GeneratedSets` (None for an imported task)."""
        self.task  # noqa: B018 - draws the sets
        return self._task[3]

    def nested_sets(self, task: Optional[Task] = None) -> list[str]:
        """The sets drawn as first-N of one draw (``[sets] nested = true``: those of `NESTED_SETS` the
        study has), in the order they are dealt; none by default (every set disjoint by item)."""
        from .spec import NESTED_SETS

        if not self.spec.sets.nested:
            return []
        return [name for name in self.prompt_set_sizes(task) if name in NESTED_SETS]

    def prompt_set_sizes(self, task: Optional[Task] = None) -> dict[str, int]:
        """The rows each prompt set of the study needs, in the order they are dealt: the mean-ablation reference
        first (so every group of the task has reference prompts), then as the stages run (``task``: the study's,
        where it is being built)."""
        d, s, p = self.spec.discovery, self.spec.scoring, self.spec.positions
        sizes = {"reference": s.reference_n, "eval": self.spec.eval.n}
        if p.n > 0:
            sizes["positions"] = p.n
        sizes.update({"ranking": d.n, "curve": d.curve_n} if d.method == "curve" else {"discovery": d.n})
        sizes["matrix"] = s.n
        if s.prune:
            sizes["prune"] = s.prune_n
        if (task or self.task).desiderata:
            sizes["dcm"] = self.spec.dcm.n_train + self.spec.dcm.n_val + self.spec.dcm.n_test
        if self.spec.models.finetunes:
            sizes["cmap"] = self.spec.cmap.n
        return sizes

    def prompt_set_items(self) -> dict[str, int]:
        """The items each prompt set takes (its rows' distinct items: clean prompts, or the task's item field), as
        the study's own set construction draws them before any weights load: an imported task's from its rows, a
        generated task's from its generators' prompts (one row an item where no prompt repeats). What ``--plan``
        computes each set's detectable difference on (`detectable_text`)."""
        return {name: int(k) for name, k in self.prompt_sets_record()["items"].items()}

    def options(self, held_out: bool = True, prompts: Optional[str] = None) -> dict:
        """Generator options: ``n_boxes``, the objects held out from fine-tuning where the task splits its
        objects (`split_options`), and the prompt set's name (an imported task
        hands out that set's rows); the task keeps only the options it accepts."""
        split = self.task.split_options("eval") if held_out else {}
        return {"n_boxes": self.spec.task.n_boxes, "prompt_set": prompts, **split}

    def seed(self, prompts: str) -> int:
        """The seed of one of the study's prompt sets (`prompt_seed`); nested sets
        (``[sets] nested = true``) share the first nested set's, so each is a prefix of one draw."""
        nested = self.nested_sets()
        return prompt_seed(self.spec.task.seed, nested[0] if prompts in nested else prompts)

    def eval_records(self) -> list:
        return self.task.records(self.tokenizer, self.spec.eval.n, self.seed("eval"), **self.options(prompts="eval"))

    def model(self, name: str) -> LoadedModel:
        return self.models[name]

    def reference_inputs(self) -> dict:
        """What a scorer's ablation means depend on besides the task and model."""
        return {"reference_n": self.spec.scoring.reference_n, "batch_size": self.spec.eval.batch_size}

    def scored_sets(self) -> dict[str, int]:
        """The prompt sets scored under mean ablation (name -> number of prompts), as the stages ask for them."""
        d, s, p = self.spec.discovery, self.spec.scoring, self.spec.positions
        out = {"matrix": s.n}
        if p.n > 0:
            out["positions"] = p.n
        if d.method == "curve":
            out.update(ranking=d.n, curve=d.curve_n)
        if s.prune:
            out["prune"] = s.prune_n
        return out

    def check_prompts(self) -> None:
        """Before any weights load: every scored prompt's group (template, token length) has reference prompts
        (mean ablation never averages across templates or lengths), and the task's rows are readable."""
        from ...tasks.base import check_reference

        reference = self.reference_records()
        for prompts, n in self.scored_sets().items():
            records = self.task.records(self.tokenizer, n, self.seed(prompts), **self.options(prompts=prompts))
            check_reference(records, reference, f"{prompts} prompts")

    def reference_records(self, seed: Optional[int] = None) -> list:
        """The mean-ablation reference: ``reference_n`` prompts of their own (held-out objects, like every set),
        drawn by the study's seed or by ``seed`` (a model's pruning seed, as if it were the task's)."""
        s = self.spec.scoring
        drawn = self.seed("reference") if seed is None else prompt_seed(seed, "reference")
        return self.task.reference_records(self.tokenizer, s.reference_n, drawn, **self.options(prompts="reference"))

    def prompt_records(self, prompts: str, n: int) -> list:
        """The ``n`` records of the named prompt set (held-out objects; an imported task's drawn rows)."""
        return self.task.records(self.tokenizer, n, self.seed(prompts), **self.options(prompts=prompts))

    def scorer(self, name: str, prompts: str = "matrix", n: Optional[int] = None, seed: Optional[int] = None):
        """A scorer of ``name`` on ``n`` prompts of the named set; every scorer ablates with the means of the
        same ``reference_n`` reference prompts (held-out objects, like every other prompt set), or of those a
        seed of its own draws (``seed``: a model's pruning seed)."""
        from ...circuits.scoring import Scorer

        records = self.prompt_records(prompts, n or self.spec.scoring.n)
        return Scorer.build(
            self.model(name),
            records,
            self.reference_records(seed),
            self.spec.eval.batch_size,
            self.progress,
            store=self.store,
            metric=self.task.metric,
        )

    def analysis_groups(self, circuit: Circuit, wanted: list[str], check: bool = True) -> list[str]:
        """The groups DCM and CMAP (``check``: groups at a position the prompts carry) or completeness look at;
        each patches every token of a group's position class (`group_choice`)."""
        return self.group_choice(circuit, wanted, check)[0]

    def group_choice(self, circuit: Circuit, wanted: list[str], check: bool = True) -> tuple[list, dict]:
        """The groups a stage looks at and each group left out, with why (`group_choice`)."""
        return group_choice(self.task, self.probe_records(), circuit, wanted, check)

    def probe_records(self) -> list:
        """A few of the task's eval prompts (16), enough to read which positions its prompts carry and how."""
        return self.task.records(self.tokenizer, 16, self.seed("eval"), **self.options(prompts="eval"))

    def class_groups(self, wanted: list[str]) -> dict[str, list[str]]:
        """Key inputs naming the classes of several tokens a DCM or CMAP stage may patch (`class_groups`);
        a path circuit's groups (a plan's steps) sit at their step's sender position."""
        from ...tasks.plan import task_plan

        path = self.spec.discovery.method == "path"
        at = {s.name: s.sender for s in task_plan(self.task).steps} if path else {}
        return class_groups(self.probe_records(), wanted, at)

    def set_items(self, prompts: str) -> Any:
        """The item id of each row of the prompt set ``prompts`` (``np.ndarray``, int64), aligned with the rows its
        stages score (their first ``n`` where a stage reads fewer): rows of one item share an id, and ids are the
        study's (one item, one id in every set), as ``run.json``'s ``prompt_sets.item_ids`` records them. What an
        interval clustered by item resamples. A model's own discovery or pruning seed (``[discovery.models.NAME]``)
        draws other prompts than these."""
        from ...tasks.prompt_sets import set_items

        return set_items(self.prompt_sets_record(), prompts)

    def prompt_sets_record(self) -> dict:
        """``run.json``'s account of the prompt sets: each set's rows (an imported task's task rows) and item ids
        (aligned with the rows its stages score: `set_items` reads them), the sets
        each stage reads, and what the report states of them (rows and items per set, groups, rows and items shared
        between sets, counterfactuals that are another item's prompt), computed from the lists; declared nested
        sets as a departure."""
        from ...tasks.prompt_sets import describe_items, describe_sets, nested_departure

        sets, ranked = self.prompt_sets, "discovery" if self.spec.discovery.method == "path" else "ranking"
        sizes, nested = self.prompt_set_sizes(), self.nested_sets()
        reads = {
            "accuracy": ["eval"],
            "positions": ["positions", "reference"],
            "circuit": [ranked, "curve", "reference"] if ranked == "ranking" else [ranked],
            "prune": ["prune", "reference"],
            "matrix": ["matrix", "reference"],
            "dcm": ["dcm"],
            "cmap": ["cmap"],
        }
        stages = {stage: [n for n in names if n in sizes] for stage, names in reads.items()}
        if sets:
            t = self.task
            out = {"rows": sets, **describe_sets(sets, t.strata, t.items, t.sources, nested)}
        else:
            generated = self.generated_sets
            keys = generated.set_keys(sizes, self.tokenizer)
            out = {"generated": True, **describe_items(keys, nested), "left_out": generated.left_out(self.tokenizer)}
        out.update(stages={k: v for k, v in stages.items() if v}, nested=nested)
        if nested:
            out["departure"] = nested_departure(nested)
        return out
