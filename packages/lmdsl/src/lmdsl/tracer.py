"""Tracing: run a program's Python body once over placeholders and record a frozen `Graph`.

Arguments not given to `trace()` become `ArgRef` placeholders and `s[name]` becomes a `VarRef`;
reading their value in Python (f-strings, `if`, comparisons) raises `TraceError`, because the
graph could not represent it.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from lmdsl.chat_template import ChatTemplate
from lmdsl.errors import TraceError
from lmdsl.interpreter import SetVars
from lmdsl.ir import (
    ArgRef,
    Constant,
    Node,
    RoleBegin,
    RoleEnd,
    VarRef,
    VarScopeBegin,
    VarScopeEnd,
    flatten,
    to_node,
)

if TYPE_CHECKING:
    from lmdsl.function import Function


@dataclass(frozen=True)
class Fork(Node):
    """`s.fork(size)`: `branches[i]` are the nodes of child i (paths `{parent}.{fork_id}[i]`)."""

    fork_id: str
    size: int
    branches: tuple[tuple[Node, ...], ...]

    def describe(self) -> str:
        return f"fork {self.fork_id} x{self.size}"


@dataclass(frozen=True)
class Join(Node):
    fork_id: str
    mode: str

    def describe(self) -> str:
        return f"join {self.fork_id} ({self.mode})"


@dataclass(frozen=True)
class Graph:
    """A traced program: the root state's nodes; forks hold their branches."""

    name: str
    arg_names: tuple[str, ...]
    bound: tuple[tuple[str, Any], ...]
    nodes: tuple[Node, ...]

    def walk(self) -> Iterator[Node]:
        """Every node, depth first (fork branches right after their fork)."""
        def visit(nodes: tuple[Node, ...]) -> Iterator[Node]:
            for node in nodes:
                yield node
                if isinstance(node, Fork):
                    for branch in node.branches:
                        yield from visit(branch)
        return visit(self.nodes)

    def __str__(self) -> str:
        free = [a for a in self.arg_names if a not in dict(self.bound)]
        lines = [f"program {self.name}({', '.join(free)})"]

        def emit(nodes: tuple[Node, ...], indent: str) -> None:
            for node in nodes:
                lines.append(indent + node.describe())
                if isinstance(node, Fork):
                    for i, branch in enumerate(node.branches):
                        lines.append(f"{indent}  [{i}]")
                        emit(branch, indent + "    ")

        emit(self.nodes, "  ")
        return "\n".join(lines)


class _Recorder:
    def __init__(self) -> None:
        self.num_forks = 0


class _ForkRecord(Node):
    """Mutable stand-in for a `Fork` while its branches are still being traced."""

    def __init__(self, fork_id: str, children: list[TracerState]) -> None:
        self.fork_id = fork_id
        self.children = children

    def freeze(self) -> Fork:
        return Fork(self.fork_id, len(self.children), tuple(c.frozen_nodes() for c in self.children))


class TracerState:
    """Stands in for `ProgramState` while tracing; records instead of running."""

    def __init__(self, recorder: _Recorder, path: str) -> None:
        self._recorder = recorder
        self.path = path
        self.nodes: list[Node] = []

    def frozen_nodes(self) -> tuple[Node, ...]:
        return tuple(n.freeze() if isinstance(n, _ForkRecord) else n for n in self.nodes)

    def __iadd__(self, other: Any) -> TracerState:
        self.nodes.extend(flatten(to_node(other)))
        return self

    def _role(self, role: str, expr: Any) -> Any:
        if expr is None:
            return self._role_scope(role)
        self += RoleBegin(role) + to_node(expr) + RoleEnd(role)
        return None

    @contextmanager
    def _role_scope(self, role: str) -> Iterator[None]:
        self.nodes.append(RoleBegin(role))
        yield
        self.nodes.append(RoleEnd(role))

    def system(self, expr: Any = None) -> Any:
        return self._role("system", expr)

    def user(self, expr: Any = None) -> Any:
        return self._role("user", expr)

    def assistant(self, expr: Any = None) -> Any:
        return self._role("assistant", expr)

    @contextmanager
    def var_scope(self, name: str) -> Iterator[None]:
        self.nodes.append(VarScopeBegin(name))
        yield
        self.nodes.append(VarScopeEnd(name))

    def get_var(self, name: str) -> VarRef:
        return VarRef(self.path, name)

    __getitem__ = get_var

    def set_var(self, name: str, value: Any) -> None:
        self.nodes.append(SetVars(((name, value),)))

    __setitem__ = set_var

    def _unreadable(self, what: str) -> TraceError:
        return TraceError(f"{what} cannot be read while tracing: the text and variables exist only at run time")

    def text(self) -> str:
        raise self._unreadable("s.text()")

    def messages(self) -> list[Any]:
        raise self._unreadable("s.messages()")

    def __contains__(self, name: str) -> bool:
        raise self._unreadable("'name in s'")

    def sync(self) -> None:
        return None

    def error(self) -> None:
        return None

    def fork(self, size: int = 1, position_ids_offset: Any = None) -> TracerGroup:
        fork_id = f"fork{self._recorder.num_forks}"
        self._recorder.num_forks += 1
        children = [TracerState(self._recorder, f"{self.path}.{fork_id}[{i}]") for i in range(size)]
        self.nodes.append(_ForkRecord(fork_id, children))
        return TracerGroup(children, self, fork_id)


class TracerGroup:
    def __init__(self, states: list[TracerState], parent: TracerState, fork_id: str) -> None:
        self.states = states
        self.parent = parent
        self.fork_id = fork_id

    def __getitem__(self, i: int) -> TracerState:
        return self.states[i]

    def __setitem__(self, i: int, value: TracerState) -> None:
        if value is not self.states[i]:
            raise TypeError("a fork group's members cannot be replaced; use forks[i] += expr")

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self) -> Iterator[TracerState]:
        return iter(self.states)

    def __iadd__(self, other: Any) -> TracerGroup:
        for i, state in enumerate(self.states):
            if callable(other) and not isinstance(other, Node):
                state += other(i)
            elif isinstance(other, (list, tuple)):
                state += other[i]
            else:
                state += other
        return self

    def join(self, mode: str = "gather_variable") -> None:
        self.parent.nodes.append(Join(self.fork_id, mode))


def _arguments(function: Function, kwargs: dict[str, Any]) -> dict[str, Any]:
    given = {**function.bind_arguments, **kwargs}
    unknown = set(given) - set(function.arg_names)
    if unknown:
        raise TypeError(f"{function.__name__}.trace: unknown arguments {sorted(unknown)}")
    arguments: dict[str, Any] = {}
    for name in function.arg_names:
        param = function.signature.parameters[name]
        if name in given:
            arguments[name] = given[name]
        elif param.default is not inspect.Parameter.empty:
            arguments[name] = param.default
        else:
            arguments[name] = ArgRef(name)
    return arguments


def trace_program(function: Function, kwargs: dict[str, Any]) -> Graph:
    """Runs the program body over a `TracerState`; given kwargs are real values, others placeholders."""
    arguments = _arguments(function, kwargs)
    root = TracerState(_Recorder(), "s")
    try:
        function.func(root, **arguments)
    except TraceError:
        raise
    except Exception as e:
        raise TraceError(f"tracing {function.__name__} failed: {type(e).__name__}: {e}") from e
    bound = tuple((k, v) for k, v in arguments.items() if not isinstance(v, ArgRef))
    return Graph(function.__name__, tuple(function.arg_names), bound, root.frozen_nodes())


def trace_prefix(function: Function) -> tuple[Node, ...]:
    """The root nodes recorded before tracing stops, at the end or at the first statement that cannot
    be traced (an f-string over an argument, a branch on a generated value...): enough to find the
    constant prefix of programs that cannot be traced whole."""
    root = TracerState(_Recorder(), "s")
    # NOTE: any exception only ends the trace early; what was recorded before it is still valid.
    with contextlib.suppress(Exception):
        function.func(root, **_arguments(function, {}))
    return tuple(root.nodes[: _first_fork(root.nodes)])


def _first_fork(nodes: list[Node]) -> int:
    return next((i for i, n in enumerate(nodes) if isinstance(n, _ForkRecord)), len(nodes))


def constant_prefix(graph: Graph | tuple[Node, ...], template: ChatTemplate) -> str:
    """The prompt text every run of `graph` (or of a node sequence) starts with: constants and role
    markers up to the first primitive that depends on arguments or the model."""
    text = ""
    first_role = True
    for node in graph.nodes if isinstance(graph, Graph) else graph:
        if isinstance(node, Constant):
            text += node.text
        elif isinstance(node, RoleBegin):
            if first_role and node.role != "system" and template.default_system_prompt is not None:
                text += template.prefix("system") + template.default_system_prompt + template.suffix("system")
            first_role = False
            text += template.prefix(node.role)
        elif isinstance(node, RoleEnd):
            text += template.suffix(node.role)
        else:
            break
    return text


__all__ = ["ArgRef", "Fork", "Graph", "Join", "TracerState", "VarRef", "constant_prefix", "trace_program"]
