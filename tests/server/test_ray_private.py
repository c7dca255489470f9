"""When Pagoda starts Ray itself, the cluster has no dashboard and keeps token authentication (Ray 2.60 binds its
GCS and raylets on every interface whatever address it is given; the server README says what guards them)."""

from __future__ import annotations

import ipaddress

import psutil
import pytest

ray = pytest.importorskip("ray")

from pagoda.server.procs.ray_launcher import private_ray_options, start_ray  # noqa: E402

DASHBOARD_PORT = 8265  # Ray's default dashboard port


def test_private_ray_options_have_no_dashboard() -> None:
    """The options Pagoda starts Ray with turn the dashboard off (and keep its host on loopback)."""
    options = private_ray_options()
    assert options["include_dashboard"] is False
    assert ipaddress.ip_address(options["dashboard_host"]).is_loopback


@pytest.mark.timeout(300)
def test_started_ray_opens_no_dashboard(monkeypatch: pytest.MonkeyPatch) -> None:
    """With no RAY_ADDRESS and no cluster on the node, `start_ray` starts one: no dashboard URL, nothing on the
    dashboard's port."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    assert not ray.is_initialized()
    try:
        assert start_ray(num_cpus=2) is True
        context = ray.get_runtime_context()
        assert ray.is_initialized() and context is not None
        assert not ray._private.worker.global_worker.node.address_info.get("webui_url")
        me = psutil.Process()
        ports = {
            conn.laddr.port
            for process in (me, *me.children(recursive=True))
            for conn in process.net_connections(kind="inet")
            if conn.status == psutil.CONN_LISTEN
        }
        assert DASHBOARD_PORT not in ports
    finally:
        ray.shutdown()
