"""Start-up time stamps: each phase of an engine's start logs how long it took and when it ended, counted from the
process's start (the kernel's start time of the process: the interpreter's own start and every import count).

The lines read `startup <phase>: <seconds> s (done <seconds> s after the process started)`, at INFO on the
`pagoda.startup` logger; `tools/bench_startup.py` parses them into its phase table. Phases may overlap (the
tokenizer loads on its own thread while the weights load).
"""

from __future__ import annotations

import logging
import os
import time

logger = logging.getLogger("pagoda.startup")

# The line each phase logs (bench_startup.py parses it).
PHASE_FORMAT = "startup %s: %.3f s (done %.3f s after the process started)"


def process_age() -> float:
    """Seconds since this process started (/proc/self/stat's start time, in clock ticks since boot, against
    CLOCK_BOOTTIME: 10 ms resolution); without /proc, time.perf_counter() (an arbitrary origin)."""
    try:
        with open("/proc/self/stat") as stat:
            # Field 22 (starttime) counts from the end of the command field, which may hold spaces.
            fields = stat.read().rsplit(")", 1)[1].split()
        started = int(fields[19]) / os.sysconf("SC_CLK_TCK")
        return time.clock_gettime(time.CLOCK_BOOTTIME) - started
    except (OSError, ValueError, IndexError, AttributeError):
        return time.perf_counter()


def log_phase(name: str, started: float) -> float:
    """Log that phase `name`, begun at `started` (time.perf_counter()), ended now; returns now (the next phase's
    start)."""
    now = time.perf_counter()
    logger.info(PHASE_FORMAT, name, now - started, process_age())
    return now
