"""Every code block of every README runs, or is listed here with the reason it does not run here.

- ```python blocks run as written, each in a fresh interpreter (cwd: the repository root), unless
  `POLICY` names them: `RunBy(test)` (another test runs that block: checked to exist and to read
  that README section), `Slow(reason)` (runs in the `slow` tier), `Skip(reason)`, or `FakeServer()`
  (a client example for `lmserver serve` on port 30000: it runs against a server with a fake engine
  core on a free port).
- Other blocks (shell lines, layout listings) are checked for what they refer to: `make` targets
  exist in the Makefile, `pip install` paths are packages with the named extras, repository paths
  exist, `python -m` modules and `lmserver serve` / `lmserver route` options exist.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import shlex
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import tomllib

from lmserver.testing import ServerProcess

ROOT = Path(__file__).resolve().parents[1]
READMES = sorted({ROOT / "README.md", ROOT / "integration_tests" / "README.md",
                  *ROOT.glob("packages/*/README.md"), *ROOT.glob("packages/*/src/**/README.md"),
                  *ROOT.glob("benchmarks/**/README.md"), *ROOT.glob("docs/**/README.md")})
SHELL_LANGS = ("", "bash", "sh", "shell", "console", "text")


@dataclasses.dataclass(frozen=True)
class Block:
    readme: str  # relative to ROOT
    line: int  # of the opening fence
    lang: str
    heading: str  # the last heading above the block
    code: str
    nth: int = 1  # among the python (or the other) blocks under that heading

    @property
    def key(self) -> str:
        """README path, heading, and "#n" for the n-th block (n > 1) under one heading."""
        return f"{self.readme}:{self.heading}" + (f"#{self.nth}" if self.nth > 1 else "")


def _blocks() -> list[Block]:
    out: list[Block] = []
    for path in READMES:
        lines = path.read_text(encoding="utf-8").splitlines()
        heading, i = "(top)", 0
        while i < len(lines):
            line = lines[i]
            if line.startswith("#"):
                heading = line
            fence = re.match(r"^```(\S*)\s*$", line)
            if fence:
                end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == "```")
                out.append(Block(str(path.relative_to(ROOT)), i + 1, fence.group(1), heading,
                                 "\n".join(lines[i + 1 : end]) + "\n"))
                i = end
            i += 1
    seen: dict[tuple[str, bool], int] = {}
    numbered = []
    for b in out:
        kind = (b.key, b.lang == "python")
        n = seen[kind] = seen.get(kind, 0) + 1
        numbered.append(dataclasses.replace(b, nth=n))
    return numbered


@dataclasses.dataclass(frozen=True)
class RunBy:
    test: str  # "path::function", relative to ROOT


@dataclasses.dataclass(frozen=True)
class Slow:
    reason: str


@dataclasses.dataclass(frozen=True)
class Skip:
    reason: str


@dataclasses.dataclass(frozen=True)
class FakeServer:
    url: str = "http://127.0.0.1:30000"


SERVER = "packages/server/README.md"
# Python blocks that do not simply run here (in the default tier), and why.
POLICY: dict[str, RunBy | Slow | Skip | FakeServer] = {
    f"{SERVER}:## Serve": FakeServer(),
    f"{SERVER}:## Tool calling and reasoning": RunBy("integration_tests/test_tools_server.py::test_readme_example"),
    f"{SERVER}:## Speculative decoding": RunBy("packages/server/tests/test_spec_engine.py::test_readme_example"),
    f"{SERVER}:## Images and video (LLaVA)": RunBy("packages/server/tests/test_mm_engine.py::test_readme_example"),
    f"{SERVER}:## Offline engine": RunBy("packages/server/tests/test_engine.py::test_readme_example"),
    f"{SERVER}:## FP8 weights and KV cache": RunBy("packages/server/tests/test_fp8.py::test_readme_example"),
    f"{SERVER}:## Constrained decoding (cfsm)": Slow("loads the embedded model and compiles a regex over its "
                                                     "vocabulary (tests/test_constrained_engine.py checks the "
                                                     "same call's output)"),
    f"{SERVER}:## lmdsl programs in process": Slow("loads the embedded model; the lmdsl README's in-process "
                                                   "example (same backend) runs in the default tier"),
    "packages/cfsm/README.md:## Usage#2": Slow("loads SmolLM2 from its GGUF through transformers and compiles "
                                               "a regex over its 49,152 tokens"),
}


def _python_blocks() -> list[Block]:
    return [b for b in _blocks() if b.lang == "python"]


def _run_params() -> Iterator[object]:
    for b in _python_blocks():
        policy = POLICY.get(b.key)
        if policy is None or isinstance(policy, FakeServer):
            yield pytest.param(b, id=b.key)
        elif isinstance(policy, Slow):
            yield pytest.param(b, id=b.key, marks=pytest.mark.slow)


def _run(code: str, timeout_s: float = 600) -> None:
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-6000:]}"


def test_policy_names_existing_python_blocks() -> None:
    keys = [b.key for b in _python_blocks()]
    assert len(keys) == len(set(keys))
    assert sorted(set(POLICY) - set(keys)) == []
    assert len(keys) >= 15 and len(READMES) >= 10


@pytest.mark.parametrize("block", list(_run_params()))
def test_python_block_runs(block: Block) -> None:
    code = block.code
    policy = POLICY.get(block.key)
    if isinstance(policy, FakeServer):
        assert policy.url in code
        with ServerProcess(["--context-length", "2048"]) as srv:
            _run(code.replace(policy.url, srv.base_url))
        return
    _run(code)


@pytest.mark.parametrize("block", [pytest.param(b, id=b.key) for b in _python_blocks()
                                   if isinstance(POLICY.get(b.key), RunBy)])
def test_block_run_by_another_test(block: Block) -> None:
    """The named test exists and runs the README section of the block (it names its heading)."""
    policy = POLICY[block.key]
    assert isinstance(policy, RunBy) and block.nth == 1
    path, name = policy.test.split("::")
    source = (ROOT / path).read_text(encoding="utf-8")
    match = re.search(rf"^def {name}\(.*?(?=^def |^@|\Z)", source, re.S | re.M)
    assert match is not None, f"{policy.test} does not exist"
    assert "README" in match.group(0) and block.heading in match.group(0), f"{policy.test} does not run {block.key}"


# ---- shell blocks and listings

def _make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text(encoding="utf-8")
    return set(re.findall(r"^([A-Za-z][\w-]*):", text, re.M))


def _extras(package: Path) -> set[str]:
    data = tomllib.loads((package / "pyproject.toml").read_text(encoding="utf-8"))
    return set(data["project"].get("optional-dependencies", {}))


def _cli_options(*command: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "lmserver", *command, "--help"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _looks_like_path(token: str) -> bool:
    if any(c in token for c in "<>$*{}|=") or token.startswith(("-", "http", "[")) or "..." in token:
        return False
    return bool(re.match(r"^(packages|benchmarks|integration_tests|docs|\.ci)(/|$)", token)) or bool(
        re.match(r"^[\w./-]+\.(py|md|toml|txt)$", token))


def _problems(block: Block) -> list[str]:
    problems = []
    base = (ROOT / block.readme).parent
    targets = _make_targets()
    help_cache: dict[str, str] = {}
    code = block.code.replace("\\\n", " ")
    for raw in code.splitlines():
        line = raw.split(" #", 1)[0].strip()
        if not line or line.startswith("#"):
            continue
        try:
            words = shlex.split(line)
        except ValueError:
            words = line.split()
        words = [w.split("=", 1)[1] if re.match(r"^[A-Z_]+=", w) else w for w in words]  # VAR=value prefixes
        if words[:1] == ["make"]:
            problems += [f"make target {t!r} missing" for t in words[1:] if not t.startswith("-") and t not in targets]
        if "pip" in " ".join(words[:3]) and "install" in words:
            for w in words[words.index("install") + 1:]:
                spec = re.match(r"^((?:packages|\.)/[\w./-]*)(?:\[([\w,]+)\])?$", w)
                if spec is None:
                    continue
                package = ROOT / spec.group(1)
                if not (package / "pyproject.toml").is_file():
                    problems.append(f"{w}: no package there")
                elif spec.group(2):
                    problems += [f"{w}: no extra {e!r}" for e in spec.group(2).split(",") if e not in _extras(package)]
        for i, w in enumerate(words):
            if (w == "-m" and i + 1 < len(words) and words[i - 1].endswith(("python", "python3"))
                    and importlib.util.find_spec(words[i + 1].split(".")[0]) is None):
                problems.append(f"python -m {words[i + 1]}: no such module")
        if words[:1] == ["lmserver"] and len(words) > 1 and words[1] in ("serve", "route"):
            helptext = help_cache.setdefault(words[1], _cli_options(words[1]))
            problems += [f"lmserver {words[1]} has no option {w}" for w in words[2:]
                         if re.match(r"^--[\w-]+$", w) and w not in ("--help",) and w not in helptext]
        bases = [ROOT, base]  # NOTE: and folders named earlier on the line ("benchmarks/ ... RESULTS.md")
        for w in words:
            rel = re.sub(r"\[[\w,]+\]$", "", w.rstrip(","))  # "packages/cfsm[hf]": the extras are checked above
            if _looks_like_path(rel):
                found = [b / rel for b in bases if (b / rel).exists()]
                if not found:
                    problems.append(f"path {rel} does not exist")
                bases += [f for f in found if f.is_dir()]
    return problems


@pytest.mark.parametrize("block", [pytest.param(b, id=f"{b.readme}:{b.line}") for b in _blocks()
                                   if b.lang in SHELL_LANGS])
def test_shell_block_refers_to_existing_things(block: Block) -> None:
    assert _problems(block) == []


def test_the_shell_check_finds_wrong_references() -> None:
    block = Block("README.md", 1, "", "## x", "make servee\npip install -e \"packages/cfsm[nope]\" -e packages/nothing\n"
                  "python benchmarks/no_such_bench.py\nlmserver serve --no-such-flag  # comment\n")
    assert _problems(block) == ["make target 'servee' missing", "packages/cfsm[nope]: no extra 'nope'",
                                "packages/nothing: no package there", "path packages/nothing does not exist",
                                "path benchmarks/no_such_bench.py does not exist",
                                "lmserver serve has no option --no-such-flag"]
    assert _problems(dataclasses.replace(block, code="make serve test\npip install -e \"packages/cfsm[hf]\"\n"
                                         "benchmarks/   results in RESULTS.md\nlmserver serve --tp-size 2\n")) == []
