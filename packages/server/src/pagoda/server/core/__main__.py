"""`python -m pagoda.server.core`: one engine-core process; its `ChildSpec[CoreSpec]` comes on stdin."""

from __future__ import annotations

from pagoda.server.core.engine_core import CORE_PROGRAM
from pagoda.server.procs.child import run_process

if __name__ == "__main__":
    run_process(CORE_PROGRAM)
