"""The README's first Python example runs as written."""

from __future__ import annotations

from pathlib import Path

import regex


def test_readme_example_runs() -> None:
    text = (Path(__file__).parents[1] / "README.md").read_text()
    blocks = regex.findall(r"```python\n(.*?)```", text, flags=regex.S)
    exec(compile(blocks[0], "README.md", "exec"), {})
