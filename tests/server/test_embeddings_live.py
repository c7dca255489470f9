"""Issue 26 (embeddings): POST /v1/embeddings through the official OpenAI client against `pagoda serve --task embed`
(the pooling runner under vLLM's older flag) with a MEAN --pooler-config, on a tiny random Llama that declares
Matryoshka dimensions; and the runner errors of both runners."""

from __future__ import annotations

import base64
import json
import struct
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, cast

import httpx
import openai
import pytest
import torch
from api_cases import MAX_MODEL_LEN, MODEL
from pagoda.server.testing import make_tiny_model
from test_api_live import LiveServer, serving, sync_client
from transformers import AutoModelForCausalLM, AutoTokenizer

MATRYOSHKA = [16, 32]
TEXTS = ["The quick brown fox", "Hello world! How are you today?", "Paris"]
IDS = [[1, 17, 42, 99, 7], [1, 250, 31, 64, 5, 77, 120, 200, 3]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Llama whose config.json declares Matryoshka dimensions."""
    path = make_tiny_model("llama", tmp_path_factory.mktemp("embed") / "llama")
    config_file = path / "config.json"
    config = json.loads(config_file.read_text())
    config["matryoshka_dimensions"] = MATRYOSHKA
    config_file.write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def live(model_dir: Path) -> Iterator[LiveServer]:
    """The pooling runner, MEAN pooling, small chunks (chunked prefill)."""
    with serving(
        model_dir,
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--task",
        "embed",
        "--pooler-config",
        '{"pooling_type": "MEAN"}',
        "--max-num-batched-tokens",
        "8",
    ) as server:
        yield server


@pytest.fixture(scope="module")
def client(live: LiveServer) -> openai.OpenAI:
    """The official synchronous OpenAI client."""
    return sync_client(live)


def reference(
    model_dir: Path, prompts: Sequence[Sequence[int]], dims: int | None = None
) -> list[torch.Tensor]:
    """transformers' float32 final hidden states of each prompt, mean-pooled, cut to `dims`, normalised."""
    model = cast(Any, AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32))
    out = []
    with torch.no_grad():
        for ids in prompts:
            mean = model.model(torch.tensor([list(ids)])).last_hidden_state[0].mean(dim=0)
            out.append(torch.nn.functional.normalize(mean[:dims], dim=0))
    return out


def assert_vectors(got: Sequence[Sequence[float]], want: Sequence[torch.Tensor]) -> None:
    """Cosine >= 0.99999 with each reference."""
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert len(g) == w.shape[0]
        cosine = torch.nn.functional.cosine_similarity(torch.tensor(g, dtype=torch.float32), w, dim=0).item()
        assert cosine >= 0.99999


def tokens(model_dir: Path, texts: Sequence[str]) -> list[list[int]]:
    """The server's tokenization of text inputs (special tokens added)."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return [tokenizer.encode(text) for text in texts]


def test_every_input_shape_matches_transformers(client: openai.OpenAI, model_dir: Path) -> None:
    """A string, a list of strings, token ids and a list of token-id lists; the official client's default
    (base64, decoded by the client) and explicit floats; usage counts the input tokens."""
    text_ids = tokens(model_dir, TEXTS)
    one = client.embeddings.create(model=MODEL, input=TEXTS[0])
    assert_vectors([one.data[0].embedding], reference(model_dir, text_ids[:1]))
    assert one.usage.prompt_tokens == one.usage.total_tokens == len(text_ids[0])
    many = client.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert [d.index for d in many.data] == [0, 1, 2]
    assert_vectors([d.embedding for d in many.data], reference(model_dir, text_ids))
    assert many.usage.prompt_tokens == sum(map(len, text_ids))
    ids = client.embeddings.create(model=MODEL, input=IDS[0])
    assert_vectors([ids.data[0].embedding], reference(model_dir, IDS[:1]))
    lists = client.embeddings.create(model=MODEL, input=IDS)
    assert_vectors([d.embedding for d in lists.data], reference(model_dir, IDS))
    assert lists.model == MODEL


def test_base64_round_trips(live: LiveServer, client: openai.OpenAI) -> None:
    """base64 is the float32 little-endian bytes of the float answer (what the official client decodes)."""
    floats = client.embeddings.create(model=MODEL, input=IDS, encoding_format="float")
    raw = httpx.post(
        f"{live.base_url}/v1/embeddings", json={"input": IDS, "encoding_format": "base64"}, timeout=60
    ).json()
    for item, expected in zip(raw["data"], floats.data, strict=True):
        data = base64.b64decode(item["embedding"])
        decoded = struct.unpack(f"<{len(data) // 4}f", data)
        assert list(decoded) == pytest.approx(expected.embedding, abs=1e-6)
    # Without encoding_format the official client asks for base64 and decodes it itself.
    via_client = client.embeddings.create(model=MODEL, input=IDS)
    for got, expected in zip(via_client.data, floats.data, strict=True):
        assert got.embedding == pytest.approx(expected.embedding, abs=1e-6)
    explicit = client.embeddings.create(model=MODEL, input=IDS, encoding_format="base64")
    assert [d.embedding for d in explicit.data] == [item["embedding"] for item in raw["data"]]


def test_matryoshka_dimensions(client: openai.OpenAI, model_dir: Path) -> None:
    """A declared width cuts the vector before normalising; another is a 400 naming dimensions."""
    result = client.embeddings.create(model=MODEL, input=IDS, dimensions=16, encoding_format="float")
    assert_vectors([d.embedding for d in result.data], reference(model_dir, IDS, dims=16))
    with pytest.raises(openai.BadRequestError) as info:
        client.embeddings.create(model=MODEL, input=IDS, dimensions=20)
    assert info.value.body["param"] == "dimensions"  # type: ignore[index]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": ["ok", ""]}, "input"),
        ({"input": [[]]}, "input"),
        ({"input": [5] * (MAX_MODEL_LEN + 1)}, "input"),
        ({"input": [100000]}, "input"),
        ({"input": [-1]}, "input"),
        ({"input": 5}, "input"),
        ({"input": [1.5]}, "input"),
        ({}, "input"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": "x", "dimensions": 0}, "dimensions"),
        ({"input": "x", "dimensions": "16"}, "dimensions"),
        ({"input": "x", "dimensions": 20}, "dimensions"),
        ({"input": "x", "model": "other"}, "model"),
        ({"input": "x", "temperature": 0}, "temperature"),
        ({"input": ["x"] * 10_000}, "input"),
    ],
)
def test_bad_input_is_400_naming_the_field(
    live: LiveServer, client: openai.OpenAI, body: dict[str, Any], param: str
) -> None:
    """Each bad body is a 4xx naming its field (404 for an unknown model), and the server serves on."""
    response = httpx.post(f"{live.base_url}/v1/embeddings", json=body, timeout=60)
    assert response.status_code == (404 if param == "model" else 400), response.text
    assert response.json()["error"]["param"] == param, response.text
    assert len(client.embeddings.create(model=MODEL, input="still serving").data) == 1


def test_completion_and_chat_on_the_pooling_runner_say_which_runner(client: openai.OpenAI) -> None:
    """A completion or a chat completion to the pooling runner is a 400 telling to start --runner generate."""
    with pytest.raises(openai.BadRequestError, match="--runner generate"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="--runner generate"):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )
    with pytest.raises(openai.BadRequestError, match="--runner generate"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, stream=True)
    assert len(client.embeddings.create(model=MODEL, input="still serving").data) == 1


def test_score_and_rerank_are_cosines_of_embeddings(live: LiveServer, model_dir: Path) -> None:
    """Issue 42: on an embedding model /score and /rerank score a pair by the cosine of its two texts' vectors
    (each distinct text embedded once: usage counts the query once), equal to transformers' pooled vectors'
    within 1e-4 (cosine >= 0.99999 above bounds each vector's direction to that)."""
    text_ids = tokens(model_dir, TEXTS)
    vectors = reference(model_dir, text_ids)
    want = [float(torch.dot(vectors[0], v)) for v in vectors]  # unit vectors: the dot is the cosine
    response = httpx.post(
        f"{live.base_url}/score", json={"text_1": TEXTS[0], "text_2": TEXTS}, timeout=60
    ).json()
    assert [d["index"] for d in response["data"]] == [0, 1, 2]
    assert [d["score"] for d in response["data"]] == pytest.approx(want, abs=1e-4)
    assert response["usage"]["prompt_tokens"] == sum(map(len, text_ids))
    ranked = httpx.post(
        f"{live.base_url}/v1/rerank", json={"query": TEXTS[0], "documents": TEXTS[1:], "top_n": 1}, timeout=60
    ).json()
    best = 1 + max(range(2), key=lambda i: want[1 + i])
    assert [(r["index"], r["document"]["text"]) for r in ranked["results"]] == [(best - 1, TEXTS[best])]
    assert ranked["results"][0]["relevance_score"] == pytest.approx(want[best], abs=1e-4)


def test_embeddings_on_the_generate_runner_say_which_runner(model_dir: Path) -> None:
    """An embeddings request to the generate runner (the default) is a 400 telling to start --runner pooling, and
    so are /score and /rerank (issue 42)."""
    with serving(model_dir, "--max-model-len", str(MAX_MODEL_LEN)) as server:
        client = sync_client(server)
        with pytest.raises(openai.BadRequestError, match="--runner pooling") as info:
            client.embeddings.create(model=MODEL, input="hi")
        assert info.value.body["param"] == "input"  # type: ignore[index]
        for path, body in (
            ("/score", {"text_1": "a", "text_2": "b"}),
            ("/rerank", {"query": "q", "documents": ["a"]}),
        ):
            response = httpx.post(f"{server.base_url}{path}", json=body, timeout=60)
            assert response.status_code == 400, response.text
            assert "--runner pooling" in response.json()["error"]["message"]
        result = client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert len(result.choices) == 1
