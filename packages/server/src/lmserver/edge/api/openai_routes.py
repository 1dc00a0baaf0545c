"""OpenAI-compatible routes: /v1/models, /v1/completions, /v1/chat/completions."""

from __future__ import annotations

import dataclasses
import os
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import orjson
from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse

from lmserver.edge.api.chat_tools import ChoiceOutput, ToolPlan, plan_tools, prepare_messages
from lmserver.edge.api.errors import APIError, JSONBody, sse_error
from lmserver.edge.api.native import manager
from lmserver.edge.api.openai_protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    chat_logprobs,
    chat_messages,
    completion_logprobs,
    message_extras,
    sampling_params,
)
from lmserver.edge.api.reasoning import REASONING_PARSERS, ReasoningParser
from lmserver.edge.api.streams import (
    DONE,
    SSE_HEADERS,
    collect_all,
    due,
    merge,
    new_text,
    prime,
    sse,
    until_disconnect,
)
from lmserver.edge.api.tool_parsers import choose_parser
from lmserver.edge.tokenizer_manager import EngineDeadError, GenState, TokenizerManager
from lmserver.io_struct import GenerateReq, InvalidRequestError, SamplingParams, expand_n

router = APIRouter(prefix="/v1")


def served_model_name(mgr: TokenizerManager) -> str:
    """--served-model-name, else the model folder's name (never a path of the host)."""
    assert mgr.ready is not None
    return mgr.config.served_model_name or os.path.basename(mgr.ready.model_path.rstrip("/")) or "default"


def _model_aliases(mgr: TokenizerManager) -> tuple[str | None, ...]:
    assert mgr.ready is not None
    return (None, "", "default", served_model_name(mgr), mgr.ready.model_path,
            os.path.basename(mgr.ready.model_path.rstrip("/")))


def _check_model(mgr: TokenizerManager, model: str | None) -> str:
    """The served name for a request naming `model`: any name is this model (SGLang's behaviour)
    unless --strict-model-name, then only its own names (404 otherwise)."""
    name = served_model_name(mgr)
    if mgr.config.strict_model_name and model not in _model_aliases(mgr):
        raise APIError(404, f"the model {model!r} does not exist; this server serves {name!r}",
                       param="model", code="model_not_found")
    return name


def _finish(state: GenState) -> str | None:
    if not state.finished or state.finish_reason is None:
        return None
    return str(state.finish_reason.get("type"))


def _matched(state: GenState) -> Any:
    return (state.finish_reason or {}).get("matched")


def _notes(state: GenState) -> dict[str, Any]:
    """A choice's `grammar_approximations` (beside `matched_stop`, lmserver's other per-choice
    extra) once finished: what its JSON Schema grammar over-approximates, if anything."""
    if state.finished and state.grammar_approximations:
        return {"grammar_approximations": state.grammar_approximations}
    return {}


def _usage(groups: list[list[GenState]]) -> dict[str, Any]:
    prompt = sum(g[0].prompt_tokens for g in groups)
    completion = sum(s.completion_tokens for g in groups for s in g)
    cached = sum(g[0].cached_tokens for g in groups)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def _make_reqs(mgr: TokenizerManager, prompts: list[list[int]], params: SamplingParams, given: bool,
               rid: str | None, **kw: Any) -> list[GenerateReq]:
    """One engine request per (prompt, sample), in choice-index order (prompt-major)."""
    reqs = []
    base = rid or mgr.new_rid()
    for i, ids in enumerate(prompts):
        p = dataclasses.replace(params, stop=list(params.stop))
        mgr.check_input_ids(ids, p, given)
        reqs.extend(expand_n(GenerateReq(rid=f"{base}-p{i}" if len(prompts) > 1 else base, input_ids=ids,
                                         sampling_params=p, **kw)))
    return reqs


async def _states(request: Request, mgr: TokenizerManager, reqs: list[GenerateReq]) -> list[GenState]:
    return await until_disconnect(request, collect_all([mgr.generate(r) for r in reqs]))


@router.get("/models")
async def models(request: Request) -> dict[str, Any]:
    return {"object": "list", "data": [_model_card(manager(request))]}


def _model_card(mgr: TokenizerManager) -> dict[str, Any]:
    return {"id": served_model_name(mgr), "object": "model", "created": 0, "owned_by": "lmserver",
            "root": served_model_name(mgr), "max_model_len": mgr.context_length}


@router.get("/models/{model_id:path}")
async def retrieve_model(request: Request, model_id: str) -> dict[str, Any]:
    """The model card of one of this server's own names; 404 for any other id."""
    mgr = manager(request)
    if model_id not in _model_aliases(mgr):
        raise APIError(404, f"the model {model_id!r} does not exist; this server serves {served_model_name(mgr)!r}",
                       param="model", code="model_not_found")
    return _model_card(mgr)


@router.post("/completions")
async def completions(request: Request) -> Response:
    mgr = manager(request)
    req = CompletionRequest.model_validate_json(await request.body())
    model = _check_model(mgr, req.model)
    if req.suffix:
        raise APIError(400, "suffix is not supported", param="suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise APIError(400, "best_of other than n is not supported", param="best_of")
    p = req.prompt
    if isinstance(p, str):
        prompts = [await mgr.encode_async(p)]
    elif p and all(isinstance(x, str) for x in p):
        prompts = [await mgr.encode_async(x) for x in p]  # type: ignore[arg-type]
    elif p and all(isinstance(x, int) for x in p):
        prompts = [list(p)]  # type: ignore[arg-type]
    elif p and all(isinstance(x, list) for x in p):
        prompts = [list(x) for x in p]  # type: ignore[union-attr,arg-type]
    else:
        raise APIError(400, "prompt must not be empty", param="prompt")
    params, given = sampling_params(req, req.max_tokens)
    want_lp = req.logprobs is not None
    reqs = _make_reqs(mgr, prompts, params, given, req.rid, return_logprob=want_lp,
                      logprob_start_len=0 if (want_lp and req.echo) else -1,
                      top_logprobs_num=req.logprobs or 0, return_text_in_logprobs=True, stream=req.stream)
    n = req.n
    cid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
    echo_text = [await mgr.decode_async(ids) if req.echo else "" for ids in prompts]

    def logprobs_of(state: GenState, i: int, start: int) -> dict[str, Any] | None:
        if not want_lp:
            return None
        entries, tops = state.output_token_logprobs[start:], state.output_top_logprobs[start:]
        offset = len(echo_text[i // n]) + len(state.text) - sum(len(e[2] or "") for e in entries)
        if req.echo and start == 0:
            entries = list(state.input_token_logprobs or []) + entries
            tops = list(state.input_top_logprobs or []) + list(tops)
            offset = 0
        return completion_logprobs(entries, tops if req.logprobs else [], mgr.decode, offset)

    if not req.stream:
        states = await _states(request, mgr, reqs)
        choices = [{"index": i, "text": echo_text[i // n] + s.text, "logprobs": logprobs_of(s, i, 0),
                    "finish_reason": _finish(s), "matched_stop": _matched(s), **_notes(s)} for i, s in enumerate(states)]
        groups = [states[k:k + n] for k in range(0, len(states), n)]
        return JSONBody({"id": cid, "object": "text_completion", "created": created, "model": model,
                               "choices": choices, "usage": _usage(groups)})

    events = await prime(merge([mgr.generate(r) for r in reqs]))
    interval = mgr.config.stream_interval
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    async def body() -> AsyncIterator[bytes]:
        final: dict[int, GenState] = {}
        started: set[int] = set()
        try:
            async for i, s in events:
                if not due(s, interval):
                    continue
                text = new_text(s)
                if i not in started:
                    started.add(i)
                    text = echo_text[i // n] + text
                lp = logprobs_of(s, i, s.num_logprobs_sent)
                s.num_logprobs_sent = len(s.output_token_logprobs)
                if s.finished:
                    final[i] = s
                yield sse({"id": cid, "object": "text_completion", "created": created, "model": model,
                           "choices": [{"index": i, "text": text, "logprobs": lp, "finish_reason": _finish(s),
                                        "matched_stop": _matched(s), **_notes(s)}]})
            if include_usage:
                states = [final[i] for i in sorted(final)]
                groups = [states[k:k + n] for k in range(0, len(states), n)]
                yield sse({"id": cid, "object": "text_completion", "created": created, "model": model,
                           "choices": [], "usage": _usage(groups)})
        except InvalidRequestError as exc:
            yield sse_error(str(exc), exc.status)
        except EngineDeadError as exc:
            yield sse_error(f"the engine is unavailable: {exc}", 503)
        yield DONE

    return StreamingResponse(body(), media_type="text/event-stream", headers=SSE_HEADERS)


@router.post("/chat/completions")
async def chat_completions(request: Request) -> Response:
    mgr = manager(request)
    req = ChatCompletionRequest.model_validate_json(await request.body())
    model = _check_model(mgr, req.model)
    if req.top_logprobs and not req.logprobs:
        raise APIError(400, "top_logprobs needs logprobs: true", param="top_logprobs")
    template = getattr(mgr.tokenizer, "chat_template", None)
    template = template if isinstance(template, str) else None
    plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls,
                      choose_parser(mgr.config.tool_call_parser, template))
    reasoning = (REASONING_PARSERS[mgr.config.reasoning_parser]()
                 if mgr.config.reasoning_parser in REASONING_PARSERS else None)
    messages, media = chat_messages(req)
    messages, tools = prepare_messages(messages, message_extras(req), plan, template)
    ids, mm_items = await mgr.prepare_media(await mgr.apply_chat_template_async(messages, tools), media)
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params, given = sampling_params(req, max_tokens)
    _constrain(params, plan, reasoning)
    reqs = _make_reqs(mgr, [ids], params, given, req.rid, return_logprob=req.logprobs,
                      top_logprobs_num=req.top_logprobs or 0, return_text_in_logprobs=True, stream=req.stream,
                      mm_items=mm_items)
    cid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())

    def lp(state: GenState, start: int) -> dict[str, Any] | None:
        if not req.logprobs:
            return None
        return chat_logprobs(state.output_token_logprobs[start:], state.output_top_logprobs[start:], mgr.decode)

    def output() -> ChoiceOutput:
        return ChoiceOutput(plan, reasoning)

    if not req.stream:
        states = await _states(request, mgr, reqs)
        choices = []
        for i, s in enumerate(states):
            message, called = output().message(s.text)
            choices.append({"index": i, "message": message, "logprobs": lp(s, 0),
                            "finish_reason": "tool_calls" if called else _finish(s), "matched_stop": _matched(s),
                            **_notes(s)})
        return JSONBody({"id": cid, "object": "chat.completion", "created": created, "model": model,
                               "choices": choices, "usage": _usage([states])})

    events = await prime(merge([mgr.generate(r) for r in reqs]))
    interval = mgr.config.stream_interval
    include_usage = bool(req.stream_options and req.stream_options.include_usage)

    def chunk(choices: list[dict[str, Any]], **extra: Any) -> bytes:
        return sse({"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                    "choices": choices, **extra})

    async def body() -> AsyncIterator[bytes]:
        final: dict[int, GenState] = {}
        outs: dict[int, ChoiceOutput] = {}
        try:
            async for i, s in events:
                if i not in outs:
                    outs[i] = output()
                    yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                  "finish_reason": None}])
                if not due(s, interval):
                    continue
                logprobs = lp(s, s.num_logprobs_sent)
                s.num_logprobs_sent = len(s.output_token_logprobs)
                new_text(s)  # NOTE: advances the state's cursor; the deltas come from the whole text
                deltas = outs[i].deltas(s.text, s.finished)
                if logprobs and logprobs["content"] and not deltas:
                    deltas = [{"content": ""}]
                for k, delta in enumerate(deltas):
                    yield chunk([{"index": i, "delta": delta, "logprobs": logprobs if k == 0 else None,
                                  "finish_reason": None}])
                if s.finished:
                    final[i] = s
                    yield chunk([{"index": i, "delta": {}, "logprobs": None,
                                  "finish_reason": "tool_calls" if outs[i].called else _finish(s),
                                  "matched_stop": _matched(s), **_notes(s)}])
            if include_usage:
                yield chunk([], usage=_usage([[final[i] for i in sorted(final)]]))
        except InvalidRequestError as exc:
            yield sse_error(str(exc), exc.status)
        except EngineDeadError as exc:
            yield sse_error(f"the engine is unavailable: {exc}", 503)
        yield DONE

    return StreamingResponse(body(), media_type="text/event-stream", headers=SSE_HEADERS)


def _constrain(params: SamplingParams, plan: ToolPlan, reasoning: ReasoningParser | None) -> None:
    """Puts the tool-call constraint into `params`, and with a reasoning parser lets a regex
    constraint start after `</think>` (a JSON Schema one cannot: 400). Mutates `params`."""
    if plan.schema is not None:
        if params.regex is not None or params.json_schema is not None:
            raise APIError(400, "tool_choice required or a named function constrains the output; give no "
                                "response_format, regex or json_schema with it", param="tool_choice")
        params.json_schema = orjson.dumps(plan.schema).decode()
    if reasoning is None:
        return
    if params.json_schema is not None:
        raise APIError(400, f"with --reasoning-parser {reasoning.name}, a JSON Schema constraint (response_format, "
                            "json_schema, tool_choice required or named) cannot start after the reasoning part yet; "
                            "use a regex constraint or tool_choice auto",
                       param="tool_choice" if plan.schema is not None else "response_format")
    if params.regex is not None:
        params.regex = f"{reasoning.constraint_prefix()}(?:{params.regex})"
