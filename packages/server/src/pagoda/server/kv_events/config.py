"""`--kv-events-config`: vLLM's JSON object and its keys, parsed once into a frozen config (the config tree's)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any
from urllib.parse import urlsplit

from pagoda.server.config_tree import json_object

DEFAULT_ENDPOINT = "tcp://127.0.0.1:5557"  # loopback unless an address is given (vLLM binds tcp://*:5557)


@dataclass(frozen=True, slots=True)
class KVEventsConfig:
    """vLLM's KVEventsConfig keys: whether to publish, with which publisher, where, and how much to replay."""

    enable_kv_cache_events: bool = False
    publisher: str = "zmq"  # "zmq", or "null" (events computed, nothing sent)
    endpoint: str = DEFAULT_ENDPOINT  # the PUB socket
    replay_endpoint: str | None = None  # a ROUTER socket answering "every batch from sequence number N"
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # ZeroMQ send high-water mark of the PUB socket
    max_queue_size: int = 100_000  # batches waiting for the publisher thread before new ones are dropped
    topic: str = ""  # the first frame of every message

    def __post_init__(self) -> None:
        """ValueError naming the key."""
        if self.publisher not in ("zmq", "null"):
            raise ValueError(f'kv_events_config.publisher must be "zmq" or "null", got {self.publisher!r}')
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"kv_events_config.{name} must be >= 1, got {getattr(self, name)}")
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is not None and urlsplit(value).scheme not in ("tcp", "ipc", "inproc"):
                raise ValueError(
                    f"kv_events_config.{name} must be a ZeroMQ tcp://, ipc:// or inproc:// address"
                )


def parse_kv_events_config(value: str | Mapping[str, object] | KVEventsConfig | None) -> KVEventsConfig:
    """The config of `--kv-events-config` JSON, of a mapping (`LLM(kv_events_config={...})`) or a config as is
    (None or empty text: events off); ValueError naming a bad key."""
    if isinstance(value, KVEventsConfig):
        return value
    if value is None or value == "":
        return KVEventsConfig()
    data: dict[str, Any] = json_object(value, "kv_events_config")
    known = {f.name: f.type for f in fields(KVEventsConfig)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(f"kv_events_config has unknown key(s): {', '.join(unknown)}")
    expected: dict[str, tuple[type, ...]] = {
        "enable_kv_cache_events": (bool,),
        "publisher": (str,),
        "endpoint": (str,),
        "replay_endpoint": (str, type(None)),
        "buffer_steps": (int,),
        "hwm": (int,),
        "max_queue_size": (int,),
        "topic": (str,),
    }
    for key, item in data.items():
        ok = isinstance(item, expected[key]) and not (isinstance(item, bool) and bool not in expected[key])
        if not ok:
            raise ValueError(f"kv_events_config.{key} has the wrong type: {item!r}")
    return KVEventsConfig(**data)


def _offset_port(endpoint: str, offset: int) -> str:
    """`endpoint` with its tcp port moved up by `offset` (other transports and `*` ports: a suffix / as is)."""
    scheme, _, rest = endpoint.partition("://")
    if scheme == "tcp":
        host, _, port = rest.rpartition(":")
        return f"tcp://{host}:{int(port) + offset}" if port.isdigit() else endpoint
    return f"{endpoint}-{offset}" if offset else endpoint


def for_replica(config: KVEventsConfig | None, index: int) -> KVEventsConfig | None:
    """Replica `index`'s KV events config: its tcp ports offset by `index`, as vLLM offsets them by the
    data-parallel rank, so that every engine core binds its own endpoint (None: events off, for every replica)."""
    if config is None or not config.enable_kv_cache_events or index == 0:
        return config
    replay = config.replay_endpoint
    return replace(
        config,
        endpoint=_offset_port(config.endpoint, index),
        replay_endpoint=None if replay is None else _offset_port(replay, index),
    )
