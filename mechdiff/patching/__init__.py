"""Interventions on nnsight: activation patching, path patching, patching scans, attribution screening,
and the position-wise means of mean ablation (ablation.py)."""

from .core import Patch, Prefix, Resume, Run, head_patch, run

__all__ = ["Patch", "Prefix", "Resume", "Run", "head_patch", "run"]
