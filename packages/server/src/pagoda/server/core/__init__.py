"""Engine cores beyond the server's process: one core process, data-parallel replicas, Ray actors.

`CoreClient` is the multiprocess engine-core client (`EngineClient`); `EngineCore` is the step loop it talks to
over ZeroMQ with msgspec frames; launchers start cores as local processes or Ray actors.
"""

from pagoda.server.core.client import CoreClient, CoreStartupError
from pagoda.server.core.engine_core import CoreSpec, EngineCore
from pagoda.server.core.launchers import CoreLauncher, ProcessLauncher

__all__ = [
    "CoreClient",
    "CoreLauncher",
    "CoreSpec",
    "CoreStartupError",
    "EngineCore",
    "ProcessLauncher",
]
