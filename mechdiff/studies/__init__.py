"""Every study, one system: a study is a task file whose ``[study] kind`` picks a class of
`mechdiff.studies.base.KINDS` (`.circuits`, the default, for any task; `.knowledge`;
`.headmap`; `.trajectory`). What they share: `.base` (run directory, lock, manifest, plan, model
loading), `.spec` (the task file's schema), and, one layer down, `mechdiff.runs.stages` (the one hash-keyed
stage cache) and `mechdiff.runs.seeds` (seeds by name). ``mechdiff run TASKFILE`` runs any kind; the methods
they call live below (``circuits/``, ``methods/``) and their tables and reports in ``report/``. The single commands'
runs (prompts, computation, tables, figures, JSON) live here too: `.scoring` (``score``, ``prune``,
``compare``, ``curve``, ``positions``), `.discovery` (``circuit``), `.cmap`, `.dcm`, `.evaluation`
(``eval``), `.scan`, `.editing` (``knowledge-edit``), `.finetuning` (``finetune``), and
`.reproduce` (the paper's published circuit scored in its own models)."""
