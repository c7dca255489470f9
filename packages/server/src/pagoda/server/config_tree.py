"""The generic builder of a configuration tree from flat names (the CLI's destinations, `LLM`'s keywords).

A tree is a frozen dataclass whose fields are leaves or sections (fields whose default is itself a dataclass
instance). Every leaf has one flat name, its field name, unique over the whole tree; `build_config` hands each
flat name to the section that declares it, so a new field needs no code between its flag and its consumer.

A JSON sub-config (vLLM's `--speculative-config`, `--pooler-config`, `--kv-events-config`) is a leaf holding its
typed config; `json_object` is the first step of each one's parser, which runs once, where text or a dict enters.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import fields, is_dataclass, replace
from typing import Any, TypeVar

T = TypeVar("T")


def _sections(node: object) -> list[tuple[str, object]]:
    """(field name, value) of `node`'s fields whose value is itself a dataclass instance (a section)."""
    return [
        (f.name, value)
        for f in fields(node)  # type: ignore[arg-type]
        if is_dataclass(value := getattr(node, f.name)) and not isinstance(value, type)
    ]


def flat_names(tree: object) -> dict[str, tuple[str, ...]]:
    """Every leaf of `tree` (an instance) by flat name -> its path of field names; ValueError on a duplicate."""
    names: dict[str, tuple[str, ...]] = {}

    def walk(node: object, path: tuple[str, ...]) -> None:
        sections = dict(_sections(node))
        for f in fields(node):  # type: ignore[arg-type]
            if f.name in sections:
                walk(sections[f.name], (*path, f.name))
            elif f.name in names:
                raise ValueError(
                    f"{f.name} is a field of two sections: {names[f.name]} and {(*path, f.name)}"
                )
            else:
                names[f.name] = (*path, f.name)

    walk(tree, ())
    return names


def build_config(defaults: T, flat: Mapping[str, object]) -> T:
    """`defaults` (a tree instance) with the leaves `flat` names replaced; each section is rebuilt (and so
    validated by its `__post_init__`) once. TypeError naming the flat names no section declares."""
    unknown = sorted(set(flat) - set(flat_names(defaults)))
    if unknown:
        raise TypeError(f"unknown configuration name(s): {', '.join(unknown)}")
    return _rebuilt(defaults, flat)


def _rebuilt(node: T, flat: Mapping[str, object]) -> T:
    """`node` with its own leaves from `flat` and each section rebuilt the same way."""
    changes: dict[str, Any] = {name: _rebuilt(section, flat) for name, section in _sections(node)}
    changes.update({f.name: flat[f.name] for f in fields(node) if f.name not in changes and f.name in flat})  # type: ignore[arg-type]
    return replace(node, **changes) if changes else node  # type: ignore[type-var]


def json_object(
    value: object, name: str, *, example: str | None = None, error: Callable[[str], ValueError] = ValueError
) -> dict[str, object]:
    """The keys of a JSON sub-config given as a flag's JSON text or as a mapping (`LLM(name={...})`): `error`
    saying that `name` is not valid JSON, or not a JSON object (`such as {example}`)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise error(f"{name} is not valid JSON: {exc}") from None
    if not isinstance(value, Mapping):
        raise error(f"{name} must be a JSON object" + ("" if example is None else f" such as {example}"))
    return dict(value)
