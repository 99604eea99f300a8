"""Circuits: named groups of heads at named positions, discovery, scoring and overlap."""

from .circuit import GROUP_NAMES, POSITION_NAMES, Circuit

__all__ = ["Circuit", "GROUP_NAMES", "POSITION_NAMES"]
