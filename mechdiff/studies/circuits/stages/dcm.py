"""DCM (``dcm`` for the base, ``dcm:<model>`` for a fine-tune's own under ``[cmap] scope = "paper"``): masks over
each group of a circuit trained per desideratum, and semantic patching of the base's selections into every model;
the pair cache's mode a run uses (`run_cache_mode`) and the count of each mode (`mode_cost`). Its records make
the report's DCM section and findings (`report.dcm_section`)."""

from __future__ import annotations

import logging
import math
from dataclasses import asdict, dataclass, replace
from typing import Any, Optional

from ....circuits.circuit import Circuit
from ....methods.dcm_cache import CACHE_MODES
from ....models.devices import GIB
from ....models.footprint import backward_bytes, dtype_bytes, model_dims
from ....runs.stages import StageRecord
from ...planner import Lengths, StageCost, duration, task_lengths
from ..spec import RunSpec
from .counting import Context, circuit_groups, group_starts, run_device

log = logging.getLogger(__name__)


def inputs(study: Any, circuit_rec: StageRecord) -> dict:
    """The stage's key inputs: every model, the circuit's key, ``[dcm]`` (its cache mode aside: the modes give
    the same results but for float rounding), the task and the classes of several tokens it may patch."""
    section = {k: v for k, v in asdict(study.spec.dcm).items() if k != "cache"}
    out = {"models": study.digests, "circuit": circuit_rec.key, "dcm": section, "task": study.task_inputs()}
    out.update(study.class_groups(study.spec.dcm.groups))
    return out


def run(study: Any, circuit_rec: StageRecord, name: Optional[str] = None) -> StageRecord:
    """DCM masks over the groups of ``circuit_rec``'s circuit in model ``name`` (default: the base); semantic
    patching of the selections into every model for the base's."""
    name = name or study.spec.models.base
    stage = "dcm" if name == study.spec.models.base else f"dcm:{name}"
    key = inputs(study, circuit_rec)
    if not study.cache.planning and not study.cache.ready(stage, key):
        study.dcm_cache_mode()  # chosen (this machine measured) before the stage's own work and time begin
    return study.cache.run(stage, key, lambda: compute(study, circuit_rec, name))


def compute(study: Any, circuit_rec: StageRecord, name: str) -> dict:
    """DCM of ``name``'s circuit on every declared desideratum (what `run` caches)."""
    from ....tasks.desiderata import chosen_desiderata, desideratum_pairs

    c, t = study.spec.dcm, study.spec.task
    circuit = Circuit.from_dict(circuit_rec.result["circuit"])
    config = dcm_config(study.spec)
    opts = study.options()
    n = c.n_train + c.n_val + c.n_test
    # the configured desiderata the task defines; none of them: the task's own (an imported task's
    # counterfactual: the patched run should give the counterfactual prompt's answer)
    names = chosen_desiderata(c.desiderata, study.task.desiderata)
    if not names:
        return {
            "dcm": [],
            "semantic": [],
            "skipped": f"the task declares no desideratum: {study.task.name} defines none (import it "
            "with --desideratum NAME=COLUMN, or give every row a counterfactual_answer)",
        }
    desiderata = {
        d: desideratum_pairs(
            d,
            study.tokenizer,
            n,
            t.n_boxes,
            study.seed("dcm"),
            vocabulary=opts.get("vocabulary"),
            task=study.task,
            prompt_set="dcm",
        )
        for d in names
    }
    groups, left_out = study.group_choice(circuit, c.groups)
    left_out.update(unpaired_classes(circuit, groups, desiderata, config.eval_batch))
    groups = [g for g in groups if g not in left_out]
    if not groups:
        return {
            "dcm": [],
            "semantic": [],
            "skipped": f"no group of the circuit of {name} with heads sits at a position DCM can patch",
            "left_out": left_out,
        }
    mode, why = study.dcm_cache_mode()
    log.info("DCM of %s: pair cache %s (%s)", name, mode, why)
    return _masks(study, name, circuit, desiderata, config, groups, left_out, mode)


def _masks(
    study: Any, name: str, circuit: Circuit, desiderata: dict, config: Any, groups: list, left_out: dict, mode: str
) -> dict:
    """The masks of ``groups`` trained per desideratum, then the base's selections patched into every model."""
    from ....methods.dcm import dcm_circuit

    c = study.spec.dcm
    items = dcm_items(study, c.n_train + c.n_val + c.n_test)
    lm = study.model(name)
    results = dcm_circuit(lm, circuit, desiderata, config, groups, study.progress, items=items, mode=mode)
    base = name == study.spec.models.base
    semantic = semantic_records(study.models, results, desiderata, config, mode, items) if base else []
    records = [r.to_dict() for r in results]
    return {"model": name, "dcm": records, "semantic": semantic, "left_out": left_out, "cache": mode}


def semantic_records(
    models: Any, results: list, desiderata: dict, config: Any, mode: str, items: Optional[list] = None
) -> list[dict]:
    """Semantic patching: each non-empty selection of ``results`` patched source -> base within every model of
    ``models`` (a `ModelSet`: its ``names``, each loaded as it is reached) on its desideratum's test pairs (split
    as DCM split them, by ``items`` where given), with ``config.n_random`` random head sets of its layers; one
    record per selection and model, in the order of ``results``. A desideratum's selections share one pair cache
    per model (`semantic_selections`). What the stage and ``mechdiff dcm`` both compute
    (`mechdiff.studies.circuits.dcm.dcm_run`)."""
    from ....methods.dcm import split_pairs
    from ....methods.semantic import semantic_selections

    chosen = [r for r in results if r.selected]
    found: dict[int, list] = {}
    for d in dict.fromkeys(r.desideratum for r in chosen):
        mine = [r for r in chosen if r.desideratum == d]
        test = split_pairs(list(desiderata[d]), config.split, config.seed, items)[2]
        sems = semantic_selections(
            (models[n] for n in models.names),
            [(r.selected, r.position) for r in mine],
            test,
            config.eval_batch,
            n_random=config.n_random,
            seed=config.seed + 1,
            mode=mode,
        )
        found.update({id(r): sem for r, sem in zip(mine, sems)})
    out = []
    for r in chosen:
        heads = [h.name for h in r.selected]
        out.extend(
            {"group": r.group, "desideratum": r.desideratum, "heads": heads, **s.to_dict()} for s in found[id(r)]
        )
    return out


def dcm_items(study: Any, n: int) -> Optional[list]:
    """The item of each of DCM's ``n`` pairs: an imported task's items of the ``dcm`` set's rows (its clean
    prompt, or the field it names); None for a generated task (DCM reads a pair's clean prompt itself)."""
    t = study.task
    if "dcm" not in study.prompt_sets or t.items is None:
        return None
    return [t.items[r] for r in study.prompt_sets["dcm"][:n]]


def dcm_config(spec: RunSpec):
    """The `DCMConfig` a study's ``[dcm]`` section gives (split: its pair counts)."""
    from ....methods.dcm import DCMConfig

    c = spec.dcm
    n = c.n_train + c.n_val + c.n_test
    return DCMConfig(
        lam=c.lam,
        lam_scale=c.lam_scale,
        lr=c.lr,
        epochs=c.epochs,
        batch_size=c.batch_size,
        micro_batch=c.batch_size,
        eval_batch=spec.eval.batch_size,
        eval_every=c.eval_every,
        schedule=c.schedule,
        shuffle=c.shuffle,
        split=(c.n_train / n, c.n_val / n, c.n_test / n),
        seed=spec.task.seed,
        random_pool=c.random_pool,
        n_random=c.n_random,
    )


def unpaired_classes(circuit: Circuit, groups: list[str], desiderata: dict, batch_size: int) -> dict[str, str]:
    """The groups at a position class whose token count differs between a desideratum pair's two prompts, with
    why: DCM writes the source's tokens of the class into the base's token for token
    (`class_widths`)."""
    from ....methods.dcm_cache import UnequalClass, class_widths

    out = {}
    for g in groups:
        for d, pairs in desiderata.items():
            try:
                class_widths(pairs, [circuit.positions[g]], batch_size)
            except UnequalClass as error:
                out[g] = f"desideratum {d}: {error}"
                break
    return out


# ---------------------------------------------------------------------------------------------- its cost


def cost(ctx: Context, name: str, semantic: int, mode: Optional[str] = None) -> StageCost:
    """DCM of ``name``'s circuit (`mode_cost`); ``semantic``: models its selections are patched into. Its pair
    cache in ``mode`` (one of `CACHE_MODES`), by default the one the run uses (`dcm_cache_choice`); its note
    compares the three."""
    costs = {m: mode_cost(ctx, name, semantic, m) for m in CACHE_MODES}
    ran = ctx.known.get("dcm_cache", {}).get(name)
    # a run chooses once, for the base's DCM (``CircuitsStudy.dcm_cache_mode``); every DCM stage runs in that mode
    chosen, why = (mode, "asked") if mode else (ran, "the run's") if ran else dcm_cache_choice(ctx)
    cost = costs[chosen]
    shown = []
    for m, c in costs.items():
        held = f"{c.disk / GIB:.1f} GiB on disk, {c.reads.scratch / 1e12:.2f} TB read" if m == "file" else ""
        held = held or (f"{c.host_kept / GIB:.2f} GiB in host memory" if m == "memory" else "sources run again")
        fit = "" if c.fits(ctx.device) else ", does not fit"
        shown.append(f"{m} ({held}): {duration(_seconds(c, ctx)).strip()}{fit}")
    cost.note = f"pair cache {chosen} ({why}); " + "; ".join(shown)
    masked = name if ctx.spec.dcm.circuit != "pruned" or not ctx.spec.scoring.prune else f"{name} pruned"
    if masked in ctx.known.get("released", {}):
        cost.note += f"; groups as in {ctx.known['released'][masked]} (the released circuit, assumed)"
    if not cost.fits(ctx.device):
        others = [m for m, c in costs.items() if c.fits(ctx.device)]
        cost.remedy = f'[dcm] cache = "{others[0]}"' if others else ""
    return cost


def dcm_cache_choice(ctx: Context, costs: Optional[dict[str, StageCost]] = None) -> tuple[str, str]:
    """The pair-cache mode DCM runs in and why: ``[dcm] cache`` where it names one, else the fastest on
    ``ctx.device`` of those that fit it (memory, host memory, disk), else the one that holds least (recompute).
    ``costs``: each mode's cost (default: the base's DCM, as a run chooses)."""
    setting = ctx.spec.dcm.cache
    if setting != "auto":
        return setting, "[dcm] cache"
    base = ctx.spec.models.base
    costs = costs or {m: mode_cost(ctx, base, len(ctx.spec.model_names), m) for m in CACHE_MODES}
    fitting = [m for m, c in costs.items() if c.fits(ctx.device)]
    if not fitting:
        return "recompute", f"none fits {ctx.device.name}; recompute holds least"
    best = min(fitting, key=lambda m: _seconds(costs[m], ctx))
    return best, f"the fastest that fits {ctx.device.name}"


def _seconds(cost: StageCost, ctx: Context) -> float:
    """``cost``'s time on ``ctx.device``; infinite where the device's throughput in ``ctx.dtype`` is not known (a
    plan recounted under another dtype than this machine's measured one)."""
    try:
        return cost.seconds(ctx.device, ctx.dtype)
    except ValueError:
        return math.inf


def run_cache_mode(spec: RunSpec, lengths: Optional[Lengths] = None) -> tuple[str, str]:
    """The pair-cache mode a run of ``spec`` gives DCM, and why: ``[dcm] cache`` where it names one; else
    `dcm_cache_choice` on the machine the run's models are on (`run_device`); "file" on NDIF (no plan of
    its server)."""
    if spec.dcm.cache != "auto":
        return spec.dcm.cache, "[dcm] cache"
    try:
        dims, _ = model_dims(spec.models.base)
        lengths = lengths or task_lengths(spec)
    except (OSError, ValueError) as err:  # a model or tokenizer the plan cannot read: the file, as before plans
        return "file", f"no plan ({err})"
    device = run_device(spec, dims, lengths)
    if device is None:
        return "file", "a run on NDIF"
    return dcm_cache_choice(Context(spec, dims, lengths, spec.models.dtype, device))


def mode_cost(ctx: Context, name: str, semantic: int, mode: str) -> StageCost:
    """DCM's cost with its pair cache in ``mode`` (`work_cost`): ``[dcm]``'s pairs and training over the groups of
    ``name``'s circuit, one mask a group and desideratum, the selection, the whole group and ``n_random`` random
    head sets on the test pairs, and the selections patched into ``semantic`` models."""
    c = ctx.spec.dcm
    masked = name if c.circuit != "pruned" or not ctx.spec.scoring.prune else f"{name} pruned"
    groups = circuit_groups(ctx, masked, c.groups)
    work = DcmWork(
        c,
        len(desiderata(ctx)),
        len(groups),
        group_starts(ctx, masked, groups),
        c.n_random,
        # the random baseline and semantic patching run for a selection of heads: every one, unless the run chose none
        chose=ctx.known.get("dcm_selected", {}).get(name, 1.0),
        semantic=semantic,
    )
    stage = "dcm" if name == ctx.spec.models.base else f"dcm:{name}"
    return work_cost(ctx, ctx.spec.eval.batch_size, work, mode, stage)


@dataclass(frozen=True)
class DcmWork:
    """What a DCM stage trains and tests, as `work_cost` counts it: ``section`` (``[dcm]``: its pairs, epochs,
    batch and validation schedule), ``k`` desiderata (a pair cache each), ``groups`` and each one's lowest layer
    and position (``starts``), ``seeds`` masks trained per group and desideratum, the test runs of the whole group
    beside the selection's (``whole``: 1, or 0 where only the selection is tested), ``n_random`` random head sets,
    the share of groups that select heads (``chose``), the models the selections are patched into
    (``semantic``) and the models the stage holds (``models``)."""

    section: Any
    k: int
    groups: int
    starts: dict[str, tuple[float, str]]
    n_random: int
    seeds: int = 1
    whole: int = 1
    chose: float = 1.0
    semantic: int = 0
    models: int = 2


def work_cost(m: Any, batch: int, w: DcmWork, mode: str, stage: str) -> StageCost:
    """DCM's cost with its pair cache in ``mode``, on a `Counting` ``m`` (with the task's ``lengths``) in batches
    of ``batch`` pairs (the evaluation's): ``"file"`` writes every pair's row to a scratch file and reads it back
    for every patched run (suffix runs from the group's layer and position); ``"memory"`` holds the sources' ``z``
    (every layer's at each group's position: random heads are drawn from every layer) and runs patched runs in
    full; ``"recompute"`` holds nothing and runs each patched batch's sources again, in full. What the circuits
    study's DCM (`mode_cost`) and the trajectory's roles by DCM (``roles:<ckpt>``) count."""
    c, t, dims, b = w.section, m.lengths, m.dims, dtype_bytes(m.dtype)
    n, k, chose = c.n_train + c.n_val + c.n_test, w.k, w.chose
    file, full = mode == "file", mode != "file"
    # pairs a cache write (and an evaluation) and a training step hold
    built, trained = max(1, min(batch, n)), min(c.batch_size, c.n_train)
    flops = k * m.fwd((2 if mode != "recompute" else 1) * n, t.tokens)
    reads = k * m.reads((2 if mode != "recompute" else 1) * math.ceil(n / built))
    checks = validations(c)
    starts = w.starts
    positions = {pos for _, pos in starts.values()} or {""}
    # a pair's row of the file: every layer's keys and values and a group's entering residual stream per token, and
    # the sources' z at each position; a patched run reads the keys and values, one stream and one position's z
    source = dims.n_layers * dims.d_model * b
    per_pair = int(t.longest * (dims.n_layers * dims.kv_width() + w.groups * dims.d_model) * b)
    per_pair += len(positions) * source
    per_run = t.longest * (dims.n_layers * dims.kv_width() + dims.d_model) * b + source
    scratch = k * n * per_pair if file else 0.0  # written once, as the cache is built
    for layer, pos in starts.values():
        # a suffix run computes every prompt of its batch from the batch's earliest position (`Lengths.batch_after`)
        tokens, layers = (t.tokens, dims.n_layers) if full else (t.batch_after(pos, built), dims.n_layers - layer)
        steps = t.tokens if full else t.batch_after(pos, trained)
        # each seed's training and validation; the test pairs once: the selection, the whole group, random sets
        trains, tested = w.seeds * c.epochs * c.n_train, (1 + w.whole + w.n_random * chose) * c.n_test
        evaluated = w.seeds * checks * c.n_val + tested
        rows_read = trains + evaluated
        flops += k * (m.fwd(2 * trains, steps, t.tokens, layers) + m.fwd(evaluated, tokens, t.tokens, layers))
        training = w.seeds * 2 * c.epochs * math.ceil(c.n_train / trained)
        passes = training + w.seeds * checks * math.ceil(c.n_val / built)
        passes += (1 + w.whole + w.n_random * chose) * math.ceil(c.n_test / built)
        reads += k * m.reads(passes, layers)
        if mode == "recompute":  # every patched batch's sources again (forward only)
            flops += k * m.fwd(rows_read, t.tokens)
            reads += k * m.reads(passes - training // 2)
        scratch += k * rows_read * per_run if file else 0.0
        # semantic patching in every model: the selection's patched evaluation and n_random random head sets of its
        # layers, each a patched run of the test pairs, read from the desideratum's cache (below)
        patched = (1 + w.n_random) * c.n_test
        flops += k * chose * w.semantic * m.fwd(patched, tokens, t.tokens, layers)
        reads += k * chose * w.semantic * m.reads((1 + w.n_random) * math.ceil(c.n_test / built), layers)
        scratch += k * chose * w.semantic * patched * per_run if file else 0.0
    # semantic patching's caches: one a model for each desideratum with a selection (`semantic_selections`), two
    # forwards a test pair; a desideratum selects in at least one of its groups unless every group chose none
    cached = k * w.semantic * (1 - (1 - chose) ** len(starts))
    flops += cached * m.fwd(2 * c.n_test, t.tokens)
    reads += cached * m.reads(2 * math.ceil(c.n_test / built))
    scratch += cached * c.n_test * per_pair if file else 0.0
    longest_after = max((t.batch_after(p, trained) for _, p in starts.values()), default=t.tokens) if file else t.tokens
    depth = dims.n_layers / 2 if file else dims.n_layers
    # a training step: its backward's activations and (file) the rows it read back (its keys and values prefix)
    step = backward_bytes(dims, trained, math.ceil(longest_after), depth, m.dtype, t.longest)
    step += trained * per_pair if file else 0
    # a cache write: a forward keeping (file) every layer's keys and values as it goes, its read-out holding a third
    # vocabulary-wide float32 row a pair beside the two `forward_bytes` counts (the answer positions' logits, cut
    # from those the run kept; measured on a tiny model, whose peak is its read-out); after it (file), beside the
    # keys and values and those logits, the keys' (then the values') stacked copy and the row-ordered copy the
    # scratch file is written from (`RowStore.write`), a second row's worth
    logits = built * dims.vocab_size * 4  # one answer token a row (an answer of several tokens: one a token)
    write = m.act(built, t.longest) + logits
    write = max(write + built * per_pair, 2 * built * per_pair + logits) if file else write
    host = {"file": max(built, trained) * per_pair, "memory": n * len(positions) * source, "recompute": 0}[mode]
    disk = n * per_pair if file else 0  # the scratch file: every pair's row, one desideratum's file at a time
    return StageCost(
        stage,
        w.models,
        n,
        trained,
        flops,
        w.models * m.weights,
        0,
        max(step, write),
        host,
        disk,
        batch_option="[dcm] batch_size",
        reads=replace(reads, scratch=scratch),
        staged=file,  # the rows read back: on a GPU machine in host memory first; on a CPU the step's own
    )


def validations(c: Any) -> int:
    """The validation runs that patch heads in one mask's training under ``[dcm]`` ``c``: every step that
    `validates` picks; the one before training (schedule ``"steps"``) patches nothing, the mask starting at 1
    (`DCMConfig.init`), so it runs no pass."""
    from ....methods.dcm import validates

    per_epoch = math.ceil(c.n_train / c.batch_size)
    total = c.epochs * per_epoch
    return sum(validates(c, e * per_epoch + b + 1, b, total) for e in range(c.epochs) for b in range(per_epoch))


def desiderata(ctx: Context) -> list[str]:
    """The desiderata DCM trains, as the study picks them (`Context.desiderata`, read once per context)."""
    return ctx.desiderata
