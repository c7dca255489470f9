"""Engine cores beyond the server's process: one core process, data-parallel replicas, Ray actors.

`CoreClient` is the multiprocess engine-core client (`EngineClient`); `EngineCore` is the step loop it talks to
over ZeroMQ with msgspec frames; the launchers of `pagoda.server.procs` start cores (`CORE_PROGRAM`) as local
processes or Ray actors.
"""

from pagoda.server.core.client import CoreClient, CoreConfigError, CoreStartupError
from pagoda.server.core.engine_core import CORE_PROGRAM, CoreSpec, EngineCore

__all__ = [
    "CORE_PROGRAM",
    "CoreClient",
    "CoreConfigError",
    "CoreSpec",
    "CoreStartupError",
    "EngineCore",
]
