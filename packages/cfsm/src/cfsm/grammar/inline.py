"""Inline the rules that no recursion goes through: they become regular parts of their callers.

Fewer rules mean fewer returns at runtime (a token that leaves a rule needs the stack below to be
decided), and a grammar whose start rule inlines to no reference at all is regular: it compiles
through cfsm's regular path (`regular_root`). Rules on a cycle of calls stay rules. A rule whose
inlined tree would pass `CfsmLimits.max_inline_nodes` stays a rule too (no exponential growth).
"""

from __future__ import annotations

from cfsm.config import CfsmLimits
from cfsm.grammar.rules import Grammar, RuleRef, has_refs
from cfsm.regex.syntax import Alt, Cat, Node, Repeat, Scope, Sep, Shared

__all__ = ["inline_rules", "regular_root"]


def _refs(node: Node, out: set[str], seen: set[int]) -> None:
    if id(node) in seen:
        return
    seen.add(id(node))
    if isinstance(node, RuleRef):
        out.add(node.name)
    elif isinstance(node, Cat | Alt):
        for x in node.items:
            _refs(x, out, seen)
    elif isinstance(node, Repeat | Scope | Shared):
        _refs(node.item, out, seen)
    elif isinstance(node, Sep):
        _refs(node.item, out, seen)
        _refs(node.sep, out, seen)
    else:
        for x in getattr(node, "items", ()) or ():
            _refs(x, out, seen)


def _size(node: Node, memo: dict[int, int]) -> int:
    hit = memo.get(id(node))
    if hit is not None:
        return hit
    if isinstance(node, Cat | Alt):
        n = 1 + sum(_size(x, memo) for x in node.items)
    elif isinstance(node, Repeat):
        n = 1 + _size(node.item, memo) * max(1, min(node.lo, 64))
    elif isinstance(node, Scope | Shared):
        n = 1 + _size(node.item, memo)
    elif isinstance(node, Sep):
        n = 1 + _size(node.item, memo) + _size(node.sep, memo)
    else:
        n = 1
    memo[id(node)] = n
    return n


def _recursive(calls: dict[str, set[str]]) -> set[str]:
    """Rules on a cycle of calls (one that can reach itself)."""
    out = set()
    for start in calls:
        seen: set[str] = set()
        work = list(calls[start])
        while work:
            r = work.pop()
            if r == start:
                out.add(start)
                break
            if r not in seen:
                seen.add(r)
                work.extend(calls.get(r, ()))
    return out


def _subst(node: Node, bodies: dict[str, Node], memo: dict[int, Node]) -> Node:
    hit = memo.get(id(node))
    if hit is not None:
        return hit
    out: Node = node
    if isinstance(node, RuleRef):
        out = bodies.get(node.name, node)
    elif isinstance(node, Cat):
        out = Cat([_subst(x, bodies, memo) for x in node.items])
    elif isinstance(node, Alt):
        out = Alt([_subst(x, bodies, memo) for x in node.items])
    elif isinstance(node, Repeat):
        out = Repeat(_subst(node.item, bodies, memo), node.lo, node.hi)
    elif isinstance(node, Sep):
        out = Sep(_subst(node.item, bodies, memo), _subst(node.sep, bodies, memo))
    elif isinstance(node, Scope):
        out = type(node)(_subst(node.item, bodies, memo))
    elif isinstance(node, Shared):
        out = Shared(_subst(node.item, bodies, memo))
    memo[id(node)] = out
    return out


def inline_rules(grammar: Grammar, max_nodes: int = CfsmLimits.max_inline_nodes) -> Grammar:
    """The same language with every non-recursive rule (but the start rule) inlined into its
    callers and dropped, and rules the start rule never reaches dropped; a rule whose inlined
    tree has more than `max_nodes` nodes stays a rule. Pure."""
    calls: dict[str, set[str]] = {}
    for name, body in grammar.rules.items():
        refs: set[str] = set()
        _refs(body, refs, set())
        calls[name] = refs
    recursive = _recursive(calls)
    bodies: dict[str, Node] = {}  # inlined bodies of the non-recursive rules
    sizes: dict[int, int] = {}
    done: set[str] = set()

    def resolve(name: str) -> None:
        # NOTE: non-recursive rules form a DAG below them, so this terminates
        if name in done:
            return
        done.add(name)
        for callee in calls[name]:
            if callee not in recursive:
                resolve(callee)
        body = _subst(grammar.rules[name], bodies, {})
        if name not in recursive and _size(body, sizes) <= max_nodes:
            bodies[name] = body
        else:
            new_rules[name] = body

    new_rules: dict[str, Node] = {}
    for name in grammar.rules:
        resolve(name)
    rules = {name: new_rules.get(name, bodies.get(name)) for name in grammar.rules}
    # the rules still called, from the start rule
    keep: dict[str, Node] = {}
    work = [grammar.root]
    while work:
        name = work.pop()
        if name in keep:
            continue
        found = rules[name]
        assert found is not None
        keep[name] = found
        refs = set()
        _refs(found, refs, set())
        work.extend(r for r in refs if r in new_rules)
    ordered = {name: keep[name] for name in grammar.rules if name in keep}
    return Grammar(rules=ordered, root=grammar.root, positions=grammar.positions)


def regular_root(grammar: Grammar) -> Node | None:
    """The start rule's tree when the (inlined) grammar is regular (no reference left), else None."""
    body = grammar.rules[grammar.root]
    return None if has_refs(body, {}) else body
