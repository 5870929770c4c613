"""Printing what a user copies back (ids, model names, snippets) whole at any terminal width."""

from __future__ import annotations

from rich.console import Console, RenderableType
from rich.measure import Measurement


def print_whole(console: Console, renderable: RenderableType) -> None:
    """Prints a table as wide as it needs, however narrow the terminal: rich would wrap or cut its cells (an id
    split over two lines cannot be copied); the terminal folds the long lines instead, and copying gives them back
    whole."""
    needed = Measurement.get(console, console.options.update(max_width=10_000), renderable).maximum
    Console(width=max(needed, console.width), file=console.file, color_system=console.color_system,
            highlight=False).print(renderable)
