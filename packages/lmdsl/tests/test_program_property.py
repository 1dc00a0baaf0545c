"""Property: for random programs (constants, gens, selects, roles, forks with both join modes), the
asynchronous interpreter and the compiled graph both give what a naive synchronous evaluator gives."""

from __future__ import annotations

import zlib
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

import lmdsl as sgl
from lmdsl.backend.base import Prompt
from lmdsl.ir import SamplingParams
from lmdsl.testing import MockBackend

WORDS = ["alpha", "beta", "gamma", "delta", "eps"]
CHOICES = ["red", "green", "blue"]


def respond(prompt: Prompt, params: SamplingParams) -> str:
    h = zlib.crc32(prompt.text.encode())
    return " " + " ".join(WORDS[(h >> (3 * i)) % len(WORDS)] for i in range(3)) + "\n tail"


def logprobs(prompt: Prompt, choice: str) -> list[float]:
    return [-(zlib.crc32((prompt.text + choice).encode()) % 1000) / 100.0]


def new_backend() -> MockBackend:
    return MockBackend(respond=respond, select_logprobs=logprobs)


leaf = st.one_of(
    st.tuples(st.just("const"), st.sampled_from(["Q: ", "A:", "\n", "Note. "])),
    st.tuples(st.just("gen"), st.integers(1, 4)),
    st.tuples(st.just("select"), st.just(0)),
)
branch_ops = st.lists(leaf, min_size=1, max_size=3)
op = st.one_of(
    leaf,
    st.tuples(st.just("role"), st.sampled_from(["user", "assistant"]), st.lists(leaf, min_size=1, max_size=2)),
    st.tuples(st.just("fork"), st.integers(1, 3), branch_ops, st.sampled_from(["gather_variable", "concate_and_append"])),
)
programs = st.lists(op, min_size=1, max_size=6)


def build(ops: list[Any]) -> sgl.Function:
    def body(s):
        counter = [0]

        def emit(target, leaf_op):
            counter[0] += 1
            name = f"v{counter[0]}"
            if leaf_op[0] == "const":
                target += leaf_op[1]
            elif leaf_op[0] == "gen":
                target += sgl.gen(name, max_tokens=leaf_op[1], stop="\n")
            else:
                target += sgl.select(name, CHOICES)

        for o in ops:
            if o[0] == "role":
                with getattr(s, o[1])():
                    for leaf_op in o[2]:
                        emit(s, leaf_op)
            elif o[0] == "fork":
                forks = s.fork(o[1])
                forks += lambda i: f"[{i}]"
                start = counter[0]
                for f in forks:
                    counter[0] = start
                    for leaf_op in o[2]:
                        emit(f, leaf_op)
                forks.join(o[3])
            else:
                emit(s, o)

    return sgl.function(body)


def naive(ops: list[Any], backend: MockBackend) -> tuple[str, dict[str, Any]]:
    """A synchronous reference: text and variables, computed in program order with direct backend calls."""
    template = backend.get_chat_template()
    text, variables, counter = "", {}, [0]

    def run_leaf(t: str, vs: dict[str, Any], leaf_op: Any) -> str:
        counter[0] += 1
        name = f"v{counter[0]}"
        if leaf_op[0] == "const":
            return t + leaf_op[1]
        if leaf_op[0] == "gen":
            out = backend.generate(Prompt(t), SamplingParams(max_new_tokens=leaf_op[1], stop=("\n",))).text
        else:
            out = backend.select(Prompt(t), CHOICES, 0.0, "token_length_normalized").decision
        vs[name] = out
        return t + str(out)

    for o in ops:
        if o[0] == "role":
            text += template.prefix(o[1])
            for leaf_op in o[2]:
                text = run_leaf(text, variables, leaf_op)
            text += template.suffix(o[1])
        elif o[0] == "fork":
            start, children = counter[0], []
            for i in range(o[1]):
                counter[0] = start
                child_vars: dict[str, Any] = {}
                child_text = text + f"[{i}]"
                for leaf_op in o[2]:
                    child_text = run_leaf(child_text, child_vars, leaf_op)
                children.append((child_text[len(text):], child_vars))
            if o[3] == "gather_variable":
                for name in children[0][1]:
                    variables[name] = [c[1][name] for c in children]
            else:
                text += "".join(c[0] for c in children)
        else:
            text = run_leaf(text, variables, o)
    return text, variables


@settings(max_examples=40, deadline=None)
@given(programs)
def test_interpreter_and_compiled_match_a_naive_evaluator(ops: list[Any]) -> None:
    expected_text, expected_vars = naive(ops, new_backend())
    program = build(ops)
    for state in (program.run(backend=new_backend()), program.compile().run(backend=new_backend())):
        assert state.error() is None, state.error()
        assert state.text() == expected_text
        assert {k: state[k] for k in expected_vars} == expected_vars
