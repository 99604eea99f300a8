"""Every study, one system: a study is a task file whose ``[study] kind`` picks a class of
:data:`mechdiff.studies.base.KINDS` (:mod:`.circuits`, the default, for any task; :mod:`.knowledge`;
:mod:`.headmap`). What they share: :mod:`.base` (run directory, lock, manifest, plan, model loading),
:mod:`.stages` (the one hash-keyed stage cache) and :mod:`.seeds` (seeds by name). ``mechdiff run TASKFILE``
runs any kind; the methods they call live in the libraries (``circuits/``, ``knowledge/``, ``headmap.py``).
The single commands' runs (prompts, computation, tables, figures, JSON) live here too: :mod:`.scoring` (``score``,
``prune``, ``compare``, ``curve``, ``positions``), :mod:`.discovery` (``circuit``), :mod:`.cmap`, :mod:`.dcm`,
:mod:`.evaluation` (``eval``), :mod:`.scan`, :mod:`.editing` (``knowledge-edit``), :mod:`.finetuning` (``finetune``)."""
