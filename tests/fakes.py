"""Test doubles shared by the unit tests."""

from __future__ import annotations


class FakeClock:
    """A monotonic clock that moves only when a test moves it."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
