"""Request fields Pagoda knows but does not serve: each is a 400 naming it, unless its value changes nothing."""

from __future__ import annotations

from collections.abc import Collection

from pagoda.server.api.errors import bad_request
from pagoda.server.api.protocol import SamplingFields
from pydantic import JsonValue

# (field, the values that change nothing and are accepted); a field the body's model does not declare is skipped.
_UNSERVED: tuple[tuple[str, tuple[JsonValue, ...]], ...] = (
    ("tools", (None, [])),
    ("tool_choice", (None, "none")),
    ("parallel_tool_calls", (None,)),
    ("functions", (None, [])),
    ("function_call", (None, "none")),
    ("use_beam_search", (False,)),
    ("length_penalty", (None, 1.0)),
    ("logits_processors", (None, [])),
    ("suffix", (None, "")),
    ("audio", (None,)),
    ("modalities", (None, ["text"])),
    ("prediction", (None,)),
    ("reasoning_effort", (None,)),
    ("verbosity", (None,)),
    ("web_search_options", (None,)),
    ("chat_template", (None,)),
    ("continue_final_message", (False,)),
    ("service_tier", (None, "auto", "default")),
)


def check_fields(body: SamplingFields, *, served: Collection[str] = ()) -> None:
    """400 for the first unknown field, or known field with a value Pagoda would otherwise have to ignore.

    `served` names fields of `_UNSERVED` that the caller's endpoint does serve (beam search on completions).
    """
    unknown = body.unknown_fields()
    if unknown:
        raise bad_request(f"{unknown[0]}: unrecognized request field", unknown[0])
    declared = type(body).model_fields
    for name, harmless in _UNSERVED:
        if name in declared and name not in served and getattr(body, name) not in harmless:
            raise bad_request(f"{name} is not supported yet", name)
    if "best_of" not in served and body.best_of is not None and body.best_of != body.n:
        raise bad_request(
            "best_of other than n is not supported (no beam search on this endpoint)", "best_of"
        )
