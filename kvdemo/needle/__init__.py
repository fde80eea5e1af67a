"""Needle in a haystack: the grid (`grid`), its contexts (`haystack`), its inputs checked (`inputs`) and what
it returns (`records`)."""

from kvdemo.needle.grid import needle_grid
from kvdemo.needle.records import NeedleCell, NeedleGrid

__all__ = [
    "NeedleCell",
    "NeedleGrid",
    "needle_grid",
]
