"""The circuits report's limitations and "What was run": departures, models' sources, prompt sets, cost."""

from __future__ import annotations

from ....models.resolve import resolve_spec
from ....runs.seeds import PROMPT_OFFSETS
from ....tasks.row_checks import per_template, task_empty_classes
from .kit import Study, _held_out, _pruned_on


def limitations(study: "Study", positions: dict) -> str:
    """The departures and cuts of this run, each stated only where the run made it."""
    d, sc, cm = study.spec.discovery, study.spec.scoring, study.spec.cmap
    scanned = any(rec is not None and rec.result["scan"]["steps"] for rec in positions.values())
    lines = []
    if d.method == "curve":
        lines.append(
            "- Departures from Prakash et al.: circuits are drawn over (head, position class) pairs ranked by a\n"
            "  first-order attribution, not path-patched head groups A-D"
            + (
                " (the position scan shows how much the paper's\n  form, every head kept at the named "
                "positions, explains)"
                if scanned
                else ""
            )
            + "; DCM and CMAP run on the groups of the base's circuit, a group at\n"
            "  a position class patched at every token of it (its groups are position classes, not the paper's\n"
            "  functional groups). `method =\n"
            '  "path"` in the task file gives the paper\'s form.'
        )
    else:
        lines.append(
            "- Circuits by path patching of head groups as Prakash et al.; pruning, DCM and CMAP follow the rules the\n"
            f"  task file names (pruning `{sc.prune_rule}`, DCM `lam_scale = {study.spec.dcm.lam_scale}`, CMAP "
            f"`scope = {cm.scope}`); the README's departures table says which are the paper's."
        )
    if sc.prune and sc.prune_rule == "greedy":
        lines.append(
            f"- Pruning uses the {_pruned_on(study)} on its own small prompt set and a bounded greedy "
            "search for K; pairs\n"
            "  whose removal alone already exceeds the threshold skip the search (it could only raise them)."
        )
    nested = study.nested_sets() if hasattr(study, "nested_sets") else []
    if nested:
        from ....tasks.prompt_sets import nested_departure

        lines.append(f"- Departure from disjoint sets: {nested_departure(nested)}.")
    if study.task.answer_tokens > 1:
        lines.append(
            f"- Answers of up to {study.task.answer_tokens} tokens are scored by teacher forcing (each answer's "
            "tokens appended to the prompt); the circuits,\n  pruning, DCM and CMAP cover the prompt's positions only, "
            "never an answer token's own, so the heads\n  reach the answer's later tokens only through what they write "
            "at the prompt (by answer length, and by first token against the rest:\n  "
            "`tables/accuracy_by_answer_length.csv`, `tables/circuit_x_model_by_answer_length.csv`)."
        )
    empty = task_empty_classes(study.task)
    if empty:  # a class empty in a prompt holds no head there (a named position on the last token, say)
        lines.append(
            "- Position classes empty in some prompts: "
            + "; ".join(f"`{c}` ({per_template(n)})" for c, n in empty.items())
            + "."
        )
    if cm.n_random:
        lines.append(
            f"- CMAP's random control: {cm.n_random} draws of layer-matched heads per group (the `[cmap] n_random`\n"
            "  setting), each draw's outcomes kept; a part is compared with it by the sign-flip test against the\n"
            "  per-prompt share of draws that are right."
        )
    return "\n".join(lines) + "\n"


#: The last limitation: entity tracking's one template family, or any other task's own templates.
PHRASINGS = {
    True: """- Every prompt comes from one template family with 7 boxes; nothing here says how the circuits transfer to
  other phrasings.
""",
    False: """- Every prompt comes from the task's own templates; nothing here says how the circuits transfer to other
  phrasings.
""",
}


def _source(name: str, provenance: dict) -> str:
    """Where a model came from as its spec names it (``package:...``, a hub id), never this machine's resolved
    path: the adapter for a LoRA, else the spec's source (and GGUF file)."""
    if provenance.get("adapter"):
        return str(provenance["adapter"])
    spec = resolve_spec(name)
    return spec.source + (f"/{spec.gguf_file}" if spec.gguf_file else "")


def _cost(manifest: dict) -> str:
    """What the stages cost when computed, and what this invocation reused."""
    stages = manifest["stages"].values()
    total = sum(s["seconds"] for s in stages)
    reused = sum(bool(s["cached"]) for s in stages)
    return (
        f"Computing the {len(stages)} stages took {total / 60:.1f} min in all (the seconds above, from the "
        f"runs that computed them); this invocation reused {reused} of them from the cache and took "
        f"{manifest['wall_seconds']:.0f} s up to writing this report." + _compute_sentence(manifest)
    )


def _compute_sentence(manifest: dict) -> str:
    """What the stage table's compute columns mean, where ``run.json`` records the plan."""
    record = manifest.get("resources")
    if not record or "throughput" not in record:
        return ""
    return (
        f" Beside each stage's seconds: the FLOPs the resource planner counts for it (matrix multiplies, "
        f"`mechdiff run --plan`) and the share of this machine's matrix-multiply throughput they make in those "
        f"seconds (FLOPs / (seconds x {record['throughput'] / 1e9:.1f} GFLOP/s, {record['dtype']}, measured per CPU "
        "second when `run.json` was written; on several threads a share can pass 1). A stage far below the others "
        "spends its time outside matrix multiplies."
    )


def _prompt_sets_sentence(study: "Study", manifest: dict) -> str:
    """Where the prompts came from: for a task of fixed rows, the sets as ``run.json`` lists them (sizes, groups,
    rows shared, counted from the lists); for a generated task, each set's seed."""
    sets = manifest.get("prompt_sets")
    if not sets or sets.get("generated"):
        seeds = ", ".join(f"{k} +{v}" for k, v in PROMPT_OFFSETS.items() if not k.startswith("reproduction"))
        held = (
            ". All prompts use only the held-out objects (`eval_objects()`), disjoint from the fine-tuning objects. "
            if _held_out(study)
            else ". "
        )
        return f"Seeds: task seed {study.spec.task.seed}; each prompt set's seed is it plus {seeds}{held}" + (
            _items_sentence(sets) if sets else ""
        )
    each = ", ".join(f"{name} {n} ({sets['groups'][name]} groups)" for name, n in sets["sizes"].items())
    shared = (
        "no row is in two sets"
        if sets["shared_rows"] == 0
        else f"{sets['shared_rows']} rows are shared between sets, so those sets are not disjoint"
    )
    return (
        f"Prompt sets: dealt from the task's {sets['n_rows']} rows ({sets['n_groups']} (template, token length) "
        f"groups) by seed {study.spec.task.seed}, stratified by group, the same rows for every model: {each}; "
        f"{shared} (counted from the row lists in `run.json`, `prompt_sets`). " + _items_sentence(sets)
    )


def _items_sentence(sets: dict) -> str:
    """Each set's rows and items (an item: a clean prompt, or the task's item field) and the items sets share, from
    ``run.json``'s ``prompt_sets`` (a record made before items were counted: nothing)."""
    if "items" not in sets:
        return ""
    each = ", ".join(f"{name} {n} rows / {sets['items'][name]} items" for name, n in sets["sizes"].items())
    nested = sets.get("nested") or []
    shared = "no item is in two sets" if sets["shared_items"] == 0 else f"{sets['shared_items']} items are in two sets"
    aside = f" ({', '.join(nested)} nested: first-N of one draw, a departure)" if nested else ""
    return f"Items: {each}; {shared}{aside}. "
