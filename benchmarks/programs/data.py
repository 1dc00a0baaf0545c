"""Synthetic, fixed-seed data for the program workloads (no data set can be downloaded).

The text is made of plain words so that it tokenizes like prose: with the SmolLM2 tokenizer each
word of `WORDS` is one token, so a length in words is a length in tokens (within a few percent;
`test_workloads.py` checks it). What matters is the structure: how long the shared and the
private parts are, how they are shared, and how many calls a program makes. The lengths are
parameters; `workloads.Sizes` holds them, with the reference benchmarks' values in `REFERENCE`.
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
NOUNS = WORDS[40:]
NAMES = ["Ada", "Bram", "Cora", "Dev", "Elin", "Faro", "Gus", "Hana", "Ivo", "Juno", "Kai", "Lena"]
CITIES = ["Paris", "Lima", "Oslo", "Cairo", "Quito", "Perth", "Seoul", "Turin", "Accra", "Hanoi"]
SUBJECTS = ["astronomy", "biology", "economics", "geography", "history", "law", "medicine", "physics"]


def sentence(rng: random.Random, n: int) -> str:
    words = [rng.choice(WORDS) for _ in range(max(n, 1))]
    return " ".join(words).capitalize() + "."


def prose(rng: random.Random, n: int, per_sentence: int = 12) -> str:
    """About n tokens of sentences (the last one shorter)."""
    out = []
    while n > 0:
        k = min(per_sentence, n)
        out.append(sentence(rng, k))
        n -= k + 1  # NOTE: the period is a token of its own
    return " ".join(out)


def subject(i: int) -> str:
    return SUBJECTS[i] if i < len(SUBJECTS) else f"{SUBJECTS[i % len(SUBJECTS)]} {i // len(SUBJECTS)}"


# ---------------------------------------------------------------- MMLU
def mmlu_question(rng: random.Random, question_tokens: int, option_tokens: int) -> str:
    """One question, four options and "Answer:" (the answer letter follows in a shot)."""
    q = prose(rng, question_tokens)[:-1] + "?"
    opts = "\n".join(f"{letter}. {sentence(rng, max(option_tokens - 3, 1))[:-1]}" for letter in "ABCD")
    return f"{q}\n{opts}\nAnswer:"


def mmlu_shots(subject_name: str, k: int, question_tokens: int, option_tokens: int, seed: int = 0) -> str:
    """The subject line and k solved questions: the prefix every question of the subject shares."""
    rng = random.Random(f"mmlu-{subject_name}-{seed}")
    out = f"The following are multiple choice questions (with answers) about {subject_name}.\n\n"
    for _ in range(k):
        out += mmlu_question(rng, question_tokens, option_tokens) + " " + rng.choice("ABCD") + "\n\n"
    return out


# ---------------------------------------------------------------- HellaSwag
ACTIVITIES = ["Baking cookies", "Washing a car", "Playing the piano", "Rock climbing", "Making tea",
              "Ironing clothes", "Painting a fence", "Walking the dog"]


def hellaswag_item(rng: random.Random, ctx_tokens: int, ending_tokens: int) -> tuple[str, list[str]]:
    """An activity label and context, and four endings (each with a leading space)."""
    ctx = rng.choice(ACTIVITIES) + ": " + prose(rng, max(ctx_tokens - 4, 1))
    return ctx, [" " + sentence(rng, max(ending_tokens - 1, 1)) for _ in range(4)]


def hellaswag_shots(k: int, ctx_tokens: int, ending_tokens: int, seed: int = 0) -> str:
    rng = random.Random(f"hellaswag-{seed}")
    out = ""
    for _ in range(k):
        ctx, endings = hellaswag_item(rng, ctx_tokens, ending_tokens)
        out += ctx + endings[0] + "\n\n"
    return out


# ---------------------------------------------------------------- ReAct
TOOLS = {"search": "looks an entity up and gives the opening paragraph of its page",
         "lookup": "finds the next line of the open page that mentions a keyword",
         "finish": "ends the episode with the answer"}


def react_header(demos: int, demo_steps: int, observation_tokens: int, seed: int = 0) -> str:
    """The instruction and `demos` solved questions (thought, action, observation per step)."""
    rng = random.Random(f"react-{seed}")
    head = ("Solve a question answering task with interleaving Thought, Action, Observation steps. "
            "A thought works out what to do next; an action is one of:\n"
            + "\n".join(f"({i}) {k}[x], which {v}." for i, (k, v) in enumerate(TOOLS.items(), 1))
            + "\nSolved examples follow.\n")
    out = [head]
    for _ in range(demos):
        lines = [f"Question: {sentence(rng, 18)[:-1]}?"]
        for step in range(1, demo_steps + 1):
            lines.append(f"Thought {step}: {prose(rng, 24)}")
            tool = "finish" if step == demo_steps else rng.choice(["search", "lookup"])
            lines.append(f"Action {step}: {tool}[{rng.choice(NOUNS)} {rng.choice(NOUNS)}]")
            lines.append(f"Observation {step}: {prose(rng, observation_tokens)}")
        out.append("\n".join(lines) + "\n")
    return "".join(out)


def react_observation(question_id: int, step: int, tokens: int) -> str:
    """The deterministic 'tool' result of one step (a stand-in for the recorded Wikipedia text)."""
    return prose(random.Random(f"obs-{question_id}-{step}"), tokens)


# ---------------------------------------------------------------- generative agents
# NOTE: the five prompt templates of the top five generative-agents functions (about 70% of the
# app's calls): poignancy rating, event triple, emoji, action sector, action object; each with its
# own constant head (few-shot examples) and a fixed output cap.
AGENT_KINDS = ("poignancy", "triple", "emoji", "sector", "object")
AGENT_MAX_TOKENS = {"poignancy": 2, "triple": 20, "emoji": 6, "sector": 10, "object": 5}
AGENT_STOP = {"poignancy": None, "triple": ")", "emoji": None, "sector": "}", "object": "}"}
PLACES = ["the bakery", "the library", "the park", "the town hall", "the cafe", "the school", "the market"]
ACTIONS = ["reading a book", "baking bread", "writing a letter", "painting a wall", "feeding the birds",
           "sweeping the floor", "tuning a piano", "planting tomatoes", "fixing a bicycle"]


def agent_iss(rng: random.Random, name: str, age: int, tokens: int) -> str:
    """A resident's identity description (name, age, traits, lifestyle, plan), about `tokens` long."""
    traits = ", ".join(rng.choice(NOUNS) for _ in range(3))
    head = f"Name: {name}\nAge: {age}\nInnate traits: {traits}\n"
    return head + "Learned traits: " + prose(rng, max(tokens - 20, 1)) + "\n"


def agent_calls(num_agents: int, calls_per_agent: int, iss_tokens: int, seed: int = 0) -> list[dict[str, object]]:
    """Recorded calls of a generative-agents run, interleaved across agents: each names the agent,
    the template (`kind`, in turn through AGENT_KINDS) and that template's fields."""
    rng = random.Random(f"agentcalls-{seed}")
    isses = [agent_iss(rng, NAMES[a % len(NAMES)], 20 + a * 7, iss_tokens) for a in range(num_agents)]
    calls: list[dict[str, object]] = []
    for step in range(calls_per_agent):
        for a in range(num_agents):
            name = NAMES[a % len(NAMES)]
            home, here, there = rng.sample(PLACES, 3)
            calls.append({
                "kind": AGENT_KINDS[(a + step) % len(AGENT_KINDS)], "name": name, "iss": isses[a],
                "event": sentence(rng, 10), "action": rng.choice(ACTIONS), "next_action": rng.choice(ACTIONS),
                "home": home, "here": here, "there": there, "plan": prose(rng, 30),
                "areas": ", ".join(rng.sample(["kitchen", "hall", "garden", "office", "attic", "porch"], 3)),
            })
    return calls


# ---------------------------------------------------------------- the rest
def city_document(rng: random.Random, tokens: int) -> tuple[str, dict[str, object]]:
    """An encyclopedia-style page about a city, about `tokens` long, and the facts it states."""
    rec = {"name": rng.choice(CITIES), "country": rng.choice(["Peru", "Norway", "Egypt", "Ghana", "Japan"]),
           "latitude": round(rng.uniform(-60, 60), 2), "population": rng.randint(10_000, 9_000_000)}
    facts = (f"{rec['name']} is a city in {rec['country']} at latitude {rec['latitude']}. "
             f"It has a population of {rec['population']}. ")
    return facts + prose(rng, max(tokens - 30, 1)) + "\n", rec


def corpus(num_passages: int, passage_tokens: int, seed: int = 0) -> list[str]:
    rng = random.Random(f"corpus-{seed}")
    return [f"{rng.choice(CITIES)} {rng.choice(NOUNS)} | " + prose(rng, max(passage_tokens - 4, 1))
            for _ in range(num_passages)]


def retrieve(passages: list[str], query: str, k: int) -> list[str]:
    """Word-overlap retrieval (a stand-in for ColBERT): top k passages, ties by index."""
    q = set(query.lower().split())
    scored = sorted(range(len(passages)), key=lambda i: (-len(q & set(passages[i].lower().split())), i))
    return [passages[i] for i in scored[:k]]


def topics() -> list[str]:
    return [f"keeping a {n} {m}" for n in ("small", "quiet", "warm", "bright") for m in NOUNS[:16]]
