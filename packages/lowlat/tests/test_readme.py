"""The README's usage example runs as written."""

from __future__ import annotations

import contextlib
import io
import re
from pathlib import Path


def test_readme_usage_block_runs() -> None:
    text = Path(__file__).resolve().parents[1].joinpath("README.md").read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S)
    assert code is not None
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code.group(1), "README.md", "exec"), {})
    printed = out.getvalue()
    assert "plugin nvidia" in printed and "unsupported" in printed and "steps on plugin: 0" in printed
