"""Deterministic synthetic request traces for the radixcache benchmark.

A trace is a list of `TraceReq`. A request with `parent=None` arrives at `arrival_step`; any other
request arrives when its parent finishes (the next chat turn, agent step or tree-of-thought
branch). Token ids are drawn from a seeded generator, so every run sees the same trace.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

VOCAB = 32000


@dataclass
class TraceReq:
    rid: int
    prompt: np.ndarray  # (prompt_len,) int64
    output: np.ndarray  # (output_len,) int64
    parent: int | None  # arrives when this request finishes; None: arrives at `arrival_step`
    arrival_step: int = 0


def _tok(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(1, VOCAB, size=n, dtype=np.int64)


def fewshot(seed: int = 0, num_questions: int = 500, prefix_len: int = 1500, question_len: int = 200,
            output_len: int = 32, per_step: int = 8) -> list[TraceReq]:
    """One shared few-shot prefix, then a distinct question per request."""
    rng = np.random.default_rng(seed)
    prefix = _tok(rng, prefix_len)
    return [
        TraceReq(i, np.concatenate([prefix, _tok(rng, question_len)]), _tok(rng, output_len), None, i // per_step)
        for i in range(num_questions)
    ]


def chat(seed: int = 1, num_chats: int = 200, turns: int = 8, system_len: int = 64,
         per_step: int = 4) -> list[TraceReq]:
    """Multi-turn chats: turn t's prompt is the whole history (earlier prompts and replies)."""
    rng = np.random.default_rng(seed)
    system = _tok(rng, system_len)
    out: list[TraceReq] = []
    for c in range(num_chats):
        history = system
        parent = None
        for _ in range(turns):
            prompt = np.concatenate([history, _tok(rng, int(rng.integers(40, 160)))])
            reply = _tok(rng, int(rng.integers(40, 200)))
            rid = len(out)
            out.append(TraceReq(rid, prompt, reply, parent, c // per_step))
            history = np.concatenate([prompt, reply])
            parent = rid
    return out


def tree_of_thought(seed: int = 2, num_problems: int = 25, branching: int = 3, depth: int = 4,
                    problem_len: int = 300, thought_len: int = 60, per_step: int = 1) -> list[TraceReq]:
    """Each request extends one node's text with a new thought; `branching` siblings share a
    prompt, and each finished thought spawns `branching` children, down to `depth`."""
    rng = np.random.default_rng(seed)
    out: list[TraceReq] = []
    for p in range(num_problems):
        frontier: list[tuple[np.ndarray, int | None]] = [(_tok(rng, problem_len), None)]
        for _ in range(depth):
            nxt = []
            for text, parent in frontier:
                for _ in range(branching):
                    thought = _tok(rng, thought_len)
                    rid = len(out)
                    out.append(TraceReq(rid, text, thought, parent, p // per_step))
                    nxt.append((np.concatenate([text, thought]), rid))
            frontier = nxt
    return out


def no_sharing(seed: int = 3, num_prompts: int = 2000, prompt_len: int = 1000, output_len: int = 16,
               per_step: int = 8) -> list[TraceReq]:
    """Random prompts that share nothing: pure overhead, and eviction pressure."""
    rng = np.random.default_rng(seed)
    return [TraceReq(i, _tok(rng, prompt_len), _tok(rng, output_len), None, i // per_step) for i in range(num_prompts)]


def agents(seed: int = 4, num_agents: int = 300, steps: int = 6, system_len: int = 800, task_len: int = 100,
           action_len: int = 40, observation_len: int = 80, per_step: int = 4) -> list[TraceReq]:
    """Agents sharing a system prompt; each step's prompt is the agent's growing history plus a
    new observation, its output the next action."""
    rng = np.random.default_rng(seed)
    system = _tok(rng, system_len)
    out: list[TraceReq] = []
    for a in range(num_agents):
        history = np.concatenate([system, _tok(rng, task_len)])
        parent = None
        for _ in range(steps):
            prompt = np.concatenate([history, _tok(rng, observation_len)])
            action = _tok(rng, action_len)
            rid = len(out)
            out.append(TraceReq(rid, prompt, action, parent, a // per_step))
            history = np.concatenate([prompt, action])
            parent = rid
    return out


TRACES: dict[str, Callable[[], list[TraceReq]]] = {
    "fewshot": fewshot,
    "chat": chat,
    "tree_of_thought": tree_of_thought,
    "no_sharing": no_sharing,
    "agents": agents,
}


def optimal_hit_rate(trace: list[TraceReq]) -> float:
    """Hit rate with an infinite cache where every distinct token (prefix position) is computed
    once: 1 - (prompt tokens whose prefix was never seen) / (prompt tokens). Parents precede
    children in a trace, and a finished request's prompt + output count as seen. Independent of
    radixcache: a set of chained per-token hashes."""
    seen: set[int] = set()
    total = computed = 0
    for req in trace:
        h = 0
        hashes = []
        for tok in np.concatenate([req.prompt, req.output]).tolist():
            h = hash((h, tok))
            hashes.append(h)
        n = len(req.prompt)
        hit = 0
        while hit < n and hashes[hit] in seen:
            hit += 1
        total += n
        computed += n - hit
        seen.update(hashes)
    return 1.0 - computed / total
