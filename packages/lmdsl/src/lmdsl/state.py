"""`ProgramState`, what a program function receives as `s`, and `ProgramStateGroup` from `fork`."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from lmdsl.errors import LmdslError
from lmdsl.interpreter import AppendForks, SetVars, StreamExecutor, Usage
from lmdsl.ir import CommitLazy, Node, RoleBegin, RoleEnd, VarScopeBegin, VarScopeEnd, to_node

_JOIN_MODES = ("gather_variable", "concate_and_append")


class ProgramState:
    """The state of one running program: its prompt text, chat messages and variables.

    `s += expr` queues primitives and returns at once; reads (`s[name]`, `text()`, `messages()`)
    wait for what they need. Errors of failed primitives are recorded: `error()` returns the
    first one, and reading a variable that was not produced raises it.
    """

    def __init__(self, executor: StreamExecutor) -> None:
        self.stream_executor = executor

    # ---- writing
    def __iadd__(self, other: Any) -> ProgramState:
        self.stream_executor.submit(other)
        return self

    def _role(self, role: str, expr: Any) -> Any:
        if expr is None:
            return self._role_scope(role)
        self.stream_executor.submit(RoleBegin(role) + to_node(expr) + RoleEnd(role))
        return None

    @contextmanager
    def _role_scope(self, role: str) -> Iterator[None]:
        self.stream_executor.submit(RoleBegin(role))
        yield
        self.stream_executor.submit(RoleEnd(role))

    def system(self, expr: Any = None) -> Any:
        """`s.system("text")` appends a system turn; `with s.system():` scopes one."""
        return self._role("system", expr)

    def user(self, expr: Any = None) -> Any:
        """`s.user("text")` appends a user turn; `with s.user():` scopes one."""
        return self._role("user", expr)

    def assistant(self, expr: Any = None) -> Any:
        """`s.assistant(gen(...))` appends an assistant turn; `with s.assistant():` scopes one."""
        return self._role("assistant", expr)

    @contextmanager
    def var_scope(self, name: str) -> Iterator[None]:
        """The text appended inside the `with` block becomes variable `name`."""
        self.stream_executor.submit(VarScopeBegin(name))
        yield
        self.stream_executor.submit(VarScopeEnd(name))

    def set_var(self, name: str, value: Any) -> None:
        """Sets a variable immediately. Mutates this state's variables."""
        self.stream_executor.set_var(name, value)

    def __setitem__(self, name: str, value: Any) -> None:
        self.set_var(name, value)

    # ---- reading
    def get_var(self, name: str) -> Any:
        """The value of `name`, waiting for the primitive that produces it."""
        return self.stream_executor.get_var(name)

    def __getitem__(self, name: str) -> Any:
        return self.get_var(name)

    def __contains__(self, name: str) -> bool:
        return name in self.stream_executor.variables

    def get_meta_info(self, name: str) -> Any:
        """The backend's meta info of the primitive that produced `name` (waits for it)."""
        self.get_var(name)
        return self.stream_executor.meta_info.get(name)

    def sync(self) -> None:
        """Waits until every queued primitive has run."""
        self.stream_executor.sync()

    def text(self) -> str:
        """The whole prompt text so far (waits for queued primitives)."""
        self.sync()
        return self.stream_executor.text_

    def messages(self) -> list[dict[str, Any]]:
        """The finished chat turns so far, as OpenAI-style messages (waits for queued primitives)."""
        self.sync()
        return list(self.stream_executor.messages_)

    def error(self) -> LmdslError | None:
        """The first recorded error (waits for queued primitives), or None."""
        self.sync()
        return self.stream_executor.error_

    def usage(self) -> Usage:
        """API calls and prompt/completion tokens of the whole program (forks included) so far."""
        return self.stream_executor.usage.snapshot()

    @property
    def ret_value(self) -> Any:
        """The program function's return value (after `run` returns, or the stream ends)."""
        return self.stream_executor.ret_value

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """Text chunks in program order as they are produced (one chunk of the result when not streaming).

        With `var_name`, only that variable's chunks. Raises the recorded error after the last chunk.
        """
        executor = self.stream_executor
        if not executor.stream:
            yield self.text() if var_name is None else str(self.get_var(var_name))
            return
        start = 0
        while True:
            entries, finished = executor.wait_log(start)
            start += len(entries)
            for var, chunk in entries:
                if var_name is None or var == var_name:
                    yield chunk
            if finished and not entries:
                break
        if executor.error_ is not None:
            raise executor.error_

    async def text_async_iter(self, var_name: str | None = None, return_meta_data: bool = False) -> AsyncIterator[Any]:
        """The async form of `text_iter` (waits run in the event loop's default executor)."""
        executor = self.stream_executor
        if not executor.stream:
            text = await asyncio.to_thread(self.text if var_name is None else lambda: str(self.get_var(var_name)))
            yield (text, {}) if return_meta_data else text
            return
        loop = asyncio.get_running_loop()
        start = 0
        while True:
            entries, finished = await loop.run_in_executor(None, executor.wait_log, start)
            start += len(entries)
            for var, chunk in entries:
                if var_name is None or var == var_name:
                    yield (chunk, executor.meta_info.get(var or "", {})) if return_meta_data else chunk
            if finished and not entries:
                break
        if executor.error_ is not None:
            raise executor.error_

    # ---- fork and join
    def fork(self, size: int = 1, position_ids_offset: list[int] | None = None) -> ProgramStateGroup:
        """`size` children that share this state's committed prefix (sent to the backend as a prefix hint)."""
        if size < 1:
            raise ValueError(f"fork(size={size}): size must be >= 1")
        executor = self.stream_executor
        if size > 1:
            executor.submit(CommitLazy())
        executor.sync()
        children = [ProgramState(executor.fork_copy()) for _ in range(size)]
        return ProgramStateGroup(children, self)

    def __repr__(self) -> str:
        return f"ProgramState({self.text()!r})"


class ProgramStateGroup(Sequence[ProgramState]):
    """The children of `fork`; `+=` takes an expression, a list (one per child) or `f(index)`."""

    def __init__(self, states: list[ProgramState], parent: ProgramState) -> None:
        self.states = states
        self.parent = parent

    def __getitem__(self, i: Any) -> Any:
        return self.states[i]

    def __setitem__(self, i: int, value: ProgramState) -> None:
        # NOTE: `forks[i] += expr` reads the child, adds to it in place, then assigns it back.
        if value is not self.states[i]:
            raise TypeError("a fork group's members cannot be replaced; use forks[i] += expr")

    def __len__(self) -> int:
        return len(self.states)

    def __iadd__(self, other: Any) -> ProgramStateGroup:
        if callable(other) and not isinstance(other, Node):
            for i, state in enumerate(self.states):
                state += other(i)
        elif isinstance(other, (list, tuple)):
            if len(other) != len(self.states):
                raise ValueError(f"fork group of {len(self.states)} got a list of {len(other)} expressions")
            for state, expr in zip(self.states, other, strict=True):
                state += expr
        else:
            for state in self.states:
                state += other
        return self

    def join(self, mode: str = "gather_variable") -> None:
        """Waits for the children, then (in the parent's program order) gathers their new variables
        as lists, or appends their new text ("concate_and_append")."""
        if mode not in _JOIN_MODES:
            raise ValueError(f"join(mode={mode!r}): use one of {_JOIN_MODES}")
        executors = [s.stream_executor for s in self.states]
        for e in executors:
            e.sync()
            e.finish()
        parent = self.parent.stream_executor
        failed = next((e.error_ for e in executors if e.error_ is not None), None)
        if failed is not None:
            parent.record_error(failed)
            return
        if mode == "gather_variable":
            base = parent.variables
            names: list[str] = []
            for e in executors:
                for name, value in e.variables.items():
                    if name not in names and (name not in base or base[name] is not value):
                        names.append(name)
            values = tuple((n, [e.variables.get(n) for e in executors]) for n in names)
            parent.submit(SetVars(values))
        else:
            parent.submit(AppendForks(tuple(executors)))


__all__ = ["ProgramState", "ProgramStateGroup"]
