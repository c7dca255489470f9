"""The load of `tools/soak.py --surfaces`: issue #43's surfaces, each exercised in a loop until a deadline.

Two tenant keys store /v1/responses (GET each back, chain previous_response_id, some in the background, delete the
end of each chain); the admin key loads and unloads a LoRA adapter under a new name each cycle while the tenants
run requests on it; dashboard viewers (a tenant's key or the admin's) connect, read a few frames and leave; KV
event subscribers connect with the key of the certificate the server logged, read a batch, ask for a replay and
leave. Every call's answer is checked: a surprise is an error in the `Tally`, not an exception.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import msgspec
import zmq
from pagoda.server.kv_events.keys import load_server_key, subscribe_securely
from pagoda.server.kv_events.wire import KVEventBatch

SURFACES = ("responses", "lora", "dashboard", "kv_events")
TENANTS = ("sk-soak-tenant-a", "sk-soak-tenant-b")
ADMIN = "sk-soak-admin"
LORA_RANK = 8
# A small per-key store: it fills during the warm-up, so a flat RSS afterwards means evictions free what they drop.
MAX_STORED = 64
# Batches the replay buffer keeps: the default 10,000 (about 100 s of this load, ~1 KB each) would still be
# filling when a minute's soak ends, and its filling read as growth; 1,000 fill during the warm-up.
REPLAY_BATCHES = 1000
CHAIN = 4  # responses per previous_response_id chain (the context stays short)
FRAMES = 3  # SSE messages a dashboard viewer reads before leaving (the history, then frames)
KV_WAIT_S = (
    10.0  # for a subscriber's first batch and for a replay's answer (the load stores blocks all the time)
)
# Prompts long enough to fill 16-token blocks, so that every request publishes BlockStored events.
PROMPT = " ".join(["the soak of the new surfaces goes on"] * 6)
_CERTIFICATE = re.compile(r"public key is in (\S+)")
_DECODER = msgspec.msgpack.Decoder(KVEventBatch)


@dataclass(slots=True)
class Tally:
    """Operations per surface, and every error seen (a status or answer not as expected)."""

    ops: dict[str, int] = field(default_factory=lambda: dict.fromkeys(SURFACES, 0))
    errors: list[str] = field(default_factory=list)

    def check(self, surface: str, response: httpx.Response) -> bool:
        """Count one operation; a non-200 answer is an error (False)."""
        self.ops[surface] += 1
        if response.status_code == 200:
            return True
        request = response.request
        self.errors.append(
            f"{surface}: {request.method} {request.url.path} -> {response.status_code} {response.text[:200]}"
        )
        return False


@dataclass(frozen=True, slots=True)
class Target:
    """The server under soak: its URL, model name, the adapter folder and the KV events endpoints and key."""

    base_url: str
    model: str
    adapter: Path
    events_endpoint: str
    replay_endpoint: str
    certificate: Path


def serve_flags(endpoint: str, replay_endpoint: str) -> list[str]:
    """`pagoda serve` flags: two tenant keys, the admin key, runtime LoRA, KV events with replay, INFO logs."""
    events = {"enable_kv_cache_events": True, "endpoint": endpoint, "replay_endpoint": replay_endpoint}
    events["buffer_steps"] = REPLAY_BATCHES
    return [
        "--log-level", "info", "--api-key", TENANTS[0], "--api-key", TENANTS[1], "--admin-api-key", ADMIN,
        "--enable-lora", "--max-lora-rank", str(LORA_RANK), "--allow-runtime-lora-updating",
        "--max-stored-responses", str(MAX_STORED), "--kv-events-config", json.dumps(events),
    ]  # fmt: skip


def certificate_in(log: str) -> Path | None:
    """The KV events certificate path a server logged at INFO (None: not logged yet)."""
    match = _CERTIFICATE.search(log)
    return None if match is None else Path(match.group(1))


def client(target: Target, key: str) -> httpx.AsyncClient:
    """An HTTP client of `target` with `key`."""
    headers = {"Authorization": f"Bearer {key}"}
    return httpx.AsyncClient(base_url=target.base_url, headers=headers, timeout=120)


async def until(deadline: float, surface: str, tally: Tally, step: Callable[[], Awaitable[None]]) -> None:
    """Run `step` again and again until `deadline` (time.monotonic()); an exception is a tallied error."""
    while time.monotonic() < deadline:
        try:
            await step()
        except Exception as error:  # a timeout, a dropped connection, a malformed answer: counted, not fatal
            tally.errors.append(f"{surface}: {type(error).__name__}: {error}")


async def stored_response(http: httpx.AsyncClient, tally: Tally, body: dict[str, Any]) -> str | None:
    """POST a stored response and GET it back until it ended; its id (None: an error was tallied)."""
    created = await http.post("/v1/responses", json=body)
    if not tally.check("responses", created):
        return None
    response_id: str = created.json()["id"]
    while True:
        got = await http.get(f"/v1/responses/{response_id}")
        if not tally.check("responses", got):
            return None
        status = got.json()["status"]
        if status in ("completed", "incomplete"):  # incomplete: max_output_tokens reached, as asked
            return response_id
        if status not in ("queued", "in_progress"):
            tally.errors.append(f"responses: {response_id} ended {status}")
            return None
        await asyncio.sleep(0.05)  # a background one still running


async def responses_chains(target: Target, key: str, tally: Tally, deadline: float) -> None:
    """Chains of CHAIN stored responses (the last one in the background); the chain's end is then deleted."""
    async with client(target, key) as http:

        async def chain() -> None:
            previous: str | None = None
            for turn in range(CHAIN):
                body: dict[str, Any] = {"model": target.model, "input": PROMPT, "max_output_tokens": 4}
                body |= {"store": True, "background": turn == CHAIN - 1}
                if previous is not None:
                    body["previous_response_id"] = previous
                previous = await stored_response(http, tally, body)
                if previous is None:
                    return
            tally.check("responses", await http.delete(f"/v1/responses/{previous}"))

        await until(deadline, "responses", tally, chain)


async def lora_rotation(target: Target, tally: Tally, deadline: float) -> None:
    """The admin loads the adapter under a new name, each tenant runs a request on it, the admin unloads it."""
    cycle = 0
    async with (
        client(target, ADMIN) as admin,
        client(target, TENANTS[0]) as a,
        client(target, TENANTS[1]) as b,
    ):

        async def rotate() -> None:
            nonlocal cycle
            name, cycle = f"soak-lora-{cycle}", cycle + 1
            load = {"lora_name": name, "lora_path": str(target.adapter)}
            loaded = await admin.post("/v1/load_lora_adapter", json=load)
            if not tally.check("lora", loaded):
                return
            completion = {"model": name, "prompt": PROMPT, "max_tokens": 4}
            tally.check("lora", await a.post("/v1/completions", json=completion))
            response = {"model": name, "input": PROMPT, "max_output_tokens": 4, "store": False}
            tally.check("lora", await b.post("/v1/responses", json=response))
            tally.check("lora", await admin.post("/v1/unload_lora_adapter", json={"lora_name": name}))

        await until(deadline, "lora", tally, rotate)


async def dashboard_viewers(target: Target, tally: Tally, deadline: float) -> None:
    """Viewers with each key in turn: connect to /dashboard/events, read FRAMES messages, leave."""
    keys = [*TENANTS, ADMIN]
    visit = 0

    async def view() -> None:
        nonlocal visit
        key, visit = keys[visit % len(keys)], visit + 1
        async with client(target, key) as http, http.stream("GET", "/dashboard/events") as stream:
            if not tally.check("dashboard", stream):
                return
            read = 0
            async for line in stream.aiter_lines():
                if line.startswith("data: "):
                    json.loads(line.removeprefix("data: "))
                    read += 1
                    if read == FRAMES:
                        return  # leaving the block closes the stream mid-way, as a closed browser tab does
            tally.errors.append(f"dashboard: the stream ended after {read} messages")

    await until(deadline, "dashboard", tally, view)


def kv_subscriber_visit(
    ctx: zmq.Context[zmq.Socket[bytes]], target: Target, key: bytes, tally: Tally
) -> None:
    """One keyed subscriber: receive a batch, ask for a replay from sequence 1 and read it to its end, leave."""
    sub, replay = ctx.socket(zmq.SUB), ctx.socket(zmq.DEALER)
    try:
        for sock, endpoint in ((sub, target.events_endpoint), (replay, target.replay_endpoint)):
            sock.setsockopt(zmq.LINGER, 0)
            subscribe_securely(sock, key)
            if sock is sub:
                sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.connect(endpoint)
        tally.ops["kv_events"] += 1
        if not sub.poll(int(KV_WAIT_S * 1000)):
            tally.errors.append(f"kv_events: no batch within {KV_WAIT_S:g} s")
            return
        _DECODER.decode(sub.recv_multipart()[-1])
        tally.ops["kv_events"] += 1
        replay.send((1).to_bytes(8, "big"))
        while replay.poll(int(KV_WAIT_S * 1000)):
            seq, payload = replay.recv_multipart()
            if int.from_bytes(seq, "big", signed=True) == -1:
                return
            _DECODER.decode(payload)
        tally.errors.append(f"kv_events: the replay did not end within {KV_WAIT_S:g} s")
    finally:
        sub.close()
        replay.close()


async def kv_subscribers(target: Target, tally: Tally, deadline: float) -> None:
    """Keyed subscribers, one after another (each on a worker thread: the sockets block)."""
    key = load_server_key(target.certificate)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        await until(
            deadline,
            "kv_events",
            tally,
            lambda: asyncio.to_thread(kv_subscriber_visit, ctx, target, key, tally),
        )
    finally:
        ctx.destroy(linger=0)


async def exercise(target: Target, tally: Tally, deadline: float) -> None:
    """Every surface at once until `deadline`: two chains per tenant, the LoRA rotation, two viewers, two
    subscribers."""
    await asyncio.gather(
        *(responses_chains(target, key, tally, deadline) for key in (*TENANTS, *TENANTS)),
        lora_rotation(target, tally, deadline),
        *(dashboard_viewers(target, tally, deadline) for _ in range(2)),
        *(kv_subscribers(target, tally, deadline) for _ in range(2)),
    )
