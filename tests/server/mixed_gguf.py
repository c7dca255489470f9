"""Tiny GGUFs whose matrices mix block formats, written once per test session (the `mixed_gguf` fixture's)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import pytest
from pagoda.server.testing.tiny_gguf import cycling_types, write_tiny_gguf


class MixedGGUFs:
    """`mixed(arch, types, embedding)`: a tiny GGUF of `arch` whose matrices cycle through `types` and whose
    embedding (the tied LM head) is `embedding`, written on first use and then reused."""

    def __init__(self, tmp_path_factory: pytest.TempPathFactory) -> None:
        self._tmp_path_factory = tmp_path_factory
        self._made: dict[tuple[str, tuple[str, ...], str], Path] = {}

    def __call__(self, arch: str, types: Sequence[str], embedding: str = "Q8_0") -> Path:
        """The file for these formats (written now if it was not yet)."""
        key = (arch, tuple(types), embedding)
        if key not in self._made:
            folder = self._tmp_path_factory.mktemp(f"mixed-{arch}")
            self._made[key] = write_tiny_gguf(arch, folder / "mixed.gguf", cycling_types(types, embedding))[0]
        return self._made[key]
