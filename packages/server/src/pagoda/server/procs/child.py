"""The child's side of a local process: read the `ChildSpec`, set the process up, run the program's body.

Every local child (an engine core, a tensor-parallel worker) starts the same way: its log format, SIGINT ignored
(Ctrl-C reaches the whole process group; the parent decides), a watchdog that exits the process once its parent
is gone (an orphan would hold its memory forever), its CPU pinning; then the body, then a fast exit.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from typing import NoReturn, TypeVar

from pagoda.server.procs.spec import Program, decode_child

logger = logging.getLogger(__name__)

S = TypeVar("S")

# How often the watchdog checks that the process that started the child still lives.
PARENT_CHECK_S = 0.5


def watch_parent(parent_pid: int, what: str) -> None:
    """Exit the process at once when its parent is gone (re-parented), whatever the main thread is doing."""
    while os.getppid() == parent_pid:
        time.sleep(PARENT_CHECK_S)
    logger.error("the process that started this %s (pid %d) is gone; exiting", what, parent_pid)
    os._exit(1)


def pin_threads(cpus: tuple[int, ...] | None) -> None:
    """Pin this process to `cpus` and give torch as many threads (so siblings do not fight over cores)."""
    if cpus is None:
        return
    import torch

    os.sched_setaffinity(0, cpus)
    torch.set_num_threads(len(cpus))


def run_process(program: Program[S]) -> NoReturn:
    """The `python -m` entry of `program`: its `ChildSpec` comes on stdin; exits 0 once the body returned."""
    child = decode_child(sys.stdin.buffer.read(), program)
    logging.basicConfig(
        level=child.log_level, format=f"%(levelname)s %(name)s[{program.name} %(process)d]: %(message)s"
    )
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if child.parent_pid is not None:
        threading.Thread(target=watch_parent, args=(child.parent_pid, program.name), daemon=True).start()
    pin_threads(child.cpus)
    program.run(child)
    # Skip the interpreter's teardown (seconds of collecting torch's objects on a busy machine): all is closed.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
