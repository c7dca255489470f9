"""Issue 37: the JSON sub-configs (`speculative_config`, `pooler_config`, `kv_events_config`) are parsed once, where
text or a dict enters (the CLI's flag types, `EngineConfig.from_flat` under `LLM(**kwargs)`); the config tree holds
their typed configs, which cross process boundaries as they are and which no consumer parses again."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Any

import msgspec
import pytest
from pagoda.server.cli import build_parser, engine_config, main, serve_config
from pagoda.server.config import (
    CacheConfig,
    EngineConfig,
    KVEventsConfig,
    ModelConfig,
    PoolerConfig,
    ServeConfig,
    SpeculativeConfig,
)
from pagoda.server.engine.executor.messages import WorkerSpec
from pagoda.server.kv_events import start_kv_events
from pagoda.server.kv_events.config import for_replica
from pagoda.server.procs.security import PeerKeys
from test_config import llm_config

SPEC = {"method": "ngram", "num_speculative_tokens": 3}
POOLER = {"pooling_type": "mean", "normalize": False}
EVENTS = {
    "enable_kv_cache_events": True,
    "endpoint": "tcp://127.0.0.1:6001",
    "replay_endpoint": "tcp://*:7001",
}
TYPED = (
    SpeculativeConfig("ngram", num_speculative_tokens=3),
    PoolerConfig("MEAN", normalize=False),
    KVEventsConfig(True, endpoint="tcp://127.0.0.1:6001", replay_endpoint="tcp://*:7001"),
)
FLAGS = [
    "--speculative-config",
    json.dumps(SPEC),
    "--pooler-config",
    json.dumps(POOLER),
    "--kv-events-config",
    json.dumps(EVENTS),
]


def _sub_configs(config: EngineConfig) -> tuple[object, object, object]:
    """The tree's three sub-configs: speculative, pooler, KV events."""
    return (
        config.speculative_config,
        config.model_config.pooler_config,
        config.cache_config.kv_events_config,
    )


def test_the_cli_puts_the_typed_configs_in_the_tree() -> None:
    """The flags' JSON becomes the typed configs at parse time: argparse's namespace already holds them."""
    args = build_parser().parse_args(["serve", "m", *FLAGS])
    assert (args.speculative_config, args.pooler_config, args.kv_events_config) == TYPED
    assert _sub_configs(engine_config(args)) == TYPED
    assert _sub_configs(engine_config(build_parser().parse_args(["serve", "m"]))) == (None, None, None)


@pytest.mark.parametrize("given", ["dict", "json", "typed"])
def test_llm_keywords_give_the_same_typed_tree_as_the_flags(
    given: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LLM(...) takes vLLM's dicts, their JSON text or the typed configs; each builds the config the flags build."""
    values: dict[str, Any] = {"speculative_config": SPEC, "pooler_config": POOLER, "kv_events_config": EVENTS}
    if given == "json":
        values = {name: json.dumps(value) for name, value in values.items()}
    elif given == "typed":
        values = dict(zip(values, TYPED, strict=True))
    config = llm_config(monkeypatch, model="m", **values)
    assert _sub_configs(config) == TYPED
    assert config == engine_config(build_parser().parse_args(["serve", "m", *FLAGS]))
    assert config == EngineConfig.from_flat(model="m", **values)
    if given == "typed":  # a typed config is kept as is, not parsed again
        assert all(a is b for a, b in zip(_sub_configs(config), TYPED, strict=True))


def test_json_is_decoded_once_from_the_flag_to_every_consumer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Three flags, three json.loads: building the tree, the per-replica configs, the routing check and the
    publisher's start read the typed configs."""
    calls: list[str] = []
    loads = json.loads

    def counting(text: str | bytes, **kwargs: Any) -> Any:
        calls.append(str(text))
        return loads(text, **kwargs)

    monkeypatch.setattr(json, "loads", counting)
    args = build_parser().parse_args(
        ["serve", "m", *FLAGS, "--routing-kv-events", "--data-parallel-size", "2"]
    )
    config = serve_config(args)
    events = config.engine.cache_config.kv_events_config
    assert events is not None and for_replica(events, 1) is not None
    assert start_kv_events(events, object(), medium="CPU") is None  # no paged KV manager: nothing to publish
    assert len(calls) == 3, calls


def test_the_sections_hold_typed_configs_only() -> None:
    """Text and dicts are parsed at the boundary: a section given one directly refuses it, naming the field."""
    with pytest.raises(ValueError, match=r"^pooler_config must be a PoolerConfig"):
        ModelConfig(pooler_config=POOLER)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^kv_events_config must be a KVEventsConfig"):
        CacheConfig(kv_events_config=json.dumps(EVENTS))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^speculative_config must be a SpeculativeConfig"):
        EngineConfig(speculative_config=SPEC)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("name", "value", "key"),
    [
        ("kv_events_config", {"colour": 1}, "colour"),
        ("kv_events_config", "{bad", "not valid JSON"),
        ("kv_events_config", [1], "JSON object"),
        ("pooler_config", {"pooling_type": "SUM"}, "pooling_type"),
        ("pooler_config", [1], "JSON object"),
        ("speculative_config", {"method": "ngram", "k": 4}, "'k'"),
    ],
)
def test_llm_refuses_a_bad_sub_config_naming_the_key(
    name: str, value: object, key: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(ValueError, match=key) as info:
        llm_config(monkeypatch, model="m", **{name: value})
    assert name in str(info.value)


@pytest.mark.parametrize(
    ("value", "key"),
    [
        ('{"enable_kv_cache_events": true, "colour": 1}', "colour"),
        ('{"buffer_steps": 0}', "buffer_steps"),
        ("{bad", "not valid JSON"),
        ("[1]", "JSON object"),
    ],
)
def test_a_bad_kv_events_flag_exits_2_naming_the_flag_and_key(
    value: str, key: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main(["serve", "m", "--kv-events-config", value])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "--kv-events-config" in err and key in err, err


def test_the_typed_configs_cross_processes_as_msgpack() -> None:
    """Engine cores (one config per replica, its KV events endpoint offset) and tensor-parallel workers receive
    the tree as msgpack: the sub-configs come back as the same typed configs."""
    config = EngineConfig.from_flat(
        model="m", speculative_config=SPEC, pooler_config=POOLER, kv_events_config=EVENTS
    )
    for index in range(2):
        replica = replace(
            config,
            cache_config=replace(
                config.cache_config, kv_events_config=for_replica(config.cache_config.kv_events_config, index)
            ),
        )
        decoded = msgspec.msgpack.decode(msgspec.msgpack.encode(replica), type=EngineConfig)
        assert decoded == replica
        assert [type(c) for c in _sub_configs(decoded)] == [SpeculativeConfig, PoolerConfig, KVEventsConfig]
    events = decoded.cache_config.kv_events_config
    assert events is not None and events.endpoint == "tcp://127.0.0.1:6002"
    keys = PeerKeys("server-public", "public", "secret", "token")
    spec = WorkerSpec(config, "m", "cpu", "float32", 1, 2, "tcp://127.0.0.1:1", "127.0.0.1", 1, None, keys)
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(spec), type=WorkerSpec).config == config
    off = EngineConfig.from_flat(model="m")
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(off), type=EngineConfig) == off


def test_routing_by_events_needs_the_typed_config_to_enable_zmq() -> None:
    """The ServeConfig check reads the typed config: None or a null publisher is refused, naming the fields."""
    with pytest.raises(ValueError, match="routing_kv_events needs kv_events_config"):
        ServeConfig.from_flat(routing_kv_events=True, data_parallel_size=2)
    with pytest.raises(ValueError, match="routing_kv_events needs kv_events_config"):
        ServeConfig.from_flat(
            routing_kv_events=True, data_parallel_size=2, kv_events_config={**EVENTS, "publisher": "null"}
        )
    config = ServeConfig.from_flat(routing_kv_events=True, data_parallel_size=2, kv_events_config=EVENTS)
    assert config.engine.cache_config.kv_events_config == TYPED[2]
