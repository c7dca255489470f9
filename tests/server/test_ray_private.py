"""When Pagoda starts Ray itself, the cluster has no dashboard and keeps token authentication (Ray 2.60 binds its
GCS and raylets on every interface whatever address it is given; the server README says what guards them)."""

from __future__ import annotations

import ipaddress
import json
import os
import subprocess
import sys

import pytest
from pagoda.server.procs.ray_launcher import private_ray_options
from ray_head import ensure_ray_token

DASHBOARD_PORT = 8265  # Ray's default dashboard port


def test_private_ray_options_have_no_dashboard() -> None:
    """The options Pagoda starts Ray with turn the dashboard off (and keep its host on loopback)."""
    options = private_ray_options()
    assert options["include_dashboard"] is False
    assert ipaddress.ip_address(options["dashboard_host"]).is_loopback


# Run in a fresh interpreter: Ray forks its processes from whoever starts it, and a pytest worker may be too large
# to fork (ray_head.py says why).
PROBE = """
import json, psutil, ray
from pagoda.server.procs.ray_launcher import start_ray
assert not ray.is_initialized()
try:
    started = start_ray(num_cpus=2)
    assert ray.is_initialized() and ray.get_runtime_context() is not None
    me = psutil.Process()
    ports = sorted({
        conn.laddr.port
        for process in (me, *me.children(recursive=True))
        for conn in process.net_connections(kind="inet")
        if conn.status == psutil.CONN_LISTEN
    })
    webui = ray._private.worker.global_worker.node.address_info.get("webui_url")
    print(json.dumps({"started": started, "webui": webui, "ports": ports}))
finally:
    ray.shutdown()
"""


@pytest.mark.timeout(300)
def test_started_ray_opens_no_dashboard() -> None:
    """With no RAY_ADDRESS and no cluster on the node, `start_ray` starts one: no dashboard URL, nothing on the
    dashboard's port."""
    ensure_ray_token()  # one token for every cluster a test run starts, whoever starts first
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    done = subprocess.run(
        [sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=240, check=False
    )
    assert done.returncode == 0, done.stderr[-4000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    assert seen["started"] is True
    assert not seen["webui"]
    assert seen["ports"] and DASHBOARD_PORT not in seen["ports"]
