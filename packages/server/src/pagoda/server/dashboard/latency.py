"""A bounded window of recent latency samples, for the dashboard's TTFT / ITL percentiles."""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Sequence


class LatencyWindow:
    """The last `maxlen` (time, seconds) samples; written by the engine thread, copied there by `samples`."""

    __slots__ = ("_samples",)

    def __init__(self, maxlen: int = 8192) -> None:
        """An empty window keeping at most `maxlen` samples (older ones fall out)."""
        self._samples: deque[tuple[float, float]] = deque(maxlen=maxlen)

    def add(self, seconds: float, now: float | None = None) -> None:
        """Record one sample at `now` (time.monotonic() by default)."""
        self._samples.append((time.monotonic() if now is None else now, seconds))

    def samples(self, since: float) -> list[float]:
        """The sample values recorded at `since` or later."""
        return since_time(self.copy(), since)

    def copy(self) -> tuple[tuple[float, float], ...]:
        """Every (time, seconds) sample, copied at C speed (cheap enough for the engine thread)."""
        return tuple(self._samples)


def since_time(samples: tuple[tuple[float, float], ...], since: float) -> list[float]:
    """The values of `samples` recorded at `since` or later."""
    return [value for t, value in samples if t >= since]


def percentile(values: Sequence[float], q: float) -> float | None:
    """The nearest-rank `q` percentile (0-100) of `values`, None when empty."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]
