"""Where a random program's choices come from: hypothesis, or numpy seeded with one integer."""

from __future__ import annotations

from typing import Protocol, Sequence, TypeVar

import numpy as np

T = TypeVar("T")

__all__ = ["Drawer", "HypothesisDrawer", "SeededDrawer"]


class Drawer(Protocol):
    """Where a program's random choices come from."""

    def integer(self, low: int, high: int) -> int:
        """An integer in ``[low, high]``; shrinks toward ``low``."""

    def choice(self, options: Sequence[T]) -> T:
        """One of ``options``; shrinks toward the first."""

    def chance(self, percent: int) -> bool:
        """True with probability ``percent`` / 100; shrinks toward False."""


class HypothesisDrawer:
    """Draws through hypothesis' ``st.data()``, so a failing program shrinks.

    Parameters
    ----------
    data : hypothesis.strategies.DataObject
        The object a ``@given(st.data())`` test receives.
    """

    def __init__(self, data) -> None:
        from hypothesis import strategies as st

        self._data = data
        self._st = st

    def integer(self, low: int, high: int) -> int:
        """An integer in ``[low, high]``."""
        return self._data.draw(self._st.integers(low, high))

    def choice(self, options: Sequence[T]) -> T:
        """One of ``options``."""
        return options[self.integer(0, len(options) - 1)]

    def chance(self, percent: int) -> bool:
        """True with probability about ``percent`` / 100."""
        return self.integer(0, 99) >= 100 - percent


class SeededDrawer:
    """Draws from numpy's generator seeded with one integer.

    Parameters
    ----------
    seed : int
        The same seed gives the same program.
    """

    def __init__(self, seed: int) -> None:
        self._rng = np.random.default_rng(seed)

    def integer(self, low: int, high: int) -> int:
        """An integer in ``[low, high]``."""
        return int(self._rng.integers(low, high + 1))

    def choice(self, options: Sequence[T]) -> T:
        """One of ``options``."""
        return options[self.integer(0, len(options) - 1)]

    def chance(self, percent: int) -> bool:
        """True with probability ``percent`` / 100."""
        return self.integer(0, 99) < percent
