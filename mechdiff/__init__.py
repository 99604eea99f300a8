"""mechdiff: compare the mechanisms inside checkpoints of one language model."""

__version__ = "0.1.0"
