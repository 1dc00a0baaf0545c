"""The interpreter: one `StreamExecutor` per program state walks its IR nodes in order.

Nodes are queued by the Python program (which continues at once) and executed by a shared
thread pool, one drain job at a time per state, so a state's primitives keep their order while
different states (forks, batch items) run in parallel. `get_var` blocks until the variable's
pending primitives are done.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter, deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace
from typing import Any

from lmdsl.backend.base import Backend, Prompt
from lmdsl.chat_template import ChatTemplate
from lmdsl.config import LmdslConfig
from lmdsl.errors import ChatTemplateError, LmdslError, ProgramError, SpeculationError
from lmdsl.ir import (
    CommitLazy,
    Constant,
    Gen,
    Image,
    Node,
    RoleBegin,
    RoleEnd,
    SamplingParams,
    Select,
    VarScopeBegin,
    VarScopeEnd,
    Video,
    flatten,
    to_node,
)
from lmdsl.spec import SpecTerm, consume_constant, find_first_stop, match_template

logger = logging.getLogger("lmdsl")


@dataclass(frozen=True)
class Usage:
    """API calls and tokens a program used (all its states, forks included)."""

    num_api_calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0


class UsageCounter:
    """Thread-safe running totals; `add` mutates, `snapshot` does not."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._usage = Usage()

    def add(self, meta: dict[str, Any]) -> None:
        with self._lock:
            u = self._usage
            self._usage = Usage(
                u.num_api_calls + int(meta.get("num_api_calls", 1)),
                u.prompt_tokens + int(meta.get("prompt_tokens") or 0),
                u.completion_tokens + int(meta.get("completion_tokens") or 0),
            )

    def snapshot(self) -> Usage:
        with self._lock:
            return self._usage


@dataclass(frozen=True)
class SetVars(Node):
    """Internal: sets variables in program order (used by `join`)."""

    values: tuple[tuple[str, Any], ...]


@dataclass(frozen=True)
class AppendForks(Node):
    """Internal: `join("concate_and_append")` appends the children's new text."""

    children: tuple[Any, ...]


@dataclass(frozen=True)
class EndProgram(Node):
    """Internal: the program function returned."""


def defined_names(node: Node) -> tuple[str, ...]:
    """The variables `node` sets when it runs."""
    if isinstance(node, (Gen, Select, VarScopeEnd)):
        return (node.name,) if node.name is not None else ()
    if isinstance(node, SetVars):
        return tuple(name for name, _ in node.values)
    return ()


class PrefixHints:
    """A program's prefix hints sent without waiting (`LmdslConfig.wait_for_prefix_hints` off), on
    a pool of their own: a node-pool job that waits for them (the program's end) can never wait on
    a job queued behind itself. Shared by a root state and its forks.

    At the program's end a hint still queued is dropped (the program's own requests have carried
    its prefix to the server by then) and a hint in flight is waited for, so no hint outlives its
    program and a busy pool never holds a program back (with 64 tree-of-thought programs at once,
    waiting for every queued hint made each program wait for the whole queue)."""

    WORKERS = 64
    _pool: ThreadPoolExecutor | None = None
    _pool_lock = threading.Lock()

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pending: list[Future[None]] = []

    @classmethod
    def _shared_pool(cls) -> ThreadPoolExecutor:
        with cls._pool_lock:
            if cls._pool is None:
                cls._pool = ThreadPoolExecutor(max_workers=cls.WORKERS, thread_name_prefix="lmdsl-hint")
            return cls._pool

    def send(self, backend: Backend, prompt: Prompt) -> None:
        future = self._shared_pool().submit(_send_hint, backend, prompt)
        with self._lock:
            self._pending = [f for f in self._pending if not f.done()]
            self._pending.append(future)

    def wait(self) -> None:
        """Drops the hints not started yet; returns once the ones in flight are answered (or failed)."""
        with self._lock:
            pending, self._pending = self._pending, []
        wait([f for f in pending if not f.cancel()])


def _send_hint(backend: Backend, prompt: Prompt) -> None:
    """A prefix hint sent without waiting: a failure costs only the hint (it is logged)."""
    try:
        backend.commit_lazy_operations(prompt)
    except Exception as exc:  # noqa: BLE001 - a lost hint changes no result
        logger.warning("prefix hint failed (the fork went on without it): %s", exc)


class StreamExecutor:
    """Executes the nodes of one program state; see the module docstring for the threading model."""

    def __init__(
        self,
        backend: Backend,
        default_params: SamplingParams,
        pool: ThreadPoolExecutor,
        usage: UsageCounter,
        config: LmdslConfig,
        *,
        stream: bool = False,
        num_api_spec_tokens: int | None = None,
        chat_template: ChatTemplate | None = None,
        hints: PrefixHints | None = None,
    ) -> None:
        self.backend = backend
        self.hints = hints if hints is not None else PrefixHints()
        self.default_params = default_params
        self.pool = pool
        self.usage = usage
        self.config = config
        self.stream = stream
        self.num_api_spec_tokens = num_api_spec_tokens
        self.chat_template = chat_template or backend.get_chat_template()
        self.text_ = ""
        self.messages_: list[dict[str, Any]] = []
        self.images_: list[str] = []
        self.videos_: list[tuple[str, int]] = []
        self.variables: dict[str, Any] = {}
        self.meta_info: dict[str, Any] = {}
        self.error_: LmdslError | None = None
        self.cur_role: str | None = None
        self.role_content_pos = 0
        self.role_parts: list[dict[str, Any]] = []
        self.var_scope_pos: dict[str, int] = {}
        self.spec_buffer = ""
        self.chat_spec_terms: list[SpecTerm] = []
        self.fork_start_pos = 0
        self.ret_value: Any = None
        self._queue: deque[Node] = deque()
        self._draining = False
        self._cond = threading.Condition()
        self._pending: Counter[str] = Counter()
        self._deferred: set[str] = set()
        self._log: list[tuple[str | None, str]] = []
        self._done = False

    # ----------------------------------------------------------------- queueing (program thread)
    def submit(self, expr: Any) -> None:
        """Queues the atomic nodes of `expr`; returns at once. Mutates the queue only."""
        nodes = flatten(to_node(expr))
        with self._cond:
            for node in nodes:
                for name in defined_names(node):
                    self._pending[name] += 1
            self._queue.extend(nodes)
            if nodes and not self._draining:
                self._draining = True
                self.pool.submit(self._drain)

    def sync(self) -> None:
        """Blocks until every queued node has run (or been dropped after an error)."""
        with self._cond:
            self._cond.wait_for(lambda: not self._draining)

    def get_var(self, name: str) -> Any:
        """Waits for the pending primitives that set `name`; raises the recorded error if one failed."""
        with self._cond:
            self._cond.wait_for(
                lambda: self._pending[name] <= 0 or self.error_ is not None
                or (not self._draining and name in self._deferred)
            )
            if self._pending[name] <= 0 and name in self.variables:
                return self.variables[name]
            if self.error_ is not None:
                raise self.error_
            if name in self._deferred:
                raise SpeculationError(
                    f"variable {name!r} is generated at the end of the assistant turn under API speculative "
                    "execution; read it after the turn ends"
                )
            raise KeyError(f"no variable {name!r}; variables so far: {sorted(self.variables)}")

    def set_var(self, name: str, value: Any) -> None:
        """Sets a variable now (not in program order). Mutates `variables`."""
        with self._cond:
            self.variables[name] = value
            self._cond.notify_all()

    def record_error(self, error: LmdslError) -> None:
        with self._cond:
            if self.error_ is None:
                self.error_ = error
            self._done = True
            self._cond.notify_all()

    def finish(self) -> None:
        """Marks the stream finished (for `text_iter` of fork children, at join)."""
        with self._cond:
            self._done = True
            self._cond.notify_all()

    def wait_log(self, start: int) -> tuple[list[tuple[str | None, str]], bool]:
        """Stream entries from `start` on, waiting for at least one or the end; (entries, finished)."""
        with self._cond:
            self._cond.wait_for(lambda: len(self._log) > start or self._done or self.error_ is not None)
            return self._log[start:], self._done or self.error_ is not None

    def prompt(self) -> Prompt:
        messages = list(self.messages_)
        if self.cur_role is not None:
            messages.append({"role": self.cur_role, "content": self._role_content()})
        return Prompt(self.text_, tuple(messages), tuple(self.images_), tuple(self.videos_), self.cur_role)

    def fork_copy(self) -> StreamExecutor:
        """A child sharing this state's committed text, variables, backend, pool and usage counter."""
        child = StreamExecutor(
            self.backend, self.default_params, self.pool, self.usage, self.config, stream=self.stream,
            num_api_spec_tokens=self.num_api_spec_tokens, chat_template=self.chat_template, hints=self.hints,
        )
        child.text_ = self.text_
        child.messages_ = list(self.messages_)
        child.images_ = list(self.images_)
        child.videos_ = list(self.videos_)
        child.variables = dict(self.variables)
        child.meta_info = dict(self.meta_info)
        child.cur_role = self.cur_role
        child.role_content_pos = self.role_content_pos
        child.role_parts = list(self.role_parts)
        child.spec_buffer = self.spec_buffer
        child.fork_start_pos = len(self.text_)
        return child

    # ----------------------------------------------------------------- execution (pool threads)
    def _drain(self) -> None:
        while True:
            with self._cond:
                if not self._queue:
                    self._draining = False
                    self._cond.notify_all()
                    return
                node = self._queue.popleft()
                failed = self.error_ is not None
            if not failed:
                try:
                    self._execute(node)
                except Exception as e:  # recorded, re-raised on read: nothing is swallowed
                    error = e if isinstance(e, ProgramError) else ProgramError(
                        f"{node.describe()} failed: {type(e).__name__}: {e}")
                    error.__cause__ = e
                    with self._cond:
                        self.error_ = self.error_ or error
            with self._cond:
                for name in defined_names(node):
                    if name not in self._deferred:
                        self._pending[name] -= 1
                self._cond.notify_all()

    def _execute(self, node: Node) -> None:
        if isinstance(node, Constant):
            self._fill(node.text)
        elif isinstance(node, Gen):
            self._gen(node)
        elif isinstance(node, Select):
            self._select(node)
        elif isinstance(node, RoleBegin):
            self._role_begin(node.role)
        elif isinstance(node, RoleEnd):
            self._role_end(node.role)
        elif isinstance(node, Image):
            self._media(node.path, None)
        elif isinstance(node, Video):
            self._media(node.path, node.num_frames)
        elif isinstance(node, VarScopeBegin):
            self.var_scope_pos[node.name] = len(self.text_)
        elif isinstance(node, VarScopeEnd):
            if node.name not in self.var_scope_pos:
                raise ProgramError(f"var_scope {node.name!r} ended without a begin")
            self._set(node.name, self.text_[self.var_scope_pos.pop(node.name):], {})
        elif isinstance(node, CommitLazy):
            if not self.config.fork_hints_for(self.backend.wants_prefix_hints):
                pass  # NOTE: the children's own requests carry the prefix; the server shares it
            elif self.config.wait_for_prefix_hints:
                self.backend.commit_lazy_operations(self.prompt())
            else:  # NOTE: a hint has no result: the fork goes on while it is sent
                self.hints.send(self.backend, self.prompt())
        elif isinstance(node, SetVars):
            for name, value in node.values:
                self._set(name, value, None)
        elif isinstance(node, AppendForks):
            self.backend.concatenate_and_append(self.prompt(), [c.prompt() for c in node.children])
            self._fill("".join(c.text_[c.fork_start_pos:] for c in node.children))
        elif isinstance(node, EndProgram):
            self.hints.wait()  # NOTE: no hint of a program outlives it
            self.backend.end_program([self.prompt()])
            with self._cond:
                self._done = True
        else:
            raise TypeError(f"the interpreter cannot execute {node!r}")

    def _in_chat_spec(self) -> bool:
        return self.num_api_spec_tokens is not None and self.backend.is_chat_model and self.cur_role == "assistant"

    def _fill(self, text: str, var: str | None = None) -> None:
        if not text:
            return
        if var is None and self._in_chat_spec():
            self.chat_spec_terms.append(SpecTerm(text=text))
            return
        if var is None:
            self.spec_buffer = consume_constant(self.spec_buffer, text)
        with self._cond:
            self.text_ += text
            self._log.append((var, text))
            self._cond.notify_all()

    def _set(self, name: str | None, value: Any, meta: dict[str, Any] | None) -> None:
        if name is None:
            return
        with self._cond:
            self.variables[name] = value
            if meta is not None:
                self.meta_info[name] = meta

    def _role_content(self) -> str | list[dict[str, Any]]:
        tail = self.text_[self.role_content_pos:]
        if not self.role_parts:
            return tail
        parts = list(self.role_parts)
        if tail:
            parts.append({"type": "text", "text": tail})
        return parts

    def _role_begin(self, role: str) -> None:
        if self.cur_role is not None:
            raise ChatTemplateError(f"role {role!r} started inside the open {self.cur_role!r} turn; end it first")
        template = self.chat_template
        if not self.messages_ and role != "system" and template.default_system_prompt is not None:
            self._fill(template.prefix("system") + template.default_system_prompt + template.suffix("system"))
            self.messages_.append({"role": "system", "content": template.default_system_prompt})
        self._fill(template.prefix(role))
        self.cur_role = role
        self.role_content_pos = len(self.text_)
        self.role_parts = []

    def _role_end(self, role: str) -> None:
        if self.cur_role != role:
            raise ChatTemplateError(f"end of role {role!r} but the open turn is {self.cur_role!r}")
        if self.chat_spec_terms:
            self._resolve_chat_spec()
        content = self._role_content()
        self.cur_role = None
        self._fill(self.chat_template.suffix(role))
        self.messages_.append({"role": role, "content": content})
        self.role_parts = []

    def _media(self, path: str, num_frames: int | None) -> None:
        if num_frames is None:
            self.images_.append(path)
        else:
            self.videos_.append((path, num_frames))
        if self.cur_role is not None:
            tail = self.text_[self.role_content_pos:]
            if tail:
                self.role_parts.append({"type": "text", "text": tail})
            kind = "image_url" if num_frames is None else "video_url"
            self.role_parts.append({"type": kind, kind: {"url": path}})
        self._fill(self.chat_template.image_token)
        if self.cur_role is not None:
            self.role_content_pos = len(self.text_)

    # ----------------------------------------------------------------- gen and select
    def _gen(self, node: Gen) -> None:
        params = self.default_params.merge(node.params)
        if self.chat_template.stop_str:
            # NOTE: like SGLang, every gen also stops at the end-of-turn marker of the chat template.
            extra = tuple(s for s in self.chat_template.stop_str if s not in (params.stop or ()))
            params = replace(params, stop=(*(params.stop or ()), *extra))
        if self._in_chat_spec():
            with self._cond:
                if node.name is not None:
                    self._deferred.add(node.name)
            self.chat_spec_terms.append(SpecTerm(name=node.name, params=params))
            return
        speculative = (
            self.num_api_spec_tokens is not None and not self.backend.is_chat_model and not self.stream
            and params.constraint_regex() is None and params.json_schema is None and params.ebnf is None
            and (params.n or 1) == 1
            and bool(params.stop)
        )
        if speculative:
            text, spec_meta = self._spec_gen(params)
            self._fill(text, node.name or "")
            self._set(node.name, text, spec_meta)
            return
        self.spec_buffer = ""
        if self.stream and (params.n or 1) == 1:
            meta: dict[str, Any] = {}
            chunks = []
            for delta, chunk_meta in self.backend.generate_stream(self.prompt(), params):
                meta = chunk_meta
                chunks.append(delta)
                self._fill(delta, node.name or "")
            self.usage.add(meta)
            self._set(node.name, "".join(chunks), meta)
            return
        result = self.backend.generate(self.prompt(), params)
        self.usage.add(result.meta_info)
        first = result.text if isinstance(result.text, str) else result.text[0]
        self._fill(first, node.name or "")
        self._set(node.name, result.text, result.meta_info)

    def _spec_gen(self, params: SamplingParams) -> tuple[str, dict[str, Any]]:
        assert self.num_api_spec_tokens is not None and params.stop
        max_new = params.max_new_tokens or 0
        meta: dict[str, Any] = {"speculative": True}
        fresh: dict[str, Any] | None = None
        pos = -1
        if self.spec_buffer:
            pos = find_first_stop(self.spec_buffer, params.stop)
        if not self.spec_buffer or pos == -1:
            call = replace(params, max_new_tokens=max(max_new, self.num_api_spec_tokens), stop=())
            result = self.backend.generate(self.prompt(), call)
            self.usage.add(result.meta_info)
            assert isinstance(result.text, str)
            self.spec_buffer = result.text
            fresh = result.meta_info
            pos = find_first_stop(self.spec_buffer, params.stop)
        if fresh is not None and not self._within_budget(fresh, pos, max_new):
            # NOTE: the continuation may run past this gen's max_new_tokens: one exact call instead.
            self.spec_buffer = ""
            result = self.backend.generate(self.prompt(), params)
            self.usage.add(result.meta_info)
            assert isinstance(result.text, str)
            return result.text, {**result.meta_info, "speculative": False}
        end = len(self.spec_buffer) if pos == -1 else pos
        text, self.spec_buffer = self.spec_buffer[:end], self.spec_buffer[end:]
        if fresh is not None:
            meta.update(fresh)
        return text, meta

    def _within_budget(self, meta: dict[str, Any], pos: int, max_new: int) -> bool:
        """Whether the text up to the stop (or the whole reply) fits this gen's token budget."""
        used = meta.get("completion_tokens")
        if used is None:
            return pos != -1
        if used <= max_new:
            # NOTE: the whole reply fits; a plain call would have produced the same text up to the stop.
            return True
        if pos == -1 or not self.spec_buffer:
            return False
        # Estimate the tokens up to the stop from the reply's characters per token.
        return pos * used / len(self.spec_buffer) <= max_new

    def _resolve_chat_spec(self) -> None:
        terms, self.chat_spec_terms = self.chat_spec_terms, []
        values: dict[int, str] | None = {}
        if any(t.is_gen for t in terms):
            first = next(t.params for t in terms if t.params is not None)
            assert self.num_api_spec_tokens is not None
            call = replace(first, max_new_tokens=self.num_api_spec_tokens, stop=())
            reply = ""
            # NOTE: a greedy call gives the same reply again, so it gets one try.
            tries = 1 if (call.temperature or 0.0) < 1e-6 else self.config.chat_spec_max_tries
            for _ in range(tries):
                result = self.backend.generate(self.prompt(), call)
                self.usage.add(result.meta_info)
                reply = result.text if isinstance(result.text, str) else result.text[0]
                values = match_template(terms, reply)
                if values is not None:
                    break
            if values is None:
                raise SpeculationError(
                    f"{tries} replies did not follow the assistant turn's template "
                    f"{[t.text if not t.is_gen else '<gen ' + str(t.name) + '>' for t in terms]}; last reply: "
                    f"{reply!r}. Make the prompt show the format, or give each gen its own assistant turn."
                )
        for k, term in enumerate(terms):
            if term.is_gen:
                value = values[k] if values is not None else ""
                with self._cond:
                    self.text_ += value
                    self._log.append((term.name or "", value))
                self._set(term.name, value, {"speculative": True})
                with self._cond:
                    if term.name is not None:
                        self._deferred.discard(term.name)
                        self._pending[term.name] -= 1
                    self._cond.notify_all()
            else:
                assert term.text is not None
                with self._cond:
                    self.text_ += term.text
                    self._log.append((None, term.text))

    def _select(self, node: Select) -> None:
        if self.chat_spec_terms:
            raise SpeculationError(
                "select inside an assistant turn with deferred gens (chat API speculative execution) is not "
                "supported: give the select its own assistant turn")
        method = node.choices_method or self.config.default_select_method
        decision = self.backend.select(self.prompt(), list(node.choices), node.temperature, method)
        self.usage.add({"num_api_calls": 0, **decision.meta_info.get("usage", {})})
        self.spec_buffer = consume_constant(self.spec_buffer, decision.decision)
        with self._cond:
            self.text_ += decision.decision
            self._log.append((node.name or "", decision.decision))
        self._set(node.name, decision.decision, decision.meta_info)
