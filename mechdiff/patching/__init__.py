"""Interventions on nnsight: activation patching, path patching, attribution screening."""

from .core import Patch, Run, head_patch, run

__all__ = ["Patch", "Run", "head_patch", "run"]
