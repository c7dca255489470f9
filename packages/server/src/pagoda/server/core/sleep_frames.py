"""The frames of sleep mode with engine-core processes (`POST /sleep`, `POST /wake_up`).

Front end -> every core: `SleepEngine` (the core sleeps once it has no unfinished request) and `WakeEngine`.
Each core answers `SleepDone` with the call's id: no error, or the `SleepModeError`'s message and field. A core
that (re)starts while the front end sleeps is sent a `SleepEngine` right after its `Ready`.
"""

from __future__ import annotations

import msgspec


class SleepEngine(msgspec.Struct, frozen=True, tag=True):
    """Sleep at `level` (1 or 2) once idle."""

    call_id: int
    level: int


class WakeEngine(msgspec.Struct, frozen=True, tag=True):
    """Wake what `tags` name ("weights", "kv_cache"; None: everything)."""

    call_id: int
    tags: list[str] | None = None


class SleepDone(msgspec.Struct, frozen=True, tag=True):
    """A core's answer to `SleepEngine` / `WakeEngine`: `message` and `param` are None when it succeeded."""

    call_id: int
    message: str | None = None
    param: str | None = None
