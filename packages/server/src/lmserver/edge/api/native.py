"""SGLang-native routes: /generate, health, model and server info, cache, abort, tokenize.

Contract: shared reference `native-api.md`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse

from lmserver.config import REDACTED
from lmserver.edge.api.errors import APIError, JSONBody, read_json, sse_error
from lmserver.edge.api.streams import DONE, SSE_HEADERS, collect_all, due, merge, prime, sse, until_disconnect
from lmserver.edge.tokenizer_manager import EngineDeadError, GenState, TokenizerManager, is_token_id_list
from lmserver.io_struct import GenerateReq, InvalidRequestError, SamplingParams, expand_n
from lmserver.multimodal.frontend import MediaRef

router = APIRouter()

MAX_TOP_LOGPROBS = 100

_GENERATE_KEYS = {"text", "input_ids", "sampling_params", "rid", "stream", "return_logprob", "logprob_start_len",
                  "top_logprobs_num", "return_text_in_logprobs", "image_data", "video_data", "extra_key"}


def manager(request: Request) -> TokenizerManager:
    return request.app.state.manager  # type: ignore[no-any-return]


def _per_prompt(body: dict[str, Any], key: str, i: int, batch: bool, default: Any) -> Any:
    value = body.get(key, default)
    if value is None:
        return default
    if batch and isinstance(value, list) and key != "sampling_params":
        if len(value) != body["_num"]:
            raise APIError(400, f"{key} has {len(value)} entries for {body['_num']} prompts", param=key)
        return value[i]
    if batch and key == "sampling_params" and isinstance(value, list):
        if len(value) != body["_num"]:
            raise APIError(400, f"sampling_params has {len(value)} entries for {body['_num']} prompts", param=key)
        return value[i]
    return value


def _typed(value: Any, kind: type | tuple[type, ...], key: str) -> Any:
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        name = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise APIError(400, f"{key} must be of type {name}, got {type(value).__name__}", param=key)
    return value


def _media_source(entry: Any, key: str) -> MediaRef:
    kind = "image" if key == "image_data" else "video"
    if isinstance(entry, str) and entry:
        return MediaRef(kind, entry)
    if isinstance(entry, dict) and isinstance(entry.get("url"), str) and entry["url"]:
        frames = entry.get("num_frames")
        if frames is not None and (not isinstance(frames, int) or isinstance(frames, bool) or kind != "video"):
            raise APIError(400, f"{key}: num_frames must be an integer (videos only)", param=key)
        return MediaRef(kind, entry["url"], frames)
    extra = ' or {"url": ..., "num_frames": n}' if kind == "video" else ""
    raise APIError(400, f"{key} entries must be non-empty strings (a file path, an http(s) or data: URL, or "
                        f"base64){extra}", param=key)


def _media_refs(body: dict[str, Any], i: int, batch: bool) -> list[MediaRef]:
    """The images and videos of prompt `i`: one entry, or a list, per prompt (SGLang's layout)."""
    refs: list[MediaRef] = []
    for key in ("image_data", "video_data"):
        value = body.get(key)
        if value is None:
            continue
        if batch:
            if not isinstance(value, list) or len(value) != body["_num"]:
                raise APIError(400, f"{key} must have one entry (or list) per prompt: {body['_num']}", param=key)
            value = value[i]
        entries = value if isinstance(value, list) else [] if value is None else [value]
        refs.extend(_media_source(entry, key) for entry in entries)
    return refs


async def parse_generate(mgr: TokenizerManager, body: Any) -> tuple[list[list[GenerateReq]], bool, bool]:
    """Builds the engine requests of a /generate body: one list (n copies) per prompt; loads
    and preprocesses its images and videos.

    Returns (requests per prompt, batch, stream). Raises APIError/InvalidRequestError (400).
    """
    if not isinstance(body, dict):
        raise APIError(400, "the request body must be a JSON object")
    unknown = sorted(k for k, v in body.items() if k not in _GENERATE_KEYS and v not in (None, False))
    if unknown:
        raise APIError(400, f"unsupported field(s): {', '.join(unknown)}", param=unknown[0])
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise APIError(400, "give exactly one of text or input_ids", param="text")
    if text is not None:
        if isinstance(text, str):
            prompts: list[Any] = [text]
            batch = False
        elif isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            prompts, batch = list(text), True
        else:
            raise APIError(400, "text must be a string or a non-empty list of strings", param="text")
    elif is_token_id_list(ids):
        prompts, batch = [ids], False
    elif isinstance(ids, list) and ids and all(is_token_id_list(x) for x in ids):
        prompts, batch = list(ids), True
    else:
        raise APIError(400, "input_ids must be a list of token ids or a non-empty list of such lists",
                       param="input_ids")
    stream = _typed(body.get("stream", False), bool, "stream")
    body = dict(body, _num=len(prompts))
    out: list[list[GenerateReq]] = []
    for i, prompt in enumerate(prompts):
        sp = _per_prompt(body, "sampling_params", i, batch, {})
        if not isinstance(sp, dict):
            raise APIError(400, "sampling_params must be a JSON object (or a list of them for a batch)",
                           param="sampling_params")
        # NOTE: null means "the default" (SGLang clients send every field, some as null)
        sp = {k: v for k, v in sp.items() if v is not None}
        try:
            params = SamplingParams.from_dict(sp)
        except (TypeError, ValueError) as exc:  # InvalidRequestError is a ValueError with a clear message
            if isinstance(exc, InvalidRequestError):
                raise
            raise APIError(400, f"invalid sampling_params: {exc}", param="sampling_params") from None
        input_ids = await mgr.encode_async(prompt) if isinstance(prompt, str) else list(prompt)
        input_ids, mm_items = await mgr.prepare_media(input_ids, _media_refs(body, i, batch))
        mgr.check_input_ids(input_ids, params, max_new_tokens_given="max_new_tokens" in sp)
        rid = _per_prompt(body, "rid", i, batch, None)
        rid = _typed(rid, str, "rid") if rid is not None else mgr.new_rid()
        return_logprob = _typed(_per_prompt(body, "return_logprob", i, batch, False), bool, "return_logprob")
        logprob_start_len = _typed(_per_prompt(body, "logprob_start_len", i, batch, -1), int, "logprob_start_len")
        if return_logprob and logprob_start_len == -1 and params.max_new_tokens == 0:
            # NOTE: a prefill-only request scores its prompt: every input token's logprob, the first
            # one None (SGLang's frontend, e.g. select's unconditional-likelihood normalization,
            # sends exactly this and assumes that first None)
            logprob_start_len = 0
        req = GenerateReq(
            rid=rid, input_ids=input_ids, sampling_params=params,
            return_logprob=return_logprob, logprob_start_len=logprob_start_len,
            top_logprobs_num=_typed(_per_prompt(body, "top_logprobs_num", i, batch, 0), int, "top_logprobs_num"),
            return_text_in_logprobs=_typed(body.get("return_text_in_logprobs", False), bool,
                                           "return_text_in_logprobs"),
            stream=stream, extra_key=body.get("extra_key"), mm_items=mm_items)
        if req.return_logprob and not -1 <= req.logprob_start_len < len(input_ids):
            raise APIError(400, f"logprob_start_len must be -1 or in [0, {len(input_ids) - 1}]",
                           param="logprob_start_len")
        if not 0 <= req.top_logprobs_num <= MAX_TOP_LOGPROBS:
            raise APIError(400, f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}]", param="top_logprobs_num")
        if req.extra_key is not None and not isinstance(req.extra_key, str):
            raise APIError(400, "extra_key must be a string", param="extra_key")
        out.append(expand_n(req))
    rids = [r.rid for group in out for r in group]
    if len(set(rids)) != len(rids):
        raise APIError(400, "rid values must be unique within a request", param="rid")
    return out, batch, stream


@dataclass
class StreamCursor:
    """What an incremental stream has sent of one generation (text characters, output ids,
    output logprob entries)."""

    chars: int = 0
    ids: int = 0
    logprobs: int = 0


def native_output(state: GenState, req: GenerateReq, cursor: StreamCursor | None = None) -> dict[str, Any]:
    """The native response object of one generation: cumulative, or with `cursor` (an
    incremental stream) only what is new since the last chunk; advances `cursor`.

    Matches SGLang's tokenizer manager: `meta_info.output_token_logprobs_length` is always the
    cumulative number of output logprobs; with --incremental-streaming-output a chunk's `text`,
    `output_ids`, `output_token_logprobs` and `output_top_logprobs` are sliced from the previous
    chunk's end (its `_slice_streaming_output_meta_info` and `last_output_offset`), while
    `input_token_logprobs` come whole in every chunk.
    """
    meta: dict[str, Any] = {
        "id": state.rid, "prompt_tokens": state.prompt_tokens, "completion_tokens": state.completion_tokens,
        "cached_tokens": state.cached_tokens, "finish_reason": state.finish_reason,
        "e2e_latency": round(state.e2e_latency, 6)}
    if state.jump_forward_tokens:
        meta["jump_forward_tokens"] = state.jump_forward_tokens
    if state.grammar_approximations:
        meta["grammar_approximations"] = state.grammar_approximations
    text, output_ids, lp_from = state.text, state.output_ids, 0
    if cursor is not None:
        # NOTE: a jump-forward rollback can shorten output_ids below the cursor: nothing new then
        text, output_ids = text[cursor.chars:], output_ids[cursor.ids:]
        lp_from = cursor.logprobs
        cursor.chars, cursor.ids = len(state.text), max(cursor.ids, len(state.output_ids))
        cursor.logprobs = len(state.output_token_logprobs)
    if req.return_logprob:
        meta["input_token_logprobs"] = state.input_token_logprobs or []
        meta["output_token_logprobs"] = state.output_token_logprobs[lp_from:]
        meta["output_token_logprobs_length"] = len(state.output_token_logprobs)
        if req.top_logprobs_num > 0:
            meta["input_top_logprobs"] = state.input_top_logprobs or []
            meta["output_top_logprobs"] = state.output_top_logprobs[lp_from:]
    return {"text": text, "output_ids": output_ids, "meta_info": meta}


@router.api_route("/generate", methods=["POST", "PUT"])
async def generate(request: Request) -> Response:
    mgr = manager(request)
    per_prompt, batch, stream = await parse_generate(mgr, await read_json(request))
    reqs = [r for group in per_prompt for r in group]
    single = not batch and len(reqs) == 1
    if not stream:
        states = await until_disconnect(request, collect_all([mgr.generate(r) for r in reqs]))
        outs = [native_output(s, r) for s, r in zip(states, reqs, strict=True)]
        return JSONBody(outs[0] if single else outs)

    events = await prime(merge([mgr.generate(r) for r in reqs]))
    interval = mgr.config.stream_interval
    cursors = [StreamCursor() for _ in reqs] if mgr.config.incremental_streaming_output else None

    async def body() -> AsyncIterator[bytes]:
        try:
            async for i, state in events:
                if not due(state, interval):
                    continue
                obj = native_output(state, reqs[i], cursors[i] if cursors is not None else None)
                if not single:
                    obj["index"] = i
                yield sse(obj)
        except InvalidRequestError as exc:
            yield sse_error(str(exc), exc.status)
        except EngineDeadError as exc:
            yield sse_error(f"the engine is unavailable: {exc}", 503)
        yield DONE

    return StreamingResponse(body(), media_type="text/event-stream", headers=SSE_HEADERS)


@router.get("/health")
async def health(request: Request) -> Response:
    mgr = manager(request)
    if mgr.dead_reason is not None:
        raise APIError(503, f"the engine core is dead: {mgr.dead_reason}")
    if mgr.shutting_down:  # NOTE: draining after SIGTERM: load balancers should send no more
        raise APIError(503, "the server is shutting down")
    return Response(status_code=200)


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    if not await manager(request).health_generate():
        raise APIError(503, "the engine did not complete a one-token generation")
    return Response(status_code=200)


@router.get("/get_model_info")
async def get_model_info(request: Request) -> dict[str, Any]:
    mgr = manager(request)
    assert mgr.ready is not None
    cfg = mgr.ready.resolved_config
    return {"model_path": mgr.ready.model_path, "tokenizer_path": cfg.get("tokenizer_path") or mgr.ready.model_path,
            "is_generation": True, "preferred_sampling_params": None,
            "context_length": mgr.context_length, "vocab_size": mgr.vocab_size,
            # NOTE: a prefill-only "prefix hint" request never helps here: the scheduler computes a prefix
            # shared by the requests of one batch once (scheduler.IN_BATCH_PREFIX_THRESHOLD), and with the radix cache
            # off nothing is kept; frontends (lmdsl's prefix_hints="auto") skip them
            "prefix_hints_useful": False,
            # images / videos (a multimodal model); video_data entries may be {"url": ..., "num_frames": n}
            "is_multimodal": mgr.mm is not None,
            "image_token": mgr.mm.token_texts["image"] if mgr.mm is not None else None,
            "video_token": mgr.mm.token_texts["video"] if mgr.mm is not None else None,
            "video_frames_in_requests": True}


@router.get("/get_server_info")
@router.get("/server_info")
async def get_server_info(request: Request) -> dict[str, Any]:
    mgr = manager(request)
    assert mgr.ready is not None
    stats = await mgr.rpc("get_stats")
    return {**mgr.ready.resolved_config, "model_path": mgr.ready.model_path, "context_length": mgr.context_length,
            "api_key": REDACTED if mgr.config.api_key else None,  # NOTE: never the secret itself
            "scheduler": stats, "num_pending_http_requests": mgr.num_pending, "core_pid": mgr.ready.pid, "version": _version()}


@router.get("/get_step_trace")
async def get_step_trace(request: Request) -> dict[str, Any]:
    """The core's last `--step-trace` records of the running requests' gaps between two tokens and
    what filled each (lmserver.engine.step_trace: fields, then one row per gap)."""
    try:
        return dict(await manager(request).rpc("get_step_trace"))
    except RuntimeError as exc:  # a core without a trace (a test double)
        raise APIError(501, f"step trace unavailable: {exc}") from None


@router.get("/check_memory_invariant")
async def check_memory_invariant(request: Request) -> dict[str, Any]:
    """Runs the core's memory accounting check; 500 with the violation when it fails."""
    try:
        await manager(request).rpc("check_memory_invariant")
    except RuntimeError as exc:
        raise APIError(500, f"memory invariant violated: {exc}") from None
    return {"ok": True}


@router.post("/flush_cache")
@router.get("/flush_cache")
async def flush_cache(request: Request) -> dict[str, Any]:
    if not await manager(request).rpc("flush_cache"):
        raise APIError(400, "cannot flush the cache while requests are running or waiting; retry when idle")
    return {"success": True, "message": "cache flushed"}


@router.post("/abort_request")
async def abort_request(request: Request) -> dict[str, Any]:
    body = await read_json(request)
    if not isinstance(body, dict) or not isinstance(body.get("rid"), str):
        raise APIError(400, "the body must be {\"rid\": <request id>}", param="rid")
    found = await manager(request).abort(body["rid"])
    return {"rid": body["rid"], "aborted": found}


@router.post("/tokenize")
async def tokenize(request: Request) -> dict[str, Any]:
    body = await read_json(request)
    mgr = manager(request)
    prompt = body.get("prompt", body.get("text")) if isinstance(body, dict) else None
    add_special = body.get("add_special_tokens", True) if isinstance(body, dict) else True
    if not isinstance(add_special, bool):
        raise APIError(400, "add_special_tokens must be a boolean", param="add_special_tokens")

    def enc(s: str) -> list[int]:
        return list(mgr.tokenizer.encode(s, add_special_tokens=add_special))

    if isinstance(prompt, str):
        tokens: Any = await mgr.off_loop(len(prompt), enc, prompt)
        count: Any = len(tokens)
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        tokens = [await mgr.off_loop(len(p), enc, p) for p in prompt]
        count = [len(t) for t in tokens]
    else:
        raise APIError(400, "prompt must be a string or a list of strings", param="prompt")
    return {"tokens": tokens, "count": count, "max_model_len": mgr.context_length}


@router.post("/detokenize")
async def detokenize(request: Request) -> dict[str, Any]:
    body = await read_json(request)
    mgr = manager(request)
    tokens = body.get("tokens", body.get("input_ids")) if isinstance(body, dict) else None
    if not isinstance(tokens, list) or not is_token_id_list(tokens):
        raise APIError(400, "tokens must be a list of token ids", param="tokens")
    bad = [t for t in tokens if not 0 <= t < mgr.vocab_size]
    if bad:
        raise APIError(400, f"token id(s) out of the vocabulary (size {mgr.vocab_size}): {bad[:5]}", param="tokens")
    return {"text": await mgr.decode_async(tokens, skip_special_tokens=False)}


def _version() -> str:
    from lmserver import __version__

    return __version__
