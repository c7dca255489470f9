"""The process stack: child processes (engine cores, tensor-parallel workers) started, watched and stopped.

`Launcher` is the one seam (procs/launch.py): `ProcessLauncher` runs a `Program` as a fresh local interpreter,
`RayLauncher` (procs/ray_launcher.py, imported only when Ray is asked for) as a Ray actor; both hand the child
one msgpack `ChildSpec` (procs/spec.py) and return a `Handle`; `stop_children` waits, then kills the
stragglers. Parent and child speak the control frames of procs/control.py (`Ready`, `Shutdown`, `Failed`).
"""

from pagoda.server.procs.control import Failed, FrameDecoder, Ready, Shutdown
from pagoda.server.procs.launch import Handle, Launcher, bind, local_path, stop_children
from pagoda.server.procs.local import ProcessHandle, ProcessLauncher, pinned_cpus
from pagoda.server.procs.spec import ChildSpec, Program

__all__ = [
    "ChildSpec",
    "Failed",
    "FrameDecoder",
    "Handle",
    "Launcher",
    "ProcessHandle",
    "ProcessLauncher",
    "Program",
    "Ready",
    "Shutdown",
    "bind",
    "local_path",
    "pinned_cpus",
    "stop_children",
]
