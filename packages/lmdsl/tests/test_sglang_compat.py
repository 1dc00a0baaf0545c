"""Program shapes that SGLang's own frontend tests use, written with `import lmdsl as sgl`:
unnamed gens, positional max_tokens, `forks[i] += ...`, calling a program directly, `.sync()`,
dtype gens, var_scope JSON, control flow on a select, `global_config.default_backend.token_usage`."""

from __future__ import annotations

import json
import re

import lmdsl as sgl
from lmdsl.backend.openai_backend import OpenAI
from lmdsl.testing import MockBackend
from lmdsl.testing.fake_lm import TranscriptLM
from lmdsl.testing.fake_openai import FakeOpenAIServer


def test_programs_in_sglang_style() -> None:
    backend = MockBackend(
        {'"name": ': '"Paris"', '"population": ': "2100000", "hours in a day is ": "24", "Is the sky blue? ": "True",
         "pi is ": "3.14", "calculate(": "257*983)", "Thought 1:": " I should search.", "Thought 2:": " Done.",
         " [": "Linus]", "Observation 1:": " Finland.", "Tip 1:": " Plan.\n\n", "Tip 2:": " Edit.\n\n",
         "In summary,": " plan and edit."},
        select_logprobs=lambda prompt, choice: [-0.1] if (choice == "Search") == prompt.text.endswith("Action 1: ")
        else [-2.0],
    )
    sgl.set_default_backend(backend)
    try:
        @sgl.function
        def city(s):
            with s.var_scope("json_output"):
                s += "{\n"
                s += '  "name": ' + sgl.gen_string() + ",\n"
                s += '  "population": ' + sgl.gen_int() + "\n"
                s += "}"

        assert json.loads(city.run(max_new_tokens=16)["json_output"]) == {"name": "Paris", "population": 2100000}

        @sgl.function
        def dtypes(s):
            s += "The number of hours in a day is " + sgl.gen("h", dtype=int) + "\n"
            s += "Is the sky blue? " + sgl.gen("b", dtype=bool) + "\n"
            s += "The value of pi is " + sgl.gen("f", dtype=float) + "\n"

        state = dtypes()  # calling the program runs it, as in SGLang
        state["h"] = int(state["h"])
        assert (state["h"], state["b"], float(state["f"])) == (24, "True", 3.14)
        regexes = [c.params.to_native()["regex"] for c in backend.calls_of("generate")[-3:]]
        assert regexes == [sgl.REGEX_INT, sgl.REGEX_BOOL, sgl.REGEX_FLOAT]

        def calculate(expression: str) -> str:
            a, b = expression.split("*")
            return str(int(a) * int(b))

        @sgl.function
        def tool_use(s, lhs, rhs):
            s += "What is " + str(lhs) + " times " + str(rhs) + "? calculate(" + sgl.gen("expression", stop=")")
            s += ") = "
            with s.var_scope("answer"):
                s += calculate(s["expression"])

        assert int(tool_use(lhs=257, rhs=983, temperature=0)["answer"]) == 257 * 983

        @sgl.function
        def react(s, question):
            s += "Question: " + question + "\n"
            for i in range(1, 4):
                s += f"Thought {i}:" + sgl.gen(stop=[".", "\n"]) + ".\n"
                s += f"Action {i}: " + sgl.select(f"action_{i}", ["Search", "Finish"])
                if s[f"action_{i}"] == "Search":
                    s += " [" + sgl.gen(stop="]") + "].\n"
                    s += f"Observation {i}:" + sgl.gen(stop=[".", "\n"]) + ".\n"
                else:
                    s += " [" + sgl.gen("answer", stop="]") + "].\n"
                    break

        state = react.run(question="Who wrote Linux?", temperature=0.1)
        assert (state["action_1"], state["action_2"], state["answer"]) == ("Search", "Finish", "Linus")
        assert "action_3" not in state

        @sgl.function
        def parallel_decoding(s, topic):
            s += "Tips for " + topic + ".\n"
            forks = s.fork(2)
            for i in range(2):
                forks[i] += f"Expand tip {i + 1}:\nTip {i + 1}:"
                forks[i] += sgl.gen("detailed_tip", 64, stop=["\n\n"])
            forks.join()
            for i in range(2):
                s += f"Tip {i + 1}:" + forks[i]["detailed_tip"] + "\n"
            s += "In summary," + sgl.gen("summary", max_tokens=32)

        state = parallel_decoding.run(topic="writing", temperature=0.3)
        assert state["detailed_tip"] == [" Plan.", " Edit."]
        assert state.text().endswith("Tip 1: Plan.\nTip 2: Edit.\nIn summary, plan and edit.")
        assert "fork0[1]" in str(parallel_decoding.trace())
    finally:
        sgl.set_default_backend(None)


def test_token_usage_through_global_config() -> None:
    prompt = "Character:\nName: Steve Jobs.\nBirthday: February 24, 1955.\nJob: Apple CEO.\n\nA new one.\n"
    transcript = prompt + "Name: Ada Lovelace.\nBirthday: December 10, 1815.\nJob: Mathematician.\n"

    def body(s):
        s += prompt
        s += "Name:" + sgl.gen("name", stop="\n") + "\nBirthday:" + sgl.gen("birthday", stop="\n")
        s += "\nJob:" + sgl.gen("job", stop="\n") + "\n"

    with FakeOpenAIServer(TranscriptLM(transcript)) as server:
        sgl.global_config.default_backend = OpenAI(
            "gpt-3.5-turbo-instruct", base_url=server.url + "/v1", api_key="k", max_retries=0)
        try:
            token_usage = sgl.global_config.default_backend.token_usage
            token_usage.reset()
            spec = sgl.function(num_api_spec_tokens=64)(body)()
            spec.sync()
            with_spec = token_usage.prompt_tokens
            token_usage.reset()
            plain = sgl.function(body)()
            plain.sync()
            assert with_spec < token_usage.prompt_tokens
            assert with_spec == spec.usage().prompt_tokens and token_usage.prompt_tokens == plain.usage().prompt_tokens
            assert [spec[k] for k in ("name", "birthday", "job")] == [plain[k] for k in ("name", "birthday", "job")]
            assert re.fullmatch(r" Ada Lovelace\.", plain["name"])
        finally:
            sgl.set_default_backend(None)
