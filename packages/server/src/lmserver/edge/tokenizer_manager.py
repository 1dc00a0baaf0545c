"""Front-end side of the engine: tokenization, chat templates, n-expansion, request state and
the ZMQ client of the core process. Runs on the HTTP event loop; never runs model code.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import zmq
import zmq.asyncio

from lmserver.config import ServerConfig
from lmserver.edge.ipc import (
    TERM_TIMEOUT_S,
    AbortReq,
    BatchOut,
    CoreFatal,
    CoreReady,
    CoreStats,
    IpcAddrs,
    RpcReq,
    RpcResp,
    ShutdownReq,
    pack,
    terminate_context,
)
from lmserver.edge.metrics import ServerMetrics
from lmserver.io_struct import (
    GenerateReq,
    InvalidRequestError,
    PixelsNeededError,
    ReqOutput,
    SamplingParams,
    TokenLogprob,
    request_error,
)

if TYPE_CHECKING:
    from lmserver.multimodal.frontend import MediaRef, MultimodalFrontend

logger = logging.getLogger("lmserver")

TOKENIZE_THREADS = 2  # tokenizer threads per HTTP process (long inputs only)
INLINE_TOKENIZE_SIZE = 4096  # characters (or token ids) tokenized on the event loop itself


def is_token_id_list(x: Any) -> bool:
    """A list of ints (bools are not token ids). NOTE: the type set is built in C (4,096 ids: 84 us where the
    per-element check took 357 on the CPU, benchmarks/serving/bench_prompt_checks.py); the per-element check only
    for other types (int subclasses)."""
    if not isinstance(x, list):
        return False
    return set(map(type, x)) <= {int} or all(isinstance(t, int) and not isinstance(t, bool) for t in x)


class EngineDeadError(RuntimeError):
    """The core process is gone or failed; the server answers 503 and shuts down."""


@dataclass
class GenState:
    """Cumulative result of one (n == 1) request, updated in place as outputs arrive."""

    rid: str
    prompt_tokens: int
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    completion_tokens: int = 0
    cached_tokens: int = 0
    jump_forward_tokens: int = 0  # output tokens added by jump-forward (constrained decoding)
    grammar_approximations: list[str] | None = None  # what the JSON Schema grammar over-approximates
    finished: bool = False
    finish_reason: dict[str, Any] | None = None
    input_token_logprobs: list[TokenLogprob] | None = None
    input_top_logprobs: list[list[TokenLogprob] | None] | None = None
    output_token_logprobs: list[TokenLogprob] = field(default_factory=list)
    output_top_logprobs: list[list[TokenLogprob] | None] = field(default_factory=list)
    # streaming cursors (owned by the route that streams this state)
    num_logprobs_sent: int = 0
    num_chars_sent: int = 0
    num_tokens_streamed: int = -1
    created: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def e2e_latency(self) -> float:
        return (self.finish_time or time.monotonic()) - self.created


class TokenizerManager:
    """Holds the request states and the two ZMQ sockets to the core process.

    `start()` must run on the event loop that serves HTTP; it waits for `CoreReady`.
    """

    def __init__(self, config: ServerConfig, addrs: IpcAddrs, metrics: ServerMetrics | None = None) -> None:
        self.config = config
        self.metrics = metrics or ServerMetrics()
        self._ctx = zmq.asyncio.Context()
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.bind(addrs.to_core)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.bind(addrs.from_core)
        self._states: dict[str, asyncio.Queue[ReqOutput | BaseException]] = {}
        self._rpcs: dict[int, asyncio.Future[RpcResp]] = {}
        self._rpc_ids = itertools.count()
        self._recv_task: asyncio.Task[None] | None = None
        self.ready: CoreReady | None = None
        self.tokenizer: Any = None
        self.stats: dict[str, Any] = {}
        self.dead_reason: str | None = None
        self.shutting_down = False
        self.mm: MultimodalFrontend | None = None  # images / videos of a multimodal model (set when ready)
        # NOTE: tokenizing a long text (a 5 MB prompt takes seconds) runs here, never on the event loop, so /health
        # and every other request keep being served; the Rust tokenizer releases the GIL while it works
        self._tokenize_pool = ThreadPoolExecutor(max_workers=TOKENIZE_THREADS, thread_name_prefix="tokenize")

    # -- life cycle -----------------------------------------------------------------------------
    async def wait_ready(self, timeout_s: float | None = None) -> CoreReady:
        """Waits for the core's `CoreReady`; raises EngineDeadError on `CoreFatal`."""
        msg = await asyncio.wait_for(self._pull.recv_pyobj(), timeout_s)
        if isinstance(msg, CoreFatal):
            raise EngineDeadError(f"the engine core failed to start: {msg.message}")
        if not isinstance(msg, CoreReady):
            raise EngineDeadError(f"unexpected first message from the core: {type(msg).__name__}")
        self.ready, self.tokenizer = msg, msg.tokenizer
        from lmserver.multimodal.frontend import MultimodalFrontend

        self.mm = MultimodalFrontend.for_model(msg.model_path, msg.tokenizer, self.config,
                                               str(msg.resolved_config.get("device", "cpu")))
        self._recv_task = asyncio.get_running_loop().create_task(self._recv_loop())
        self._recv_task.add_done_callback(self._recv_done)
        return msg

    def _recv_done(self, task: asyncio.Task[None]) -> None:
        # NOTE: without the receive loop every request would wait forever: fail loudly instead.
        if not task.cancelled() and task.exception() is not None:
            logger.error("the receive loop failed", exc_info=task.exception())
            self.mark_dead(f"the server's receive loop failed: {task.exception()!r}")

    def mark_dead(self, reason: str) -> None:
        """Fails every pending request and RPC with EngineDeadError (idempotent)."""
        if self.dead_reason is None:
            self.dead_reason = reason
            logger.error("engine core is dead: %s", reason)
        err = EngineDeadError(self.dead_reason)
        for q in self._states.values():
            q.put_nowait(err)
        for fut in self._rpcs.values():
            if not fut.done():
                fut.set_exception(err)

    async def shutdown(self) -> None:
        """Asks the core to stop, then closes the sockets (the launcher joins the process)."""
        self.shutting_down = True
        if self.dead_reason is None:
            with contextlib.suppress(asyncio.TimeoutError, zmq.ZMQError):
                await asyncio.wait_for(self._push.send_pyobj(ShutdownReq()), 1.0)
        if self._recv_task is not None:
            self._recv_task.cancel()
        if self.mm is not None:
            await self.mm.aclose()
        self._tokenize_pool.shutdown(wait=False, cancel_futures=True)
        self._push.close(linger=500)
        self._pull.close(linger=0)
        if not await asyncio.get_running_loop().run_in_executor(None, terminate_context, self._ctx):
            logger.warning("the ZMQ context did not terminate within %.0f s; going on without it", TERM_TIMEOUT_S)

    async def _recv_loop(self) -> None:
        while True:
            msg = await self._pull.recv_pyobj()
            if isinstance(msg, BatchOut):
                for out in msg.outputs:
                    q = self._states.get(out.rid)
                    if q is not None:
                        q.put_nowait(out)
            elif isinstance(msg, RpcResp):
                fut = self._rpcs.pop(msg.id, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
            elif isinstance(msg, CoreStats):
                self.stats = msg.stats
                self.metrics.update_core_stats(msg.stats)
            elif isinstance(msg, CoreFatal):
                self.mark_dead(msg.message)

    # -- tokenization ---------------------------------------------------------------------------
    @property
    def context_length(self) -> int:
        assert self.ready is not None
        return self.ready.context_length

    @property
    def vocab_size(self) -> int:
        assert self.ready is not None
        return self.ready.vocab_size

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text))

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens))

    async def off_loop(self, size: int, fn: Callable[..., Any], *args: Any) -> Any:
        """`fn(*args)` (tokenizer work on an input of `size` characters or tokens): inline when it is
        small (a thread hop costs more), else on the tokenizer threads while the event loop goes on."""
        if size <= INLINE_TOKENIZE_SIZE:
            return fn(*args)
        return await asyncio.get_running_loop().run_in_executor(self._tokenize_pool, fn, *args)

    async def encode_async(self, text: str) -> list[int]:
        """`encode` off the event loop for long texts."""
        return await self.off_loop(len(text), self.encode, text)  # type: ignore[no-any-return]

    async def decode_async(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        """`decode` off the event loop for long id lists."""
        return await self.off_loop(len(ids), self.decode, ids, skip_special_tokens)  # type: ignore[no-any-return]

    async def apply_chat_template_async(self, messages: list[dict[str, Any]],
                                        tools: list[dict[str, Any]] | None = None) -> list[int]:
        """`apply_chat_template` off the event loop for long conversations."""
        size = sum(len(str(m.get("content") or "")) for m in messages)
        return await self.off_loop(size, self.apply_chat_template, messages, tools)  # type: ignore[no-any-return]

    def apply_chat_template(self, messages: list[dict[str, Any]],
                            tools: list[dict[str, Any]] | None = None) -> list[int]:
        """Token ids of `messages` rendered with the tokenizer's chat template plus the generation prompt.
        `tools` (OpenAI `{"type": "function", "function": {...}}` objects) go to the template as HF's `tools`.

        A message's content may be a list of parts `{"type": "text", "text": ...}`, `{"type":
        "image"}`, `{"type": "video"}` (a multimodal model): rendered by the template as parts
        when it places one placeholder per image / video (HF LLaVA templates), else with each
        image / video as its placeholder text inside the content string."""
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise InvalidRequestError("this model's tokenizer has no chat template; use /v1/completions")
        media = [p["type"] for m in messages if isinstance(m.get("content"), list) for p in m["content"]
                 if p.get("type") != "text"]
        if not media:
            text = self._render_chat(messages, tools)
        else:
            flat = self._flatten_parts(messages)  # raises for a text-only model
            try:  # the template's own layout of content parts (HF LLaVA templates) when it places them all
                text = self._render_chat(messages, tools)
            except InvalidRequestError:
                text = ""
            if not self._places(text, media):
                text = self._render_chat(flat, tools)
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def _render_chat(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> str:
        try:
            return str(self.tokenizer.apply_chat_template(messages, tools=tools, tokenize=False,
                                                          add_generation_prompt=True))
        except Exception as exc:  # noqa: BLE001 - a template error is a bad conversation
            raise InvalidRequestError(f"the chat template rejected the messages: {exc}") from None

    def _flatten_parts(self, messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if self.mm is None:
            raise InvalidRequestError("this model is text-only: it takes no images or videos")
        mm = self.mm
        return [dict(m, content="".join(p["text"] if p["type"] == "text" else mm.token_text(p["type"])
                                        for p in m["content"])) if isinstance(m.get("content"), list) else m
                for m in messages]

    def _places(self, text: str, media: list[str]) -> bool:
        """Whether the rendered `text` holds one placeholder per image / video of `media`."""
        assert self.mm is not None
        return all(text.count(self.mm.token_text(kind)) == media.count(kind) for kind in set(media))

    async def prepare_media(self, input_ids: list[int], refs: list[MediaRef]) -> tuple[list[int], list[Any]]:
        """`input_ids` with each image / video placeholder expanded, and the MultimodalItems of
        `refs` (loaded and preprocessed); ([ids], []) without refs. Raises InvalidRequestError."""
        if not refs:
            return input_ids, []
        if self.mm is None:
            raise InvalidRequestError("this model is text-only: it takes no images or videos")
        media = await self.mm.prepare(refs)
        return self.mm.expand(input_ids, media)

    def check_input_ids(self, input_ids: list[int], params: SamplingParams, max_new_tokens_given: bool) -> None:
        """Validates a prompt against the vocabulary and the context length.

        Mutates `params.max_new_tokens`: when it was not given it is clipped to what fits.
        """
        if not input_ids:
            raise InvalidRequestError("the prompt is empty")
        vocab = self.vocab_size
        # NOTE: the common case in C (types, min, max); the per-element scan only to name what is wrong
        if not (is_token_id_list(input_ids) and min(input_ids) >= 0 and max(input_ids) < vocab):
            not_ids = [t for t in input_ids if not isinstance(t, int) or isinstance(t, bool)]
            if not_ids:
                raise InvalidRequestError(f"token ids must be integers, got {not_ids[:5]!r}")
            bad = [t for t in input_ids if not 0 <= t < vocab]
            raise InvalidRequestError(f"token id(s) out of the vocabulary (size {vocab}): {bad[:5]}")
        params.validate(vocab)
        for pattern in params.stop_regex:
            try:
                re.compile(pattern)
            except re.error as exc:
                raise InvalidRequestError(f"stop_regex {pattern!r} is not a valid regular expression: {exc}") from None
        n, ctx = len(input_ids), self.context_length
        if n > ctx or (n == ctx and params.max_new_tokens > 0):
            raise InvalidRequestError(
                f"the prompt has {n} tokens, longer than this model's context length ({ctx} tokens)")
        room = ctx - n
        if params.max_new_tokens > room:
            if max_new_tokens_given:
                raise InvalidRequestError(
                    f"this model's context length is {ctx} tokens, but {n + params.max_new_tokens} were "
                    f"requested ({n} in the prompt, {params.max_new_tokens} to generate); "
                    "reduce the prompt or max_new_tokens")
            params.max_new_tokens = room

    # -- generation -----------------------------------------------------------------------------
    def new_rid(self) -> str:
        return uuid.uuid4().hex

    def _check_alive(self) -> None:
        if self.dead_reason is not None:
            raise EngineDeadError(self.dead_reason)
        if self.shutting_down:
            raise EngineDeadError("the server is shutting down")

    async def generate(self, req: GenerateReq, record_metrics: bool = True) -> AsyncIterator[GenState]:
        """Sends one n == 1 request and yields its cumulative `GenState` after each output.

        Raises InvalidRequestError when the core rejects it and EngineDeadError when the core
        dies. If the consumer stops early (client disconnect), the request is aborted in the core.
        """
        self._check_alive()
        if req.rid in self._states:
            raise InvalidRequestError(f"request id {req.rid!r} is already running")
        q: asyncio.Queue[ReqOutput | BaseException] = asyncio.Queue()
        self._states[req.rid] = q
        state = GenState(rid=req.rid, prompt_tokens=len(req.input_ids))
        if self.config.log_requests:
            logger.info("request %s: %d prompt tokens, %s", req.rid, len(req.input_ids), req.sampling_params)
        # an image the engine got before goes by its hash alone (MultimodalFrontend.for_engine)
        wire = req if self.mm is None or not req.mm_items else dataclasses.replace(
            req, mm_items=self.mm.for_engine(req.mm_items))
        try:
            # NOTE: the pixels of images / videos go as frames of their own (no pickle copy, see ipc.pack)
            await self._push.send_multipart(pack(wire), copy=False)
            while not state.finished:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                if item.error is not None and item.error_status == PixelsNeededError.status and wire is not req:
                    # the engine dropped an image sent by its hash (evicted): once more, every pixel with it
                    assert self.mm is not None
                    self.mm.sent_in_full(req.mm_items)
                    wire = req
                    await self._push.send_multipart(pack(req), copy=False)
                    continue
                if item.error is not None:
                    raise request_error(item.error, item.error_status)
                self._apply(state, item, record_metrics)
                yield state
        finally:
            self._states.pop(req.rid, None)
            if not state.finished and self.dead_reason is None:
                with contextlib.suppress(zmq.ZMQError):
                    self._push.send_pyobj(AbortReq(req.rid))
                if record_metrics:  # the client went away (or the route gave up): an aborted request
                    self.metrics.observe_aborted()
            if state.finished and record_metrics:
                self.metrics.observe_finished(state)
                if self.config.log_requests:
                    logger.info("finished %s: %r (%s)", req.rid, state.text[:200], state.finish_reason)

    def _apply(self, state: GenState, out: ReqOutput, record_metrics: bool) -> None:
        now = time.monotonic()
        if out.new_token_ids and state.first_token_time is None:
            state.first_token_time = now
            if record_metrics:
                self.metrics.observe_first_token(now - state.created)
        state.text += out.new_text
        if out.rollback_tokens:  # jump-forward retokenized the tail
            del state.output_ids[len(state.output_ids) - out.rollback_tokens :]
        state.output_ids.extend(out.new_token_ids)
        state.prompt_tokens = out.prompt_tokens or state.prompt_tokens
        state.completion_tokens = out.completion_tokens or len(state.output_ids)
        state.cached_tokens = out.cached_tokens
        state.jump_forward_tokens = out.jump_forward_tokens or state.jump_forward_tokens
        if out.grammar_approximations is not None:
            state.grammar_approximations = list(out.grammar_approximations)
        if out.input_token_logprobs is not None:
            state.input_token_logprobs = list(out.input_token_logprobs)
            state.input_top_logprobs = list(out.input_top_logprobs or [])
        state.output_token_logprobs.extend(out.output_token_logprobs)
        state.output_top_logprobs.extend(out.output_top_logprobs)
        if out.finished:
            state.finished, state.finish_reason, state.finish_time = True, out.finish_reason, now

    async def abort(self, rid: str) -> bool:
        """Aborts `rid` (and its n-expanded `rid-i` copies); their waiters finish with "abort"."""
        rids = [r for r in self._states if r == rid or r.startswith(f"{rid}-")]
        for r in rids:
            await self._push.send_pyobj(AbortReq(r))
            self._states[r].put_nowait(ReqOutput(
                rid=r, new_token_ids=[], new_text="", finished=True,
                finish_reason={"type": "abort", "message": "aborted by /abort_request"}))
        return bool(rids)

    async def rpc(self, method: str, timeout_s: float = 30.0) -> Any:
        """Calls `method` on the core (see ipc.RPC_METHODS); raises RuntimeError with its error."""
        self._check_alive()
        rid = next(self._rpc_ids)
        fut: asyncio.Future[RpcResp] = asyncio.get_running_loop().create_future()
        self._rpcs[rid] = fut
        await self._push.send_pyobj(RpcReq(rid, method))
        try:
            resp = await asyncio.wait_for(fut, timeout_s)
        finally:
            self._rpcs.pop(rid, None)
        if resp.error is not None:
            raise RuntimeError(resp.error)
        if method == "flush_cache" and resp.result and self.mm is not None:
            self.mm.forget_sent()  # the engine's encoder cache is empty now
        return resp.result

    async def health_generate(self, timeout_s: float = 20.0) -> bool:
        """Runs a one-token greedy generation through the core; True when it finishes in time."""
        if self.dead_reason is not None or self.shutting_down or self.ready is None:
            return False
        ids = self.encode("ok") or [0]
        req = GenerateReq(f"HEALTH_CHECK_{self.new_rid()}", ids,
                          SamplingParams(max_new_tokens=1, temperature=0.0))

        async def run() -> bool:
            async for state in self.generate(req, record_metrics=False):
                if state.finished:
                    return True
            return False

        try:
            return await asyncio.wait_for(run(), timeout_s)
        except (asyncio.TimeoutError, EngineDeadError, InvalidRequestError):
            return False

    @property
    def num_pending(self) -> int:
        return len(self._states)
