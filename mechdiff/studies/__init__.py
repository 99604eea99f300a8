"""What every study shares: the hash-keyed stage cache (:mod:`.stages`), the task-file loader
(:mod:`.config`), seeds derived by name (:mod:`.seeds`); and the studies built on them
(:mod:`.headmap`; the knowledge-circuit study is :mod:`mechdiff.knowledge.pipeline`, the
entity-tracking/IOI study :mod:`mechdiff.study`)."""
