"""`@function` programs: run, run_batch, bind, trace, cache, compile; the default backend."""

from __future__ import annotations

import contextvars
import inspect
import os
import sys
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from lmdsl.backend.base import Backend, Prompt
from lmdsl.config import DEFAULT_CONFIG, LmdslConfig
from lmdsl.errors import NoBackendError, ProgramError
from lmdsl.interpreter import EndProgram, StreamExecutor, UsageCounter
from lmdsl.ir import DEFAULT_SAMPLING, SamplingParams
from lmdsl.state import ProgramState

if TYPE_CHECKING:
    from lmdsl.compiler import CompiledFunction
    from lmdsl.tracer import Graph

_default_backend: contextvars.ContextVar[Backend | None] = contextvars.ContextVar("lmdsl_backend", default=None)


def set_default_backend(backend: Backend | None) -> None:
    """Sets the backend programs use when `run(backend=None)`, in the current context.

    Threads that `run_batch` and streaming runs start inherit it; a thread you start yourself sees
    it when started through `contextvars.copy_context().run`, or pass `backend=` explicitly.
    """
    _default_backend.set(backend)


def get_default_backend() -> Backend | None:
    return _default_backend.get()


class GlobalConfig:
    """SGLang's `sgl.global_config`, reduced to what programs read: `default_backend` gets and sets
    the current context's default backend (see `set_default_backend`)."""

    @property
    def default_backend(self) -> Backend | None:
        return _default_backend.get()

    @default_backend.setter
    def default_backend(self, backend: Backend | None) -> None:
        _default_backend.set(backend)


global_config = GlobalConfig()


@contextmanager
def use_backend(backend: Backend) -> Iterator[Backend]:
    """Scopes a default backend to a `with` block (restored afterwards)."""
    token = _default_backend.set(backend)
    try:
        yield backend
    finally:
        _default_backend.reset(token)


def _resolve_backend(backend: Backend | None) -> Backend:
    resolved = backend or _default_backend.get()
    if resolved is None:
        raise NoBackendError("no backend: pass run(backend=...) or call lmdsl.set_default_backend(backend) first")
    return resolved


def flush_cache(backend: Backend | None = None) -> Any:
    """Asks the (default) backend's server to empty its prefix cache."""
    return _resolve_backend(backend).flush_cache()


def get_server_info(backend: Backend | None = None) -> Any:
    """The (default) backend's server info."""
    return _resolve_backend(backend).get_server_info()


_SAMPLING_ARGS = ("max_new_tokens", "n", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k",
                  "min_p", "frequency_penalty", "presence_penalty", "ignore_eos", "return_logprob",
                  "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs")


def _split_sampling(kwargs: dict[str, Any]) -> tuple[SamplingParams, dict[str, Any]]:
    sampling = {k: kwargs.pop(k) for k in _SAMPLING_ARGS if k in kwargs}
    return DEFAULT_SAMPLING.merge(SamplingParams.build(**sampling)), kwargs


class Function:
    """An LM program: a Python function whose first argument is the `ProgramState`."""

    def __init__(
        self,
        func: Callable[..., Any],
        num_api_spec_tokens: int | None = None,
        bind_arguments: dict[str, Any] | None = None,
        config: LmdslConfig = DEFAULT_CONFIG,
    ) -> None:
        if num_api_spec_tokens is not None and num_api_spec_tokens < 1:
            raise ValueError("num_api_spec_tokens must be >= 1 (or None to turn speculation off)")
        self.func = func
        self.num_api_spec_tokens = num_api_spec_tokens
        self.bind_arguments = dict(bind_arguments or {})
        self.config = config
        self.signature = inspect.signature(func)
        params = list(self.signature.parameters)
        if not params:
            raise TypeError(f"@function {func.__name__}: the first parameter must be the program state (s)")
        self.arg_names = params[1:]
        self.__name__ = func.__name__
        self.__doc__ = func.__doc__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """With a program state first (inside another program, or while tracing): runs this body inline
        on that state. Otherwise the same as `run(*args, **kwargs)`, as in SGLang."""
        from lmdsl.tracer import TracerState

        if args and isinstance(args[0], (ProgramState, TracerState)):
            return self.func(*args, **{**self.bind_arguments, **kwargs})
        return self.run(*args, **kwargs)

    def bind(self, **kwargs: Any) -> Function:
        """A new Function with some arguments fixed (this one is not mutated)."""
        unknown = set(kwargs) - set(self.arg_names)
        if unknown:
            raise TypeError(f"{self.__name__}.bind: unknown arguments {sorted(unknown)}; parameters: {self.arg_names}")
        return Function(self.func, self.num_api_spec_tokens, {**self.bind_arguments, **kwargs}, self.config)

    def _arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        try:
            bound = self.signature.bind(None, *args, **{**self.bind_arguments, **kwargs})
        except TypeError as e:
            raise TypeError(f"{self.__name__}: {e}") from None
        bound.apply_defaults()
        return dict(list(bound.arguments.items())[1:])

    def run(self, *args: Any, stream: bool = False, backend: Backend | None = None, **kwargs: Any) -> ProgramState:
        """Runs the program; returns its state.

        kwargs are the program's arguments plus run-wide sampling defaults (max_new_tokens, stop,
        temperature, top_p, top_k, min_p, ...). With `stream=True` the program body runs in a
        thread and the state returns at once (read it with `text_iter`). Backend failures are
        recorded in the state (see `ProgramState.error`); exceptions of the program body itself
        propagate (when streaming, they are recorded).
        """
        default_params, program_kwargs = _split_sampling(dict(kwargs))
        arguments = self._arguments(args, program_kwargs)
        return run_program(self, arguments, _resolve_backend(backend), default_params, stream=stream)

    def run_batch(
        self,
        batch_kwargs: list[dict[str, Any]],
        *,
        backend: Backend | None = None,
        num_threads: int | str = "auto",
        progress_bar: bool = False,
        generator_style: bool = False,
        **sampling: Any,
    ) -> Any:
        """Runs the program once per kwargs dict, in parallel threads; returns the states in order.

        The constant prefix of the program is sent once as a prefix hint first (batch of 2 or more;
        not with `LmdslConfig.prefix_hints="never"`).
        `generator_style=True` returns an iterator of states in order instead of a list.
        """
        resolved = _resolve_backend(backend)
        default_params, rest = _split_sampling(dict(sampling))
        if rest:
            raise TypeError(f"run_batch: unknown arguments {sorted(rest)} (program arguments go in batch_kwargs)")
        all_arguments = [self._arguments((), dict(kw)) for kw in batch_kwargs]
        if num_threads == "auto":
            threads = max(1, min(len(all_arguments), self.config.batch_num_threads, 4 * (os.cpu_count() or 1) + 16))
        elif isinstance(num_threads, int) and num_threads >= 1:
            threads = num_threads
        else:
            raise ValueError(f"run_batch(num_threads={num_threads!r}): use 'auto' or an int >= 1")
        if len(all_arguments) > 1 and self.config.batch_prefix_hint:
            self.cache(resolved)
        context = contextvars.copy_context()
        # NOTE: one executor pool for the whole batch (its jobs only wait on backend I/O, never on
        # each other, so a bounded pool cannot deadlock); a pool per program would keep a thread per
        # returned state alive.
        node_pool = ThreadPoolExecutor(max_workers=max(threads, self.config.max_workers), thread_name_prefix="lmdsl")

        def one(arguments: dict[str, Any]) -> ProgramState:
            return context.copy().run(run_program, self, arguments, resolved, default_params, pool=node_pool)

        pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="lmdsl-batch")
        futures = [pool.submit(one, a) for a in all_arguments]
        pool.shutdown(wait=False)

        def ordered() -> Iterator[ProgramState]:
            for i, f in enumerate(futures):
                state = f.result()
                if progress_bar:
                    print(f"\r{self.__name__}: {i + 1}/{len(futures)}", end="", file=sys.stderr, flush=True)
                yield state
            if progress_bar:
                print(file=sys.stderr)

        return ordered() if generator_style else list(ordered())

    def trace(self, **kwargs: Any) -> Graph:
        """The program's graph IR; arguments not given become placeholders. Runs nothing."""
        from lmdsl.tracer import trace_program

        return trace_program(self, kwargs)

    def cache(self, backend: Backend | None = None) -> str:
        """Sends the program's constant prefix (found by tracing up to the first argument or model
        output) as a prefix hint; returns it ("" when the program starts with a dynamic part)."""
        from lmdsl.tracer import constant_prefix, trace_prefix

        resolved = _resolve_backend(backend)
        prefix = constant_prefix(trace_prefix(self), resolved.get_chat_template())
        if prefix:
            resolved.cache_prefix(prefix)
        return prefix

    def compile(self, **kwargs: Any) -> CompiledFunction:
        """Traces once and returns a program that runs the frozen graph (no Python body at run time)."""
        from lmdsl.compiler import CompiledFunction

        return CompiledFunction(self.trace(**kwargs), self)


def function(
    func: Callable[..., Any] | None = None, *, num_api_spec_tokens: int | None = None
) -> Any:
    """Decorator: `@function` or `@function(num_api_spec_tokens=64)`."""
    if func is None:
        return lambda f: Function(f, num_api_spec_tokens=num_api_spec_tokens)
    return Function(func, num_api_spec_tokens=num_api_spec_tokens)


def new_state(
    function: Function, backend: Backend, default_params: SamplingParams, *, stream: bool = False,
    pool: ThreadPoolExecutor | None = None,
) -> ProgramState:
    """A fresh root state with its own usage counter, on `pool` (default: a new executor pool)."""
    if pool is None:
        pool = ThreadPoolExecutor(max_workers=function.config.max_workers, thread_name_prefix="lmdsl")
    executor = StreamExecutor(
        backend, default_params, pool, UsageCounter(), function.config, stream=stream,
        num_api_spec_tokens=function.num_api_spec_tokens,
    )
    return ProgramState(executor)


def run_program(
    function: Function,
    arguments: dict[str, Any],
    backend: Backend,
    default_params: SamplingParams,
    *,
    stream: bool = False,
    body: Callable[[ProgramState], Any] | None = None,
    pool: ThreadPoolExecutor | None = None,
) -> ProgramState:
    """Runs `body(state)` (default: the function with `arguments`) on a new state."""
    state = new_state(function, backend, default_params, stream=stream, pool=pool)
    executor = state.stream_executor
    backend.begin_program(Prompt(""))

    def execute() -> None:
        try:
            executor.ret_value = body(state) if body is not None else function.func(state, **arguments)
        except Exception as e:
            if not stream:
                raise
            # NOTE: recorded before EndProgram, so a reader never sees the end without the error.
            error = ProgramError(f"program {function.__name__} raised {type(e).__name__}: {e}")
            error.__cause__ = e
            executor.record_error(error)
        finally:
            executor.submit(EndProgram())

    if not stream:
        execute()
        state.sync()
        return state

    thread = threading.Thread(target=contextvars.copy_context().run, args=(execute,), daemon=True)
    thread.start()
    return state
