"""The request fields of structured outputs: OpenAI's `response_format`, vLLM's `structured_outputs` and the
legacy `guided_*` (serving_structured.py turns them into one constraint)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_CHOICES = 256  # choice strings per request: each is an alternative of the compiled grammar


class _Model(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="ignore", populate_by_name=True)


class JsonSchemaFormat(_Model):
    """`response_format.json_schema`: a named JSON schema (OpenAI's Structured Outputs)."""

    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None  # accepted; the schema is always enforced (see the README)


class ResponseFormat(_Model):
    """OpenAI's `response_format`: plain text, any JSON object, or JSON matching a schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsField(_Model):
    """vLLM's `structured_outputs` extra: exactly one of json, regex, choice, grammar, json_object."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = Field(default=None, max_length=MAX_CHOICES)
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False  # vLLM's: with `json`, no whitespace runs outside strings


class StructuredFields(_Model):
    """The structured-output fields shared by completions and chat."""

    # Mixed into the request bodies, whose unknown fields are kept to be rejected by name: do not drop them here.
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow", populate_by_name=True)

    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = Field(default=None, max_length=MAX_CHOICES)
    guided_grammar: str | None = None
