"""What the trajectory's edge stage (``[edges]``, docs/trajectories.md "Edges beside nodes") costs on one checkpoint,
and how many nodes its top-n edges touch: the reference means and EAP on ``PROMPTS`` ranking prompts of the task
file's prompt sets, timed, with the nodes of the top 100, 500 and 1000 edges and the edge and node null on halves.

    OMP_NUM_THREADS=1 python scripts/edges_cost.py tasks/entity_tracking_trajectory.toml smollm2-et@100

Loads the checkpoint once; writes nothing (the study's results directory is a temporary one)."""

from __future__ import annotations

import resource
import sys
import tempfile
import time

from mechdiff.methods.edge_structure import checkpoint_top, edge_structure
from mechdiff.methods.knowledge.graph import Graph
from mechdiff.methods.knowledge.task_graph import group_ablations, prompt_edge_scores, task_batches
from mechdiff.models.loading import load_model
from mechdiff.studies.trajectory.settings import load_settings
from mechdiff.studies.trajectory.study import TrajectoryStudy

PROMPTS = 16


def main(task_file: str, checkpoint: str) -> None:
    st = load_settings(task_file)
    study = TrajectoryStudy(st, out=tempfile.mkdtemp(), progress=False)
    lm = load_model(checkpoint)
    graph = Graph.for_model(lm)
    records = study.records("ranking", PROMPTS)
    reference = study.task.reference_records(
        study.tokenizer, st.scoring.reference_n, study.seed("reference"), **study.options()
    )
    t0 = time.time()
    ablations = group_ablations(lm, graph, reference, st.edges.batch_size)
    t_means = time.time() - t0
    t0 = time.time()
    x = prompt_edge_scores(lm, graph, task_batches(records, st.edges.batch_size), ablations, st.edges.method)
    t_eap = time.time() - t0
    print(f"{graph.n_edges} edges; means over {len(reference)} reference prompts {t_means:.0f} s; {st.edges.method} on")
    print(f"{PROMPTS} prompts {t_eap:.0f} s (256 prompts: {t_eap * 256 / PROMPTS:.0f} s)")
    print(f"peak memory {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6:.1f} GB")
    for n in (100, st.edges.n, 1000):
        nodes = checkpoint_top(x, graph, n)["nodes"]
        mlps = sum(v.startswith("MLP") for v in nodes)
        null = edge_structure({"a": x, "b": x}, graph, n, draws=20, resamples=1, resample_splits=1)["null"]["a"]
        print(
            f"top {n} edges: {len(nodes)} of {graph.n_senders - 1} nodes ({mlps} MLPs); null on halves of "
            f"{PROMPTS // 2}: edges {null['edges']['value']:.3f}, nodes {null['nodes']['value']:.3f}"
        )


if __name__ == "__main__":
    main(*sys.argv[1:3])
