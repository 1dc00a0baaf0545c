"""The paper's LM-program workloads written in lmdsl, with their sizes and sanity checks.

Each `Workload` gives the program, the keyword arguments of each program instance (fixed seed),
and a sanity check of one finished state (a choice was picked, the JSON parses and matches the
schema, every branch produced text...). Shared text a program starts with is a module constant,
so that `function.cache()` (the frontend's prefix hint) can find it.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

import data
import jsonschema

import lmdsl as sgl


@dataclass(frozen=True)
class Sizes:
    """Workload sizes; each field is also a command-line flag (`--mmlu-programs 64`)."""

    mmlu_programs: int = 6
    hellaswag_programs: int = 3
    react_programs: int = 2
    react_steps: int = 3
    agents: int = 2
    agent_calls_per_agent: int = 3
    tot_programs: int = 1
    tot_width: int = 3
    tot_depth: int = 3
    sot_programs: int = 2
    sot_points: int = 3
    judge_programs: int = 2
    json_programs: int = 4
    chat_programs: int = 3
    chat_long_programs: int = 2
    chat_turns: int = 3
    rag_programs: int = 3
    independent_programs: int = 6
    max_tokens: int = 8
    long_tokens: int = 24


# ---------------------------------------------------------------- programs
MMLU_HEADER = "The following are multiple choice questions (with answers).\n\n"
MMLU_SHOTS = {subject: data.mmlu_shots(subject) for subject in data.SUBJECTS[:2]}


@sgl.function
def mmlu(s, shots, question, ntok):
    s += MMLU_HEADER
    s += shots + question
    s += sgl.gen("answer", max_tokens=min(ntok, 2))


HELLASWAG_SHOTS = data.hellaswag_shots(20)


@sgl.function
def hellaswag(s, context, endings):
    s += HELLASWAG_SHOTS
    s += context
    s += sgl.select("ending", choices=endings)


REACT_HEADER = data.react_header()
REACT_TOOLS = [" " + t for t in data.TOOLS]


@sgl.function
def react(s, qid, question, steps, ntok):
    s += REACT_HEADER
    s += "Question: " + question + "\n"
    for step in range(1, steps + 1):
        s += f"Thought {step}:" + sgl.gen(f"thought_{step}", max_tokens=ntok, stop="\n") + "\n"
        s += f"Action {step}:" + sgl.select(f"tool_{step}", choices=REACT_TOOLS)
        s += "[" + sgl.gen(f"arg_{step}", max_tokens=6, stop=["]", "\n"]) + "]\n"
        s += f"Observation {step}: " + data.react_observation(qid, step) + "\n"


AGENT_WORLD = ("You are simulating the residents of a small town. Each resident has a memory stream; "
               "answer as the resident would, in the first person, in one sentence.\n\n")


@sgl.function
def agent_call(s, name, persona, memories, question, ntok):
    s += AGENT_WORLD
    s += persona
    s += "Relevant memories:\n" + memories + "\nQuestion: " + question + "\n" + name + ":"
    s += sgl.gen("reply", max_tokens=ntok, stop="\n")


TOT_HEADER = ("Solve the problem by thinking step by step. At each step, propose one idea in one line; "
              "promising ideas are explored further.\n\n")


def _expand(s, level, depth, width, ntok, leaves):
    forks = s.fork(width)
    for i, f in enumerate(forks):
        f += f"Step {level}.{i + 1}:" + sgl.gen("thought", max_tokens=ntok, stop="\n") + "\n"
    for f in forks:
        if level < depth:
            _expand(f, level + 1, depth, width, ntok, leaves)
        else:
            leaves.append(f)


@sgl.function
def tree_of_thought(s, question, width, depth, ntok, leaves):
    s += TOT_HEADER
    s += "Problem: " + question + "\n"
    _expand(s, 1, depth, width, ntok, leaves)


SOT_HEADER = ("You are an organized writer. First write a skeleton of the answer as a numbered list of "
              "short points (3 to 5 words each), then expand each point in one or two sentences.\n\n")


@sgl.function
def skeleton_of_thought(s, question, num_points, ntok, ntok_long):
    s += SOT_HEADER
    s += "Question: " + question + "\nSkeleton:\n1."
    s += sgl.gen("skeleton", max_tokens=ntok * num_points, stop="\n\n")
    lines = [ln.split(".", 1)[-1].strip() for ln in ("1." + s["skeleton"]).split("\n") if ln.strip()]
    points = (lines + [f"point {i + 1}" for i in range(num_points)])[:num_points]
    s.set_var("points_parsed", min(len(lines), num_points))
    forks = s.fork(num_points)
    for i, (f, point) in enumerate(zip(forks, points, strict=True)):
        f += f"\nExpand point {i + 1} ({point}):" + sgl.gen("expansion", max_tokens=ntok_long, stop="\n\n")
    forks.join()


JUDGE_SYSTEM = "You are a strict teacher who evaluates student essays."
JUDGE_DIMENSIONS = ["clarity", "originality", "evidence", "structure"]


@sgl.function
def llm_judge(s, essay, ntok):
    s += sgl.system(JUDGE_SYSTEM)
    s += sgl.user("Essay: " + essay)
    s += sgl.assistant("I have read the essay.")
    forks = s.fork(len(JUDGE_DIMENSIONS))
    for f, dim in zip(forks, JUDGE_DIMENSIONS, strict=True):
        f += sgl.user(f"Judge the essay on {dim} in one sentence.")
        f += sgl.assistant(sgl.gen("judgment", max_tokens=ntok, stop="\n"))
    forks.join()
    s += sgl.user("Your judgments:\n" + "\n".join(s["judgment"]) + "\nGive the overall grade, A to D.")
    s += sgl.assistant(sgl.select("grade", choices=["A", "B", "C", "D"]))


PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
                   "is_student": {"type": "boolean"}},
    "required": ["name", "age", "city", "is_student"],
    "additionalProperties": False,
}
# NOTE: the regex of PERSON_SCHEMA with fixed key order and spacing (as outlines/SGLang build it);
# its constant parts (keys, quotes, separators) are what jump-forward decodes without the model.
PERSON_REGEX = (r'\{"name": "[A-Za-z ]{1,16}", "age": [1-9][0-9]?, "city": "[A-Za-z ]{1,16}", '
                r'"is_student": (true|false)\}')
JSON_HEADER = ("Extract the person described in the text as JSON with the keys name, age, city, is_student.\n\n"
               "Text: Rain fell on the market. Ola is 23 years old and lives in Bergen. She studies music.\n"
               'JSON: {"name": "Ola", "age": 23, "city": "Bergen", "is_student": true}\n\n')


@sgl.function
def json_decode(s, text):
    s += JSON_HEADER
    s += "Text: " + text + "\nJSON: "
    s += sgl.gen("json", max_tokens=64, regex=PERSON_REGEX)


CHAT_SYSTEM = ("You are a helpful, concise assistant for a travel company. You answer questions about "
               "cities, trains, weather and food. Keep answers short and friendly.")


@sgl.function
def multi_turn_chat(s, questions, ntok):
    s += sgl.system(CHAT_SYSTEM)
    for i, q in enumerate(questions):
        s += sgl.user(q)
        s += sgl.assistant(sgl.gen(f"reply_{i}", max_tokens=ntok))


RAG_CORPUS = data.corpus(40)
RAG_HEADER = ("Answer questions with short factoid answers. First write a search query, then read the "
              "retrieved context, reason step by step, and answer in a few words.\n\n"
              "Question: Which city has the old castle?\nSearch query: old castle city\n"
              "Context:\n" + "\n".join(RAG_CORPUS[:2]) + "\nReasoning: Let's think step by step. "
              "The context names the city.\nAnswer: Oslo\n\n")


@sgl.function
def rag_pipeline(s, question, ntok):
    s += RAG_HEADER
    s += "Question: " + question + "\nSearch query:" + sgl.gen("query", max_tokens=8, stop="\n")
    context = data.retrieve(RAG_CORPUS, question + " " + s["query"])
    s += "\nContext:\n" + "\n".join(context) + "\nReasoning: Let's think step by step."
    s += sgl.gen("reasoning", max_tokens=ntok * 2, stop="\n")
    s += "\nAnswer:" + sgl.gen("answer", max_tokens=ntok, stop="\n")


@sgl.function
def independent(s, text, ntok):
    s += text
    s += sgl.gen("out", max_tokens=ntok)


# ---------------------------------------------------------------- workloads
@dataclass(frozen=True)
class Workload:
    """name; program; make(sizes) -> kwargs per program instance; check(state, kwargs) -> bool
    (the sanity count); check_label says what the count means."""

    name: str
    program: Any
    make: Callable[[Sizes], list[dict[str, Any]]]
    check: Callable[[Any, dict[str, Any]], bool]
    check_label: str
    constrained: bool = False


def _rng(name: str) -> random.Random:
    return random.Random(f"workload-{name}")


def _mmlu_args(z: Sizes) -> list[dict[str, Any]]:
    rng = _rng("mmlu")
    subjects = list(MMLU_SHOTS)
    return [{"shots": MMLU_SHOTS[subjects[i % len(subjects)]], "question": data.mmlu_question(rng),
             "ntok": z.max_tokens} for i in range(z.mmlu_programs)]


def _hellaswag_args(z: Sizes) -> list[dict[str, Any]]:
    rng = _rng("hellaswag")
    out = []
    for _ in range(z.hellaswag_programs):
        ctx, endings = data.hellaswag_item(rng)
        out.append({"context": ctx, "endings": endings})
    return out


def _react_args(z: Sizes) -> list[dict[str, Any]]:
    rng = _rng("react")
    return [{"qid": i, "question": data.sentence(rng, 12)[:-1] + "?", "steps": z.react_steps,
             "ntok": z.max_tokens} for i in range(z.react_programs)]


def _agent_args(z: Sizes) -> list[dict[str, Any]]:
    personas = data.agent_personas(z.agents)
    out = []
    for c in data.agent_calls(z.agents, z.agent_calls_per_agent):
        a = int(c["agent"])  # type: ignore[call-overload]
        name = data.NAMES[a % len(data.NAMES)]
        out.append({"name": name, "persona": personas[a], "memories": c["memories"],
                    "question": str(c["question"]).format(n=name), "ntok": z.max_tokens})
    return out


def _tot_args(z: Sizes) -> list[dict[str, Any]]:
    rng = _rng("tot")
    return [{"question": data.sentence(rng, 16), "width": z.tot_width, "depth": z.tot_depth,
             "ntok": z.max_tokens, "leaves": []} for _ in range(z.tot_programs)]


def _sot_args(z: Sizes) -> list[dict[str, Any]]:
    rng = _rng("sot")
    return [{"question": "How can " + data.sentence(rng, 8)[:-1].lower() + "?", "num_points": z.sot_points,
             "ntok": z.max_tokens, "ntok_long": z.long_tokens} for _ in range(z.sot_programs)]


def _judge_args(z: Sizes) -> list[dict[str, Any]]:
    rng = _rng("judge")
    return [{"essay": data.essay(rng), "ntok": z.max_tokens} for _ in range(z.judge_programs)]


def _json_args(z: Sizes) -> list[dict[str, Any]]:
    rng = _rng("json")
    return [{"text": data.city_record(rng)[0]} for _ in range(z.json_programs)]


def _chat_args(z: Sizes, long: bool) -> list[dict[str, Any]]:
    rng = _rng("chat-long" if long else "chat-short")
    out = []
    for _ in range(z.chat_long_programs if long else z.chat_programs):
        city = rng.choice(data.CITIES)
        qs = [f"I am visiting {city}. " + data.sentence(rng, 10)[:-1] + "?" for _ in range(z.chat_turns)]
        out.append({"questions": qs, "ntok": z.long_tokens if long else z.max_tokens})
    return out


def _rag_args(z: Sizes) -> list[dict[str, Any]]:
    rng = _rng("rag")
    return [{"question": f"What happened in {rng.choice(data.CITIES)} near the {rng.choice(data.WORDS[40:])}?",
             "ntok": z.max_tokens} for _ in range(z.rag_programs)]


def _independent_args(z: Sizes) -> list[dict[str, Any]]:
    rng = _rng("independent")
    return [{"text": f"{i}: " + " ".join(data.sentence(rng, 12) for _ in range(8)), "ntok": z.max_tokens}
            for i in range(z.independent_programs)]


def _nonempty(*names: str) -> Callable[[Any, dict[str, Any]], bool]:
    def check(state: Any, kw: dict[str, Any]) -> bool:
        return all(str(state[n]).strip() for n in names)
    return check


def _check_json(state: Any, kw: dict[str, Any]) -> bool:
    try:
        jsonschema.validate(json.loads(state["json"]), PERSON_SCHEMA)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def _check_react(state: Any, kw: dict[str, Any]) -> bool:
    return all(state[f"tool_{i}"] in REACT_TOOLS for i in range(1, kw["steps"] + 1))


def _check_tot(state: Any, kw: dict[str, Any]) -> bool:
    leaves = kw["leaves"]
    return len(leaves) == kw["width"] ** kw["depth"] and all(str(f["thought"]).strip() for f in leaves)


def _check_sot(state: Any, kw: dict[str, Any]) -> bool:
    return len(state["expansion"]) == kw["num_points"] and all(str(e).strip() for e in state["expansion"])


def _check_chat(state: Any, kw: dict[str, Any]) -> bool:
    return all(str(state[f"reply_{i}"]).strip() for i in range(len(kw["questions"])))


WORKLOADS: list[Workload] = [
    Workload("mmlu_5shot", mmlu, _mmlu_args,
             lambda st, kw: str(st["answer"]).strip()[:1] in ("A", "B", "C", "D"), "answer is a letter A-D"),
    Workload("hellaswag_20shot", hellaswag, _hellaswag_args,
             lambda st, kw: st["ending"] in kw["endings"], "an ending picked"),
    Workload("react_agent", react, _react_args, _check_react, "a tool picked at every step"),
    Workload("generative_agents", agent_call, _agent_args, _nonempty("reply"), "non-empty reply"),
    Workload("tree_of_thought", tree_of_thought, _tot_args, _check_tot, "all leaves non-empty"),
    Workload("skeleton_of_thought", skeleton_of_thought, _sot_args, _check_sot, "all points expanded"),
    Workload("llm_judge", llm_judge, _judge_args,
             lambda st, kw: st["grade"] in ("A", "B", "C", "D"), "a grade picked"),
    Workload("json_decode", json_decode, _json_args, _check_json, "valid JSON matching the schema",
             constrained=True),
    Workload("chat_short", multi_turn_chat, lambda z: _chat_args(z, False), _check_chat, "all turns non-empty"),
    Workload("chat_long", multi_turn_chat, lambda z: _chat_args(z, True), _check_chat, "all turns non-empty"),
    Workload("rag_pipeline", rag_pipeline, _rag_args, _nonempty("answer", "query"), "query and answer non-empty"),
    Workload("no_sharing", independent, _independent_args, _nonempty("out"), "non-empty output"),
]


def size_fields() -> list[tuple[str, int]]:
    return [(f.name, int(f.default)) for f in fields(Sizes)]  # type: ignore[call-overload]
