"""The README's essay judge: the lmdsl program and the raw-openai program give the same result against
local fakes of our server's two APIs, and the README shows both files and their true line counts."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

import openai

import lmdsl as sgl
from lmdsl.testing.fake_lm import FunctionLM
from lmdsl.testing.fake_native import FakeNativeServer
from lmdsl.testing.fake_openai import FakeOpenAIServer

PACKAGE = Path(__file__).resolve().parents[1]
JUDGMENTS = {"Clarity": "Clear and direct.", "Originality": "A familiar scene.", "Evidence": "Few details."}
RESULT = '{"summary": "A clear, short essay", "grade": "B+"}'


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"lmdsl_example_{name}", PACKAGE / "examples" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def answer(question: str) -> str:
    if "related to the image" in question:
        return "yes"
    for dim, judgment in JUDGMENTS.items():
        if "on " + dim in question:
            return judgment
    if "as JSON" in question:
        return RESULT
    return "?"


def last_user_chatml(prompt: str) -> str:
    return prompt.rsplit("<|im_start|>user\n", 1)[-1].split("<|im_end|>")[0]


def test_both_programs_agree(tmp_path: Path) -> None:
    image = tmp_path / "essay.png"
    image.write_bytes(b"\x89PNG not really")
    essay = "A cat sleeps on a warm windowsill."
    lm = FunctionLM(lambda p: answer(last_user_chatml(p)) + "<|im_end|>\n",
                    logprob=lambda ctx, tok: 0.0 if "yes" in tok else -5.0)
    with FakeNativeServer(lm) as native, FakeOpenAIServer(
        lm, chat=lambda messages: answer(str(messages[-1]["content"]))
    ) as compatible:
        judge = load("essay_judge").essay_judge
        state = judge.run(image_path=str(image), essay=essay, backend=sgl.RuntimeEndpoint(native.url))
        assert state.error() is None, state.error()
        ours = {"related": state["related"], "judgment": state["judgment"], "result": state["result"]}
        client = openai.OpenAI(base_url=compatible.url + "/v1", api_key="k", max_retries=0)
        raw = load("essay_judge_openai").essay_judge(client, "fake-model", str(image), essay)
        assert ours == raw == {"related": "yes", "judgment": list(JUDGMENTS.values()), "result": RESULT}
        generate = native.requests_to("/generate")
        assert generate[-1]["sampling_params"]["regex"] == load("essay_judge").RESULT_REGEX
        assert sum(r["sampling_params"] == {"max_new_tokens": 0} and isinstance(r["text"], str)
                   for r in generate) == 2  # select's prompt count, then the fork's prefix hint
        assert len(compatible.requests_to("/v1/chat/completions")) == 5


def program_lines(path: Path) -> int:
    """Non-blank, non-comment lines of the program, without the module docstring and the __main__ block."""
    text = path.read_text().split('\nif __name__ == "__main__":')[0]
    lines = [line for line in text.splitlines()[1:] if line.strip() and not line.strip().startswith("#")]
    return len(lines)


def test_readme_shows_the_programs_and_their_line_counts() -> None:
    readme = (PACKAGE / "README.md").read_text()
    ours, raw = PACKAGE / "examples" / "essay_judge.py", PACKAGE / "examples" / "essay_judge_openai.py"
    for path in (ours, raw):
        assert path.read_text().split('\n\nif __name__')[0].strip() in readme, f"README is missing {path.name}"
    counts = dict(re.findall(r"\| `examples/(\w+\.py)` \| (\d+) \|", readme))
    assert counts == {ours.name: str(program_lines(ours)), raw.name: str(program_lines(raw))}


def test_readme_usage_example_runs() -> None:
    readme = (PACKAGE / "README.md").read_text()
    usage = readme.split("## Usage", 1)[1].split("```python\n", 1)[1].split("```", 1)[0]
    exec(compile(usage, "README.md usage", "exec"), {"__name__": "readme_usage"})
