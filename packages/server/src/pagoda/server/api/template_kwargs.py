"""Bounds on a request's `chat_template_kwargs` (issue 43 item 10): the variables are rendered by the chat
template on every request, so a megabyte value or a deep structure is refused (400 naming the field) before it
is validated item by item or reaches the template. Real uses are a few flags (`enable_thinking`,
`reasoning_effort`): a few hundred bytes."""

from __future__ import annotations

import json
from typing import Annotated, Any

from pydantic import BeforeValidator, JsonValue

MAX_TEMPLATE_KWARGS_CHARS = 16 * 1024  # the variables as compact JSON text
MAX_TEMPLATE_KWARGS_DEPTH = 8  # nesting of objects and arrays below the top-level object
MAX_TEMPLATE_KWARGS_KEYS = 64  # top-level variables


def _depth_exceeds(value: object, limit: int) -> bool:
    """Whether `value` nests objects/arrays deeper than `limit` (walked without recursion)."""
    stack: list[tuple[object, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        children: Any = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if depth >= limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


def check_template_kwargs_size(value: object) -> object:
    """ValueError when the variables are too many, too deep or too long (see the limits); else `value`."""
    if not isinstance(value, dict):
        return value  # the type check after this one names the field
    if len(value) > MAX_TEMPLATE_KWARGS_KEYS:
        raise ValueError(f"at most {MAX_TEMPLATE_KWARGS_KEYS} variables, got {len(value)}")
    if any(_depth_exceeds(item, MAX_TEMPLATE_KWARGS_DEPTH) for item in value.values()):
        raise ValueError(f"values nest deeper than {MAX_TEMPLATE_KWARGS_DEPTH} levels")
    try:
        size = len(json.dumps(value, separators=(",", ":"), ensure_ascii=False))
    except (TypeError, ValueError):
        return value  # not JSON: the type check after this one says so
    if size > MAX_TEMPLATE_KWARGS_CHARS:
        raise ValueError(f"at most {MAX_TEMPLATE_KWARGS_CHARS} characters as JSON, got {size}")
    return value


TemplateKwargs = Annotated[dict[str, JsonValue], BeforeValidator(check_template_kwargs_size)]
