"""The engine's request rules (`AdmissionRules`), each on its own, and how the API relays a rejection."""

from __future__ import annotations

from collections.abc import Callable

import pagoda.scheduler
import pytest
from pagoda.server.api.errors import APIError
from pagoda.server.api.serving_base import to_api_error
from pagoda.server.engine import AdmissionRules, RequestRejectedError
from pagoda.server.sampling_params import SamplingParams, StructuredOutputsParams

RULES = AdmissionRules(max_model_len=10, vocab_size=100)


def rejected_param(call: Callable[..., object], *args: object) -> str | None:
    """The `param` of the RequestRejectedError that `call(*args)` raises."""
    with pytest.raises(RequestRejectedError) as info:
        call(*args)
    return info.value.param


def test_one_rejection_class_for_scheduler_and_engine() -> None:
    """The engine raises the scheduler's class, so a scheduler rejection needs no translation."""
    assert RequestRejectedError is pagoda.scheduler.RequestRejectedError
    assert issubclass(RequestRejectedError, ValueError)
    assert RequestRejectedError("no").param is None


def test_token_ids_must_be_in_the_vocabulary() -> None:
    """Ids in [0, vocab_size) pass; -1 and vocab_size are refused under the caller's field name."""
    RULES.check_token_ids([0, 99], "tokens")
    assert rejected_param(RULES.check_token_ids, [5, 100], "tokens") == "tokens"
    assert rejected_param(RULES.check_token_ids, [-1], "stop_token_ids") == "stop_token_ids"


def test_the_prompt_must_not_be_empty() -> None:
    """An empty prompt is refused under the field that carried it."""
    assert rejected_param(RULES.max_tokens, [], 5) == "prompt"
    assert rejected_param(RULES.max_tokens, [], None, "messages") == "messages"


def test_prompt_ids_are_checked_against_the_vocabulary() -> None:
    """A prompt id outside the vocabulary names the prompt's field."""
    assert rejected_param(RULES.max_tokens, [1, 100], 1, "messages") == "messages"


def test_the_prompt_alone_must_fit_max_model_len() -> None:
    """A prompt longer than max_model_len names the prompt, whatever max_tokens says."""
    assert rejected_param(RULES.max_tokens, [1] * 11, 1) == "prompt"
    assert rejected_param(RULES.max_tokens, [1] * 11, None) == "prompt"


def test_prompt_plus_max_tokens_must_fit_max_model_len() -> None:
    """max_tokens up to the room left passes; one more names max_tokens."""
    assert RULES.max_tokens([1] * 4, 6) == 6
    assert rejected_param(RULES.max_tokens, [1] * 4, 7, "messages") == "max_tokens"


def test_omitted_max_tokens_takes_the_room_left() -> None:
    """Without max_tokens the request may fill max_model_len; a prompt that leaves no room names the prompt."""
    assert RULES.max_tokens([1] * 4, None) == 6
    assert RULES.max_tokens([1] * 9, None) == 1
    assert rejected_param(RULES.max_tokens, [1] * 10, None, "messages") == "messages"


def test_check_applies_every_rule_to_an_engine_request() -> None:
    """The engine's entry point: prompt, max_tokens and stop token ids."""
    RULES.check([1, 2], SamplingParams(max_tokens=8, stop_token_ids=(99,)))
    assert rejected_param(RULES.check, [], SamplingParams()) == "prompt"
    assert rejected_param(RULES.check, [1, 2], SamplingParams(max_tokens=9)) == "max_tokens"
    assert (
        rejected_param(RULES.check, [1], SamplingParams(max_tokens=2, stop_token_ids=(100,)))
        == "stop_token_ids"
    )


@pytest.mark.parametrize("param", ["prompt", "max_tokens", "n", "request_id", None])
def test_the_api_relays_a_rejection_with_its_param(param: str | None) -> None:
    """Whatever field the engine (or its scheduler) names becomes the 400's `param`."""
    error = to_api_error(RequestRejectedError("refused", param))
    assert isinstance(error, APIError)
    assert (error.status, error.message, error.param) == (400, "refused", param)


def test_the_api_answers_another_value_error_with_a_400_naming_nothing() -> None:
    """A ValueError that is not a rejection still answers 400, without guessing a field."""
    error = to_api_error(ValueError("bad"))
    assert isinstance(error, APIError)
    assert (error.status, error.param) == (400, None)


def test_a_constraint_must_parse() -> None:
    """A structured-outputs constraint that does not parse names its own field; one that parses passes."""
    RULES.check_constraint(
        SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(regex="[a-z]+"))
    )
    bad = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(regex="[a-z"))
    assert rejected_param(RULES.check_constraint, bad) == "structured_outputs.regex"
    schema = SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(json="[1]"))
    assert rejected_param(RULES.check_constraint, schema) == "structured_outputs.json"


def test_the_engine_check_does_not_parse_the_constraint(monkeypatch: pytest.MonkeyPatch) -> None:
    """The engine thread's check leaves the grammar alone (the front end parsed it; the pool compiles it)."""
    import pagoda.server.engine.admission as admission

    def no_parse(*_: object) -> None:
        raise AssertionError("the engine's check parsed the grammar")

    monkeypatch.setattr(admission, "parse_grammar", no_parse)
    RULES.check(
        [1, 2], SamplingParams(max_tokens=8, structured_outputs=StructuredOutputsParams(regex="[a-z"))
    )
