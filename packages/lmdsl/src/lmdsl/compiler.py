"""Compiled mode: run a traced `Graph` without the program's Python body.

The walk submits the graph's frozen nodes to the same interpreter, resolving placeholders as it
goes: an `ArgRef` becomes the run's argument, a `VarRef` waits for the variable it names.
"""

from __future__ import annotations

import contextvars
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from lmdsl.backend.base import Backend
from lmdsl.interpreter import SetVars
from lmdsl.ir import ArgRef, Constant, Image, Node, VarRef, Video, to_node
from lmdsl.state import ProgramState, ProgramStateGroup
from lmdsl.tracer import Fork, Graph, Join

if TYPE_CHECKING:
    from lmdsl.function import Function


def _resolve_value(value: Any, args: dict[str, Any], states: dict[str, ProgramState]) -> Any:
    if isinstance(value, ArgRef):
        return args[value.name]
    if isinstance(value, VarRef):
        return states[value.state][value.name]
    return value


def _resolve(node: Node, args: dict[str, Any], states: dict[str, ProgramState]) -> Node:
    if isinstance(node, ArgRef):
        return to_node(args[node.name])
    if isinstance(node, VarRef):
        return Constant(str(states[node.state][node.name]))
    if isinstance(node, (Image, Video)) and isinstance(node.path, ArgRef):
        return replace(node, path=str(args[node.path.name]))
    if isinstance(node, SetVars):
        return SetVars(tuple((k, _resolve_value(v, args, states)) for k, v in node.values))
    return node


def execute_graph(graph: Graph, state: ProgramState, args: dict[str, Any]) -> None:
    """Submits `graph` to `state` in order (forks and joins included). Mutates `state` only."""
    states: dict[str, ProgramState] = {"s": state}
    groups: dict[str, ProgramStateGroup] = {}

    def walk(nodes: tuple[Node, ...], current: ProgramState, path: str) -> None:
        for node in nodes:
            if isinstance(node, Fork):
                group = current.fork(node.size)
                groups[node.fork_id] = group
                for i, branch in enumerate(node.branches):
                    child_path = f"{path}.{node.fork_id}[{i}]"
                    states[child_path] = group[i]
                    walk(branch, group[i], child_path)
            elif isinstance(node, Join):
                groups[node.fork_id].join(node.mode)
            else:
                current.stream_executor.submit(_resolve(node, args, states))

    walk(graph.nodes, state, "s")


class CompiledFunction:
    """A traced program, run by walking its graph; `run`/`run_batch` take the free arguments."""

    def __init__(self, graph: Graph, function: Function) -> None:
        self.graph = graph
        self.function = function

    def __str__(self) -> str:
        return str(self.graph)

    def _args(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        args = {**dict(self.graph.bound), **kwargs}
        missing = [a for a in self.graph.arg_names if a not in args]
        unknown = set(kwargs) - set(self.graph.arg_names)
        if missing or unknown:
            raise TypeError(f"compiled {self.graph.name}: missing arguments {missing}, unknown {sorted(unknown)}")
        return args

    def run(self, *, backend: Backend | None = None, stream: bool = False, **kwargs: Any) -> ProgramState:
        """Runs the graph once; kwargs are the free arguments plus run-wide sampling defaults."""
        from lmdsl.function import _resolve_backend, _split_sampling, run_program

        default_params, program_kwargs = _split_sampling(dict(kwargs))
        args = self._args(program_kwargs)
        return run_program(self.function, {}, _resolve_backend(backend), default_params, stream=stream,
                           body=lambda s: execute_graph(self.graph, s, args))

    def run_batch(
        self, batch_kwargs: list[dict[str, Any]], *, backend: Backend | None = None, num_threads: int = 16,
        **sampling: Any,
    ) -> list[ProgramState]:
        """`run` per kwargs dict in parallel threads; states in input order."""
        from lmdsl.function import _resolve_backend

        resolved = _resolve_backend(backend)
        context = contextvars.copy_context()
        with ThreadPoolExecutor(max_workers=max(1, num_threads)) as pool:
            futures = [pool.submit(context.copy().run, lambda kw=kw: self.run(backend=resolved, **kw, **sampling))
                       for kw in batch_kwargs]
            return [f.result() for f in futures]
