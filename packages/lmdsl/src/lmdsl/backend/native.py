"""`NativeBackend`: lmdsl's calls written once over the native `/generate` contract.

A subclass supplies the transport: `native_generate(body)` (the reply of one `/generate` body)
and `native_stream(body)` (its streamed events). `RuntimeEndpoint` sends the bodies over HTTP;
lmserver's in-process backend hands them to its `Engine`. Both therefore send the same requests
for the same program: prompts as rendered text, prefix hints as `max_new_tokens: 0` requests,
`select` from the `input_token_logprobs` of one batched request.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from typing import Any

from lmdsl.backend.base import Backend, ChoiceDecision, GenResult, Prompt
from lmdsl.chat_template import ChatTemplate, get_chat_template, get_chat_template_by_model_path
from lmdsl.choices import decide
from lmdsl.ir import SamplingParams

Body = dict[str, Any]


def choice_token_logprobs(entries: list[list[Any]], choice: str) -> list[float]:
    """The logprobs of the tokens that carry `choice`, from `input_token_logprobs` entries
    ([logprob, token_id, text]) that start a little before the choice.

    Tokens lying wholly in the prompt are dropped; a token spanning the boundary (the prompt's
    last characters merged with the choice's first) is kept. When the token texts do not spell
    the choice, the two prompt tokens the request asked for are dropped.
    """
    texts = [e[2] if isinstance(e[2], str) else "" for e in entries]
    joined = "".join(texts)
    if joined.endswith(choice):
        boundary = len(joined) - len(choice)
        kept, end = [], 0
        for entry, text in zip(entries, texts, strict=True):
            end += len(text)
            if end > boundary:
                kept.append(entry)
    else:
        kept = entries[2:] if len(entries) > 2 else entries[-1:]
    return [float(e[0]) if e[0] is not None else 0.0 for e in kept]


def pick_chat_template(model_info: dict[str, Any], chat_template: str | ChatTemplate | None) -> ChatTemplate:
    """`chat_template` (a name or object) when given, else the template of the model path in
    `model_info`, with the model's image placeholder (lmserver's `image_token`) when it names one."""
    if isinstance(chat_template, ChatTemplate):
        return chat_template
    if chat_template is not None:
        return get_chat_template(chat_template)
    template = get_chat_template_by_model_path(str(model_info.get("model_path", "")))
    image_token = model_info.get("image_token")
    if isinstance(image_token, str) and image_token:
        template = dataclasses.replace(template, image_token=image_token)
    return template


class NativeBackend(Backend):
    """A backend speaking the native `/generate` contract through `native_generate` /
    `native_stream`. `model_info` is the server's `/get_model_info` object (read once by the
    subclass before use): `model_path`, `prefix_hints_useful`, `video_frames_in_requests`."""

    model_info: dict[str, Any]

    # ---- transport (subclasses)
    def native_generate(self, body: Body) -> Any:
        """The reply object of one `/generate` body (a dict, or a list of dicts for a batch)."""
        raise NotImplementedError

    def native_stream(self, body: Body) -> Iterator[dict[str, Any]]:
        """The events of one streamed `/generate` body (cumulative `text`, `meta_info`)."""
        raise NotImplementedError

    def media_payload(self, ref: str) -> str:
        """How an image or video reference travels in a body. Default: as given."""
        return ref

    # ---- the contract
    @property
    def wants_prefix_hints(self) -> bool:
        return self.model_info.get("prefix_hints_useful") is not False

    def get_model_name(self) -> str:
        return str(self.model_info.get("model_path", ""))

    def _base(self, prompt: Prompt) -> Body:
        data: Body = {"text": prompt.text}
        if prompt.images:
            images = [self.media_payload(p) for p in prompt.images]
            data["image_data"] = images if len(images) > 1 else images[0]
        if prompt.videos:
            if self.model_info.get("video_frames_in_requests"):  # lmserver: the frame count travels along
                data["video_data"] = [{"url": self.media_payload(p), "num_frames": n} for p, n in prompt.videos]
            else:
                data["video_data"] = [self.media_payload(p) for p, _ in prompt.videos]
        return data

    def _sampling(self, prompt: Prompt, params: SamplingParams) -> Body:
        data = self._base(prompt)
        data["sampling_params"] = params.to_native()
        for name in ("return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs"):
            value = getattr(params, name)
            if value is not None:
                data[name] = value
        return data

    def cache_prefix(self, prefix_str: str) -> None:
        self.native_generate({"text": prefix_str, "sampling_params": {"max_new_tokens": 0}})

    def commit_lazy_operations(self, prompt: Prompt) -> None:
        data = self._base(prompt)
        data["sampling_params"] = {"max_new_tokens": 0}
        self.native_generate(data)

    def generate(self, prompt: Prompt, params: SamplingParams) -> GenResult:
        reply = self.native_generate(self._sampling(prompt, params))
        if isinstance(reply, list):
            texts = [r["text"] for r in reply]
            meta = dict(reply[0]["meta_info"])
            meta["completion_tokens"] = sum(r["meta_info"].get("completion_tokens", 0) for r in reply)
            meta["all_meta_info"] = [r["meta_info"] for r in reply]
            return GenResult(texts if len(texts) > 1 else texts[0], meta)
        return GenResult(reply["text"], dict(reply["meta_info"]))

    def generate_stream(self, prompt: Prompt, params: SamplingParams) -> Iterator[tuple[str, dict[str, Any]]]:
        data = self._sampling(prompt, params)
        data["stream"] = True
        sent = ""
        for event in self.native_stream(data):
            text = event["text"]
            yield text[len(sent):], event.get("meta_info", {})
            sent = text

    def select(self, prompt: Prompt, choices: list[str], temperature: float, choices_method: str) -> ChoiceDecision:
        prefill = self._base(prompt)
        prefill["sampling_params"] = {"max_new_tokens": 0}
        prompt_len = int(self.native_generate(prefill)["meta_info"]["prompt_tokens"])
        data = self._base(prompt)
        for key in ("image_data", "video_data"):
            if key in data:  # NOTE: a batched request takes one entry per prompt
                data[key] = [data[key]] * len(choices)
        data.update(text=[prompt.text + c for c in choices], sampling_params={"max_new_tokens": 0, "temperature": 0},
                    return_logprob=True, return_text_in_logprobs=True, logprob_start_len=max(prompt_len - 2, 0))
        replies = self.native_generate(data)
        entries = [r["meta_info"]["input_token_logprobs"] for r in replies]
        cond = [choice_token_logprobs(e, c) for e, c in zip(entries, choices, strict=True)]
        unconditional = None
        num_calls = 2
        if choices_method == "unconditional_likelihood_normalized":
            replies_u = self.native_generate({
                "text": list(choices), "sampling_params": {"max_new_tokens": 0, "temperature": 0},
                "return_logprob": True, "return_text_in_logprobs": True, "logprob_start_len": 0})
            num_calls = 3
            unconditional = []
            for r, lp in zip(replies_u, cond, strict=True):
                values = [float(e[0]) if e[0] is not None else 0.0 for e in r["meta_info"]["input_token_logprobs"]]
                values = values[-len(lp):] if lp else []
                unconditional.append([0.0] * (len(lp) - len(values)) + values)
        decision = decide(choices_method, choices, cond, unconditional)
        usage = {"num_api_calls": num_calls, "prompt_tokens": prompt_len + sum(
            int(r["meta_info"].get("prompt_tokens", 0)) for r in replies)}
        return ChoiceDecision(decision.decision, {**decision.meta_info, "input_token_logprobs": entries,
                                                  "choice_token_logprobs": cond, "usage": usage})
