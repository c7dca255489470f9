"""tools/bench_serving.py --lora without a server: each server runs twice, the base alone and then requests that
take the base and each adapter in turn."""

from __future__ import annotations

import random

from pagoda.server.bench import serving as bench_serving


def test_lora_runs_each_server_on_the_base_then_spread_over_the_adapters() -> None:
    """A base target and a `lora` target per server; the lora run's models cycle base, a1..a4."""
    args = bench_serving.parse_args(
        [
            "--base-url",
            "http://a:1",
            "--model",
            "base",
            "--lora",
            "a1",
            "a2",
            "a3",
            "a4",
            "--num-prompts",
            "10",
        ]
    )
    plain, lora = bench_serving.targets(args)
    assert (plain.label, plain.spread, lora.label) == ("a:1", (), "a:1 lora")
    requests = bench_serving.make_requests(args, random.Random(0))
    models = [bench_serving.request_body(args, lora, r, i)["model"] for i, r in enumerate(requests)]
    assert models == ["base", "a1", "a2", "a3", "a4"] * 2
    assert {bench_serving.request_body(args, plain, r, i)["model"] for i, r in enumerate(requests)} == {
        "base"
    }


def test_lora_runs_a_peer_on_its_base_then_spread_over_the_adapters() -> None:
    """A --peer (or --peer-url) server gets its LoRA run too, over its own base model's name and the adapters."""
    args = bench_serving.parse_args(["--serve", "pagoda=", "--lora", "a1", "a2", "--num-prompts", "6"])
    peer = bench_serving.Target("http://p:2", "/models/base", "vllm")
    plain, lora = bench_serving.lora_twins(args, [peer])
    assert (plain, lora.label, lora.spread) == (peer, "vllm lora", ("/models/base", "a1", "a2"))
    requests = bench_serving.make_requests(args, random.Random(0))
    models = [bench_serving.request_body(args, lora, r, i)["model"] for i, r in enumerate(requests)]
    assert models == ["/models/base", "a1", "a2"] * 2
    assert bench_serving.lora_twins(bench_serving.parse_args(["--serve", "pagoda="]), [peer]) == [peer]
