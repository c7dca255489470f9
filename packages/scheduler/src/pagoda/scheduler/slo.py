"""Service-level objectives: time to first token (TTFT) and time per output token (TPOT), per priority class.

A target list is `((priority or None, ms), ...)`: None is the default for every class not named. It is what
`SchedulerConfig.slo_ttft_ms` / `slo_tpot_ms` hold; `parse_slo_targets` reads the flag's text (`"500"`,
`"2000,0:300"`: 300 ms for priority 0, 2000 ms for the others), a number or a mapping.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal, Protocol

SLOName = Literal["ttft", "tpot"]
SLOTargets = tuple[tuple[int | None, float], ...]


@dataclass(frozen=True, slots=True)
class RequestSLO:
    """One request's own objectives in milliseconds (None: its class's, from the scheduler's config)."""

    ttft_ms: float | None = None
    tpot_ms: float | None = None

    def __post_init__(self) -> None:
        """ValueError naming the field for a value that is not a positive finite number."""
        for name in ("ttft_ms", "tpot_ms"):
            value = getattr(self, name)
            if value is not None and not (
                isinstance(value, int | float) and math.isfinite(value) and value > 0
            ):
                raise ValueError(f"slo.{name} must be a number > 0, got {value!r}")


def _positive_ms(value: object, name: str) -> float:
    """`value` as milliseconds > 0; ValueError naming `name`."""
    try:
        ms = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be milliseconds > 0, got {value!r}") from None
    if not math.isfinite(ms) or ms <= 0:
        raise ValueError(f"{name} must be milliseconds > 0, got {value!r}")
    return ms


def _priority(value: object, name: str) -> int | None:
    """A class key: an integer priority, or None (the default)."""
    if value is None:
        return None
    try:
        return int(str(value).strip())
    except ValueError:
        raise ValueError(f"{name}: priority class {value!r} is not an integer") from None


def parse_slo_targets(value: object, name: str) -> SLOTargets:
    """Canonical targets (default first, then by priority) of a number, a text `"MS[,PRIORITY:MS...]"`, a
    mapping {priority or None: ms} or a target tuple (None or "": none); ValueError naming `name`."""
    pairs: list[tuple[int | None, float]] = []
    if value is None:
        return ()
    if isinstance(value, bool):
        raise ValueError(f"{name} must be milliseconds > 0, got {value!r}")
    if isinstance(value, int | float):
        pairs.append((None, _positive_ms(value, name)))
    elif isinstance(value, str):
        for part in filter(None, (p.strip() for p in value.split(","))):
            key, sep, ms = part.rpartition(":")
            pairs.append((_priority(key, name) if sep else None, _positive_ms(ms, name)))
    elif isinstance(value, Mapping):
        pairs += [(_priority(k, name), _positive_ms(v, name)) for k, v in value.items()]
    elif isinstance(value, tuple | list):
        for item in value:
            if not isinstance(item, tuple | list) or len(item) != 2:
                raise ValueError(f"{name}: {item!r} is not a (priority, ms) pair")
            pairs.append((_priority(item[0], name), _positive_ms(item[1], name)))
    else:
        raise ValueError(f"{name} must be milliseconds > 0, got {value!r}")
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"{name} names a priority class twice")
    return tuple(sorted(pairs, key=lambda p: (p[0] is not None, p[0] or 0)))


def target_for(targets: SLOTargets, priority: int) -> float | None:
    """The class's target in ms (its own, else the default), None when there is none."""
    default = None
    for key, ms in targets:
        if key == priority:
            return ms
        if key is None:
            default = ms
    return default


@dataclass(slots=True)
class SLOCounts:
    """Finished sequences of one priority class: how many met each objective, how many had one."""

    ttft_met: int = 0
    ttft_total: int = 0
    tpot_met: int = 0
    tpot_total: int = 0


class SLOTracker:
    """Each sequence's first-token time and, when it finishes, whether it met its class's objectives.

    TTFT is arrival to the step that produced the first token; TPOT the mean gap after it (vLLM's
    `--goodput` definitions). Aborted sequences are not counted. Times are on the clock of
    `Request.arrival_time`, read when the scheduler reports a step (`first_tokens`) or a finish (`finished`).
    """

    def __init__(self, ttft_ms: SLOTargets = (), tpot_ms: SLOTargets = ()) -> None:
        """Class targets in ms (a request's own `slo` overrides them field by field)."""
        self.ttft_ms = ttft_ms
        self.tpot_ms = tpot_ms
        self.first_token_time: dict[str, float] = {}
        self.counts: dict[int, SLOCounts] = {}

    def targets(self, request: _Sequence) -> tuple[float | None, float | None]:
        """`request`'s (TTFT, TPOT) targets in seconds; None where it has none."""
        own = request.slo
        ttft = (
            own.ttft_ms
            if own is not None and own.ttft_ms is not None
            else target_for(self.ttft_ms, request.priority)
        )
        tpot = (
            own.tpot_ms
            if own is not None and own.tpot_ms is not None
            else target_for(self.tpot_ms, request.priority)
        )
        return (None if ttft is None else ttft / 1000.0, None if tpot is None else tpot / 1000.0)

    def first_tokens(self, running: Iterable[_Sequence], now: float) -> None:
        """Note `now` as the first-token time of every running sequence whose first output just came."""
        seen = self.first_token_time
        for request in running:
            if request.num_output_tokens and request.request_id not in seen:
                seen[request.request_id] = now

    def finished(self, request: _Sequence, now: float, *, aborted: bool = False) -> None:
        """Count a finished sequence against its targets (an abort only forgets it)."""
        first = self.first_token_time.pop(request.request_id, now)
        if aborted or not request.num_output_tokens:
            return
        ttft, tpot = self.targets(request)
        counts = self.counts.setdefault(request.priority, SLOCounts())
        if ttft is not None:
            counts.ttft_total += 1
            counts.ttft_met += first - request.arrival_time <= ttft
        if tpot is not None:
            counts.tpot_total += 1
            gaps = request.num_output_tokens - 1
            counts.tpot_met += gaps == 0 or (now - first) / gaps <= tpot

    def attainment(self) -> tuple[tuple[int, int, int, int, int], ...]:
        """(priority, ttft_met, ttft_total, tpot_met, tpot_total) per class seen, by priority."""
        return tuple(
            (p, c.ttft_met, c.ttft_total, c.tpot_met, c.tpot_total) for p, c in sorted(self.counts.items())
        )


class _Sequence(Protocol):
    """What the tracker reads of a `Request` (declared here: request.py imports this module)."""

    @property
    def request_id(self) -> str: ...

    @property
    def arrival_time(self) -> float: ...

    @property
    def priority(self) -> int: ...

    @property
    def num_output_tokens(self) -> int: ...

    @property
    def slo(self) -> RequestSLO | None: ...
