"""The entity-tracking object split under the name the committed adapters' recipes record
(``mechdiff.tasks.splits.train_objects()``); it lives in `mechdiff.tasks.entity_tracking.splits`."""

from .entity_tracking.splits import HOLDOUT_EVERY, SPLITS, eval_objects, split_objects, train_objects  # noqa: F401
