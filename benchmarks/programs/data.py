"""Synthetic, fixed-seed data for the program workloads (no data set can be downloaded).

The text is made of plain words so that it tokenizes like prose; what matters is the structure:
how long the shared parts are, how they are shared, and how many calls a program makes.
"""

from __future__ import annotations

import random

_TEXT = (
    "the of and a to in is was for on that with as by at from it his an were are which be this "
    "river mountain cloud stone paper window garden silver orange music planet engine yellow forest "
    "ocean bridge candle market winter summer city train doctor farmer teacher village castle "
    "history energy water light sound metal glass bread salt coffee letter number animal bird "
    "small large old new early late quick slow bright dark warm cold simple strong quiet"
)
WORDS = tuple(_TEXT.split(" "))
NAMES = ["Ada", "Bram", "Cora", "Dev", "Elin", "Faro", "Gus", "Hana", "Ivo", "Juno", "Kai", "Lena"]
CITIES = ["Paris", "Lima", "Oslo", "Cairo", "Quito", "Perth", "Seoul", "Turin", "Accra", "Hanoi"]
SUBJECTS = ["astronomy", "biology", "economics", "geography"]


def sentence(rng: random.Random, n: int) -> str:
    words = [rng.choice(WORDS) for _ in range(n)]
    return " ".join(words).capitalize() + "."


def mmlu_shots(subject: str, k: int = 5, seed: int = 0) -> str:
    """A 5-shot MMLU-style header: instructions and k solved questions with four options."""
    rng = random.Random(f"mmlu-{subject}-{seed}")
    out = [f"The following are multiple choice questions (with answers) about {subject}.\n"]
    for _ in range(k):
        out.append(mmlu_question(rng) + " " + rng.choice("ABCD") + "\n")
    return "\n".join(out) + "\n"


def mmlu_question(rng: random.Random) -> str:
    q = sentence(rng, 10)[:-1] + "?"
    opts = "\n".join(f"{letter}. {sentence(rng, 3)}" for letter in "ABCD")
    return f"{q}\n{opts}\nAnswer:"


def hellaswag_shots(k: int = 20, seed: int = 0) -> str:
    rng = random.Random(f"hellaswag-{seed}")
    return "".join(sentence(rng, 8) + " " + sentence(rng, 5) + "\n\n" for _ in range(k))


def hellaswag_item(rng: random.Random) -> tuple[str, list[str]]:
    return sentence(rng, 8), [" " + sentence(rng, 5) for _ in range(4)]


TOOLS = {"search": "searches the web", "lookup": "finds a term on the page", "finish": "gives the answer"}


def react_header(seed: int = 0) -> str:
    rng = random.Random(f"react-{seed}")
    head = ("Solve a question answering task with interleaving Thought, Action, Observation steps. "
            "Action can be of three types: " + "; ".join(f"{k}[x] {v}" for k, v in TOOLS.items()) + ".\n\n")
    demos = []
    for _ in range(2):
        lines = [f"Question: {sentence(rng, 12)[:-1]}?"]
        for step in range(1, 4):
            lines.append(f"Thought {step}: {sentence(rng, 10)}")
            tool = "finish" if step == 3 else rng.choice(["search", "lookup"])
            lines.append(f"Action {step}: {tool}[{rng.choice(WORDS)} {rng.choice(WORDS)}]")
            lines.append(f"Observation {step}: {sentence(rng, 14)}")
        demos.append("\n".join(lines))
    return head + "\n\n".join(demos) + "\n\n"


def react_observation(question_id: int, step: int) -> str:
    """The deterministic 'tool' result of one step (a stand-in for a search API)."""
    return sentence(random.Random(f"obs-{question_id}-{step}"), 14)


def agent_personas(num_agents: int, seed: int = 0) -> list[str]:
    rng = random.Random(f"agents-{seed}")
    out = []
    for a in range(num_agents):
        name = NAMES[a % len(NAMES)]
        traits = ", ".join(rng.choice(WORDS[40:]) for _ in range(3))
        bio = " ".join(sentence(rng, 10) for _ in range(4))
        out.append(f"Name: {name}\nAge: {20 + a * 7}\nInnate traits: {traits}\n{bio}\n")
    return out


AGENT_QUESTIONS = (
    "What should {n} do next? Answer in one short sentence.",
    "How important is this event to {n}, on a scale from 1 to 10?",
    "What is {n}'s plan for the next hour? Answer briefly.",
    "Summarize what {n} has noticed recently.",
)


def agent_calls(num_agents: int, calls_per_agent: int, seed: int = 0) -> list[dict[str, object]]:
    """Recorded calls of a generative-agents run: each names an agent, the memories retrieved for
    it (a growing stream), and one of the app's prompt templates. Interleaved across agents."""
    rng = random.Random(f"agentcalls-{seed}")
    memories: list[list[str]] = [[] for _ in range(num_agents)]
    calls = []
    for step in range(calls_per_agent):
        for a in range(num_agents):
            memories[a].append(f"[{8 + step}:00] " + sentence(rng, 10))
            calls.append({"agent": a, "memories": "\n".join(memories[a][-6:]),
                          "question": AGENT_QUESTIONS[(a + step) % len(AGENT_QUESTIONS)]})
    return calls


def essay(rng: random.Random, sentences: int = 4) -> str:
    return " ".join(sentence(rng, 10) for _ in range(sentences))


def city_record(rng: random.Random) -> tuple[str, dict[str, object]]:
    """A short text about a person and the record a perfect extractor would return."""
    rec = {"name": rng.choice(NAMES), "age": rng.randint(18, 90), "city": rng.choice(CITIES)}
    text = (f"{sentence(rng, 8)} {rec['name']} is {rec['age']} years old and lives in {rec['city']}. "
            f"{sentence(rng, 10)}")
    return text, rec


def corpus(num_passages: int, seed: int = 0) -> list[str]:
    rng = random.Random(f"corpus-{seed}")
    return [f"{rng.choice(CITIES)} {rng.choice(WORDS[40:])}: " + sentence(rng, 16) for _ in range(num_passages)]


def retrieve(passages: list[str], query: str, k: int = 2) -> list[str]:
    """Word-overlap retrieval (a stand-in for ColBERT): top k passages, ties by index."""
    q = set(query.lower().split())
    scored = sorted(range(len(passages)), key=lambda i: (-len(q & set(passages[i].lower().split())), i))
    return [passages[i] for i in scored[:k]]
