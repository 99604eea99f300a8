"""Score nested circuits of a finished study's ranking on the study's own fresh matrix prompts.

The study picks its circuit on the curve's prompts; this prints what the sizes around that pick keep on
the circuit x model matrix's prompts (the same prompts and ablation means as the report's matrix), so a
reader can see how far the pick sits from the target on prompts it was not chosen on.

    python benchmarks/curve_sizes.py tasks/entity_tracking.toml smollm2-et-early --pairs 246,351
"""

from __future__ import annotations

import argparse

from mechdiff.circuits.curve import ranked_circuit
from mechdiff.circuits.measures import faithfulness
from mechdiff.common.components import parse
from mechdiff.studies.circuits.spec import load_spec
from mechdiff.studies.circuits.study import CircuitsStudy as Study


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("task_file")
    p.add_argument("model")
    p.add_argument("--pairs", required=True, help="circuit sizes (numbers of top pairs), comma-separated")
    p.add_argument("--store", default="/tmp/curve-sizes.h5", help="activation store for the means")
    args = p.parse_args()
    spec = load_spec(args.task_file)
    study = Study(spec, progress=False)
    study.store = args.store
    if not study.cache.path(f"circuit:{args.model}").is_file():
        raise SystemExit(f"no circuit of {args.model} in {study.dir}: run the study first")
    saved = study.circuit(args.model).result  # cached (a changed task file would recompute it)
    ranked = [(parse(name.split("@")[0]), name.split("@")[1]) for name, _ in saved["ranking"]]
    scorer = study.scorer(args.model, "matrix")
    for n in (int(x) for x in args.pairs.split(",")):
        if n > len(ranked):
            raise SystemExit(f"the study keeps the top {len(ranked)} pairs of its ranking; ask for at most that")
        res = faithfulness(scorer, ranked_circuit(ranked, n, args.model, study.task.name))
        f, a = res["circuit"]["faithfulness"], res["circuit"]["accuracy"]
        print(
            f"{args.model}: top {n} pairs: faithfulness {f['value']:.3f} [{f['low']:.3f}, {f['high']:.3f}], "
            f"accuracy {a['value']:.3f} [{a['low']:.3f}, {a['high']:.3f}] on {res['n_prompts']} prompts"
        )


if __name__ == "__main__":
    main()
