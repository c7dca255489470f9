"""Prefill/decode disaggregation live (issue 40): `pagoda serve --prefill-replicas 1 --decode-replicas 1` gives one
engine's tokens (greedy, seeded at temperature 1.0 with logprobs, stop strings, streamed or not, prompts inside a
block, filling blocks and crossing several); requests that cannot move (n > 1, max_tokens 1) run on the prefill
core; /metrics counts the transfers and their bytes; a decode core killed mid-stream fails its streams with an
error to retry and comes back; bad flag combinations exit 2 naming them."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest
from api_cases import MODEL
from dashboard_support import wait_for_frame
from pagoda.server.cli import main
from pagoda.server.llm import LLM
from pagoda.server.procs.local import CHILD_INDEX_ENV
from pagoda.server.sampling_params import SamplingParams
from pagoda.server.testing import make_tiny_model
from test_api_live import NO_EOS, LiveServer, serving, sync_client
from test_engine_core import REPLICA_CPUS, _core_pids, metric_value, wait_replicas_alive

READY_S = 300
MAX_MODEL_LEN = 512
BLOCK = 16
# Inside one block, exactly two blocks, and across several (the decode core recomputes only the partial block).
PROMPTS = [[5, 17, 42, 9, 33], list(range(40, 40 + 2 * BLOCK)), [(7 * i) % 250 + 3 for i in range(45)]]
FLAGS = ("--max-model-len", str(MAX_MODEL_LEN), "--block-size", str(BLOCK), "--log-level", "info")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama."""
    return make_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama", max_position_embeddings=4096)


@pytest.fixture(scope="module")
def offline(model_dir: Path) -> Iterator[LLM]:
    """One float32 engine in this process: the tokens the disaggregated server must give."""
    llm = LLM(
        str(model_dir), dtype="float32", max_model_len=MAX_MODEL_LEN, block_size=BLOCK, num_kv_blocks=128
    )
    yield llm
    llm.engine.close()


@pytest.fixture(scope="module")
def pd(model_dir: Path) -> Iterator[LiveServer]:
    """One prefill core and one decode core, each pinned to its own CPU where there are two."""
    flags = (*FLAGS, "--prefill-replicas", "1", "--decode-replicas", "1", "--replica-cpus", REPLICA_CPUS)
    with serving(model_dir, *flags, ready_timeout=READY_S) as live:
        yield live


def want(offline: LLM, prompt: list[int], params: SamplingParams) -> tuple[str, tuple[int, ...], Any]:
    """One engine's text, tokens and logprobs."""
    (out,) = offline.generate([prompt], params, use_tqdm=False)
    sample = out.outputs[0]
    return sample.text, sample.token_ids, sample.logprobs


def labelled(exposition: str, name: str, **labels: str) -> float:
    """The value of the series of `name` carrying every label given."""
    for line in exposition.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not in /metrics")


def transfers(live: LiveServer) -> tuple[float, float]:
    """The /metrics counters (transfers, bytes)."""
    text = httpx.get(f"{live.base_url}/metrics").text
    label = f'{{model_name="{MODEL}"}}'
    return (
        metric_value(text, f"pagoda:kv_transfer_total{label}"),
        metric_value(text, f"pagoda:kv_transfer_bytes_total{label}"),
    )


@pytest.mark.timeout(900)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_disaggregated_tokens_equal_one_engine(pd: LiveServer, offline: LLM, temperature: float) -> None:
    """Every prompt, greedy and seeded: the server's text, token logprobs and finish equal one engine's, streamed
    or not; each request is one transfer, of the prompt's full blocks."""
    client = sync_client(pd)
    before = transfers(pd)
    for i, prompt in enumerate(PROMPTS):
        params = SamplingParams(
            temperature=temperature, seed=100 + i, max_tokens=10, ignore_eos=True, logprobs=0
        )
        text, tokens, logprobs = want(offline, prompt, params)
        body: dict[str, Any] = {"seed": 100 + i, **NO_EOS}
        got = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=10, temperature=temperature, logprobs=0, extra_body=body
        )
        choice = got.choices[0]
        assert choice.text == text and choice.finish_reason == "length", (i, temperature)
        assert choice.logprobs is not None and choice.logprobs.token_logprobs is not None
        for got_lp, token, entry in zip(choice.logprobs.token_logprobs, tokens, logprobs, strict=True):
            # The same float32 KV, attention summed in another chunking: a few ulps of the logits.
            assert got_lp is not None and abs(got_lp - entry[token].logprob) < 1e-4
        streamed = client.completions.create(
            model=MODEL, prompt=prompt, max_tokens=10, temperature=temperature, stream=True, extra_body=body
        )
        assert "".join(c.choices[0].text for c in streamed if c.choices) == text
    after = transfers(pd)
    assert after[0] - before[0] == 2 * len(PROMPTS)
    assert after[1] > before[1]


@pytest.mark.timeout(600)
def test_stop_strings_and_requests_that_stay_on_the_prefill_core(pd: LiveServer, offline: LLM) -> None:
    """A stop string met after the hand-off ends the text where one engine ends it; n = 2 and max_tokens 1 run
    wholly on the prefill core (no transfer) with one engine's tokens."""
    client = sync_client(pd)
    prompt = PROMPTS[2]
    full, _, _ = want(offline, prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    stop = full[3:5]
    assert stop, full
    text, _, _ = want(
        offline, prompt, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, stop=(stop,))
    )
    got = client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=12, temperature=0.0, stop=[stop], extra_body=NO_EOS
    )
    assert got.choices[0].text == text and got.choices[0].finish_reason == "stop"
    before = transfers(pd)
    two = SamplingParams(n=2, temperature=1.0, seed=5, max_tokens=6, ignore_eos=True)
    (out,) = offline.generate([prompt], two, use_tqdm=False)
    got = client.completions.create(
        model=MODEL, prompt=prompt, n=2, max_tokens=6, temperature=1.0, extra_body={"seed": 5, **NO_EOS}
    )
    assert sorted(c.text for c in got.choices) == sorted(s.text for s in out.outputs)
    one, _, _ = want(offline, prompt, SamplingParams(temperature=0.0, max_tokens=1))
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0.0)
    assert got.choices[0].text == one
    assert transfers(pd)[0] == before[0]


def test_health_and_the_dashboard_name_each_cores_role(pd: LiveServer) -> None:
    """/health lists the roles in core order; each dashboard replica map names its core's role."""
    assert roles(pd) == ["prefill", "decode"]
    frame = wait_for_frame(pd.base_url, {}, lambda f: len(f["replicas"]) == 2)
    assert [(r["replica"], r["role"]) for r in frame["replicas"]] == [(0, "prefill"), (1, "decode")]


def roles(live: LiveServer) -> list[str]:
    """Each replica's role, as /health lists them."""
    roles: list[str] = httpx.get(f"{live.base_url}/health").json()["replica_roles"]
    return roles


@pytest.mark.timeout(600)
def test_a_decode_core_killed_mid_stream(pd: LiveServer) -> None:
    """SIGKILL the decode core while three streams decode on it: they end with an error naming the replica (to
    retry), the core restarts, and new requests are served with their transfers again."""
    assert roles(pd) == ["prefill", "decode"]
    client = sync_client(pd)
    results: dict[int, Any] = {}
    started = threading.Barrier(4)

    def stream(i: int) -> None:
        try:
            events = client.completions.create(
                model=MODEL,
                prompt=f"story {i}",
                max_tokens=400,
                temperature=0,
                stream=True,
                extra_body=NO_EOS,
            )
            count = 0
            for chunk in events:
                count += len(chunk.choices)
                if count == 3:  # past the first token: decoding on the decode core
                    started.wait(60)
            results[i] = count
        except openai.APIError as exc:
            results[i] = exc

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(3)]
    for thread in threads:
        thread.start()
    started.wait(60)
    pids = _core_pids(pd)
    assert len(pids) == 2
    (decode,) = [pid for pid in pids if psutil.Process(pid).environ().get(CHILD_INDEX_ENV) == "1"]
    os.kill(decode, signal.SIGKILL)
    for thread in threads:
        thread.join(120)
    assert all(isinstance(r, openai.APIError) and "replica" in str(r) for r in results.values()), results
    wait_replicas_alive(pd, 2, 120, "the decode core did not come back")
    before = transfers(pd)
    got = client.completions.create(
        model=MODEL, prompt="back again", max_tokens=6, temperature=0, extra_body=NO_EOS
    )
    assert got.choices[0].finish_reason == "length"
    assert transfers(pd)[0] == before[0] + 1


@pytest.mark.timeout(900)
def test_blocks_pulled_over_tcp_give_one_engines_tokens(model_dir: Path, offline: LLM) -> None:
    """`--kv-transfer tcp`: each core keeps a host tier of its own (as on two hosts) and the decode core pulls the
    prompt's blocks from the prefill core's block server; greedy and seeded texts equal one engine's, and the decode
    core's `peer` tier counts the bytes it pulled."""
    flags = (*FLAGS, "--prefill-replicas", "1", "--decode-replicas", "1", "--kv-transfer", "tcp")
    with serving(model_dir, *flags, ready_timeout=READY_S) as live:
        client = sync_client(live)
        for temperature in (0.0, 1.0):
            for i, prompt in enumerate(PROMPTS):
                params = SamplingParams(temperature=temperature, seed=i, max_tokens=10, ignore_eos=True)
                text, _, _ = want(offline, prompt, params)
                got = client.completions.create(
                    model=MODEL,
                    prompt=prompt,
                    max_tokens=10,
                    temperature=temperature,
                    extra_body={"seed": i, **NO_EOS},
                )
                assert got.choices[0].text == text, (i, temperature)
        exposition = httpx.get(f"{live.base_url}/metrics").text
        pulled = labelled(exposition, "pagoda:kv_tier_bytes_in_total", engine="1", tier="peer")
        served = labelled(exposition, "pagoda:kv_tier_bytes_out_total", engine="0", tier="peer")
        assert pulled > 0 and pulled == served
        assert transfers(live)[0] == 2 * len(PROMPTS)


@pytest.mark.timeout(900)
def test_ray_places_the_cores_and_the_blocks_move_over_tcp(
    model_dir: Path, offline: LLM, ray_cluster: str
) -> None:
    """`--distributed-executor-backend ray --kv-transfer tcp`: Ray places the prefill and decode cores (a local
    cluster here), the blocks move over TCP, and greedy texts equal one engine's."""
    flags = (*FLAGS, "--prefill-replicas", "1", "--decode-replicas", "1", "--kv-transfer", "tcp",
             "--distributed-executor-backend", "ray")  # fmt: skip
    with serving(model_dir, *flags, ready_timeout=READY_S) as live:
        client = sync_client(live)
        for prompt in PROMPTS:
            text, _, _ = want(offline, prompt, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
            got = client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=8, temperature=0.0, extra_body=NO_EOS
            )
            assert got.choices[0].text == text
        exposition = httpx.get(f"{live.base_url}/metrics").text
        assert labelled(exposition, "pagoda:kv_tier_bytes_in_total", engine="1", tier="peer") > 0


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--prefill-replicas", "1"], "--decode-replicas"),
        (
            ["--prefill-replicas", "1", "--decode-replicas", "1", "--data-parallel-size", "3"],
            "--data-parallel-size",
        ),
        (
            ["--prefill-replicas", "1", "--decode-replicas", "1", "--no-enable-prefix-caching"],
            "--enable-prefix-caching",
        ),
        (
            ["--prefill-replicas", "1", "--decode-replicas", "1", "--distributed-executor-backend", "ray"],
            "--kv-transfer",
        ),
        (["--prefill-replicas", "-1", "--decode-replicas", "1"], "--prefill-replicas"),
        (["--kv-transfer", "tcp"], "--prefill-replicas"),
        (["--prefill-replicas", "1", "--decode-replicas", "1", "--kv-transfer", "udp"], "--kv-transfer"),
    ],
)
def test_bad_disaggregation_flags_exit_2(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each bad combination exits 2 naming the flag before any model loads."""
    try:
        status = main(["serve", "unused-model", *flags])
    except SystemExit as exc:  # argparse's own refusal of a value
        status = exc.code  # type: ignore[assignment]
    assert status == 2
    assert message in capsys.readouterr().err
