"""Structured outputs (issue 16) through the live server and the offline LLM, on tiny random-weight models:
random weights make output valid only where the grammar enforces it."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any

import openai
import pytest
from api_cases import MODEL
from pagoda.server.llm import LLM
from pagoda.server.sampling_params import SamplingParams, StructuredOutputsParams
from pagoda.server.testing import make_tiny_model
from pydantic import BaseModel, Field
from test_api_live import NO_EOS, LiveServer, assert_good_request, serving, sync_client

MAX_TOKENS = 400  # room for a schema-bounded JSON object to close (each test checks finish_reason)


class Kind(StrEnum):
    """An enum field."""

    CAT = "cat"
    DOG = "dog"


class Owner(BaseModel):
    """A nested object."""

    # Letters only: with a byte-level vocabulary xgrammar 0.2 lets a free string end inside a UTF-8 sequence.
    name: str = Field(pattern=r"^[a-z]{1,6}$")
    verified: bool


class Pet(BaseModel):
    """Nested objects, an enum, a bounded array and bounded strings."""

    kind: Kind
    owner: Owner
    ages: list[Annotated[int, Field(ge=0, le=99)]] = Field(max_length=3)
    nickname: str = Field(pattern=r"^[A-Za-z]{1,5}$")


REGEX = r"[a-z]{3}-\d{2}"


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    """A server over a tiny random Llama with room for whole JSON objects."""
    path = make_tiny_model("llama", tmp_path_factory.mktemp("tiny") / "llama", max_position_embeddings=4096)
    with serving(path, "--max-model-len", "1024") as server:
        yield server


@pytest.fixture(scope="module")
def client(live: LiveServer) -> openai.OpenAI:
    """The official synchronous OpenAI client."""
    return sync_client(live)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_parse_returns_a_valid_pydantic_instance(client: openai.OpenAI, temperature: float) -> None:
    """`chat.completions.parse(response_format=Model)` gives a parsed instance, n > 1 samples each valid."""
    result = client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe a pet."}],
        response_format=Pet,
        max_tokens=MAX_TOKENS,
        temperature=temperature,
        n=1 if temperature == 0.0 else 3,
        seed=7,
    )
    assert len(result.choices) == (1 if temperature == 0.0 else 3)
    for choice in result.choices:
        assert choice.finish_reason == "stop", choice.message.content
        pet = choice.message.parsed
        assert isinstance(pet, Pet)
        assert Pet.model_validate_json(choice.message.content or "") == pet


def test_regex_choice_and_grammar_match_exactly(client: openai.OpenAI) -> None:
    """`regex`, `choice` and `grammar`, as vLLM's structured_outputs and as the legacy guided_* fields."""
    regexes: list[dict[str, Any]] = [{"structured_outputs": {"regex": REGEX}}, {"guided_regex": REGEX}]
    for extra in regexes:
        text = client.completions.create(
            model=MODEL, prompt="Code:", max_tokens=30, temperature=0.9, seed=1, extra_body=extra
        )
        assert re.fullmatch(REGEX, text.choices[0].text), text
    choices = ["yes", "no", "maybe later"]
    choice_fields: list[dict[str, Any]] = [
        {"structured_outputs": {"choice": choices}},
        {"guided_choice": choices},
    ]
    for extra in choice_fields:
        chat = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Well?"}],
            max_tokens=30,
            n=4,
            temperature=1.0,
            extra_body=extra,
        )
        assert all(c.message.content in choices for c in chat.choices), chat
    grammar = 'root ::= ("red" | "blue") " " [0-9] [0-9]'
    grammar_fields: list[dict[str, Any]] = [
        {"structured_outputs": {"grammar": grammar}},
        {"guided_grammar": grammar},
    ]
    for extra in grammar_fields:
        text = client.completions.create(model=MODEL, prompt="Colour:", max_tokens=30, extra_body=extra)
        assert re.fullmatch(r"(red|blue) \d\d", text.choices[0].text), text


def test_json_object_and_guided_json(client: openai.OpenAI) -> None:
    """`json_object` gives a JSON value; `guided_json` a schema-valid object, on /v1/completions too."""
    result = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "JSON please"}],
        response_format={"type": "json_object"},
        max_tokens=MAX_TOKENS,
        temperature=0,
    )
    if result.choices[0].finish_reason == "stop":  # the free grammar may not close in time; a prefix is valid
        assert isinstance(json.loads(result.choices[0].message.content or ""), dict)
    completion = client.completions.create(
        model=MODEL,
        prompt="A pet:",
        max_tokens=900,  # JSON whitespace runs are free (up to 16 characters each) and random weights love them
        temperature=0,
        extra_body={"guided_json": Pet.model_json_schema()},
    )
    assert completion.choices[0].finish_reason == "stop", completion.choices[0].text
    Pet.model_validate_json(completion.choices[0].text)


def test_unconstrained_requests_are_unchanged_in_a_constrained_batch(
    live: LiveServer, client: openai.OpenAI
) -> None:
    """Greedy unconstrained completions in one batch with json_schema requests equal the same sent alone."""
    prompts = [f"The quick brown fox number {i}" for i in range(4)]
    alone = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=24, temperature=0, extra_body=NO_EOS)
        .choices[0]
        .text
        for p in prompts
    ]
    aclient = openai.AsyncOpenAI(base_url=f"{live.base_url}/v1", api_key="unused", max_retries=0, timeout=120)

    async def together() -> tuple[list[str], list[str]]:
        async def plain(prompt: str) -> str:
            result = await aclient.completions.create(
                model=MODEL, prompt=prompt, max_tokens=24, temperature=0, extra_body=NO_EOS
            )
            return result.choices[0].text

        async def constrained(i: int) -> str:
            result = await aclient.chat.completions.parse(
                model=MODEL,
                messages=[{"role": "user", "content": f"pet {i}"}],
                response_format=Pet,
                max_tokens=MAX_TOKENS,
                temperature=0.7,
            )
            return result.choices[0].message.content or ""

        jobs = await asyncio.gather(*[plain(p) for p in prompts], *[constrained(i) for i in range(4)])
        await aclient.close()
        return list(jobs[: len(prompts)]), list(jobs[len(prompts) :])

    mixed, structured = asyncio.run(together())
    assert mixed == alone
    for text in structured:
        Pet.model_validate_json(text)


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "wat"}},
                }
            },
            "response_format.json_schema.schema",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"grammar": "root ::= undefined_rule"}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"guided_regex": "[z-a]"}, "guided_regex"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_choice": ["a"], "guided_regex": "a"}, "guided_choice"),
    ],
)
def test_invalid_constraint_is_400_naming_the_field(
    client: openai.OpenAI, extra: dict[str, Any], field: str
) -> None:
    """A bad schema, regex, grammar or combination is a 400 naming its field; the server serves on."""
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL, prompt="x", max_tokens=8, extra_body=extra)
    body = info.value.body
    assert isinstance(body, dict)
    assert body["param"] == field, body
    assert_good_request(client)


def test_offline_llm_with_preemption_by_recompute(tmp_path: Path) -> None:
    """SamplingParams(structured_outputs=...) offline; a KV pool so small that requests are preempted and
    recomputed still yields valid outputs (each matcher advances once per sampled token)."""
    path = make_tiny_model("llama", tmp_path / "llama", max_position_embeddings=4096)
    # Room for one request of max_model_len only: six at once preempt each other.
    llm = LLM(str(path), max_model_len=256, num_kv_blocks=64, block_size=4, max_num_seqs=8, dtype="float32")
    schema = Owner.model_json_schema()
    params = [
        SamplingParams(
            temperature=1.0,
            seed=i,
            max_tokens=240,
            structured_outputs=StructuredOutputsParams(json=schema),
        )
        for i in range(6)
    ]
    outputs = llm.generate([f"pet {i}" for i in range(6)], params, use_tqdm=False)
    assert llm.engine.get_stats().num_preemptions > 0
    for output in outputs:
        (sample,) = output.outputs
        assert sample.finish_reason == "stop", sample.text
        Owner.model_validate_json(sample.text)
