"""Needle in a haystack: the grid (`grid`), its contexts (`haystack`), its inputs checked (`inputs`) and what
it returns (`records`)."""
