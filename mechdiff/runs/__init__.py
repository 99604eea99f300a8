"""Run infrastructure: the stage cache and the seeds of a study run."""
