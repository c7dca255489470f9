"""`python -m pagoda.server.core`: one engine-core process; its `ChildSpec[CoreSpec]` comes on stdin."""

from __future__ import annotations

from pagoda.server.import_cache import install

if __name__ == "__main__":
    install()  # before transformers is imported (pagoda.server.import_cache)
    from pagoda.server.core.engine_core import CORE_PROGRAM
    from pagoda.server.procs.child import run_process

    run_process(CORE_PROGRAM)
