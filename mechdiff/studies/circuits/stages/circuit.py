"""Circuit discovery (``circuit:<model>``) by ``[discovery] method``: the curve (attribution ranking, nested
circuits scored, the smallest reaching the target) or the paper's path patching (each step of the task's plan);
its key, its computation and its count (the path-patching count is the longest of the planner's: see
`path_circuit_cost`). Its records make the report's circuit section (`report.circuit_section`)."""

from __future__ import annotations

import math
from typing import Any, Optional

from ....models.devices import GIB
from ....models.footprint import backward_bytes, dtype_bytes, held_pair_bytes
from ....runs.stages import StageRecord, label
from ...planner import Reads, StageCost
from ..spec import discovery_inputs
from .counting import Context, plan_steps, reference_runs

# ---------------------------------------------------------------------------------------------- the stage


def inputs(study: Any, name: str) -> dict:
    """The stage's key inputs: the model, the task, ``[discovery]`` (with the plan's k for path patching), the
    metric, and a curve's scorer reference."""
    from ....tasks.plan import task_plan

    d = study.spec.discovery
    plan_k = task_plan(study.task).k if d.method == "path" else None
    out = {"model": study.digests[name], "task": study.task_inputs(), "discovery": discovery_inputs(d, plan_k)}
    out.update(study.metric_inputs())
    if d.method == "curve":
        out["scoring"] = study.reference_inputs()
    return out


def run(study: Any, name: str) -> StageRecord:
    """The circuit of ``name`` by the configured method (``[discovery] method``)."""
    compute = curve_circuit if study.spec.discovery.method == "curve" else path_circuit
    return study.cache.run(f"circuit:{name}", inputs(study, name), lambda: compute(study, name))


def curve_circuit(study: Any, name: str) -> dict:
    """Rank every (head, position class) pair by attribution, score nested circuits, keep the smallest
    reaching the target; the ranking's stability over bootstrap resamples of its prompts."""
    from ....circuits.curve import curve_circuit as discover_curve
    from ....circuits.positions import task_classes
    from ....circuits.pruning import pair_name
    from ....report.positions import curve_figure, stability_figure

    d = study.spec.discovery
    ranker = study.scorer(name, "ranking", d.n)
    classes = task_classes(ranker)
    found = discover_curve(
        ranker,
        study.scorer(name, "curve", d.curve_n),
        classes,
        d.sizes,
        d.target,
        d.select,
        d.stability_draws,
        study.seed("ranking"),
        name,
        study.task.name,
    )
    circuit, ranked, n, stability = found.circuit, found.ranked, found.n, found.stability
    circuit.save(study.dir / "circuits" / f"{label(name)}.json")
    figures = {
        "curve": study.dir / "figures" / f"curve_{label(name)}.png",
        "stability": study.dir / "figures" / f"stability_{label(name)}.png",
    }
    curve_figure(found.curve, figures["curve"], title=f"{name}: faithfulness vs circuit size")
    kept = {pair_name(p): stability[p] for p in ranked[:n]}
    in_circuit = set(ranked[:n])
    stability_figure(
        kept,
        n / len(ranked),
        figures["stability"],
        title=f"{name}: selection frequency over {d.stability_draws} resamples of {d.n} prompts",
    )
    return {
        "circuit": circuit.to_dict(),
        "curve": found.curve,
        "classes": classes,
        "stability": {
            "draws": d.stability_draws,
            "chance": n / len(ranked),
            "selected": kept,
            "others": {pair_name(p): f for p, f in stability.items() if f > 0 and p not in in_circuit},
        },
        "ranking": [[pair_name(p), found.scores[p]] for p in ranked[: 2 * n]],
        "figures": {k: str(v.relative_to(study.dir)) for k, v in figures.items()},
    }


def path_settings(study: Any, name: str, plan: Any) -> Any:
    """Model ``name``'s path-patching settings: the section's, with what ``[discovery.models.NAME]`` sets for it
    (top_k, circuit_k, seed), each step table cut to the steps of ``plan``."""
    from ....circuits.discovery import DiscoverySettings

    d, t = study.spec.discovery, study.spec.task
    own = d.models.get(name, {})
    steps_of_plan = {step.name for step in plan.steps}
    return DiscoverySettings(
        k={s: k for s, k in own.get("top_k", d.top_k).items() if s in steps_of_plan},
        circuit_k={s: k for s, k in own.get("circuit_k", d.circuit_k).items() if s in steps_of_plan},
        screen=d.screen,
        screen_multiple=d.screen_multiple,
        n_prompts=d.n,
        n_boxes=t.n_boxes,
        seed=own.get("seed", study.seed("discovery")),
        score=d.score,
        source_position={s: p for s, p in d.source_position.items() if s in steps_of_plan},
        pairs_per_part=d.pairs_per_part,
    )


def pair_options(study: Any) -> dict:
    """The path-patching pairs' options ``[discovery]`` sets off their defaults: the paper's counterfactual
    construction, and the study's clean prompts where a model's seed redraws only the counterfactuals (none at the
    defaults, so every other task's generator is called as before)."""
    from ..spec import KEYED_WHEN_SET

    d, defaults = study.spec.discovery, KEYED_WHEN_SET["discovery"]
    out = {}
    if d.counterfactual != defaults["counterfactual"]:
        out["counterfactual"] = d.counterfactual
    if d.model_seed_redraws != defaults["model_seed_redraws"]:
        out["clean_seed"] = study.seed("discovery")
    return out


def path_circuit(study: Any, name: str) -> dict:
    """The paper's path patching: each step of the task's plan keeps its top-k heads as the next step's
    receivers and puts its top circuit_k heads (default: the same) in the circuit."""
    from ....circuits.discovery import discover
    from ....common.metrics import metric_label
    from ....report.figures import head_heatmap
    from ....tasks.plan import task_plan

    d = study.spec.discovery
    lm = study.model(name)
    plan = task_plan(study.task)
    settings = study.path_settings(name, plan)
    pairs = study.task.discovery_pairs(
        study.tokenizer, d.n, settings.seed, **study.options(prompts="discovery"), **study.pair_options()
    )
    circuit, steps = discover(
        lm, pairs, settings, task=study.task.name, progress=study.progress, plan=plan, metric=study.task.metric
    )
    figures = {}
    for step, res in steps.items():
        path = study.dir / "figures" / f"path_patching_{label(name)}_{step}.png"
        head_heatmap(
            res.exact,
            lm.shape.n_layers,
            lm.shape.n_heads,
            path,
            title=f"{name}: step {step} ({circuit.names.get(step, '')}), senders at {res.sender_position}",
            selected=res.selected,
            label=f"(p_patched - p_clean)/p_clean, p: {metric_label(study.task.metric)}",
        )
        figures[step] = str(path.relative_to(study.dir))
    circuit.save(study.dir / "circuits" / f"{label(name)}.json")
    return {
        "circuit": circuit.to_dict(),
        "figures": figures,
        "exact": {s: {h.name: v for h, v in r.exact.items()} for s, r in steps.items()},
    }


# ---------------------------------------------------------------------------------------------- its cost


def cost(ctx: Context, name: str) -> StageCost:
    """Discovery's cost by ``[discovery] method`` (`curve_circuit_cost`, `path_circuit_cost`)."""
    return path_circuit_cost(ctx, name) if ctx.spec.discovery.method == "path" else curve_circuit_cost(ctx, name)


def curve_circuit_cost(ctx: Context, name: str) -> StageCost:
    """Attribution on the ranking prompts (a forward and a backward to the activations only, no weight gradients:
    two forwards' FLOPs), then the full model, the empty circuit and the nested circuits on the curve prompts."""
    d, t, b = ctx.spec.discovery, ctx.lengths, ctx.spec.eval.batch_size
    reference = reference_runs(ctx, f"circuit:{name}")
    flops = ctx.fwd(reference + d.n * 2 + d.curve_n * (2 + len(d.sizes)), t.tokens)
    rows = ctx.rows(max(d.n, d.curve_n, reference))
    transient = backward_bytes(ctx.dims, rows, t.longest, ctx.dims.n_layers, ctx.dtype) + ctx.ablation_patches(rows)
    passes = math.ceil(reference / b) + 2 * math.ceil(d.n / b) + math.ceil(d.curve_n / b) * (2 + len(d.sizes))
    return StageCost(f"circuit:{name}", 1, d.n, rows, flops, ctx.weights, 0, transient, reads=ctx.reads(passes))


def senders_per_pass(ctx: Context, n: int, kept: int) -> int:
    """Sender copies per pass: 8 on a CPU; on a GPU as ``auto_senders_per_pass`` sizes them from the memory left."""
    from ....models.architectures import ModelShape
    from ....models.memory import MAX_BATCH, example_bytes
    from ....patching.path import SENDERS_PER_PASS

    if not ctx.device.gpu:
        return SENDERS_PER_PASS
    dims = ctx.dims
    shape = ModelShape(dims.n_layers, dims.n_heads, dims.n_kv_heads, dims.d_head, dims.d_model, dims.vocab_size)
    free = max(ctx.device.memory - ctx.weights - kept, 0)
    rows = max(
        1,
        min(
            max(MAX_BATCH, n * SENDERS_PER_PASS),
            int(free * 0.6) // example_bytes(shape, ctx.lengths.longest, dtype_bytes(ctx.dtype)),
        ),
    )
    return max(1, rows // n)


def path_circuit_cost(ctx: Context, name: str) -> StageCost:
    """Path patching as the plan's steps run it: clean and counterfactual runs of every pair, kept (every layer's
    ``z``, the residual stream, keys and values: this grows with ``n``), then per step every head below the deepest
    receiver as a sender (`step_senders`): a one-token frozen run over half the layers and receiver runs of the
    tokens after the receiver position over half the layers, one per distinct receiver position (`step_runs`),
    a pass of `senders_per_pass` senders. With ``[discovery] screen`` each step's attribution screen first runs
    every held pair at once with gradients (step A's through every layer: what autograd saves of it grows with
    ``n``, like the kept runs, and is most of the stage's peak: `screen_bytes`)."""
    d = ctx.spec.discovery
    flops, kept, transient, s = path_cost(ctx, d.n, name=name)
    held = held_pairs(ctx, d.n)
    reads = path_reads(ctx, d.n, plan_steps(ctx), held, s, name)
    most = path_most_pairs(ctx)
    if held < d.n:
        note = f"holds {held} pairs' activations at a time ({kept / GIB:.1f} GiB; [discovery] pairs_per_part)"
    else:
        fit = f"n up to {most} fits {ctx.device.name}" if most else f"no n fits {ctx.device.name}"
        note = f"keeps every pair's activations ({kept / GIB:.1f} GiB, grows with n: {fit})"
    remedy = f"[discovery] pairs_per_part = {most} (holds {most} pairs at a time)" if 0 < most < held else ""
    if d.screen:
        note += f"; the attribution screen's pass with gradients holds {screen_bytes(ctx, held) / GIB:.1f} GiB of them"
    return StageCost(
        f"circuit:{name}",
        1,
        d.n,
        s * held,
        flops,
        ctx.weights,
        kept,
        transient,
        note=f"{note}; {s} senders a pass",
        batch_option="senders a pass",
        reads=reads,
        remedy=remedy,
    )


def path_reads(ctx: Context, n: int, steps: list[Any], held: int, per_pass: int, name: Optional[str] = None) -> Reads:
    """What path patching's passes over ``steps`` read, ``held`` of ``n`` pairs at a time and ``per_pass`` senders a
    pass: the clean and counterfactual runs (`prepared_runs`), then per step, part and pass of the senders it
    path-patches (`scored_senders` of ``name``'s circuit) a frozen run and the receiver runs (`step_runs`) over half
    the layers, and the attribution screen's runs (`screen_runs`) once a part."""
    parts = math.ceil(n / held)
    reads = ctx.reads(parts * prepared_runs(ctx, n, held, len(steps)))
    for step in steps:
        chunks = math.ceil(scored_senders(ctx, step, name) / per_pass)
        reads += ctx.reads(parts * chunks * step_runs(ctx, step), ctx.dims.n_layers / 2)
        for layers in screen_runs(ctx, step, name):
            reads += ctx.reads(parts, layers)
    return reads


def prepared_runs(ctx: Context, n: int, held: int, steps: int) -> int:
    """Forwards a pair's clean and counterfactual runs take over ``steps`` steps: both once where every pair is
    held; in parts, a clean run to read each part, then both again at each pass over the parts a step makes (path
    patching, and the attribution screen where on)."""
    if held >= n:
        return 2
    return 1 + 2 * steps * (2 if ctx.spec.discovery.screen else 1)


def held_pairs(ctx: Context, n: int) -> int:
    """Pairs path patching holds at once: ``[discovery] pairs_per_part`` where set (and fewer than ``n``), else all."""
    part = ctx.spec.discovery.pairs_per_part
    return min(n, part) if part else n


def step_senders(ctx: Context, step: Any, name: Optional[str] = None) -> float:
    """Senders a path-patching step scores: every head below its deepest receiver (`
    eligible_senders`), every head of the model for a step into the logits. The deepest receiver is the deepest head of
    the receiving step's group in ``name``'s circuit where the run found it (an upper bound: the circuit keeps
    ``circuit_k`` heads, the receivers are the first ``top_k`` of them), else assumed at the middle layer."""
    dims = ctx.dims
    if not step.receiver:
        return dims.n_layers * dims.n_heads
    found = ctx.known.get("circuit", {}).get(name or "")
    heads = found["groups"].get(step.receiver, []) if found else []
    if heads:
        from ....common.components import parse_heads

        return max(h.layer for h in parse_heads(heads)) * dims.n_heads
    return dims.n_layers / 2 * dims.n_heads


def scored_senders(ctx: Context, step: Any, name: Optional[str] = None) -> float:
    """Senders a step path-patches: every one it scores (`step_senders`), or with ``[discovery] screen`` the
    ``screen_multiple x k`` the attribution screen keeps of them (``circuits.discovery.run_step``; ``k``: the step's
    ``top_k`` for ``name``, else the plan's)."""
    senders = step_senders(ctx, step, name)
    d = ctx.spec.discovery
    if not d.screen:
        return senders
    k = d.models.get(name or "", {}).get("top_k", d.top_k).get(step.name, step.k)
    return min(senders, math.ceil(d.screen_multiple * k))


def screen_runs(ctx: Context, step: Any, name: Optional[str] = None) -> list[float]:
    """The blocks each pass of a step's attribution screen runs over every pair (none without ``[discovery]
    screen``; `mechdiff.patching.attribution`), a backward counted as a forward of its blocks (the weights are
    frozen: gradients reach the activations only): step A a forward with gradients through every layer and its
    backward; a step with receivers a clean run capturing the receivers' sites, a forward with gradients to them
    and its backward down to the lowest receiver, and the frozen run stopped at the deepest receiver and its
    backward. The receivers' layers are those of the receiving group in ``name``'s found circuit, else assumed at
    the middle layer."""
    if not ctx.spec.discovery.screen:
        return []
    n = ctx.dims.n_layers
    if not step.receiver:
        return [n, n]
    found = ctx.known.get("circuit", {}).get(name or "")
    heads = found["groups"].get(step.receiver, []) if found else []
    if heads:
        from ....common.components import parse_heads

        layers = [h.layer for h in parse_heads(heads)]
        low, high = min(layers), max(layers)
    else:
        low = high = n / 2
    return [n, n, n - low, high, high]


def step_runs(ctx: Context, step: Any) -> int:
    """Runs a path-patching step makes per pass of senders: the frozen run, and for a step with receivers one
    receiver run per distinct receiver position among a part's prompts (each a suffix run from its own position:
    step D of entity tracking, receivers at the context's label of the queried box, makes one per box)."""
    if not step.receiver:
        return 1
    return 1 + max(ctx.lengths.distinct.get(step.receiver_position, 1), 1)


def path_cost(
    ctx: Context, n: int, steps: Optional[list[Any]] = None, held: Optional[int] = None, name: Optional[str] = None
) -> tuple[float, int, int, int]:
    """FLOPs, kept bytes, transient bytes and senders a pass of path patching on ``n`` pairs, ``held`` at a time
    (default as ``[discovery] pairs_per_part`` says; held in parts, the clean and counterfactual runs are run once
    more at each step); ``steps``: those of the task's plan to count, default all; ``name``: the model whose found
    circuit bounds each step's senders (`step_senders`)."""
    t, dims = ctx.lengths, ctx.dims
    half = dims.n_layers / 2
    held = held_pairs(ctx, n) if held is None else held
    kept = held * held_pair_bytes(dims.n_layers, dims.d_model, dims.kv_width(), t.longest, dtype_bytes(ctx.dtype))
    plan = plan_steps(ctx) if steps is None else steps
    flops = ctx.fwd(n * prepared_runs(ctx, n, held, len(plan)), t.tokens)
    s = senders_per_pass(ctx, held, kept)
    transient = ctx.act(held, t.longest)  # the clean and counterfactual runs, a part's pairs at once
    if ctx.spec.discovery.screen:
        transient = max(transient, screen_bytes(ctx, held))
    for step in plan:
        senders = scored_senders(ctx, step, name)
        after = t.after(step.receiver_position) if step.receiver else 0.0
        flops += senders * n * (ctx.fwd(1, 1, 1, half) + (ctx.fwd(1, after, t.tokens, half) if after else 0.0))
        flops += sum(ctx.fwd(n, t.tokens, None, layers) for layers in screen_runs(ctx, step, name))
        transient = max(transient, ctx.act(s * held, max(after, 1), t.longest))
    return flops, kept, transient, s


def screen_bytes(ctx: Context, rows: int) -> int:
    """The attribution screen's peak (`mechdiff.patching.attribution`): one pass with gradients of a part's ``rows``
    pairs at once (every pair where held whole), what autograd saves of it over every layer (`backward_bytes`; step
    A's, the largest: a step with receivers differentiates a pass to its deepest receiver, then one from there on),
    and the read-out's float32 probabilities and their gradient."""
    dims = ctx.dims
    return backward_bytes(dims, rows, ctx.lengths.longest, dims.n_layers, ctx.dtype) + 2 * rows * dims.vocab_size * 4


def path_most_pairs(ctx: Context) -> int:
    """The most pairs path patching keeps within the device's memory (one sender a pass at the least; 0: none)."""

    def fits(n: int) -> bool:
        _, kept, transient, _ = path_cost(ctx, n, held=n)
        return ctx.weights + kept + transient <= ctx.device.memory

    if not fits(1):
        return 0
    low, high = 1, 2
    while fits(high) and high < 10**7:
        low, high = high, 2 * high
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    return low
