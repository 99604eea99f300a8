"""Every study, one system: a study is a task file whose ``[study] kind`` picks a class of
:data:`mechdiff.studies.base.KINDS` (:mod:`.circuits`, the default, for any task; :mod:`.knowledge`;
:mod:`.headmap`; :mod:`.trajectory`). What they share: :mod:`.base` (run directory, lock, manifest, plan, model
loading), :mod:`.spec` (the task file's schema), and, one layer down, :mod:`mechdiff.runs.stages` (the one hash-keyed
stage cache) and :mod:`mechdiff.runs.seeds` (seeds by name). ``mechdiff run TASKFILE`` runs any kind; the methods
they call live below (``circuits/``, ``methods/``) and their tables and reports in ``report/``. The single commands'
runs (prompts, computation, tables, figures, JSON) live here too: :mod:`.scoring` (``score``, ``prune``,
``compare``, ``curve``, ``positions``), :mod:`.discovery` (``circuit``), :mod:`.cmap`, :mod:`.dcm`, :mod:`.evaluation`
(``eval``), :mod:`.scan`, :mod:`.editing` (``knowledge-edit``), :mod:`.finetuning` (``finetune``), and
:mod:`.reproduce` (the paper's published circuit scored in its own models)."""
