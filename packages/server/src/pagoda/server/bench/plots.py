"""The PNGs of `pagoda bench throughput | latency` (the serving benchmark draws its own: `serving.plot`).

matplotlib is imported when a plot is drawn: pagoda-server's `bench` extra installs it (`pip install
"pagoda-server[bench]"`); without it the benchmark says so and writes its JSON alone.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _pyplot() -> Any | None:
    """matplotlib's pyplot on the Agg backend, or None (with a note on stderr) when matplotlib is missing."""
    try:
        import matplotlib
    except ImportError:
        print("no PNG: matplotlib is not installed (pip install 'pagoda-server[bench]')", file=sys.stderr)
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_throughput(finish_s: Sequence[float], latency_s: Sequence[float], title: str, path: Path) -> bool:
    """Completed requests over the run and the distribution of request latencies; False without matplotlib."""
    plt = _pyplot()
    if plt is None:
        return False
    fig, (done, spread) = plt.subplots(1, 2, figsize=(12, 4.5))
    ends = [0.0, *sorted(finish_s)]
    done.step(ends, range(len(ends)), where="post", color="tab:blue")
    done.set(title="Completed requests", xlabel="seconds since the start", ylabel="requests")
    spread.hist(latency_s, bins=min(50, max(5, len(latency_s) // 4)), color="tab:green")
    spread.set(title="Request latency (queued + computed)", xlabel="seconds", ylabel="requests")
    return _save(plt, fig, (done, spread), title, path)


def plot_latency(latencies_s: Sequence[float], title: str, path: Path) -> bool:
    """Each timed iteration's latency in order, and their histogram; False without matplotlib."""
    plt = _pyplot()
    if plt is None:
        return False
    fig, (order, spread) = plt.subplots(1, 2, figsize=(12, 4.5))
    order.plot(range(1, len(latencies_s) + 1), latencies_s, marker="o", color="tab:blue")
    order.set(title="Latency per iteration", xlabel="iteration", ylabel="seconds")
    spread.hist(latencies_s, bins=min(30, max(5, len(latencies_s) // 2)), color="tab:green")
    spread.set(title="Latency distribution", xlabel="seconds", ylabel="iterations")
    return _save(plt, fig, (order, spread), title, path)


def _save(plt: Any, fig: Any, axes: Sequence[Any], title: str, path: Path) -> bool:
    """Grid the axes, title the figure, write it to `path` and close it; True."""
    for axis in axes:
        axis.grid(alpha=0.3)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
