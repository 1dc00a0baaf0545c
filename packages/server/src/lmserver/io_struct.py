"""Plain-data messages between the HTTP front end and the engine core (no torch).

This is the contract between `lmserver.edge.api` (HTTP, tokenization, ZMQ) and `lmserver.engine`
(scheduler + model runner). Field names follow SGLang's `GenerateReqInput` and `SamplingParams`
(see shared/reference/native-api.md). Changes must be additive.

The engine core is synchronous and in-process:

    core.add_request(GenerateReq)      # validated, tokenized, n == 1 (see `expand_n`)
    core.abort_request(rid)            # at any stage; frees everything the request held
    outputs = core.step()              # -> list[ReqOutput]: one per request that progressed
    core.has_work()                    # bool: something is running or waiting
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any


class InvalidRequestError(ValueError):
    """Bad user input; the HTTP layer answers `status` (400) with this message."""

    status = 400


class OverloadedError(InvalidRequestError):
    """A valid request the server cannot take now (e.g. its grammar compile queue is full); the
    HTTP layer answers 503 with this message (retry later). An `InvalidRequestError`, so every path
    that hands a request error back to its client hands this one back too."""

    status = 503


class PixelsNeededError(InvalidRequestError):
    """The engine holds neither the vision embeddings nor the pixels of an image the front end sent
    by its hash alone (`MultimodalItem.pixel_values` None): the front end sends the request again
    with its pixels. Never reaches a client."""

    status = 409


def request_error(message: str, status: int = 400) -> InvalidRequestError:
    """The error to raise for a request the engine failed with `message` and HTTP `status`."""
    return OverloadedError(message) if status == OverloadedError.status else InvalidRequestError(message)


@dataclass
class SamplingParams:
    """Sampling parameters of one request (native API names and defaults)."""

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    stop_regex: list[str] = field(default_factory=list)
    ignore_eos: bool = False
    no_stop_trim: bool = False
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    n: int = 1
    logit_bias: dict[int, float] = field(default_factory=dict)
    sampling_seed: int | None = None
    regex: str | None = None
    json_schema: str | None = None
    # JSON Schema keywords cfsm can only over-approximate are a 400 (None: the server's --grammar-strict)
    json_schema_strict: bool | None = None
    ebnf: str | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> SamplingParams:
        """Builds from a JSON object; unknown keys and wrong types raise InvalidRequestError."""
        data = dict(data or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise InvalidRequestError(f"unknown sampling parameter(s): {', '.join(unknown)}")
        for key in ("stop", "stop_regex"):
            if isinstance(data.get(key), str):
                data[key] = [data[key]]
            elif data.get(key) is None and key in data:
                data[key] = []
        if data.get("stop_token_ids") is None and "stop_token_ids" in data:
            data["stop_token_ids"] = []
        if isinstance(data.get("logit_bias"), dict):
            try:
                data["logit_bias"] = {int(k): float(v) for k, v in data["logit_bias"].items()}
            except (TypeError, ValueError) as exc:
                raise InvalidRequestError(f"logit_bias must map token ids to numbers: {exc}") from None
        params = cls(**data)
        params.validate()
        return params

    def validate(self, vocab_size: int | None = None) -> None:
        """Raises InvalidRequestError naming the first bad field."""

        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise InvalidRequestError(msg)

        def is_int(v: Any) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v: Any) -> bool:
            return (isinstance(v, (int, float)) and not isinstance(v, bool)) and math.isfinite(v)

        for name in ("max_new_tokens", "min_new_tokens", "top_k", "n"):
            # NOTE: a JSON integer past 64 bits arrives as a float (orjson) or a Python int the engine's
            # tensors cannot hold; either way the value is out of range, not of the wrong type
            v = getattr(self, name)
            big = (is_int(v) and not -(2**63) <= v < 2**63) or (isinstance(v, float) and v.is_integer()
                                                                and abs(v) >= 2**63)
            need(not big, f"{name} is out of range (at most {2**63 - 1})")
        need(is_int(self.max_new_tokens) and self.max_new_tokens >= 0, "max_new_tokens must be an integer >= 0")
        need(is_int(self.min_new_tokens) and self.min_new_tokens >= 0, "min_new_tokens must be an integer >= 0")
        need(self.min_new_tokens <= max(self.max_new_tokens, 0) or self.max_new_tokens == 0,
             "min_new_tokens must be <= max_new_tokens")
        need(is_num(self.temperature) and self.temperature >= 0, "temperature must be a number >= 0")
        need(is_num(self.top_p) and 0 < self.top_p <= 1, "top_p must be a finite number in (0, 1]")
        need(is_int(self.top_k) and (self.top_k == -1 or self.top_k >= 1), "top_k must be -1 or an integer >= 1")
        need(is_num(self.min_p) and 0 <= self.min_p <= 1, "min_p must be in [0, 1]")
        need(is_num(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
             "frequency_penalty must be in [-2, 2]")
        need(is_num(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
             "presence_penalty must be in [-2, 2]")
        need(is_num(self.repetition_penalty) and 0 < self.repetition_penalty <= 2,
             "repetition_penalty must be in (0, 2]")
        need(is_int(self.n) and 1 <= self.n <= 128, "n must be an integer in [1, 128]")
        need(isinstance(self.stop, list) and all(isinstance(s, str) and s for s in self.stop),
             "stop must be a non-empty string or a list of them")
        need(isinstance(self.stop_regex, list) and all(isinstance(s, str) and s for s in self.stop_regex),
             "stop_regex must be a string or a list of strings")
        need(isinstance(self.stop_token_ids, list) and all(is_int(t) and t >= 0 for t in self.stop_token_ids),
             "stop_token_ids must be a list of token ids")
        need(self.sampling_seed is None or is_int(self.sampling_seed), "sampling_seed must be an integer")
        need(isinstance(self.logit_bias, dict) and all(is_int(k) and is_num(v) for k, v in self.logit_bias.items()),
             "logit_bias must map token ids to numbers")
        constraints = [c for c in (self.regex, self.json_schema, self.ebnf) if c is not None]
        need(len(constraints) <= 1, "at most one of regex, json_schema, ebnf may be given")
        need(all(isinstance(c, str) for c in constraints), "regex, json_schema and ebnf must be strings")
        need(self.json_schema_strict is None or isinstance(self.json_schema_strict, bool),
             "json_schema_strict must be a boolean")
        need(self.json_schema_strict is None or self.json_schema is not None, "json_schema_strict needs json_schema")
        for flag in ("ignore_eos", "no_stop_trim", "skip_special_tokens", "spaces_between_special_tokens"):
            need(isinstance(getattr(self, flag), bool), f"{flag} must be a boolean")
        if vocab_size is not None:
            bad = [t for t in list(self.stop_token_ids) + list(self.logit_bias) if not 0 <= t < vocab_size]
            need(not bad, f"token id(s) out of the vocabulary (size {vocab_size}): {bad[:5]}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < 1e-6


# An item's tokens in a radix-cache key: pad values are negative, so they never equal a token id.
_PAD_MASK = (1 << 62) - 1


def mm_pad_value(content_hash: int) -> int:
    """The radix-key value standing for every token of the image or video with `content_hash`
    (a negative int64: a repeated image is a prefix hit, two images never share KV)."""
    return -1 - (content_hash & _PAD_MASK)


@dataclass
class MultimodalItem:
    """One image or video of a prompt, preprocessed: its tokens are
    `input_ids[offset : offset + num_tokens]` (each the model's image or video token id)."""

    kind: str  # "image" | "video"
    content_hash: int  # 64-bit hash of the item's bytes (and kind / frame count)
    offset: int
    num_tokens: int
    # numpy float32: (3, H, W), (patches, 3, H, W) or video frames (F, 3, H, W); None: an image sent by
    # its hash alone (the engine had it: see engine.multimodal.MultimodalInputs.check)
    pixel_values: Any
    image_size: tuple[int, int] = (0, 0)  # (height, width) of the original image or frame
    # set: pixel_values are the decoded (H, W, 3) uint8 image and the engine runs this plan of the
    # remaining steps on its device (multimodal.processor.ImagePlan; bit-identical result)
    plan: Any = None
    # engine side only: the item's vision embeddings (num_tokens, hidden), taken from the encoder cache
    # when the item came without pixels (kept here, the cache may evict them before the forward)
    embeds: Any = None

    @property
    def end(self) -> int:
        return self.offset + self.num_tokens

    @property
    def pad_value(self) -> int:
        return mm_pad_value(self.content_hash)


@dataclass
class GenerateReq:
    """One tokenized request for the engine core (always n == 1; see `expand_n`)."""

    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    return_logprob: bool = False
    logprob_start_len: int = -1
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    stream: bool = False
    extra_key: str | None = None
    mm_items: list[MultimodalItem] = field(default_factory=list)  # images / videos, in prompt order


def expand_n(req: GenerateReq) -> list[GenerateReq]:
    """Splits a request with n > 1 into n requests `rid-0 .. rid-(n-1)` with n == 1.

    Same-seed copies get seeds `seed + i`, so the n samples differ but stay reproducible.
    """
    n = req.sampling_params.n
    if n == 1:
        return [req]
    out = []
    for i in range(n):
        seed = req.sampling_params.sampling_seed
        params = dataclasses.replace(req.sampling_params, n=1, sampling_seed=None if seed is None else seed + i)
        out.append(dataclasses.replace(req, rid=f"{req.rid}-{i}", sampling_params=params))
    return out


# (logprob, token_id, token_text or None) as in the native API's *_token_logprobs.
TokenLogprob = tuple[float | None, int, str | None]


@dataclass
class ReqOutput:
    """Progress of one request since its previous ReqOutput (deltas), plus running totals."""

    rid: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: dict[str, Any] | None = None  # {"type": "stop"|"length"|"abort", "matched": ...}
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    jump_forward_tokens: int = 0  # tokens added by jump-forward so far (total, not a delta)
    rollback_tokens: int = 0  # drop this many earlier new_token_ids before appending (jump-forward)
    output_token_logprobs: list[TokenLogprob] = field(default_factory=list)
    output_top_logprobs: list[list[TokenLogprob] | None] = field(default_factory=list)
    input_token_logprobs: list[TokenLogprob] | None = None  # sent once, with the first output
    input_top_logprobs: list[list[TokenLogprob] | None] | None = None
    error: str | None = None  # set when the request failed inside the engine (e.g. bad grammar)
    error_status: int = 400  # the HTTP status of `error` (503: overloaded, retry later)
    # what the request's JSON Schema grammar over-approximates (cfsm.Approximation strings), sent once
    grammar_approximations: list[str] | None = None
