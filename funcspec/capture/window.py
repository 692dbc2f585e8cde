"""Bounded windows of per-step samples: the recent replay times of a graph or a bucket."""

from __future__ import annotations

import collections

WINDOW = 1024
"""Samples a :class:`Window` keeps: the recent steps, enough for a stable median that stays cheap."""


class Window(collections.deque):
    """The last ``maxlen`` samples of a series, and ``total``: how many were ever appended.

    NOTE: an engine steps as long as it serves, so a list of one float per step grew without end (and every
    ``Engine.stats`` took its median over all of them); a window keeps memory and that median bounded.
    """

    def __init__(self, maxlen: int = WINDOW):
        super().__init__(maxlen=maxlen)
        self.total = 0

    def append(self, x) -> None:
        super().append(x)
        self.total += 1

    def since(self, mark: int) -> list:
        """The samples appended once ``total`` was ``mark``, as far as the window still holds them."""
        return list(self)[max(len(self) - (self.total - mark), 0):]
