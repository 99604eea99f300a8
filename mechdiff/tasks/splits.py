"""Where ``mechdiff.study`` still imports the entity-tracking object split from; the split lives in
:mod:`mechdiff.tasks.entity_tracking.splits` (remove this module once the circuits study imports it there)."""

from .entity_tracking.splits import HOLDOUT_EVERY, SPLITS, eval_objects, split_objects, train_objects  # noqa: F401
