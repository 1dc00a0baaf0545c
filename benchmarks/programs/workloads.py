"""The paper's LM-program workloads written in lmdsl, with their sizes and sanity checks.

Each `Workload` gives the program, the keyword arguments of each program instance (fixed seed),
and a sanity check of one finished state (a choice was picked, the JSON parses and matches the
schema, every branch produced text...). The shapes (few-shot counts and lengths, turns, branches,
levels, output caps) follow SGLang's benchmark scripts (`benchmark/<name>/bench_sglang.py` of
sgl-project/sglang); `REFERENCE` holds the sizes that reproduce them where the CPU defaults are
smaller. Shared text that depends on the sizes is bound into the program (`Function.bind`) by
`make`, so that `function.cache()` (the frontend's prefix hint) still finds it.
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
    """Workload sizes; each field is also a command-line flag (`--mmlu-programs 64`).

    Lengths are in tokens of the SmolLM2 tokenizer (one word of `data.WORDS` is one token).
    `max_tokens` / `long_tokens` are the free-form generation caps of the workloads whose
    reference does not fix them; fixed outputs (MMLU's answer letter, chat answers, the agents'
    templates, the judge's score, the JSON fields) have their own fields or constants.
    """

    mmlu_programs: int = 6
    mmlu_subjects: int = 2
    mmlu_shots: int = 5
    mmlu_question_tokens: int = 55
    mmlu_option_tokens: int = 12
    mmlu_answer_tokens: int = 1
    hellaswag_programs: int = 3
    hellaswag_shots: int = 20
    hellaswag_ctx_tokens: int = 20
    hellaswag_ending_tokens: int = 10
    react_programs: int = 2
    react_steps: int = 4
    react_demos: int = 2
    react_demo_steps: int = 3
    react_observation_tokens: int = 30
    agents: int = 2
    agent_calls_per_agent: int = 5
    agent_iss_tokens: int = 150
    tot_programs: int = 1
    tot_width: int = 2
    tot_depth: int = 4
    tot_question_tokens: int = 55
    sot_programs: int = 2
    sot_points: int = 5
    judge_programs: int = 2
    judge_article_tokens: int = 250
    json_programs: int = 4
    json_doc_tokens: int = 300
    chat_programs: int = 3
    chat_long_programs: int = 2
    chat_turns: int = 4
    chat_user_min_tokens: int = 64
    chat_user_max_tokens: int = 128
    chat_answer_min_tokens: int = 4
    chat_answer_max_tokens: int = 8
    chat_long_min_tokens: int = 16
    chat_long_max_tokens: int = 32
    rag_programs: int = 3
    rag_full_demos: int = 2
    rag_qa_demos: int = 4
    rag_passages: int = 3
    rag_passage_tokens: int = 40
    independent_programs: int = 6
    max_tokens: int = 8
    long_tokens: int = 24


# NOTE: the sizes where the reference shape differs from the CPU default (see README.md for the
# sources). Free-form caps (max_tokens 256 for tree-of-thought and the judge, 200 for ReAct, 24/128
# for skeleton-of-thought) are left to --max-tokens / --long-tokens, which set them for all.
REFERENCE: dict[str, int] = {
    "hellaswag_ctx_tokens": 45, "hellaswag_ending_tokens": 20,
    "react_demos": 6, "react_observation_tokens": 85,
    "judge_article_tokens": 650, "json_doc_tokens": 3000,
    "chat_user_min_tokens": 256, "chat_user_max_tokens": 512,
    "chat_long_min_tokens": 256, "chat_long_max_tokens": 512,
    "rag_full_demos": 4, "rag_qa_demos": 12, "rag_passage_tokens": 100,
}
REFERENCE_CONTEXT_LENGTH = 8192  # NOTE: the reference chat_long reaches ~4,200 tokens, JSON ~3,100


def reference_flags() -> str:
    return " ".join(f"--{k.replace('_', '-')} {v}" for k, v in REFERENCE.items())


class Bindable:
    """A program whose shared text depends on the sizes: `make` binds that text (`Function.bind`),
    and `run` / `cache` go to the bound function, so the prefix hint sees the text as constant.

    Mutates: self.bound (on `bind`; the suite runs one workload at a time).
    """

    def __init__(self, function: Any) -> None:
        self.function = function
        self.bound = function

    def bind(self, **kwargs: Any) -> None:
        self.bound = self.function.bind(**kwargs)

    def run(self, **kwargs: Any) -> Any:
        return self.bound.run(**kwargs)

    def cache(self, backend: Any = None) -> str:
        return str(self.bound.cache(backend))


# ---------------------------------------------------------------- programs
@sgl.function
def mmlu(s, shots, question, ntok):
    s += shots + question
    s += sgl.gen("answer", max_tokens=ntok)


@sgl.function
def _hellaswag(s, shots, context, endings):
    s += shots + context
    s += sgl.select("ending", choices=endings)


hellaswag = Bindable(_hellaswag)
REACT_TOOLS = [" " + t for t in data.TOOLS]


@sgl.function
def _react(s, header, qid, question, steps, obs_tokens, ntok):
    s += header
    s += "Question: " + question + "\n"
    for step in range(1, steps + 1):
        s += f"Thought {step}:" + sgl.gen(f"thought_{step}", max_tokens=ntok, stop="\n") + "\n"
        s += f"Action {step}:" + sgl.select(f"tool_{step}", choices=REACT_TOOLS)
        s += "[" + sgl.gen(f"arg_{step}", max_tokens=8, stop=["]", "\n"]) + "]\n"
        s += f"Observation {step}: " + data.react_observation(qid, step, obs_tokens) + "\n"


react = Bindable(_react)

# NOTE: the agents' template heads, in our words, with the references' lengths and output caps.
AGENT_TRIPLE_HEAD = "Job: rewrite each sentence as a (who, does, what) triple.\n" + "".join(
    f"Input: {n} is {a}.\nOutput: ({n}, {a.split()[0]}, {a.split()[-1]})\n---\n"
    for n, a in zip(data.NAMES[:6], data.ACTIONS[:6], strict=True))
AGENT_SECTOR_HEAD = "Job: pick the place, out of the listed places, where a resident does the next activity.\n" + "".join(
    f"Home of {n}: {{{h}}}, with a kitchen, a hall and a porch.\nWhere {n} is now: {{{c}}}, with a garden "
    f"and an office.\nPlaces: {{{', '.join(data.PLACES)}}}.\n- Prefer the place where {n} already is when "
    "the activity fits there; leave only when it needs somewhere else.\n- Answer with one of the places, "
    f"spelled exactly as listed.\nNext activity of {n}: {a}. Place: {{{t}}}\n---\n"
    for n, h, c, a, t in (("Ivo", "the bakery", "the park", "reading a book", "the library"),
                          ("Lena", "the school", "the market", "baking bread", "the bakery")))
AGENT_OBJECT_HEAD = "".join(
    f"\n{n} stands in the {o} of {h}.\nRooms of {h}: {{kitchen, hall, porch}}\nKeep to the room where "
    f"{n} is when the activity fits there, and do not enter private rooms without a reason.\nThe room of "
    f"{h} for {a}:\nAnswer: {{{o}}}\n---"
    for n, o, h, a in (("Juno", "kitchen", "the cafe", "baking bread"),
                       ("Kai", "porch", "the town hall", "feeding the birds")))


@sgl.function
def agent_call(s, kind, name, iss, event, action, next_action, home, here, there, plan, areas):
    cap = data.AGENT_MAX_TOKENS[kind]
    stop = data.AGENT_STOP[kind]
    if kind == "poignancy":
        s += f"About {name}:\n{iss}"
        s += ("How much would the event below matter to " + name + "? Use a scale from 1 to 10: 1 for an "
              "everyday chore (tidying a desk, boiling an egg) and 10 for a life-changing moment (moving "
              f"abroad, losing a friend).\n\nEvent: {event}\nScore (one number from 1 to 10):")
    elif kind == "triple":
        s += AGENT_TRIPLE_HEAD + f"Input: {name} is {action}.\nOutput: ({name},"
    elif kind == "emoji":
        s += ("Show the activity below as emoji, at most two of them.\n"
              f"Activity: {action}.\nEmoji:")
    elif kind == "sector":
        s += AGENT_SECTOR_HEAD
        s += (f"Home of {name}: {{{home}}}, with {areas}.\nWhere {name} is now: {{{here}}}, with {areas}.\n"
              f"{plan}\nPlaces: {{{', '.join(data.PLACES)}}}.\n- Prefer the place where {name} already is "
              f"when the activity fits there; leave only when it needs somewhere else.\n- Answer with one of "
              f"the places, spelled exactly as listed.\n{name} is {action} now. Next activity of {name}: "
              f"{next_action}. Place: {{")
    else:
        s += AGENT_OBJECT_HEAD
        s += (f"\n{name} is on the way to {there}.\nRooms of {there}: {{{areas}}}\n- Keep to the room where "
              f"{name} is when the activity fits there.\n- Do not enter private rooms without a reason.\n"
              f"{name} is {action} now. The room of {there} for {next_action} (one of {{{areas}}}):\nAnswer: {{")
    s += sgl.gen("reply", max_tokens=cap, stop=stop)


# NOTE: one instruction per level of the tree (plan, execute, reflect, final answer), as in
# tree_of_thought_deep; deeper trees repeat the last one.
TOT_LEVELS = (
    "Before any arithmetic, sketch how you would attack the word problem below: name the approach and "
    "the key quantities, restate the facts in whatever order helps, but leave every number uncomputed "
    "for now. Stay brief, at most eighty words in total. Problem: ",
    "Good sketch. Now carry it out with the actual numbers: work through the problem one step at a time "
    "as the sketch says, and finish with the result. Be brief.",
    "Now review your own work carefully, checking each step for mistakes, and rate how sure you are "
    "that it is right, from 1 to 5.",
    "Having reviewed it, would you change anything? State the final result you now stand by, after "
    "thinking it over.",
)


def _tot_level(s, level, depth, width, question, ntok, leaves):
    prompt = TOT_LEVELS[min(level, len(TOT_LEVELS)) - 1] + (question if level == 1 else "")
    s += sgl.user(prompt)
    forks = s.fork(width)
    for f in forks:
        f += sgl.assistant(sgl.gen("thought", max_tokens=ntok))
    for f in forks:
        if level < depth:
            _tot_level(f, level + 1, depth, width, question, ntok, leaves)
        else:
            leaves.append(f)


@sgl.function
def tree_of_thought(s, question, width, depth, ntok, leaves):
    _tot_level(s, 1, depth, width, question, ntok, leaves)


# NOTE: skeleton-of-thought as SGLang's tip_suggestion benchmark: each tip, once generated, starts
# an independent expansion program with its own few-shot head; the outline then collects them.
SOT_EXPAND_HEAD = "Turn the short tip on the topic into a full paragraph of advice.\n\n" + "".join(
    f"Topic: {topic}\nTip: {tip}\nParagraph: {data.prose(random.Random(f'sot-{topic}'), 72)}\n\n"
    for topic, tip in (("saving money", "Track every expense"), ("learning to swim", "Start in shallow water"),
                       ("growing herbs", "Give them morning sun")))
SOT_HEAD = "You are an assistant that gives people practical advice on whatever topic they bring up.\n"


@sgl.function
def expand_tip(s, topic, tip, ntok):
    s += SOT_EXPAND_HEAD + "Topic: " + topic + "\nTip: " + tip + "\nParagraph:"
    s += sgl.gen("paragraph", max_tokens=ntok, stop="\n\n")


@sgl.function
def skeleton_of_thought(s, topic, num_points, ntok, ntok_long):
    s += SOT_HEAD + "USER: What are good tips for " + topic + "?\n"
    s += f"ASSISTANT: Sure. {num_points} short tips of a few words each:\n"
    backend = s.stream_executor.backend
    expansions = []
    for i in range(1, num_points + 1):
        s += f"{i}." + sgl.gen(f"tip_{i}", max_tokens=ntok, stop=[".", "\n"]) + ".\n"
        expansions.append(expand_tip.run(topic=topic, tip=s[f"tip_{i}"], ntok=ntok_long, backend=backend,
                                         temperature=0))
    for i, e in enumerate(expansions, 1):
        s += f"Tip {i}:" + e["paragraph"] + "\n"
    s.set_var("expansion", [e["paragraph"] for e in expansions])


JUDGE_SYSTEM = ("You review the article below as a neutral and demanding examiner: hold it to the "
                "highest standard and forgive nothing.")
JUDGE_DIMENSIONS = (
    "Substance: are the facts right, on topic and backed by research? Does the writer know the field, "
    "and is it plain what the piece sets out to do?",
    "Layout: is there an opening, a middle and a close? Does each paragraph hand over to the next one "
    "without a jolt, so that the whole reads as one piece?",
    "Reasoning: does the case hold together from start to end? Is every claim supported by evidence, "
    "and is that evidence weighed rather than just listed?",
    "Readability: could a newcomer follow every point on a first reading? Are the words exact, the "
    "sentences short enough, and nothing left open to two meanings?",
    "Mechanics: are spelling, grammar and punctuation correct throughout? Slips of this kind pull the "
    "reader out of the text and can even change what a sentence says.",
    "Sources: is every borrowed idea credited, with a reference the reader could follow up? Are the "
    "citations complete and in one consistent style, as a course or a journal would ask of its writers?",
)


@sgl.function
def llm_judge(s, article, ntok):
    s += JUDGE_SYSTEM + "\n```\n" + article + "\n```\n\n"
    forks = s.fork(len(JUDGE_DIMENSIONS))
    for f, dim in zip(forks, JUDGE_DIMENSIONS, strict=True):
        f += ("USER: Assess the article on this criterion only. " + dim + " Write your assessment as one "
              'paragraph, stay on this criterion, and close the paragraph with the word "END"\nJUDGE:')
        f += sgl.gen("judgement", max_tokens=ntok, stop="END")
    forks.join()
    s += "My assessments, criterion by criterion:\n"
    for f, dim in zip(forks, JUDGE_DIMENSIONS, strict=True):
        s += dim.split(":")[0] + ": " + str(f["judgement"]).strip() + "\n"
    s += "Overall, out of 10, the article earns"
    s += sgl.gen("score", max_tokens=2)


# NOTE: the city record of json_decode_regex: five fields, each a `gen` with its own regex (the
# reference's string / float / int / list-of-strings patterns, with ASCII classes) and cap.
JSON_STR = r'"[A-Za-z ]{1,16}"'
JSON_FIELDS = (
    ("name", JSON_STR + ",", 8), ("country", JSON_STR + ",", 8),
    ("latitude", r"-?[0-9]{1,2}\.[0-9]{1,2},", 8), ("population", r"[0-9]{1,6},", 8),
    ("top 3 landmarks", r"\[(" + JSON_STR + ", ){2}" + JSON_STR + r"\]", 24),
)
CITY_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "country": {"type": "string"}, "latitude": {"type": "number"},
                   "population": {"type": "integer"},
                   "top 3 landmarks": {"type": "array", "items": {"type": "string"}, "minItems": 3, "maxItems": 3}},
    "required": ["name", "country", "latitude", "population", "top 3 landmarks"],
    "additionalProperties": False,
}
JSON_HEADER = "Read the encyclopedia entry below and pull out the facts about its city.\n"


@sgl.function
def json_decode(s, document):
    s += JSON_HEADER + "<entry>\n" + document + "</entry>\n"
    s += "The city's name, country, latitude, population and three best-known landmarks, as JSON:\n"
    with s.var_scope("json_output"):
        s += "{\n"
        for key, regex, cap in JSON_FIELDS:
            s += f'  "{key}": ' + sgl.gen(key, max_tokens=cap, regex=regex) + "\n"
        s += "}\n"


@sgl.function
def multi_turn_chat(s, turns):
    for i, (prompt, ntok) in enumerate(turns):
        s += prompt
        s += sgl.gen(f"reply_{i}", max_tokens=ntok, ignore_eos=True)


RAG_INSTRUCTION = ("Reply to each question with a brief fact.\n\n---\n\nEvery example is laid out as:\n\n"
                   "Context: passages that may hold the facts\n\nQuestion: the question\n\nReasoning: a "
                   "short chain of steps towards the reply\n\n"
                   "Answer: a few words, usually one to five\n\n---\n\n")


@sgl.function
def _rag_pipeline(s, header, question, passages, ntok):
    s += header
    s += "Context:\n" + "\n".join(f"[{i}] «{p}»" for i, p in enumerate(passages, 1)) + "\n\n"
    s += "Question: " + question + "\n\nReasoning: Let's think step by step."
    s += sgl.gen("reasoning", max_tokens=ntok * 2, stop="\n")
    s += "\n\nAnswer:" + sgl.gen("answer", max_tokens=ntok, stop="\n")


rag_pipeline = Bindable(_rag_pipeline)
RAG_CORPUS_SIZE = 60


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
    shots = [data.mmlu_shots(data.subject(i), z.mmlu_shots, z.mmlu_question_tokens, z.mmlu_option_tokens)
             for i in range(max(z.mmlu_subjects, 1))]
    return [{"shots": shots[i % len(shots)],
             "question": data.mmlu_question(rng, z.mmlu_question_tokens, z.mmlu_option_tokens),
             "ntok": z.mmlu_answer_tokens} for i in range(z.mmlu_programs)]


def _hellaswag_args(z: Sizes) -> list[dict[str, Any]]:
    hellaswag.bind(shots=data.hellaswag_shots(z.hellaswag_shots, z.hellaswag_ctx_tokens, z.hellaswag_ending_tokens))
    rng = _rng("hellaswag")
    out = []
    for _ in range(z.hellaswag_programs):
        ctx, endings = data.hellaswag_item(rng, z.hellaswag_ctx_tokens, z.hellaswag_ending_tokens)
        out.append({"context": ctx, "endings": endings})
    return out


def _react_args(z: Sizes) -> list[dict[str, Any]]:
    react.bind(header=data.react_header(z.react_demos, z.react_demo_steps, 30))
    rng = _rng("react")
    return [{"qid": i, "question": data.sentence(rng, 18)[:-1] + "?", "steps": z.react_steps,
             "obs_tokens": z.react_observation_tokens, "ntok": z.max_tokens} for i in range(z.react_programs)]


def _agent_args(z: Sizes) -> list[dict[str, Any]]:
    return [dict(c) for c in data.agent_calls(z.agents, z.agent_calls_per_agent, z.agent_iss_tokens)]


def _tot_args(z: Sizes) -> list[dict[str, Any]]:
    rng = _rng("tot")
    return [{"question": data.prose(rng, z.tot_question_tokens)[:-1] + "?", "width": z.tot_width,
             "depth": z.tot_depth, "ntok": z.max_tokens, "leaves": []} for _ in range(z.tot_programs)]


def _sot_args(z: Sizes) -> list[dict[str, Any]]:
    topics = data.topics()
    return [{"topic": topics[i % len(topics)], "num_points": z.sot_points, "ntok": z.max_tokens,
             "ntok_long": z.long_tokens} for i in range(z.sot_programs)]


def _judge_args(z: Sizes) -> list[dict[str, Any]]:
    rng = _rng("judge")
    return [{"article": "A title about " + rng.choice(data.NOUNS) + "\n\n" + data.prose(rng, z.judge_article_tokens),
             "ntok": z.max_tokens} for _ in range(z.judge_programs)]


def _json_args(z: Sizes) -> list[dict[str, Any]]:
    rng = _rng("json")
    return [{"document": data.city_document(rng, z.json_doc_tokens)[0]} for _ in range(z.json_programs)]


def _chat_args(z: Sizes, long: bool) -> list[dict[str, Any]]:
    rng = _rng("chat-long" if long else "chat-short")
    lo, hi = (z.chat_long_min_tokens, z.chat_long_max_tokens) if long else (z.chat_answer_min_tokens,
                                                                            z.chat_answer_max_tokens)
    out = []
    for i in range(z.chat_long_programs if long else z.chat_programs):
        turns = []
        for _ in range(z.chat_turns):
            n = rng.randint(z.chat_user_min_tokens, max(z.chat_user_min_tokens, z.chat_user_max_tokens))
            # NOTE: a number first, so that no two programs share more than the empty prefix
            turns.append((f"{i}: " + data.prose(rng, n), rng.randint(lo, max(lo, hi))))
        out.append({"turns": turns})
    return out


def _rag_header(z: Sizes, passages: list[str]) -> str:
    rng = _rng("rag-demos")
    demos = []
    for _ in range(z.rag_qa_demos):
        demos.append(f"Question: {data.sentence(rng, 14)[:-1]}?\nAnswer: {rng.choice(data.CITIES)}")
    for _ in range(z.rag_full_demos):
        q = data.sentence(rng, 14)[:-1] + "?"
        ctx = data.retrieve(passages, q, z.rag_passages)
        demos.append("Context:\n" + "\n".join(f"[{i}] «{p}»" for i, p in enumerate(ctx, 1)) + "\n\nQuestion: "
                     + q + "\n\nReasoning: Let's think step by step. " + data.prose(rng, 36)
                     + "\n\nAnswer: " + rng.choice(data.CITIES))
    return RAG_INSTRUCTION + "".join(d + "\n\n---\n\n" for d in demos)


def _rag_args(z: Sizes) -> list[dict[str, Any]]:
    passages = data.corpus(RAG_CORPUS_SIZE, z.rag_passage_tokens)
    rag_pipeline.bind(header=_rag_header(z, passages))
    rng = _rng("rag")
    out = []
    for _ in range(z.rag_programs):
        q = f"What happened in {rng.choice(data.CITIES)} near the {rng.choice(data.NOUNS)}?"
        out.append({"question": q, "passages": data.retrieve(passages, q, z.rag_passages), "ntok": z.max_tokens})
    return out


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
        jsonschema.validate(json.loads(state["json_output"]), CITY_SCHEMA)
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
    return all(str(state[f"reply_{i}"]).strip() for i in range(len(kw["turns"])))


WORKLOADS: list[Workload] = [
    Workload("mmlu_5shot", mmlu, _mmlu_args,
             lambda st, kw: str(st["answer"]).strip()[:1] in ("A", "B", "C", "D"), "answer is a letter A-D"),
    Workload("hellaswag_20shot", hellaswag, _hellaswag_args,
             lambda st, kw: st["ending"] in kw["endings"], "an ending picked"),
    Workload("react_agent", react, _react_args, _check_react, "a tool picked at every step"),
    Workload("generative_agents", agent_call, _agent_args, _nonempty("reply"), "non-empty reply"),
    Workload("tree_of_thought", tree_of_thought, _tot_args, _check_tot, "all leaves non-empty"),
    Workload("skeleton_of_thought", skeleton_of_thought, _sot_args, _check_sot, "all tips expanded"),
    Workload("llm_judge", llm_judge, _judge_args, _nonempty("score"), "a score generated"),
    Workload("json_decode", json_decode, _json_args, _check_json, "valid JSON matching the schema",
             constrained=True),
    Workload("chat_short", multi_turn_chat, lambda z: _chat_args(z, False), _check_chat, "all turns answered"),
    Workload("chat_long", multi_turn_chat, lambda z: _chat_args(z, True), _check_chat, "all turns answered"),
    Workload("rag_pipeline", rag_pipeline, _rag_args, _nonempty("answer", "reasoning"),
             "reasoning and answer non-empty"),
    Workload("no_sharing", independent, _independent_args, _nonempty("out"), "non-empty output"),
]


def size_fields() -> list[tuple[str, int]]:
    return [(f.name, int(f.default)) for f in fields(Sizes)]  # type: ignore[call-overload]
