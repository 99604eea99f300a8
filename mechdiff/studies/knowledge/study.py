"""The knowledge-circuit study (kind ``knowledge``) of one or more relations on one or more checkpoints.

For each model: keep the facts it gets right by Hit@k (the paper's sampling); score every edge
(EAP-IG by default, or run ACDC); choose the circuit as the smallest circuit among ``sizes``
(greedy growth from the logits by score, or top scores; dangling edges pruned) whose Hit@k
reaches ``target`` x the full model's; compare with
random circuits of the same edge count; the MIB-style faithfulness curve with CPR and CMD;
logit lens and head roles; figures and tables. With two or more models the facts are those every
model gets right, and the circuits are compared (edge and node overlap, persisting heads).

Stages, each cached in ``<out>/stages/`` by `mechdiff.runs.stages.StageCache` under a key of
what it reads: ``facts`` (which facts every model gets right), and per model ``discovery`` (edge
scores), ``scoring`` (the circuit, random circuits, the curve) and ``analysis`` (logit lens, head
roles). A rerun recomputes only the stages a changed option reaches; tables, figures and reports are
rewritten from the records every time. Random circuits draw their seeds by name
(`mechdiff.runs.seeds.derive`). The methods (edge graph, EAP/ACDC, evaluation, logit lens) are the
library `mechdiff.methods.knowledge`; `KnowledgeStudy` runs them as stages, each stage a module of this package
holding its key, its computation and its cost (`facts`, `discovery`, `scoring`, `analysis`; what a model's stages
share: `model_run`), beside the settings (`settings`), the results written from the records (`results`), the
report (`report`) and the resource plan (`plan`).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any, Callable, Optional

from ...models.loading import LoadedModel
from ...models.modelset import check_vocabularies
from ...runs.stages import Pending, StageCache
from ...tasks.relation_data import Relation
from ..base import Study, section_study
from .facts import facts_stage, load_facts
from .model_run import ModelRun
from .plan import plan_facts, relation_costs
from .results import model_stages, write_relation
from .settings import KnowledgeSettings, load_file

log = logging.getLogger(__name__)


class KnowledgeStudy(Study):
    """The knowledge circuits of each relation (``relations``, else ``relation``) on ``settings.models``: per
    relation, the facts every model gets right, one circuit per model, their comparison. One relation: into
    ``out``; several: each into ``out/<relation>`` with its own stage cache (as the committed studies are laid out).
    ``load`` loads a model by name (`model_loader`; a test's tiny models)."""

    kind = "knowledge"

    def __init__(
        self, settings: KnowledgeSettings, out: str | Path, load: Callable[[str], LoadedModel], progress: bool = True
    ):
        super().__init__(out, progress)
        self.settings, self.load = settings, load
        for name in self.relations():
            Relation.load(name)  # an unknown relation is refused before any weights load
        self._models: dict[str, LoadedModel] = {}
        self._caches = {
            r: self.cache if len(self.relations()) == 1 else StageCache(self.dir / r) for r in self.relations()
        }
        self.outcome: dict[str, dict] = {}

    @classmethod
    def from_file(
        cls,
        path: Optional[str | Path],
        out: Optional[str] = None,
        progress: bool = True,
        models: Optional[dict] = None,
        task: Optional[str] = None,
    ) -> "KnowledgeStudy":
        """The study of a task file with ``[study] kind = "knowledge"``; ``models``: how models load (dtype, ...)."""
        return section_study(
            cls, path, out, progress, models, task, load_file, "knowledge", "tasks/knowledge_acdc.toml"
        )

    @classmethod
    def plan_inputs(cls, path: Optional[str | Path], task: Optional[str] = None, dtype: Optional[str] = None) -> Any:
        """The ``[knowledge]`` settings, the first model's dims (every model is assumed of its shape: checkpoints
        of one model) and each relation's facts per token length under its tokenizer (`plan_facts`)."""
        from ...models.footprint import model_dims
        from ..planner import Lengths, PlanInputs

        if path is None or task is not None:
            raise ValueError("a knowledge study is a task file's [knowledge] section; it has no [task] to override")
        s = load_file(path)[0]
        dims, source = model_dims(s.models[0])
        counts, used = plan_facts(s)
        every = [t for c in counts.values() for t, n in c.items() for _ in range(n)] or [1]
        lengths = Lengths(sum(every) / len(every), max(every), {}, 0, used)
        rows = min(2048, s.batch_size * lengths.longest)
        return PlanInputs(
            "knowledge", s, dims, source, lengths, dtype or "float32", tuple(s.models), len(s.models), rows,
            known={"facts": counts},
        )  # fmt: skip

    @classmethod
    def stage_costs(cls, inputs: Any, device: Any) -> list:
        """Per relation: facts, then each model's discovery, scoring and analysis (`relation_costs`)."""
        s, counts = inputs.settings, inputs.known["facts"]
        meter = inputs.meter(device)
        several = len(counts) > 1
        out = []
        for relation, lengths in counts.items():
            known = inputs.known.get("found", {}).get(relation, {})
            out += relation_costs(meter, s, lengths, known, f"{relation}/" if several else "")
        return out

    @classmethod
    def with_batch(cls, settings: Any, cost: Any, batch: int) -> Any:
        return replace(settings, batch_size=batch)

    def relations(self) -> tuple[str, ...]:
        return tuple(self.settings.relations) or (self.settings.relation,)

    def relation_settings(self, relation: str) -> KnowledgeSettings:
        """The settings of one relation: its template where ``templates`` names one."""
        s = self.settings
        return replace(s, relation=relation, template=s.templates.get(relation, s.template))

    def caches(self) -> list[StageCache]:
        return list(self._caches.values())

    def settings_record(self) -> dict:
        return asdict(self.settings)

    def model(self, name: str) -> LoadedModel:
        if name not in self._models:
            self._models[name] = self.load(name)
        return self._models[name]

    def stages(self) -> dict[str, dict]:
        """Per relation: the facts stage, then each model's discovery, scoring and analysis."""
        return {r: self._relation_stages(r) for r in self.relations()}

    def _relation_stages(self, relation: str) -> dict:
        settings, cache = self.relation_settings(relation), self._caches[relation]
        models = [self.model(n) for n in settings.models]
        check_vocabularies({m.name: m.tokenizer for m in models})
        facts = load_facts(models[0], settings)
        data = facts_stage(models, facts, settings, cache)
        try:
            kept = [facts[i] for i in data.result["kept"]]
        except Pending as pending:  # a plan: which facts every model gets right is still to compute
            for m in models:
                for stage in ("discovery", "scoring", "analysis"):
                    cache.pending(f"{stage}:{m.name}", pending.stage)
            return {}
        if not kept:
            raise ValueError(f"no fact of {settings.relation} is right (Hit@{settings.k}) in every model")
        log.info("%s: keeping %d of %d facts", relation, len(kept), len(facts))
        per_model = {}
        for m in models:
            run = ModelRun(m, kept, settings, self.progress)
            try:
                per_model[m.name] = (run, *model_stages(run, cache))
            except Pending:
                continue
        return {"facts": facts, "data": data, "kept": kept, "models": per_model}

    def write(self, results: dict[str, dict]) -> Path:
        """Per relation: each model's results, tables, figures, report and ``report.html``, the comparison and
        ``study.json``; the study directory's ``report.html`` where it holds several relations."""
        from ...report.html import write_html

        reports = []
        for relation, res in results.items():
            out = self._caches[relation].root
            self.outcome[relation] = write_relation(self.relation_settings(relation), res, out, self._caches[relation])
            reports.append(out / ("comparison.md" if len(res["models"]) > 1 else "report.md"))
            write_html(out)  # each relation's page (its circuit, tables), as `mechdiff view` writes it
        if any(r.parent != self.dir for r in reports):
            write_html(self.dir)
        return reports[0] if len(reports) == 1 else self.dir
