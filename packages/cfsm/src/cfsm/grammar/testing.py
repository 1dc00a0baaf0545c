"""Test helpers for context-free grammars (imported by tests only): a membership oracle independent of cfsm's pushdown
matcher (memoized recursive descent over the rule trees, on code points: every end position of
every node, exact for grammars without left recursion), a random derivation drawer, and a byte
vocabulary in which every string can be spelled."""

from __future__ import annotations

import functools
import random
from collections.abc import Callable

from cfsm.grammar import Grammar, RuleRef
from cfsm.masks.vocab import Vocabulary
from cfsm.regex.syntax import Alt, Cat, Chars, Node, Repeat, Scope, Sep, Shared

__all__ = ["JSON_GBNF", "LARK_JSON", "accepts", "byte_vocab", "draw_member", "greedy_tokens"]


# A JSON grammar in GBNF with bounded runs (numbers, whitespace), so that its pushdown network stays small (tests share it).
JSON_GBNF = r'''
root   ::= value
value  ::= object | array | string | number | ("true" | "false" | "null")
object ::= "{" ws ( string ws ":" ws value ws ( "," ws string ws ":" ws value ws )* )? "}"
array  ::= "[" ws ( value ws ( "," ws value ws )* )? "]"
string ::= "\"" ( [^"\\\x7F\x00-\x1F] | "\\" ( ["\\/bfnrt] | "u" [0-9a-fA-F]{4} ) )* "\""
number ::= "-"? ( [0-9] | [1-9] [0-9]{0,3} ) ( "." [0-9]+ )? ( [eE] [-+]? [0-9]{1,2} )?
ws     ::= [ \t\n]{0,3}
'''

# The JSON grammar of Lark's tutorial, in the Lark subset `compile_lark` takes (tests and benchmarks share it).
LARK_JSON = r"""
start: value
?value: object
      | array
      | ESCAPED_STRING
      | SIGNED_NUMBER      -> number
      | "true" | "false" | "null"
array  : "[" [value ("," value)*] "]"
object : "{" [pair ("," pair)*] "}"
pair   : ESCAPED_STRING ":" value
%import common.ESCAPED_STRING
%import common.SIGNED_NUMBER
%import common.WS
%ignore WS
"""


def accepts(grammar: Grammar, text: str) -> bool:
    """Whether `text` is in the language of `grammar` (no left recursion)."""
    rules = grammar.rules
    n = len(text)

    @functools.cache
    def ends(node_id: int, i: int) -> frozenset[int]:
        return frozenset(_ends(nodes[node_id], i))

    nodes: dict[int, Node] = {}

    def run(node: Node, i: int) -> frozenset[int]:
        nodes[id(node)] = node
        return ends(id(node), i)

    def _ends(node: Node, i: int) -> set[int]:
        if isinstance(node, Chars):
            if i < n:
                cp = ord(text[i])
                if any(lo <= cp <= hi for lo, hi in node.ranges):
                    return {i + 1}
            return set()
        if isinstance(node, RuleRef):
            return set(run(rules[node.name], i))
        if isinstance(node, Cat):
            cur = {i}
            for item in node.items:
                cur = {e for s in cur for e in run(item, s)}
                if not cur:
                    break
            return cur
        if isinstance(node, Alt):
            return {e for item in node.items for e in run(item, i)}
        if isinstance(node, Repeat):
            out: set[int] = set()
            cur = {i}
            count = 0
            seen: set[int] = set()
            while cur:
                if count >= node.lo:
                    out |= cur
                if node.hi is not None and count >= node.hi:
                    break
                nxt = {e for s in cur for e in run(node.item, s)}
                if count >= node.lo:
                    nxt -= seen  # NOTE: past the minimum, positions seen before add nothing new
                    seen |= cur
                cur = nxt
                count += 1
            return out
        if isinstance(node, Sep):
            return _ends(Cat([node.item, Repeat(Cat([node.sep, node.item]), 0, None)]), i)
        if isinstance(node, Scope | Shared):
            return set(run(node.item, i))
        raise TypeError(f"the oracle does not know {type(node).__name__}")

    return n in run(rules[grammar.root], 0)


def _heights(grammar: Grammar) -> dict[str, float]:
    """Per rule, the least rule-call nesting of a derivation (fixpoint)."""
    inf = float("inf")
    h = dict.fromkeys(grammar.rules, inf)

    def height(node: Node) -> float:
        if isinstance(node, RuleRef):
            return 1 + h[node.name]
        if isinstance(node, Cat):
            return max((height(x) for x in node.items), default=0)
        if isinstance(node, Alt):
            return min((height(x) for x in node.items), default=inf)
        if isinstance(node, Repeat):
            return 0 if node.lo == 0 else height(node.item)
        if isinstance(node, Sep):
            return height(node.item)
        if isinstance(node, Scope | Shared):
            return height(node.item)
        return 0

    changed = True
    while changed:
        changed = False
        for name, body in grammar.rules.items():
            v = height(body)
            if v < h[name]:
                h[name] = v
                changed = True
    grammar_heights = dict(h)
    grammar_heights["__height__"] = 0
    return grammar_heights


def draw_member(grammar: Grammar, rng: random.Random, max_depth: int = 6, max_repeat: int = 3,
                pick_char: Callable[[random.Random, Chars], str] | None = None) -> str:
    """A random string of the language: random choices until `max_depth` rule calls deep, then the
    shallowest ones."""
    heights = _heights(grammar)

    def node_height(node: Node) -> float:
        if isinstance(node, RuleRef):
            return 1 + heights[node.name]
        if isinstance(node, Cat):
            return max((node_height(x) for x in node.items), default=0)
        if isinstance(node, Alt):
            return min((node_height(x) for x in node.items), default=float("inf"))
        if isinstance(node, Repeat):
            return 0 if node.lo == 0 else node_height(node.item)
        if isinstance(node, Sep | Scope | Shared):
            return node_height(node.item)
        return 0

    def char(node: Chars) -> str:
        if pick_char is not None:
            return pick_char(rng, node)
        lo, hi = rng.choice(node.ranges)
        hi = min(hi, lo + 300)
        while True:
            cp = rng.randint(lo, hi)
            if not 0xD800 <= cp <= 0xDFFF:
                return chr(cp)

    def gen(node: Node, depth: int) -> str:
        if isinstance(node, Chars):
            return char(node)
        if isinstance(node, RuleRef):
            return gen(grammar.rules[node.name], depth + 1)
        if isinstance(node, Cat):
            return "".join(gen(x, depth) for x in node.items)
        if isinstance(node, Alt):
            if depth >= max_depth:
                best = min(node_height(x) for x in node.items)
                choices = [x for x in node.items if node_height(x) == best]
            else:
                choices = [x for x in node.items if node_height(x) < float("inf")]
            return gen(rng.choice(choices), depth)
        if isinstance(node, Repeat):
            hi = node.lo + max_repeat if node.hi is None else min(node.hi, node.lo + max_repeat)
            count = node.lo if depth >= max_depth else rng.randint(node.lo, hi)
            return "".join(gen(node.item, depth) for _ in range(count))
        if isinstance(node, Sep):
            count = 0 if depth >= max_depth else rng.randint(0, max_repeat)
            return gen(node.item, depth) + "".join(gen(node.sep, depth) + gen(node.item, depth) for _ in range(count))
        if isinstance(node, Scope | Shared):
            return gen(node.item, depth)
        raise TypeError(type(node).__name__)

    return gen(grammar.rules[grammar.root], 0)


def byte_vocab(pieces: list[str]) -> Vocabulary:
    """Every single byte, the UTF-8 of `pieces`, then EOS (the last id)."""
    tokens = [bytes([b]) for b in range(256)]
    tokens += sorted({p.encode() for p in pieces if len(p.encode()) > 1})
    tokens.append(b"")
    return Vocabulary(tokens, [len(tokens) - 1])


def greedy_tokens(vocab: Vocabulary, data: bytes) -> list[int]:
    """Longest-match tokenization of `data` (every byte is a token)."""
    by_bytes = {t: i for i, t in enumerate(vocab.tokens) if t and i not in vocab.special_token_ids}
    longest = max(len(t) for t in by_bytes)
    out = []
    i = 0
    while i < len(data):
        for k in range(min(longest, len(data) - i), 0, -1):
            tid = by_bytes.get(data[i:i + k])
            if tid is not None:
                out.append(tid)
                i += k
                break
    return out
