"""The structured-output fields of a request turned into one `StructuredOutputsParams`, naming the field at
fault in every 400."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagoda.server.api.errors import bad_request
from pagoda.server.api.structured_fields import StructuredFields
from pagoda.server.structured import GrammarError, GrammarKind, StructuredOutputsParams, parse_grammar

if TYPE_CHECKING:  # xgrammar takes ~0.4 s to import: loaded at the first constrained request, not at start
    import xgrammar as xgr


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
                disable_any_whitespace=so.disable_any_whitespace and so.json_ is not None,
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


@dataclass(frozen=True, slots=True)
class GrammarCheck:
    """What the API checks of a constraint before the engine sees it: its length, its parse, its compile time.

    `compile` starts a compilation (the in-process engine's own manager, so that the engine then finds the
    grammar in its cache; else a front-end manager). A compile not done within `timeout` seconds is a 400; it
    runs on on its pool thread (xgrammar cannot be interrupted) and its result is dropped.
    """

    compile: Callable[[StructuredOutputsParams], Future[xgr.CompiledGrammar]]
    max_chars: int  # --max-grammar-chars
    timeout: float  # --grammar-compile-timeout

    async def check(
        self,
        constraint: StructuredOutputsParams,
        fields: dict[GrammarKind, str],
        run: Callable[[Callable[[], None]], Awaitable[None]],  # runs work off the event loop
    ) -> None:
        """A 400 naming the request field when the constraint is too long, does not parse, or does not compile
        in time."""
        field = fields.get(constraint.kind, "structured_outputs")
        try:
            _, text = constraint.source()
        except GrammarError as exc:
            raise bad_request(f"{field}: {exc}", field) from exc
        if len(text) > self.max_chars:
            raise bad_request(
                f"{field}: the constraint has {len(text)} characters, more than --max-grammar-chars "
                f"({self.max_chars})",
                field,
            )
        await run(lambda: check_constraint(constraint, fields))
        try:
            await asyncio.wait_for(asyncio.wrap_future(self.compile(constraint)), self.timeout)
        except TimeoutError as exc:
            raise bad_request(
                f"{field}: the constraint did not compile within {self.timeout:g} s (--grammar-compile-timeout)",
                field,
            ) from exc
        except (RuntimeError, ValueError) as exc:  # what the parse let through and the compiler refused
            raise bad_request(f"{field}: the constraint could not be compiled: {exc}", field) from exc
