"""The structured-output fields of a request turned into one `StructuredOutputsParams`, naming the field at
fault in every 400."""

from __future__ import annotations

from pagoda.server.api.errors import bad_request
from pagoda.server.api.structured_fields import StructuredFields
from pagoda.server.structured import GrammarError, GrammarKind, StructuredOutputsParams, parse_grammar


def requested_constraint(
    body: StructuredFields,
) -> tuple[StructuredOutputsParams, dict[GrammarKind, str]] | None:
    """The one constraint a body asks for and, per kind, the field that gave it; a 400 when several are given."""
    found: list[tuple[str, StructuredOutputsParams, str]] = []  # (field, constraint, field naming its value)
    try:
        fmt = body.response_format
        if fmt is not None and fmt.type == "json_object":
            found.append(("response_format", StructuredOutputsParams(json_object=True), "response_format"))
        elif fmt is not None and fmt.type == "json_schema":
            if fmt.json_schema is None or fmt.json_schema.json_schema is None:
                raise bad_request(
                    "response_format of type json_schema needs json_schema.schema",
                    "response_format.json_schema",
                )
            schema = StructuredOutputsParams(json=fmt.json_schema.json_schema)
            found.append(("response_format", schema, "response_format.json_schema.schema"))
        so = body.structured_outputs
        if so is not None:
            given = {
                "json": so.json_,
                "regex": so.regex,
                "choice": so.choice,
                "grammar": so.grammar,
                "json_object": so.json_object or None,
            }
            named = [kind for kind, value in given.items() if value is not None]
            if len(named) != 1:
                raise bad_request(
                    "structured_outputs takes exactly one of json, regex, choice, grammar or json_object",
                    "structured_outputs",
                )
            kind = named[0]
            constraint = StructuredOutputsParams(
                json=so.json_,
                regex=so.regex,
                choice=None if so.choice is None else tuple(so.choice),
                grammar=so.grammar,
                json_object=bool(so.json_object),
            )
            found.append(("structured_outputs", constraint, f"structured_outputs.{kind}"))
        legacy: list[tuple[str, StructuredOutputsParams | None]] = [
            (
                "guided_json",
                None if body.guided_json is None else StructuredOutputsParams(json=body.guided_json),
            ),
            (
                "guided_regex",
                None if body.guided_regex is None else StructuredOutputsParams(regex=body.guided_regex),
            ),
            (
                "guided_choice",
                None
                if body.guided_choice is None
                else StructuredOutputsParams(choice=tuple(body.guided_choice)),
            ),
            (
                "guided_grammar",
                None if body.guided_grammar is None else StructuredOutputsParams(grammar=body.guided_grammar),
            ),
        ]
        found += [(name, constraint, name) for name, constraint in legacy if constraint is not None]
    except GrammarError as exc:  # a JSON schema that is not JSON text
        raise bad_request(str(exc), "structured_outputs") from exc
    if not found:
        return None
    if len(found) > 1:
        raise bad_request(
            f"only one structured output may be requested, got {', '.join(name for name, _, _ in found)}",
            found[1][0],
        )
    _, constraint, field = found[0]
    return constraint, {constraint.kind: field}


def check_constraint(constraint: StructuredOutputsParams, fields: dict[GrammarKind, str]) -> None:
    """Parse the constraint; a 400 naming the request field when the schema, regex or grammar is invalid."""
    try:
        parse_grammar(constraint)
    except GrammarError as exc:
        field = fields.get(exc.kind or constraint.kind, "structured_outputs")
        raise bad_request(f"{field}: {exc}", field) from exc
