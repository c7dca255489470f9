"""The usage example in packages/blockalloc/README.md runs and its assertions hold."""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parents[2] / "packages" / "blockalloc" / "README.md"


def test_readme_examples_run() -> None:
    """Every ```python block of the README executes without error."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.DOTALL)
    assert blocks
    for code in blocks:
        exec(compile(code, str(README), "exec"), {})
