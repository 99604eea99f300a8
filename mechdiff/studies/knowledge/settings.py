"""The knowledge kind's settings: the ``[knowledge]`` section of a task file (``tasks/knowledge.toml``), its
allowed values and how a task file is read into it; the command's flags override it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ...methods.knowledge.acdc import METRICS
from ...methods.knowledge.evaluate import SIZES
from ..base import load_section_file

METHODS = ("eap", "iterative", "eap-ig", "acdc")
ABLATIONS = ("mean", "zero")
SELECTIONS = ("greedy", "topk")


@dataclass
class KnowledgeSettings:
    """The ``[knowledge]`` section of a task file (``tasks/knowledge.toml``); the command's flags override it."""

    relation: str = "country_language"
    unedited: bool = False  # an edit file's subjects with their original objects (the facts before the edit)
    models: tuple = ("smollm2-135m",)  # one circuit each on the facts all get right, then their overlap
    template: int = 0
    method: str = "eap"  # one of METHODS
    ig_steps: int = 5
    shrink: float = 0.25  # iterative: at most this fraction of the edges kept per round
    ablation: str = "mean"  # mean | zero
    keep_first: bool = False  # never ablate position 0 (the attention sink)
    k: int = 10  # Hit@k
    target: float = 0.7  # circuit Hit@k >= target * full model's
    sizes: tuple = (0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1)  # candidate circuit sizes (fraction of edges)
    curve_sizes: tuple = SIZES
    curve: bool = True
    tau: float = 0.02  # ACDC threshold on its metric (paper: 0.02, 0.01, 0.005)
    acdc_metric: str = "match_nll"  # one of acdc.METRICS (match_nll: the paper's); see knowledge/acdc.py
    acdc_prefilter: float = 0.0  # ACDC tries only this top fraction of edges by |EAP| (0: every edge)
    acdc_batch: int = 0  # ACDC candidate edges per forward (0: sized by memory)
    acdc_facts: int = 0  # ACDC on at most this many top-1 facts of one length (0: every fact)
    n_random: int = 3
    max_facts: int = 0  # 0: every fact of the relation
    batch_size: int = 32
    signed: bool = False  # rank edges by score instead of |score|
    prune_unreached: bool = True  # also drop edges from senders without inputs (exact under zero ablation only)
    selection: str = "greedy"  # greedy (grow from the logits) | topk (top edges, dangling ones pruned)
    seed: int = 0
    max_graph_edges: int = 200  # edges drawn in the circuit figure
    # the study (`mechdiff run`): these relations, each into <[output] dir>/<relation> (empty: `relation` into dir)
    relations: tuple = ()
    templates: dict = field(default_factory=dict)  # relation -> its template, where not `template`

    @property
    def label(self) -> str:
        """The relation as reports name it (an edit file's facts before the edit: ``<relation> (unedited)``)."""
        return f"{self.relation} (unedited)" if self.unedited else self.relation


CHOICES = {
    ("knowledge", "method"): METHODS,
    ("knowledge", "ablation"): ABLATIONS,
    ("knowledge", "selection"): SELECTIONS,
    ("knowledge", "acdc_metric"): METRICS,
}


def load_settings(path: str | Path) -> KnowledgeSettings:
    """The ``[knowledge]`` section of the task file ``path`` (unknown keys refused with their line)."""
    return load_file(path)[0]


def load_file(path: str | Path) -> tuple[KnowledgeSettings, str]:
    """The ``[knowledge]`` settings and the ``[output] dir`` of the task file ``path`` (checked with their line)."""
    return load_section_file(path, "knowledge", KnowledgeSettings, CHOICES, "tasks/knowledge.toml")
