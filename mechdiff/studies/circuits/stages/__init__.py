"""The circuits study's stages, one module a stage: `accuracy`, `positions`, `circuit` (curve or path),
`prune`, `matrix`, `dcm`, `cmap` and `reproduction`. Each holds

- ``inputs(study, ...)``: the stage's key inputs (what its record is cached under, unchanged by this layout),
- ``run(study, ...)``: its computation through the study's stage cache (`CircuitsStudy` orders the calls and
  holds what they share: models, prompt sets, the cache),
- ``cost(ctx, ...)``: the planner's count of its FLOPs, memory and reads (`counting.Context`), beside the
  algorithm it counts, so a change to one is seen next to the other,

and its docstring names the report section its records make. Modules, not classes: a stage has no state of its
own (the study holds it), so a module of functions is the unit, and the study and the planner call it the same
way. `counting` holds what several stages' counts share, `groups` the groups DCM, CMAP and completeness look at,
and `plan` asks each stage for its cost in the order a run meets them (`plan.stage_costs`)."""
